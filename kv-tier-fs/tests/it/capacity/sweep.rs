//! What a sweep deletes: above the cap only, oldest mtime first down to the low watermark,
//! files within grace spared until halfway to the hard ceiling (the window ending to the
//! nanosecond), only this rank's `.bin` files with their sidecars; a sweep that panics leaves
//! its victims sweepable.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kv_tier_core::{BlockKey, Namespace, RunFields, SecondaryTier};
use kv_tier_fs::{FsTier, SweepPoint};
use kv_tier_testkit::fixtures::files::allocation_units;
use kv_tier_testkit::{temp_root, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_cap_nothing_is_deleted() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = leaf_keys(0..10);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 10_000 - i as u64);
    assert_eq!(tier.gc_sweep_now().unwrap(), 0);
    assert!(present(&tier, &ks).iter().all(|&p| p));
    assert_eq!(gc_stats(&tier).bytes, held(root.path(), 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_cap_exactly_the_seven_oldest_go() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = stored_aged(&tier, 15, &[]).await;
    tier.take_events();
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    let p = present(&tier, &ks);
    assert_eq!(p, (0..15).map(|i| i >= 7).collect::<Vec<_>>());
    let s = gc_stats(&tier);
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
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = leaf_keys(0..15);
    assert!(fs_store(&tier, &ks, 0).await.is_success()); // fresh mtimes
    assert_eq!(tier.gc_sweep_now().unwrap(), 0);
    assert!(present(&tier, &ks).iter().all(|&p| p));
    let s = gc_stats(&tier);
    assert_eq!(s.skipped_in_grace, 15);
    assert!(s.bytes > s.cap_bytes, "knowingly left over the cap");
    assert_eq!(s.sweeps_over_cap, 1);
    // once the grace window has passed they are fair game
    tier.advance_gc_clock(Duration::from_secs(301)).unwrap();
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    assert_eq!(
        gc_stats(&tier).sweeps_over_cap,
        1,
        "a sweep that ended within the cap"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_bin_files_are_swept() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = stored_aged(&tier, 15, &[]).await;
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

/// The other order: the sweep deletes first, then a store finds no file and writes it again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_after_the_delete_rewrites_the_file() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = stored_aged(&tier, 15, &[]).await;
    tier.gc_sweep_now().unwrap();
    assert!(!tier.block_path(&ks[0]).exists());
    assert!(fs_store(&tier, &ks[..1], 0).await.is_success());
    assert!(load(&tier, &ks[..1]).await.0.is_success());
    assert_eq!(gc_stats(&tier).files, 9);
}

/// Real concurrency: writers store and re-store keys while sweeps run; every key whose store
/// returned success keeps its file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_stores_and_sweeps_never_lose_a_stored_block() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 40, 0.5));
    let old = leaf_keys(0..60);
    assert!(fs_store(&*tier, &old, 0).await.is_success());
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
        // re-store a few old leaf_keys (they may be mid-sweep) and add new ones
        let mut batch: Vec<BlockKey> = old
            .iter()
            .skip((round * 3) as usize % 60)
            .take(3)
            .copied()
            .collect();
        batch.extend(leaf_keys(1000 + round * 4..1000 + round * 4 + 4));
        let res = fs_store(&*tier, &batch, 0).await;
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

/// Past halfway from the cap to the hard ceiling, a sweep no longer spares the grace window
/// above the cap: it takes the oldest files, young or not, down to the cap. At exactly
/// halfway it still spares them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn past_halfway_to_the_hard_ceiling_grace_holds_only_down_to_the_cap() {
    let root = temp_root();
    // 16 blocks (one leaf and one top directory: 2 directories) are exactly halfway; they are
    // stored first with the ceiling out of the way (a job's first stores into a new leaf
    // each reserve its directories)
    let ks = leaf_keys(0..16);
    // halfway: 15 blocks' bytes and 1.5 times the directories
    let tier = with_ceiling(root.path(), &ks, 2.0).await;
    let s = gc_stats(&tier);
    assert_eq!(2 * s.bytes, s.cap_bytes + s.hard_ceiling_bytes, "{s:?}");
    assert_eq!(
        tier.gc_sweep_now().unwrap(),
        0,
        "young files went at halfway"
    );
    assert!(fs_store(&tier, &leaf_keys(16..17), 0).await.is_success());
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.bytes), (10, held(root.path(), 10)));
    assert!(s.grace_overridden > 0, "{s:?}");
}

/// The grace window ends exactly `gc_grace_s` after a file's last use: a nanosecond before,
/// the file is spared; at the boundary, it is fair game.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grace_window_ends_to_the_nanosecond() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8); // grace: 300 s
    tier.freeze_gc_clock().unwrap();
    let ks = leaf_keys(0..15);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    // last used at t = 61 s on the GC clock, on disk and in the index alike (a file's own
    // mtime is the wall clock's, past the frozen one)
    tier.advance_gc_clock(Duration::from_secs(61)).unwrap();
    tier.touch(&ks);
    tier.gc_apply_stamps_now().unwrap();
    tier.advance_gc_clock(Duration::from_secs(300) - Duration::from_nanos(1))
        .unwrap();
    assert_eq!(tier.gc_sweep_now().unwrap(), 0);
    assert_eq!(gc_stats(&tier).skipped_in_grace, 15);
    tier.advance_gc_clock(Duration::from_nanos(1)).unwrap();
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
}

/// A sweep that panics after deciding its victims and before unlinking them (a bug; here a
/// hook) leaves none of them marked as being deleted: a store of a victim ends instead of
/// waiting forever, and the victims whose files are still there are indexed again (they
/// count toward the cap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_that_panics_after_its_decisions_leaves_no_key_waiting() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
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
    assert_eq!(
        gc_stats(&tier).files,
        15,
        "the victims left the index for good"
    );
    let res = fs_store(&*tier, &[ks[0]], 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert_eq!(
        tier.gc_sweep_now().unwrap(),
        7,
        "the victims are sweepable again"
    );
}

/// A sweep deletes a block's checksum sidecar with the block, whatever the tier's mode: a
/// root written where user xattrs were missing keeps its checksums in sidecars, and a tier
/// that keeps them in xattrs must not leave those behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_deletes_a_victims_sidecar_in_any_mode() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8); // unchecked: no sidecars of its own
    let ks = stored_aged(&tier, 15, &[]).await;
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

/// README table: "`gc_low_watermark` ... a sweep deletes down to cap x watermark"; README
/// "Sweep": "oldest mtime first down to the watermark".
///
/// 120 blocks over a cap of ~100 (all out of grace): one sweep leaves the index and `du` at
/// or under cap x 0.5, deletes no more than one block's worth past it, and what it deleted is
/// exactly the oldest blocks (stored one at a time, so oldest = first stored).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_goes_down_to_the_low_watermark_oldest_first() {
    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir; // a random key: own leaf and, mostly, top
    let cap = 100 * per_block;
    let mut c = capped_hand_swept_cfg(root.path(), cap);
    c.gc_low_watermark = Some(0.5);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let keys: Vec<_> = (0..120).map(|i| test_key(6_000_000 + i)).collect();
    for k in &keys {
        assert!(store_sized(&tier, &[*k], BS).await.is_success());
    }
    let before = gc_stats(&tier);
    assert!(before.bytes > cap, "{before:?}");
    tier.advance_gc_clock(Duration::from_secs(10_000)).unwrap();
    let deleted = tier.gc_sweep_now().unwrap();
    let s = gc_stats(&tier);
    let low = (cap as f64 * 0.5) as u64;
    assert!(deleted > 0);
    assert!(
        s.bytes <= low,
        "not down to the watermark: {} > {low}: {s:?}",
        s.bytes
    );
    assert_eq!(
        s.bytes,
        du(root.path()),
        "index vs du after the sweep: {s:?}"
    );
    assert!(
        s.bytes + per_block + dir > low,
        "deleted far past the watermark: {} left, low {low}, per block {per_block}",
        s.bytes
    );
    let gone: Vec<bool> = keys.iter().map(|k| !tier.block_path(k).exists()).collect();
    let n_gone = gone.iter().filter(|g| **g).count();
    assert_eq!(n_gone, deleted, "files deleted vs reported");
    assert!(
        gone[..n_gone].iter().all(|g| *g) && gone[n_gone..].iter().all(|g| !*g),
        "not oldest first: {:?}",
        gone.iter().map(|g| *g as u8).collect::<Vec<_>>()
    );
}

/// README table, `gc_grace_s`: "files used within this window are spared by sweeps while the
/// total is within halfway from the cap to the hard ceiling"; README: "past halfway to the
/// hard ceiling grace yields (the oldest files go even within grace ...)"; config.rs: "past
/// that ... they go (oldest first) like any other", "(down to the cap)".
///
/// All files fresh (default grace 300 s), ceiling 2x: over the cap but under 1.5x, a sweep
/// deletes nothing; past 1.5x, a sweep brings the total to the cap or under, oldest first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grace_spares_within_halfway_and_yields_past_it() {
    let cap = leaf_cost(20).await;
    let root = temp_root();
    let mut c = capped_hand_swept_cfg(root.path(), cap);
    c.gc_hard_ceiling = Some(2.0);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let keys: Vec<_> = (0..40).map(leaf_key).collect();
    let mut n = 0;
    while gc_stats(&tier).bytes <= cap + cap / 10 {
        assert!(store_sized(&tier, &[keys[n]], BS).await.is_success());
        n += 1;
    }
    let s = gc_stats(&tier);
    assert!(s.bytes < cap + cap / 2, "{s:?}");
    assert_eq!(
        tier.gc_sweep_now().unwrap(),
        0,
        "grace files deleted within halfway: {:?}",
        gc_stats(&tier)
    );
    let s = gc_stats(&tier);
    assert!(s.skipped_in_grace > 0, "{s:?}");
    while gc_stats(&tier).bytes <= cap + cap / 2 + cap / 20 {
        assert!(store_sized(&tier, &[keys[n]], BS).await.is_success());
        n += 1;
    }
    let deleted = tier.gc_sweep_now().unwrap();
    let s = gc_stats(&tier);
    assert!(deleted > 0, "{s:?}");
    assert!(
        s.bytes <= cap,
        "past halfway the sweep should go down to the cap: {s:?}"
    );
    assert!(s.grace_overridden > 0, "{s:?}");
    let gone: Vec<bool> = keys[..n]
        .iter()
        .map(|k| !tier.block_path(k).exists())
        .collect();
    assert!(
        gone[..deleted].iter().all(|g| *g),
        "not oldest first: {gone:?}"
    );
    assert_eq!(s.bytes, du(root.path()), "{s:?}");
}

/// README "Accounting": "one walk at open adopts what is on disk (files written by other
/// processes or by vLLM included, with their mtimes; stray temp files are reaped in the same
/// walk)"; "Startup": "Stray `.tmp` files older than `tmp_reap_age_s` are deleted (in bounded
/// mode also those directly in the rank directory ...)"; `GcStats::foreign_files`: "left
/// alone, not counted toward the cap"; "Scope": "other models or ranks on the same root have
/// their own"; "Sweep": "oldest mtime first".
///
/// A root with blocks of rank 0 (mtimes set, oldest first), of rank 1 and of another model
/// (older still), foreign files in the rank directory (older still), stray old temp files
/// and empty directories. A bounded rank-0 tier opened on it sweeps exactly the oldest of its
/// own blocks and nothing else, and reaps the temp files.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lru_after_reopen_among_foreign_files_other_ranks_and_strays() {
    let root = temp_root();
    // rank 1 of the same model in a tensor-parallel layout (a parallel-agnostic namespace is
    // always rank 0)
    let mut tp = RunFields::new("test-org/test-model", "torch.float16", 16);
    tp.parallel_agnostic = false;
    tp.tp_size = 2;
    let ns1 = Namespace::new(tp, 1).unwrap();
    assert!(ns1.rank_dir_name().ends_with("_r1"));
    let other = Namespace::new(RunFields::new("other-org/other", "torch.float16", 16), 0).unwrap();
    let mut strangers = Vec::new();
    for (n, base) in [(ns1, 8_100_000u64), (other, 8_200_000)] {
        let t = FsTier::open("fs", cfg(root.path()), n, BS).unwrap();
        let ks: Vec<_> = (0..20).map(|i| test_key(base + i)).collect();
        assert!(store_sized(&t, &ks, BS).await.is_success());
        strangers.extend(ks.iter().map(|k| t.block_path(k)));
        t.shutdown().await.unwrap();
    }
    let mine: Vec<_> = (0..40).map(|i| test_key(8_000_000 + i)).collect();
    {
        let t = FsTier::open(
            "fs",
            capped_hand_swept_cfg(root.path(), 100 << 20),
            ns(),
            BS,
        )
        .unwrap();
        assert!(store_sized(&t, &mine, BS).await.is_success());
        t.shutdown().await.unwrap();
    }
    let t0 = FsTier::open(
        "fs",
        capped_hand_swept_cfg(root.path(), 100 << 20),
        ns(),
        BS,
    )
    .unwrap();
    let paths: Vec<_> = mine.iter().map(|k| t0.block_path(k)).collect();
    drop(t0);
    for (i, p) in paths.iter().enumerate() {
        set_mtime(p, 10_000 - 10 * i as u64);
    }
    for p in &strangers {
        set_mtime(p, 50_000);
    }
    let rd = rank_dir(root.path());
    let foreign = [
        rd.join("README.txt"),
        rd.join("foreign.bin"),
        rd.join("abc/de_g0/notahexname.bin"),
        rd.join("zzz/whatever.dat"),
    ];
    for f in &foreign {
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, vec![1u8; 9000]).unwrap();
        set_mtime(f, 90_000);
    }
    let leaf = paths[0].parent().unwrap();
    let tmps = [
        leaf.join(format!(
            "{}_abc123.tmp",
            paths[0].file_name().unwrap().to_string_lossy()
        )),
        rd.join("stray_xyz.tmp"),
    ];
    for f in &tmps {
        std::fs::write(f, vec![2u8; 4096]).unwrap();
        set_mtime(f, 7200);
    }
    std::fs::create_dir_all(rd.join("fff/ff_g0")).unwrap();
    std::fs::create_dir_all(rd.join("eee")).unwrap();

    let probe = FsTier::open(
        "fs",
        capped_hand_swept_cfg(root.path(), 100 << 20),
        ns(),
        BS,
    )
    .unwrap();
    let held = gc_stats(&probe).bytes;
    assert!(gc_stats(&probe).files == 40, "{:?}", gc_stats(&probe));
    drop(probe);
    let cap = held / 2;
    let tier = FsTier::open("fs", capped_hand_swept_cfg(root.path(), cap), ns(), BS).unwrap();
    let foreign_seen = gc_stats(&tier).foreign_files;
    for f in &tmps {
        assert!(
            !f.exists(),
            "stray temp {} older than tmp_reap_age_s survived a bounded open",
            f.display()
        );
    }
    let deleted = tier.gc_sweep_now().unwrap();
    let s = gc_stats(&tier);
    assert!(deleted > 0 && s.bytes <= (cap as f64 * 0.9) as u64, "{s:?}");
    let gone: Vec<bool> = paths.iter().map(|p| !p.exists()).collect();
    assert_eq!(gone.iter().filter(|g| **g).count(), deleted);
    assert!(
        gone[..deleted].iter().all(|g| *g),
        "not oldest first: {gone:?}"
    );
    for p in &strangers {
        assert!(
            p.exists(),
            "another rank's or model's block was deleted: {}",
            p.display()
        );
    }
    for f in &foreign {
        assert!(f.exists(), "a foreign file was deleted: {}", f.display());
    }
    let _ = foreign_seen; // counted by `foreign_files_are_counted_and_never_swept`
}
