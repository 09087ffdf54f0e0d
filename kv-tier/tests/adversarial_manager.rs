//! Adversarial tests of the `TieringManager` through its public API only: deadlines, torn or
//! wrong blocks, cancellation of the async calls, request lifecycle, capacity, config ranges.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_tier::{
    BlockKey, Capability, Error, JobResult, KvTierConfig, LoadJob, Locality, LookupResult, Medium,
    ProtectGuard, ProtectionSet, RequestContext, RequestId, SecondaryTier, StoreJob, TierEvent,
    TierInfo, TieringManager, async_trait,
};
use kv_tier_testkit::{FaultyTier, MemoryTier, fill_block, store_keys, test_key, verify_block};

// ------------------------------------------------------------------------------ helpers

const BS: usize = 4096;

fn cfg(slots: usize, bs: usize, extra: &str) -> KvTierConfig {
    // slots are page-rounded: size the pool in slot units
    let slot = bs.div_ceil(4096) * 4096;
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}{extra}}}"#,
        slots * slot
    ))
    .unwrap()
}

fn build(c: KvTierConfig, tiers: Vec<Arc<dyn SecondaryTier>>) -> TieringManager {
    let mut b = kv_tier::builder(c).unwrap();
    for t in tiers {
        b = b.tier(t);
    }
    b.build_blocking().unwrap()
}

fn fs_cfg(root: &std::path::Path, slots: usize, bs: usize, fs_extra: &str) -> KvTierConfig {
    let slot = bs.div_ceil(4096) * 4096;
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs},
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}{fs_extra}}}]}}"#,
        slots * slot,
        root
    ))
    .unwrap()
}

fn store(m: &TieringManager, req: u64, keys: &[BlockKey]) {
    let mut p = m.prepare_store(keys).expect("store refused");
    for (k, s) in p.slots() {
        fill_block(k, 0, s.as_mut_slice());
    }
    p.commit(RequestId(req));
}

fn idle(m: &TieringManager) {
    m.runtime().block_on(m.wait_idle());
}

fn step(m: &TieringManager) {
    m.on_schedule_end();
    idle(m);
}

/// Asserts that every view of a successful `prepare_load` holds the stored bytes.
fn load_and_verify(m: &TieringManager, keys: &[BlockKey]) -> bool {
    match m.prepare_load(keys) {
        Ok(views) => {
            assert_eq!(views.len(), keys.len());
            for (k, v) in keys.iter().zip(&views) {
                assert!(
                    verify_block(k, 0, v.as_slice()),
                    "{k}: wrong or torn bytes served"
                );
            }
            true
        }
        Err(_) => false,
    }
}

/// Loops lookups of one key for `req` until it is `Hit` or `Miss`, at most `limit`.
fn settle(
    m: &TieringManager,
    key: &BlockKey,
    req: &RequestContext,
    limit: Duration,
) -> LookupResult {
    let t0 = Instant::now();
    loop {
        let v = m.lookup(key, req);
        if matches!(v, LookupResult::Hit | LookupResult::Miss) {
            return v;
        }
        m.on_schedule_end();
        assert!(t0.elapsed() < limit, "{key} stuck in {v:?} for {limit:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// After all requests ended and the manager is idle: nothing tracked, pinned, held, leased.
fn assert_clean(m: &TieringManager) {
    idle(m);
    let s = m.stats();
    assert_eq!(s.held_blocks, 0, "held blocks left: {s:#?}");
    assert_eq!(s.holding_requests, 0, "holding requests left");
    assert_eq!(s.write_back_pinned_bytes, 0, "write-back pins left");
    assert_eq!(s.primary.writing_blocks, 0, "DRAM slots left Writing");
    for t in &s.tiers {
        assert_eq!(t.write_back_bytes, 0, "{}: write-back bytes left", t.name);
        assert_eq!(t.leased_keys, 0, "{}: leases left", t.name);
        assert_eq!(t.tracked_keys, 0, "{}: tracked keys left", t.name);
        assert_eq!(t.tracked_requests, 0, "{}: tracked requests left", t.name);
    }
    // every DRAM slot is reusable at once: one store of `capacity` fresh keys
    let cap = s.primary.capacity_blocks;
    let fresh: Vec<BlockKey> = (0..cap as u64).map(|i| test_key(9_000_000 + i)).collect();
    let p = m.prepare_store(&fresh);
    assert!(p.is_ok(), "DRAM not fully reusable: {:?}", p.err());
    let p = p.unwrap();
    assert_eq!(p.keys().len() + p.present().len(), cap);
    p.abort();
}

// ------------------------------------------------------------------------------ a scripted tier

/// A tier over a `MemoryTier` that can hang, lie about its loads or give a wrong number of
/// probe answers.
#[derive(Debug)]
struct Script {
    name: String,
    inner: Arc<MemoryTier>,
    hang_lookup: AtomicBool,
    hang_store: AtomicBool,
    hang_load: AtomicBool,
    hang_shutdown: AtomicBool,
    all_present: AtomicBool,
    answer_delta: AtomicI64,
    extra_ok: Mutex<Vec<BlockKey>>,
    ok_and_failed: AtomicBool,
    shutdowns: AtomicU64,
    loads: AtomicU64,
    protection: ProtectionSet,
}

impl Script {
    fn new(name: &str, bs: usize) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            inner: Arc::new(MemoryTier::new(name, bs)),
            hang_lookup: AtomicBool::new(false),
            hang_store: AtomicBool::new(false),
            hang_load: AtomicBool::new(false),
            hang_shutdown: AtomicBool::new(false),
            all_present: AtomicBool::new(false),
            answer_delta: AtomicI64::new(0),
            extra_ok: Mutex::new(Vec::new()),
            ok_and_failed: AtomicBool::new(false),
            shutdowns: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            protection: ProtectionSet::new(),
        })
    }
}

#[async_trait]
impl SecondaryTier for Script {
    fn info(&self) -> TierInfo {
        TierInfo::new(
            self.name.clone(),
            Medium::Storage,
            Locality::Local,
            Capability::new(),
        )
    }
    async fn lookup(&self, keys: &[BlockKey]) -> kv_tier::Result<Vec<bool>> {
        if self.hang_lookup.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let mut v = if self.all_present.load(Ordering::SeqCst) {
            vec![true; keys.len()]
        } else {
            self.inner.lookup(keys).await?
        };
        let d = self.answer_delta.load(Ordering::SeqCst);
        if d < 0 {
            v.truncate(v.len().saturating_sub((-d) as usize));
        } else {
            v.extend(std::iter::repeat_n(true, d as usize));
        }
        Ok(v)
    }
    async fn store(&self, job: StoreJob) -> JobResult {
        if self.hang_store.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.store(job).await
    }
    async fn load(&self, job: LoadJob) -> JobResult {
        self.loads.fetch_add(1, Ordering::SeqCst);
        if self.hang_load.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let mut r = self.inner.load(job).await;
        r.ok.extend(self.extra_ok.lock().unwrap().iter().copied());
        if self.ok_and_failed.load(Ordering::SeqCst) {
            let dup: Vec<(BlockKey, Error)> =
                r.ok.iter()
                    .map(|k| {
                        (
                            *k,
                            Error::NotFound {
                                key: *k,
                                tier: self.name.clone(),
                            },
                        )
                    })
                    .collect();
            r.failed.extend(dup);
        }
        r
    }
    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch(keys)
    }
    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.protection.protect(keys)
    }
    fn is_protected(&self, key: &BlockKey) -> bool {
        self.protection.contains(key)
    }
    fn take_events(&self) -> Vec<TierEvent> {
        Vec::new()
    }
    async fn shutdown(&self) -> kv_tier::Result<()> {
        self.shutdowns.fetch_add(1, Ordering::SeqCst);
        if self.hang_shutdown.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

fn put(m: &TieringManager, t: &Script, keys: &[BlockKey]) {
    let r = m
        .runtime()
        .block_on(store_keys(&*t.inner, keys, 0, m.block_size()));
    assert!(r.is_success());
}

// ------------------------------------------------------------------------------ deadlines

/// A tier whose probe never answers keeps a key out of Hit/Miss no longer than the probe
/// deadline (`probe_timeout_s`: "no key waits in `Retry` longer than this").
#[test]
fn a_hanging_probe_settles_to_miss_within_the_probe_deadline() {
    let t = Script::new("hang", BS);
    t.hang_lookup.store(true, Ordering::SeqCst);
    let m = build(cfg(8, BS, r#", "probe_timeout_s": 0.2"#), vec![t.clone()]);
    let req = RequestContext::new(1);
    let t0 = Instant::now();
    let v = settle(&m, &test_key(1), &req, Duration::from_secs(10));
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

/// The first tier hangs, the second has the block: the key is served from the second once
/// the first's probe passes its deadline, with the right bytes.
#[test]
fn a_hanging_first_tier_does_not_hide_the_second_tiers_block() {
    let hang = Script::new("hang", BS);
    hang.hang_lookup.store(true, Ordering::SeqCst);
    let good = Script::new("good", BS);
    // the deadline applies to the good tier's probe too: long enough that it answers in time
    // on a loaded machine
    let m = build(
        cfg(8, BS, r#", "probe_timeout_s": 2"#),
        vec![hang.clone(), good.clone()],
    );
    let k = test_key(7);
    put(&m, &good, &[k]);
    let req = RequestContext::new(1);
    let v = settle(&m, &k, &req, Duration::from_secs(30));
    assert_eq!(
        v,
        LookupResult::Hit,
        "the second tier's block was not served"
    );
    assert!(load_and_verify(&m, &[k]));
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
    let m = build(
        cfg(
            4,
            BS,
            r#", "job_timeout_s": 0.2, "job_timeout_per_block_s": 0"#,
        ),
        vec![t.clone()],
    );
    let req = RequestContext::new(1);
    let k = test_key(3);
    let t0 = Instant::now();
    let v = settle(&m, &k, &req, Duration::from_secs(30));
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
    let m = build(
        cfg(
            4,
            BS,
            r#", "job_timeout_s": 0.2, "job_timeout_per_block_s": 0"#,
        ),
        vec![t.clone()],
    );
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    store(&m, 1, &keys);
    assert!(m.stats().write_back_pinned_bytes > 0);
    m.on_request_finished(RequestId(1));
    let t0 = Instant::now();
    idle(&m);
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

/// `shutdown` with a tier whose `shutdown` never returns still ends (the tier shutdown has a
/// deadline, `shutdown_timeout_s`).
#[test]
fn shutdown_with_a_hanging_tier_shutdown_ends() {
    let t = Script::new("hang", BS);
    t.hang_shutdown.store(true, Ordering::SeqCst);
    let m = build(
        cfg(4, BS, r#", "shutdown_timeout_s": 0.3"#),
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

// ------------------------------------------------------------------------------ lying tiers

/// A tier that reports loaded a key that was not in the load job, one the engine is still
/// writing: that key must not turn readable (a torn block) before the engine commits it.
#[test]
fn a_load_reporting_a_foreign_key_does_not_publish_an_unfinished_store() {
    let t = Script::new("liar", BS);
    let m = build(cfg(8, BS, ""), vec![t.clone()]);
    let (a, b) = (test_key(1), test_key(2));
    put(&m, &t, &[a]);
    // the engine is writing b: half written so far
    let mut pending = m.prepare_store(&[b]).unwrap();
    pending.slots()[0].1.as_mut_slice()[..BS / 2].fill(0xAB);
    *t.extra_ok.lock().unwrap() = vec![b];
    let req = RequestContext::new(1);
    let v = settle(&m, &a, &req, Duration::from_secs(5));
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
    let m = build(cfg(8, BS, ""), vec![t.clone()]);
    let (a, c) = (test_key(1), test_key(3));
    put(&m, &t, &[a]);
    *t.extra_ok.lock().unwrap() = vec![c];
    let req = RequestContext::new(1);
    assert_eq!(
        settle(&m, &a, &req, Duration::from_secs(5)),
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
    let m = build(cfg(8, BS, ""), vec![t.clone()]);
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    put(&m, &t, &keys);
    let req = RequestContext::new(1);
    for k in &keys {
        if settle(&m, k, &req, Duration::from_secs(5)) == LookupResult::Hit {
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
        let m = build(cfg(8, BS, ""), vec![t.clone()]);
        let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
        put(&m, &t, &keys);
        t.answer_delta.store(delta, Ordering::SeqCst);
        let req = RequestContext::new(1);
        assert_eq!(
            settle(&m, &keys[0], &req, Duration::from_secs(5)),
            LookupResult::Miss,
            "delta {delta}"
        );
        m.on_schedule_end();
        m.on_request_finished(req.id);
        t.answer_delta.store(0, Ordering::SeqCst);
        let r2 = RequestContext::new(2);
        assert_eq!(
            settle(&m, &keys[0], &r2, Duration::from_secs(5)),
            LookupResult::Hit
        );
        assert!(load_and_verify(&m, &keys[..1]));
        m.on_schedule_end();
        m.on_request_finished(r2.id);
        assert_clean(&m);
        m.shutdown_blocking().unwrap();
    }
}

/// A promotion from the first tier fails; the second tier has the block: the request gets
/// it from there rather than recomputing.
#[test]
fn a_failed_promotion_falls_back_to_the_next_tier() {
    let a = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("a", BS))));
    let b = Script::new("b", BS);
    let m = build(cfg(8, BS, ""), vec![a.clone(), b.clone()]);
    let k = test_key(5);
    let r = m.runtime().block_on(store_keys(&**a.inner(), &[k], 0, BS));
    assert!(r.is_success());
    put(&m, &b, &[k]);
    a.fail_load(&[k]);
    let req = RequestContext::new(1);
    let v = settle(&m, &k, &req, Duration::from_secs(5));
    assert_eq!(
        v,
        LookupResult::Hit,
        "the block in the second tier was not used after the first tier's load failed"
    );
    assert!(load_and_verify(&m, &[k]));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

// ------------------------------------------------------------------------------ cancellation

/// `reset_cache` dropped while it waits for a promotion in flight leaves nothing behind.
#[test]
fn a_dropped_reset_cache_leaves_nothing_behind() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build(cfg(4, BS, ""), vec![f.clone()]);
    let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
    let r = m.runtime().block_on(store_keys(&**f.inner(), &keys, 0, BS));
    assert!(r.is_success());
    let gate = f.hold_loads();
    let req = RequestContext::new(1);
    m.lookup_many(&keys, &req);
    step(&m); // probes
    let v = m.lookup_many(&keys, &req);
    assert!(v.iter().all(|x| *x == LookupResult::HitPending), "{v:?}");
    m.on_schedule_end(); // the load is sent, held at the gate
    m.runtime().block_on(gate.wait_arrived(1));
    let r = m.runtime().block_on(async {
        tokio::time::timeout(Duration::from_millis(100), m.reset_cache()).await
    });
    assert!(
        r.is_err(),
        "reset_cache did not wait for the load in flight"
    );
    gate.open();
    idle(&m);
    let v = m.lookup_many(&keys, &req);
    for (k, x) in keys.iter().zip(&v) {
        if *x == LookupResult::Hit {
            assert!(load_and_verify(&m, &[*k]));
        }
    }
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    // reset works afterwards, and empties DRAM
    let left = m.runtime().block_on(m.reset_cache());
    assert_eq!(left, 0);
    assert_eq!(m.stats().primary.ready_blocks, 0);
    m.shutdown_blocking().unwrap();
}

/// `wait_idle`/`wait_jobs` dropped mid-way: later waits still see the jobs land.
#[test]
fn dropped_waits_leave_nothing_behind() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build(cfg(8, BS, ""), vec![f.clone()]);
    let gate = f.hold_stores();
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    store(&m, 1, &keys);
    m.on_request_finished(RequestId(1));
    for _ in 0..3 {
        let r = m.runtime().block_on(async {
            tokio::time::timeout(Duration::from_millis(30), m.wait_idle()).await
        });
        assert!(r.is_err());
        let r = m.runtime().block_on(async {
            tokio::time::timeout(Duration::from_millis(30), m.wait_jobs()).await
        });
        assert!(r.is_err());
    }
    assert!(!m.is_idle());
    gate.open();
    idle(&m);
    assert!(m.is_idle());
    let s = m.stats();
    assert_eq!(s.tiers[0].blocks_stored, 4);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// `shutdown` dropped while it waits for a store in flight: a second `shutdown` still shuts
/// every tier down, and the acknowledged store is either in the tier or counted failed.
#[test]
fn a_dropped_shutdown_can_be_completed_by_a_second_one() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build(cfg(8, BS, ""), vec![f.clone()]);
    let gate = f.hold_stores();
    let k = test_key(1);
    store(&m, 1, &[k]);
    m.on_request_finished(RequestId(1));
    let r = m
        .runtime()
        .block_on(async { tokio::time::timeout(Duration::from_millis(100), m.shutdown()).await });
    assert!(r.is_err(), "shutdown did not wait for the store in flight");
    gate.open();
    let r = m
        .runtime()
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), m.shutdown()).await });
    assert!(r.is_ok(), "the second shutdown hung");
    assert!(
        f.shutdowns() >= 1,
        "after a cancelled shutdown, a second shutdown never shut the tier down"
    );
    let mem = f.inner().clone();
    let present = m.runtime().block_on(mem.lookup(&[k])).unwrap()[0];
    let s = m.stats();
    assert!(
        present || s.tiers[0].store_failures > 0,
        "an acknowledged store neither landed nor was counted failed"
    );
}

/// `shutdown` waits for a store in flight: the acknowledged block lands in the tier.
#[test]
fn shutdown_waits_for_stores_in_flight() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build(cfg(8, BS, ""), vec![f.clone()]);
    let gate = f.hold_stores();
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    store(&m, 1, &keys);
    m.on_request_finished(RequestId(1));
    let g = gate.clone();
    let opener = std::thread::spawn(move || {
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
    store(&m, 2, &[test_key(100)]);
    assert_eq!(m.lookup(&test_key(100), &req), LookupResult::Hit);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    // a second shutdown does not hang or panic
    let _ = m.shutdown_blocking();
}

// ------------------------------------------------------------------------------ request lifecycle

/// A request aborted with its promotion queued: the DRAM reservation and lease go; another
/// request that joined the promotion still gets the block.
#[test]
fn a_request_finished_with_a_queued_promotion_does_not_strand_a_joiner() {
    let t = Script::new("mem", BS);
    let m = build(cfg(4, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    put(&m, &t, &[k]);
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    assert_eq!(m.lookup(&k, &r1), LookupResult::Retry);
    step(&m);
    assert_eq!(m.lookup(&k, &r1), LookupResult::HitPending);
    assert_eq!(m.lookup(&k, &r2), LookupResult::HitPending);
    m.on_request_finished(r1.id); // before the promotion is sent
    m.on_schedule_end();
    idle(&m);
    let v = settle(&m, &k, &r2, Duration::from_secs(5));
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

/// A request aborted while its promotion's load is in flight: the block lands, nothing is
/// held for the dead request.
#[test]
fn a_request_aborted_mid_load_holds_nothing() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build(cfg(4, BS, ""), vec![f.clone()]);
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    let r = m.runtime().block_on(store_keys(&**f.inner(), &keys, 0, BS));
    assert!(r.is_success());
    let gate = f.hold_loads();
    let req = RequestContext::new(1);
    m.lookup_many(&keys, &req);
    step(&m);
    let v = m.lookup_many(&keys, &req);
    assert!(v.iter().all(|x| *x == LookupResult::HitPending), "{v:?}");
    m.on_schedule_end();
    m.runtime().block_on(gate.wait_arrived(1));
    m.on_request_finished(req.id);
    m.on_request_finished(req.id); // twice
    m.on_request_finished(RequestId(12345)); // never started
    gate.open();
    assert_clean(&m);
    // the landed blocks are right
    let r2 = RequestContext::new(2);
    let v = m.lookup_many(&keys, &r2);
    for (k, x) in keys.iter().zip(&v) {
        if *x == LookupResult::Hit {
            assert!(load_and_verify(&m, &[*k]));
        }
    }
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
    let m = build(cfg(8, BS, ""), vec![f.clone()]);
    let gate = f.hold_stores();
    let req = RequestContext::new(1);
    let other = test_key(50);
    assert_eq!(m.lookup(&other, &req), LookupResult::Retry);
    m.on_schedule_end();
    let keys: Vec<BlockKey> = (0..2).map(test_key).collect();
    store(&m, 1, &keys);
    m.on_request_finished(req.id);
    m.on_request_finished(req.id);
    gate.open();
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// Duplicate keys in one store: one slot per key, the bytes right, the pool fully reusable.
#[test]
fn duplicate_keys_in_one_store() {
    let t = Script::new("mem", BS);
    let m = build(cfg(4, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    let mut p = m.prepare_store(&[k, k, k]).unwrap();
    let n = p.slots().len();
    for (i, (key, s)) in p.slots().iter_mut().enumerate() {
        // if two slots were given, the second write differs: a torn or wrong block shows it
        if i == 0 {
            fill_block(key, 0, s.as_mut_slice());
        } else {
            s.as_mut_slice().fill(0xEE);
        }
    }
    p.commit(RequestId(1));
    assert_eq!(n, 1, "one key was given {n} slots");
    assert_eq!(m.stats().primary.ready_blocks, 1);
    let req = RequestContext::new(1);
    assert_eq!(m.lookup(&k, &req), LookupResult::Hit);
    assert!(load_and_verify(&m, &[k]));
    idle(&m);
    assert_eq!(m.stats().tiers[0].blocks_stored, 1);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// Duplicate keys in one lookup whose block comes from a secondary tier.
#[test]
fn duplicate_keys_in_one_lookup_with_promotion() {
    let t = Script::new("mem", BS);
    let m = build(cfg(4, BS, ""), vec![t.clone()]);
    let (a, b) = (test_key(1), test_key(2));
    put(&m, &t, &[a, b]);
    let req = RequestContext::new(1);
    let keys = [a, a, b, a, b];
    let t0 = Instant::now();
    loop {
        let c = m.lookup_prefix(&keys, &req);
        if c.hit == keys.len() {
            break;
        }
        step(&m);
        assert!(t0.elapsed() < Duration::from_secs(5), "{c:?}");
    }
    assert!(load_and_verify(&m, &keys));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_eq!(m.stats().primary.ready_blocks, 2);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

// ------------------------------------------------------------------------------ capacity

/// DRAM of exactly one block, over the fs tier: blocks cascade, evict each other, and come
/// back from fs with their bytes.
#[test]
fn one_block_of_dram_over_fs() {
    let dir = tempfile::tempdir().unwrap();
    let m = kv_tier::builder(fs_cfg(dir.path(), 1, BS, r#", "checksum": "crc32c""#))
        .unwrap()
        .build_blocking()
        .unwrap();
    assert_eq!(m.stats().primary.capacity_blocks, 1);
    let keys: Vec<BlockKey> = (0..5).map(test_key).collect();
    for (i, k) in keys.iter().enumerate() {
        store(&m, i as u64, &[*k]);
        m.on_request_finished(RequestId(i as u64));
        idle(&m);
    }
    assert_eq!(m.stats().tiers[0].blocks_stored, 5);
    for (i, k) in keys.iter().enumerate() {
        let req = RequestContext::new(100 + i as u64);
        let v = settle(&m, k, &req, Duration::from_secs(5));
        assert_eq!(v, LookupResult::Hit, "{k}");
        assert!(load_and_verify(&m, &[*k]));
        m.on_schedule_end();
        m.on_request_finished(req.id);
    }
    // a two-block prefix cannot fit: the second is a miss, not a hang or an eviction of the first
    let req = RequestContext::new(200);
    let t0 = Instant::now();
    let c = loop {
        let c = m.lookup_prefix(&keys[..2], &req);
        if !c.retry && c.hit == c.present {
            break c;
        }
        step(&m);
        assert!(t0.elapsed() < Duration::from_secs(5), "{c:?}");
    };
    assert!(c.hit <= 1, "{c:?}");
    assert!(load_and_verify(&m, &keys[..c.hit]));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// Block sizes 1 and odd, over fs with checksums: round trips through fs are exact.
#[test]
fn odd_block_sizes_round_trip_through_fs() {
    for bs in [1usize, 7, 4097, 65537] {
        let dir = tempfile::tempdir().unwrap();
        let m = kv_tier::builder(fs_cfg(dir.path(), 4, bs, r#", "checksum": "crc32c""#))
            .unwrap()
            .build_blocking()
            .unwrap();
        let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
        store(&m, 1, &keys);
        m.on_request_finished(RequestId(1));
        idle(&m);
        let s = m.stats();
        assert_eq!(
            s.tiers[0].blocks_stored, 3,
            "bs {bs}: {:?}",
            s.tiers[0].store_failure_causes
        );
        m.runtime().block_on(m.reset_cache());
        let req = RequestContext::new(2);
        let t0 = Instant::now();
        loop {
            let c = m.lookup_prefix(&keys, &req);
            if c.hit == keys.len() {
                break;
            }
            assert!(c.present == keys.len() || c.retry, "bs {bs}: {c:?}");
            step(&m);
            assert!(t0.elapsed() < Duration::from_secs(5), "bs {bs}: {c:?}");
        }
        assert!(load_and_verify(&m, &keys), "bs {bs}");
        m.on_schedule_end();
        m.on_request_finished(req.id);
        assert_clean(&m);
        m.shutdown_blocking().unwrap();
    }
}

/// A pool smaller than one page-rounded slot: refused at construction naming the field, or
/// it holds at least the one block the config promised (`cpu_bytes_to_use`: "Must hold at
/// least one block").
#[test]
fn a_pool_smaller_than_one_rounded_slot() {
    for (cpu, bs) in [(5000u64, 4097u64), (1, 1), (4095, 7)] {
        let c = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {cpu}, "block_size_bytes": {bs}}}"#
        ));
        let c = match c {
            Err(e) => {
                assert!(e.to_string().contains("cpu_bytes_to_use"), "{e}");
                continue;
            }
            Ok(c) => c,
        };
        match kv_tier::builder(c).and_then(|b| b.build_blocking()) {
            Err(e) => assert!(
                e.to_string().contains("cpu_bytes_to_use"),
                "({cpu}, {bs}): {e}"
            ),
            Ok(m) => {
                let cap = m.stats().primary.capacity_blocks;
                let r = m.prepare_store(&[test_key(1)]).map(|p| p.keys().len());
                assert!(
                    cap >= 1 && r.is_ok(),
                    "({cpu}, {bs}): accepted, but the pool holds {cap} blocks and a store of one gives {r:?}"
                );
            }
        }
    }
}

/// Many keys in one lookup, present in a tier, with a small DRAM: non-blocking, bounded by
/// DRAM, every hit right, everything released at the end.
#[test]
fn a_huge_prefix_over_a_small_dram() {
    let t = Script::new("mem", BS);
    let m = build(cfg(8, BS, ""), vec![t.clone()]);
    let keys: Vec<BlockKey> = (0..2000).map(test_key).collect();
    put(&m, &t, &keys);
    let req = RequestContext::new(1);
    let t0 = Instant::now();
    let c = loop {
        // (that a lookup does not wait for the tier is shown without a clock by
        // `a_huge_lookup_returns_while_the_tier_has_not_answered`)
        let c = m.lookup_prefix(&keys, &req);
        if !c.retry && c.hit == c.present {
            break c;
        }
        step(&m);
        assert!(t0.elapsed() < Duration::from_secs(60), "{c:?}");
    };
    assert!(c.hit >= 1 && c.hit <= 8, "{c:?}");
    assert!(load_and_verify(&m, &keys[..c.hit]));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// 200k keys, nothing anywhere, over fs: all settle to Miss, and nothing is left behind.
/// (That one lookup call does not wait for the tier is shown without a clock by
/// `a_huge_lookup_returns_while_the_tier_has_not_answered`.)
#[test]
fn a_huge_lookup_of_missing_keys_over_fs() {
    let dir = tempfile::tempdir().unwrap();
    let m = kv_tier::builder(fs_cfg(dir.path(), 8, BS, ""))
        .unwrap()
        .build_blocking()
        .unwrap();
    let keys: Vec<BlockKey> = (0..200_000).map(test_key).collect();
    let req = RequestContext::new(1);
    let v = m.lookup_many(&keys, &req);
    assert!(v.iter().all(|r| *r == LookupResult::Retry));
    m.on_schedule_end();
    let t0 = Instant::now();
    loop {
        let v = m.lookup_many(&keys, &req);
        if v[0] == LookupResult::Miss {
            break;
        }
        step(&m);
        assert!(t0.elapsed() < Duration::from_secs(60), "never settled");
    }
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// 200k keys asked of a tier whose existence checks are held: `lookup_many` and
/// `on_schedule_end` return while no answer can have come (the probe is sent off the
/// caller's thread); once the tier answers, every key settles to Miss.
#[test]
fn a_huge_lookup_returns_while_the_tier_has_not_answered() {
    let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let gate = t.hold_lookups();
    let m = build(cfg(8, BS, r#", "probe_timeout_s": 600"#), vec![t.clone()]);
    let keys: Vec<BlockKey> = (0..200_000).map(test_key).collect();
    let req = RequestContext::new(1);
    let v = m.lookup_many(&keys, &req);
    assert!(v.iter().all(|r| *r == LookupResult::Retry));
    m.on_schedule_end();
    let t0 = Instant::now();
    while gate.arrived() == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the probe never reached the tier"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(!gate.is_open(), "returned only once the tier could answer");
    assert!(
        m.lookup_many(&keys, &req)
            .iter()
            .all(|r| *r == LookupResult::Retry),
        "a verdict without an answer"
    );
    gate.open();
    loop {
        let v = m.lookup_many(&keys, &req);
        if v.iter().all(|r| *r == LookupResult::Miss) {
            break;
        }
        step(&m);
        assert!(t0.elapsed() < Duration::from_secs(60), "never settled");
    }
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// Many threads looking up overlapping prefixes while others store new blocks into a small
/// DRAM: every block served has its bytes, nothing hangs, nothing is left behind.
#[test]
fn concurrent_requests_over_overlapping_prefixes_under_eviction() {
    let t = Script::new("mem", BS);
    let m = build(cfg(12, BS, ""), vec![t.clone()]);
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
    let m = kv_tier::builder(fs_cfg(
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
        store(&m, i as u64, chunk);
        m.on_request_finished(RequestId(i as u64));
        m.on_schedule_end();
        if i % 5 == 0 {
            idle(&m);
        }
    }
    idle(&m);
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
        if settle(&m, k, &req, Duration::from_secs(5)) == LookupResult::Hit {
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

// ------------------------------------------------------------------------------ write-back

/// A `wait` tier's reservation by a prepared store is given back when the store is dropped
/// uncommitted: the next store is not refused forever.
#[test]
fn an_aborted_store_gives_back_its_write_back_reservation() {
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS},
            "secondary_tiers": [{{"type": "memory", "write_back_policy": "wait", "write_back_limit_mb": 0.0078125}}]}}"#,
        64 * BS
    ))
    .unwrap();
    let mut reg = kv_tier::registry();
    MemoryTier::register(&mut reg).unwrap();
    let m = kv_tier::builder(c)
        .unwrap()
        .registry(reg)
        .build_blocking()
        .unwrap();
    // the limit: 2 blocks
    for round in 0..10u64 {
        let keys = [test_key(round * 2), test_key(round * 2 + 1)];
        let p = m
            .prepare_store(&keys)
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        drop(p);
    }
    // and a prepared store that is refused does not reserve anything either
    let p = m.prepare_store(&[test_key(500), test_key(501)]).unwrap();
    let refused = m.prepare_store(&[test_key(502), test_key(503)]);
    assert!(
        matches!(refused, Err(Error::WriteBackFull { .. })),
        "{refused:?}"
    );
    drop(p);
    store(&m, 1, &[test_key(600), test_key(601)]);
    m.on_request_finished(RequestId(1));
    idle(&m);
    assert_eq!(m.stats().tiers[0].blocks_stored, 2);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

// ------------------------------------------------------------------------------ config

fn field_of(e: &Error) -> String {
    match e {
        Error::InvalidConfig { field, .. } => field.clone(),
        other => format!("<not InvalidConfig: {other}>"),
    }
}

/// Every documented range: both ends accepted, just beyond refused naming the field.
#[test]
fn every_manager_range_is_checked_at_its_documented_ends() {
    // (field, documented min, documented max, integer)
    let ranges: &[(&str, f64, f64, bool)] = &[
        ("probe_timeout_s", 0.001, 600.0, false),
        ("job_timeout_s", 0.01, 86_400.0, false),
        ("job_timeout_per_block_s", 0.0, 3_600.0, false),
        ("lease_s", 0.001, 86_400.0, false),
        ("shutdown_timeout_s", 0.01, 86_400.0, false),
        ("write_back_max_dram_fraction", 0.01, 1.0, false),
        ("blocks_per_chunk", 1.0, 65_536.0, true),
        // `store_threshold`: "range 0 to 10,000" (KvTierConfig::store_threshold)
        ("store_threshold", 0.0, 10_000.0, true),
        ("max_tracker_size", 1.0, 100_000_000.0, true),
        ("event_buffer_keys", 1.0, 1e10, true),
    ];
    let mut problems = Vec::new();
    for &(field, min, max, int) in ranges {
        let text = |v: String| {
            format!(r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536, "{field}": {v}}}"#)
        };
        let fmt = |v: f64| {
            if int {
                format!("{}", v as u64)
            } else {
                format!("{v}")
            }
        };
        for v in [min, max] {
            if let Err(e) = KvTierConfig::from_json_str(&text(fmt(v))).and_then(|c| c.validate()) {
                problems.push(format!("{field} = {} refused: {e}", fmt(v)));
            }
        }
        let below = if int {
            (min - 1.0, min >= 1.0)
        } else {
            (min - min.max(1e-9) * 0.5 - 1e-9, true)
        };
        let above = if int { max + 1.0 } else { max * 1.001 };
        let mut outs = vec![fmt(above)];
        if below.1 {
            outs.push(fmt(below.0));
        }
        outs.push("-1".into());
        for v in outs {
            match KvTierConfig::from_json_str(&text(v.clone())) {
                Ok(_) => problems.push(format!("{field} = {v} accepted")),
                Err(e) if !e.to_string().contains(field) => {
                    problems.push(format!("{field} = {v} refused without naming it: {e}"))
                }
                Err(_) => {}
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// The per-tier manager options: both documented ends accepted, beyond refused naming the
/// field at construction.
#[test]
fn every_tier_option_range_is_checked_at_its_documented_ends() {
    let ranges: &[(&str, &[&str], &[&str])] = &[
        (
            "probe_budget_s",
            &["0.0001", "600"],
            &["0.00009", "601", "-1", "0"],
        ),
        (
            "write_back_limit_mb",
            &["0.000001", "1e9"],
            &["0.0000009", "1.1e9", "-1", "0"],
        ),
        ("admit_after_lookups", &["0", "10000"], &["10001", "-1"]),
        (
            "write_budget_mb_per_s",
            &["0.001", "1e9"],
            &["0.0009", "1.1e9", "-1", "0"],
        ),
    ];
    let mut problems = Vec::new();
    for &(field, ok, bad) in ranges {
        let attempt = |v: &str| -> Result<TieringManager, Error> {
            let c = KvTierConfig::from_json_str(&format!(
                r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536,
                    "secondary_tiers": [{{"type": "memory", "{field}": {v}}}]}}"#
            ))?;
            let mut reg = kv_tier::registry();
            MemoryTier::register(&mut reg).unwrap();
            kv_tier::builder(c)?.registry(reg).build_blocking()
        };
        for v in ok {
            match attempt(v) {
                Ok(m) => m.shutdown_blocking().unwrap(),
                Err(e) => problems.push(format!("{field} = {v} refused: {e}")),
            }
        }
        for v in bad {
            match attempt(v) {
                Ok(m) => {
                    problems.push(format!("{field} = {v} accepted"));
                    m.shutdown_blocking().unwrap();
                }
                Err(e) if !field_of(&e).contains(field) && !e.to_string().contains(field) => {
                    problems.push(format!("{field} = {v} refused without naming it: {e}"))
                }
                Err(_) => {}
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// A runtime without timers is refused at construction (deadlines need them), not at the
/// first probe; `shutdown_blocking` inside a runtime is refused, not a panic.
#[test]
fn runtime_misuse_is_refused_cleanly() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let r = kv_tier::builder(cfg(4, BS, ""))
        .unwrap()
        .tier(Script::new("mem", BS))
        .runtime(rt.handle().clone())
        .build_blocking();
    assert!(r.is_err(), "a runtime without timers was accepted");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let m = rt.block_on(async {
        kv_tier::builder(cfg(4, BS, ""))
            .unwrap()
            .tier(Script::new("mem", BS))
            .build()
            .await
            .unwrap()
    });
    let r = rt.block_on(async { m.shutdown_blocking() });
    assert!(
        r.is_err(),
        "shutdown_blocking inside a runtime was not refused"
    );
    rt.block_on(m.shutdown()).unwrap();
}

// ------------------------------------------------------------------------------ more attacks

/// A slow probe past the tier's `probe_budget_s`: the asking request is told `Miss` within
/// the budget, and the late answer serves the next request ("a late answer still serves
/// later lookups").
#[test]
fn a_late_probe_answer_serves_the_next_request() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("slow", BS))));
    let opts = kv_tier::TierOptions {
        probe_budget_s: Some(0.01),
        ..Default::default()
    };
    // the probe deadline far past the budget: the probe is held, not timed out
    let m = kv_tier::builder(cfg(8, BS, r#", "probe_timeout_s": 60"#))
        .unwrap()
        .tier_with_options(f.clone(), opts)
        .build_blocking()
        .unwrap();
    let k = test_key(1);
    let r = m.runtime().block_on(store_keys(&**f.inner(), &[k], 0, BS));
    assert!(r.is_success());
    // the probe answers only once the gate opens: `Miss` while it is shut is the budget's
    let gate = f.hold_lookups();
    let r1 = RequestContext::new(1);
    assert_eq!(
        settle(&m, &k, &r1, Duration::from_secs(30)),
        LookupResult::Miss
    );
    assert!(!gate.is_open());
    m.on_schedule_end();
    gate.open();
    idle(&m); // the late answer lands
    let r2 = RequestContext::new(2);
    let v = m.lookup(&k, &r2);
    assert_eq!(
        v,
        LookupResult::HitPending,
        "the late answer did not serve the next request"
    );
    assert_eq!(
        settle(&m, &k, &r2, Duration::from_secs(30)),
        LookupResult::Hit
    );
    assert!(load_and_verify(&m, &[k]));
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r2.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A tier that panics in every call (probe, load, protect): the scheduler thread never sees a
/// panic, lookups settle, stores still complete in DRAM.
#[test]
fn a_tier_that_panics_everywhere_costs_only_misses() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("boom", BS))));
    let m = build(cfg(8, BS, ""), vec![f.clone()]);
    let k = test_key(1);
    let r = m.runtime().block_on(store_keys(&**f.inner(), &[k], 0, BS));
    assert!(r.is_success());
    f.panic_on_lookup(true);
    f.panic_on_load(true);
    f.panic_on_protect(true);
    let req = RequestContext::new(1);
    assert_eq!(
        settle(&m, &k, &req, Duration::from_secs(30)),
        LookupResult::Miss
    );
    store(&m, 1, &[test_key(2)]);
    assert_eq!(m.lookup(&test_key(2), &req), LookupResult::Hit);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    f.heal();
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A view from `prepare_load` held across `reset_cache` and DRAM pressure keeps its bytes:
/// its slot is never reused under it.
#[test]
fn a_held_view_survives_reset_and_pressure_with_its_bytes() {
    let t = Script::new("mem", BS);
    let m = build(cfg(4, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    store(&m, 1, &[k]);
    let view = m.prepare_load(&[k]).unwrap();
    let left = m.runtime().block_on(m.reset_cache());
    assert_eq!(left, 1);
    for round in 0..10u64 {
        let keys: Vec<BlockKey> = (0..4).map(|i| test_key(100 + round * 4 + i)).collect();
        if let Ok(mut p) = m.prepare_store(&keys) {
            for (_, s) in p.slots() {
                s.as_mut_slice().fill(0x5A);
            }
            p.commit(RequestId(2));
        }
        let _ = m.prepare_store(&keys[..3]).map(|mut p| {
            for (_, s) in p.slots() {
                s.as_mut_slice().fill(0xA5);
            }
            p.commit(RequestId(2))
        });
        assert!(
            verify_block(&k, 0, view[0].as_slice()),
            "round {round}: a pinned slot was reused"
        );
    }
    drop(view);
    m.on_request_finished(RequestId(1));
    m.on_request_finished(RequestId(2));
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// The engine computes a block that a promotion is bringing in: `prepare_store` calls it
/// `present` ("nothing to do"). If that promotion then fails, the key misses (as
/// `PendingStore::present` says: the block is computed again), never a wrong or torn block,
/// and a new store of it lands.
#[test]
fn a_store_answered_present_because_of_a_promotion_that_then_fails() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build(cfg(8, BS, ""), vec![f.clone()]);
    let k = test_key(1);
    let r = m.runtime().block_on(store_keys(&**f.inner(), &[k], 0, BS));
    assert!(r.is_success());
    let gate = f.hold_loads();
    f.fail_load(&[k]);
    let r1 = RequestContext::new(1);
    assert_eq!(m.lookup(&k, &r1), LookupResult::Retry);
    step(&m);
    assert_eq!(m.lookup(&k, &r1), LookupResult::HitPending);
    m.on_schedule_end();
    m.runtime().block_on(gate.wait_arrived(1));
    // request 2 recomputed the block and offloads it
    let mut p = m.prepare_store(&[k]).unwrap();
    let written = p.keys().len();
    let present = p.present().to_vec();
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    p.commit(RequestId(2));
    gate.open();
    idle(&m);
    let r3 = RequestContext::new(3);
    let v = settle(&m, &k, &r3, Duration::from_secs(30));
    assert_eq!(written, 0, "the key was being promoted: nothing to write");
    assert_eq!(present, vec![k], "answered present while its promotion ran");
    assert_eq!(
        v,
        LookupResult::Miss,
        "the promotion failed: the key must miss, not hang or be served"
    );
    // computed again: the new store lands and is served whole
    let mut p = m.prepare_store(&[k]).unwrap();
    assert_eq!(p.keys(), vec![k]);
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    p.commit(RequestId(3));
    idle(&m);
    let r4 = RequestContext::new(4);
    assert_eq!(
        settle(&m, &k, &r4, Duration::from_secs(30)),
        LookupResult::Hit
    );
    m.on_schedule_end();
    for r in 1..=4 {
        m.on_request_finished(RequestId(r));
    }
    f.heal();
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// Shutdown from one thread while others look up and store: no hang, no panic; afterwards
/// DRAM-only service.
#[test]
fn shutdown_concurrent_with_traffic() {
    let t = Script::new("mem", BS);
    let m = build(cfg(16, BS, ""), vec![t.clone()]);
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
            std::thread::sleep(Duration::from_millis(300));
            let r = m.shutdown_blocking();
            let _ = tx.send(r.is_ok());
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
    idle(&m);
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
    let c = fs_cfg(dir.path(), 16, 65536, "");
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
                store(&m, i, &keys);
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

/// `event_buffer_keys` bounds every buffer; the excess is counted.
#[test]
fn event_buffers_are_bounded() {
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "event_buffer_keys": 3,
            "secondary_tiers": [{{"type": "memory", "enable_kv_events": true}}]}}"#,
        4 * BS
    ))
    .unwrap();
    let mut reg = kv_tier::registry();
    MemoryTier::register(&mut reg).unwrap();
    let m = kv_tier::builder(c)
        .unwrap()
        .registry(reg)
        .build_blocking()
        .unwrap();
    for i in 0..10u64 {
        store(&m, i, &[test_key(i * 2), test_key(i * 2 + 1)]);
        m.on_request_finished(RequestId(i));
        idle(&m);
    }
    let ev = m.take_events();
    let mut per: std::collections::HashMap<String, usize> = Default::default();
    for e in &ev {
        *per.entry(e.tier.clone()).or_default() += e.keys.len();
    }
    for (tier, n) in &per {
        assert!(
            *n <= 3,
            "{tier}: {n} event keys held with event_buffer_keys = 3"
        );
    }
    assert!(m.stats().events_dropped > 0);
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
        let m = kv_tier::builder(fs_cfg(dir.path(), 16, bs, ""))
            .unwrap()
            .build_blocking()
            .unwrap();
        for (i, c) in keys.chunks(8).enumerate() {
            store(&m, i as u64, c);
            m.on_request_finished(RequestId(i as u64));
            idle(&m);
        }
        assert_eq!(m.stats().tiers[0].blocks_stored, 48);
        m.shutdown_blocking().unwrap();
    }
    let mut c = fs_cfg(dir.path(), 6, bs, "");
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
    let drained = Instant::now() + Duration::from_secs(60);
    loop {
        idle(&m);
        match m.prepare_store(&fresh) {
            Ok(p) if p.keys().len() + p.present().len() == cap as usize => {
                p.abort();
                break;
            }
            Ok(p) => p.abort(),
            Err(_) => {}
        }
        assert!(
            Instant::now() < drained,
            "DRAM slots still held 60 s after the last job"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A tiny lease (it expires before the promotion is even sent): the promotion still lands
/// right, for the asking request and a joiner.
#[test]
fn a_lease_expiring_before_its_promotion_is_sent() {
    let t = Script::new("mem", BS);
    let m = build(cfg(8, BS, r#", "lease_s": 0.001"#), vec![t.clone()]);
    let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
    put(&m, &t, &keys);
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    m.lookup_many(&keys, &r1);
    step(&m);
    std::thread::sleep(Duration::from_millis(20));
    let v = m.lookup_many(&keys, &r1);
    std::thread::sleep(Duration::from_millis(20));
    let v2 = m.lookup_many(&keys, &r2);
    println!("{v:?} {v2:?}");
    m.on_schedule_end();
    idle(&m);
    for r in [&r1, &r2] {
        let t0 = Instant::now();
        loop {
            let c = m.lookup_prefix(&keys, r);
            if c.hit == keys.len() {
                break;
            }
            step(&m);
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

/// DRAM entirely pinned by the engine's views: a promotion is refused as a `Miss` (counted),
/// never a hang; once the views go, the block is promoted.
#[test]
fn promotions_into_a_fully_pinned_dram_are_refused_then_work() {
    let t = Script::new("mem", BS);
    let m = build(cfg(2, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    put(&m, &t, &[k]);
    let pinned = [test_key(10), test_key(11)];
    store(&m, 9, &pinned);
    let views = m.prepare_load(&pinned).unwrap();
    let r1 = RequestContext::new(1);
    assert_eq!(
        settle(&m, &k, &r1, Duration::from_secs(30)),
        LookupResult::Miss
    );
    assert!(m.stats().promotions_refused >= 1);
    drop(views);
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    let r2 = RequestContext::new(2);
    assert_eq!(
        settle(&m, &k, &r2, Duration::from_secs(30)),
        LookupResult::Hit
    );
    assert!(load_and_verify(&m, &[k]));
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    m.on_request_finished(RequestId(9));
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A request allowed no tier (or an unknown one) gets `Miss` at once, never `Retry`.
#[test]
fn a_request_filtering_out_every_tier_misses_at_once() {
    let t = Script::new("mem", BS);
    let m = build(cfg(8, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    put(&m, &t, &[k]);
    for req in [
        RequestContext::new(1).only_tiers(["nope"]),
        RequestContext::new(2).skip_tiers(["mem"]),
    ] {
        assert_eq!(m.lookup(&k, &req), LookupResult::Miss);
        m.on_schedule_end();
        m.on_request_finished(req.id);
    }
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// An engine that also calls `poll` between steps (a metrics thread, say) with a short lease
/// (`lease_s` 0.005, inside its documented range 0.001 to 86,400): the key must still settle
/// to Hit or Miss ("no key stays out of Hit/Miss for long"), not re-probe forever.
#[test]
fn a_short_lease_with_polling_between_steps_still_settles() {
    let t = Script::new("mem", BS);
    let m = build(cfg(8, BS, r#", "lease_s": 0.005"#), vec![t.clone()]);
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
