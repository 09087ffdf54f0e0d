//! Edges of the fs tier that the mutation run found untested: reservations given back by
//! failed stores, a rescan racing stamps, a rescan waking the GC, stores that give up
//! waiting for room, a plain file in an unchecked tier, an oversized checksum xattr.

mod common;

use std::path::Path;
use std::sync::Arc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{
    BS, HOOK_DEADLINE, age, cfg, hook_at, leaf_key, load, ns, open_checksummed, set_crc_xattr,
    store,
};
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{FsOp, FsTier, FsTierConfig, SweepPoint};
use kv_tier_testkit::{block_bytes, temp_root, test_key, verify_block};

fn dirs(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    2 * std::fs::metadata(root).unwrap().blocks() * 512
}

/// A bounded tier whose cap holds `cap_blocks` blocks of one leaf and whose low watermark
/// holds `low_blocks` of them; GC driven by hand unless `background`.
fn bounded(root: &Path, cap_blocks: u64, low_blocks: u64) -> FsTierConfig {
    let mut c = cfg(root);
    let cap = cap_blocks * BS as u64 + dirs(root);
    let low = low_blocks as f64 * BS as f64 + dirs(root) as f64 + 0.5;
    c.gc_max_size_gb = Some(cap as f64 / (1u64 << 30) as f64);
    c.gc_low_watermark = Some(low / cap as f64);
    c.gc_hard_ceiling = Some(1000.0);
    c.gc_interval_s = Some(3600.0);
    c.gc_background = false;
    c
}

fn gc(tier: &FsTier) -> kv_tier_fs::GcStats {
    tier.stats().gc.unwrap()
}

fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + HOOK_DEADLINE;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A store that reserved room and then failed (a write error) gives the room back: the
/// tier's total is what is on disk, not what failed stores once wanted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_store_gives_its_reserved_room_back() {
    let root = temp_root();
    let tier = FsTier::open("fs", bounded(root.path(), 100, 50), ns(), BS).unwrap();
    assert!(store(&tier, &[leaf_key(0)], 0).await.is_success()); // the leaf exists now
    let before = gc(&tier).bytes;
    tier.set_fault_injector(Some(Arc::new(|op, _p: &Path| {
        (op == FsOp::Write).then(|| std::io::Error::from_raw_os_error(libc::EIO))
    })));
    let ks: Vec<BlockKey> = (1..9).map(leaf_key).collect();
    let res = store(&tier, &ks, 0).await;
    assert_eq!(res.failed.len(), ks.len(), "the writes were meant to fail");
    tier.set_fault_injector(None);
    let s = gc(&tier);
    assert_eq!(
        s.bytes, before,
        "failed stores kept their reservations: {s:?}"
    );
    assert_eq!(s.files, 1);
    assert!(store(&tier, &ks, 0).await.is_success());
    assert_eq!(gc(&tier).bytes, before + ks.len() as u64 * BS as u64);
}

/// A stamp applied while a rescan walks is newer than what the walk saw: the rescan keeps
/// it, so the stamped key is recent for the next sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_keeps_a_stamp_applied_while_it_walked() {
    let root = temp_root();
    let tier = Arc::new(FsTier::open("fs", bounded(root.path(), 3, 2), ns(), BS).unwrap());
    let ks: Vec<BlockKey> = (0..4).map(leaf_key).collect();
    assert!(store(&*tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 4000 - 1000 * i as u64); // ks[0] is the oldest
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::RescanWalked);
    let t = tier.clone();
    let rescan = std::thread::spawn(move || t.gc_rescan_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the rescan never walked");
    let stamps = gc(&tier).stamps;
    tier.touch(&ks[..1]); // the oldest is read now
    tier.gc_apply_stamps_now().unwrap();
    assert_eq!(gc(&tier).stamps, stamps + 1, "the touch was not stamped");
    go_tx.send(()).unwrap();
    rescan.join().unwrap();
    tier.set_sweep_hook(None).unwrap();
    assert_eq!(tier.gc_sweep_now().unwrap(), 2);
    let present: Vec<bool> = ks.iter().map(|k| tier.block_path(k).exists()).collect();
    assert_eq!(
        present,
        [true, false, false, true],
        "the stamped key was swept as old"
    );
    // and the index held the stamp: the sweep never had to find the key fresh on disk
    assert_eq!(
        gc(&tier).skipped_recent,
        0,
        "the rescan put the old mtime back"
    );
}

/// A rescan that finds the tier over its cap (files another process wrote) wakes the GC
/// thread, which sweeps without waiting for its interval (an hour here).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_that_finds_the_tier_over_its_cap_wakes_the_gc() {
    let root = temp_root();
    let mut c = bounded(root.path(), 4, 2);
    c.gc_background = true;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let other = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let ks: Vec<BlockKey> = (0..8).map(leaf_key).collect();
    assert!(store(&other, &ks, 0).await.is_success());
    for k in &ks {
        // used long ago: outside the grace window
        let f = std::fs::File::options()
            .write(true)
            .open(tier.block_path(k))
            .unwrap();
        f.set_modified(std::time::SystemTime::now() - Duration::from_secs(1000))
            .unwrap();
    }
    assert_eq!(gc(&tier).sweeps, 0);
    tier.gc_rescan_now().unwrap();
    wait_for("a sweep", || gc(&tier).sweeps >= 1);
    wait_for("the files to go", || gc(&tier).files == 2);
    tier.shutdown().await.unwrap();
}

/// A store that needs room while another thread's sweep holds the GC waits for that sweep
/// at most its deadline (a second), then fails with `NoSpace`; it never waits on a sweep
/// that does not end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_waiting_for_another_sweep_gives_up_at_its_deadline() {
    let root = temp_root();
    let ks: Vec<BlockKey> = (0..4).map(leaf_key).collect();
    // stored with the ceiling out of the way (a batch's first stores into a new leaf each
    // reserve its directories), then reopened with the ceiling at the cap: at the ceiling
    let first = FsTier::open("fs", bounded(root.path(), 4, 2), ns(), BS).unwrap();
    assert!(store(&first, &ks, 0).await.is_success());
    drop(first);
    let mut c = bounded(root.path(), 4, 2);
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
    tokio::spawn(async move { done_tx.send(store(&*t, &[leaf_key(9)], 0).await).unwrap() });
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

/// Without checksums, a block file written by another program (no xattr, no sidecar) is a
/// block like any other: a store of its key skips it, nothing is called damaged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unchecked_tier_takes_a_plain_file_as_the_block() {
    let root = temp_root();
    let mut c = cfg(root.path());
    c.accept_unverified = false;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let k = test_key(1);
    let p = tier.block_path(&k);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, block_bytes(&k, 3, BS)).unwrap();
    // written long ago (not a publish whose checksum could still be coming)
    let f = std::fs::File::options().write(true).open(&p).unwrap();
    f.set_modified(std::time::SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    assert!(store(&tier, &[k], 0).await.is_success());
    let s = tier.stats();
    assert_eq!(
        (s.blocks.stores_skipped, s.blocks.corrupt_deleted),
        (1, 0),
        "{s:?}"
    );
    let (res, data) = load(&tier, &[k]).await;
    assert!(
        res.is_success() && verify_block(&k, 3, &data[0].1),
        "the file was replaced"
    );
}

/// A checksum xattr longer than a checksum (too long for the buffer a load reads it into)
/// is damage like any malformed one: a miss, and the file goes; not an I/O error that
/// would keep a bad block forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversized_checksum_xattr_is_damage() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    let p = tier.block_path(&k);
    set_crc_xattr(&p, &[7u8; 16]);
    let (res, _) = load(&tier, &[k]).await;
    assert!(
        matches!(res.failed[..], [(_, Error::Corrupt { .. })]),
        "{:?}",
        res.failed
    );
    assert!(!p.exists(), "the damaged block was kept");
    assert_eq!(tier.stats().blocks.corrupt_deleted, 1);
}

/// A load that finds its block damaged removes only the file it read: a good block put in
/// its place meanwhile (another writer's publish) stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_removes_only_the_damaged_file_it_read() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    let path = tier.block_path(&k);
    let good = root.path().join("good.bin");
    std::fs::hard_link(&path, &good).unwrap(); // the good block, its checksum xattr included
    let bad = root.path().join("bad.bin");
    std::fs::write(&bad, block_bytes(&k, 9, BS)).unwrap(); // no checksum: damage
    std::fs::rename(&bad, &path).unwrap();
    let (p, g) = (path.clone(), good.clone());
    let once = std::sync::atomic::AtomicBool::new(false);
    tier.set_fault_injector(Some(Arc::new(move |op, _: &Path| {
        if op == FsOp::Read && !once.swap(true, std::sync::atomic::Ordering::SeqCst) {
            std::fs::rename(&g, &p).unwrap(); // the good block is published again meanwhile
        }
        None
    })));
    let (res, _) = load(&tier, &[k]).await;
    tier.set_fault_injector(None);
    assert!(
        matches!(res.failed[..], [(_, Error::Corrupt { .. })]),
        "{:?}",
        res.failed
    );
    assert!(
        path.exists(),
        "the good block put in place meanwhile was removed"
    );
    let (res, data) = load(&tier, &[k]).await;
    assert!(res.is_success() && verify_block(&k, 0, &data[0].1));
}

/// Where checksums live in sidecars, a block file published a moment ago whose sidecar is
/// not written yet (its publisher writes it right after) is not damage to a store that meets
/// it: the store skips it instead of deleting another writer's block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_leaves_a_block_whose_sidecar_is_still_coming() {
    let m = common::Mount::new("ramfs", "");
    let mut c = cfg(&m.dir);
    c.checksum = kv_tier_fs::Checksum::Crc32c;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    tier.set_sidecar_grace(Duration::from_secs(3600));
    // just published, no sidecar yet
    store_over_a_planted_block(&tier, test_key(1)).await;
}

/// Writes a block file without any checksum at `k`'s path (another writer's), stores `k`
/// and checks the store skipped it and left the file as it was; returns its path.
async fn store_over_a_planted_block(tier: &FsTier, k: BlockKey) -> std::path::PathBuf {
    let p = tier.block_path(&k);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, block_bytes(&k, 3, BS)).unwrap();
    assert!(store(tier, &[k], 0).await.is_success());
    let s = tier.stats();
    assert_eq!(
        (s.blocks.stores_skipped, s.blocks.corrupt_deleted),
        (1, 0),
        "{s:?}"
    );
    assert_eq!(std::fs::read(&p).unwrap(), block_bytes(&k, 3, BS));
    p
}

/// A buffer whose start is deliberately not aligned for direct I/O, readable after the tier
/// has dropped the sink over it.
struct Unaligned(std::cell::UnsafeCell<Vec<u8>>);
// SAFETY: the only writer is the sink; the test reads only after the tier dropped it.
unsafe impl Sync for Unaligned {}

/// A sink whose memory is not aligned for `O_DIRECT` (a primary tier may hand one over
/// through `BlockSink::from_raw_parts`) is filled through an aligned bounce buffer: the load
/// succeeds with the block's bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_into_an_unaligned_sink_goes_through_a_bounce_buffer() {
    let root = temp_root();
    let tier = common::open(root.path());
    assert!(tier.stats().direct_io, "the test needs direct I/O");
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    let buf = Arc::new(Unaligned(std::cell::UnsafeCell::new(vec![0u8; BS + 1])));
    // SAFETY: the vector outlives the sink (the sink owns a clone of the Arc) and nothing
    // else touches it until the sink is dropped.
    let sink = unsafe {
        let v: &mut Vec<u8> = &mut *buf.0.get();
        let p = std::ptr::NonNull::new(v.as_mut_ptr().add(1)).unwrap();
        kv_tier_core::BlockSink::from_raw_parts(p, BS, Box::new(buf.clone()))
    };
    assert!(!sink.is_aligned(512));
    let res = tier
        .load(kv_tier_core::LoadJob {
            requests: Vec::new(),
            blocks: vec![(k, sink)],
        })
        .await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert_eq!(Arc::strong_count(&buf), 1, "the tier kept the sink");
    // SAFETY: the sink is gone; this is the only reference.
    let got: &Vec<u8> = unsafe { &*buf.0.get() };
    let got = &got[1..];
    assert!(verify_block(&k, 0, got));
}

/// A block file cut short between the tier's size check and its read (another process
/// truncating it) is damage: the load fails as `Corrupt` and the file is removed, instead of
/// serving a block whose tail is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_truncated_while_it_is_read_is_damage() {
    let root = temp_root();
    let tier = common::open(root.path());
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    let path = tier.block_path(&k);
    let p = path.clone();
    tier.set_fault_injector(Some(Arc::new(move |op, _: &Path| {
        if op == FsOp::Read {
            let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
            f.set_len(BS as u64 / 2).unwrap();
        }
        None
    })));
    let (res, data) = load(&tier, &[k]).await;
    tier.set_fault_injector(None);
    assert!(
        matches!(res.failed[..], [(_, Error::Corrupt { .. })]),
        "{:?}",
        res.failed
    );
    assert!(data.is_empty());
    assert!(!path.exists(), "the damaged file stays");
}

/// A block that is already there is not written again: in a plain tier, and in a checked
/// tier with `accept_unverified` for a file that carries no checksum (another writer's);
/// either way the store counts as skipped and the file stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_present_block_is_kept_by_a_store_in_a_plain_and_a_lenient_tier() {
    let root = temp_root();
    let mut lenient = cfg(root.path());
    lenient.checksum = kv_tier_fs::Checksum::Crc32c;
    lenient.accept_unverified = true;
    for c in [cfg(root.path()), lenient] {
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let p = store_over_a_planted_block(&tier, test_key(7)).await;
        std::fs::remove_file(&p).unwrap();
    }
}

/// Files a sweep decided to delete stay counted until they are unlinked: held at the moment
/// a batch is decided and not yet unlinked, the tier's total still holds them (they are on
/// disk), and room reserved against it cannot pass the ceiling on bytes not freed yet.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_being_unlinked_count_until_they_are_gone() {
    let root = temp_root();
    let tier = Arc::new(FsTier::open("fs", bounded(root.path(), 4, 1), ns(), BS).unwrap());
    let ks: Vec<BlockKey> = (0..6).map(leaf_key).collect();
    assert!(store(&*tier, &ks, 0).await.is_success());
    age(&tier, &ks, |i| 6000 - 1000 * i as u64);
    let full = gc(&tier).bytes;
    let (at_rx, go_tx) = hook_at(&tier, SweepPoint::Unlinking);
    let t = tier.clone();
    let sweep = std::thread::spawn(move || t.gc_sweep_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the sweep never reached its unlinks");
    // decided, out of the index, still on disk: still counted
    assert!(ks.iter().all(|k| tier.block_path(k).exists()));
    assert_eq!(
        gc(&tier).bytes,
        full,
        "victims not unlinked yet were not counted"
    );
    // a load of a victim meanwhile finds its file: counted once, not again
    let (res, _) = load(&*tier, &ks[..1]).await;
    assert!(res.is_success());
    assert_eq!(
        gc(&tier).bytes,
        full,
        "a victim loaded meanwhile was counted twice"
    );
    go_tx.send(()).unwrap();
    assert_eq!(sweep.join().unwrap(), 5);
    tier.set_sweep_hook(None).unwrap();
    assert_eq!(gc(&tier).bytes, full - 5 * BS as u64);
}
