//! Protection: a key guarded by `protect()` or by a job in flight is never swept while it is
//! (whenever the guard came, before or after the sweep's decision), `protect()` waits out an
//! unlink of its own key under way and only that, and released keys go first.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_fs::{FsOp, FsTier, SweepPoint};
use kv_tier_testkit::fixtures::files::{Mount, allocation_units};
use kv_tier_testkit::wait::{SETTLE_LIMIT, poll_until_async};
use kv_tier_testkit::{load_keys, temp_root, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_blocks_stay_and_go_first_once_released() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = stored_aged(&tier, 15, &[]).await;
    let guard = tier.protect(&ks[..3]);
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| !(3..10).contains(&i)).collect::<Vec<_>>()
    );
    assert_eq!(gc_stats(&tier).skipped_in_flight, 3);
    drop(guard);
    let fresh = leaf_keys(100..105);
    assert!(fs_store(&tier, &fresh, 0).await.is_success());
    assert_eq!(gc_stats(&tier).files, 13);
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
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = stored_aged(&tier, 15, &[]).await;
    let g1 = tier.protect(&ks[..1]);
    let g2 = tier.protect(&ks[..1]);
    drop(g1);
    tier.gc_sweep_now().unwrap();
    assert!(tier.block_path(&ks[0]).exists());
    drop(g2);
}

/// The reference's race: a key protected by a store in flight is decided under the same lock
/// as its unlink. Held at `Selected`, the sweep then meets the protection and keeps the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_in_flight_during_a_sweep_keeps_its_file() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
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

/// A store that protects a key the sweep has already decided to delete (its unlink pending)
/// keeps it: protection is checked again right before each unlink. The store waits for the
/// sweep's decision to settle, then finds the file and reports it stored; the file stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_during_the_unlink_keeps_the_file() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking); // keys 0..7 are decided, their files still on disk
    assert!(tier.block_path(&ks[0]).exists());
    let t = tier.clone();
    let k0 = ks[0];
    let mut put = tokio::spawn(async move { fs_store(&*t, &[k0], 5).await });
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
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.3));
    let ks = stored_aged(&tier, 15, &[]).await; // down to 3 of 10: keys 0..12 are decided
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
    assert_eq!(gc_stats(&tier).files, 11);
    assert_eq!(gc_stats(&tier).bytes, held(root.path(), 11));
    tier.set_sweep_hook(None).unwrap();
    drop(guard);
    assert_eq!(tier.gc_sweep_now().unwrap(), 8);
}

/// `protect()` of a key whose unlink is under way returns only once the unlink has ended:
/// after it returns, the file is gone (it was decided before the protection) and no unlink
/// of the key can start while the guard lives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protect_waits_out_an_unlink_under_way() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
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

/// A key protected after the sweep decided on it, and before its unlink, is kept, and the
/// sweep reports it among the files it spared for jobs in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_protected_before_its_unlink_is_kept_and_counted() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking);
    let guard = tier.protect(&ks[..1]);
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 6, "the protected victim was deleted");
    tier.set_sweep_hook(None).unwrap();
    assert!(tier.block_path(&ks[0]).exists());
    let s = gc_stats(&tier);
    assert_eq!((s.skipped_in_flight, s.files), (1, 9), "{s:?}");
    drop(guard);
}

/// `protect()` waits only for an unlink of its own keys: while another key's unlink is under
/// way, protecting other keys returns at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protect_does_not_wait_for_other_keys_unlinks() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
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

/// A sweep that panics in the middle of a key's unlink (a bug; here a hook) leaves the key
/// unmarked: `protect()` of it returns instead of waiting for an unlink that never ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_that_panics_mid_unlink_leaves_protect_free() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
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
    assert_eq!(
        gc_stats(&tier).files,
        15,
        "the victims left the index for good"
    );
}

/// `SecondaryTier::protect`: "Keeps `keys` from being evicted while the guard lives"; README:
/// "past halfway to the hard ceiling grace yields (the oldest files go even within grace,
/// protected ones never)"; "once `protect()` has returned, no file of its keys is deleted
/// while the guard lives".
///
/// The oldest key is protected, then 16 tasks flood_jobs a 256 KiB cap with a tiny grace window
/// while a watcher checks its file every millisecond: it must never vanish and no removal
/// event may name it. Once the guard drops, it goes like any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_protected_key_survives_a_flood_and_goes_once_released() {
    let m = Mount::new("tmpfs", "size=64m");
    let cap = 256 << 10;
    let mut c = capped_cfg(&m.dir, cap);
    c.gc_interval_s = Some(0.01);
    c.gc_stamp_interval_s = Some(0.001);
    c.gc_grace_s = Some(0.002);
    let tier = open_cfg(c, BS);
    let k = test_key(9_000_000);
    assert!(store_sized(&tier, &[k], BS).await.is_success());
    let guard = tier.protect(&[k]);
    let p = tier.block_path(&k);
    let stop = Arc::new(AtomicBool::new(false));
    let vanished = Arc::new(AtomicUsize::new(0));
    let watcher = {
        let (stop, vanished, p) = (stop.clone(), vanished.clone(), p.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if !p.exists() {
                    vanished.fetch_add(1, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(1)); // the watcher's period
            }
        })
    };
    let out = flood_jobs(&tier, 16, 60, 8, BS, 9_100_000).await;
    stop.store(true, Ordering::Relaxed);
    watcher.join().unwrap();
    let mut ev = Vec::new();
    drain_events(&tier, &mut ev);
    let s = gc_stats(&tier);
    assert!(
        s.swept_files as usize > out.ok / 2,
        "the flood_jobs did not churn: {s:?}"
    );
    assert_eq!(
        vanished.load(Ordering::Relaxed),
        0,
        "the protected file vanished: {s:?}"
    );
    assert!(
        !ev.iter().any(|(kk, r)| *kk == k && *r),
        "a removal event names the protected key"
    );
    let (res, got) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success() && kv_tier_testkit::verify_block(&k, 0, &got[0].1));
    assert!(s.peak_bytes <= s.hard_ceiling_bytes, "{s:?}");
    drop(guard);
    // released, it goes like any other: stores keep the pressure on until a sweep takes it
    // (a tier under its cap sweeps nothing, so waiting without stores would wait in vain)
    let mut gone = false;
    for i in 0..200 {
        let ks: Vec<_> = (0..8).map(|x| test_key(9_900_000 + i * 8 + x)).collect();
        let _ = store_sized(&tier, &ks, BS).await;
        if poll_until_async(Duration::from_millis(50), || !p.exists()).await {
            gone = true;
            break;
        }
    }
    assert!(
        gone,
        "released, the oldest key is never evicted: {:?}",
        gc_stats(&tier)
    );
    tier.shutdown().await.unwrap();
}

/// README "Sweep": "skipping (and counting separately) keys protected by jobs in flight";
/// `gc_sweep_for_space_now`: "protected keys and files with a job in flight are spared";
/// `SecondaryTier::store`: "A store that reports success leaves a readable block".
///
/// A load of the oldest block held inside its read (a fault injector that waits), and a
/// store of the second oldest (present: a skip) held inside its write: sweeps (cap and
/// space) run meanwhile and must spare both; the load then returns the right bytes and the
/// store's success leaves its block readable.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn files_with_a_job_in_flight_are_not_evicted() {
    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir;
    let mut c = capped_hand_swept_cfg(root.path(), 10 * per_block);
    c.gc_low_watermark = Some(0.1);
    let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    let keys: Vec<_> = (0..30).map(|i| test_key(10_000_000 + i)).collect();
    for k in &keys {
        assert!(store_sized(&tier, &[*k], BS).await.is_success());
    }
    tier.advance_gc_clock(Duration::from_secs(10_000)).unwrap();
    let (a, b) = (keys[0], keys[1]);
    let (leaf_a, leaf_b) = (
        tier.block_path(&a).parent().unwrap().to_path_buf(),
        tier.block_path(&b).parent().unwrap().to_path_buf(),
    );
    assert_ne!(leaf_a, leaf_b);
    // (entered a, entered b, released)
    let gate = Arc::new((Mutex::new((false, false, false)), Condvar::new()));
    let g = gate.clone();
    tier.set_fault_injector(Some(Arc::new(move |op: FsOp, p: &Path| {
        let which = if matches!(op, FsOp::OpenRead | FsOp::Read) && p.starts_with(&leaf_a) {
            0
        } else if matches!(op, FsOp::CreateTmp | FsOp::Write | FsOp::Publish)
            && p.starts_with(&leaf_b)
        {
            1
        } else {
            return None;
        };
        let (m, cv) = &*g;
        let mut s = m.lock().unwrap();
        if which == 0 {
            s.0 = true
        } else {
            s.1 = true
        }
        cv.notify_all();
        let end = Instant::now() + Duration::from_secs(60);
        while !s.2 && Instant::now() < end {
            s = cv.wait_timeout(s, Duration::from_millis(50)).unwrap().0;
        }
        None
    })));
    let t1 = tier.clone();
    let load = tokio::spawn(async move { load_keys(&*t1, &[a], BS).await });
    let t2 = tier.clone();
    let store = tokio::spawn(async move { store_sized(&t2, &[b], BS).await });
    let g = gate.clone();
    assert!(
        poll_until_async(SETTLE_LIMIT, || {
            let s = g.0.lock().unwrap();
            s.0 && s.1
        })
        .await,
        "the jobs never reached their I/O"
    );
    let t3 = tier.clone();
    let (n1, n2) = tokio::task::spawn_blocking(move || {
        (
            t3.gc_sweep_now().unwrap(),
            t3.gc_sweep_for_space_now().unwrap(),
        )
    })
    .await
    .unwrap();
    let s = gc_stats(&tier);
    assert!(n1 > 0, "{s:?}");
    assert!(
        tier.block_path(&a).exists(),
        "a block being loaded was swept ({n1}, {n2}): {s:?}"
    );
    assert!(
        tier.block_path(&b).exists(),
        "a block being stored was swept ({n1}, {n2}): {s:?}"
    );
    assert!(s.skipped_in_flight >= 2, "{s:?}");
    {
        let (m, cv) = &*gate;
        m.lock().unwrap().2 = true;
        cv.notify_all();
    }
    let (res, got) = load.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(kv_tier_testkit::verify_block(&a, 0, &got[0].1));
    let res = store.await.unwrap();
    if res.is_success() {
        let (res, got) = load_keys(&*tier, &[b], BS).await;
        assert!(
            res.is_success(),
            "store reported ok, block not readable: {:?}",
            res.failed
        );
        assert!(kv_tier_testkit::verify_block(&b, 0, &got[0].1));
    }
    tier.set_fault_injector(None);
    assert!(
        !tier.is_protected(&a) && !tier.is_protected(&b),
        "the jobs ended, their keys are still protected"
    );
}

/// README "Sweep": "Right before each unlink the protection is checked again, atomically with
/// marking the key as unlinking, and `protect()` waits for an unlink in progress: once
/// `protect()` has returned, no file of its keys is deleted while the guard lives."
///
/// Background sweeps under constant pressure (tiny grace) while 6 tasks protect recently
/// stored keys at random: whenever the file exists right after `protect()` returned, it must
/// still exist when the guard is about to drop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_protect_returns_an_existing_file_stays_until_the_guard_drops() {
    let m = Mount::new("tmpfs", "size=64m");
    let cap = 128 << 10;
    let mut c = capped_cfg(&m.dir, cap);
    c.gc_interval_s = Some(0.01);
    c.gc_stamp_interval_s = Some(0.0005);
    c.gc_grace_s = Some(0.001);
    c.gc_low_watermark = Some(0.5);
    let tier = open_cfg(c, BS);
    let recent: Arc<Mutex<Vec<BlockKey>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let mut writers = Vec::new();
    for w in 0..4u64 {
        let (tier, recent, stop) = (tier.clone(), recent.clone(), stop.clone());
        writers.push(tokio::spawn(async move {
            let mut j = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let ks: Vec<_> = (0..4)
                    .map(|x| test_key(11_000_000 + w * 1_000_000 + j * 4 + x))
                    .collect();
                let res = store_sized(&tier, &ks, BS).await;
                let mut r = recent.lock().unwrap();
                r.extend(res.ok);
                let len = r.len();
                if len > 256 {
                    r.drain(..len - 256);
                }
                j += 1;
            }
        }));
    }
    let violations = Arc::new(Mutex::new(Vec::new()));
    let checks = Arc::new(AtomicUsize::new(0));
    let mut checkers = Vec::new();
    for c in 0..6u64 {
        let (tier, recent, v, checks) = (
            tier.clone(),
            recent.clone(),
            violations.clone(),
            checks.clone(),
        );
        checkers.push(std::thread::spawn(move || {
            for i in 0..3000u64 {
                let k = {
                    let r = recent.lock().unwrap();
                    if r.is_empty() {
                        None
                    } else {
                        Some(r[(mix(c * 100_000 + i) % r.len() as u64) as usize])
                    }
                };
                let Some(k) = k else {
                    // nothing stored yet: this round checks nothing, the next may
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                };
                let p = tier.block_path(&k);
                let g = tier.protect(&[k]);
                let before = p.exists();
                for _ in 0..(mix(i) % 200) {
                    std::hint::spin_loop();
                }
                if i % 3 == 0 {
                    // the guard held a while, as a job's I/O would hold it
                    std::thread::sleep(Duration::from_micros(mix(i) % 500));
                }
                let after = p.exists();
                drop(g);
                checks.fetch_add(1, Ordering::Relaxed);
                if before && !after {
                    v.lock().unwrap().push(k);
                }
            }
        }));
    }
    for c in checkers {
        c.join().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.unwrap();
    }
    let s = gc_stats(&tier);
    let v = violations.lock().unwrap().clone();
    assert!(s.swept_files > 100, "no pressure: {s:?}");
    assert!(
        v.is_empty(),
        "{} of {} protected files were deleted under their guard: {s:?}",
        v.len(),
        checks.load(Ordering::Relaxed)
    );
    tier.shutdown().await.unwrap();
}
