//! What the fs benches share: their directory and rounds, cleanup between rounds.

use std::path::{Path, PathBuf};
use std::time::Duration;

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

/// Deletes the blocks and their second-level directories, keeping the first level as a
/// cache in use has it.
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
