//! The tree changed under a running tier: leaf, top and rank directories removed, recreated or
//! replaced by files, FIFOs and links, the rank directory renamed away, replaced, or a symlink
//! retargeted, the whole root removed, files and directories deleted while stores and loads
//! run. A store reported done is at its key's path; a load serves the right bytes or misses.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::FsTier;
use kv_tier_testkit::fixtures::files::mkfifo;
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{temp_root, test_key, verify_block};

use crate::support::*;

/// Where the whole root is removed under a running tier (an operator's `rm -rf`), the blocks
/// stored after are found again, not missed for good; and the ones removed are misses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_stored_after_the_root_was_removed_are_found_again() {
    let root = temp_root();
    let tier = open(root.path());
    // (the top directories are made in the background: let that end before removing them)
    wait_until_async("the top directories", SETTLE_LIMIT, || {
        tier.stats().top_dirs_ready
    })
    .await;
    let old: Vec<_> = (0..4).map(test_key).collect();
    assert!(fs_store(&tier, &old, 0).await.is_success());
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
        assert!(fs_store(&tier, &new, 1).await.is_success());
        let (res, data) = load(&tier, &new).await;
        assert!(res.is_success(), "{:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 1, d)));
        assert!(fs_store(&tier, &old, 0).await.is_success());
        assert!(load(&tier, &old).await.0.is_success());
    }
}

/// Between stores, leaf directories, top directories or the whole rank directory are
/// removed (or removed and recreated empty); every store that reports a key stored has its
/// block at the key's path with the right bytes, and every store succeeds (nothing is in the
/// way: only directories went missing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_after_directories_vanish_land_on_disk_and_load() {
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let mut rng = Rng::new(7);
        let mut stored: Vec<BlockKey> = Vec::new();
        let mut next = 0u64;
        for it in 0..80 {
            let action = rng.below(6);
            if let Some(&victim) = stored.get(rng.below(stored.len() as u64) as usize) {
                match action {
                    0 => rm_rf(&leaf_dir(&tier, &victim)),
                    1 => rm_rf(&top_dir(&tier, &victim)),
                    2 => rm_rf(&rank_dir_of(&tier, &victim)),
                    3 => {
                        rm_rf(&rank_dir_of(&tier, &victim));
                        let _ = std::fs::create_dir(rank_dir_of(&tier, &victim));
                    }
                    4 => {
                        rm_rf(&leaf_dir(&tier, &victim));
                        let _ = std::fs::create_dir_all(leaf_dir(&tier, &victim));
                    }
                    _ => {}
                }
            }
            // half the batch in the one shared leaf, half anywhere
            let batch: Vec<BlockKey> = (0..4)
                .map(|j| {
                    next += 1;
                    if j % 2 == 0 {
                        leaf_key(next)
                    } else {
                        test_key(50_000 + next)
                    }
                })
                .collect();
            let res = fs_store(&tier, &batch, 0).await;
            assert_accounts(&res, &batch, "store");
            assert!(
                res.is_success(),
                "publish {publish}, iteration {it} after action {action}: {:?}",
                res.failed
            );
            for k in &res.ok {
                let p = tier.block_path(k);
                assert!(
                    is_regular(&p),
                    "publish {publish}, iteration {it}, action {action}: {k} reported stored, not at {}",
                    p.display()
                );
            }
            let (res, data) = load(&tier, &batch).await;
            assert!(
                res.is_success(),
                "publish {publish}, iteration {it}: {:?}",
                res.failed
            );
            for (k, d) in &data {
                assert!(verify_block(k, 0, d));
            }
            // earlier keys: present ones load right, gone ones are misses
            let (res, data) = load(&tier, &stored).await;
            assert_accounts(&res, &stored, "load of earlier keys");
            for (k, d) in &data {
                assert!(verify_block(k, 0, d));
            }
            for k in &res.ok {
                assert!(
                    is_regular(&tier.block_path(k)),
                    "{k} loaded but not on disk"
                );
            }
            stored.extend(batch);
        }
        assert!(
            tmp_files(root.path()).is_empty(),
            "{:?}",
            tmp_files(root.path())
        );
        tier.shutdown().await.unwrap();
    }
}

/// A leaf directory, a top directory or the rank directory replaced by a regular file, a
/// FIFO or a symlink to a directory outside the root: a store never reports a key stored
/// that cannot be read back from its path; once the obstacle is gone the tier stores and
/// loads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directories_replaced_by_files_or_links_never_make_a_store_lie() {
    let mut report = Vec::new();
    let mut broken = Vec::new();
    for publish in [true, false] {
        for (level, kind) in [
            ("leaf", "file"),
            ("leaf", "fifo"),
            ("leaf", "symlink"),
            ("top", "file"),
            ("top", "symlink"),
            ("rank", "file"),
            ("rank", "symlink"),
        ] {
            let what = format!("publish {publish}, {level} replaced by a {kind}");
            let root = temp_root();
            let outside = temp_root();
            let mut c = checked_cfg(root.path());
            c.tmpfile_publish = publish;
            let tier = FsTier::open("fs", c, ns(), BS).unwrap();
            let (a, b) = (leaf_key(1), leaf_key(2));
            assert!(fs_store(&tier, &[a], 0).await.is_success());
            let dir = match level {
                "leaf" => leaf_dir(&tier, &a),
                "top" => top_dir(&tier, &a),
                _ => rank_dir_of(&tier, &a),
            };
            // the tier makes the top directories in the background: remove until gone
            let deadline = Instant::now() + Duration::from_secs(10);
            while let Err(e) = std::fs::remove_dir_all(&dir) {
                assert!(
                    Instant::now() < deadline,
                    "{what}: cannot remove {}: {e}",
                    dir.display()
                );
            }
            match kind {
                "file" => std::fs::write(&dir, b"not a directory").unwrap(),
                "fifo" => mkfifo(&dir),
                _ => std::os::unix::fs::symlink(outside.path(), &dir).unwrap(),
            }
            let res = tokio::time::timeout(Duration::from_secs(15), fs_store(&tier, &[b], 0))
                .await
                .unwrap_or_else(|_| panic!("{what}: the store hung"));
            let store_ok = res.is_success();
            assert_accounts(&res, &[b], &what);
            let pb = tier.block_path(&b);
            if res.is_success() {
                let bytes = std::fs::read(&pb)
                    .unwrap_or_else(|e| panic!("{what}: reported stored, {}: {e}", pb.display()));
                assert!(verify_block(&b, 0, &bytes), "{what}: wrong bytes on disk");
            } else {
                let msg = res.failed[0].1.to_string();
                assert!(
                    msg.contains(&b.hash_hex())
                        || msg.contains(&*dir.to_string_lossy())
                        || msg.contains(&*root.path().to_string_lossy()),
                    "{what}: the error names neither key nor path: {msg}"
                );
            }
            let (res, data) = tokio::time::timeout(Duration::from_secs(15), load(&tier, &[a, b]))
                .await
                .unwrap_or_else(|_| panic!("{what}: the load hung"));
            assert_accounts(&res, &[a, b], &what);
            for (k, d) in &data {
                assert!(verify_block(k, 0, d), "{what}: wrong bytes for {k}");
            }
            assert!(
                !res.ok.contains(&a) || kind == "symlink",
                "{what}: a was served though its directory is gone"
            );
            report.push(format!(
                "{what}: store of b {}, load a {} b {}, outside dir holds {:?}",
                if store_ok { "ok" } else { "failed" },
                res.ok.contains(&a),
                res.ok.contains(&b),
                all_entries(outside.path())
                    .iter()
                    .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
            ));
            // the obstacle goes: the tier works again
            rm_rf(&dir);
            let res = fs_store(&tier, &[a, b], 3).await;
            assert!(
                res.is_success(),
                "{what}: after the obstacle went: {:?}",
                res.failed
            );
            for k in [a, b] {
                assert!(
                    is_regular(&tier.block_path(&k)),
                    "{what}: {k} not on disk after the obstacle went"
                );
            }
            let (res, data) = load(&tier, &[a, b]).await;
            if !res.is_success() {
                broken.push(format!(
                    "{what}: after the obstacle went, a and b stored (both regular files at their paths) but a load \
                     of them says {:?}; the outside directory (the link's old target) holds {:?}",
                    res.failed.iter().map(|(k, e)| format!("{}: {e}", &k.hash_hex()[..8])).collect::<Vec<_>>(),
                    all_entries(outside.path())
                ));
            }
            for (k, d) in &data {
                if !verify_block(k, 3, d) {
                    broken.push(format!(
                        "{what}: after the obstacle went, {} (salt 3 at its path) was served with other bytes \
                         (salt 0: {}), from the link's old target {:?}",
                        &k.hash_hex()[..8],
                        verify_block(k, 0, d),
                        all_entries(outside.path())
                    ));
                }
            }
            tier.shutdown().await.unwrap();
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        broken.is_empty(),
        "{}\nhistory:\n{}",
        broken.join("\n"),
        report.join("\n")
    );
}

/// The rank directory renamed away under a running tier (an operator clearing the cache
/// with `mv cache cache.old`): the tier's later stores land at the keys' paths, not in the
/// directory that moved; a store reported done is at `block_path`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_rank_directory_is_renamed_away_stores_land_at_its_path() {
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let k1 = leaf_key(1);
        assert!(fs_store(&tier, &[k1], 0).await.is_success());
        let rank = rank_dir_of(&tier, &k1);
        let old = root.path().join("moved-away");
        std::fs::rename(&rank, &old).unwrap();
        let fresh: Vec<BlockKey> = vec![leaf_key(2), test_key(60_001), test_key(60_002)];
        let res = fs_store(&tier, &fresh, 0).await;
        assert_accounts(&res, &fresh, "store");
        for k in &res.ok {
            assert!(
                is_regular(&tier.block_path(k)),
                "publish {publish}: {k} reported stored but is not at its path {} (the moved directory has {:?})",
                tier.block_path(k).display(),
                bin_files(&old)
            );
        }
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
    }
}

/// The rank directory renamed away (`mv`, the directory lives on elsewhere) under a running
/// tier that has loaded from it: blocks the tier stores afterwards (reported stored, at their
/// paths) load from the same tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_rank_directory_is_renamed_away_blocks_stored_since_load() {
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let k1 = test_key(60_101);
        assert!(fs_store(&tier, &[k1], 0).await.is_success());
        assert!(load(&tier, &[k1]).await.0.is_success());
        let rank = rank_dir_of(&tier, &k1);
        std::fs::rename(&rank, root.path().join("moved-away")).unwrap();
        let fresh: Vec<BlockKey> = (0..4).map(|i| test_key(60_200 + i)).collect();
        let res = fs_store(&tier, &fresh, 0).await;
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
        assert!(fresh.iter().all(|k| is_regular(&tier.block_path(k))));
        let looked = tier.lookup(&fresh).await.unwrap();
        let (res, data) = load(&tier, &fresh).await;
        assert!(
            res.is_success(),
            "publish {publish}: blocks just stored at their paths (lookup {looked:?}) do not load from the same tier: {:?}",
            res.failed
                .iter()
                .map(|(_, e)| e.to_string())
                .collect::<Vec<_>>()
        );
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    }
}

/// The rank directory renamed away and another one put in its place (another instance
/// opened on the root after the move and stored `k` with other bytes): a load of `k` serves
/// what is at `k`'s path now, and a key only in the moved directory is a miss, as `lookup`
/// says. (A questionable expectation if the tier means to keep reading the directory it
/// opened; the README says the descriptor is "reopened if the directory was removed".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_rank_directory_is_replaced_loads_read_the_new_one() {
    let root = temp_root();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    let (k, only_old) = (test_key(61_001), test_key(61_002));
    assert!(fs_store(&tier, &[k, only_old], 0).await.is_success());
    let (res, _) = load(&tier, &[k, only_old]).await; // the descriptor is open and used
    assert!(res.is_success());
    let rank = rank_dir_of(&tier, &k);
    std::fs::rename(&rank, root.path().join("moved-away")).unwrap();
    let other = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    assert!(fs_store(&other, &[k], 7).await.is_success());
    assert!(!exists_nofollow(&tier.block_path(&only_old)));
    let looked = tier.lookup(&[k, only_old]).await.unwrap();
    let (res, data) = load(&tier, &[k, only_old]).await;
    assert_accounts(&res, &[k, only_old], "load");
    let got: HashMap<BlockKey, bytes::Bytes> = data.into_iter().collect();
    let served_old = got.get(&k).map(|d| verify_block(&k, 0, d));
    let only_old_served = res.ok.contains(&only_old);
    let observed = format!(
        "lookup {looked:?}; key only in the moved-away directory served: {only_old_served}; \
         k (salt 0 in the moved-away directory, salt 7 at its path now): {}",
        match served_old {
            Some(true) => "served the MOVED-AWAY directory's bytes (salt 0)",
            Some(false) => "served the bytes at its path (salt 7)",
            None => "a miss",
        }
    );
    assert_eq!(looked, vec![true, false], "{observed}");
    assert!(!only_old_served, "{observed}");
    assert_eq!(served_old, Some(false), "{observed}");
    assert!(verify_block(&k, 7, &got[&k]));
}

/// A root that is a symlink, and a rank directory that is a symlink to a directory
/// elsewhere, work; the rank symlink retargeted under the running tier: later stores land
/// at the keys' paths (in the new target).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlinked_root_and_rank_directory() {
    // root_dir a symlink
    let real = temp_root();
    let holder = temp_root();
    let link = holder.path().join("root-link");
    std::os::unix::fs::symlink(real.path(), &link).unwrap();
    let tier = FsTier::open("fs", checked_cfg(&link), ns(), BS).unwrap();
    let ks: Vec<BlockKey> = (0..8).map(|i| test_key(62_000 + i)).collect();
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    assert_eq!(bin_files(real.path()).len(), 8);
    let (res, data) = load(&tier, &ks).await;
    assert!(res.is_success() && data.iter().all(|(k, d)| verify_block(k, 0, d)));
    tier.shutdown().await.unwrap();
    drop(tier);

    // the rank directory a symlink
    let root = temp_root();
    let probe = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let rank_name = rank_dir_of(&probe, &ks[0]).file_name().unwrap().to_owned();
    probe.shutdown().await.unwrap();
    drop(probe);
    let root = temp_root();
    let (x, y) = (temp_root(), temp_root());
    let rank = root.path().join(&rank_name);
    std::os::unix::fs::symlink(x.path(), &rank).unwrap();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    assert!(fs_store(&tier, &ks[..4], 0).await.is_success());
    assert_eq!(
        bin_files(x.path()).len(),
        4,
        "blocks not in the link's target"
    );
    let (res, _) = load(&tier, &ks[..4]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    // retarget the link
    std::fs::remove_file(&rank).unwrap();
    std::os::unix::fs::symlink(y.path(), &rank).unwrap();
    let res = fs_store(&tier, &ks[4..], 0).await;
    for k in &res.ok {
        assert!(
            is_regular(&tier.block_path(k)),
            "{k} reported stored but not at its path after the rank link was retargeted (old target has {} blocks)",
            bin_files(x.path()).len()
        );
    }
    assert!(res.is_success(), "{:?}", res.failed);
}

/// The rank directory is a symlink (to a bigger disk, say) and the operator points it at
/// another directory while the tier runs: a block the tier then stores (reported stored, at
/// its path) loads from the same tier. Loads of a key stored before the retarget, which is
/// not at its path any more, are a miss like `lookup` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_rank_link_is_retargeted_a_block_just_stored_loads() {
    let probe_root = temp_root();
    let probe = FsTier::open("fs", cfg(probe_root.path()), ns(), BS).unwrap();
    let k0 = test_key(62_500);
    let rank_name = rank_dir_of(&probe, &k0).file_name().unwrap().to_owned();
    probe.shutdown().await.unwrap();
    drop(probe);
    let root = temp_root();
    let (x, y) = (temp_root(), temp_root());
    let rank = root.path().join(&rank_name);
    std::os::unix::fs::symlink(x.path(), &rank).unwrap();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    let (old, new) = (test_key(62_501), test_key(62_502));
    assert!(fs_store(&tier, &[old], 0).await.is_success());
    let (res, _) = load(&tier, &[old]).await; // a load before the link is retargeted
    assert!(res.is_success());
    std::fs::remove_file(&rank).unwrap();
    std::os::unix::fs::symlink(y.path(), &rank).unwrap();
    let res = fs_store(&tier, &[new], 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(
        is_regular(&tier.block_path(&new)),
        "stored, not at its path"
    );
    assert!(
        bin_files(y.path()).len() == 1,
        "not in the link's new target"
    );
    let looked = tier.lookup(&[old, new]).await.unwrap();
    let (res, data) = load(&tier, &[old, new]).await;
    assert_eq!(looked, vec![false, true]);
    assert!(
        res.ok.contains(&new),
        "a block just stored (at {}) is not found by a load of the same tier: {:?} (lookup {looked:?}; \
         the old target still holds {:?})",
        tier.block_path(&new).display(),
        res.failed,
        bin_files(x.path())
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert!(
        !res.ok.contains(&old),
        "a key not at its path (only in the link's old target) was served; lookup said {looked:?}"
    );
}

/// Stores, loads and lookups run while another thread deletes block files, leaf and top
/// directories and (rarely) the whole rank directory: loads never serve wrong bytes, no
/// damage is ever found (an external delete is not damage), every job accounts for its
/// keys; once the deletes stop, one store puts every key on disk and every key loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_loads_and_external_deletes_never_serve_wrong_bytes() {
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
        let keys: Vec<BlockKey> = (0..64)
            .map(|i| {
                if i % 2 == 0 {
                    leaf_key(i)
                } else {
                    test_key(66_000 + i)
                }
            })
            .collect();
        let paths: Vec<PathBuf> = keys.iter().map(|k| tier.block_path(k)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let deleter = {
            let (stop, paths) = (stop.clone(), paths.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(5);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let p = &paths[rng.below(paths.len() as u64) as usize];
                    match rng.below(100) {
                        0..=69 => {
                            let _ = std::fs::remove_file(p);
                        }
                        70..=89 => rm_rf(p.parent().unwrap()),
                        90..=97 => rm_rf(p.parent().unwrap().parent().unwrap()),
                        _ => rm_rf(p.parent().unwrap().parent().unwrap().parent().unwrap()),
                    }
                    n += 1;
                    std::thread::sleep(Duration::from_micros(300)); // the deleter's pace
                }
                n
            })
        };
        let wrong = Arc::new(AtomicU64::new(0));
        let served = Arc::new(AtomicU64::new(0));
        let until = Instant::now() + Duration::from_secs(3);
        let fails = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for t in 0..6u64 {
            let (tier, keys, wrong, served) =
                (tier.clone(), keys.clone(), wrong.clone(), served.clone());
            let fails = fails.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng::new(t + 1);
                while Instant::now() < until {
                    let mut ks = keys.clone();
                    rng.shuffle(&mut ks);
                    ks.truncate(8);
                    match t % 3 {
                        0 => {
                            let res = fs_store(&tier, &ks, 0).await;
                            assert_accounts(&res, &ks, "store");
                            for (_, e) in &res.failed {
                                if fails.fetch_add(1, Ordering::Relaxed) < 3 {
                                    eprintln!("store failure under external deletes: {e}");
                                }
                            }
                        }
                        1 => {
                            let (res, data) = load(&tier, &ks).await;
                            assert_accounts(&res, &ks, "load");
                            for (k, d) in &data {
                                served.fetch_add(1, Ordering::Relaxed);
                                if !verify_block(k, 0, d) {
                                    wrong.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        _ => {
                            let r = tier.lookup(&ks).await.unwrap();
                            assert_eq!(r.len(), ks.len());
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let deletes = deleter.join().unwrap();
        let s = tier.stats().blocks;
        eprintln!(
            "publish {publish}: {deletes} deletes, {} served, {s:?}",
            served.load(Ordering::Relaxed)
        );
        assert_eq!(
            wrong.load(Ordering::Relaxed),
            0,
            "publish {publish}: wrong bytes served"
        );
        assert!(served.load(Ordering::Relaxed) > 0, "nothing served");
        assert_eq!(
            (
                s.corrupt_deleted,
                s.checksum_mismatches,
                s.unverified_refused
            ),
            (0, 0, 0),
            "publish {publish}: external deletes were taken for damage: {s:?}"
        );
        let res = fs_store(&tier, &keys, 0).await;
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
        for k in &keys {
            assert!(
                is_regular(&tier.block_path(k)),
                "publish {publish}: {k} reported stored, not on disk"
            );
        }
        let (res, data) = load(&tier, &keys).await;
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        assert!(
            tmp_files(root.path()).is_empty(),
            "{:?}",
            tmp_files(root.path())
        );
    }
}
