//! What the index sums is what `du` of the rank directory shows: allocated bytes of the block
//! files, their sidecars and the directories they keep; room reserved by failed stores given
//! back; victims counted until their unlink; files gone or damaged taken out.

use std::path::Path;
use std::sync::Arc;

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_fs::{FsOp, FsTier, SweepPoint};
use kv_tier_testkit::fixtures::files::{Mount, allocation_units};
use kv_tier_testkit::wait::{SETTLE_LIMIT, poll_until_async};
use kv_tier_testkit::{allocated_bytes, find_files, load_keys, temp_root, test_key};

use crate::support::*;

/// The index follows the disk for any key, not only the first one indexed: a file gone or
/// damaged behind the tier's back leaves the index when a load finds it so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_or_damaged_file_leaves_the_index_whichever_it_is() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = leaf_keys(0..5);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    std::fs::remove_file(tier.block_path(&ks[3])).unwrap();
    let (res, _) = load(&tier, &ks[3..4]).await;
    assert_eq!(res.failed.len(), 1);
    assert_eq!(
        gc_stats(&tier).files,
        4,
        "a vanished file stayed in the index"
    );
    std::fs::File::options()
        .write(true)
        .open(tier.block_path(&ks[4]))
        .unwrap()
        .set_len(10)
        .unwrap();
    let (res, _) = load(&tier, &ks[4..5]).await;
    assert_eq!(res.failed.len(), 1);
    let s = gc_stats(&tier);
    assert_eq!(
        (s.files, s.bytes),
        (3, held(root.path(), 3)),
        "a damaged file stayed in the index"
    );
}

/// What a block takes on ramfs where its checksum lives in a sidecar: a page for the block,
/// one for its sidecar.
const SIDECAR_BLOCK: u64 = 2 * BS as u64;

/// A fresh ramfs (no user xattrs: checksums in sidecars) and a hand-swept bounded config of
/// its root with CRC32C checksums, capped at `blocks` blocks with their sidecars.
fn sidecars_on_ramfs(blocks: u64) -> (Mount, kv_tier_fs::FsTierConfig) {
    let m = Mount::new("ramfs", "");
    let mut c = hand_swept_cfg(&m.dir, blocks, 0.8);
    c.checksum = kv_tier_fs::Checksum::Crc32c;
    c.gc_max_size_gb = Some((blocks * SIDECAR_BLOCK) as f64 / (1u64 << 30) as f64);
    (m, c)
}

/// Where checksums live in sidecars (no user xattrs: ramfs), each block counts with its
/// sidecar, and a sweep takes the sidecar with its block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecars_count_toward_the_cap_and_go_with_their_blocks() {
    // ramfs keeps no blocks for directories; a block and its sidecar take a page each
    let (m, mut c) = sidecars_on_ramfs(10);
    let per_block = SIDECAR_BLOCK;
    c.gc_low_watermark = Some(0.8);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks = leaf_keys(0..15);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    assert_eq!(gc_stats(&tier).bytes, 15 * per_block);
    age(&tier, &ks, |i| (15 - i as u64) * 1000);
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.bytes), (8, 8 * per_block));
    assert_eq!(find_files(&m.dir, ".bin").len(), 8);
    assert_eq!(
        find_files(&m.dir, kv_tier_fs::CRC_SIDECAR_SUFFIX).len(),
        8,
        "a swept block's sidecar stayed"
    );
}

/// Where checksums live in sidecars, a block someone else deleted (vLLM's own eviction, a
/// reaper) without its sidecar: the load that finds it gone forgets it and deletes the orphan
/// sidecar, so the index and the disk agree at once, not at the next walk (`tmp_reap_age_s`
/// or the hourly rescan).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_deleted_by_someone_else_takes_its_sidecar_at_the_load_that_finds_it_gone() {
    let (m, c) = sidecars_on_ramfs(10);
    let per_block = SIDECAR_BLOCK;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks = leaf_keys(0..3);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    std::fs::remove_file(tier.block_path(&ks[1])).unwrap();
    let (res, _) = load(&tier, &[ks[1]]).await;
    assert!(!res.is_success(), "a deleted block loaded");
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.bytes), (2, 2 * per_block), "{s:?}");
    assert_eq!(
        find_files(&m.dir, kv_tier_fs::CRC_SIDECAR_SUFFIX).len(),
        2,
        "the orphan sidecar stayed"
    );
    assert_eq!(tier.stats().sidecars_reaped, 1);
    let (res, _) = load(&tier, &[ks[0], ks[2]]).await;
    assert!(res.is_success(), "{:?}", res.failed);
}

/// Where checksums live in sidecars, a load that finds a block gone races a store of the same
/// key, a thousand times (each key stored, its block file deleted by someone else, then the
/// load and the store started together, in either order): the load may delete the orphan
/// sidecar, never the store's fresh one, and the index ends equal to the disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_finds_a_block_gone_never_takes_the_sidecar_of_a_store_racing_it() {
    let n = 1000;
    let (m, c) = sidecars_on_ramfs(2 * n + 64);
    let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    let ks = leaf_keys(0..n);
    let mut lost = Vec::new();
    for (i, k) in ks.iter().enumerate() {
        assert!(fs_store(&*tier, &[*k], 0).await.is_success());
        std::fs::remove_file(tier.block_path(k)).unwrap();
        let (t1, t2, one) = (tier.clone(), tier.clone(), [*k]);
        let loading = async move { load(&t1, &one).await };
        let storing = async move { fs_store(&*t2, &one, 0).await };
        let (l, s) = if i % 2 == 0 {
            let l = tokio::spawn(loading);
            (l, tokio::spawn(storing))
        } else {
            let s = tokio::spawn(storing);
            (tokio::spawn(loading), s)
        };
        l.await.unwrap();
        assert!(s.await.unwrap().is_success());
        let block = tier.block_path(k);
        let mut side = block.clone().into_os_string();
        side.push(kv_tier_fs::CRC_SIDECAR_SUFFIX);
        if block.exists() && !std::path::Path::new(&side).exists() {
            lost.push(i);
        }
    }
    assert!(
        lost.is_empty(),
        "stores whose sidecar a load deleted: {lost:?}"
    );
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.bytes), (n, allocated_bytes(&rank_dir(&m.dir))));
    let (res, _) = load(&tier, &ks).await;
    assert!(res.is_success(), "{:?}", res.failed);
}

/// Files someone else deleted between the sweep's decision and its unlinks are gone, as the
/// sweep wanted: not errors, and not put back into the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn victims_deleted_by_someone_else_before_the_unlink_count_as_gone() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = stored_aged(&tier, 15, &[]).await;
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking);
    for k in &ks[..7] {
        std::fs::remove_file(tier.block_path(k)).unwrap();
    }
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 7);
    tier.set_sweep_hook(None).unwrap();
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.errors), (8, 0), "{s:?}");
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| i >= 7).collect::<Vec<_>>()
    );
}

/// Where checksums live in sidecars, a block the index learns from a load (another process
/// wrote it) counts with its sidecar, as one the tier stored itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learned_block_counts_with_its_sidecar() {
    let (m, c) = sidecars_on_ramfs(10);
    let per_block = SIDECAR_BLOCK;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let mut oc = cfg(&m.dir);
    oc.checksum = kv_tier_fs::Checksum::Crc32c;
    let other = FsTier::open("fs", oc, ns(), BS).unwrap();
    let (mine, theirs) = (leaf_key(1), leaf_key(2));
    assert!(fs_store(&tier, &[mine], 0).await.is_success());
    assert_eq!(gc_stats(&tier).bytes, per_block);
    assert!(fs_store(&other, &[theirs], 0).await.is_success());
    let (res, _) = load(&tier, &[theirs]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.bytes), (2, 2 * per_block), "{s:?}");
}

/// A victim the sweep cannot unlink (here an immutable file) is an error, stays on disk and
/// stays in the index: the tier keeps counting what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_victim_that_cannot_be_unlinked_stays_counted() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = stored_aged(&tier, 15, &[]).await;
    set_immutable(&tier.block_path(&ks[0]), true);
    let deleted = tier.gc_sweep_now().unwrap();
    set_immutable(&tier.block_path(&ks[0]), false);
    let s = gc_stats(&tier);
    assert!(tier.block_path(&ks[0]).exists());
    assert_eq!(s.errors, 1, "{s:?}");
    assert_eq!(s.files as usize, 15 - deleted, "{s:?}");
    assert_eq!(
        s.bytes,
        held(root.path(), s.files),
        "the index lost the file: {s:?}"
    );
}

/// The accounted bytes are the allocated bytes of the block files and of the directories
/// they keep (here every key has its own leaf and top directory, as random keys do), and
/// sweeps remove the directories they empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tier_accounts_what_du_counts_directories_included() {
    let root = temp_root();
    let tier = FsTier::open("fs", capped_no_thread_cfg(root.path(), 1 << 20), ns(), BS).unwrap();
    let keys: Vec<_> = (0..40).map(test_key).collect();
    assert!(fs_store(&tier, &keys, 0).await.is_success());
    let s = gc_stats(&tier);
    assert_eq!(
        s.bytes,
        allocated_bytes(&rank_dir(root.path())),
        "accounted vs du: {s:?}"
    );
    assert!(s.dir_bytes > 0 && s.bytes > 40 * BS as u64, "{s:?}");
    age(&tier, &keys, |i| 10_000 - i as u64);
    let cap = 20 * BS as u64 + s.dir_bytes / 2; // well under what is held
    let mut c = capped_no_thread_cfg(root.path(), cap);
    c.gc_low_watermark = Some(0.5);
    drop(tier);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    assert_eq!(
        gc_stats(&tier).bytes,
        allocated_bytes(&rank_dir(root.path())),
        "after a reopen"
    );
    assert!(tier.gc_sweep_now().unwrap() > 0);
    let s = gc_stats(&tier);
    assert!(s.dirs_removed > 0, "{s:?}");
    assert_eq!(
        s.bytes,
        allocated_bytes(&rank_dir(root.path())),
        "after a sweep: {s:?}"
    );
    assert!(s.bytes <= s.cap_bytes / 2 + 1, "{s:?}");
}

/// A directory grows with its entries and never shrinks: the tier counts what a leaf
/// directory that once held many files still takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaf_directory_that_held_many_files_counts_its_size() {
    let root = temp_root();
    let mut c = capped_no_thread_cfg(root.path(), 64 << 20);
    c.gc_low_watermark = Some(0.1);
    let tier = FsTier::open("fs", c, ns(), 512).unwrap();
    // 400 keys in one leaf directory (`abc/de_g0`)
    let keys: Vec<_> = (0..400u64)
        .map(|i| {
            let mut h = [0u8; 32];
            h.copy_from_slice(test_key(i).hash_bytes());
            h[0] = 0xab;
            h[1] = 0xcd;
            h[2] = 0xe0 | (h[2] & 0x0f);
            kv_tier_core::BlockKey::from_hash32(h, 0)
        })
        .collect();
    for chunk in keys.chunks(50) {
        assert!(
            kv_tier_testkit::store_keys(&tier, chunk, 0, 512)
                .await
                .is_success()
        );
    }
    let s = gc_stats(&tier);
    assert_eq!(s.bytes, allocated_bytes(&rank_dir(root.path())), "{s:?}");
    assert!(
        s.dir_bytes > 2 * 4096,
        "a 400-entry directory counted as one unit: {s:?}"
    );
    // all but a few go; the directory keeps its size, and so does the count
    for k in &keys[..390] {
        std::fs::remove_file(tier.block_path(k)).unwrap();
    }
    tier.gc_rescan_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!(s.files, 10);
    assert_eq!(
        s.bytes,
        allocated_bytes(&rank_dir(root.path())),
        "after most files went: {s:?}"
    );
}

/// A store that reserved room and then failed (a write error) gives the room back: the
/// tier's total is what is on disk, not what failed stores once wanted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_store_gives_its_reserved_room_back() {
    let root = temp_root();
    let tier = FsTier::open(
        "fs",
        hand_swept_low_blocks_cfg(root.path(), 100, 50),
        ns(),
        BS,
    )
    .unwrap();
    assert!(fs_store(&tier, &[leaf_key(0)], 0).await.is_success()); // the leaf exists now
    let before = gc_stats(&tier).bytes;
    tier.set_fault_injector(Some(Arc::new(|op, _p: &Path| {
        (op == FsOp::Write).then(|| std::io::Error::from_raw_os_error(libc::EIO))
    })));
    let ks: Vec<BlockKey> = (1..9).map(leaf_key).collect();
    let res = fs_store(&tier, &ks, 0).await;
    assert_eq!(res.failed.len(), ks.len(), "the writes were meant to fail");
    tier.set_fault_injector(None);
    let s = gc_stats(&tier);
    assert_eq!(
        s.bytes, before,
        "failed stores kept their reservations: {s:?}"
    );
    assert_eq!(s.files, 1);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    assert_eq!(gc_stats(&tier).bytes, before + ks.len() as u64 * BS as u64);
}

/// Files a sweep decided to delete stay counted until they are unlinked: held at the moment
/// a batch is decided and not yet unlinked, the tier's total still holds them (they are on
/// disk), and room reserved against it cannot pass the ceiling on bytes not freed yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_being_unlinked_count_until_they_are_gone() {
    let root = temp_root();
    let tier = Arc::new(
        FsTier::open("fs", hand_swept_low_blocks_cfg(root.path(), 4, 1), ns(), BS).unwrap(),
    );
    let ks: Vec<BlockKey> = (0..6).map(leaf_key).collect();
    assert!(fs_store(&*tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 6000 - 1000 * i as u64);
    let full = gc_stats(&tier).bytes;
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::Unlinking);
    let t = tier.clone();
    let sweep = std::thread::spawn(move || t.gc_sweep_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the sweep never reached its unlinks");
    // decided, out of the index, still on disk: still counted
    assert!(ks.iter().all(|k| tier.block_path(k).exists()));
    assert_eq!(
        gc_stats(&tier).bytes,
        full,
        "victims not unlinked yet were not counted"
    );
    // a load of a victim meanwhile finds its file: counted once, not again
    let (res, _) = load(&*tier, &ks[..1]).await;
    assert!(res.is_success());
    assert_eq!(
        gc_stats(&tier).bytes,
        full,
        "a victim loaded meanwhile was counted twice"
    );
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 5);
    tier.set_sweep_hook(None).unwrap();
    assert_eq!(gc_stats(&tier).bytes, full - 5 * BS as u64);
}

/// README "Accounting": sizes are those "of the `.bin` files and their sidecars, plus the
/// directories they keep", "What the index sums is what `du` of the rank directory shows",
/// "a rare rescan repairs drift"; config.rs `gc_rescan_interval_s`: rescans "repair drift from
/// external deletes"; README: "never above the hard ceiling".
///
/// An external reaper removes every block file (as `find -delete` of `.bin` files would),
/// leaving the leaf and top directories the tier made. After a rescan the index and `du`
/// must agree; 40 new blocks later (the cap holds about 40), `du` of the rank directory
/// must still be within the ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directories_left_empty_by_external_deletes_still_count() {
    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir;
    let mut c = capped_cfg(root.path(), 40 * per_block);
    c.gc_background = false;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    for i in 0..40 {
        let res = store_sized(&tier, &[test_key(12_500_000 + i)], BS).await;
        assert!(res.is_success(), "{:?}", res.failed);
    }
    for p in bins(root.path()) {
        std::fs::remove_file(p).unwrap();
    }
    tier.gc_rescan_now().unwrap();
    let s1 = gc_stats(&tier);
    let du1 = du(root.path());
    for i in 0..40 {
        let res = store_sized(&tier, &[test_key(12_600_000 + i)], BS).await;
        assert!(res.is_success(), "{:?}", res.failed);
    }
    tier.gc_rescan_now().unwrap();
    let s2 = gc_stats(&tier);
    let du2 = du(root.path());
    assert_eq!(
        (s1.bytes, s2.bytes),
        (du1, du2),
        "index vs du, after the reaper and a rescan, then after 40 stores and a rescan ({s2:?})"
    );
    assert!(
        du2 <= s2.hard_ceiling_bytes,
        "du {du2} > ceiling {}: {s2:?}",
        s2.hard_ceiling_bytes
    );
}

/// README: the 4,096 top-level directories, where "under 5% of the cap ... are pre-created and
/// counted as a fixed part; otherwise each counts, and goes, with its last file"; "one walk
/// at open adopts what is on disk"; "What the index sums is what `du` of the rank directory
/// shows"; "Set, the tier keeps what it holds on disk under the cap, and never above the hard
/// ceiling".
///
/// A root first served by an unbounded tier (which pre-creates the 4,096 top directories:
/// `FsStats::top_dirs_ready`), then reopened bounded at 1 MiB, and 300 blocks stored: `du` of
/// the rank directory must be within the ceiling and equal the index.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_root_first_used_unbounded_then_bounded() {
    let root = temp_root();
    {
        let t = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
        assert!(
            store_sized(&t, &[test_key(25_000_000)], BS)
                .await
                .is_success()
        );
        assert!(
            poll_until_async(SETTLE_LIMIT, || t.stats().top_dirs_ready).await,
            "top dirs never ready"
        );
        t.shutdown().await.unwrap();
    }
    let before = du(root.path());
    let cap = 1 << 20;
    let mut c = capped_cfg(root.path(), cap);
    c.gc_interval_s = Some(0.05);
    let tier = match FsTier::open("fs", c, ns(), BS) {
        Ok(t) => t,
        Err(e) => panic!(
            "a 1 MiB cap refused on a root an unbounded tier used ({before} bytes of directories): {e}"
        ),
    };
    for j in 0..30u64 {
        let ks: Vec<_> = (0..10).map(|x| test_key(25_100_000 + j * 10 + x)).collect();
        let res = store_sized(&tier, &ks, BS).await;
        for (_, e) in &res.failed {
            assert!(is_no_space(e), "{e}");
        }
    }
    tier.shutdown().await.unwrap();
    let s = gc_stats(&tier);
    let d = du(root.path());
    let rd = rank_dir(root.path());
    let tops = std::fs::read_dir(&rd)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir())
        .count();
    let nonempty_tops = std::fs::read_dir(&rd)
        .unwrap()
        .flatten()
        .filter(|e| e.path().is_dir() && std::fs::read_dir(e.path()).unwrap().next().is_some())
        .count();
    eprintln!(
        "unbounded->bounded: {} block files, {tops} top dirs ({nonempty_tops} non-empty), no_space {}",
        bins(root.path()).len(),
        tier.stats().no_space
    );
    assert!(
        d <= s.hard_ceiling_bytes && s.bytes == d,
        "du of the rank directory {d} (before reopening bounded: {before}); index {}; ceiling {}: {s:?}",
        s.bytes,
        s.hard_ceiling_bytes
    );
}

/// `GcStats`: "`bytes`: What the tier holds on disk: allocated bytes of its block files, their
/// sidecars and the directories they keep, plus bytes reserved by stores in flight",
/// "`dir_bytes`: The part of `bytes` that is directories", "`files`: Block files in the
/// index"; README: "What the index sums is what `du` of the rank directory shows".
///
/// A mixed workload (stores, loads, touches) from 8 tasks under background GC, with keys
/// sharing few leaf directories (so directories grow); after shutdown the stats equal the
/// disk: bytes = du, dir_bytes = du of directories, files = `.bin` files, and peak within
/// the ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn stats_match_the_disk_after_a_mixed_workload() {
    let root = temp_root();
    let mut c = capped_cfg(root.path(), 1 << 20);
    c.gc_interval_s = Some(0.01);
    c.gc_stamp_interval_s = Some(0.01);
    c.gc_grace_s = Some(0.05);
    let tier = open_cfg(c, BS);
    let key = |i: u64| {
        // 4 leaf directories, many keys each
        let mut h = [0u8; 32];
        h.copy_from_slice(test_key(18_000_000 + i).hash_bytes());
        h[0] = 0x12;
        h[1] = 0x34;
        h[2] = (h[2] & 0x0f) | ((i % 4) as u8) << 4;
        BlockKey::from_hash32(h, 0)
    };
    let mut hs = Vec::new();
    for w in 0..8u64 {
        let tier = tier.clone();
        hs.push(tokio::spawn(async move {
            for j in 0..100u64 {
                let ks: Vec<_> = (0..4)
                    .map(|x| key(mix(w * 10_000 + j * 4 + x) % 2000))
                    .collect();
                match j % 3 {
                    0 | 1 => {
                        let _ = store_sized(&tier, &ks, BS).await;
                    }
                    _ => {
                        let _ = load_keys(&*tier, &ks, BS).await;
                        tier.touch(&ks);
                    }
                }
            }
        }));
    }
    for h in hs {
        h.await.unwrap();
    }
    tier.shutdown().await.unwrap();
    let s = gc_stats(&tier);
    let rd = rank_dir(root.path());
    assert!(s.swept_files > 0, "{s:?}");
    assert!(s.peak_bytes <= s.hard_ceiling_bytes, "{s:?}");
    assert_eq!(s.files as usize, bins(root.path()).len(), "{s:?}");
    assert_eq!(
        s.dir_bytes,
        du_dirs(&rd),
        "dir_bytes vs du of the directories: {s:?}"
    );
    assert_eq!(s.bytes, du(root.path()), "bytes vs du: {s:?}");
}

/// README "Accounting": "Sizes are allocated bytes (`st_blocks`) of the `.bin` files and their
/// sidecars"; ARCHITECTURE.md: a victim is "unlinked with no lock (plus its sidecar)";
/// "Startup": sidecars "whose block is gone" are reaped.
///
/// On ramfs (no user xattrs: checksums in sidecars) 8 tasks flood_jobs a bounded tier with
/// checksums on; after shutdown the index equals `du` (sidecars counted), no sidecar is left
/// without its block, the ceiling held, and surviving blocks verify.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sidecars_are_counted_and_go_with_their_blocks() {
    let m = Mount::new("ramfs", "");
    let mut c = capped_cfg(&m.dir, 256 << 10);
    c.checksum = kv_tier_fs::Checksum::Crc32c;
    c.gc_interval_s = Some(0.01);
    c.gc_stamp_interval_s = Some(0.001);
    c.gc_grace_s = Some(0.002);
    let tier = open_cfg(c, BS);
    let out = flood_jobs(&tier, 8, 50, 4, BS, 23_000_000).await;
    assert!(
        out.other.is_empty(),
        "{:?}",
        &out.other[..out.other.len().min(5)]
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
    let s = gc_stats(&tier);
    let cars = find_files(&rank_dir(&m.dir), kv_tier_fs::CRC_SIDECAR_SUFFIX);
    assert!(
        !cars.is_empty(),
        "no sidecars: xattrs work on ramfs here, the test does not bite"
    );
    let orphans: Vec<_> = cars
        .iter()
        .filter(|c| {
            let s = c.to_string_lossy();
            !Path::new(&s[..s.len() - kv_tier_fs::CRC_SIDECAR_SUFFIX.len()]).exists()
        })
        .collect();
    assert!(
        orphans.is_empty(),
        "{} sidecars without their block",
        orphans.len()
    );
    assert!(
        s.swept_files > 0 && s.peak_bytes <= s.hard_ceiling_bytes,
        "{s:?}"
    );
    assert!(du(&m.dir) <= s.hard_ceiling_bytes, "{s:?}");
    assert_eq!(s.bytes, du(&m.dir), "sidecars not counted? {s:?}");
}
