//! Looking at the disk: the walk at open and rescans adopt what is there (block files only;
//! foreign files counted and never swept) and repair drift (external deletes, a `kv-tier gc`
//! run); a rescan, a stamp or a load that finds a file gone never forgets one published again
//! meanwhile.

use std::collections::HashSet;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, SystemTime};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{FsTier, SweepPoint};
use kv_tier_testkit::fixtures::files::allocation_units;
use kv_tier_testkit::wait::{SETTLE_LIMIT, poll_until_async};
use kv_tier_testkit::{load_keys, temp_root, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_recovers_size_and_recency_from_disk() {
    let root = temp_root();
    let ks = {
        let tier = open_hand_swept(root.path(), 10, 0.8);
        stored_aged(&tier, 15, &[]).await
    };
    // a file written by another process (vLLM) is adopted too, with its mtime
    let foreign = leaf_key(77);
    let p = ns().block_path(root.path(), &foreign);
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(&p, vec![0u8; BS]).unwrap();
    let f = std::fs::File::options().write(true).open(&p).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(99_999))
        .unwrap();
    drop(f);
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.bytes), (16, held(root.path(), 16)));
    assert_eq!(tier.gc_sweep_now().unwrap(), 8);
    assert!(!p.exists(), "the oldest (foreign) file goes first");
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| i >= 7).collect::<Vec<_>>()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_external_rm_is_absorbed_by_the_rescan() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = leaf_keys(0..5);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    tier.take_events();
    std::fs::remove_file(tier.block_path(&ks[1])).unwrap();
    std::fs::remove_file(tier.block_path(&ks[3])).unwrap();
    assert_eq!(
        gc_stats(&tier).files,
        5,
        "the index does not walk the tree by itself"
    );
    tier.gc_rescan_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.bytes, s.rescans), (3, held(root.path(), 3), 1));
    let removed: Vec<BlockKey> = kv_tier_testkit::removed_keys(tier.take_events());
    assert_eq!(removed.len(), 2);
    assert!(removed.contains(&ks[1]) && removed.contains(&ks[3]));
}

/// A rescan takes what the disk says for a file that changed size while keeping its mtime
/// (rewritten by another process that restored the time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_takes_a_new_size_under_an_old_mtime() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let k = leaf_key(1);
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    tier.gc_rescan_now().unwrap(); // the index holds the file's own mtime and size now
    assert_eq!(gc_stats(&tier).bytes, held(root.path(), 1));
    let path = tier.block_path(&k);
    let mtime = std::fs::metadata(&path).unwrap().modified().unwrap();
    let f = std::fs::File::options().write(true).open(&path).unwrap();
    std::io::Write::write_all(&mut &f, &vec![7u8; 4 * BS]).unwrap();
    f.sync_all().unwrap();
    f.set_modified(mtime).unwrap();
    tier.gc_rescan_now().unwrap();
    assert_eq!(gc_stats(&tier).bytes, held(root.path(), 4));
}

/// The opening walk adopts block files only: a directory named like a block and a `.bin`
/// whose name is not a block's are counted as foreign (by a rescan too), a stray note is
/// passed over; none is a block or counts toward the cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_walk_adopts_block_files_only_and_counts_the_rest() {
    let root = temp_root();
    let k = leaf_key(1);
    {
        let t = open_hand_swept(root.path(), 10, 0.8);
        assert!(fs_store(&t, &[k], 0).await.is_success());
        let leaf = t.block_path(&k).parent().unwrap().to_path_buf();
        std::fs::create_dir(t.block_path(&leaf_key(2))).unwrap(); // a directory named like a block
        std::fs::write(leaf.join("zz.bin"), b"not a block name").unwrap();
        std::fs::write(leaf.join("notes.txt"), b"someone's notes").unwrap();
    }
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.foreign_files), (1, 2), "{s:?}");
    assert_eq!(s.bytes, held(root.path(), 1), "{s:?}");
    tier.gc_rescan_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.foreign_files), (1, 2), "{s:?}");
}

/// A rescan that walked the tree before some files were published keeps them (and reports no
/// removal); only files verified absent are forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_keeps_files_published_while_it_walked() {
    let root = temp_root();
    let tier =
        Arc::new(FsTier::open("fs", capped_no_thread_cfg(root.path(), 1 << 30), ns(), BS).unwrap());
    let old: Vec<_> = (0..10).map(test_key).collect();
    assert!(fs_store(&*tier, &old, 0).await.is_success());
    std::fs::remove_file(tier.block_path(&old[3])).unwrap(); // an external rm
    tier.take_events();
    let (at_tx, at_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    tier.set_sweep_hook(Some(Arc::new(move |p| {
        if p == SweepPoint::RescanWalked {
            at_tx.send(()).unwrap();
            go_rx.lock().unwrap().recv().unwrap();
        }
    })))
    .unwrap();
    let t = tier.clone();
    let rescan = std::thread::spawn(move || t.gc_rescan_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the sweep hook was never reached"); // the walk is done; its merge waits
    let new: Vec<_> = (100..110).map(test_key).collect();
    assert!(fs_store(&*tier, &new, 0).await.is_success());
    go_tx.send(()).unwrap();
    rescan.join().unwrap();
    tier.set_sweep_hook(None).unwrap();
    let s = gc_stats(&tier);
    assert_eq!(s.files, 19, "{s:?}");
    let removed = kv_tier_testkit::removed_keys(tier.take_events());
    assert_eq!(
        removed,
        vec![old[3]],
        "only the file verified absent is reported"
    );
}

/// A stamp that finds its file gone does not forget a file published again since.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stamp_that_finds_no_file_keeps_a_file_published_since() {
    let root = temp_root();
    let mut c = capped_no_thread_cfg(root.path(), 1 << 30);
    c.gc_stamp_interval_s = Some(0.001);
    let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    let k = test_key(1);
    assert!(fs_store(&*tier, &[k], 0).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(1)).unwrap();
    tier.touch(&[k]);
    std::fs::remove_file(tier.block_path(&k)).unwrap(); // deleted behind the tier's back...
    let (at_tx, at_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    tier.set_sweep_hook(Some(Arc::new(move |p| {
        if p == SweepPoint::StampsDone {
            at_tx.send(()).unwrap();
            go_rx.lock().unwrap().recv().unwrap();
        }
    })))
    .unwrap();
    let t = tier.clone();
    let stamps = std::thread::spawn(move || t.gc_apply_stamps_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the sweep hook was never reached"); // the stamp hit ENOENT
    assert!(fs_store(&*tier, &[k], 0).await.is_success()); // ...and published again
    go_tx.send(()).unwrap();
    stamps.join().unwrap();
    tier.set_sweep_hook(None).unwrap();
    assert_eq!(gc_stats(&tier).files, 1, "the index forgot a live file");
    assert!(kv_tier_testkit::removed_keys(tier.take_events()).is_empty());
}

/// A load that finds a key's file gone does not forget the file a store published again in
/// between (the race: open answers ENOENT, the store publishes, the load updates the index).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_that_misses_keeps_a_file_stored_meanwhile() {
    let root = temp_root();
    let tier =
        Arc::new(FsTier::open("fs", capped_no_thread_cfg(root.path(), 1 << 30), ns(), BS).unwrap());
    let k = test_key(1);
    assert!(fs_store(&*tier, &[k], 0).await.is_success());
    std::fs::remove_file(tier.block_path(&k)).unwrap(); // an external rm
    // the load's open is made to answer ENOENT only after a store has published again
    let (at_tx, at_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    tier.set_fault_injector(Some(Arc::new(move |op, _p: &Path| {
        if op == kv_tier_fs::FsOp::OpenRead {
            at_tx.send(()).unwrap();
            go_rx.lock().unwrap().recv().unwrap();
            return Some(std::io::Error::from_raw_os_error(libc::ENOENT));
        }
        None
    })));
    let t = tier.clone();
    let loading = tokio::spawn(async move { load(&*t, &[k]).await.0 });
    tokio::task::spawn_blocking(move || {
        at_rx
            .recv_timeout(HOOK_DEADLINE)
            .expect("the sweep hook was never reached")
    })
    .await
    .unwrap();
    assert!(fs_store(&*tier, &[k], 0).await.is_success()); // published again
    go_tx.send(()).unwrap();
    let res = loading.await.unwrap();
    assert!(matches!(
        res.failed[0].1,
        kv_tier_core::Error::NotFound { .. }
    ));
    tier.set_fault_injector(None);
    assert!(tier.block_path(&k).exists());
    assert_eq!(gc_stats(&tier).files, 1, "the index forgot a file on disk");
}

/// While it runs, a tier's rescans never reap its own temp files, even with
/// `tmp_reap_age_s: 0` (which reaps every temp file at open).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rescan_never_reaps_the_tiers_own_temp_files() {
    let root = temp_root();
    let mut c = capped_no_thread_cfg(root.path(), 1 << 30);
    c.tmp_reap_age_s = 0;
    let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
    let (at_tx, at_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    tier.set_fault_injector(Some(Arc::new(move |op, _p: &Path| {
        if op == kv_tier_fs::FsOp::Publish {
            at_tx.send(()).unwrap();
            go_rx.lock().unwrap().recv().unwrap();
        }
        None
    })));
    let k = test_key(1);
    let t = tier.clone();
    let storing = tokio::spawn(async move { fs_store(&*t, &[k], 0).await });
    tokio::task::spawn_blocking(move || {
        at_rx
            .recv_timeout(HOOK_DEADLINE)
            .expect("the sweep hook was never reached")
    })
    .await
    .unwrap(); // the temp file is written, not yet published
    tier.gc_rescan_now().unwrap();
    go_tx.send(()).unwrap();
    let res = storing.await.unwrap();
    assert!(
        res.is_success(),
        "a rescan reaped an in-flight temp file: {:?}",
        res.failed
    );
}

/// `GcStats::foreign_files`: "Files in the tree that are not block files of this layout (a
/// `.bin` in the rank, a top or a leaf directory that is not a regular file, or whose name or
/// place is not a block's; directories below the leaves are not walked), as the last walk (at
/// open or a rescan) found them: left alone, not counted toward the cap".
///
/// Four `.bin` files that are not blocks (at the top of the rank directory, with a name that
/// is not hex, in a leaf whose name does not match, one level too deep): the open walk counts
/// the 3 it walks past (the one below a leaf is not walked), nothing counts toward the cap,
/// and a rescan leaves them all. (Found: the one in the rank directory was not counted.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn foreign_files_are_counted_and_never_swept() {
    let root = temp_root();
    {
        let t = FsTier::open(
            "fs",
            capped_hand_swept_cfg(root.path(), 100 << 20),
            ns(),
            BS,
        )
        .unwrap();
        assert!(
            store_sized(&t, &[test_key(27_000_000)], BS)
                .await
                .is_success()
        );
    }
    let rd = rank_dir(root.path());
    let foreign: Vec<_> = [
        "foreign.bin",
        "abc/de_g0/notahexname.bin",
        "abc/zz_g0/abcdef.bin",
        "abc/de_g0/deeper/abcde.bin",
    ]
    .iter()
    .map(|r| rd.join(r))
    .collect();
    for f in &foreign {
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, vec![1u8; 4096]).unwrap();
        set_mtime(f, 90_000);
    }
    let mut c = capped_hand_swept_cfg(root.path(), 100 << 20);
    c.gc_low_watermark = Some(1e-9);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let s = gc_stats(&tier);
    assert_eq!(s.files, 1, "{s:?}");
    let counted = s.foreign_files;
    tier.gc_rescan_now().unwrap();
    for f in &foreign {
        assert!(f.exists(), "{}", f.display());
    }
    assert_eq!(
        (counted, gc_stats(&tier).foreign_files),
        (3, 3),
        "foreign .bin files counted at open and by a rescan"
    );
}

/// README "Accounting": "a rare rescan repairs drift", "What the index sums is what `du` of
/// the rank directory shows", "A rescan merges what it finds: ... only files verified absent
/// are forgotten (and reported)"; "Events": "`BlockRemoved` ... for files a rescan finds
/// gone"; ARCHITECTURE.md: "an externally deleted file is dropped from the index" by a sweep,
/// and "Files found already gone are reported `BlockRemoved`".
///
/// Blocks removed with `rm` behind the tier's back: a rescan forgets exactly them (with
/// removal events), the index equals `du` again; more removed, then a sweep (no rescan)
/// meets them: no errors, events for them, index equals `du`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_deletes_are_repaired_and_reported() {
    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir;
    let tier = FsTier::open(
        "fs",
        capped_hand_swept_cfg(root.path(), 40 * per_block),
        ns(),
        BS,
    )
    .unwrap();
    let keys: Vec<_> = (0..30).map(|i| test_key(12_000_000 + i)).collect();
    for k in &keys {
        assert!(store_sized(&tier, &[*k], BS).await.is_success()); // one at a time: mtime order = key order
    }
    let _ = tier.take_events();
    let rm: Vec<_> = keys.iter().step_by(3).copied().collect();
    for k in &rm {
        std::fs::remove_file(tier.block_path(k)).unwrap();
    }
    tier.gc_rescan_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!(s.files, 20, "{s:?}");
    let mut ev = Vec::new();
    drain_events(&tier, &mut ev);
    let removed: HashSet<_> = ev.iter().filter(|e| e.1).map(|e| e.0).collect();
    assert_eq!(
        removed,
        rm.iter().copied().collect::<HashSet<_>>(),
        "removal events after a rescan"
    );
    assert_eq!(tier.lookup(&rm).await.unwrap(), vec![false; rm.len()]);

    // deleted behind the sweep's back, then swept
    let more: Vec<_> = (30..60).map(|i| test_key(12_000_000 + i)).collect();
    assert!(store_sized(&tier, &more, BS).await.is_success());
    let _ = tier.take_events();
    tier.advance_gc_clock(Duration::from_secs(10_000)).unwrap();
    let survivors: Vec<_> = keys.iter().filter(|k| !rm.contains(k)).copied().collect();
    let rm2: Vec<_> = survivors.iter().take(5).copied().collect(); // the oldest: sweep candidates
    for k in &rm2 {
        std::fs::remove_file(tier.block_path(k)).unwrap();
    }
    let errors_before = gc_stats(&tier).errors;
    tier.gc_sweep_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!(
        s.errors, errors_before,
        "a file already gone counted as an error: {s:?}"
    );
    let mut ev = Vec::new();
    drain_events(&tier, &mut ev);
    let removed: HashSet<_> = ev.iter().filter(|e| e.1).map(|e| e.0).collect();
    let unreported = rm2.iter().filter(|k| !removed.contains(k)).count();
    assert_eq!(
        unreported,
        0,
        "{unreported} of {} externally deleted candidates not reported removed by the sweep ({} removals reported): {s:?}",
        rm2.len(),
        removed.len()
    );
    for k in &removed {
        assert!(
            !tier.block_path(k).exists(),
            "reported removed, still on disk"
        );
    }
    assert_eq!(s.files as usize, bins(root.path()).len(), "{s:?}");
}

/// kv-tier-cli: "`kv-tier gc ROOT --max-size-gb X [--dry-run]`: what a sweep would delete,
/// oldest first"; README: the index repairs drift from external deletes ("a rescan merges
/// ... only files verified absent are forgotten (and reported)"); `SecondaryTier::load`: "A
/// key that is missing ... fails alone".
///
/// The operator's `kv-tier gc` run on the root while a bounded tier is live and storing: the
/// CLI exits 0 (files and directories the tier removed under its walk are skipped or
/// reported "already gone"), and the tier goes on (stores succeed, loads return right bytes or a miss, never
/// wrong bytes), and once quiet its index matches `du` again and stays within the ceiling. (Skipped, loudly,
/// if the `kv-tier` binary was not built: `cargo build -p kv-tier-cli`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_gc_cli_run_against_a_live_tier() {
    let exe = std::env::current_exe().unwrap();
    let bin = exe.parent().unwrap().parent().unwrap().join("kv-tier");
    if !bin.exists() {
        eprintln!(
            "SKIPPED: {} not built (cargo build -p kv-tier-cli)",
            bin.display()
        );
        return;
    }
    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir;
    let cap = 200 * per_block;
    let mut c = capped_cfg(root.path(), cap);
    c.gc_interval_s = Some(0.05);
    c.gc_rescan_interval_s = Some(1.0);
    let tier = open_cfg(c, BS);
    let first: Vec<_> = (0..150).map(|i| test_key(14_000_000 + i)).collect();
    assert!(store_sized(&tier, &first, BS).await.is_success());
    let stop = Arc::new(AtomicBool::new(false));
    let mut hs = Vec::new();
    for w in 0..3u64 {
        let (tier, stop) = (tier.clone(), stop.clone());
        hs.push(tokio::spawn(async move {
            let mut stored = Vec::new();
            let mut other = Vec::new();
            let mut j = 0;
            while !stop.load(Ordering::Relaxed) {
                let ks: Vec<_> = (0..4)
                    .map(|x| test_key(14_100_000 + w * 100_000 + j * 4 + x))
                    .collect();
                let res = store_sized(&tier, &ks, BS).await;
                stored.extend(res.ok);
                other.extend(
                    res.failed
                        .into_iter()
                        .filter(|(_, e)| !is_no_space(e))
                        .map(|(_, e)| e.to_string()),
                );
                j += 1;
                if j > 2000 {
                    break;
                }
            }
            (stored, other)
        }));
    }
    let cli_cap = gb(du(root.path()) / 3);
    let root_s = root.path().to_path_buf();
    // the CLI walks a root that changes under it (the tier's own sweeps delete files and
    // empty directories): what is gone meanwhile is skipped or reported "already gone", and
    // it exits 0 (forced: it refuses a root in use otherwise)
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(&bin)
            .arg("gc")
            .arg(&root_s)
            .arg("--max-size-gb")
            .arg(format!("{cli_cap}"))
            .arg("--force")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        out.status.success(),
        "kv-tier gc on the live root: {:?}; stderr: {}; stdout lines: {}",
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).trim(),
        String::from_utf8_lossy(&out.stdout).lines().count()
    );
    tokio::time::sleep(Duration::from_millis(300)).await; // let stores continue after the CLI
    stop.store(true, Ordering::Relaxed);
    let mut stored = first.clone();
    let mut other = Vec::new();
    for h in hs {
        let (s, o) = h.await.unwrap();
        stored.extend(s);
        other.extend(o);
    }
    assert!(other.is_empty(), "{:?}", &other[..other.len().min(5)]);
    assert!(
        ns().config_path(root.path()).exists(),
        "the CLI deleted config.json"
    );
    let (res, got) = load_keys(&*tier, &stored, BS).await;
    for (k, b) in &got {
        assert!(
            kv_tier_testkit::verify_block(k, 0, b),
            "wrong bytes after the CLI's sweep"
        );
    }
    for (_, e) in &res.failed {
        assert!(
            matches!(e, Error::NotFound { .. }),
            "a load failed other than as a miss: {e}"
        );
    }
    let r = root.path().to_path_buf();
    let t = tier.clone();
    let settled = poll_until_async(SETTLE_LIMIT, || {
        let s = gc_stats(&t);
        s.bytes == du(&r)
    })
    .await;
    let s = gc_stats(&tier);
    assert!(
        settled,
        "the index never matched du again: {} vs {}: {s:?}",
        s.bytes,
        du(root.path())
    );
    assert!(du(root.path()) <= s.hard_ceiling_bytes, "{s:?}");
    let res = store_sized(&tier, &[test_key(14_999_999)], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    tier.shutdown().await.unwrap();
}

/// README "Accounting": "one walk at open adopts what is on disk ... What the index sums is
/// what `du` of the rank directory shows"; "Sweep": deletes only "above the cap"
/// (`gc_sweep_now`: "Runs one sweep now ... (if over the cap)").
///
/// A tier holding 2000 blocks (its index equal to `du`, checked live and after a rescan)
/// is reopened: the open walk must find the same total, and with a cap 1.2x what `du` shows
/// a sweep (every file out of grace) must delete nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reopen_adopts_what_du_shows_at_scale() {
    let root = temp_root();
    {
        let t = FsTier::open(
            "fs",
            capped_hand_swept_cfg(root.path(), 100 << 20),
            ns(),
            BS,
        )
        .unwrap();
        for j in 0..40u64 {
            let ks: Vec<_> = (0..50).map(|x| test_key(28_000_000 + j * 50 + x)).collect();
            assert!(store_sized(&t, &ks, BS).await.is_success());
        }
        t.gc_rescan_now().unwrap();
        assert_eq!(gc_stats(&t).bytes, du(root.path()), "live, after a rescan");
        t.shutdown().await.unwrap();
    }
    let d = du(root.path());
    let dirs = du_dirs(&rank_dir(root.path()));
    let cap = d + d / 5;
    let t = FsTier::open("fs", capped_hand_swept_cfg(root.path(), cap), ns(), BS).unwrap();
    let s = gc_stats(&t);
    t.advance_gc_clock(Duration::from_secs(10_000)).unwrap(); // grace is not what spares them
    let deleted = t.gc_sweep_now().unwrap();
    assert!(
        s.bytes == d && s.dir_bytes == dirs && deleted == 0,
        "after reopening: index {} (dirs {}, peak {}) vs du {d} (dirs {dirs}); a sweep under a cap of {cap} deleted {deleted} of 2000 blocks",
        s.bytes,
        s.dir_bytes,
        s.peak_bytes
    );
}
