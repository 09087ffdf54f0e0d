//! The bound on disk: stores never take the tier above its hard ceiling (floods sampled with
//! `statvfs`, odd block sizes, a ceiling of one, a cap of one block, caps at their documented
//! minimum, caps larger than the disk, a growing leaf directory); a store at the ceiling makes
//! room first, or fails with `NoSpace` when everything left is protected or being swept.

use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, mpsc};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{FsTier, SweepPoint};
use kv_tier_testkit::fixtures::files::{Mount, allocation_units, statvfs_used};
use kv_tier_testkit::{allocated_bytes, load_keys, temp_root, test_key};

use crate::support::*;

/// At the hard ceiling, a store into a new leaf and top directory makes room for the file and
/// both directories it creates in one sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_at_the_ceiling_makes_room_for_its_new_directories_too() {
    let root = temp_root();
    let ks = leaf_keys(0..12); // one leaf: 12 files and 2 directories fit under the ceiling
    let tier = with_ceiling(root.path(), &ks, 1.2).await;
    age(&tier, &ks, |i| 5000 - i as u64);
    let sweeps = gc_stats(&tier).sweeps;
    // a key in another top directory: its file and two new directories
    let far = test_key(7);
    assert_ne!(
        tier.block_path(&far).parent().unwrap().parent(),
        tier.block_path(&ks[0]).parent().unwrap().parent()
    );
    let res = fs_store(&tier, &[far], 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let s = gc_stats(&tier);
    assert_eq!(s.sweeps, sweeps + 1, "{s:?}");
    assert!(s.bytes <= s.hard_ceiling_bytes, "{s:?}");
    assert!(tier.block_path(&far).exists());
    // room for one file and its two new directories (a directory takes a block here): three
    // old files went, not more
    assert_eq!(s.files, 12 - 3 + 1, "{s:?}");
}

/// A sweep that panicked (here a hook; in life a bug) leaves no sweep "running": a store at
/// the hard ceiling still sweeps for room itself, instead of waiting for a sweep that will
/// never end and failing with `NoSpace`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicked_sweep_does_not_stop_stores_from_making_room() {
    let root = temp_root();
    let ks = leaf_keys(0..12);
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
    let res = fs_store(&*tier, &[far], 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let s = gc_stats(&tier);
    assert!(s.bytes <= s.hard_ceiling_bytes, "{s:?}");
    assert!(tier.block_path(&far).exists());
}

/// Grace is a preference, not a licence: stores at full speed with every file inside the
/// default grace window never take the tier above its hard ceiling; the oldest files go
/// (protected ones never).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn above_the_hard_ceiling_the_oldest_go_even_within_grace() {
    let root = temp_root();
    let per_block = measured_per_block().await;
    let cap = 30 * per_block;
    let tier = FsTier::open("fs", capped_no_thread_cfg(root.path(), cap), ns(), BS).unwrap(); // grace 300 s
    let keep = test_key(1);
    assert!(fs_store(&tier, &[keep], 0).await.is_success());
    let guard = tier.protect(&[keep]);
    let mut stored = 0;
    for batch in 0..20u64 {
        let keys: Vec<_> = (100 + batch * 8..108 + batch * 8).map(test_key).collect();
        let res = fs_store(&tier, &keys, 0).await;
        assert!(res.is_success(), "{:?}", res.failed);
        stored += keys.len();
        let s = gc_stats(&tier);
        assert!(s.bytes <= s.hard_ceiling_bytes, "{s:?}");
        assert!(
            allocated_bytes(&rank_dir(root.path())) <= s.hard_ceiling_bytes,
            "du over the ceiling"
        );
    }
    let s = gc_stats(&tier);
    assert!(stored as u64 * per_block > 4 * cap);
    assert!(s.peak_bytes <= s.hard_ceiling_bytes, "{s:?}");
    assert!(s.grace_overridden > 0 && s.store_waits > 0, "{s:?}");
    assert!(tier.block_path(&keep).exists(), "a protected key went");
    drop(guard);
}

/// With a cap larger than the disk, a full disk does not fail every store: `ENOSPC` triggers
/// a sweep of the oldest files and one retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enospc_on_store_sweeps_and_retries() {
    let m = Mount::new("tmpfs", "size=512k");
    let mut c = capped_no_thread_cfg(&m.dir, 1 << 30);
    c.gc_low_watermark = Some(0.5);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let mut failed = 0;
    for batch in 0..40u64 {
        let keys: Vec<_> = (batch * 8..batch * 8 + 8).map(test_key).collect();
        failed += fs_store(&tier, &keys, 0).await.failed.len();
    }
    let s = gc_stats(&tier);
    assert!(s.enospc_sweeps > 0, "{s:?}");
    assert!(
        failed <= 8,
        "{failed} of 320 stores failed on a full disk with a sweep to make room"
    );
    assert!(tier.stats().blocks.blocks_written > 100);
}

/// The index's total never passes the hard ceiling, however stores, loads and touches race
/// the sweeps: 4 writers of 16-block jobs of 2 MiB on 16 I/O threads under a 64 MiB cap,
/// each loading and touching what it stored two jobs before (so sweeps find victims
/// protected at their unlink and keep them). A kept victim used to be counted twice for a
/// moment (back in the index and still as being unlinked): 1.067x the cap against a 1.05x
/// ceiling. Slack: two directories (a leaf and its top made between a store's reservation and
/// its publish, after a sweep removed them).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_index_never_passes_the_hard_ceiling_while_stores_and_loads_race_sweeps() {
    const B: usize = 2 << 20;
    let root = temp_root();
    let mut c = cfg(root.path());
    c.n_read_threads = 8;
    c.n_write_threads = 8;
    c.gc_max_size_gb = Some(64.0 / 1024.0);
    c.gc_interval_s = Some(0.05);
    c.gc_stamp_interval_s = Some(0.5);
    c.gc_grace_s = Some(1.0);
    let tier = Arc::new(FsTier::open("fs", c, ns(), B).unwrap());
    let writers: Vec<_> = (0..4u64)
        .map(|w| {
            let t = tier.clone();
            tokio::spawn(async move {
                for j in 0..40u64 {
                    let keys: Vec<_> = (0..16).map(|i| test_key(w << 40 | j << 8 | i)).collect();
                    let _ = kv_tier_testkit::store_keys(&*t, &keys, 0, B).await;
                    let back: Vec<_> = (0..16)
                        .map(|i| test_key(w << 40 | j.saturating_sub(2) << 8 | i))
                        .collect();
                    let _ = kv_tier_testkit::load_keys(&*t, &back, B).await;
                    t.touch(&back);
                }
            })
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let g = tier.stats().gc.unwrap();
    let dir_unit = std::fs::metadata(root.path()).unwrap().blocks() * 512;
    assert!(
        g.peak_bytes <= g.hard_ceiling_bytes + 2 * dir_unit,
        "peak {} = {:.3}x the cap, ceiling {}: {g:?}",
        g.peak_bytes,
        g.peak_bytes as f64 / g.cap_bytes as f64,
        g.hard_ceiling_bytes
    );
    assert!(g.swept_files > 0, "the run never swept: {g:?}");
}

/// A store that needs room while another thread's sweep holds the GC waits for that sweep
/// at most its deadline (a second since the sweep last freed room), then fails with
/// `NoSpace`; it never waits on a sweep that does not end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_waiting_for_another_sweep_gives_up_at_its_deadline() {
    let root = temp_root();
    let ks: Vec<BlockKey> = (0..4).map(leaf_key).collect();
    // stored with the ceiling out of the way (a batch's first stores into a new leaf each
    // reserve its directories), then reopened with the ceiling at the cap: at the ceiling
    let first = FsTier::open("fs", hand_swept_low_blocks_cfg(root.path(), 4, 2), ns(), BS).unwrap();
    assert!(fs_store(&first, &ks, 0).await.is_success());
    drop(first);
    let mut c = hand_swept_low_blocks_cfg(root.path(), 4, 2);
    c.gc_hard_ceiling = Some(1.0);
    let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::Selected);
    let t = tier.clone();
    let sweep = std::thread::spawn(move || t.gc_sweep_for_space_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the sweep never selected");
    let t = tier.clone();
    let (done_tx, done_rx) = mpsc::channel();
    tokio::spawn(async move {
        done_tx
            .send(fs_store(&*t, &[leaf_key(9)], 0).await)
            .unwrap()
    });
    let res = tokio::task::spawn_blocking(move || done_rx.recv_timeout(HOOK_DEADLINE))
        .await
        .unwrap()
        .expect("the store waited on a sweep that does not end");
    assert!(
        matches!(res.failed[..], [(_, Error::NoSpace { .. })]),
        "{:?}",
        res.failed
    );
    go_tx.send(()).unwrap();
    sweep.join().unwrap();
}

/// README, "Bounded capacity": "Set, the tier keeps what it holds on disk under the cap, and
/// never above the hard ceiling"; config.rs `gc_hard_ceiling`: "A store that would cross this
/// ceiling first makes room"; README: "stores reserve their bytes before writing".
///
/// 24 tasks store new blocks as fast as they can (every file inside the default 300 s grace
/// window) into a 1 MiB cap; a thread samples `statvfs` of the tier's own tmpfs (every page,
/// unnamed files being written included) and must never see more than the ceiling above what
/// the empty tier held. Failures may only be `NoSpace`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn flood_from_many_tasks_never_exceeds_the_hard_ceiling_on_disk() {
    let m = Mount::new("tmpfs", "size=96m");
    let cap = 1 << 20;
    let mut c = capped_cfg(&m.dir, cap);
    c.gc_interval_s = Some(0.01);
    let tier = open_cfg(c, BS);
    let base = statvfs_used(&m.dir);
    let sampler = UsageSampler::start(&m.dir, base);
    let out = flood_jobs(&tier, 24, 120, 8, BS, 1_000_000_000).await;
    let (max, samples) = sampler.finish();
    let s = gc_stats(&tier);
    assert!(
        out.other.is_empty(),
        "non-NoSpace failures: {:?}",
        &out.other[..out.other.len().min(5)]
    );
    assert!(
        out.ok as u64 * BS as u64 > 8 * cap,
        "the flood_jobs stored too little: {out:?}"
    );
    assert!(
        max <= s.hard_ceiling_bytes,
        "statvfs saw {max} bytes above the empty tier's, ceiling {} (cap {cap}; {samples} samples; {s:?})",
        s.hard_ceiling_bytes
    );
    assert!(s.peak_bytes <= s.hard_ceiling_bytes, "{s:?}");
    tier.shutdown().await.unwrap();
    let s = gc_stats(&tier);
    assert_eq!(s.bytes, du(&m.dir), "accounted vs du after shutdown: {s:?}");
    assert_eq!(s.files as usize, bins(&m.dir).len(), "{s:?}");
}

/// README: "Sizes are **allocated bytes** (`st_blocks`) of the `.bin` files" and "never above
/// the hard ceiling"; `FsTier::open` takes any block size from 1 byte to 1 GiB.
///
/// Blocks whose size is not a multiple of the page (4097, 1000 and 12289 bytes: allocated
/// 8192, 4096 and 16384 on tmpfs) flooded by 16 tasks: sampled usage stays under the ceiling,
/// the index equals `du`, and what survives loads back byte for byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn odd_block_sizes_are_bounded_by_allocated_bytes() {
    for (i, bs) in [4097usize, 1000, 12289].into_iter().enumerate() {
        let m = Mount::new("tmpfs", "size=96m");
        let cap = 768 << 10;
        let mut c = capped_cfg(&m.dir, cap);
        c.gc_interval_s = Some(0.01);
        let tier = open_cfg(c, bs);
        let base = statvfs_used(&m.dir);
        let sampler = UsageSampler::start(&m.dir, base);
        let out = flood_jobs(&tier, 16, 60, 6, bs, 2_000_000_000 + i as u64 * 100_000_000).await;
        let (max, _) = sampler.finish();
        let s = gc_stats(&tier);
        assert!(
            out.other.is_empty(),
            "bs {bs}: {:?}",
            &out.other[..out.other.len().min(5)]
        );
        assert!(
            max <= s.hard_ceiling_bytes,
            "bs {bs}: statvfs saw {max} > ceiling {} ({s:?})",
            s.hard_ceiling_bytes
        );
        assert!(s.peak_bytes <= s.hard_ceiling_bytes, "bs {bs}: {s:?}");
        let present: Vec<BlockKey> = out
            .stored
            .iter()
            .copied()
            .filter(|k| tier.block_path(k).exists())
            .collect();
        assert!(!present.is_empty(), "bs {bs}: nothing survived");
        let (res, got) = load_keys(&*tier, &present, bs).await;
        for (k, b) in &got {
            assert!(
                kv_tier_testkit::verify_block(k, 0, b),
                "bs {bs}: wrong bytes"
            );
        }
        // a file may have been swept between the exists() and the load; none may be wrong
        assert!(res.ok.len() + res.failed.len() == present.len());
        tier.shutdown().await.unwrap();
        let s = gc_stats(&tier);
        assert_eq!(s.bytes, du(&m.dir), "bs {bs}: accounted vs du: {s:?}");
        let want = (bs as u64).div_ceil(4096) * 4096;
        for p in bins(&m.dir).iter().take(3) {
            assert_eq!(
                std::fs::metadata(p).unwrap().blocks() * 512,
                want,
                "bs {bs}"
            );
        }
    }
}

/// config.rs `gc_hard_ceiling`: "How far above the cap the tier may go, as a multiple of it
/// (default 1.05, range 1 to 1,000)"; README: "a store never takes the total above it".
///
/// At the range's minimum, 1.0, the ceiling is the cap itself: a flood_jobs of 16 tasks must never
/// take the filesystem's usage above the cap, even for a moment.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn hard_ceiling_at_its_minimum_is_the_cap_itself() {
    let m = Mount::new("tmpfs", "size=96m");
    let cap = 512 << 10;
    let mut c = capped_cfg(&m.dir, cap);
    c.gc_hard_ceiling = Some(1.0);
    c.gc_interval_s = Some(0.01);
    let tier = open_cfg(c, BS);
    let base = statvfs_used(&m.dir);
    let sampler = UsageSampler::start(&m.dir, base);
    let out = flood_jobs(&tier, 16, 100, 8, BS, 3_000_000_000).await;
    let (max, _) = sampler.finish();
    let s = gc_stats(&tier);
    assert!(
        out.other.is_empty(),
        "{:?}",
        &out.other[..out.other.len().min(5)]
    );
    assert!(out.ok > 0, "{out:?}");
    assert_eq!(s.hard_ceiling_bytes, cap, "{s:?}");
    assert!(
        max <= cap,
        "statvfs saw {max} above the empty tier with a ceiling of 1.0 x {cap}: {s:?}"
    );
    assert!(s.peak_bytes <= cap, "{s:?}");
    tier.shutdown().await.unwrap();
}

/// config.rs `gc_max_size_gb`: "must also hold one block file with its leaf and top
/// directories on the root's filesystem ... checked when the tier opens ... failing naming
/// `gc_max_size_gb`"; `gc_hard_ceiling`: "failing with `NoSpace` if everything left is
/// protected or being written".
///
/// On tmpfs (directories allocate nothing) the minimum is one page. With the cap there, 8
/// tasks store one block each, over and over: usage may never reach two blocks (an unnamed
/// file being written counts), and a store may fail only with `NoSpace`, never more
/// than half of them. Then, alone, every store must succeed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cap_of_one_block_under_concurrent_stores() {
    let m = Mount::new("tmpfs", "size=32m");
    let cap = 4096;
    let mut c = capped_cfg(&m.dir, cap);
    c.gc_interval_s = Some(0.01);
    let tier = open_cfg(c, BS);
    let base = statvfs_used(&m.dir);
    let sampler = UsageSampler::start(&m.dir, base);
    let out = flood_jobs(&tier, 8, 60, 1, BS, 4_000_000_000).await;
    let (max, _) = sampler.finish();
    let s = gc_stats(&tier);
    assert!(
        out.other.is_empty(),
        "{:?}",
        &out.other[..out.other.len().min(5)]
    );
    assert!(
        max <= s.hard_ceiling_bytes,
        "statvfs {max} > ceiling ({s:?})"
    );
    assert!(out.ok > 0, "{out:?}");
    for i in 0..30 {
        let k = test_key(4_100_000_000 + i);
        let res = store_sized(&tier, &[k], BS).await;
        assert!(
            res.is_success(),
            "alone, store {i} at the minimum cap failed: {:?}, {:?}",
            res.failed,
            gc_stats(&tier)
        );
        let (res, _) = load_keys(&*tier, &[k], BS).await;
        assert!(
            res.is_success(),
            "the block just stored is not loadable: {:?}",
            res.failed
        );
        assert!(du(&m.dir) <= s.hard_ceiling_bytes);
    }
    tier.shutdown().await.unwrap();
}

/// config.rs `gc_max_size_gb`: "must also hold one block file with its leaf and top
/// directories on the root's filesystem (with 4 KiB blocks on ext4, 12 KiB): that is checked
/// when the tier opens ... failing naming `gc_max_size_gb`".
///
/// Exactly that minimum opens and then cycles 40 blocks, one store at a time: every store
/// succeeds (there is always an unprotected older block to evict), the block just stored
/// loads, and `du` of the rank directory never passes the ceiling. One byte less is refused
/// naming the field. Also with an odd block size (5000 bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_documented_minimum_cap_opens_and_works_one_byte_less_is_refused() {
    for bs in [BS, 5000] {
        let root = temp_root();
        let (dir, unit) = allocation_units(root.path());
        let min = (bs as u64).div_ceil(unit) * unit + 2 * dir;
        let too_small = FsTier::open("fs", capped_cfg(root.path(), min - 1), ns(), bs);
        match too_small {
            Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, "gc_max_size_gb"),
            other => panic!(
                "bs {bs}: a cap of {} (min {min}) was not refused: {other:?}",
                min - 1
            ),
        }
        let tier = match FsTier::open("fs", capped_cfg(root.path(), min), ns(), bs) {
            Ok(t) => t,
            Err(e) => panic!("bs {bs}: the documented minimum {min} is refused: {e}"),
        };
        let hard = gc_stats(&tier).hard_ceiling_bytes;
        for i in 0..40 {
            let k = test_key(5_000_000 + i);
            let res = store_sized(&tier, &[k], bs).await;
            assert!(
                res.is_success(),
                "bs {bs}, store {i}: {:?} {:?}",
                res.failed,
                gc_stats(&tier)
            );
            let (res, got) = load_keys(&tier, &[k], bs).await;
            assert!(res.is_success() && kv_tier_testkit::verify_block(&k, 0, &got[0].1));
            let d = du(root.path());
            assert!(
                d <= hard,
                "bs {bs}, store {i}: du {d} > ceiling {hard}: {:?}",
                gc_stats(&tier)
            );
        }
        tier.shutdown().await.unwrap();
    }
}

/// config.rs `gc_max_size_gb`: "must also hold one block file with its leaf and top
/// directories on the root's filesystem (with 4 KiB blocks on ext4, 12 KiB)".
///
/// On a root already holding 3000 blocks, a cap of 64 KiB (five times that minimum) must
/// open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_minimum_cap_on_a_populated_root() {
    let root = temp_root();
    {
        let t = FsTier::open(
            "fs",
            capped_hand_swept_cfg(root.path(), 100 << 20),
            ns(),
            BS,
        )
        .unwrap();
        for j in 0..60u64 {
            let ks: Vec<_> = (0..50).map(|x| test_key(26_000_000 + j * 50 + x)).collect();
            assert!(store_sized(&t, &ks, BS).await.is_success());
        }
        t.shutdown().await.unwrap();
    }
    let (dir, unit) = allocation_units(root.path());
    let min = unit.max(BS as u64) + 2 * dir;
    let cap = 64 << 10;
    assert!(cap >= 5 * min);
    let mut c = capped_cfg(root.path(), cap);
    c.gc_background = false;
    if let Err(e) = FsTier::open("fs", c, ns(), BS) {
        panic!("cap {cap} (documented minimum {min}) refused on a populated root: {e}");
    }
}

/// config.rs `gc_hard_ceiling`: "failing with `NoSpace` if everything left is protected or
/// being written"; README: "a store that would cross the ceiling makes room first (a sweep,
/// or a wait of at most a second for one that runs) or fails with `NoSpace`".
///
/// Every block held is protected and the total sits just under the ceiling: new stores fail
/// with `NoSpace`, nothing protected is deleted, the ceiling holds. Guards dropped, stores
/// succeed again, still under the ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_everything_is_protected_stores_fail_with_no_space_and_the_bound_holds() {
    let cap = leaf_cost(10).await;
    let root = temp_root();
    let mut c = capped_cfg(root.path(), cap);
    c.gc_background = false;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let held: Vec<_> = (0..10).map(leaf_key).collect();
    for k in &held {
        let res = store_sized(&tier, &[*k], BS).await;
        assert!(res.is_success(), "{:?} {:?}", res.failed, gc_stats(&tier));
    }
    let guard = tier.protect(&held);
    let hard = gc_stats(&tier).hard_ceiling_bytes;
    let mut failed = 0;
    for i in 0..5 {
        let res = store_sized(&tier, &[leaf_key(100 + i)], BS).await;
        for (_, e) in &res.failed {
            assert!(is_no_space(e), "not NoSpace: {e}");
            failed += 1;
        }
        assert!(
            du(root.path()) <= hard,
            "du over the ceiling: {:?}",
            gc_stats(&tier)
        );
    }
    assert_eq!(
        failed,
        5,
        "stores over an all-protected tier succeeded: {:?}",
        gc_stats(&tier)
    );
    for k in &held {
        assert!(tier.block_path(k).exists(), "a protected block was deleted");
    }
    assert!(gc_stats(&tier).no_room > 0, "{:?}", gc_stats(&tier));
    drop(guard);
    for i in 0..5 {
        let res = store_sized(&tier, &[leaf_key(200 + i)], BS).await;
        assert!(
            res.is_success(),
            "released, a store still fails: {:?} {:?}",
            res.failed,
            gc_stats(&tier)
        );
        assert!(du(root.path()) <= hard, "{:?}", gc_stats(&tier));
    }
}

/// README: "`ENOSPC` from the filesystem (a cap larger than the disk) triggers a sweep of the
/// oldest files and one retry"; `gc_sweep_for_space_now`: "down to `gc_low_watermark` of the
/// current total, oldest first, grace window or not".
///
/// An 8 MiB tmpfs under a 64 MiB cap, fed 32 MiB one job at a time (8 blocks each, all
/// within grace): every store must succeed (nothing is protected but the job's own keys), the
/// newest blocks load, the index equals `du`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_larger_than_the_disk_sequential_stores_all_succeed() {
    let m = Mount::new("tmpfs", "size=8m");
    let tier = open_cfg(capped_cfg(&m.dir, 64 << 20), BS);
    let mut failures = Vec::new();
    let mut last = Vec::new();
    for j in 0..1024u64 {
        let ks: Vec<_> = (0..8).map(|x| test_key(15_000_000 + j * 8 + x)).collect();
        let res = store_sized(&tier, &ks, BS).await;
        failures.extend(res.failed.iter().map(|(k, e)| (j, *k, e.to_string())));
        last = ks;
    }
    let s = gc_stats(&tier);
    assert!(s.enospc_sweeps > 0, "the disk never filled? {s:?}");
    assert!(
        failures.is_empty(),
        "{} blocks failed storing onto a full disk (first: {:?}); stats {s:?}, no_space {}",
        failures.len(),
        failures.first(),
        tier.stats().no_space
    );
    let (res, _) = load_keys(&*tier, &last, BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    tier.shutdown().await.unwrap();
    assert_eq!(gc_stats(&tier).bytes, du(&m.dir), "{:?}", gc_stats(&tier));
}

/// README: "`ENOSPC` ... triggers a sweep of the oldest files and one retry"; `SecondaryTier`:
/// "A store that reports success leaves a readable block".
///
/// 16 tasks flood_jobs an 8 MiB tmpfs under a 64 MiB cap. Failures may only be `NoSpace`; at the
/// end, a lone store succeeds, every block reported stored that is still on disk loads right,
/// and the index equals `du`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cap_larger_than_the_disk_under_a_concurrent_flood() {
    let m = Mount::new("tmpfs", "size=8m");
    let tier = open_cfg(capped_cfg(&m.dir, 64 << 20), BS);
    let out = flood_jobs(&tier, 16, 50, 8, BS, 16_000_000).await;
    let s = gc_stats(&tier);
    assert!(
        out.other.is_empty(),
        "{:?}",
        &out.other[..out.other.len().min(5)]
    );
    assert!(s.enospc_sweeps > 0, "{s:?}");
    assert!(
        out.ok > out.no_space,
        "most of the flood_jobs failed: {} ok, {} NoSpace, {s:?}",
        out.ok,
        out.no_space
    );
    let res = store_sized(&tier, &[test_key(16_999_999)], BS).await;
    assert!(
        res.is_success(),
        "after the flood_jobs a lone store fails: {:?} {s:?}",
        res.failed
    );
    let present: Vec<_> = out
        .stored
        .iter()
        .copied()
        .filter(|k| tier.block_path(k).exists())
        .collect();
    let (_, got) = load_keys(&*tier, &present, BS).await;
    for (k, b) in &got {
        assert!(kv_tier_testkit::verify_block(k, 0, b));
    }
    tier.shutdown().await.unwrap();
    assert_eq!(gc_stats(&tier).bytes, du(&m.dir), "{:?}", gc_stats(&tier));
}

/// README: "a store that would cross the ceiling makes room first"; config.rs: "(a sweep on
/// its own thread that ignores `gc_grace_s` ...)"; "one walk at open adopts what is on disk".
///
/// A root filled by an unbounded tier, reopened bounded at a quarter of what it holds with
/// background GC off and every file within grace: the first store must succeed, and leave
/// the index and `du` under the ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopened_over_the_ceiling_the_first_store_makes_room() {
    let root = temp_root();
    let keys: Vec<_> = (0..80).map(|i| test_key(21_000_000 + i)).collect();
    {
        let t = FsTier::open(
            "fs",
            capped_hand_swept_cfg(root.path(), 100 << 20),
            ns(),
            BS,
        )
        .unwrap();
        assert!(store_sized(&t, &keys, BS).await.is_success());
        t.shutdown().await.unwrap();
    }
    let held = du(root.path());
    let mut c = capped_cfg(root.path(), held / 4);
    c.gc_background = false;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    assert_eq!(
        gc_stats(&tier).bytes,
        held,
        "the open walk adopts everything: {:?}",
        gc_stats(&tier)
    );
    let k = test_key(21_999_999);
    let res = store_sized(&tier, &[k], BS).await;
    let s = gc_stats(&tier);
    assert!(res.is_success(), "{:?} {s:?}", res.failed);
    assert!(s.bytes <= s.hard_ceiling_bytes, "{s:?}");
    assert!(
        du(root.path()) <= s.hard_ceiling_bytes,
        "du {} > {}",
        du(root.path()),
        s.hard_ceiling_bytes
    );
    assert!(tier.block_path(&k).exists());
}

/// README "Accounting": a leaf directory "grows with its entries and never shrinks: walks
/// and every 16th store into a leaf measure it"; "never above the hard ceiling"; config.rs:
/// ceiling range "1 to 1,000".
///
/// Every key in ONE leaf directory, which grows well past 4 KiB as ~400 entries pass through
/// it; ceiling 1.0 (the cap). After every wave of concurrent stores, `du` of the rank
/// directory must be within the cap; after shutdown the index equals `du`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_growing_leaf_directory_under_a_ceiling_of_one() {
    growing_leaf(Some(1.0)).await;
}

/// The same as `a_growing_leaf_directory_under_a_ceiling_of_one`, with the default ceiling
/// (1.05): README "a store never takes the total above it"; `GcStats::peak_bytes` "The most
/// `bytes` has been since open", `bytes` "What the tier holds on disk ... plus bytes reserved
/// by stores in flight".
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_growing_leaf_directory_under_the_default_ceiling() {
    growing_leaf(None).await;
}

/// README "Accounting": a store's reservation holds the directories it will publish into.
/// A store reserves room in a leaf directory that one old file keeps alive; a sweep deletes
/// that file before the store publishes. The directories stay (the sweep does not remove a
/// directory a store is about to write into) and stay counted, so another store cannot take
/// their room meanwhile: with the ceiling half a directory short of what both stores and all
/// their directories need, the second store fails with `NoSpace` instead of taking the tier
/// over its ceiling when the first publishes. After it, the index equals `du`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_racing_a_store_into_its_leaf_leaves_the_reserved_directories() {
    let root = temp_root();
    let (old, new, far) = (leaf_key(0), leaf_key(1), test_key(7));
    // a cap of one block with its directories; the ceiling 2 blocks and 3.5 directories
    let mut c = hand_swept_cfg(root.path(), 1, 0.0);
    let unit = dirs(root.path()) / 2;
    let cap = held(root.path(), 1);
    c.gc_hard_ceiling = Some((2 * BS as u64 + 7 * unit / 2) as f64 / cap as f64);
    let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    assert!(fs_store(&*tier, &[old], 0).await.is_success());
    age(&tier, &[old], |_| 5000);
    // the store of `new` is held after its reservation, before its file is created
    let leaf = leaf_dir(&tier, &new);
    let (at_tx, at_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    let held_once = std::sync::atomic::AtomicBool::new(false);
    let watched = leaf.clone();
    tier.set_fault_injector(Some(Arc::new(move |op, p| {
        if op == kv_tier_fs::FsOp::CreateTmp
            && p.starts_with(&watched)
            && !held_once.swap(true, std::sync::atomic::Ordering::SeqCst)
        {
            let _ = at_tx.send(());
            let _ = go_rx.lock().unwrap().recv();
        }
        None
    })));
    let t = tier.clone();
    let storing = tokio::spawn(async move { fs_store(&*t, &[new], 1).await });
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the store never reached its create");
    assert_eq!(tier.gc_sweep_now().unwrap(), 1, "the old file goes");
    assert!(!tier.block_path(&old).exists());
    assert!(
        leaf.exists(),
        "the sweep removed the directory a store writes into"
    );
    assert_eq!(gc_stats(&tier).dirs_removed, 0);
    // what the sweep freed is the old file only: no room for another file and two directories
    let res = fs_store(&*tier, &[far], 2).await;
    assert!(
        matches!(&res.failed[..], [(k, Error::NoSpace { .. })] if *k == far),
        "{:?}",
        res.failed
    );
    go_tx.send(()).unwrap();
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    tier.set_fault_injector(None);
    assert!(tier.block_path(&new).exists());
    check_stats(&tier, root.path(), "after the store that the sweep raced");
}
