//! The order of `BlockStored` and `BlockRemoved` events against the disk: a key's last event
//! says whether its file is there, even when a sweep and a store of the key interleave.
//! Interleavings are held with the sweep hook.

mod common;

use std::path::Path;
use std::sync::Arc;

use common::{
    BS, HOOK_DEADLINE, age, hand_swept_cfg, hook_at, leaf_key, load, ns, store, sweep_held_at,
};
use kv_tier_core::{BlockKey, SecondaryTier, TierEvent};
use kv_tier_fs::{FsTier, SweepPoint};
use kv_tier_testkit::temp_root;

/// A bounded tier (sweeps by hand only) whose cap holds `cap_blocks` test blocks and whose
/// low watermark holds 80% of them; the hard ceiling is out of the way.
fn bounded(root: &Path, cap_blocks: u64) -> Arc<FsTier> {
    Arc::new(FsTier::open("fs", hand_swept_cfg(root, cap_blocks, 0.8), ns(), BS).unwrap())
}

/// `n` keys in one leaf directory, stored, oldest first (key 0 the oldest).
async fn aged(tier: &FsTier, n: u64) -> Vec<BlockKey> {
    let ks: Vec<BlockKey> = (0..n).map(leaf_key).collect();
    assert!(store(tier, &ks, 0).await.is_success());
    age(tier, &ks, |i| (n - i as u64) * 1000);
    tier.take_events();
    ks
}

/// Whether `key`'s last event is a removal (`None`: no event of it).
fn last_removed(ev: &[TierEvent], key: &BlockKey) -> Option<bool> {
    ev.iter()
        .rev()
        .find(|e| e.keys.contains(key))
        .map(|e| e.removed)
}

/// Stores `key` again while the sweep is held (bounded: a store that waits for the held sweep
/// fails the test instead of hanging it).
async fn store_while_held(tier: &Arc<FsTier>, key: BlockKey) {
    let t = tier.clone();
    let r = tokio::time::timeout(HOOK_DEADLINE, async move { store(&*t, &[key], 0).await })
        .await
        .expect("the store waited for the held sweep");
    assert!(r.is_success());
}

/// A sweep decides and unlinks its victims in batches (256 a batch) and used to report every
/// removal when the whole sweep ended: a store of a key the first batch removed, made while
/// a later batch was still being decided, was reported stored *before* its removal, so the
/// key's last event said "removed" while its file was on disk. Held at the first decision of
/// the second batch, the store of a key of the first batch must come after its removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_a_sweep_removed_and_a_store_wrote_again_ends_stored() {
    let root = temp_root();
    let tier = bounded(root.path(), 100);
    let ks = aged(&tier, 400).await;
    // 400 over a cap of 100 down to 80: over 300 victims, the oldest first, 256 in the first
    // batch
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::BeforeDelete(ks[256]));
    assert!(
        !tier.block_path(&ks[0]).exists(),
        "the first batch is unlinked"
    );
    store_while_held(&tier, ks[0]).await;
    go_tx.send(()).unwrap();
    let deleted = sweep.join().unwrap();
    assert!(deleted > 256, "one batch only: {deleted}");
    let ev = tier.take_events();
    assert!(
        tier.block_path(&ks[0]).exists(),
        "the newest file was swept"
    );
    assert_eq!(
        ev.iter()
            .filter(|e| e.keys.contains(&ks[0]))
            .map(|e| e.removed)
            .collect::<Vec<_>>(),
        vec![true, false],
        "removed by the sweep, then stored again: in that order"
    );
    // every key: its last event says whether its file is there
    for (i, k) in ks.iter().enumerate() {
        let on_disk = tier.block_path(k).exists();
        assert_eq!(
            last_removed(&ev, k) != Some(true),
            on_disk,
            "key {i}: on disk {on_disk}, events {:?}",
            last_removed(&ev, k)
        );
    }
    let removals = ev
        .iter()
        .filter(|e| e.removed)
        .map(|e| e.keys.len())
        .sum::<usize>();
    assert_eq!(removals, deleted, "each victim reported removed once");
}

/// A file deleted behind the tier's back is found gone by the sweep and reported removed; a
/// store of the key made later in the same sweep must be reported after that removal (it
/// used to be reported at the sweep's end, after the store).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_file_stored_again_during_the_sweep_ends_stored() {
    let root = temp_root();
    let tier = bounded(root.path(), 10);
    let ks = aged(&tier, 15).await;
    std::fs::remove_file(tier.block_path(&ks[0])).unwrap();
    // key 0 is decided (found gone) before the sweep stops at key 1
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::BeforeDelete(ks[1]));
    store_while_held(&tier, ks[0]).await;
    go_tx.send(()).unwrap();
    sweep.join().unwrap();
    let ev = tier.take_events();
    assert!(tier.block_path(&ks[0]).exists());
    assert_eq!(
        ev.iter()
            .filter(|e| e.keys.contains(&ks[0]))
            .map(|e| e.removed)
            .collect::<Vec<_>>(),
        vec![true, false],
        "found gone, then stored again: in that order"
    );
    assert_eq!(tier.stats().gc.unwrap().external_removals, 1);
}

/// A load that finds a block's file gone (deleted behind the tier's back) forgets it and
/// reports it removed, once: a rescan afterwards does not report it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_finds_a_file_gone_reports_it_removed_once() {
    let root = temp_root();
    let tier = bounded(root.path(), 10);
    let ks = aged(&tier, 3).await;
    std::fs::remove_file(tier.block_path(&ks[1])).unwrap();
    let (r, _) = load(&*tier, &ks[1..2]).await;
    assert!(!r.is_success());
    tier.gc_rescan_now().unwrap();
    let ev = tier.take_events();
    assert_eq!(
        ev.iter()
            .filter(|e| e.removed)
            .flat_map(|e| e.keys.clone())
            .collect::<Vec<_>>(),
        vec![ks[1]]
    );
    assert_eq!(tier.stats().gc.unwrap().files, 2);
    // stored again: its last event is the store
    assert!(store(&*tier, &ks[1..2], 0).await.is_success());
    assert_eq!(last_removed(&tier.take_events(), &ks[1]), Some(false));
}

/// A rescan walks the tree with no lock held, then merges what it saw. Files a sweep deleted
/// between the walk and the merge used to come back into the index (the merge keeps entries
/// that appeared while it walked, and took these for new): the index then counted files that
/// were gone, and a later sweep or rescan found them "deleted behind the tier's back" and
/// reported them removed a second time. Held between its walk and its merge, the rescan
/// must leave the sweep's work as it is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_does_not_bring_back_what_a_sweep_deleted_during_its_walk() {
    let root = temp_root();
    let tier = bounded(root.path(), 10);
    let ks = aged(&tier, 15).await;
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::RescanWalked);
    let rescan = {
        let t = tier.clone();
        std::thread::spawn(move || t.gc_rescan_now().unwrap())
    };
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the rescan never finished its walk");
    // the walk saw all 15 files; a sweep deletes the oldest now
    tier.set_sweep_hook(None).unwrap();
    let deleted = tier.gc_sweep_now().unwrap();
    assert!(deleted > 0);
    go_tx.send(()).unwrap();
    rescan.join().unwrap();
    let on_disk = ks.iter().filter(|k| tier.block_path(k).exists()).count();
    let s = tier.stats().gc.unwrap();
    assert_eq!(
        (s.files as usize, on_disk),
        (15 - deleted, 15 - deleted),
        "the rescan put back files the sweep deleted: {s:?}"
    );
    // nothing is found gone later, and nothing is reported removed twice
    tier.gc_rescan_now().unwrap();
    tier.gc_sweep_now().unwrap();
    let s = tier.stats().gc.unwrap();
    assert_eq!(s.external_removals, 0, "{s:?}");
    let ev = tier.take_events();
    for k in &ks {
        let removals = ev
            .iter()
            .filter(|e| e.removed && e.keys.contains(k))
            .count();
        assert!(removals <= 1, "{k} reported removed {removals} times");
        assert_eq!(
            last_removed(&ev, k) == Some(true),
            !tier.block_path(k).exists()
        );
    }
}

/// A sweep keeps a victim that was protected since its decision, and used to put it back in
/// the index as it was: when the victim's file went meanwhile (here a load found it damaged
/// and removed it, reporting the removal itself), the index then held a file that was gone,
/// and whoever found it gone reported it removed a second time. Now the damaged file's
/// removal is reported once (by the sweep, which finds it gone) and the entry is not put back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_victim_removed_as_damaged_during_the_sweep_is_reported_once() {
    let root = temp_root();
    let tier = bounded(root.path(), 10);
    let ks = aged(&tier, 15).await;
    let victim = ks[0];
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking);
    // the victim is decided; a job protects it (so the sweep keeps it) and a load finds its
    // file damaged and removes it
    let guard = tier.protect(&[victim]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(tier.block_path(&victim))
        .unwrap()
        .set_len(100)
        .unwrap();
    let (r, _) = load(&*tier, &[victim]).await;
    assert!(!r.is_success());
    assert!(!tier.block_path(&victim).exists(), "the load removed it");
    go_tx.send(()).unwrap();
    let deleted = sweep.join().unwrap();
    drop(guard);
    let on_disk = ks.iter().filter(|k| tier.block_path(k).exists()).count();
    assert_eq!(on_disk, 15 - 1 - deleted);
    let s = tier.stats().gc.unwrap();
    assert_eq!(
        s.files as usize, on_disk,
        "the gone victim is back in the index: {s:?}"
    );
    // a later rescan and sweep find nothing gone; the victim was reported removed once
    tier.gc_rescan_now().unwrap();
    tier.gc_sweep_now().unwrap();
    let ev = tier.take_events();
    let removals = ev
        .iter()
        .filter(|e| e.removed && e.keys.contains(&victim))
        .count();
    assert_eq!(removals, 1, "{ev:?}");
    for k in &ks {
        assert_eq!(
            last_removed(&ev, k) == Some(true),
            !tier.block_path(k).exists()
        );
    }
}

/// The stamps thread looks at files with no lock held, and indexes a stamped file the index
/// does not know (another process's). A sweep's victim is out of the index from its decision
/// on: stamped then (a load touched it), its file was learned back after the sweep had
/// deleted and reported it, so the index held a gone file, found gone later and reported
/// removed a second time. Held between their looks and their application, the stamps must
/// not bring back what the sweep deleted meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stamps_do_not_bring_back_a_victim_the_sweep_deleted_meanwhile() {
    use std::sync::Mutex;
    use std::sync::mpsc::channel;
    let root = temp_root();
    let tier = bounded(root.path(), 10);
    let ks = aged(&tier, 15).await;
    let victim = ks[0];
    let (at_tx, at_rx) = channel::<SweepPoint>();
    let (go_sweep, sweep_rx) = channel::<()>();
    let (go_stamps, stamps_rx) = channel::<()>();
    let (sweep_rx, stamps_rx) = (Mutex::new(sweep_rx), Mutex::new(stamps_rx));
    tier.set_sweep_hook(Some(Arc::new(move |p| {
        let rx = match p {
            SweepPoint::Unlinking => &sweep_rx,
            SweepPoint::StampsDone => &stamps_rx,
            _ => return,
        };
        let _ = at_tx.send(p);
        let _ = rx.lock().unwrap().recv();
    })))
    .unwrap();
    let reached = |want: SweepPoint| {
        let p = at_rx
            .recv_timeout(HOOK_DEADLINE)
            .expect("a hook point was never reached");
        assert_eq!(p, want);
    };
    let sweep = {
        let t = tier.clone();
        std::thread::spawn(move || t.gc_sweep_now().unwrap())
    };
    reached(SweepPoint::Unlinking); // the victims are decided, their files still there
    tier.touch(&[victim]);
    let stamps = {
        let t = tier.clone();
        std::thread::spawn(move || t.gc_apply_stamps_now().unwrap())
    };
    reached(SweepPoint::StampsDone); // the victim's file stamped and looked at
    go_sweep.send(()).unwrap();
    let deleted = sweep.join().unwrap();
    assert!(!tier.block_path(&victim).exists());
    go_stamps.send(()).unwrap();
    stamps.join().unwrap();
    tier.set_sweep_hook(None).unwrap();
    let on_disk = ks.iter().filter(|k| tier.block_path(k).exists()).count();
    assert_eq!(on_disk, 15 - deleted);
    let s = tier.stats().gc.unwrap();
    assert_eq!(
        s.files as usize, on_disk,
        "a deleted victim is back in the index: {s:?}"
    );
    tier.gc_rescan_now().unwrap();
    tier.gc_sweep_now().unwrap();
    let s = tier.stats().gc.unwrap();
    assert_eq!(s.external_removals, 0, "{s:?}");
    let ev = tier.take_events();
    let removals = ev
        .iter()
        .filter(|e| e.removed && e.keys.contains(&victim))
        .count();
    assert_eq!(removals, 1);
}
