//! Adversarial tests of the fs tier's shared root mode (written by a tester working from the
//! public API and the issue's text): coordination files deleted or garbled under running
//! instances, the same keys stored by several instances at once, store futures dropped at
//! random points, a follower's hot keys under a flood, instances churning, paths that are
//! the wrong kind of file. Every store has a deadline; the directory is sampled every 10 ms.

mod common;
use common::ns;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{FsTier, FsTierConfig};
use kv_tier_testkit::{load_keys, store_keys, test_key, verify_block};

const BS: usize = 64 << 10;
const CAP: u64 = 8 << 20;
const LEASE_S: f64 = 0.4;
const STAMP_S: f64 = 0.5;

fn cfg(root: &Path, id: &str) -> FsTierConfig {
    let mut c = common::shared_cfg(root, id, CAP, LEASE_S, STAMP_S);
    c.n_read_threads = 2;
    c.n_write_threads = 2;
    c
}

fn open(root: &Path, id: &str) -> FsTier {
    FsTier::open("fs", cfg(root, id), ns(), BS).unwrap()
}

fn key(tag: u64, i: u64) -> BlockKey {
    test_key(tag << 40 | i)
}

fn coord_dir(root: &Path) -> PathBuf {
    ns().namespace_dir(root).join("shared-r0")
}

fn rank_dir(root: &Path) -> PathBuf {
    root.join(ns().rank_dir_name())
}

fn allocated(dir: &Path) -> u64 {
    kv_tier_testkit::allocated_bytes(dir)
}

fn count_files(dir: &Path) -> usize {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            total += 1;
            if e.metadata().is_ok_and(|m| m.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    total
}

fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Samples the rank directory's allocated bytes in the background; returns the peak and
/// how long it stayed above `limit` in a row at most.
struct Sampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    over_ms: Arc<AtomicU64>,
    h: Option<std::thread::JoinHandle<()>>,
}

impl Sampler {
    fn new(dir: PathBuf, limit: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let over_ms = Arc::new(AtomicU64::new(0));
        let h = {
            let (stop, peak, over_ms) = (stop.clone(), peak.clone(), over_ms.clone());
            std::thread::spawn(move || {
                let mut over_since: Option<Instant> = None;
                while !stop.load(Ordering::Relaxed) {
                    let a = allocated(&dir);
                    peak.fetch_max(a, Ordering::Relaxed);
                    if a > limit {
                        let s = *over_since.get_or_insert_with(Instant::now);
                        over_ms.fetch_max(s.elapsed().as_millis() as u64, Ordering::Relaxed);
                    } else {
                        over_since = None;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
            })
        };
        Self {
            stop,
            peak,
            over_ms,
            h: Some(h),
        }
    }
    fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.h.take().unwrap().join().unwrap();
        (
            self.peak.load(Ordering::Relaxed),
            self.over_ms.load(Ordering::Relaxed),
        )
    }
}

/// Stores `n` blocks of fresh keys in 16-block jobs, each bounded by 10 s (a hang fails).
async fn store_many(t: &FsTier, tag: u64, from: u64, n: u64) -> (u64, u64) {
    let (mut ok, mut nospace) = (0, 0);
    let mut i = from;
    while i < from + n {
        let keys: Vec<BlockKey> = (i..i + 16).map(|j| key(tag, j)).collect();
        let r = tokio::time::timeout(Duration::from_secs(10), store_keys(t, &keys, 0, BS))
            .await
            .expect("a store hung for 10 s");
        ok += r.ok.len() as u64;
        nospace += r
            .failed
            .iter()
            .filter(|(_, e)| matches!(e, Error::NoSpace { .. }))
            .count() as u64;
        for (k, e) in &r.failed {
            if !matches!(e, Error::NoSpace { .. }) {
                panic!("store of {k} failed: {e}");
            }
        }
        i += 16;
    }
    (ok, nospace)
}

fn limit() -> u64 {
    (CAP as f64 * 1.10) as u64
}

/// A follower's journal file is deleted (e.g. by an operator cleaning up, or a tmp
/// reaper). The follower notices at its heartbeat and starts a fresh journal with
/// granted = consumed = 0, then reads its grant file: the *cumulative* bytes the leader
/// ever granted. The leader keeps tailing the old (unlinked) descriptor, so it never sees
/// the follower's new `P` lines. Bound must still hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_follower_journal_does_not_break_the_bound() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let a = open(&root, "a");
    wait_until("a leads", || a.stats().shared.unwrap().leader);
    let b = open(&root, "b");
    let s = Sampler::new(rank_dir(&root), limit());
    // b writes 4x the cap (so its cumulative grant is well above the cap)
    let (ok, _) = store_many(&b, 1, 0, 4 * CAP / BS as u64).await;
    assert!(ok > 2 * CAP / BS as u64, "b stored too little: {ok}");
    let granted_before = b.stats().shared.unwrap().granted_bytes;
    // b's journal as it is now: `b`, or `b.r<n>` if b was taken for dead on a loaded machine
    // and joined again (the newest)
    let current = std::fs::read_dir(coord_dir(&root).join("journal"))
        .unwrap()
        .flatten()
        .filter(|e| {
            let n = e.file_name().to_string_lossy().to_string();
            n == "b" || n.starts_with("b.r")
        })
        .max_by_key(|e| e.metadata().and_then(|m| m.modified()).ok())
        .expect("b has a journal")
        .path();
    std::fs::remove_file(current).unwrap();
    tokio::time::sleep(Duration::from_secs_f64(LEASE_S)).await;
    let (ok2, ns2) = store_many(&b, 2, 0, 4 * CAP / BS as u64).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (peak, over_ms) = s.finish();
    let now = allocated(&rank_dir(&root));
    let st = b.stats().shared.unwrap();
    eprintln!(
        "granted before {granted_before}; after: {st:?}; stored after {ok2} (nospace {ns2}); peak {peak} ({:.2}x cap), over 1.10x for {over_ms} ms, now {now} ({:.2}x)",
        peak as f64 / CAP as f64,
        now as f64 / CAP as f64
    );
    assert!(
        peak <= limit(),
        "peak {peak} = {:.2}x cap",
        peak as f64 / CAP as f64
    );
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// The journal directory is removed whole; a new instance then joins (recreating it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_dir_removed_then_new_member_keeps_the_bound() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let a = open(&root, "a");
    wait_until("a leads", || a.stats().shared.unwrap().leader);
    let b = open(&root, "b");
    let s = Sampler::new(rank_dir(&root), limit());
    store_many(&b, 1, 0, 3 * CAP / BS as u64).await;
    store_many(&a, 3, 0, CAP / BS as u64).await;
    std::fs::remove_dir_all(coord_dir(&root).join("journal")).unwrap();
    // stores must not hang meanwhile
    store_many(&b, 4, 0, 64).await;
    let c = open(&root, "c");
    tokio::time::sleep(Duration::from_secs_f64(LEASE_S)).await;
    let (okb, _) = store_many(&b, 2, 0, 3 * CAP / BS as u64).await;
    let (oka, _) = store_many(&a, 5, 0, 2 * CAP / BS as u64).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (peak, over_ms) = s.finish();
    eprintln!(
        "a {:?}\nb {:?}\nstored after a {oka} b {okb}; peak {peak} ({:.2}x cap), over for {over_ms} ms",
        a.stats().shared,
        b.stats().shared,
        peak as f64 / CAP as f64
    );
    assert!(
        peak <= limit(),
        "peak {peak} = {:.2}x cap",
        peak as f64 / CAP as f64
    );
    c.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// Climb the lease epoch by handing the lease over a dozen times, then delete the lease
/// file (or make it garbage). A new leader must appear and stores must get credit again.
async fn lease_lost_after_epochs_climb(garbage: bool) {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let mut cur = open(&root, "x0");
    wait_until("x0 leads", || cur.stats().shared.unwrap().leader);
    for i in 1..=12u64 {
        let next = open(&root, &format!("x{i}"));
        // both store something at this epoch (so their writers take grants of it)
        assert!(
            store_many(&next, 10 + i, 0, 16).await.0 > 0,
            "store at epoch step {i}"
        );
        cur.shutdown().await.unwrap();
        wait_until("the next takes the lease", || {
            next.stats().shared.unwrap().leader
        });
        cur = next;
    }
    let epoch = cur.stats().shared.unwrap().epoch;
    let other = open(&root, "other");
    assert!(store_many(&other, 50, 0, 16).await.0 > 0);
    assert!(store_many(&cur, 51, 0, 16).await.0 > 0);
    let lease = coord_dir(&root).join("lease");
    if garbage {
        std::fs::write(&lease, "garbage\n").unwrap();
    } else {
        std::fs::remove_file(&lease).unwrap();
    }
    let old_text = format!("{epoch} ");
    wait_until("a new lease written", || {
        std::fs::read_to_string(&lease)
            .is_ok_and(|t| !t.starts_with(&old_text) && !t.starts_with("garbage"))
    });
    wait_until("a new leader", || {
        cur.stats().shared.unwrap().leader || other.stats().shared.unwrap().leader
    });
    let new_epoch = std::fs::read_to_string(&lease).unwrap_or_default();
    eprintln!("old epoch {epoch}, new lease {new_epoch:?}");
    // stores succeed again: two bounds' worth (bounded wait, 60 s: a loaded machine is slow)
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    let (mut ok_cur, mut ok_other) = (0, 0);
    while Instant::now() < deadline && ok_cur + ok_other < 2 * CAP / BS as u64 {
        ok_cur += store_many(&cur, 60, i, 16).await.0;
        ok_other += store_many(&other, 61, i, 16).await.0;
        i += 16;
    }
    assert!(
        ok_cur + ok_other >= 2 * CAP / BS as u64,
        "after the lease was {} at epoch {epoch}, the new lease is {new_epoch:?}; stores stored cur {ok_cur} other {ok_other} within 60 s; cur {:?}; other {:?}",
        if garbage { "garbled" } else { "deleted" },
        cur.stats().shared.unwrap(),
        other.stats().shared.unwrap()
    );
    other.shutdown().await.unwrap();
    cur.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_deleted_after_epochs_climb_stores_get_credit_again() {
    lease_lost_after_epochs_climb(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_garbled_after_epochs_climb_stores_get_credit_again() {
    lease_lost_after_epochs_climb(true).await;
}

/// Three instances store the SAME keys at once, repeatedly, with a tiny cap; every block
/// served verifies, no store hangs, the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_keys_from_three_instances() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let ts: Vec<Arc<FsTier>> = ["a", "b", "c"]
        .iter()
        .map(|id| Arc::new(open(&root, id)))
        .collect();
    wait_until("a leader", || {
        ts.iter().any(|t| t.stats().shared.unwrap().leader)
    });
    let s = Sampler::new(rank_dir(&root), limit());
    let end = Instant::now() + Duration::from_secs(8);
    let wrong = Arc::new(AtomicU64::new(0));
    let loaded = Arc::new(AtomicU64::new(0));
    let mut hs = Vec::new();
    for t in &ts {
        let (t, wrong, loaded) = (t.clone(), wrong.clone(), loaded.clone());
        hs.push(tokio::spawn(async move {
            let mut round = 0u64;
            while Instant::now() < end {
                // 3 * 64 = 192 blocks per round > cap (128 blocks)
                let base = (round % 3) * 64;
                let keys: Vec<BlockKey> = (base..base + 64).map(|j| key(7, j)).collect();
                let r =
                    tokio::time::timeout(Duration::from_secs(10), store_keys(&*t, &keys, 0, BS))
                        .await
                        .expect("store hung");
                for (k, e) in &r.failed {
                    assert!(matches!(e, Error::NoSpace { .. }), "{k}: {e}");
                }
                let (_, data) = load_keys(&*t, &keys, BS).await;
                loaded.fetch_add(data.len() as u64, Ordering::Relaxed);
                for (k, d) in &data {
                    if !verify_block(k, 0, d) {
                        eprintln!("WRONG {k}");
                        wrong.fetch_add(1, Ordering::Relaxed);
                    }
                }
                round += 1;
            }
        }));
    }
    for h in hs {
        h.await.unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (peak, over_ms) = s.finish();
    eprintln!(
        "loaded {} wrong {} peak {:.2}x over {over_ms} ms",
        loaded.load(Ordering::Relaxed),
        wrong.load(Ordering::Relaxed),
        peak as f64 / CAP as f64
    );
    assert_eq!(wrong.load(Ordering::Relaxed), 0);
    assert!(loaded.load(Ordering::Relaxed) > 0);
    assert!(peak <= limit(), "peak {:.2}x cap", peak as f64 / CAP as f64);
    for t in ts {
        Arc::try_unwrap(t).ok().unwrap().shutdown().await.unwrap();
    }
}

/// Store futures dropped mid-way, hundreds of times, on a follower: afterwards the
/// follower still gets credit (no leaked outstanding credit or pending stores), the bound
/// holds, and stored blocks verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_store_futures_leak_nothing() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let a = open(&root, "a");
    wait_until("a leads", || a.stats().shared.unwrap().leader);
    let b = open(&root, "b");
    let s = Sampler::new(rank_dir(&root), limit());
    for i in 0..300u64 {
        let keys: Vec<BlockKey> = (0..8).map(|j| key(20, i * 8 + j)).collect();
        let d = Duration::from_micros(50 + (i % 7) * 300);
        let _ = tokio::time::timeout(d, store_keys(&b, &keys, 0, BS)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (ok, nospace) = store_many(&b, 21, 0, 3 * CAP / BS as u64).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (peak, over_ms) = s.finish();
    eprintln!(
        "after drops: ok {ok} nospace {nospace} peak {:.2}x over {over_ms} ms b {:?}",
        peak as f64 / CAP as f64,
        b.stats().shared
    );
    assert!(
        ok >= CAP / BS as u64,
        "stores starved after dropped futures: ok {ok} nospace {nospace}"
    );
    assert!(peak <= limit(), "peak {:.2}x cap", peak as f64 / CAP as f64);
    // every block still there verifies
    let keys: Vec<BlockKey> = (0..2400).map(|j| key(20, j)).collect();
    let (_, data) = load_keys(&a, &keys, BS).await;
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// A key read every 30 ms by a FOLLOWER is never evicted while the leader and another
/// follower flood a tiny cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_key_of_follower_survives_flood() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let a = Arc::new(open(&root, "a"));
    wait_until("a leads", || a.stats().shared.unwrap().leader);
    let b = Arc::new(open(&root, "b"));
    let c = Arc::new(open(&root, "c"));
    let hot: Vec<BlockKey> = (0..8).map(|j| key(30, j)).collect();
    assert!(store_keys(&*b, &hot, 0, BS).await.is_success());
    let end = Instant::now() + Duration::from_secs(8);
    let flood: Vec<_> = [(a.clone(), 31u64), (c.clone(), 32)]
        .into_iter()
        .map(|(t, tag)| {
            tokio::spawn(async move {
                let mut i = 0;
                while Instant::now() < end {
                    store_many(&t, tag, i, 16).await;
                    i += 16;
                }
            })
        })
        .collect();
    let mut misses = Vec::new();
    let mut loads = 0;
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_millis(30)).await;
        let (r, data) = load_keys(&*b, &hot, BS).await;
        loads += 1;
        for (k, e) in &r.failed {
            misses.push(format!("{k}: {e}"));
        }
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    }
    for f in flood {
        f.await.unwrap();
    }
    assert!(
        misses.is_empty(),
        "{} misses of {loads} loads: {:?}",
        misses.len(),
        &misses[..misses.len().min(5)]
    );
    for t in [c, b, a] {
        Arc::try_unwrap(t).ok().unwrap().shutdown().await.unwrap();
    }
}

/// Instances opening and closing repeatedly (new ids, and the same id) around a stable
/// leader: the coordination directory's file count stays steady and the leader's member
/// count comes back down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn churn_of_instances_leaks_no_files() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let a = open(&root, "a");
    wait_until("a leads", || a.stats().shared.unwrap().leader);
    let cd = coord_dir(&root);
    let mut counts = Vec::new();
    for i in 0..40u64 {
        let id = if i % 2 == 0 {
            format!("n{i}")
        } else {
            "same".to_string()
        };
        let t = open(&root, &id);
        store_many(&t, 40 + i, 0, 16).await;
        t.shutdown().await.unwrap();
        if i % 10 == 9 {
            tokio::time::sleep(Duration::from_secs_f64(LEASE_S)).await;
            counts.push(count_files(&cd));
        }
    }
    // the leader reaps the members that left within a few leases (polled, bounded: a loaded
    // machine's leader may tick late)
    let reaping = Instant::now() + Duration::from_secs(30);
    tokio::time::sleep(Duration::from_secs_f64(2.0 * LEASE_S)).await;
    while (count_files(&cd) > 16 || a.stats().shared.unwrap().members != 1)
        && Instant::now() < reaping
    {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let fin = count_files(&cd);
    let members = a.stats().shared.unwrap().members;
    eprintln!("coord file counts {counts:?} final {fin} members {members}");
    let names: Vec<String> = walk_names(&cd);
    assert!(fin <= 16, "coordination files left: {fin}: {names:?}");
    assert_eq!(members, 1);
    a.shutdown().await.unwrap();
}

fn walk_names(d: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for sub in ["", "claims", "members", "journal", "grants"] {
        if let Ok(rd) = std::fs::read_dir(d.join(sub)) {
            for e in rd.flatten() {
                v.push(format!("{sub}/{}", e.file_name().to_string_lossy()));
            }
        }
    }
    v
}

/// The coordination directory's place is a file: the open error names the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coordination_dir_is_a_file_error_names_path() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let cd = coord_dir(&root);
    std::fs::create_dir_all(cd.parent().unwrap()).unwrap();
    std::fs::write(&cd, "x").unwrap();
    let e = FsTier::open("fs", cfg(&root, "a"), ns(), BS).expect_err("open must fail");
    let m = e.to_string();
    assert!(m.contains("shared-r0"), "error does not name the path: {m}");
}

/// A lease file that is a directory: stores are refused quickly (no hang), and once it is
/// fixed a leader appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_path_is_a_directory() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let cd = coord_dir(&root);
    std::fs::create_dir_all(cd.join("lease")).unwrap();
    let a = open(&root, "a");
    let r = tokio::time::timeout(Duration::from_secs(5), store_keys(&a, &[key(70, 0)], 0, BS))
        .await
        .expect("store hung");
    eprintln!("with a lease dir: {:?} {:?}", r.failed, a.stats().shared);
    std::fs::remove_dir(cd.join("lease")).unwrap();
    wait_until("a leads after the lease dir is removed", || {
        a.stats().shared.unwrap().leader
    });
    assert!(store_keys(&a, &[key(70, 1)], 0, BS).await.is_success());
    a.shutdown().await.unwrap();
}

/// Two leaders: garble the lease repeatedly while three instances run; at no sample do two
/// instances claim leadership for longer than a lease period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_two_leaders_for_long_under_lease_tampering() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let ts: Vec<FsTier> = ["a", "b", "c"].iter().map(|id| open(&root, id)).collect();
    wait_until("a leader", || {
        ts.iter().any(|t| t.stats().shared.unwrap().leader)
    });
    let lease = coord_dir(&root).join("lease");
    let mut two_since: Option<Instant> = None;
    let mut worst = Duration::ZERO;
    let end = Instant::now() + Duration::from_secs(8);
    let mut n = 0u64;
    while Instant::now() < end {
        n += 1;
        if n.is_multiple_of(50) {
            match n % 150 {
                0 => {
                    let _ = std::fs::remove_file(&lease);
                }
                50 => {
                    let _ = std::fs::write(&lease, "1 zz 0\n");
                }
                _ => {
                    let _ = std::fs::write(&lease, "zz\n");
                }
            }
        }
        let leaders = ts
            .iter()
            .filter(|t| t.stats().shared.unwrap().leader)
            .count();
        if leaders > 1 {
            let s = *two_since.get_or_insert_with(Instant::now);
            worst = worst.max(s.elapsed());
        } else {
            two_since = None;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    eprintln!("worst two-leader span {worst:?}");
    assert!(
        worst < Duration::from_secs_f64(LEASE_S),
        "two leaders for {worst:?}"
    );
    for t in ts {
        t.shutdown().await.unwrap();
    }
}
