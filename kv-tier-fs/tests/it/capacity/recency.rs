//! Recency is the file mtime: `touch`, loads and skipped stores queue stamps applied off the
//! caller's thread, at most one per key per stamp interval (to the nanosecond, foreign keys
//! included); reads by another instance or process count; rescans keep the stamps.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_fs::{FsTier, SweepPoint};
use kv_tier_testkit::fixtures::files::allocation_units;
use kv_tier_testkit::wait::{SETTLE_LIMIT, poll_until_async};
use kv_tier_testkit::{load_keys, temp_root, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touch_stamps_the_mtime_off_thread_and_is_rate_limited() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let k = leaf_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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
    assert_eq!(gc_stats(&tier).pending_stamps, 1);
    tier.gc_apply_stamps_now().unwrap();
    let stamped = mtime(&tier);
    assert!(
        SystemTime::now()
            .duration_since(stamped)
            .unwrap_or_default()
            < Duration::from_secs(60)
    );
    assert_eq!(gc_stats(&tier).stamps, 1);
    // within the stamp interval: no second stamp
    tier.touch(&[k]);
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc_stats(&tier).stamps, 1);
    // after it: stamped again
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc_stats(&tier).stamps, 2);
    assert!(mtime(&tier) > stamped);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touching_missing_keys_is_harmless_and_tracking_is_bounded() {
    let root = temp_root();
    let mut c = hand_swept_cfg(root.path(), 10, 0.8);
    c.gc_max_tracked = Some(2);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    // keys of no file: queued like keys of other processes (bounded), then found absent
    tier.touch(&leaf_keys(500..600));
    assert_eq!(gc_stats(&tier).stamps_dropped, 98);
    tier.gc_apply_stamps_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!(
        (s.stamps, s.stamp_errors, s.pending_stamps, s.files),
        (0, 0, 0, 0)
    );
    let ks = leaf_keys(0..5);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    age(&tier, &ks, |_| 5000);
    tier.touch(&ks);
    let s = gc_stats(&tier);
    assert_eq!((s.pending_stamps, s.stamps_dropped), (2, 98 + 3));
}

/// A key touched after the sweep chose its victims is not deleted on its stale mtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_touch_after_the_sweep_began_keeps_the_key() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
    let victim = ks[2];
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::BeforeDelete(victim)); // keys 0 and 1 are gone; key 2 is next
    tier.touch(&[victim]);
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 7);
    assert!(
        tier.block_path(&victim).exists(),
        "deleted on a stale mtime"
    );
    assert_eq!(gc_stats(&tier).skipped_recent, 1);
    assert_eq!(present(&tier, &ks[..2]), vec![false, false]);
}

/// A key of another process (not in this tier's index) is stamped at most once per stamp
/// interval, however often it is touched: the memory of foreign stamps rate-limits them too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_touched_twice_in_an_interval_is_stamped_once() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8); // stamp interval: a minute
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let k = leaf_key(1);
    assert!(fs_store(&other, &[k], 0).await.is_success());
    tier.touch(&[k]);
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!((s.stamps, s.stamp_errors), (1, 0), "{s:?}");
    assert_eq!(s.files, 1, "the stamped foreign key joins the index");
}

/// A key of another process, touched again after a stamp interval, is stamped again: the
/// memory of foreign stamps limits their rate, it does not refuse a key for good. (The key
/// stays foreign while its file is missing: a stamp that finds no file learns nothing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_key_touched_again_after_an_interval_is_stamped_again() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8); // stamp interval: a minute
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let j = leaf_key(1);
    tier.touch(&[j]); // no file yet: the stamp finds nothing
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc_stats(&tier).stamps, 0);
    assert!(fs_store(&other, &[j], 0).await.is_success());
    tier.touch(&[j]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(
        gc_stats(&tier).stamps,
        0,
        "stamped twice within an interval"
    );
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[j]);
    tier.gc_apply_stamps_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!((s.stamps, s.files), (1, 1), "{s:?}");
}

/// A rescan that finds a file as the index has it leaves its entry alone: the stamp memory
/// stays, so a key stamped a moment ago is not stamped again within its interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_leaves_an_unchanged_entry_and_its_stamp_memory_alone() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8); // stamp interval: a minute
    let k = leaf_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc_stats(&tier).stamps, 1);
    tier.gc_rescan_now().unwrap();
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(
        gc_stats(&tier).stamps,
        1,
        "stamped twice within an interval"
    );
}

/// A stamp that fails (here on an immutable file) is an error, and the file stays in the
/// index: only a file that is gone leaves it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stamp_that_fails_keeps_its_file_in_the_index() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let k = leaf_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    set_immutable(&tier.block_path(&k), true);
    tier.touch(&[k]);
    tier.gc_apply_stamps_now().unwrap();
    set_immutable(&tier.block_path(&k), false);
    let s = gc_stats(&tier);
    assert_eq!(
        (s.stamp_errors, s.files, s.external_removals),
        (1, 1, 0),
        "{s:?}"
    );
}

/// A hand-swept tier in `root` (stamp interval: a minute), its GC clock frozen, holding one
/// block stored now: the block's key.
async fn one_block_on_a_frozen_clock(root: &std::path::Path) -> (FsTier, BlockKey) {
    let tier = open_hand_swept(root, 10, 0.8);
    tier.freeze_gc_clock().unwrap();
    let k = leaf_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success()); // its last use: now
    (tier, k)
}

/// The mtime of `k`'s block file.
fn mtime_of(tier: &FsTier, k: &BlockKey) -> std::time::SystemTime {
    std::fs::metadata(tier.block_path(k))
        .unwrap()
        .modified()
        .unwrap()
}

/// Touches `k` a minute and a second after its store (past the stamp interval: a stamp is
/// queued); returns the file's mtime from before (the store's).
fn touched_past_the_interval(tier: &FsTier, k: BlockKey) -> std::time::SystemTime {
    let stored = mtime_of(tier, &k);
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[k]);
    stored
}

/// On a frozen GC clock (a test's, the simulator's), a stored file's mtime is the clock's
/// time, as its index entry's is, not the wall time it was written at: what a reopen reads
/// from the disk is the recency the index held (the files of one step, equally recent on
/// the clock, had their write order on the wall clock, and a reused root's sweeps followed
/// it: `serve_sim --sync-steps` over a reused root differed from run to run).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_frozen_clock_a_stored_file_has_the_clocks_time() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    tier.freeze_gc_clock().unwrap();
    tier.advance_gc_clock(Duration::from_secs(3600)).unwrap();
    let (a, b) = (leaf_key(1), leaf_key(2));
    assert!(fs_store(&tier, &[a], 0).await.is_success());
    std::thread::sleep(Duration::from_millis(20)); // the wall clock moves; the GC clock not
    assert!(fs_store(&tier, &[b], 0).await.is_success());
    assert_eq!(
        mtime_of(&tier, &a),
        mtime_of(&tier, &b),
        "one clock time, one mtime"
    );
    let ahead = mtime_of(&tier, &a)
        .duration_since(std::time::SystemTime::now())
        .expect("the mtime is the clock's, an hour ahead of the wall");
    assert!(ahead > Duration::from_secs(3000), "{ahead:?}");
}

/// A key is stamped at most once per `gc_stamp_interval_s`, and again as soon as a whole
/// interval has passed: a nanosecond before, a touch is dropped; at the boundary, it is queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stamp_interval_ends_to_the_nanosecond() {
    let root = temp_root();
    let (tier, k) = one_block_on_a_frozen_clock(root.path()).await;
    touch_at_the_stamp_interval_boundary(&tier, k);
}

/// `touch` only queues its keys; the index applies them later, but each at the clock of its
/// own call: a touch a nanosecond inside the stamp interval stays rate-limited though the
/// interval has passed by the time anything looks, and one at the boundary is queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_touch_is_judged_at_the_clock_of_its_call() {
    let root = temp_root();
    let (tier, k) = one_block_on_a_frozen_clock(root.path()).await;
    tier.advance_gc_clock(Duration::from_secs(60) - Duration::from_nanos(1))
        .unwrap();
    tier.touch(&[k]);
    tier.advance_gc_clock(Duration::from_nanos(1)).unwrap();
    assert_eq!(
        gc_stats(&tier).pending_stamps,
        0,
        "judged when applied, not when touched"
    );
    tier.touch(&[k]);
    assert_eq!(gc_stats(&tier).pending_stamps, 1);
}

/// The same boundary for a key of another process, which the tier remembers only by the time
/// of its last stamp.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_keys_stamp_interval_ends_to_the_nanosecond() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8); // stamp interval: a minute
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
    let (tier, k) = one_block_on_a_frozen_clock(root.path()).await;
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[k]); // queued at t = 61 s
    tier.advance_gc_clock(Duration::from_secs(50)).unwrap();
    tier.gc_apply_stamps_now().unwrap(); // applied at t = 111 s
    tier.gc_rescan_now().unwrap();
    tier.advance_gc_clock(Duration::from_secs(10)).unwrap();
    tier.touch(&[k]); // t = 121 s: an interval after the last touch
    let s = gc_stats(&tier);
    assert_eq!((s.stamps, s.pending_stamps), (1, 1), "{s:?}");
}

/// A stamp writes the time of the touch that queued it, not the time the GC thread got to
/// apply it: the file's recency on disk is when the block was used.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stamp_writes_the_time_of_the_touch() {
    let root = temp_root();
    let (tier, k) = one_block_on_a_frozen_clock(root.path()).await;
    let stored = touched_past_the_interval(&tier, k); // at t = 61 s, stored at t = 0
    tier.advance_gc_clock(Duration::from_secs(50)).unwrap();
    tier.gc_apply_stamps_now().unwrap(); // t = 111 s
    assert_eq!(mtime_of(&tier, &k), stored + Duration::from_secs(61));
}

/// A rescan that runs between a touch and its stamp finds the file's older mtime on disk: the
/// touch's time stands, and the stamp writes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_before_a_stamp_keeps_the_touch() {
    let root = temp_root();
    let (tier, k) = one_block_on_a_frozen_clock(root.path()).await;
    let stored = touched_past_the_interval(&tier, k);
    assert_eq!(gc_stats(&tier).pending_stamps, 1);
    tier.gc_rescan_now().unwrap(); // sees the store's mtime on disk
    tier.advance_gc_clock(Duration::from_secs(50)).unwrap();
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(mtime_of(&tier, &k), stored + Duration::from_secs(61));
}

/// A rescan that finds a touched file changed in size takes its size from the disk and keeps
/// the touch, whose stamp then writes the touch's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_that_finds_a_touched_file_resized_keeps_the_touch() {
    let root = temp_root();
    let (tier, k) = one_block_on_a_frozen_clock(root.path()).await;
    let path = tier.block_path(&k);
    let stored = touched_past_the_interval(&tier, k);
    assert_eq!(gc_stats(&tier).pending_stamps, 1);
    // grown behind the tier's back (its mtime is the wall clock's now)
    let f = std::fs::OpenOptions::new()
        .append(true)
        .open(&path)
        .unwrap();
    std::io::Write::write_all(&mut &f, &vec![0u8; 64 << 10]).unwrap();
    drop(f);
    tier.gc_rescan_now().unwrap();
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(mtime_of(&tier, &k), stored + Duration::from_secs(61));
}

/// A touch the index took before a rescan began, stamped while the rescan walked (the walk
/// may have read the file's older time): the merge keeps the touch's time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_keeps_a_touch_taken_before_it_and_stamped_while_it_walked() {
    let root = temp_root();
    let (tier, ks) = four_aged_keys(root.path()).await;
    tier.touch(&ks[..1]);
    assert_eq!(gc_stats(&tier).pending_stamps, 1); // in the index, not on disk yet
    while_a_rescan_walked(&tier, || tier.gc_apply_stamps_now().unwrap());
    the_sweep_keeps_the_touched_oldest(&tier, &ks);
}

/// Four files stored and aged, `ks[0]` the oldest, on a tier that sweeps down to two.
async fn four_aged_keys(root: &std::path::Path) -> (Arc<FsTier>, Vec<BlockKey>) {
    let tier =
        Arc::new(FsTier::open("fs", hand_swept_low_blocks_cfg(root, 3, 2), ns(), BS).unwrap());
    let ks: Vec<BlockKey> = (0..4).map(leaf_key).collect();
    assert!(fs_store(&*tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 4000 - 1000 * i as u64);
    (tier, ks)
}

/// Runs `during` while a rescan is held between its walk and its merge.
fn while_a_rescan_walked(tier: &Arc<FsTier>, during: impl FnOnce()) {
    let (at_rx, go_tx) = hook_at(tier, SweepPoint::RescanWalked);
    let t = tier.clone();
    let rescan = std::thread::spawn(move || t.gc_rescan_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the rescan never walked");
    during();
    go_tx.send(()).unwrap();
    rescan.join().unwrap();
    tier.set_sweep_hook(None).unwrap();
}

/// A sweep down to two takes the two middle keys: the oldest was touched, and the index
/// held its touch (the sweep never had to find the key fresh on disk).
fn the_sweep_keeps_the_touched_oldest(tier: &FsTier, ks: &[BlockKey]) {
    assert_eq!(tier.gc_sweep_now().unwrap(), 2);
    let present: Vec<bool> = ks.iter().map(|k| tier.block_path(k).exists()).collect();
    assert_eq!(
        present,
        [true, false, false, true],
        "the touched key was swept as old"
    );
    assert_eq!(
        gc_stats(tier).skipped_recent,
        0,
        "the rescan put the file's older mtime back"
    );
}

/// Two tier instances on one root: B reads a key A wrote, and touches it; A's sweep does not
/// evict it as least recently used. B stamps it although B never wrote it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_another_instance_reads_is_recent_for_this_one() {
    let root = temp_root();
    let mut ca = capped_no_thread_cfg(root.path(), 16 * measured_per_block().await);
    ca.gc_hard_ceiling = Some(1.5); // the 20 blocks fit; sweeps are by hand
    ca.gc_low_watermark = Some(0.5);
    ca.gc_stamp_interval_s = Some(0.001);
    let a = FsTier::open("a", ca.clone(), ns(), BS).unwrap();
    let b = FsTier::open("b", ca, ns(), BS).unwrap(); // opened before A wrote anything
    let keys: Vec<_> = (0..20).map(test_key).collect();
    assert!(fs_store(&a, &keys, 0).await.is_success());
    age(&a, &keys, |i| 10_000 - i as u64); // key 0 is the oldest
    let hot = keys[0];
    // B touches it without loading (it is not in B's index), then loads it
    b.touch(&[hot]);
    b.gc_apply_stamps_now().unwrap();
    assert_eq!(
        gc_stats(&b).stamps,
        1,
        "B did not stamp a key it never wrote"
    );
    assert!(load(&b, &[hot]).await.0.is_success());
    assert!(
        gc_stats(&b).files >= 1,
        "B's index did not learn the key it read"
    );
    assert!(a.gc_sweep_now().unwrap() > 0);
    assert!(a.block_path(&hot).exists(), "A evicted a key B uses");
    assert!(!a.block_path(&keys[1]).exists(), "the next oldest goes");
}

/// An unbounded instance's reads (touches) are recency for a bounded instance on the same
/// root: it stamps the files it reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_instances_reads_are_recency_for_a_bounded_one() {
    let root = temp_root();
    let mut ca = capped_no_thread_cfg(root.path(), 16 * measured_per_block().await);
    ca.gc_hard_ceiling = Some(1.5);
    ca.gc_low_watermark = Some(0.5);
    let a = FsTier::open("a", ca, ns(), BS).unwrap();
    let b = FsTier::open("b", cfg(root.path()), ns(), BS).unwrap(); // unbounded
    let keys: Vec<_> = (0..20).map(test_key).collect();
    assert!(fs_store(&a, &keys, 0).await.is_success());
    age(&a, &keys, |i| 10_000 - i as u64);
    let hot = keys[0];
    let before = std::fs::metadata(a.block_path(&hot))
        .unwrap()
        .modified()
        .unwrap();
    b.touch(&[hot]);
    poll_until_async(Duration::from_secs(60), || {
        std::fs::metadata(a.block_path(&hot))
            .unwrap()
            .modified()
            .unwrap()
            > before
    })
    .await;
    assert!(
        std::fs::metadata(a.block_path(&hot))
            .unwrap()
            .modified()
            .unwrap()
            > before,
        "the unbounded instance did not stamp what it read"
    );
    assert!(a.gc_sweep_now().unwrap() > 0);
    assert!(a.block_path(&hot).exists(), "A evicted a key B reads");
}

/// A stamp applied while a rescan walks is newer than what the walk saw: the rescan keeps
/// it, so the stamped key is recent for the next sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_keeps_a_stamp_applied_while_it_walked() {
    let root = temp_root();
    let (tier, ks) = four_aged_keys(root.path()).await;
    while_a_rescan_walked(&tier, || {
        let stamps = gc_stats(&tier).stamps;
        tier.touch(&ks[..1]); // the oldest is read now
        tier.gc_apply_stamps_now().unwrap();
        assert_eq!(
            gc_stats(&tier).stamps,
            stamps + 1,
            "the touch was not stamped"
        );
    });
    the_sweep_keeps_the_touched_oldest(&tier, &ks);
}

/// README: "`touch(keys)` queues a stamp"; ARCHITECTURE.md: "`touch`, skipped stores and loads
/// queue a stamp"; `gc_grace_s`: "Files used (mtime) within this many seconds are spared by
/// the GC's sweeps over the cap"; README "Sweep": "A key touched after the sweep began is not
/// deleted on its stale mtime."
///
/// 24 blocks, all made old by moving the GC clock 1000 s; one touched, one loaded, one
/// stored again (a skip); then a sweep to the watermark: those three stay, the others go
/// oldest first. Then a key touched while a sweep is paused after choosing its victims stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touched_loaded_and_restored_keys_are_spared_within_grace() {
    let cap = leaf_cost(20).await;
    let root = temp_root();
    let mut c = capped_hand_swept_cfg(root.path(), cap);
    c.gc_low_watermark = Some(0.5);
    let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    let keys: Vec<_> = (100..124).map(leaf_key).collect();
    for k in &keys {
        assert!(store_sized(&tier, &[*k], BS).await.is_success());
    }
    tier.advance_gc_clock(Duration::from_secs(1000)).unwrap();
    let (touched, loaded, restored) = (keys[1], keys[3], keys[5]);
    tier.touch(&[touched]);
    let (res, _) = load_keys(&*tier, &[loaded], BS).await;
    assert!(res.is_success());
    assert!(store_sized(&tier, &[restored], BS).await.is_success());
    tier.gc_apply_stamps_now().unwrap();
    let deleted = tier.gc_sweep_now().unwrap();
    assert!(deleted > 3, "{:?}", gc_stats(&tier));
    for (what, k) in [
        ("touched", touched),
        ("loaded", loaded),
        ("re-stored", restored),
    ] {
        assert!(
            tier.block_path(&k).exists(),
            "the {what} key was swept within grace: {:?}",
            gc_stats(&tier)
        );
    }
    let others: Vec<_> = keys
        .iter()
        .filter(|k| ![touched, loaded, restored].contains(k))
        .collect();
    let gone: Vec<bool> = others
        .iter()
        .map(|k| !tier.block_path(k).exists())
        .collect();
    let n_gone = gone.iter().filter(|g| **g).count();
    assert!(
        gone[..n_gone].iter().all(|g| *g),
        "not oldest first: {gone:?}"
    );

    // touched between selection and deletion
    tier.advance_gc_clock(Duration::from_secs(1000)).unwrap();
    let more: Vec<_> = (200..220).map(leaf_key).collect();
    assert!(store_sized(&tier, &more, BS).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(1000)).unwrap();
    let oldest = *others.iter().find(|k| tier.block_path(k).exists()).unwrap();
    let (at, go) = hook_at(&tier, SweepPoint::Selected);
    let t2 = tier.clone();
    let sweep = tokio::task::spawn_blocking(move || t2.gc_sweep_now().unwrap());
    at.recv_timeout(Duration::from_secs(30))
        .expect("sweep never selected");
    tier.touch(&[*oldest]);
    go.send(()).unwrap();
    let n = sweep.await.unwrap();
    tier.set_sweep_hook(None).unwrap();
    assert!(n > 0);
    assert!(
        tier.block_path(oldest).exists(),
        "touched after selection, still deleted: {:?}",
        gc_stats(&tier)
    );
}

/// README "Recency is the file mtime": "`touch` stamps any key whose file exists, also one
/// another process wrote ... so a key another instance reads is recent for this one's
/// sweeps"; README: unbounded, "`touch` stamps the mtimes of the files it names ... so this
/// process's reads count as recency for bounded tiers of other processes on the same root";
/// ARCHITECTURE.md: a candidate "fresher on disk (mtime updated)" is skipped.
///
/// A bounded tier A and an unbounded tier B on one root. Every file is made 2000 s old (and
/// A rescans); B touches one key; once its file's mtime is fresh, A's sweep must spare it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_process_touch_counts_as_recency() {
    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir;
    let mut c = capped_hand_swept_cfg(root.path(), 30 * per_block);
    c.gc_low_watermark = Some(0.3);
    let a = FsTier::open("fs", c, ns(), BS).unwrap();
    let keys: Vec<_> = (0..30).map(|i| test_key(7_000_000 + i)).collect();
    assert!(store_sized(&a, &keys, BS).await.is_success());
    for (i, k) in keys.iter().enumerate() {
        set_mtime(&a.block_path(k), 2000 + 30 - i as u64);
    }
    a.gc_rescan_now().unwrap();
    let b = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let hot = keys[0]; // the oldest
    b.touch(&[hot]);
    let p = a.block_path(&hot);
    assert!(
        poll_until_async(SETTLE_LIMIT, || mtime_age_s(&p).is_some_and(|s| s < 120.0)).await,
        "B's touch never stamped the file"
    );
    let more: Vec<_> = (30..40).map(|i| test_key(7_000_000 + i)).collect();
    assert!(store_sized(&a, &more, BS).await.is_success());
    let deleted = a.gc_sweep_now().unwrap();
    assert!(deleted > 5, "{:?}", gc_stats(&a));
    assert!(
        p.exists(),
        "a key another process touched was swept as oldest: {:?}",
        gc_stats(&a)
    );
    b.shutdown().await.unwrap();
}
