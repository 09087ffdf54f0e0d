//! Adversarial tests of the `serve_sim` binary (and, for checking roots it leaves, the
//! `kv-tier` CLI binary of kv-tier-cli, which must be built first:
//! `cargo build -j1 -p kv-tier-cli` into the same target dir). Each test runs the built
//! binaries as subprocesses, through their documented interfaces only.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SERVE_SIM: &str = env!("CARGO_BIN_EXE_serve_sim");

/// The `kv-tier` CLI binary, beside serve_sim in the target dir.
fn kv_tier_bin() -> PathBuf {
    let p = Path::new(SERVE_SIM).with_file_name("kv-tier");
    assert!(
        p.exists(),
        "{} missing: run `cargo build -j1 -p kv-tier-cli` with the same CARGO_TARGET_DIR",
        p.display()
    );
    p
}

#[derive(Debug)]
struct Out {
    code: Option<i32>,
    signal: Option<i32>,
    stdout: String,
    stderr: String,
    timed_out: bool,
    secs: f64,
}

impl Out {
    fn all(&self) -> String {
        format!(
            "code {:?} signal {:?} timed_out {} ({:.1} s)\n--- stdout\n{}\n--- stderr\n{}",
            self.code,
            self.signal,
            self.timed_out,
            self.secs,
            self.stdout,
            tail(&self.stderr, 3000)
        )
    }
}

fn tail(s: &str, n: usize) -> &str {
    let mut i = s.len().saturating_sub(n);
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// Waits for `child` at most `timeout`, killing it past that; collects its output.
fn finish(mut child: Child, timeout: Duration) -> Out {
    use std::os::unix::process::ExitStatusExt;
    let start = Instant::now();
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t1 = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = so.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let t2 = std::thread::spawn(move || {
        let mut s = Vec::new();
        let _ = se.read_to_end(&mut s);
        String::from_utf8_lossy(&s).into_owned()
    });
    let mut timed_out = false;
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if start.elapsed() > timeout {
            timed_out = true;
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Out {
        code: status.code(),
        signal: status.signal(),
        stdout: t1.join().unwrap(),
        stderr: t2.join().unwrap(),
        timed_out,
        secs: start.elapsed().as_secs_f64(),
    }
}

fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Child {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(SERVE_SIM);
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SIGINT as a terminal delivers it: a test run started in the background (`cmd &` in a
    // script, as CI may) passes SIGINT ignored on to its children
    // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    cmd.spawn().unwrap()
}

fn sim<S: AsRef<std::ffi::OsStr>>(args: &[S], timeout_s: u64) -> Out {
    finish(spawn(args), Duration::from_secs(timeout_s))
}

/// A small, quick workload (tiny model, 1 MiB of DRAM so the fs tier gets used) without
/// the flags a test may want to give itself.
fn small() -> Vec<String> {
    [
        "--model",
        "tiny",
        "--streams",
        "2",
        "--turns",
        "2",
        "--output-tokens",
        "32",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn with(extra: &[&str]) -> Vec<String> {
    let mut v = small();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// A usage error done right: non-zero, not a panic (101), not killed, no hang, the
/// argument named.
fn assert_clean_refusal(out: &Out, names: &[&str]) {
    assert!(!out.timed_out, "hung: {}", out.all());
    assert!(out.signal.is_none(), "killed by a signal: {}", out.all());
    assert_ne!(out.code, Some(0), "accepted: {}", out.all());
    assert_ne!(out.code, Some(101), "panicked: {}", out.all());
    assert!(!out.stderr.contains("panicked"), "panicked: {}", out.all());
    assert!(
        names.iter().any(|n| out.stderr.contains(n)),
        "the message names none of {names:?}: {}",
        out.all()
    );
}

fn assert_ok(out: &Out) {
    assert!(
        out.code == Some(0) && !out.timed_out,
        "run failed: {}",
        out.all()
    );
    assert!(
        out.stdout.contains(" 0 corrupt"),
        "corrupt blocks: {}",
        out.all()
    );
}

/// A workload that writes to, and reads back from, the fs tier.
fn fs_workload(root: &Path, seed: &str) -> Vec<String> {
    let mut v: Vec<String> = [
        "--model",
        "tiny",
        "--streams",
        "4",
        "--turns",
        "6",
        "--prefix-tokens",
        "512",
        "--prompt-tokens",
        "128",
        "--output-tokens",
        "32",
        "--dram-mb",
        "1",
        "--prefill-tokens-per-s",
        "0",
        "--no-progress",
        "--seed",
        seed,
        "--root-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(root.to_str().unwrap().to_string());
    v
}

fn verify(root: &Path) -> Out {
    let child = Command::new(kv_tier_bin())
        .arg("verify")
        .arg(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(child, Duration::from_secs(60))
}

fn assert_verifies(root: &Path) {
    let v = verify(root);
    assert_eq!(
        v.code,
        Some(0),
        "kv-tier verify {} refused the root: {}",
        root.display(),
        v.all()
    );
    assert!(v.stdout.contains(" 0 damaged"), "{}", v.all());
}

fn kill(child: &Child, sig: i32) {
    // SAFETY: a plain kill(2) of our own child's pid.
    let r = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(r, 0);
}

// ---------------------------------------------------------------------------------------
// Numbers: overflow, huge values, NaN, negatives

#[test]
fn model_dimensions_whose_product_overflows_are_refused_not_a_panic() {
    let out = sim(
        &with(&["--layers", "4294967296", "--kv-heads", "4294967296"]),
        30,
    );
    assert_clean_refusal(&out, &["--layers", "--kv-heads"]);
}

#[test]
fn a_huge_tokens_per_block_is_refused_not_a_panic() {
    let out = sim(&with(&["--tokens-per-block", "18446744073709551615"]), 30);
    assert_clean_refusal(&out, &["--tokens-per-block"]);
}

#[test]
fn a_huge_streams_count_is_refused_not_a_panic() {
    // 4 x streams (the default --prefixes) overflows
    let out = sim(
        &[
            "--model",
            "tiny",
            "--no-progress",
            "--streams",
            "4611686018427387904",
        ],
        30,
    );
    assert_clean_refusal(&out, &["--streams"]);
}

#[test]
fn a_huge_prefix_tokens_is_refused_not_a_panic() {
    let out = sim(&with(&["--prefix-tokens", "18446744073709551615"]), 30);
    assert_clean_refusal(&out, &["--prefix-tokens"]);
}

#[test]
fn a_large_prefix_tokens_is_refused_or_finishes_never_hangs() {
    // 8 prefixes of 10^8 tokens: no documented range; either refused up front or done
    // within 20 s (the run stops admitting turns after --duration 2)
    let out = sim(
        &with(&[
            "--prefix-tokens",
            "100000000",
            "--duration",
            "2",
            "--dram-mb",
            "1",
        ]),
        20,
    );
    assert!(!out.timed_out, "hung past 20 s: {}", out.all());
    assert_ne!(out.code, Some(101), "{}", out.all());
}

#[test]
fn a_huge_turns_count_is_refused_or_cut_by_duration_not_a_panic() {
    let out = sim(
        &[
            "--model",
            "tiny",
            "--no-progress",
            "--streams",
            "2",
            "--dram-mb",
            "1",
            "--turns",
            "18446744073709551615",
            "--duration",
            "2",
        ],
        30,
    );
    assert!(!out.timed_out, "{}", out.all());
    assert_ne!(out.code, Some(101), "panicked: {}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
}

#[test]
fn a_huge_gpu_cache_blocks_is_refused_or_works_not_a_panic() {
    let out = sim(&with(&["--gpu-cache-blocks", "18446744073709551615"]), 30);
    assert!(!out.timed_out, "{}", out.all());
    assert_ne!(out.code, Some(101), "panicked: {}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
}

#[test]
fn a_negative_or_nan_prefill_rate_is_refused() {
    // documented: "Simulated prefill speed of missed tokens (0: none)"; a speed of -1 or
    // NaN tokens/s has no meaning and every number has a range checked up front
    for v in ["-1", "NaN", "inf"] {
        let out = sim(&with(&["--dram-mb", "1", "--prefill-tokens-per-s", v]), 30);
        assert_clean_refusal(&out, &["--prefill-tokens-per-s"]);
    }
    // clap takes "-inf" for a flag of its own (not a number): refused, a usage error
    let out = sim(
        &with(&["--dram-mb", "1", "--prefill-tokens-per-s", "-inf"]),
        30,
    );
    assert_clean_refusal(&out, &["unexpected argument"]);
    assert_eq!(out.code, Some(2), "{}", out.all());
}

#[test]
fn a_dram_size_that_wraps_around_is_refused_as_too_large() {
    // 2^44 MiB = 2^64 bytes: `<< 20` wraps to 0; the user asked for a huge size, not 0
    let out = sim(&with(&["--dram-mb", "17592186044416"]), 30);
    assert_clean_refusal(&out, &["--dram-mb"]);
    assert!(
        !out.stderr.contains("must be positive"),
        "a huge --dram-mb is reported as not positive: {}",
        out.all()
    );
}

#[test]
fn a_zero_dram_size_names_the_flag() {
    let out = sim(&with(&["--dram-mb", "0"]), 30);
    assert_clean_refusal(&out, &["--dram-mb"]);
}

#[test]
fn an_out_of_range_fs_cap_names_the_flag() {
    for v in ["1e-12", "1e300"] {
        let out = sim(&with(&["--dram-mb", "1", "--fs-cap-gb", v]), 30);
        assert_clean_refusal(&out, &["--fs-cap-gb"]);
    }
}

#[test]
fn non_numbers_negatives_and_missing_values_are_usage_errors() {
    for args in [
        vec!["--turns", "1.5"],
        vec!["--seed", "x"],
        vec!["--dram-mb", "1e3"],
        vec!["--gpu-cache-blocks", "18446744073709551616"],
        vec!["--fs-cap-gb", "NaN"],
        vec!["--fs-write-budget-mb-per-s", "0"],
        vec!["--fs-write-budget-mb-per-s", "abc"],
        vec!["--duration", "NaN"],
        vec!["--duration", "1e30"],
        vec!["--instances", "0"],
        vec!["--metrics-addr", "not-an-addr"],
        vec!["--json"],
        vec!["--root-dir"],
    ] {
        let out = sim(&args, 30);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.all());
        assert_clean_refusal(&out, &[args[0]]);
    }
}

#[test]
fn a_negative_count_is_refused_naming_the_flag() {
    // clap reads "-1" as an unknown flag: "unexpected argument '-1' found", naming no flag
    for args in [
        vec!["--turns", "-1"],
        vec!["--seed", "-1"],
        vec!["--dram-mb", "-1"],
        vec!["--gpu-cache-blocks", "-1"],
    ] {
        let out = sim(&args, 30);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.all());
        assert_clean_refusal(&out, &[args[0]]);
    }
}

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
fn conflicting_flags_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kv.json");
    std::fs::write(
        &cfg,
        r#"{"cpu_bytes_to_use": 1048576, "block_size_bytes": 8192}"#,
    )
    .unwrap();
    let cfg = cfg.to_str().unwrap();
    for args in [
        vec!["--instances", "2", "--config", cfg],
        vec!["--instances", "2", "--sync-steps", "--fs-cap-gb", "1"],
        vec!["--compare-admission", "--root-dir", "/tmp"],
        vec!["--config", cfg, "--s3-endpoint", "http://127.0.0.1:1"],
    ] {
        let out = sim(&args, 30);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.all());
        assert_clean_refusal(&out, &[args[0]]);
    }
}

#[test]
fn a_zero_token_workload_is_refused_or_reports_without_nan() {
    let out = sim(
        &with(&[
            "--dram-mb",
            "1",
            "--prefix-tokens",
            "0",
            "--prompt-tokens",
            "0",
            "--output-tokens",
            "0",
        ]),
        30,
    );
    assert!(!out.timed_out && out.code != Some(101), "{}", out.all());
    if out.code == Some(0) {
        for bad in ["NaN", "inf"] {
            assert!(!out.stdout.contains(bad), "{bad} printed: {}", out.all());
        }
    }
}

#[test]
fn instances_with_the_largest_seed_do_not_overflow() {
    // documented: "seeds seed..seed+N-1"; u64::MAX + 1 overflows
    let dir = tempfile::tempdir().unwrap();
    let out = sim(
        &[
            "--instances",
            "2",
            "--model",
            "tiny",
            "--streams",
            "2",
            "--turns",
            "2",
            "--dram-mb",
            "1",
            "--fs-cap-gb",
            "0.01",
            "--prefill-tokens-per-s",
            "0",
            "--no-progress",
            "--seed",
            "18446744073709551615",
            "--root-dir",
            dir.path().join("shared").to_str().unwrap(),
        ],
        60,
    );
    assert!(!out.timed_out, "{}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
    assert_ne!(out.code, Some(101), "{}", out.all());
    if out.code != Some(0) {
        assert_clean_refusal(&out, &["--seed"]);
    }
}

// ---------------------------------------------------------------------------------------
// Paths

#[test]
fn a_config_that_is_a_fifo_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kv.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a NUL-terminated path
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let out = sim(
        &[
            "--model",
            "tiny",
            "--no-progress",
            "--config",
            fifo.to_str().unwrap(),
        ],
        15,
    );
    assert_clean_refusal(&out, &["--config"]);
}

#[test]
fn a_config_that_is_a_directory_is_refused_naming_config() {
    let dir = tempfile::tempdir().unwrap();
    let out = sim(&["--config", dir.path().to_str().unwrap()], 30);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_clean_refusal(&out, &["--config"]);
}

#[test]
fn an_unwritable_json_path_is_refused_before_the_run() {
    // house rule: every argument is checked up front, not after a (long) run
    let dir = tempfile::tempdir().unwrap();
    for path in [
        dir.path().join("no/such/dir/report.json"),
        dir.path().to_path_buf(), // a directory
    ] {
        let out = sim(
            &with(&["--dram-mb", "1", "--json", path.to_str().unwrap()]),
            30,
        );
        assert_clean_refusal(&out, &["--json"]);
        assert!(
            !out.stdout.contains("serve_sim report"),
            "the run went ahead before --json was found unwritable: {}",
            out.all()
        );
    }
}

#[test]
fn a_json_path_that_is_a_fifo_without_reader_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("report.json");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: mkfifo on a NUL-terminated path
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
    let out = sim(
        &with(&["--dram-mb", "1", "--json", fifo.to_str().unwrap()]),
        20,
    );
    assert!(
        !out.timed_out,
        "hung writing --json to a FIFO: {}",
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

// ---------------------------------------------------------------------------------------
// Interrupts

/// A run long enough to interrupt: many turns, stopping after `--duration 20`.
fn long_workload(root: &Path) -> Vec<String> {
    let mut v = fs_workload(root, "9");
    let i = v.iter().position(|a| a == "--turns").unwrap();
    v[i + 1] = "100000".into();
    v.extend(["--duration".to_string(), "90".to_string()]);
    v
}

/// Bytes of the .bin files under `root`.
fn blocks_under(root: &Path) -> usize {
    fn walk(p: &Path, n: &mut usize) {
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                let path = e.path();
                if path.is_dir() {
                    walk(&path, n);
                } else if path.extension().is_some_and(|x| x == "bin") {
                    *n += 1;
                }
            }
        }
    }
    let mut n = 0;
    walk(root, &mut n);
    n
}

fn interrupt_mid_run(sig: i32) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let child = spawn(&long_workload(&root));
    let start = Instant::now();
    while blocks_under(&root) < 50 && start.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(blocks_under(&root) >= 50, "no blocks written to interrupt");
    std::thread::sleep(Duration::from_millis(500));
    kill(&child, sig);
    let t = Instant::now();
    let out = finish(child, Duration::from_secs(30));
    assert!(
        !out.timed_out,
        "did not stop within 30 s of the signal: {}",
        out.all()
    );
    assert_ne!(out.code, Some(101), "panicked on the signal: {}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
    eprintln!(
        "stopped {:.1} s after the signal: {:?}/{:?}",
        t.elapsed().as_secs_f64(),
        out.code,
        out.signal
    );
    assert_verifies(&root);
    // a second run on the root accepts it, with no corrupt blocks
    let out = sim(&fs_workload(&root, "9"), 60);
    assert_ok(&out);
    assert_verifies(&root);
}

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
    let start = Instant::now();
    while !probe.exists() && start.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
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

// ---------------------------------------------------------------------------------------
// Output

#[test]
fn a_run_of_several_seconds_prints_progress_on_stderr() {
    // house rule: long runs print progress (here stderr is a pipe, as in CI or a log)
    let dir = tempfile::tempdir().unwrap();
    let mut args = long_workload(&dir.path().join("root"));
    args.retain(|a| a != "--no-progress");
    let i = args.iter().position(|a| a == "--duration").unwrap();
    args[i + 1] = "6".into();
    let out = sim(&args, 60);
    assert_eq!(out.code, Some(0), "{}", out.all());
    let lines = out.stderr.lines().count();
    assert!(
        lines >= 3 && out.stderr.contains(" requests, "),
        "a {:.0} s run printed no progress on stderr ({lines} lines): {}",
        out.secs,
        out.all()
    );
}

/// The first number after `label` in `text`'s line that starts with it.
fn figure(text: &str, label: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("{label} not in\n{text}"));
    let rest = &line.trim_start()[label.len()..];
    rest.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .find(|w| !w.is_empty())
        .unwrap()
        .parse()
        .unwrap()
}

#[test]
fn json_report_parses_and_agrees_with_the_text_and_itself() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let mut args = fs_workload(&dir.path().join("root"), "2");
    args.extend([
        "--fs-cap-gb".to_string(),
        "0.002".to_string(),
        "--json".to_string(),
        json.to_str().unwrap().to_string(),
    ]);
    let out = sim(&args, 60);
    assert_ok(&out);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let t = &out.stdout;
    let u = |k: &str| {
        v[k].as_u64()
            .unwrap_or_else(|| panic!("{k} missing or not a count: {v:#}"))
    };
    assert_eq!(figure(t, "requests") as u64, u("requests"));
    assert_eq!(figure(t, "prompt tokens") as u64, u("prompt_tokens"));
    assert_eq!(
        figure(t, "from GPU cache") as u64,
        u("tokens_from_gpu_cache")
    );
    assert_eq!(figure(t, "from DRAM") as u64, u("tokens_from_dram"));
    assert_eq!(figure(t, "recomputed") as u64, u("tokens_recomputed"));
    assert_eq!(figure(t, "lookups") as u64, u("lookups"));
    assert_eq!(figure(t, "verified blocks") as u64, u("blocks_verified"));
    assert_eq!(u("blocks_corrupt"), 0);
    assert!(u("lookup_hits") <= u("lookups"));
    assert_eq!(
        u("lookups"),
        u("lookup_hits") + u("lookup_hits_pending") + u("lookup_retries") + u("lookup_misses")
    );
    assert_eq!(
        u("prompt_tokens"),
        u("tokens_from_gpu_cache")
            + u("tokens_from_dram")
            + u("tokens_from_secondary")
            + u("tokens_recomputed")
    );
    assert!(u("requests") <= u("requests_planned"));
    let hr = v["hit_rate"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&hr), "{hr}");
    assert!(
        (figure(t, "hit rate") - 100.0 * hr).abs() < 0.06,
        "text hit rate vs json {hr}"
    );
    assert!(v["ideal_hit_rate"].as_f64().unwrap() + 1e-9 >= hr);
    // the GC figures against the cap
    let gc = &v["gc"];
    let cap = gc["cap_bytes"].as_u64().unwrap();
    let peak = gc["peak_bytes"].as_u64().unwrap();
    let cap_want = (0.002 * (1u64 << 30) as f64) as u64;
    assert!(
        cap.abs_diff(cap_want) < 4096,
        "cap {cap} vs --fs-cap-gb 0.002 = {cap_want}"
    );
    assert!(peak >= gc["bytes"].as_u64().unwrap(), "peak < end: {gc}");
    assert!(
        t.contains(&format!(
            "{:.3} GiB ({:.2}x)",
            peak as f64 / (1u64 << 30) as f64,
            peak as f64 / cap as f64
        )),
        "the text's peak differs from the json's {peak}/{cap}:\n{t}"
    );
    for tier in v["tiers"].as_array().unwrap() {
        assert_eq!(tier["store_failures"], 0, "{tier}");
    }
}

#[test]
fn metrics_addr_already_in_use_fails_cleanly() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let out = sim(&with(&["--dram-mb", "1", "--metrics-addr", &addr]), 30);
    assert_clean_refusal(&out, &["--metrics-addr", "metrics", &addr]);
}

// ---------------------------------------------------------------------------------------
// S3 and the README's commands

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct S3 {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for S3 {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `kv-tier s3-server --root DIR --port P` as the README gives it (on a free port rather
/// than 9000, which another run on this machine may hold).
fn s3_server() -> S3 {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let child = Command::new(kv_tier_bin())
        .args(["s3-server", "--root"])
        .arg(dir.path().join("s3"))
        .args(["--port", &port.to_string()])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let start = Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "s3-server did not listen"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    S3 {
        child,
        port,
        _dir: dir,
    }
}

#[test]
fn the_readme_s3_commands_run_as_written() {
    let s3 = s3_server();
    let endpoint = format!("http://127.0.0.1:{}", s3.port);
    let mut args: Vec<String> = [
        "--s3-endpoint",
        &endpoint,
        "--s3-bucket",
        "kv-cache",
        "--s3-access-key",
        "kv-tier-test-access",
        "--s3-secret-key",
        "kv-tier-test-secret-0123456789",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // short-run flags
    args.extend(with(&[
        "--dram-mb",
        "1",
        "--prefill-tokens-per-s",
        "0",
        "--fs-cap-gb",
        "0.001",
    ]));
    let out = sim(&args, 60);
    assert_ok(&out);
    assert!(out.stdout.contains("tier obj"), "{}", out.all());
}

#[test]
fn an_s3_endpoint_that_is_not_a_url_is_refused_naming_it() {
    let out = sim(
        &with(&[
            "--dram-mb",
            "1",
            "--s3-endpoint",
            "not a url",
            "--s3-access-key",
            "a",
            "--s3-secret-key",
            "b",
        ]),
        30,
    );
    assert_clean_refusal(&out, &["--s3-endpoint", "endpoint"]);
}

#[test]
fn an_s3_endpoint_nobody_listens_on_fails_or_runs_without_hanging() {
    // no keys: "[default: the AWS credential chain]"
    let port = free_port();
    let out = sim(
        &with(&[
            "--dram-mb",
            "1",
            "--prefill-tokens-per-s",
            "0",
            "--s3-endpoint",
            &format!("http://127.0.0.1:{port}"),
        ]),
        30,
    );
    assert!(!out.timed_out, "hung: {}", out.all());
    assert_ne!(out.code, Some(101), "{}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
}

#[test]
fn an_s3_bucket_name_that_is_a_path_is_refused_naming_it() {
    let s3 = s3_server();
    let endpoint = format!("http://127.0.0.1:{}", s3.port);
    for bucket in ["..", "a/../../b", ""] {
        let out = sim(
            &with(&[
                "--dram-mb",
                "1",
                "--s3-endpoint",
                &endpoint,
                "--s3-bucket",
                bucket,
                "--s3-access-key",
                "kv-tier-test-access",
                "--s3-secret-key",
                "kv-tier-test-secret-0123456789",
            ]),
            30,
        );
        assert_clean_refusal(&out, &["--s3-bucket", "bucket"]);
    }
}

#[test]
fn instances_on_one_root_share_it_and_leave_it_valid() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("shared");
    let json = dir.path().join("i.json");
    let out = sim(
        &[
            "--instances",
            "2",
            "--model",
            "tiny",
            "--streams",
            "2",
            "--turns",
            "4",
            "--dram-mb",
            "1",
            "--fs-cap-gb",
            "0.003",
            "--prefill-tokens-per-s",
            "0",
            "--duration",
            "10",
            "--root-dir",
            root.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ],
        60,
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["blocks_corrupt"], 0);
    let (peak, cap) = (
        v["peak_bytes"].as_u64().unwrap(),
        v["cap_bytes"].as_u64().unwrap(),
    );
    assert!(peak as f64 <= 1.10 * cap as f64, "peak {peak} cap {cap}");
    assert_verifies(&root);
}

#[test]
fn the_readme_default_run_prints_what_the_readme_promises_and_cleans_up() {
    // README: `cargo run --release -p kv-tier-examples --bin serve_sim` (here the debug
    // binary, cut short with --duration 5)
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let scratch = tmp.path().join("tmp");
    std::fs::create_dir(&scratch).unwrap();
    let child = Command::new(SERVE_SIM)
        .args(["--duration", "5", "--no-progress", "--json"])
        .arg(&json)
        .env("TMPDIR", &scratch)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = finish(child, Duration::from_secs(90));
    assert_ok(&out);
    for want in [
        "llama-8b (2048 KiB blocks of 16 tokens)",
        "an unbounded cache",
        "O_DIRECT",
        "p50",
        "p99",
        "failed loads",
        "failed stores",
        "late answers",
        "writes dropped",
        "fs GC",
        "allocated at the end",
        "4.00 GiB cap",
        "peak",
        "events",
        "prefill time saved",
        "draining",
    ] {
        assert!(out.stdout.contains(want), "{want:?} missing: {}", out.all());
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["blocks_corrupt"], 0);
    assert!(v["lookup_hits"].as_u64().unwrap() <= v["lookups"].as_u64().unwrap());
    let left: Vec<_> = std::fs::read_dir(&scratch)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "temp cache dir not removed: {left:?}");
}
