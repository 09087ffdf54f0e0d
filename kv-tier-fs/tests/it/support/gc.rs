//! Driving the GC: keys of one leaf directory, aged files, sweeps held at a hook point, a
//! settled tier, chains stored with their links.

use std::path::Path;
use std::sync::{Arc, mpsc};
use std::time::Duration;

use kv_tier_core::{BlockKey, ChainLink, SecondaryTier, StoreJob};
use kv_tier_fs::FsTier;
use kv_tier_testkit::{source_for, temp_root, test_key};

use super::*;

/// Sets each key's file mtime to `secs_ago(i)` seconds in the past, then rescans (so the
/// tier's index sees the new ages).
pub(crate) fn age(tier: &FsTier, keys: &[BlockKey], secs_ago: impl Fn(usize) -> u64) {
    for (i, k) in keys.iter().enumerate() {
        let f = std::fs::File::options()
            .write(true)
            .open(tier.block_path(k))
            .unwrap();
        f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(secs_ago(i)))
            .unwrap();
    }
    tier.gc_rescan_now().unwrap();
}

/// A key in the one leaf directory `abc/de_g0` (`i` picks the rest of the hash): what such
/// keys hold on disk is their files plus one fixed pair of directories.
pub(crate) fn leaf_key(i: u64) -> BlockKey {
    let mut h = [0u8; 32];
    h.copy_from_slice(kv_tier_testkit::test_key(i).hash_bytes());
    h[0] = 0xab;
    h[1] = 0xcd;
    h[2] = 0xe0 | (h[2] & 0x0f);
    BlockKey::from_hash32(h, 0)
}

/// Installs a GC hook that stops at `point`: the receiver gets a message when the GC is
/// there, and the GC goes on when the sender sends (or is dropped).
pub(crate) fn hook_at(
    tier: &FsTier,
    point: kv_tier_fs::SweepPoint,
) -> (std::sync::mpsc::Receiver<()>, std::sync::mpsc::Sender<()>) {
    let (at_tx, at_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    tier.set_sweep_hook(Some(std::sync::Arc::new(move |p| {
        if p == point {
            let _ = at_tx.send(());
            let _ = go_rx.lock().unwrap().recv();
        }
    })))
    .unwrap();
    (at_rx, go_tx)
}

/// Allocated bytes of the directories the test keys keep: they all share one leaf directory
/// (and so one top directory), each a directory's allocation on this filesystem.
pub(crate) fn dirs(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    2 * std::fs::metadata(root).unwrap().blocks() * 512
}

/// What `n` test blocks hold on disk: their files and their shared directories.
pub(crate) fn held(root: &Path, n: u64) -> u64 {
    n * BS as u64 + dirs(root)
}

/// Holds the sweep at `point`: returns the sweep's thread once it has reached it, and the
/// sender that lets it go on.
pub(crate) fn sweep_held_at(
    tier: &std::sync::Arc<FsTier>,
    point: kv_tier_fs::SweepPoint,
) -> (std::thread::JoinHandle<usize>, std::sync::mpsc::Sender<()>) {
    let (at_rx, go_tx) = hook_at(tier, point);
    let t = tier.clone();
    let sweep = std::thread::spawn(move || t.gc_sweep_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the sweep hook was never reached");
    (sweep, go_tx)
}

/// The [`leaf_key`]s of `range`.
pub(crate) fn leaf_keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
    range.map(leaf_key).collect()
}

/// Stores `ks` in a tier whose cap holds 10 test blocks with the hard ceiling out of the way
/// (a job's first stores into a new leaf each reserve its directories), then reopens it with
/// the ceiling at `ceiling` x the cap.
pub(crate) async fn with_ceiling(root: &Path, ks: &[BlockKey], ceiling: f64) -> FsTier {
    assert!(
        fs_store(&open_hand_swept(root, 10, 0.8), ks, 0)
            .await
            .is_success()
    );
    let mut c = hand_swept_cfg(root, 10, 0.8);
    c.gc_hard_ceiling = Some(ceiling);
    FsTier::open("fs", c, ns(), BS).unwrap()
}

/// Protects `key` on a thread of its own: the receiver gets, once `protect()` has returned,
/// whether the key's file existed then; the thread returns the guard.
pub(crate) fn protect_on_thread(
    tier: &Arc<FsTier>,
    key: BlockKey,
) -> (
    std::thread::JoinHandle<kv_tier_core::ProtectGuard>,
    mpsc::Receiver<bool>,
) {
    let (t, path) = (tier.clone(), tier.block_path(&key));
    let (tx, rx) = mpsc::channel();
    let protector = std::thread::spawn(move || {
        let guard = t.protect(&[key]);
        tx.send(path.exists()).unwrap();
        guard
    });
    (protector, rx)
}

/// Touches `k` a nanosecond before a whole stamp interval (a minute) has passed on the frozen
/// GC clock since its last stamp, then exactly at it: only the second touch is queued.
pub(crate) fn touch_at_the_stamp_interval_boundary(tier: &FsTier, k: BlockKey) {
    tier.advance_gc_clock(Duration::from_secs(60) - Duration::from_nanos(1))
        .unwrap();
    tier.touch(&[k]);
    assert_eq!(
        gc_stats(tier).pending_stamps,
        0,
        "stamped within the interval"
    );
    tier.advance_gc_clock(Duration::from_nanos(1)).unwrap();
    tier.touch(&[k]);
    assert_eq!(gc_stats(tier).pending_stamps, 1);
}

/// What one block with its own leaf and top directories holds on this filesystem (with a cap
/// small enough that top directories count per use, as in the tests that use this).
pub(crate) async fn measured_per_block() -> u64 {
    let root = temp_root();
    let probe = FsTier::open("fs", capped_no_thread_cfg(root.path(), 64 << 20), ns(), BS).unwrap();
    assert!(fs_store(&probe, &[test_key(0)], 0).await.is_success());
    gc_stats(&probe).bytes
}

/// `n` keys in one leaf directory, stored, oldest first (key 0 the oldest).
pub(crate) async fn aged_quiet(tier: &FsTier, n: u64) -> Vec<BlockKey> {
    let ks: Vec<BlockKey> = (0..n).map(leaf_key).collect();
    assert!(fs_store(tier, &ks, 0).await.is_success());
    age(tier, &ks, |i| (n - i as u64) * 1000);
    tier.take_events();
    ks
}

/// Stores `key` again while the sweep is held (bounded: a store that waits for the held sweep
/// fails the test instead of hanging it).
pub(crate) async fn store_while_held(tier: &Arc<FsTier>, key: BlockKey) {
    let t = tier.clone();
    let r = tokio::time::timeout(HOOK_DEADLINE, async move { fs_store(&*t, &[key], 0).await })
        .await
        .expect("the store waited for the held sweep");
    assert!(r.is_success());
}

/// What `n` sequentially stored one-leaf keys ([`leaf_key`]) hold, measured.
pub(crate) async fn leaf_cost(n: u64) -> u64 {
    let root = temp_root();
    let t = open_cfg(capped_hand_swept_cfg(root.path(), 64 << 20), BS);
    let keys: Vec<_> = (0..n).map(leaf_key).collect();
    assert!(store_sized(&t, &keys, BS).await.is_success());
    gc_stats(&t).bytes
}

/// `n` keys in one leaf directory, stored; ages: key `i` is `(n - i) * 1000` s old (key 0
/// the oldest), except the keys in `young`, stamped now.
pub(crate) async fn stored_aged(tier: &FsTier, n: u64, young: &[usize]) -> Vec<BlockKey> {
    let ks: Vec<BlockKey> = (0..n).map(leaf_key).collect();
    assert!(fs_store(tier, &ks, 0).await.is_success());
    age(tier, &ks, |i| {
        if young.contains(&i) {
            0
        } else {
            (n - i as u64) * 1000
        }
    });
    ks
}

/// Sweep, rescan, stamps, sweep again: the tier's own GC work done, nothing in flight.
pub(crate) fn settle(tier: &FsTier) {
    tier.gc_apply_stamps_now().unwrap();
    tier.gc_sweep_now().unwrap();
    tier.gc_rescan_now().unwrap();
    tier.gc_apply_stamps_now().unwrap();
    tier.gc_sweep_now().unwrap();
}

/// A fresh root and a tier of [`leaf_cap_cfg`] (10 blocks, the ceiling out of the way,
/// sweeps by hand) holding 15 [`stored_aged`] keys, its events taken.
pub(crate) async fn fifteen_aged_quiet() -> (tempfile::TempDir, Arc<FsTier>, Vec<BlockKey>) {
    let root = temp_root();
    let tier = open_cfg(leaf_cap_cfg(root.path(), 10, 1000.0, false), BS);
    let ks = stored_aged(&tier, 15, &[]).await;
    tier.take_events();
    (root, tier, ks)
}

/// Stores `keys` as one job, each linked to the key before it (`chain[0]` to `first_parent`).
pub(crate) async fn store_chain(
    tier: &kv_tier_fs::FsTier,
    keys: &[BlockKey],
    first_parent: Option<BlockKey>,
) {
    let mut links = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let parent = if i == 0 {
            first_parent
        } else {
            Some(keys[i - 1])
        };
        if let Some(parent) = parent {
            links.push((
                *k,
                ChainLink {
                    parent,
                    depth: i as u32 + 1,
                },
            ));
        }
    }
    let job = StoreJob {
        blocks: keys.iter().map(|k| (*k, source_for(k, 0, BS))).collect(),
        requests: Vec::new(),
        links,
    };
    assert!(tier.store(job).await.is_success());
}
