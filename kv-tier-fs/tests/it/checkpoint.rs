//! Restart from a checkpoint: the index a tier wrote when it closed is where the next open
//! starts (no walk at open), reconciled with the disk by a walk in the background; a
//! damaged, cut-short or foreign checkpoint is refused and the tree walked; chains and
//! measured directories survive; `gc_checkpoint_interval_s: 0` turns it off.

use std::path::{Path, PathBuf};

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_fs::{FsTier, FsTierConfig};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until};
use kv_tier_testkit::{load_keys, temp_root, verify_block};

use crate::support::*;

/// [`hand_swept_cfg`] with the GC thread on (it reconciles a checkpointed index first).
fn background_cfg(root: &Path, cap_blocks: u64, watermark: f64) -> FsTierConfig {
    let mut c = hand_swept_cfg(root, cap_blocks, watermark);
    c.gc_background = true;
    c
}

fn checkpoint_file(root: &Path) -> PathBuf {
    let ns = ns();
    ns.namespace_dir(root)
        .join(format!("{}.index", ns.rank_dir_name()))
}

fn reconciled(tier: &FsTier) {
    wait_until("the index is reconciled", SETTLE_LIMIT, || {
        gc_stats(tier).reconciled
    });
}

/// Stores `n` blocks of one leaf on a tier that holds 100, and closes it (writing its
/// checkpoint).
async fn closed_with(root: &Path, n: u64) -> Vec<BlockKey> {
    let tier = open_hand_swept(root, 100, 0.8);
    let ks = leaf_keys(0..n);
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    tier.shutdown().await.unwrap();
    assert_eq!(gc_stats(&tier).checkpoints_written, 1);
    ks
}

/// Promise (`gc_checkpoint_interval_s`): the checkpoint written at close is read by the next
/// open "instead of walking the tree; it then answers at once and reconciles with the disk
/// by a walk in the background". Reopened, the tier holds every block, counts what `du`
/// counts, serves the blocks, and has walked once, after the open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reopened_tier_starts_from_its_checkpoint() {
    let root = temp_root();
    let ks = closed_with(root.path(), 20).await;
    assert!(checkpoint_file(root.path()).is_file());
    let tier = FsTier::open("fs", background_cfg(root.path(), 100, 0.8), ns(), BS).unwrap();
    let s = gc_stats(&tier);
    assert_eq!((s.checkpoint_files, s.files, s.adopt_ms), (20, 20, 0));
    assert!(ks.iter().all(|k| tier.holds(k) == Some(true)));
    reconciled(&tier);
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.rescans, s.external_removals), (20, 1, 0));
    assert_eq!(s.bytes, du(root.path()), "index vs du: {s:?}");
    let (r, data) = load_keys(&tier, &ks, BS).await;
    assert!(r.is_success());
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// Promise (checkpoint module): "every open that reads one reconciles it with the disk ...
/// which adopts the files added since and forgets the ones removed since, whoever changed
/// them". Two blocks removed and one written by another process while the tier was closed:
/// once reconciled, the index has what the disk has, counts what `du` counts, reports the
/// two removals, and answers `holds` for each as the disk would.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_changed_while_closed_are_reconciled() {
    let root = temp_root();
    let ks = closed_with(root.path(), 10).await;
    let tier_path = |k: &BlockKey| ns().block_path(root.path(), k);
    std::fs::remove_file(tier_path(&ks[2])).unwrap();
    std::fs::remove_file(tier_path(&ks[7])).unwrap();
    let foreign = leaf_key(50);
    let mut bytes = vec![0u8; BS];
    kv_tier_testkit::fill_block(&foreign, 0, &mut bytes);
    std::fs::write(tier_path(&foreign), bytes).unwrap();
    let tier = FsTier::open("fs", background_cfg(root.path(), 100, 0.8), ns(), BS).unwrap();
    assert_eq!(gc_stats(&tier).checkpoint_files, 10);
    reconciled(&tier);
    let s = gc_stats(&tier);
    assert_eq!((s.files, s.external_removals), (9, 2), "{s:?}");
    assert_eq!(s.bytes, du(root.path()), "index vs du: {s:?}");
    let removed = kv_tier_testkit::removed_keys(tier.take_events());
    assert_eq!(removed.len(), 2);
    assert!(removed.contains(&ks[2]) && removed.contains(&ks[7]));
    assert_eq!(tier.holds(&ks[2]), Some(false));
    assert_eq!(tier.holds(&ks[3]), Some(true));
    assert_eq!(
        tier.holds(&foreign),
        Some(true),
        "the foreign file was not adopted"
    );
}

/// Promise (checkpoint module): "a damaged, truncated or foreign checkpoint is refused, with
/// the reason, and the open walks the tree as it would without one". Each kind is refused
/// (counted), and the walk finds every block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_cut_or_foreign_checkpoint_is_refused_and_the_tree_walked() {
    let root = temp_root();
    closed_with(root.path(), 12).await;
    let file = checkpoint_file(root.path());
    let good = std::fs::read(&file).unwrap();
    let mut flipped = good.clone();
    flipped[good.len() / 2] ^= 1;
    // written for another namespace's rank directory: same format, another identity
    let other = {
        let other_root = temp_root();
        let mut c = hand_swept_cfg(other_root.path(), 100, 0.8);
        c.gc_background = false;
        let ns1 = kv_tier_core::Namespace::new(
            kv_tier_core::RunFields::new("other/model", "torch.bfloat16", 16),
            0,
        )
        .unwrap();
        let t = FsTier::open("fs", c, ns1.clone(), BS).unwrap();
        assert!(fs_store(&t, &leaf_keys(0..3), 0).await.is_success());
        drop(t);
        std::fs::read(
            ns1.namespace_dir(other_root.path())
                .join(format!("{}.index", ns1.rank_dir_name())),
        )
        .unwrap()
    };
    for (what, bytes) in [
        ("flipped", flipped),
        ("cut", good[..good.len() - 9].to_vec()),
        ("empty", Vec::new()),
        ("garbage", vec![0x5a; 4096]),
        ("foreign", other),
    ] {
        std::fs::write(&file, &bytes).unwrap();
        let tier = FsTier::open("fs", background_cfg(root.path(), 100, 0.8), ns(), BS).unwrap();
        let s = gc_stats(&tier);
        assert_eq!(
            (
                s.checkpoints_refused,
                s.checkpoint_files,
                s.files,
                s.reconciled
            ),
            (1, 0, 12, true),
            "{what}: {s:?}"
        );
        // closing writes a good one again; the next kind of damage replaces it
        drop(tier);
    }
}

/// Promise (`LruIndex::chain_link`, checkpoint module: records carry their chain link):
/// chain links survive a restart. A chain whose head is the oldest file and whose tail was
/// used lately stays whole through the first sweep after the reopen, as it does before one
/// (`capacity::chains::a_chain_used_at_its_tail_keeps_its_head`); a walk, which knows no
/// links, would take its head first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chain_links_survive_a_restart() {
    let root = temp_root();
    let ks = leaf_keys(0..15);
    {
        let tier = open_hand_swept(root.path(), 100, 0.8);
        store_chain(&tier, &ks[..5], None).await;
        assert!(fs_store(&tier, &ks[5..], 0).await.is_success());
        age(&tier, &ks, |i| {
            if i == 4 { 400 } else { (15 - i as u64) * 1000 }
        });
    }
    // reopened holding 10: over the cap, the GC thread sweeps once reconciled
    let tier = FsTier::open("fs", background_cfg(root.path(), 10, 0.8), ns(), BS).unwrap();
    assert_eq!(gc_stats(&tier).checkpoint_files, 15);
    wait_until("the reopened tier swept", SETTLE_LIMIT, || {
        let s = gc_stats(&tier);
        s.reconciled && s.swept_files == 7
    });
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| !(5..12).contains(&i)).collect::<Vec<_>>(),
        "the chain stays whole, the seven oldest others go"
    );
}

/// Promise (`gc_checkpoint_interval_s`): "0: no checkpoints (none written, none read)"; and
/// "not used ... with `gc_background` false (the open walks)".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_are_off_at_zero_and_unread_without_the_gc_thread() {
    let root = temp_root();
    let mut off = background_cfg(root.path(), 100, 0.8);
    off.gc_checkpoint_interval_s = Some(0.0);
    let tier = FsTier::open("fs", off.clone(), ns(), BS).unwrap();
    assert!(fs_store(&tier, &leaf_keys(0..4), 0).await.is_success());
    drop(tier);
    assert!(!checkpoint_file(root.path()).exists(), "written while off");
    closed_with(root.path(), 6).await; // writes one
    let tier = FsTier::open("fs", off, ns(), BS).unwrap();
    assert_eq!(gc_stats(&tier).checkpoint_files, 0, "read while off");
    assert_eq!(gc_stats(&tier).files, 6);
    drop(tier);
    let tier = open_hand_swept(root.path(), 100, 0.8);
    let s = gc_stats(&tier);
    assert_eq!((s.checkpoint_files, s.files, s.reconciled), (0, 6, true));
}

/// Promise (checkpoint module): "written whole to a temp file, fsynced and renamed over the
/// previous one, so a crash at any moment leaves the previous checkpoint or the new one".
/// A writer killed mid-write leaves its temp file beside the good checkpoint: the open reads
/// the good one, and the temp file is reaped as any stray temp file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_write_cut_by_a_crash_leaves_the_previous_one() {
    let root = temp_root();
    closed_with(root.path(), 8).await;
    let file = checkpoint_file(root.path());
    let good = std::fs::read(&file).unwrap();
    let mut tmp = file.as_os_str().to_os_string();
    tmp.push("_00000000deadbeef.tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, &good[..good.len() / 3]).unwrap();
    let f = std::fs::File::options().write(true).open(&tmp).unwrap();
    f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(3600))
        .unwrap();
    drop(f);
    let tier = FsTier::open("fs", background_cfg(root.path(), 100, 0.8), ns(), BS).unwrap();
    let s = gc_stats(&tier);
    assert_eq!((s.checkpoint_files, s.checkpoints_refused), (8, 0));
    assert!(!tmp.exists(), "the cut temp file was not reaped");
}

/// A FIFO at the checkpoint's path is refused without waiting for a writer (the open does
/// not hang), and the tree is walked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fifo_at_the_checkpoint_path_does_not_hang_the_open() {
    let root = temp_root();
    closed_with(root.path(), 5).await;
    let file = checkpoint_file(root.path());
    std::fs::remove_file(&file).unwrap();
    let c = std::ffi::CString::new(file.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let (tx, rx) = std::sync::mpsc::channel();
    let cfg = background_cfg(root.path(), 100, 0.8);
    std::thread::spawn(move || {
        let t = FsTier::open("fs", cfg, ns(), BS).unwrap();
        tx.send(gc_stats(&t)).unwrap();
    });
    let s = rx
        .recv_timeout(SETTLE_LIMIT)
        .expect("the open hung on a FIFO at the checkpoint path");
    assert_eq!((s.checkpoints_refused, s.files), (1, 5), "{s:?}");
}

/// Links learned after a checkpoint (a job that stores blocks the tier has, now with their
/// chain) make the index changed: the next checkpoint holds them, and they survive a
/// restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn links_learned_after_a_checkpoint_are_checkpointed() {
    let root = temp_root();
    let ks = leaf_keys(0..15);
    {
        let tier = open_hand_swept(root.path(), 100, 0.8);
        assert!(fs_store(&tier, &ks, 0).await.is_success());
        age(&tier, &ks, |i| {
            if i == 4 { 400 } else { (15 - i as u64) * 1000 }
        });
        tier.gc_checkpoint_now().unwrap();
        store_chain(&tier, &ks[..5], None).await; // the same blocks, now linked
        assert!(
            tier.gc_checkpoint_now().unwrap(),
            "new links left the index unchanged"
        );
    }
    let tier = FsTier::open("fs", background_cfg(root.path(), 10, 0.8), ns(), BS).unwrap();
    wait_until("the reopened tier swept", SETTLE_LIMIT, || {
        let s = gc_stats(&tier);
        s.reconciled && s.swept_files == 7
    });
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| !(5..12).contains(&i)).collect::<Vec<_>>()
    );
}

/// Promise (README, startup): stray temp files older than `tmp_reap_age_s` are deleted at
/// startup. An open from a checkpoint reaps them in its reconciling walk, as the opening walk
/// would have, however young that is against the rescans' one-minute floor; then the index
/// counts what `du` counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_from_a_checkpoint_reaps_stray_temp_files() {
    let root = temp_root();
    let ks = closed_with(root.path(), 3).await;
    let leaf_tmp = {
        let mut p = ns().block_path(root.path(), &ks[0]).into_os_string();
        p.push("_0123456789abcdef.tmp");
        PathBuf::from(p)
    };
    let rank_tmp = root
        .path()
        .join(ns().rank_dir_name())
        .join("x_0123456789abcdef.tmp");
    for p in [&leaf_tmp, &rank_tmp] {
        std::fs::write(p, vec![1u8; BS]).unwrap();
        let f = std::fs::File::options().write(true).open(p).unwrap();
        f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(30))
            .unwrap();
    }
    let mut c = background_cfg(root.path(), 100, 0.8);
    c.tmp_reap_age_s = 10;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    assert_eq!(gc_stats(&tier).checkpoint_files, 3);
    reconciled(&tier);
    assert!(
        !leaf_tmp.exists() && !rank_tmp.exists(),
        "stray temp files survived"
    );
    assert_eq!(gc_stats(&tier).bytes, du(root.path()));
}
