//! Helpers of the shared-bucket tests (`crate::shared`): configs, instances on their own
//! runtime, floods and their tallies, a sampler of the bucket's bytes and leaders, the
//! coordination objects, child processes.

use std::path::Path;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures::TryStreamExt as _;
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::object_store::path::Path as ObjPath;
use kv_tier_obj::object_store::{ObjectStore, ObjectStoreExt as _};
use kv_tier_obj::{ObjChecksum, ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::ControlledStore;
use kv_tier_testkit::fixtures::process::test_binary_child;
use kv_tier_testkit::wait::poll_until_async;
use kv_tier_testkit::{find_files, store_keys, test_key};

use super::{BS, ns, present_bytes, tier_on};

/// Seconds a loaded 2-core machine may add to a bound of a few leases (scheduling, not the
/// protocol): takeovers are checked against two leases plus this.
pub(crate) const SCHED_SLACK_S: f64 = 2.0;

/// A GiB, in bytes.
pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// The path of the coordination object `rel` of this binary's rank (`lease`, `grants/<id>`,
/// `members`, `journal/<id>`...).
pub(crate) fn coord(rel: &str) -> ObjPath {
    ObjPath::from(format!("kv-tier-shared/{}/{rel}", ns().rank_dir_name()))
}

/// The coordination objects under `rel` in `s`.
pub(crate) async fn list(s: &ControlledStore, rel: &str) -> Vec<ObjPath> {
    s.inner
        .list(Some(&coord(rel)))
        .map_ok(|m| m.location)
        .try_collect()
        .await
        .unwrap()
}

/// The text of the coordination object `rel` in `s`, if it is there.
pub(crate) async fn read(s: &ControlledStore, rel: &str) -> Option<String> {
    let r = s.inner.get(&coord(rel)).await.ok()?;
    Some(String::from_utf8_lossy(&r.bytes().await.ok()?).to_string())
}

/// Samples the bucket's block bytes (and how many instances claim to lead) until stopped.
pub(crate) struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    max_leaders: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<u64>,
}

impl Sampler {
    /// Stops sampling: the peak block bytes, the most instances seen leading at once, and the
    /// number of samples.
    pub(crate) async fn finish(self) -> (u64, u64, u64) {
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

/// Starts sampling `s`'s block bytes and the leaders among `tiers`, every 2 ms.
pub(crate) fn sampler(s: &Arc<ControlledStore>, tiers: Vec<Arc<ObjTier>>) -> Sampler {
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let max_leaders = Arc::new(AtomicU64::new(0));
    let task = {
        let (s, stop, peak, ml) = (s.clone(), stop.clone(), peak.clone(), max_leaders.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(present_bytes(&s.inner), Ordering::Relaxed);
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
                // the sampler's pace
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

/// What store jobs did with their blocks.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Tally {
    /// Stored.
    pub(crate) stored: u64,
    /// Refused for lack of room (`NoSpace`).
    pub(crate) no_space: u64,
    /// Failed otherwise.
    pub(crate) other: u64,
}

impl std::ops::AddAssign for Tally {
    fn add_assign(&mut self, o: Self) {
        self.stored += o.stored;
        self.no_space += o.no_space;
        self.other += o.other;
    }
}

/// The tally of one store job's result.
pub(crate) fn tally(r: &kv_tier_core::JobResult) -> Tally {
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

/// Stores fresh keys `base + seq` (from `seq` = `start`, `job` keys a job) as fast as the tier
/// takes them until `until`.
pub(crate) async fn flood_until(
    t: Arc<ObjTier>,
    base: u64,
    start: u64,
    until: Instant,
    job: u64,
) -> Tally {
    let mut seq = start;
    let mut out = Tally::default();
    while Instant::now() < until {
        let keys: Vec<BlockKey> = (seq..seq + job).map(|i| test_key(base + i)).collect();
        seq += job;
        let r = store_keys(&*t, &keys, 0, BS).await;
        let tl = tally(&r);
        out += tl;
        if tl.stored == 0 {
            // a pause before the next try when nothing was stored
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
    out
}

/// [`flood_until`] on a task of its own.
pub(crate) fn spawn_flood(
    t: &Arc<ObjTier>,
    base: u64,
    start: u64,
    until: Instant,
    job: u64,
) -> tokio::task::JoinHandle<Tally> {
    tokio::spawn(flood_until(t.clone(), base, start, until, job))
}

/// The first key number of instance `i`'s keys (each instance stores keys of its own).
pub(crate) fn base(i: u64) -> u64 {
    (i + 1) << 40
}

/// The positions in `ts` of the instances that hold the lease now.
pub(crate) fn leaders(ts: &[Arc<ObjTier>]) -> Vec<usize> {
    ts.iter()
        .enumerate()
        .filter(|(_, t)| t.stats().shared.unwrap().leader)
        .map(|(i, _)| i)
        .collect()
}

/// Waits until some instance leads and every instance has stored one block (credit flows).
pub(crate) async fn warm(ts: &[Arc<ObjTier>], tag: u64) {
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
pub(crate) async fn first_success(
    t: &ObjTier,
    key_base: u64,
    within: Duration,
) -> Option<Duration> {
    let t0 = Instant::now();
    let mut i = 0;
    while t0.elapsed() < within {
        let k = [test_key(key_base + i)];
        i += 1;
        if store_keys(t, &k, 0, BS).await.is_success() {
            return Some(t0.elapsed());
        }
        // one try every 10 ms
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// Shuts every tier of `ts` down, failing if one hangs 30 s or takes 15 s.
pub(crate) async fn shutdown_all_promptly(ts: &[Arc<ObjTier>]) {
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

/// Opens a tier on a runtime of its own (so the runtime can be killed, as a process is).
pub(crate) fn open_on_own_runtime(
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
        let t = rt.block_on(tier_on(&s, c));
        (rt, t)
    })
    .join()
    .unwrap()
}

/// Floods `ts` for `secs`, in two halves; returns the tallies of the second half.
pub(crate) async fn flood_halves(
    ts: &[Arc<ObjTier>],
    key_tag: u64,
    secs: f64,
) -> (Vec<Tally>, Vec<Tally>) {
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

/// Every `members/<id>` heartbeat deleted every 15 ms for 6 s under `n` flooding instances:
/// the bound holds and stores go on. (The body of the `heartbeats_deleted_repeatedly_*`
/// tests.)
pub(crate) async fn heartbeats_deleted(n: usize) {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..n {
        ts.push(
            tier_on(
                &s,
                shared_mem_cfg(&format!("m{i}"), blocks(CAP as f64), 0.5),
            )
            .await,
        );
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
                // the vandal's pace
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
    shutdown_all_promptly(&ts).await;
    assert!(ratio <= 1.10, "peak {peak} B = {ratio:.3}x the bound");
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 3 s: {t:?}"
        );
    }
}

/// Bytes of the `.bin` files under `dir` (the S3 test server's files of block objects).
pub(crate) fn block_file_bytes(dir: &std::path::Path) -> u64 {
    find_files(dir, ".bin")
        .iter()
        .filter_map(|p| p.metadata().ok())
        .map(|m| m.len())
        .sum()
}

/// An in-memory (bucket "mem") shared-bucket config of instance `id`: a bound of `cap_bytes`,
/// a lease of `lease` s, 8 I/O threads, 2 s requests, no retries.
pub(crate) fn shared_mem_cfg(id: &str, cap_bytes: f64, lease: f64) -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.max_size_gb = Some(cap_bytes / GIB);
    c.shared = true;
    c.shared_lease_s = Some(lease);
    c.instance_id = Some(id.into());
    c.io_threads = 8;
    c.request_timeout_s = 2.0;
    c.max_retries = 0;
    c
}

/// `n` blocks of [`BS`], in bytes.
pub(crate) fn blocks(n: f64) -> f64 {
    n * BS as f64
}

/// Shuts every tier of `ts` down, failing if one hangs 20 s.
pub(crate) async fn shutdown_all(ts: &[Arc<ObjTier>]) {
    for t in ts {
        tokio::time::timeout(Duration::from_secs(20), t.shutdown())
            .await
            .expect("shutdown hung")
            .unwrap();
    }
}

/// Whether some instance of `ts` leads within `within`.
pub(crate) async fn wait_leader(ts: &[Arc<ObjTier>], within: Duration) -> bool {
    poll_until_async(within, || !leaders(ts).is_empty()).await
}

/// One key at a time on `t` for `secs`: how many stored, how many refused.
pub(crate) async fn trickle(t: Arc<ObjTier>, base: u64, secs: f64) -> (u64, u64) {
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let (mut ok, mut no) = (0, 0);
    let mut i = 0;
    while Instant::now() < until {
        let r = store_keys(&*t, &[test_key(base + i)], 0, BS).await;
        i += 1;
        if r.is_success() {
            ok += 1;
        } else {
            no += 1;
        }
        // one key every 10 ms
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (ok, no)
}

/// The block size of the tests on [`shared_obj_config`] (the S3 server's shared bucket): 16 KiB.
pub(crate) const SHARED_BS: usize = 16 << 10;

/// The bound of [`shared_obj_config`]: 16 MiB.
pub(crate) const SHARED_CAP_BYTES: u64 = 16 << 20;

/// The lease of [`shared_obj_config`], in seconds.
pub(crate) const SHARED_LEASE_S: f64 = 2.0;

/// The processes of the four-process test.
pub(crate) const SHARED_INSTANCES: u64 = 4;

/// Blocks per store job of the tests on [`shared_obj_config`].
pub(crate) const SHARED_JOB: u64 = 16;

/// `c` as instance `id` of a shared bucket of [`SHARED_CAP_BYTES`] (lease [`SHARED_LEASE_S`]),
/// checksums on, 8 I/O threads, 5 s requests, one retry: the config of the tests on
/// [`SHARED_BS`] blocks.
pub(crate) fn shared_obj_config(mut c: ObjTierConfig, id: &str) -> ObjTierConfig {
    c.checksum = ObjChecksum::Crc32c;
    c.max_size_gb = Some(SHARED_CAP_BYTES as f64 / (1u64 << 30) as f64);
    c.shared = true;
    c.shared_lease_s = Some(SHARED_LEASE_S);
    c.instance_id = Some(id.into());
    c.io_threads = 8;
    c.request_timeout_s = 5.0;
    c.max_retries = 1;
    c
}

/// The test the children of the four-process test run, by its full path in this binary.
pub(crate) const SHARED_BUCKET_CHILD: &str = "shared::processes::shared_bucket_child";

/// Runs [`SHARED_BUCKET_CHILD`] in a child process of this test binary: instance `child` on
/// the S3 server at `endpoint` for `secs` seconds, its outcome written to `out`.
pub(crate) fn spawn_child(endpoint: &str, child: u64, secs: f64, out: &Path) -> Child {
    test_binary_child(SHARED_BUCKET_CHILD)
        .env(
            "KV_TIER_SHARED_CHILD",
            format!("{endpoint}|{child}|{secs}|{}", out.display()),
        )
        .spawn()
        .unwrap()
}
