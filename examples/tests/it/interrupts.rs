//! SIGINT and SIGTERM: mid-run or during startup's disk probe, serve_sim stops within 30 s
//! without a panic and leaves a root that `kv-tier verify` and a second run accept, with no
//! stray file.

use std::time::Duration;

use kv_tier_testkit::fixtures::process::finish;
use kv_tier_testkit::wait::poll_until;

use crate::support::*;

#[test]
fn sigint_mid_run_leaves_a_root_that_a_second_run_and_verify_accept() {
    interrupt_mid_run(libc::SIGINT);
}

#[test]
fn sigterm_mid_run_leaves_a_root_that_a_second_run_and_verify_accept() {
    interrupt_mid_run(libc::SIGTERM);
}

#[test]
fn sigint_during_startup_leaves_no_stray_file_in_the_root() {
    // at startup serve_sim writes a 256 MiB O_DIRECT probe file into the root
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let child = spawn(&long_workload(&root));
    let probe = root.join(".kv-tier-disk-probe.tmp");
    // the signal follows within 10 s whether the probe file was seen or not
    let _ = poll_until(Duration::from_secs(10), || probe.exists());
    kill(&child, libc::SIGINT);
    let out = finish(child, Duration::from_secs(15));
    assert!(!out.timed_out, "{}", out.all());
    let second = sim(&fs_workload(&root, "9"), 60);
    assert_ok(&second);
    assert_verifies(&root);
    let stray: Vec<_> = std::fs::read_dir(&root)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .filter(|n| n.to_string_lossy().contains("probe"))
        .collect();
    assert!(
        stray.is_empty(),
        "left in the root after an interrupt and a second run: {stray:?}; first run: {}",
        out.all()
    );
    // the second run measured the disk (the probe file's leftover did not stop it)
    assert!(second.stdout.contains("O_DIRECT"), "{}", second.all());
}
