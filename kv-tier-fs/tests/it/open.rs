//! Opening a root: `config.json` written once, rewritten when damaged, a foreign one refused
//! naming what differs; stray temp files and orphan sidecars reaped by the opening walk (young
//! ones kept); odd mtimes adopted, block sizes past the limit refused.

use std::path::Path;
use std::time::{Duration, SystemTime};

use kv_tier_core::Error;
use kv_tier_fs::{CRC_SIDECAR_SUFFIX, Checksum, FsTier};
use kv_tier_testkit::fixtures::files::Mount;
use kv_tier_testkit::{find_files, temp_root, test_key};

use crate::support::*;

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

#[test]
fn a_damaged_config_json_is_rewritten_and_a_foreign_one_refused_naming_fields() {
    let root = temp_root();
    drop(open(root.path()));
    let path = ns().config_path(root.path());
    for damage in ["", "{\"model_name\": \"m", "\u{0}\u{0}\u{0}", "[1, 2]"] {
        std::fs::write(&path, damage).unwrap();
        let tier = open(root.path());
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

/// A ramfs (no xattrs: checksums go to sidecar files) and an unbounded tier's config on it
/// with CRC32C checksums and temp files reaped at 100 s.
fn sidecars_on_ramfs() -> (Mount, kv_tier_fs::FsTierConfig) {
    let m = Mount::new("ramfs", "");
    let mut c = cfg(&m.dir);
    c.checksum = Checksum::Crc32c;
    c.gc_max_size_gb = None;
    c.tmp_reap_age_s = 100;
    (m, c)
}

/// The checksum sidecar's path of the block file at `p`.
fn sidecar_of(p: &Path) -> std::path::PathBuf {
    let mut s = p.as_os_str().to_os_string();
    s.push(CRC_SIDECAR_SUFFIX);
    std::path::PathBuf::from(s)
}

/// The rank directory's own temp files (an open's capability probe killed mid-way) and
/// sidecars whose block is gone are reaped at open (bounded mode walks the tree) and by
/// rescans: temp files past `tmp_reap_age_s`, orphan sidecars whatever their age (until
/// then the index, which does not count them, was below `du` for up to `tmp_reap_age_s`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probe_temp_files_and_orphan_sidecars_are_reaped_by_walks() {
    let (m, mut c) = sidecars_on_ramfs();
    c.gc_max_size_gb = Some(1.0);
    c.gc_background = false;
    let tier = FsTier::open("fs", c.clone(), ns(), BS).unwrap();
    let ks: Vec<_> = (0..3).map(test_key).collect();
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    drop(tier);
    let rank = rank_dir(&m.dir);
    let probe = rank.join(".kv-tier-probe-0123456789abcdef.tmp");
    std::fs::write(&probe, b"").unwrap();
    set_mtime(&probe, 1000);
    let young = rank.join(".kv-tier-probe-fedcba9876543210.tmp");
    std::fs::write(&young, b"").unwrap();
    // someone else deleted two blocks and left their sidecars behind
    let paths: Vec<_> = ks.iter().map(|k| ns().block_path(&m.dir, k)).collect();
    for p in &paths[..2] {
        std::fs::remove_file(p).unwrap();
    }
    set_mtime(&sidecar_of(&paths[0]), 1000);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    assert!(!probe.exists(), "the probe's temp file survived a reopen");
    assert!(young.exists(), "a young temp file was reaped");
    // orphan sidecars go whatever their age (written before the walk: no block of theirs
    // is on its way)
    assert!(
        !sidecar_of(&paths[0]).exists(),
        "an orphan sidecar survived"
    );
    assert!(
        !sidecar_of(&paths[1]).exists(),
        "a young orphan sidecar survived"
    );
    assert!(
        sidecar_of(&paths[2]).exists(),
        "a live block's sidecar went"
    );
    assert_eq!(tier.stats().sidecars_reaped, 2);
    // a rescan reaps old temp files with the configured age, and orphan sidecars of any age
    set_mtime(&young, 1000);
    let k3 = test_key(3);
    assert!(fs_store(&tier, &[k3], 0).await.is_success());
    let p3 = ns().block_path(&m.dir, &k3);
    std::fs::remove_file(&p3).unwrap();
    tier.gc_rescan_now().unwrap();
    assert!(!young.exists() && !sidecar_of(&p3).exists());
    assert_eq!(tier.stats().sidecars_reaped, 3);
    assert!(load(&tier, &ks[2..]).await.0.is_success());
    assert_eq!(find_files(&m.dir, CRC_SIDECAR_SUFFIX).len(), 1);
}

/// An unbounded tier's open reaps sidecars whose block is gone whatever their age, as a
/// bounded tier's walk does (it waited for `tmp_reap_age_s`, and an unbounded tier never
/// rescans: a sidecar left by another reaper's deletion stayed until a reopen 10 minutes
/// later); a live block's sidecar and a young temp file stay.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unbounded_open_reaps_orphan_sidecars_whatever_their_age() {
    let (m, c) = sidecars_on_ramfs();
    let tier = FsTier::open("fs", c.clone(), ns(), BS).unwrap();
    let ks: Vec<_> = (0..2).map(test_key).collect();
    assert!(fs_store(&tier, &ks, 0).await.is_success());
    drop(tier);
    let young = rank_dir(&m.dir).join(".kv-tier-probe-fedcba9876543210.tmp");
    std::fs::write(&young, b"").unwrap();
    let paths: Vec<_> = ks.iter().map(|k| ns().block_path(&m.dir, k)).collect();
    // another reaper deleted a block just now and left its (young) sidecar behind
    std::fs::remove_file(&paths[0]).unwrap();
    assert!(sidecar_of(&paths[0]).exists());
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    assert!(
        !sidecar_of(&paths[0]).exists(),
        "a young orphan sidecar survived"
    );
    assert!(
        sidecar_of(&paths[1]).exists(),
        "a live block's sidecar went"
    );
    assert!(young.exists(), "a young temp file was reaped");
    assert_eq!(tier.stats().sidecars_reaped, 1);
    assert!(load(&tier, &ks[1..]).await.0.is_success());
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
    assert!(fs_store(&tier, &[k], 0).await.is_success());
    drop(tier);
    let leaf = ns()
        .block_path(root.path(), &k)
        .parent()
        .unwrap()
        .to_path_buf();
    let top = leaf.parent().unwrap().to_path_buf();
    let tmps = [
        rank_dir(root.path()).join("x_0123456789abcdef.tmp"),
        top.join("y_0123456789abcdef.tmp"),
        leaf.join("z_0123456789abcdef.tmp"),
    ];
    for t in &tmps {
        std::fs::write(t, b"partial").unwrap();
        set_mtime(t, 1000);
    }
    let foreign = leaf.join("not-a-block.bin");
    std::fs::write(&foreign, b"someone else's").unwrap();
    let notes = top.join("notes.txt"); // old, but not a temp file
    std::fs::write(&notes, b"someone else's").unwrap();
    set_mtime(&notes, 1000);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    for t in &tmps {
        assert!(!t.exists(), "{} survived", t.display());
    }
    assert_eq!(tier.stats().tmp_reaped, 3);
    assert!(foreign.exists(), "a file that is not a block went");
    assert!(notes.exists(), "an old file that is not a temp file went");
    assert!(load(&tier, &[k]).await.0.is_success());
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
