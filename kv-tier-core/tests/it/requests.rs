//! Request lifecycle: `on_new_request` and `on_request_finished` reach the tiers, jobs carry their
//! requests, a finished request's state goes once its stores end and it sends no promotion, request
//! ids reused.

use std::sync::Arc;
use std::time::Duration;

use LookupResult::{Hit, HitPending, Miss, Retry};
use kv_tier::OffloadPolicy;
use kv_tier_core::{BlockKey, LookupResult, PrimaryTier, RequestContext, RequestId, SecondaryTier};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{FaultyTier, MemoryTier, fill_block, store_keys, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_state_is_dropped_only_after_its_stores_finish() {
    let inner = mem("fs");
    let t = faulty_over(&inner);
    let fx = evented_manager(4, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    let absent = test_key(5);
    step(&fx.m, &[absent], &req);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&absent, &req), LookupResult::Miss);
    let gate = t.hold_stores();
    engine_store(&fx.m, req.id, &[test_key(6)]);
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
async fn jobs_carry_their_request_and_tiers_see_requests_start_and_finish() {
    // stores held
    let rec = Recording::new("rec", kv_tier_core::OffloadPolicy::ChunkLevel, false);
    let fx = evented_manager(4, vec![rec.clone()]).await;
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
    engine_store(&fx.m, r1.id, &keys);
    fx.m.on_request_finished(r1.id);
    // the store job has started (bounded wait: a loaded machine may take a while to run it)
    let started = poll_until_async(LIMIT, || {
        let started = rec.log().contains(&stored_line);
        if !started {
            fx.m.on_schedule_end();
        }
        started
    })
    .await;
    assert!(started, "{:?}", rec.log());
    // and steps go on while it is held (time for a wrong "finished" to reach the tier)
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
    engine_store(&fx.m, RequestId(9), &others);
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
async fn a_finished_request_sends_no_promotions_and_leaves_no_state() {
    let inner = mem("fs");
    let keys: Vec<_> = (0..4).map(test_key).collect();
    seed(&*inner, &keys).await;
    let fx = manager(8, vec![inner.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &keys, &req);
    fx.m.wait_idle().await;
    let got: Vec<_> = keys.iter().map(|k| fx.m.lookup(k, &req)).collect();
    assert_eq!(got, vec![LookupResult::HitPending; 4]); // promotions queued
    fx.m.on_request_finished(req.id);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    let s = fx.m.stats();
    assert_eq!(
        s.tiers[0].load_jobs, 0,
        "a finished request's promotion was sent"
    );
    assert_eq!(s.tiers[0].promotions_cancelled, 4);
    for k in &keys {
        assert_eq!(fx.cpu.lookup(k), LookupResult::Miss, "reservation kept");
        assert!(!inner.is_protected(k), "lease kept");
    }
    assert_eq!(fx.cpu.stats().writing_blocks, 0);
    assert_no_lookup_state(&fx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_promotion_of_a_finished_request_leaves_no_lookup_state() {
    let inner = mem("fs");
    let keys: Vec<_> = (0..20).map(test_key).collect();
    seed(&*inner, &keys).await;
    let t = Arc::new(FaultyTier::new(inner.clone()));
    let fx = manager(32, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &keys, &req);
    fx.m.wait_idle().await;
    let gate = t.hold_loads();
    t.fail_load(&keys);
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 20]);
    gate.wait_arrived(1).await; // the promotion is in flight
    fx.m.on_request_finished(req.id);
    gate.open();
    fx.m.wait_idle().await; // it fails, for a request that has finished
    assert_eq!(fx.m.stats().tiers[0].load_failures, 20);
    assert_no_lookup_state(&fx);
    assert!(fx.m.stats().tiers[0].probes.ignored_answers >= 1);
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `ProbeCache`): "negative answers are kept
/// per request and dropped when it finishes." A request id reused after
/// `on_request_finished` starts clean: the old request's `Miss` does not answer the new one
/// for a block that arrived meanwhile.
#[test]
fn a_request_id_reused_after_finish_is_not_answered_by_the_old_miss() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(101);
    let (end, _) = settle_lookup(&m, &k, &ctx(1), SETTLE_LIMIT);
    assert_eq!(end, Miss);
    m.on_schedule_end();
    m.on_request_finished(RequestId(1));
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let again = ctx(1);
    let first = m.lookup(&k, &again);
    assert_ne!(
        first, Miss,
        "the finished request's Miss answered its successor"
    );
    let (end, seen) = settle_lookup(&m, &k, &again, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(again.id);
    assert_nothing_left(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/mod.rs, `lookup`, and ARCHITECTURE.md §2.6: "when it
/// reaches 0 for a request that already finished, its lookup state is dropped"): a request
/// finished with a store in flight; its id is reused by a new request that gets a promotion;
/// the old store then lands. The new request still reaches `Hit` with the right bytes, and
/// when it finishes nothing is left tracked, held or leased.
#[test]
fn a_request_id_reused_while_its_old_store_is_in_flight() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let m = build_with(mcfg(6, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let (k1, k2) = (test_key(111), test_key(112));
    assert!(rt.block_on(store_keys(&*mem, &[k2], 0, BS)).is_success());
    let stores = faulty.hold_stores();
    engine_store(&m, RequestId(1), &[k1]);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, stores.wait_arrived(1)).await
    })
    .unwrap();
    m.on_request_finished(RequestId(1));
    let again = ctx(1);
    assert_eq!(m.lookup(&k2, &again), Retry);
    m.on_schedule_end();
    step_until(&m, "k2 HitPending for the reused id", SETTLE_LIMIT, |m| {
        m.lookup(&k2, &again) == HitPending
    });
    // the old request's store lands while the new one's promotion is queued
    stores.open();
    block_on_jobs(&m);
    m.on_schedule_end();
    let (end, seen) = settle_lookup(&m, &k2, &again, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k2]);
    m.on_schedule_end();
    assert!(mem.contains(&k1), "the old store did not land");
    m.on_request_finished(again.id);
    assert_nothing_left(&m, &[k1, k2]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/stats/mod.rs, `TierStats::promotions_cancelled`: "Queued
/// promotions not sent because their request finished first"; ARCHITECTURE.md §3:
/// "`on_request_finished` cancels that request's queued (unsent) promotions (sinks dropped,
/// slots freed, `holds.failed`, leases released)"; lifecycle.rs `shutdown`: "Afterwards ...
/// stores cascade nowhere"). A request finished with its promotion queued: nothing is sent,
/// the slot and the lease are freed; after shutdown an engine store cascades to no tier.
#[test]
fn a_queued_promotion_of_a_finished_request_is_never_sent() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let k = test_key(381);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let loads = faulty.hold_loads();
    let r = ctx(1);
    assert_eq!(m.lookup(&k, &r), Retry);
    m.on_schedule_end();
    block_on_idle(&m);
    assert_eq!(m.lookup(&k, &r), HitPending);
    m.on_request_finished(r.id);
    m.on_schedule_end();
    block_on_idle(&m);
    // time for a wrongly sent promotion to reach the tier's gate
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(loads.arrived(), 0, "a cancelled promotion was sent");
    let s = m.stats();
    assert_eq!(s.tiers[0].promotions_cancelled, 1, "{:?}", s.tiers[0]);
    assert_eq!(s.tiers[0].load_jobs, 0);
    assert_eq!(
        m.primary().lookup(&k),
        Miss,
        "the cancelled promotion's slot is still reserved"
    );
    assert_nothing_left(&m, &[k]);
    loads.open();
    m.shutdown_blocking().unwrap();
    let before = m.stats();
    engine_store(&m, RequestId(2), &[test_key(382)]);
    m.on_request_finished(RequestId(2));
    block_on_idle(&m);
    let after = m.stats();
    assert_eq!(
        after.tiers[0].store_jobs, before.tiers[0].store_jobs,
        "a store cascaded after shutdown"
    );
    assert_eq!(
        (
            after.write_back_pinned_bytes,
            after.tiers[0].write_back_bytes
        ),
        (0, 0)
    );
    assert!(!mem.contains(&test_key(382)));
}

/// Promise (kv-tier-core/src/manager/mod.rs and ARCHITECTURE.md §2.6: a finished request's
/// lookup state is dropped once its stores end; `TierStats::tracked_requests`: "Requests the
/// tier's probe cache tracks (asked and not finished)"). An engine whose GPU -> DRAM copy
/// completes after the scheduler finished the request (the store committed under the
/// finished id, a probe of it still out): once the manager is idle nothing of that request
/// is tracked, held or leased, and the stored block is served to the next request.
#[test]
fn a_store_committed_after_its_request_finished_leaves_nothing_tracked() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let (k, kq) = (test_key(391), test_key(392));
    assert!(rt.block_on(store_keys(&*mem, &[kq], 0, BS)).is_success());
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let r = ctx(1);
    let mut p = m.prepare_store(&[k]).unwrap(); // the copy starts
    let gate = faulty.hold_lookups();
    assert_eq!(m.lookup(&kq, &r), Retry);
    m.on_schedule_end();
    m.on_request_finished(r.id); // the scheduler is done with the request
    for (kk, s) in p.slots() {
        fill_block(kk, 0, s.as_mut_slice());
    }
    p.commit(r.id); // ... and the copy completes later
    m.on_schedule_end();
    gate.open();
    block_on_idle(&m);
    assert!(mem.contains(&k), "the late store did not cascade");
    let s = m.stats();
    assert_eq!(
        (
            s.tiers[0].tracked_requests,
            s.tiers[0].tracked_keys,
            s.tiers[0].leased_keys
        ),
        (0, 0, 0),
        "{:?}",
        s.tiers[0]
    );
    assert_nothing_left(&m, &[k, kq]);
    let r2 = ctx(2);
    let (end, seen) = settle_lookup(&m, &kq, &r2, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    assert_nothing_left(&m, &[k, kq]);
    m.shutdown_blocking().unwrap();
}

/// A request aborted with its promotion queued: the DRAM reservation and lease go; another
/// request that joined the promotion still gets the block.
#[test]
fn a_request_finished_with_a_queued_promotion_does_not_strand_a_joiner() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(4, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    put(&m, &t, &[k]);
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    assert_eq!(m.lookup(&k, &r1), LookupResult::Retry);
    step_and_wait(&m);
    assert_eq!(m.lookup(&k, &r1), LookupResult::HitPending);
    assert_eq!(m.lookup(&k, &r2), LookupResult::HitPending);
    m.on_request_finished(r1.id); // before the promotion is sent
    m.on_schedule_end();
    block_on_idle(&m);
    let v = settle_lookup(&m, &k, &r2, Duration::from_secs(5)).0;
    assert_eq!(
        v,
        LookupResult::Hit,
        "the joining request never got the block"
    );
    assert!(load_and_verify(&m, &[k]));
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A request finished twice while its store job is in flight: its state is dropped once,
/// nothing tracked remains.
#[test]
fn a_request_finished_twice_with_a_store_in_flight() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build_with(dram_cfg(8, BS, ""), vec![f.clone()]);
    let gate = f.hold_stores();
    let req = RequestContext::new(1);
    let other = test_key(50);
    assert_eq!(m.lookup(&other, &req), LookupResult::Retry);
    m.on_schedule_end();
    let keys: Vec<BlockKey> = (0..2).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    m.on_request_finished(req.id);
    m.on_request_finished(req.id);
    gate.open();
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

#[test]
fn jobs_carry_request_ids_and_finished_waits_for_every_store() {
    let (m, rec, log) = rec_manager();
    let r7 = RequestContext::new(7);
    assert_eq!(m.on_new_request(&r7), OffloadPolicy::ChunkLevel);
    rec.gate.send_replace(false);
    engine_store(&m, RequestId(7), &[test_key(1)]);
    engine_store(&m, RequestId(7), &[test_key(2)]); // a second store of the same request
    m.on_schedule_end();
    wait_until("both stores started", SETTLE_LIMIT, || {
        log.lock()
            .unwrap()
            .iter()
            .filter(|s| s.starts_with("store_start"))
            .count()
            == 2
    });
    m.on_request_finished(RequestId(7));
    // steps go on while the stores are held: time for a wrong "finished" to reach the tier
    for _ in 0..5 {
        m.on_schedule_end();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        !log.lock()
            .unwrap()
            .iter()
            .any(|s| s.starts_with("finished")),
        "finished before the stores ended: {:?}",
        log.lock().unwrap()
    );
    rec.gate.send_replace(true);
    m.runtime().block_on(m.wait_idle());
    m.on_schedule_end();
    let l = log.lock().unwrap().clone();
    assert_eq!(l[0], "new RequestId(7)");
    assert_eq!(
        l.iter()
            .filter(|s| *s == "store_start [RequestId(7)]")
            .count(),
        2,
        "{l:?}"
    );
    let last_end = l.iter().rposition(|s| s == "store_end").unwrap();
    let fin = l
        .iter()
        .position(|s| s == "finished RequestId(7)")
        .expect("finished delivered");
    assert!(fin > last_end, "{l:?}");
}

#[test]
fn promotion_load_jobs_carry_the_request() {
    let (m, rec, log) = rec_manager();
    let k = test_key(5);
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    m.runtime().block_on(m.wait_idle());
    m.runtime().block_on(m.reset_cache());
    let r9 = RequestContext::new(9);
    let mut steps = 0;
    loop {
        let r = m.lookup(&k, &r9);
        m.on_schedule_end();
        if r == LookupResult::Hit {
            break;
        }
        steps += 1;
        assert!(steps < 1000);
        m.runtime().block_on(m.wait_idle());
    }
    drop(rec);
    assert!(
        log.lock()
            .unwrap()
            .iter()
            .any(|s| s == "load [RequestId(9)]"),
        "{:?}",
        log.lock().unwrap()
    );
}
