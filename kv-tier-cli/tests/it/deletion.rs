//! What `verify --repair` and `gc` may delete: blocks under ROOT, never a file outside it
//! through a symlink, never the contents of a directory at a block path.

use kv_tier_testkit::find_files;

use crate::support::*;

/// Symlinks inside ROOT pointing outside it (a leaf directory, a block file): gc and verify
/// --repair must not delete anything outside ROOT.
#[test]
fn gc_and_repair_never_touch_files_outside_root_through_symlinks() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let (tier, keys) = write_root(root.path(), 6);
    // key 0's leaf directory moved outside and linked back in
    let b0 = tier.block_path(&keys[0]);
    let leaf = b0.parent().unwrap().to_path_buf();
    let ext_leaf = outside.path().join("leaf");
    copy_dir(&leaf, &ext_leaf);
    std::fs::remove_dir_all(&leaf).unwrap();
    std::os::unix::fs::symlink(&ext_leaf, &leaf).unwrap();
    // key 1's block file replaced by a link to a file outside: a damaged (short) one
    let b1 = tier.block_path(&keys[1]);
    let ext_file = outside.path().join("precious.bin");
    std::fs::write(&ext_file, b"not a block, and not yours").unwrap();
    std::fs::remove_file(&b1).unwrap();
    std::os::unix::fs::symlink(&ext_file, &b1).unwrap();
    // a link to the outside directory itself, named like a rank's prefix directory
    let rank = leaf.parent().unwrap().parent().unwrap().to_path_buf();
    std::os::unix::fs::symlink(outside.path(), rank.join("fff")).unwrap();
    let ext_count = || find_files(outside.path(), "").len();
    let before = ext_count();
    let mut bad = Vec::new();
    for args in [
        vec!["verify", arg(root.path()), "--repair", "--json"],
        vec![
            "gc",
            arg(root.path()),
            "--max-size-gb",
            "1e-12",
            "--low-watermark",
            "1e-9",
        ],
    ] {
        let out = run(&args);
        if out.panicked() || out.timed_out {
            bad.push(format!("{args:?}: {out:?}"));
        }
        let now = ext_count();
        if now != before || !ext_file.exists() {
            bad.push(format!(
                "{args:?} deleted files outside ROOT: {before} -> {now}, precious.bin exists: {}\n{out:?}",
                ext_file.exists()
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// A non-empty directory where a block file goes (someone's files, or a tool's): `verify
/// --repair` and `gc` may treat the path as damage, but must not delete what is inside it
/// recursively (the fs tier removes "a directory ... at the path" as damage; an operator's
/// files inside it are not blocks).
#[test]
fn repair_and_gc_do_not_recursively_delete_a_directory_at_a_block_path() {
    let mut bad = Vec::new();
    for args in [
        vec!["verify", "--repair", "--json"],
        vec![
            "gc",
            "--max-size-gb",
            "1e-12",
            "--low-watermark",
            "1e-9",
            "--json",
        ],
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (tier, keys) = write_root(dir.path(), 3);
        let b = tier.block_path(&keys[0]);
        std::fs::remove_file(&b).unwrap();
        std::fs::create_dir(&b).unwrap();
        std::fs::write(b.join("notes.txt"), b"mine").unwrap();
        let mut a = args.clone();
        a.insert(1, arg(dir.path()));
        let out = run(&a);
        if out.panicked() || !b.join("notes.txt").exists() {
            bad.push(format!(
                "{a:?}: notes.txt inside the directory at a block path exists: {}; {out:?}",
                b.join("notes.txt").exists()
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// Under a namespace whose `config.json` is gone, `verify --repair` and `gc` delete only files
/// at the layout's paths (another program's `a/b/notes.bin`, or a block name in directories its
/// hex does not give, is left alone and reported foreign), and those only with `--force`:
/// without the layout they may not be blocks.
#[test]
fn without_the_layout_only_files_at_block_paths_go_and_only_when_forced() {
    let (dir, tier, keys) = written_root(6);
    let rank = tier.block_path(&keys[0]);
    let rank = rank.parent().unwrap().parent().unwrap().parent().unwrap();
    std::fs::remove_file(root_namespace().config_path(dir.path())).unwrap();
    // damaged (short) files that are not blocks: another program's, a name in the wrong place
    let foreign = [
        rank.join("a/b/notes.bin"),
        rank.join(format!("fff/ff_g0/{}.bin", keys[1].hash_hex())),
    ];
    for f in &foreign {
        std::fs::create_dir_all(f.parent().unwrap()).unwrap();
        std::fs::write(f, b"not a block").unwrap();
    }
    // and a damaged block at its path
    let damaged = tier.block_path(&keys[2]);
    overwrite(&damaged, 0, b"\xff\xff\xff\xff");
    std::fs::File::options()
        .write(true)
        .open(&damaged)
        .unwrap()
        .set_len(100)
        .unwrap();
    let inspect = json(&run(&["inspect", arg(dir.path()), "--json"]));
    let r = &inspect["namespaces"][0]["ranks"][0];
    assert_eq!(
        (r["blocks"].as_u64(), r["foreign_files"].as_u64()),
        (Some(6), Some(2)),
        "{r}"
    );
    // repair: the damaged block is reported and kept; the foreign files are not touched
    let out = run(&["verify", arg(dir.path()), "--repair"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stdout.contains("not removed: no usable config.json") && damaged.exists(),
        "{out:?}"
    );
    let out = run(&["verify", arg(dir.path()), "--repair", "--force"]);
    assert!(out.success(), "{out:?}");
    assert!(!damaged.exists(), "{out:?}");
    // gc: nothing deleted without --force, every block with it, the foreign files kept
    let gc = |force: bool| run(&gc_all(dir.path(), if force { &["--force"] } else { &[] }));
    let out = gc(false);
    assert!(out.success(), "{out:?}");
    assert!(out.stdout.contains("not deleted: 5 blocks"), "{out:?}");
    assert!(
        keys[3..].iter().all(|k| tier.block_path(k).exists()),
        "{out:?}"
    );
    let out = gc(true);
    assert!(out.success(), "{out:?}");
    assert!(keys.iter().all(|k| !tier.block_path(k).exists()), "{out:?}");
    for f in &foreign {
        assert!(f.exists(), "{} deleted: {out:?}", f.display());
    }
}
