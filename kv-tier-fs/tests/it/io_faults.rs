//! Errors of the filesystem, injected at each operation or real (a full tmpfs, no descriptors
//! left): transient errors keep the file and its bytes, a failed store leaves nothing at the
//! path and no temp file, a full disk is `NoSpace`, every error names the key or the path, and
//! the tier works again once the cause is gone.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{FsOp, FsTier};
use kv_tier_testkit::fixtures::files::{Mount, statvfs_used};
use kv_tier_testkit::{find_files, load_keys, store_keys, temp_root, test_key, verify_block};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transient_error_keeps_the_file_and_its_bytes() {
    let root = temp_root();
    let tier = open(root.path());
    let k = test_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
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
async fn a_full_disk_fails_the_store_with_no_space_and_loads_keep_working() {
    let m = Mount::new("tmpfs", "size=256k");
    let tier = open(&m.dir);
    let first: Vec<_> = (0..8).map(test_key).collect();
    assert!(fs_store(&tier, &first, 0).await.is_success());
    let more: Vec<_> = (100..200).map(test_key).collect();
    let res = fs_store(&tier, &more, 0).await;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_write_or_publish_leaves_no_temp_file() {
    let root = temp_root();
    let tier = open(root.path());
    for op in [FsOp::Write, FsOp::Publish, FsOp::CreateTmp] {
        tier.set_fault_injector(Some(Arc::new(move |o, _: &Path| {
            (o == op).then(|| std::io::Error::from_raw_os_error(libc::EIO))
        })));
        let res = fs_store(&tier, &[test_key(1)], 0).await;
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
    let res = fs_store(&tier, &[test_key(1)], 0).await;
    assert_eq!(res.failed.len(), 1);
    assert_eq!(tries.load(std::sync::atomic::Ordering::Relaxed), 4);
    tier.set_fault_injector(None);
    assert!(fs_store(&tier, &[test_key(1)], 0).await.is_success());
}

/// On an 8 MiB tmpfs, blocks of 1.5 MiB stored until the disk is full: every key reported
/// stored is whole on disk and loads; every failed key fails with `NoSpace`, has nothing at
/// its path and loads as a plain miss; no temp file remains and no space is held by
/// unnamed files; once space is freed, the failed keys store and load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enospc_fails_cleanly_and_the_tier_works_again_once_space_is_freed() {
    const B: usize = 3 << 19; // 1.5 MiB
    for publish in [true, false] {
        let m = Mount::new("tmpfs", "size=8m");
        let mut c = checked_cfg(&m.dir);
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), B).unwrap();
        let what = format!("tmpfile_publish {publish}");
        let keys: Vec<BlockKey> = (0..8).map(|i| test_key(68_000 + i)).collect();
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        for chunk in keys.chunks(4) {
            let res = store_keys(&tier, chunk, 0, B).await;
            assert_accounts(&res, chunk, &what);
            ok.extend(res.ok.iter().copied());
            failed.extend(res.failed);
        }
        eprintln!(
            "{what}: {} stored, {} failed: {:?}",
            ok.len(),
            failed.len(),
            failed.iter().map(|f| f.1.to_string()).collect::<Vec<_>>()
        );
        assert!(!failed.is_empty(), "{what}: the disk never filled");
        for (k, e) in &failed {
            assert!(
                matches!(e, Error::NoSpace { .. }),
                "{what}: {k} failed with {e:?}, not NoSpace"
            );
            assert!(
                !exists_nofollow(&tier.block_path(k)),
                "{what}: a failed store left a file at {}",
                tier.block_path(k).display()
            );
        }
        for k in &ok {
            let md = std::fs::metadata(tier.block_path(k)).unwrap();
            assert_eq!(md.len(), B as u64, "{what}");
        }
        assert!(
            tmp_files(&m.dir).is_empty(),
            "{what}: {:?}",
            tmp_files(&m.dir)
        );
        let used = statvfs_used(&m.dir);
        assert!(
            used <= ok.len() as u64 * B as u64 + (256 << 10),
            "{what}: {used} bytes used for {} blocks: space held by something else: {:?}",
            ok.len(),
            all_entries(&m.dir)
        );
        let (res, data) = load_keys(&tier, &keys, B).await;
        assert_accounts(&res, &keys, &what);
        let served: HashSet<BlockKey> = data.iter().map(|d| d.0).collect();
        assert_eq!(
            served,
            ok.iter().copied().collect(),
            "{what}: loads after ENOSPC"
        );
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        for (k, e) in &res.failed {
            assert!(matches!(e, Error::NotFound { .. }), "{what}: {k}: {e:?}");
        }
        assert_eq!(tier.stats().blocks.corrupt_deleted, 0);
        assert!(
            tier.stats().no_space >= failed.len() as u64,
            "{what}: no_space {:?}",
            tier.stats()
        );
        // free the space
        for k in &ok {
            std::fs::remove_file(tier.block_path(k)).unwrap();
        }
        for (k, _) in failed.iter().take(4) {
            let res = store_keys(&tier, &[*k], 0, B).await;
            assert!(
                res.is_success(),
                "{what}: after space was freed: {:?}",
                res.failed
            );
            let (res, data) = load_keys(&tier, &[*k], B).await;
            assert!(res.is_success() && verify_block(k, 0, &data[0].1), "{what}");
        }
        tier.shutdown().await.unwrap();
    }
}

/// A disk that fills up while the checksum xattr is set, or while a directory is made:
/// an 8 MiB tmpfs filled to the last page by a file of ours, then stores of small blocks
/// fail cleanly (nothing at the path, no temp files), and work once the filler goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_full_to_the_last_page_fails_small_stores_cleanly() {
    for publish in [true, false] {
        let m = Mount::new("tmpfs", "size=8m");
        let mut c = checked_cfg(&m.dir);
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let what = format!("tmpfile_publish {publish}");
        let warm = test_key(69_000);
        assert!(fs_store(&tier, &[warm], 0).await.is_success());
        // fill
        let filler = m.dir.join("filler");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&filler).unwrap();
            let chunk = vec![1u8; 64 << 10];
            while f.write_all(&chunk).is_ok() {}
            let one = [1u8; 4096];
            while f.write_all(&one).is_ok() {}
        }
        let keys: Vec<BlockKey> = (1..9).map(|i| test_key(69_000 + i)).collect();
        let res = fs_store(&tier, &keys, 0).await;
        assert_accounts(&res, &keys, &what);
        for k in &res.ok {
            let bytes = std::fs::read(tier.block_path(k)).unwrap();
            assert!(verify_block(k, 0, &bytes), "{what}");
        }
        for (k, e) in &res.failed {
            assert!(
                !exists_nofollow(&tier.block_path(k)),
                "{what}: {e}: a file is left at the path"
            );
        }
        assert!(
            !res.failed.is_empty(),
            "{what}: the full disk took every block"
        );
        assert!(
            tmp_files(&m.dir).is_empty(),
            "{what}: {:?}",
            tmp_files(&m.dir)
        );
        let (res2, data) = load(&tier, &keys).await;
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)), "{what}");
        assert_eq!(res2.ok.len(), res.ok.len(), "{what}: loads vs stores");
        std::fs::remove_file(&filler).unwrap();
        let res = fs_store(&tier, &keys, 0).await;
        assert!(res.is_success(), "{what}: {:?}", res.failed);
        let (res, data) = load(&tier, &keys).await;
        assert!(
            res.is_success() && data.iter().all(|(k, d)| verify_block(k, 0, d)),
            "{what}: {:?}",
            res.failed
        );
        tier.shutdown().await.unwrap();
    }
}

/// Out of file descriptors (EMFILE, the soft limit lowered and the rest taken): loads fail
/// but keep the files (transient, no BlockRemoved), stores fail leaving nothing at the path
/// and no temp file; nothing hangs or panics; with descriptors back, everything works.
/// Changes the whole process's limit: the test restores it before it asserts, and runs in a
/// process of its own (a child run of this binary), where no other test needs a descriptor
/// meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emfile_is_transient_keeps_files_and_leaves_nothing_behind() {
    if !in_a_process_of_its_own(
        "io_faults::emfile_is_transient_keeps_files_and_leaves_nothing_behind",
    ) {
        return;
    }
    for publish in [true, false] {
        let what = format!("tmpfile_publish {publish}");
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let old: Vec<BlockKey> = (0..6).map(|i| leaf_key(200 + i)).collect();
        let new: Vec<BlockKey> = (0..6)
            .map(|i| {
                if i % 2 == 0 {
                    leaf_key(300 + i)
                } else {
                    test_key(70_000 + i)
                }
            })
            .collect();
        assert!(fs_store(&tier, &old, 0).await.is_success());
        let (res, _) = load(&tier, &old).await;
        assert!(res.is_success());
        tier.take_events();
        let removed_before = tier.stats().blocks.corrupt_deleted;

        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: valid pointer.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        let open_now = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        let low = libc::rlimit {
            rlim_cur: open_now + 32,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: valid pointer.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
        let mut hogs = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            hogs.push(f);
            if hogs.len() > 100_000 {
                break;
            }
        }
        let (lres, ldata) = tokio::time::timeout(Duration::from_secs(15), load(&tier, &old))
            .await
            .expect("load hung on EMFILE");
        let sres = tokio::time::timeout(Duration::from_secs(15), fs_store(&tier, &new, 0))
            .await
            .expect("store hung on EMFILE");
        let look = tokio::time::timeout(Duration::from_secs(15), tier.lookup(&old))
            .await
            .expect("lookup hung");
        drop(hogs);
        // SAFETY: valid pointer.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);

        eprintln!(
            "{what}: under EMFILE load ok {} failed {:?}; store ok {} failed {:?}; lookup {:?}",
            lres.ok.len(),
            lres.failed.first().map(|f| f.1.to_string()),
            sres.ok.len(),
            sres.failed.first().map(|f| f.1.to_string()),
            look.as_ref().map_err(|e| e.to_string())
        );
        assert_accounts(&lres, &old, &what);
        assert_accounts(&sres, &new, &what);
        assert!(ldata.iter().all(|(k, d)| verify_block(k, 0, d)), "{what}");
        assert!(
            !lres.failed.is_empty(),
            "{what}: every load succeeded without descriptors?"
        );
        for k in &old {
            assert!(
                is_regular(&tier.block_path(k)),
                "{what}: EMFILE removed {k}'s file"
            );
        }
        assert!(
            removed(&tier).is_empty(),
            "{what}: BlockRemoved for a transient error"
        );
        assert_eq!(
            tier.stats().blocks.corrupt_deleted,
            removed_before,
            "{what}"
        );
        for (k, e) in &sres.failed {
            assert!(
                !exists_nofollow(&tier.block_path(k)),
                "{what}: a failed store left {}",
                tier.block_path(k).display()
            );
            assert!(!matches!(e, Error::Corrupt { .. }), "{what}: {e}");
        }
        for k in &sres.ok {
            assert!(
                is_regular(&tier.block_path(k)),
                "{what}: {k} reported stored, not on disk"
            );
        }
        assert!(
            tmp_files(root.path()).is_empty(),
            "{what}: {:?}",
            tmp_files(root.path())
        );
        // descriptors back
        let (res, data) = load(&tier, &old).await;
        assert!(res.is_success(), "{what}: after EMFILE: {:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        let res = fs_store(&tier, &new, 0).await;
        assert!(res.is_success(), "{what}: after EMFILE: {:?}", res.failed);
        let (res, _) = load(&tier, &new).await;
        assert!(res.is_success(), "{what}: {:?}", res.failed);
        tier.shutdown().await.unwrap();
    }
}

/// Every error a store or a load reports names the key or the path it concerns: faults
/// injected at each operation (EIO, EACCES, EMFILE), a short file, a missing block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_key_or_the_path() {
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let stored = test_key(71_000);
        assert!(fs_store(&tier, &[stored], 0).await.is_success());
        let names = |e: &Error, k: &BlockKey| {
            let m = e.to_string();
            let bp = tier.block_path(k);
            m.contains(&k.hash_hex())
                || m.contains(&*bp.to_string_lossy())
                || m.contains(&*bp.parent().unwrap().to_string_lossy())
        };
        let mut n = 1u64;
        for op in [
            FsOp::CreateTmp,
            FsOp::Write,
            FsOp::Publish,
            FsOp::OpenRead,
            FsOp::Read,
        ] {
            for errno in [libc::EIO, libc::EACCES, libc::EMFILE] {
                n += 1;
                let what = format!("publish {publish}, {op:?} fails with errno {errno}");
                tier.set_fault_injector(Some(Arc::new(move |o, _p: &Path| {
                    (o == op).then(|| std::io::Error::from_raw_os_error(errno))
                })));
                let k = test_key(71_000 + n);
                let res = fs_store(&tier, &[k], 0).await;
                let (lres, data) = load(&tier, &[stored]).await;
                tier.set_fault_injector(None);
                for (fk, e) in res.failed.iter().chain(lres.failed.iter()) {
                    assert!(
                        names(e, fk),
                        "{what}: `{e}` names neither {fk} nor its path"
                    );
                }
                let store_op = matches!(op, FsOp::CreateTmp | FsOp::Write | FsOp::Publish);
                assert_eq!(
                    res.failed.len(),
                    usize::from(store_op),
                    "{what}: store {:?}",
                    res.failed
                );
                assert_eq!(
                    lres.failed.len(),
                    usize::from(!store_op),
                    "{what}: load {:?}",
                    lres.failed
                );
                if store_op {
                    assert!(
                        !exists_nofollow(&tier.block_path(&k)),
                        "{what}: the failed store left a file"
                    );
                } else {
                    assert!(data.is_empty());
                    assert!(
                        is_regular(&tier.block_path(&stored)),
                        "{what}: a transient error removed the block"
                    );
                }
                assert!(
                    tmp_files(root.path()).is_empty(),
                    "{what}: {:?}",
                    tmp_files(root.path())
                );
            }
        }
        // a short file, a missing block
        let short = test_key(71_900);
        let p = tier.block_path(&short);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, [0u8; 10]).unwrap();
        let missing = test_key(71_901);
        let (res, _) = load(&tier, &[short, missing]).await;
        assert_eq!(res.failed.len(), 2);
        for (k, e) in &res.failed {
            assert!(names(e, k), "`{e}` names neither {k} nor its path");
        }
        tier.shutdown().await.unwrap();
    }
}
