//! Shutdown and drop: later jobs fail cleanly, joining the tier's threads never blocks an async
//! worker, a dropped tier creates nothing afterwards, and a shutdown while the GC is mid-sweep or
//! held at a hook is prompt and leaves the disk accounted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{FsOp, FsTier, SweepPoint};
use kv_tier_testkit::wait::{SETTLE_LIMIT, poll_until_async, wait_until, wait_until_async};
use kv_tier_testkit::{temp_root, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_fails_later_jobs_cleanly() {
    let root = temp_root();
    let tier = open(root.path());
    tier.shutdown().await.unwrap();
    let res = fs_store(&tier, &[test_key(1)], 0).await;
    assert!(matches!(res.failed[0].1, Error::Shutdown { .. }));
    assert!(tier.lookup(&[test_key(1)]).await.is_err());
}

/// Dropping a tier stops the thread that pre-creates its top directories: nothing is created
/// in the root afterwards, so the root can be removed (before, each short-lived tier could
/// leave its 4,096 directories behind in a temp dir being removed).
#[test]
fn a_dropped_tier_creates_nothing_afterwards() {
    for _ in 0..20 {
        let root = temp_root();
        let path = root.path().to_path_buf();
        drop(open(&path));
        root.close().expect("the root could not be removed");
        assert!(!path.exists());
    }
}

/// `shutdown` on a one-worker runtime while an I/O thread is busy with a block that only a
/// task on that worker can finish: the join must not block the worker.
#[test]
fn shutdown_does_not_block_the_async_worker() {
    current_thread_runtime().block_on(async {
        let root = temp_root();
        let tier = open(root.path());
        let held = hold_writes(&tier, FsOp::Write);
        let k = [test_key(1)];
        let mut job = Box::pin(fs_store(&tier, &k, 0));
        assert!(futures::poll!(&mut job).is_pending());
        held.entered.notified().await; // an I/O thread is inside the write
        let tx = held.release.clone();
        tokio::spawn(async move {
            let _ = tx.send("task");
        });
        tier.shutdown().await.unwrap();
        let _ = job.await;
        assert_eq!(
            *held.released_by.lock().unwrap(),
            Some("task"),
            "shutdown blocked the runtime's only worker while joining"
        );
    });
}

/// The same for dropping the tier.
#[test]
fn dropping_the_tier_does_not_block_the_async_worker() {
    current_thread_runtime().block_on(async {
        let root = temp_root();
        let tier = open(root.path());
        let held = hold_writes(&tier, FsOp::Write);
        let k = [test_key(1)];
        let mut job = Box::pin(fs_store(&tier, &k, 0));
        assert!(futures::poll!(&mut job).is_pending());
        held.entered.notified().await;
        drop(job);
        let tx = held.release.clone();
        let released = tokio::spawn(async move {
            let _ = tx.send("task");
        });
        drop(tier);
        released.await.unwrap();
        // the helper thread joins the I/O thread once the write is released
        wait_until_async("the held write to be released", SETTLE_LIMIT, || {
            held.released_by.lock().unwrap().is_some()
        })
        .await;
        assert_eq!(*held.released_by.lock().unwrap(), Some("task"));
    });
}

/// README: "`shutdown` stops it [the GC thread] promptly, and joins the tier's threads on
/// tokio's blocking pool"; ARCHITECTURE.md: "a sweep that panics mid-way re-indexes the victims
/// whose files remain" (consistency of an interrupted sweep).
///
/// A background sweep of 2000 blocks, each decision slowed to 20 ms by the sweep hook (40 s
/// in all, a slow disk's worth): shutdown called mid-sweep must return within 30 s, and afterwards the
/// index matches the disk and every removal event names a file that is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_during_a_long_sweep_is_prompt() {
    let root = temp_root();
    {
        let t = FsTier::open(
            "fs",
            capped_hand_swept_cfg(root.path(), 100 << 20),
            ns(),
            BS,
        )
        .unwrap();
        for j in 0..40u64 {
            let ks: Vec<_> = (0..50).map(|x| test_key(20_000_000 + j * 50 + x)).collect();
            assert!(store_sized(&t, &ks, BS).await.is_success());
        }
        t.shutdown().await.unwrap();
    }
    let mut c = capped_cfg(root.path(), 1 << 20);
    c.gc_interval_s = Some(1.0);
    c.gc_stamp_interval_s = Some(0.001);
    c.gc_grace_s = Some(0.002);
    c.gc_low_watermark = Some(1e-9);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let in_sweep = Arc::new(AtomicBool::new(false));
    let f = in_sweep.clone();
    tier.set_sweep_hook(Some(Arc::new(move |p| {
        if let SweepPoint::BeforeDelete(_) = p {
            f.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(20)); // a slow disk's decision
        }
    })))
    .unwrap();
    let i = in_sweep.clone();
    assert!(
        poll_until_async(SETTLE_LIMIT, || i.load(Ordering::SeqCst)).await,
        "the GC never swept: {:?}",
        gc_stats(&tier)
    );
    // well inside the sweep (any moment of its 40 s does; this one is a few decisions in)
    tokio::time::sleep(Duration::from_millis(200)).await;
    let t0 = Instant::now();
    let r = tokio::time::timeout(Duration::from_secs(180), tier.shutdown()).await;
    let took = t0.elapsed();
    let left = bins(root.path()).len();
    eprintln!("shutdown took {took:?}; {left} of 2000 block files left");
    assert!(r.is_ok(), "shutdown hung past 180 s");
    assert!(
        took < Duration::from_secs(30),
        "shutdown during a sweep took {took:?}: {:?}",
        gc_stats(&tier)
    );
    let s = gc_stats(&tier);
    assert!(!s.thread_alive, "{s:?}");
    let mut ev = Vec::new();
    drain_events(&tier, &mut ev);
    for (k, removed) in &ev {
        if *removed {
            assert!(
                !tier.block_path(k).exists(),
                "reported removed, still on disk"
            );
        }
    }
    assert_eq!(s.files as usize, bins(root.path()).len(), "{s:?}");
    assert_eq!(s.bytes, du(root.path()), "{s:?}");
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
        let mut c = leaf_cap_cfg(root.path(), 10, 1000.0, which != 4);
        c.tmpfile_publish = false;
        c.gc_rescan_interval_s = Some(if which == 2 { 1.0 } else { 0.0 });
        c.gc_stamp_interval_s = Some(0.001);
        c.gc_grace_s = Some(0.002);
        // the background GC must not sweep before the hook is in
        c.gc_max_size_gb = Some(1.0);
        let tier = open_cfg(c.clone(), BS);
        let ks: Vec<BlockKey> = (0..15).map(leaf_key).collect();
        assert!(fs_store(&*tier, &ks, 0).await.is_success());
        drop(tier.shutdown().await);
        drop(tier);
        // reopened with the small cap, the background GC held where the test wants it
        let c = {
            let mut s = leaf_cap_cfg(root.path(), 10, 1000.0, which != 4);
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
        let tier = open_cfg(c.clone(), BS);
        // old enough to be swept (a sweep run at once would find them within grace)
        age(&tier, &ks, |i| 1000 + i as u64);
        let (at_rx, go_tx) = hook_at(&tier, point);
        let extra: Vec<BlockKey> = (100..130).map(leaf_key).collect();
        assert!(fs_store(&*tier, &extra[..10], 0).await.is_success());
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
                gc_stats(&tier)
            );
        }
        // stores in flight during the shutdown
        let inflight = {
            let t = tier.clone();
            let k = extra[10..].to_vec();
            tokio::spawn(async move { fs_store(&*t, &k, 0).await })
        };
        let shutting = Arc::new(AtomicBool::new(false));
        let releaser = {
            let shutting = shutting.clone();
            on_thread(move || {
                wait_until("the shutdown to begin", SETTLE_LIMIT, || {
                    shutting.load(Ordering::Acquire)
                });
                // the shutdown's window to reach the held step (it waits there, unseen)
                std::thread::sleep(Duration::from_millis(200));
                let _ = go_tx.send(());
                drop(go_tx);
            })
        };
        shutting.store(true, Ordering::Release);
        let r = within_limit(&format!("{what}: shutdown"), tier.shutdown()).await;
        assert!(r.is_ok(), "{what}: shutdown failed: {r:?}");
        join(&releaser, "the releaser");
        if let Some(m) = manual {
            join(&m, "the manual sweep");
        }
        let _ = within_limit("the store in flight", inflight).await;
        assert!(
            !gc_stats(&tier).thread_alive,
            "{what}: the GC thread still runs"
        );
        let tmps = regular_files(root.path(), ".tmp");
        assert!(tmps.is_empty(), "{what}: temp files left: {tmps:?}");
        drop(tier);
        let mut c2 = c.clone();
        c2.gc_background = false;
        let again = open_cfg(c2, BS);
        check_stats(&again, root.path(), &format!("{what}, reopened"));
        again.shutdown().await.unwrap();
    }
}
