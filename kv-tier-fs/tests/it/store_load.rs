//! Stores and loads on real files: blocks land at vLLM's paths as raw bytes (and blocks other
//! tools wrote there are read), O_DIRECT where the filesystem takes it and buffered I/O where
//! it does not, bounce buffers for unaligned memory, publish-if-absent (one file per key however
//! many writers, an unnamed temp file until the publish, a block already there kept), lookups
//! on the tier's I/O threads.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_tier_core::{BlockKey, Error, Namespace, SecondaryTier};
use kv_tier_fs::{FsOp, FsTier};
use kv_tier_testkit::fixtures::files::Mount;
use kv_tier_testkit::{block_bytes, find_files, temp_root, test_key, verify_block};

use crate::support::*;

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
        assert!(fs_store(&tier, &[key], 0).await.is_success());
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
    let mut cc = cfg(root.path());
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
    assert!(fs_store(&tier, &keys, 0).await.is_success());
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

/// With `O_TMPFILE` a block has no name until it is published: at the moment of the publish
/// its leaf directory holds no temp file (with the named fallback, it holds one). Both
/// publish the same bytes, and neither replaces a block already there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unnamed_temp_file_has_no_name_until_published() {
    for tmpfile in [true, false] {
        let root = temp_root();
        let mut c = cfg(root.path());
        c.tmpfile_publish = tmpfile;
        c.checksum = kv_tier_fs::Checksum::Crc32c;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
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
        assert!(fs_store(&tier, &[k], 0).await.is_success());
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
        assert!(fs_store(&tier, &[k], 1).await.is_success());
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
        tasks.push(tokio::spawn(
            async move { fs_store(&*t, &[k], 100 + w).await },
        ));
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
    assert!(fs_store(&tier, &keys[..10], 0).await.is_success());
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
            links: Vec::new(),
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
            links: Vec::new(),
            requests: Vec::new(),
            blocks: vec![(k, kv_tier_core::BlockSource::from_bytes(unaligned))],
        })
        .await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert_eq!(std::fs::read(tier.block_path(&k)).unwrap(), shifted);
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
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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

/// Where checksums live in sidecars, a block file published a moment ago whose sidecar is
/// not written yet (its publisher writes it right after) is not damage to a store that meets
/// it: the store skips it instead of deleting another writer's block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_leaves_a_block_whose_sidecar_is_still_coming() {
    let m = Mount::new("ramfs", "");
    let mut c = cfg(&m.dir);
    c.checksum = kv_tier_fs::Checksum::Crc32c;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    tier.set_sidecar_grace(Duration::from_secs(3600));
    // just published, no sidecar yet
    store_over_a_planted_block(&tier, test_key(1)).await;
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
    let tier = open(root.path());
    assert!(tier.stats().direct_io, "the test needs direct I/O");
    let k = test_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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
            blocks: vec![(k, sink)],
            ..Default::default()
        })
        .await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert_eq!(Arc::strong_count(&buf), 1, "the tier kept the sink");
    // SAFETY: the sink is gone; this is the only reference.
    let got: &Vec<u8> = unsafe { &*buf.0.get() };
    let got = &got[1..];
    assert!(verify_block(&k, 0, got));
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

/// Twelve tasks over two instances on one root store the same 48 keys at once, each with
/// its own bytes (salt), in its own order: every job succeeds for every key, exactly 48
/// blocks are written in all (the rest skipped), no damage is found, both instances serve
/// the same bytes for each key, whole (one writer's), and no temp file remains. With
/// unnamed and named temp files, with xattrs (ext4) and sidecars (ramfs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_writers_of_the_same_keys_through_two_instances_write_each_once() {
    for (fs, publish) in [
        ("ext4", true),
        ("ext4", false),
        ("ramfs", true),
        ("ramfs", false),
    ] {
        let what = format!("{fs}, tmpfile_publish {publish}");
        let tmp;
        let mnt;
        let root: PathBuf = if fs == "ramfs" {
            mnt = Mount::new("ramfs", "");
            mnt.dir.clone()
        } else {
            tmp = temp_root();
            tmp.path().to_path_buf()
        };
        let mk = || {
            let mut c = checked_cfg(&root);
            c.tmpfile_publish = publish;
            Arc::new(FsTier::open("fs", c, ns(), BS).unwrap())
        };
        let (a, b) = (mk(), mk());
        let keys: Vec<BlockKey> = (0..48)
            .map(|i| {
                if i % 3 == 0 {
                    leaf_key(i)
                } else {
                    test_key(65_000 + i)
                }
            })
            .collect();
        let writers = 12u64;
        let mut tasks = Vec::new();
        for w in 0..writers {
            let tier = if w % 2 == 0 { a.clone() } else { b.clone() };
            let mut ks = keys.clone();
            Rng::new(w + 100).shuffle(&mut ks);
            tasks.push(tokio::spawn(async move {
                let mut failed = Vec::new();
                for chunk in ks.chunks(6) {
                    let res = fs_store(&tier, chunk, w + 1).await;
                    assert_accounts(&res, chunk, "store");
                    failed.extend(res.failed.into_iter().map(|(k, e)| format!("{k}: {e}")));
                }
                failed
            }));
        }
        let mut failed = Vec::new();
        for t in tasks {
            failed.extend(t.await.unwrap());
        }
        assert!(failed.is_empty(), "{what}: stores failed: {failed:?}");
        let (sa, sb) = (a.stats().blocks, b.stats().blocks);
        assert_eq!(
            sa.corrupt_deleted + sb.corrupt_deleted,
            0,
            "{what}: damage found among concurrent writers: {sa:?} {sb:?}"
        );
        assert_eq!(
            sa.blocks_written + sb.blocks_written,
            48,
            "{what}: blocks written: {sa:?} {sb:?}"
        );
        assert_eq!(
            sa.stores_skipped + sb.stores_skipped,
            writers * 48 - 48,
            "{what}: skips"
        );
        assert_eq!(bin_files(&root).len(), 48, "{what}");
        assert!(
            tmp_files(&root).is_empty(),
            "{what}: {:?}",
            tmp_files(&root)
        );
        let (ra, da) = load(&a, &keys).await;
        let (rb, db) = load(&b, &keys).await;
        assert!(
            ra.is_success() && rb.is_success(),
            "{what}: {:?} {:?}",
            ra.failed,
            rb.failed
        );
        for ((k, x), (_, y)) in da.iter().zip(db.iter()) {
            assert_eq!(x, y, "{what}: the instances serve different bytes for {k}");
            assert!(
                (1..=writers).any(|s| verify_block(k, s, x)),
                "{what}: {k}'s bytes are no writer's whole block"
            );
        }
        if fs == "ramfs" {
            let sidecars = find_files(&root, kv_tier_fs::CRC_SIDECAR_SUFFIX).len();
            assert_eq!(sidecars, 48, "{what}: sidecars");
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    }
}

/// Each block of a load is reported as it lands (`LoadProgress`: the manager keeps those of a
/// load job it cuts), the missing one not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_reports_each_block_as_it_lands() {
    let root = temp_root();
    let tier = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let keys: Vec<BlockKey> = (1..=5).map(test_key).collect();
    kv_tier_testkit::assert_loads_report_what_landed(&tier, &keys, test_key(99), BS).await;
}
