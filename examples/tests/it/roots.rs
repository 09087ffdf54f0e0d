//! `--root-dir`: a file (or a path under one) refused; a root another block size or another
//! model used refused or kept valid; two runs at once on one root; a disk probe's leftover
//! file does not drop the disk figures.

use std::time::Duration;

use kv_tier_testkit::fixtures::process::finish;

use crate::support::*;

#[test]
fn a_leftover_disk_probe_file_does_not_silently_drop_the_disk_figures() {
    // what an interrupt during the startup disk probe leaves in --root-dir
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    std::fs::write(root.join(".kv-tier-disk-probe.tmp"), b"").unwrap();
    let out = sim(&fs_workload(&root, "1"), 60);
    assert_ok(&out);
    assert!(
        out.stdout.contains("O_DIRECT"),
        "no disk figures (README: 'GB/s per tier next to the disk's'): {}",
        out.all()
    );
}

#[test]
fn a_root_dir_that_is_a_file_or_under_a_file_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("afile");
    std::fs::write(&file, b"x").unwrap();
    for root in [file.clone(), file.join("sub")] {
        let out = sim(
            &with(&["--dram-mb", "1", "--root-dir", root.to_str().unwrap()]),
            30,
        );
        assert_clean_refusal(&out, &["--root-dir", "root_dir"]);
    }
}

#[test]
fn a_root_used_with_another_block_size_is_refused_or_stays_valid() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    assert_ok(&sim(&fs_workload(&root, "1"), 60));
    assert_verifies(&root);
    // the same model with 2 layers: 16 KiB blocks in a root of 8 KiB blocks
    let mut args = fs_workload(&root, "1");
    args.extend(["--layers".to_string(), "2".to_string()]);
    let out = sim(&args, 60);
    if out.code == Some(0) {
        assert_ok(&out);
        assert_verifies(&root);
    } else {
        assert_clean_refusal(&out, &["block", "--root-dir", "root_dir"]);
        assert_verifies(&root);
    }
}

#[test]
fn a_root_used_by_another_model_is_refused_or_stays_valid() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    assert_ok(&sim(&fs_workload(&root, "1"), 60));
    // qwen3-0.6b: 1.75 MiB blocks, needs more DRAM; --dram-mb given twice is refused, so
    // build the args anew
    let args: Vec<String> = [
        "--model",
        "qwen3-0.6b",
        "--streams",
        "2",
        "--turns",
        "3",
        "--prefix-tokens",
        "256",
        "--prompt-tokens",
        "128",
        "--output-tokens",
        "32",
        "--dram-mb",
        "64",
        "--prefill-tokens-per-s",
        "0",
        "--no-progress",
        "--root-dir",
        root.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let out = sim(&args, 60);
    if out.code == Some(0) {
        assert_ok(&out);
    } else {
        assert_clean_refusal(&out, &["block", "model", "--root-dir", "root_dir"]);
    }
    assert_verifies(&root);
}

#[test]
fn two_runs_at_once_on_one_root_both_work_or_one_refuses_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let a = spawn(&fs_workload(&root, "3"));
    let b = spawn(&fs_workload(&root, "4"));
    let (a, b) = (
        finish(a, Duration::from_secs(60)),
        finish(b, Duration::from_secs(60)),
    );
    let mut worked = 0;
    for o in [&a, &b] {
        assert!(!o.timed_out, "{}", o.all());
        if o.code == Some(0) {
            assert_ok(o);
            worked += 1;
        } else {
            assert_clean_refusal(o, &["--root-dir", "root_dir", "in use", "lock"]);
        }
    }
    assert!(worked >= 1, "neither run worked:\n{}\n{}", a.all(), b.all());
    assert_verifies(&root);
}
