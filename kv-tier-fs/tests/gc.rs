//! Bounded capacity: mtime-LRU sweeps, stamps, grace, protection, restarts, rescans, and the
//! races of the reference design, driven deterministically through the sweep hook.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, SystemTime};

use common::{
    BS, HOOK_DEADLINE, age, cfg, hand_swept_cfg, held, leaf_key, load, ns, store, sweep_held_at,
};
use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_fs::{FsTier, SweepPoint};
use kv_tier_testkit::{find_files, temp_root, test_key};

fn bounded(root: &Path, cap_blocks: u64, watermark: f64) -> FsTier {
    FsTier::open("fs", hand_swept_cfg(root, cap_blocks, watermark), ns(), BS).unwrap()
}

fn keys(range: std::ops::Range<u64>) -> Vec<BlockKey> {
    range.map(leaf_key).collect()
}

fn present(tier: &FsTier, keys: &[BlockKey]) -> Vec<bool> {
    keys.iter().map(|k| tier.block_path(k).exists()).collect()
}

fn gc(tier: &FsTier) -> kv_tier_fs::GcStats {
    tier.stats().gc.unwrap()
}

/// Stores `ks` in a tier whose cap holds 10 test blocks with the hard ceiling out of the way
/// (a job's first stores into a new leaf each reserve its directories), then reopens it with
/// the ceiling at `ceiling` x the cap.
async fn with_ceiling(root: &Path, ks: &[BlockKey], ceiling: f64) -> FsTier {
    assert!(store(&bounded(root, 10, 0.8), ks, 0).await.is_success());
    let mut c = hand_swept_cfg(root, 10, 0.8);
    c.gc_hard_ceiling = Some(ceiling);
    FsTier::open("fs", c, ns(), BS).unwrap()
}

/// 15 blocks of ascending age: key 0 is the oldest.
async fn fifteen_aged(tier: &FsTier) -> Vec<BlockKey> {
    let ks = keys(0..15);
    assert!(store(tier, &ks, 0).await.is_success());
    age(tier, &ks, |i| (15 - i as u64) * 1000);
    ks
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_cap_nothing_is_deleted() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = keys(0..10);
    assert!(store(&tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 10_000 - i as u64);
    assert_eq!(tier.gc_sweep_now().unwrap(), 0);
    assert!(present(&tier, &ks).iter().all(|&p| p));
    assert_eq!(gc(&tier).bytes, held(root.path(), 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_cap_exactly_the_seven_oldest_go() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = fifteen_aged(&tier).await;
    tier.take_events();
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    let p = present(&tier, &ks);
    assert_eq!(p, (0..15).map(|i| i >= 7).collect::<Vec<_>>());
    let s = gc(&tier);
    assert_eq!(
        (s.files, s.bytes, s.swept_files, s.swept_bytes),
        (8, held(root.path(), 8), 7, 7 * BS as u64)
    );
    assert!(s.peak_bytes >= held(root.path(), 15), "{s:?}");
    let ev = tier.take_events();
    let removed: Vec<BlockKey> = ev
        .iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys.clone())
        .collect();
    let mut want = ks[..7].to_vec();
    let mut got = removed.clone();
    want.sort();
    got.sort();
    assert_eq!(got, want, "BlockRemoved names exactly the swept blocks");
    assert!(ev.iter().all(|e| e.medium == kv_tier_core::Medium::Storage));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everything_within_the_grace_window_stays() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = keys(0..15);
    assert!(store(&tier, &ks, 0).await.is_success()); // fresh mtimes
    assert_eq!(tier.gc_sweep_now().unwrap(), 0);
    assert!(present(&tier, &ks).iter().all(|&p| p));
    let s = gc(&tier);
    assert_eq!(s.skipped_in_grace, 15);
    assert!(s.bytes > s.cap_bytes, "knowingly left over the cap");
    assert_eq!(s.sweeps_over_cap, 1);
    // once the grace window has passed they are fair game
    tier.advance_gc_clock(Duration::from_secs(301)).unwrap();
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    assert_eq!(
        gc(&tier).sweeps_over_cap,
        1,
        "a sweep that ended within the cap"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_blocks_stay_and_go_first_once_released() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = fifteen_aged(&tier).await;
    let guard = tier.protect(&ks[..3]);
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| !(3..10).contains(&i)).collect::<Vec<_>>()
    );
    assert_eq!(gc(&tier).skipped_in_flight, 3);
    drop(guard);
    let fresh = keys(100..105);
    assert!(store(&tier, &fresh, 0).await.is_success());
    assert_eq!(gc(&tier).files, 13);
    assert_eq!(tier.gc_sweep_now().unwrap(), 5);
    // the three old ones went first, then the two oldest of the rest
    assert_eq!(present(&tier, &ks[..3]), vec![false; 3]);
    assert_eq!(
        present(&tier, &ks[10..15]),
        vec![false, false, true, true, true]
    );
    assert!(present(&tier, &fresh).iter().all(|&p| p));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protect_twice_release_once_still_protects() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = fifteen_aged(&tier).await;
    let g1 = tier.protect(&ks[..1]);
    let g2 = tier.protect(&ks[..1]);
    drop(g1);
    tier.gc_sweep_now().unwrap();
    assert!(tier.block_path(&ks[0]).exists());
    drop(g2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touch_stamps_the_mtime_off_thread_and_is_rate_limited() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let k = leaf_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    age(&tier, &[k], |_| 5000);
    let mtime = |t: &FsTier| {
        std::fs::metadata(t.block_path(&k))
            .unwrap()
            .modified()
            .unwrap()
    };
    let old = mtime(&tier);
    tier.touch(&[k]);
    assert_eq!(mtime(&tier), old, "touch did I/O on the caller's thread");
    assert_eq!(gc(&tier).pending_stamps, 1);
    tier.gc_apply_stamps_now().unwrap();
    let stamped = mtime(&tier);
    assert!(
        SystemTime::now()
            .duration_since(stamped)
            .unwrap_or_default()
            < Duration::from_secs(60)
    );
    assert_eq!(gc(&tier).stamps, 1);
    // within the stamp interval: no second stamp
    tier.touch(&[k]);
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc(&tier).stamps, 1);
    // after it: stamped again
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc(&tier).stamps, 2);
    assert!(mtime(&tier) > stamped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touching_missing_keys_is_harmless_and_tracking_is_bounded() {
    let root = temp_root();
    let mut c = hand_swept_cfg(root.path(), 10, 0.8);
    c.gc_max_tracked = Some(2);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    // keys of no file: queued like keys of other processes (bounded), then found absent
    tier.touch(&keys(500..600));
    assert_eq!(gc(&tier).stamps_dropped, 98);
    tier.gc_apply_stamps_now().unwrap();
    let s = gc(&tier);
    assert_eq!(
        (s.stamps, s.stamp_errors, s.pending_stamps, s.files),
        (0, 0, 0, 0)
    );
    let ks = keys(0..5);
    assert!(store(&tier, &ks, 0).await.is_success());
    age(&tier, &ks, |_| 5000);
    tier.touch(&ks);
    let s = gc(&tier);
    assert_eq!((s.pending_stamps, s.stamps_dropped), (2, 98 + 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_bin_files_are_swept() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = fifteen_aged(&tier).await;
    let leaf = tier.block_path(&ks[0]).parent().unwrap().to_path_buf();
    let tmp = leaf.join("zzz.bin_0011223344556677.tmp"); // a live writer's
    let stale = leaf.join("yyy.bin_0011223344556677.tmp"); // a killed writer's
    let other = leaf.join("notes.txt");
    for p in [&tmp, &stale, &other] {
        std::fs::write(p, b"partial").unwrap();
    }
    let config = ns().config_path(root.path());
    for p in [&stale, &other, &config] {
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs(99_999))
            .unwrap();
    }
    tier.gc_rescan_now().unwrap();
    assert!(
        !stale.exists(),
        "the rescan reaps temp files older than tmp_reap_age_s"
    );
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    assert!(tmp.exists() && other.exists() && config.exists());
}

/// The reference's race: a key protected by a store in flight is decided under the same lock
/// as its unlink. Held at `Selected`, the sweep then meets the protection and keeps the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_in_flight_during_a_sweep_keeps_its_file() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Selected); // the sweep chose its victims: keys 0..7
    // A store job for key 0 starts: it protects the key, finds the file and keeps it.
    let guard = tier.protect(&ks[..1]);
    go_tx.send(()).unwrap();
    let deleted = sweep.join().unwrap();
    assert!(
        tier.block_path(&ks[0]).exists(),
        "the sweep deleted a key a store had protected"
    );
    assert_eq!(deleted, 7, "it went on to the next oldest instead");
    assert!(!tier.block_path(&ks[7]).exists());
    drop(guard);
}

/// A key touched after the sweep chose its victims is not deleted on its stale mtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_touch_after_the_sweep_began_keeps_the_key() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let victim = ks[2];
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::BeforeDelete(victim)); // keys 0 and 1 are gone; key 2 is next
    tier.touch(&[victim]);
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 7);
    assert!(
        tier.block_path(&victim).exists(),
        "deleted on a stale mtime"
    );
    assert_eq!(gc(&tier).skipped_recent, 1);
    assert_eq!(present(&tier, &ks[..2]), vec![false, false]);
}

/// The other order: the sweep deletes first, then a store finds no file and writes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_after_the_delete_rewrites_the_file() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = fifteen_aged(&tier).await;
    tier.gc_sweep_now().unwrap();
    assert!(!tier.block_path(&ks[0]).exists());
    assert!(store(&tier, &ks[..1], 0).await.is_success());
    assert!(load(&tier, &ks[..1]).await.0.is_success());
    assert_eq!(gc(&tier).files, 9);
}

/// Real concurrency: writers store and re-store keys while sweeps run; every key whose store
/// returned success keeps its file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_stores_and_sweeps_never_lose_a_stored_block() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 40, 0.5));
    let old = keys(0..60);
    assert!(store(&*tier, &old, 0).await.is_success());
    age(&tier, &old, |i| 10_000 + i as u64);
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let t = tier.clone();
    let s2 = stop.clone();
    let sweeper = std::thread::spawn(move || {
        let mut n = 0;
        loop {
            // at least one sweep, however late this thread starts
            n += t.gc_sweep_now().unwrap();
            t.gc_apply_stamps_now().unwrap();
            if s2.load(std::sync::atomic::Ordering::Relaxed) {
                return n;
            }
        }
    });
    let mut stored = Vec::new();
    for round in 0..20u64 {
        // re-store a few old keys (they may be mid-sweep) and add new ones
        let mut batch: Vec<BlockKey> = old
            .iter()
            .skip((round * 3) as usize % 60)
            .take(3)
            .copied()
            .collect();
        batch.extend(keys(1000 + round * 4..1000 + round * 4 + 4));
        let res = store(&*tier, &batch, 0).await;
        assert!(res.is_success());
        stored.extend(res.ok);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let swept = sweeper.join().unwrap();
    assert!(swept > 0, "no sweep deleted anything");
    let lost: Vec<_> = stored
        .iter()
        .filter(|k| !tier.block_path(k).exists())
        .collect();
    assert!(lost.is_empty(), "stored blocks lost to a sweep: {lost:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_recovers_size_and_recency_from_disk() {
    let root = temp_root();
    let ks = {
        let tier = bounded(root.path(), 10, 0.8);
        fifteen_aged(&tier).await
    };
    // a file written by another process (vLLM) is adopted too, with its mtime
    let foreign = leaf_key(77);
    let p = ns().block_path(root.path(), &foreign);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, vec![0u8; BS]).unwrap();
    let f = std::fs::File::options().write(true).open(&p).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(99_999))
        .unwrap();
    drop(f);
    let tier = bounded(root.path(), 10, 0.8);
    let s = gc(&tier);
    assert_eq!((s.files, s.bytes), (16, held(root.path(), 16)));
    assert_eq!(tier.gc_sweep_now().unwrap(), 8);
    assert!(!p.exists(), "the oldest (foreign) file goes first");
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| i >= 7).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_rm_is_absorbed_by_the_rescan() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = keys(0..5);
    assert!(store(&tier, &ks, 0).await.is_success());
    tier.take_events();
    std::fs::remove_file(tier.block_path(&ks[1])).unwrap();
    std::fs::remove_file(tier.block_path(&ks[3])).unwrap();
    assert_eq!(
        gc(&tier).files,
        5,
        "the index does not walk the tree by itself"
    );
    tier.gc_rescan_now().unwrap();
    let s = gc(&tier);
    assert_eq!((s.files, s.bytes, s.rescans), (3, held(root.path(), 3), 1));
    let removed: Vec<BlockKey> = kv_tier_testkit::removed_keys(tier.take_events());
    assert_eq!(removed.len(), 2);
    assert!(removed.contains(&ks[1]) && removed.contains(&ks[3]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_emits_block_removed_and_leaves_the_index() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let k = leaf_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    tier.take_events();
    std::fs::File::options()
        .write(true)
        .open(tier.block_path(&k))
        .unwrap()
        .set_len(10)
        .unwrap();
    let (res, _) = load(&tier, &[k]).await;
    assert_eq!(res.failed.len(), 1);
    let ev = tier.take_events();
    assert!(ev.iter().any(|e| e.removed && e.keys == vec![k]));
    assert_eq!(gc(&tier).files, 0);
}

fn wait_for(what: &str, cond: impl Fn() -> bool) {
    // A condition wait, not a timing assertion: generous bound, polled.
    for _ in 0..2000 {
        if cond() {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gc_thread_survives_a_panic_and_stops_promptly() {
    let root = temp_root();
    let mut c = hand_swept_cfg(root.path(), 10, 0.8);
    c.gc_background = true;
    c.gc_interval_s = Some(0.02);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    tier.set_sweep_hook(Some(Arc::new(|p| {
        if p == SweepPoint::Selected {
            panic!("injected GC panic");
        }
    })))
    .unwrap();
    let ks = fifteen_aged(&tier).await;
    wait_for("a GC panic", || gc(&tier).errors >= 1);
    assert!(gc(&tier).thread_alive, "the GC thread died quietly");
    tier.set_sweep_hook(None).unwrap();
    wait_for("the sweep to finish", || gc(&tier).sweeps >= 1);
    assert_eq!(gc(&tier).files, 8);
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| i >= 7).collect::<Vec<_>>(),
        "{:?}",
        gc(&tier)
    );
    tier.shutdown().await.unwrap();
    assert!(!gc(&tier).thread_alive);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_crosses_the_cap_wakes_the_gc() {
    let root = temp_root();
    let mut c = hand_swept_cfg(root.path(), 10, 0.8);
    c.gc_background = true; // interval stays at an hour
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks = keys(0..10);
    assert!(store(&tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 5000 - i as u64);
    assert!(store(&tier, &keys(50..55), 0).await.is_success());
    // 15 blocks were stored against a cap of 10: sweeps woken by the stores keep it within
    wait_for("the woken sweep", || {
        // (sizes drop when a sweep decides; the counters move when its unlinks are done)
        let s = gc(&tier);
        s.bytes <= s.cap_bytes && s.swept_files >= 5
    });
    assert!(gc(&tier).sweeps >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_tier_has_no_gc() {
    let root = temp_root();
    let tier = common::open(root.path());
    assert!(tier.stats().gc.is_none());
    tier.touch(&keys(0..3));
    assert!(tier.gc_sweep_now().is_err());
    assert!(find_files(root.path(), ".bin").is_empty());
}

/// A store that protects a key the sweep has already decided to delete (its unlink pending)
/// keeps it: protection is checked again right before each unlink. The store waits for the
/// sweep's decision to settle, then finds the file and reports it stored; the file stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_during_the_unlink_keeps_the_file() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking); // keys 0..7 are decided, their files still on disk
    assert!(tier.block_path(&ks[0]).exists());
    let t = tier.clone();
    let k0 = ks[0];
    let mut put = tokio::spawn(async move { store(&*t, &[k0], 5).await });
    // the store must not finish while the unlink is pending (it would report a file that
    // may be about to vanish)
    let early = tokio::time::timeout(Duration::from_millis(200), &mut put).await;
    assert!(
        early.is_err(),
        "the store did not wait for the pending unlink"
    );
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 6, "the protected key was unlinked");
    assert!(put.await.unwrap().is_success());
    assert!(
        tier.block_path(&ks[0]).exists(),
        "a stored block was lost to the sweep"
    );
    let (res, data) = load(&*tier, &ks[..1]).await;
    assert!(res.is_success() && kv_tier_testkit::verify_block(&ks[0], 0, &data[0].1));
    assert!(present(&tier, &ks[1..7]).iter().all(|p| !p));
}

/// Issue: `protect()` after a sweep has chosen its victims did not save them. Held after its
/// batch is decided, the sweep meets 8 keys protected since: none is deleted while the guard
/// lives, and the index still counts them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_protected_after_the_decision_are_not_deleted_while_protected() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.3));
    let ks = fifteen_aged(&tier).await; // down to 3 of 10: keys 0..12 are decided
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking);
    let guard = tier.protect(&ks[..8]);
    go_tx.send(()).unwrap();
    assert_eq!(
        sweep.join().unwrap(),
        4,
        "only the unprotected decided keys go"
    );
    assert!(
        present(&tier, &ks[..8]).iter().all(|&p| p),
        "a key protected after the decision was deleted while protected"
    );
    assert!(present(&tier, &ks[8..12]).iter().all(|&p| !p));
    assert_eq!(gc(&tier).files, 11);
    assert_eq!(gc(&tier).bytes, held(root.path(), 11));
    tier.set_sweep_hook(None).unwrap();
    drop(guard);
    assert_eq!(tier.gc_sweep_now().unwrap(), 8);
}

/// The index follows the disk for any key, not only the first one indexed: a file gone or
/// damaged behind the tier's back leaves the index when a load finds it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_or_damaged_file_leaves_the_index_whichever_it_is() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = keys(0..5);
    assert!(store(&tier, &ks, 0).await.is_success());
    std::fs::remove_file(tier.block_path(&ks[3])).unwrap();
    let (res, _) = load(&tier, &ks[3..4]).await;
    assert_eq!(res.failed.len(), 1);
    assert_eq!(gc(&tier).files, 4, "a vanished file stayed in the index");
    std::fs::File::options()
        .write(true)
        .open(tier.block_path(&ks[4]))
        .unwrap()
        .set_len(10)
        .unwrap();
    let (res, _) = load(&tier, &ks[4..5]).await;
    assert_eq!(res.failed.len(), 1);
    let s = gc(&tier);
    assert_eq!(
        (s.files, s.bytes),
        (3, held(root.path(), 3)),
        "a damaged file stayed in the index"
    );
}

/// A rescan takes what the disk says for a file that changed size while keeping its mtime
/// (rewritten by another process that restored the time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_takes_a_new_size_under_an_old_mtime() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let k = leaf_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    tier.gc_rescan_now().unwrap(); // the index holds the file's own mtime and size now
    assert_eq!(gc(&tier).bytes, held(root.path(), 1));
    let path = tier.block_path(&k);
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let f = std::fs::File::options().write(true).open(&path).unwrap();
    std::io::Write::write_all(&mut &f, &vec![7u8; 4 * BS]).unwrap();
    f.sync_all().unwrap();
    f.set_modified(mtime).unwrap();
    tier.gc_rescan_now().unwrap();
    assert_eq!(gc(&tier).bytes, held(root.path(), 4));
}

/// Blocks another process wrote, found by this tier's loads, count toward the cap at once: a
/// load that takes the total past the cap wakes the sweep (whose own interval is an hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_blocks_seen_past_the_cap_wake_the_sweep() {
    let root = temp_root();
    let mut c = hand_swept_cfg(root.path(), 10, 0.8);
    c.gc_background = true;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks = keys(0..10);
    assert!(store(&tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 5000 - i as u64);
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let foreign = keys(50..55);
    assert!(store(&other, &foreign, 0).await.is_success());
    let (res, _) = load(&tier, &foreign).await;
    assert!(res.is_success());
    wait_for("the woken sweep", || {
        let s = gc(&tier);
        s.bytes <= s.cap_bytes && s.swept_files >= 5
    });
}

/// Where checksums live in sidecars (no user xattrs: ramfs), each block counts with its
/// sidecar, and a sweep takes the sidecar with its block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_count_toward_the_cap_and_go_with_their_blocks() {
    let m = common::Mount::new("ramfs", "");
    let mut c = hand_swept_cfg(&m.dir, 10, 0.8);
    c.checksum = kv_tier_fs::Checksum::Crc32c;
    // ramfs keeps no blocks for directories; a block and its sidecar take a page each
    let per_block = 2 * BS as u64;
    c.gc_max_size_gb = Some((10 * per_block) as f64 / (1u64 << 30) as f64);
    c.gc_low_watermark = Some(0.8);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks = keys(0..15);
    assert!(store(&tier, &ks, 0).await.is_success());
    assert_eq!(gc(&tier).bytes, 15 * per_block);
    age(&tier, &ks, |i| (15 - i as u64) * 1000);
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    let s = gc(&tier);
    assert_eq!((s.files, s.bytes), (8, 8 * per_block));
    assert_eq!(find_files(&m.dir, ".bin").len(), 8);
    assert_eq!(
        find_files(&m.dir, kv_tier_fs::CRC_SIDECAR_SUFFIX).len(),
        8,
        "a swept block's sidecar stayed"
    );
}

/// Past halfway from the cap to the hard ceiling, a sweep no longer spares the grace window
/// above the cap: it takes the oldest files, young or not, down to the cap. At exactly
/// halfway it still spares them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_halfway_to_the_hard_ceiling_grace_holds_only_down_to_the_cap() {
    let root = temp_root();
    // 16 blocks (one leaf and one top directory: 2 directories) are exactly halfway; they are
    // stored first with the ceiling out of the way (a job's first stores into a new leaf
    // each reserve its directories)
    let ks = keys(0..16);
    // halfway: 15 blocks' bytes and 1.5 times the directories
    let tier = with_ceiling(root.path(), &ks, 2.0).await;
    let s = gc(&tier);
    assert_eq!(2 * s.bytes, s.cap_bytes + s.hard_ceiling_bytes, "{s:?}");
    assert_eq!(
        tier.gc_sweep_now().unwrap(),
        0,
        "young files went at halfway"
    );
    assert!(store(&tier, &keys(16..17), 0).await.is_success());
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    let s = gc(&tier);
    assert_eq!((s.files, s.bytes), (10, held(root.path(), 10)));
    assert!(s.grace_overridden > 0, "{s:?}");
}

/// At the hard ceiling, a store into a new leaf and top directory makes room for the file and
/// both directories it creates in one sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_at_the_ceiling_makes_room_for_its_new_directories_too() {
    let root = temp_root();
    let ks = keys(0..12); // one leaf: 12 files and 2 directories fit under the ceiling
    let tier = with_ceiling(root.path(), &ks, 1.2).await;
    age(&tier, &ks, |i| 5000 - i as u64);
    let sweeps = gc(&tier).sweeps;
    // a key in another top directory: its file and two new directories
    let far = test_key(7);
    assert_ne!(
        tier.block_path(&far).parent().unwrap().parent(),
        tier.block_path(&ks[0]).parent().unwrap().parent()
    );
    let res = store(&tier, &[far], 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let s = gc(&tier);
    assert_eq!(s.sweeps, sweeps + 1, "{s:?}");
    assert!(s.bytes <= s.hard_ceiling_bytes, "{s:?}");
    assert!(tier.block_path(&far).exists());
    // room for one file and its two new directories (a directory takes a block here): three
    // old files went, not more
    assert_eq!(s.files, 12 - 3 + 1, "{s:?}");
}

/// Files someone else deleted between the sweep's decision and its unlinks are gone, as the
/// sweep wanted: not errors, and not put back into the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn victims_deleted_by_someone_else_before_the_unlink_count_as_gone() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking);
    for k in &ks[..7] {
        std::fs::remove_file(tier.block_path(k)).unwrap();
    }
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 7);
    tier.set_sweep_hook(None).unwrap();
    let s = gc(&tier);
    assert_eq!((s.files, s.errors), (8, 0), "{s:?}");
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| i >= 7).collect::<Vec<_>>()
    );
}

/// A key of another process (not in this tier's index) is stamped at most once per stamp
/// interval, however often it is touched: the memory of foreign stamps rate-limits them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_touched_twice_in_an_interval_is_stamped_once() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8); // stamp interval: a minute
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let k = leaf_key(1);
    assert!(store(&other, &[k], 0).await.is_success());
    tier.touch(&[k]);
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    let s = gc(&tier);
    assert_eq!((s.stamps, s.stamp_errors), (1, 0), "{s:?}");
    assert_eq!(s.files, 1, "the stamped foreign key joins the index");
}

/// A key of another process, touched again after a stamp interval, is stamped again: the
/// memory of foreign stamps limits their rate, it does not refuse a key for good. (The key
/// stays foreign while its file is missing: a stamp that finds no file learns nothing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_touched_again_after_an_interval_is_stamped_again() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8); // stamp interval: a minute
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let j = leaf_key(1);
    tier.touch(&[j]); // no file yet: the stamp finds nothing
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc(&tier).stamps, 0);
    assert!(store(&other, &[j], 0).await.is_success());
    tier.touch(&[j]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc(&tier).stamps, 0, "stamped twice within an interval");
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[j]);
    tier.gc_apply_stamps_now().unwrap();
    let s = gc(&tier);
    assert_eq!((s.stamps, s.files), (1, 1), "{s:?}");
}

/// A sweep that panicked (here a hook; in life a bug) leaves no sweep "running": a store at
/// the hard ceiling still sweeps for room itself, instead of waiting for a sweep that will
/// never end and failing with `NoSpace`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicked_sweep_does_not_stop_stores_from_making_room() {
    let root = temp_root();
    let ks = keys(0..12);
    let tier = Arc::new(with_ceiling(root.path(), &ks, 1.2).await);
    age(&tier, &ks, |i| 5000 - i as u64);
    tier.set_sweep_hook(Some(Arc::new(|p| {
        if p == SweepPoint::Selected {
            panic!("injected sweep panic");
        }
    })))
    .unwrap();
    let t = tier.clone();
    let panicked = std::thread::spawn(move || t.gc_sweep_now()).join();
    assert!(panicked.is_err(), "the hook did not panic the sweep");
    tier.set_sweep_hook(None).unwrap();
    let far = test_key(7);
    let res = store(&*tier, &[far], 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let s = gc(&tier);
    assert!(s.bytes <= s.hard_ceiling_bytes, "{s:?}");
    assert!(tier.block_path(&far).exists());
}

/// Protects `key` on a thread of its own: the receiver gets, once `protect()` has returned,
/// whether the key's file existed then; the thread returns the guard.
fn protect_on_thread(
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

/// `protect()` of a key whose unlink is under way returns only once the unlink has ended:
/// after it returns, the file is gone (it was decided before the protection) and no unlink
/// of the key can start while the guard lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protect_waits_out_an_unlink_under_way() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let k = ks[0]; // the oldest: swept first
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::UnlinkingKey(k));
    let (protector, rx) = protect_on_thread(&tier, k);
    // give the protector time to reach protect() (were it not to wait, it would answer now,
    // with the file still there)
    if let Ok(exists) = rx.recv_timeout(Duration::from_millis(200)) {
        panic!("protect() returned while the unlink was held (file exists: {exists})");
    }
    go_tx.send(()).unwrap();
    let exists = rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("protect() never returned");
    assert!(!exists, "protect() returned before the unlink ended");
    let guard = protector.join().unwrap();
    assert_eq!(sweep.join().unwrap(), 7);
    tier.set_sweep_hook(None).unwrap();
    drop(guard);
}

/// Where checksums live in sidecars, a block the index learns from a load (another process
/// wrote it) counts with its sidecar, as one the tier stored itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learned_block_counts_with_its_sidecar() {
    let m = common::Mount::new("ramfs", "");
    let mut c = hand_swept_cfg(&m.dir, 10, 0.8);
    c.checksum = kv_tier_fs::Checksum::Crc32c;
    let per_block = 2 * BS as u64; // ramfs: a page for the block, one for its sidecar
    c.gc_max_size_gb = Some((10 * per_block) as f64 / (1u64 << 30) as f64);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let mut oc = cfg(&m.dir);
    oc.checksum = kv_tier_fs::Checksum::Crc32c;
    let other = FsTier::open("fs", oc, ns(), BS).unwrap();
    let (mine, theirs) = (leaf_key(1), leaf_key(2));
    assert!(store(&tier, &[mine], 0).await.is_success());
    assert_eq!(gc(&tier).bytes, per_block);
    assert!(store(&other, &[theirs], 0).await.is_success());
    let (res, _) = load(&tier, &[theirs]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let s = gc(&tier);
    assert_eq!((s.files, s.bytes), (2, 2 * per_block), "{s:?}");
}

/// A rescan that finds a file as the index has it leaves its entry alone: the stamp memory
/// stays, so a key stamped a moment ago is not stamped again within its interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_leaves_an_unchanged_entry_and_its_stamp_memory_alone() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8); // stamp interval: a minute
    let k = leaf_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc(&tier).stamps, 1);
    tier.gc_rescan_now().unwrap();
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc(&tier).stamps, 1, "stamped twice within an interval");
}

/// A key protected after the sweep decided on it, and before its unlink, is kept, and the
/// sweep reports it among the files it spared for jobs in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_protected_before_its_unlink_is_kept_and_counted() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking);
    let guard = tier.protect(&ks[..1]);
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 6, "the protected victim was deleted");
    tier.set_sweep_hook(None).unwrap();
    assert!(tier.block_path(&ks[0]).exists());
    let s = gc(&tier);
    assert_eq!((s.skipped_in_flight, s.files), (1, 9), "{s:?}");
    drop(guard);
}

/// A file gone before the sweep decides on it is an external removal, not a file the sweep
/// deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_gone_before_the_decision_is_an_external_removal() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::BeforeDelete(ks[0]));
    std::fs::remove_file(tier.block_path(&ks[0])).unwrap();
    go_tx.send(()).unwrap();
    let deleted = sweep.join().unwrap();
    tier.set_sweep_hook(None).unwrap();
    let s = gc(&tier);
    assert_eq!(
        (s.external_removals, s.swept_files),
        (1, deleted as u64),
        "{s:?}"
    );
    assert_eq!(deleted, 6, "{s:?}");
    assert_eq!(s.files, 8);
    let removed: Vec<BlockKey> = tier
        .take_events()
        .into_iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys.clone())
        .collect();
    assert!(
        removed.contains(&ks[0]),
        "the file found gone was not reported removed: {removed:?}"
    );
    assert_eq!(removed.len(), 7, "{removed:?}");
}

/// Sets or clears the immutable flag of a file (root on ext4): its unlink then fails.
fn set_immutable(path: &Path, on: bool) {
    use std::os::fd::AsRawFd;
    const FS_IMMUTABLE_FL: libc::c_long = 0x10;
    let f = std::fs::File::open(path).unwrap();
    let mut flags: libc::c_long = 0;
    // SAFETY: a valid fd and a pointer to a c_long, as FS_IOC_GETFLAGS/SETFLAGS take.
    unsafe {
        assert_eq!(
            libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags),
            0
        );
        flags = if on {
            flags | FS_IMMUTABLE_FL
        } else {
            flags & !FS_IMMUTABLE_FL
        };
        assert_eq!(libc::ioctl(f.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags), 0);
    }
}

/// A victim the sweep cannot unlink (here an immutable file) is an error, stays on disk and
/// stays in the index: the tier keeps counting what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_victim_that_cannot_be_unlinked_stays_counted() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let ks = fifteen_aged(&tier).await;
    set_immutable(&tier.block_path(&ks[0]), true);
    let deleted = tier.gc_sweep_now().unwrap();
    set_immutable(&tier.block_path(&ks[0]), false);
    let s = gc(&tier);
    assert!(tier.block_path(&ks[0]).exists());
    assert_eq!(s.errors, 1, "{s:?}");
    assert_eq!(s.files as usize, 15 - deleted, "{s:?}");
    assert_eq!(
        s.bytes,
        held(root.path(), s.files),
        "the index lost the file: {s:?}"
    );
}

/// The opening walk adopts block files only: a directory named like a block and a `.bin`
/// whose name is not a block's are counted as foreign (by a rescan too), a stray note is
/// passed over; none is a block or counts toward the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_walk_adopts_block_files_only_and_counts_the_rest() {
    let root = temp_root();
    let k = leaf_key(1);
    {
        let t = bounded(root.path(), 10, 0.8);
        assert!(store(&t, &[k], 0).await.is_success());
        let leaf = t.block_path(&k).parent().unwrap().to_path_buf();
        std::fs::create_dir(t.block_path(&leaf_key(2))).unwrap(); // a directory named like a block
        std::fs::write(leaf.join("zz.bin"), b"not a block name").unwrap();
        std::fs::write(leaf.join("notes.txt"), b"someone's notes").unwrap();
    }
    let tier = bounded(root.path(), 10, 0.8);
    let s = gc(&tier);
    assert_eq!((s.files, s.foreign_files), (1, 2), "{s:?}");
    assert_eq!(s.bytes, held(root.path(), 1), "{s:?}");
    tier.gc_rescan_now().unwrap();
    let s = gc(&tier);
    assert_eq!((s.files, s.foreign_files), (1, 2), "{s:?}");
}

/// The GC is woken when the tier goes over its cap, not before: at the cap is within it,
/// and neither a rescan nor a load of another process's block wakes it below the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gc_is_woken_over_the_cap_only() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let ks = keys(0..10);
    // (a batch's stores each reserve room for a new leaf's directories while in flight, so
    // they may wake the GC on the way: the count starts after them)
    assert!(store(&tier, &ks[..9], 0).await.is_success());
    assert!(store(&other, &ks[9..], 0).await.is_success());
    let kicks = gc(&tier).kicks;
    let (res, _) = load(&tier, &ks[9..]).await; // learned: the tier is at its cap
    assert!(res.is_success());
    let s = gc(&tier);
    assert_eq!(s.bytes, s.cap_bytes, "{s:?}");
    tier.gc_rescan_now().unwrap();
    assert_eq!(gc(&tier).kicks, kicks, "woken at the cap");
    assert!(store(&tier, &keys(10..11), 0).await.is_success());
    assert_eq!(gc(&tier).kicks, kicks + 1, "not woken past the cap");
}

/// `protect()` waits only for an unlink of its own keys: while another key's unlink is under
/// way, protecting other keys returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protect_does_not_wait_for_other_keys_unlinks() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::UnlinkingKey(ks[0]));
    let (protector, rx) = protect_on_thread(&tier, ks[14]); // the newest: not a victim
    let returned = rx.recv_timeout(HOOK_DEADLINE);
    go_tx.send(()).unwrap();
    returned.expect("protect() of another key waited for an unlink under way");
    let guard = protector.join().unwrap();
    assert_eq!(sweep.join().unwrap(), 7);
    tier.set_sweep_hook(None).unwrap();
    drop(guard);
}

/// A stamp that fails (here on an immutable file) is an error, and the file stays in the
/// index: only a file that is gone leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stamp_that_fails_keeps_its_file_in_the_index() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8);
    let k = leaf_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    set_immutable(&tier.block_path(&k), true);
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    set_immutable(&tier.block_path(&k), false);
    let s = gc(&tier);
    assert_eq!(
        (s.stamp_errors, s.files, s.external_removals),
        (1, 1, 0),
        "{s:?}"
    );
}

/// The grace window ends exactly `gc_grace_s` after a file's last use: a nanosecond before,
/// the file is spared; at the boundary, it is fair game.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grace_window_ends_to_the_nanosecond() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8); // grace: 300 s
    tier.freeze_gc_clock().unwrap();
    let ks = keys(0..15);
    assert!(store(&tier, &ks, 0).await.is_success());
    // last used at t = 61 s on the GC clock, on disk and in the index alike (a file's own
    // mtime is the wall clock's, past the frozen one)
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&ks);
    tier.gc_apply_stamps_now().unwrap();
    tier.advance_gc_clock(Duration::from_secs(300) - Duration::from_nanos(1))
        .unwrap();
    assert_eq!(tier.gc_sweep_now().unwrap(), 0);
    assert_eq!(gc(&tier).skipped_in_grace, 15);
    tier.advance_gc_clock(Duration::from_nanos(1)).unwrap();
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
}

/// Touches `k` a nanosecond before a whole stamp interval (a minute) has passed on the frozen
/// GC clock since its last stamp, then exactly at it: only the second touch is queued.
fn touch_at_the_stamp_interval_boundary(tier: &FsTier, k: BlockKey) {
    tier.advance_gc_clock(Duration::from_secs(60) - Duration::from_nanos(1))
        .unwrap();
    tier.touch(&[k]);
    assert_eq!(gc(tier).pending_stamps, 0, "stamped within the interval");
    tier.advance_gc_clock(Duration::from_nanos(1)).unwrap();
    tier.touch(&[k]);
    assert_eq!(gc(tier).pending_stamps, 1);
}

/// A key is stamped at most once per `gc_stamp_interval_s`, and again as soon as a whole
/// interval has passed: a nanosecond before, a touch is dropped; at the boundary, it is queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stamp_interval_ends_to_the_nanosecond() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8); // stamp interval: a minute
    tier.freeze_gc_clock().unwrap();
    let k = leaf_key(1);
    assert!(store(&tier, &[k], 0).await.is_success()); // its last use: now
    touch_at_the_stamp_interval_boundary(&tier, k);
}

/// The same boundary for a key of another process, which the tier remembers only by the time
/// of its last stamp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_keys_stamp_interval_ends_to_the_nanosecond() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8); // stamp interval: a minute
    tier.freeze_gc_clock().unwrap();
    let j = leaf_key(1); // no file anywhere: it stays foreign
    tier.touch(&[j]);
    tier.gc_apply_stamps_now().unwrap();
    touch_at_the_stamp_interval_boundary(&tier, j);
}

/// A stamp's interval runs from the touch that queued it, not from when the GC thread got to
/// apply it; a rescan that finds the stamped file unchanged keeps that memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_keeps_when_a_key_was_last_touched() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8); // stamp interval: a minute
    tier.freeze_gc_clock().unwrap();
    let k = leaf_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[k]); // queued at t = 61 s
    tier.advance_gc_clock(Duration::from_secs(50)).unwrap();
    tier.gc_apply_stamps_now().unwrap(); // applied at t = 111 s
    tier.gc_rescan_now().unwrap();
    tier.advance_gc_clock(Duration::from_secs(10)).unwrap();
    tier.touch(&[k]); // t = 121 s: an interval after the last touch
    let s = gc(&tier);
    assert_eq!((s.stamps, s.pending_stamps), (1, 1), "{s:?}");
}

/// A sweep that panics after deciding its victims and before unlinking them (a bug; here a
/// hook) leaves none of them marked as being deleted: a store of a victim ends instead of
/// waiting forever, and the victims whose files are still there are indexed again (they
/// count toward the cap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_that_panics_after_its_decisions_leaves_no_key_waiting() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    tier.set_sweep_hook(Some(Arc::new(|p| {
        if p == SweepPoint::Unlinking {
            panic!("injected sweep panic");
        }
    })))
    .unwrap();
    let t = tier.clone();
    let panicked = std::thread::spawn(move || t.gc_sweep_now()).join();
    assert!(panicked.is_err(), "the hook did not panic the sweep");
    tier.set_sweep_hook(None).unwrap();
    assert!(
        tier.block_path(&ks[0]).exists(),
        "the oldest file was unlinked"
    );
    assert_eq!(gc(&tier).files, 15, "the victims left the index for good");
    let res = store(&*tier, &[ks[0]], 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert_eq!(
        tier.gc_sweep_now().unwrap(),
        7,
        "the victims are sweepable again"
    );
}

/// A sweep that panics in the middle of a key's unlink (a bug; here a hook) leaves the key
/// unmarked: `protect()` of it returns instead of waiting for an unlink that never ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_that_panics_mid_unlink_leaves_protect_free() {
    let root = temp_root();
    let tier = Arc::new(bounded(root.path(), 10, 0.8));
    let ks = fifteen_aged(&tier).await;
    let k = ks[0];
    tier.set_sweep_hook(Some(Arc::new(move |p| {
        if p == SweepPoint::UnlinkingKey(k) {
            panic!("injected sweep panic");
        }
    })))
    .unwrap();
    let t = tier.clone();
    let panicked = std::thread::spawn(move || t.gc_sweep_now()).join();
    assert!(panicked.is_err(), "the hook did not panic the sweep");
    tier.set_sweep_hook(None).unwrap();
    let (protector, rx) = protect_on_thread(&tier, k);
    let existed = rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("protect() waits for an unlink that ended in a panic");
    assert!(existed, "the file whose unlink never ran is gone");
    drop(protector.join().unwrap());
    assert_eq!(gc(&tier).files, 15, "the victims left the index for good");
}

/// A sweep deletes a block's checksum sidecar with the block, whatever the tier's mode: a
/// root written where user xattrs were missing keeps its checksums in sidecars, and a tier
/// that keeps them in xattrs must not leave those behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_deletes_a_victims_sidecar_in_any_mode() {
    let root = temp_root();
    let tier = bounded(root.path(), 10, 0.8); // unchecked: no sidecars of its own
    let ks = fifteen_aged(&tier).await;
    let mut side = tier.block_path(&ks[0]).into_os_string();
    side.push(kv_tier_fs::CRC_SIDECAR_SUFFIX);
    std::fs::write(&side, b"left by a writer without xattrs").unwrap();
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    assert!(!tier.block_path(&ks[0]).exists());
    assert!(
        !Path::new(&side).exists(),
        "the swept block's sidecar stayed"
    );
}
