//! GC stress: ingest into a bounded fs tier as fast as the disk allows, every file inside the
//! default grace window (300 s), and measure how far above its cap the tier goes: the tier's
//! own accounting (peak) and `du` of its directory sampled every 10 ms. The same ingest into
//! an unbounded tier, interleaved, is the baseline for what the bound costs in throughput.
//! Then, with checksums on, every kind of damage the tier must refuse is applied to live
//! blocks, every block is loaded, and the wrong bytes served are counted (must be 0).
//!
//! `cargo bench -p kv-tier-fs --bench gc_stress` (directory: `KV_TIER_BENCH_DIR`, default the
//! system temp dir; `KV_TIER_STRESS_CAP_MB`, default 256; `KV_TIER_STRESS_ROUNDS`, default 3).
//! The sidecar cases mount a ramfs (root only; skipped otherwise).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Namespace, RunFields, SecondaryTier};
use kv_tier_fs::{CRC_SIDECAR_SUFFIX, CRC_XATTR, Checksum, FsTier, FsTierConfig};
use kv_tier_testkit::bench::median;
use kv_tier_testkit::{block_bytes, load_keys, store_keys, test_key, verify_block};

const BS: usize = 256 << 10;
const WRITERS: usize = 4;
const JOB: usize = 16;

fn ns() -> Namespace {
    Namespace::new(RunFields::new("bench/stress", "torch.bfloat16", 16), 0).unwrap()
}

fn du(dir: &Path) -> u64 {
    kv_tier_testkit::allocated_bytes(dir)
}

struct Ingest {
    gb_per_s: f64,
    peak_accounted: u64,
    peak_du: u64,
    failed: usize,
    grace_overridden: u64,
    store_waits: u64,
}

/// `total` bytes of new blocks from `WRITERS` tasks, jobs of `JOB` blocks.
fn ingest(rt: &tokio::runtime::Runtime, base: &Path, cap: Option<u64>, total: u64) -> Ingest {
    let dir = tempfile::Builder::new()
        .prefix("kv-tier-stress-")
        .tempdir_in(base)
        .unwrap();
    let mut c = FsTierConfig::new(dir.path());
    c.n_read_threads = 8;
    c.n_write_threads = 8;
    if let Some(cap) = cap {
        c.gc_max_size_gb = Some(cap as f64 / (1u64 << 30) as f64);
        c.gc_interval_s = Some(1.0); // grace stays at its default, 300 s
    }
    let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    let rank = dir.path().join(ns().rank_dir_name());
    let stop = Arc::new(AtomicBool::new(false));
    let peak_du = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak, rank) = (stop.clone(), peak_du.clone(), rank.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(du(&rank), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let blocks = (total / BS as u64) as usize;
    let per_writer = blocks / WRITERS;
    let started = Instant::now();
    let failed: usize = rt.block_on(async {
        let mut tasks = Vec::new();
        for w in 0..WRITERS {
            let tier = tier.clone();
            tasks.push(tokio::spawn(async move {
                let mut failed = 0;
                for j in (0..per_writer).step_by(JOB) {
                    let keys: Vec<BlockKey> = (j..(j + JOB).min(per_writer))
                        .map(|i| test_key((w * per_writer + i) as u64))
                        .collect();
                    failed += store_keys(&*tier, &keys, 0, BS).await.failed.len();
                }
                failed
            }));
        }
        let mut n = 0;
        for t in tasks {
            n += t.await.unwrap();
        }
        n
    });
    let secs = started.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let g = tier.stats().gc;
    Ingest {
        gb_per_s: (blocks - failed) as f64 * BS as f64 / secs / 1e9,
        peak_accounted: g.map_or(0, |g| g.peak_bytes),
        peak_du: peak_du.load(Ordering::Relaxed).max(du(&rank)),
        failed,
        grace_overridden: g.map_or(0, |g| g.grace_overridden),
        store_waits: g.map_or(0, |g| g.store_waits),
    }
}

fn main() {
    let base = std::env::var("KV_TIER_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir());
    let cap_mb: u64 = std::env::var("KV_TIER_STRESS_CAP_MB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(256);
    let rounds: usize = std::env::var("KV_TIER_STRESS_ROUNDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let cap = cap_mb << 20;
    let total = 4 * cap;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!(
        "GC stress: {} MiB cap, {} MiB ingested per run in jobs of {JOB} x {} KiB from {WRITERS} writers, grace 300 s (default), {rounds} rounds interleaved",
        cap_mb,
        total >> 20,
        BS >> 10
    );
    println!(
        "{:>6} {:>10} {:>10} {:>16} {:>12} {:>8} {:>10} {:>10}",
        "round", "tier", "GB/s", "peak acct / cap", "peak du/cap", "failed", "grace ovr", "waits"
    );
    let (mut bounded, mut unbounded, mut worst_acct, mut worst_du) = (vec![], vec![], 0f64, 0f64);
    for r in 0..rounds {
        let order: [Option<u64>; 2] = if r % 2 == 0 {
            [Some(cap), None]
        } else {
            [None, Some(cap)]
        };
        for c in order {
            let i = ingest(&rt, &base, c, total);
            let (acct, du_r) = (
                i.peak_accounted as f64 / cap as f64,
                i.peak_du as f64 / cap as f64,
            );
            let name = if c.is_some() { "bounded" } else { "unbounded" };
            println!(
                "{:>6} {:>10} {:>10.2} {:>16} {:>12.3} {:>8} {:>10} {:>10}",
                r,
                name,
                i.gb_per_s,
                if c.is_some() {
                    format!("{acct:.3}")
                } else {
                    "-".into()
                },
                du_r,
                i.failed,
                i.grace_overridden,
                i.store_waits
            );
            if c.is_some() {
                bounded.push(i.gb_per_s);
                worst_acct = worst_acct.max(acct);
                worst_du = worst_du.max(du_r);
            } else {
                unbounded.push(i.gb_per_s);
            }
            // SAFETY: sync(2) takes no arguments.
            unsafe { libc::sync() };
        }
    }
    let (b, u) = (median(bounded), median(unbounded));
    println!(
        "median ingest: bounded {b:.2} GB/s vs unbounded {u:.2} GB/s ({:.2}x); worst peak: accounted {worst_acct:.3} x cap, du {worst_du:.3} x cap (target <= 1.10)",
        b / u
    );
    corruption(&rt, &base);
}

/// Every kind of damage, applied to live blocks of a checksummed tier; every block loaded.
fn corruption(rt: &tokio::runtime::Runtime, base: &Path) {
    println!("\ncorruption with checksums on: blocks damaged, then every block loaded");
    println!(
        "{:>34} {:>8} {:>8} {:>10} {:>12}",
        "kind", "blocks", "served", "missed", "wrong bytes"
    );
    let mut wrong_total = 0;
    let dir = tempfile::Builder::new()
        .prefix("kv-tier-corrupt-")
        .tempdir_in(base)
        .unwrap();
    wrong_total += damage_run(rt, dir.path(), false);
    match Mount::ramfs() {
        Some(m) => wrong_total += damage_run(rt, &m.dir, true),
        None => println!("{:>34}", "(sidecar kinds skipped: no ramfs)"),
    }
    println!("wrong bytes served across every kind: {wrong_total} (must be 0)");
    assert_eq!(wrong_total, 0, "wrong bytes were served");
}

type Damage = fn(&Path, &BlockKey);

fn damage_run(rt: &tokio::runtime::Runtime, root: &Path, sidecars: bool) -> usize {
    let mut c = FsTierConfig::new(root);
    c.checksum = Checksum::Crc32c;
    c.n_read_threads = 4;
    c.n_write_threads = 4;
    let bs = 64 << 10;
    let tier = FsTier::open("fs", c, ns(), bs).unwrap();
    tier.set_sidecar_grace(Duration::ZERO);
    let mut kinds: Vec<(&str, Damage)> = vec![
        ("byte flipped in place", |p, _| {
            let mut b = std::fs::read(p).unwrap();
            b[100] ^= 0x40;
            std::fs::write(p, b).unwrap();
        }),
        ("truncated", |p, _| {
            std::fs::OpenOptions::new()
                .write(true)
                .open(p)
                .unwrap()
                .set_len(1000)
                .unwrap();
        }),
        ("extended", |p, _| {
            let f = std::fs::OpenOptions::new().append(true).open(p).unwrap();
            std::io::Write::write_all(&mut &f, b"tail").unwrap();
        }),
        ("replaced by another file", |p, k| {
            let tmp = p.with_extension("x");
            std::fs::write(&tmp, block_bytes(k, 99, 64 << 10)).unwrap();
            std::fs::rename(tmp, p).unwrap();
        }),
        ("directory at the path", |p, _| {
            std::fs::remove_file(p).unwrap();
            std::fs::create_dir(p).unwrap();
        }),
        ("symlink at the path", |p, k| {
            let t = p.with_extension("target");
            std::fs::write(&t, block_bytes(k, 0, 64 << 10)).unwrap();
            std::fs::remove_file(p).unwrap();
            std::os::unix::fs::symlink(&t, p).unwrap();
        }),
    ];
    if sidecars {
        kinds.push(("sidecar deleted", |p, _| {
            std::fs::remove_file(sidecar(p)).unwrap();
        }));
        kinds.push(("sidecar malformed (5 bytes)", |p, _| {
            std::fs::write(sidecar(p), [1u8, 2, 3, 4, 5]).unwrap();
        }));
        kinds.push(("sidecar of another checksum", |p, _| {
            let mut b = std::fs::read(sidecar(p)).unwrap();
            b[0] ^= 1;
            std::fs::write(sidecar(p), b).unwrap();
        }));
    } else {
        kinds.push(("xattr malformed (3 bytes)", |p, _| set_xattr(p, &[1, 2, 3])));
        kinds.push(("xattr of another checksum", |p, _| {
            set_xattr(p, &[1, 2, 3, 4])
        }));
        kinds.push(("xattr removed", |p, _| {
            let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
            let n = std::ffi::CString::new(CRC_XATTR).unwrap();
            // SAFETY: valid path and name.
            unsafe { libc::removexattr(c.as_ptr(), n.as_ptr()) };
        }));
    }
    let per_kind = 16;
    let mut wrong = 0;
    for (i, (name, damage)) in kinds.iter().enumerate() {
        let keys: Vec<BlockKey> = (0..per_kind)
            .map(|j| test_key(1_000_000 + (i * per_kind + j) as u64))
            .collect();
        let res = rt.block_on(store_keys(&tier, &keys, 0, bs));
        assert!(res.is_success(), "{:?}", res.failed);
        for k in &keys {
            damage(&tier.block_path(k), k);
        }
        let (res, data) = rt.block_on(load_keys(&tier, &keys, bs));
        let bad = data.iter().filter(|(k, d)| !verify_block(k, 0, d)).count();
        wrong += bad;
        println!(
            "{:>34} {:>8} {:>8} {:>10} {:>12}",
            name,
            keys.len(),
            res.ok.len(),
            res.failed.len(),
            bad
        );
    }
    rt.block_on(tier.shutdown()).unwrap();
    wrong
}

fn sidecar(p: &Path) -> PathBuf {
    let mut s = p.as_os_str().to_os_string();
    s.push(CRC_SIDECAR_SUFFIX);
    PathBuf::from(s)
}

fn set_xattr(p: &Path, v: &[u8]) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let n = std::ffi::CString::new(CRC_XATTR).unwrap();
    // SAFETY: valid path, name and value buffer.
    let rc = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(rc, 0);
}

struct Mount {
    dir: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Mount {
    fn ramfs() -> Option<Mount> {
        let tmp = tempfile::tempdir().ok()?;
        let dir = tmp.path().join("mnt");
        std::fs::create_dir(&dir).ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "ramfs", "ramfs"])
            .arg(&dir)
            .output()
            .is_ok_and(|o| o.status.success());
        ok.then_some(Mount { dir, _tmp: tmp })
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.dir)
            .status();
    }
}
