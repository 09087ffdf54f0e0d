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
    // the most DRAM a config takes: 2^32 - 2 slots of the largest block
    let most = (u64::from(u32::MAX) - 1) << 30;
    let good = w(serde_json::json!({
        "cpu_bytes_to_use": most, "block_size_bytes": 1u64 << 30,
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
    assert_eq!(v["effective"]["cpu_bytes_to_use"], most, "{v}");
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

/// A bounded fs tier's options left out are printed with their defaults and listed as such;
/// an fs tier without a cap, or with one above its filesystem's free space, is valid with a
/// WARN line; what the builder would refuse for a reason the config alone gives
/// (`cpu_bytes_to_use` = 2^64 - 1: more slots than a DRAM tier numbers) is refused naming the
/// field; a device is refused unread, and so is a file too large to be a config.
#[test]
fn config_check_fills_the_defaults_warns_and_refuses_what_the_builder_would() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cache");
    let cfg = |fs: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536,
                "secondary_tiers": [{{"type": "fs", "root_dir": {root:?}{fs}}}]}}"#
        )
    };
    let bounded = write_config(
        dir.path(),
        "bounded.json",
        &cfg(r#", "gc_max_size_gb": 0.001"#),
    );
    let out = run(&["config", "check", arg(&bounded), "--json"]);
    assert!(out.success(), "{out:?}");
    let v = json(&out);
    let fs = &v["effective"]["secondary_tiers"][0];
    for (key, want) in [
        ("gc_grace_s", 300.0),
        ("gc_interval_s", 60.0),
        ("gc_low_watermark", 0.9),
        ("gc_hard_ceiling", 1.05),
        ("gc_stamp_interval_s", 60.0),
        ("gc_rescan_interval_s", 3600.0),
    ] {
        assert_eq!(fs[key].as_f64(), Some(want), "{key}: {fs}");
        let listed = format!("secondary_tiers[0].{key}");
        assert!(
            v["defaults"]
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d == &*listed),
            "{listed} not listed as a default: {v}"
        );
    }
    assert_eq!(fs["gc_max_tracked"], 200_000);
    assert_eq!(v["warnings"].as_array().map(Vec::len), Some(0), "{v}");
    let text = run(&["config", "check", arg(&bounded)]);
    assert!(
        text.stderr.contains("defaults (left out of the file): ") && !text.stderr.contains("WARN"),
        "{text:?}"
    );
    // no cap: valid, warned
    let unbounded = write_config(dir.path(), "unbounded.json", &cfg(""));
    let out = run(&["config", "check", arg(&unbounded)]);
    assert!(out.success(), "{out:?}");
    assert!(
        out.stderr.contains("WARN") && out.stderr.contains("has no cap"),
        "{out:?}"
    );
    // a cap of a PiB: more than any free space here
    let huge = write_config(
        dir.path(),
        "huge.json",
        &cfg(r#", "gc_max_size_gb": 1048576"#),
    );
    let v = json(&run(&["config", "check", arg(&huge), "--json"]));
    let w = v["warnings"][0].as_str().unwrap_or("");
    assert!(w.contains("free on the filesystem"), "{v}");
    // what the builder would refuse, refused by the check
    let max = write_config(
        dir.path(),
        "max.json",
        r#"{"cpu_bytes_to_use": 18446744073709551615, "block_size_bytes": 65536}"#,
    );
    let out = run(&["config", "check", arg(&max)]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains("cpu_bytes_to_use") && out.stderr.contains("slots"),
        "{out:?}"
    );
    // no device, and nothing larger than a config
    let out = run(&["config", "check", "/dev/zero"]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("not a regular file"), "{out:?}");
    let big = dir.path().join("big.json");
    std::fs::File::create(&big)
        .unwrap()
        .set_len(17 << 20)
        .unwrap();
    let out = run(&["config", "check", arg(&big)]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("larger than"), "{out:?}");
}

/// "Every option's effective value, defaults marked": the manager's options and each tier's
/// are listed as defaults exactly when the file leaves them out (an option given by its
/// vLLM alias, or inside vLLM's nested `store_config`, is given), the load-or-recompute
/// options included; a shared obj tier's lease period is filled in; a FIFO is refused
/// unread.
#[test]
fn config_check_marks_every_default_and_nothing_given() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cache");
    let cfg = write_config(
        dir.path(),
        "kv.json",
        &format!(
            r#"{{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536, "lease_s": 12,
            "secondary_tiers": [
              {{"type": "fs", "root_dir": {root:?}, "max_storage_size_gb": 0.001,
                "n_read_threads": 4, "probe_budget_s": 0.01}},
              {{"type": "obj", "store_config": {{"bucket": "b",
                "endpoint_override": "http://127.0.0.1:9"}}, "shared": true,
                "max_size_gb": 1, "io_threads": 8}}]}}"#
        ),
    );
    let out = run(&["config", "check", arg(&cfg), "--json"]);
    assert!(out.success(), "{out:?}");
    let v = json(&out);
    let defaults: Vec<&str> = v["defaults"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    let e = &v["effective"];
    assert_eq!(e["promotion_cut_margin"], 2.0, "{e}");
    assert!(e["prefill_tokens_per_s"].is_null(), "{e}");
    assert_eq!(e["secondary_tiers"][1]["shared_lease_s"], 10.0, "{e}");
    for d in [
        "probe_timeout_s",
        "promotion_cut_margin",
        "prefill_tokens_per_s",
        "secondary_tiers[0].n_write_threads",
        "secondary_tiers[0].gc_grace_s",
        "secondary_tiers[0].write_back_policy",
        "secondary_tiers[1].shared_lease_s",
        "secondary_tiers[1].request_timeout_s",
        "secondary_tiers[1].probe_budget_s",
    ] {
        assert!(defaults.contains(&d), "{d} not listed: {defaults:?}");
    }
    for given in [
        "cpu_bytes_to_use",
        "lease_s",
        "secondary_tiers[0].root_dir",
        "secondary_tiers[0].gc_max_size_gb",
        "secondary_tiers[0].n_read_threads",
        "secondary_tiers[0].probe_budget_s",
        "secondary_tiers[1].bucket",
        "secondary_tiers[1].max_size_gb",
        "secondary_tiers[1].io_threads",
    ] {
        assert!(!defaults.contains(&given), "{given} listed: {defaults:?}");
    }
    let fifo = dir.path().join("fifo.json");
    kv_tier_testkit::fixtures::files::mkfifo(&fifo);
    let out = run_os(&["config", "check", arg(&fifo)], 30);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(out.stderr.contains("not a regular file"), "{out:?}");
}

/// A misspelled key in a tier entry lists the tier type's keys and the keys every tier takes
/// (`probe_budget` is near `probe_budget_s`, which the fs type's own list does not hold); a
/// file that is not JSON says so without naming an empty field.
#[test]
fn a_misspelled_key_lists_every_key_the_entry_takes() {
    let dir = tempfile::tempdir().unwrap();
    let typo = write_config(
        dir.path(),
        "typo.json",
        r#"{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536,
            "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv", "probe_budget": 0.1}]}"#,
    );
    let out = run(&["config", "check", arg(&typo)]);
    assert_eq!(out.code, Some(1), "{out:?}");
    for want in [
        "secondary_tiers[0].probe_budget",
        "`gc_max_size_gb`",
        "`probe_budget_s`",
    ] {
        assert!(out.stderr.contains(want), "{want:?} missing: {out:?}");
    }
    let broken = write_config(dir.path(), "broken.json", "not json at all");
    let out = run(&["config", "check", arg(&broken)]);
    assert_eq!(out.code, Some(1), "{out:?}");
    assert!(
        out.stderr.contains("invalid config: not valid JSON") && !out.stderr.contains("``"),
        "{out:?}"
    );
}
