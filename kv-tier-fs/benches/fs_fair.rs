//! The fs tier against the fairest baselines we can build, in the same run, interleaved round
//! by round (the order rotates), page cache dropped before every load phase where allowed:
//!
//! - `raw@T`: plain O_DIRECT `open`/`pwrite`/`close` and `open`/`pread`/`close` of files at
//!   the tier's directory depth (`<rank>/<hex[0..3]>/<hex[3..5]>_g0/<hex>.bin`, leaf
//!   directories made on first use) on as many threads as the tier runs (16 writers, 16
//!   readers);
//! - `raw@J`: the same on as many threads as jobs in flight;
//! - `vllm`: vLLM's C++ fs path as vLLM drives it: one thread per 16-block job, per block
//!   `access`, `stat` x2, `mkdir`, `open`, `write`, `close`, `link`, `unlink` to store and
//!   `open` (O_DIRECT), `read`, `close` to load.
//!
//! Every case ends with a line `summary block=<bytes> jobs=<n> store_vs_raw=<r>
//! load_vs_raw=<r> store_vs_vllm=<r> load_vs_vllm=<r>`: same-run median ratios of the tier's
//! GB/s to raw@T's and vllm's. Then `summary syscalls store=<n> load=<n>`: file syscalls per
//! block of the tier, counted under `strace -f -c` (the bench runs itself as the child).
//!
//! `cargo bench -p kv-tier-fs --bench fs_fair` (directory: `KV_TIER_BENCH_DIR`, default the
//! system temp dir; rounds: `KV_TIER_BENCH_ROUNDS`, default 5).

mod common;
use common::{clear_blocks, settle, tier_load, tier_store};

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_tier_core::{
    AlignedBuf, BlockKey, EvictionPolicy, Namespace, PrimaryTier, RunFields, SecondaryTier,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_fs::{FsTier, FsTierConfig};
use kv_tier_testkit::bench::median;
use kv_tier_testkit::{fill_block, test_key};

const JOB_BLOCKS: usize = 16;
const TIER_THREADS: usize = 16;

fn main() {
    if let Some(n) = std::env::args()
        .skip_while(|a| a != "--syscall-child")
        .nth(1)
    {
        syscall_child(n.parse().unwrap());
        return;
    }
    let (base, rounds) = common::dir_and_rounds();
    let dir = tempfile::Builder::new()
        .prefix("kv-tier-fair-")
        .tempdir_in(&base)
        .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let cold = drop_caches();
    println!(
        "fs tier vs raw O_DIRECT at the tier's depth and vs vLLM's access pattern in {} ({rounds} rounds, interleaved; page cache {} before loads); GB/s median [min-max]",
        dir.path().display(),
        if cold {
            "dropped"
        } else {
            "NOT dropped (not root)"
        }
    );
    let mut summaries = Vec::new();
    for (block, n) in [(256usize << 10, 512usize), (2 << 20, 128)] {
        for jobs in [1usize, 4, 16] {
            summaries.push(run_case(&rt, dir.path(), block, n, jobs, rounds));
        }
    }
    for s in summaries {
        println!("{s}");
    }
    println!("{}", syscall_summary());
}

/// GB/s of each competitor, per round.
#[derive(Default)]
struct Figures {
    tier: Vec<f64>,
    raw_t: Vec<f64>,
    raw_j: Vec<f64>,
    vllm: Vec<f64>,
}

fn run_case(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    bs: usize,
    n: usize,
    jobs: usize,
    rounds: usize,
) -> String {
    let ns = Namespace::new(RunFields::new("bench/model", "torch.bfloat16", 16), 0).unwrap();
    let root = dir.join(format!("tier-{bs}-{jobs}"));
    let tier = Arc::new(FsTier::open("fs", FsTierConfig::new(&root), ns.clone(), bs).unwrap());
    while !tier.stats().top_dirs_ready {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(tier.stats().direct_io, "O_DIRECT is not available here");
    let cpu = CpuTier::new(CpuTierConfig {
        capacity_bytes: (n * bs) as u64,
        block_size: bs,
        policy: EvictionPolicy::Lru,
        prefault: true,
    })
    .unwrap();
    let srcs: Vec<Bytes> = (0..n)
        .map(|i| {
            let mut b = AlignedBuf::zeroed(bs);
            fill_block(&test_key(i as u64), 0, b.as_mut_slice());
            Bytes::from_owner(b)
        })
        .collect();
    let gb = (n * bs) as f64 / 1e9;
    let (mut w, mut r) = (Figures::default(), Figures::default());
    for round in 0..rounds {
        let keys: Vec<BlockKey> = (0..n)
            .map(|i| test_key((round as u64) << 40 | (jobs as u64) << 32 | i as u64))
            .collect();
        let raw_t = dir.join(format!("raw-t-{bs}-{jobs}-{round}"));
        let raw_j = dir.join(format!("raw-j-{bs}-{jobs}-{round}"));
        let vllm = dir.join(format!("vllm-{bs}-{jobs}-{round}"));
        // four competitors, the order rotating round by round
        for k in 0..4 {
            let g = |d: Duration| gb / d.as_secs_f64();
            match (k + round) % 4 {
                0 => w
                    .tier
                    .push(g(tier_store(rt, &tier, &keys, &srcs, JOB_BLOCKS, jobs))),
                1 => w
                    .raw_t
                    .push(g(raw_store(&raw_t, &ns, &keys, &srcs, TIER_THREADS))),
                2 => w.raw_j.push(g(raw_store(&raw_j, &ns, &keys, &srcs, jobs))),
                _ => w.vllm.push(g(vllm_store(&vllm, &ns, &keys, &srcs, jobs))),
            }
        }
        for k in 0..4 {
            drop_caches();
            let g = |d: Duration| gb / d.as_secs_f64();
            match (k + round) % 4 {
                0 => r
                    .tier
                    .push(g(tier_load(rt, &tier, &cpu, &keys, JOB_BLOCKS, jobs))),
                1 => r
                    .raw_t
                    .push(g(direct_load(&raw_t, &ns, &keys, &cpu, TIER_THREADS, 1))),
                2 => r
                    .raw_j
                    .push(g(direct_load(&raw_j, &ns, &keys, &cpu, jobs, 1))),
                _ => r
                    .vllm
                    .push(g(direct_load(&vllm, &ns, &keys, &cpu, jobs, JOB_BLOCKS))),
            }
        }
        for d in [&raw_t, &raw_j, &vllm] {
            std::fs::remove_dir_all(d).unwrap();
        }
        clear_blocks(&root.join(ns.rank_dir_name()));
        settle();
    }
    let show = |name: &str, f: &Figures| {
        println!(
            "{:>4} KiB {:>2} job(s) {name:<5}: tier {} | raw@{TIER_THREADS} {} | raw@{jobs} {} | vllm {}",
            bs >> 10,
            jobs,
            span(&f.tier),
            span(&f.raw_t),
            span(&f.raw_j),
            span(&f.vllm)
        );
    };
    show("store", &w);
    show("load", &r);
    let ratio = |a: &[f64], b: &[f64]| median(a.iter().zip(b).map(|(x, y)| x / y).collect());
    format!(
        "summary block={bs} jobs={jobs} store_vs_raw={:.2} load_vs_raw={:.2} store_vs_vllm={:.2} load_vs_vllm={:.2}",
        ratio(&w.tier, &w.raw_t),
        ratio(&r.tier, &r.raw_t),
        ratio(&w.tier, &w.vllm),
        ratio(&r.tier, &r.vllm)
    )
}

/// The block's path under `root` at the tier's depth.
fn block_path(root: &Path, ns: &Namespace, k: &BlockKey) -> PathBuf {
    root.join(ns.block_rel_path(k))
}

/// Runs `f(thread, index)` for every index below `n` on `threads` threads (each takes the
/// next index).
fn on_threads(n: usize, threads: usize, f: impl Fn(usize, usize) + Sync) -> Duration {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let (next, f) = (&next, &f);
    let t = Instant::now();
    std::thread::scope(|s| {
        for th in 0..threads.min(n) {
            s.spawn(move || {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    f(th, i);
                }
            });
        }
    });
    t.elapsed()
}

/// The DRAM tier's slots for `keys` (pre-faulted, as an engine's are): every competitor reads
/// into the same kind of memory. Give them back with `cpu.complete_store(keys, false)`.
fn dram_slots(cpu: &CpuTier, keys: &[BlockKey]) -> Vec<std::sync::Mutex<kv_tier_core::BlockSink>> {
    let mut prepared = cpu.prepare_store(keys).unwrap();
    assert_eq!(
        prepared.to_store.len(),
        keys.len(),
        "a DRAM slot for every block"
    );
    std::mem::take(&mut prepared.to_store)
        .into_iter()
        .map(|(_, sink)| std::sync::Mutex::new(sink))
        .collect()
}

/// The first-level directories of `keys` under `root`, made before the clock starts (the
/// tier makes all 4096 when it opens).
fn top_dirs(root: &Path, ns: &Namespace, keys: &[BlockKey]) {
    for k in keys {
        let p = block_path(root, ns, k);
        std::fs::create_dir_all(p.parent().unwrap().parent().unwrap()).unwrap();
    }
}

fn raw_store(
    root: &Path,
    ns: &Namespace,
    keys: &[BlockKey],
    srcs: &[Bytes],
    threads: usize,
) -> Duration {
    top_dirs(root, ns, keys);
    let made = std::sync::Mutex::new(HashSet::new());
    on_threads(keys.len(), threads, |_, i| {
        let p = block_path(root, ns, &keys[i]);
        let parent = p.parent().unwrap().to_path_buf();
        if made.lock().unwrap().insert(parent.clone()) {
            std::fs::create_dir_all(&parent).unwrap();
        }
        let f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(&p)
            .unwrap();
        f.write_all_at(&srcs[i], 0).unwrap();
    })
}

/// O_DIRECT `open`, `read`, `close` of every block into the DRAM tier's slots, on `threads`
/// threads, each task `per_task` consecutive blocks: 1 for the raw baseline (threads take
/// the next block), a job's 16 for vLLM's pattern (one thread per job).
fn direct_load(
    root: &Path,
    ns: &Namespace,
    keys: &[BlockKey],
    cpu: &CpuTier,
    threads: usize,
    per_task: usize,
) -> Duration {
    let slots = dram_slots(cpu, keys);
    let tasks = keys.len().div_ceil(per_task);
    let took = on_threads(tasks, threads, |_, t| {
        for i in t * per_task..((t + 1) * per_task).min(keys.len()) {
            let mut sink = slots[i].lock().unwrap();
            let f = OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(block_path(root, ns, &keys[i]))
                .unwrap();
            f.read_exact_at(sink.as_mut_slice(), 0).unwrap();
        }
    });
    drop(slots);
    cpu.complete_store(keys, false);
    took
}

/// vLLM's store of one job: one thread per job, its blocks one after the other.
fn vllm_store(
    root: &Path,
    ns: &Namespace,
    keys: &[BlockKey],
    srcs: &[Bytes],
    jobs: usize,
) -> Duration {
    top_dirs(root, ns, keys);
    let n_jobs = keys.len().div_ceil(JOB_BLOCKS);
    on_threads(n_jobs, jobs, |_, j| {
        for i in j * JOB_BLOCKS..((j + 1) * JOB_BLOCKS).min(keys.len()) {
            let p = block_path(root, ns, &keys[i]);
            let parent = p.parent().unwrap();
            // access(dest): skip a block already there
            if std::fs::exists(&p).unwrap() {
                continue;
            }
            let _ = std::fs::metadata(parent); // stat
            let _ = std::fs::metadata(parent.parent().unwrap()); // stat
            let _ = std::fs::create_dir_all(parent); // mkdir
            let tmp = p.with_extension(format!("tmp{i}"));
            let f = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_DIRECT)
                .open(&tmp)
                .unwrap();
            f.write_all_at(&srcs[i], 0).unwrap();
            drop(f); // close
            let _ = std::fs::hard_link(&tmp, &p); // link
            std::fs::remove_file(&tmp).unwrap(); // unlink
        }
    })
}

/// Drops the page cache (and cached directory entries and inodes) so loads start cold;
/// false where not allowed.
fn drop_caches() -> bool {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

fn span(v: &[f64]) -> String {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(0.0, f64::max);
    format!("{:.2} [{min:.2}-{max:.2}]", median(v.to_vec()))
}

/// The child of the syscall count: stores then loads `n` 256 KiB blocks, 16-block jobs, one
/// in flight, keys in 16 leaf directories.
fn syscall_child(n: usize) {
    let bs = 256 << 10;
    let dir = tempfile::tempdir().unwrap();
    let ns = Namespace::new(RunFields::new("bench/model", "torch.bfloat16", 16), 0).unwrap();
    let tier = Arc::new(FsTier::open("fs", FsTierConfig::new(dir.path()), ns, bs).unwrap());
    while !tier.stats().top_dirs_ready {
        std::thread::sleep(Duration::from_millis(10));
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let keys: Vec<BlockKey> = (0..n as u32)
        .map(|i| {
            let mut h = [0u8; 32];
            h[0] = (i % 16) as u8;
            h[4..8].copy_from_slice(&i.to_be_bytes());
            BlockKey::from_hash32(h, 0)
        })
        .collect();
    let mut b = AlignedBuf::zeroed(bs);
    b.as_mut_slice().fill(7);
    let srcs = vec![Bytes::from_owner(b); n];
    let cpu = CpuTier::new(CpuTierConfig {
        capacity_bytes: (n * bs) as u64,
        block_size: bs,
        policy: EvictionPolicy::Lru,
        prefault: true,
    })
    .unwrap();
    tier_store(&rt, &tier, &keys, &srcs, JOB_BLOCKS, 1);
    tier_load(&rt, &tier, &cpu, &keys, JOB_BLOCKS, 1);
    // the block's own file syscalls only: leave the directory in place at exit
    rt.block_on(tier.shutdown()).unwrap();
    std::mem::forget(dir);
}

/// Counts the tier's file syscalls per block: two children under `strace -f -c` (N = 256
/// and 512 blocks); the difference over 256 is per block, setup cancelling out.
fn syscall_summary() -> String {
    let me = std::env::current_exe().unwrap();
    let mut counts = Vec::new();
    for n in [256, 512] {
        let out = std::env::temp_dir().join(format!("kv-tier-fair-strace-{n}"));
        let status = std::process::Command::new("strace")
            .args(["-f", "-c", "-o"])
            .arg(&out)
            .arg(&me)
            .args(["--syscall-child", &n.to_string()])
            .stdout(std::process::Stdio::null())
            .status();
        match status {
            Ok(s) if s.success() => {}
            _ => return "summary syscalls unavailable (strace did not run)".into(),
        }
        let text = std::fs::read_to_string(&out).unwrap_or_default();
        let _ = std::fs::remove_file(&out);
        let mut m = std::collections::HashMap::new();
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() >= 5
                && f[0].chars().next().is_some_and(|c| c.is_ascii_digit())
                && let (Ok(calls), Some(name)) = (f[3].parse::<f64>(), f.last())
            {
                m.insert(name.to_string(), calls);
            }
        }
        counts.push(m);
    }
    let per = |name: &str| {
        (counts[1].get(name).unwrap_or(&0.0) - counts[0].get(name).unwrap_or(&0.0)) / 256.0
    };
    let store = ["mkdir", "renameat2", "pwrite64"]
        .iter()
        .map(|s| per(s))
        .sum::<f64>();
    let load = per("pread64");
    // open, close and statx serve both: split by the phases' known shape (the store opens
    // and closes once, the load opens, stats and closes once)
    let opens = per("openat");
    let closes = per("close");
    let statx = per("statx") + per("newfstatat");
    let store_total = store + opens / 2.0 + closes / 2.0;
    let load_total = load + opens / 2.0 + closes / 2.0 + statx;
    format!(
        "summary syscalls store={store_total:.2} load={load_total:.2} (openat {opens:.2}, close {closes:.2}, stat {statx:.2}, mkdir {:.2}, renameat2 {:.2}, pwrite {:.2}, pread {:.2} per block, store+load)",
        per("mkdir"),
        per("renameat2"),
        per("pwrite64"),
        per("pread64")
    )
}
