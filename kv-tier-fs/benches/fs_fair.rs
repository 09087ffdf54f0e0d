//! The fs tier against the fairest baselines we can build, in the same run, interleaved round
//! by round (the order rotates), page cache dropped before every load phase where allowed:
//!
//! - `raw@T`: plain O_DIRECT `open`/`pwrite`/`close` and `open`/`pread`/`close` of files at
//!   the tier's directory depth (`<rank>/<hex[0..3]>/<hex[3..5]>_g0/<hex>.bin`, leaf
//!   directories made on first use) on as many threads as the tier runs (16 writers, 16
//!   readers), driven as the tier is: J jobs of 16 blocks in flight, a job ending when its
//!   last block does and the next one starting then;
//! - `stream@T`: the same threads without jobs (each takes the next block: no job ever
//!   waits for its slowest block), the ceiling of the thread count;
//! - `raw@J`: the same on as many threads as jobs in flight;
//! - `vllm`: vLLM's C++ fs path as vLLM drives it: one thread per 16-block job, per block
//!   `access`, `stat` x2, `mkdir`, `open`, `write`, `close`, `link`, `unlink` to store and
//!   `open` (O_DIRECT), `read`, `close` to load;
//! - `uring` (loads only, of raw@T's files): io_uring with each block a linked `OPENAT` (into a
//!   direct descriptor), `READ`, `CLOSE` chain, a job's 16 chains submitted together and J
//!   jobs in flight, one thread submitting and reaping: opens overlapped with reads, with as
//!   many blocks in flight as the jobs hold and no thread pool (what an io_uring load path in
//!   the tier could do at best).
//!
//! Each case moves 1 GiB (256 KiB blocks) or 2 GiB (2 MiB blocks) per competitor and round:
//! at least 64 jobs, so even 16 jobs in flight run four waves deep and each timing lasts
//! about a second. Every store competitor starts after a `sync(2)` (no competitor's
//! write-back lands in the next one's clock); every load after the page cache is dropped.
//!
//! Every case ends with a line `summary block=<bytes> jobs=<n> store_vs_raw=<r>
//! load_vs_raw=<r> store_vs_vllm=<r> load_vs_vllm=<r>`: same-run median ratios of the tier's
//! GB/s to raw@T's and vllm's, each with its range over the rounds (`0.98[0.91..1.04]`);
//! and a `detail` line with the tier against `stream@T`, `raw@J`
//! and `uring`, `uring` against raw@T, and the ceilings of the vLLM ratio: raw@T (plain I/O
//! driven in jobs as the tier is) and `stream@T` (the disk at the tier's thread count with no
//! job ever waiting for its slowest block) against vllm. Then two `summary syscalls
//! store=<n> load=<n>` lines: file syscalls per block of the tier, counted under `strace -f
//! -c` (the bench runs itself as the child), for a fresh cache (keys spread as real hashes
//! are, so nearly every store makes its leaf directory, as vLLM's does) and for keys whose
//! leaf directories exist.
//!
//! `cargo bench -p kv-tier-fs --bench fs_fair` (directory: `KV_TIER_BENCH_DIR`, default the
//! system temp dir; rounds: `KV_TIER_BENCH_ROUNDS`, default 5; only some cases:
//! `KV_TIER_FAIR_CASES=262144x1,2097152x16`, block bytes x jobs in flight).

mod common;
use common::{settle, tier_load, tier_store};

use std::collections::HashSet;
use std::fs::OpenOptions;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_tier_core::{AlignedBuf, BlockKey, EvictionPolicy, Namespace, PrimaryTier, SecondaryTier};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::bench::median;
use kv_tier_testkit::{fill_block, test_key};

const JOB_BLOCKS: usize = 16;
const TIER_THREADS: usize = 16;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip_while(|a| a != "--syscall-child")
        .collect();
    if let [_, n, leaves, ..] = &args[..] {
        let leaves = if leaves == "Fresh" {
            Leaves::Fresh
        } else {
            Leaves::Made
        };
        syscall_child(n.parse().unwrap(), leaves);
        return;
    }
    let (dir, rounds, rt) = common::setup("kv-tier-fair-");
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
    // `KV_TIER_FAIR_CASES=262144x1,2097152x16`: only those cases (block bytes x jobs)
    let only = std::env::var("KV_TIER_FAIR_CASES").ok();
    let mut summaries = Vec::new();
    for (block, n) in [(256usize << 10, 4096usize), (2 << 20, 1024)] {
        for jobs in [1usize, 4, 16] {
            if only
                .as_deref()
                .is_some_and(|o| !o.split(',').any(|c| c.trim() == format!("{block}x{jobs}")))
            {
                continue;
            }
            summaries.push(run_case(&rt, dir.path(), block, n, jobs, rounds));
        }
    }
    for s in summaries {
        println!("{s}");
    }
    println!("{}", syscall_summary(Leaves::Fresh));
    println!("{}", syscall_summary(Leaves::Made));
}

/// GB/s of each competitor, per round.
#[derive(Default)]
struct Figures {
    tier: Vec<f64>,
    raw_t: Vec<f64>,
    stream_t: Vec<f64>,
    raw_j: Vec<f64>,
    vllm: Vec<f64>,
    /// Loads only.
    uring: Vec<f64>,
}

fn run_case(
    rt: &tokio::runtime::Runtime,
    dir: &Path,
    bs: usize,
    n: usize,
    jobs: usize,
    rounds: usize,
) -> String {
    let ns = common::bench_ns();
    // a fresh root per round, as every raw competitor gets a fresh directory tree (reusing
    // one root would have the tier alone write into space freed and discarded a moment
    // before, which this virtual disk makes slow); its top directories made before the clock
    let open_tier = |round: usize| {
        let root = dir.join(format!("tier-{bs}-{jobs}-{round}"));
        let tier = common::open_ready_tier(&root, &ns, bs);
        assert!(tier.stats().direct_io, "O_DIRECT is not available here");
        (root, tier)
    };
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
        let (root, tier) = open_tier(round);
        let keys: Vec<BlockKey> = (0..n)
            .map(|i| test_key((round as u64) << 40 | (jobs as u64) << 32 | i as u64))
            .collect();
        let raw_t = dir.join(format!("raw-t-{bs}-{jobs}-{round}"));
        let stream_t = dir.join(format!("stream-t-{bs}-{jobs}-{round}"));
        let raw_j = dir.join(format!("raw-j-{bs}-{jobs}-{round}"));
        let vllm = dir.join(format!("vllm-{bs}-{jobs}-{round}"));
        // five competitors, the order rotating round by round
        const N: usize = 5;
        for k in 0..N {
            sync_disk();
            let g = |d: Duration| gb / d.as_secs_f64();
            match (k + round) % N {
                0 => w
                    .tier
                    .push(g(tier_store(rt, &tier, &keys, &srcs, JOB_BLOCKS, jobs))),
                1 => w.raw_t.push(g(raw_store(
                    &raw_t,
                    &ns,
                    &keys,
                    &srcs,
                    Drive::Jobs(TIER_THREADS, jobs),
                ))),
                2 => w.stream_t.push(g(raw_store(
                    &stream_t,
                    &ns,
                    &keys,
                    &srcs,
                    Drive::Stream(TIER_THREADS),
                ))),
                3 => w
                    .raw_j
                    .push(g(raw_store(&raw_j, &ns, &keys, &srcs, Drive::Stream(jobs)))),
                _ => w.vllm.push(g(vllm_store(&vllm, &ns, &keys, &srcs, jobs))),
            }
        }
        for k in 0..N + 1 {
            drop_caches();
            let g = |d: Duration| gb / d.as_secs_f64();
            let raw = |d: &Path, drive| direct_load(d, &ns, &keys, &cpu, drive, 1);
            match (k + round) % (N + 1) {
                0 => r
                    .tier
                    .push(g(tier_load(rt, &tier, &cpu, &keys, JOB_BLOCKS, jobs))),
                1 => r
                    .raw_t
                    .push(g(raw(&raw_t, Drive::Jobs(TIER_THREADS, jobs)))),
                2 => r
                    .stream_t
                    .push(g(raw(&stream_t, Drive::Stream(TIER_THREADS)))),
                3 => r.raw_j.push(g(raw(&raw_j, Drive::Stream(jobs)))),
                4 => r.uring.push(g(uring_load(&raw_t, &ns, &keys, &cpu, jobs))),
                _ => r.vllm.push(g(direct_load(
                    &vllm,
                    &ns,
                    &keys,
                    &cpu,
                    Drive::Stream(jobs),
                    JOB_BLOCKS,
                ))),
            }
        }
        for d in [&raw_t, &stream_t, &raw_j, &vllm] {
            std::fs::remove_dir_all(d).unwrap();
        }
        rt.block_on(tier.shutdown()).unwrap();
        drop(tier);
        std::fs::remove_dir_all(&root).unwrap();
        settle();
    }
    let show = |name: &str, f: &Figures| {
        println!(
            "{:>4} KiB {:>2} job(s) {name:<5}: tier {} | raw@{TIER_THREADS} {} | stream@{TIER_THREADS} {} | raw@{jobs} {} | vllm {}{}",
            bs >> 10,
            jobs,
            span(&f.tier),
            span(&f.raw_t),
            span(&f.stream_t),
            span(&f.raw_j),
            span(&f.vllm),
            if f.uring.is_empty() {
                String::new()
            } else {
                format!(" | uring {}", span(&f.uring))
            }
        );
    };
    show("store", &w);
    show("load", &r);
    let ratio = |a: &[f64], b: &[f64]| {
        let r: Vec<f64> = a.iter().zip(b).map(|(x, y)| x / y).collect();
        let (min, max) = min_max(&r);
        format!("{:.2}[{min:.2}..{max:.2}]", median(r))
    };
    format!(
        "summary block={bs} jobs={jobs} store_vs_raw={} load_vs_raw={} store_vs_vllm={} load_vs_vllm={}\n\
         detail block={bs} jobs={jobs} store_vs_stream={} load_vs_stream={} store_vs_raw_at_jobs={} load_vs_raw_at_jobs={} load_vs_uring={} uring_vs_raw={} raw_vs_vllm store={} load={} stream_vs_vllm store={} load={}",
        ratio(&w.tier, &w.raw_t),
        ratio(&r.tier, &r.raw_t),
        ratio(&w.tier, &w.vllm),
        ratio(&r.tier, &r.vllm),
        ratio(&w.tier, &w.stream_t),
        ratio(&r.tier, &r.stream_t),
        ratio(&w.tier, &w.raw_j),
        ratio(&r.tier, &r.raw_j),
        ratio(&r.tier, &r.uring),
        ratio(&r.uring, &r.raw_t),
        ratio(&w.raw_t, &w.vllm),
        ratio(&r.raw_t, &r.vllm),
        ratio(&w.stream_t, &w.vllm),
        ratio(&r.stream_t, &r.vllm),
    )
}

/// The block's path under `root` at the tier's depth.
fn block_path(root: &Path, ns: &Namespace, k: &BlockKey) -> PathBuf {
    root.join(ns.block_rel_path(k))
}

/// How a raw competitor runs its blocks.
#[derive(Clone, Copy)]
enum Drive {
    /// On this many threads, each taking the next block (no job boundaries).
    Stream(usize),
    /// On `.0` threads, as `.1` jobs of [`JOB_BLOCKS`] blocks in flight: a job's blocks are
    /// queued together, and the next job starts when one has ended (as the tier is driven).
    Jobs(usize, usize),
}

/// Runs `f(index)` for every index below `n`, driven as `drive` says; the time it took.
fn on_threads(n: usize, drive: Drive, f: impl Fn(usize) + Sync) -> Duration {
    use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use std::sync::{Condvar, Mutex};
    let next = AtomicUsize::new(0);
    let (next, f) = (&next, &f);
    let t = Instant::now();
    match drive {
        Drive::Stream(threads) => std::thread::scope(|s| {
            for _ in 0..threads.min(n) {
                s.spawn(move || {
                    loop {
                        let i = next.fetch_add(1, Relaxed);
                        if i >= n {
                            break;
                        }
                        f(i);
                    }
                });
            }
        }),
        Drive::Jobs(threads, jobs) => {
            let n_jobs = n.div_ceil(JOB_BLOCKS);
            // (queued block indices with their job, stop) and each job's blocks left
            let queue = Mutex::new((std::collections::VecDeque::<(usize, usize)>::new(), false));
            let (work, ended) = (Condvar::new(), Condvar::new());
            let left: Vec<AtomicUsize> = (0..n_jobs)
                .map(|j| AtomicUsize::new(JOB_BLOCKS.min(n - j * JOB_BLOCKS)))
                .collect();
            let (queue, work, ended, left) = (&queue, &work, &ended, &left);
            std::thread::scope(|s| {
                for _ in 0..threads {
                    s.spawn(move || {
                        loop {
                            let (j, i) = {
                                let mut q = queue.lock().unwrap();
                                loop {
                                    if let Some(t) = q.0.pop_front() {
                                        break t;
                                    }
                                    if q.1 {
                                        return;
                                    }
                                    q = work.wait(q).unwrap();
                                }
                            };
                            f(i);
                            if left[j].fetch_sub(1, Relaxed) == 1 {
                                let _q = queue.lock().unwrap();
                                ended.notify_all();
                            }
                        }
                    });
                }
                let drivers: Vec<_> = (0..jobs.min(n_jobs))
                    .map(|_| {
                        s.spawn(move || {
                            loop {
                                let j = next.fetch_add(1, Relaxed);
                                if j >= n_jobs {
                                    break;
                                }
                                let mut q = queue.lock().unwrap();
                                q.0.extend(
                                    (j * JOB_BLOCKS..((j + 1) * JOB_BLOCKS).min(n)).map(|i| (j, i)),
                                );
                                work.notify_all();
                                while left[j].load(Relaxed) > 0 {
                                    q = ended.wait(q).unwrap();
                                }
                            }
                        })
                    })
                    .collect();
                for d in drivers {
                    d.join().unwrap();
                }
                queue.lock().unwrap().1 = true;
                work.notify_all();
            });
        }
    }
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
    drive: Drive,
) -> Duration {
    top_dirs(root, ns, keys);
    let made = std::sync::Mutex::new(HashSet::new());
    on_threads(keys.len(), drive, |i| {
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

/// O_DIRECT `open`, `read`, `close` of every block into the DRAM tier's slots, driven as
/// `drive` says, each task `per_task` consecutive blocks: 1 for the raw baselines, a job's 16
/// for vLLM's pattern (one thread per job).
fn direct_load(
    root: &Path,
    ns: &Namespace,
    keys: &[BlockKey],
    cpu: &CpuTier,
    drive: Drive,
    per_task: usize,
) -> Duration {
    let slots = dram_slots(cpu, keys);
    let tasks = keys.len().div_ceil(per_task);
    let took = on_threads(tasks, drive, |t| {
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

/// io_uring loads of every block into the DRAM tier's slots: per block a linked `OPENAT`
/// (O_DIRECT, into a direct descriptor: no file table entry), `READ`, `CLOSE`; a job's chains
/// submitted together, `jobs` jobs in flight, the next job submitted when one has completed;
/// one thread submits and reaps. Every open and close must succeed and every read be whole.
fn uring_load(
    root: &Path,
    ns: &Namespace,
    keys: &[BlockKey],
    cpu: &CpuTier,
    jobs: usize,
) -> Duration {
    use io_uring::{IoUring, opcode, squeue::Flags, types};
    use std::os::unix::ffi::OsStrExt;
    let mut sinks: Vec<kv_tier_core::BlockSink> = dram_slots(cpu, keys)
        .into_iter()
        .map(|m| m.into_inner().unwrap())
        .collect();
    let bs = sinks[0].len();
    let paths: Vec<std::ffi::CString> = keys
        .iter()
        .map(|k| {
            std::ffi::CString::new(std::ffi::OsStr::new(&ns.block_rel_path(k)).as_bytes()).unwrap()
        })
        .collect();
    let dir = std::fs::File::open(root).unwrap();
    let n_jobs = keys.len().div_ceil(JOB_BLOCKS);
    let lanes = jobs.min(n_jobs);
    let mut ring = IoUring::new((lanes * JOB_BLOCKS * 3).next_power_of_two() as u32).unwrap();
    ring.submitter()
        .register_files_sparse((lanes * JOB_BLOCKS) as u32)
        .unwrap();
    // user data: lane << 32 | op << 24 | block index (op: 0 open, 1 read, 2 close)
    let mut submit = |ring: &mut IoUring, lane: usize, j: usize| -> usize {
        let blocks = j * JOB_BLOCKS..((j + 1) * JOB_BLOCKS).min(keys.len());
        let n = blocks.len();
        for (k, i) in blocks.enumerate() {
            let slot = (lane * JOB_BLOCKS + k) as u32;
            let ud = |op: u64| (lane as u64) << 32 | op << 24 | i as u64;
            let open = opcode::OpenAt::new(types::Fd(dir.as_raw_fd()), paths[i].as_ptr())
                .flags(libc::O_RDONLY | libc::O_DIRECT)
                .file_index(Some(
                    types::DestinationSlot::try_from_slot_target(slot).unwrap(),
                ))
                .build()
                .flags(Flags::IO_LINK)
                .user_data(ud(0));
            let buf = sinks[i].as_mut_slice().as_mut_ptr();
            let read = opcode::Read::new(types::Fixed(slot), buf, bs as u32)
                .offset(0)
                .build()
                .flags(Flags::IO_LINK)
                .user_data(ud(1));
            let close = opcode::Close::new(types::Fixed(slot))
                .build()
                .user_data(ud(2));
            // SAFETY: the path and the buffer outlive the operations (this function waits for
            // every completion before it returns), and the ring has room for every operation
            // in flight (three per block of `lanes` jobs).
            unsafe {
                let mut sq = ring.submission();
                sq.push(&open).unwrap();
                sq.push(&read).unwrap();
                sq.push(&close).unwrap();
            }
        }
        3 * n
    };
    let t = Instant::now();
    let mut left = vec![0usize; lanes];
    let mut next = 0;
    for (lane, l) in left.iter_mut().enumerate() {
        *l = submit(&mut ring, lane, next);
        next += 1;
    }
    let mut running = lanes;
    while running > 0 {
        ring.submit_and_wait(1).unwrap();
        let done: Vec<(u64, i32)> = ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (ud, res) in done {
            let (lane, op, i) = ((ud >> 32) as usize, (ud >> 24) & 0xff, ud & 0xff_ffff);
            match op {
                1 => assert_eq!(res, bs as i32, "io_uring read of block {i}"),
                _ => assert!(res >= 0, "io_uring op {op} of block {i}: {res}"),
            }
            left[lane] -= 1;
            if left[lane] == 0 {
                if next < n_jobs {
                    left[lane] = submit(&mut ring, lane, next);
                    next += 1;
                } else {
                    running -= 1;
                }
            }
        }
    }
    let took = t.elapsed();
    drop(sinks);
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
    on_threads(n_jobs, Drive::Stream(jobs), |j| {
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

/// Writes back every dirty page and inode, so no competitor pays for the one before it.
fn sync_disk() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
}

/// Drops the page cache (and cached directory entries and inodes) so loads start cold;
/// false where not allowed.
fn drop_caches() -> bool {
    sync_disk();
    std::fs::write("/proc/sys/vm/drop_caches", "3").is_ok()
}

fn span(v: &[f64]) -> String {
    let (min, max) = min_max(v);
    format!("{:.2} [{min:.2}-{max:.2}]", median(v.to_vec()))
}

/// The least and the greatest of `v` (positive figures: GB/s and their ratios).
fn min_max(v: &[f64]) -> (f64, f64) {
    let min = v.iter().copied().fold(f64::INFINITY, f64::min);
    let max = v.iter().copied().fold(0.0, f64::max);
    (min, max)
}

/// Where the syscall count's keys go.
#[derive(Clone, Copy, Debug)]
enum Leaves {
    /// Spread as real hashes are: nearly every store makes its leaf directory.
    Fresh,
    /// In 16 leaf directories the first stores make: the rest find theirs.
    Made,
}

/// The child of the syscall count: stores then loads `n` 256 KiB blocks, 16-block jobs, one
/// in flight, keys placed as `leaves` says.
fn syscall_child(n: usize, leaves: Leaves) {
    let bs = 256 << 10;
    let dir = tempfile::tempdir().unwrap();
    let tier = common::open_ready_tier(dir.path(), &common::bench_ns(), bs);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let keys: Vec<BlockKey> = (0..n as u32)
        .map(|i| match leaves {
            Leaves::Fresh => test_key(u64::from(i)),
            Leaves::Made => {
                let mut h = [0u8; 32];
                h[0] = (i % 16) as u8;
                h[4..8].copy_from_slice(&i.to_be_bytes());
                BlockKey::from_hash32(h, 0)
            }
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
/// and 512 blocks, keys placed as `leaves` says); the difference over 256 is per block,
/// setup cancelling out.
fn syscall_summary(leaves: Leaves) -> String {
    let me = std::env::current_exe().unwrap();
    let mut counts = Vec::new();
    for n in [256, 512] {
        let out = std::env::temp_dir().join(format!("kv-tier-fair-strace-{n}"));
        let status = std::process::Command::new("strace")
            .args(["-f", "-c", "-o"])
            .arg(&out)
            .arg(&me)
            .args(["--syscall-child", &n.to_string(), &format!("{leaves:?}")])
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
    let store = ["mkdir", "renameat2", "linkat", "pwrite64"]
        .iter()
        .map(|s| per(s))
        .sum::<f64>();
    let load = per("pread64") + per("preadv");
    // open and close serve both: split by the phases' known shape (each opens and closes
    // once); a stat is counted to the load (the store makes none)
    let opens = per("openat");
    let closes = per("close");
    let statx = per("statx") + per("newfstatat");
    let store_total = store + opens / 2.0 + closes / 2.0;
    let load_total = load + opens / 2.0 + closes / 2.0 + statx;
    format!(
        "summary syscalls leaves={leaves:?} store={store_total:.2} load={load_total:.2} (openat {opens:.2}, close {closes:.2}, stat {statx:.2}, mkdir {:.2}, renameat2 {:.2}, linkat {:.2}, pwrite {:.2}, pread/preadv {:.2} per block, store+load)",
        per("mkdir"),
        per("renameat2"),
        per("linkat"),
        per("pwrite64"),
        load
    )
}
