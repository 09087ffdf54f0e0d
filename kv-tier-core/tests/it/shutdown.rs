//! `shutdown`, `shutdown_blocking` and dropping a manager without either: every tier is shut down
//! within its deadline, stores in flight land, afterwards the manager serves DRAM only; a dropped
//! manager leaves no torn block, thread or task.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use LookupResult::{Hit, Miss, Retry};
use kv_tier::Error;
use kv_tier::fs::FsTier;
use kv_tier::obj::ObjTier;
use kv_tier_core::{
    BlockKey, KvTierConfig, LookupResult, RequestContext, RequestId, SecondaryTier, TieringManager,
};
use kv_tier_testkit::s3::S3Server;
use kv_tier_testkit::{
    FaultyTier, MemoryTier, fill_block, load_keys, store_keys, temp_root, test_key, verify_block,
};

use crate::support::*;

#[test]
fn shutdown_blocking_shuts_a_sync_embedders_manager_down() {
    let cfg = KvTierConfig::new((8 * BS) as u64, BS as u64);
    let inner = mem("fs");
    let m = TieringManager::builder(cfg)
        .primary(lru_dram(8, BS))
        .tier(inner.clone())
        .build_blocking()
        .unwrap();
    let k = test_key(1);
    engine_store(&m, RequestId(1), &[k]);
    m.shutdown_blocking().unwrap();
    assert!(inner.contains(&k), "shutdown waits for the cascade");
    // afterwards: DRAM only
    assert_eq!(
        m.lookup(&test_key(2), &RequestContext::new(2)),
        LookupResult::Miss
    );
    engine_store(&m, RequestId(1), &[test_key(3)]);
    assert!(m.is_idle());
    // inside a runtime it is refused, naming why
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let err = rt.block_on(async { m.shutdown_blocking().unwrap_err() });
    assert!(err.to_string().contains("runtime"), "{err}");
}

/// A tier whose `shutdown()` hangs, and one whose `shutdown()` panics: the manager's shutdown
/// ends within `shutdown_timeout_s`, reports the first failure, and shuts every tier down.
#[tokio::test(start_paused = true)]
async fn shutdown_ends_and_reaches_every_tier_when_one_hangs_or_panics() {
    let (a, b, c) = (mem("fs"), mem("fs"), mem("fs"));
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
        let t = Arc::new(FaultyTier::new(mem("fs")));
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

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `shutdown`: "Cancels queued promotions,
/// waits for jobs in flight, and shuts every tier down. Afterwards the manager serves DRAM
/// only: lookups past DRAM answer `Miss` and stores cascade nowhere"). `shutdown` called from
/// two tasks at once, with a store in flight and a slow tier shutdown: both return, neither
/// fails, and afterwards the manager serves DRAM only.
#[test]
fn shutdown_from_two_tasks_at_once() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let m = Arc::new(
        kv_tier::builder(mcfg(4, r#", "probe_timeout_s": 30"#))
            .unwrap()
            .runtime(rt.handle().clone())
            .tier(faulty.clone())
            .build_blocking()
            .unwrap(),
    );
    let k = test_key(171);
    let kt = test_key(172);
    assert!(rt.block_on(store_keys(&*mem, &[kt], 0, BS)).is_success());
    let stores = faulty.hold_stores();
    faulty.delay_shutdown(Some(Duration::from_millis(100)));
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    m.on_schedule_end();
    rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, stores.wait_arrived(1)).await })
        .unwrap();
    let a = rt.spawn({
        let m = m.clone();
        async move { m.shutdown().await }
    });
    let b = rt.spawn({
        let m = m.clone();
        async move { m.shutdown().await }
    });
    // time for both shutdowns to start waiting on the store in flight
    std::thread::sleep(Duration::from_millis(20));
    stores.open();
    let (ra, rb) = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(60), async {
            (a.await.unwrap(), b.await.unwrap())
        })
        .await
        .expect("a concurrent shutdown hung")
    });
    assert!(ra.is_ok() && rb.is_ok(), "{ra:?} {rb:?}");
    assert!(
        mem.contains(&k),
        "shutdown did not wait for the store in flight"
    );
    assert_eq!(
        m.lookup(&kt, &ctx(2)),
        Miss,
        "a lookup past DRAM after shutdown"
    );
    assert_eq!(m.lookup(&k, &ctx(2)), Hit, "DRAM still serves");
    m.on_schedule_end();
    m.on_request_finished(RequestId(2));
    let s = m.stats();
    assert_eq!(s.tiers[0].write_back_bytes, 0);
    assert_eq!((s.held_blocks, s.write_back_pinned_bytes), (0, 0));
}

/// Promise (kv-tier crate docs §5, "Dropping the manager"): "Dropping the manager without it
/// is safe but abrupt: ... if the manager owns its runtime (`build_blocking`), that runtime
/// is shut down in the background, and those jobs stop at their next await. No tier is left
/// with a torn block either way: the fs tier publishes a block only whole (a temp file
/// renamed into place, reaped at the next open if left behind) and stops its threads when the
/// last handle to it goes." A manager over fs dropped with 32 stores of 1 MiB just sent:
/// the fs threads end; reopened, every block is whole or absent and no temp file is left.
#[test]
fn dropping_the_manager_with_fs_stores_in_flight() {
    if !in_own_process("shutdown::dropping_the_manager_with_fs_stores_in_flight") {
        return;
    }
    let root = temp_root();
    let bs = 1 << 20;
    let cfg = || {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}, {LAYOUT},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "checksum": "crc32c",
                   "n_read_threads": 2, "n_write_threads": 2, "tmp_reap_age_s": 0}}]}}"#,
            40 * bs,
            root.path()
        ))
        .unwrap()
    };
    let base = fs_threads();
    let keys: Vec<BlockKey> = (0..32).map(|i| test_key(180 + i)).collect();
    for round in 0..3 {
        let m = kv_tier::builder(cfg()).unwrap().build_blocking().unwrap();
        let ks: Vec<BlockKey> = keys.iter().map(|k| test_key_round(k, round)).collect();
        let mut p = m.prepare_store(&ks).unwrap();
        for (k, s) in p.slots() {
            fill_block(k, 0, s.as_mut_slice());
        }
        p.commit(RequestId(1));
        m.on_schedule_end();
        if round > 0 {
            // dropped a little later each round, with the stores further along
            std::thread::sleep(Duration::from_millis(3 * round as u64));
        }
        drop(m);
        assert!(
            poll_until(SETTLE_LIMIT, || fs_threads() <= base),
            "fs threads left after the manager was dropped: {} (base {base})",
            fs_threads()
        );
        let m = kv_tier::builder(cfg()).unwrap().build_blocking().unwrap();
        assert!(
            tmp_files_below(root.path()).is_empty(),
            "temp files survived a reopen: {:?}",
            tmp_files_below(root.path())
        );
        let fs = m.tier::<FsTier>("fs").unwrap();
        let (res, bytes) = m.runtime().block_on(load_keys(&*fs, &ks, bs));
        for (k, b) in &bytes {
            assert!(verify_block(k, 0, b), "{k} torn");
        }
        for (k, e) in &res.failed {
            assert!(matches!(e, Error::NotFound { .. }), "{k}: {e}");
        }
        drop(fs);
        m.shutdown_blocking().unwrap();
        drop(m);
        assert!(poll_until(SETTLE_LIMIT, || fs_threads() <= base));
    }
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `shutdown`: "waits for jobs in flight, and
/// shuts every tier down"; config `shutdown_timeout_s`: "A tier's shutdown waits for work its
/// abandoned jobs left running ..., so it has a deadline of its own: a short job deadline
/// does not make shutdowns fail"). Cascades of 1 MiB blocks to fs abandoned at a 10 ms job
/// deadline: `shutdown` succeeds, and when it returns no DRAM is pinned by them: the whole
/// pool takes a store at once.
#[test]
fn manager_shutdown_after_abandoned_fs_jobs_frees_dram() {
    let root = temp_root();
    let bs = 1 << 20;
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}, {LAYOUT}, "job_timeout_s": 0.01,
            "job_timeout_per_block_s": 0, "write_back_max_dram_fraction": 1,
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "n_read_threads": 1, "n_write_threads": 1,
                                  "fsync": true}}]}}"#,
        24 * bs,
        root.path()
    ))
    .unwrap();
    let m = kv_tier::builder(cfg).unwrap().build_blocking().unwrap();
    let keys: Vec<BlockKey> = (0..24).map(|i| test_key(290 + i)).collect();
    for c in keys.chunks(4) {
        engine_store(&m, RequestId(1), c);
    }
    m.on_request_finished(RequestId(1));
    m.on_schedule_end();
    m.shutdown_blocking().expect("shutdown failed");
    let s = m.stats();
    assert_eq!(s.write_back_pinned_bytes, 0);
    let fresh: Vec<BlockKey> = (0..24).map(|i| test_key(3_900 + i)).collect();
    let p = m.prepare_store(&fresh);
    assert!(
        p.is_ok(),
        "DRAM still pinned after shutdown returned: {:?} (timed out jobs: {})",
        p.err(),
        s.tiers[0].jobs_timed_out
    );
    p.unwrap().abort();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `shutdown`: "Afterwards the manager
/// serves DRAM only: lookups past DRAM answer `Miss`"; probe_cache docs: leases end "when
/// every request that asked for it finished"). A probe held across `shutdown` answers
/// "present" afterwards: the key is still `Miss`, and once the request finishes nothing is
/// leased, tracked or protected.
#[test]
fn a_probe_answer_arriving_after_shutdown_leaves_nothing() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let k = test_key(301);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let m = Arc::new(
        kv_tier::builder(mcfg(4, r#", "probe_timeout_s": 60"#))
            .unwrap()
            .runtime(rt.handle().clone())
            .tier(faulty.clone())
            .build_blocking()
            .unwrap(),
    );
    let gate = faulty.hold_lookups();
    let r = ctx(1);
    assert_eq!(m.lookup(&k, &r), Retry);
    m.on_schedule_end();
    rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await })
        .unwrap();
    let sd = rt.spawn({
        let m = m.clone();
        async move { m.shutdown().await }
    });
    // time for the shutdown to start while the probe is held
    std::thread::sleep(Duration::from_millis(50));
    gate.open();
    rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, sd).await })
        .expect("shutdown hung")
        .unwrap()
        .expect("shutdown failed");
    assert!(poll_until(SETTLE_LIMIT, || {
        m.poll();
        m.is_idle()
    }));
    assert_eq!(m.lookup(&k, &r), Miss, "a lookup past DRAM after shutdown");
    m.on_schedule_end();
    m.on_request_finished(r.id);
    m.poll();
    let s = m.stats();
    assert_eq!(
        (
            s.tiers[0].tracked_keys,
            s.tiers[0].tracked_requests,
            s.tiers[0].leased_keys
        ),
        (0, 0, 0),
        "{:?}",
        s.tiers[0]
    );
    assert!(
        poll_until(SETTLE_LIMIT, || !faulty.is_protected(&k)),
        "protected after shutdown"
    );
}

/// Promise (kv-tier crate docs §5: "Dropping the manager without it is safe but abrupt: jobs
/// still running go on, on the runtime they run on, until they end (each has a deadline)
/// ... the fs tier ... stops its threads when the last handle to it goes"). A manager built
/// on an engine's runtime, dropped with fs cascades in flight: the cascades end, the fs
/// threads then stop, and every block is whole or absent.
#[test]
fn dropping_a_manager_on_an_external_runtime_with_jobs_in_flight() {
    if !in_own_process("shutdown::dropping_a_manager_on_an_external_runtime_with_jobs_in_flight") {
        return;
    }
    let rt = runtime();
    let root = temp_root();
    let bs = 1 << 20;
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}, {LAYOUT},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "checksum": "crc32c",
               "n_read_threads": 2, "n_write_threads": 2, "tmp_reap_age_s": 0}}]}}"#,
        40 * bs,
        root.path()
    ))
    .unwrap();
    let base = fs_threads();
    let keys: Vec<BlockKey> = (0..32).map(|i| test_key(310 + i)).collect();
    let m = rt
        .block_on(kv_tier::builder(cfg.clone()).unwrap().build())
        .unwrap();
    let mut p = m.prepare_store(&keys).unwrap();
    for (k, s) in p.slots() {
        fill_block(k, 0, s.as_mut_slice());
    }
    p.commit(RequestId(1));
    m.on_schedule_end();
    drop(m);
    assert!(
        poll_until(SETTLE_LIMIT, || fs_threads() <= base),
        "fs threads left after the manager was dropped: {} (base {base})",
        fs_threads()
    );
    let m = rt.block_on(kv_tier::builder(cfg).unwrap().build()).unwrap();
    assert!(
        tmp_files_below(root.path()).is_empty(),
        "{:?}",
        tmp_files_below(root.path())
    );
    let fs = m.tier::<FsTier>("fs").unwrap();
    let (res, bytes) = rt.block_on(load_keys(&*fs, &keys, bs));
    for (k, b) in &bytes {
        assert!(verify_block(k, 0, b), "{k} torn");
    }
    for (k, e) in &res.failed {
        assert!(matches!(e, Error::NotFound { .. }), "{k}: {e}");
    }
    drop(fs);
    rt.block_on(m.shutdown()).unwrap();
}

/// Promise (kv-tier crate docs §5 and `TieringManager` docs: "Dropping the manager without it
/// is safe but abrupt: jobs still running go on ... until they end (each has a deadline) ...
/// a tier's own threads stop when its last handle goes"; obj README "Shared bucket": the
/// coordination runs in tasks "started at open and awaited by `shutdown`"). A manager over a
/// shared obj bucket dropped without `shutdown`: its coordination stops (the server goes
/// quiet, no task is left on the engine's runtime), so it does not hold the bucket's leader
/// lease forever; a new manager on the bucket then leads.
#[test]
fn dropping_a_manager_over_a_shared_obj_bucket_stops_its_coordination() {
    if !in_own_process(
        "shutdown::dropping_a_manager_over_a_shared_obj_bucket_stops_its_coordination",
    ) {
        return;
    }
    let s3_rt = runtime();
    let s3 = s3_rt.block_on(S3Server::start());
    let rt = runtime();
    // the runtime's own machinery starts before its tasks are counted
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
    let base_tasks = rt.metrics().num_alive_tasks();
    let cfg = || {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
                "secondary_tiers": [{}]}}"#,
            shared_obj_entry(&s3.endpoint)
        ))
        .unwrap()
    };
    let m = rt
        .block_on(kv_tier::builder(cfg()).unwrap().build())
        .unwrap();
    let obj = m.tier::<ObjTier>("obj").unwrap();
    assert!(
        poll_until(SETTLE_LIMIT, || obj
            .stats()
            .shared
            .map(|s| s.leader)
            .unwrap_or(false)),
        "the only instance never led"
    );
    let k = test_key(321);
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    rt.block_on(m.wait_idle());
    drop(obj);
    drop(m);
    let ok = poll_until(SETTLE_LIMIT, || {
        rt.metrics().num_alive_tasks() <= base_tasks
    });
    assert!(
        ok,
        "tasks left on the runtime after the manager was dropped: {} (base {base_tasks})",
        rt.metrics().num_alive_tasks()
    );
    assert!(
        poll_until(SETTLE_LIMIT, || server_quiet(
            &s3,
            Duration::from_millis(1_500)
        )),
        "the dropped manager's tier still talks to the bucket"
    );
    rt.block_on(async {
        tokio::time::timeout(SETTLE_LIMIT, async {
            let m = kv_tier::builder(cfg()).unwrap().build().await.unwrap();
            let obj = m.tier::<ObjTier>("obj").unwrap();
            m.shutdown().await.unwrap();
            drop(obj);
        })
        .await
    })
    .unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `shutdown`: "From its start the manager
/// serves DRAM only: lookups past DRAM answer `Miss` and stores cascade nowhere, so the wait
/// ends however much traffic other threads bring meanwhile"). Every store job takes 50 ms and
/// another thread commits a store every 10 ms: jobs are always in flight. Shutdown returns
/// (bounded), and no store committed after it began reaches the tier. (Found by CI: shutdown
/// waited for idleness before it stopped sending, and under traffic that never came: "did not
/// return within 30 s".)
#[test]
fn shutdown_ends_while_other_threads_keep_committing_stores() {
    let (_mem, faulty) = faulty_mem();
    faulty.delay(Some(Duration::from_millis(50)));
    let m = Arc::new(build_with(mcfg(256, ""), vec![faulty.clone()]));
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let (m, stop) = (m.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let r = ctx(800_000 + i);
                if let Ok(mut p) = m.prepare_store(&[test_key(900_000 + i)]) {
                    for (k, s) in p.slots() {
                        fill_block(k, 0, s.as_mut_slice());
                    }
                    p.commit(r.id);
                }
                m.on_schedule_end();
                m.on_request_finished(r.id);
                i += 1;
                // the traffic's pace: a store every 10 ms
                std::thread::sleep(Duration::from_millis(10));
            }
            i
        })
    };
    // jobs in flight at every moment from here
    wait_until("the traffic's first store job", SETTLE_LIMIT, || {
        m.stats().tiers[0].store_jobs > 0
    });
    let jobs = |m: &TieringManager| m.stats().tiers[0].store_jobs;
    let seen_before = jobs(&m);
    let done = block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, m.shutdown()).await
    });
    let seen_at_end = jobs(&m);
    // the traffic goes on after shutdown: time for a wrong cascade to land
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::SeqCst);
    let n = traffic.join().unwrap();
    assert!(
        done.is_ok(),
        "shutdown did not return within {SETTLE_LIMIT:?} while {n} stores were committed"
    );
    done.unwrap().unwrap();
    assert!(seen_before > 0, "no store reached the tier before shutdown");
    assert_eq!(
        jobs(&m),
        seen_at_end,
        "a store committed after shutdown was sent to the tier"
    );
}

/// `shutdown` with a tier whose `shutdown` never returns still ends (the tier shutdown has a
/// deadline, `shutdown_timeout_s`).
#[test]
fn shutdown_with_a_hanging_tier_shutdown_ends() {
    let t = Script::new("hang", BS);
    t.hang_shutdown.store(true, Ordering::SeqCst);
    let m = build_with(
        dram_cfg(4, BS, r#", "shutdown_timeout_s": 0.3"#),
        vec![t.clone()],
    );
    let t0 = Instant::now();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        s.spawn(|| {
            let r = m.shutdown_blocking();
            let _ = tx.send(r.is_ok());
        });
        let got = rx.recv_timeout(Duration::from_secs(10));
        assert!(got.is_ok(), "shutdown hung on a tier's shutdown");
    });
    assert!(t0.elapsed() < Duration::from_secs(5));
}

/// `shutdown` waits for a store in flight: the acknowledged block lands in the tier.
#[test]
fn shutdown_waits_for_stores_in_flight() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build_with(dram_cfg(8, BS, ""), vec![f.clone()]);
    let gate = f.hold_stores();
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    m.on_request_finished(RequestId(1));
    let g = gate.clone();
    let opener = std::thread::spawn(move || {
        // opened while shutdown waits: it must wait for the store
        std::thread::sleep(Duration::from_millis(300));
        g.open();
    });
    m.shutdown_blocking().unwrap();
    opener.join().unwrap();
    let mem = f.inner().clone();
    let present = m.runtime().block_on(mem.lookup(&keys)).unwrap();
    assert!(
        present.iter().all(|p| *p),
        "shutdown lost acknowledged stores: {present:?}"
    );
    // after shutdown: DRAM only
    let req = RequestContext::new(2);
    assert_eq!(m.lookup(&keys[0], &req), LookupResult::Hit);
    assert_eq!(m.lookup(&test_key(99), &req), LookupResult::Miss);
    engine_store(&m, RequestId(2), &[test_key(100)]);
    assert_eq!(m.lookup(&test_key(100), &req), LookupResult::Hit);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    // a second shutdown does not hang or panic
    let _ = m.shutdown_blocking();
}

/// Shutdown from one thread while others look up and store: no hang, no panic; afterwards
/// DRAM-only service.
#[test]
fn shutdown_concurrent_with_traffic() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(16, BS, ""), vec![t.clone()]);
    let shared: Vec<BlockKey> = (0..30).map(test_key).collect();
    put(&m, &t, &shared);
    let done = AtomicBool::new(false);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|s| {
        for th in 0..3u64 {
            let (m, shared, done) = (&m, &shared, &done);
            s.spawn(move || {
                let mut rid = 100 * (th + 1);
                while !done.load(Ordering::Relaxed) {
                    rid += 1;
                    let req = RequestContext::new(rid);
                    let c = m.lookup_prefix(&shared[..8 + (rid % 10) as usize], &req);
                    if c.hit > 0 {
                        load_and_verify(m, &shared[..c.hit]);
                    }
                    let nk = [test_key(50_000 + rid)];
                    if let Ok(mut p) = m.prepare_store(&nk) {
                        for (k, s) in p.slots() {
                            fill_block(k, 0, s.as_mut_slice());
                        }
                        p.commit(req.id);
                    }
                    m.on_schedule_end();
                    m.on_request_finished(req.id);
                }
            });
        }
        let (m, done) = (&m, &done);
        s.spawn(move || {
            // traffic runs a while before the shutdown
            std::thread::sleep(Duration::from_millis(300));
            let r = m.shutdown_blocking();
            let _ = tx.send(r.is_ok());
            // the traffic goes on after shutdown a while
            std::thread::sleep(Duration::from_millis(200));
            done.store(true, Ordering::Relaxed);
        });
        let r = rx.recv_timeout(Duration::from_secs(10));
        if r.is_err() {
            done.store(true, Ordering::Relaxed);
        }
        assert_eq!(r, Ok(true), "shutdown hung or failed under traffic");
    });
    let req = RequestContext::new(1);
    assert_eq!(m.lookup(&test_key(777_777), &req), LookupResult::Miss);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    block_on_idle(&m);
    let s = m.stats();
    assert_eq!(s.held_blocks, 0);
    assert_eq!(s.primary.writing_blocks, 0);
    assert_eq!(s.write_back_pinned_bytes, 0);
}

/// Dropping a manager built on an async engine's current-thread runtime, with fs jobs in
/// flight and no shutdown: "safe but abrupt", no hang, no panic.
#[test]
fn dropping_a_manager_inside_a_current_thread_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let c = fs_manager_config(dir.path(), 16, 65536, "");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let m = kv_tier::builder(c).unwrap().build().await.unwrap();
            for i in 0..4u64 {
                let keys: Vec<BlockKey> = (i * 4..i * 4 + 4).map(test_key).collect();
                engine_store(&m, RequestId(i), &keys);
            }
            tokio::task::yield_now().await;
            drop(m);
        });
        drop(rt);
        let _ = tx.send(());
    });
    assert!(
        rx.recv_timeout(Duration::from_secs(15)).is_ok(),
        "dropping the manager hung or panicked"
    );
}

/// `shutdown`: "Cancels queued promotions, waits for jobs in flight, and shuts every tier
/// down. From its start the manager serves DRAM only: lookups past DRAM answer `Miss` and
/// stores cascade nowhere, so the wait ends however much traffic other threads bring
/// meanwhile."
///
/// Under traffic with slow tiers whose own shutdown takes 300 ms: `shutdown` ends; a store
/// committed before the call is in both tiers; no store whose `prepare_store` began after a
/// tier's shutdown was called ever reaches a tier; lookups past DRAM answer `Miss`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_under_traffic_ends_and_nothing_committed_after_it_began_lands() {
    let mut fx = mx([5, 40]).await;
    for f in &fx.faults {
        f.delay_shutdown(Some(Duration::from_millis(300)));
    }
    fx.start_traffic(3);
    fx.flowing().await;
    let k = test_key(91_000_000);
    fx.store(91_000, k).await;
    bounded("shutdown under traffic", fx.m.shutdown())
        .await
        .expect("shutdown failed");
    for (i, mem) in fx.mems.iter().enumerate() {
        assert!(
            mem.contains(&k),
            "shutdown returned before the store committed before its call reached tier {i}"
        );
        assert!(fx.faults[i].shutdowns() >= 1, "tier {i} was not shut down");
    }
    // the traffic goes on after shutdown
    tokio::time::sleep(Duration::from_millis(300)).await;
    let r = RequestContext::new(91_001);
    let p = fx.seeded[0];
    for _ in 0..3 {
        let v = fx.m.lookup(&p, &r);
        assert!(
            matches!(v, LookupResult::Miss | LookupResult::Hit),
            "after shutdown a lookup past DRAM answered {v:?}"
        );
        fx.m.on_schedule_end();
    }
    fx.stop_traffic();
    // time for a store committed after shutdown began to (wrongly) land
    tokio::time::sleep(Duration::from_millis(200)).await;
    let committed = fx.committed.lock().unwrap().clone();
    let after: Vec<BlockKey> = committed.iter().filter(|c| c.1).map(|c| c.0).collect();
    assert!(
        !after.is_empty(),
        "the traffic committed nothing after the tiers' shutdown (test did not exercise it)"
    );
    for (i, mem) in fx.mems.iter().enumerate() {
        let landed: Vec<&BlockKey> = after.iter().filter(|k| mem.contains(k)).collect();
        assert!(
            landed.is_empty(),
            "tier {i}: {} of {} stores committed after the tier's shutdown was called \
             reached it (first {:?})",
            landed.len(),
            after.len(),
            landed.first()
        );
    }
}

/// Dropped without `shutdown` while its cascades run: a manager over the same root later
/// finds only whole blocks, each with the bytes stored.
#[test]
fn dropping_a_manager_without_shutdown_leaves_no_torn_block() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<BlockKey> = (0..48).map(test_key).collect();
    {
        let m = kv_tier::builder(disk_tier_config(dir.path(), 64, BS_64K))
            .unwrap()
            .build_blocking()
            .unwrap();
        for chunk in keys.chunks(8) {
            engine_store(&m, RequestId(1), chunk);
        }
        // no shutdown, no wait: the cascade jobs are in flight
    }
    let m = kv_tier::builder(disk_tier_config(dir.path(), 64, BS_64K))
        .unwrap()
        .build_blocking()
        .unwrap();
    let fs = m.tier::<kv_tier::fs::FsTier>("disk").unwrap();
    let req = RequestContext::new(2);
    let (mut found, mut missed, mut steps) = (0, 0, 0);
    let mut pending: Vec<BlockKey> = keys.clone();
    while !pending.is_empty() {
        steps += 1;
        assert!(steps < 1000, "keys never settled: {pending:?}");
        // one key at a time: not a prefix, a miss must not end the pass
        let verdicts: Vec<LookupResult> = pending.iter().map(|k| m.lookup(k, &req)).collect();
        m.on_schedule_end();
        let mut next = Vec::new();
        for (k, v) in pending.iter().zip(verdicts) {
            match v {
                LookupResult::Hit => {
                    let view = m.prepare_load(&[*k]).unwrap();
                    assert!(verify_block(k, 0, view[0].as_slice()), "{k}: wrong bytes");
                    found += 1;
                }
                LookupResult::Miss => missed += 1,
                LookupResult::HitPending | LookupResult::Retry => next.push(*k),
            }
        }
        pending = next;
        m.runtime().block_on(m.wait_idle());
    }
    let s = fs.stats();
    assert_eq!(
        s.blocks.load_failures, 0,
        "a torn or damaged block was found"
    );
    assert_eq!(
        s.blocks.corrupt_deleted, 0,
        "a torn or damaged block was found"
    );
    assert_eq!(found + missed, keys.len(), "every key answered");
    println!("{found} of {} blocks survived the drop", keys.len());
    m.on_request_finished(req.id);
    m.shutdown_blocking().unwrap();
}
