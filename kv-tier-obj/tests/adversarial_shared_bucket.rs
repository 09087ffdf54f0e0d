//! Adversarial tests of the shared bucket mode (`shared: true`), through the public API only
//! (written by a tester who saw the requirement, not the code): several `ObjTier`s in one
//! process on one `ControlledStore` (in-memory, conditional writes) or on the S3 test server,
//! against "a shared bucket with a global bound": peak block bytes <= 1.10x `max_size_gb`, no
//! wrong bytes, keys loaded again and again never deleted, the lease taken over within two
//! periods of the leader's death, coordination objects deleted or garbled, restarts and
//! duplicate ids, nothing hanging, bad config refused naming the field.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{BS, ns};
use futures::TryStreamExt as _;
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::object_store::path::Path as ObjPath;
use kv_tier_obj::object_store::{ObjectStore, ObjectStoreExt as _, PutPayload};
use kv_tier_obj::{ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::ControlledStore;
use kv_tier_testkit::{load_keys, store_keys, test_key, verify_block};

/// Seconds a loaded 2-core machine may add to a bound of a few leases (scheduling, not the
/// protocol): takeovers are checked against two leases plus this.
const SCHED_SLACK_S: f64 = 2.0;

const GIB: f64 = (1u64 << 30) as f64;

fn cfg(id: &str, cap_blocks: u64, lease: f64) -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.max_size_gb = Some((cap_blocks * BS as u64) as f64 / GIB);
    c.shared = true;
    c.shared_lease_s = Some(lease);
    c.instance_id = Some(id.into());
    c.io_threads = 8;
    c.request_timeout_s = 2.0;
    c.max_retries = 0;
    c
}

async fn open(s: &Arc<ControlledStore>, c: ObjTierConfig) -> Arc<ObjTier> {
    common::tier_on(s, c).await
}

fn coord(rel: &str) -> ObjPath {
    ObjPath::from(format!("kv-tier-shared/{}/{rel}", ns().rank_dir_name()))
}

/// Bytes of the rank's block objects in the store.
async fn block_bytes(s: &ControlledStore) -> u64 {
    let prefix = ObjPath::from(ns().rank_dir_name());
    s.inner
        .list(Some(&prefix))
        .try_fold(0u64, |acc, m| async move {
            Ok(acc
                + if m.location.as_ref().ends_with(".bin") {
                    m.size
                } else {
                    0
                })
        })
        .await
        .unwrap()
}

async fn list(s: &ControlledStore, rel: &str) -> Vec<ObjPath> {
    s.inner
        .list(Some(&coord(rel)))
        .map_ok(|m| m.location)
        .try_collect()
        .await
        .unwrap()
}

async fn read(s: &ControlledStore, rel: &str) -> Option<String> {
    let r = s.inner.get(&coord(rel)).await.ok()?;
    Some(String::from_utf8_lossy(&r.bytes().await.ok()?).to_string())
}

/// Samples the bucket's block bytes (and how many instances claim to lead) until stopped.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    max_leaders: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<u64>,
}

fn sampler(s: &Arc<ControlledStore>, tiers: Vec<Arc<ObjTier>>) -> Sampler {
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let max_leaders = Arc::new(AtomicU64::new(0));
    let task = {
        let (s, stop, peak, ml) = (s.clone(), stop.clone(), peak.clone(), max_leaders.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(block_bytes(&s).await, Ordering::Relaxed);
                let leaders = tiers
                    .iter()
                    .filter(|t| t.stats().shared.unwrap().leader)
                    .count() as u64;
                ml.fetch_max(leaders, Ordering::Relaxed);
                if leaders > 1 {
                    // samples with more than one leader, in the high half
                    ml.fetch_add(1 << 32, Ordering::Relaxed);
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            n
        })
    };
    Sampler {
        stop,
        peak,
        max_leaders,
        task,
    }
}

impl Sampler {
    async fn finish(self) -> (u64, u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let n = self.task.await.unwrap();
        let ml = self.max_leaders.load(Ordering::Relaxed);
        if ml >> 32 > 0 {
            eprintln!(
                "samples (every ~2 ms) with more than one leader: {} of {n}",
                ml >> 32
            );
        }
        (self.peak.load(Ordering::Relaxed), ml & 0xffff_ffff, n)
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    stored: u64,
    no_space: u64,
    other: u64,
}

impl std::ops::AddAssign for Tally {
    fn add_assign(&mut self, o: Self) {
        self.stored += o.stored;
        self.no_space += o.no_space;
        self.other += o.other;
    }
}

fn tally(r: &kv_tier_core::JobResult) -> Tally {
    let no_space = r
        .failed
        .iter()
        .filter(|(_, e)| matches!(e, Error::NoSpace { .. }))
        .count() as u64;
    Tally {
        stored: r.ok.len() as u64,
        no_space,
        other: r.failed.len() as u64 - no_space,
    }
}

/// Stores fresh keys `base + seq` as fast as the tier takes them until `until`.
async fn flood(t: Arc<ObjTier>, base: u64, start: u64, until: Instant, job: u64) -> Tally {
    let mut seq = start;
    let mut out = Tally::default();
    while Instant::now() < until {
        let keys: Vec<BlockKey> = (seq..seq + job).map(|i| test_key(base + i)).collect();
        seq += job;
        let r = store_keys(&*t, &keys, 0, BS).await;
        let tl = tally(&r);
        out += tl;
        if tl.stored == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    out
}

fn spawn_flood(
    t: &Arc<ObjTier>,
    base: u64,
    start: u64,
    until: Instant,
    job: u64,
) -> tokio::task::JoinHandle<Tally> {
    tokio::spawn(flood(t.clone(), base, start, until, job))
}

fn base(i: u64) -> u64 {
    (i + 1) << 40
}

fn leaders(ts: &[Arc<ObjTier>]) -> Vec<usize> {
    ts.iter()
        .enumerate()
        .filter(|(_, t)| t.stats().shared.unwrap().leader)
        .map(|(i, _)| i)
        .collect()
}

/// Waits until some instance leads and every instance has stored one block (credit flows).
async fn warm(ts: &[Arc<ObjTier>], tag: u64) {
    let t0 = Instant::now();
    for (i, t) in ts.iter().enumerate() {
        let k = [test_key(0xEE << 48 | tag << 32 | i as u64)];
        loop {
            if store_keys(&**t, &k, 0, BS).await.is_success() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "instance {i} never got credit: {:?}",
                t.stats().shared
            );
        }
    }
}

/// Stores one fresh key at a time on `t` until one succeeds; how long it took (None: never
/// within `within`).
async fn first_success(t: &ObjTier, key_base: u64, within: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < within {
        let k = [test_key(key_base + i)];
        i += 1;
        if store_keys(t, &k, 0, BS).await.is_success() {
            return Some(t0.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

async fn shutdown_all(ts: &[Arc<ObjTier>]) {
    for t in ts {
        let t0 = Instant::now();
        tokio::time::timeout(Duration::from_secs(30), t.shutdown())
            .await
            .expect("shutdown hung")
            .unwrap();
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "shutdown took {:?}",
            t0.elapsed()
        );
    }
}

// ---------------------------------------------------------------------------------------
// The bound under load
// ---------------------------------------------------------------------------------------

/// 6 instances, 2 writers each, distinct keys, 8 s as fast as the store takes them: the
/// bucket's block bytes never exceed 1.10x the bound; the recent keys load with the right
/// bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_instances_flooding_stay_under_the_bound() {
    const CAP: u64 = 512;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..6 {
        ts.push(open(&s, cfg(&format!("i{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 1).await;
    let smp = sampler(&s, ts.clone());
    let until = Instant::now() + Duration::from_secs(8);
    let mut hs = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        for w in 0..2u64 {
            hs.push(spawn_flood(t, base(i as u64), w << 30, until, 8));
        }
    }
    let mut total = Tally::default();
    for h in hs {
        total += h.await.unwrap();
    }
    let (peak, max_leaders, samples) = smp.finish().await;
    // the last keys of each instance's first writer load with their bytes
    let mut wrong = 0;
    for (i, t) in ts.iter().enumerate() {
        let keys: Vec<BlockKey> = (0..64).map(|j| test_key(base(i as u64) + j)).collect();
        let (_, data) = load_keys(&**t, &keys, BS).await;
        wrong += data.iter().filter(|(k, d)| !verify_block(k, 0, d)).count();
    }
    let cap = CAP * BS as u64;
    let ratio = peak as f64 / cap as f64;
    eprintln!(
        "six instances: {total:?}; peak {peak} B = {ratio:.3}x the bound over {samples} samples; max simultaneous leaders {max_leaders}; wrong {wrong}"
    );
    shutdown_all(&ts).await;
    assert_eq!(wrong, 0);
    assert!(total.stored * BS as u64 > 2 * cap, "vacuous: {total:?}");
    assert!(ratio <= 1.10, "peak {peak} B is {ratio:.3}x the bound");
    assert!(max_leaders <= 1, "{max_leaders} instances led at once");
}

// ---------------------------------------------------------------------------------------
// The leader's death
// ---------------------------------------------------------------------------------------

/// The leader dropped (its last `Arc`) without shutdown: another instance holds the lease
/// within two lease periods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_dropped_without_shutdown_is_taken_over() {
    const LEASE: f64 = 0.5;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(open(&s, cfg(&format!("d{i}"), 256, LEASE)).await);
    }
    warm(&ts, 2).await;
    let l = leaders(&ts);
    assert_eq!(l.len(), 1, "leaders {l:?}");
    let dead = ts.remove(l[0]);
    let dead_id = dead.stats().shared.unwrap();
    let before = read(&s, "lease").await;
    drop(dead);
    let t0 = Instant::now();
    let mut took = None;
    while t0.elapsed() < Duration::from_secs_f64(8.0 * LEASE + 10.0) {
        if !leaders(&ts).is_empty() {
            took = Some(t0.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let after = read(&s, "lease").await;
    eprintln!(
        "leader dropped ({dead_id:?}); lease before {before:?}, {:?} later {after:?}; takeover after {took:?}",
        t0.elapsed()
    );
    shutdown_all(&ts).await;
    let took = took.unwrap_or_else(|| {
        panic!(
            "no takeover within {:?} of dropping the leader: the lease went from {before:?} to {after:?} (still renewed)",
            t0.elapsed()
        )
    });
    assert!(
        took <= Duration::from_secs_f64(2.0 * LEASE + SCHED_SLACK_S),
        "takeover after {took:?}"
    );
}

/// Opens a tier on a runtime of its own (so the runtime can be killed, as a process is).
fn open_on_own_runtime(
    s: &Arc<ControlledStore>,
    c: ObjTierConfig,
) -> (tokio::runtime::Runtime, Arc<ObjTier>) {
    let s = s.clone();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let t = rt.block_on(open(&s, c));
        (rt, t)
    })
    .join()
    .unwrap()
}

/// The leader's runtime killed mid-flood (as a SIGKILL does): another instance takes the
/// lease within two lease periods, grants again, and the bound holds throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_runtime_killed_mid_flood_is_taken_over_and_the_bound_holds() {
    const LEASE: f64 = 0.5;
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let (rt, a) = open_on_own_runtime(&s, cfg("k-a", CAP, LEASE));
    // a leads (it opened first)
    let t0 = Instant::now();
    while !a.stats().shared.unwrap().leader {
        assert!(t0.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let b = open(&s, cfg("k-b", CAP, LEASE)).await;
    let c = open(&s, cfg("k-c", CAP, LEASE)).await;
    let others = vec![b.clone(), c.clone()];
    warm(&others, 3).await;
    let smp = sampler(&s, others.clone());
    // a floods on its own runtime
    let a_until = Instant::now() + Duration::from_secs(30);
    let _a_flood = rt.spawn(flood(a.clone(), base(0), 0, a_until, 8));
    let until = Instant::now() + Duration::from_secs(7);
    let hb = spawn_flood(&b, base(1), 0, until, 8);
    let hc = spawn_flood(&c, base(2), 0, until, 8);
    tokio::time::sleep(Duration::from_secs(2)).await;
    rt.shutdown_background();
    let killed = Instant::now();
    let mut took = None;
    while killed.elapsed() < Duration::from_secs_f64(8.0 * LEASE + 10.0) {
        if !leaders(&others).is_empty() {
            took = Some(killed.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let tb = hb.await.unwrap();
    let tc = hc.await.unwrap();
    // credit flows after the takeover
    let late_b = first_success(&b, 0xB0 << 40, Duration::from_secs(30)).await;
    let late_c = first_success(&c, 0xC0 << 40, Duration::from_secs(30)).await;
    let (peak, max_leaders, samples) = smp.finish().await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "killed leader: takeover after {took:?}; b {tb:?} c {tc:?}; later stores b {late_b:?} c {late_c:?}; peak {ratio:.3}x over {samples} samples; max leaders among survivors {max_leaders}"
    );
    shutdown_all(&others).await;
    drop(a);
    let took = took.expect("no survivor took the lease");
    assert!(
        took <= Duration::from_secs_f64(2.0 * LEASE + SCHED_SLACK_S),
        "takeover after {took:?}"
    );
    assert!(
        late_b.is_some() && late_c.is_some(),
        "no credit after the takeover"
    );
    assert!(ratio <= 1.10, "peak {ratio:.3}x the bound");
}

// ---------------------------------------------------------------------------------------
// Coordination objects deleted or garbled under live instances
// ---------------------------------------------------------------------------------------

/// Floods `ts` for `secs`, in two halves; returns the tallies of the second half.
async fn flood_halves(ts: &[Arc<ObjTier>], key_tag: u64, secs: f64) -> (Vec<Tally>, Vec<Tally>) {
    let half = Duration::from_secs_f64(secs / 2.0);
    let mut first = Vec::new();
    let mut second = Vec::new();
    let mid = Instant::now() + half;
    let hs: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| spawn_flood(t, base(i as u64) | key_tag << 36, 0, mid, 8))
        .collect();
    for h in hs {
        first.push(h.await.unwrap());
    }
    let end = Instant::now() + half;
    let hs: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| spawn_flood(t, base(i as u64) | key_tag << 36, 1 << 30, end, 8))
        .collect();
    for h in hs {
        second.push(h.await.unwrap());
    }
    (first, second)
}

/// The lease object deleted at epoch 1 under three live instances: stores go on (credit
/// flows again), the bound holds, at most one leader at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_deleted_at_epoch_one() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(open(&s, cfg(&format!("l{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 4).await;
    // some traffic first, longer than the journal's retention (4 leases = 2 s), so each
    // writer's cumulative grant exceeds what its retained journal accounts for
    let until = Instant::now() + Duration::from_secs(4);
    let hs: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| spawn_flood(t, base(i as u64), 0, until, 8))
        .collect();
    for h in hs {
        h.await.unwrap();
    }
    let smp = sampler(&s, ts.clone());
    let before: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    s.inner.delete(&coord("lease")).await.unwrap();
    let (first, second) = flood_halves(&ts, 1, 8.0).await;
    let (peak, max_leaders, _) = smp.finish().await;
    let after: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    let lease = read(&s, "lease").await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "lease deleted at epoch 1: before {before:?}\nafter {after:?}\nlease now {lease:?}\nfirst 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x, max leaders {max_leaders}"
    );
    shutdown_all(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
    assert!(max_leaders <= 1, "{max_leaders} leaders at once");
}

/// After a clean handover (epoch 2), the lease object is deleted: stores must go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_deleted_after_a_handover() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(open(&s, cfg(&format!("h{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 5).await;
    let l = leaders(&ts);
    assert_eq!(l.len(), 1);
    let old = ts.remove(l[0]);
    old.shutdown().await.unwrap();
    drop(old);
    let t0 = Instant::now();
    while !ts.iter().any(|t| {
        let st = t.stats().shared.unwrap();
        st.leader && st.epoch == 2
    }) {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "the released lease was not taken"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    warm(&ts, 6).await;
    let epoch_before: Vec<u64> = ts.iter().map(|t| t.stats().shared.unwrap().epoch).collect();
    let smp = sampler(&s, ts.clone());
    s.inner.delete(&coord("lease")).await.unwrap();
    let (first, second) = flood_halves(&ts, 2, 8.0).await;
    let (peak, max_leaders, _) = smp.finish().await;
    let after: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    let lease = read(&s, "lease").await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "lease deleted after a handover (epochs {epoch_before:?}): lease now {lease:?}\nafter {after:?}\nfirst 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x, max leaders {max_leaders}"
    );
    shutdown_all(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
}

/// The lease object overwritten with garbage under live instances: stores go on, the bound
/// holds, at most one leader at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_garbled() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(open(&s, cfg(&format!("g{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 7).await;
    // some traffic first, longer than the journal's retention (4 leases = 2 s), so each
    // writer's cumulative grant exceeds what its retained journal accounts for
    let until = Instant::now() + Duration::from_secs(4);
    let hs: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| spawn_flood(t, base(i as u64) | 11 << 36, 0, until, 8))
        .collect();
    for h in hs {
        h.await.unwrap();
    }
    let smp = sampler(&s, ts.clone());
    s.inner
        .put(&coord("lease"), PutPayload::from("\u{1}garbage\u{ff}"))
        .await
        .unwrap();
    let (first, second) = flood_halves(&ts, 3, 8.0).await;
    let (peak, max_leaders, _) = smp.finish().await;
    let after: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    let lease = read(&s, "lease").await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "lease garbled: lease now {lease:?}\nafter {after:?}\nfirst 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x, max leaders {max_leaders}"
    );
    shutdown_all(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
    assert!(max_leaders <= 1, "{max_leaders} leaders at once");
}

/// `grants/<id>` deleted and garbled repeatedly for 1 s under a flooding instance: its stores
/// go on afterwards, the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_deleted_and_garbled() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(open(&s, cfg(&format!("gr{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 8).await;
    let smp = sampler(&s, ts.clone());
    let vandal = {
        let s = s.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let mut n = 0u64;
            while t0.elapsed() < Duration::from_secs(1) {
                for id in ["gr0", "gr1", "gr2"] {
                    let p = coord(&format!("grants/{id}"));
                    if n.is_multiple_of(2) {
                        let _ = s.inner.delete(&p).await;
                    } else {
                        let _ = s.inner.put(&p, PutPayload::from("x\u{0} 1e3 -")).await;
                    }
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(7)).await;
            }
        })
    };
    let (first, second) = flood_halves(&ts, 4, 8.0).await;
    vandal.await.unwrap();
    let (peak, _, _) = smp.finish().await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!("grants vandalised: first 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x");
    shutdown_all(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
}

/// Every `members/<id>` heartbeat deleted every 15 ms for 6 s under `n` flooding instances:
/// the bound holds and stores go on.
async fn heartbeats_deleted(n: usize) {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..n {
        ts.push(open(&s, cfg(&format!("m{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 9).await;
    let smp = sampler(&s, ts.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let vandal = {
        let (s, stop) = (s.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                for p in list(&s, "members").await {
                    let _ = s.inner.delete(&p).await;
                }
                tokio::time::sleep(Duration::from_millis(15)).await;
            }
        })
    };
    let (first, second) = flood_halves(&ts, 5, 6.0).await;
    stop.store(true, Ordering::Relaxed);
    vandal.await.unwrap();
    let (peak, max_leaders, _) = smp.finish().await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "heartbeats deleted, {n} instances: first 3 s {first:?}\nlast 3 s {second:?}\npeak {ratio:.3}x, max leaders {max_leaders}"
    );
    shutdown_all(&ts).await;
    assert!(ratio <= 1.10, "peak {peak} B = {ratio:.3}x the bound");
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 3 s: {t:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_deleted_repeatedly_4_instances() {
    heartbeats_deleted(4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_deleted_repeatedly_8_instances() {
    heartbeats_deleted(8).await;
}

/// The leader's PUT of one member's grant times out once (the request held past its
/// deadline, so it never lands: a transient failure): that member is granted credit again
/// afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_put_that_times_out_once_does_not_starve_the_member() {
    use kv_tier_testkit::controlled_store::Op;
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let c = |id: &str| {
        let mut c = cfg(id, CAP, 0.5);
        c.request_timeout_s = 0.3;
        c
    };
    let q0 = open(&s, c("q0")).await;
    let t0 = Instant::now();
    while !q0.stats().shared.unwrap().leader {
        assert!(t0.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // the leader's first grant PUT to q1 is held past its deadline (never lands)
    let vid = "q1";
    let path = coord(&format!("grants/{vid}")).to_string();
    let _gate = s.hold_path(Op::Put, &path);
    let q1 = open(&s, c("q1")).await;
    let q2 = open(&s, c("q2")).await;
    let ts = vec![q0, q1, q2];
    let v = 1;
    let before = read(&s, &format!("grants/{vid}")).await;
    let held_until = Instant::now() + Duration::from_secs(2);
    let during = flood(ts[v].clone(), base(v as u64) | 12 << 36, 0, held_until, 8).await;
    s.release(Op::Put);
    let mid = read(&s, &format!("grants/{vid}")).await;
    let (first, second) = flood_halves(&ts, 13, 6.0).await;
    let after = read(&s, &format!("grants/{vid}")).await;
    let st = ts[v].stats().shared.unwrap();
    eprintln!(
        "grant PUT held for {vid}: grant before {before:?}, after the hold {mid:?}, at the end {after:?}; during {during:?}\nthen first 3 s {first:?}\nlast 3 s {second:?}\n{vid}: {st:?}"
    );
    shutdown_all(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 3 s: {t:?}"
        );
    }
}

/// One member's heartbeat PUTs fail (held past their deadline) for 4 s, long enough for
/// the leader to find it dead and forget it, while its journal and grant reads still work;
/// then its heartbeats land again: it is granted credit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_heartbeat_lapses_is_granted_again() {
    use kv_tier_testkit::controlled_store::Op;
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        let mut c = cfg(&format!("hb{i}"), CAP, 0.5);
        c.request_timeout_s = 0.2;
        ts.push(open(&s, c).await);
    }
    warm(&ts, 20).await;
    let l = leaders(&ts);
    assert_eq!(l.len(), 1);
    let v = (l[0] + 1) % 3;
    // traffic first: its cumulative grant grows
    let until = Instant::now() + Duration::from_secs(2);
    let hs: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| spawn_flood(t, base(i as u64) | 14 << 36, 0, until, 8))
        .collect();
    for h in hs {
        h.await.unwrap();
    }
    let _gate = s.hold_path(Op::Put, coord(&format!("members/hb{v}")).as_ref());
    let held = Instant::now();
    let leader = ts[l[0]].clone();
    let mut members_min = u64::MAX;
    while held.elapsed() < Duration::from_secs(4) {
        members_min = members_min.min(leader.stats().shared.unwrap().members);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.release(Op::Put);
    let (first, second) = flood_halves(&ts, 15, 6.0).await;
    let st = ts[v].stats().shared.unwrap();
    let grant = read(&s, &format!("grants/hb{v}")).await;
    eprintln!(
        "heartbeat of hb{v} held 4 s (leader counted as few as {members_min} members)\nthen first 3 s {first:?}\nlast 3 s {second:?}\nhb{v}: {st:?}; its grant object {grant:?}"
    );
    shutdown_all(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 3 s: {t:?}"
        );
    }
}

/// One instance's journal batches deleted for 1 s while it stores (a batch the leader had
/// not read yet goes missing): its stores are granted again afterwards and the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_batches_deleted() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(open(&s, cfg(&format!("j{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 10).await;
    let smp = sampler(&s, ts.clone());
    let victim = ts[1].clone();
    let until = Instant::now() + Duration::from_secs(1);
    let h = spawn_flood(&victim, base(1) | 6 << 36, 0, until, 8);
    let mut deleted = 0;
    while Instant::now() < until {
        for p in list(&s, "journal/j1").await {
            if s.inner.delete(&p).await.is_ok() {
                deleted += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let during = h.await.unwrap();
    let (first, second) = flood_halves(&ts, 7, 6.0).await;
    let (peak, _, _) = smp.finish().await;
    let st = victim.stats().shared.unwrap();
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "journal of j1: {deleted} batches deleted; during {during:?}\nthen first 3 s {first:?}\nlast 3 s {second:?}\nj1 {st:?}\npeak {ratio:.3}x"
    );
    shutdown_all(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 3 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
}

// ---------------------------------------------------------------------------------------
// Instance ids reused
// ---------------------------------------------------------------------------------------

/// Two instances opened with the SAME instance_id (plus a third): either the second open is
/// refused, or the bound holds under their flood.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_the_same_id() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let x = open(&s, cfg("x", CAP, 0.5)).await;
    let d1 = open(&s, cfg("dup", CAP, 0.5)).await;
    let second = ObjTier::with_store("obj", s.clone(), cfg("dup", CAP, 0.5), ns(), BS).await;
    let d2 = match second {
        Err(e) => {
            eprintln!("the second open with the same id was refused: {e}");
            shutdown_all(&[x, d1]).await;
            return;
        }
        Ok(t) => Arc::new(t),
    };
    let ts = vec![x, d1, d2];
    warm(&ts, 11).await;
    let smp = sampler(&s, ts.clone());
    let (first, second) = flood_halves(&ts, 8, 8.0).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let resid = block_bytes(&s).await;
    let (peak, _, _) = smp.finish().await;
    let cap = CAP * BS as u64;
    let ratio = peak as f64 / cap as f64;
    eprintln!(
        "same id twice (second open accepted): first 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x; 2 s after the flood the bucket holds {:.3}x",
        resid as f64 / cap as f64
    );
    shutdown_all(&ts).await;
    assert!(ratio <= 1.10, "peak {peak} B = {ratio:.3}x the bound");
}

/// An instance shut down cleanly and reopened at once with the same instance_id (a restart)
/// while the leader lives: the bound holds while it floods, and once the flood stops the
/// leader brings the bucket back under the bound (it knows the restarted instance's objects).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_with_the_same_id_while_the_leader_lives() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let lead = open(&s, cfg("lead", CAP, 0.5)).await;
    let t0 = Instant::now();
    while !lead.stats().shared.unwrap().leader {
        assert!(t0.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let b = open(&s, cfg("b", CAP, 0.5)).await;
    warm(&[lead.clone(), b.clone()], 12).await;
    // b's first life: 3 s of flood (several bounds' worth)
    let first = flood(
        b.clone(),
        base(1),
        0,
        Instant::now() + Duration::from_secs(3),
        8,
    )
    .await;
    let st1 = b.stats().shared.unwrap();
    b.shutdown().await.unwrap();
    drop(b);
    let smp = sampler(&s, vec![lead.clone()]);
    let b = open(&s, cfg("b", CAP, 0.5)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = flood(
        b.clone(),
        base(1),
        1 << 30,
        Instant::now() + Duration::from_secs(4),
        8,
    )
    .await;
    let st2 = b.stats().shared.unwrap();
    // idle: the leader's sweeps bring the bucket back under its bound (polled, bounded: a
    // loaded machine's leader may sweep late)
    let cap = CAP * BS as u64;
    let idle_since = Instant::now();
    let mut resid = block_bytes(&s).await;
    while resid > cap && idle_since.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        resid = block_bytes(&s).await;
    }
    let (peak, _, _) = smp.finish().await;
    let lst = lead.stats();
    let ratio = peak as f64 / cap as f64;
    let resid_ratio = resid as f64 / cap as f64;
    eprintln!(
        "restart with the same id: first life {first:?} {st1:?}\nsecond life {second:?} {st2:?}\nleader indexes {} B / {} objects, {:?}\npeak {ratio:.3}x; {:?} after the flood the bucket holds {resid_ratio:.3}x",
        lst.bytes,
        lst.objects,
        lst.shared,
        idle_since.elapsed()
    );
    shutdown_all(&[lead, b]).await;
    assert!(ratio <= 1.10, "peak {peak} B = {ratio:.3}x the bound");
    assert!(
        resid_ratio <= 1.0,
        "the bucket stays at {resid_ratio:.3}x its bound once idle"
    );
}

/// Every instance shut down cleanly, then all reopened with the same ids (a fleet restart):
/// each instance stores again (credit keeps flowing) and the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_shut_down_then_reopened_with_the_same_ids() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let ids = ["r0", "r1", "r2"];
    let mut ts = Vec::new();
    for id in ids {
        ts.push(open(&s, cfg(id, CAP, 0.5)).await);
    }
    warm(&ts, 13).await;
    let (f1, s1) = flood_halves(&ts, 9, 3.0).await;
    shutdown_all(&ts).await;
    drop(ts);
    let mut ts = Vec::new();
    for id in ids {
        ts.push(open(&s, cfg(id, CAP, 0.5)).await);
    }
    // an engine opens, then stores a little later
    tokio::time::sleep(Duration::from_millis(500)).await;
    let smp = sampler(&s, ts.clone());
    let (f2, s2) = flood_halves(&ts, 10, 8.0).await;
    let (peak, _, _) = smp.finish().await;
    let sts: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "fleet restart: before {f1:?} {s1:?}\nafter, first 4 s {f2:?}\nafter, last 4 s {s2:?}\n{sts:#?}\npeak {ratio:.3}x"
    );
    shutdown_all(&ts).await;
    for (i, t) in s2.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s after reopening: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
}

// ---------------------------------------------------------------------------------------
// Cancellation, loads, shutdown
// ---------------------------------------------------------------------------------------

/// Store, load and lookup futures dropped at random early points 600 times across three
/// instances: afterwards every instance stores within 3 s, the bound held, and once idle the
/// leader's count agrees with the bucket (no credit or store in flight leaked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_futures_leave_nothing_wedged() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(open(&s, cfg(&format!("c{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 14).await;
    let smp = sampler(&s, ts.clone());
    let mut rng = 0x1234_5678_9abc_def1u64;
    let mut dropped = 0;
    for n in 0..600u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let t = &ts[(rng % 3) as usize];
        let d = Duration::from_micros(rng >> 54); // 0 to ~1 ms
        let keys: Vec<BlockKey> = (0..8).map(|j| test_key(0xC0 << 40 | n << 8 | j)).collect();
        let r = match n % 3 {
            0 => tokio::time::timeout(d, store_keys(&**t, &keys, 0, BS))
                .await
                .is_err(),
            1 => tokio::time::timeout(d, load_keys(&**t, &keys, BS))
                .await
                .is_err(),
            _ => tokio::time::timeout(d, t.lookup(&keys)).await.is_err(),
        };
        dropped += r as u64;
    }
    let mut late = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        late.push(first_success(t, 0xCF << 40 | (i as u64) << 20, Duration::from_secs(30)).await);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (peak, _, _) = smp.finish().await;
    let bucket = block_bytes(&s).await;
    let l = leaders(&ts);
    let global = l
        .first()
        .map(|&i| ts[i].stats().shared.unwrap().global_bytes);
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "{dropped} of 600 futures dropped; later first stores {late:?}; peak {ratio:.3}x; idle: bucket {bucket} B, leader's global_bytes {global:?}"
    );
    shutdown_all(&ts).await;
    assert!(
        late.iter().all(Option::is_some),
        "no credit after drops: {late:?}"
    );
    assert!(ratio <= 1.10);
}

/// One instance loads 8 hot keys every 30 ms while two others flood for 8 s: no hot load
/// misses, and the bytes are right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_keys_loaded_repeatedly_survive_a_flood() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(open(&s, cfg(&format!("hk{i}"), CAP, 0.5)).await);
    }
    warm(&ts, 15).await;
    let hot: Vec<BlockKey> = (0..8).map(|i| test_key(0xA0 << 40 | i)).collect();
    let t0 = Instant::now();
    while !store_keys(&*ts[0], &hot, 0, BS).await.is_success() {
        assert!(t0.elapsed() < Duration::from_secs(5));
    }
    let until = Instant::now() + Duration::from_secs(8);
    let h1 = spawn_flood(&ts[1], base(1), 0, until, 8);
    let h2 = spawn_flood(&ts[2], base(2), 0, until, 8);
    let (mut loads, mut misses, mut wrong) = (0, 0, 0);
    let mut first_miss = None;
    while Instant::now() < until {
        let (r, data) = load_keys(&*ts[0], &hot, BS).await;
        loads += hot.len();
        misses += r.failed.len();
        if !r.failed.is_empty() && first_miss.is_none() {
            first_miss = Some((t0.elapsed(), format!("{:?}", r.failed[0].1)));
        }
        wrong += data.iter().filter(|(k, d)| !verify_block(k, 0, d)).count();
        tokio::time::sleep(Duration::from_millis(30)).await;
    }
    let f = (h1.await.unwrap(), h2.await.unwrap());
    eprintln!(
        "hot keys: {loads} loads, {misses} misses (first {first_miss:?}), {wrong} wrong; flood {f:?}"
    );
    shutdown_all(&ts).await;
    assert_eq!(wrong, 0);
    assert_eq!(misses, 0, "hot keys deleted: first {first_miss:?}");
}

/// With no credit to be had (the bound is under a block for the writer's share), a store of
/// 64 blocks is refused with NoSpace in about a second; a shutdown while it waits ends at
/// once, and the store ends too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_waiting_for_credit_end_in_about_a_second_and_shutdown_ends() {
    let s = Arc::new(ControlledStore::new());
    // 16 blocks, 3 instances: each may hold 16*4096/8/3 = 2730 bytes unspent < one block
    let mut ts = Vec::new();
    for i in 0..3 {
        let mut c = cfg(&format!("n{i}"), 16, 0.5);
        c.io_threads = 4;
        ts.push(open(&s, c).await);
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let keys: Vec<BlockKey> = (0..64).map(|i| test_key(0xD0 << 40 | i)).collect();
    let t0 = Instant::now();
    let r = store_keys(&*ts[0], &keys, 0, BS).await;
    let took = t0.elapsed();
    let tl = tally(&r);
    // during a wait: shutdown
    let t = ts[1].clone();
    let keys2: Vec<BlockKey> = (0..64).map(|i| test_key(0xD1 << 40 | i)).collect();
    let st = tokio::spawn(async move {
        let t0 = Instant::now();
        let r = store_keys(&*t, &keys2, 0, BS).await;
        (t0.elapsed(), tally(&r))
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t1 = Instant::now();
    ts[1].shutdown().await.unwrap();
    let shut = t1.elapsed();
    let (store_took, tl2) = st.await.unwrap();
    eprintln!(
        "no credit: a 64-block store (io_threads 4) took {took:?}: {tl:?}; with a shutdown 300 ms in: shutdown took {shut:?}, the store {store_took:?}: {tl2:?}"
    );
    shutdown_all(&[ts[0].clone(), ts[2].clone()]).await;
    assert!(shut < Duration::from_secs(10), "shutdown took {shut:?}");
    assert!(
        took < Duration::from_secs(10),
        "a store without credit took {took:?}"
    );
    assert!(
        store_took < Duration::from_secs(10),
        "a store during shutdown took {store_took:?}"
    );
}

/// A bound of 7 blocks, one instance alone: a non-shared bounded tier stores up to 7 blocks;
/// the shared one should store something (or refuse the config naming a field).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_bound_still_grants_a_block() {
    let s = Arc::new(ControlledStore::new());
    let c = cfg("small", 7, 0.5);
    let t = match ObjTier::with_store("obj", s.clone(), c, ns(), BS).await {
        Ok(t) => Arc::new(t),
        Err(e) => {
            eprintln!("refused: {e}");
            return;
        }
    };
    let got = first_success(&t, 0x5A << 40, Duration::from_secs(5)).await;
    let st = t.stats().shared.unwrap();
    eprintln!("bound of 7 blocks: first store after {got:?}; {st:?}");
    shutdown_all(&[t]).await;
    assert!(
        got.is_some(),
        "nothing stored within 5 s under a 7-block bound: {st:?}"
    );
}

// ---------------------------------------------------------------------------------------
// Config edges
// ---------------------------------------------------------------------------------------

#[test]
fn out_of_range_and_malformed_shared_options_are_refused_naming_the_field() {
    let ok = cfg("a", 16, 1.0);
    ok.validate().unwrap();
    let mut bad = Vec::new();
    for v in [
        0.0,
        0.0999,
        -1.0,
        600.001,
        1e9,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ] {
        let mut c = ok.clone();
        c.shared_lease_s = Some(v);
        match c.validate() {
            Err(e) if e.to_string().contains("shared_lease_s") => {}
            other => bad.push(format!("shared_lease_s {v}: {other:?}")),
        }
    }
    for v in [0.1, 600.0] {
        let mut c = ok.clone();
        c.shared_lease_s = Some(v);
        if let Err(e) = c.validate() {
            bad.push(format!("shared_lease_s {v} refused: {e}"));
        }
    }
    let long = "a".repeat(65);
    for id in [
        "",
        ".",
        "..",
        "a/b",
        "a b",
        "ä",
        "a\nb",
        "a:b",
        "*",
        long.as_str(),
        "a%2Fb",
    ] {
        let mut c = ok.clone();
        c.instance_id = Some(id.into());
        match c.validate() {
            Err(e) if e.to_string().contains("instance_id") => {}
            other => bad.push(format!("instance_id {id:?}: {other:?}")),
        }
    }
    for id in ["a", "A-b_c.9", &"z".repeat(64), "...", "-"] {
        let mut c = ok.clone();
        c.instance_id = Some(id.into());
        if let Err(e) = c.validate() {
            bad.push(format!("instance_id {id:?} refused: {e}"));
        }
    }
    // through a spec, as a user writes it
    for (k, v) in [
        ("shared_lease_s", serde_json::json!(0.05)),
        ("shared_lease_s", serde_json::json!("1")),
        ("shared_lease_s", serde_json::json!(-3)),
        ("instance_id", serde_json::json!("a/b")),
        ("instance_id", serde_json::json!(7)),
        ("shared", serde_json::json!("yes")),
    ] {
        let mut opts = serde_json::Map::new();
        opts.insert("bucket".into(), "b".into());
        opts.insert("shared".into(), true.into());
        opts.insert("max_size_gb".into(), 1.into());
        opts.insert(k.into(), v.clone());
        let mut spec = kv_tier_core::TierSpec::new("obj");
        spec.options = opts;
        match ObjTierConfig::from_spec(&spec) {
            Err(e) if e.to_string().contains(k) => {}
            other => bad.push(format!("spec {k}={v}: {other:?}")),
        }
    }
    assert!(
        bad.is_empty(),
        "not refused naming the field (or wrongly refused):\n{}",
        bad.join("\n")
    );
}

/// The lease at its range's ends: 0.1 s (two instances flooding 4 s: the bound holds, the
/// lease does not flap much, shutdown ends) and 600 s (stores are granted within a few s,
/// shutdown ends promptly).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_at_the_ends_of_its_range() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let ts = vec![
        open(&s, cfg("e0", CAP, 0.1)).await,
        open(&s, cfg("e1", CAP, 0.1)).await,
    ];
    warm(&ts, 17).await;
    let smp = sampler(&s, ts.clone());
    let until = Instant::now() + Duration::from_secs(4);
    let h0 = spawn_flood(&ts[0], base(0), 0, until, 8);
    let h1 = spawn_flood(&ts[1], base(1), 0, until, 8);
    let f = (h0.await.unwrap(), h1.await.unwrap());
    let (peak, max_leaders, _) = smp.finish().await;
    let takeovers: u64 = ts.iter().map(|t| t.stats().shared.unwrap().takeovers).sum();
    let epoch = ts[0].stats().shared.unwrap().epoch;
    let t0 = Instant::now();
    shutdown_all(&ts).await;
    let shut_fast = t0.elapsed();
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    // 600 s
    let s2 = Arc::new(ControlledStore::new());
    let long = open(&s2, cfg("long", CAP, 600.0)).await;
    let got = first_success(&long, 0x60 << 40, Duration::from_secs(10)).await;
    let t1 = Instant::now();
    shutdown_all(std::slice::from_ref(&long)).await;
    let shut_long = t1.elapsed();
    eprintln!(
        "lease 0.1 s: {f:?}, peak {ratio:.3}x, takeovers {takeovers} (epoch {epoch}), max leaders {max_leaders}, shutdown {shut_fast:?}; lease 600 s: first store after {got:?}, shutdown {shut_long:?}"
    );
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
    assert!(got.is_some(), "lease 600 s: no store granted within 10 s");
    assert!(
        shut_long < Duration::from_secs(5),
        "lease 600 s: shutdown took {shut_long:?}"
    );
}

// ---------------------------------------------------------------------------------------
// On the S3 test server
// ---------------------------------------------------------------------------------------

fn s3_block_bytes(dir: &std::path::Path) -> u64 {
    let mut total = 0;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in rd.flatten() {
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() {
            total += s3_block_bytes(&e.path());
        } else if e.file_name().to_string_lossy().ends_with(".bin")
            && let Ok(m) = e.metadata()
        {
            total += m.len();
        }
    }
    total
}

/// On the S3 server: an instance restarted with the same instance_id while the leader
/// lives floods; the bucket's block bytes stay within 1.10x the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_restart_with_the_same_id_while_the_leader_lives() {
    use common::{AK, BUCKET, S3Server, S3ServerExt as _, SK};
    const CAP: u64 = 256;
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("s3");
    let server = S3Server::serve(
        &root,
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        BUCKET,
        AK,
        SK,
    )
    .await
    .unwrap();
    let rank_dir = root.join(BUCKET).join("tests").join(ns().rank_dir_name());
    let s3cfg = |id: &str| {
        let mut c = server.config();
        let base = cfg(id, CAP, 1.0);
        c.max_size_gb = base.max_size_gb;
        c.shared = true;
        c.shared_lease_s = base.shared_lease_s;
        c.instance_id = base.instance_id;
        c.io_threads = 8;
        c
    };
    let lead = Arc::new(server.tier(s3cfg("lead")).await);
    let t0 = Instant::now();
    while !lead.stats().shared.unwrap().leader {
        assert!(t0.elapsed() < Duration::from_secs(5));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let b = Arc::new(server.tier(s3cfg("b")).await);
    warm(&[lead.clone(), b.clone()], 18).await;
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let smp = {
        let (stop, peak, rank_dir) = (stop.clone(), peak.clone(), rank_dir.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(s3_block_bytes(&rank_dir), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let first = flood(
        b.clone(),
        base(1),
        0,
        Instant::now() + Duration::from_secs(6),
        8,
    )
    .await;
    let st1 = b.stats().shared.unwrap();
    let peak_first = peak.load(Ordering::Relaxed);
    b.shutdown().await.unwrap();
    drop(b);
    let b = Arc::new(server.tier(s3cfg("b")).await);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = flood(
        b.clone(),
        base(1),
        1 << 30,
        Instant::now() + Duration::from_secs(6),
        8,
    )
    .await;
    let st2 = b.stats().shared.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    let resid = s3_block_bytes(&rank_dir);
    stop.store(true, Ordering::Relaxed);
    smp.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
    let cap = CAP * BS as u64;
    let ratio = peak as f64 / cap as f64;
    eprintln!(
        "S3, restart with the same id: first life {first:?} {st1:?} (peak then {:.3}x)\nsecond life {second:?} {st2:?}\npeak {ratio:.3}x; 4 s after the flood the bucket holds {:.3}x; leader {:?}",
        peak_first as f64 / cap as f64,
        resid as f64 / cap as f64,
        lead.stats().shared
    );
    shutdown_all(&[lead, b]).await;
    assert!(ratio <= 1.10, "peak {peak} B = {ratio:.3}x the bound");
    drop(server);
}
