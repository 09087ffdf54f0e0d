//! Leases: a key found present is protected in its tier from the probe until its promotion ends or
//! its requests finish; an expired lease is reaped, an answer that expired unused is renewed once,
//! and no lease outlives its use.

use std::sync::Arc;
use std::time::{Duration, Instant};

use LookupResult::{Hit, HitPending, Retry};
use kv_tier::fs::FsTier;
use kv_tier_core::{
    BlockKey, LookupResult, Presence, ProbeCache, RequestContext, RequestId, SecondaryTier,
};
use kv_tier_testkit::{FaultyTier, MemoryTier, store_keys, temp_root, test_key};

use crate::support::*;

#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_counted_and_the_key_probed_again() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let (al, notify) = probe_cache(inner.clone());
    let mut al = al.with_timeouts(Duration::from_secs(1), Duration::from_millis(50));
    let r = RequestId(1);
    assert_eq!(al.ask(&k, r), Presence::Retry);
    al.flush();
    settle_probes(&mut al, &notify).await;
    assert_eq!(al.ask(&k, r), Presence::Present);
    assert!(inner.is_protected(&k), "a found key is leased");
    // the paused clock: 1 ms before the lease ends
    tokio::time::sleep(Duration::from_millis(49)).await;
    assert_eq!(al.ask(&k, r), Presence::Present, "the lease ended early");
    // the paused clock: past the lease
    tokio::time::sleep(Duration::from_millis(2)).await;
    assert_eq!(
        al.ask(&k, r),
        Presence::Retry,
        "an expired lease still answered present"
    );
    assert_eq!(al.stats().leases_expired, 1);
    assert_eq!(al.queued(), 1, "the key is probed again");
}

/// An answer that expires before any ask used it (a scheduler slower than the lease) is
/// renewed once and answered present, not probed again: with a lease shorter than the
/// scheduler's steps, every answer would otherwise expire unused and the key stay `Retry`.
#[tokio::test(start_paused = true)]
async fn an_answer_that_expired_unused_is_renewed_once() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let (al, notify) = probe_cache(inner.clone());
    let mut al = al.with_timeouts(Duration::from_secs(1), Duration::from_millis(5));
    let r = RequestId(1);
    assert_eq!(al.ask(&k, r), Presence::Retry);
    al.flush();
    settle_probes(&mut al, &notify).await;
    // the scheduler comes back four leases later
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert!(
        !inner.is_protected(&k),
        "the reaper ended the expired lease"
    );
    assert_eq!(
        al.ask(&k, r),
        Presence::Present,
        "the unused answer was dropped"
    );
    assert!(inner.is_protected(&k), "renewed: protected again");
    assert_eq!(al.stats().leases_expired, 1);
    assert_eq!(al.queued(), 0, "nothing probed again");
    // used now: when it expires again, the key is probed again
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(al.ask(&k, r), Presence::Retry);
    assert_eq!(al.stats().leases_expired, 2);
    assert_eq!(al.queued(), 1, "the key is probed again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_found_key_is_leased_until_its_promotion_ends() {
    let inner = mem("fs");
    let keys: Vec<_> = (0..2).map(test_key).collect();
    seed(&*inner, &keys).await;
    let fx = manager(8, vec![inner.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &keys, &req);
    fx.m.wait_idle().await; // found: leased from the probe on
    assert!(keys.iter().all(|k| inner.is_protected(k)));
    assert_eq!(fx.m.stats().tiers[0].leased_keys, 2);
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 2]);
    fx.m.wait_idle().await; // promoted: the lease ends with the promotion
    assert!(keys.iter().all(|k| !inner.is_protected(k)));
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Hit; 2]);
    // a lease nothing ends expires
    let other = test_key(9);
    seed(&*inner, &[other]).await;
    let r2 = RequestContext::new(2);
    step(&fx.m, &[other], &r2);
    fx.m.wait_idle().await;
    assert!(inner.is_protected(&other));
    fx.m.on_request_finished(r2.id); // ...or the request's end
    assert!(!inner.is_protected(&other));
    fx.m.on_request_finished(req.id);
    assert_no_lookup_state(&fx);
}

#[tokio::test(start_paused = true)]
async fn an_unused_expired_lease_is_renewed_once() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let fx = manager_with(1, vec![inner.clone()], |c| c.lease_s = 5.0).await;
    // DRAM holds one block: k's promotion is refused while another block is pinned there
    let pinned = test_key(2);
    engine_store(&fx.m, RequestId(9), &[pinned]);
    fx.m.wait_idle().await;
    let pin = fx.m.prepare_load(&[pinned]).unwrap();
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    assert!(inner.is_protected(&k));
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::Miss); // no room: lease released
    assert!(!inner.is_protected(&k));
    drop(pin);
    let r2 = RequestContext::new(2);
    step(&fx.m, &[k], &r2);
    fx.m.wait_idle().await;
    assert!(inner.is_protected(&k));
    // the reaper ticks every quarter lease (1.25 s) and leaves a live lease alone
    tokio::time::advance(Duration::from_secs(4)).await;
    fx.m.poll();
    assert!(inner.is_protected(&k), "a live lease was ended");
    tokio::time::advance(Duration::from_secs(2)).await;
    fx.m.poll();
    assert!(!inner.is_protected(&k), "an expired lease still protects");
    // no lookup had used the answer (the scheduler came back after the lease): it is renewed
    // once and used, not probed again (with a lease shorter than the scheduler's steps, a
    // key would otherwise stay `Retry` for good)
    assert_eq!(
        fx.m.lookup(&k, &r2),
        LookupResult::HitPending,
        "an unused answer is renewed and used"
    );
    assert!(inner.is_protected(&k), "the renewed lease protects");
    assert_eq!(fx.m.stats().tiers[0].probes.leases_expired, 1);
    // (a used answer whose lease expires is probed again:
    // `an_expired_lease_is_counted_and_the_key_probed_again`)
}

/// A lease nothing ends (a live request, an idle scheduler) is dropped at its expiry even if
/// the manager is not called.
#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_dropped_while_the_scheduler_is_idle() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let fx = manager_with(8, vec![inner.clone()], |c| c.lease_s = 4.0).await;
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    assert!(inner.is_protected(&k));
    tokio::time::sleep(Duration::from_secs(6)).await; // no manager call meanwhile
    assert!(
        !inner.is_protected(&k),
        "an expired lease still protects its key"
    );
    assert_eq!(fx.m.stats().tiers[0].leased_keys, 0);
}

/// A key both tiers have is served by A; the lease B took on it (probed at the same time)
/// ends with A's promotion instead of pinning B's copy until the request ends.
#[tokio::test(start_paused = true)]
async fn the_slow_tier_lets_go_of_a_key_the_fast_one_promoted() {
    let (a, b_inner, b) = two_tiers();
    let k = test_key(1);
    seed(&*a, &[k]).await;
    seed(&*b_inner, &[k]).await;
    let m = two_tier_manager(8, a.clone(), b.clone(), |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    m.wait_idle().await;
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::HitPending]);
    m.wait_idle().await;
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Hit]);
    let s = m.stats();
    assert_eq!(s.tiers[0].hits, 1);
    assert_eq!(
        (s.tiers[0].leased_keys, s.tiers[1].leased_keys),
        (0, 0),
        "a tier keeps a lease on a key another tier promoted"
    );
    assert!(!b.is_protected(&k));
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs): the lease ends at expiry, "then the key is
/// probed again if asked; but an answer that expired before any ask used it is renewed once
/// and answered `Present`, so a lease shorter than the scheduler's steps cannot keep a key
/// at `Retry`"; `leased_keys`: "an expired lease is dropped by a reaper within a quarter
/// lease". With `lease_s` at its minimum (1 ms) and steps of 10 ms, requests over fs still
/// reach `Hit` for their whole prefix, and no lease or protection outlives them.
#[test]
fn leases_expiring_at_every_moment_never_keep_a_prefix_from_hit() {
    let root = temp_root();
    let fs = open_fs(root.path(), BS);
    let m = build_with(
        mcfg(16, r#", "probe_timeout_s": 30, "lease_s": 0.001"#),
        vec![fs.clone()],
    );
    let prefix: Vec<BlockKey> = (0..6).map(|i| test_key(130 + i)).collect();
    engine_store(&m, RequestId(1), &prefix);
    m.on_request_finished(RequestId(1));
    block_on_jobs(&m);
    for n in 0..4u64 {
        assert_eq!(block_on(&m, m.reset_cache()), 0);
        let r = ctx(10 + n);
        let t0 = Instant::now();
        let mut history = Vec::new();
        loop {
            let found = m.lookup_prefix(&prefix, &r);
            history.push(found);
            if found.hit == prefix.len() {
                load_verify(&m, &prefix);
                break;
            }
            m.on_schedule_end();
            assert!(
                t0.elapsed() < SETTLE_LIMIT,
                "never all Hit: {:?}",
                &history[history.len().saturating_sub(5)..]
            );
            // steps longer than the lease (the subject)
            std::thread::sleep(Duration::from_millis(10 + 5 * n));
        }
        m.on_schedule_end();
        m.on_request_finished(r.id);
    }
    assert_nothing_left(&m, &prefix);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs): "A key found present is leased: protected
/// from eviction in the tier from the moment its probe is sent until [`ProbeCache::release`]
/// (the promotion ended)"; `flush`: "The batch's keys are protected in the tier from now
/// until the answer is applied"; fs README: "once `protect()` has returned, no file of its
/// keys is deleted while the guard lives". A bounded fs tier swept below its cap while the
/// key's probe is held, and again while its promotion is held: the key survives both, is
/// served with its bytes, and is no longer protected afterwards.
#[test]
fn a_probe_in_flight_and_a_lease_keep_the_key_through_gc_sweeps() {
    let root = temp_root();
    let mut c = fs_tier_config(root.path());
    c.gc_max_size_gb = Some(64.0 * 1024.0 / (1u64 << 30) as f64); // 64 KiB
    c.gc_background = false;
    c.gc_hard_ceiling = Some(1000.0);
    let fs = Arc::new(FsTier::open("fs", c, model_namespace(), BS).unwrap());
    let faulty = Arc::new(FaultyTier::new(fs.clone()));
    let m = build_with(mcfg(8, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(241);
    let others: Vec<BlockKey> = (0..40).map(|i| test_key(2_410 + i)).collect();
    for (n, chunk) in std::iter::once(&[k][..])
        .chain(others.chunks(8))
        .enumerate()
    {
        engine_store(&m, RequestId(1), chunk);
        block_on_jobs(&m);
        if n == 0 {
            std::thread::sleep(Duration::from_millis(20)); // k is the oldest file
        }
    }
    m.on_request_finished(RequestId(1));
    assert_eq!(block_on(&m, m.reset_cache()), 0);
    fs.advance_gc_clock(Duration::from_secs(100_000)).unwrap();
    // 1. the probe is out, held
    let gate = faulty.hold_lookups();
    let r = ctx(2);
    assert_eq!(m.lookup(&k, &r), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    let deleted = fs.gc_sweep_now().unwrap();
    assert!(deleted > 0, "the sweep deleted nothing: the test is void");
    assert!(
        fs.block_path(&k).exists(),
        "a key under probe was deleted by a sweep"
    );
    // 2. the promotion is out, held
    let loads = faulty.hold_loads();
    gate.open();
    block_on_idle(&m);
    assert_eq!(m.lookup(&k, &r), HitPending);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, loads.wait_arrived(1)).await
    })
    .unwrap();
    let more: Vec<BlockKey> = (0..24).map(|i| test_key(2_500 + i)).collect();
    assert!(block_on(&m, store_keys(&*fs, &more, 0, BS)).is_success());
    fs.advance_gc_clock(Duration::from_secs(100_000)).unwrap();
    assert!(fs.gc_sweep_now().unwrap() > 0);
    assert!(
        fs.block_path(&k).exists(),
        "a leased key was deleted by a sweep"
    );
    loads.open();
    let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_nothing_left(&m, &[k]);
    // no protection outlives the promotion: a later sweep may now take k
    let mut round = 0u64;
    assert!(
        poll_until(SETTLE_LIMIT, || {
            // over the cap again, with newer files than k
            round += 1;
            let more: Vec<BlockKey> = (0..24).map(|i| test_key(2_600 + round * 100 + i)).collect();
            assert!(block_on(&m, store_keys(&*fs, &more, 0, BS)).is_success());
            fs.gc_apply_stamps_now().unwrap(); // the load's recency stamp (no GC thread here)
            fs.advance_gc_clock(Duration::from_secs(100_000)).unwrap();
            let _ = fs.gc_sweep_now();
            !fs.block_path(&k).exists()
        }),
        "k stayed protected"
    );
    m.shutdown_blocking().unwrap();
}

/// Promises of kv-tier-core/src/probe_cache/mod.rs, on a `ProbeCache` driven directly:
/// `leased_keys`: "an expired lease is dropped by a reaper within a quarter lease, even while
/// nobody calls the lookup"; `ProbeCache`: "an answer that expired before any ask used it is
/// renewed once and answered `Present`" (and "A key found present is leased: protected from
/// eviction"); `release`: "their leases end, and their 'present' answers with them (a later
/// ask probes again)"; `mark_miss`: "For a request this lookup does not know (it finished),
/// nothing is created"; `mark_stored`: "Keys no request tracks are not kept";
/// "negative answers are kept per request".
#[test]
fn probe_cache_leases_release_and_request_scope() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let (k, k2, k3) = (test_key(341), test_key(342), test_key(343));
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let notify = Arc::new(tokio::sync::Notify::new());
    let lease = Duration::from_millis(100);
    let mut pc = ProbeCache::new(faulty.clone(), rt.handle().clone(), notify.clone())
        .with_timeouts(Duration::from_secs(30), lease);
    let settle = |pc: &mut ProbeCache| {
        pc.flush();
        let t0 = Instant::now();
        while pc.in_flight() > 0 {
            rt.block_on(kv_tier_testkit::util::wait_probe_results(pc, &notify));
            pc.apply_results();
            assert!(t0.elapsed() < SETTLE_LIMIT);
        }
    };
    // the answer lands and takes a lease; nobody asks: the reaper ends it
    assert_eq!(pc.ask(&k, RequestId(1)), Presence::Retry);
    settle(&mut pc);
    assert_eq!(pc.leased_keys(), 1);
    assert!(faulty.is_protected(&k), "a found key is not protected");
    let reaped = poll_until(SETTLE_LIMIT, || {
        pc.leased_keys() == 0 && !faulty.is_protected(&k)
    });
    assert!(
        reaped,
        "an expired lease was not reaped (leased {}, protected {})",
        pc.leased_keys(),
        faulty.is_protected(&k)
    );
    // renewed once: the first ask after the expiry uses the answer, and holds a lease again
    assert_eq!(
        pc.ask(&k, RequestId(1)),
        Presence::Present,
        "an unused expired answer was not renewed"
    );
    assert_eq!(pc.leased_keys(), 1, "the renewed answer holds no lease");
    assert!(
        faulty.is_protected(&k),
        "the renewed answer is not protected"
    );
    // release: the answer goes with the lease
    pc.release(&[k]);
    assert_eq!(pc.leased_keys(), 0);
    assert!(!faulty.is_protected(&k));
    assert_eq!(
        pc.ask(&k, RequestId(1)),
        Presence::Retry,
        "a released answer still served"
    );
    settle(&mut pc);
    assert_eq!(pc.ask(&k, RequestId(1)), Presence::Present);
    // request scope of negative answers
    assert_eq!(pc.ask(&k2, RequestId(1)), Presence::Retry);
    settle(&mut pc);
    assert_eq!(pc.ask(&k2, RequestId(1)), Presence::Absent);
    assert!(rt.block_on(store_keys(&*mem, &[k2], 0, BS)).is_success()); // written by someone else
    assert_eq!(
        pc.ask(&k2, RequestId(2)),
        Presence::Retry,
        "another request's miss answered"
    );
    settle(&mut pc);
    assert_eq!(pc.ask(&k2, RequestId(2)), Presence::Present);
    // nothing created for unknown requests and untracked keys
    let (tk, tr) = (pc.tracked_keys(), pc.tracked_requests());
    pc.mark_miss(&[k3], RequestId(99));
    pc.mark_stored(&[k3]);
    assert_eq!(
        (pc.tracked_keys(), pc.tracked_requests()),
        (tk, tr),
        "state created for nobody"
    );
    pc.finish_request(RequestId(1));
    pc.finish_request(RequestId(2));
    assert_eq!(
        (pc.tracked_keys(), pc.tracked_requests(), pc.leased_keys()),
        (0, 0, 0)
    );
    for key in [k, k2, k3] {
        assert!(!faulty.is_protected(&key));
    }
}

/// A tiny lease (it expires before the promotion is even sent): the promotion still lands
/// right, for the asking request and a joiner.
#[test]
fn a_lease_expiring_before_its_promotion_is_sent() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(8, BS, r#", "lease_s": 0.001"#), vec![t.clone()]);
    let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
    put(&m, &t, &keys);
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    m.lookup_many(&keys, &r1);
    step_and_wait(&m);
    // past the 1 ms lease
    std::thread::sleep(Duration::from_millis(20));
    let v = m.lookup_many(&keys, &r1);
    // past the 1 ms lease again
    std::thread::sleep(Duration::from_millis(20));
    let v2 = m.lookup_many(&keys, &r2);
    println!("{v:?} {v2:?}");
    m.on_schedule_end();
    block_on_idle(&m);
    for r in [&r1, &r2] {
        let t0 = Instant::now();
        loop {
            let c = m.lookup_prefix(&keys, r);
            if c.hit == keys.len() {
                break;
            }
            step_and_wait(&m);
            assert!(t0.elapsed() < Duration::from_secs(5), "{c:?}");
        }
        assert!(load_and_verify(&m, &keys));
    }
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r2.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// An engine that also calls `poll` between steps (a metrics thread, say) with a short lease
/// (`lease_s` 0.005, inside its documented range 0.001 to 86,400): the key must still settle
/// to Hit or Miss ("no key stays out of Hit/Miss for long"), not re-probe forever.
#[test]
fn a_short_lease_with_polling_between_steps_still_settles() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(8, BS, r#", "lease_s": 0.005"#), vec![t.clone()]);
    let k = test_key(1);
    put(&m, &t, &[k]);
    let req = RequestContext::new(1);
    let t0 = Instant::now();
    let mut seen = Vec::new();
    let v = loop {
        let v = m.lookup(&k, &req);
        seen.push(v);
        if matches!(v, LookupResult::Hit | LookupResult::Miss) {
            break v;
        }
        m.on_schedule_end();
        std::thread::sleep(Duration::from_millis(10)); // the forward pass
        m.poll(); // someone applies completed work between steps
        // the rest of the step
        std::thread::sleep(Duration::from_millis(20));
        if t0.elapsed() > Duration::from_secs(30) {
            break v;
        }
    };
    assert_eq!(
        v,
        LookupResult::Hit,
        "after {:?} and {} steps the key is still {v:?} (last verdicts {:?})",
        t0.elapsed(),
        seen.len(),
        &seen[seen.len().saturating_sub(5)..]
    );
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
