//! `kv-tier config check`: the effective config printed (defaults filled in, secrets masked)
//! or the field in error named; files that are no config; the far ends of every range; and
//! that it creates and connects nothing.

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::support::*;

#[test]
fn config_check_prints_the_effective_config_or_the_field_in_error() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_config(
        dir.path(),
        "good.json",
        r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536,
            "layout": {"model_name": "org/m", "dtype": "torch.bfloat16", "tokens_per_hash": 16},
            "secondary_tiers": [
              {"type": "fs", "root_dir": "/tmp/kv", "gc_max_size_gb": 10},
              {"type": "obj", "bucket": "b", "endpoint_override": "http://127.0.0.1:9000",
               "access_key": "AK", "secret_key": "SECRET"}]}"#,
    );
    let out = run(&["config", "check", arg(&good), "--json"]);
    assert!(out.success(), "{out:?}");
    let v = json(&out);
    assert_eq!(v["ok"], true);
    let e = &v["effective"];
    assert_eq!(e["job_timeout_s"], 30.0, "a manager default, filled in");
    assert_eq!(
        e["shutdown_timeout_s"], 30.0,
        "a manager default, filled in"
    );
    assert_eq!(e["layout"]["rank"], 0);
    assert_eq!(e["secondary_tiers"][0]["gc_max_size_gb"], 10.0);
    assert_eq!(e["secondary_tiers"][0]["checksum"], "none");
    assert_eq!(e["secondary_tiers"][1]["name"], "obj");
    assert_eq!(
        e["secondary_tiers"][1]["secret_key"], "***",
        "secrets are masked"
    );
    assert_eq!(
        e["secondary_tiers"][1]["probe_budget_s"], 0.005,
        "a remote tier's budget"
    );
    let text = run(&["config", "check", arg(&good)]).stdout;
    assert!(
        !text.contains("SECRET") && text.contains("\"gc_max_size_gb\": 10.0"),
        "{text}"
    );
    for (body, field) in [
        (
            r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536,
                "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv", "gc_low_watermark": 2}]}"#,
            "secondary_tiers[0].gc_low_watermark",
        ),
        (
            r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536, "lease_s": -1}"#,
            "lease_s",
        ),
        (
            r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536,
                "secondary_tiers": [{"type": "tape"}]}"#,
            "secondary_tiers[0].type",
        ),
        (
            r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536, "frobnicate": 1}"#,
            "frobnicate",
        ),
    ] {
        let bad = write_config(dir.path(), "bad.json", body);
        let out = run(&["config", "check", arg(&bad)]);
        assert_eq!(out.code, Some(1));
        let err = &out.stderr;
        assert!(err.contains(field), "{field} not named: {err}");
        let v = json(&run(&["config", "check", arg(&bad), "--json"]));
        assert_eq!(v["ok"], false);
        assert!(v["error"].as_str().unwrap().contains(field));
    }
    let out = run(&["config", "check", "/nonexistent/kv.json"]);
    assert_eq!(out.code, Some(1));
    assert!(out.stderr.contains("/nonexistent/kv.json"));
}

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
        let out = run(&["config", "check", arg(f)]);
        if out.panicked() || out.code != Some(1) || !out.stderr.contains(arg(f)) {
            bad.push(format!("{}: {out:?}", f.display()));
        }
        let out = run(&["config", "check", arg(f), "--json"]);
        let ok_json = serde_json::from_str::<serde_json::Value>(&out.stdout)
            .ok()
            .is_some_and(|v| v["ok"] == false);
        if out.panicked() || out.code != Some(1) || !(ok_json || out.stderr.contains(arg(f))) {
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
    let out = run(&["config", "check", arg(&cfg), "--json"]);
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
    let out = run(&["config", "check", arg(&good), "--json"]);
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
        let out = run(&["config", "check", arg(&p)]);
        assert!(
            !out.panicked() && out.code == Some(1) && out.stderr.contains(field),
            "{body}: {out:?}"
        );
    }
}
