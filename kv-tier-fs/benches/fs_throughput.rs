//! Store then load blocks through `FsTier` with 1, 4 and 16 jobs of 16 blocks in flight, and
//! one 64-block job alone; in the same run, interleaved round by round, a raw baseline that
//! writes and reads the same bytes with plain O_DIRECT pwrite/pread on the same number of
//! threads to fresh files in the same directory. Prints GB/s of both and the median ratio.
//!
//! Its raw baseline is not the fairest one: a flat directory, loads with a warm page cache,
//! and raw reads into ordinary buffers while the tier reads into the DRAM tier's pre-faulted
//! slots (2.5x "faster than raw" on loads here comes from that). `fs_fair` is the fair
//! comparison; this one stays for its case mix and the lookup figure.
//!
//! `cargo bench -p kv-tier-fs --bench fs_throughput` (directory: `KV_TIER_BENCH_DIR`, default
//! the system temp dir; rounds: `KV_TIER_BENCH_ROUNDS`, default 5).

mod common;
use common::{clear_blocks, settle, tier_load, tier_store};

use std::fs::OpenOptions;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use kv_tier_core::{AlignedBuf, BlockKey, EvictionPolicy, Namespace, RunFields, SecondaryTier};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_fs::{FsTier, FsTierConfig};
use kv_tier_testkit::bench::median;
use kv_tier_testkit::{fill_block, test_key};

#[derive(Clone, Copy)]
struct Case {
    label: &'static str,
    jobs_in_flight: usize,
    job_blocks: usize,
    raw_threads: usize,
}

impl Case {
    /// A lone job is measured job after job; the raw baseline gets the same barriers.
    fn raw_batch(&self) -> usize {
        if self.jobs_in_flight == 1 && self.job_blocks > 16 {
            self.job_blocks
        } else {
            usize::MAX
        }
    }
}

const CASES: [Case; 4] = [
    Case {
        label: "1 job in flight",
        jobs_in_flight: 1,
        job_blocks: 16,
        raw_threads: 1,
    },
    Case {
        label: "4 jobs in flight",
        jobs_in_flight: 4,
        job_blocks: 16,
        raw_threads: 4,
    },
    Case {
        label: "16 jobs in flight",
        jobs_in_flight: 16,
        job_blocks: 16,
        raw_threads: 16,
    },
    Case {
        label: "one 64-block job (raw: 4 threads)",
        jobs_in_flight: 1,
        job_blocks: 64,
        raw_threads: 4,
    },
];

struct Sizes {
    block: usize,
    n: usize,
}

fn main() {
    let (dir, rounds, rt) = common::setup("kv-tier-bench-");
    println!(
        "fs tier vs raw O_DIRECT pwrite/pread in {} ({rounds} rounds, medians; a flat, warm, plain-buffer baseline: see the fs_fair bench for the fair one)",
        dir.path().display()
    );
    println!(
        "{:<9} {:<36} {:>9} {:>9} {:>7} | {:>9} {:>9} {:>7}",
        "block", "case", "fs wr", "raw wr", "ratio", "fs rd", "raw rd", "ratio"
    );
    for sizes in [
        Sizes {
            block: 2 << 20,
            n: 128,
        },
        Sizes {
            block: 256 << 10,
            n: 512,
        },
    ] {
        run_size(&rt, dir.path(), &sizes, rounds);
    }
    lookup_bench(&rt, dir.path());
}

fn run_size(rt: &tokio::runtime::Runtime, dir: &Path, s: &Sizes, rounds: usize) {
    let bs = s.block;
    let ns = common::bench_ns();
    let root = dir.join(format!("fs-{bs}"));
    let tier = common::open_ready_tier(&root, &ns, bs);
    settle();
    assert!(
        tier.stats().direct_io,
        "O_DIRECT is not available in {}",
        dir.display()
    );
    let cpu = CpuTier::new(CpuTierConfig {
        capacity_bytes: (s.n * bs) as u64,
        block_size: bs,
        policy: EvictionPolicy::Lru,
        prefault: true,
    })
    .unwrap();
    let srcs: Vec<Bytes> = (0..s.n)
        .map(|i| {
            let mut b = AlignedBuf::zeroed(bs);
            fill_block(&test_key(i as u64), 0, b.as_mut_slice());
            Bytes::from_owner(b)
        })
        .collect();
    let mut dst: Vec<AlignedBuf> = (0..s.n.min(64))
        .map(|_| {
            let mut b = AlignedBuf::zeroed(bs);
            b.as_mut_slice().fill(1);
            b
        })
        .collect();
    let gb = (s.n * bs) as f64 / 1e9;
    for case in CASES {
        let (mut fw, mut rw, mut wr, mut fr, mut rr, mut rdr) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for round in 0..rounds {
            let keys: Vec<BlockKey> = (0..s.n)
                .map(|i| test_key((round as u64) << 40 | i as u64))
                .collect();
            let raw_dir = dir.join(format!("raw-{bs}-{round}"));
            std::fs::create_dir_all(&raw_dir).unwrap();
            // writes, in alternating order
            let (f_w, r_w) = if round % 2 == 0 {
                let f = tier_store(
                    rt,
                    &tier,
                    &keys,
                    &srcs,
                    case.job_blocks,
                    case.jobs_in_flight,
                );
                (
                    f,
                    raw_write(&raw_dir, &srcs, case.raw_threads, case.raw_batch()),
                )
            } else {
                let r = raw_write(&raw_dir, &srcs, case.raw_threads, case.raw_batch());
                (
                    tier_store(
                        rt,
                        &tier,
                        &keys,
                        &srcs,
                        case.job_blocks,
                        case.jobs_in_flight,
                    ),
                    r,
                )
            };
            let (f_r, r_r) = if round % 2 == 0 {
                let f = tier_load(rt, &tier, &cpu, &keys, case.job_blocks, case.jobs_in_flight);
                (
                    f,
                    raw_read(&raw_dir, s.n, &mut dst, case.raw_threads, case.raw_batch()),
                )
            } else {
                let r = raw_read(&raw_dir, s.n, &mut dst, case.raw_threads, case.raw_batch());
                (
                    tier_load(rt, &tier, &cpu, &keys, case.job_blocks, case.jobs_in_flight),
                    r,
                )
            };
            std::fs::remove_dir_all(&raw_dir).unwrap();
            clear_blocks(&root.join(ns.rank_dir_name()));
            settle();
            let g = |d: Duration| gb / d.as_secs_f64();
            fw.push(g(f_w));
            rw.push(g(r_w));
            wr.push(r_w.as_secs_f64() / f_w.as_secs_f64());
            fr.push(g(f_r));
            rr.push(g(r_r));
            rdr.push(r_r.as_secs_f64() / f_r.as_secs_f64());
        }
        println!(
            "{:<9} {:<36} {:>9.2} {:>9.2} {:>6.2}x | {:>9.2} {:>9.2} {:>6.2}x",
            format!("{} KiB", bs >> 10),
            case.label,
            median(fw),
            median(rw),
            median(wr),
            median(fr),
            median(rr),
            median(rdr)
        );
    }
    let _ = rt.block_on(tier.shutdown());
}

fn raw_write(dir: &Path, srcs: &[Bytes], threads: usize, batch: usize) -> Duration {
    let t = Instant::now();
    for start in (0..srcs.len()).step_by(batch) {
        let end = (start + batch).min(srcs.len());
        let next = AtomicUsize::new(start);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= end {
                            break;
                        }
                        let f = OpenOptions::new()
                            .write(true)
                            .create_new(true)
                            .custom_flags(libc::O_DIRECT)
                            .open(dir.join(format!("{i}.bin")))
                            .unwrap();
                        f.write_all_at(&srcs[i], 0).unwrap();
                    }
                });
            }
        });
    }
    t.elapsed()
}

fn raw_read(
    dir: &Path,
    n: usize,
    dst: &mut [AlignedBuf],
    threads: usize,
    batch: usize,
) -> Duration {
    let slots: Vec<std::sync::Mutex<&mut AlignedBuf>> =
        dst.iter_mut().map(std::sync::Mutex::new).collect();
    let t = Instant::now();
    for start in (0..n).step_by(batch) {
        let end = (start + batch).min(n);
        let next = AtomicUsize::new(start);
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= end {
                            break;
                        }
                        let f = OpenOptions::new()
                            .read(true)
                            .custom_flags(libc::O_DIRECT)
                            .open(dir.join(format!("{i}.bin")))
                            .unwrap();
                        let mut buf = slots[i % slots.len()].lock().unwrap();
                        let len = buf.len();
                        let mut done = 0;
                        while done < len {
                            let r = f
                                .read_at(&mut buf.as_mut_slice()[done..], done as u64)
                                .unwrap();
                            assert!(r > 0);
                            done += r;
                        }
                    }
                });
            }
        });
    }
    t.elapsed()
}

fn lookup_bench(rt: &tokio::runtime::Runtime, dir: &Path) {
    let ns = Namespace::new(RunFields::new("bench/model", "torch.bfloat16", 16), 0).unwrap();
    let tier = FsTier::open("fs", FsTierConfig::new(dir.join("lookup")), ns, 4096).unwrap();
    let keys: Vec<BlockKey> = (0..2000).map(|i| test_key(1 << 50 | i)).collect();
    let mut samples = Vec::new();
    for _ in 0..21 {
        let t = Instant::now();
        let found = rt.block_on(tier.lookup(&keys)).unwrap();
        samples.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(found.iter().all(|&b| !b));
    }
    println!(
        "lookup of 2,000 absent keys: median {:.2} ms (target <= 20 ms; runs on the tier's I/O threads)",
        median(samples)
    );
}
