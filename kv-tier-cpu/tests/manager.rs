//! The TieringManager over the real DRAM tier and the reference / fault-injecting tiers.

use std::sync::Arc;

use kv_tier_core::{
    BlockKey, EvictionPolicy, KvTierConfig, LookupResult, Presence, PrimaryTier, ProbeCache,
    RequestContext, RequestId, SecondaryTier, StoreJob, TieringManager,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::{
    FaultyTier, MemoryTier, Workload, WorkloadConfig, source_for, test_key, verify_block,
};
use tokio::sync::Notify;

const BS: usize = 4096;

struct Fx {
    m: TieringManager,
    cpu: Arc<CpuTier>,
}

async fn manager(slots: usize, tiers: Vec<Arc<dyn SecondaryTier>>) -> Fx {
    let cpu = Arc::new(
        CpuTier::new(CpuTierConfig {
            capacity_bytes: (slots * BS) as u64,
            block_size: BS,
            policy: EvictionPolicy::Lru,
            prefault: true,
        })
        .unwrap(),
    );
    let mut b = TieringManager::builder(KvTierConfig::new((slots * BS) as u64, BS as u64))
        .primary(cpu.clone());
    for t in tiers {
        // the tests read the tiers' events: reported (vLLM's enable_kv_events)
        b = b.tier_with_options(t, kv_tier_core::TierOptions::default().with_events());
    }
    Fx {
        m: b.build().await.unwrap(),
        cpu,
    }
}

fn mem(name: &str) -> Arc<MemoryTier> {
    Arc::new(MemoryTier::new(name, BS))
}

fn faulty(inner: &Arc<MemoryTier>) -> Arc<FaultyTier> {
    Arc::new(FaultyTier::new(inner.clone()))
}

use kv_tier_testkit::util::engine_store as store;

/// Puts blocks straight into a secondary tier (as if stored by an earlier process).
async fn seed(t: &dyn SecondaryTier, keys: &[BlockKey]) {
    let job = StoreJob {
        requests: Vec::new(),
        blocks: keys.iter().map(|k| (*k, source_for(k, 0, BS))).collect(),
    };
    assert!(t.store(job).await.is_success());
    t.take_events();
}

fn assert_dram_bytes(cpu: &CpuTier, keys: &[BlockKey]) {
    let views = cpu.prepare_load(keys).unwrap();
    for (k, v) in keys.iter().zip(views) {
        assert!(
            verify_block(k, 0, v.as_slice()),
            "DRAM bytes of {k} are wrong"
        );
    }
}

/// One scheduler step: look up every key, end the step.
fn step(m: &TieringManager, keys: &[BlockKey], req: &RequestContext) -> Vec<LookupResult> {
    let r = keys.iter().map(|k| m.lookup(k, req)).collect();
    m.on_schedule_end();
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cascade_to_two_tiers() {
    let (a, b) = (mem("a"), mem("b"));
    let fx = manager(8, vec![a.clone(), b.clone()]).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    store(&fx.m, RequestId(1), &keys);
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
async fn promotion_goes_retry_then_pending_then_hit() {
    let t = mem("fs");
    let keys: Vec<_> = (0..4).map(test_key).collect();
    seed(&*t, &keys).await;
    let fx = manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Retry; 4]);
    fx.m.wait_idle().await; // the probe's answer arrives
    assert_eq!(t.lookup_counts(), (4, 1), "one batched probe for the step");
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 4]);
    fx.m.wait_idle().await; // the promotion lands
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Hit; 4]);
    assert_dram_bytes(&fx.cpu, &keys);
    let s = fx.m.stats();
    assert_eq!(
        (
            s.tiers[0].hits,
            s.tiers[0].load_jobs,
            s.tiers[0].blocks_loaded
        ),
        (4, 1, 4)
    );
    assert_eq!(s.tiers[0].bytes_loaded, 4 * BS as u64);
    assert_eq!(s.lookups, 12);
    assert_eq!((s.retries, s.hits_pending, s.hits, s.misses), (4, 4, 4, 0));
    let c = fx.m.lookup_prefix(&keys, &req);
    assert_eq!((c.hit, c.present, c.retry), (4, 4, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_promotion_keeps_what_loaded_and_misses_the_rest() {
    let inner = mem("fs");
    let keys: Vec<_> = (0..3).map(test_key).collect();
    seed(&*inner, &keys).await;
    let t = faulty(&inner);
    t.fail_load(&keys[1..2]);
    let fx = manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &keys, &req);
    fx.m.wait_idle().await;
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 3]);
    fx.m.wait_idle().await;
    assert_eq!(
        step(&fx.m, &keys, &req),
        vec![LookupResult::Hit, LookupResult::Miss, LookupResult::Hit]
    );
    assert_dram_bytes(&fx.cpu, &[keys[0], keys[2]]);
    // no livelock: the failed key stays a Miss for this request, with no new probe or load
    let probes = inner.lookup_counts();
    for _ in 0..3 {
        assert_eq!(fx.m.lookup(&keys[1], &req), LookupResult::Miss);
        fx.m.on_schedule_end();
        fx.m.wait_idle().await;
    }
    assert_eq!(inner.lookup_counts(), probes);
    assert_eq!(fx.m.stats().tiers[0].load_failures, 1);
    assert_eq!(fx.m.stats().tiers[0].load_jobs, 1);
    // a later successful store makes it Hit again
    t.heal();
    store(&fx.m, RequestId(2), &keys[1..2]);
    assert_eq!(fx.m.lookup(&keys[1], &req), LookupResult::Hit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_requests_for_one_block_cause_one_promotion() {
    let t = mem("fs");
    let k = test_key(1);
    seed(&*t, &[k]).await;
    let fx = manager(8, vec![t.clone()]).await;
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    assert_eq!(fx.m.lookup(&k, &r1), LookupResult::Retry);
    assert_eq!(fx.m.lookup(&k, &r2), LookupResult::Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(t.lookup_counts(), (1, 1), "one probe for both requests");
    assert_eq!(fx.m.lookup(&k, &r1), LookupResult::HitPending);
    assert_eq!(fx.m.lookup(&k, &r2), LookupResult::HitPending);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &r1), LookupResult::Hit);
    assert_eq!(fx.m.lookup(&k, &r2), LookupResult::Hit);
    let s = fx.m.stats();
    assert_eq!((s.tiers[0].load_jobs, s.tiers[0].blocks_loaded), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promotions_are_one_job_per_tier_and_request() {
    let t = mem("fs");
    let keys: Vec<_> = (0..6).map(test_key).collect();
    seed(&*t, &keys).await;
    let fx = manager(16, vec![t.clone()]).await;
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    for k in &keys[..3] {
        fx.m.lookup(k, &r1);
    }
    for k in &keys[3..] {
        fx.m.lookup(k, &r2);
    }
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    for k in &keys[..3] {
        assert_eq!(fx.m.lookup(k, &r1), LookupResult::HitPending);
    }
    for k in &keys[3..] {
        assert_eq!(fx.m.lookup(k, &r2), LookupResult::HitPending);
    }
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.stats().tiers[0].load_jobs, 2);
    assert_dram_bytes(&fx.cpu, &keys);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_store_cascades_nothing() {
    let t = mem("fs");
    let fx = manager(4, vec![t.clone()]).await;
    let k = test_key(1);
    fx.m.prepare_store(&[k]).unwrap().abort();
    fx.m.wait_idle().await;
    assert!(t.is_empty());
    let s = fx.m.stats();
    assert_eq!((s.cascades, s.tiers[0].store_jobs), (0, 0));
    assert!(fx.m.take_events().is_empty());
    assert_eq!(fx.cpu.lookup(&k), LookupResult::Miss);
}

/// A probe that saw "absent" before a store completed must not turn the key into a Miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_probe_after_completed_store_is_ignored() {
    let inner = mem("fs");
    let t = faulty(&inner);
    let fx = manager(1, vec![t.clone()]).await; // one DRAM slot
    let (k, other) = (test_key(1), test_key(2));
    let req = RequestContext::new(1);
    let gate = t.hold_lookups();
    assert_eq!(step(&fx.m, &[k], &req), vec![LookupResult::Retry]);
    gate.wait_arrived(1).await; // the probe has looked (absent) and is held
    assert!(!inner.contains(&k));
    store(&fx.m, RequestId(2), &[k]);
    fx.m.wait_jobs().await; // the cascade landed: mark_stored
    assert!(inner.contains(&k));
    store(&fx.m, RequestId(2), &[other]); // evicts k from DRAM
    assert_eq!(fx.cpu.lookup(&k), LookupResult::Miss);
    gate.open();
    fx.m.wait_idle().await; // the stale "absent" arrives
    assert_eq!(fx.m.stats().tiers[0].probes.stale_answers, 1);
    // not a Miss: the store made the old answer stale, so the key is probed afresh (and
    // leased), then promoted
    assert_eq!(
        step(&fx.m, &[k], &req),
        vec![LookupResult::Retry],
        "the stale probe won"
    );
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::HitPending);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mark_miss_on_a_pending_probe_is_not_overwritten() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = faulty(&inner);
    let notify = Arc::new(Notify::new());
    let mut al = ProbeCache::new(t.clone(), tokio::runtime::Handle::current(), notify.clone());
    let (r1, r2) = (RequestId(1), RequestId(2));
    let gate = t.hold_lookups();
    assert_eq!(al.ask(&k, r1), Presence::Retry);
    assert_eq!(al.flush(), 1);
    gate.wait_arrived(1).await; // the probe saw "present" and is held
    al.mark_miss(&[k], r1); // a failed load for r1 while the probe is pending: no panic
    gate.open();
    kv_tier_testkit::util::wait_probe_results(&al, &notify).await;
    al.apply_results();
    assert_eq!(al.stats().stale_answers, 1);
    assert_eq!(
        al.ask(&k, r1),
        Presence::Absent,
        "the stale probe overwrote mark_miss"
    );
    // another request probes afresh and sees the block
    assert_eq!(al.ask(&k, r2), Presence::Retry);
    al.flush();
    kv_tier_testkit::util::wait_probe_results(&al, &notify).await;
    al.apply_results();
    assert_eq!(al.ask(&k, r2), Presence::Present);
    // mark_stored clears r1's miss (a later store makes it a hit again)
    al.mark_stored(&[k]);
    assert_eq!(al.ask(&k, r1), Presence::Present);
    // finishing both requests forgets the key
    al.finish_request(r1);
    al.finish_request(r2);
    assert_eq!(al.tracked_keys(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_probe_after_mark_stored_is_ignored_in_async_lookup() {
    let inner = mem("fs");
    let t = faulty(&inner);
    let notify = Arc::new(Notify::new());
    let mut al = ProbeCache::new(t.clone(), tokio::runtime::Handle::current(), notify.clone());
    let k = test_key(1);
    let gate = t.hold_lookups();
    assert_eq!(al.ask(&k, RequestId(1)), Presence::Retry);
    al.flush();
    gate.wait_arrived(1).await;
    seed(&*inner, &[k]).await; // the store landed
    al.mark_stored(&[k]);
    gate.open();
    kv_tier_testkit::util::wait_probe_results(&al, &notify).await;
    al.apply_results();
    assert_eq!(al.stats().stale_answers, 1);
    // the stale "absent" is ignored; the key is probed again, found and leased
    assert_eq!(al.ask(&k, RequestId(1)), Presence::Retry);
    al.flush();
    kv_tier_testkit::util::wait_probe_results(&al, &notify).await;
    al.apply_results();
    assert_eq!(al.ask(&k, RequestId(1)), Presence::Present);
    assert!(inner.is_protected(&k), "a found key is leased");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_errors_count_as_misses() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = faulty(&inner);
    t.fail_lookups(true);
    let fx = manager(4, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::Miss);
    assert_eq!(fx.m.stats().tiers[0].probes.probe_errors, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_cache_empties_dram_and_secondaries_keep_data() {
    let t = mem("fs");
    let fx = manager(8, vec![t.clone()]).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    store(&fx.m, RequestId(1), &keys);
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
    let fx = manager(2, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::HitPending); // slot reserved, load queued
    fx.m.reset_cache().await;
    assert_eq!(fx.cpu.lookup(&k), LookupResult::Miss);
    assert_eq!(fx.m.stats().tiers[0].load_jobs, 0);
    assert_eq!(fx.cpu.stats().writing_blocks, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_filter_skips_a_tier() {
    let (a, b) = (mem("a"), mem("b"));
    let k = test_key(1);
    seed(&*b, &[k]).await;
    let fx = manager(4, vec![a.clone(), b.clone()]).await;
    let skip_b = RequestContext::new(1).skip_tiers(["b"]);
    step(&fx.m, &[k], &skip_b);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &skip_b), LookupResult::Miss);
    assert_eq!(b.lookup_counts(), (0, 0), "tier b was probed");
    let only_b = RequestContext::new(2).only_tiers(["b"]);
    assert_eq!(step(&fx.m, &[k], &only_b), vec![LookupResult::Retry]);
    fx.m.wait_idle().await;
    assert_eq!(
        a.lookup_counts(),
        (1, 1),
        "tier a was probed for the filtered request"
    );
    assert_eq!(step(&fx.m, &[k], &only_b), vec![LookupResult::HitPending]);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &only_b), LookupResult::Hit);
    assert_eq!(fx.m.stats().tiers[1].blocks_loaded, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secondary_hit_without_dram_room_is_a_miss() {
    let t = mem("fs");
    let k = test_key(1);
    seed(&*t, &[k]).await;
    let fx = manager(1, vec![t.clone()]).await;
    let pinned = test_key(9);
    store(&fx.m, RequestId(1), &[pinned]);
    fx.m.wait_idle().await;
    let _reader = fx.cpu.prepare_load(&[pinned]).unwrap(); // the only slot is pinned
    let req = RequestContext::new(2);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::Miss);
    assert_eq!(fx.m.stats().promotions_refused, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_state_is_dropped_only_after_its_stores_finish() {
    let inner = mem("fs");
    let t = faulty(&inner);
    let fx = manager(4, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    let absent = test_key(5);
    step(&fx.m, &[absent], &req);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&absent, &req), LookupResult::Miss);
    let gate = t.hold_stores();
    store(&fx.m, req.id, &[test_key(6)]);
    fx.m.on_request_finished(req.id);
    assert_eq!(
        fx.m.stats().tiers[0].tracked_keys,
        1,
        "forgotten before its store finished"
    );
    gate.open();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.stats().tiers[0].tracked_keys, 0);
    // without pending stores the state goes at once
    let r2 = RequestContext::new(2);
    step(&fx.m, &[absent], &r2);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.stats().tiers[0].tracked_keys, 1);
    fx.m.on_request_finished(r2.id);
    assert_eq!(fx.m.stats().tiers[0].tracked_keys, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_tier_fails_its_job_and_the_manager_goes_on() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = faulty(&inner);
    let fx = manager(4, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    t.panic_on_load(true);
    assert_eq!(step(&fx.m, &[k], &req), vec![LookupResult::HitPending]);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::Miss);
    assert_eq!(
        fx.cpu.stats().writing_blocks,
        0,
        "the reserved slot was freed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touch_refreshes_dram_recency_through_the_manager() {
    let fx = manager(2, vec![]).await;
    let (a, b, c) = (test_key(1), test_key(2), test_key(3));
    store(&fx.m, RequestId(1), &[a]);
    store(&fx.m, RequestId(1), &[b]);
    fx.m.touch(&[a]);
    let p = fx.m.prepare_store(&[c]).unwrap();
    assert_eq!(p.evicted(), [b]);
}

#[test]
fn build_blocking_owns_a_runtime_and_unknown_types_are_refused() {
    let cfg = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 16384, "block_size_bytes": 4096, "secondary_tiers": [{"type": "memory"}, {"type": "nvme"}]}"#,
    )
    .unwrap();
    let mut reg = kv_tier_core::TierRegistry::new();
    MemoryTier::register(&mut reg).unwrap();
    let err = kv_tier_testkit::dram_manager_builder(cfg.clone())
        .unwrap()
        .registry(reg.clone())
        .build_blocking()
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("secondary_tiers[1].type") && msg.contains("\"nvme\""),
        "{msg}"
    );
    let bad = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 16384, "block_size_bytes": 4096, "secondary_tiers": [{"type": "memory", "size": 3}]}"#,
    )
    .unwrap();
    let err = kv_tier_testkit::dram_manager_builder(bad)
        .unwrap()
        .registry(reg.clone())
        .build_blocking()
        .unwrap_err();
    assert!(err.to_string().contains("secondary_tiers[0].size"), "{err}");
    let mut ok = cfg;
    ok.secondary_tiers.pop();
    let m = kv_tier_testkit::dram_manager_builder(ok)
        .unwrap()
        .registry(reg)
        .build_blocking()
        .unwrap();
    assert_eq!(m.tier_names(), ["memory"]);
    let k = test_key(1);
    store(&m, RequestId(1), &[k]);
    m.runtime().clone().block_on(m.wait_idle());
    assert_eq!(m.stats().tiers[0].blocks_stored, 1);
}

/// The whole loop under real concurrency: a multi-turn workload over a small DRAM tier and a
/// flaky secondary tier. Every block that answers Hit has exactly the bytes of its key, and
/// every turn resolves in a bounded number of steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_round_trips_verify_under_faults() {
    let inner = mem("fs");
    let t = faulty(&inner);
    t.fail_every_nth_load(Some(5));
    let fx = manager(24, vec![t.clone()]).await;
    let wl = Workload::new(WorkloadConfig {
        seed: 7,
        streams: 6,
        turns: 3,
        prefix_pool: 3,
        prefix_blocks: 6,
        prompt_blocks: 3,
        output_blocks: 2,
        group: 0,
    });
    let mut verified = 0;
    for turn in wl {
        let req = RequestContext::new(turn.request);
        let mut steps = 0;
        let hit = loop {
            let c = fx.m.lookup_prefix(&turn.keys, &req);
            fx.m.on_schedule_end();
            if !c.retry && c.present == c.hit {
                break c.hit;
            }
            steps += 1;
            assert!(steps < 20, "turn {} did not resolve", turn.request.0);
            fx.m.wait_idle().await;
        };
        // the engine reads the hit prefix from DRAM
        let views = fx.cpu.prepare_load(&turn.keys[..hit]).unwrap();
        for (k, v) in turn.keys[..hit].iter().zip(&views) {
            assert!(verify_block(k, 0, v.as_slice()), "wrong bytes for {k}");
            verified += 1;
        }
        drop(views);
        // computes and stores the rest plus the output
        let mut new: Vec<BlockKey> = turn.keys[hit..].to_vec();
        new.extend(&turn.output);
        for chunk in new.chunks(8) {
            store(&fx.m, req.id, chunk);
        }
        fx.m.touch(&turn.keys);
        fx.m.on_request_finished(req.id);
        fx.m.wait_idle().await;
    }
    let s = fx.m.stats();
    assert!(verified > 0);
    assert!(s.tiers[0].blocks_loaded > 0, "no promotion happened: {s:?}");
    assert!(s.tiers[0].load_failures > 0, "no fault was injected: {s:?}");
    assert!(s.primary.evictions > 0);
    assert_eq!(s.tiers[0].tracked_keys, 0, "request state leaked");
}

/// A promotion's reservation never evicts a block the same prefix lookup answered Hit for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_does_not_evict_hits_of_the_same_prefix_lookup() {
    let t = mem("fs");
    let (k0, k1, k2, other) = (test_key(0), test_key(1), test_key(2), test_key(9));
    seed(&*t, &[k2]).await;
    let fx = manager(3, vec![t.clone()]).await;
    store(&fx.m, RequestId(1), &[k0]);
    store(&fx.m, RequestId(1), &[k1]);
    store(&fx.m, RequestId(1), &[other]); // most recent: k0 is the LRU block
    fx.m.wait_idle().await;
    let req = RequestContext::new(2).only_tiers(["fs"]);
    let prefix = [k0, k1, k2];
    let c = fx.m.lookup_prefix(&prefix, &req);
    assert_eq!((c.hit, c.retry), (2, true));
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    let c = fx.m.lookup_prefix(&prefix, &req);
    assert_eq!((c.hit, c.present), (2, 3));
    // the answered hits are still readable; the unrelated block made room
    assert!(
        fx.m.prepare_load(&[k0, k1]).is_ok(),
        "a block answered Hit was evicted"
    );
    assert_eq!(fx.cpu.lookup(&other), LookupResult::Miss);
}

/// A promotion whose load failed, with its result not applied yet, while the engine completes
/// a store of the same key: the slot must not become a readable block of garbage. (Found by
/// serve_sim's byte-for-byte oracle.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_store_never_completes_a_slot_reserved_by_a_promotion() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = faulty(&inner);
    t.fail_load(&[k]);
    let fx = manager(4, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    let held = t.hold_load_results();
    assert_eq!(step(&fx.m, &[k], &req), vec![LookupResult::HitPending]);
    held.wait_arrived(1).await; // the load failed and released its slot; no result yet
    // same step, the engine recomputed the block and stores it
    let other = RequestContext::new(2);
    let p = fx.m.prepare_store(&[k]).unwrap();
    assert!(p.keys().is_empty(), "the slot is reserved by the promotion");
    p.commit(other.id);
    assert_ne!(
        fx.cpu.lookup(&k),
        LookupResult::Hit,
        "a slot nobody wrote became readable"
    );
    held.open();
    fx.m.wait_idle().await;
    assert_eq!(fx.cpu.lookup(&k), LookupResult::Miss);
    // and the engine can store it for real now
    store(&fx.m, other.id, &[k]);
    assert_dram_bytes(&fx.cpu, &[k]);
}

/// When DRAM has no other room, a promotion is refused (Miss) rather than evicting a block the
/// same lookup already answered Hit for. (Found by serve_sim's test under CI load.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_dram_refuses_a_promotion_rather_than_evict_a_hit_of_the_same_lookup() {
    let t = mem("fs");
    let (k0, k1, k2, k3) = (test_key(0), test_key(1), test_key(2), test_key(3));
    seed(&*t, &[k2, k3]).await;
    let fx = manager(3, vec![t.clone()]).await;
    store(&fx.m, RequestId(1), &[k0]);
    store(&fx.m, RequestId(1), &[k1]);
    fx.m.wait_idle().await;
    let req = RequestContext::new(2);
    let prefix = [k0, k1, k2, k3];
    assert_eq!(
        fx.m.lookup_many(&prefix, &req),
        vec![
            LookupResult::Hit,
            LookupResult::Hit,
            LookupResult::Retry,
            LookupResult::Retry
        ]
    );
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    // one free slot: k2 gets it; k3 would have to evict k0 or k1
    let r = fx.m.lookup_many(&prefix, &req);
    assert_eq!(
        r,
        vec![
            LookupResult::Hit,
            LookupResult::Hit,
            LookupResult::HitPending,
            LookupResult::Miss
        ]
    );
    assert!(
        fx.m.prepare_load(&[k0, k1]).is_ok(),
        "a block answered Hit was evicted"
    );
    assert_eq!(fx.m.stats().promotions_refused, 1);
}

/// The end of a step sends the probes its lookups queued, on its own: the tier sees them
/// without the engine calling anything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_end_of_a_step_sends_its_probes() {
    let t = mem("fs");
    let keys: Vec<_> = (0..4).map(test_key).collect();
    seed(&*t, &keys).await;
    let fx = manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Retry; 4]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while t.lookup_counts() != (4, 1) {
        assert!(
            std::time::Instant::now() < deadline,
            "the step's probe was never sent: {:?}",
            t.lookup_counts()
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

/// Typed access finds a tier the manager built by its name, as its own type, and nothing
/// under another name or type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_access_finds_the_tier_of_that_name_and_type() {
    let (a, b) = (mem("a"), mem("b"));
    let fx = manager(8, vec![a.clone(), b.clone()]).await;
    let got = fx.m.tier::<MemoryTier>("b").expect("tier b");
    assert!(Arc::ptr_eq(&got, &b));
    assert!(Arc::ptr_eq(&fx.m.tier::<MemoryTier>("a").unwrap(), &a));
    assert!(fx.m.tier::<FaultyTier>("a").is_none(), "another type");
    assert!(fx.m.tier::<MemoryTier>("c").is_none(), "no such name");
}

/// A local tier gets the local defaults (no probe budget of its own: the probe deadline
/// bounds it); the manager's stats name every tier; `Debug` of the builder and of a pending
/// store shows what they hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_tier_gets_local_defaults_and_stats_and_debug_name_things() {
    let t = mem("fs");
    assert_eq!(t.info().locality, kv_tier_core::Locality::Local);
    let b = TieringManager::builder(KvTierConfig::new((8 * BS) as u64, BS as u64));
    assert!(format!("{b:?}").contains("TieringManagerBuilder"), "{b:?}");
    let fx = manager(8, vec![t.clone()]).await;
    assert_eq!(fx.m.tier_settings(0).probe_budget, std::time::Duration::MAX);
    assert_eq!(fx.m.stats().tiers[0].name, "fs");
    let (a, b) = (test_key(1), test_key(2));
    store(&fx.m, RequestId(1), &[a]);
    let p = fx.m.prepare_store(&[a, b]).unwrap();
    assert_eq!(
        p.present(),
        &[a],
        "a block in DRAM is present, not stored again"
    );
    assert_eq!(p.keys(), vec![b]);
    let shown = format!("{p:?}");
    assert!(
        shown.contains("present") && shown.contains(&a.to_string()),
        "{shown}"
    );
    p.abort();
}

/// A memory tier that records the request hooks and the requests its jobs carry.
#[derive(Debug)]
struct Recording {
    inner: Arc<MemoryTier>,
    log: std::sync::Mutex<Vec<String>>,
    /// Stores wait for a permit while this is closed.
    gate: tokio::sync::Semaphore,
    /// What it answers `on_new_request`.
    policy: kv_tier_core::OffloadPolicy,
}

impl Recording {
    fn new(name: &str, policy: kv_tier_core::OffloadPolicy, open: bool) -> Arc<Self> {
        Arc::new(Self {
            inner: mem(name),
            log: Default::default(),
            gate: tokio::sync::Semaphore::new(if open { 1 << 20 } else { 0 }),
            policy,
        })
    }
}

impl Recording {
    fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
    fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

#[kv_tier_core::async_trait]
impl SecondaryTier for Recording {
    fn info(&self) -> kv_tier_core::TierInfo {
        self.inner.info()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> kv_tier_core::Result<Vec<bool>> {
        self.inner.lookup(keys).await
    }
    async fn store(&self, job: StoreJob) -> kv_tier_core::JobResult {
        let mut keys = job.keys();
        keys.sort();
        self.note(format!(
            "store {:?} x{} {keys:?}",
            job.requests,
            job.blocks.len()
        ));
        let _pass = self.gate.acquire().await;
        let r = self.inner.store(job).await;
        self.note("stored".into());
        r
    }
    async fn load(&self, job: kv_tier_core::LoadJob) -> kv_tier_core::JobResult {
        self.note(format!("load {:?} x{}", job.requests, job.blocks.len()));
        self.inner.load(job).await
    }
    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch(keys)
    }
    fn protect(&self, keys: &[BlockKey]) -> kv_tier_core::ProtectGuard {
        self.inner.protect(keys)
    }
    fn is_protected(&self, key: &BlockKey) -> bool {
        self.inner.is_protected(key)
    }
    fn take_events(&self) -> Vec<kv_tier_core::TierEvent> {
        self.inner.take_events()
    }
    fn on_new_request(&self, req: &RequestContext) -> kv_tier_core::OffloadPolicy {
        self.note(format!("new {:?}", req.id));
        self.policy
    }
    fn on_request_finished(&self, req: RequestId) {
        self.note(format!("finished {req:?}"));
    }
    async fn shutdown(&self) -> kv_tier_core::Result<()> {
        self.inner.shutdown().await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_carry_their_request_and_tiers_see_requests_start_and_finish() {
    // stores held
    let rec = Recording::new("rec", kv_tier_core::OffloadPolicy::ChunkLevel, false);
    let fx = manager(4, vec![rec.clone()]).await;
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    assert_eq!(
        fx.m.on_new_request(&r1),
        kv_tier_core::OffloadPolicy::ChunkLevel
    );
    let keys: Vec<BlockKey> = (0..2).map(test_key).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    let stored_line = format!("store [RequestId(1)] x2 {sorted:?}");
    // r1 stores two blocks: the cascade to the tier is r1's; r1 finishes while it is held
    store(&fx.m, r1.id, &keys);
    fx.m.on_request_finished(r1.id);
    // the store job has started (bounded wait: a loaded machine may take a while to run it)
    let patience = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !rec.log().contains(&stored_line) {
        assert!(std::time::Instant::now() < patience, "{:?}", rec.log());
        fx.m.on_schedule_end();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    // and steps go on while it is held
    for _ in 0..3 {
        fx.m.on_schedule_end();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    assert_eq!(
        rec.log(),
        ["new RequestId(1)", stored_line.as_str()],
        "not finished for the tier while its store runs"
    );
    rec.gate.add_permits(1 << 20);
    fx.m.wait_idle().await;
    fx.m.on_schedule_end(); // applies the store's completion: r1's state may go now
    assert_eq!(
        rec.log(),
        [
            "new RequestId(1)",
            stored_line.as_str(),
            "stored",
            "finished RequestId(1)"
        ]
    );
    // evict them from DRAM, then r2's lookups promote them back: a load job of r2's
    fx.m.on_new_request(&r2);
    let others: Vec<BlockKey> = (10..14).map(test_key).collect();
    store(&fx.m, RequestId(9), &others);
    fx.m.wait_idle().await;
    for _ in 0..20 {
        if fx.m.lookup_prefix(&keys, &r2).hit == keys.len() {
            break;
        }
        fx.m.on_schedule_end();
        fx.m.wait_idle().await;
    }
    fx.m.on_request_finished(r2.id);
    let log = rec.log();
    assert!(log.contains(&"new RequestId(2)".to_string()), "{log:?}");
    assert!(
        log.iter().any(|l| l.starts_with("load [RequestId(2)]")),
        "the promotion's load job carries r2: {log:?}"
    );
    assert_eq!(
        log.last().map(String::as_str),
        Some("finished RequestId(2)")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_level_tier_also_gets_the_blocks_already_in_dram() {
    use kv_tier_core::OffloadPolicy;
    let rl = Recording::new("rl", OffloadPolicy::RequestLevel, true);
    let chunk = Recording::new("chunk", OffloadPolicy::ChunkLevel, true);
    let fx = manager(8, vec![rl.clone(), chunk.clone()]).await;
    let (a, b) = (test_key(1), test_key(2));
    // r1 computes a: both tiers get it
    let r1 = RequestContext::new(1);
    assert_eq!(fx.m.on_new_request(&r1), OffloadPolicy::RequestLevel);
    store(&fx.m, r1.id, &[a]);
    fx.m.wait_idle().await;
    // r2 finds a in DRAM and computes b: the chunk-level tier gets b, the request-level
    // tier a and b
    let r2 = RequestContext::new(2);
    fx.m.on_new_request(&r2);
    store(&fx.m, r2.id, &[a, b]);
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
    store(&fx.m, r2.id, &[a, c]);
    fx.m.wait_idle().await;
    assert_eq!(
        stores(&rl).last().unwrap(),
        &format!("store [RequestId(2)] x1 {:?}", [c])
    );
}
