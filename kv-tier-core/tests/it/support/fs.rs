//! The fs tier in the tests: its config and a tier opened directly (alone or behind a
//! fault-injecting tier), manager configs over it, a bounded tier with a fast background GC,
//! keys crowded into a few leaf directories, worker, collector and sampler tasks for churn,
//! the checks of its events against the disk, and the `kv-tier` command beside this binary.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_tier::fs::{Checksum, FsTier, FsTierConfig, GcStats};
use kv_tier_core::{BlockKey, KvTierConfig, SecondaryTier, TierEvent, TieringManager};
use kv_tier_testkit::{allocated_bytes, find_files, load_keys, store_keys, test_key, verify_block};

use super::*;

/// An fs tier config over `root`: CRC32C checksums, two read and two write threads.
pub(crate) fn fs_tier_config(root: &Path) -> FsTierConfig {
    let mut c = FsTierConfig::new(root);
    c.checksum = Checksum::Crc32c;
    c.n_read_threads = 2;
    c.n_write_threads = 2;
    c
}

/// An fs tier named `fs` over `root` ([`fs_tier_config`]) for blocks of `bs` bytes, in [`model_namespace`].
pub(crate) fn open_fs(root: &Path, bs: usize) -> Arc<FsTier> {
    Arc::new(FsTier::open("fs", fs_tier_config(root), model_namespace(), bs).unwrap())
}

/// A real fs tier in `root` wrapped in a `FaultyTier` (for gates).
pub(crate) fn faulty_fs(root: &Path) -> (Arc<FsTier>, Arc<FaultyTier>) {
    let fs = open_fs(root, BS);
    let faulty = Arc::new(FaultyTier::new(fs.clone()));
    (fs, faulty)
}

/// A manager config of `slots` DRAM blocks of `bs` bytes (slots page-rounded) over one fs tier in
/// `root`, `fs_extra` added to the tier's entry.
pub(crate) fn fs_manager_config(
    root: &std::path::Path,
    slots: usize,
    bs: usize,
    fs_extra: &str,
) -> KvTierConfig {
    let slot = bs.div_ceil(4096) * 4096;
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs},
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}{fs_extra}}}]}}"#,
        slots * slot,
        root
    ))
    .unwrap()
}

/// A manager of `slots` DRAM blocks of [`BS`] bytes over one fs tier in `dir`, `extra` added to
/// the config's top level.
pub(crate) fn fs_manager(dir: &std::path::Path, slots: usize, extra: &str) -> TieringManager {
    build(
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}{extra}, {},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
            slots * BS,
            LAYOUT,
            dir
        ))
        .unwrap(),
    )
}

/// A manager config over an fs tier in `root` and then a tier of the type `gated` (a
/// [`GatedBuilder`]).
pub(crate) fn gated_cfg(root: &Path) -> KvTierConfig {
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{{"type": "fs", "root_dir": {root:?}, "n_read_threads": 2,
                                  "n_write_threads": 2, "gc_max_size_gb": 1}},
                                {{"type": "gated"}}]}}"#
    ))
    .unwrap()
}

/// The temp files (`.tmp`) below `root`.
pub(crate) fn tmp_files_below(root: &Path) -> Vec<PathBuf> {
    find_files(root, ".tmp")
}

/// The rank directory of [`model_namespace`] in `root`.
pub(crate) fn model_rank_dir(root: &Path) -> PathBuf {
    root.join(model_namespace().rank_dir_name())
}

/// Allocated bytes of the rank directory in `root` (what `du` shows).
pub(crate) fn model_rank_du(root: &Path) -> u64 {
    allocated_bytes(&model_rank_dir(root))
}

/// A bounded tier's GC statistics.
pub(crate) fn gcs(t: &FsTier) -> GcStats {
    t.stats().gc.expect("a bounded tier has GC stats")
}

/// A key in leaf directory `leaf` (of a handful sharing one top directory): index `i`.
pub(crate) fn crowded_leaf_key(leaf: u8, i: u32) -> BlockKey {
    let mut h = [0u8; 32];
    h[0] = 0xa0;
    h[1] = leaf;
    h[2] = 0x5c;
    h[3..7].copy_from_slice(&i.to_be_bytes());
    h[31] = 0x77;
    BlockKey::from_hash32(h, 0)
}

/// A bounded, checksummed tier whose cap holds about `cap_blocks` blocks (plus directories),
/// background GC every 10 ms, tiny grace and stamp interval, rescans every second.
pub(crate) fn bounded_tier(root: &Path, cap_blocks: u64) -> Arc<FsTier> {
    bounded_tier_bg(root, cap_blocks, true)
}

/// [`bounded_tier`], with the background GC on or off (`gc_background`).
pub(crate) fn bounded_tier_bg(root: &Path, cap_blocks: u64, background: bool) -> Arc<FsTier> {
    let mut c = FsTierConfig::new(root);
    c.checksum = Checksum::Crc32c;
    c.n_read_threads = 2;
    c.n_write_threads = 2;
    let cap = cap_blocks * BS as u64 + 16 * 4096;
    c.gc_max_size_gb = Some(cap as f64 / GIB);
    c.gc_interval_s = Some(0.01);
    c.gc_stamp_interval_s = Some(0.001);
    c.gc_grace_s = Some(0.002);
    c.gc_rescan_interval_s = Some(1.0);
    c.gc_background = background;
    Arc::new(FsTier::open("fs", c, model_namespace(), BS).unwrap())
}

/// The pool: `per_leaf` keys in each of `leaves` leaf directories, plus `spread` keys spread
/// over the layout.
pub(crate) fn pool(leaves: u8, per_leaf: u32, spread: u64) -> Vec<BlockKey> {
    let mut v = Vec::new();
    for l in 0..leaves {
        for i in 0..per_leaf {
            v.push(crowded_leaf_key(0x11 + l * 0x10, i));
        }
    }
    v.extend((0..spread).map(|i| test_key(60_000_000 + i)));
    v
}

/// Store / load (verified) / touch / lookup workers on random keys of `keys`; returns the
/// wrong-byte count and the op count.
pub(crate) fn spawn_fs_workers(
    tier: &Arc<FsTier>,
    keys: &Arc<Vec<BlockKey>>,
    stop: &Arc<AtomicBool>,
    n: u64,
    base: u64,
    wrong: &Arc<AtomicU64>,
) -> Vec<tokio::task::JoinHandle<u64>> {
    (0..n)
        .map(|w| {
            let (tier, keys, stop, wrong) =
                (tier.clone(), keys.clone(), stop.clone(), wrong.clone());
            tokio::spawn(async move {
                let mut rng = Rng::new(base ^ (w + 7));
                let mut ops = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let n = 1 + rng.below(4) as usize;
                    let batch: Vec<BlockKey> = (0..n)
                        .map(|_| keys[rng.below(keys.len() as u64) as usize])
                        .collect::<HashSet<_>>()
                        .into_iter()
                        .collect();
                    match rng.below(10) {
                        0..=3 => {
                            // the same batch stored twice at once: one writes, one skips
                            if rng.below(3) == 0 {
                                let (a, b) = tokio::join!(
                                    store_keys(&*tier, &batch, 0, BS),
                                    store_keys(&*tier, &batch, 0, BS)
                                );
                                drop((a, b));
                            } else {
                                let _ = store_keys(&*tier, &batch, 0, BS).await;
                            }
                        }
                        4..=7 => {
                            let (_r, got) = load_keys(&*tier, &batch, BS).await;
                            for (k, b) in got {
                                if !verify_block(&k, 0, &b) {
                                    wrong.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        8 => tier.touch(&batch),
                        _ => {
                            let _ = tier.lookup(&batch).await;
                        }
                    }
                    ops += 1;
                    tokio::task::yield_now().await;
                }
                ops
            })
        })
        .collect()
}

/// Takes the tier's events every 20 ms into one ordered list until stopped.
pub(crate) fn spawn_collector(
    tier: &Arc<FsTier>,
    stop: &Arc<AtomicBool>,
    out: &Arc<Mutex<Vec<TierEvent>>>,
) -> std::thread::JoinHandle<()> {
    let (tier, stop, out) = (tier.clone(), stop.clone(), out.clone());
    std::thread::spawn(move || {
        while !stop.load(Ordering::Relaxed) {
            let ev = tier.take_events();
            out.lock().unwrap().extend(ev);
            // the collector takes events every 20 ms
            std::thread::sleep(Duration::from_millis(20));
        }
    })
}

/// Samples `GcStats` every 200 us; returns (max of `bytes`, max of `peak_bytes`, ceiling).
pub(crate) fn spawn_sampler(
    tier: &Arc<FsTier>,
    stop: &Arc<AtomicBool>,
) -> std::thread::JoinHandle<(u64, u64, u64)> {
    let (tier, stop) = (tier.clone(), stop.clone());
    std::thread::spawn(move || {
        let (mut b, mut p, mut c) = (0, 0, 0);
        while !stop.load(Ordering::Relaxed) {
            let g = gcs(&tier);
            b = b.max(g.bytes);
            p = p.max(g.peak_bytes);
            c = g.hard_ceiling_bytes;
            // the sampler looks every 200 us
            std::thread::sleep(Duration::from_micros(200));
        }
        (b, p, c)
    })
}

/// Every key's event history, in order.
pub(crate) fn histories(ev: &[TierEvent]) -> HashMap<BlockKey, Vec<bool>> {
    let mut h: HashMap<BlockKey, Vec<bool>> = HashMap::new();
    for e in ev {
        for k in &e.keys {
            h.entry(*k).or_default().push(e.removed);
        }
    }
    h
}

/// The checks of the README's "Events" on a quiet tier: for every key, its last event is a
/// removal exactly when no file is there; no removal follows a removal; a key's first event
/// is not a removal (the tier started empty). Returns a description of every violation.
pub(crate) fn event_violations(tier: &FsTier, keys: &[BlockKey], ev: &[TierEvent]) -> Vec<String> {
    let h = histories(ev);
    let mut bad = Vec::new();
    for k in keys {
        let on_disk = tier.block_path(k).exists();
        let hist = h.get(k).cloned().unwrap_or_default();
        let last_removed = hist.last().copied();
        let said_there = last_removed == Some(false);
        if said_there != on_disk {
            bad.push(format!(
                "{k}: on disk {on_disk}, last event {:?} (history {hist:?})",
                last_removed.map(|r| if r { "removed" } else { "stored" })
            ));
        }
        if hist.windows(2).any(|w| w[0] && w[1]) {
            bad.push(format!("{k}: removed twice in a row (history {hist:?})"));
        }
        if hist.first() == Some(&true) {
            bad.push(format!(
                "{k}: first event is a removal, no store before (history {hist:?})"
            ));
        }
    }
    bad
}

/// The `kv-tier` command of this build (`CARGO_TARGET_DIR`'s, or beside this test binary's
/// directory); it must have been built (`cargo build -p kv-tier-cli`).
pub(crate) fn cli_binary() -> PathBuf {
    if let Ok(t) = std::env::var("CARGO_TARGET_DIR") {
        let p = PathBuf::from(t).join("debug").join("kv-tier");
        if p.exists() {
            return p;
        }
    }
    // target/debug/deps/<this test> -> target/debug/kv-tier
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join("kv-tier");
    assert!(
        p.exists(),
        "{} missing: build it first (cargo build -p kv-tier-cli)",
        p.display()
    );
    p
}
