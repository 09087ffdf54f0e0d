//! The events against the disk: a key's last event (`BlockStored` or `BlockRemoved`) says
//! whether its file is there, and every removal is reported once, however sweeps, rescans,
//! stamps, loads, stores and other instances interleave (held at the sweep hook's points or run
//! at once).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_fs::{Checksum, SweepPoint};
use kv_tier_testkit::fixtures::files::{Mount, allocation_units};
use kv_tier_testkit::{temp_root, test_key, verify_block};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_emits_block_removed_and_leaves_the_index() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let k = leaf_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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
    assert_eq!(gc_stats(&tier).files, 0);
}

/// A file gone before the sweep decides on it is an external removal, not a file the sweep
/// deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_gone_before_the_decision_is_an_external_removal() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::BeforeDelete(ks[0]));
    std::fs::remove_file(tier.block_path(&ks[0])).unwrap();
    go_tx.send(()).unwrap();
    let deleted = sweep.join().unwrap();
    tier.set_sweep_hook(None).unwrap();
    let s = gc_stats(&tier);
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

/// A sweep decides and unlinks its victims in batches (256 a batch) and used to report every
/// removal when the whole sweep ended: a store of a key the first batch removed, made while
/// a later batch was still being decided, was reported stored *before* its removal, so the
/// key's last event said "removed" while its file was on disk. Held at the first decision of
/// the second batch, the store of a key of the first batch must come after its removal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_a_sweep_removed_and_a_store_wrote_again_ends_stored() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 100, 0.8));
    let ks = aged_quiet(&tier, 400).await;
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
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = aged_quiet(&tier, 15).await;
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
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = aged_quiet(&tier, 3).await;
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
    assert!(fs_store(&*tier, &ks[1..2], 0).await.is_success());
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
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = aged_quiet(&tier, 15).await;
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
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = aged_quiet(&tier, 15).await;
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
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = aged_quiet(&tier, 15).await;
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

/// README "Events": "`BlockRemoved` for every file a sweep deletes"; `take_events`: "Takes the
/// events accumulated since the last call (stores, then removals, in order)".
///
/// 8 tasks store random jobs from a pool of 300 keys (evicted keys come back) under
/// constant eviction; events are taken every few milliseconds. After shutdown: no event was
/// dropped; a key whose last event is a removal has no file; a key with a file has a stored
/// event as its last, and a key whose last event is a store has a file; every removal is of
/// a key whose last event was a store.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn removal_events_match_what_left_the_disk() {
    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir;
    let mut c = capped_cfg(root.path(), 24 * per_block);
    c.gc_interval_s = Some(0.01);
    c.gc_stamp_interval_s = Some(0.001);
    c.gc_grace_s = Some(0.002);
    let tier = open_cfg(c, BS);
    let pool: Vec<_> = (0..300).map(|i| test_key(17_000_000 + i)).collect();
    let events = Arc::new(Mutex::new(Vec::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let collector = {
        let (tier, events, stop) = (tier.clone(), events.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                drain_events(&tier, &mut events.lock().unwrap());
                tokio::time::sleep(Duration::from_millis(3)).await; // events taken every 3 ms
            }
        })
    };
    let mut hs = Vec::new();
    for w in 0..8u64 {
        let (tier, pool) = (tier.clone(), pool.clone());
        hs.push(tokio::spawn(async move {
            for j in 0..80u64 {
                let n = 1 + mix(w * 1000 + j) % 6;
                let mut ks: Vec<_> = (0..n)
                    .map(|x| pool[(mix(w * 77 + j * 13 + x) % 300) as usize])
                    .collect();
                ks.sort();
                ks.dedup();
                let _ = store_sized(&tier, &ks, BS).await;
            }
        }));
    }
    for h in hs {
        h.await.unwrap();
    }
    tier.shutdown().await.unwrap();
    stop.store(true, Ordering::Relaxed);
    collector.await.unwrap();
    let mut ev = std::mem::take(&mut *events.lock().unwrap());
    drain_events(&tier, &mut ev);
    assert_eq!(tier.events_dropped(), 0);
    let s = gc_stats(&tier);
    assert!(s.swept_files > 50, "no churn: {s:?}");
    let mut last: HashMap<BlockKey, bool> = HashMap::new();
    let mut bad_order = Vec::new();
    for (k, removed) in &ev {
        if *removed && last.get(k) != Some(&false) {
            bad_order.push(*k);
        }
        last.insert(*k, *removed);
    }
    let mut removed_but_present = 0;
    let mut present_not_stored = 0;
    let mut stored_but_absent = 0;
    for k in &pool {
        let exists = tier.block_path(k).exists();
        match last.get(k) {
            Some(true) if exists => removed_but_present += 1,
            Some(false) if !exists => stored_but_absent += 1,
            Some(false) => {}
            _ if exists => present_not_stored += 1,
            _ => {}
        }
    }
    assert_eq!(
        stored_but_absent, 0,
        "keys whose last event is a store have no file"
    );
    assert_eq!(
        removed_but_present,
        0,
        "keys whose last event is a removal are on disk ({} events)",
        ev.len()
    );
    assert_eq!(
        present_not_stored, 0,
        "keys on disk whose last event is not a store"
    );
    // Each removal is reported while the key is still out of reach of a store (sweep victims
    // before their batch ends, files found gone under the index lock): a store of the key
    // is reported after it (the tests of this module hold both interleavings).
    assert!(
        bad_order.is_empty(),
        "{} removals of keys whose last event was not a store (in event order): {:?}",
        bad_order.len(),
        &bad_order[..bad_order.len().min(4)]
    );
}

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
        let tier = open_cfg(leaf_cap_cfg(root.path(), 10, 1000.0, false), BS);
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
            is_regular(&tier.block_path(&ks[0])),
            "{what}: protected key swept"
        );
        assert!(
            is_regular(&tier.block_path(&ks[4])),
            "{what}: key in grace swept"
        );
        if which == 0 {
            assert!(
                is_regular(&tier.block_path(&ks[1])),
                "{what}: a key touched after the sweep began was deleted"
            );
        }
        drop(guard);
        settle(&tier);
        drain_log(&tier, &mut log);
        check_events(&tier, &log, &ks, &HashSet::new(), &what);
        check_stats(&tier, root.path(), &what);
        let s = gc_stats(&tier);
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
        let tier = open_cfg(leaf_cap_cfg(root.path(), 10, 1000.0, false), BS);
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
            tokio::spawn(async move { fs_store(&*t, &v, 0).await })
        };
        let protector = {
            let t = tier.clone();
            let k = ks[1];
            on_thread(move || t.protect(&[k]))
        };
        // let them meet the held sweep before it goes on: some wait on it, unseen (no state
        // says they got there), and what is checked below holds however far they got
        tokio::time::sleep(Duration::from_millis(300)).await;
        go_tx.send(()).unwrap();
        drop(go_tx);
        join(&sweep, "the sweep");
        let guard = join(&protector, "protect()");
        let (_, got) = within_limit("the loads", loads).await.unwrap();
        for (k, b) in &got {
            assert!(verify_block(k, 0, b), "{what}: wrong bytes for {k}");
        }
        let sres = within_limit("the stores", stores).await.unwrap();
        assert!(
            sres.failed.is_empty(),
            "{what}: stores failed: {:?}",
            sres.failed
        );
        tier.set_sweep_hook(None).unwrap();
        // the protected key: if its file is there now, no sweep takes it while guarded
        let there = is_regular(&tier.block_path(&ks[1]));
        tier.gc_sweep_for_space_now().unwrap();
        if there {
            assert!(
                is_regular(&tier.block_path(&ks[1])),
                "{what}: a guarded key's file was swept"
            );
        }
        drop(guard);
        load_verified(&tier, &ks, &what).await;
        settle(&tier);
        drain_log(&tier, &mut log);
        check_events(&tier, &log, &ks, &HashSet::new(), &what);
        check_stats(&tier, root.path(), &what);
        let s = gc_stats(&tier);
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
        let tier = open_cfg(leaf_cap_cfg(root.path(), 10, 1000.0, false), BS);
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
        truncate_file(&p(1), 100);
        std::fs::remove_file(p(2)).unwrap();
        std::fs::create_dir(p(2)).unwrap();
        std::fs::remove_file(p(3)).unwrap();
        std::os::unix::fs::symlink(p(13), p(3)).unwrap();
        // non-victims: 9 rm, 10 truncated, 11 a directory, 12 a symlink to key 14
        std::fs::remove_file(p(9)).unwrap();
        truncate_file(&p(10), 100);
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
                is_regular(&p(i)),
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
        drain_log(&tier, &mut log);
        check_events(&tier, &log, &ks, &HashSet::new(), &what);
        check_stats(&tier, root.path(), &what);
        let s = gc_stats(&tier);
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
        let mut c = leaf_cap_cfg(&root, 10, 1000.0, false);
        c.checksum = Checksum::Crc32c;
        if sidecars {
            // ramfs keeps no blocks for directories; a block and its sidecar a page each
            c.gc_max_size_gb = Some((10 * 2 * BS) as f64 / GIB);
            c.gc_low_watermark = Some(0.8);
        }
        let tier = open_cfg(c, BS);
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
                set_crc_xattr(&tier.block_path(&ks[i]), b"xy");
            }
        }
        for i in [1usize, 11] {
            if sidecars {
                std::fs::write(side(&ks[i]), b"garbage that is no checksum").unwrap();
            } else {
                set_crc_xattr(&tier.block_path(&ks[i]), &[1, 2, 3, 4]);
            }
        }
        let (_, got) = within_limit("the load", load(&*tier, &ks)).await;
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
        drain_log(&tier, &mut log);
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
        let s = gc_stats(&tier);
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
        let mut ca = leaf_cap_cfg(root.path(), 16, 1000.0, false);
        ca.checksum = Checksum::Crc32c;
        ca.gc_grace_s = Some(0.002);
        ca.gc_stamp_interval_s = Some(0.001);
        let a = open_cfg(ca.clone(), BS);
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
        let b = open_cfg(cb, BS);
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
                    std::thread::sleep(Duration::from_millis(2)); // the GC steps' pace
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
                    let r = fs_store(&*t, keys, 0).await;
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
            within_limit("a writer", t).await.unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        join(&gc_thread, "the GC driver");
        within_limit("the other's shutdown", b.shutdown())
            .await
            .unwrap();
        drop(b);
        settle(&a);
        let mut log = Vec::new();
        drain_log(&a, &mut log);
        assert_eq!(a.events_dropped(), 0, "{what}");
        for (i, k) in pool.iter().enumerate() {
            let last = log
                .iter()
                .rev()
                .find(|e| e.keys.contains(k))
                .map(|e| e.removed);
            if last == Some(false) {
                assert!(
                    is_regular(&a.block_path(k)),
                    "{what}: key {i}: last event stored, no file"
                );
            }
        }
        check_stats(&a, root.path(), what);
        let s = gc_stats(&a);
        if !other_bounded {
            assert_eq!(
                s.external_removals, 0,
                "{what}: the other instance deletes nothing: {s:?}"
            );
        }
        // every file there loads, verified
        let n = pool.iter().filter(|k| is_regular(&a.block_path(k))).count();
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
    let c = leaf_cap_cfg(root.path(), 10, 1000.0, false);
    let all: Vec<BlockKey> = (0..40).map(leaf_key).collect();
    // phase 1: 20 aged keys, a sweep, an external rm found by a rescan
    let tier = open_cfg(c.clone(), BS);
    let paths: Vec<PathBuf> = all.iter().map(|k| tier.block_path(k)).collect();
    let mut log = Vec::new();
    let ks1 = stored_aged(&tier, 10, &[]).await;
    assert!(fs_store(&*tier, &all[10..20], 0).await.is_success());
    age(&tier, &all[10..20], |i| 5000 - i as u64 * 10);
    std::fs::remove_file(tier.block_path(&ks1[9])).unwrap();
    settle(&tier);
    drain_log(&tier, &mut log);
    check_events(&tier, &log, &all, &HashSet::new(), "phase 1");
    check_stats(&tier, root.path(), "phase 1");
    assert_eq!(
        gc_stats(&tier).external_removals,
        1,
        "phase 1: {:?}",
        gc_stats(&tier)
    );
    tier.shutdown().await.unwrap();
    drop(tier);
    // while down: one file removed, one truncated
    let survivors: Vec<&PathBuf> = paths.iter().filter(|p| is_regular(p)).collect();
    assert!(
        survivors.len() >= 3,
        "phase 1 left {} files",
        survivors.len()
    );
    std::fs::remove_file(survivors[0]).unwrap();
    truncate_file(survivors[1], 10);
    // phase 2: reopened; what is there predates the open
    for phase in 2..4 {
        let what = format!("phase {phase}");
        let tier = open_cfg(c.clone(), BS);
        let mut log = Vec::new();
        let predating: HashSet<BlockKey> = all
            .iter()
            .copied()
            .filter(|k| is_regular(&tier.block_path(k)))
            .collect();
        check_stats(&tier, root.path(), &format!("{what}, at open"));
        // new keys, stored young; the old ones are older and go first
        let new: Vec<BlockKey> = all[20 + (phase - 2) * 10..30 + (phase - 2) * 10].to_vec();
        assert!(fs_store(&*tier, &new, 0).await.is_success());
        // an external rm of a predating file, found by the rescan
        let victim = predating
            .iter()
            .copied()
            .find(|k| is_regular(&tier.block_path(k)) && !new.contains(k))
            .expect("a predating file");
        std::fs::remove_file(tier.block_path(&victim)).unwrap();
        settle(&tier);
        load_verified(&tier, &all, &what).await;
        settle(&tier);
        drain_log(&tier, &mut log);
        check_events(&tier, &log, &all, &predating, &what);
        check_stats(&tier, root.path(), &what);
        let s = gc_stats(&tier);
        assert_eq!(
            s.external_removals, 1,
            "{what}: one file was deleted behind this tier's back: {s:?}"
        );
        within_limit("shutdown", tier.shutdown()).await.unwrap();
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
    let mut c = leaf_cap_cfg(root.path(), 24, 1.05, true);
    c.gc_grace_s = Some(0.002);
    c.gc_stamp_interval_s = Some(0.001);
    c.gc_rescan_interval_s = Some(1.0);
    let tier = open_cfg(c, BS);
    let pool: Arc<Vec<BlockKey>> = Arc::new((0..64).map(leaf_key).collect());
    let keep = pool[0];
    assert!(fs_store(&*tier, &[keep], 0).await.is_success());
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
                std::thread::sleep(Duration::from_millis(3)); // the GC steps' pace
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
                std::thread::sleep(Duration::from_millis(7)); // the vandal's pace
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
                        let r = fs_store(&*t, keys, 0).await;
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
        within_limit("a worker", t).await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    join(&gc_driver, "the GC driver");
    join(&vandal, "the vandal");
    // quiet: what the vandal truncated is found by loads, what it removed by rescans
    load_verified(&tier, &pool, "soak").await;
    settle(&tier);
    let mut log = Vec::new();
    drain_log(&tier, &mut log);
    assert!(
        is_regular(&tier.block_path(&keep)),
        "the protected key's file is gone"
    );
    assert_eq!(
        removals_of(&log, &keep),
        0,
        "the protected key reported removed"
    );
    check_events(&tier, &log, &pool, &HashSet::new(), "soak");
    check_stats(&tier, root.path(), "soak");
    let s = gc_stats(&tier);
    let d = deleted.load(Ordering::Relaxed);
    assert!(
        s.external_removals <= d,
        "{} external removals counted, the test deleted {d} files: {s:?}",
        s.external_removals
    );
    assert_eq!(s.errors, 0, "{s:?}");
    drop(guard);
    within_limit("shutdown", tier.shutdown()).await.unwrap();
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
                open_cfg(leaf_cap_cfg(root.path(), 10, 1000.0, false), BS)
            } else {
                open_cfg(cfg(root.path()), BS)
            };
            let ks: Vec<BlockKey> = (0..15).map(leaf_key).collect();
            assert!(fs_store(&*tier, &ks, 0).await.is_success());
            tier.take_events();
            truncate_file(&tier.block_path(&ks[12]), 100);
            let mut hs = Vec::new();
            for _ in 0..8 {
                let t = tier.clone();
                let k = ks[12];
                hs.push(tokio::spawn(async move { load(&*t, &[k]).await }));
            }
            for h in hs {
                within_limit("a load", h).await.unwrap();
            }
            assert!(!is_regular(&tier.block_path(&ks[12])));
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
        within_limit("store", fs_store(&*tier, &ks[12..13], 0))
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
    assert!(is_regular(&tier.block_path(&ks[12])));
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
        within_limit("store", fs_store(&*tier, &ks[12..13], 0))
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
    assert!(is_regular(&tier.block_path(&ks[12])));
    assert_eq!(seq.last(), Some(&false), "{seq:?}");
    settle(&tier);
    check_stats(&tier, _r.path(), "h");
}

/// A block's bytes whose last reference is dropped only when the test says so: the store
/// that wrote them is held there, after it published and indexed the block.
struct HeldBytes {
    buf: kv_tier_core::AlignedBuf,
    at: std::sync::mpsc::Sender<()>,
    go: Mutex<std::sync::mpsc::Receiver<()>>,
}

impl AsRef<[u8]> for HeldBytes {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_slice()
    }
}

impl Drop for HeldBytes {
    fn drop(&mut self) {
        let _ = self.at.send(());
        let _ = self.go.lock().unwrap().recv_timeout(HOOK_DEADLINE);
    }
}

/// A store reports its block stored in the step that indexes it: a load that finds the file
/// gone right after (deleted behind the tier's back before the store's job even ended) takes
/// the entry out after that, so its removal comes after the `BlockStored`, and the key's last
/// event says what the disk says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_found_gone_just_after_its_store_indexed_it_ends_removed() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let k = test_key(7);
    let (at_tx, at_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel();
    let mut buf = kv_tier_core::AlignedBuf::zeroed(BS);
    kv_tier_testkit::fill_block(&k, 0, buf.as_mut_slice());
    let src = kv_tier_core::BlockSource::from_owner(HeldBytes {
        buf,
        at: at_tx,
        go: Mutex::new(go_rx),
    });
    let store = {
        let t = tier.clone();
        tokio::spawn(async move {
            let job = kv_tier_core::StoreJob {
                links: Vec::new(),
                requests: Vec::new(),
                blocks: vec![(k, src)],
            };
            t.store(job).await
        })
    };
    // the store's I/O thread drops the bytes once they are written and published
    tokio::task::spawn_blocking(move || at_rx.recv_timeout(HOOK_DEADLINE))
        .await
        .unwrap()
        .expect("the store never dropped its bytes");
    assert!(
        is_regular(&tier.block_path(&k)),
        "published before the drop"
    );
    std::fs::remove_file(tier.block_path(&k)).unwrap();
    let (r, _) = load(&*tier, &[k]).await;
    assert!(!r.is_success());
    go_tx.send(()).unwrap();
    assert!(within_limit("the store", store).await.unwrap().is_success());
    settle(&tier);
    let ev = tier.take_events();
    let seq: Vec<bool> = ev
        .iter()
        .filter(|e| e.keys.contains(&k))
        .map(|e| e.removed)
        .collect();
    assert_eq!(seq, vec![false, true], "stored, then removed: {ev:?}");
}
