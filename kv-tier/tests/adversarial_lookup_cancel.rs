//! Adversarial tests, through the public API and documentation only, of (1) the async lookup
//! and its generation guard (`ProbeCache`, leases, `Retry`/`HitPending`/`Hit`/`Miss`,
//! `lookup_prefix`, late answers, `probe_budget_s`) and (2) the cancellation safety of the
//! async entry points: the manager's `build`, `wait_idle`, `wait_jobs`, `reset_cache`,
//! `shutdown`, and the fs and obj tiers' `SecondaryTier` methods driven directly.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::task::Poll;
use std::time::{Duration, Instant};

use LookupResult::{Hit, HitPending, Miss, Retry};
use kv_tier::fs::{Checksum, FsTier, FsTierConfig};
use kv_tier::obj::{ObjChecksum, ObjTier, ObjTierConfig, Scheme};
use kv_tier::{
    AlignedBuf, BlockKey, BlockSink, BlockSource, BuildContext, Error, KvTierConfig, LoadJob,
    LookupResult, Namespace, Presence, ProbeCache, RequestContext, RequestId, RunFields,
    SecondaryTier, StoreJob, TierBuilder, TierOptions, TierSpec, TieringManager, async_trait,
    count_prefix,
};
use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};
use kv_tier_testkit::{
    FaultyTier, Gate, MemoryTier, fill_block, find_files, load_keys, store_keys, temp_root,
    test_key, verify_block,
};

// ------------------------------------------------------------------------------ helpers

const BS: usize = 4096;
const LIMIT: Duration = Duration::from_secs(30);

/// Tests that count the process's threads run alone: they take this lock for writing, every
/// other test for reading.
static SERIAL: RwLock<()> = RwLock::new(());

fn shared() -> RwLockReadGuard<'static, ()> {
    SERIAL.read().unwrap_or_else(|e| e.into_inner())
}

fn exclusive() -> RwLockWriteGuard<'static, ()> {
    SERIAL.write().unwrap_or_else(|e| e.into_inner())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("adv-rt")
        .enable_all()
        .build()
        .unwrap()
}

fn ns() -> Namespace {
    Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap()
}

const LAYOUT: &str =
    r#""layout": {"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}"#;

/// A manager config: `slots` DRAM blocks of `bs` bytes, plus `extra` top-level fields.
fn mcfg_bs(slots: usize, bs: usize, extra: &str) -> KvTierConfig {
    let slot = bs.div_ceil(4096) * 4096;
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}{extra}}}"#,
        slots * slot
    ))
    .unwrap()
}

fn mcfg(slots: usize, extra: &str) -> KvTierConfig {
    mcfg_bs(slots, BS, extra)
}

fn fs_config(root: &Path) -> FsTierConfig {
    let mut c = FsTierConfig::new(root);
    c.checksum = Checksum::Crc32c;
    c.n_read_threads = 2;
    c.n_write_threads = 2;
    c
}

fn open_fs(root: &Path, bs: usize) -> Arc<FsTier> {
    Arc::new(FsTier::open("fs", fs_config(root), ns(), bs).unwrap())
}

/// A real fs tier in `root` wrapped in a `FaultyTier` (for gates).
fn faulty_fs(root: &Path) -> (Arc<FsTier>, Arc<FaultyTier>) {
    let fs = open_fs(root, BS);
    let faulty = Arc::new(FaultyTier::new(fs.clone()));
    (fs, faulty)
}

fn faulty_mem() -> (Arc<MemoryTier>, Arc<FaultyTier>) {
    faulty_mem_named("mem")
}

fn faulty_mem_named(name: &str) -> (Arc<MemoryTier>, Arc<FaultyTier>) {
    let mem = Arc::new(MemoryTier::new(name, BS));
    let faulty = Arc::new(FaultyTier::new(mem.clone()));
    (mem, faulty)
}

fn manager(cfg: KvTierConfig, tiers: Vec<Arc<dyn SecondaryTier>>) -> TieringManager {
    let mut b = kv_tier::builder(cfg).unwrap();
    for t in tiers {
        b = b.tier(t);
    }
    b.build_blocking().unwrap()
}

fn ctx(id: u64) -> RequestContext {
    RequestContext::new(id)
}

/// The engine's store: prepare, fill each new block with its bytes (salt 0), commit.
fn store(m: &TieringManager, req: u64, keys: &[BlockKey]) {
    let mut p = m.prepare_store(keys).expect("store refused");
    for (k, s) in p.slots() {
        fill_block(k, 0, s.as_mut_slice());
    }
    p.commit(RequestId(req));
}

fn block_on<F: Future>(m: &TieringManager, f: F) -> F::Output {
    m.runtime().block_on(f)
}

fn idle(m: &TieringManager) {
    block_on(m, async {
        tokio::time::timeout(Duration::from_secs(60), m.wait_idle())
            .await
            .expect("wait_idle did not return within 60 s")
    })
}

fn jobs(m: &TieringManager) {
    block_on(m, async {
        tokio::time::timeout(Duration::from_secs(60), m.wait_jobs())
            .await
            .expect("wait_jobs did not return within 60 s")
    })
}

/// Stores `n` fresh junk keys (request `req`, finished) so every older DRAM block is evicted,
/// and lets their cascades land.
fn flush_dram(m: &TieringManager, req: u64) {
    let n = m.stats().primary.capacity_blocks;
    let junk: Vec<BlockKey> = (0..n as u64)
        .map(|i| test_key(50_000_000 + req * 1000 + i))
        .collect();
    store(m, req, &junk);
    m.on_request_finished(RequestId(req));
    jobs(m);
}

/// Polls until `f` holds or `limit` passes; returns whether it held.
fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        if f() {
            return true;
        }
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Steps `req`'s lookups of `key` until `Hit` or `Miss` (bounded); returns the end and every
/// verdict seen.
fn settle(
    m: &TieringManager,
    key: &BlockKey,
    req: &RequestContext,
) -> (LookupResult, Vec<LookupResult>) {
    let t0 = Instant::now();
    let mut seen = Vec::new();
    loop {
        let v = m.lookup(key, req);
        seen.push(v);
        if matches!(v, Hit | Miss) {
            return (v, seen);
        }
        m.on_schedule_end();
        assert!(
            t0.elapsed() < LIMIT,
            "{key} stuck out of Hit/Miss for {LIMIT:?}: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(3));
    }
}

/// `prepare_load` of `keys` succeeds and every view holds the stored bytes.
fn load_verify(m: &TieringManager, keys: &[BlockKey]) {
    let views = m
        .prepare_load(keys)
        .expect("prepare_load of Hit keys failed");
    assert_eq!(views.len(), keys.len());
    for (k, v) in keys.iter().zip(&views) {
        assert!(verify_block(k, 0, v.as_slice()), "{k}: wrong bytes served");
    }
}

/// After every request finished: the manager idle, nothing tracked, leased, held or pinned,
/// no key of `keys` protected in any tier (bounded: a tier's own threads may still let go),
/// and the whole DRAM pool reusable at once.
fn assert_clean(m: &TieringManager, keys: &[BlockKey]) {
    idle(m);
    let s = m.stats();
    assert_eq!(s.held_blocks, 0, "held blocks left: {s:#?}");
    assert_eq!(s.holding_requests, 0, "holding requests left");
    assert_eq!(s.write_back_pinned_bytes, 0, "write-back pins left");
    assert_eq!(s.primary.writing_blocks, 0, "DRAM slots left Writing");
    for t in &s.tiers {
        assert_eq!(t.write_back_bytes, 0, "{}: write-back bytes left", t.name);
        assert_eq!(t.tracked_keys, 0, "{}: tracked keys left", t.name);
        assert_eq!(t.tracked_requests, 0, "{}: tracked requests left", t.name);
    }
    assert!(
        wait_until(LIMIT, || m.stats().tiers.iter().all(|t| t.leased_keys == 0)),
        "leases left: {:?}",
        m.stats()
            .tiers
            .iter()
            .map(|t| t.leased_keys)
            .collect::<Vec<_>>()
    );
    for t in m.tiers() {
        assert!(
            wait_until(LIMIT, || keys.iter().all(|k| !t.is_protected(k))),
            "{}: keys still protected: {:?}",
            t.info().name,
            keys.iter()
                .filter(|k| t.is_protected(k))
                .collect::<Vec<_>>()
        );
    }
    let cap = s.primary.capacity_blocks;
    let fresh: Vec<BlockKey> = (0..cap as u64).map(|i| test_key(90_000_000 + i)).collect();
    let p = m.prepare_store(&fresh);
    assert!(p.is_ok(), "DRAM not fully reusable: {:?}", p.err());
    let p = p.unwrap();
    assert_eq!(p.keys().len() + p.present().len(), cap);
    p.abort();
}

/// Polls `fut` up to `n` times (yielding between polls), then drops it unless it finished.
async fn poll_n<F: Future>(fut: F, n: usize) -> Option<F::Output> {
    let mut fut = pin!(fut);
    for i in 0..n {
        if let Poll::Ready(v) = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await
        {
            return Some(v);
        }
        if i + 1 < n {
            tokio::task::yield_now().await;
        }
    }
    None
}

/// Drops `fut` at the `i`-th of a spread of points: after 0..8 polls, or after a timeout of
/// a few hundred microseconds to tens of milliseconds.
async fn drop_at<F: Future>(fut: F, i: usize) -> Option<F::Output> {
    if i < 8 {
        poll_n(fut, i).await
    } else {
        let us = [50u64, 200, 500, 1_000, 3_000, 10_000, 30_000, 80_000][(i - 8) % 8];
        tokio::time::timeout(Duration::from_micros(us), fut)
            .await
            .ok()
    }
}

/// Threads of this process whose name passes `pred`.
fn threads_where(pred: impl Fn(&str) -> bool) -> usize {
    let Ok(rd) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    rd.flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .map(|c| pred(c.trim_end()))
                .unwrap_or(false)
        })
        .count()
}

fn fs_threads() -> usize {
    threads_where(|n| n.starts_with("kv-fs"))
}

fn tmp_files(root: &Path) -> Vec<PathBuf> {
    find_files(root, ".tmp")
}

/// A block source over the key's bytes whose owner counts itself while alive (a DRAM pin).
struct Tracked {
    buf: AlignedBuf,
    live: Arc<AtomicUsize>,
}

impl AsRef<[u8]> for Tracked {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_slice()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

fn tracked_source(key: &BlockKey, bs: usize, live: &Arc<AtomicUsize>) -> BlockSource {
    let mut buf = AlignedBuf::zeroed(bs);
    fill_block(key, 0, buf.as_mut_slice());
    live.fetch_add(1, Ordering::SeqCst);
    BlockSource::from_owner(Tracked {
        buf,
        live: live.clone(),
    })
}

fn store_job(keys: &[BlockKey], bs: usize, live: &Arc<AtomicUsize>) -> StoreJob {
    StoreJob {
        requests: Vec::new(),
        blocks: keys
            .iter()
            .map(|k| (*k, tracked_source(k, bs, live)))
            .collect(),
    }
}

/// Every sink of `readers` has been let go of (the reader gets its bytes back).
fn sinks_released(readers: &mut Vec<kv_tier::SinkReader>) -> bool {
    let mut left = Vec::new();
    for r in readers.drain(..) {
        if let Err(r) = r.into_bytes() {
            left.push(r);
        }
    }
    *readers = left;
    readers.is_empty()
}

fn obj_config(endpoint: &str, prefix: &str) -> ObjTierConfig {
    let mut c = ObjTierConfig::new(BUCKET);
    c.endpoint_override = Some(endpoint.to_string());
    c.access_key = Some(AK.to_string());
    c.secret_key = Some(SK.to_string());
    c.scheme = Scheme::Http;
    c.prefix = prefix.to_string();
    c.checksum = ObjChecksum::Crc32c;
    c.io_threads = 1;
    c.request_timeout_s = 5.0;
    c.max_retries = 0;
    c
}

/// Every object in the bucket (recursively, by delimiter listing).
async fn list_objects(tier: &ObjTier) -> Vec<String> {
    use kv_tier::obj::object_store::path::Path as OPath;
    let store = tier.object_store();
    let mut out = Vec::new();
    let mut dirs: Vec<Option<OPath>> = vec![None];
    while let Some(d) = dirs.pop() {
        let r = store
            .list_with_delimiter(d.as_ref())
            .await
            .expect("list the bucket");
        out.extend(r.objects.iter().map(|o| o.location.to_string()));
        dirs.extend(r.common_prefixes.into_iter().map(Some));
    }
    out.sort();
    out
}

// ------------------------------------------------------------------------------ 1. generation guard

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `ProbeCache`): "a completed store
/// ([`ProbeCache::mark_stored`]) ... makes every probe in flight for its keys stale, so a late
/// probe never overwrites it"; README: "a completed store bumps a per-key generation so a
/// late existence probe can never turn a present block into a miss". Here: a probe of the
/// real fs tier looks (absent) and is held; the key's store completes and the key leaves
/// DRAM; the probe's late "absent" must not make the asking request `Miss`.
#[test]
fn a_late_absent_probe_never_makes_a_stored_key_miss() {
    let _g = shared();
    let root = temp_root();
    let (fs, faulty) = faulty_fs(root.path());
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let gate = faulty.hold_lookups();
    let k = test_key(1);
    let r1 = ctx(1);
    assert_eq!(m.lookup(&k, &r1), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    // the probe has looked (absent) and waits to answer: now k's store completes
    store(&m, 2, &[k]);
    m.on_request_finished(RequestId(2));
    jobs(&m);
    assert!(fs.block_path(&k).exists(), "the cascade did not land in fs");
    flush_dram(&m, 3);
    assert_eq!(m.primary().lookup(&k), Miss, "k still in DRAM");
    gate.open();
    assert!(wait_until(LIMIT, || {
        m.poll();
        m.is_idle()
    }));
    let (end, seen) = settle(&m, &k, &r1);
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
    let (end, seen) = settle(&m, &k, &r4);
    assert_eq!(end, Hit, "{seen:?}");
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r4.id);
    assert_clean(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `mark_stored`): "A completed store: every
/// probe in flight for the keys is stale ..., and the keys are no longer a miss for any
/// request." A request answered `Miss` for an absent key, still running when the key's store
/// completes (and the key then leaves DRAM), must not be answered `Miss` from that old
/// negative answer.
#[test]
fn a_completed_store_clears_a_live_requests_earlier_miss() {
    let _g = shared();
    let root = temp_root();
    let (_fs, faulty) = faulty_fs(root.path());
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(11);
    let r1 = ctx(1);
    let (end, _) = settle(&m, &k, &r1);
    assert_eq!(end, Miss, "an absent key");
    store(&m, 2, &[k]);
    m.on_request_finished(RequestId(2));
    jobs(&m);
    flush_dram(&m, 3);
    assert_eq!(m.primary().lookup(&k), Miss);
    m.on_schedule_end();
    let first = m.lookup(&k, &r1);
    assert_ne!(
        first, Miss,
        "the request's old 'absent' outlived the completed store"
    );
    let (end, seen) = settle(&m, &k, &r1);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    assert_clean(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier README): kv-tier "never returns a wrong or torn block"; `LookupResult::Hit`
/// (kv-tier-core/src/request.rs): "In DRAM and readable now". A probe of the fs tier that
/// looked (present) and is held; the file is then deleted; the late "present" must never
/// end as a `Hit` (nothing can be loaded), only as a `Miss`; another request also misses.
#[test]
fn a_late_present_probe_for_a_deleted_block_never_becomes_a_hit() {
    let _g = shared();
    let root = temp_root();
    let (fs, faulty) = faulty_fs(root.path());
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(21);
    store(&m, 1, &[k]);
    m.on_request_finished(RequestId(1));
    jobs(&m);
    flush_dram(&m, 2);
    let gate = faulty.hold_lookups();
    let r = ctx(3);
    assert_eq!(m.lookup(&k, &r), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    std::fs::remove_file(fs.block_path(&k)).unwrap();
    gate.open();
    let (end, seen) = settle(&m, &k, &r);
    assert_eq!(end, Miss, "a deleted block answered {seen:?}");
    let r4 = ctx(4);
    let (end, seen) = settle(&m, &k, &r4);
    assert_eq!(end, Miss, "{seen:?}");
    m.on_schedule_end();
    m.on_request_finished(r.id);
    m.on_request_finished(r4.id);
    assert_clean(&m, &[k]);
    // the key stores and serves again
    store(&m, 5, &[k]);
    m.on_request_finished(RequestId(5));
    jobs(&m);
    flush_dram(&m, 6);
    let r7 = ctx(7);
    let (end, seen) = settle(&m, &k, &r7);
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
    let _g = shared();
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
    rt.block_on(async { tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await })
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
    let _g = shared();
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
    rt.block_on(async { tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await })
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
            Presence::Retry => assert!(t0.elapsed() < LIMIT, "stuck at Retry"),
        }
    }
    // 2. the same with the asking request alive
    let k2 = test_key(42);
    let gate2 = faulty.hold_lookups();
    assert_eq!(pc.ask(&k2, RequestId(3)), Presence::Retry);
    pc.flush();
    rt.block_on(async { tokio::time::timeout(LIMIT, gate2.wait_arrived(1)).await })
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
        assert!(t0.elapsed() < LIMIT);
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

// ------------------------------------------------------------------------------ 2. verdicts

/// Promise (kv-tier-core/src/config/mod.rs, `probe_timeout_s`): "A probe that has not
/// answered by then ... answers 'absent in this tier' for its keys, so no key waits in
/// `Retry` longer than this." Requests joining a held probe at every step each end at a
/// verdict (bounded), and once the tier answers again the key is served.
#[test]
fn every_request_joining_a_held_probe_leaves_retry_at_the_probe_deadline() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let m = manager(mcfg(4, r#", "probe_timeout_s": 0.2"#), vec![faulty.clone()]);
    let k = test_key(51);
    let rt = runtime();
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let gate = faulty.hold_lookups();
    let reqs: Vec<RequestContext> = (1..=10).map(ctx).collect();
    let mut done = vec![None; reqs.len()];
    let t0 = Instant::now();
    let mut step = 0;
    while done.iter().any(Option::is_none) {
        for (i, r) in reqs.iter().enumerate().take(step + 1) {
            if done[i].is_none() {
                let v = m.lookup(&k, r);
                if matches!(v, Hit | Miss) {
                    done[i] = Some(v);
                }
            }
        }
        m.on_schedule_end();
        step += 1;
        assert!(
            t0.elapsed() < LIMIT,
            "requests stuck out of Hit/Miss: {done:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(done.iter().all(|v| *v == Some(Miss)), "{done:?}");
    gate.open();
    let r = ctx(100);
    let (end, seen) = settle(&m, &k, &r);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    for r in reqs.iter().chain([&r]) {
        m.on_request_finished(r.id);
    }
    assert_clean(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/tier_options.rs, `probe_budget_s`): "how long a lookup waits for
/// this tier's probe before it counts the key as absent here for the asking request ... The
/// probe goes on until `probe_timeout_s`; a late answer still serves later lookups." A
/// request past the budget misses; the late "present" then serves the next request without
/// another probe (its first verdict is `HitPending`), which reads the right bytes.
#[test]
fn a_late_answer_past_the_budget_serves_the_next_request() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let k = test_key(61);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let opts = TierOptions {
        probe_budget_s: Some(0.01),
        ..Default::default()
    };
    let m = kv_tier::builder(mcfg(4, r#", "probe_timeout_s": 30"#))
        .unwrap()
        .tier_with_options(faulty.clone(), opts)
        .build_blocking()
        .unwrap();
    let gate = faulty.hold_lookups();
    let r1 = ctx(1);
    assert_eq!(m.lookup(&k, &r1), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(50)); // past the 10 ms budget
    assert_eq!(
        m.lookup(&k, &r1),
        Miss,
        "past its budget the request misses"
    );
    m.on_schedule_end();
    gate.open();
    assert!(wait_until(LIMIT, || {
        m.poll();
        m.is_idle()
    }));
    let r2 = ctx(2);
    let first = m.lookup(&k, &r2);
    assert_eq!(
        first, HitPending,
        "the late answer did not serve the next request"
    );
    let (end, seen) = settle(&m, &k, &r2);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    let p = m.stats().tiers[0].probes;
    assert!(p.over_budget >= 1 && p.late_answers >= 1, "{p:?}");
    assert_eq!(p.probes, 1, "the late answer was probed for again: {p:?}");
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r2.id);
    assert_clean(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier crate docs, the step loop): "Ask again next step for `HitPending` and
/// `Retry`; a probe has a deadline, so no key stays out of `Hit`/`Miss` for long"; config:
/// a job "that has not ended by then is abandoned (its future dropped) and every key of it
/// fails". Loads held forever: the promoting request and every joiner end (bounded), none
/// with a `Hit`, and nothing is left held; afterwards the key is served.
#[test]
fn hit_pending_with_loads_held_forever_ends_for_every_joiner() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let k = test_key(71);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let m = manager(
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
        assert!(t0.elapsed() < LIMIT, "stuck: {done:?} {seen:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(done.iter().all(|v| *v == Some(Miss)), "{done:?}");
    assert!(gate.arrived() >= 1);
    gate.open();
    m.on_schedule_end();
    for r in &reqs {
        m.on_request_finished(r.id);
    }
    assert_clean(&m, &[k]);
    let r = ctx(9);
    let (end, s) = settle(&m, &k, &r);
    assert_eq!(end, Hit, "{s:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r.id);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/mod.rs, `lookup_prefix`): "Looks up `keys` in prefix
/// order and counts the contiguous run of hits. Stops at the first `Miss`"; `lookup_many`:
/// "it stops after the first `Miss`, so the result may be shorter than `keys`"; `Hit`: "In
/// DRAM and readable now". Over a prefix whose 5th block exists nowhere: the count never
/// passes it, `lookup_prefix` agrees with the verdicts of `lookup_many` in the same step, and
/// the blocks counted as hits are loadable with their bytes at every step.
#[test]
fn lookup_prefix_never_counts_past_a_miss_and_its_hits_load() {
    let _g = shared();
    let root = temp_root();
    let fs = open_fs(root.path(), BS);
    let m = manager(mcfg(16, r#", "probe_timeout_s": 30"#), vec![fs.clone()]);
    let prefix: Vec<BlockKey> = (0..8).map(|i| test_key(80 + i)).collect();
    let stored: Vec<BlockKey> = prefix
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 4)
        .map(|(_, k)| *k)
        .collect();
    store(&m, 1, &stored);
    m.on_request_finished(RequestId(1));
    jobs(&m);
    assert_eq!(block_on(&m, m.reset_cache()), 0);
    let r = ctx(2);
    let t0 = Instant::now();
    loop {
        let verdicts = m.lookup_many(&prefix, &r);
        if let Some(p) = verdicts.iter().position(|v| *v == Miss) {
            assert_eq!(
                p + 1,
                verdicts.len(),
                "lookup_many went on past a Miss: {verdicts:?}"
            );
            assert_eq!(p, 4, "a stored block missed: {verdicts:?}");
        }
        let c = count_prefix(verdicts.iter().copied());
        let found = m.lookup_prefix(&prefix, &r);
        assert_eq!(
            (found.hit, found.present, found.retry),
            (c.hit, c.present, c.retry),
            "lookup_prefix disagrees with lookup_many in the same step: {verdicts:?}"
        );
        assert!(
            found.hit <= found.present && found.present <= 4,
            "{found:?}"
        );
        if found.hit > 0 {
            load_verify(&m, &prefix[..found.hit]);
        }
        m.on_schedule_end();
        if found.hit == 4 && verdicts.len() == 5 {
            break;
        }
        assert!(
            t0.elapsed() < LIMIT,
            "never reached 4 hits: {found:?} {verdicts:?}"
        );
        std::thread::sleep(Duration::from_millis(3));
    }
    m.on_request_finished(r.id);
    assert_clean(&m, &prefix);
    m.shutdown_blocking().unwrap();
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
    let _g = shared();
    let root = temp_root();
    let (fs, faulty) = faulty_fs(root.path());
    faulty.fail_every_nth_load(Some(5));
    let m = Arc::new(manager(
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
    assert_clean(&m, &all);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/mod.rs, `lookup`): the promoted block "is then held in
/// DRAM for `req` ... until `req` reads it ..., its prefix stops before it ..., or `req`
/// finishes"; ARCHITECTURE.md: "promotions already in flight land for others". The promoting
/// request finishes while its load is in flight; a joiner still gets its `Hit`; when every
/// asker finished mid-promotion, the landed block is held for nobody.
#[test]
fn requests_finishing_mid_promotion_strand_nothing() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let (k, k2) = (test_key(91), test_key(92));
    assert!(rt.block_on(store_keys(&*mem, &[k, k2], 0, BS)).is_success());
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let gate = faulty.hold_loads();
    let (r1, r2) = (ctx(1), ctx(2));
    assert_eq!(m.lookup(&k, &r1), Retry);
    m.on_schedule_end();
    idle(&m);
    assert_eq!(m.lookup(&k, &r1), HitPending);
    m.on_schedule_end(); // the load goes out, and waits at the gate
    block_on(&m, async {
        tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    assert_eq!(m.lookup(&k, &r2), HitPending, "a joiner");
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    gate.open();
    let (end, seen) = settle(&m, &k, &r2);
    assert_eq!(end, Hit, "the joiner was stranded: {seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    // every asker gone mid-promotion
    let gate = faulty.hold_loads();
    let r3 = ctx(3);
    assert_eq!(m.lookup(&k2, &r3), Retry);
    m.on_schedule_end();
    idle(&m);
    assert_eq!(m.lookup(&k2, &r3), HitPending);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    m.on_request_finished(r3.id);
    gate.open();
    assert_clean(&m, &[k, k2]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `ProbeCache`): "negative answers are kept
/// per request and dropped when it finishes." A request id reused after
/// `on_request_finished` starts clean: the old request's `Miss` does not answer the new one
/// for a block that arrived meanwhile.
#[test]
fn a_request_id_reused_after_finish_is_not_answered_by_the_old_miss() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(101);
    let (end, _) = settle(&m, &k, &ctx(1));
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
    let (end, seen) = settle(&m, &k, &again);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(again.id);
    assert_clean(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/mod.rs, `lookup`, and ARCHITECTURE.md §2.6: "when it
/// reaches 0 for a request that already finished, its lookup state is dropped"): a request
/// finished with a store in flight; its id is reused by a new request that gets a promotion;
/// the old store then lands. The new request still reaches `Hit` with the right bytes, and
/// when it finishes nothing is left tracked, held or leased.
#[test]
fn a_request_id_reused_while_its_old_store_is_in_flight() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let m = manager(mcfg(6, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let (k1, k2) = (test_key(111), test_key(112));
    assert!(rt.block_on(store_keys(&*mem, &[k2], 0, BS)).is_success());
    let stores = faulty.hold_stores();
    store(&m, 1, &[k1]);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(LIMIT, stores.wait_arrived(1)).await
    })
    .unwrap();
    m.on_request_finished(RequestId(1));
    let again = ctx(1);
    assert_eq!(m.lookup(&k2, &again), Retry);
    m.on_schedule_end();
    let t0 = Instant::now();
    while m.lookup(&k2, &again) != HitPending {
        m.on_schedule_end();
        assert!(t0.elapsed() < LIMIT);
        std::thread::sleep(Duration::from_millis(3));
    }
    // the old request's store lands while the new one's promotion is queued
    stores.open();
    jobs(&m);
    m.on_schedule_end();
    let (end, seen) = settle(&m, &k2, &again);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k2]);
    m.on_schedule_end();
    assert!(mem.contains(&k1), "the old store did not land");
    m.on_request_finished(again.id);
    assert_clean(&m, &[k1, k2]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs): "The first [`ProbeCache::ask`] of a key
/// returns [`Presence::Retry`] and queues one probe ... Positive answers are shared by all
/// requests"; ARCHITECTURE.md §3.4: "Other requests asking meanwhile see `HitPending` from
/// DRAM (slot `Writing`) and join the hold." The same fs key asked by 100 requests on 100
/// threads at once: one probe, one load, every request reads the right bytes, nothing left.
#[test]
fn the_same_key_asked_by_100_requests_at_once() {
    let _g = shared();
    let root = temp_root();
    let (_fs, faulty) = faulty_fs(root.path());
    let m = Arc::new(manager(
        mcfg(8, r#", "probe_timeout_s": 30"#),
        vec![faulty.clone()],
    ));
    let k = test_key(121);
    store(&m, 1, &[k]);
    m.on_request_finished(RequestId(1));
    jobs(&m);
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
            let (end, seen) = settle(&m, &k, &r);
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
    assert_clean(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs): the lease ends at expiry, "then the key is
/// probed again if asked; but an answer that expired before any ask used it is renewed once
/// and answered `Present`, so a lease shorter than the scheduler's steps cannot keep a key
/// at `Retry`"; `leased_keys`: "an expired lease is dropped by a reaper within a quarter
/// lease". With `lease_s` at its minimum (1 ms) and steps of 10 ms, requests over fs still
/// reach `Hit` for their whole prefix, and no lease or protection outlives them.
#[test]
fn leases_expiring_at_every_moment_never_keep_a_prefix_from_hit() {
    let _g = shared();
    let root = temp_root();
    let fs = open_fs(root.path(), BS);
    let m = manager(
        mcfg(16, r#", "probe_timeout_s": 30, "lease_s": 0.001"#),
        vec![fs.clone()],
    );
    let prefix: Vec<BlockKey> = (0..6).map(|i| test_key(130 + i)).collect();
    store(&m, 1, &prefix);
    m.on_request_finished(RequestId(1));
    jobs(&m);
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
                t0.elapsed() < LIMIT,
                "never all Hit: {:?}",
                &history[history.len().saturating_sub(5)..]
            );
            std::thread::sleep(Duration::from_millis(10 + 5 * n));
        }
        m.on_schedule_end();
        m.on_request_finished(r.id);
    }
    assert_clean(&m, &prefix);
    m.shutdown_blocking().unwrap();
}

// ------------------------------------------------------------------------------ 3. cancellation: manager

/// A tier type whose builder waits at a gate: parks `build()` after the tiers before it.
struct GatedBuilder {
    gate: Gate,
}

#[async_trait]
impl TierBuilder for GatedBuilder {
    async fn build(
        &self,
        _spec: &TierSpec,
        c: &BuildContext,
    ) -> kv_tier::Result<Arc<dyn SecondaryTier>> {
        self.gate.pass().await;
        Ok(Arc::new(MemoryTier::new(c.name.clone(), c.block_size)))
    }
}

fn gated_cfg(root: &Path) -> KvTierConfig {
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{{"type": "fs", "root_dir": {root:?}, "n_read_threads": 2,
                                  "n_write_threads": 2, "gc_max_size_gb": 1}},
                                {{"type": "gated"}}]}}"#
    ))
    .unwrap()
}

/// Promise (kv-tier-core/src/tier.rs): "Every async method must be cancellation-safe";
/// kv-tier crate docs §5 and `TieringManager` docs: the fs tier "stops its threads when the
/// last handle to it goes". A `build()` dropped while a later tier is still being built
/// (the fs tier already open, its threads running) leaves no fs thread behind, and the same
/// root builds again.
#[test]
fn a_build_dropped_after_the_fs_tier_opened_leaves_no_fs_thread() {
    let _g = exclusive();
    let rt = runtime();
    let root = temp_root();
    let base = fs_threads();
    let gate = Gate::new();
    let mut reg = kv_tier::registry();
    reg.register("gated", GatedBuilder { gate: gate.clone() })
        .unwrap();
    let during = rt.block_on(async {
        let b = kv_tier::builder(gated_cfg(root.path()))
            .unwrap()
            .registry(reg)
            .build();
        let mut b = pin!(b);
        let t0 = Instant::now();
        while gate.arrived() == 0 {
            if let Poll::Ready(r) =
                std::future::poll_fn(|cx| Poll::Ready(b.as_mut().poll(cx))).await
            {
                panic!("build finished past a closed gate: {:?}", r.err());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            assert!(t0.elapsed() < LIMIT, "the gated builder was never reached");
        }
        fs_threads()
    });
    assert!(
        during > base,
        "the fs tier had no threads running ({during} vs {base})"
    );
    assert!(
        wait_until(LIMIT, || fs_threads() <= base),
        "fs threads left after the build was dropped: {} (base {base})",
        fs_threads()
    );
    gate.open();
    let mut reg = kv_tier::registry();
    reg.register("gated", GatedBuilder { gate: gate.clone() })
        .unwrap();
    let m = rt
        .block_on(
            kv_tier::builder(gated_cfg(root.path()))
                .unwrap()
                .registry(reg)
                .build(),
        )
        .expect("the root builds again");
    rt.block_on(m.shutdown()).unwrap();
    drop(m);
    assert!(wait_until(LIMIT, || fs_threads() <= base));
}

/// Promise (kv-tier-core/src/tier.rs, cancellation): "its future may be dropped at any await
/// point ... no entry, claim, pin, permit or protection created by the call may outlive the
/// call's own work"; registry.rs: the fs open runs "on the runtime's blocking pool". A
/// `build()` of an fs manager dropped after 1, 2, ... polls (the open possibly still running
/// on the blocking pool) leaves no fs thread once that work ended, and no temp file.
#[test]
fn a_build_dropped_at_every_early_poll_leaves_no_fs_thread() {
    let _g = exclusive();
    let rt = runtime();
    let root = temp_root();
    let cfg = || {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "n_read_threads": 2,
                                      "n_write_threads": 2, "gc_max_size_gb": 1}}]}}"#,
            root.path()
        ))
        .unwrap()
    };
    let base = fs_threads();
    for i in 0..12 {
        let done = rt.block_on(drop_at(kv_tier::builder(cfg()).unwrap().build(), i));
        if let Some(m) = done {
            rt.block_on(m.unwrap().shutdown()).unwrap();
        }
        assert!(
            wait_until(LIMIT, || fs_threads() <= base),
            "drop point {i}: fs threads left: {} (base {base})",
            fs_threads()
        );
    }
    // an abandoned open may still be running on the blocking pool (its capability probe file
    // exists while it runs): once it ended, no thread and no file of it is left
    let settled = || {
        wait_until(LIMIT, || {
            fs_threads() <= base && tmp_files(root.path()).is_empty()
        })
    };
    assert!(
        settled(),
        "threads {} (base {base}), temp files {:?}",
        fs_threads(),
        tmp_files(root.path())
    );
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        settled(),
        "threads {} (base {base}), temp files {:?}",
        fs_threads(),
        tmp_files(root.path())
    );
    let m = rt
        .block_on(kv_tier::builder(cfg()).unwrap().build())
        .unwrap();
    rt.block_on(m.shutdown()).unwrap();
}

/// Starts a TCP listener that accepts connections and never answers (a black hole); returns
/// its endpoint and a flag that stops it.
fn black_hole() -> (String, Arc<AtomicBool>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::Builder::new()
        .name("black-hole".into())
        .spawn(move || {
            let mut held = Vec::new();
            while !s.load(Ordering::SeqCst) {
                if let Ok((c, _)) = l.accept() {
                    held.push(c);
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
        .unwrap();
    (format!("http://{addr}"), stop)
}

fn obj_manager_cfg(endpoint: &str, request_timeout_s: f64) -> KvTierConfig {
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{endpoint}",
              "scheme": "http", "access_key": "{AK}", "secret_key": "{SK}",
              "request_timeout_s": {request_timeout_s}, "max_retries": 0}}]}}"#
    ))
    .unwrap()
}

/// Promise (kv-tier-core/src/tier.rs, cancellation: "no entry, claim, pin, permit or
/// protection created by the call may outlive the call's own work"; obj README: "every
/// request ... has a deadline"). A `build()` of an obj manager dropped during the obj tier's
/// startup probe against a server that never answers leaves no thread and no task running
/// past the probe's deadline.
#[test]
fn a_build_dropped_during_the_obj_startup_probe_leaks_no_thread_or_task() {
    let _g = exclusive();
    let (endpoint, stop) = black_hole();
    let rt = runtime();
    let others = || threads_where(|n| n != "adv-rt");
    // warm up the runtime's own machinery, then measure
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
    let base_threads = others();
    let base_tasks = rt.metrics().num_alive_tasks();
    for i in [1usize, 3, 8, 12, 14] {
        let r = rt.block_on(drop_at(
            kv_tier::builder(obj_manager_cfg(&endpoint, 0.5))
                .unwrap()
                .build(),
            i,
        ));
        assert!(
            r.is_none() || r.unwrap().is_err(),
            "built against a black hole"
        );
    }
    let r = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_millis(200),
            kv_tier::builder(obj_manager_cfg(&endpoint, 0.5))
                .unwrap()
                .build(),
        )
        .await
    });
    assert!(r.is_err() || r.unwrap().is_err());
    let ok = wait_until(LIMIT, || rt.metrics().num_alive_tasks() <= base_tasks);
    assert!(
        ok,
        "tasks left: {} (base {base_tasks})",
        rt.metrics().num_alive_tasks()
    );
    let ok = wait_until(LIMIT, || others() <= base_threads);
    assert!(ok, "threads left: {} (base {base_threads})", others());
    stop.store(true, Ordering::SeqCst);
}

/// Promise (kv-tier-core/src/tier.rs, cancellation; obj README "A startup probe turns bad
/// credentials, a missing bucket or an unreachable endpoint into a clear error"). `build()`
/// of an obj manager dropped at many points of its startup against a slow real S3 server
/// leaves nothing in the bucket, and the next build on the same bucket works and stores.
#[test]
fn a_build_dropped_during_the_obj_startup_leaves_the_bucket_empty() {
    let _g = shared();
    let rt = runtime();
    let s3 = rt.block_on(S3Server::start());
    s3.set_latency(Duration::from_millis(30));
    for i in 0..16 {
        let r = rt.block_on(drop_at(
            kv_tier::builder(obj_manager_cfg(&s3.endpoint, 5.0))
                .unwrap()
                .build(),
            i,
        ));
        if let Some(m) = r {
            rt.block_on(m.unwrap().shutdown()).unwrap();
        }
    }
    s3.set_latency(Duration::ZERO);
    let m = rt
        .block_on(
            kv_tier::builder(obj_manager_cfg(&s3.endpoint, 5.0))
                .unwrap()
                .build(),
        )
        .unwrap();
    // let anything the dropped builds left running finish (each request has a deadline)
    std::thread::sleep(Duration::from_millis(600));
    let obj = m.tier::<ObjTier>("obj").unwrap();
    let objects = rt.block_on(list_objects(&obj));
    assert!(
        objects.is_empty(),
        "objects left by dropped builds: {objects:?}"
    );
    let k = test_key(141);
    store(&m, 1, &[k]);
    m.on_request_finished(RequestId(1));
    rt.block_on(m.wait_idle());
    assert_eq!(rt.block_on(list_objects(&obj)), vec![obj.object_path(&k)]);
    rt.block_on(m.shutdown()).unwrap();
}

/// Sets up, over a `FaultyTier` on a `MemoryTier`, one of each kind of background work held
/// at a gate: a store cascade, a promotion (load) and a probe. Returns the gates
/// (stores, loads, lookups) and the keys (stored, promoted, probed).
fn park_everything(
    m: &TieringManager,
    mem: &MemoryTier,
    faulty: &FaultyTier,
    rt: &tokio::runtime::Runtime,
) -> ([Gate; 3], [BlockKey; 3]) {
    let (ks, kp, kq) = (test_key(151), test_key(152), test_key(153));
    assert!(rt.block_on(store_keys(mem, &[kp, kq], 0, BS)).is_success());
    let r1 = ctx(1);
    assert_eq!(m.lookup(&kp, &r1), Retry);
    m.on_schedule_end();
    idle(m);
    assert_eq!(m.lookup(&kp, &r1), HitPending);
    let loads = faulty.hold_loads();
    let lookups = faulty.hold_lookups();
    assert_eq!(m.lookup(&kq, &r1), Retry);
    m.on_schedule_end(); // sends the load of kp and the probe of kq
    let stores = faulty.hold_stores();
    store(m, 2, &[ks]);
    m.on_schedule_end();
    block_on(m, async {
        tokio::time::timeout(LIMIT, async {
            loads.wait_arrived(1).await;
            lookups.wait_arrived(1).await;
            stores.wait_arrived(1).await;
        })
        .await
    })
    .expect("the parked work never reached its gates");
    ([stores, loads, lookups], [ks, kp, kq])
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `wait_idle` / `wait_jobs`) together with
/// the cancellation rule of kv-tier-core/src/tier.rs ("its future may be dropped at any await
/// point ... and the [state] must stay consistent"). `wait_idle` and `wait_jobs` dropped at
/// many points while a store, a load and a probe are parked: afterwards everything lands,
/// the blocks are served with their bytes, and nothing is left behind.
#[test]
fn wait_idle_and_wait_jobs_dropped_at_every_point_leave_nothing_behind() {
    let _g = shared();
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let m = manager(mcfg(6, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let (gates, [ks, kp, kq]) = park_everything(&m, &mem, &faulty, &rt);
    for i in 0..16 {
        assert!(
            block_on(&m, drop_at(m.wait_idle(), i)).is_none(),
            "wait_idle returned with work parked"
        );
        assert!(
            block_on(&m, drop_at(m.wait_jobs(), i)).is_none(),
            "wait_jobs returned with jobs parked"
        );
        assert!(m.lookup(&kp, &ctx(1)).is_present());
        m.on_schedule_end();
    }
    for g in &gates {
        g.open();
    }
    idle(&m);
    let r1 = ctx(1);
    for k in [kp, kq] {
        let (end, seen) = settle(&m, &k, &r1);
        assert_eq!(end, Hit, "{k}: {seen:?}");
        load_verify(&m, &[k]);
    }
    assert!(mem.contains(&ks), "the parked store did not land");
    m.on_schedule_end();
    m.on_request_finished(RequestId(1));
    m.on_request_finished(RequestId(2));
    assert_clean(&m, &[ks, kp, kq]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `reset_cache`): "Cancels queued
/// promotions, waits for the jobs in flight, then empties DRAM ... Returns how many blocks
/// stay in DRAM because readers still pin them"; cancellation rule of tier.rs. `reset_cache`
/// dropped at many points while work is parked; then a complete `reset_cache` returns 0 and
/// empties DRAM, and the blocks are served again from the tier with their bytes.
#[test]
fn a_reset_cache_dropped_at_every_point_then_completed() {
    let _g = shared();
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let m = manager(mcfg(6, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let (gates, keys) = park_everything(&m, &mem, &faulty, &rt);
    for i in 0..16 {
        assert!(
            block_on(&m, drop_at(m.reset_cache(), i)).is_none(),
            "reset_cache returned with jobs parked"
        );
        m.on_schedule_end();
    }
    for g in &gates {
        g.open();
    }
    assert_eq!(
        block_on(&m, m.reset_cache()),
        0,
        "blocks pinned after the reset"
    );
    assert_eq!(m.stats().primary.ready_blocks, 0, "DRAM not emptied");
    m.on_request_finished(RequestId(1));
    m.on_request_finished(RequestId(2));
    assert_clean(&m, &keys);
    let r = ctx(3);
    for k in keys {
        let (end, seen) = settle(&m, &k, &r);
        assert_eq!(end, Hit, "{k}: {seen:?}");
        load_verify(&m, &[k]);
    }
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_clean(&m, &keys);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `shutdown`: "Cancels queued promotions,
/// waits for jobs in flight, and shuts every tier down"; kv-tier crate docs §5: "the fs tier
/// publishes a block only whole ...; the obj tier's PUTs are whole objects"; tier.rs
/// cancellation). A manager over real fs and obj tiers with cascades in flight to a slow S3
/// server: `shutdown` dropped at several points, then completed. It succeeds; the fs root
/// has no temp file, the bucket only whole blocks; reopened, every block is absent or its
/// exact bytes.
#[test]
fn a_shutdown_dropped_midway_then_completed_over_real_fs_and_obj() {
    let _g = shared();
    let rt = runtime();
    let s3 = rt.block_on(S3Server::start());
    let root = temp_root();
    let cfg = || {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536, {LAYOUT},
                "secondary_tiers": [
                  {{"type": "fs", "root_dir": {:?}, "checksum": "crc32c", "n_read_threads": 2, "n_write_threads": 2}},
                  {{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{}", "scheme": "http",
                    "access_key": "{AK}", "secret_key": "{SK}", "checksum": "crc32c", "io_threads": 2,
                    "request_timeout_s": 5, "max_retries": 0}}]}}"#,
            root.path(),
            s3.endpoint
        ))
        .unwrap()
    };
    let m = rt
        .block_on(kv_tier::builder(cfg()).unwrap().build())
        .unwrap();
    let keys: Vec<BlockKey> = (0..12).map(|i| test_key(160 + i)).collect();
    s3.set_latency(Duration::from_millis(40));
    let mut p = m.prepare_store(&keys).unwrap();
    for (k, s) in p.slots() {
        fill_block(k, 0, s.as_mut_slice());
    }
    p.commit(RequestId(1));
    m.on_request_finished(RequestId(1));
    m.on_schedule_end();
    for i in [1usize, 2, 4, 9, 11, 13, 14] {
        if let Some(r) = rt.block_on(drop_at(m.shutdown(), i)) {
            r.expect("a shutdown that ran to its end failed");
        }
    }
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), m.shutdown()).await })
        .expect("the second shutdown hung")
        .expect("the second shutdown failed");
    let obj = m.tier::<ObjTier>("obj").unwrap();
    drop(obj);
    drop(m);
    s3.set_latency(Duration::ZERO);
    assert!(
        tmp_files(root.path()).is_empty(),
        "{:?}",
        tmp_files(root.path())
    );
    // reopened: every block absent or whole
    let m = rt
        .block_on(kv_tier::builder(cfg()).unwrap().build())
        .unwrap();
    let obj = m.tier::<ObjTier>("obj").unwrap();
    let fs = m.tier::<FsTier>("fs").unwrap();
    let paths: std::collections::BTreeSet<String> =
        keys.iter().map(|k| obj.object_path(k)).collect();
    for o in rt.block_on(list_objects(&obj)) {
        assert!(paths.contains(&o), "a stray object in the bucket: {o}");
    }
    for t in [fs.clone() as Arc<dyn SecondaryTier>, obj.clone()] {
        let (res, bytes) = rt.block_on(load_keys(&*t, &keys, 65536));
        for (k, b) in &bytes {
            assert!(verify_block(k, 0, b), "{}: {k} torn", t.info().name);
        }
        for (k, e) in &res.failed {
            assert!(
                matches!(e, Error::NotFound { .. }),
                "{}: {k}: {e}",
                t.info().name
            );
        }
    }
    assert!(tmp_files(root.path()).is_empty());
    rt.block_on(m.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `shutdown`: "Cancels queued promotions,
/// waits for jobs in flight, and shuts every tier down. Afterwards the manager serves DRAM
/// only: lookups past DRAM answer `Miss` and stores cascade nowhere"). `shutdown` called from
/// two tasks at once, with a store in flight and a slow tier shutdown: both return, neither
/// fails, and afterwards the manager serves DRAM only.
#[test]
fn shutdown_from_two_tasks_at_once() {
    let _g = shared();
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
    store(&m, 1, &[k]);
    m.on_request_finished(RequestId(1));
    m.on_schedule_end();
    rt.block_on(async { tokio::time::timeout(LIMIT, stores.wait_arrived(1)).await })
        .unwrap();
    let a = rt.spawn({
        let m = m.clone();
        async move { m.shutdown().await }
    });
    let b = rt.spawn({
        let m = m.clone();
        async move { m.shutdown().await }
    });
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
    let _g = exclusive();
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
            std::thread::sleep(Duration::from_millis(3 * round as u64));
        }
        drop(m);
        assert!(
            wait_until(LIMIT, || fs_threads() <= base),
            "fs threads left after the manager was dropped: {} (base {base})",
            fs_threads()
        );
        let m = kv_tier::builder(cfg()).unwrap().build_blocking().unwrap();
        assert!(
            tmp_files(root.path()).is_empty(),
            "temp files survived a reopen: {:?}",
            tmp_files(root.path())
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
        assert!(wait_until(LIMIT, || fs_threads() <= base));
    }
}

fn test_key_round(k: &BlockKey, round: u32) -> BlockKey {
    BlockKey::from_hash32(k.hash_bytes().try_into().unwrap(), round)
}

// ------------------------------------------------------------------------------ 4. cancellation: tiers driven directly

/// Promise (kv-tier-core/src/tier.rs, "Cancellation, deadlines and panics"): "Every async
/// method must be cancellation-safe: its future may be dropped at any await point ..., and
/// the tier must stay consistent: no entry, claim, pin, permit or protection created by the
/// call may outlive the call's own work ... Work the call handed to threads of its own may
/// finish after the drop (its buffers keep their DRAM slots pinned until then, and its keys
/// may stay protected until then), but never longer." The fs tier's `store` dropped at
/// every point: its sources are let go of, its keys unprotected, no temp file stays, and
/// the same keys then store and load with their bytes.
#[test]
fn fs_store_dropped_at_every_point() {
    let _g = shared();
    let rt = runtime();
    let root = temp_root();
    let bs = 64 * 1024;
    let fs = open_fs(root.path(), bs);
    let live = Arc::new(AtomicUsize::new(0));
    for i in 0..16usize {
        let keys: Vec<BlockKey> = (0..6)
            .map(|j| test_key(10_000 + i as u64 * 10 + j))
            .collect();
        let job = store_job(&keys, bs, &live);
        let r = rt.block_on(drop_at(fs.store(job), i));
        assert!(
            wait_until(LIMIT, || live.load(Ordering::SeqCst) == 0),
            "point {i}: {} block sources still held after the store was dropped",
            live.load(Ordering::SeqCst)
        );
        assert!(
            wait_until(LIMIT, || keys.iter().all(|k| !fs.is_protected(k))),
            "point {i}: keys still protected"
        );
        assert!(
            wait_until(LIMIT, || tmp_files(root.path()).is_empty()),
            "point {i}: {:?}",
            tmp_files(root.path())
        );
        if let Some(r) = r {
            assert!(r.is_success(), "{:?}", r.failed);
        }
        let res = rt.block_on(store_keys(&*fs, &keys, 0, bs));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        let (res, bytes) = rt.block_on(load_keys(&*fs, &keys, bs));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        for (k, b) in &bytes {
            assert!(verify_block(k, 0, b), "point {i}: {k} wrong bytes");
        }
    }
    rt.block_on(fs.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/tier.rs, cancellation, as above; `LoadJob`: "Each sink is
/// exclusive and pins its slot until dropped"). The fs tier's `load` and `lookup` dropped at
/// every point: every sink is let go of, no key stays protected, and the blocks then load
/// with their bytes.
#[test]
fn fs_load_and_lookup_dropped_at_every_point() {
    let _g = shared();
    let rt = runtime();
    let root = temp_root();
    let bs = 64 * 1024;
    let fs = open_fs(root.path(), bs);
    let keys: Vec<BlockKey> = (0..6).map(|j| test_key(20_000 + j)).collect();
    assert!(rt.block_on(store_keys(&*fs, &keys, 0, bs)).is_success());
    for i in 0..16usize {
        let mut job = LoadJob::default();
        let mut readers = Vec::new();
        for k in &keys {
            let (s, r) = BlockSink::pair(bs);
            job.blocks.push((*k, s));
            readers.push(r);
        }
        let _ = rt.block_on(drop_at(fs.load(job), i));
        assert!(
            wait_until(LIMIT, || sinks_released(&mut readers)),
            "point {i}: sinks still held"
        );
        let _ = rt.block_on(drop_at(fs.lookup(&keys), i));
        assert!(
            wait_until(LIMIT, || keys.iter().all(|k| !fs.is_protected(k))),
            "point {i}: keys still protected"
        );
        let (res, bytes) = rt.block_on(load_keys(&*fs, &keys, bs));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        assert!(bytes.iter().all(|(k, b)| verify_block(k, 0, b)));
        assert_eq!(
            rt.block_on(fs.lookup(&keys)).unwrap(),
            vec![true; keys.len()]
        );
    }
    rt.block_on(fs.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/tier.rs: "Every async method must be cancellation-safe"; fs
/// README: "`shutdown` stops it promptly, and joins the tier's threads"; `SecondaryTier::
/// shutdown`: "Stops background work and releases resources"). The fs tier's `shutdown`
/// dropped at its first polls, then called again: the second completes, and once the tier
/// is dropped none of its threads is left.
#[test]
fn fs_shutdown_dropped_then_completed_leaves_no_thread() {
    let _g = exclusive();
    let rt = runtime();
    let root = temp_root();
    let base = fs_threads();
    for i in 0..6usize {
        let mut c = fs_config(root.path());
        c.gc_max_size_gb = Some(1.0);
        let fs = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
        let keys: Vec<BlockKey> = (0..4).map(|j| test_key(30_000 + j)).collect();
        assert!(rt.block_on(store_keys(&*fs, &keys, 0, BS)).is_success());
        assert!(fs_threads() > base);
        let first = rt.block_on(drop_at(fs.shutdown(), i));
        if let Some(r) = first {
            r.unwrap();
        }
        rt.block_on(async { tokio::time::timeout(LIMIT, fs.shutdown()).await })
            .expect("the second shutdown hung")
            .expect("the second shutdown failed");
        drop(fs);
        assert!(
            wait_until(LIMIT, || fs_threads() <= base),
            "point {i}: fs threads left: {} (base {base})",
            fs_threads()
        );
    }
}

fn s3_and_obj(
    rt: &tokio::runtime::Runtime,
    prefix: &str,
    tune: impl FnOnce(&mut ObjTierConfig),
) -> (S3Server, Arc<ObjTier>) {
    let s3 = rt.block_on(S3Server::start());
    let mut c = obj_config(&s3.endpoint, prefix);
    tune(&mut c);
    let tier = rt.block_on(ObjTier::connect("obj", c, ns(), BS)).unwrap();
    (s3, Arc::new(tier))
}

/// Promise (kv-tier-obj README: "Every method is cancellation-safe: a dropped store frees its
/// claim on the key (concurrent stores of one key upload once), its permit and its
/// protection"; tier.rs cancellation). The obj tier (`io_threads` 1, a slow server): `store`
/// dropped at every point; its sources are let go of, no key stays protected, a later store
/// of the same keys completes (claim and permit freed) and they load with their bytes; the
/// bucket holds only whole blocks.
#[test]
fn obj_store_dropped_at_every_point() {
    let _g = shared();
    let rt = runtime();
    let (s3, obj) = s3_and_obj(&rt, "adv", |_| {});
    s3.set_latency(Duration::from_millis(5));
    let live = Arc::new(AtomicUsize::new(0));
    let mut all = Vec::new();
    for i in 0..16usize {
        let keys: Vec<BlockKey> = (0..3)
            .map(|j| test_key(40_000 + i as u64 * 10 + j))
            .collect();
        all.extend(keys.iter().copied());
        let _ = rt.block_on(drop_at(obj.store(store_job(&keys, BS, &live)), i));
        assert!(
            wait_until(LIMIT, || live.load(Ordering::SeqCst) == 0),
            "point {i}: {} sources still held",
            live.load(Ordering::SeqCst)
        );
        assert!(
            wait_until(LIMIT, || keys.iter().all(|k| !obj.is_protected(k))),
            "point {i}: keys still protected"
        );
        let res = rt
            .block_on(async {
                tokio::time::timeout(LIMIT, obj.store(store_job(&keys, BS, &live))).await
            })
            .unwrap_or_else(|_| {
                panic!("point {i}: a store after a dropped one hung (claim or permit kept)")
            });
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        let (res, bytes) = rt.block_on(load_keys(&*obj, &keys, BS));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        assert!(bytes.iter().all(|(k, b)| verify_block(k, 0, b)));
    }
    let paths: std::collections::BTreeSet<String> =
        all.iter().map(|k| obj.object_path(k)).collect();
    let objects = rt.block_on(list_objects(&obj));
    for o in &objects {
        assert!(paths.contains(o), "a stray object: {o}");
    }
    assert_eq!(objects.len(), paths.len());
    rt.block_on(obj.shutdown()).unwrap();
}

/// Promise (kv-tier-obj README: "a dropped store frees its claim on the key (concurrent
/// stores of one key upload once)"; `SecondaryTier::store`: "of concurrent stores of one key
/// exactly one copy survives, whole. A store that reports success leaves a readable block").
/// Two concurrent stores of one key, one dropped at every point: the other completes, with
/// success, and the key loads with its bytes.
#[test]
fn obj_concurrent_stores_of_one_key_with_one_dropped() {
    let _g = shared();
    let rt = runtime();
    let (s3, obj) = s3_and_obj(&rt, "adv2", |c| c.io_threads = 2);
    s3.set_latency(Duration::from_millis(5));
    let live = Arc::new(AtomicUsize::new(0));
    for i in 0..16usize {
        let k = test_key(50_000 + i as u64);
        let (a, b) = (obj.clone(), obj.clone());
        let live2 = live.clone();
        let survivor = rt.spawn(async move { b.store(store_job(&[k], BS, &live2)).await });
        let _ = rt.block_on(drop_at(a.store(store_job(&[k], BS, &live)), i));
        let res = rt
            .block_on(async { tokio::time::timeout(LIMIT, survivor).await })
            .unwrap_or_else(|_| panic!("point {i}: the surviving store hung"))
            .unwrap();
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        let (res, bytes) = rt.block_on(load_keys(&*obj, &[k], BS));
        assert!(
            res.is_success() && verify_block(&k, 0, &bytes[0].1),
            "point {i}: {:?}",
            res.failed
        );
        assert!(wait_until(LIMIT, || live.load(Ordering::SeqCst) == 0
            && !obj.is_protected(&k)));
    }
    rt.block_on(obj.shutdown()).unwrap();
}

/// Promise (tier.rs cancellation; kv-tier-obj README "Every method is cancellation-safe").
/// The obj tier's `load` and `lookup` dropped at every point with `io_threads` 1: every sink
/// is let go of, no key stays protected, and a later load (which needs the one permit)
/// completes with the right bytes.
#[test]
fn obj_load_and_lookup_dropped_at_every_point() {
    let _g = shared();
    let rt = runtime();
    let (s3, obj) = s3_and_obj(&rt, "adv3", |_| {});
    let keys: Vec<BlockKey> = (0..3).map(|j| test_key(60_000 + j)).collect();
    assert!(rt.block_on(store_keys(&*obj, &keys, 0, BS)).is_success());
    s3.set_latency(Duration::from_millis(5));
    for i in 0..16usize {
        let mut job = LoadJob::default();
        let mut readers = Vec::new();
        for k in &keys {
            let (s, r) = BlockSink::pair(BS);
            job.blocks.push((*k, s));
            readers.push(r);
        }
        let _ = rt.block_on(drop_at(obj.load(job), i));
        assert!(
            wait_until(LIMIT, || sinks_released(&mut readers)),
            "point {i}: sinks still held"
        );
        obj.clear_exists_cache();
        let _ = rt.block_on(drop_at(obj.lookup(&keys), i));
        assert!(
            wait_until(LIMIT, || keys.iter().all(|k| !obj.is_protected(k))),
            "point {i}: keys still protected"
        );
        let (res, bytes) = rt
            .block_on(async { tokio::time::timeout(LIMIT, load_keys(&*obj, &keys, BS)).await })
            .unwrap_or_else(|_| panic!("point {i}: a load after dropped calls hung"));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        assert!(bytes.iter().all(|(k, b)| verify_block(k, 0, b)));
        let found = rt
            .block_on(async { tokio::time::timeout(LIMIT, obj.lookup(&keys)).await })
            .unwrap()
            .unwrap();
        assert_eq!(found, vec![true; keys.len()], "point {i}");
    }
    rt.block_on(obj.shutdown()).unwrap();
}

/// Promise (kv-tier-obj README: "`shutdown` stops and awaits the background sweeps; later
/// calls fail with `Shutdown`"; capacity: "`shutdown` saves the recency order ... in one small
/// object beside the blocks"; tier.rs cancellation). A bounded obj tier's `shutdown` dropped
/// at every point against a slow server, then completed: it succeeds, later stores fail with
/// `Shutdown`, and the bucket holds the blocks and at most that one small object.
#[test]
fn obj_shutdown_dropped_then_completed() {
    let _g = shared();
    let rt = runtime();
    let s3 = rt.block_on(S3Server::start());
    for i in 0..10usize {
        let mut c = obj_config(&s3.endpoint, &format!("sd{i}"));
        c.max_size_gb = Some(1.0);
        let obj = rt.block_on(ObjTier::connect("obj", c, ns(), BS)).unwrap();
        let keys: Vec<BlockKey> = (0..3)
            .map(|j| test_key(70_000 + i as u64 * 10 + j))
            .collect();
        assert!(rt.block_on(store_keys(&obj, &keys, 0, BS)).is_success());
        obj.touch(&keys);
        s3.set_latency(Duration::from_millis(20));
        if let Some(r) = rt.block_on(drop_at(obj.shutdown(), i)) {
            r.unwrap();
        }
        rt.block_on(async { tokio::time::timeout(LIMIT, obj.shutdown()).await })
            .unwrap_or_else(|_| panic!("point {i}: the second shutdown hung"))
            .unwrap_or_else(|e| panic!("point {i}: the second shutdown failed: {e}"));
        s3.set_latency(Duration::ZERO);
        let k = test_key(79_000 + i as u64);
        let res = rt.block_on(store_keys(&obj, &[k], 0, BS));
        assert!(
            res.failed.len() == 1 && matches!(res.failed[0].1, Error::Shutdown { .. }),
            "point {i}: a store after shutdown: {res:?}"
        );
        let paths: std::collections::BTreeSet<String> =
            keys.iter().map(|k| obj.object_path(k)).collect();
        let objects: Vec<String> = rt
            .block_on(list_objects(&obj))
            .into_iter()
            .filter(|o| o.starts_with(&format!("sd{i}/")))
            .collect();
        let others: Vec<&String> = objects.iter().filter(|o| !paths.contains(*o)).collect();
        assert!(others.len() <= 1, "point {i}: stray objects: {others:?}");
        assert_eq!(
            objects.len() - others.len(),
            paths.len(),
            "point {i}: {objects:?}"
        );
    }
}

// ------------------------------------------------------------------------------ 5. more of the lookup

/// Promise (kv-tier-core/src/manager/mod.rs, `TieringManager`): "Completed jobs and probes
/// are applied at the first call of a step and at [`TieringManager::on_schedule_end`], so
/// verdicts change only there." A probe answer that arrives in the middle of a step does not
/// change the verdicts of that step (`lookup`, `lookup_many`, `lookup_prefix`); the next
/// step sees it.
#[test]
fn verdicts_change_only_at_step_boundaries() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let (k, k2) = (test_key(201), test_key(202));
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let gate = faulty.hold_lookups();
    let r = ctx(1);
    assert_eq!(m.lookup_many(&[k, k2], &r), vec![Retry, Retry]);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    // a new step starts with this call; the answer is still held
    assert_eq!(m.lookup(&k, &r), Retry);
    gate.open();
    std::thread::sleep(Duration::from_millis(300)); // the answer arrives mid-step
    assert_eq!(m.lookup(&k, &r), Retry, "an answer was applied mid-step");
    assert_eq!(m.lookup_many(&[k, k2], &r), vec![Retry, Retry], "mid-step");
    let c = m.lookup_prefix(&[k, k2], &r);
    assert_eq!((c.hit, c.present, c.retry), (0, 0, true), "mid-step");
    assert!(m.prepare_load(&[k]).is_err());
    m.on_schedule_end();
    assert_eq!(
        m.lookup_many(&[k, k2], &r),
        vec![HitPending, Miss],
        "the next step"
    );
    m.on_schedule_end();
    let (end, seen) = settle(&m, &k, &r);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_clean(&m, &[k, k2]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs): `wait_jobs` "Waits until no store or load
/// job is in flight, sending nothing new (queued promotions and probes stay queued)";
/// `is_idle`: "Whether no job or probe is queued or in flight"; `wait_idle`: "Sends
/// everything queued and waits until every job and probe has completed and been applied."
#[test]
fn wait_jobs_sends_nothing_queued_and_wait_idle_sends_everything() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let (kp, kq) = (test_key(211), test_key(212));
    assert!(
        rt.block_on(store_keys(&*mem, &[kp, kq], 0, BS))
            .is_success()
    );
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let r = ctx(1);
    assert_eq!(m.lookup(&kp, &r), Retry);
    m.on_schedule_end();
    idle(&m);
    let loads = faulty.hold_loads();
    let lookups = faulty.hold_lookups();
    assert_eq!(m.lookup(&kp, &r), HitPending); // a promotion queued
    assert_eq!(m.lookup(&kq, &r), Retry); // a probe queued
    assert!(!m.is_idle(), "is_idle with a promotion and a probe queued");
    jobs(&m);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(loads.arrived(), 0, "wait_jobs sent a queued promotion");
    assert_eq!(lookups.arrived(), 0, "wait_jobs sent a queued probe");
    assert!(!m.is_idle());
    loads.open();
    lookups.open();
    idle(&m);
    assert!(m.is_idle());
    assert_eq!(
        (loads.arrived(), lookups.arrived()),
        (1, 1),
        "wait_idle did not send them"
    );
    for k in [kp, kq] {
        let (end, seen) = settle(&m, &k, &r);
        assert_eq!(end, Hit, "{seen:?}");
    }
    load_verify(&m, &[kp, kq]);
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_clean(&m, &[kp, kq]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/tier.rs, `PreparedStore::present`: "Keys already present (or
/// being written, which may yet fail): nothing to do for them"; README "never returns a wrong
/// or torn block"; `Hit`: "In DRAM and readable now"). The engine stores a key whose
/// promotion is in flight: the key is not `Hit` before the load lands, and when it is, its
/// bytes are the block's; a load that then fails never leaves a readable unfilled slot.
#[test]
fn an_engine_store_of_a_key_being_promoted_never_serves_unfilled_bytes() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let (k, k2) = (test_key(221), test_key(222));
    assert!(rt.block_on(store_keys(&*mem, &[k, k2], 0, BS)).is_success());
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    for (key, fail) in [(k, false), (k2, true)] {
        let loads = faulty.hold_loads();
        if fail {
            faulty.fail_load(&[key]);
        }
        let r = ctx(1 + fail as u64);
        assert_eq!(m.lookup(&key, &r), Retry);
        m.on_schedule_end();
        idle(&m);
        assert_eq!(m.lookup(&key, &r), HitPending);
        m.on_schedule_end();
        block_on(&m, async {
            tokio::time::timeout(LIMIT, loads.wait_arrived(1)).await
        })
        .unwrap();
        // the engine recomputed the block and offloads it: its slot is the promotion's
        let mut p = m.prepare_store(&[key]).unwrap();
        assert!(
            p.keys().is_empty(),
            "a second slot for a key being promoted"
        );
        for (kk, s) in p.slots() {
            fill_block(kk, 0, s.as_mut_slice());
        }
        p.commit(RequestId(100));
        m.on_schedule_end();
        let v = m.lookup(&key, &ctx(50));
        assert_ne!(v, Hit, "Hit before the promotion's load ran");
        assert!(
            m.prepare_load(&[key]).is_err(),
            "an unfilled slot was readable"
        );
        m.on_schedule_end();
        loads.open();
        idle(&m);
        let (end, seen) = settle(&m, &key, &r);
        if fail {
            assert_eq!(end, Miss, "{seen:?}");
            assert!(
                m.prepare_load(&[key]).is_err(),
                "a failed load left a readable slot"
            );
        } else {
            assert_eq!(end, Hit, "{seen:?}");
            load_verify(&m, &[key]);
        }
        m.on_schedule_end();
        m.on_request_finished(r.id);
        m.on_request_finished(RequestId(50));
        m.on_request_finished(RequestId(100));
        faulty.heal();
    }
    assert_clean(&m, &[k, k2]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/request.rs, `HitPending`: "Present, but a write or a promotion
/// into DRAM is still in flight: ask again next step"; `PendingStore` docs: dropping or
/// aborting it "frees its slots"). A key `HitPending` because the engine is writing it, whose
/// store is then aborted, does not stay `HitPending` and is never `Hit`.
#[test]
fn an_aborted_engine_store_ends_hit_pending() {
    let _g = shared();
    let (_mem, faulty) = faulty_mem();
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(231);
    let r = ctx(2);
    for abort in [true, false] {
        let mut p = m.prepare_store(&[k]).unwrap();
        for (kk, s) in p.slots() {
            fill_block(kk, 0, s.as_mut_slice());
        }
        assert_eq!(m.lookup(&k, &r), HitPending);
        m.on_schedule_end();
        if abort {
            p.abort();
        } else {
            drop(p);
        }
        let (end, seen) = settle(&m, &k, &r);
        assert_eq!(end, Miss, "{seen:?}");
        m.on_schedule_end();
    }
    m.on_request_finished(r.id);
    assert_clean(&m, &[k]);
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
    let _g = shared();
    let root = temp_root();
    let mut c = fs_config(root.path());
    c.gc_max_size_gb = Some(64.0 * 1024.0 / (1u64 << 30) as f64); // 64 KiB
    c.gc_background = false;
    c.gc_hard_ceiling = Some(1000.0);
    let fs = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    let faulty = Arc::new(FaultyTier::new(fs.clone()));
    let m = manager(mcfg(8, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(241);
    let others: Vec<BlockKey> = (0..40).map(|i| test_key(2_410 + i)).collect();
    for (n, chunk) in std::iter::once(&[k][..])
        .chain(others.chunks(8))
        .enumerate()
    {
        store(&m, 1, chunk);
        jobs(&m);
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
        tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await
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
    idle(&m);
    assert_eq!(m.lookup(&k, &r), HitPending);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(LIMIT, loads.wait_arrived(1)).await
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
    let (end, seen) = settle(&m, &k, &r);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_clean(&m, &[k]);
    // no protection outlives the promotion: a later sweep may now take k
    let mut round = 0u64;
    assert!(
        wait_until(LIMIT, || {
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

/// Promise (kv-tier-core/src/manager/mod.rs, `lookup_prefix`: "A promotion's DRAM
/// reservation never evicts a block this call has already answered `Hit` for"; `lookup_many`:
/// "When nothing else can make room, the promotion is refused and that key is a `Miss`").
/// DRAM holds the prefix's first blocks as its least recent ones; the promotions of the rest
/// evict others, never them; with no other room, the promotion is refused as a `Miss` and
/// the hits stay loadable.
#[test]
fn promotion_reservations_never_evict_this_calls_hits() {
    let _g = shared();
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let prefix: Vec<BlockKey> = (0..4).map(|i| test_key(250 + i)).collect();
    assert!(rt.block_on(store_keys(&*mem, &prefix, 0, BS)).is_success());
    // 4 slots: prefix[0..2] in DRAM, least recent, then two junk blocks
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    store(&m, 1, &prefix[..2]);
    store(&m, 1, &[test_key(258), test_key(259)]);
    m.on_request_finished(RequestId(1));
    jobs(&m);
    let r = ctx(2);
    let t0 = Instant::now();
    loop {
        let found = m.lookup_prefix(&prefix, &r);
        assert!(found.hit >= 2, "this call's hits were evicted: {found:?}");
        load_verify(&m, &prefix[..found.hit]);
        m.on_schedule_end();
        if found.hit == 4 {
            break;
        }
        assert!(t0.elapsed() < LIMIT, "{found:?}");
        std::thread::sleep(Duration::from_millis(3));
    }
    m.on_schedule_end();
    m.on_request_finished(r.id);
    // 2 slots, both the prefix's: the third block has no room
    let m2 = manager(mcfg(2, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    store(&m2, 1, &prefix[..2]);
    m2.on_request_finished(RequestId(1));
    jobs(&m2);
    let r = ctx(3);
    let t0 = Instant::now();
    loop {
        let v = m2.lookup_many(&prefix[..3], &r);
        assert_eq!(&v[..2], &[Hit, Hit], "{v:?}");
        load_verify(&m2, &prefix[..2]);
        m2.on_schedule_end();
        if v[2] == Miss {
            break;
        }
        assert_ne!(v[2], Hit);
        assert!(t0.elapsed() < LIMIT, "{v:?}");
        std::thread::sleep(Duration::from_millis(3));
    }
    assert!(m2.stats().promotions_refused >= 1);
    m2.on_schedule_end();
    m2.on_request_finished(r.id);
    assert_clean(&m2, &prefix);
    assert_clean(&m, &prefix);
    m2.shutdown_blocking().unwrap();
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier README: "`Retry` lasts only while a tier that could still answer present
/// is pending and within its probe budget (`probe_budget_s`; default ... 5 ms for a remote
/// one, whose late answers serve the next requests)"). The real obj tier behind a server
/// 300 ms away, its default budget: the first request misses rather than wait; the next,
/// asking after the answer came back, is served without a new probe, with the right bytes.
#[test]
fn a_remote_obj_tier_late_answer_serves_the_next_request() {
    let _g = shared();
    let rt = runtime();
    let s3 = rt.block_on(S3Server::start());
    let cfg = || {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT}, "probe_timeout_s": 10,
                "secondary_tiers": [{{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{}",
                  "scheme": "http", "access_key": "{AK}", "secret_key": "{SK}", "checksum": "crc32c",
                  "lookup_timeout_s": 5}}]}}"#,
            s3.endpoint
        ))
        .unwrap()
    };
    let k = test_key(261);
    {
        let m = rt
            .block_on(kv_tier::builder(cfg()).unwrap().build())
            .unwrap();
        store(&m, 1, &[k]);
        m.on_request_finished(RequestId(1));
        rt.block_on(m.wait_idle());
        rt.block_on(m.shutdown()).unwrap();
    }
    let m = kv_tier::builder(cfg())
        .unwrap()
        .runtime(rt.handle().clone())
        .build_blocking()
        .unwrap();
    s3.set_latency(Duration::from_millis(300));
    let r1 = ctx(2);
    let (end, seen) = settle(&m, &k, &r1);
    assert_eq!(
        end, Miss,
        "the first request waited for the slow tier: {seen:?}"
    );
    assert!(
        wait_until(LIMIT, || {
            m.poll();
            m.stats().tiers[0].probes.late_answers >= 1
        }),
        "{:?}",
        m.stats().tiers[0].probes
    );
    let r2 = ctx(3);
    assert_eq!(
        m.lookup(&k, &r2),
        HitPending,
        "the late answer did not serve the next request"
    );
    let (end, seen) = settle(&m, &k, &r2);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r2.id);
    s3.set_latency(Duration::ZERO);
    assert_clean(&m, &[k]);
    rt.block_on(m.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `flush`: "an error, panic, timeout or
/// dropped task is reported as such (never lost)"; `ProbeCache`: "A probe that errs, panics
/// or passes its deadline answers 'absent' for its keys"). A probe whose task is dropped
/// because its runtime shut down mid-probe: the asking request gets an answer (absent), the
/// batch's protection ends, nothing stays tracked.
#[test]
fn probe_cache_a_probe_dropped_with_its_runtime_is_reported() {
    let _g = shared();
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
    rt.block_on(async { tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await })
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

// ------------------------------------------------------------------------------ 6. more cancellation

/// A tier type whose builder always fails.
struct FailingBuilder;

#[async_trait]
impl TierBuilder for FailingBuilder {
    async fn build(
        &self,
        _spec: &TierSpec,
        _c: &BuildContext,
    ) -> kv_tier::Result<Arc<dyn SecondaryTier>> {
        Err(Error::config("failing", "this tier never builds"))
    }
}

/// Promise (kv-tier crate docs §5: the fs tier "stops its threads when the last handle to it
/// goes"; tier.rs cancellation: no state "created by the call may outlive the call's own
/// work"). A `build()` that fails at a later tier, after the fs tier opened, leaves no fs
/// thread, and the root opens again.
#[test]
fn a_build_failing_after_the_fs_tier_opened_leaves_no_fs_thread() {
    let _g = exclusive();
    let rt = runtime();
    let root = temp_root();
    let base = fs_threads();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "n_read_threads": 2,
                                  "n_write_threads": 2, "gc_max_size_gb": 1}},
                                {{"type": "failing"}}]}}"#,
        root.path()
    ))
    .unwrap();
    for _ in 0..3 {
        let mut reg = kv_tier::registry();
        reg.register("failing", FailingBuilder).unwrap();
        let r = rt.block_on(kv_tier::builder(cfg.clone()).unwrap().registry(reg).build());
        assert!(r.is_err());
        assert!(
            wait_until(LIMIT, || fs_threads() <= base),
            "fs threads left after a failed build: {} (base {base})",
            fs_threads()
        );
    }
    let fs = open_fs(root.path(), BS);
    drop(fs);
}

/// Promise (kv-tier-core/src/tier.rs: "Work the call handed to threads of its own may finish
/// after the drop (its buffers keep their DRAM slots pinned until then ...), but never
/// longer"; config `shutdown_timeout_s`: "A tier's shutdown waits for work its abandoned jobs
/// left running"). fs stores and loads of 1 MiB blocks dropped at many points, then
/// `shutdown`: once it returns, no buffer of a dropped call is still held.
#[test]
fn fs_shutdown_after_dropped_calls_holds_no_buffer() {
    let _g = shared();
    let rt = runtime();
    for i in 0..10usize {
        let root = temp_root();
        let bs = 1 << 20;
        let fs = open_fs(root.path(), bs);
        let live = Arc::new(AtomicUsize::new(0));
        let keys: Vec<BlockKey> = (0..8)
            .map(|j| test_key(80_000 + i as u64 * 10 + j))
            .collect();
        let _ = rt.block_on(drop_at(fs.store(store_job(&keys, bs, &live)), i));
        let mut readers = Vec::new();
        let mut job = LoadJob::default();
        for k in &keys {
            let (s, r) = BlockSink::pair(bs);
            job.blocks.push((*k, s));
            readers.push(r);
        }
        let _ = rt.block_on(drop_at(fs.load(job), i));
        rt.block_on(async { tokio::time::timeout(LIMIT, fs.shutdown()).await })
            .expect("shutdown hung")
            .expect("shutdown failed");
        assert_eq!(
            live.load(Ordering::SeqCst),
            0,
            "point {i}: a store's buffer held past shutdown"
        );
        assert!(
            sinks_released(&mut readers),
            "point {i}: a load's sink held past shutdown"
        );
        assert!(
            keys.iter().all(|k| !fs.is_protected(k)),
            "point {i}: protected past shutdown"
        );
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
    let _g = shared();
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
        store(&m, 1, c);
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
    let _g = shared();
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
    rt.block_on(async { tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await })
        .unwrap();
    let sd = rt.spawn({
        let m = m.clone();
        async move { m.shutdown().await }
    });
    std::thread::sleep(Duration::from_millis(50));
    gate.open();
    rt.block_on(async { tokio::time::timeout(LIMIT, sd).await })
        .expect("shutdown hung")
        .unwrap()
        .expect("shutdown failed");
    assert!(wait_until(LIMIT, || {
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
        wait_until(LIMIT, || !faulty.is_protected(&k)),
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
    let _g = exclusive();
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
        wait_until(LIMIT, || fs_threads() <= base),
        "fs threads left after the manager was dropped: {} (base {base})",
        fs_threads()
    );
    let m = rt.block_on(kv_tier::builder(cfg).unwrap().build()).unwrap();
    assert!(
        tmp_files(root.path()).is_empty(),
        "{:?}",
        tmp_files(root.path())
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

/// Promise (kv-tier-core/src/tier.rs, cancellation: "no entry, claim, pin, permit or
/// protection created by the call may outlive the call's own work"; obj README "Capacity":
/// "an index of (key, size, last use)"; `ObjStats::objects`: "Objects in the capacity index").
/// A bounded obj tier (`io_threads` 1, a slow server) whose store of 4 blocks is dropped
/// while its first PUT is out and the others wait for the one permit: the capacity index
/// does not keep entries for blocks whose PUT was never sent (at most the one PUT in doubt).
#[test]
fn obj_dropped_stores_leave_no_phantom_capacity_entries() {
    let _g = shared();
    let rt = runtime();
    let (s3, obj) = s3_and_obj(&rt, "cap", |c| c.max_size_gb = Some(1.0));
    let live = Arc::new(AtomicUsize::new(0));
    let mut phantoms_seen = Vec::new();
    for i in 0..6usize {
        s3.set_latency(Duration::from_millis(150));
        let keys: Vec<BlockKey> = (0..4)
            .map(|j| test_key(90_000 + i as u64 * 10 + j))
            .collect();
        let r = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_millis(60 + 10 * i as u64),
                obj.store(store_job(&keys, BS, &live)),
            )
            .await
        });
        assert!(
            r.is_err(),
            "the store finished before it was dropped: the test is void"
        );
        assert!(wait_until(LIMIT, || live.load(Ordering::SeqCst) == 0
            && keys.iter().all(|k| !obj.is_protected(k))));
        s3.set_latency(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(400)); // the server ends the PUT it had
        let actual = rt.block_on(list_objects(&obj)).len() as u64;
        let indexed = obj.stats().objects;
        phantoms_seen.push((indexed, actual));
        assert!(
            indexed <= actual + 1,
            "drop {i}: the capacity index counts {indexed} objects, the bucket holds {actual}: \
             entries of PUTs never sent outlived the dropped store (history {phantoms_seen:?})"
        );
        // the same keys store whole afterwards
        let res = rt.block_on(store_keys(&*obj, &keys, 0, BS));
        assert!(res.is_success(), "{:?}", res.failed);
    }
    rt.block_on(obj.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/tier.rs, cancellation, as above; `GcStats::files`: "Block files
/// in the index"; `GcStats::bytes`: "... plus bytes reserved by stores in flight"). A bounded
/// fs tier's stores dropped at every point: once their work ended, the index counts exactly
/// the block files on disk and no reservation is left.
#[test]
fn fs_dropped_stores_leave_the_gc_index_exact() {
    let _g = shared();
    let rt = runtime();
    let root = temp_root();
    let bs = 64 * 1024;
    let mut c = fs_config(root.path());
    c.gc_max_size_gb = Some(1.0);
    let fs = Arc::new(FsTier::open("fs", c, ns(), bs).unwrap());
    let live = Arc::new(AtomicUsize::new(0));
    for i in 0..16usize {
        let keys: Vec<BlockKey> = (0..6)
            .map(|j| test_key(95_000 + i as u64 * 10 + j))
            .collect();
        let _ = rt.block_on(drop_at(fs.store(store_job(&keys, bs, &live)), i));
        assert!(wait_until(LIMIT, || live.load(Ordering::SeqCst) == 0
            && keys.iter().all(|k| !fs.is_protected(k))));
        let ok = wait_until(LIMIT, || {
            let on_disk = find_files(root.path(), ".bin").len() as u64;
            fs.stats().gc.map(|g| g.files) == Some(on_disk)
        });
        assert!(
            ok,
            "point {i}: the index counts {:?} files, the disk holds {}",
            fs.stats().gc.map(|g| g.files),
            find_files(root.path(), ".bin").len()
        );
    }
    // with every file gone from the index's bytes, what is left is directories and files
    let g = fs.stats().gc.unwrap();
    let files_bytes = find_files(root.path(), ".bin").len() as u64 * bs as u64;
    assert!(g.bytes >= files_bytes, "{g:?}");
    assert!(
        g.bytes <= kv_tier_testkit::allocated_bytes(root.path()) + 64 * 4096 * 4096,
        "bytes reserved by dropped stores left in the total: {g:?}"
    );
    rt.block_on(fs.shutdown()).unwrap();
}

// ------------------------------------------------------------------------------ 7. shared tiers

fn shared_obj_entry(endpoint: &str) -> String {
    format!(
        r#"{{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{endpoint}", "scheme": "http",
            "access_key": "{AK}", "secret_key": "{SK}", "prefix": "shared", "max_size_gb": 1,
            "shared": true, "shared_lease_s": 0.5, "request_timeout_s": 2, "max_retries": 0}}"#
    )
}

/// Whether the server saw no request during `window` (sampled twice).
fn server_quiet(s3: &S3Server, window: Duration) -> bool {
    let a = s3.requests.load(Ordering::SeqCst);
    std::thread::sleep(window);
    s3.requests.load(Ordering::SeqCst) == a
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
    let _g = exclusive();
    let s3_rt = runtime();
    let s3 = s3_rt.block_on(S3Server::start());
    let rt = runtime();
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
        wait_until(LIMIT, || obj
            .stats()
            .shared
            .map(|s| s.leader)
            .unwrap_or(false)),
        "the only instance never led"
    );
    let k = test_key(321);
    store(&m, 1, &[k]);
    m.on_request_finished(RequestId(1));
    rt.block_on(m.wait_idle());
    drop(obj);
    drop(m);
    let ok = wait_until(LIMIT, || rt.metrics().num_alive_tasks() <= base_tasks);
    assert!(
        ok,
        "tasks left on the runtime after the manager was dropped: {} (base {base_tasks})",
        rt.metrics().num_alive_tasks()
    );
    assert!(
        wait_until(LIMIT, || server_quiet(&s3, Duration::from_millis(1_500))),
        "the dropped manager's tier still talks to the bucket"
    );
    rt.block_on(async {
        tokio::time::timeout(LIMIT, async {
            let m = kv_tier::builder(cfg()).unwrap().build().await.unwrap();
            let obj = m.tier::<ObjTier>("obj").unwrap();
            m.shutdown().await.unwrap();
            drop(obj);
        })
        .await
    })
    .unwrap();
}

/// Promise (tier.rs cancellation: "no entry, claim, pin, permit or protection created by the
/// call may outlive the call's own work"; kv-tier crate docs §5). A `build()` dropped after a
/// shared obj tier connected (a later tier still building): the tier's coordination stops,
/// no task is left on the runtime, the server goes quiet.
#[test]
fn a_build_dropped_after_a_shared_obj_tier_connected_stops_its_coordination() {
    let _g = exclusive();
    let s3_rt = runtime();
    let s3 = s3_rt.block_on(S3Server::start());
    let rt = runtime();
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
    let base_tasks = rt.metrics().num_alive_tasks();
    let gate = Gate::new();
    let mut reg = kv_tier::registry();
    reg.register("gated", GatedBuilder { gate: gate.clone() })
        .unwrap();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{}, {{"type": "gated"}}]}}"#,
        shared_obj_entry(&s3.endpoint)
    ))
    .unwrap();
    rt.block_on(async {
        let b = kv_tier::builder(cfg).unwrap().registry(reg).build();
        let mut b = pin!(b);
        let t0 = Instant::now();
        while gate.arrived() == 0 {
            if let Poll::Ready(r) =
                std::future::poll_fn(|cx| Poll::Ready(b.as_mut().poll(cx))).await
            {
                panic!("build finished past a closed gate: {:?}", r.err());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            assert!(t0.elapsed() < LIMIT, "the gated builder was never reached");
        }
        tokio::time::sleep(Duration::from_millis(300)).await; // the coordination runs
    });
    let ok = wait_until(LIMIT, || rt.metrics().num_alive_tasks() <= base_tasks);
    assert!(
        ok,
        "tasks left after the build was dropped: {} (base {base_tasks})",
        rt.metrics().num_alive_tasks()
    );
    assert!(
        wait_until(LIMIT, || server_quiet(&s3, Duration::from_millis(1_500))),
        "the dropped build's tier still talks to the bucket"
    );
}

/// Promise (kv-tier crate docs §5: the fs tier "stops its threads when the last handle to it
/// goes"; fs README "Shared root": each instance runs a coordination thread). A `build()`
/// dropped after a shared fs tier opened, and a manager over a shared root dropped without
/// `shutdown`: no fs thread (coordination included) is left.
#[test]
fn dropping_a_build_or_a_manager_over_a_shared_fs_root_leaves_no_thread() {
    let _g = exclusive();
    let rt = runtime();
    let root = temp_root();
    let base = fs_threads();
    let cfg = |gated: bool| {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "n_read_threads": 1,
                    "n_write_threads": 1, "gc_max_size_gb": 1, "shared": true, "shared_lease_s": 0.5}}{}]}}"#,
            root.path(),
            if gated { r#", {"type": "gated"}"# } else { "" }
        ))
        .unwrap()
    };
    let gate = Gate::new();
    let mut reg = kv_tier::registry();
    reg.register("gated", GatedBuilder { gate: gate.clone() })
        .unwrap();
    let during = rt.block_on(async {
        let b = kv_tier::builder(cfg(true)).unwrap().registry(reg).build();
        let mut b = pin!(b);
        let t0 = Instant::now();
        while gate.arrived() == 0 {
            if let Poll::Ready(r) =
                std::future::poll_fn(|cx| Poll::Ready(b.as_mut().poll(cx))).await
            {
                panic!("build finished past a closed gate: {:?}", r.err());
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            assert!(t0.elapsed() < LIMIT);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        fs_threads()
    });
    assert!(during > base);
    assert!(
        wait_until(LIMIT, || fs_threads() <= base),
        "fs threads left after the build was dropped: {} (base {base})",
        fs_threads()
    );
    let m = rt
        .block_on(kv_tier::builder(cfg(false)).unwrap().build())
        .unwrap();
    let k = test_key(331);
    store(&m, 1, &[k]);
    m.on_request_finished(RequestId(1));
    rt.block_on(m.wait_idle());
    drop(m);
    assert!(
        wait_until(LIMIT, || fs_threads() <= base),
        "fs threads left after the manager was dropped: {} (base {base})",
        fs_threads()
    );
}

// ------------------------------------------------------------------------------ 8. liveness and the ProbeCache's smaller promises

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `wait_idle`: "Work that other callers send
/// meanwhile is not waited for (it may still be in flight when this returns), so the wait
/// ends however much traffic they bring"; `wait_until`: "Each job and probe has a
/// deadline, so this returns within the longest of them"). With another thread adding
/// stores and probes without pause, `wait_idle`, `wait_jobs`, `reset_cache` and `shutdown`
/// each return (bounded), and afterwards nothing is left.
#[test]
fn waits_return_under_continuous_traffic() {
    let _g = shared();
    let (_mem, faulty) = faulty_mem();
    faulty.delay(Some(Duration::from_millis(3)));
    let m = Arc::new(manager(
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
                std::thread::sleep(Duration::from_micros(300));
            }
            i
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let t = |what: &str, f: &dyn Fn() -> bool| {
        assert!(f(), "{what} did not return within 30 s under traffic")
    };
    t("wait_idle", &|| {
        block_on(&m, async {
            tokio::time::timeout(LIMIT, m.wait_idle()).await
        })
        .is_ok()
    });
    t("wait_jobs", &|| {
        block_on(&m, async {
            tokio::time::timeout(LIMIT, m.wait_jobs()).await
        })
        .is_ok()
    });
    t("reset_cache", &|| {
        block_on(&m, async {
            tokio::time::timeout(LIMIT, m.reset_cache()).await
        })
        .is_ok()
    });
    t("shutdown", &|| {
        block_on(&m, async {
            tokio::time::timeout(LIMIT, m.shutdown()).await
        })
        .map(|r| r.expect("shutdown failed"))
        .is_ok()
    });
    stop.store(true, Ordering::SeqCst);
    let n = traffic.join().unwrap();
    assert!(n > 10, "no traffic ran ({n} iterations)");
    assert_clean(&m, &[]);
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
    let _g = shared();
    let (_mem, faulty) = faulty_mem();
    faulty.delay(Some(Duration::from_millis(50)));
    let m = Arc::new(manager(mcfg(256, ""), vec![faulty.clone()]));
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
                std::thread::sleep(Duration::from_millis(10));
            }
            i
        })
    };
    // jobs in flight at every moment from here
    std::thread::sleep(Duration::from_millis(200));
    let jobs = |m: &TieringManager| m.stats().tiers[0].store_jobs;
    let seen_before = jobs(&m);
    let done = block_on(&m, async {
        tokio::time::timeout(LIMIT, m.shutdown()).await
    });
    let seen_at_end = jobs(&m);
    std::thread::sleep(Duration::from_millis(100));
    stop.store(true, Ordering::SeqCst);
    let n = traffic.join().unwrap();
    assert!(
        done.is_ok(),
        "shutdown did not return within {LIMIT:?} while {n} stores were committed"
    );
    done.unwrap().unwrap();
    assert!(seen_before > 0, "no store reached the tier before shutdown");
    assert_eq!(
        jobs(&m),
        seen_at_end,
        "a store committed after shutdown was sent to the tier"
    );
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
    let _g = shared();
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
            assert!(t0.elapsed() < LIMIT);
        }
    };
    // the answer lands and takes a lease; nobody asks: the reaper ends it
    assert_eq!(pc.ask(&k, RequestId(1)), Presence::Retry);
    settle(&mut pc);
    assert_eq!(pc.leased_keys(), 1);
    assert!(faulty.is_protected(&k), "a found key is not protected");
    let reaped = wait_until(LIMIT, || pc.leased_keys() == 0 && !faulty.is_protected(&k));
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

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `with_budget`: "a key whose probe was sent
/// at least the budget before that moment and had not answered by then is absent for the
/// requests that asked for it then, for as long as they live ... The answer is not discarded
/// when it arrives: it is applied at the next application and serves every other request from
/// then on"; tier_options.rs `probe_budget_s`: "counts the key as absent here for the asking
/// request"). On a `ProbeCache`: the request past the budget is absent, and stays absent; at
/// the next application the late "present" answer serves a new request. (Found: the doc said
/// the absence lasted "until the next application", which neither the code nor the other docs
/// do.)
#[test]
fn probe_cache_budget_absence_lasts_for_the_asking_request() {
    let _g = shared();
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let k = test_key(351);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let notify = Arc::new(tokio::sync::Notify::new());
    let mut pc = ProbeCache::new(faulty.clone(), rt.handle().clone(), notify.clone())
        .with_timeouts(Duration::from_secs(30), Duration::from_secs(30))
        .with_budget(Duration::from_millis(10));
    let gate = faulty.hold_lookups();
    assert_eq!(pc.ask(&k, RequestId(1)), Presence::Retry);
    pc.flush();
    rt.block_on(async { tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await })
        .unwrap();
    std::thread::sleep(Duration::from_millis(30));
    pc.apply_results();
    assert_eq!(
        pc.ask(&k, RequestId(1)),
        Presence::Absent,
        "past the budget"
    );
    gate.open();
    rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
    pc.apply_results(); // the next application, with the late answer
    assert_eq!(
        pc.ask(&k, RequestId(2)),
        Presence::Present,
        "the late answer does not serve"
    );
    assert_eq!(
        pc.ask(&k, RequestId(1)),
        Presence::Absent,
        "a request told the key is absent was told otherwise later"
    );
    assert_eq!(pc.stats().late_answers, 1, "{:?}", pc.stats());
    pc.finish_request(RequestId(1));
    pc.finish_request(RequestId(2));
    assert_eq!((pc.tracked_keys(), pc.leased_keys()), (0, 0));
}

/// Promise (README: "A key that misses DRAM is probed in every secondary tier at once; the
/// first tier in order that has it serves it"; ARCHITECTURE.md §1: "a `Present` behind a
/// pending tier is ignored for now"). Two tiers have the key; the first answers late: the
/// block is promoted from the first, never from the second.
#[test]
fn the_first_tier_in_order_serves_even_when_it_answers_last() {
    let _g = shared();
    let rt = runtime();
    let (mem_a, a) = faulty_mem_named("a");
    let (mem_b, b) = faulty_mem_named("b");
    let k = test_key(361);
    assert!(rt.block_on(store_keys(&*mem_a, &[k], 0, BS)).is_success());
    assert!(rt.block_on(store_keys(&*mem_b, &[k], 0, BS)).is_success());
    let m = manager(
        mcfg(4, r#", "probe_timeout_s": 30"#),
        vec![a.clone(), b.clone()],
    );
    let gate = a.hold_lookups();
    let r = ctx(1);
    assert_eq!(m.lookup(&k, &r), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    assert!(
        wait_until(LIMIT, || {
            // the second tier's answer lands; the first is still out
            let v = m.lookup(&k, &r);
            m.on_schedule_end();
            v != Retry || m.stats().tiers[1].probes.keys_found >= 1
        }),
        "{:?}",
        m.stats().tiers[1].probes
    );
    for _ in 0..5 {
        assert_eq!(m.lookup(&k, &r), Retry, "served past a pending first tier");
        m.on_schedule_end();
        std::thread::sleep(Duration::from_millis(5));
    }
    gate.open();
    let (end, seen) = settle(&m, &k, &r);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    let s = m.stats();
    assert_eq!(
        (s.tiers[0].blocks_loaded, s.tiers[1].blocks_loaded),
        (1, 0),
        "served by the wrong tier"
    );
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_clean(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs and tier.rs cancellation). A manager
/// `shutdown` dropped at its first points with a promotion queued and a store in flight,
/// and the manager then used on: `wait_idle` returns, every request ends at `Hit` or `Miss`
/// (a `Hit` with the right bytes), nothing is left once they finish, and a later `shutdown`
/// completes.
#[test]
fn a_manager_used_on_after_a_dropped_shutdown() {
    let _g = shared();
    let rt = runtime();
    for i in 1..8usize {
        let (mem, faulty) = faulty_mem();
        let m = manager(mcfg(6, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
        let (kp, ks) = (test_key(371), test_key(372));
        assert!(rt.block_on(store_keys(&*mem, &[kp], 0, BS)).is_success());
        let r = ctx(1);
        assert_eq!(m.lookup(&kp, &r), Retry);
        m.on_schedule_end();
        idle(&m);
        assert_eq!(m.lookup(&kp, &r), HitPending); // a promotion queued
        let stores = faulty.hold_stores();
        store(&m, 2, &[ks]);
        m.on_request_finished(RequestId(2));
        let _ = block_on(&m, drop_at(m.shutdown(), i));
        stores.open();
        idle(&m);
        let (end, seen) = settle(&m, &kp, &r);
        if end == Hit {
            load_verify(&m, &[kp]);
        }
        let _ = seen;
        assert_eq!(
            m.lookup(&ks, &r),
            Hit,
            "point {i}: the engine's own store is gone from DRAM"
        );
        load_verify(&m, &[ks]);
        m.on_schedule_end();
        m.on_request_finished(r.id);
        assert_clean(&m, &[kp, ks]);
        block_on(&m, async {
            tokio::time::timeout(LIMIT, m.shutdown()).await
        })
        .expect("the later shutdown hung")
        .expect("the later shutdown failed");
    }
}

/// Promise (kv-tier-core/src/stats/mod.rs, `TierStats::promotions_cancelled`: "Queued
/// promotions not sent because their request finished first"; ARCHITECTURE.md §3:
/// "`on_request_finished` cancels that request's queued (unsent) promotions (sinks dropped,
/// slots freed, `holds.failed`, leases released)"; lifecycle.rs `shutdown`: "Afterwards ...
/// stores cascade nowhere"). A request finished with its promotion queued: nothing is sent,
/// the slot and the lease are freed; after shutdown an engine store cascades to no tier.
#[test]
fn a_queued_promotion_of_a_finished_request_is_never_sent() {
    let _g = shared();
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let k = test_key(381);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let loads = faulty.hold_loads();
    let r = ctx(1);
    assert_eq!(m.lookup(&k, &r), Retry);
    m.on_schedule_end();
    idle(&m);
    assert_eq!(m.lookup(&k, &r), HitPending);
    m.on_request_finished(r.id);
    m.on_schedule_end();
    idle(&m);
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
    assert_clean(&m, &[k]);
    loads.open();
    m.shutdown_blocking().unwrap();
    let before = m.stats();
    store(&m, 2, &[test_key(382)]);
    m.on_request_finished(RequestId(2));
    idle(&m);
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

/// Promise (kv-tier-core/src/tier.rs, `store`: "of concurrent stores of one key exactly one
/// copy survives, whole. A store that reports success leaves a readable block"; and the
/// cancellation rule). Two concurrent fs stores of one key, one dropped at every point:
/// the other succeeds and the key loads with its bytes; nothing stays held or protected.
#[test]
fn fs_concurrent_stores_of_one_key_with_one_dropped() {
    let _g = shared();
    let rt = runtime();
    let root = temp_root();
    let bs = 256 * 1024;
    let fs = open_fs(root.path(), bs);
    let live = Arc::new(AtomicUsize::new(0));
    for i in 0..16usize {
        let k = test_key(97_000 + i as u64);
        let b = fs.clone();
        let live2 = live.clone();
        let survivor = rt.spawn(async move { b.store(store_job(&[k], bs, &live2)).await });
        let _ = rt.block_on(drop_at(fs.store(store_job(&[k], bs, &live)), i));
        let res = rt
            .block_on(async { tokio::time::timeout(LIMIT, survivor).await })
            .unwrap_or_else(|_| panic!("point {i}: the surviving store hung"))
            .unwrap();
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        let (res, bytes) = rt.block_on(load_keys(&*fs, &[k], bs));
        assert!(
            res.is_success() && verify_block(&k, 0, &bytes[0].1),
            "point {i}: {:?}",
            res.failed
        );
        assert!(wait_until(LIMIT, || live.load(Ordering::SeqCst) == 0
            && !fs.is_protected(&k)));
    }
    assert!(wait_until(LIMIT, || tmp_files(root.path()).is_empty()));
    rt.block_on(fs.shutdown()).unwrap();
}

/// Promise (tier.rs cancellation; kv-tier crate docs §5). A `build()` that fails at an fs
/// tier (its root is a regular file) after a shared obj tier connected: the obj tier's
/// coordination stops, no task is left, the server goes quiet.
#[test]
fn a_build_failing_after_a_shared_obj_tier_connected_stops_its_coordination() {
    let _g = exclusive();
    let s3_rt = runtime();
    let s3 = s3_rt.block_on(S3Server::start());
    let rt = runtime();
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
    let base_tasks = rt.metrics().num_alive_tasks();
    let dir = temp_root();
    let not_a_dir = dir.path().join("file");
    std::fs::write(&not_a_dir, b"x").unwrap();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{}, {{"type": "fs", "root_dir": {not_a_dir:?}}}]}}"#,
        shared_obj_entry(&s3.endpoint)
    ))
    .unwrap();
    let r = rt.block_on(kv_tier::builder(cfg).unwrap().build());
    assert!(r.is_err(), "built an fs tier on a regular file");
    let ok = wait_until(LIMIT, || rt.metrics().num_alive_tasks() <= base_tasks);
    assert!(
        ok,
        "tasks left after the failed build: {} (base {base_tasks})",
        rt.metrics().num_alive_tasks()
    );
    assert!(
        wait_until(LIMIT, || server_quiet(&s3, Duration::from_millis(1_500))),
        "the failed build's obj tier still talks to the bucket"
    );
}

/// Promise (kv-tier-core/src/manager/mod.rs and ARCHITECTURE.md §2.6: a finished request's
/// lookup state is dropped once its stores end; `TierStats::tracked_requests`: "Requests the
/// tier's probe cache tracks (asked and not finished)"). An engine whose GPU -> DRAM copy
/// completes after the scheduler finished the request (the store committed under the
/// finished id, a probe of it still out): once the manager is idle nothing of that request
/// is tracked, held or leased, and the stored block is served to the next request.
#[test]
fn a_store_committed_after_its_request_finished_leaves_nothing_tracked() {
    let _g = shared();
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let (k, kq) = (test_key(391), test_key(392));
    assert!(rt.block_on(store_keys(&*mem, &[kq], 0, BS)).is_success());
    let m = manager(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
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
    idle(&m);
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
    assert_clean(&m, &[k, kq]);
    let r2 = ctx(2);
    let (end, seen) = settle(&m, &kq, &r2);
    assert_eq!(end, Hit, "{seen:?}");
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    assert_clean(&m, &[k, kq]);
    m.shutdown_blocking().unwrap();
}
