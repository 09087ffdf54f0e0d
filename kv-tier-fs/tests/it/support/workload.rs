//! Load generators (floods, stores of many keys, a seeded RNG), samplers of a filesystem's or
//! a directory's use, and scenarios that two tests share.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::FsTier;
use kv_tier_testkit::fixtures::files::statvfs_used;
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until};
use kv_tier_testkit::{allocated_bytes_at_once, block_bytes, store_keys, temp_root, test_key};

use super::*;

/// Writes a block file without any checksum at `k`'s path (another writer's), stores `k`
/// and checks the store skipped it and left the file as it was; returns its path.
pub(crate) async fn store_over_a_planted_block(tier: &FsTier, k: BlockKey) -> std::path::PathBuf {
    let p = tier.block_path(&k);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, block_bytes(&k, 3, BS)).unwrap();
    assert!(fs_store(tier, &[k], 0).await.is_success());
    let s = tier.stats();
    assert_eq!(
        (s.blocks.stores_skipped, s.blocks.corrupt_deleted),
        (1, 0),
        "{s:?}"
    );
    assert_eq!(std::fs::read(&p).unwrap(), block_bytes(&k, 3, BS));
    p
}

/// Samples `statvfs` usage above `baseline` in a thread until stopped; returns the maximum.
pub(crate) struct UsageSampler {
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) max: Arc<AtomicU64>,
    pub(crate) h: Option<std::thread::JoinHandle<u64>>,
}

impl UsageSampler {
    pub(crate) fn start(dir: &Path, baseline: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let max = Arc::new(AtomicU64::new(0));
        let (s, m, d) = (stop.clone(), max.clone(), dir.to_path_buf());
        let h = std::thread::spawn(move || {
            let mut n = 0;
            while !s.load(Ordering::Relaxed) {
                let u = statvfs_used(&d).saturating_sub(baseline);
                m.fetch_max(u, Ordering::Relaxed);
                n += 1;
                std::thread::sleep(Duration::from_micros(100)); // the sampling period
            }
            n
        });
        UsageSampler {
            stop,
            max,
            h: Some(h),
        }
    }

    /// (max above baseline, samples taken)
    pub(crate) fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let n = self.h.take().unwrap().join().unwrap();
        (self.max.load(Ordering::Relaxed), n)
    }
}

impl Drop for UsageSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.h.take() {
            let _ = h.join();
        }
    }
}

/// splitmix64's finaliser: a well-mixed `u64` from `z`.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// What a [`flood_jobs`] did: blocks stored, `NoSpace` failures, other failures (their messages),
/// the keys stored.
#[derive(Default, Debug)]
pub(crate) struct FloodOutcome {
    pub(crate) ok: usize,
    pub(crate) no_space: usize,
    pub(crate) other: Vec<String>,
    pub(crate) stored: Vec<BlockKey>,
}

/// `tasks` tasks each storing `jobs` jobs of 1 to `max_blocks` new keys.
pub(crate) async fn flood_jobs(
    tier: &Arc<FsTier>,
    tasks: u64,
    jobs: u64,
    max_blocks: u64,
    bs: usize,
    key_base: u64,
) -> FloodOutcome {
    let mut hs = Vec::new();
    for t in 0..tasks {
        let tier = tier.clone();
        hs.push(tokio::spawn(async move {
            let mut out = FloodOutcome::default();
            for j in 0..jobs {
                let n = 1 + mix(t * 7919 + j) % max_blocks;
                let keys: Vec<_> = (0..n)
                    .map(|x| test_key(key_base + t * 1_000_000 + j * 64 + x))
                    .collect();
                let res = store_sized(&tier, &keys, bs).await;
                out.ok += res.ok.len();
                out.stored.extend(res.ok.iter().copied());
                for (_, e) in &res.failed {
                    if is_no_space(e) {
                        out.no_space += 1;
                    } else {
                        out.other.push(e.to_string());
                    }
                }
            }
            out
        }));
    }
    let mut all = FloodOutcome::default();
    for h in hs {
        let o = h.await.unwrap();
        all.ok += o.ok;
        all.no_space += o.no_space;
        all.other.extend(o.other);
        all.stored.extend(o.stored);
    }
    all
}

/// Waves of concurrent stores of keys all in ONE leaf directory (which grows well past 4 KiB)
/// into a 400 KiB cap with the hard ceiling `ceiling` (`None`: the default): after each wave
/// `du` of the rank directory is within the ceiling; after shutdown the tier's peak is, and
/// the index equals `du`.
pub(crate) async fn growing_leaf(ceiling: Option<f64>) {
    let root = temp_root();
    let cap: u64 = 400 << 10;
    let mut c = capped_cfg(root.path(), cap);
    c.gc_hard_ceiling = ceiling;
    let hard = (cap as f64 * ceiling.unwrap_or(1.05)) as u64;
    c.gc_interval_s = Some(0.01);
    let tier = open_cfg(c, BS);
    let mut worst = 0;
    let mut n = 0u64;
    for wave in 0..25u64 {
        let mut hs = Vec::new();
        for w in 0..6u64 {
            let tier = tier.clone();
            let base = n + w * 8;
            hs.push(tokio::spawn(async move {
                let ks: Vec<_> = (0..8).map(|x| leaf_key(22_000_000 + base + x)).collect();
                store_sized(&tier, &ks, BS).await
            }));
        }
        n += 48;
        for h in hs {
            let res = h.await.unwrap();
            for (_, e) in &res.failed {
                assert!(is_no_space(e), "{e}");
            }
        }
        let d = du(root.path());
        worst = worst.max(d);
        assert!(
            d <= hard,
            "wave {wave}: du {d} > ceiling {hard}: {:?}",
            gc_stats(&tier)
        );
    }
    let leaf = tier
        .block_path(&leaf_key(0))
        .parent()
        .unwrap()
        .to_path_buf();
    let leaf_size = std::fs::metadata(&leaf).unwrap().blocks() * 512;
    tier.shutdown().await.unwrap();
    let s = gc_stats(&tier);
    assert!(
        leaf_size > 4096,
        "the leaf never grew ({leaf_size}): the test did not bite"
    );
    assert!(
        s.peak_bytes <= hard,
        "the tier's own peak passed its ceiling {hard}: {s:?} (worst du at a wave's end {worst})"
    );
    assert_eq!(s.bytes, du(root.path()), "{s:?} (worst du {worst})");
}

/// A small deterministic PRNG (xorshift64*).
pub(crate) struct Rng(u64);

impl Rng {
    pub(crate) fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub(crate) fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(crate) fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// A key of `tag`'s own range: [`test_key`] of `tag << 40 | i`.
pub(crate) fn tag_key(tag: u64, i: u64) -> BlockKey {
    test_key(tag << 40 | i)
}

/// Samples the rank directory's allocated bytes in the background (what was there at one
/// instant, [`allocated_bytes_at_once`]: a plain walk under churn counts files deleted and
/// created during it together); returns the peak and how long it stayed above `limit` in a
/// row at most.
pub(crate) struct DirSampler {
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) peak: Arc<AtomicU64>,
    pub(crate) over_ms: Arc<AtomicU64>,
    pub(crate) h: Option<std::thread::JoinHandle<()>>,
}

impl DirSampler {
    pub(crate) fn new(dir: PathBuf, limit: u64) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(0));
        let over_ms = Arc::new(AtomicU64::new(0));
        let h = {
            let (stop, peak, over_ms) = (stop.clone(), peak.clone(), over_ms.clone());
            std::thread::spawn(move || {
                let mut over_since: Option<Instant> = None;
                while !stop.load(Ordering::Relaxed) {
                    let a = allocated_bytes_at_once(&dir);
                    peak.fetch_max(a, Ordering::Relaxed);
                    if a > limit {
                        let s = *over_since.get_or_insert_with(Instant::now);
                        over_ms.fetch_max(s.elapsed().as_millis() as u64, Ordering::Relaxed);
                    } else {
                        over_since = None;
                    }
                    std::thread::sleep(Duration::from_millis(10)); // the sampling period
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
    pub(crate) fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        self.h.take().unwrap().join().unwrap();
        (
            self.peak.load(Ordering::Relaxed),
            self.over_ms.load(Ordering::Relaxed),
        )
    }
}

/// Stores `n` blocks of fresh keys in 16-block jobs, each bounded by 10 s (a hang fails).
pub(crate) async fn store_many(t: &FsTier, tag: u64, from: u64, n: u64) -> (u64, u64) {
    let (mut ok, mut nospace) = (0, 0);
    let mut i = from;
    while i < from + n {
        let keys: Vec<BlockKey> = (i..i + 16).map(|j| tag_key(tag, j)).collect();
        let r = tokio::time::timeout(Duration::from_secs(10), store_keys(t, &keys, 0, SHARED_BS))
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

/// Climb the lease epoch by handing the lease over a dozen times, then delete the lease
/// file (or make it garbage). A new leader must appear and stores must get credit again.
pub(crate) async fn lease_lost_after_epochs_climb(garbage: bool) {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let mut cur = open_tight(&root, "x0");
    wait_until("x0 leads", SETTLE_LIMIT, || {
        cur.stats().shared.unwrap().leader
    });
    for i in 1..=12u64 {
        let next = open_tight(&root, &format!("x{i}"));
        // both store something at this epoch (so their writers take grants of it)
        assert!(
            store_many(&next, 10 + i, 0, 16).await.0 > 0,
            "store at epoch step {i}"
        );
        cur.shutdown().await.unwrap();
        wait_until("the next takes the lease", SETTLE_LIMIT, || {
            next.stats().shared.unwrap().leader
        });
        cur = next;
    }
    let epoch = cur.stats().shared.unwrap().epoch;
    let other = open_tight(&root, "other");
    assert!(store_many(&other, 50, 0, 16).await.0 > 0);
    assert!(store_many(&cur, 51, 0, 16).await.0 > 0);
    let lease = coord_dir(&root).join("lease");
    if garbage {
        std::fs::write(&lease, "garbage\n").unwrap();
    } else {
        std::fs::remove_file(&lease).unwrap();
    }
    let old_text = format!("{epoch} ");
    wait_until("a new lease written", SETTLE_LIMIT, || {
        std::fs::read_to_string(&lease)
            .is_ok_and(|t| !t.starts_with(&old_text) && !t.starts_with("garbage"))
    });
    wait_until("a new leader", SETTLE_LIMIT, || {
        cur.stats().shared.unwrap().leader || other.stats().shared.unwrap().leader
    });
    let new_epoch = std::fs::read_to_string(&lease).unwrap_or_default();
    eprintln!("old epoch {epoch}, new lease {new_epoch:?}");
    // stores succeed again: two bounds' worth (bounded wait, 60 s: a loaded machine is slow)
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut i = 0;
    let (mut ok_cur, mut ok_other) = (0, 0);
    while Instant::now() < deadline && ok_cur + ok_other < 2 * TIGHT_CAP / SHARED_BS as u64 {
        ok_cur += store_many(&cur, 60, i, 16).await.0;
        ok_other += store_many(&other, 61, i, 16).await.0;
        i += 16;
    }
    assert!(
        ok_cur + ok_other >= 2 * TIGHT_CAP / SHARED_BS as u64,
        "after the lease was {} at epoch {epoch}, the new lease is {new_epoch:?}; stores stored cur {ok_cur} other {ok_other} within 60 s; cur {:?}; other {:?}",
        if garbage { "garbled" } else { "deleted" },
        cur.stats().shared.unwrap(),
        other.stats().shared.unwrap()
    );
    other.shutdown().await.unwrap();
    cur.shutdown().await.unwrap();
}
