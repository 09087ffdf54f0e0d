//! What the fs benches share: their directory and rounds, the tier's store and load of a
//! round, cleanup between rounds.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use kv_tier_core::{BlockKey, BlockSource, LoadJob, PrimaryTier, SecondaryTier, StoreJob};
use kv_tier_cpu::CpuTier;
use kv_tier_fs::FsTier;

/// The benchmark directory (`KV_TIER_BENCH_DIR`, default the system temp dir) and the
/// rounds (`KV_TIER_BENCH_ROUNDS`, default 5).
pub(crate) fn dir_and_rounds() -> (PathBuf, usize) {
    let base = std::env::var("KV_TIER_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| std::env::temp_dir());
    let rounds = std::env::var("KV_TIER_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5);
    (base, rounds)
}

/// The benches' namespace.
pub(crate) fn bench_ns() -> kv_tier_core::Namespace {
    kv_tier_core::Namespace::new(
        kv_tier_core::RunFields::new("bench/model", "torch.bfloat16", 16),
        0,
    )
    .unwrap()
}

/// A fs tier on `root` with the default options, once its 4,096 top directories exist (as
/// a cache in use has them: their making is not what a bench measures).
pub(crate) fn open_ready_tier(
    root: &Path,
    ns: &kv_tier_core::Namespace,
    block_size: usize,
) -> Arc<FsTier> {
    let tier = Arc::new(
        FsTier::open(
            "fs",
            kv_tier_fs::FsTierConfig::new(root),
            ns.clone(),
            block_size,
        )
        .unwrap(),
    );
    while !tier.stats().top_dirs_ready {
        std::thread::sleep(Duration::from_millis(10));
    }
    tier
}

/// The benchmark's directory (a fresh temp dir named `prefix...` under
/// [`dir_and_rounds`]'s base, removed on drop), its rounds, and a 2-worker runtime.
pub(crate) fn setup(prefix: &str) -> (tempfile::TempDir, usize, tokio::runtime::Runtime) {
    let (base, rounds) = dir_and_rounds();
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in(&base)
        .unwrap();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    (dir, rounds, rt)
}

/// Deletes the blocks and their second-level directories, keeping the first level as a
/// cache in use has it.
#[allow(dead_code)] // fs_throughput's, not fs_fair's
pub(crate) fn clear_blocks(rank_dir: &Path) {
    for top in std::fs::read_dir(rank_dir).unwrap().flatten() {
        for leaf in std::fs::read_dir(top.path()).unwrap().flatten() {
            std::fs::remove_dir_all(leaf.path()).unwrap();
        }
    }
}

/// Deleting files makes the disk discard them in the background (the root filesystem here is
/// mounted with `discard`); let that finish before the next measurement.
pub(crate) fn settle() {
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    std::thread::sleep(Duration::from_millis(300));
}

/// Stores `keys` (bytes `srcs`) through the tier in jobs of `job_blocks`, `jobs` in flight;
/// the time it took.
pub(crate) fn tier_store(
    rt: &tokio::runtime::Runtime,
    tier: &Arc<FsTier>,
    keys: &[BlockKey],
    srcs: &[Bytes],
    job_blocks: usize,
    jobs: usize,
) -> Duration {
    let js: Vec<StoreJob> = keys
        .chunks(job_blocks)
        .zip(srcs.chunks(job_blocks))
        .map(|(ks, ss)| StoreJob {
            links: Vec::new(),
            requests: Vec::new(),
            blocks: ks
                .iter()
                .zip(ss)
                .map(|(k, s)| (*k, BlockSource::from_bytes(s.clone())))
                .collect(),
        })
        .collect();
    let t = Instant::now();
    rt.block_on(async {
        let results: Vec<_> = futures::stream::iter(js)
            .map(|j| tier.store(j))
            .buffer_unordered(jobs)
            .collect()
            .await;
        assert!(results.iter().all(|r| r.is_success()));
    });
    t.elapsed()
}

/// Loads `keys` through the tier into the DRAM tier's slots (pre-faulted, as an engine's
/// are) in jobs of `job_blocks`, `jobs` in flight; the time it took.
pub(crate) fn tier_load(
    rt: &tokio::runtime::Runtime,
    tier: &Arc<FsTier>,
    cpu: &CpuTier,
    keys: &[BlockKey],
    job_blocks: usize,
    jobs: usize,
) -> Duration {
    let mut prepared = cpu.prepare_store(keys).unwrap();
    assert_eq!(
        prepared.to_store.len(),
        keys.len(),
        "a DRAM slot for every block"
    );
    let mut sinks = std::mem::take(&mut prepared.to_store).into_iter();
    let mut js = Vec::new();
    loop {
        let blocks: Vec<_> = sinks.by_ref().take(job_blocks).collect();
        if blocks.is_empty() {
            break;
        }
        js.push(LoadJob {
            blocks,
            ..Default::default()
        });
    }
    let t = Instant::now();
    rt.block_on(async {
        let results: Vec<_> = futures::stream::iter(js)
            .map(|j| tier.load(j))
            .buffer_unordered(jobs)
            .collect()
            .await;
        assert!(
            results.iter().all(|r| r.is_success()),
            "{:?}",
            results.iter().find(|r| !r.is_success())
        );
    });
    let took = t.elapsed();
    cpu.complete_store(keys, false);
    took
}
