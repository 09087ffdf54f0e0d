//! Adversarial tests of the fs tier's bounded-capacity bookkeeping (the index, `GcStats`) and
//! of its `BlockStored` / `BlockRemoved` events, written from the public API and the
//! documentation only (kv-tier-fs/README.md "Bounded capacity", rustdoc of `FsTier`,
//! `GcStats`, `FsTierConfig`).
//!
//! Every test ends by quiescing the tier and auditing it against the disk:
//!
//! - events (README, "Events"): "`BlockRemoved` for every file a sweep deletes, for files
//!   deleted after a failed load, and for files found gone (by a sweep, a rescan, a stamp or a
//!   load), each once. A key's last event says whether its file is there": for every key, a
//!   last event that is a removal <=> no file; never two removals in a row for a key; a key's
//!   first event is a removal only if its file predates the tier's open; nothing dropped.
//! - accounting (README, "Accounting"): "What the index sums is what `du` of the rank
//!   directory shows": `bytes` equals `du` once quiet, `files` the number of `.bin` files,
//!   `peak_bytes` never above `hard_ceiling_bytes` when nothing else writes to the root,
//!   `external_removals` counts only files deleted behind the tier's back.
//!
//! Interleavings are held with the sweep hook where it can hold them, and driven by real
//! concurrency otherwise. No timing is asserted: waits are bounded guards only.

mod common;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, mpsc};
use std::time::Duration;

use common::{BS, HOOK_DEADLINE, Mount, age, cfg, hook_at, leaf_key, load, ns, store};
use kv_tier_core::{BlockKey, SecondaryTier, TierEvent};
use kv_tier_fs::{Checksum, FsTier, FsTierConfig, GcStats, SweepPoint};
use kv_tier_testkit::{allocated_bytes, temp_root, verify_block};

/// Bounds every wait: a wait that never ends fails its test instead of hanging it.
const LIMIT: Duration = Duration::from_secs(60);
const GIB: f64 = (1u64 << 30) as f64;

// ------------------------------------------------------------------------------ helpers

fn rank_dir(root: &Path) -> PathBuf {
    root.join(ns().rank_dir_name())
}

fn gcs(t: &FsTier) -> GcStats {
    t.stats().gc.expect("a bounded tier has GC stats")
}

/// Regular files (links not followed) below `dir` whose names end with `suffix`.
fn regular_files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() && e.path().to_string_lossy().ends_with(suffix) {
                out.push(e.path());
            }
        }
    }
    out
}

/// Whether a regular file (not a link, not a directory) is at `p`.
fn is_file(p: &Path) -> bool {
    std::fs::symlink_metadata(p)
        .map(|m| m.is_file())
        .unwrap_or(false)
}

/// A bounded tier config whose cap holds `cap_blocks` blocks of the one leaf directory of
/// [`leaf_key`] and whose low watermark holds 80% of them; GC by hand unless `background`.
fn bounded_cfg(root: &Path, cap_blocks: u64, ceiling: f64, background: bool) -> FsTierConfig {
    use std::os::unix::fs::MetadataExt;
    let dirs = 2 * std::fs::metadata(root).unwrap().blocks() * 512;
    let cap = cap_blocks * BS as u64 + dirs;
    let low = 0.8 * (cap_blocks * BS as u64) as f64 + dirs as f64 + 0.5;
    let mut c = cfg(root);
    c.gc_max_size_gb = Some(cap as f64 / GIB);
    c.gc_low_watermark = Some(low / cap as f64);
    c.gc_hard_ceiling = Some(ceiling);
    c.gc_grace_s = Some(300.0);
    c.gc_stamp_interval_s = Some(60.0);
    c.gc_interval_s = Some(if background { 0.05 } else { 3600.0 });
    c.gc_background = background;
    c
}

fn open(c: FsTierConfig) -> Arc<FsTier> {
    Arc::new(FsTier::open("fs", c, ns(), BS).unwrap())
}

/// `n` keys in one leaf directory, stored; ages: key `i` is `(n - i) * 1000` s old (key 0
/// the oldest), except the keys in `young`, stamped now.
async fn stored_aged(tier: &FsTier, n: u64, young: &[usize]) -> Vec<BlockKey> {
    let ks: Vec<BlockKey> = (0..n).map(leaf_key).collect();
    assert!(store(tier, &ks, 0).await.is_success());
    age(tier, &ks, |i| {
        if young.contains(&i) {
            0
        } else {
            (n - i as u64) * 1000
        }
    });
    ks
}

/// Runs `f` on a thread of its own; the receiver gets its result.
fn on_thread<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> mpsc::Receiver<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

fn join<T>(rx: &mpsc::Receiver<T>, what: &str) -> T {
    rx.recv_timeout(LIMIT)
        .unwrap_or_else(|e| panic!("{what} did not end within {LIMIT:?}: {e}"))
}

async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {LIMIT:?}"))
}

/// Sweep, rescan, stamps, sweep again: the tier's own GC work done, nothing in flight.
fn settle(tier: &FsTier) {
    tier.gc_apply_stamps_now().unwrap();
    tier.gc_sweep_now().unwrap();
    tier.gc_rescan_now().unwrap();
    tier.gc_apply_stamps_now().unwrap();
    tier.gc_sweep_now().unwrap();
}

/// The event audit (README, "Events"), against the disk, of a quiet tier whose events since
/// open are `log`: for every key of `keys`, its last event is a removal exactly when no file is
/// there, it is never reported removed twice in a row, and its first event is a removal only
/// if its file predates the tier's open (`predating`); a file with no event at all predates
/// the open too. Nothing was dropped.
fn check_events(
    tier: &FsTier,
    log: &[TierEvent],
    keys: &[BlockKey],
    predating: &HashSet<BlockKey>,
    what: &str,
) {
    assert_eq!(tier.events_dropped(), 0, "{what}: events dropped");
    let mut seqs: HashMap<BlockKey, Vec<bool>> = HashMap::new();
    for e in log {
        for k in &e.keys {
            seqs.entry(*k).or_default().push(e.removed);
        }
    }
    let mut problems = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let on_disk = is_file(&tier.block_path(k));
        let seq = seqs.get(k).cloned().unwrap_or_default();
        match seq.last() {
            Some(&last) if last == on_disk => problems.push(format!(
                "key {i}: last event removed={last} but file on disk={on_disk} (events {seq:?})"
            )),
            None if on_disk && !predating.contains(k) => {
                problems.push(format!("key {i}: a file on disk and no event of it"))
            }
            _ => {}
        }
        if seq.windows(2).any(|w| w[0] && w[1]) {
            problems.push(format!("key {i}: removed twice in a row (events {seq:?})"));
        }
        if seq.first() == Some(&true) && !predating.contains(k) {
            problems.push(format!(
                "key {i}: first event a removal, file not from before the open (events {seq:?})"
            ));
        }
    }
    assert!(problems.is_empty(), "{what}:\n{}", problems.join("\n"));
}

/// The accounting audit (README, "Accounting"; `GcStats`) of a quiet tier: `bytes` is `du`
/// of the rank directory, `files` the number of `.bin` files, the peak within the ceiling.
fn check_stats(tier: &FsTier, root: &Path, what: &str) {
    let s = gcs(tier);
    let du = allocated_bytes(&rank_dir(root));
    let bins = regular_files(&rank_dir(root), ".bin").len() as u64;
    assert_eq!(
        (s.bytes, s.files),
        (du, bins),
        "{what}: (bytes, files) accounted vs (du, .bin files) on disk: {s:?}"
    );
    assert!(
        s.peak_bytes <= s.hard_ceiling_bytes,
        "{what}: peak {} above the hard ceiling {}: {s:?}",
        s.peak_bytes,
        s.hard_ceiling_bytes
    );
}

fn drain(tier: &FsTier, log: &mut Vec<TierEvent>) {
    log.extend(tier.take_events());
}

fn removals_of(log: &[TierEvent], k: &BlockKey) -> usize {
    log.iter()
        .filter(|e| e.removed && e.keys.contains(k))
        .map(|e| e.keys.iter().filter(|x| *x == k).count())
        .sum()
}

/// Loads `keys` and checks every block served is the one stored (salt 0).
async fn load_verified(tier: &FsTier, keys: &[BlockKey], what: &str) -> usize {
    let (_, got) = load(tier, keys).await;
    for (k, b) in &got {
        assert!(verify_block(k, 0, b), "{what}: wrong bytes served for {k}");
    }
    got.len()
}

/// Truncates the file at `p` to `len` bytes.
fn truncate(p: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len)
        .unwrap();
}

// -------------------------------------------------------------------------------- tests

/// "A rescan merges what it finds: files that appeared while it walked stay, and only files
/// verified absent are forgotten (and reported)"; "A key touched after the sweep began is not
/// deleted on its stale mtime"; "skipping ... keys protected by jobs in flight and files used
/// within the grace window"; "`BlockRemoved` ... each once. A key's last event says whether
/// its file is there"; "What the index sums is what `du` of the rank directory shows".
///
/// A sweep is held at each of its points (`Selected`, `BeforeDelete`, `Unlinking`,
/// `UnlinkingKey`) while touches, a rescan and the application of stamps run from other
/// threads; a protected key and a key used within grace must stay, a key touched at
/// `Selected` must stay, and the audit must hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rescans_stamps_and_touches_while_a_sweep_is_held_at_each_point() {
    for which in 0..4 {
        let root = temp_root();
        let tier = open(bounded_cfg(root.path(), 10, 1000.0, false));
        let mut log = Vec::new();
        let ks = stored_aged(&tier, 15, &[4]).await;
        let point = match which {
            0 => SweepPoint::Selected,
            1 => SweepPoint::BeforeDelete(ks[3]),
            2 => SweepPoint::Unlinking,
            _ => SweepPoint::UnlinkingKey(ks[3]),
        };
        let what = format!("held at {point:?}");
        let guard = tier.protect(&ks[..1]);
        let (at_rx, go_tx) = hook_at(&tier, point);
        let sweep = {
            let t = tier.clone();
            on_thread(move || t.gc_sweep_now().unwrap())
        };
        at_rx
            .recv_timeout(HOOK_DEADLINE)
            .unwrap_or_else(|_| panic!("{what}: the sweep never got there"));
        tier.touch(&[ks[1], ks[6]]);
        let rescan = {
            let t = tier.clone();
            on_thread(move || t.gc_rescan_now().unwrap())
        };
        let stamps = {
            let t = tier.clone();
            on_thread(move || t.gc_apply_stamps_now().unwrap())
        };
        // let them run into the held sweep (or finish) before it goes on
        let rescan_done = rescan.recv_timeout(Duration::from_secs(1)).is_ok();
        let stamps_done = stamps.recv_timeout(Duration::from_secs(1)).is_ok();
        go_tx.send(()).unwrap();
        drop(go_tx);
        let deleted = join(&sweep, "the sweep");
        if !rescan_done {
            join(&rescan, "the rescan");
        }
        if !stamps_done {
            join(&stamps, "the stamps");
        }
        tier.set_sweep_hook(None).unwrap();
        assert!(deleted > 0, "{what}: nothing swept");
        assert!(
            is_file(&tier.block_path(&ks[0])),
            "{what}: protected key swept"
        );
        assert!(
            is_file(&tier.block_path(&ks[4])),
            "{what}: key in grace swept"
        );
        if which == 0 {
            assert!(
                is_file(&tier.block_path(&ks[1])),
                "{what}: a key touched after the sweep began was deleted"
            );
        }
        drop(guard);
        settle(&tier);
        drain(&tier, &mut log);
        check_events(&tier, &log, &ks, &HashSet::new(), &what);
        check_stats(&tier, root.path(), &what);
        let s = gcs(&tier);
        assert_eq!(
            (s.external_removals, s.errors),
            (0, 0),
            "{what}: nobody else touched the root: {s:?}"
        );
        tier.shutdown().await.unwrap();
    }
}

/// "a store (which protects its keys first) waits for such a key's unlink before it looks for
/// the file"; "`protect()` waits for an unlink in progress: once `protect()` has returned, no
/// file of its keys is deleted while the guard lives"; "a removal is reported before a store
/// can write the key again, so the store's `BlockStored` comes after it".
///
/// Held at `BeforeDelete`, `Unlinking` and `UnlinkingKey`, loads and stores of every victim
/// (and a protect of one, from a thread) start; once the sweep goes on they all end, the
/// protected key's file stays while guarded, the loads serve only right bytes, and the audit
/// holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_stores_and_protects_of_victims_while_a_sweep_is_held() {
    for which in 0..3 {
        let root = temp_root();
        let tier = open(bounded_cfg(root.path(), 10, 1000.0, false));
        let mut log = Vec::new();
        let ks = stored_aged(&tier, 15, &[]).await;
        let point = match which {
            0 => SweepPoint::BeforeDelete(ks[2]),
            1 => SweepPoint::Unlinking,
            _ => SweepPoint::UnlinkingKey(ks[1]),
        };
        let what = format!("held at {point:?}");
        let (at_rx, go_tx) = hook_at(&tier, point);
        let sweep = {
            let t = tier.clone();
            on_thread(move || t.gc_sweep_now().unwrap())
        };
        at_rx
            .recv_timeout(HOOK_DEADLINE)
            .unwrap_or_else(|_| panic!("{what}: the sweep never got there"));
        let victims: Vec<BlockKey> = ks[..8].to_vec();
        let loads = {
            let (t, v) = (tier.clone(), victims.clone());
            tokio::spawn(async move { load(&*t, &v).await })
        };
        let stores = {
            let (t, v) = (tier.clone(), victims.clone());
            tokio::spawn(async move { store(&*t, &v, 0).await })
        };
        let protector = {
            let t = tier.clone();
            let k = ks[1];
            on_thread(move || t.protect(&[k]))
        };
        // let them meet the held sweep before it goes on
        tokio::time::sleep(Duration::from_millis(300)).await;
        go_tx.send(()).unwrap();
        drop(go_tx);
        join(&sweep, "the sweep");
        let guard = join(&protector, "protect()");
        let (_, got) = bounded("the loads", loads).await.unwrap();
        for (k, b) in &got {
            assert!(verify_block(k, 0, b), "{what}: wrong bytes for {k}");
        }
        let sres = bounded("the stores", stores).await.unwrap();
        assert!(
            sres.failed.is_empty(),
            "{what}: stores failed: {:?}",
            sres.failed
        );
        tier.set_sweep_hook(None).unwrap();
        // the protected key: if its file is there now, no sweep takes it while guarded
        let there = is_file(&tier.block_path(&ks[1]));
        tier.gc_sweep_for_space_now().unwrap();
        if there {
            assert!(
                is_file(&tier.block_path(&ks[1])),
                "{what}: a guarded key's file was swept"
            );
        }
        drop(guard);
        load_verified(&tier, &ks, &what).await;
        settle(&tier);
        drain(&tier, &mut log);
        check_events(&tier, &log, &ks, &HashSet::new(), &what);
        check_stats(&tier, root.path(), &what);
        let s = gcs(&tier);
        assert_eq!(s.external_removals, 0, "{what}: {s:?}");
        tier.shutdown().await.unwrap();
    }
}

/// "files found gone (by a sweep, a rescan, a stamp or a load), each once"; "a directory or
/// link at the path is removed, that key is a miss, and a `BlockRemoved` event says so";
/// "`external_removals`: files found deleted behind the tier's back".
///
/// Held at `Unlinking` (victims decided, not yet unlinked) and at `Selected`, the test
/// damages victims and non-victims behind the tier's back: a file removed, truncated,
/// replaced by an empty directory, replaced by a symlink to another key's file. After the
/// sweep goes on, loads, a rescan and sweeps: the audit holds, the symlinks' targets survive
/// and load, no directory or link is left at a block path, and `external_removals` counts at
/// most the files deleted (removed or replaced) behind the tier's back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_rm_truncation_dirs_and_symlinks_while_a_sweep_is_held() {
    for which in 0..2 {
        let root = temp_root();
        let tier = open(bounded_cfg(root.path(), 10, 1000.0, false));
        let mut log = Vec::new();
        let ks = stored_aged(&tier, 15, &[]).await;
        let point = if which == 0 {
            SweepPoint::Unlinking
        } else {
            SweepPoint::Selected
        };
        let what = format!("held at {point:?}");
        let (at_rx, go_tx) = hook_at(&tier, point);
        let sweep = {
            let t = tier.clone();
            on_thread(move || t.gc_sweep_now().unwrap())
        };
        at_rx
            .recv_timeout(HOOK_DEADLINE)
            .unwrap_or_else(|_| panic!("{what}: the sweep never got there"));
        let p = |i: usize| tier.block_path(&ks[i]);
        // victims (the oldest): 0 rm, 1 truncated, 2 a directory, 3 a symlink to key 13
        std::fs::remove_file(p(0)).unwrap();
        truncate(&p(1), 100);
        std::fs::remove_file(p(2)).unwrap();
        std::fs::create_dir(p(2)).unwrap();
        std::fs::remove_file(p(3)).unwrap();
        std::os::unix::fs::symlink(p(13), p(3)).unwrap();
        // non-victims: 9 rm, 10 truncated, 11 a directory, 12 a symlink to key 14
        std::fs::remove_file(p(9)).unwrap();
        truncate(&p(10), 100);
        std::fs::remove_file(p(11)).unwrap();
        std::fs::create_dir(p(11)).unwrap();
        std::fs::remove_file(p(12)).unwrap();
        std::os::unix::fs::symlink(p(14), p(12)).unwrap();
        go_tx.send(()).unwrap();
        drop(go_tx);
        join(&sweep, "the sweep");
        tier.set_sweep_hook(None).unwrap();
        // a rescan first: loads that find files gone report them but are not counted in
        // `external_removals` (rustdoc: "by rescans, stamps or sweeps")
        tier.gc_rescan_now().unwrap();
        load_verified(&tier, &ks, &what).await;
        settle(&tier);
        load_verified(&tier, &ks, &what).await;
        settle(&tier);
        for i in [13, 14] {
            assert!(
                is_file(&p(i)),
                "{what}: key {i}, a symlink's target, lost its file"
            );
        }
        for (i, k) in ks.iter().enumerate() {
            let m = std::fs::symlink_metadata(tier.block_path(k));
            assert!(
                m.map(|m| m.is_file()).unwrap_or(true),
                "{what}: key {i}: something other than a file left at its path"
            );
        }
        drain(&tier, &mut log);
        check_events(&tier, &log, &ks, &HashSet::new(), &what);
        check_stats(&tier, root.path(), &what);
        let s = gcs(&tier);
        assert!(
            s.external_removals <= 6,
            "{what}: 6 files were deleted behind the tier's back, {} counted: {s:?}",
            s.external_removals
        );
        assert!(
            s.external_removals >= 1,
            "{what}: key 9 was removed behind the tier's back, {} counted: {s:?}",
            s.external_removals
        );
        tier.shutdown().await.unwrap();
    }
}

/// With checksums (`Checksum::Crc32c`) in xattrs (ext4) and in sidecars (ramfs): "Sizes are
/// allocated bytes (`st_blocks`) of the `.bin` files and their sidecars"; "Anything that
/// cannot be served for a reason that will not go away (..., a checksum mismatch, a missing
/// ... checksum ...) is removed, that key is a miss, and a `BlockRemoved` event says so";
/// "each once".
///
/// Held at `Unlinking`, a load finds decided victims damaged (checksum removed or garbled)
/// and removes them itself while the sweep is about to unlink them; non-victims are damaged
/// too. After the sweep goes on: each removed once, the audit holds, `bytes` is `du` with the
/// sidecars, and no file was deleted behind the tier's back (`external_removals` 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checksummed_victims_found_damaged_by_loads_during_a_held_sweep() {
    for sidecars in [false, true] {
        let tmp;
        let mnt;
        let root: PathBuf = if sidecars {
            mnt = Mount::new("ramfs", "");
            mnt.dir.clone()
        } else {
            tmp = temp_root();
            tmp.path().to_path_buf()
        };
        let what = if sidecars {
            "sidecars (ramfs)"
        } else {
            "xattrs"
        };
        let mut c = bounded_cfg(&root, 10, 1000.0, false);
        c.checksum = Checksum::Crc32c;
        if sidecars {
            // ramfs keeps no blocks for directories; a block and its sidecar a page each
            c.gc_max_size_gb = Some((10 * 2 * BS) as f64 / GIB);
            c.gc_low_watermark = Some(0.8);
        }
        let tier = open(c);
        tier.set_sidecar_grace(Duration::ZERO);
        let mut log = Vec::new();
        let ks = stored_aged(&tier, 15, &[]).await;
        let side = |k: &BlockKey| {
            let mut p = tier.block_path(k).into_os_string();
            p.push(kv_tier_fs::CRC_SIDECAR_SUFFIX);
            PathBuf::from(p)
        };
        if sidecars {
            assert!(side(&ks[0]).exists(), "no sidecar: the test does not bite");
        }
        let (at_rx, go_tx) = hook_at(&tier, SweepPoint::Unlinking);
        let sweep = {
            let t = tier.clone();
            on_thread(move || t.gc_sweep_now().unwrap())
        };
        at_rx
            .recv_timeout(HOOK_DEADLINE)
            .unwrap_or_else(|_| panic!("{what}: the sweep never got there"));
        // victims 0, 1 and non-victims 10, 11: checksum gone / garbled
        for i in [0usize, 10] {
            if sidecars {
                std::fs::remove_file(side(&ks[i])).unwrap();
            } else {
                common::set_crc_xattr(&tier.block_path(&ks[i]), b"xy");
            }
        }
        for i in [1usize, 11] {
            if sidecars {
                std::fs::write(side(&ks[i]), b"garbage that is no checksum").unwrap();
            } else {
                common::set_crc_xattr(&tier.block_path(&ks[i]), &[1, 2, 3, 4]);
            }
        }
        let (_, got) = bounded("the load", load(&*tier, &ks)).await;
        for (k, b) in &got {
            assert!(verify_block(k, 0, b), "{what}: wrong bytes for {k}");
        }
        for i in [0usize, 1, 10, 11] {
            assert!(
                !got.iter().any(|(k, _)| *k == ks[i]),
                "{what}: key {i} served without a valid checksum"
            );
        }
        go_tx.send(()).unwrap();
        drop(go_tx);
        join(&sweep, "the sweep");
        tier.set_sweep_hook(None).unwrap();
        settle(&tier);
        drain(&tier, &mut log);
        for i in [0usize, 1, 10, 11] {
            assert_eq!(
                removals_of(&log, &ks[i]),
                1,
                "{what}: key {i} reported removed {} times",
                removals_of(&log, &ks[i])
            );
        }
        check_events(&tier, &log, &ks, &HashSet::new(), what);
        check_stats(&tier, &root, what);
        let s = gcs(&tier);
        assert_eq!(s.external_removals, 0, "{what}: {s:?}");
        if sidecars {
            let bins: HashSet<PathBuf> = regular_files(&rank_dir(&root), ".bin")
                .into_iter()
                .collect();
            for sc in regular_files(&rank_dir(&root), kv_tier_fs::CRC_SIDECAR_SUFFIX) {
                let s = sc.to_string_lossy();
                let bin = PathBuf::from(&s[..s.len() - kv_tier_fs::CRC_SIDECAR_SUFFIX.len()]);
                assert!(
                    bins.contains(&bin),
                    "{what}: a sidecar outlived its block: {}",
                    sc.display()
                );
            }
        }
        tier.shutdown().await.unwrap();
    }
}

/// "a store of a key whose file another process writes at the same time": another instance
/// on the same root (unbounded; bounded, not shared) stores the same keys while this bounded
/// tier stores, loads, sweeps, rescans and stamps them. "A store that reports success leaves
/// a readable block"; "`touch` stamps any key whose file exists, also one another process
/// wrote"; "A key's last event says whether its file is there" (here: a last `BlockStored`
/// means a file, since only this tier, or the bounded other one before this tier's closing
/// rescan, deletes); "`external_removals` counts files found deleted behind the tier's back"
/// (0 when the other instance is unbounded: it deletes nothing); `bytes` is `du` once quiet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_instance_stores_the_same_keys_at_the_same_time() {
    for other_bounded in [false, true] {
        let what = if other_bounded {
            "other instance bounded"
        } else {
            "other instance unbounded"
        };
        let root = temp_root();
        let mut ca = bounded_cfg(root.path(), 16, 1000.0, false);
        ca.checksum = Checksum::Crc32c;
        ca.gc_grace_s = Some(0.002);
        ca.gc_stamp_interval_s = Some(0.001);
        let a = open(ca.clone());
        let mut cb = if other_bounded {
            let mut c = ca.clone();
            c.gc_background = true;
            c
        } else {
            let mut c = cfg(root.path());
            c.checksum = Checksum::Crc32c;
            c
        };
        cb.root_dir = root.path().to_path_buf();
        let b = open(cb);
        let pool: Arc<Vec<BlockKey>> = Arc::new((0..48).map(leaf_key).collect());
        let stop = Arc::new(AtomicBool::new(false));
        let gc_thread = {
            let (a, stop) = (a.clone(), stop.clone());
            on_thread(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    match i % 3 {
                        0 => drop(a.gc_sweep_now().unwrap()),
                        1 => a.gc_rescan_now().unwrap(),
                        _ => a.gc_apply_stamps_now().unwrap(),
                    }
                    i += 1;
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
        };
        let mut tasks = Vec::new();
        for (t, who) in [
            (a.clone(), 0u64),
            (b.clone(), 1),
            (a.clone(), 2),
            (b.clone(), 3),
        ] {
            let pool = pool.clone();
            tasks.push(tokio::spawn(async move {
                let mut served = 0usize;
                for round in 0..40u64 {
                    let from = ((round * 7 + who * 11) % 40) as usize;
                    let keys = &pool[from..from + 8];
                    let r = store(&*t, keys, 0).await;
                    assert!(r.failed.is_empty(), "store failed: {:?}", r.failed);
                    t.touch(keys);
                    let (_, got) = load(&*t, keys).await;
                    for (k, b) in &got {
                        assert!(verify_block(k, 0, b), "wrong bytes for {k}");
                    }
                    served += got.len();
                }
                served
            }));
        }
        for t in tasks {
            bounded("a writer", t).await.unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        join(&gc_thread, "the GC driver");
        bounded("the other's shutdown", b.shutdown()).await.unwrap();
        drop(b);
        settle(&a);
        let mut log = Vec::new();
        drain(&a, &mut log);
        assert_eq!(a.events_dropped(), 0, "{what}");
        for (i, k) in pool.iter().enumerate() {
            let last = log
                .iter()
                .rev()
                .find(|e| e.keys.contains(k))
                .map(|e| e.removed);
            if last == Some(false) {
                assert!(
                    is_file(&a.block_path(k)),
                    "{what}: key {i}: last event stored, no file"
                );
            }
        }
        check_stats(&a, root.path(), what);
        let s = gcs(&a);
        if !other_bounded {
            assert_eq!(
                s.external_removals, 0,
                "{what}: the other instance deletes nothing: {s:?}"
            );
        }
        // every file there loads, verified
        let n = pool.iter().filter(|k| is_file(&a.block_path(k))).count();
        assert_eq!(load_verified(&a, &pool, what).await, n, "{what}");
        a.shutdown().await.unwrap();
    }
}

/// Restart between phases: "one walk at open adopts what is on disk ... with their mtimes";
/// "What the index sums is what `du` of the rank directory shows"; "`external_removals`:
/// files found deleted behind the tier's back" (files deleted while no tier ran are not
/// found gone by anyone: the next open's walk never saw them); a key's first event is a
/// removal only if its file predates the open; "Recency survives restarts".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_between_phases_keeps_index_and_events_consistent() {
    let root = temp_root();
    let c = bounded_cfg(root.path(), 10, 1000.0, false);
    let all: Vec<BlockKey> = (0..40).map(leaf_key).collect();
    // phase 1: 20 aged keys, a sweep, an external rm found by a rescan
    let tier = open(c.clone());
    let paths: Vec<PathBuf> = all.iter().map(|k| tier.block_path(k)).collect();
    let mut log = Vec::new();
    let ks1 = stored_aged(&tier, 10, &[]).await;
    assert!(store(&*tier, &all[10..20], 0).await.is_success());
    age(&tier, &all[10..20], |i| 5000 - i as u64 * 10);
    std::fs::remove_file(tier.block_path(&ks1[9])).unwrap();
    settle(&tier);
    drain(&tier, &mut log);
    check_events(&tier, &log, &all, &HashSet::new(), "phase 1");
    check_stats(&tier, root.path(), "phase 1");
    assert_eq!(gcs(&tier).external_removals, 1, "phase 1: {:?}", gcs(&tier));
    tier.shutdown().await.unwrap();
    drop(tier);
    // while down: one file removed, one truncated
    let survivors: Vec<&PathBuf> = paths.iter().filter(|p| is_file(p)).collect();
    assert!(
        survivors.len() >= 3,
        "phase 1 left {} files",
        survivors.len()
    );
    std::fs::remove_file(survivors[0]).unwrap();
    truncate(survivors[1], 10);
    // phase 2: reopened; what is there predates the open
    for phase in 2..4 {
        let what = format!("phase {phase}");
        let tier = open(c.clone());
        let mut log = Vec::new();
        let predating: HashSet<BlockKey> = all
            .iter()
            .copied()
            .filter(|k| is_file(&tier.block_path(k)))
            .collect();
        check_stats(&tier, root.path(), &format!("{what}, at open"));
        // new keys, stored young; the old ones are older and go first
        let new: Vec<BlockKey> = all[20 + (phase - 2) * 10..30 + (phase - 2) * 10].to_vec();
        assert!(store(&*tier, &new, 0).await.is_success());
        // an external rm of a predating file, found by the rescan
        let victim = predating
            .iter()
            .copied()
            .find(|k| is_file(&tier.block_path(k)) && !new.contains(k))
            .expect("a predating file");
        std::fs::remove_file(tier.block_path(&victim)).unwrap();
        settle(&tier);
        load_verified(&tier, &all, &what).await;
        settle(&tier);
        drain(&tier, &mut log);
        check_events(&tier, &log, &all, &predating, &what);
        check_stats(&tier, root.path(), &what);
        let s = gcs(&tier);
        assert_eq!(
            s.external_removals, 1,
            "{what}: one file was deleted behind this tier's back: {s:?}"
        );
        bounded("shutdown", tier.shutdown()).await.unwrap();
    }
}

/// "`shutdown` stops it promptly, and joins the tier's threads on tokio's blocking pool";
/// "every failure path removes" a named temp file: a shutdown while the GC thread (or a
/// sweep run by hand) is held at a hook point, with stores in flight, ends once the hook is
/// released from another thread, and leaves no `.tmp` file; a reopened tier then accounts
/// exactly what is on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_a_sweep_rescan_or_stamp_step_is_held() {
    for which in 0..5 {
        let root = temp_root();
        let mut c = bounded_cfg(root.path(), 10, 1000.0, which != 4);
        c.tmpfile_publish = false;
        c.gc_rescan_interval_s = Some(if which == 2 { 1.0 } else { 0.0 });
        c.gc_stamp_interval_s = Some(0.001);
        c.gc_grace_s = Some(0.002);
        // the background GC must not sweep before the hook is in
        c.gc_max_size_gb = Some(1.0);
        let tier = open(c.clone());
        let ks: Vec<BlockKey> = (0..15).map(leaf_key).collect();
        assert!(store(&*tier, &ks, 0).await.is_success());
        drop(tier.shutdown().await);
        drop(tier);
        // reopened with the small cap, the background GC held where the test wants it
        let c = {
            let mut s = bounded_cfg(root.path(), 10, 1000.0, which != 4);
            s.tmpfile_publish = false;
            s.gc_rescan_interval_s = c.gc_rescan_interval_s;
            s.gc_stamp_interval_s = c.gc_stamp_interval_s;
            s.gc_grace_s = c.gc_grace_s;
            s
        };
        let point = match which {
            0 => SweepPoint::Selected,
            1 => SweepPoint::Unlinking,
            2 => SweepPoint::RescanWalked,
            3 => SweepPoint::StampsDone,
            _ => SweepPoint::Unlinking,
        };
        let what = format!("case {which}: held at {point:?}");
        // the hook must be in before the GC's first tick: open with background GC, install
        // the hook at once (a sweep that ran before it is allowed: then the store below
        // crosses the cap again)
        let tier = open(c.clone());
        // old enough to be swept (a sweep run at once would find them within grace)
        age(&tier, &ks, |i| 1000 + i as u64);
        let (at_rx, go_tx) = hook_at(&tier, point);
        let extra: Vec<BlockKey> = (100..130).map(leaf_key).collect();
        assert!(store(&*tier, &extra[..10], 0).await.is_success());
        if which == 3 {
            // stamps to apply (touched keys count as recent: only where the held step is
            // the stamps')
            tier.touch(&ks);
        }
        let manual = if which == 4 {
            let t = tier.clone();
            Some(on_thread(move || t.gc_sweep_now().unwrap()))
        } else {
            None
        };
        if at_rx.recv_timeout(HOOK_DEADLINE).is_err() {
            let swept = manual.as_ref().map(|m| m.try_recv());
            panic!(
                "{what}: never got there (manual sweep: {swept:?}): {:?}",
                gcs(&tier)
            );
        }
        // stores in flight during the shutdown
        let inflight = {
            let t = tier.clone();
            let k = extra[10..].to_vec();
            tokio::spawn(async move { store(&*t, &k, 0).await })
        };
        let shutting = Arc::new(AtomicBool::new(false));
        let releaser = {
            let shutting = shutting.clone();
            on_thread(move || {
                while !shutting.load(Ordering::Acquire) {
                    std::thread::sleep(Duration::from_millis(5));
                }
                std::thread::sleep(Duration::from_millis(200));
                let _ = go_tx.send(());
                drop(go_tx);
            })
        };
        shutting.store(true, Ordering::Release);
        let r = bounded(&format!("{what}: shutdown"), tier.shutdown()).await;
        assert!(r.is_ok(), "{what}: shutdown failed: {r:?}");
        join(&releaser, "the releaser");
        if let Some(m) = manual {
            join(&m, "the manual sweep");
        }
        let _ = bounded("the store in flight", inflight).await;
        assert!(!gcs(&tier).thread_alive, "{what}: the GC thread still runs");
        let tmps = regular_files(root.path(), ".tmp");
        assert!(tmps.is_empty(), "{what}: temp files left: {tmps:?}");
        drop(tier);
        let mut c2 = c.clone();
        c2.gc_background = false;
        let again = open(c2);
        check_stats(&again, root.path(), &format!("{what}, reopened"));
        again.shutdown().await.unwrap();
    }
}

/// Real concurrency with the background GC on a small cap and the default ceiling: stores,
/// loads and touches from several tasks over a small key pool, sweeps, rescans and stamps from
/// a thread, external deletes and truncations from another, one key protected throughout.
/// Once quiet: the event and accounting audits hold; "`peak_bytes` never above the hard
/// ceiling" (nothing outside writes); "`external_removals` counts only files deleted behind
/// the tier's back" (at most the files the test deleted); "the sweep never deletes a file
/// protected" (the protected key is never reported removed and keeps its file).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_background_gc_with_external_deletes_and_truncations() {
    let root = temp_root();
    let mut c = bounded_cfg(root.path(), 24, 1.05, true);
    c.gc_grace_s = Some(0.002);
    c.gc_stamp_interval_s = Some(0.001);
    c.gc_rescan_interval_s = Some(1.0);
    let tier = open(c);
    let pool: Arc<Vec<BlockKey>> = Arc::new((0..64).map(leaf_key).collect());
    let keep = pool[0];
    assert!(store(&*tier, &[keep], 0).await.is_success());
    let guard = tier.protect(&[keep]);
    let stop = Arc::new(AtomicBool::new(false));
    let gc_driver = {
        let (t, stop) = (tier.clone(), stop.clone());
        on_thread(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                match i % 4 {
                    0 => drop(t.gc_sweep_now().unwrap()),
                    1 => t.gc_rescan_now().unwrap(),
                    2 => t.gc_apply_stamps_now().unwrap(),
                    _ => drop(t.gc_sweep_for_space_now().unwrap()),
                }
                i += 1;
                std::thread::sleep(Duration::from_millis(3));
            }
        })
    };
    let deleted = Arc::new(AtomicU64::new(0));
    let vandal = {
        let (t, stop, pool, deleted) = (tier.clone(), stop.clone(), pool.clone(), deleted.clone());
        on_thread(move || {
            let mut i = 1u64;
            while !stop.load(Ordering::Relaxed) {
                i = i
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let k = pool[1 + (i >> 33) as usize % (pool.len() - 1)];
                let p = t.block_path(&k);
                if (i >> 20).is_multiple_of(3) {
                    if let Ok(f) = std::fs::OpenOptions::new().write(true).open(&p) {
                        let _ = f.set_len(BS as u64 / 2);
                    }
                } else if std::fs::remove_file(&p).is_ok() {
                    deleted.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(7));
            }
        })
    };
    let mut tasks = Vec::new();
    for w in 0..3u64 {
        let (t, pool) = (tier.clone(), pool.clone());
        tasks.push(tokio::spawn(async move {
            let mut x = w + 1;
            for _ in 0..250 {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let from = 1 + (x >> 33) as usize % (pool.len() - 8);
                let keys = &pool[from..from + 1 + (x >> 20) as usize % 6];
                match (x >> 40) % 3 {
                    0 => {
                        let r = store(&*t, keys, 0).await;
                        assert!(
                            r.failed.is_empty()
                                || r.failed
                                    .iter()
                                    .all(|(_, e)| matches!(e, kv_tier_core::Error::NoSpace { .. })),
                            "store failed: {:?}",
                            r.failed
                        );
                    }
                    1 => {
                        let (_, got) = load(&*t, keys).await;
                        for (k, b) in &got {
                            assert!(verify_block(k, 0, b), "wrong bytes for {k}");
                        }
                    }
                    _ => t.touch(keys),
                }
            }
        }));
    }
    for t in tasks {
        bounded("a worker", t).await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    join(&gc_driver, "the GC driver");
    join(&vandal, "the vandal");
    // quiet: what the vandal truncated is found by loads, what it removed by rescans
    load_verified(&tier, &pool, "soak").await;
    settle(&tier);
    let mut log = Vec::new();
    drain(&tier, &mut log);
    assert!(
        is_file(&tier.block_path(&keep)),
        "the protected key's file is gone"
    );
    assert_eq!(
        removals_of(&log, &keep),
        0,
        "the protected key reported removed"
    );
    check_events(&tier, &log, &pool, &HashSet::new(), "soak");
    check_stats(&tier, root.path(), "soak");
    let s = gcs(&tier);
    let d = deleted.load(Ordering::Relaxed);
    assert!(
        s.external_removals <= d,
        "{} external removals counted, the test deleted {d} files: {s:?}",
        s.external_removals
    );
    assert_eq!(s.errors, 0, "{s:?}");
    drop(guard);
    bounded("shutdown", tier.shutdown()).await.unwrap();
}

// ------------------------------------------------- deterministic races of single keys

async fn fifteen_aged_quiet() -> (tempfile::TempDir, Arc<FsTier>, Vec<BlockKey>) {
    let root = temp_root();
    let tier = open(bounded_cfg(root.path(), 10, 1000.0, false));
    let ks = stored_aged(&tier, 15, &[]).await;
    tier.take_events();
    (root, tier, ks)
}

/// "files found gone (by a sweep, a rescan, a stamp or a load), each once": a victim the
/// sweep decided is deleted behind its back and a load finds it gone while the sweep is held
/// at `Unlinking`; the sweep's unlink then finds it gone too. One removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_victim_found_gone_by_a_load_and_by_the_sweep_is_removed_once() {
    let (_r, tier, ks) = fifteen_aged_quiet().await;
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::Unlinking);
    let sweep = {
        let t = tier.clone();
        on_thread(move || t.gc_sweep_now().unwrap())
    };
    at_rx.recv_timeout(HOOK_DEADLINE).unwrap();
    std::fs::remove_file(tier.block_path(&ks[0])).unwrap();
    let (r, _) = load(&*tier, &ks[..1]).await;
    assert!(!r.is_success());
    go_tx.send(()).unwrap();
    join(&sweep, "sweep");
    settle(&tier);
    let ev = tier.take_events();
    assert_eq!(removals_of(&ev, &ks[0]), 1, "{ev:?}");
}

/// "Anything that cannot be served for a reason that will not go away (a short or long
/// file, ...) is removed, that key is a miss, and a `BlockRemoved` event says so"; "each
/// once"; "never two removals in a row": eight concurrent load jobs of one truncated block
/// (a bounded tier of 15 aged blocks; and an unbounded tier) report its removal once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_loads_of_one_truncated_file_report_it_removed_once() {
    let mut doubled = Vec::new();
    for bounded_tier in [true, false] {
        for round in 0..30 {
            let root = temp_root();
            let tier = if bounded_tier {
                open(bounded_cfg(root.path(), 10, 1000.0, false))
            } else {
                open(cfg(root.path()))
            };
            let ks: Vec<BlockKey> = (0..15).map(leaf_key).collect();
            assert!(store(&*tier, &ks, 0).await.is_success());
            tier.take_events();
            truncate(&tier.block_path(&ks[12]), 100);
            let mut hs = Vec::new();
            for _ in 0..8 {
                let t = tier.clone();
                let k = ks[12];
                hs.push(tokio::spawn(async move { load(&*t, &[k]).await }));
            }
            for h in hs {
                bounded("a load", h).await.unwrap();
            }
            assert!(!is_file(&tier.block_path(&ks[12])));
            let ev = tier.take_events();
            let n = removals_of(&ev, &ks[12]);
            if n != 1 {
                doubled.push(format!(
                    "bounded {bounded_tier} round {round}: {n} removals"
                ));
            }
            if bounded_tier {
                settle(&tier);
                check_stats(&tier, root.path(), "after the loads");
            }
        }
    }
    assert!(
        doubled.is_empty(),
        "one truncated file reported removed more than once:\n{}",
        doubled.join("\n")
    );
}

/// "files found gone (by ... a rescan ... or a load), each once": a file deleted behind the
/// tier's back, found gone by eight concurrent loads and a rescan at once. One removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_loads_and_a_rescan_find_a_removed_file_gone_once() {
    for _ in 0..20 {
        let (_r, tier, ks) = fifteen_aged_quiet().await;
        std::fs::remove_file(tier.block_path(&ks[12])).unwrap();
        let mut hs = Vec::new();
        for _ in 0..8 {
            let t = tier.clone();
            let k = ks[12];
            hs.push(tokio::spawn(async move { load(&*t, &[k]).await }));
        }
        let rs = {
            let t = tier.clone();
            on_thread(move || t.gc_rescan_now().unwrap())
        };
        for h in hs {
            h.await.unwrap();
        }
        join(&rs, "rescan");
        settle(&tier);
        let ev = tier.take_events();
        assert_eq!(removals_of(&ev, &ks[12]), 1, "{ev:?}");
    }
}

/// "files found gone (by ... a stamp or a load), each once": the stamp of a touched key
/// finds its file gone; held at `StampsDone` (applied on disk, not yet to the index), a load
/// finds it gone too. One removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_found_gone_by_a_stamp_and_a_load_is_removed_once() {
    let (_r, tier, ks) = fifteen_aged_quiet().await;
    tier.touch(&ks[12..13]);
    std::fs::remove_file(tier.block_path(&ks[12])).unwrap();
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::StampsDone);
    let st = {
        let t = tier.clone();
        on_thread(move || t.gc_apply_stamps_now().unwrap())
    };
    at_rx.recv_timeout(HOOK_DEADLINE).unwrap();
    let (r, _) = load(&*tier, &ks[12..13]).await;
    assert!(!r.is_success());
    go_tx.send(()).unwrap();
    join(&st, "stamps");
    tier.set_sweep_hook(None).unwrap();
    settle(&tier);
    let ev = tier.take_events();
    assert_eq!(removals_of(&ev, &ks[12]), 1, "{ev:?}");
}

/// "a removal is reported before a store can write the key again, so the store's
/// `BlockStored` comes after it": the stamp of a touched key finds its file gone; held at
/// `StampsDone`, a store writes the key again. Its last event is the store, and nothing later
/// finds it gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_while_a_stamp_found_the_file_gone_ends_stored() {
    let (_r, tier, ks) = fifteen_aged_quiet().await;
    tier.touch(&ks[12..13]);
    std::fs::remove_file(tier.block_path(&ks[12])).unwrap();
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::StampsDone);
    let st = {
        let t = tier.clone();
        on_thread(move || t.gc_apply_stamps_now().unwrap())
    };
    at_rx.recv_timeout(HOOK_DEADLINE).unwrap();
    assert!(
        bounded("store", store(&*tier, &ks[12..13], 0))
            .await
            .is_success()
    );
    go_tx.send(()).unwrap();
    join(&st, "stamps");
    tier.set_sweep_hook(None).unwrap();
    let ev = tier.take_events();
    let seq: Vec<bool> = ev
        .iter()
        .filter(|e| e.keys.contains(&ks[12]))
        .map(|e| e.removed)
        .collect();
    assert!(is_file(&tier.block_path(&ks[12])));
    assert_eq!(seq.last(), Some(&false), "{seq:?}");
    settle(&tier);
    let ev = tier.take_events();
    assert_eq!(removals_of(&ev, &ks[12]), 0, "{ev:?}");
}

/// "A rescan merges what it finds: files that appeared while it walked stay, and only files
/// verified absent are forgotten (and reported)": a file deleted behind the tier's back is
/// missed by the rescan's walk; held at `RescanWalked`, a store writes it again. Its last
/// event is the store, and `bytes` is `du`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_while_a_rescan_walked_past_a_deleted_file_ends_stored() {
    let (_r, tier, ks) = fifteen_aged_quiet().await;
    std::fs::remove_file(tier.block_path(&ks[12])).unwrap();
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::RescanWalked);
    let st = {
        let t = tier.clone();
        on_thread(move || t.gc_rescan_now().unwrap())
    };
    at_rx.recv_timeout(HOOK_DEADLINE).unwrap();
    assert!(
        bounded("store", store(&*tier, &ks[12..13], 0))
            .await
            .is_success()
    );
    let (r, _) = load(&*tier, &ks[12..13]).await;
    assert!(r.is_success());
    go_tx.send(()).unwrap();
    join(&st, "rescan");
    tier.set_sweep_hook(None).unwrap();
    let ev = tier.take_events();
    let seq: Vec<bool> = ev
        .iter()
        .filter(|e| e.keys.contains(&ks[12]))
        .map(|e| e.removed)
        .collect();
    assert!(is_file(&tier.block_path(&ks[12])));
    assert_eq!(seq.last(), Some(&false), "{seq:?}");
    settle(&tier);
    check_stats(&tier, _r.path(), "h");
}
