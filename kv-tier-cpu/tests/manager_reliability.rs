//! The manager and its async lookup keep their promises when a tier panics, hangs or fails,
//! when requests finish early, and when several callers wait at once. Interleavings are driven
//! by the fault-injecting tier's gates; deadlines run on tokio's paused clock.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{
    BlockKey, KvTierConfig, LookupResult, Presence, PrimaryTier, ProbeCache, RequestContext,
    RequestId, SecondaryTier, StoreJob, TieringManager,
};
use kv_tier_cpu::CpuTier;
use kv_tier_testkit::{FaultyTier, MemoryTier, source_for, test_key};
use tokio::sync::Notify;

const BS: usize = 4096;

struct Fx {
    m: Arc<TieringManager>,
    cpu: Arc<CpuTier>,
}

fn cpu(slots: usize) -> Arc<CpuTier> {
    kv_tier_testkit::util::lru_dram(slots, BS)
}

async fn manager_with(
    slots: usize,
    tiers: Vec<Arc<dyn SecondaryTier>>,
    tune: impl FnOnce(&mut KvTierConfig),
) -> Fx {
    let cpu = cpu(slots);
    let mut cfg = KvTierConfig::new((slots * BS) as u64, BS as u64);
    tune(&mut cfg);
    let mut b = TieringManager::builder(cfg).primary(cpu.clone());
    for t in tiers {
        b = b.tier(t);
    }
    Fx {
        m: Arc::new(b.build().await.unwrap()),
        cpu,
    }
}

async fn manager(slots: usize, tiers: Vec<Arc<dyn SecondaryTier>>) -> Fx {
    manager_with(slots, tiers, |_| {}).await
}

fn mem() -> Arc<MemoryTier> {
    Arc::new(MemoryTier::new("fs", BS))
}

async fn seed(t: &dyn SecondaryTier, keys: &[BlockKey]) {
    let job = StoreJob {
        requests: Vec::new(),
        blocks: keys.iter().map(|k| (*k, source_for(k, 0, BS))).collect(),
    };
    assert!(t.store(job).await.is_success());
    t.take_events();
}

use kv_tier_testkit::util::engine_store as store;

fn step(m: &TieringManager, keys: &[BlockKey], req: &RequestContext) -> Vec<LookupResult> {
    let r = keys.iter().map(|k| m.lookup(k, req)).collect();
    m.on_schedule_end();
    r
}

/// A bound on waits in tests on the real clock: turns a hang into a failure.
async fn bounded<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

fn assert_no_lookup_state(fx: &Fx) {
    for t in fx.m.stats().tiers {
        assert_eq!(
            (t.tracked_keys, t.tracked_requests, t.leased_keys),
            (0, 0, 0),
            "lookup state left in tier {}",
            t.name
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_probe_answers_absent_and_nothing_hangs() {
    let inner = mem();
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = Arc::new(FaultyTier::new(inner.clone()));
    t.panic_on_lookup(true);
    let fx = manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&fx.m, &[k], &req), vec![LookupResult::Retry]);
    bounded("wait_idle", fx.m.wait_idle()).await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::Miss);
    assert_eq!(fx.m.stats().tiers[0].probes.probe_panics, 1);
    assert!(!inner.is_protected(&k), "the probe's protection leaked");
    bounded("reset_cache", fx.m.reset_cache()).await;
    bounded("shutdown", fx.m.shutdown()).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_never_answers_is_given_up_at_its_deadline() {
    let inner = mem();
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = Arc::new(FaultyTier::new(inner.clone()));
    let _never = t.hold_lookups();
    let fx = manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    let started = tokio::time::Instant::now();
    assert_eq!(step(&fx.m, &[k], &req), vec![LookupResult::Retry]);
    fx.m.wait_idle().await; // returns at the probe deadline (1 s by default)
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(1) && waited < Duration::from_millis(1100),
        "{waited:?}"
    );
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::Miss);
    let s = fx.m.stats();
    assert_eq!(s.tiers[0].probes.probe_timeouts, 1);
    assert!(!inner.is_protected(&k));
    // another request probes again; a tier that stays stuck costs it one deadline, no more
    let r2 = RequestContext::new(2);
    assert_eq!(step(&fx.m, &[k], &r2), vec![LookupResult::Retry]);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &r2), LookupResult::Miss);
    fx.m.on_request_finished(req.id);
    fx.m.on_request_finished(r2.id);
    fx.m.reset_cache().await;
    fx.m.shutdown().await.unwrap();
    assert_no_lookup_state(&fx);
}

#[tokio::test(start_paused = true)]
async fn a_job_that_never_ends_is_abandoned_at_its_deadline() {
    let inner = mem();
    let keys: Vec<_> = (0..3).map(test_key).collect();
    seed(&*inner, &keys).await;
    let t = Arc::new(FaultyTier::new(inner.clone()));
    let fx = manager_with(8, vec![t.clone()], |c| {
        c.job_timeout_s = 5.0;
        c.job_timeout_per_block_s = 1.0;
    })
    .await;
    let req = RequestContext::new(1);
    step(&fx.m, &keys, &req);
    fx.m.wait_idle().await;
    let _never = t.hold_loads();
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 3]);
    let started = tokio::time::Instant::now();
    fx.m.wait_idle().await; // the load job is abandoned at 5 + 3 x 1 s
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_secs(8) && waited < Duration::from_millis(8100),
        "{waited:?}"
    );
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Miss; 3]);
    let ts = &fx.m.stats().tiers[0];
    assert_eq!(ts.jobs_timed_out, 1);
    assert_eq!(ts.load_failure_causes.timed_out, 3);
    assert_eq!(ts.load_failure_causes.total(), ts.load_failures);
    for k in &keys {
        assert_eq!(fx.cpu.lookup(k), LookupResult::Miss, "the DRAM slot leaked");
        assert!(!inner.is_protected(k), "the job's protection leaked");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_request_sends_no_promotions_and_leaves_no_state() {
    let inner = mem();
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
    let inner = mem();
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

/// The exact interleaving of the generation hole: a probe P1 looks (absent) before a store
/// completes; the key's state is dropped and re-created by a new request, whose probe P2 is
/// in flight when P1's answer arrives. P1 must be stale.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_older_than_a_store_never_marks_the_key_absent_after_its_state_was_dropped() {
    let inner = mem();
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_found_key_is_leased_until_its_promotion_ends() {
    let inner = mem();
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
    let inner = mem();
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let fx = manager_with(1, vec![inner.clone()], |c| c.lease_s = 5.0).await;
    // DRAM holds one block: k's promotion is refused while another block is pinned there
    let pinned = test_key(2);
    store(&fx.m, RequestId(9), &[pinned]);
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
    // (a used answer whose lease expires is probed again: lookup_cache.rs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_wait_idle_callers_all_return() {
    let inner = mem();
    let t = Arc::new(FaultyTier::new(inner.clone()));
    let fx = manager(8, vec![t.clone()]).await;
    let gate = t.hold_stores();
    store(&fx.m, RequestId(1), &[test_key(1)]);
    let waiters: Vec<_> = (0..6)
        .map(|_| {
            let m = fx.m.clone();
            tokio::spawn(async move { m.wait_idle().await })
        })
        .collect();
    gate.wait_arrived(1).await;
    gate.open();
    for w in waiters {
        bounded("a concurrent wait_idle", w).await.unwrap();
    }
    assert!(inner.contains(&test_key(1)));
}

#[test]
fn shutdown_blocking_shuts_a_sync_embedders_manager_down() {
    let cfg = KvTierConfig::new((8 * BS) as u64, BS as u64);
    let inner = mem();
    let m = TieringManager::builder(cfg)
        .primary(cpu(8))
        .tier(inner.clone())
        .build_blocking()
        .unwrap();
    let k = test_key(1);
    store(&m, RequestId(1), &[k]);
    m.shutdown_blocking().unwrap();
    assert!(inner.contains(&k), "shutdown waits for the cascade");
    // afterwards: DRAM only
    assert_eq!(
        m.lookup(&test_key(2), &RequestContext::new(2)),
        LookupResult::Miss
    );
    store(&m, RequestId(1), &[test_key(3)]);
    assert!(m.is_idle());
    // inside a runtime it is refused, naming why
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = rt.block_on(async { m.shutdown_blocking().unwrap_err() });
    assert!(err.to_string().contains("runtime"), "{err}");
}

#[test]
fn a_runtime_without_timers_is_refused_at_build() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let cfg = KvTierConfig::new((8 * BS) as u64, BS as u64);
    let err = rt
        .block_on(
            TieringManager::builder(cfg)
                .primary(cpu(8))
                .tier(mem())
                .build(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("timers"), "{err}");
}

#[test]
fn every_numeric_option_out_of_range_is_refused_naming_it() {
    let fields = [
        "probe_timeout_s",
        "job_timeout_s",
        "job_timeout_per_block_s",
        "lease_s",
    ];
    for f in fields {
        assert!(
            kv_tier_core::config::RANGES.iter().any(|r| r.0 == f),
            "{f} has no documented range"
        );
        for v in ["-1", "1e300", "1e19", "0.0000000001", "\"1\""] {
            if f == "job_timeout_per_block_s" && v == "0.0000000001" {
                continue; // in range: 0 is allowed
            }
            let json =
                format!(r#"{{"cpu_bytes_to_use": 8192, "block_size_bytes": 4096, "{f}": {v}}}"#);
            match KvTierConfig::from_json_str(&json) {
                Err(kv_tier_core::Error::InvalidConfig { field, .. }) => {
                    assert_eq!(field, f, "{json}")
                }
                other => panic!("{json}: {other:?}"),
            }
        }
    }
    let ok = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 8192, "block_size_bytes": 4096, "probe_timeout_s": 600,
            "job_timeout_s": 86400, "job_timeout_per_block_s": 3600, "lease_s": 86400}"#,
    )
    .unwrap();
    // the largest deadline of any job converts without overflow
    assert!(ok.job_timeout(usize::MAX) > Duration::from_secs(86_400));
}

/// A tier whose `shutdown()` hangs, and one whose `shutdown()` panics: the manager's shutdown
/// ends within `shutdown_timeout_s`, reports the first failure, and shuts every tier down.
#[tokio::test(start_paused = true)]
async fn shutdown_ends_and_reaches_every_tier_when_one_hangs_or_panics() {
    let (a, b, c) = (mem(), mem(), mem());
    let (fa, fb, fc) = (
        Arc::new(FaultyTier::new(a)),
        Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("b", BS)))),
        Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("c", BS)))),
    );
    drop((b, c));
    fa.hang_shutdown(true);
    fb.panic_on_shutdown(true);
    let fx = manager_with(4, vec![fa.clone(), fb.clone(), fc.clone()], |c| {
        c.shutdown_timeout_s = 10.0
    })
    .await;
    let started = tokio::time::Instant::now();
    let err = fx.m.shutdown().await.unwrap_err();
    assert!(matches!(err, kv_tier_core::Error::Timeout { .. }), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(11),
        "{:?}",
        started.elapsed()
    );
    assert_eq!((fa.shutdowns(), fb.shutdowns(), fc.shutdowns()), (1, 1, 1));
}

/// A tier's shutdown that takes longer than a job's deadline (it waits for work abandoned jobs
/// left running, as the fs tier joins its I/O threads) but less than `shutdown_timeout_s`
/// succeeds: a short `job_timeout_s` does not make shutdowns fail. Past `shutdown_timeout_s`
/// it is reported, naming the tier.
#[tokio::test(start_paused = true)]
async fn a_tier_shutdown_has_its_own_deadline_not_a_jobs() {
    for (shutdown_s, ok) in [(30.0, true), (0.5, false)] {
        let t = Arc::new(FaultyTier::new(mem()));
        t.delay_shutdown(Some(Duration::from_secs(2)));
        let fx = manager_with(4, vec![t.clone()], |c| {
            c.job_timeout_s = 0.01;
            c.job_timeout_per_block_s = 0.0;
            c.shutdown_timeout_s = shutdown_s;
        })
        .await;
        let r = fx.m.shutdown().await;
        assert_eq!(t.shutdowns(), 1);
        if ok {
            r.unwrap();
        } else {
            let e = r.unwrap_err();
            assert!(matches!(e, kv_tier_core::Error::Timeout { .. }), "{e}");
            assert!(e.to_string().contains("shutdown of tier `fs`"), "{e}");
        }
    }
}

/// A tier whose `protect()` panics costs protection, never the scheduler: probes, stores and
/// promotions go on, nothing hangs and no state is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_that_panics_in_protect_wedges_nothing() {
    let inner = mem();
    let keys: Vec<_> = (0..3).map(test_key).collect();
    seed(&*inner, &keys).await;
    let t = Arc::new(FaultyTier::new(inner.clone()));
    t.panic_on_protect(true);
    let fx = manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Retry; 3]);
    bounded("wait_idle", fx.m.wait_idle()).await;
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 3]);
    bounded("wait_idle", fx.m.wait_idle()).await;
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Hit; 3]);
    store(&fx.m, RequestId(2), &[test_key(9)]);
    bounded("wait_idle", fx.m.wait_idle()).await;
    assert!(inner.contains(&test_key(9)));
    fx.m.on_request_finished(req.id);
    fx.m.on_request_finished(RequestId(2));
    assert_no_lookup_state(&fx);
}

/// A lease nothing ends (a live request, an idle scheduler) is dropped at its expiry even if
/// the manager is not called.
#[tokio::test(start_paused = true)]
async fn an_expired_lease_is_dropped_while_the_scheduler_is_idle() {
    let inner = mem();
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
