//! Adversarial round 32: the `kv-tier` command given what an operator might give it by mistake
//! (or a damaged cache directory gives it). Promises: exit 0 all well, 1 something wrong (with a
//! message naming what), 2 usage error; never a panic (exit 101 or "panicked" on stderr), never
//! a hang, never a change outside ROOT.

use std::ffi::OsStr;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kv_tier::fs::{Checksum, FsTier, FsTierConfig};
use kv_tier::{BlockKey, Namespace, RunFields, SecondaryTier};
use kv_tier_testkit::{store_keys, test_key};

const BS: usize = 16384;

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    timed_out: bool,
}

impl std::fmt::Debug for Out {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit {:?}{}\nstdout: {}\nstderr: {}",
            self.code,
            if self.timed_out {
                " (TIMED OUT, killed)"
            } else {
                ""
            },
            self.stdout.chars().take(2000).collect::<String>(),
            self.stderr.chars().take(2000).collect::<String>()
        )
    }
}

impl Out {
    fn panicked(&self) -> bool {
        self.code == Some(101) || self.code.is_none() || self.stderr.contains("panicked")
    }
}

fn run_os<S: AsRef<OsStr>>(args: &[S], secs: u64) -> Out {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kv-tier"))
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kv-tier runs");
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let t1 = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = so.read_to_end(&mut v);
        v
    });
    let t2 = std::thread::spawn(move || {
        let mut v = Vec::new();
        let _ = se.read_to_end(&mut v);
        v
    });
    let start = Instant::now();
    let mut timed_out = false;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if start.elapsed() > Duration::from_secs(secs) {
            timed_out = true;
            let _ = child.kill();
            break child.wait().unwrap();
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Out {
        code: if timed_out { Some(-1) } else { status.code() },
        stdout: String::from_utf8_lossy(&t1.join().unwrap()).into_owned(),
        stderr: String::from_utf8_lossy(&t2.join().unwrap()).into_owned(),
        timed_out,
    }
}

fn run(args: &[&str]) -> Out {
    run_os(args, 20)
}

fn ns() -> Namespace {
    Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap()
}

/// A root at `dir` written by the fs tier with checksums: `n` blocks, the tier shut down.
fn write_root(dir: &Path, n: u64) -> (FsTier, Vec<BlockKey>) {
    let mut cfg = FsTierConfig::new(dir);
    cfg.checksum = Checksum::Crc32c;
    let tier = FsTier::open("fs", cfg, ns(), BS).unwrap();
    let keys: Vec<BlockKey> = (0..n).map(test_key).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        assert!(store_keys(&tier, &keys, 0, BS).await.is_success());
        tier.shutdown().await.unwrap();
    });
    (tier, keys)
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn mkfifo(p: &Path) {
    let st = Command::new("mkfifo").arg(p).status().unwrap();
    assert!(st.success());
}

fn json(out: &Out) -> serde_json::Value {
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out:?}"))
}

// ------------------------------------------------------------------------------ config check

/// A config file whose name is not UTF-8: `config check --json` prints `{"file": ...}`; the
/// name must not make it panic.
#[test]
fn config_check_json_with_a_non_utf8_file_name() {
    let dir = tempfile::tempdir().unwrap();
    let mut bad = Vec::new();
    for (body, want) in [
        (
            r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536}"#,
            0,
        ),
        (r#"{"cpu_bytes_to_use": 0}"#, 1),
    ] {
        let name = OsStr::from_bytes(b"cfg-\xff\xfe.json");
        let p = dir.path().join(name);
        std::fs::write(&p, body).unwrap();
        for json in [true, false] {
            let mut args = vec![OsStr::new("config"), OsStr::new("check"), p.as_os_str()];
            if json {
                args.push(OsStr::new("--json"));
            }
            let out = run_os(&args, 20);
            if out.panicked() || out.code != Some(want) {
                bad.push(format!("{body} --json={json}: {out:?}"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// Files that are no config: a directory, empty, binary, not UTF-8, `null`, a number too big for
/// JSON, nesting deeper than the parser goes, /dev/null, /proc files. Exit 1 naming the file,
/// `--json` prints ok: false; no panic.
#[test]
fn config_check_on_files_that_are_no_config() {
    let dir = tempfile::tempdir().unwrap();
    let w = |name: &str, body: &[u8]| {
        let p = dir.path().join(name);
        std::fs::write(&p, body).unwrap();
        p
    };
    let mut files = vec![
        dir.path().to_path_buf(),
        w("empty.json", b""),
        w("binary.json", &[0, 159, 146, 150, 0xff, 0]),
        w(
            "latin1.json",
            b"{\"cpu_bytes_to_use\": 4194304, \"x\": \"\xe9\"}",
        ),
        w("null.json", b"null"),
        w("array.json", b"[]"),
        w("big.json", b"{\"cpu_bytes_to_use\": 1e309}"),
        w(
            "deep.json",
            format!("{}{}", "[".repeat(200_000), "]".repeat(200_000)).as_bytes(),
        ),
        w("two.json", b"{\"cpu_bytes_to_use\": 4194304}{}"),
        PathBuf::from("/dev/null"),
        PathBuf::from("/proc/self/status"),
    ];
    files.push(dir.path().join("missing").join("x.json"));
    let mut bad = Vec::new();
    for f in &files {
        let out = run(&["config", "check", s(f)]);
        if out.panicked() || out.code != Some(1) || !out.stderr.contains(s(f)) {
            bad.push(format!("{}: {out:?}", f.display()));
        }
        let out = run(&["config", "check", s(f), "--json"]);
        let ok_json = serde_json::from_str::<serde_json::Value>(&out.stdout)
            .ok()
            .is_some_and(|v| v["ok"] == false);
        if out.panicked() || out.code != Some(1) || !(ok_json || out.stderr.contains(s(f))) {
            bad.push(format!("{} --json: {out:?}", f.display()));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// `config check` creates nothing and connects nowhere: a missing root_dir stays missing and an
/// unreachable endpoint answers at once.
#[test]
fn config_check_creates_and_connects_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("not").join("yet");
    let cfg = dir.path().join("c.json");
    std::fs::write(
        &cfg,
        serde_json::json!({
            "cpu_bytes_to_use": 4194304, "block_size_bytes": 65536,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [
                {"type": "fs", "root_dir": root, "gc_max_size_gb": 1, "shared": true},
                {"type": "obj", "bucket": "b", "endpoint_override": "http://192.0.2.1:9", "request_timeout_s": 3600}
            ]
        })
        .to_string(),
    )
    .unwrap();
    let t = Instant::now();
    let out = run(&["config", "check", s(&cfg), "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert!(!root.exists(), "config check created {}", root.display());
    assert!(!root.parent().unwrap().exists());
}

/// Valid configs at the far ends of every range print their effective config (exit 0); a float
/// in an integer field, a nested object, a duplicated key, an unknown nested key: exit 1 with
/// the field named.
#[test]
fn config_check_extremes() {
    let dir = tempfile::tempdir().unwrap();
    let w = |body: String| {
        let p = dir.path().join("c.json");
        std::fs::write(&p, body).unwrap();
        p
    };
    let good = w(serde_json::json!({
        "cpu_bytes_to_use": u64::MAX, "block_size_bytes": 1u64 << 30,
        "max_tracker_size": 100000000u64, "event_buffer_keys": 10000000000u64,
        "probe_timeout_s": 600, "job_timeout_s": 86400, "job_timeout_per_block_s": 3600,
        "lease_s": 86400, "shutdown_timeout_s": 86400, "write_back_max_dram_fraction": 1,
        "secondary_tiers": [
            {"type": "fs", "root_dir": "/tmp/adv32-never", "gc_max_size_gb": 1e9, "gc_hard_ceiling": 1000,
             "write_back_limit_mb": 1e9, "write_budget_mb_per_s": 1e9, "probe_budget_s": 600},
            {"type": "obj", "name": "o", "bucket": "b", "io_threads": 1024, "max_retries": 100,
             "request_timeout_s": 3600, "max_size_gb": 1e9}
        ]
    })
    .to_string());
    let out = run(&["config", "check", s(&good), "--json"]);
    assert_eq!(out.code, Some(0), "{out:?}");
    let v = json(&out);
    assert_eq!(v["effective"]["cpu_bytes_to_use"], u64::MAX, "{v}");
    for (body, field) in [
        (r#"{"cpu_bytes_to_use": 4194304.0}"#, "cpu_bytes_to_use"),
        (
            r#"{"cpu_bytes_to_use": {"bytes": 4194304}}"#,
            "cpu_bytes_to_use",
        ),
        (
            r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{"type": "fs", "root_dir": "/x", "gc": {"max": 1}}]}"#,
            "secondary_tiers[0].gc",
        ),
        (
            r#"{"cpu_bytes_to_use": 4194304, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": [], "x": 1}]}}"#,
            "layout.kv_cache_groups[0].x",
        ),
    ] {
        let p = w(body.to_string());
        let out = run(&["config", "check", s(&p)]);
        assert!(
            !out.panicked() && out.code == Some(1) && out.stderr.contains(field),
            "{body}: {out:?}"
        );
    }
}

// ------------------------------------------------------------------------------ verify

/// `verify --block-size` 0 or absurdly large is not a block size: a usage error (or a refusal
/// naming it), never a panic, and with `--repair` it must not delete the good blocks.
#[test]
fn verify_with_a_zero_or_huge_block_size_deletes_nothing() {
    let mut bad = Vec::new();
    for bs in [
        "0",
        "18446744073709551615",
        "1099511627776",
        "9223372036854775808",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (tier, keys) = write_root(dir.path(), 4);
        let out = run(&[
            "verify",
            s(dir.path()),
            "--block-size",
            bs,
            "--repair",
            "--json",
        ]);
        let left = keys.iter().filter(|k| tier.block_path(k).exists()).count();
        if out.panicked() || out.timed_out || left != 4 {
            bad.push(format!(
                "--block-size {bs} --repair: {left}/4 blocks left; {out:?}"
            ));
        } else if out.code == Some(0) {
            bad.push(format!(
                "--block-size {bs}: exit 0 (every block checked at that size?) {out:?}"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// Numbers clap refuses: a usage error (exit 2), for every numeric argument.
#[test]
fn malformed_numeric_arguments_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    write_root(dir.path(), 1);
    let r = s(dir.path());
    let mut bad = Vec::new();
    let cases: Vec<Vec<&str>> = vec![
        vec!["verify", r, "--block-size", "-1"],
        vec!["verify", r, "--block-size", "1.5"],
        vec!["verify", r, "--block-size", "nan"],
        vec!["verify", r, "--block-size", "18446744073709551616"],
        vec!["verify", r, "--block-size", ""],
        vec!["gc", r, "--max-size-gb", "1e309"],
        vec!["gc", r, "--max-size-gb", "inf"],
        vec!["gc", r, "--max-size-gb", "NaN"],
        vec!["gc", r, "--max-size-gb", "-0"],
        vec!["gc", r, "--max-size-gb", "0x10"],
        vec!["gc", r, "--max-size-gb", ""],
        vec!["gc", r, "--max-size-gb", "1", "--low-watermark", "nan"],
        vec!["gc", r, "--max-size-gb", "1", "--low-watermark", "-0"],
        vec![
            "gc",
            r,
            "--max-size-gb",
            "1",
            "--low-watermark",
            "1.0000001",
        ],
        vec!["gc", r],
        vec!["s3-server", "--root", r, "--port", "70000"],
        vec!["s3-server", "--root", r, "--port", "-1"],
        vec!["s3-server", "--root", r, "--port", "1.5"],
        vec![
            "s3-server",
            "--root",
            r,
            "--port",
            "0",
            "--host",
            "localhost:1",
        ],
        vec!["inspect"],
        vec!["config", "check"],
        vec!["frobnicate"],
    ];
    for args in &cases {
        let out = run(args);
        if out.code != Some(2) || out.panicked() {
            bad.push(format!("{args:?}: {out:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

// ------------------------------------------------------------------------------ paths

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
            (s(&missing), true),
            (s(&file), true),
            ("/dev/null", true),
            (s(&empty), false),
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

/// A FIFO at one path of a written root (the fs tier's README: "a FIFO at a block, sidecar or
/// config.json path is damage, never a hang"): inspect, verify and gc --dry-run must end.
fn fifo_case(which: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let (tier, keys) = write_root(dir.path(), 4);
    let at = match which {
        "config" => ns().config_path(dir.path()),
        "block" => tier.block_path(&keys[0]),
        _ => PathBuf::from(format!("{}.crc32c", tier.block_path(&keys[1]).display())),
    };
    let _ = std::fs::remove_file(&at);
    mkfifo(&at);
    let mut bad = Vec::new();
    for args in [
        vec!["inspect", s(dir.path()), "--json"],
        vec!["verify", s(dir.path()), "--json"],
        vec![
            "gc",
            s(dir.path()),
            "--max-size-gb",
            "1e-9",
            "--dry-run",
            "--json",
        ],
    ] {
        let out = run_os(&args, 5);
        if out.timed_out || out.panicked() {
            bad.push(format!("FIFO at the {which} path: {args:?}: {out:?}"));
        }
    }
    bad
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
    let ext_count = || walk_files(outside.path()).len();
    let before = ext_count();
    let mut bad = Vec::new();
    for args in [
        vec!["verify", s(root.path()), "--repair", "--json"],
        vec![
            "gc",
            s(root.path()),
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

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

fn walk_files(p: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                out.extend(walk_files(&e.path()));
            } else {
                out.push(e.path());
            }
        }
    }
    out
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
        vec!["inspect", s(root), "--json"],
        vec!["inspect", s(root)],
        vec!["verify", s(root), "--json"],
        vec!["verify", s(root)],
        vec![
            "gc",
            s(root),
            "--max-size-gb",
            "1e-9",
            "--dry-run",
            "--json",
        ],
        vec!["gc", s(root), "--max-size-gb", "1e-9", "--dry-run"],
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

/// gc with caps at the extremes clap lets through: 1e300 GiB (nothing to do), 1e-320 GiB (a
/// subnormal: 0 bytes), --low-watermark 1e-300. No panic; exit 0.
#[test]
fn gc_with_extreme_caps() {
    let mut bad = Vec::new();
    for (cap, low) in [
        ("1e300", "0.9"),
        ("1.7976931348623157e308", "1"),
        ("1e-320", "1e-300"),
        ("4.9e-324", "1"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_root(dir.path(), 3);
        for dry in [true, false] {
            let mut args = vec![
                "gc",
                s(dir.path()),
                "--max-size-gb",
                cap,
                "--low-watermark",
                low,
                "--json",
            ];
            if dry {
                args.push("--dry-run");
            }
            let out = run(&args);
            if out.panicked() || out.code != Some(0) {
                bad.push(format!("{args:?}: {out:?}"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

// ------------------------------------------------------------------------------ s3-server

/// Runs s3-server for up to `secs`; returns its output, killed if still serving.
fn s3_server(args: &[&str], secs: u64) -> Out {
    let mut all = vec!["s3-server"];
    all.extend_from_slice(args);
    run_os(&all, secs)
}

/// s3-server with a root that is a file, /proc, a port already taken, an address not on this
/// host: exit 1 with a message, no panic.
#[test]
fn s3_server_start_failures_are_clean() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let mut bad = Vec::new();
    for args in [
        vec!["--root", s(&file), "--port", "0"],
        vec!["--root", "/proc/self", "--port", "0"],
        vec!["--root", s(dir.path()), "--port", &port],
        vec![
            "--root",
            s(dir.path()),
            "--port",
            "0",
            "--host",
            "203.0.113.7",
        ],
    ] {
        let out = s3_server(&args, 5);
        if out.panicked() || out.timed_out || out.code != Some(1) || out.stderr.trim().is_empty() {
            bad.push(format!("{args:?}: {out:?}"));
        }
    }
    drop(taken);
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// The bucket name becomes a directory under --root ("each subdirectory a bucket"): one with
/// `..` or `/` must be refused, never create or serve a directory outside --root.
#[test]
fn s3_server_bucket_names_cannot_escape_the_root() {
    let parent = tempfile::tempdir().unwrap();
    let root = parent.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let mut bad = Vec::new();
    for (bucket, outside) in [
        ("../escape", parent.path().join("escape")),
        ("..", parent.path().to_path_buf()),
        ("a/b", root.join("a").join("b")),
        ("", root.clone()),
        ("/abs-escape", PathBuf::from("/abs-escape")),
    ] {
        let existed = outside.exists();
        let out = s3_server(&["--root", s(&root), "--port", "0", "--bucket", bucket], 3);
        let created = !existed && outside.exists();
        if out.panicked() && !out.timed_out {
            bad.push(format!("bucket {bucket:?}: {out:?}"));
        } else if out.timed_out || created {
            bad.push(format!(
                "bucket {bucket:?}: accepted and served as {} (created by it: {created}); stderr: {}",
                outside.display(),
                out.stderr.lines().next().unwrap_or("")
            ));
        }
        let _ = std::fs::remove_dir_all("/abs-escape");
        let _ = std::fs::remove_dir_all(parent.path().join("escape"));
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
        a.insert(1, s(dir.path()));
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
