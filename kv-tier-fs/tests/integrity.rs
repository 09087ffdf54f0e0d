//! With checksums on, the fs tier serves verified bytes or a miss; damage at a block's path
//! heals (it is removed and reported, and the next store rewrites it); a damaged
//! `config.json` never blocks a cache directory; stray temp files and orphan sidecars go.

mod common;

use std::path::Path;
use std::time::{Duration, SystemTime};

use common::{BS, Mount, cfg, load, ns, open_checksummed, store};
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{CRC_SIDECAR_SUFFIX, Checksum, FsTier};
use kv_tier_testkit::{block_bytes, find_files, temp_root, test_key, verify_block};

fn removed(tier: &FsTier) -> Vec<BlockKey> {
    kv_tier_testkit::removed_keys(tier.take_events())
}

/// Loads `k` expecting a miss that removed the file and reported it; then a store rewrites
/// it and it loads verified.
async fn assert_miss_then_heals(tier: &FsTier, k: BlockKey, what: &str) {
    tier.take_events();
    let (res, data) = load(tier, &[k]).await;
    assert!(data.is_empty(), "{what}: unverified bytes were served");
    assert!(
        matches!(res.failed[0].1, Error::Corrupt { .. }),
        "{what}: {:?}",
        res.failed
    );
    let p = tier.block_path(&k);
    assert!(
        std::fs::symlink_metadata(&p).is_err(),
        "{what}: the damage was kept"
    );
    assert_eq!(removed(tier), vec![k], "{what}: no BlockRemoved");
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![false], "{what}");
    assert!(store(tier, &[k], 4).await.is_success());
    let (res, data) = load(tier, &[k]).await;
    assert!(res.is_success(), "{what}: {:?}", res.failed);
    assert!(verify_block(&k, 4, &data[0].1), "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_checksums_a_block_replaced_by_another_file_is_a_miss_not_unverified_bytes() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    // another file (new inode, no checksum xattr) at the block's path
    let p = tier.block_path(&k);
    let other = p.with_extension("other");
    std::fs::write(&other, block_bytes(&k, 9, BS)).unwrap();
    std::fs::rename(&other, &p).unwrap();
    assert_miss_then_heals(&tier, k, "replaced file").await;
    assert_eq!(tier.stats().blocks.unverified_refused, 1);
    assert_eq!(tier.stats().blocks.unverified_loads, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_checksum_xattr_is_damage_that_heals() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    let p = tier.block_path(&k);
    common::set_crc_xattr(&p, &[1, 2, 3]);
    // a store finds it damaged and rewrites it at once...
    assert!(store(&tier, &[k], 5).await.is_success());
    assert_eq!(removed(&tier), vec![k]);
    let (res, data) = load(&tier, &[k]).await;
    assert!(res.is_success() && verify_block(&k, 5, &data[0].1));
    // ...and a load finds it damaged, removes it and reports it
    common::set_crc_xattr(&p, &[1, 2, 3]);
    assert_miss_then_heals(&tier, k, "malformed xattr").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_directory_or_a_link_at_a_block_path_is_not_a_block_and_heals() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let (d, l) = (test_key(1), test_key(2));
    for k in [d, l] {
        std::fs::create_dir_all(tier.block_path(&k).parent().unwrap()).unwrap();
    }
    std::fs::create_dir(tier.block_path(&d)).unwrap();
    std::fs::write(tier.block_path(&d).join("x"), b"x").unwrap();
    let target = root.path().join("elsewhere.bin");
    std::fs::write(&target, block_bytes(&l, 0, BS)).unwrap();
    std::os::unix::fs::symlink(&target, tier.block_path(&l)).unwrap();
    assert_eq!(
        tier.lookup(&[d, l]).await.unwrap(),
        vec![false, false],
        "only regular files are present"
    );
    // a load removes them (and reports them)
    let (res, _) = load(&tier, &[d]).await;
    assert!(
        matches!(res.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        res.failed
    );
    assert!(!tier.block_path(&d).exists());
    assert_eq!(removed(&tier), vec![d]);
    // a store replaces them
    assert!(store(&tier, &[l], 3).await.is_success());
    assert!(
        target.exists(),
        "the link's target is not the tier's to delete"
    );
    let (res, data) = load(&tier, &[d, l]).await;
    assert_eq!(res.ok, vec![l]);
    assert!(verify_block(&l, 3, &data[0].1));
    assert!(store(&tier, &[d], 3).await.is_success());
    assert!(load(&tier, &[d]).await.0.is_success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_unverified_serves_blocks_without_a_checksum_and_nothing_else() {
    let root = temp_root();
    let mut c = cfg(root.path());
    c.checksum = Checksum::Crc32c;
    c.accept_unverified = true;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let (foreign, flipped) = (test_key(1), test_key(2));
    let p = tier.block_path(&foreign);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, block_bytes(&foreign, 0, BS)).unwrap(); // vLLM's: no checksum
    assert!(store(&tier, &[flipped], 0).await.is_success());
    let q = tier.block_path(&flipped);
    let mut bytes = std::fs::read(&q).unwrap();
    bytes[9] ^= 1;
    std::fs::write(&q, bytes).unwrap(); // in place: the xattr stays, the bytes do not match
    let (res, data) = load(&tier, &[foreign, flipped]).await;
    assert_eq!(res.ok, vec![foreign]);
    assert!(verify_block(&foreign, 0, &data[0].1));
    assert_eq!(tier.stats().blocks.unverified_loads, 1);
    assert_eq!(tier.stats().blocks.checksum_mismatches, 1);
    // the option says what it does: without checksums it is refused
    let mut bad = cfg(root.path());
    bad.accept_unverified = true;
    match FsTier::open("fs", bad, ns(), BS).unwrap_err() {
        Error::InvalidConfig { field, .. } => assert_eq!(field, "accept_unverified"),
        e => panic!("{e}"),
    }
}

/// Sidecar mode (a filesystem without user xattrs): a deleted, stale or malformed sidecar
/// is a miss; a sidecar without its block is reaped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_xattrs_a_missing_stale_or_malformed_sidecar_is_a_miss() {
    let m = Mount::new("ramfs", "");
    let tier = open_checksummed(&m.dir);
    tier.set_sidecar_grace(Duration::ZERO);
    let ks: Vec<_> = (0..4).map(test_key).collect();
    assert!(store(&tier, &ks, 0).await.is_success());
    let side = |k: &BlockKey| {
        let mut s = tier.block_path(k).into_os_string();
        s.push(CRC_SIDECAR_SUFFIX);
        std::path::PathBuf::from(s)
    };
    assert_eq!(std::fs::read(side(&ks[0])).unwrap().len(), 12);
    // deleted
    std::fs::remove_file(side(&ks[0])).unwrap();
    assert_miss_then_heals(&tier, ks[0], "deleted sidecar").await;
    // malformed (not 4 or 12 bytes)
    std::fs::write(side(&ks[1]), [1u8, 2, 3, 4, 5]).unwrap();
    assert_miss_then_heals(&tier, ks[1], "malformed sidecar").await;
    // stale: the block was replaced by another file since (another inode)
    let p = tier.block_path(&ks[2]);
    let other = p.with_extension("other");
    std::fs::write(&other, block_bytes(&ks[2], 0, BS)).unwrap();
    std::fs::rename(&other, &p).unwrap();
    assert_miss_then_heals(&tier, ks[2], "stale sidecar").await;
    // a block published a moment ago whose sidecar is not written yet: a miss, not damage
    tier.set_sidecar_grace(Duration::from_secs(3600));
    std::fs::remove_file(side(&ks[3])).unwrap();
    let p3 = tier.block_path(&ks[3]);
    let again = p3.with_extension("again");
    std::fs::copy(&p3, &again).unwrap();
    std::fs::rename(&again, &p3).unwrap(); // a fresh inode, as a publisher's
    let (res, _) = load(&tier, &ks[3..]).await;
    assert!(!res.is_success());
    assert!(
        p3.exists(),
        "a block whose sidecar is on its way was removed"
    );
}

/// Sidecar mode: a store that finds its block without a sidecar (past the grace a publisher
/// has to write one) does not take it for a stored block: it writes the block again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_xattrs_a_store_rewrites_a_block_whose_sidecar_is_gone() {
    let m = Mount::new("ramfs", "");
    let tier = open_checksummed(&m.dir);
    tier.set_sidecar_grace(Duration::ZERO);
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    let mut side = tier.block_path(&k).into_os_string();
    side.push(CRC_SIDECAR_SUFFIX);
    std::fs::remove_file(&side).unwrap();
    tier.take_events();
    assert!(store(&tier, &[k], 5).await.is_success());
    assert_eq!(removed(&tier), vec![k], "the unverifiable block was kept");
    let (res, data) = load(&tier, &[k]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&k, 5, &data[0].1));
}

#[test]
fn a_damaged_config_json_is_rewritten_and_a_foreign_one_refused_naming_fields() {
    let root = temp_root();
    drop(common::open(root.path()));
    let path = ns().config_path(root.path());
    for damage in ["", "{\"model_name\": \"m", "\u{0}\u{0}\u{0}", "[1, 2]"] {
        std::fs::write(&path, damage).unwrap();
        let tier = common::open(root.path());
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            ns().config_json(),
            "{damage:?}"
        );
        drop(tier);
    }
    // a valid one that disagrees is refused, naming what differs
    let mut v: serde_json::Value = serde_json::from_str(&ns().config_json()).unwrap();
    v["dtype"] = "torch.bfloat16".into();
    std::fs::write(&path, v.to_string()).unwrap();
    let err = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap_err();
    assert!(matches!(err, Error::LayoutMismatch { .. }), "{err}");
    assert!(err.to_string().contains("dtype"), "{err}");
}

fn age_file(p: &Path, secs: u64) {
    let f = std::fs::File::options().write(true).open(p).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(secs))
        .unwrap();
}

/// The rank directory's own temp files (an open's capability probe killed mid-way) and
/// sidecars whose block is gone are reaped at open (bounded mode walks the tree) and by
/// rescans, which honour `tmp_reap_age_s`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_temp_files_and_orphan_sidecars_are_reaped_by_walks() {
    let m = Mount::new("ramfs", ""); // sidecars
    let mut c = cfg(&m.dir);
    c.checksum = Checksum::Crc32c;
    c.gc_max_size_gb = Some(1.0);
    c.gc_background = false;
    c.tmp_reap_age_s = 100;
    let tier = FsTier::open("fs", c.clone(), ns(), BS).unwrap();
    let ks: Vec<_> = (0..3).map(test_key).collect();
    assert!(store(&tier, &ks, 0).await.is_success());
    drop(tier);
    let rank = tier_rank_dir(&m.dir);
    let probe = rank.join(".kv-tier-probe-0123456789abcdef.tmp");
    std::fs::write(&probe, b"").unwrap();
    age_file(&probe, 1000);
    let young = rank.join(".kv-tier-probe-fedcba9876543210.tmp");
    std::fs::write(&young, b"").unwrap();
    // someone else deleted two blocks and left their sidecars behind
    let paths: Vec<_> = ks.iter().map(|k| ns().block_path(&m.dir, k)).collect();
    for p in &paths[..2] {
        std::fs::remove_file(p).unwrap();
    }
    let side = |p: &Path| {
        let mut s = p.as_os_str().to_os_string();
        s.push(CRC_SIDECAR_SUFFIX);
        std::path::PathBuf::from(s)
    };
    age_file(&side(&paths[0]), 1000);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    assert!(!probe.exists(), "the probe's temp file survived a reopen");
    assert!(young.exists(), "a young temp file was reaped");
    assert!(!side(&paths[0]).exists(), "an orphan sidecar survived");
    assert!(
        side(&paths[1]).exists(),
        "a young orphan sidecar went (its block may be on its way)"
    );
    assert!(side(&paths[2]).exists(), "a live block's sidecar went");
    assert_eq!(tier.stats().sidecars_reaped, 1);
    // a rescan does the same, with the configured age
    age_file(&young, 1000);
    age_file(&side(&paths[1]), 1000);
    tier.gc_rescan_now().unwrap();
    assert!(!young.exists() && !side(&paths[1]).exists());
    assert!(load(&tier, &ks[2..]).await.0.is_success());
    assert_eq!(find_files(&m.dir, CRC_SIDECAR_SUFFIX).len(), 1);
}

/// A bounded tier's opening walk reaps old temp files at every level of the tree (the rank
/// directory, a top directory, a leaf directory) and counts them; a file that is not a block
/// is left alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_opening_walk_reaps_old_temp_files_at_every_level_and_counts_them() {
    let root = temp_root();
    let mut c = cfg(root.path());
    c.gc_max_size_gb = Some(1.0);
    c.gc_background = false;
    c.tmp_reap_age_s = 100;
    let tier = FsTier::open("fs", c.clone(), ns(), BS).unwrap();
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    drop(tier);
    let leaf = ns()
        .block_path(root.path(), &k)
        .parent()
        .unwrap()
        .to_path_buf();
    let top = leaf.parent().unwrap().to_path_buf();
    let tmps = [
        tier_rank_dir(root.path()).join("x_0123456789abcdef.tmp"),
        top.join("y_0123456789abcdef.tmp"),
        leaf.join("z_0123456789abcdef.tmp"),
    ];
    for t in &tmps {
        std::fs::write(t, b"partial").unwrap();
        age_file(t, 1000);
    }
    let foreign = leaf.join("not-a-block.bin");
    std::fs::write(&foreign, b"someone else's").unwrap();
    let notes = top.join("notes.txt"); // old, but not a temp file
    std::fs::write(&notes, b"someone else's").unwrap();
    age_file(&notes, 1000);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    for t in &tmps {
        assert!(!t.exists(), "{} survived", t.display());
    }
    assert_eq!(tier.stats().tmp_reaped, 3);
    assert!(foreign.exists(), "a file that is not a block went");
    assert!(notes.exists(), "an old file that is not a temp file went");
    assert!(load(&tier, &[k]).await.0.is_success());
}

fn tier_rank_dir(root: &Path) -> std::path::PathBuf {
    root.join(ns().rank_dir_name())
}

/// The checksum covers the key: a block file moved (or linked) to another key's path fails
/// verification there instead of being served as that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_moved_to_another_keys_path_is_not_served_as_that_key() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let (j, k) = (test_key(1), test_key(2));
    assert!(store(&tier, &[j], 0).await.is_success());
    let pk = tier.block_path(&k);
    std::fs::create_dir_all(pk.parent().unwrap()).unwrap();
    std::fs::hard_link(tier.block_path(&j), &pk).unwrap(); // same inode, same xattr
    let (res, data) = load(&tier, &[k]).await;
    assert!(data.is_empty(), "J's bytes were served as K");
    assert!(
        matches!(res.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        res.failed
    );
    assert!(load(&tier, &[j]).await.0.is_success(), "J itself is fine");
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

/// A FIFO where a block, a sidecar or `config.json` belongs never blocks a load, a store or
/// an open: it is damage (removed, or replaced).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_at_a_block_sidecar_or_config_path_blocks_nothing() {
    async fn bounded<F: Future>(fut: F) -> Result<F::Output, tokio::time::error::Elapsed> {
        tokio::time::timeout(Duration::from_secs(30), fut).await
    }
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let k = test_key(1);
    let p = tier.block_path(&k);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    mkfifo(&p);
    let (res, _) = bounded(load(&tier, &[k]))
        .await
        .expect("a load hung on a FIFO");
    assert!(
        matches!(res.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        res.failed
    );
    assert!(std::fs::symlink_metadata(&p).is_err(), "the FIFO was kept");
    mkfifo(&p);
    assert!(
        bounded(store(&tier, &[k], 0))
            .await
            .expect("a store hung")
            .is_success()
    );
    assert!(load(&tier, &[k]).await.0.is_success());
    drop(tier);
    // sidecars (no xattrs on ramfs)
    let m = Mount::new("ramfs", "");
    let tier = open_checksummed(&m.dir);
    tier.set_sidecar_grace(Duration::ZERO);
    assert!(store(&tier, &[k], 0).await.is_success());
    let mut side = tier.block_path(&k).into_os_string();
    side.push(CRC_SIDECAR_SUFFIX);
    let side = std::path::PathBuf::from(side);
    std::fs::remove_file(&side).unwrap();
    mkfifo(&side);
    let (res, _) = bounded(load(&tier, &[k]))
        .await
        .expect("a load hung on a FIFO sidecar");
    assert!(!res.is_success());
    drop(tier);
    // config.json
    let root = temp_root();
    drop(common::open(root.path()));
    let config = ns().config_path(root.path());
    std::fs::remove_file(&config).unwrap();
    mkfifo(&config);
    let opened = tokio::task::spawn_blocking({
        let r = root.path().to_path_buf();
        move || FsTier::open("fs", cfg(&r), ns(), BS).map(drop)
    });
    bounded(opened)
        .await
        .expect("open hung on a FIFO config.json")
        .unwrap()
        .unwrap();
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        ns().config_json()
    );
}

/// An unbounded tier's open reaps old sidecars whose block is gone, as a bounded one's does.
#[test]
fn an_unbounded_open_reaps_orphan_sidecars() {
    let m = Mount::new("ramfs", "");
    let k = test_key(1);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let tier = open_checksummed(&m.dir);
    assert!(rt.block_on(store(&tier, &[k], 0)).is_success());
    drop(tier);
    let p = ns().block_path(&m.dir, &k);
    std::fs::remove_file(&p).unwrap();
    let mut side = p.into_os_string();
    side.push(CRC_SIDECAR_SUFFIX);
    let side = std::path::PathBuf::from(side);
    age_file(&side, 99_999);
    let tier = open_checksummed(&m.dir);
    assert!(
        !side.exists(),
        "an orphan sidecar survived an unbounded open"
    );
    assert_eq!(tier.stats().sidecars_reaped, 1);
}

/// A file with an mtime far in the future (or past) is adopted without overflow; a block
/// size beyond the 1 GiB limit is refused naming it.
#[test]
fn odd_mtimes_and_block_sizes_never_make_open_panic() {
    let root = temp_root();
    let k = test_key(1);
    let p = ns().block_path(root.path(), &k);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, vec![0u8; BS]).unwrap();
    let f = std::fs::File::options().write(true).open(&p).unwrap();
    f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(11_000_000_000))
        .unwrap();
    drop(f);
    let mut c = cfg(root.path());
    c.gc_max_size_gb = Some(1.0);
    c.gc_background = false;
    let tier = FsTier::open("fs", c.clone(), ns(), BS).unwrap();
    tier.gc_rescan_now().unwrap();
    assert_eq!(tier.stats().gc.unwrap().files, 1);
    drop(tier);
    for bs in [usize::MAX, (1 << 30) + 1] {
        match FsTier::open("fs", c.clone(), ns(), bs).unwrap_err() {
            Error::InvalidConfig { field, .. } => assert_eq!(field, "block_size_bytes"),
            e => panic!("{e}"),
        }
    }
}
