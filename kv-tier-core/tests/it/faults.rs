//! Tiers that fail, panic, hang or lie (through `FaultyTier` and a scripted tier): probes and jobs
//! have deadlines, a panic costs only misses, a load reporting keys it was not asked for creates
//! nothing, a job or probe whose task dies with its runtime is reported.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use LookupResult::{Hit, Miss};
use kv_tier_core::{
    BlockKey, KvTierConfig, LookupResult, Presence, PrimaryTier, ProbeCache, RequestContext,
    RequestId, SecondaryTier, TieringManager,
};
use kv_tier_testkit::util::lru_dram;
use kv_tier_testkit::{FaultyTier, MemoryTier, fill_block, store_keys, test_key};
use tokio::sync::Notify;

use crate::support::*;

/// A probe whose runtime shuts down before it answers is reported (dropped: its keys absent),
/// never lost: the lookup does not wait for it forever and the keys' protection ends.
#[test]
fn a_probe_dropped_with_its_runtime_reports_its_keys_absent() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let inner = Arc::new(MemoryTier::new("m", BS));
    let faulty = Arc::new(FaultyTier::new(inner.clone()));
    let _held = faulty.hold_lookups(); // the probe never answers
    let notify = Arc::new(Notify::new());
    let mut al = ProbeCache::new(faulty.clone(), rt.handle().clone(), notify);
    let (k, r) = (test_key(1), RequestId(1));
    rt.block_on(seed(&*inner, &[k]));
    assert_eq!(al.ask(&k, r), Presence::Retry);
    assert_eq!(al.flush(), 1);
    assert!(faulty.is_protected(&k), "a key is protected while probed");
    assert!(!al.all_arrived());
    drop(rt); // drops the probe's task mid-way
    assert!(al.all_arrived(), "a dropped probe never reported");
    assert_eq!(al.apply_results(), 1);
    assert_eq!(al.in_flight(), 0);
    assert_eq!(al.stats().probe_errors, 1);
    assert_eq!(al.ask(&k, r), Presence::Absent);
    assert!(!faulty.is_protected(&k), "a dropped probe still protects");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_errors_count_as_misses() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = faulty_over(&inner);
    t.fail_lookups(true);
    let fx = evented_manager(4, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::Miss);
    assert_eq!(fx.m.stats().tiers[0].probes.probe_errors, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_tier_fails_its_job_and_the_manager_goes_on() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = faulty_over(&inner);
    let fx = evented_manager(4, vec![t.clone()]).await;
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

/// A job whose task dies with its runtime is reported (failed), never lost: nothing waits
/// for it forever and its DRAM pins are released.
#[test]
fn a_job_dropped_with_its_runtime_is_reported_failed() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let inner = Arc::new(MemoryTier::new("m", BS));
    let faulty = Arc::new(FaultyTier::new(inner.clone()));
    let _held = faulty.hold_stores();
    let cpu = lru_dram(4, BS);
    let builder = TieringManager::builder(KvTierConfig::new((4 * BS) as u64, BS as u64))
        .primary(cpu.clone())
        .runtime(rt.handle().clone())
        .tier(faulty.clone());
    let m = rt.block_on(builder.build()).unwrap();
    engine_store(&m, RequestId(1), &[test_key(1)]);
    m.on_schedule_end();
    assert!(!m.is_idle());
    assert!(m.stats().write_back_pinned_bytes > 0);
    drop(rt); // drops the job's task unrun
    assert!(m.is_idle(), "a dropped job never reported");
    let s = m.stats();
    assert_eq!((s.tiers[0].store_jobs, s.tiers[0].store_failures), (1, 1));
    assert_eq!(
        s.write_back_pinned_bytes, 0,
        "a dropped job still pins DRAM"
    );
    assert!(!faulty.is_protected(&test_key(1)));
}

/// A job whose tier panics is counted as panicked; its keys fail and nothing else breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_load_is_counted_and_its_keys_fail() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let faulty = Arc::new(FaultyTier::new(inner.clone()));
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let (m, _cpu) = manager_and_dram(8, faulty.clone()).await;
    faulty.panic_on_load(true);
    let req = RequestContext::new(1);
    assert_eq!(m.lookup(&k, &req), LookupResult::Retry);
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.lookup(&k, &req), LookupResult::HitPending);
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    let s = m.stats();
    assert_eq!(s.tiers[0].jobs_panicked, 1);
    assert_eq!(s.tiers[0].jobs_timed_out, 0);
    assert_eq!(s.tiers[0].load_failures, 1);
    assert_eq!(m.lookup(&k, &req), LookupResult::Miss);
    assert!(!faulty.is_protected(&k));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_probe_answers_absent_and_nothing_hangs() {
    let inner = mem("fs");
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

/// Probes past their deadline again and again, and failing ones: each is counted
/// (`probe_timeouts`, `probe_errors`), and the log says so once per interval
/// (`stats::LOG_INTERVAL`) with how many its line stands for, not a line per probe.
#[tokio::test(start_paused = true)]
async fn repeated_probe_troubles_are_counted_each_and_logged_once_per_interval() {
    let (warnings, _log) = kv_tier_testkit::fixtures::logs::Warnings::capture();
    let inner = mem("fs");
    let t = Arc::new(FaultyTier::new(inner.clone()));
    let fx = manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    let never = t.hold_lookups();
    // five probes past their 1 s deadline, within 10 s
    for i in 0..5 {
        assert_eq!(step(&fx.m, &[test_key(i)], &req), vec![LookupResult::Retry]);
        fx.m.wait_idle().await;
    }
    assert_eq!(fx.m.stats().tiers[0].probes.probe_timeouts, 5);
    let said = |what: &str| -> Vec<String> {
        warnings
            .lines()
            .into_iter()
            .filter(|l| l.contains(what))
            .collect()
    };
    let late = said("passed its deadline");
    assert_eq!(late.len(), 1, "{:?}", warnings.lines());
    assert!(late[0].contains("probes=1 "), "{late:?}");
    // past the interval: one more line, standing for the four unsaid and itself
    tokio::time::advance(kv_tier_core::stats::LOG_INTERVAL).await;
    assert_eq!(step(&fx.m, &[test_key(5)], &req), vec![LookupResult::Retry]);
    fx.m.wait_idle().await;
    let late = said("passed its deadline");
    assert_eq!(late.len(), 2, "{late:?}");
    assert!(late[1].contains("probes=5 "), "{late:?}");
    never.open();
    // failing probes: the same, on their own line
    t.fail_lookups(true);
    for i in 10..14 {
        assert_eq!(step(&fx.m, &[test_key(i)], &req), vec![LookupResult::Retry]);
        fx.m.wait_idle().await;
    }
    assert_eq!(fx.m.stats().tiers[0].probes.probe_errors, 4);
    let failed = said("existence probe failed");
    assert_eq!(failed.len(), 1, "{:?}", warnings.lines());
    assert!(failed[0].contains("probes=1 "), "{failed:?}");
    bounded("shutdown", fx.m.shutdown()).await.unwrap();
}

/// Store jobs whose blocks fail, one after another: every block is counted
/// (`store_failures`), and "block transfer failed" is said once per interval, with the
/// jobs it stands for.
#[tokio::test(start_paused = true)]
async fn failed_transfers_are_counted_each_and_logged_once_per_interval() {
    let (warnings, _log) = kv_tier_testkit::fixtures::logs::Warnings::capture();
    let t = Arc::new(FaultyTier::new(mem("fs")));
    let fx = manager(8, vec![t.clone()]).await;
    let keys: Vec<_> = (0..4).map(test_key).collect();
    t.fail_store(&keys);
    for (i, k) in keys.iter().enumerate() {
        engine_store(&fx.m, RequestId(i as u64), std::slice::from_ref(k));
        fx.m.on_schedule_end();
        fx.m.wait_idle().await;
    }
    let s = fx.m.stats();
    assert_eq!((s.tiers[0].store_jobs, s.tiers[0].store_failures), (4, 4));
    let failed: Vec<String> = warnings
        .lines()
        .into_iter()
        .filter(|l| l.contains("block transfer failed"))
        .collect();
    assert_eq!(failed.len(), 1, "{:?}", warnings.lines());
    assert!(failed[0].contains("jobs=1 "), "{failed:?}");
    bounded("shutdown", fx.m.shutdown()).await.unwrap();
}

#[tokio::test(start_paused = true)]
async fn a_probe_that_never_answers_is_given_up_at_its_deadline() {
    let inner = mem("fs");
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
    let inner = mem("fs");
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

/// A tier whose `protect()` panics costs protection, never the scheduler: probes, stores and
/// promotions go on, nothing hangs and no state is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_that_panics_in_protect_wedges_nothing() {
    let inner = mem("fs");
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
    engine_store(&fx.m, RequestId(2), &[test_key(9)]);
    bounded("wait_idle", fx.m.wait_idle()).await;
    assert!(inner.contains(&test_key(9)));
    fx.m.on_request_finished(req.id);
    fx.m.on_request_finished(RequestId(2));
    assert_no_lookup_state(&fx);
}

/// Promise (kv-tier crate docs, the step loop): "Ask again next step for `HitPending` and
/// `Retry`; a probe has a deadline, so no key stays out of `Hit`/`Miss` for long"; config:
/// a job "that has not ended by then is abandoned (its future dropped) and every key of it
/// fails". Loads held forever: the promoting request and every joiner end (bounded), none
/// with a `Hit`, and nothing is left held; afterwards the key is served.
#[test]
fn hit_pending_with_loads_held_forever_ends_for_every_joiner() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let k = test_key(71);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let m = build_with(
        mcfg(
            4,
            r#", "probe_timeout_s": 30, "job_timeout_s": 0.05, "job_timeout_per_block_s": 0"#,
        ),
        vec![faulty.clone()],
    );
    let gate = faulty.hold_loads();
    let reqs: Vec<RequestContext> = (1..=8).map(ctx).collect();
    let mut done = vec![None; reqs.len()];
    let mut seen: Vec<Vec<LookupResult>> = vec![Vec::new(); reqs.len()];
    let t0 = Instant::now();
    let mut step = 0;
    while done.iter().any(Option::is_none) {
        for (i, r) in reqs.iter().enumerate().take(step + 1) {
            if done[i].is_none() {
                let v = m.lookup(&k, r);
                seen[i].push(v);
                if matches!(v, Hit | Miss) {
                    done[i] = Some(v);
                }
            }
        }
        m.on_schedule_end();
        step += 1;
        assert!(t0.elapsed() < SETTLE_LIMIT, "stuck: {done:?} {seen:?}");
        // the next step: another request joins each step
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(done.iter().all(|v| *v == Some(Miss)), "{done:?}");
    assert!(gate.arrived() >= 1);
    gate.open();
    m.on_schedule_end();
    for r in &reqs {
        m.on_request_finished(r.id);
    }
    assert_nothing_left(&m, &[k]);
    let r = ctx(9);
    let (end, s) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{s:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r.id);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `flush`: "an error, panic, timeout or
/// dropped task is reported as such (never lost)"; `ProbeCache`: "A probe that errs, panics
/// or passes its deadline answers 'absent' for its keys"). A probe whose task is dropped
/// because its runtime shut down mid-probe: the asking request gets an answer (absent), the
/// batch's protection ends, nothing stays tracked.
#[test]
fn probe_cache_a_probe_dropped_with_its_runtime_is_reported() {
    let rt = runtime();
    let probe_rt = runtime();
    let (mem, faulty) = faulty_mem();
    let k = test_key(271);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let notify = Arc::new(tokio::sync::Notify::new());
    let mut pc = ProbeCache::new(faulty.clone(), probe_rt.handle().clone(), notify.clone())
        .with_timeouts(Duration::from_secs(30), Duration::from_secs(30));
    let gate = faulty.hold_lookups();
    assert_eq!(pc.ask(&k, RequestId(1)), Presence::Retry);
    pc.flush();
    rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await })
        .unwrap();
    assert!(
        faulty.is_protected(&k),
        "the batch is not protected while out"
    );
    probe_rt.shutdown_background();
    rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
    pc.apply_results();
    assert_eq!(pc.ask(&k, RequestId(1)), Presence::Absent);
    assert!(pc.stats().probe_errors >= 1, "{:?}", pc.stats());
    assert!(
        !faulty.is_protected(&k),
        "the dropped probe's protection outlived it"
    );
    pc.finish_request(RequestId(1));
    assert_eq!(
        (
            pc.tracked_keys(),
            pc.tracked_requests(),
            pc.leased_keys(),
            pc.in_flight()
        ),
        (0, 0, 0, 0)
    );
}

/// A tier whose probe never answers keeps a key out of Hit/Miss no longer than the probe
/// deadline (`probe_timeout_s`: "no key waits in `Retry` longer than this").
#[test]
fn a_hanging_probe_settles_to_miss_within_the_probe_deadline() {
    let t = Script::new("hang", BS);
    t.hang_lookup.store(true, Ordering::SeqCst);
    let m = build_with(
        dram_cfg(8, BS, r#", "probe_timeout_s": 0.2"#),
        vec![t.clone()],
    );
    let req = RequestContext::new(1);
    let t0 = Instant::now();
    let v = settle_lookup(&m, &test_key(1), &req, Duration::from_secs(10)).0;
    assert_eq!(v, LookupResult::Miss);
    // 0.2 s is the bound; 5 s keeps a loaded machine's scheduling out of it and still tells a
    // deadline that works from none (a hang never settles)
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A promotion whose load never ends: the job's deadline fails it, the request is not left
/// in `HitPending`, the DRAM slot and the lease are given back.
#[test]
fn a_hanging_load_ends_at_the_job_deadline_and_frees_everything() {
    let t = Script::new("hang", BS);
    t.all_present.store(true, Ordering::SeqCst);
    t.hang_load.store(true, Ordering::SeqCst);
    let m = build_with(
        dram_cfg(
            4,
            BS,
            r#", "job_timeout_s": 0.2, "job_timeout_per_block_s": 0"#,
        ),
        vec![t.clone()],
    );
    let req = RequestContext::new(1);
    let k = test_key(3);
    let t0 = Instant::now();
    let v = settle_lookup(&m, &k, &req, Duration::from_secs(30)).0;
    assert_eq!(
        v,
        LookupResult::Miss,
        "a load that never ended produced a hit"
    );
    // ended by its deadline (0.2 s), not never: bounded with room for a loaded machine
    assert!(t0.elapsed() < Duration::from_secs(30));
    let s = m.stats();
    assert_eq!(s.tiers[0].jobs_timed_out, 1, "{:#?}", s.tiers[0]);
    assert_eq!(s.tiers[0].load_failure_causes.timed_out, 1);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    t.hang_load.store(false, Ordering::SeqCst);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A store cascade that never ends is abandoned at its deadline: write-back accounting and
/// DRAM pins come back, and the block stays readable in DRAM.
#[test]
fn a_hanging_store_is_abandoned_and_its_pins_return() {
    let t = Script::new("hang", BS);
    t.hang_store.store(true, Ordering::SeqCst);
    let m = build_with(
        dram_cfg(
            4,
            BS,
            r#", "job_timeout_s": 0.2, "job_timeout_per_block_s": 0"#,
        ),
        vec![t.clone()],
    );
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    assert!(m.stats().write_back_pinned_bytes > 0);
    m.on_request_finished(RequestId(1));
    let t0 = Instant::now();
    block_on_idle(&m);
    // ended by the job's deadline (0.2 s), not never: bounded with room for a loaded machine
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "wait_idle took {:?}",
        t0.elapsed()
    );
    let s = m.stats();
    assert_eq!(s.tiers[0].jobs_timed_out, 1);
    // 0.75 of a 4-block pool may be pinned by write-back: one block is dropped up front
    assert_eq!(
        s.tiers[0].store_failures + s.tiers[0].writes_dropped,
        4,
        "{:#?}",
        s.tiers[0]
    );
    assert!(load_and_verify(&m, &keys));
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A tier that reports loaded a key that was not in the load job, one the engine is still
/// writing: that key must not turn readable (a torn block) before the engine commits it.
#[test]
fn a_load_reporting_a_foreign_key_does_not_publish_an_unfinished_store() {
    let t = Script::new("liar", BS);
    let m = build_with(dram_cfg(8, BS, ""), vec![t.clone()]);
    let (a, b) = (test_key(1), test_key(2));
    put(&m, &t, &[a]);
    // the engine is writing b: half written so far
    let mut pending = m.prepare_store(&[b]).unwrap();
    pending.slots()[0].1.as_mut_slice()[..BS / 2].fill(0xAB);
    *t.extra_ok.lock().unwrap() = vec![b];
    let req = RequestContext::new(1);
    let v = settle_lookup(&m, &a, &req, Duration::from_secs(5)).0;
    assert_eq!(v, LookupResult::Hit);
    assert!(load_and_verify(&m, &[a]));
    let r2 = RequestContext::new(2);
    let vb = m.lookup(&b, &r2);
    assert_eq!(
        vb,
        LookupResult::HitPending,
        "a block still being written turned readable because a tier lied about a load"
    );
    assert!(
        m.prepare_load(&[b]).is_err(),
        "an unfinished block could be loaded"
    );
    for (k, s) in pending.slots() {
        fill_block(k, 0, s.as_mut_slice());
    }
    pending.commit(r2.id);
    assert_eq!(m.lookup(&b, &r2), LookupResult::Hit);
    assert!(load_and_verify(&m, &[b]));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    m.on_request_finished(r2.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A load reporting a key loaded that the manager never asked for, and absent from DRAM:
/// nothing appears in DRAM under that key.
#[test]
fn a_load_reporting_an_unknown_key_creates_nothing() {
    let t = Script::new("liar", BS);
    let m = build_with(dram_cfg(8, BS, ""), vec![t.clone()]);
    let (a, c) = (test_key(1), test_key(3));
    put(&m, &t, &[a]);
    *t.extra_ok.lock().unwrap() = vec![c];
    let req = RequestContext::new(1);
    assert_eq!(
        settle_lookup(&m, &a, &req, Duration::from_secs(5)).0,
        LookupResult::Hit
    );
    assert_eq!(m.primary().lookup(&c), LookupResult::Miss);
    let s = m.stats();
    assert_eq!(
        s.tiers[0].blocks_loaded, 1,
        "a key not in the job counted as loaded"
    );
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A load reporting every key both loaded and failed: no panic, nothing stuck, and whatever
/// is served has the right bytes.
#[test]
fn a_load_reporting_keys_both_ok_and_failed_leaves_a_consistent_state() {
    let t = Script::new("liar", BS);
    t.ok_and_failed.store(true, Ordering::SeqCst);
    let m = build_with(dram_cfg(8, BS, ""), vec![t.clone()]);
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    put(&m, &t, &keys);
    let req = RequestContext::new(1);
    for k in &keys {
        if settle_lookup(&m, k, &req, Duration::from_secs(5)).0 == LookupResult::Hit {
            assert!(load_and_verify(&m, &[*k]));
        }
    }
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A probe answering too few or too many answers counts as absent; nothing panics, and a
/// later request finds the block once the tier answers right.
#[test]
fn wrong_answer_counts_are_absent_not_panics() {
    for delta in [-1i64, 1, 1000] {
        let t = Script::new("liar", BS);
        let m = build_with(dram_cfg(8, BS, ""), vec![t.clone()]);
        let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
        put(&m, &t, &keys);
        t.answer_delta.store(delta, Ordering::SeqCst);
        let req = RequestContext::new(1);
        assert_eq!(
            settle_lookup(&m, &keys[0], &req, Duration::from_secs(5)).0,
            LookupResult::Miss,
            "delta {delta}"
        );
        m.on_schedule_end();
        m.on_request_finished(req.id);
        t.answer_delta.store(0, Ordering::SeqCst);
        let r2 = RequestContext::new(2);
        assert_eq!(
            settle_lookup(&m, &keys[0], &r2, Duration::from_secs(5)).0,
            LookupResult::Hit
        );
        assert!(load_and_verify(&m, &keys[..1]));
        m.on_schedule_end();
        m.on_request_finished(r2.id);
        assert_clean(&m);
        m.shutdown_blocking().unwrap();
    }
}

/// A tier that panics in every call (probe, load, protect): the scheduler thread never sees a
/// panic, lookups settle, stores still complete in DRAM.
#[test]
fn a_tier_that_panics_everywhere_costs_only_misses() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("boom", BS))));
    let m = build_with(dram_cfg(8, BS, ""), vec![f.clone()]);
    let k = test_key(1);
    let r = m.runtime().block_on(store_keys(&**f.inner(), &[k], 0, BS));
    assert!(r.is_success());
    f.panic_on_lookup(true);
    f.panic_on_load(true);
    f.panic_on_protect(true);
    let req = RequestContext::new(1);
    assert_eq!(
        settle_lookup(&m, &k, &req, Duration::from_secs(30)).0,
        LookupResult::Miss
    );
    engine_store(&m, RequestId(1), &[test_key(2)]);
    assert_eq!(m.lookup(&test_key(2), &req), LookupResult::Hit);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    f.heal();
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// Jobs abandoned at a tiny deadline while the fs tier's threads still work on them: a load
/// sink still being written by an abandoned task must never become another block's slot.
/// Every block served has its bytes.
#[test]
fn abandoned_fs_jobs_never_tear_a_served_block() {
    let dir = tempfile::tempdir().unwrap();
    let bs = 2 * 1024 * 1024;
    // a generous deadline to fill the tier first
    let keys: Vec<BlockKey> = (0..48).map(test_key).collect();
    {
        let m = kv_tier::builder(fs_manager_config(dir.path(), 16, bs, ""))
            .unwrap()
            .build_blocking()
            .unwrap();
        for (i, c) in keys.chunks(8).enumerate() {
            engine_store(&m, RequestId(i as u64), c);
            m.on_request_finished(RequestId(i as u64));
            block_on_idle(&m);
        }
        assert_eq!(m.stats().tiers[0].blocks_stored, 48);
        m.shutdown_blocking().unwrap();
    }
    let mut c = fs_manager_config(dir.path(), 6, bs, "");
    c.job_timeout_s = 0.01;
    c.job_timeout_per_block_s = 0.0;
    let m = kv_tier::builder(c).unwrap().build_blocking().unwrap();
    let deadline = Instant::now() + Duration::from_secs(8);
    let mut rid = 0u64;
    let mut served = 0usize;
    while Instant::now() < deadline {
        rid += 1;
        let req = RequestContext::new(rid);
        let start = (rid as usize * 5) % 40;
        let prefix = &keys[start..start + 8];
        for _ in 0..50 {
            let c = m.lookup_prefix(prefix, &req);
            if c.hit > 0 && load_and_verify(&m, &prefix[..c.hit]) {
                served += c.hit;
            }
            m.on_schedule_end();
            if !c.retry && c.hit == c.present {
                break;
            }
            // the engine's next step
            std::thread::sleep(Duration::from_millis(2));
            m.poll();
        }
        // and the engine stores new blocks into the same small pool meanwhile
        let nk: Vec<BlockKey> = (0..2).map(|i| test_key(100_000 + rid * 2 + i)).collect();
        if let Ok(mut p) = m.prepare_store(&nk) {
            for (k, s) in p.slots() {
                fill_block(k, 0, s.as_mut_slice());
            }
            p.commit(req.id);
        }
        m.on_request_finished(req.id);
    }
    let s = m.stats();
    println!(
        "served {served}, load timeouts {}, store timeouts {}",
        s.tiers[0].load_failure_causes.timed_out, s.tiers[0].store_failure_causes.timed_out
    );
    // let abandoned fs work drain (its I/O threads hold the sinks until their reads end; a
    // loaded machine can take a while), then everything is released
    let cap = m.stats().primary.capacity_blocks as u64;
    let fresh: Vec<BlockKey> = (0..cap).map(|i| test_key(8_000_000 + i)).collect();
    wait_until("DRAM slots released after the last job", LIMIT, || {
        block_on_idle(&m);
        match m.prepare_store(&fresh) {
            Ok(p) if p.keys().len() + p.present().len() == cap as usize => {
                p.abort();
                true
            }
            Ok(p) => {
                p.abort();
                false
            }
            Err(_) => false,
        }
    });
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
