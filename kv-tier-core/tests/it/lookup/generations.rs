//! The generation guard: a late probe answer never overrides what happened after it was sent (a
//! completed store, a failed load, a deleted block, the key's state dropped and re-created),
//! through the manager and on a `ProbeCache` driven directly.

use std::sync::Arc;
use std::time::{Duration, Instant};

use LookupResult::{Hit, Miss, Retry};
use kv_tier_core::{
    LookupResult, Presence, PrimaryTier, ProbeCache, RequestContext, RequestId, SecondaryTier,
};
use kv_tier_testkit::{FaultyTier, store_keys, temp_root, test_key};
use tokio::sync::Notify;

use crate::support::*;

/// A probe that saw "absent" before a store completed must not turn the key into a Miss.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn late_probe_after_completed_store_is_ignored() {
    let inner = mem("fs");
    let t = faulty_over(&inner);
    let fx = evented_manager(1, vec![t.clone()]).await; // one DRAM slot
    let (k, other) = (test_key(1), test_key(2));
    let req = RequestContext::new(1);
    let gate = t.hold_lookups();
    assert_eq!(step(&fx.m, &[k], &req), vec![LookupResult::Retry]);
    gate.wait_arrived(1).await; // the probe has looked (absent) and is held
    assert!(!inner.contains(&k));
    engine_store(&fx.m, RequestId(2), &[k]);
    fx.m.wait_jobs().await; // the cascade landed: mark_stored
    assert!(inner.contains(&k));
    engine_store(&fx.m, RequestId(2), &[other]); // evicts k from DRAM
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
    let t = faulty_over(&inner);
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
    let t = faulty_over(&inner);
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

/// The exact interleaving of the generation hole: a probe P1 looks (absent) before a store
/// completes; the key's state is dropped and re-created by a new request, whose probe P2 is
/// in flight when P1's answer arrives. P1 must be stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_older_than_a_store_never_marks_the_key_absent_after_its_state_was_dropped() {
    let inner = mem("fs");
    let t = Arc::new(FaultyTier::new(inner.clone()));
    let notify = Arc::new(Notify::new());
    let mut al = ProbeCache::new(t.clone(), tokio::runtime::Handle::current(), notify.clone());
    let k = test_key(1);
    let (r1, r2) = (RequestId(1), RequestId(2));
    let gate1 = t.hold_lookups();
    assert_eq!(al.ask(&k, r1), Presence::Retry);
    al.flush(); // P1
    gate1.wait_arrived(1).await; // P1 saw "absent" and is held
    seed(&*inner, &[k]).await; // the store lands...
    al.mark_stored(&[k]); // ...and completes
    al.finish_request(r1); // the key's state is dropped
    let gate2 = t.hold_lookups();
    assert_eq!(al.ask(&k, r2), Presence::Retry); // state re-created
    al.flush(); // P2
    gate2.wait_arrived(1).await; // P2 saw "present" and is held
    gate1.open();
    kv_tier_testkit::util::wait_probe_results(&al, &notify).await;
    al.apply_results(); // P1's stale "absent"
    assert_eq!(al.stats().stale_answers, 1);
    assert_ne!(
        al.ask(&k, r2),
        Presence::Absent,
        "a probe older than the store marked the key absent"
    );
    gate2.open();
    while al.in_flight() > 0 {
        kv_tier_testkit::util::wait_probe_results(&al, &notify).await;
        al.apply_results();
    }
    assert_eq!(al.ask(&k, r2), Presence::Present);
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `ProbeCache`): "a completed store
/// ([`ProbeCache::mark_stored`]) ... makes every probe in flight for its keys stale, so a late
/// probe never overwrites it"; README: "a completed store bumps a per-key generation so a
/// late existence probe can never turn a present block into a miss". Here: a probe of the
/// real fs tier looks (absent) and is held; the key's store completes and the key leaves
/// DRAM; the probe's late "absent" must not make the asking request `Miss`.
#[test]
fn a_late_absent_probe_never_makes_a_stored_key_miss() {
    let root = temp_root();
    let (fs, faulty) = faulty_fs(root.path());
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let gate = faulty.hold_lookups();
    let k = test_key(1);
    let r1 = ctx(1);
    assert_eq!(m.lookup(&k, &r1), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    // the probe has looked (absent) and waits to answer: now k's store completes
    engine_store(&m, RequestId(2), &[k]);
    m.on_request_finished(RequestId(2));
    block_on_jobs(&m);
    assert!(fs.block_path(&k).exists(), "the cascade did not land in fs");
    flush_dram(&m, 3);
    assert_eq!(m.primary().lookup(&k), Miss, "k still in DRAM");
    gate.open();
    assert!(poll_until(SETTLE_LIMIT, || {
        m.poll();
        m.is_idle()
    }));
    let (end, seen) = settle_lookup(&m, &k, &r1, SETTLE_LIMIT);
    assert_eq!(
        end, Hit,
        "a stale 'absent' answer decided the key: {seen:?}"
    );
    load_verify(&m, &[k]);
    let st = m.stats().tiers[0].probes;
    assert!(
        st.stale_answers >= 1,
        "the late answer was not counted stale: {st:?}"
    );
    // a request that starts after the late answer is not misled either
    let r4 = ctx(4);
    let (end, seen) = settle_lookup(&m, &k, &r4, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r4.id);
    assert_nothing_left(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `mark_stored`): "A completed store: every
/// probe in flight for the keys is stale ..., and the keys are no longer a miss for any
/// request." A request answered `Miss` for an absent key, still running when the key's store
/// completes (and the key then leaves DRAM), must not be answered `Miss` from that old
/// negative answer.
#[test]
fn a_completed_store_clears_a_live_requests_earlier_miss() {
    let root = temp_root();
    let (_fs, faulty) = faulty_fs(root.path());
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(11);
    let r1 = ctx(1);
    let (end, _) = settle_lookup(&m, &k, &r1, SETTLE_LIMIT);
    assert_eq!(end, Miss, "an absent key");
    engine_store(&m, RequestId(2), &[k]);
    m.on_request_finished(RequestId(2));
    block_on_jobs(&m);
    flush_dram(&m, 3);
    assert_eq!(m.primary().lookup(&k), Miss);
    m.on_schedule_end();
    let first = m.lookup(&k, &r1);
    assert_ne!(
        first, Miss,
        "the request's old 'absent' outlived the completed store"
    );
    let (end, seen) = settle_lookup(&m, &k, &r1, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    assert_nothing_left(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier README): kv-tier "never returns a wrong or torn block"; `LookupResult::Hit`
/// (kv-tier-core/src/request.rs): "In DRAM and readable now". A probe of the fs tier that
/// looked (present) and is held; the file is then deleted; the late "present" must never
/// end as a `Hit` (nothing can be loaded), only as a `Miss`; another request also misses.
#[test]
fn a_late_present_probe_for_a_deleted_block_never_becomes_a_hit() {
    let root = temp_root();
    let (fs, faulty) = faulty_fs(root.path());
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(21);
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    block_on_jobs(&m);
    flush_dram(&m, 2);
    let gate = faulty.hold_lookups();
    let r = ctx(3);
    assert_eq!(m.lookup(&k, &r), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    std::fs::remove_file(fs.block_path(&k)).unwrap();
    gate.open();
    let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
    assert_eq!(end, Miss, "a deleted block answered {seen:?}");
    let r4 = ctx(4);
    let (end, seen) = settle_lookup(&m, &k, &r4, SETTLE_LIMIT);
    assert_eq!(end, Miss, "{seen:?}");
    m.on_schedule_end();
    m.on_request_finished(r.id);
    m.on_request_finished(r4.id);
    assert_nothing_left(&m, &[k]);
    // the key stores and serves again
    engine_store(&m, RequestId(5), &[k]);
    m.on_request_finished(RequestId(5));
    block_on_jobs(&m);
    flush_dram(&m, 6);
    let r7 = ctx(7);
    let (end, seen) = settle_lookup(&m, &k, &r7, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r7.id);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs): "a ... failed load
/// ([`ProbeCache::mark_miss`]) makes every probe in flight for its keys stale"; `mark_miss`:
/// "the keys are a miss for it, no longer known present for anyone, and a probe in flight
/// for them is stale (other waiters probe again)". Driven on a `ProbeCache` directly: a probe
/// looked (present) and is held, the block goes and the failed load is marked; the late
/// "present" must not be served to anyone.
#[test]
fn probe_cache_a_failed_load_makes_an_in_flight_present_probe_stale() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let k = test_key(31);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let notify = Arc::new(tokio::sync::Notify::new());
    let mut pc = ProbeCache::new(faulty.clone(), rt.handle().clone(), notify.clone())
        .with_timeouts(Duration::from_secs(30), Duration::from_secs(30));
    let gate = faulty.hold_lookups();
    let (r1, r2) = (RequestId(1), RequestId(2));
    assert_eq!(pc.ask(&k, r1), Presence::Retry);
    assert_eq!(pc.ask(&k, r2), Presence::Retry);
    assert_eq!(pc.flush(), 1);
    rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await })
        .unwrap();
    assert!(mem.remove(&k));
    pc.mark_miss(&[k], r1);
    gate.open();
    rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
    pc.apply_results();
    assert_eq!(pc.stats().stale_answers, 1, "{:?}", pc.stats());
    assert_eq!(pc.ask(&k, r1), Presence::Absent, "r1's load failed");
    let v = pc.ask(&k, r2);
    assert_eq!(
        v,
        Presence::Retry,
        "the stale 'present' was served to another waiter"
    );
    assert_eq!(pc.leased_keys(), 0, "a stale answer took a lease");
    pc.flush();
    rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
    pc.apply_results();
    assert_eq!(pc.ask(&k, r2), Presence::Absent);
    pc.finish_request(r1);
    pc.finish_request(r2);
    assert_eq!(
        (pc.tracked_keys(), pc.tracked_requests(), pc.leased_keys()),
        (0, 0, 0)
    );
    assert!(!faulty.is_protected(&k));
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs): "a completed store ... makes every probe in
/// flight for its keys stale, so a late probe never overwrites it, even after the key's state
/// was dropped and re-created." On a `ProbeCache` directly: the asking request finishes while
/// its probe (absent) is held, the key is stored and marked, a new request asks; the late
/// "absent" must not answer it, and the request then finds the key present.
#[test]
fn probe_cache_a_stale_absent_answer_survives_neither_finish_nor_recreation() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let k = test_key(41);
    let notify = Arc::new(tokio::sync::Notify::new());
    let mut pc = ProbeCache::new(faulty.clone(), rt.handle().clone(), notify.clone())
        .with_timeouts(Duration::from_secs(30), Duration::from_secs(30));
    let gate = faulty.hold_lookups();
    // 1. the key's state dropped and re-created
    assert_eq!(pc.ask(&k, RequestId(1)), Presence::Retry);
    pc.flush();
    rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await })
        .unwrap();
    pc.finish_request(RequestId(1));
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    pc.mark_stored(&[k]);
    let v = pc.ask(&k, RequestId(2));
    assert_ne!(v, Presence::Absent);
    gate.open();
    rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
    pc.apply_results();
    assert_ne!(
        pc.ask(&k, RequestId(2)),
        Presence::Absent,
        "the stale 'absent' answered"
    );
    let t0 = Instant::now();
    loop {
        pc.flush();
        if pc.in_flight() > 0 {
            rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
        }
        pc.apply_results();
        match pc.ask(&k, RequestId(2)) {
            Presence::Present => break,
            Presence::Absent => panic!("a stored key answered absent"),
            Presence::Retry => assert!(t0.elapsed() < SETTLE_LIMIT, "stuck at Retry"),
        }
    }
    // 2. the same with the asking request alive
    let k2 = test_key(42);
    let gate2 = faulty.hold_lookups();
    assert_eq!(pc.ask(&k2, RequestId(3)), Presence::Retry);
    pc.flush();
    rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, gate2.wait_arrived(1)).await })
        .unwrap();
    assert!(rt.block_on(store_keys(&*mem, &[k2], 0, BS)).is_success());
    pc.mark_stored(&[k2]);
    gate2.open();
    rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
    pc.apply_results();
    assert_ne!(
        pc.ask(&k2, RequestId(3)),
        Presence::Absent,
        "the stale 'absent' answered"
    );
    assert!(pc.stats().stale_answers >= 2, "{:?}", pc.stats());
    pc.release(&[k]);
    pc.finish_request(RequestId(2));
    pc.finish_request(RequestId(3));
    eprintln!(
        "after finish: tracked {} queued {} in flight {}",
        pc.tracked_keys(),
        pc.queued(),
        pc.in_flight()
    );
    // a probe may still be queued or out for k2: send it and let it land
    let t0 = Instant::now();
    pc.flush();
    while pc.in_flight() > 0 {
        rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
        pc.apply_results();
        assert!(t0.elapsed() < SETTLE_LIMIT);
    }
    eprintln!(
        "after landing: tracked {} queued {} in flight {}",
        pc.tracked_keys(),
        pc.queued(),
        pc.in_flight()
    );
    assert_eq!(
        (pc.tracked_keys(), pc.tracked_requests(), pc.leased_keys()),
        (0, 0, 0)
    );
    assert!(!faulty.is_protected(&k) && !faulty.is_protected(&k2));
}
