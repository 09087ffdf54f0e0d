//! Behaviour of the fs tier on real files: layout, publish-if-absent, corruption, faults,
//! O_DIRECT fallback, full disks, foreign layouts and stray temp files.

mod common;

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::{BS, Mount, cfg, load, ns, open, open_checksummed, store};
use kv_tier_core::{BlockKey, Error, Namespace, SecondaryTier};
use kv_tier_fs::{FsOp, FsTier};
use kv_tier_testkit::{block_bytes, find_files, temp_root, test_key, verify_block};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layout_vectors_land_at_the_expected_paths() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../kv-tier-core/tests/data/layout-vectors.json"
    ))
    .unwrap();
    let vectors: serde_json::Map<String, serde_json::Value> = serde_json::from_str(&text).unwrap();
    for (name, v) in vectors {
        let root = temp_root();
        let vroot = v["root_dir"].as_str().unwrap();
        let rel = |p: &str| {
            root.path()
                .join(p.strip_prefix(vroot).unwrap().trim_start_matches('/'))
        };
        let ns = Namespace::from_json(&v["config_json_fields"], v["rank"].as_u64().unwrap() as u32)
            .unwrap();
        let tier = FsTier::open("fs", cfg(root.path()), ns, BS).unwrap();
        let key = BlockKey::from_hex(
            v["block_hash_hex"].as_str().unwrap(),
            v["group"].as_u64().unwrap() as u32,
        )
        .unwrap();
        assert!(store(&tier, &[key], 0).await.is_success());
        let block = rel(v["block_path"].as_str().unwrap());
        assert!(block.is_file(), "{name}: no block at {}", block.display());
        assert_eq!(
            std::fs::read(&block).unwrap(),
            block_bytes(&key, 0, BS),
            "{name}: raw bytes, no header"
        );
        let config = rel(v["config_path"].as_str().unwrap());
        let written: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
        assert_eq!(written, v["config_json_fields"], "{name}: config.json");
        assert_eq!(find_files(root.path(), ".bin").len(), 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_written_by_another_tool_is_read_and_config_json_is_written_once() {
    let root = temp_root();
    let tier = open(root.path());
    let config = ns().config_path(root.path());
    let before = std::fs::metadata(&config).unwrap().modified().unwrap();
    // vLLM writes raw bytes at the block path.
    let k = test_key(1);
    let path = tier.block_path(&k);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, block_bytes(&k, 3, BS)).unwrap();
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![true]);
    let (res, data) = load(&tier, &[k]).await;
    assert!(res.is_success());
    assert!(verify_block(&k, 3, &data[0].1));
    drop(tier);
    let again = open(root.path());
    assert_eq!(
        std::fs::metadata(&config).unwrap().modified().unwrap(),
        before
    );
    assert_eq!(
        std::fs::read_to_string(&config).unwrap(),
        ns().config_json()
    );
    drop(again);
    // In checksum mode a foreign block carries no checksum: served only with
    // accept_unverified (counted), otherwise a miss and the file goes.
    let mut cc = common::cfg(root.path());
    cc.checksum = kv_tier_fs::Checksum::Crc32c;
    cc.accept_unverified = true;
    let c = FsTier::open("fs", cc, ns(), BS).unwrap();
    let (res, _) = load(&c, &[k]).await;
    assert!(res.is_success());
    assert_eq!(c.stats().blocks.unverified_loads, 1);
    drop(c);
    let c = open_checksummed(root.path());
    let (res, _) = load(&c, &[k]).await;
    assert!(matches!(
        res.failed[0].1,
        kv_tier_core::Error::Corrupt { .. }
    ));
    assert_eq!(c.stats().blocks.unverified_refused, 1);
    assert!(!path.exists(), "an unverified block was kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o_direct_falls_back_to_buffered_io_where_refused() {
    let on_disk = temp_root();
    assert!(open(on_disk.path()).stats().direct_io);
    let m = Mount::new("ramfs", ""); // ramfs refuses O_DIRECT
    let tier = open_checksummed(&m.dir);
    assert!(!tier.stats().direct_io);
    let keys: Vec<_> = (0..8).map(test_key).collect();
    assert!(store(&tier, &keys, 0).await.is_success());
    let (res, data) = load(&tier, &keys).await;
    assert!(res.is_success());
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert!(find_files(&m.dir, ".tmp").is_empty());
    // ramfs has no user xattrs either: checksums live in sidecar files, and still catch damage
    assert_eq!(find_files(&m.dir, kv_tier_fs::CRC_SIDECAR_SUFFIX).len(), 8);
    let path = tier.block_path(&keys[0]);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[7] ^= 1;
    std::fs::write(&path, bytes).unwrap();
    let (res, _) = load(&tier, &keys[..1]).await;
    assert!(matches!(&res.failed[0].1, Error::Corrupt { reason, .. } if reason.contains("crc32c")));
    assert!(!path.exists());
    assert_eq!(tier.stats().blocks.unverified_loads, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_file_is_deleted_and_reported() {
    let root = temp_root();
    let tier = open(root.path());
    let keys = [test_key(1), test_key(2)];
    assert!(store(&tier, &keys, 0).await.is_success());
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
    assert!(store(&tier, &keys[1..], 0).await.is_success());
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
            assert!(store(&tier, &[k], 0).await.is_success());
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
            assert!(store(&tier, &[k], 0).await.is_success());
            let (res, data) = load(&tier, &[k]).await;
            assert!(
                res.is_success() && verify_block(&k, 0, &data[0].1),
                "{what}"
            );
        }
        tier.shutdown().await.unwrap();
    }
}

/// Where the whole root is removed under a running tier (an operator's `rm -rf`), the blocks
/// stored after are found again, not missed for good; and the ones removed are misses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_stored_after_the_root_was_removed_are_found_again() {
    let root = temp_root();
    let tier = open(root.path());
    // (the top directories are made in the background: let that end before removing them)
    while !tier.stats().top_dirs_ready {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let old: Vec<_> = (0..4).map(test_key).collect();
    assert!(store(&tier, &old, 0).await.is_success());
    assert!(load(&tier, &old).await.0.is_success());
    for _ in 0..2 {
        for e in std::fs::read_dir(root.path()).unwrap().flatten() {
            std::fs::remove_dir_all(e.path()).unwrap();
        }
        let (res, _) = load(&tier, &old[..1]).await;
        assert!(
            matches!(&res.failed[..], [(_, Error::NotFound { .. })]),
            "{:?}",
            res.failed
        );
        let new: Vec<_> = (10..14).map(test_key).collect();
        assert!(store(&tier, &new, 1).await.is_success());
        let (res, data) = load(&tier, &new).await;
        assert!(res.is_success(), "{:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 1, d)));
        assert!(store(&tier, &old, 0).await.is_success());
        assert!(load(&tier, &old).await.0.is_success());
    }
}

/// With `O_TMPFILE` a block has no name until it is published: at the moment of the publish
/// its leaf directory holds no temp file (with the named fallback, it holds one). Both
/// publish the same bytes, and neither replaces a block already there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unnamed_temp_file_has_no_name_until_published() {
    for tmpfile in [true, false] {
        let root = temp_root();
        let mut c = common::cfg(root.path());
        c.tmpfile_publish = tmpfile;
        c.checksum = kv_tier_fs::Checksum::Crc32c;
        let tier = FsTier::open("fs", c, common::ns(), BS).unwrap();
        assert_eq!(tier.stats().tmpfile_publish, tmpfile);
        let k = test_key(7);
        let leaf = tier.block_path(&k).parent().unwrap().to_path_buf();
        let names = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = names.clone();
        tier.set_fault_injector(Some(Arc::new(move |o, _: &Path| {
            if o == FsOp::Publish {
                let mut v: Vec<String> = std::fs::read_dir(&leaf)
                    .unwrap()
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect();
                v.sort();
                seen.lock().unwrap().push(v);
            }
            None
        })));
        assert!(store(&tier, &[k], 0).await.is_success());
        let at_publish = names.lock().unwrap().clone();
        assert_eq!(at_publish.len(), 1, "tmpfile {tmpfile}");
        let tmps = at_publish[0].iter().filter(|n| n.ends_with(".tmp")).count();
        assert_eq!(
            tmps,
            usize::from(!tmpfile),
            "tmpfile {tmpfile}: {at_publish:?}"
        );
        let (res, data) = load(&tier, &[k]).await;
        assert!(res.is_success() && verify_block(&k, 0, &data[0].1));
        // a second store of the key does not replace it (a skip) and leaves nothing
        let path = tier.block_path(&k);
        let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path).unwrap());
        tier.set_fault_injector(None);
        assert!(store(&tier, &[k], 1).await.is_success());
        assert_eq!(
            std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(&path).unwrap()),
            ino,
            "tmpfile {tmpfile}: a second store replaced the block"
        );
        assert!(verify_block(&k, 0, &load(&tier, &[k]).await.1[0].1));
        assert!(find_files(root.path(), ".tmp").is_empty());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_error_keeps_the_file_and_its_bytes() {
    let root = temp_root();
    let tier = open(root.path());
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    let path = tier.block_path(&k);
    for (op, errno) in [
        (FsOp::Read, libc::EIO),
        (FsOp::OpenRead, libc::EMFILE),
        (FsOp::OpenRead, libc::EACCES),
    ] {
        let p = path.clone();
        tier.set_fault_injector(Some(Arc::new(move |o, at: &Path| {
            (o == op && at == p).then(|| std::io::Error::from_raw_os_error(errno))
        })));
        let (res, _) = load(&tier, &[k]).await;
        let err = &res.failed[0].1;
        assert!(err.is_transient(), "{err}");
        assert!(
            err.to_string().contains(&path.display().to_string()),
            "{err}"
        );
        assert!(
            path.exists(),
            "{op:?}/{errno}: the file was deleted on a transient error"
        );
    }
    tier.set_fault_injector(None);
    let (res, data) = load(&tier, &[k]).await;
    assert!(res.is_success());
    assert!(verify_block(&k, 0, &data[0].1));
    assert_eq!(tier.stats().blocks.corrupt_deleted, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checksum_mismatch_in_the_last_block_keeps_the_first_two() {
    let root = temp_root();
    let tier = open_checksummed(root.path());
    let keys: Vec<_> = (0..3).map(test_key).collect();
    assert!(store(&tier, &keys, 0).await.is_success());
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_writers_of_one_key_leave_one_file_and_no_temp_files() {
    let root = temp_root();
    // two tier instances on one root, as two processes would be
    let tiers: Vec<Arc<FsTier>> = (0..2)
        .map(|_| Arc::new(open_checksummed(root.path())))
        .collect();
    let k = test_key(7);
    let mut tasks = Vec::new();
    for w in 0..16u64 {
        let t = tiers[w as usize % 2].clone();
        tasks.push(tokio::spawn(async move { store(&*t, &[k], 100 + w).await }));
    }
    for t in tasks {
        assert!(t.await.unwrap().is_success());
    }
    assert_eq!(find_files(root.path(), ".bin").len(), 1);
    assert!(find_files(root.path(), ".tmp").is_empty());
    let (res, data) = load(&*tiers[0], &[k]).await;
    assert!(
        res.is_success(),
        "the winner's checksum must match its bytes"
    );
    assert_eq!(
        (0..16)
            .filter(|w| verify_block(&k, 100 + w, &data[0].1))
            .count(),
        1
    );
    let published: u64 = tiers.iter().map(|t| t.stats().blocks.blocks_written).sum();
    let skipped: u64 = tiers.iter().map(|t| t.stats().blocks.stores_skipped).sum();
    assert_eq!((published, skipped), (1, 15));
}

#[test]
fn a_foreign_config_json_is_refused() {
    let root = temp_root();
    let dir = ns().namespace_dir(root.path());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_name": "test-org/test-model", "dtype": "torch.bfloat16"}"#,
    )
    .unwrap();
    let err = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap_err();
    assert!(matches!(err, Error::LayoutMismatch { .. }), "{err}");
    assert!(err.to_string().contains("config.json"), "{err}");
}

#[test]
fn a_bad_root_dir_fails_at_construction() {
    let root = temp_root();
    let file = root.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = FsTier::open("fs", cfg(&file), ns(), BS).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidConfig { field, reason } if field == "root_dir" && reason.contains("not a directory")),
        "{err}"
    );
    let ro = Mount::new("tmpfs", "ro,size=1m");
    let err = FsTier::open("fs", cfg(&ro.dir), ns(), BS).unwrap_err();
    assert!(
        err.to_string().contains("root_dir") || matches!(err, Error::Io { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains(&ro.dir.display().to_string()),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_fails_the_store_with_no_space_and_loads_keep_working() {
    let m = Mount::new("tmpfs", "size=256k");
    let tier = open(&m.dir);
    let first: Vec<_> = (0..8).map(test_key).collect();
    assert!(store(&tier, &first, 0).await.is_success());
    let more: Vec<_> = (100..200).map(test_key).collect();
    let res = store(&tier, &more, 0).await;
    assert!(
        !res.failed.is_empty(),
        "a 256 KiB tmpfs took 108 blocks of 4 KiB"
    );
    assert!(
        res.failed
            .iter()
            .all(|(_, e)| matches!(e, Error::NoSpace { .. })),
        "{:?}",
        res.failed[0]
    );
    assert!(
        find_files(&m.dir, ".tmp").is_empty(),
        "a failed store left a temp file"
    );
    assert!(tier.stats().no_space > 0);
    let (res, data) = load(&tier, &first).await;
    assert!(res.is_success());
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    // every block reported stored is whole
    let (res2, data2) = load(&tier, &res.ok).await;
    assert!(res2.is_success() && data2.iter().all(|(k, d)| verify_block(k, 0, d)));
}

#[test]
fn stray_temp_files_are_reaped_at_open_but_young_ones_stay() {
    let root = temp_root();
    let tier = open(root.path());
    let dir = tier
        .block_path(&test_key(1))
        .parent()
        .unwrap()
        .to_path_buf();
    drop(tier);
    std::fs::create_dir_all(&dir).unwrap();
    let old = dir.join("abc.bin_0123.tmp");
    let young = dir.join("abd.bin_0456.tmp");
    std::fs::write(&old, b"partial").unwrap();
    std::fs::write(&young, b"partial").unwrap();
    let f = std::fs::File::options().write(true).open(&old).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
    drop(f);
    let tier = open(root.path());
    assert!(!old.exists());
    assert!(young.exists(), "a live writer's temp file was reaped");
    assert_eq!(tier.stats().tmp_reaped, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_run_on_the_io_threads_never_on_the_callers() {
    let root = temp_root();
    let tier = open(root.path());
    let threads = Arc::new(Mutex::new(Vec::<String>::new()));
    let t2 = threads.clone();
    tier.set_fault_injector(Some(Arc::new(move |op, _: &Path| {
        if op == FsOp::Probe {
            t2.lock()
                .unwrap()
                .push(std::thread::current().name().unwrap_or("").to_string());
        }
        None
    })));
    let keys: Vec<_> = (0..2000).map(test_key).collect();
    assert!(store(&tier, &keys[..10], 0).await.is_success());
    let found = tier.lookup(&keys).await.unwrap();
    assert_eq!(found.iter().filter(|&&b| b).count(), 10);
    assert!(found[..10].iter().all(|&b| b));
    let names = threads.lock().unwrap().clone();
    assert!(names.len() > 1, "2,000 keys were probed as one task");
    assert!(names.iter().all(|n| n.starts_with("kv-fs-")), "{names:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_create_directories_and_wrong_sizes_write_nothing() {
    let root = temp_root();
    let tier = open(root.path());
    let k = test_key(3);
    let res = tier
        .store(kv_tier_core::StoreJob {
            requests: Vec::new(),
            blocks: vec![(k, kv_tier_testkit::source_for(&k, 0, BS - 512))],
        })
        .await;
    assert!(matches!(res.failed[0].1, Error::WrongSize { .. }));
    assert!(find_files(root.path(), ".bin").is_empty());
    assert!(find_files(root.path(), ".tmp").is_empty());
    // unaligned source buffers go through a bounce buffer
    let unaligned = bytes::Bytes::from(block_bytes(&k, 0, BS + 1)).slice(1..);
    let mut shifted = block_bytes(&k, 0, BS + 1);
    shifted.remove(0);
    let res = tier
        .store(kv_tier_core::StoreJob {
            requests: Vec::new(),
            blocks: vec![(k, kv_tier_core::BlockSource::from_bytes(unaligned))],
        })
        .await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert_eq!(std::fs::read(tier.block_path(&k)).unwrap(), shifted);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_or_publish_leaves_no_temp_file() {
    let root = temp_root();
    let tier = open(root.path());
    for op in [FsOp::Write, FsOp::Publish, FsOp::CreateTmp] {
        tier.set_fault_injector(Some(Arc::new(move |o, _: &Path| {
            (o == op).then(|| std::io::Error::from_raw_os_error(libc::EIO))
        })));
        let res = store(&tier, &[test_key(1)], 0).await;
        assert_eq!(res.failed.len(), 1, "{op:?}");
        assert!(
            find_files(root.path(), ".tmp").is_empty(),
            "{op:?} left a temp file"
        );
        assert!(find_files(root.path(), ".bin").is_empty());
    }
    assert!(
        tier.take_events().is_empty(),
        "a failed store emitted an event"
    );
}

/// A leaf directory that vanishes again after every mkdir (a sweep emptying it each time)
/// fails the store after a few tries instead of looping.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leaf_directory_that_keeps_vanishing_fails_the_store_after_a_few_tries() {
    let root = temp_root();
    let tier = open(root.path());
    let tries = Arc::new(std::sync::atomic::AtomicU32::new(0));
    let seen = tries.clone();
    tier.set_fault_injector(Some(Arc::new(move |o, _: &Path| {
        (o == FsOp::CreateTmp).then(|| {
            seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            std::io::Error::from_raw_os_error(libc::ENOENT)
        })
    })));
    let res = store(&tier, &[test_key(1)], 0).await;
    assert_eq!(res.failed.len(), 1);
    assert_eq!(tries.load(std::sync::atomic::Ordering::Relaxed), 4);
    tier.set_fault_injector(None);
    assert!(store(&tier, &[test_key(1)], 0).await.is_success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_fails_later_jobs_cleanly() {
    let root = temp_root();
    let tier = open(root.path());
    tier.shutdown().await.unwrap();
    let res = store(&tier, &[test_key(1)], 0).await;
    assert!(matches!(res.failed[0].1, Error::Shutdown { .. }));
    assert!(tier.lookup(&[test_key(1)]).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_by_type_name_through_the_config_json() {
    let root = temp_root();
    let json = format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": 4096,
            "layout": {{"model_name": "m", "dtype": "float16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": "{}", "n_read_threads": 2, "n_write_threads": 2, "checksum": "crc32c"}}]}}"#,
        root.path().display()
    );
    let cfg = kv_tier_core::KvTierConfig::from_json_str(&json).unwrap();
    let mut reg = kv_tier_core::TierRegistry::new();
    FsTier::register(&mut reg).unwrap();
    let cpu = primary(4096, 16);
    let m = kv_tier_core::TieringManager::builder(cfg.clone())
        .primary(cpu)
        .registry(reg.clone())
        .build()
        .await
        .unwrap();
    assert_eq!(m.tier_names(), ["fs"]);
    assert!(m.tiers()[0].info().capability.checksums);
    // a bad option is refused naming the field
    let bad = json.replace("\"n_read_threads\": 2", "\"n_read_threads\": 0");
    let err = kv_tier_core::TieringManager::builder(
        kv_tier_core::KvTierConfig::from_json_str(&bad).unwrap(),
    )
    .primary(primary(4096, 16))
    .registry(reg.clone())
    .build()
    .await
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("secondary_tiers[0].n_read_threads"),
        "{err}"
    );
    // and a missing layout is refused naming it
    let mut no_layout = cfg;
    no_layout.layout = None;
    let err = kv_tier_core::TieringManager::builder(no_layout)
        .primary(primary(4096, 16))
        .registry(reg)
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("layout"), "{err}");
}

/// The manager needs a primary: the DRAM tier (a dev-dependency of this crate).
fn primary(block: usize, slots: usize) -> Arc<dyn kv_tier_core::PrimaryTier> {
    Arc::new(
        kv_tier_cpu::CpuTier::new(kv_tier_cpu::CpuTierConfig {
            capacity_bytes: (block * slots) as u64,
            block_size: block,
            policy: kv_tier_core::EvictionPolicy::Lru,
            prefault: false,
        })
        .unwrap(),
    )
}

/// Through the manager: a failed load is a Miss for the request with no livelock, and a later
/// successful store makes the block a hit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_manager_a_failed_load_misses_and_a_new_store_heals() {
    use kv_tier_core::{LookupResult, RequestContext, RequestId, TieringManager};
    let root = temp_root();
    let fs = Arc::new(open_checksummed(root.path()));
    let m = TieringManager::builder(kv_tier_core::KvTierConfig::new(16 * BS as u64, BS as u64))
        .primary(primary(BS, 16))
        .tier(fs.clone())
        .build()
        .await
        .unwrap();
    let k = test_key(42);
    let put = |m: &TieringManager| {
        let mut p = m.prepare_store(&[k]).unwrap();
        for (key, sink) in p.slots() {
            kv_tier_testkit::fill_block(key, 0, sink.as_mut_slice());
        }
        p.commit(RequestId(1));
    };
    put(&m);
    m.wait_idle().await;
    assert!(fs.block_path(&k).exists());
    m.reset_cache().await;
    // damage the file behind the tier's back
    let path = fs.block_path(&k);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let req = RequestContext::new(2);
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(m.lookup(&k, &req));
        m.on_schedule_end();
        m.wait_idle().await;
    }
    assert_eq!(
        seen,
        vec![
            LookupResult::Retry,
            LookupResult::HitPending,
            LookupResult::Miss
        ]
    );
    let probed = fs.stats().keys_probed;
    for _ in 0..3 {
        assert_eq!(m.lookup(&k, &req), LookupResult::Miss);
        m.on_schedule_end();
        m.wait_idle().await;
    }
    assert_eq!(
        fs.stats().keys_probed,
        probed,
        "the failed key was probed again"
    );
    assert_eq!(fs.stats().blocks.checksum_mismatches, 1);
    // a new store (cascaded to fs) heals it, for the same request too
    put(&m);
    m.wait_idle().await;
    m.reset_cache().await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(m.lookup(&k, &req));
        m.on_schedule_end();
        m.wait_idle().await;
    }
    assert_eq!(seen.last(), Some(&LookupResult::Hit), "{seen:?}");
    let views = m.prepare_load(&[k]).unwrap();
    assert!(verify_block(&k, 0, views[0].as_slice()));
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
