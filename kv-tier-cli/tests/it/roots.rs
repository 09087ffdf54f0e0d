//! inspect, verify and gc on roots that are no clean cache directory: a missing path, a file,
//! /dev/null, an empty directory, a FIFO at a config, block or sidecar path, a root damaged
//! every way at once, a root whose own path is not UTF-8. Exit 1 naming the path, or a report;
//! never a panic, never a hang.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use crate::support::*;

/// inspect, verify and gc given a missing path, a regular file, /dev/null: exit 1 naming the path.
/// Given an empty directory: no panic, exit 0 or 1.
#[test]
fn commands_on_paths_that_are_no_cache_directory() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let missing = dir.path().join("missing");
    let mut bad = Vec::new();
    for cmd in [
        vec!["inspect"],
        vec!["verify"],
        vec!["verify", "--repair"],
        vec!["gc", "--max-size-gb", "1e-9"],
    ] {
        for (p, must_fail) in [
            (arg(&missing), true),
            (arg(&file), true),
            ("/dev/null", true),
            (arg(&empty), false),
        ] {
            for json in [false, true] {
                let mut args = cmd.clone();
                args.insert(1, p);
                if json {
                    args.push("--json");
                }
                let out = run(&args);
                let named = out.stderr.contains(p) || out.stdout.contains(p);
                if out.panicked() || (must_fail && (out.code != Some(1) || !named)) {
                    bad.push(format!("{args:?}: {out:?}"));
                }
            }
        }
    }
    assert!(file.exists(), "a file given as ROOT was removed");
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

#[test]
fn a_fifo_config_json_never_hangs_the_commands() {
    let bad = fifo_case("config");
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

#[test]
fn a_fifo_block_file_never_hangs_the_commands() {
    let bad = fifo_case("block");
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

#[test]
fn a_fifo_sidecar_never_hangs_the_commands() {
    let bad = fifo_case("sidecar");
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// A root damaged every way at once: garbage and directory `config.json`s, a file where a rank
/// directory goes, a 1 TiB sparse block, an empty block, non-UTF-8 names, a leaf directory
/// named like a block. inspect, verify (no --repair: nothing removed) and gc --dry-run finish
/// with exit 0 or 1, valid JSON, no panic.
#[test]
fn a_garbage_root_is_reported_not_crashed_on() {
    let dir = tempfile::tempdir().unwrap();
    let (tier, keys) = write_root(dir.path(), 6);
    let root = dir.path();
    // another namespace with garbage config.json
    let ns2 = root.join("org_other_0123456789ab");
    std::fs::create_dir_all(ns2.join("org_other_0123456789ab_r0")).unwrap();
    std::fs::write(ns2.join("config.json"), [0xffu8, 0, 1, 2]).unwrap();
    // a namespace whose config.json is a directory
    let ns3 = root.join("org_dir_0123456789ab");
    std::fs::create_dir_all(ns3.join("config.json")).unwrap();
    // a file where a rank directory would be
    std::fs::write(ns2.join("org_other_0123456789ab_r1"), b"file").unwrap();
    // a 1 TiB sparse block, an empty one
    let huge = tier.block_path(&keys[0]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&huge)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    let empty = tier.block_path(&keys[1]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&empty)
        .unwrap()
        .set_len(0)
        .unwrap();
    // a non-UTF-8 file and directory in the leaf and rank directories
    let leaf = tier.block_path(&keys[2]).parent().unwrap().to_path_buf();
    std::fs::write(leaf.join(OsStr::from_bytes(b"\xff\xfe.bin")), b"x").unwrap();
    let rank = leaf.parent().unwrap().parent().unwrap().to_path_buf();
    std::fs::create_dir_all(rank.join(OsStr::from_bytes(b"\xff\xfe")).join("ab_g0")).unwrap();
    // a directory named like a block
    let b3 = tier.block_path(&keys[3]);
    std::fs::remove_file(&b3).unwrap();
    std::fs::create_dir(&b3).unwrap();
    // a stray file at the top
    std::fs::write(root.join("README"), b"hello").unwrap();
    let mut bad = Vec::new();
    for args in [
        vec!["inspect", arg(root), "--json"],
        vec!["inspect", arg(root)],
        vec!["verify", arg(root), "--json"],
        vec!["verify", arg(root)],
        vec![
            "gc",
            arg(root),
            "--max-size-gb",
            "1e-9",
            "--dry-run",
            "--json",
        ],
        vec!["gc", arg(root), "--max-size-gb", "1e-9", "--dry-run"],
    ] {
        let out = run(&args);
        let is_json = args.contains(&"--json");
        let parses = !is_json || serde_json::from_str::<serde_json::Value>(&out.stdout).is_ok();
        if out.panicked() || out.timed_out || !matches!(out.code, Some(0 | 1)) || !parses {
            bad.push(format!("{args:?}: {out:?}"));
        }
    }
    assert!(
        huge.exists() && empty.exists() && b3.exists(),
        "a command without --repair or with --dry-run removed something"
    );
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// ROOT's own path is not UTF-8: `--json` output carries paths; it must not panic.
#[test]
fn json_output_with_a_non_utf8_root() {
    let parent = tempfile::tempdir().unwrap();
    let root = parent.path().join(OsStr::from_bytes(b"root-\xff"));
    std::fs::create_dir(&root).unwrap();
    let (tier, keys) = write_root(&root, 4);
    // one damaged block, so verify lists it
    std::fs::OpenOptions::new()
        .write(true)
        .open(tier.block_path(&keys[0]))
        .unwrap()
        .set_len(5)
        .unwrap();
    let mut bad = Vec::new();
    for args in [
        vec![
            OsStr::new("inspect"),
            root.as_os_str(),
            OsStr::new("--json"),
        ],
        vec![OsStr::new("verify"), root.as_os_str(), OsStr::new("--json")],
        vec![
            OsStr::new("gc"),
            root.as_os_str(),
            OsStr::new("--max-size-gb"),
            OsStr::new("1e-9"),
            OsStr::new("--dry-run"),
            OsStr::new("--json"),
        ],
        vec![OsStr::new("verify"), root.as_os_str()],
    ] {
        let out = run_os(&args, 20);
        if out.panicked() || out.timed_out {
            bad.push(format!("{args:?}: {out:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}
