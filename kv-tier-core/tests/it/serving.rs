//! An engine's serving loop end to end under real concurrency: many threads over shared prefixes
//! with eviction, faults and finishes; every block served has its bytes and nothing is left behind.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use LookupResult::{Hit, Miss};
use kv_tier_core::{BlockKey, LookupResult, RequestContext, RequestId};
use kv_tier_testkit::{Workload, WorkloadConfig, fill_block, temp_root, test_key, verify_block};

use crate::support::*;

/// The whole loop under real concurrency: a multi-turn workload over a small DRAM tier and a
/// flaky secondary tier. Every block that answers Hit has exactly the bytes of its key, and
/// every turn resolves in a bounded number of steps.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workload_round_trips_verify_under_faults() {
    let inner = mem("fs");
    let t = faulty_over(&inner);
    t.fail_every_nth_load(Some(5));
    let fx = evented_manager(24, vec![t.clone()]).await;
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
            engine_store(&fx.m, req.id, chunk);
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

/// Promise (kv-tier-core/src/manager/mod.rs): the manager's methods are called from the
/// scheduler and jobs run concurrently; kv-tier/src/lib.rs: kv-tier "never returns a wrong or
/// torn block". Threads storing overlapping keys and loading them at once never see a wrong
/// byte, never exceed the pool, and leave no slot in the writing state.
#[test]
fn concurrent_stores_and_loads_of_overlapping_keys() {
    let cap = 16usize;
    let m = build(dram_cfg(cap, BS, ""));
    let bad = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (m, bad) = (&m, &bad);
            s.spawn(move || {
                for i in 0..400u64 {
                    let keys: Vec<_> = (0..3).map(|j| test_key((i * 7 + j * 3 + t) % 40)).collect();
                    if let Ok(mut p) = m.prepare_store(&keys) {
                        for (key, sk) in p.slots() {
                            fill_block(key, 0, sk.as_mut_slice());
                        }
                        if i % 5 == 0 {
                            p.abort();
                        } else {
                            p.commit(RequestId(t));
                        }
                    }
                    if let Ok(v) = m.prepare_load(&keys[..1])
                        && !verify_block(&keys[0], 0, v[0].as_slice())
                    {
                        bad.fetch_add(1, Ordering::SeqCst);
                    }
                    let st = m.stats().primary;
                    assert!(st.ready_blocks + st.writing_blocks <= cap, "{st:?}");
                }
            });
        }
    });
    assert_eq!(bad.load(Ordering::SeqCst), 0);
    let st = m.stats().primary;
    assert_eq!(st.writing_blocks, 0, "{st:?}");
}

/// Promise (kv-tier-core/src/manager/mod.rs, `TieringManager`): "All methods but the `async`
/// ones are synchronous, cheap and non-blocking"; README: "never returns a wrong or torn
/// block"; `PrefixCount` (request.rs): `hit` "Leading keys that are `Hit`", `present`
/// "Leading keys that are `Hit` or `HitPending`". Many threads run requests over shared
/// prefixes on fs under DRAM pressure, failing loads, deleted files, stores and finishes;
/// every count is consistent, every successful `prepare_load` holds the right bytes, and at
/// the end nothing is left tracked, leased, held or pinned.
#[test]
fn many_threads_interleave_stores_probes_evictions_failed_loads_and_finishes() {
    let root = temp_root();
    let (fs, faulty) = faulty_fs(root.path());
    faulty.fail_every_nth_load(Some(5));
    let m = Arc::new(build_with(
        mcfg(12, r#", "probe_timeout_s": 30, "lease_s": 0.05"#),
        vec![faulty.clone()],
    ));
    let prefixes: Arc<Vec<Vec<BlockKey>>> = Arc::new(
        (0..6u64)
            .map(|p| {
                (0..4u64)
                    .map(|i| {
                        if i < 3 {
                            test_key(1_000 + (p % 3) * 10 + i)
                        } else {
                            test_key(1_100 + p)
                        }
                    })
                    .collect()
            })
            .collect(),
    );
    let all: Vec<BlockKey> = prefixes.iter().flatten().copied().collect();
    let stop = Arc::new(AtomicBool::new(false));
    let mut handles = Vec::new();
    for t in 0..4u64 {
        let (m, prefixes) = (m.clone(), prefixes.clone());
        handles.push(std::thread::spawn(move || {
            let mut rng = t * 7 + 1;
            for it in 0..50u64 {
                let r = ctx(10_000 + t * 1_000 + it / 5);
                rng = rng
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let prefix = &prefixes[(rng >> 33) as usize % prefixes.len()];
                let found = m.lookup_prefix(prefix, &r);
                assert!(
                    found.hit <= found.present && found.present <= prefix.len(),
                    "{found:?}"
                );
                if found.hit > 0
                    && let Ok(views) = m.prepare_load(&prefix[..found.hit])
                {
                    for (k, v) in prefix.iter().zip(&views) {
                        assert!(verify_block(k, 0, v.as_slice()), "{k}: wrong bytes");
                    }
                }
                if found.present < prefix.len()
                    && !found.retry
                    && let Ok(mut p) = m.prepare_store(&prefix[found.present..])
                {
                    for (k, s) in p.slots() {
                        fill_block(k, 0, s.as_mut_slice());
                    }
                    p.commit(r.id);
                }
                m.on_schedule_end();
                if it % 5 == 4 {
                    m.on_request_finished(r.id);
                }
                // the thread's pace (random steps)
                std::thread::sleep(Duration::from_millis(1 + (rng >> 60)));
            }
        }));
    }
    {
        // a deleter (evictions behind the tier's back) and a resetter
        let (m, fs, stop, all) = (m.clone(), fs.clone(), stop.clone(), all.clone());
        handles.push(std::thread::spawn(move || {
            let mut i = 0usize;
            while !stop.load(Ordering::SeqCst) {
                let _ = std::fs::remove_file(fs.block_path(&all[i % all.len()]));
                if i.is_multiple_of(10) {
                    m.runtime().block_on(m.reset_cache());
                }
                i += 7;
                // the thread's pace
                std::thread::sleep(Duration::from_millis(7));
            }
        }));
    }
    for h in handles.drain(..4) {
        h.join().expect("a request thread failed");
    }
    stop.store(true, Ordering::SeqCst);
    for h in handles {
        h.join().unwrap();
    }
    faulty.heal();
    for t in 0..4u64 {
        for j in 0..10u64 {
            m.on_request_finished(RequestId(10_000 + t * 1_000 + j));
        }
    }
    assert_nothing_left(&m, &all);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs): "The first [`ProbeCache::ask`] of a key
/// returns [`Presence::Retry`] and queues one probe ... Positive answers are shared by all
/// requests"; ARCHITECTURE.md §3.4: "Other requests asking meanwhile see `HitPending` from
/// DRAM (slot `Writing`) and join the hold." The same fs key asked by 100 requests on 100
/// threads at once: one probe, one load, every request reads the right bytes, nothing left.
#[test]
fn the_same_key_asked_by_100_requests_at_once() {
    let root = temp_root();
    let (_fs, faulty) = faulty_fs(root.path());
    let m = Arc::new(build_with(
        mcfg(8, r#", "probe_timeout_s": 30"#),
        vec![faulty.clone()],
    ));
    let k = test_key(121);
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    block_on_jobs(&m);
    assert_eq!(block_on(&m, m.reset_cache()), 0);
    let before = m.stats().tiers[0].clone();
    let gate = faulty.hold_lookups();
    let asked = Arc::new(Barrier::new(101));
    let mut hs = Vec::new();
    for i in 0..100u64 {
        let (m, asked) = (m.clone(), asked.clone());
        hs.push(std::thread::spawn(move || {
            let r = ctx(1_000 + i);
            let first = m.lookup(&k, &r);
            asked.wait();
            let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
            assert_ne!(first, Miss);
            assert_eq!(end, Hit, "request {i}: {seen:?}");
            if let Ok(views) = m.prepare_load(&[k]) {
                assert!(verify_block(&k, 0, views[0].as_slice()), "wrong bytes");
            }
            m.on_schedule_end();
            m.on_request_finished(r.id);
        }));
    }
    asked.wait();
    m.on_schedule_end();
    gate.open();
    for h in hs {
        h.join().expect("a request failed");
    }
    let after = m.stats().tiers[0].clone();
    assert_eq!(
        after.probes.probed_keys - before.probes.probed_keys,
        1,
        "{:?}",
        after.probes
    );
    assert_eq!(
        after.blocks_loaded - before.blocks_loaded,
        1,
        "more than one promotion"
    );
    assert_nothing_left(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Many threads looking up overlapping prefixes while others store new blocks into a small
/// DRAM: every block served has its bytes, nothing hangs, nothing is left behind.
#[test]
fn concurrent_requests_over_overlapping_prefixes_under_eviction() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(12, BS, ""), vec![t.clone()]);
    let shared: Vec<BlockKey> = (0..40).map(test_key).collect();
    put(&m, &t, &shared);
    let stop = AtomicBool::new(false);
    let served = AtomicU64::new(0);
    let deadline = Instant::now() + Duration::from_secs(6);
    std::thread::scope(|s| {
        for th in 0..4u64 {
            let (m, shared, served) = (&m, &shared, &served);
            s.spawn(move || {
                let mut rid = 1000 * (th + 1);
                while Instant::now() < deadline {
                    rid += 1;
                    let req = RequestContext::new(rid);
                    let len = 4 + ((rid * 7 + th) % 12) as usize;
                    let start = ((rid * 3) % 8) as usize;
                    let prefix = &shared[start..start + len];
                    for _ in 0..200 {
                        let c = m.lookup_prefix(prefix, &req);
                        if c.hit > 0 && load_and_verify(m, &prefix[..c.hit]) {
                            served.fetch_add(c.hit as u64, Ordering::Relaxed);
                        }
                        m.on_schedule_end();
                        if !c.retry && c.hit == c.present {
                            break;
                        }
                        // the engine's next step
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    m.on_request_finished(req.id);
                }
            });
        }
        // a writer pressing DRAM with new blocks
        let (m, stop) = (&m, &stop);
        s.spawn(move || {
            let mut i = 10_000u64;
            while Instant::now() < deadline && !stop.load(Ordering::Relaxed) {
                let keys: Vec<BlockKey> = (i..i + 3).map(test_key).collect();
                i += 3;
                if let Ok(mut p) = m.prepare_store(&keys) {
                    for (k, s) in p.slots() {
                        fill_block(k, 0, s.as_mut_slice());
                    }
                    p.commit(RequestId(i));
                }
                m.on_request_finished(RequestId(i));
                m.on_schedule_end();
                // the thread's pace
                std::thread::sleep(Duration::from_millis(2));
            }
        });
    });
    stop.store(true, Ordering::Relaxed);
    assert!(
        served.load(Ordering::Relaxed) > 0,
        "nothing was ever served"
    );
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A single-threaded engine loop with several requests over overlapping prefixes, fs below a
/// small DRAM with GC capacity: bytes right, fs within its hard ceiling, all released.
#[test]
fn a_serving_loop_over_fs_with_a_small_cap_stays_within_it() {
    let dir = tempfile::tempdir().unwrap();
    let bs = 65536;
    // 2 MiB cap: ~32 blocks; we write 200
    let m = kv_tier::builder(fs_manager_config(
        dir.path(),
        16,
        bs,
        r#", "gc_max_size_gb": 0.002, "checksum": "crc32c""#,
    ))
    .unwrap()
    .build_blocking()
    .unwrap();
    let keys: Vec<BlockKey> = (0..200).map(test_key).collect();
    for (i, chunk) in keys.chunks(4).enumerate() {
        engine_store(&m, RequestId(i as u64), chunk);
        m.on_request_finished(RequestId(i as u64));
        m.on_schedule_end();
        if i % 5 == 0 {
            block_on_idle(&m);
        }
    }
    block_on_idle(&m);
    let cap = (0.002f64 * (1u64 << 30) as f64) as u64;
    let used = kv_tier_testkit::allocated_bytes(dir.path());
    assert!(
        used as f64 <= cap as f64 * 1.05 + 64.0 * 1024.0,
        "fs holds {used} bytes against a cap of {cap}"
    );
    // read back the last ones: whatever is served is right
    let mut hits = 0;
    for (i, k) in keys.iter().enumerate().rev().take(40) {
        let req = RequestContext::new(10_000 + i as u64);
        if settle_lookup(&m, k, &req, Duration::from_secs(5)).0 == LookupResult::Hit {
            assert!(load_and_verify(&m, &[*k]));
            hits += 1;
        }
        m.on_schedule_end();
        m.on_request_finished(req.id);
    }
    assert!(hits > 0);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
