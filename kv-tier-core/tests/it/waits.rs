//! `wait_idle`, `wait_jobs`, `is_idle` and `poll`: what they send and apply, several waiters at
//! once, and that they end under continuous traffic while still applying what was in flight at
//! their call.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use LookupResult::{Hit, HitPending, Retry};
use kv_tier_core::{BlockKey, LookupResult, RequestContext, RequestId, SecondaryTier};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{FaultyTier, MemoryTier, fill_block, store_keys, test_key};

use crate::support::*;

/// `is_idle` is false while anything is queued or in flight: a store job, a queued probe, a
/// probe in flight, a queued promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_means_nothing_queued_or_in_flight() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let faulty = Arc::new(FaultyTier::new(inner.clone()));
    let (m, _cpu) = manager_and_dram(8, faulty.clone()).await;
    assert!(m.is_idle());
    // a store job in flight, nothing else
    let stores = faulty.hold_stores();
    engine_store(&m, RequestId(1), &[test_key(1)]);
    m.on_schedule_end();
    assert!(!m.is_idle(), "idle with a store job in flight");
    stores.open();
    bounded("wait_idle", m.wait_idle()).await;
    assert!(m.is_idle());
    // a probe queued (not yet sent), then in flight
    let probes = faulty.hold_lookups();
    let req = RequestContext::new(2);
    let k = test_key(2);
    seed(&*inner, &[k]).await;
    assert_eq!(m.lookup(&k, &req), LookupResult::Retry);
    assert!(!m.is_idle(), "idle with a probe queued");
    m.on_schedule_end();
    assert!(!m.is_idle(), "idle with a probe in flight");
    probes.open();
    wait_until_async("the probe answered", SETTLE_LIMIT, || m.is_idle()).await;
    // a promotion queued (sent at schedule end)
    assert_eq!(m.lookup(&k, &req), LookupResult::HitPending);
    assert!(!m.is_idle(), "idle with a promotion queued");
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.lookup(&k, &req), LookupResult::Hit);
}

/// `poll` applies what completed without a step; `wait_jobs` returns with every job in
/// flight applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_and_wait_jobs_apply_completed_jobs() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let (m, _cpu) = manager_and_dram(8, inner.clone()).await;
    engine_store(&m, RequestId(1), &[test_key(1)]);
    m.on_schedule_end();
    bounded("wait_jobs", m.wait_jobs()).await;
    assert_eq!(m.stats().tiers[0].store_jobs, 1, "wait_jobs returned early");
    engine_store(&m, RequestId(1), &[test_key(2)]);
    m.on_schedule_end();
    wait_until_async("the tier holds the block", SETTLE_LIMIT, || {
        inner.contains(&test_key(2))
    })
    .await;
    wait_until_async("poll applies the job", SETTLE_LIMIT, || {
        m.poll();
        m.stats().tiers[0].store_jobs == 2
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_wait_idle_callers_all_return() {
    let inner = mem("fs");
    let t = Arc::new(FaultyTier::new(inner.clone()));
    let fx = manager(8, vec![t.clone()]).await;
    let gate = t.hold_stores();
    engine_store(&fx.m, RequestId(1), &[test_key(1)]);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_idle_ends_under_traffic_and_applies_what_was_in_flight() {
    let mut fx = RelayFx::new().await;
    fx.start_traffic();
    fx.traffic_flowing().await;
    for tag in 0..3 {
        let (stored, probed, r) = in_flight_before_the_wait(&fx, tag).await;
        let jobs_before = fx.m.stats().tiers[0].store_jobs;
        bounded("wait_idle", fx.m.wait_idle()).await;
        assert!(
            fx.inner.contains(&stored),
            "wait_idle returned before the store in flight at its call reached the tier"
        );
        assert!(fx.m.stats().tiers[0].store_jobs > jobs_before);
        // the probe's answer was applied by the wait: the key is known present (a promotion
        // is now queued), not asked again
        assert_ne!(fx.m.lookup(&probed, &r), LookupResult::Retry);
        fx.m.on_request_finished(r.id);
    }
    assert!(fx.stop_traffic() > 0);
    bounded("wait_idle after the traffic", fx.m.wait_idle()).await;
    assert!(fx.m.is_idle(), "nothing sends any more, yet work is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_jobs_ends_under_traffic_and_applies_the_stores_in_flight() {
    let mut fx = RelayFx::new().await;
    fx.start_traffic();
    fx.traffic_flowing().await;
    for tag in 10..13 {
        let (stored, _probed, r) = in_flight_before_the_wait(&fx, tag).await;
        let jobs_before = fx.m.stats().tiers[0].store_jobs;
        bounded("wait_jobs", fx.m.wait_jobs()).await;
        assert!(fx.inner.contains(&stored));
        assert!(fx.m.stats().tiers[0].store_jobs > jobs_before);
        fx.m.on_request_finished(r.id);
    }
    fx.stop_traffic();
    bounded("wait_idle after the traffic", fx.m.wait_idle()).await;
    assert!(fx.m.is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_cache_and_shutdown_end_under_traffic() {
    let mut fx = RelayFx::new().await;
    fx.start_traffic();
    fx.traffic_flowing().await;
    let (stored, _probed, r) = in_flight_before_the_wait(&fx, 20).await;
    bounded("reset_cache", fx.m.reset_cache()).await;
    assert!(fx.inner.contains(&stored));
    fx.m.on_request_finished(r.id);
    let (stored, _probed, _r) = in_flight_before_the_wait(&fx, 21).await;
    bounded("shutdown", fx.m.shutdown())
        .await
        .expect("shutdown failed");
    assert!(
        fx.inner.contains(&stored),
        "shutdown returned before the store in flight at its call reached the tier"
    );
    fx.stop_traffic();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs): `wait_jobs` "Waits until no store or load
/// job is in flight, sending nothing new (queued promotions and probes stay queued)";
/// `is_idle`: "Whether no job or probe is queued or in flight"; `wait_idle`: "Sends
/// everything queued and waits until every job and probe has completed and been applied."
#[test]
fn wait_jobs_sends_nothing_queued_and_wait_idle_sends_everything() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let (kp, kq) = (test_key(211), test_key(212));
    assert!(
        rt.block_on(store_keys(&*mem, &[kp, kq], 0, BS))
            .is_success()
    );
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let r = ctx(1);
    assert_eq!(m.lookup(&kp, &r), Retry);
    m.on_schedule_end();
    block_on_idle(&m);
    let loads = faulty.hold_loads();
    let lookups = faulty.hold_lookups();
    assert_eq!(m.lookup(&kp, &r), HitPending); // a promotion queued
    assert_eq!(m.lookup(&kq, &r), Retry); // a probe queued
    assert!(!m.is_idle(), "is_idle with a promotion and a probe queued");
    block_on_jobs(&m);
    // time for a wrongly sent promotion or probe to reach the tier's gates
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(loads.arrived(), 0, "wait_jobs sent a queued promotion");
    assert_eq!(lookups.arrived(), 0, "wait_jobs sent a queued probe");
    assert!(!m.is_idle());
    loads.open();
    lookups.open();
    block_on_idle(&m);
    assert!(m.is_idle());
    assert_eq!(
        (loads.arrived(), lookups.arrived()),
        (1, 1),
        "wait_idle did not send them"
    );
    for k in [kp, kq] {
        let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
        assert_eq!(end, Hit, "{seen:?}");
    }
    load_verify(&m, &[kp, kq]);
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_nothing_left(&m, &[kp, kq]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `wait_idle`: "Work that other callers send
/// meanwhile is not waited for (it may still be in flight when this returns), so the wait
/// ends however much traffic they bring"; `wait_until`: "Each job and probe has a
/// deadline, so this returns within the longest of them"). With another thread adding
/// stores and probes without pause, `wait_idle`, `wait_jobs`, `reset_cache` and `shutdown`
/// each return (bounded), and afterwards nothing is left.
#[test]
fn waits_return_under_continuous_traffic() {
    let (_mem, faulty) = faulty_mem();
    faulty.delay(Some(Duration::from_millis(3)));
    let m = Arc::new(build_with(
        mcfg(64, r#", "probe_timeout_s": 5"#),
        vec![faulty.clone()],
    ));
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (m, stop) = (m.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let r = ctx(500_000 + i);
                let _ = m.lookup_many(&[test_key(600_000 + 2 * i), test_key(600_001 + 2 * i)], &r);
                if let Ok(mut p) = m.prepare_store(&[test_key(700_000 + i)]) {
                    for (k, s) in p.slots() {
                        fill_block(k, 0, s.as_mut_slice());
                    }
                    p.commit(r.id);
                }
                m.on_schedule_end();
                m.on_request_finished(r.id);
                i += 1;
                std::thread::sleep(Duration::from_micros(300)); // the traffic's pace
            }
            i
        })
    };
    wait_until("the traffic's first store job", SETTLE_LIMIT, || {
        m.stats().tiers[0].store_jobs > 0
    });
    let t = |what: &str, f: &dyn Fn() -> bool| {
        assert!(f(), "{what} did not return within 30 s under traffic")
    };
    t("wait_idle", &|| {
        block_on(&m, async {
            tokio::time::timeout(SETTLE_LIMIT, m.wait_idle()).await
        })
        .is_ok()
    });
    t("wait_jobs", &|| {
        block_on(&m, async {
            tokio::time::timeout(SETTLE_LIMIT, m.wait_jobs()).await
        })
        .is_ok()
    });
    t("reset_cache", &|| {
        block_on(&m, async {
            tokio::time::timeout(SETTLE_LIMIT, m.reset_cache()).await
        })
        .is_ok()
    });
    t("shutdown", &|| {
        block_on(&m, async {
            tokio::time::timeout(SETTLE_LIMIT, m.shutdown()).await
        })
        .map(|r| r.expect("shutdown failed"))
        .is_ok()
    });
    stop.store(true, Ordering::SeqCst);
    let n = traffic.join().unwrap();
    assert!(n > 10, "no traffic ran ({n} iterations)");
    assert_nothing_left(&m, &[]);
}

/// `wait_idle`: "Sends everything queued, waits until every job and probe in flight at that
/// moment has completed, and applies what has completed ... Work that other callers send
/// meanwhile is not waited for ... so the wait ends however much traffic they bring."
/// `wait_jobs`: "Waits until every store and load job in flight when it is called has
/// reported ... Jobs other callers send meanwhile are not waited for."
///
/// Under three traffic threads and two slow tiers (5 and 20 ms a job or probe, one round at
/// 150 ms): each wait ends; a store committed before the call is in both tiers when it
/// returns; a probe sent before the call (or queued and sent by `wait_idle` itself) has its
/// answer applied, so the key is no longer `Retry`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_end_under_traffic_with_slow_tiers_and_apply_what_was_in_flight() {
    let mut fx = mx([5, 20]).await;
    fx.start_traffic(1);
    fx.flowing().await;
    for round in 0..8u64 {
        if round == 4 {
            fx.faults[1].delay(Some(Duration::from_millis(150)));
        }
        if round == 6 {
            fx.faults[1].delay(Some(Duration::from_millis(20)));
        }
        let k = test_key(90_000_000 + round);
        fx.store(90_000 + round, k).await;
        // a key only the second tier has: its first lookup queues a probe
        let p = test_key(80_000_000 + round);
        assert!(store_keys(&*fx.mems[1], &[p], 0, BS).await.is_success());
        let r = RequestContext::new(80_000 + round);
        let first = fx.m.lookup(&p, &r);
        if round % 2 == 0 {
            fx.m.on_schedule_end(); // the probe is sent before the wait
        }
        if round % 3 == 2 {
            bounded("wait_jobs under traffic", fx.m.wait_jobs()).await;
            for (i, mem) in fx.mems.iter().enumerate() {
                assert!(
                    mem.contains(&k),
                    "round {round}: wait_jobs returned before the store committed before its \
                     call reached tier {i}"
                );
            }
            // the probe may still be queued: wait_jobs sends nothing new
            bounded("wait_idle under traffic", fx.m.wait_idle()).await;
        } else {
            bounded("wait_idle under traffic", fx.m.wait_idle()).await;
            for (i, mem) in fx.mems.iter().enumerate() {
                assert!(
                    mem.contains(&k),
                    "round {round}: wait_idle returned before the store committed before its \
                     call reached tier {i}"
                );
            }
        }
        let after = fx.m.lookup(&p, &r);
        assert_ne!(
            after,
            LookupResult::Retry,
            "round {round}: the probe of {p} (first lookup {first:?}, sent before the wait or \
             by it) was not applied when wait_idle returned"
        );
        fx.m.on_schedule_end();
        fx.m.on_request_finished(r.id);
    }
    fx.stop_traffic();
    bounded("wait_idle after the traffic", fx.m.wait_idle()).await;
    assert!(fx.m.is_idle(), "nothing sends any more, yet work is left");
}

/// Several waiters at once ("Any number of callers may wait at once"), and waits dropped at
/// arbitrary poll points, under traffic: every complete wait ends; once the traffic stops,
/// `wait_idle` ends with the manager idle, no write-back bytes or DRAM pinned by write-back,
/// no slot left `Writing`, `reset_cache` finds no block pinned, no write dropped, and every
/// store the traffic committed reached both tiers ("the wait ends however much traffic they
/// bring"; `WriteBackPolicy::Wait`: "Nothing is dropped").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_and_dropped_waits_under_traffic_leave_nothing_behind() {
    let mut fx = mx([3, 10]).await;
    fx.start_traffic(2);
    fx.flowing().await;
    let base = random_seed();
    let complete = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..4u64 {
        let m = fx.m.clone();
        let complete = complete.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = Rng::new(base ^ (w + 1));
            for _ in 0..12 {
                match rng.below(6) {
                    0 => bounded("a concurrent wait_idle", m.wait_idle()).await,
                    1 => bounded("a concurrent wait_jobs", m.wait_jobs()).await,
                    2 => {
                        poll_n(m.wait_idle(), 1 + rng.below(6) as usize).await;
                    }
                    3 => {
                        poll_n(m.wait_jobs(), 1 + rng.below(6) as usize).await;
                    }
                    4 => {
                        let us = rng.below(30_000);
                        let _ =
                            tokio::time::timeout(Duration::from_micros(us), m.wait_idle()).await;
                    }
                    _ => {
                        poll_n(m.reset_cache(), 1 + rng.below(4) as usize).await;
                    }
                }
                complete.fetch_add(1, Ordering::Relaxed);
                // the waiter's pace (random)
                tokio::time::sleep(Duration::from_millis(rng.below(20))).await;
            }
        }));
    }
    for t in tasks {
        bounded("a waiter task", t)
            .await
            .expect("a waiter panicked");
    }
    assert_eq!(complete.load(Ordering::Relaxed), 48);
    fx.stop_traffic();
    bounded("wait_idle after the traffic", fx.m.wait_idle()).await;
    assert!(fx.m.is_idle(), "dropped waits left work behind");
    let s = fx.m.stats();
    for t in &s.tiers {
        assert_eq!(t.write_back_bytes, 0, "{}: write-back bytes left", t.name);
        assert_eq!(
            t.writes_dropped, 0,
            "{}: writes dropped under `wait`",
            t.name
        );
    }
    assert_eq!(
        s.write_back_pinned_bytes, 0,
        "DRAM still pinned by write-back"
    );
    assert_eq!(s.primary.writing_blocks, 0, "slots left Writing");
    let pinned = bounded("reset_cache", fx.m.reset_cache()).await;
    assert_eq!(pinned, 0, "blocks still pinned after everything ended");
    let committed = fx.committed.lock().unwrap().clone();
    assert!(!committed.is_empty());
    for (i, mem) in fx.mems.iter().enumerate() {
        let missing: Vec<&BlockKey> = committed
            .iter()
            .map(|(k, _)| k)
            .filter(|k| !mem.contains(k))
            .collect();
        assert!(
            missing.is_empty(),
            "tier {i}: {} of {} committed stores never landed (first {:?})",
            missing.len(),
            committed.len(),
            missing.first()
        );
        for (k, _) in &committed {
            assert!(
                !fx.faults[i].is_protected(k),
                "tier {i}: {k} still protected after its job ended"
            );
        }
    }
}
