//! An adversarial round (written from the public API and the documentation only):
//!
//! 1. `TieringManager::wait_idle` / `wait_jobs` / `reset_cache` / `shutdown` under continuous
//!    traffic from several threads (stores, lookups, promotions) with slow tiers: they end,
//!    they apply what was in flight at their call, several may wait at once, dropped at any
//!    poll point they leave nothing behind, and nothing committed after `shutdown` began
//!    reaches a tier.
//! 2. fs tier events (kv-tier-fs README, "Events") under real concurrency: a small key pool,
//!    a tiny cap, background GC, external deletes and truncations, rescans and sweeps from
//!    other threads: once quiet, a key's last event says whether its file is there.
//! 3. fs bounded-capacity accounting (`GcStats`): the peak never passes the hard ceiling,
//!    and `bytes` equals `du` once quiet, with many keys in few leaf directories.
//! 4. `kv-tier gc ROOT --max-size-gb X --json` and `offline::scan_rank` on a root a live
//!    bounded tier uses: exit 0, nothing failed, the walk never errors, the tier serves no
//!    wrong bytes and its index matches `du` once quiet.

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use kv_tier::fs::offline::scan_rank;
use kv_tier::fs::{Checksum, FsTier, FsTierConfig, GcStats};
use kv_tier::{
    BlockKey, KvTierConfig, LookupResult, Namespace, RequestContext, RequestId, RunFields,
    SecondaryTier, TierEvent, TierOptions, TieringManager, WriteBackPolicy,
};
use kv_tier_testkit::util::{dram_manager_builder, try_engine_store};
use kv_tier_testkit::{
    FaultyTier, MemoryTier, allocated_bytes, load_keys, store_keys, temp_root, test_key,
    verify_block,
};

const BS: usize = 4096;
/// Bounds every wait under test: one that never ends fails its test instead of hanging.
const LIMIT: Duration = Duration::from_secs(60);
const GIB: f64 = (1u64 << 30) as f64;

// ------------------------------------------------------------------------------- helpers

/// A small xorshift generator (no rand dependency), seeded per thread.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        x
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let s = t ^ (std::process::id() as u64) << 32;
    eprintln!("seed {s}");
    s
}

async fn bounded<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {LIMIT:?}"))
}

/// Polls `f` at most `n` times (yielding between polls), then drops it wherever it stands.
async fn poll_then_drop<F: Future>(f: F, n: usize) -> bool {
    let mut f = pin!(f);
    for _ in 0..n {
        let done = std::future::poll_fn(|cx: &mut Context<'_>| match f.as_mut().poll(cx) {
            Poll::Ready(_) => Poll::Ready(true),
            Poll::Pending => Poll::Ready(false),
        })
        .await;
        if done {
            return true;
        }
        tokio::task::yield_now().await;
    }
    false
}

fn ns() -> Namespace {
    Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap()
}

// ------------------------------------------------------------- manager fixture (part 1)

/// A manager over two slow memory tiers (each behind a `FaultyTier` that delays every job and
/// probe), write-back policy `wait` so no admitted block is dropped, and traffic threads.
struct Mx {
    m: Arc<TieringManager>,
    mems: Vec<Arc<MemoryTier>>,
    faults: Vec<Arc<FaultyTier>>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// Keys the store threads committed, with whether a tier's shutdown had been called
    /// before their `prepare_store`.
    committed: Arc<Mutex<Vec<(BlockKey, bool)>>>,
    /// Keys seeded in the second tier only: lookups of them promote.
    seeded: Arc<Vec<BlockKey>>,
    steps: Arc<AtomicU64>,
}

async fn mx(delays_ms: [u64; 2]) -> Mx {
    let slots = 1024usize;
    let cfg = KvTierConfig::new((slots * BS) as u64, BS as u64);
    let mut b = dram_manager_builder(cfg).unwrap();
    let mut mems = Vec::new();
    let mut faults = Vec::new();
    for (i, d) in delays_ms.iter().enumerate() {
        let mem = Arc::new(MemoryTier::new(format!("mem{i}"), BS));
        let f = Arc::new(FaultyTier::new(mem.clone()));
        f.delay(Some(Duration::from_millis(*d)));
        let opts = TierOptions {
            write_back_policy: Some(WriteBackPolicy::Wait),
            write_back_limit_mb: Some(256.0),
            ..Default::default()
        };
        b = b.tier_with_options(f.clone(), opts);
        mems.push(mem);
        faults.push(f);
    }
    let m = Arc::new(b.build().await.unwrap());
    let seeded: Vec<BlockKey> = (0..64).map(|i| test_key(70_000_000 + i)).collect();
    let r = store_keys(&*mems[1], &seeded, 0, BS).await;
    assert!(r.is_success());
    Mx {
        m,
        mems,
        faults,
        stop: Arc::new(AtomicBool::new(false)),
        threads: Vec::new(),
        committed: Arc::new(Mutex::new(Vec::new())),
        seeded: Arc::new(seeded),
        steps: Arc::new(AtomicU64::new(0)),
    }
}

impl Mx {
    /// Three threads without pause (1 ms sleeps): fresh stores; lookups (and promotions and
    /// loads) of keys only the second tier has; lookups of absent keys and touches.
    fn start_traffic(&mut self, tag: u64) {
        for t in 0..3u64 {
            let m = self.m.clone();
            let stop = self.stop.clone();
            let committed = self.committed.clone();
            let faults = self.faults.clone();
            let seeded = self.seeded.clone();
            let steps = self.steps.clone();
            self.threads.push(std::thread::spawn(move || {
                let mut rng = Rng::new(tag * 31 + t);
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let req = RequestContext::new(1_000_000_000 * (t + 1) + tag * 10_000_000 + i);
                    match t {
                        0 => {
                            let k = test_key(100_000_000 + tag * 10_000_000 + i);
                            let after = faults.iter().any(|f| f.shutdowns() > 0);
                            if try_engine_store(&m, req.id, &[k]).is_ok() {
                                committed.lock().unwrap().push((k, after));
                            }
                            let _ = m.lookup(&k, &req);
                            m.on_schedule_end();
                        }
                        1 => {
                            let k = seeded[rng.below(seeded.len() as u64) as usize];
                            for _ in 0..4 {
                                let v = m.lookup(&k, &req);
                                if v == LookupResult::Hit
                                    && let Ok(views) = m.prepare_load(&[k])
                                {
                                    for v in &views {
                                        assert!(
                                            verify_block(&k, 0, v.as_slice()),
                                            "a promoted block holds wrong bytes"
                                        );
                                    }
                                }
                                m.on_schedule_end();
                                if matches!(v, LookupResult::Hit | LookupResult::Miss) {
                                    break;
                                }
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        }
                        _ => {
                            let k = test_key(200_000_000 + tag * 10_000_000 + i);
                            let _ = m.lookup_many(&[k, seeded[(i % 64) as usize]], &req);
                            m.touch(&[k]);
                            m.on_schedule_end();
                        }
                    }
                    m.on_request_finished(req.id);
                    steps.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                    std::thread::sleep(Duration::from_millis(1));
                }
            }));
        }
    }

    fn stop_traffic(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().expect("a traffic thread panicked");
        }
    }

    /// Waits (bounded) until the traffic has made some steps and sent store jobs.
    async fn flowing(&self) {
        let t0 = Instant::now();
        while self.steps.load(Ordering::Relaxed) < 30
            || self
                .m
                .stats()
                .tiers
                .iter()
                .map(|t| t.store_jobs)
                .sum::<u64>()
                < 5
        {
            assert!(t0.elapsed() < LIMIT, "the traffic sent nothing");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The engine's store of `k` (retried while write-back pushes back).
    async fn store(&self, req: u64, k: BlockKey) {
        let t0 = Instant::now();
        while try_engine_store(&self.m, RequestId(req), &[k]).is_err() {
            assert!(
                t0.elapsed() < LIMIT,
                "the store of {k} was refused for {LIMIT:?}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

impl Drop for Mx {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

// ------------------------------------------------------------------------- part 1 tests

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
    let base = seed();
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
                        poll_then_drop(m.wait_idle(), 1 + rng.below(6) as usize).await;
                    }
                    3 => {
                        poll_then_drop(m.wait_jobs(), 1 + rng.below(6) as usize).await;
                    }
                    4 => {
                        let us = rng.below(30_000);
                        let _ =
                            tokio::time::timeout(Duration::from_micros(us), m.wait_idle()).await;
                    }
                    _ => {
                        poll_then_drop(m.reset_cache(), 1 + rng.below(4) as usize).await;
                    }
                }
                complete.fetch_add(1, Ordering::Relaxed);
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

// ------------------------------------------------------------------ fs fixtures (2-4)

fn rank_dir(root: &Path) -> PathBuf {
    root.join(ns().rank_dir_name())
}

fn du(root: &Path) -> u64 {
    allocated_bytes(&rank_dir(root))
}

fn gcs(t: &FsTier) -> GcStats {
    t.stats().gc.expect("a bounded tier has GC stats")
}

/// A key in leaf directory `leaf` (of a handful sharing one top directory): index `i`.
fn leaf_key(leaf: u8, i: u32) -> BlockKey {
    let mut h = [0u8; 32];
    h[0] = 0xa0;
    h[1] = leaf;
    h[2] = 0x5c;
    h[3..7].copy_from_slice(&i.to_be_bytes());
    h[31] = 0x77;
    BlockKey::from_hash32(h, 0)
}

/// A bounded, checksummed tier whose cap holds about `cap_blocks` blocks (plus directories),
/// background GC every 10 ms, tiny grace and stamp interval, rescans every second.
fn bounded_tier(root: &Path, cap_blocks: u64) -> Arc<FsTier> {
    bounded_tier_bg(root, cap_blocks, true)
}

/// [`bounded_tier`], with the background GC on or off (`gc_background`).
fn bounded_tier_bg(root: &Path, cap_blocks: u64, background: bool) -> Arc<FsTier> {
    let mut c = FsTierConfig::new(root);
    c.checksum = Checksum::Crc32c;
    c.n_read_threads = 2;
    c.n_write_threads = 2;
    let cap = cap_blocks * BS as u64 + 16 * 4096;
    c.gc_max_size_gb = Some(cap as f64 / GIB);
    c.gc_interval_s = Some(0.01);
    c.gc_stamp_interval_s = Some(0.001);
    c.gc_grace_s = Some(0.002);
    c.gc_rescan_interval_s = Some(1.0);
    c.gc_background = background;
    Arc::new(FsTier::open("fs", c, ns(), BS).unwrap())
}

/// The pool: `per_leaf` keys in each of `leaves` leaf directories, plus `spread` keys spread
/// over the layout.
fn pool(leaves: u8, per_leaf: u32, spread: u64) -> Vec<BlockKey> {
    let mut v = Vec::new();
    for l in 0..leaves {
        for i in 0..per_leaf {
            v.push(leaf_key(0x11 + l * 0x10, i));
        }
    }
    v.extend((0..spread).map(|i| test_key(60_000_000 + i)));
    v
}

/// Store / load (verified) / touch / lookup workers on random keys of `keys`; returns the
/// wrong-byte count and the op count.
fn spawn_fs_workers(
    tier: &Arc<FsTier>,
    keys: &Arc<Vec<BlockKey>>,
    stop: &Arc<AtomicBool>,
    n: u64,
    base: u64,
    wrong: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..n)
        .map(|w| {
            let (tier, keys, stop, wrong) =
                (tier.clone(), keys.clone(), stop.clone(), wrong.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(base ^ (w + 7));
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let n = 1 + rng.below(4) as usize;
                    let batch: Vec<BlockKey> = (0..n)
                        .map(|_| keys[rng.below(keys.len() as u64) as usize])
                        .collect::<HashSet<_>>()
                        .into_iter()
                        .collect();
                    match rng.below(10) {
                        0..=3 => {
                            // the same batch stored twice at once: one writes, one skips
                            if rng.below(3) == 0 {
                                let (a, b) = tokio::join!(
                                    store_keys(&*tier, &batch, 0, BS),
                                    store_keys(&*tier, &batch, 0, BS)
                                );
                                drop((a, b));
                            } else {
                                let _ = store_keys(&*tier, &batch, 0, BS).await;
                            }
                        }
                        4..=7 => {
                            let (_r, got) = load_keys(&*tier, &batch, BS).await;
                            for (k, b) in got {
                                if !verify_block(&k, 0, &b) {
                                    wrong.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        8 => tier.touch(&batch),
                        _ => {
                            let _ = tier.lookup(&batch).await;
                        }
                    }
                    ops += 1;
                    tokio::task::yield_now().await;
                }
                ops
            })
        })
        .collect()
}

/// Takes the tier's events every 20 ms into one ordered list until stopped.
fn spawn_collector(
    tier: &Arc<FsTier>,
    stop: &Arc<AtomicBool>,
    out: &Arc<Mutex<Vec<TierEvent>>>,
) -> std::thread::JoinHandle<()> {
    let (tier, stop, out) = (tier.clone(), stop.clone(), out.clone());
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let ev = tier.take_events();
            out.lock().unwrap().extend(ev);
            std::thread::sleep(Duration::from_millis(20));
        }
    })
}

/// Samples `GcStats` every 200 us; returns (max of `bytes`, max of `peak_bytes`, ceiling).
fn spawn_sampler(
    tier: &Arc<FsTier>,
    stop: &Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, u64, u64)> {
    let (tier, stop) = (tier.clone(), stop.clone());
    std::thread::spawn(move || {
        let (mut b, mut p, mut c) = (0, 0, 0);
        while !stop.load(Ordering::Relaxed) {
            let g = gcs(&tier);
            b = b.max(g.bytes);
            p = p.max(g.peak_bytes);
            c = g.hard_ceiling_bytes;
            std::thread::sleep(Duration::from_micros(200));
        }
        (b, p, c)
    })
}

/// Every key's event history, in order.
fn histories(ev: &[TierEvent]) -> HashMap<BlockKey, Vec<bool>> {
    let mut h: HashMap<BlockKey, Vec<bool>> = HashMap::new();
    for e in ev {
        for k in &e.keys {
            h.entry(*k).or_default().push(e.removed);
        }
    }
    h
}

/// The checks of the README's "Events" on a quiet tier: for every key, its last event is a
/// removal exactly when no file is there; no removal follows a removal; a key's first event
/// is not a removal (the tier started empty). Returns a description of every violation.
fn event_violations(tier: &FsTier, keys: &[BlockKey], ev: &[TierEvent]) -> Vec<String> {
    let h = histories(ev);
    let mut bad = Vec::new();
    for k in keys {
        let on_disk = tier.block_path(k).exists();
        let hist = h.get(k).cloned().unwrap_or_default();
        let last_removed = hist.last().copied();
        let said_there = last_removed == Some(false);
        if said_there != on_disk {
            bad.push(format!(
                "{k}: on disk {on_disk}, last event {:?} (history {hist:?})",
                last_removed.map(|r| if r { "removed" } else { "stored" })
            ));
        }
        if hist.windows(2).any(|w| w[0] && w[1]) {
            bad.push(format!("{k}: removed twice in a row (history {hist:?})"));
        }
        if hist.first() == Some(&true) {
            bad.push(format!(
                "{k}: first event is a removal, no store before (history {hist:?})"
            ));
        }
    }
    bad
}

// ------------------------------------------------------------------------- part 2 test

/// kv-tier-fs README, "Events": "`BlockRemoved` for every file a sweep deletes, for files
/// deleted after a failed load, and for files found gone (by a sweep, a rescan, a stamp or a
/// load), each once. A key's last event says whether its file is there: a removal is
/// reported before a store can write the key again, so the store's `BlockStored` comes after
/// it."
///
/// Six workers store, load, touch and probe 72 keys (64 in two leaf directories) under a cap
/// of about 24 blocks with background GC every 10 ms; another thread deletes block files
/// (`rm`), truncates them (a load then removes them as damage), and calls `gc_rescan_now` /
/// `gc_sweep_now`. Quiesced (final loads of every key, a rescan, shutdown): every key's last
/// event matches the disk, no key is removed twice in a row, no event dropped, no wrong
/// bytes served, the peak never past the hard ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fs_events_match_the_disk_under_churn_deletes_and_damage() {
    let root = temp_root();
    let tier = bounded_tier(root.path(), 24);
    let keys = Arc::new(pool(2, 32, 8));
    let base = seed();
    let stop = Arc::new(AtomicBool::new(false));
    let cstop = Arc::new(AtomicBool::new(false));
    let wrong = Arc::new(AtomicU64::new(0));
    let events = Arc::new(Mutex::new(Vec::new()));
    let collector = spawn_collector(&tier, &cstop, &events);
    let sampler = spawn_sampler(&tier, &cstop);
    let workers = spawn_fs_workers(&tier, &keys, &stop, 6, base, &wrong);
    let disturber = {
        let (tier, keys, stop) = (tier.clone(), keys.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut rng = Rng::new(base ^ 0xd15);
            let (mut rms, mut truncs, mut gc_errs) = (0u64, 0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let k = keys[rng.below(keys.len() as u64) as usize];
                match rng.below(6) {
                    0 | 1 => {
                        if std::fs::remove_file(tier.block_path(&k)).is_ok() {
                            rms += 1;
                        }
                    }
                    2 => {
                        if let Ok(f) = std::fs::OpenOptions::new()
                            .write(true)
                            .open(tier.block_path(&k))
                            && f.set_len(100).is_ok()
                        {
                            truncs += 1;
                        }
                    }
                    3 => {
                        if let Err(e) = tier.gc_rescan_now() {
                            gc_errs.push(format!("rescan: {e}"));
                        }
                    }
                    4 => {
                        if let Err(e) = tier.gc_sweep_now() {
                            gc_errs.push(format!("sweep: {e}"));
                        }
                    }
                    _ => {
                        if let Err(e) = tier.gc_apply_stamps_now() {
                            gc_errs.push(format!("stamps: {e}"));
                        }
                    }
                }
                std::thread::sleep(Duration::from_millis(5 + rng.below(15)));
            }
            (rms, truncs, gc_errs)
        })
    };
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, Ordering::Relaxed);
    let mut ops = 0;
    for w in workers {
        ops += bounded("an fs worker", w).await.unwrap();
    }
    let (rms, truncs, gc_errs) = disturber.join().unwrap();
    // quiesce: loads of every key remove the damaged files; a rescan finds the deleted ones
    for chunk in keys.chunks(8) {
        let (_r, got) = load_keys(&*tier, chunk, BS).await;
        for (k, b) in got {
            if !verify_block(&k, 0, &b) {
                wrong.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    tier.gc_rescan_now().expect("the final rescan");
    bounded("fs shutdown", tier.shutdown())
        .await
        .expect("fs shutdown");
    cstop.store(true, Ordering::Relaxed);
    collector.join().unwrap();
    let (max_bytes, max_peak, ceiling) = sampler.join().unwrap();
    let mut ev = events.lock().unwrap().clone();
    ev.extend(tier.take_events());
    let g = gcs(&tier);
    let removals: usize = ev.iter().filter(|e| e.removed).map(|e| e.keys.len()).sum();
    eprintln!(
        "ops {ops}, rm {rms}, truncated {truncs}, events {} ({removals} removed keys), gc \
         {g:?}",
        ev.len()
    );
    let mut problems = Vec::new();
    if !gc_errs.is_empty() {
        problems.push(format!("gc_*_now calls failed: {gc_errs:?}"));
    }
    if wrong.load(Ordering::Relaxed) != 0 {
        problems.push(format!(
            "{} wrong blocks served",
            wrong.load(Ordering::Relaxed)
        ));
    }
    if tier.events_dropped() != 0 {
        problems.push(format!("{} event keys dropped", tier.events_dropped()));
    }
    let peak = max_bytes.max(max_peak).max(g.peak_bytes);
    let ceiling = ceiling.max(g.hard_ceiling_bytes);
    if peak > ceiling {
        problems.push(format!(
            "past the hard ceiling: peak {peak} (sampled bytes max {max_bytes}), ceiling \
             {ceiling}"
        ));
    }
    let bad = event_violations(&tier, &keys, &ev);
    if !bad.is_empty() {
        problems.push(format!(
            "{} keys' events disagree with the disk or repeat a removal:\n{}",
            bad.len(),
            bad.join("\n")
        ));
    }
    let d = du(root.path());
    if g.bytes != d {
        problems.push(format!(
            "quiet after a rescan, the index counts {} bytes, du shows {d}",
            g.bytes
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ------------------------------------------------------------------------- part 3 test

/// `GcStats::peak_bytes`: "The most `bytes` has been since open"; `gc_hard_ceiling`: "a
/// store never takes the total above it (it makes room first)"; README: "What the index sums
/// is what `du` of the rank directory shows", directories included ("it grows with its
/// entries and never shrinks ... a store into a leaf of 16 files or more reserves a
/// directory unit for its growth").
///
/// 600 keys in 3 leaf directories (directories grow past one allocation unit) plus 40
/// spread keys, a cap of about 48 blocks; eight workers store (the same batch twice at once:
/// one writes, one skips), load and touch; no external interference. The sampled `bytes`
/// and `peak_bytes` never pass the ceiling; once quiet, `bytes` equals `du` with no rescan,
/// `files` equals the block files on disk, no file was "found deleted behind the tier's
/// back" (`GcStats::external_removals`: nobody else touches the root), and the events obey
/// the README's "Events" as in the test above.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fs_accounting_stays_under_the_ceiling_and_matches_du_with_growing_leaves() {
    let root = temp_root();
    let tier = bounded_tier(root.path(), 48);
    let keys = Arc::new(pool(3, 200, 40));
    let base = seed();
    let stop = Arc::new(AtomicBool::new(false));
    let sstop = Arc::new(AtomicBool::new(false));
    let wrong = Arc::new(AtomicU64::new(0));
    let events = Arc::new(Mutex::new(Vec::new()));
    let collector = spawn_collector(&tier, &sstop, &events);
    let sampler = spawn_sampler(&tier, &sstop);
    let workers = spawn_fs_workers(&tier, &keys, &stop, 8, base, &wrong);
    tokio::time::sleep(Duration::from_secs(6)).await;
    stop.store(true, Ordering::Relaxed);
    let mut ops = 0;
    for w in workers {
        ops += bounded("an fs worker", w).await.unwrap();
    }
    // let the background GC finish whatever sweep it started, then stop it
    tokio::time::sleep(Duration::from_millis(100)).await;
    bounded("fs shutdown", tier.shutdown())
        .await
        .expect("fs shutdown");
    sstop.store(true, Ordering::Relaxed);
    collector.join().unwrap();
    let (max_bytes, max_peak, ceiling) = sampler.join().unwrap();
    let mut ev = events.lock().unwrap().clone();
    ev.extend(tier.take_events());
    let g = gcs(&tier);
    let d = du(root.path());
    let files = kv_tier_testkit::find_files(&rank_dir(root.path()), ".bin").len() as u64;
    eprintln!("ops {ops}, du {d}, files on disk {files}, gc {g:?}");
    let mut problems = Vec::new();
    if wrong.load(Ordering::Relaxed) != 0 {
        problems.push(format!(
            "{} wrong blocks served",
            wrong.load(Ordering::Relaxed)
        ));
    }
    let peak = max_bytes.max(max_peak).max(g.peak_bytes);
    if peak > ceiling.max(g.hard_ceiling_bytes) {
        problems.push(format!(
            "past the hard ceiling: peak {peak} (sampled bytes max {max_bytes}), ceiling {}",
            g.hard_ceiling_bytes
        ));
    }
    if g.files != files {
        problems.push(format!(
            "the index holds {} files, the disk {files}",
            g.files
        ));
    }
    if g.bytes != d {
        problems.push(format!(
            "quiet, the index counts {} bytes (dirs {}), du shows {d}",
            g.bytes, g.dir_bytes
        ));
    }
    if g.external_removals != 0 {
        problems.push(format!(
            "{} files found deleted behind the tier's back, with nobody else on the root",
            g.external_removals
        ));
    }
    if tier.events_dropped() != 0 {
        problems.push(format!("{} event keys dropped", tier.events_dropped()));
    }
    let bad = event_violations(&tier, &keys, &ev);
    if !bad.is_empty() {
        problems.push(format!(
            "{} keys' events disagree with the disk or repeat a removal:\n{}",
            bad.len(),
            bad.join("\n")
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The mechanism behind the failures of the two tests above, isolated with the background GC
/// off: README "Accounting": "A rescan merges what it finds: files that appeared while it
/// walked stay, and only files verified absent are forgotten (and reported)"; "Events":
/// removals "each once"; `GcStats::external_removals`: "Files found deleted behind the
/// tier's back".
///
/// One thread stores single blocks of 400 keys in two leaf directories, sequentially, and
/// calls `gc_sweep_now` after each store; another calls `gc_rescan_now` in a loop. Nobody
/// else touches the root. Once quiet: the index's `files` and `bytes` match the disk, no
/// file was found deleted behind the tier's back, no key was reported removed twice in a
/// row, and the peak stayed under the hard ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescans_racing_sweeps_keep_the_index_and_the_events_true() {
    let root = temp_root();
    let tier = bounded_tier_bg(root.path(), 32, false);
    let keys = pool(2, 200, 0);
    let mut rng = Rng::new(seed());
    let stop = Arc::new(AtomicBool::new(false));
    let rescanner = {
        let (tier, stop) = (tier.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                tier.gc_rescan_now().expect("a rescan failed");
                n += 1;
            }
            n
        })
    };
    let mut ev = Vec::new();
    let mut max_bytes = 0;
    let t0 = Instant::now();
    let mut stores = 0u64;
    while t0.elapsed() < Duration::from_secs(4) {
        let k = keys[rng.below(keys.len() as u64) as usize];
        let _ = store_keys(&*tier, &[k], 0, BS).await;
        stores += 1;
        let t = tier.clone();
        tokio::task::spawn_blocking(move || t.gc_sweep_now().expect("a sweep failed"))
            .await
            .unwrap();
        max_bytes = max_bytes.max(gcs(&tier).bytes);
        ev.extend(tier.take_events());
    }
    stop.store(true, Ordering::Relaxed);
    let rescans = rescanner.join().unwrap();
    bounded("fs shutdown", tier.shutdown())
        .await
        .expect("fs shutdown");
    ev.extend(tier.take_events());
    let g = gcs(&tier);
    let d = du(root.path());
    let files = kv_tier_testkit::find_files(&rank_dir(root.path()), ".bin").len() as u64;
    eprintln!("stores {stores}, rescans {rescans}, du {d}, files {files}, gc {g:?}");
    let mut problems = Vec::new();
    if g.external_removals != 0 {
        problems.push(format!(
            "{} files found deleted behind the tier's back, with nobody else on the root",
            g.external_removals
        ));
    }
    if g.peak_bytes.max(max_bytes) > g.hard_ceiling_bytes {
        problems.push(format!(
            "past the hard ceiling: peak {}, ceiling {}",
            g.peak_bytes.max(max_bytes),
            g.hard_ceiling_bytes
        ));
    }
    if g.files != files {
        problems.push(format!(
            "the index holds {} files, the disk {files}",
            g.files
        ));
    }
    if g.bytes != d {
        problems.push(format!("the index counts {} bytes, du shows {d}", g.bytes));
    }
    let bad = event_violations(&tier, &keys, &ev);
    if !bad.is_empty() {
        problems.push(format!(
            "{} keys' events disagree with the disk or repeat a removal:\n{}",
            bad.len(),
            bad.join("\n")
        ));
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

// ------------------------------------------------------------------------- part 4 test

fn cli_binary() -> PathBuf {
    if let Ok(t) = std::env::var("CARGO_TARGET_DIR") {
        let p = PathBuf::from(t).join("debug").join("kv-tier");
        if p.exists() {
            return p;
        }
    }
    // target/debug/deps/<this test> -> target/debug/kv-tier
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join("kv-tier");
    assert!(
        p.exists(),
        "{} missing: build it first (cargo build -p kv-tier-cli)",
        p.display()
    );
    p
}

/// `kv-tier gc` (kv-tier-cli docs): "a file deleted by someone else since the walk is
/// reported "already gone", not an error: on a root in use, the engine's own sweeps"; exit
/// status "0 when all is well". `offline::scan_rank`: "A root in use may change under the
/// walk: a directory or file gone meanwhile (a sweep removed it and its emptied directories)
/// is skipped, not an error."
///
/// A live bounded tier under store/load churn (its sweeps removing emptied directories)
/// while `kv-tier gc ROOT --max-size-gb X --json` runs again and again (X a third of the
/// tier's cap, so it deletes many files) and `scan_rank` walks in a loop: every gc exits 0
/// with `failed` 0 and valid JSON, every walk succeeds, the tier never serves wrong bytes,
/// and once quiet (after a rescan) its index matches `du`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cli_gc_and_offline_walk_on_a_live_root() {
    let bin = cli_binary();
    let root = temp_root();
    let tier = bounded_tier(root.path(), 64);
    let cap = gcs(&tier).cap_bytes;
    let keys = Arc::new(pool(4, 60, 40));
    let base = seed();
    let stop = Arc::new(AtomicBool::new(false));
    let wrong = Arc::new(AtomicU64::new(0));
    let workers = spawn_fs_workers(&tier, &keys, &stop, 6, base, &wrong);
    let walker = {
        let (stop, dir) = (stop.clone(), rank_dir(root.path()));
        std::thread::spawn(move || {
            let (mut ok, mut errs) = (0u64, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                match scan_rank(&dir, Some(&ns())) {
                    Ok(s) => {
                        ok += 1;
                        std::hint::black_box(s.blocks.len());
                    }
                    Err(e) => errs.push(e.to_string()),
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            (ok, errs)
        })
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let x = cap as f64 / 3.0 / GIB;
    let mut runs = Vec::new();
    for _ in 0..10 {
        let out = tokio::task::spawn_blocking({
            let (bin, root) = (bin.clone(), root.path().to_path_buf());
            move || {
                std::process::Command::new(bin)
                    .arg("gc")
                    .arg(&root)
                    .arg("--max-size-gb")
                    .arg(format!("{x:.12}"))
                    .arg("--json")
                    .output()
                    .unwrap()
            }
        })
        .await
        .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        let stderr = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(
            out.status.success(),
            "kv-tier gc on a live root exited {:?}\nstdout: {stdout}\nstderr: {stderr}",
            out.status.code()
        );
        let v: serde_json::Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("not one JSON document ({e}): {stdout}"));
        let failed = match &v["failed"] {
            serde_json::Value::Number(n) => n.as_u64().unwrap_or(u64::MAX),
            serde_json::Value::Array(a) => a.len() as u64,
            other => panic!("no `failed` field: {other:?} in {stdout}"),
        };
        assert_eq!(failed, 0, "kv-tier gc failed to delete files: {stdout}");
        runs.push((
            v["deleted"].as_u64().unwrap_or(0),
            v["already_gone"].as_u64().unwrap_or(0),
        ));
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut ops = 0;
    for w in workers {
        ops += bounded("an fs worker", w).await.unwrap();
    }
    let (walks, walk_errs) = walker.join().unwrap();
    tier.gc_rescan_now().expect("the final rescan");
    bounded("fs shutdown", tier.shutdown())
        .await
        .expect("fs shutdown");
    let g = gcs(&tier);
    let d = du(root.path());
    eprintln!("ops {ops}, walks {walks}, gc runs (deleted, already gone) {runs:?}, gc {g:?}");
    assert!(
        walk_errs.is_empty(),
        "scan_rank failed on a live root: {walk_errs:?}"
    );
    assert!(walks > 0);
    assert!(
        runs.iter().map(|r| r.0 + r.1).sum::<u64>() > 0,
        "kv-tier gc never deleted anything (test did not exercise it)"
    );
    assert_eq!(
        wrong.load(Ordering::Relaxed),
        0,
        "the live tier served wrong bytes"
    );
    assert!(
        g.peak_bytes <= g.hard_ceiling_bytes,
        "past the hard ceiling: {g:?}"
    );
    assert_eq!(
        g.bytes, d,
        "quiet after a rescan, the index counts {} bytes, du shows {d}",
        g.bytes
    );
}
