//! The store cascade: a committed store is written to every secondary tier (only its new blocks,
//! once), a failed one to none, and a request-level tier also gets the blocks already in DRAM.

use std::sync::Arc;

use kv_tier_core::{LookupResult, PrimaryTier, RequestContext, RequestId};
use kv_tier_testkit::{MemoryTier, test_key, verify_block};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascade_to_two_tiers() {
    let (a, b) = (mem("a"), mem("b"));
    let fx = evented_manager(8, vec![a.clone(), b.clone()]).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    engine_store(&fx.m, RequestId(1), &keys);
    assert_eq!(
        fx.m.lookup(&keys[0], &RequestContext::new(1)),
        LookupResult::Hit
    );
    fx.m.wait_idle().await;
    for t in [&a, &b] {
        for k in &keys {
            assert!(
                verify_block(k, 0, &t.get(k).expect("cascaded")),
                "bytes in tier"
            );
        }
    }
    let s = fx.m.stats();
    for t in &s.tiers {
        assert_eq!(
            (t.store_jobs, t.blocks_stored, t.bytes_stored),
            (1, 3, 3 * BS as u64)
        );
        assert_eq!(t.store_latency.count(), 1);
    }
    assert_eq!(s.cascades, 1);
    // events: the primary's first, then each tier's in order
    let ev = fx.m.take_events();
    let names: Vec<&str> = ev.iter().map(|e| e.tier.as_str()).collect();
    assert_eq!(names, vec!["cpu", "a", "b"]);
    assert!(ev.iter().all(|e| !e.removed && e.keys == keys));
    // slots are unpinned once the jobs ended: they can all be evicted
    let more: Vec<_> = (10..18).map(test_key).collect();
    assert_eq!(fx.m.prepare_store(&more).unwrap().evicted().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_store_cascades_nothing() {
    let t = mem("fs");
    let fx = evented_manager(4, vec![t.clone()]).await;
    let k = test_key(1);
    fx.m.prepare_store(&[k]).unwrap().abort();
    fx.m.wait_idle().await;
    assert!(t.is_empty());
    let s = fx.m.stats();
    assert_eq!((s.cascades, s.tiers[0].store_jobs), (0, 0));
    assert!(fx.m.take_events().is_empty());
    assert_eq!(fx.cpu.lookup(&k), LookupResult::Miss);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_level_tier_also_gets_the_blocks_already_in_dram() {
    use kv_tier_core::OffloadPolicy;
    let rl = Recording::new("rl", OffloadPolicy::RequestLevel, true);
    let chunk = Recording::new("chunk", OffloadPolicy::ChunkLevel, true);
    let fx = evented_manager(8, vec![rl.clone(), chunk.clone()]).await;
    let (a, b) = (test_key(1), test_key(2));
    // r1 computes a: both tiers get it
    let r1 = RequestContext::new(1);
    assert_eq!(fx.m.on_new_request(&r1), OffloadPolicy::RequestLevel);
    engine_store(&fx.m, r1.id, &[a]);
    fx.m.wait_idle().await;
    // r2 finds a in DRAM and computes b: the chunk-level tier gets b, the request-level
    // tier a and b
    let r2 = RequestContext::new(2);
    fx.m.on_new_request(&r2);
    engine_store(&fx.m, r2.id, &[a, b]);
    fx.m.wait_idle().await;
    let stores = |t: &Recording| -> Vec<String> {
        t.log()
            .into_iter()
            .filter(|l| l.starts_with("store ["))
            .collect()
    };
    let mut ab = vec![a, b];
    ab.sort();
    assert_eq!(
        stores(&chunk),
        [
            format!("store [RequestId(1)] x1 {:?}", [a]),
            format!("store [RequestId(2)] x1 {:?}", [b])
        ]
    );
    assert_eq!(
        stores(&rl),
        [
            format!("store [RequestId(1)] x1 {:?}", [a]),
            format!("store [RequestId(2)] x2 {ab:?}")
        ]
    );
    // once r2 is finished its request-level state is gone: a later store under its id
    // sends the request-level tier only the new block
    fx.m.on_request_finished(r2.id);
    fx.m.on_schedule_end();
    let c = test_key(3);
    engine_store(&fx.m, r2.id, &[a, c]);
    fx.m.wait_idle().await;
    assert_eq!(
        stores(&rl).last().unwrap(),
        &format!("store [RequestId(2)] x1 {:?}", [c])
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_new_blocks_of_a_successful_store_cascade() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let (m, _cpu) = manager_and_dram(8, inner.clone()).await;
    let (a, b) = (test_key(1), test_key(2));
    m.prepare_store(&[a]).unwrap().abort();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.stats().cascades, 0, "a failed store cascaded");
    engine_store(&m, RequestId(1), &[b]);
    bounded("wait_idle", m.wait_idle()).await;
    let again = m.prepare_store(&[b]).unwrap(); // already stored: nothing new
    assert!(again.keys().is_empty());
    again.commit(RequestId(1));
    bounded("wait_idle", m.wait_idle()).await;
    let s = m.stats();
    assert_eq!(s.cascades, 1, "a store with nothing new cascaded");
    assert_eq!((s.tiers[0].store_jobs, s.tiers[0].blocks_stored), (1, 1));
    assert_eq!(s.tiers[0].bytes_stored, BS as u64);
    assert_eq!(inner.len(), 1);
    bounded("shutdown", m.shutdown()).await.unwrap();
    let c = test_key(3);
    engine_store(&m, RequestId(2), &[c]);
    assert!(m.is_idle(), "a store after shutdown cascaded");
    assert_eq!(m.stats().cascades, 1);
    assert!(!inner.contains(&c));
    // past DRAM, a shut-down manager answers Miss, counted
    let misses = m.stats().misses;
    let req = RequestContext::new(5);
    assert_eq!(m.lookup(&test_key(9), &req), LookupResult::Miss);
    assert_eq!(m.stats().misses, misses + 1);
}
