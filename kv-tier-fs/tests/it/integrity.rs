//! A load serves exactly the bytes stored or a miss. Files of the wrong size, flipped bits,
//! punched holes, blocks at another key's path, missing, stale or malformed checksums (in
//! xattrs and in sidecars), devices, sockets, links and FIFOs at block paths are damage:
//! removed, reported `BlockRemoved`, and healed by the next store; `accept_unverified` serves
//! blocks without a checksum and nothing else.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{CRC_SIDECAR_SUFFIX, CRC_XATTR, Checksum, FsOp, FsTier};
use kv_tier_testkit::fixtures::files::{Mount, mkfifo};
use kv_tier_testkit::{block_bytes, load_keys, store_keys, temp_root, test_key, verify_block};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_file_is_deleted_and_reported() {
    let root = temp_root();
    let tier = open(root.path());
    let keys = [test_key(1), test_key(2)];
    assert!(fs_store(&tier, &keys, 0).await.is_success());
    tier.take_events();
    let path = tier.block_path(&keys[1]);
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(BS as u64 / 2).unwrap();
    drop(f);
    let (res, data) = load(&tier, &keys).await;
    assert_eq!(res.ok, vec![keys[0]]);
    assert!(
        matches!(res.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        res.failed
    );
    assert!(verify_block(&keys[0], 0, &data[0].1));
    assert!(!path.exists(), "the short file was kept");
    assert_eq!(tier.lookup(&keys).await.unwrap(), vec![true, false]);
    let ev = tier.take_events();
    assert_eq!(ev.len(), 1);
    assert!(ev[0].removed && ev[0].keys == vec![keys[1]]);
    assert_eq!(tier.stats().blocks.corrupt_deleted, 1);
    // and it can be stored again
    assert!(fs_store(&tier, &keys[1..], 0).await.is_success());
    assert!(load(&tier, &keys[1..]).await.0.is_success());
}

/// A file longer than a block (a byte or a block appended: its first bytes are the right
/// block) is damage, not a block: the load reads one logical block past the end in the same
/// call to tell, with O_DIRECT on disk and buffered on ramfs, checksums on or off.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_file_is_deleted_and_reported_with_or_without_o_direct() {
    let on_disk = temp_root();
    let m = Mount::new("ramfs", "");
    for (dir, checksums) in [
        (on_disk.path(), false),
        (on_disk.path(), true),
        (m.dir.as_path(), false),
        (m.dir.as_path(), true),
    ] {
        let root = dir.join(format!("long-{checksums}"));
        let tier = if checksums {
            open_checksummed(&root)
        } else {
            open(&root)
        };
        for (i, extra) in [1usize, 511, BS].into_iter().enumerate() {
            let k = test_key(100 + i as u64);
            assert!(fs_store(&tier, &[k], 0).await.is_success());
            let path = tier.block_path(&k);
            let mut f = std::fs::OpenOptions::new()
                .append(true)
                .open(&path)
                .unwrap();
            std::io::Write::write_all(&mut f, &vec![0u8; extra]).unwrap();
            drop(f);
            let (res, _) = load(&tier, &[k]).await;
            let what = format!("{extra} bytes appended, direct {}", tier.stats().direct_io);
            assert!(
                matches!(&res.failed[..], [(_, Error::Corrupt { reason, .. })]
                    if reason.contains(&format!("is {} bytes", BS + extra))),
                "{what}: {:?}",
                res.failed
            );
            assert!(!path.exists(), "{what}: the long file was kept");
            // and it heals
            assert!(fs_store(&tier, &[k], 0).await.is_success());
            let (res, data) = load(&tier, &[k]).await;
            assert!(
                res.is_success() && verify_block(&k, 0, &data[0].1),
                "{what}"
            );
        }
        tier.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checksum_mismatch_in_the_last_block_keeps_the_first_two() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let keys: Vec<_> = (0..3).map(test_key).collect();
    assert!(fs_store(&tier, &keys, 0).await.is_success());
    // flip one byte of the third block, size unchanged
    let path = tier.block_path(&keys[2]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[BS / 3] ^= 0x40;
    std::fs::write(&path, &bytes).unwrap(); // same inode: the xattr stays
    let (res, data) = load(&tier, &keys).await;
    let mut ok = res.ok.clone();
    ok.sort();
    let mut want = keys[..2].to_vec();
    want.sort();
    assert_eq!(ok, want);
    assert_eq!(res.failed.len(), 1);
    assert_eq!(res.failed[0].0, keys[2]);
    assert!(matches!(&res.failed[0].1, Error::Corrupt { reason, .. } if reason.contains("crc32c")));
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert!(!path.exists());
    let s = tier.stats();
    assert_eq!(
        (
            s.blocks.checksum_mismatches,
            s.blocks.corrupt_deleted,
            s.blocks.unverified_loads
        ),
        (1, 1, 0)
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
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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

/// A block file cut short between the tier's size check and its read (another process
/// truncating it) is damage: the load fails as `Corrupt` and the file is removed, instead of
/// serving a block whose tail is missing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_truncated_while_it_is_read_is_damage() {
    let root = temp_root();
    let tier = open(root.path());
    let k = test_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_checksums_a_block_replaced_by_another_file_is_a_miss_not_unverified_bytes() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let k = test_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    let p = tier.block_path(&k);
    set_crc_xattr(&p, &[1, 2, 3]);
    // a store finds it damaged and rewrites it at once...
    assert!(fs_store(&tier, &[k], 5).await.is_success());
    assert_eq!(removed(&tier), vec![k]);
    let (res, data) = load(&tier, &[k]).await;
    assert!(res.is_success() && verify_block(&k, 5, &data[0].1));
    // ...and a load finds it damaged, removes it and reports it
    set_crc_xattr(&p, &[1, 2, 3]);
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
    assert!(fs_store(&tier, &[l], 3).await.is_success());
    assert!(
        target.exists(),
        "the link's target is not the tier's to delete"
    );
    let (res, data) = load(&tier, &[d, l]).await;
    assert_eq!(res.ok, vec![l]);
    assert!(verify_block(&l, 3, &data[0].1));
    assert!(fs_store(&tier, &[d], 3).await.is_success());
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
    assert!(fs_store(&tier, &[flipped], 0).await.is_success());
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
    assert!(fs_store(&tier, &ks, 0).await.is_success());
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
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    let mut side = tier.block_path(&k).into_os_string();
    side.push(CRC_SIDECAR_SUFFIX);
    std::fs::remove_file(&side).unwrap();
    tier.take_events();
    assert!(fs_store(&tier, &[k], 5).await.is_success());
    assert_eq!(removed(&tier), vec![k], "the unverifiable block was kept");
    let (res, data) = load(&tier, &[k]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&k, 5, &data[0].1));
}

/// Sidecar mode: a directory (with files in it) at a block's sidecar path is in the way of
/// the sidecar: the store removes it and writes the sidecar, and the block loads verified
/// (it used to fail every load, losing the block, forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_xattrs_a_directory_at_a_sidecar_path_is_healed_by_the_store() {
    let m = Mount::new("ramfs", "");
    let tier = open_checksummed(&m.dir);
    tier.set_sidecar_grace(Duration::ZERO);
    let k = test_key(1);
    let path = tier.block_path(&k);
    let mut side = path.clone().into_os_string();
    side.push(CRC_SIDECAR_SUFFIX);
    let side = PathBuf::from(side);
    std::fs::create_dir_all(side.join("inner")).unwrap();
    std::fs::write(side.join("inner/file"), b"x").unwrap();
    assert!(fs_store(&tier, &[k], 3).await.is_success());
    assert!(side.is_file(), "the sidecar was not written");
    for round in 0..2 {
        let (res, data) = load(&tier, &[k]).await;
        assert!(res.is_success(), "round {round}: {:?}", res.failed);
        assert!(verify_block(&k, 3, &data[0].1));
    }
}

/// The checksum covers the key: a block file moved (or linked) to another key's path fails
/// verification there instead of being served as that key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_moved_to_another_keys_path_is_not_served_as_that_key() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let (j, k) = (test_key(1), test_key(2));
    assert!(fs_store(&tier, &[j], 0).await.is_success());
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
        bounded(fs_store(&tier, &[k], 0))
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
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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
    drop(open(root.path()));
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

/// A file whose size is not exactly the block size (empty, one byte short or long, a
/// logical block long, twice the block, a sparse gigabyte long) is never served, even when
/// its first `block` bytes are exactly the block's: the load is a miss, the file removed and
/// reported. Also for a block size that is not a multiple of 512, and with buffered I/O.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_of_any_wrong_size_are_misses_removed_and_reported() {
    for (bs, direct) in [
        (4096usize, true),
        (5000, true),
        (4096, false),
        (65536, true),
    ] {
        let root = temp_root();
        let mut c = cfg(root.path());
        c.direct_io = direct;
        let tier = FsTier::open("fs", c, ns(), bs).unwrap();
        let sizes = [
            0,
            1,
            511,
            bs - 1,
            bs + 1,
            bs + 511,
            bs + 512,
            bs + 4095,
            bs + 4096,
            bs + 4097,
            2 * bs,
            3 * bs + 7,
            bs + (1 << 30),
        ];
        for (i, &sz) in sizes.iter().enumerate() {
            let what = format!("block {bs} (direct {direct}), file of {sz} bytes");
            let k = test_key(10_000 + i as u64);
            let p = tier.block_path(&k);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let mut bytes = block_bytes(&k, 0, bs.min(sz));
            if sz > bs && sz < bs + (1 << 20) {
                bytes.extend(block_bytes(&test_key(99), 0, sz - bs));
            }
            std::fs::write(&p, &bytes).unwrap();
            if sz as u64 > bytes.len() as u64 {
                let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
                f.set_len(sz as u64).unwrap(); // sparse tail
            }
            assert_eq!(std::fs::metadata(&p).unwrap().len(), sz as u64);
            tier.take_events();
            let (res, data) = load_keys(&tier, &[k], bs).await;
            assert_accounts(&res, &[k], &what);
            assert!(data.is_empty(), "{what}: served");
            assert!(
                matches!(res.failed[..], [(_, Error::Corrupt { .. })]),
                "{what}: {:?}",
                res.failed
            );
            assert!(!exists_nofollow(&p), "{what}: the file was kept");
            assert_eq!(removed(&tier), vec![k], "{what}: no BlockRemoved");
            // heals
            let r = store_keys(&tier, &[k], 1, bs).await;
            assert!(r.is_success(), "{what}: {:?}", r.failed);
            let (res, data) = load_keys(&tier, &[k], bs).await;
            assert!(
                res.is_success() && verify_block(&k, 1, &data[0].1),
                "{what}: not healed"
            );
        }
        // a right-sized sparse file with a checksum-less tier is bytes like any other
        // (nothing to check); the right size never confuses the short-read detection
        let k = test_key(20_000);
        let p = tier.block_path(&k);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(bs as u64).unwrap();
        drop(f);
        let (res, data) = load_keys(&tier, &[k], bs).await;
        assert!(
            res.is_success(),
            "block {bs}: a sparse file of exactly the size: {:?}",
            res.failed
        );
        assert!(data[0].1.iter().all(|&b| b == 0));
        tier.shutdown().await.unwrap();
    }
}

/// With checksums, a flipped bit anywhere in the block (first byte, sector edges, middle,
/// last byte), a punched hole, or a flipped bit anywhere in the checksum xattr, is never
/// served: a miss, the file removed and reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_flipped_bit_in_block_or_xattr_is_a_miss_never_served() {
    let root = temp_root();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    let mut n = 0u64;
    let mut next_key = || {
        n += 1;
        test_key(30_000 + n)
    };
    let offsets = [
        0u64,
        1,
        7,
        511,
        512,
        4095,
        BS as u64 / 2,
        BS as u64 - 2,
        BS as u64 - 1,
    ];
    for off in offsets {
        let k = next_key();
        assert!(fs_store(&tier, &[k], 0).await.is_success());
        let p = tier.block_path(&k);
        flip_byte(&p, off);
        tier.take_events();
        let (res, data) = load(&tier, &[k]).await;
        assert!(data.is_empty(), "a flipped bit at {off} was served");
        assert!(
            matches!(res.failed[..], [(_, Error::Corrupt { .. })]),
            "flip at {off}: {:?}",
            res.failed
        );
        assert!(!exists_nofollow(&p), "flip at {off}: kept");
        assert_eq!(removed(&tier), vec![k], "flip at {off}");
    }
    // a punched hole (zeros where data was, same size)
    let k = next_key();
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    let p = tier.block_path(&k);
    {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        // SAFETY: a valid descriptor.
        let rc = unsafe {
            libc::fallocate(
                f.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                BS as i64,
            )
        };
        assert_eq!(rc, 0);
    }
    assert_eq!(std::fs::metadata(&p).unwrap().len(), BS as u64);
    let (res, data) = load(&tier, &[k]).await;
    assert!(
        data.is_empty() && !res.is_success(),
        "a punched hole was served"
    );
    // every bit of the xattr
    let k0 = next_key();
    assert!(fs_store(&tier, &[k0], 0).await.is_success());
    let x = crc_xattr(&tier.block_path(&k0)).expect("ext4 keeps the checksum in an xattr");
    for i in 0..x.len() {
        for bit in [0x01u8, 0x80] {
            let k = next_key();
            assert!(fs_store(&tier, &[k], 0).await.is_success());
            let p = tier.block_path(&k);
            let mut v = crc_xattr(&p).unwrap();
            v[i] ^= bit;
            try_set_crc_xattr(&p, &v).unwrap();
            let (res, data) = load(&tier, &[k]).await;
            assert!(
                data.is_empty() && !res.is_success(),
                "xattr {:?} with byte {i} ^ {bit:#x} was served",
                String::from_utf8_lossy(&v)
            );
        }
    }
    // with the xattr removed
    let k = next_key();
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    let p = tier.block_path(&k);
    let c = cpath(&p);
    let name = CString::new(CRC_XATTR).unwrap();
    // SAFETY: valid path and name.
    assert_eq!(unsafe { libc::lremovexattr(c.as_ptr(), name.as_ptr()) }, 0);
    let (res, data) = load(&tier, &[k]).await;
    assert!(
        data.is_empty() && !res.is_success(),
        "a block without its xattr was served"
    );
    assert_eq!(
        tier.stats().blocks.blocks_read,
        0,
        "something was read whole"
    );
}

/// The CRC covers the key: the same hash in another group (a different key, a different
/// leaf directory) linked or copied with its xattr is not served there; nor is another
/// hash's block copied with its xattr; nor one whose bytes are another key's with that
/// key's xattr (a consistent pair at the wrong path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_at_another_keys_path_fails_there_also_across_groups() {
    let root = temp_root();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    let h = *b"0123456789abcdef0123456789abcdef";
    let g0 = BlockKey::from_hash32(h, 0);
    let g1 = BlockKey::from_hash32(h, 1);
    let g7 = BlockKey::from_hash32(h, 7);
    let other = test_key(40_001);
    assert!(fs_store(&tier, &[g0], 0).await.is_success());
    let src = tier.block_path(&g0);
    let xattr = crc_xattr(&src).unwrap();
    // hard link into the group-1 path
    let p1 = tier.block_path(&g1);
    assert_ne!(p1, src);
    std::fs::create_dir_all(p1.parent().unwrap()).unwrap();
    std::fs::hard_link(&src, &p1).unwrap();
    // copy (new inode) with the xattr into the group-7 path and another hash's path
    for k in [g7, other] {
        let p = tier.block_path(&k);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::copy(&src, &p).unwrap();
        try_set_crc_xattr(&p, &xattr).unwrap();
    }
    for (k, what) in [
        (g1, "hard link into group 1"),
        (g7, "copy into group 7"),
        (other, "copy into another hash"),
    ] {
        let (res, data) = load(&tier, &[k]).await;
        assert!(
            data.is_empty(),
            "{what}: group 0's bytes were served as {k}"
        );
        assert!(!res.is_success(), "{what}");
    }
    // the original stands
    let (res, data) = load(&tier, &[g0]).await;
    assert!(
        res.is_success() && verify_block(&g0, 0, &data[0].1),
        "{:?}",
        res.failed
    );
}

/// In sidecar mode (ramfs: no user xattrs), the same: a block hard-linked to another
/// group's path with its sidecar copied beside it, or a flipped byte in block or sidecar,
/// is never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_mode_never_serves_linked_or_flipped_blocks() {
    let m = Mount::new("ramfs", "");
    let tier = FsTier::open("fs", checked_cfg(&m.dir), ns(), BS).unwrap();
    let h = *b"fedcba9876543210fedcba9876543210";
    let g0 = BlockKey::from_hash32(h, 0);
    let g1 = BlockKey::from_hash32(h, 1);
    assert!(fs_store(&tier, &[g0], 0).await.is_success());
    let src = tier.block_path(&g0);
    let side = PathBuf::from(format!(
        "{}{}",
        src.display(),
        kv_tier_fs::CRC_SIDECAR_SUFFIX
    ));
    assert!(side.exists(), "no sidecar on ramfs: {}", side.display());
    let p1 = tier.block_path(&g1);
    std::fs::create_dir_all(p1.parent().unwrap()).unwrap();
    std::fs::hard_link(&src, &p1).unwrap();
    std::fs::copy(
        &side,
        format!("{}{}", p1.display(), kv_tier_fs::CRC_SIDECAR_SUFFIX),
    )
    .unwrap();
    let (res, data) = load(&tier, &[g1]).await;
    assert!(
        data.is_empty() && !res.is_success(),
        "group 0's block served as group 1 through a copied sidecar"
    );
    // flips
    for (i, off) in [0u64, BS as u64 / 2, BS as u64 - 1].into_iter().enumerate() {
        let k = test_key(41_000 + i as u64);
        assert!(fs_store(&tier, &[k], 0).await.is_success());
        flip_byte(&tier.block_path(&k), off);
        let (res, data) = load(&tier, &[k]).await;
        assert!(
            data.is_empty() && !res.is_success(),
            "sidecar mode: flip at {off} served"
        );
    }
    let k = test_key(41_100);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    let sp = PathBuf::from(format!(
        "{}{}",
        tier.block_path(&k).display(),
        kv_tier_fs::CRC_SIDECAR_SUFFIX
    ));
    let len = std::fs::metadata(&sp).unwrap().len();
    for off in 0..len {
        flip_byte(&sp, off);
        let (res, data) = load(&tier, &[k]).await;
        assert!(
            data.is_empty() && !res.is_success(),
            "sidecar byte {off} flipped: served"
        );
        if !tier.block_path(&k).exists() {
            assert!(fs_store(&tier, &[k], 0).await.is_success());
        } else {
            flip_byte(&sp, off);
        }
        let sp_now = PathBuf::from(format!(
            "{}{}",
            tier.block_path(&k).display(),
            kv_tier_fs::CRC_SIDECAR_SUFFIX
        ));
        if !sp_now.exists() {
            break;
        }
    }
}

/// Character devices (/dev/zero's and /dev/null's numbers), a unix socket, a dangling
/// symlink, a symlink loop and a symlink to /dev/zero at block paths: `lookup` says absent,
/// a load is a miss that never hangs and never serves (zeros from /dev/zero!), and the node
/// goes; a store replaces each with the block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_sockets_and_odd_links_at_block_paths_are_damage() {
    for checksum in [Checksum::None, Checksum::Crc32c] {
        for load_first in [true, false] {
            let root = temp_root();
            let mut c = cfg(root.path());
            c.checksum = checksum;
            let tier = FsTier::open("fs", c, ns(), BS).unwrap();
            let kinds = [
                "zero",
                "null",
                "socket",
                "dangling",
                "loop",
                "link-zero",
                "link-dir",
            ];
            let keys: Vec<BlockKey> = (0..kinds.len() as u64)
                .map(|i| test_key(63_000 + i))
                .collect();
            let mut _sockets = Vec::new();
            for (k, kind) in keys.iter().zip(kinds) {
                let p = tier.block_path(k);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                match kind {
                    "zero" => mknod(&p, libc::S_IFCHR | 0o666, libc::makedev(1, 5)),
                    "null" => mknod(&p, libc::S_IFCHR | 0o666, libc::makedev(1, 3)),
                    "socket" => {
                        let short = PathBuf::from(format!(
                            "/tmp/kvs-{}-{}",
                            std::process::id(),
                            k.hash_hex().get(..8).unwrap()
                        ));
                        let _ = std::fs::remove_file(&short);
                        _sockets.push(std::os::unix::net::UnixListener::bind(&short).unwrap());
                        std::fs::rename(&short, &p).unwrap();
                    }
                    "dangling" => std::os::unix::fs::symlink("/nonexistent/x.bin", &p).unwrap(),
                    "loop" => std::os::unix::fs::symlink(&p, &p).unwrap(),
                    "link-zero" => std::os::unix::fs::symlink("/dev/zero", &p).unwrap(),
                    _ => std::os::unix::fs::symlink(root.path(), &p).unwrap(),
                }
            }
            let what = format!("checksum {checksum:?}, load first {load_first}");
            let found = tier.lookup(&keys).await.unwrap();
            assert!(
                found.iter().all(|f| !f),
                "{what}: lookup counted a non-file: {found:?}"
            );
            if load_first {
                tier.take_events();
                let (res, data) = tokio::time::timeout(Duration::from_secs(15), load(&tier, &keys))
                    .await
                    .unwrap_or_else(|_| panic!("{what}: a load hung"));
                assert_accounts(&res, &keys, &what);
                assert!(
                    data.is_empty(),
                    "{what}: served {:?}",
                    data.iter().map(|d| d.0).collect::<Vec<_>>()
                );
                for (k, kind) in keys.iter().zip(kinds) {
                    assert!(
                        !exists_nofollow(&tier.block_path(k)),
                        "{what}: the {kind} at a block path was kept by a load"
                    );
                }
                let mut rm = removed(&tier);
                rm.sort();
                let mut want = keys.clone();
                want.sort();
                assert_eq!(rm, want, "{what}: BlockRemoved events");
            }
            let res = tokio::time::timeout(Duration::from_secs(15), fs_store(&tier, &keys, 2))
                .await
                .unwrap_or_else(|_| panic!("{what}: a store hung"));
            assert!(res.is_success(), "{what}: {:?}", res.failed);
            for (k, kind) in keys.iter().zip(kinds) {
                assert!(
                    is_regular(&tier.block_path(k)),
                    "{what}: the {kind} was not replaced by the block"
                );
            }
            let (res, data) = load(&tier, &keys).await;
            assert!(res.is_success(), "{what}: {:?}", res.failed);
            assert!(data.iter().all(|(k, d)| verify_block(k, 2, d)));
            assert!(std::path::Path::new("/dev/zero").exists() && root.path().is_dir());
        }
    }
}

/// A copy of a stored block (bytes and checksum xattr), to put back over damage.
struct Good {
    bytes: Vec<u8>,
    xattr: Option<Vec<u8>>,
}

/// With checksums, loads and stores run while another thread truncates, extends, rewrites
/// in place, unlinks, and renames good, flipped and foreign-xattr copies over the block
/// files: every load that reports a key loaded returns exactly the stored bytes, every job
/// accounts for its keys, and once the mutation stops every key loads again after a store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_racing_truncation_extension_and_rename_over_serve_exact_bytes_or_miss() {
    for checksum in [Checksum::Crc32c, Checksum::None] {
        let root = temp_root();
        let mut c = cfg(root.path());
        c.checksum = checksum;
        let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
        let keys: Vec<BlockKey> = (0..8).map(|i| test_key(64_000 + i)).collect();
        assert!(fs_store(&tier, &keys, 0).await.is_success());
        let goods: Vec<Good> = keys
            .iter()
            .map(|k| Good {
                bytes: std::fs::read(tier.block_path(k)).unwrap(),
                xattr: crc_xattr(&tier.block_path(k)),
            })
            .collect();
        let paths: Vec<PathBuf> = keys.iter().map(|k| tier.block_path(k)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let checked = checksum == Checksum::Crc32c;
        let mutator = {
            let (stop, ops, paths) = (stop.clone(), ops.clone(), paths.clone());
            std::thread::spawn(move || {
                use std::os::unix::fs::FileExt;
                let mut rng = Rng::new(11);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let i = rng.below(paths.len() as u64) as usize;
                    let p = &paths[i];
                    let g = &goods[i];
                    let put = |bytes: &[u8], x: Option<&Vec<u8>>, n: u64| {
                        let t = p.with_file_name(format!("mut-{n}.cpy"));
                        if std::fs::write(&t, bytes).is_err() {
                            return;
                        }
                        if let Some(x) = x {
                            let _ = try_set_crc_xattr(&t, x);
                        }
                        if std::fs::rename(&t, p).is_err() {
                            let _ = std::fs::remove_file(&t);
                        }
                    };
                    n += 1;
                    // without checksums only mutations a size check can see (the first
                    // BS bytes never change)
                    let op = if checked {
                        rng.below(8)
                    } else {
                        [1, 2, 5, 6][rng.below(4) as usize]
                    };
                    match op {
                        0 => {
                            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(p) {
                                let _ = f.set_len(rng.below(2 * BS as u64));
                            }
                        }
                        1 => {
                            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(p) {
                                let _ = f.set_len(BS as u64 + 1 + rng.below(8192));
                            }
                        }
                        2 => {
                            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(p) {
                                let _ = f.set_len(BS as u64);
                            }
                        }
                        3 => {
                            let mut b = g.bytes.clone();
                            let off = rng.below(BS as u64) as usize;
                            b[off] ^= 0x10;
                            put(&b, g.xattr.as_ref(), n);
                        }
                        4 => {
                            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(p) {
                                let off = rng.below(BS as u64);
                                let _ = f.write_all_at(&[rng.next() as u8], off);
                            }
                        }
                        5 => {
                            let _ = std::fs::remove_file(p);
                        }
                        6 => put(&g.bytes, g.xattr.as_ref(), n),
                        _ => {
                            // good bytes, another key's checksum
                            let j = (i + 1) % goods.len();
                            put(&g.bytes, goods[j].xattr.as_ref(), n);
                        }
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                    if n.is_multiple_of(4) {
                        std::thread::sleep(Duration::from_micros(200)); // the mutator's pace
                    }
                }
            })
        };
        let wrong = Arc::new(AtomicU64::new(0));
        let served = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        let until = Instant::now() + Duration::from_secs(3);
        for t in 0..3 {
            let (tier, keys, wrong, served) =
                (tier.clone(), keys.clone(), wrong.clone(), served.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < until {
                    let (res, data) = load(&tier, &keys).await;
                    assert_accounts(&res, &keys, "load");
                    for (k, d) in &data {
                        served.fetch_add(1, Ordering::Relaxed);
                        if !verify_block(k, 0, d) {
                            wrong.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if t == 0 {
                        let res = fs_store(&tier, &keys, 0).await;
                        assert_accounts(&res, &keys, "store");
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        mutator.join().unwrap();
        eprintln!(
            "checksum {checksum:?}: {} mutations, {} blocks served, stats {:?}",
            ops.load(Ordering::Relaxed),
            served.load(Ordering::Relaxed),
            tier.stats().blocks
        );
        assert_eq!(
            wrong.load(Ordering::Relaxed),
            0,
            "checksum {checksum:?}: wrong bytes were served"
        );
        assert!(
            served.load(Ordering::Relaxed) > 0,
            "nothing was ever served: the test tested nothing"
        );
        // damage left behind: a load removes it, a store rewrites, a load serves
        for f in all_entries(root.path()) {
            if f.to_string_lossy().ends_with(".cpy") {
                std::fs::remove_file(f).unwrap();
            }
        }
        let _ = load(&tier, &keys).await;
        // without checksums a file of the right size with the right bytes stands
        let res = fs_store(&tier, &keys, 0).await;
        assert!(res.is_success(), "{:?}", res.failed);
        let (res, data) = load(&tier, &keys).await;
        assert!(
            res.is_success(),
            "checksum {checksum:?}: after the mutation: {:?}",
            res.failed
        );
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        assert!(tmp_files(root.path()).is_empty());
    }
}

/// A block of [`BS`] bytes, byte `i` being `(7i + 3) mod 256`: the block the vLLM checksum
/// vectors below were computed for.
fn vllm_vector_block() -> Vec<u8> {
    (0..BS).map(|i| ((i * 7 + 3) % 256) as u8).collect()
}

/// vLLM's checksum of [`vllm_vector_block`] as vLLM stores it (four bytes big-endian),
/// computed independently with Python's `crc32c` package:
/// `crc32c.crc32c(bytes((i*7+3)%256 for i in range(4096))).to_bytes(4, "big")`.
const VLLM_VECTOR_CRC: [u8; 4] = [0xed, 0x96, 0xb6, 0x43];

/// The same for 4,096 zero bytes (`98f94189`): a checksum that does not belong to the block.
const VLLM_ZEROS_CRC: [u8; 4] = [0x98, 0xf9, 0x41, 0x89];

/// The xattr `name` of the file at `p`, if it has one.
fn xattr(p: &Path, name: &str) -> Option<Vec<u8>> {
    let (c, n) = (
        CString::new(p.as_os_str().as_encoded_bytes()).unwrap(),
        CString::new(name).unwrap(),
    );
    let mut v = vec![0u8; 64];
    // SAFETY: valid path, name and a 64-byte buffer.
    let rc = unsafe { libc::getxattr(c.as_ptr(), n.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    (rc >= 0).then(|| {
        v.truncate(rc as usize);
        v
    })
}

/// Writes `data` at `p` as vLLM's fs tier does with its checksums on: the file, and the
/// xattr `user.vllm.kv_crc32c` set to `crc` (no kv-tier checksum).
fn write_as_vllm(p: &Path, data: &[u8], crc: &[u8]) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, data).unwrap();
    let (c, n) = (
        CString::new(p.as_os_str().as_encoded_bytes()).unwrap(),
        CString::new(kv_tier_fs::VLLM_CRC_XATTR).unwrap(),
    );
    // SAFETY: valid path, name and value.
    let rc = unsafe { libc::setxattr(c.as_ptr(), n.as_ptr(), crc.as_ptr().cast(), crc.len(), 0) };
    assert_eq!(rc, 0, "setxattr {}", p.display());
}

/// With `vllm_checksum`, a block kv-tier stores carries vLLM's checksum as vLLM writes it
/// (Python's crc32c of the bytes, big-endian) beside its own; a block vLLM wrote with only
/// its checksum loads verified, with kv-tier's checksums required; one whose vLLM checksum
/// does not match its bytes is damage, removed; and without kv-tier's checksums a block with
/// no checksum at all still loads, as in vLLM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_block_checksum_is_written_and_checked_as_vllm_does() {
    let root = temp_root();
    let mut c = cfg(root.path());
    c.checksum = Checksum::Crc32c;
    c.vllm_checksum = true;
    let tier = FsTier::open("fs", c.clone(), ns(), BS).unwrap();
    let data = vllm_vector_block();
    let k = test_key(1);
    let job = kv_tier_core::StoreJob {
        links: Vec::new(),
        requests: Vec::new(),
        blocks: vec![(k, kv_tier_core::BlockSource::from_bytes(data.clone()))],
    };
    assert!(tier.store(job).await.is_success());
    let path = tier.block_path(&k);
    if xattr(&path, CRC_XATTR).is_none() {
        eprintln!("SKIPPED: no user xattrs under {}", root.path().display());
        return;
    }
    assert_eq!(
        xattr(&path, kv_tier_fs::VLLM_CRC_XATTR).as_deref(),
        Some(&VLLM_VECTOR_CRC[..])
    );
    // vLLM's blocks: one verified by its checksum, one whose checksum is another block's
    let (good, bad) = (test_key(2), test_key(3));
    write_as_vllm(&tier.block_path(&good), &data, &VLLM_VECTOR_CRC);
    write_as_vllm(&tier.block_path(&bad), &data, &VLLM_ZEROS_CRC);
    let (mut res, got) = load(&tier, &[k, good, bad]).await;
    // (a job's keys finish in any order)
    res.ok.sort();
    let mut want = vec![k, good];
    want.sort();
    assert_eq!(res.ok, want, "{:?}", res.failed);
    assert!(got.iter().all(|(_, b)| b[..] == data[..]));
    assert!(
        matches!(&res.failed[..], [(key, Error::Corrupt { reason, .. })] if *key == bad && reason.contains("vLLM")),
        "{:?}",
        res.failed
    );
    assert!(
        !tier.block_path(&bad).exists(),
        "the damaged block was kept"
    );
    // without kv-tier's checksums, a block with none at all loads (as vLLM's does)
    drop(tier);
    c.checksum = Checksum::None;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let plain = test_key(4);
    let p = tier.block_path(&plain);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, &data).unwrap();
    let (res, _) = load(&tier, &[plain, good]).await;
    assert!(res.is_success(), "{:?}", res.failed);
}
