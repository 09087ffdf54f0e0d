//! The background GC thread: woken by a store, a load or a rescan that finds the tier over its
//! cap (and only then), surviving panics in and outside its step; an unbounded tier has none.

use std::sync::{Arc, mpsc};
use std::time::Duration;

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_fs::{FsTier, SweepPoint};
use kv_tier_testkit::fixtures::files::allocation_units;
use kv_tier_testkit::wait::{SETTLE_LIMIT, poll_until, poll_until_async, wait_until};
use kv_tier_testkit::{find_files, temp_root, test_key};

use crate::support::*;

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
    let ks = stored_aged(&tier, 15, &[]).await;
    wait_until("a GC panic", SETTLE_LIMIT, || gc_stats(&tier).errors >= 1);
    assert!(gc_stats(&tier).thread_alive, "the GC thread died quietly");
    tier.set_sweep_hook(None).unwrap();
    // (a sweep that read its candidates before the ageing may end with nothing swept: what
    // the thread must do is reach the low watermark by a later sweep; the index drops when a
    // sweep decides, the counters move when its unlinks are done)
    wait_until("a sweep to reach the low watermark", SETTLE_LIMIT, || {
        let s = gc_stats(&tier);
        s.files == 8 && s.swept_files >= 7
    });
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| i >= 7).collect::<Vec<_>>(),
        "{:?}",
        gc_stats(&tier)
    );
    tier.shutdown().await.unwrap();
    assert!(!gc_stats(&tier).thread_alive);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_that_crosses_the_cap_wakes_the_gc() {
    let root = temp_root();
    let mut c = hand_swept_cfg(root.path(), 10, 0.8);
    c.gc_background = true; // interval stays at an hour
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks = leaf_keys(0..10);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 5000 - i as u64);
    assert!(fs_store(&tier, &leaf_keys(50..55), 0).await.is_success());
    // 15 blocks were stored against a cap of 10: sweeps woken by the stores keep it within
    wait_until("the woken sweep", SETTLE_LIMIT, || {
        // (sizes drop when a sweep decides; the counters move when its unlinks are done)
        let s = gc_stats(&tier);
        s.bytes <= s.cap_bytes && s.swept_files >= 5
    });
    assert!(gc_stats(&tier).sweeps >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_tier_has_no_gc() {
    let root = temp_root();
    let tier = open(root.path());
    assert!(tier.stats().gc.is_none());
    tier.touch(&leaf_keys(0..3));
    assert!(tier.gc_sweep_now().is_err());
    assert!(find_files(root.path(), ".bin").is_empty());
}

/// Blocks another process wrote, found by this tier's loads, count toward the cap at once: a
/// load that takes the total past the cap wakes the sweep (whose own interval is an hour).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_blocks_seen_past_the_cap_wake_the_sweep() {
    let root = temp_root();
    let mut c = hand_swept_cfg(root.path(), 10, 0.8);
    c.gc_background = true;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks = leaf_keys(0..10);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 5000 - i as u64);
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let foreign = leaf_keys(50..55);
    assert!(fs_store(&other, &foreign, 0).await.is_success());
    let (res, _) = load(&tier, &foreign).await;
    assert!(res.is_success());
    wait_until("the woken sweep", SETTLE_LIMIT, || {
        let s = gc_stats(&tier);
        s.bytes <= s.cap_bytes && s.swept_files >= 5
    });
}

/// The GC is woken when the tier goes over its cap, not before: at the cap is within it,
/// and neither a rescan nor a load of another process's block wakes it below the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gc_is_woken_over_the_cap_only() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let ks = leaf_keys(0..10);
    // (a batch's stores each reserve room for a new leaf's directories while in flight, so
    // they may wake the GC on the way: the count starts after them)
    assert!(fs_store(&tier, &ks[..9], 0).await.is_success());
    assert!(fs_store(&other, &ks[9..], 0).await.is_success());
    let kicks = gc_stats(&tier).kicks;
    let (res, _) = load(&tier, &ks[9..]).await; // learned: the tier is at its cap
    assert!(res.is_success());
    let s = gc_stats(&tier);
    assert_eq!(s.bytes, s.cap_bytes, "{s:?}");
    tier.gc_rescan_now().unwrap();
    assert_eq!(gc_stats(&tier).kicks, kicks, "woken at the cap");
    assert!(fs_store(&tier, &leaf_keys(10..11), 0).await.is_success());
    assert_eq!(gc_stats(&tier).kicks, kicks + 1, "not woken past the cap");
}

/// A panic in the GC loop outside its step restarts the loop; the tier stays bounded and says
/// so in its stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gc_loop_that_panics_outside_its_step_is_restarted() {
    let root = temp_root();
    let mut c = capped_no_thread_cfg(root.path(), 1 << 30);
    c.gc_background = true;
    c.gc_interval_s = Some(0.01);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let (tx, rx) = mpsc::channel();
    let tx = std::sync::Mutex::new(Some(tx));
    tier.set_sweep_hook(Some(Arc::new(move |p| {
        if p == SweepPoint::Tick {
            let first = tx.lock().unwrap().take();
            if let Some(tx) = first {
                tx.send(()).unwrap();
                panic!("injected panic outside the GC step");
            }
        }
    })))
    .unwrap();
    rx.recv_timeout(HOOK_DEADLINE)
        .expect("the sweep hook was never reached");
    // the restart waits a second before it loops again (polled, bounded)
    poll_until(Duration::from_secs(60), || {
        gc_stats(&tier).thread_restarts == 1
    });
    let s = gc_stats(&tier);
    assert_eq!(s.thread_restarts, 1, "{s:?}");
    assert!(s.thread_alive, "the GC thread died");
    // and it works: stamps are applied by the restarted loop
    let k = test_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&[k]);
    poll_until(SETTLE_LIMIT, || gc_stats(&tier).stamps >= 1);
    assert!(
        gc_stats(&tier).stamps >= 1,
        "the restarted loop does no work"
    );
    tier.shutdown().await.unwrap();
    assert!(!gc_stats(&tier).thread_alive);
}

/// A rescan that finds the tier over its cap (files another process wrote) wakes the GC
/// thread, which sweeps without waiting for its interval (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_that_finds_the_tier_over_its_cap_wakes_the_gc() {
    let root = temp_root();
    let mut c = hand_swept_low_blocks_cfg(root.path(), 4, 2);
    c.gc_background = true;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let ks: Vec<BlockKey> = (0..8).map(leaf_key).collect();
    assert!(fs_store(&other, &ks, 0).await.is_success());
    for k in &ks {
        // used long ago: outside the grace window
        let f = std::fs::File::options()
            .write(true)
            .open(tier.block_path(k))
            .unwrap();
        f.set_modified(std::time::SystemTime::now() - Duration::from_secs(1000))
            .unwrap();
    }
    assert_eq!(gc_stats(&tier).sweeps, 0);
    tier.gc_rescan_now().unwrap();
    wait_until("a sweep", HOOK_DEADLINE, || gc_stats(&tier).sweeps >= 1);
    wait_until("the files to go", HOOK_DEADLINE, || {
        gc_stats(&tier).files == 2
    });
    tier.shutdown().await.unwrap();
}

/// README table, `gc_rescan_interval_s`: "full rescans that repair drift"; `GcStats::kicks`:
/// "Times a store, a load or a rescan found the tier over its cap and woke the GC"; README:
/// "past halfway to the hard ceiling grace yields"; "Set, the tier keeps what it holds on disk
/// under the cap".
///
/// Block files copied into the tree by another process (fresh mtimes, within the default
/// grace) take the rank directory to ~2.5x the cap. The background GC (rescan every second,
/// the minimum) must bring `du` back to the cap within 30 s, and the index must match `du`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_copies_over_the_cap_are_adopted_and_swept() {
    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir;
    let cap = 40 * per_block;
    let mut c = capped_cfg(root.path(), cap);
    c.gc_interval_s = Some(0.05);
    c.gc_rescan_interval_s = Some(1.0);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    // Sweeps wait while the copies are made: a rescan on a loaded machine may adopt the first
    // copies before the last, and a sweep then could remove an original before it is copied.
    let copying = Arc::new(std::sync::RwLock::new(()));
    let gate = copying.clone();
    tier.set_sweep_hook(Some(Arc::new(move |p| {
        if p == SweepPoint::Selected {
            drop(gate.read());
        }
    })))
    .unwrap();
    let keys: Vec<_> = (0..30).map(|i| test_key(13_000_000 + i)).collect();
    assert!(store_sized(&tier, &keys, BS).await.is_success());
    let held = copying.write().unwrap();
    for i in 0..70u64 {
        let src = tier.block_path(&keys[(i % 30) as usize]);
        let dst = tier.block_path(&test_key(13_100_000 + i));
        std::fs::create_dir_all(dst.parent().unwrap()).unwrap();
        std::fs::copy(&src, &dst).unwrap();
    }
    let peak = du(root.path());
    drop(held);
    assert!(peak > 2 * cap, "{peak} vs {cap}");
    let ok = poll_until_async(SETTLE_LIMIT, || du(root.path()) <= cap).await;
    let s = gc_stats(&tier);
    assert!(
        ok,
        "30 s after copies to {peak} bytes, du is {} over a cap of {cap}: {s:?}",
        du(root.path())
    );
    assert!(s.rescans > 0 && s.kicks > 0, "{s:?}");
    tier.shutdown().await.unwrap();
    let s = gc_stats(&tier);
    assert_eq!(s.bytes, du(root.path()), "{s:?}");
    assert_eq!(s.files as usize, bins(root.path()).len(), "{s:?}");
}
