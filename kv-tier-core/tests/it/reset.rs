//! `reset_cache`: it empties DRAM (but blocks readers pin), cancels queued promotions, waits for
//! the jobs in flight, and the tiers keep their blocks.

use std::collections::HashSet;
use std::time::Duration;

use kv_tier_core::{LookupResult, PrimaryTier, RequestContext, RequestId};
use kv_tier_testkit::{fill_block, test_key, verify_block};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_cache_empties_dram_and_secondaries_keep_data() {
    let t = mem("fs");
    let fx = evented_manager(8, vec![t.clone()]).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    engine_store(&fx.m, RequestId(1), &keys);
    let view = fx.m.prepare_load(&keys[..1]).unwrap();
    assert_eq!(fx.m.reset_cache().await, 1, "a block a reader pins stays");
    assert_eq!(fx.cpu.lookup(&keys[0]), LookupResult::Hit);
    drop(view);
    assert_eq!(fx.m.reset_cache().await, 0);
    assert_eq!(t.len(), 3, "the store jobs finished before the reset");
    for k in &keys {
        assert_eq!(fx.cpu.lookup(k), LookupResult::Miss);
    }
    let req = RequestContext::new(2);
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Retry; 3]);
    fx.m.wait_idle().await;
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 3]);
    fx.m.wait_idle().await;
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Hit; 3]);
    assert_dram_bytes(&fx.cpu, &keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_cache_cancels_queued_promotions() {
    let t = mem("fs");
    let k = test_key(1);
    seed(&*t, &[k]).await;
    let fx = evented_manager(2, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::HitPending); // slot reserved, load queued
    fx.m.reset_cache().await;
    assert_eq!(fx.cpu.lookup(&k), LookupResult::Miss);
    assert_eq!(fx.m.stats().tiers[0].load_jobs, 0);
    assert_eq!(fx.cpu.stats().writing_blocks, 0);
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs `reset_cache`): "Cancels queued
/// promotions, waits for the jobs in flight, then empties DRAM ... Returns how many blocks
/// stay in DRAM because readers still pin them"; pending.rs: the store's slots are its own
/// until commit or abort. A reset while a store is being filled neither hangs nor leaks the
/// slot nor serves a block whose bytes it freed: after the commit the key is either a Hit
/// with the committed bytes or a Miss, and the pool's every slot is usable again.
#[test]
fn reset_cache_while_a_store_is_being_filled() {
    for end in ["commit", "abort"] {
        let m = build(dram_cfg(4, BS, ""));
        store_evicting(&m, 1, &[test_key(50)]);
        let a = test_key(1);
        let mut p = m.prepare_store(&[a]).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let hung = std::thread::scope(|s| {
            s.spawn(|| {
                let left = m.runtime().block_on(m.reset_cache());
                let _ = tx.send(left);
            });
            let got = rx.recv_timeout(Duration::from_secs(30));
            for (key, sk) in p.slots() {
                // overwrite after the reset: a freed slot reused elsewhere would show it
                fill_block(key, 0, sk.as_mut_slice());
            }
            if end == "commit" {
                p.commit(RequestId(1));
            } else {
                p.abort();
            }
            got.is_err()
        });
        assert!(
            !hung,
            "{end}: reset_cache waited on a store the caller's thread holds"
        );
        let hit = is_hit(&m, &a);
        if hit {
            assert_eq!(end, "commit");
            let v = m.prepare_load(&[a]).unwrap();
            assert!(verify_block(&a, 0, v[0].as_slice()), "{end}: wrong bytes");
        }
        let st = m.stats().primary;
        assert_eq!(st.writing_blocks, 0, "{end}: {st:?}");
        assert_eq!(st.ready_blocks, usize::from(hit), "{end}: {st:?}");
        // the whole pool is usable: 4 new keys, evicting at most the one block there
        let ev = store_evicting(
            &m,
            2,
            &[test_key(10), test_key(11), test_key(12), test_key(13)],
        );
        assert_eq!(ev.len(), usize::from(hit), "{end}");
        for i in 10..14 {
            let v = m.prepare_load(&[test_key(i)]).unwrap();
            assert!(verify_block(&test_key(i), 0, v[0].as_slice()));
        }
    }
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs `reset_cache`): "Cancels queued
/// promotions, waits for the jobs in flight, then empties DRAM"; lib.rs: a probe has a
/// deadline, "so no key stays out of `Hit`/`Miss` for long"; `lease_s`: "The lease ends when
/// the promotion ends or every request that asked for the key has finished". A reset while a
/// request's promotion is queued, and while it is in flight: the request's keys still settle
/// to `Hit` (with the right bytes) or `Miss`, nothing stays held, leased or being written,
/// and DRAM's events still describe DRAM.
#[test]
fn reset_cache_during_a_queued_and_an_in_flight_promotion() {
    for phase in ["queued", "in flight"] {
        let dir = tempfile::tempdir().unwrap();
        let m = fs_manager(dir.path(), 8, "");
        let keys = [test_key(1), test_key(2), test_key(3)];
        store_evicting(&m, 1, &keys);
        block_on_idle(&m);
        m.runtime().block_on(m.reset_cache());
        let mut replica = HashSet::new();
        replay_dram(&m.take_events(), &mut replica, phase);
        assert!(replica.is_empty(), "{phase}: {replica:?}");
        let req = RequestContext::new(4);
        let r = m.lookup_many(&keys, &req);
        assert!(r.iter().all(|v| *v == LookupResult::Retry), "{r:?}");
        m.on_schedule_end();
        wait_until(&format!("{phase}: HitPending"), SETTLE_LIMIT, || {
            m.runtime().block_on(m.wait_jobs());
            m.poll();
            let r = m.lookup_many(&keys, &req);
            r.iter().all(|v| *v == LookupResult::HitPending)
        });
        if phase == "in flight" {
            m.on_schedule_end(); // sends the promotion
        }
        m.runtime().block_on(m.reset_cache());
        let mut last = Vec::new();
        for _ in 0..300 {
            last = m.lookup_many(&keys, &req);
            if last.iter().all(|v| *v == LookupResult::Hit) {
                let v = m.prepare_load(&keys).unwrap();
                for (key, view) in keys.iter().zip(&v) {
                    assert!(
                        verify_block(key, 0, view.as_slice()),
                        "{phase}: wrong bytes"
                    );
                }
                m.on_schedule_end();
                break;
            }
            m.on_schedule_end();
            if last.first() == Some(&LookupResult::Miss) {
                break;
            }
            block_on_idle(&m);
        }
        assert!(
            last.iter().all(|v| *v == LookupResult::Hit)
                || last.first() == Some(&LookupResult::Miss),
            "{phase}: never settled: {last:?}"
        );
        m.on_request_finished(req.id);
        block_on_idle(&m);
        m.on_schedule_end();
        let st = m.stats();
        assert_eq!(
            (st.held_blocks, st.holding_requests),
            (0, 0),
            "{phase}: {st:?}"
        );
        assert_eq!(st.primary.writing_blocks, 0, "{phase}");
        assert_eq!(st.tiers[0].leased_keys, 0, "{phase}: {:?}", st.tiers[0]);
        replay_dram(&m.take_events(), &mut replica, phase);
        let readable: HashSet<_> = keys
            .iter()
            .copied()
            .filter(|kk| m.prepare_load(&[*kk]).is_ok())
            .collect();
        assert_eq!(replica, readable, "{phase}: DRAM events disagree with DRAM");
        assert_eq!(st.primary.ready_blocks, readable.len(), "{phase}");
        m.shutdown_blocking().unwrap();
    }
}
