//! Crash safety: a child process storing blocks is killed with SIGKILL at random moments, 50
//! times. Afterwards every `.bin` present loads with exactly the bytes that were stored
//! (checksums on), and reopening the tier reaps the temp files the killed writers left.

use std::process::{Command, Stdio};
use std::time::Duration;

use kv_tier_fs::{Checksum, FsTier};
use kv_tier_testkit::{find_files, temp_root, test_key, verify_block};

use crate::support::*;

/// The child: stores blocks until it is killed. Run only by `killed_writers_leave_only_whole_blocks`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of the crash test"]
async fn crash_child_writer() {
    let (Ok(root), Ok(seed)) = (std::env::var(CRASH_ROOT_ENV), std::env::var(CRASH_SEED_ENV))
    else {
        return;
    };
    let seed: u64 = seed.parse().unwrap();
    let tier = open_checksummed(std::path::Path::new(&root));
    eprintln!("child {seed} ready");
    for batch in 0u64.. {
        let keys: Vec<_> = (0..8)
            .map(|i| test_key(seed << 32 | batch << 8 | i))
            .collect();
        let res = fs_store(&tier, &keys, 0).await;
        assert!(res.is_success(), "{:?}", res.failed);
    }
}

#[test]
fn killed_writers_leave_only_whole_blocks() {
    let root = temp_root();
    drop(open_checksummed(root.path())); // config.json and directories exist before the first kill
    let exe = std::env::current_exe().unwrap();
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for seed in 0..50u64 {
        let mut child = Command::new(&exe)
            .args([
                "crash::crash_child_writer",
                "--exact",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CRASH_ROOT_ENV, root.path())
            .env(CRASH_SEED_ENV, seed.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        std::thread::sleep(Duration::from_millis(20 + rng % 120)); // a random moment to kill
        child.kill().unwrap(); // SIGKILL
        let status = child.wait().unwrap();
        assert!(!status.success(), "child {seed} exited by itself: {status}");
    }
    let bins = find_files(root.path(), ".bin");
    let tmps_before = find_files(root.path(), ".tmp").len();
    assert!(
        bins.len() > 50,
        "the children stored only {} blocks",
        bins.len()
    );
    // Reopen with a zero reap age: every temp file of a killed writer goes.
    let mut c = cfg(root.path());
    c.checksum = Checksum::Crc32c;
    c.tmp_reap_age_s = 0;
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    assert!(find_files(root.path(), ".tmp").is_empty());
    assert_eq!(tier.stats().tmp_reaped as usize, tmps_before);
    let keys: Vec<_> = bins.iter().map(|p| key_of(p)).collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    for chunk in keys.chunks(256) {
        let (res, data) = rt.block_on(load(&tier, chunk));
        assert!(
            res.is_success(),
            "a published block does not load: {:?}",
            res.failed.first()
        );
        for (k, d) in data {
            assert!(
                verify_block(&k, 0, &d),
                "block {k} has bytes that were never stored"
            );
        }
    }
    let s = tier.stats();
    assert_eq!(
        s.blocks.unverified_loads, 0,
        "a published block has no checksum"
    );
    assert_eq!(s.blocks.checksum_mismatches, 0);
    eprintln!(
        "crash test: 50 kills, {} blocks verified, {} temp files reaped",
        keys.len(),
        tmps_before
    );
}
