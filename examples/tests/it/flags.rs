//! The flags: presets set the model's shape, `--help` shows `SimConfig::default()`'s values,
//! bad and conflicting flags are refused with a message naming them (not a panic), and
//! `--config` files that are bad, a FIFO or a directory are refused.

use kv_tier_examples::sim::SimConfig;

use kv_tier_testkit::fixtures::files::mkfifo;

use crate::support::*;

#[test]
fn presets_set_the_model_shape_and_config_refuses_the_tier_flags_it_replaces() {
    let out = bin().args(["--model", "nope"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("qwen3-0.6b") && err.contains("llama-70b"),
        "{err}"
    );
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("kv.json");
    std::fs::write(
        &cfg,
        r#"{"cpu_bytes_to_use": 1048576, "block_size_bytes": 8192}"#,
    )
    .unwrap();
    let out = bin()
        .args(["--dram-mb", "64", "--fs-cap-gb", "1", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--config replaces the tier flags") && err.contains("--dram-mb, --fs-cap-gb"),
        "{err}"
    );
    // the presets' block sizes: 16 tokens of layers x kv heads x head dim x 2 bytes x K,V
    for (name, kib) in [
        ("tiny", 8),
        ("qwen3-0.6b", 1792),
        ("llama-8b", 2048),
        ("llama-70b", 5120),
    ] {
        let p = kv_tier_examples::sim::preset(name).unwrap();
        let cfg = SimConfig {
            layers: p.layers,
            kv_heads: p.kv_heads,
            head_dim: p.head_dim,
            dtype_bytes: p.dtype_bytes,
            ..small(1)
        };
        assert_eq!(cfg.block_bytes(), kib << 10, "{name}");
    }
    assert_eq!(
        SimConfig::default().block_bytes(),
        2 << 20,
        "MiB-sized blocks by default"
    );
}

#[test]
fn bad_flags_and_configs_fail_with_a_message_not_a_panic() {
    for (args, want) in [
        (vec!["--streams"], "a value is required for '--streams"),
        (vec!["--streams", "many"], "not a valid number"),
        (vec!["--frobnicate"], "unexpected argument '--frobnicate'"),
        (vec!["--streams", "0"], "must be 1 to 100000"),
        (vec!["--max-batch", "0"], "must be 1 to 100000"),
        (vec!["--prefixes", "0"], "must be 1 to 1000000"),
        (vec!["--duration", "0"], "must be positive"),
        (vec!["--duration", "-3"], "must be positive"),
        (vec!["--fs-cap-gb", "-1"], "must be 0 (none) or 1e-9 to 1e9"),
        (vec!["--config", "/nonexistent/kv.json"], "--config"),
    ] {
        let out = bin().args(&args).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(
            err.contains(args[0]),
            "the flag is not named: {args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("bad.json");
    std::fs::write(&cfg, r#"{"cpu_bytes_to_use": 1048576, "block_size_bytes": 8192, "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/x", "n_read_threads": 0}]}"#).unwrap();
    let out = bin()
        .args(["--model", "tiny", "--no-progress", "--config"])
        .arg(&cfg)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("secondary_tiers[0].n_read_threads"), "{err}");
}

/// The defaults `--help` shows are `SimConfig::default()`'s.
#[test]
fn help_shows_the_defaults_of_sim_config() {
    let out = bin().arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    let d = SimConfig::default();
    let cap = d.fs_cap_gb.unwrap_or(0.0);
    for (flag, default) in [
        ("--streams", d.streams.to_string()),
        ("--turns", d.turns.to_string()),
        ("--max-batch", d.max_batch.to_string()),
        ("--gpu-cache-blocks", d.gpu_cache_blocks.to_string()),
        ("--tokens-per-block", d.tokens_per_block.to_string()),
        ("--dram-mb", (d.dram_bytes >> 20).to_string()),
        ("--duration", d.duration.as_secs_f64().to_string()),
        ("--fs-cap-gb", cap.to_string()),
        ("--prefill-tokens-per-s", d.prefill_tokens_per_s.to_string()),
        ("--s3-region", d.s3_region.clone()),
    ] {
        let entry = help_entry(&help, flag);
        assert!(
            entry.contains(&format!("[default: {default}]")),
            "{flag}: want the default {default}, help says {entry:?}"
        );
    }
    assert_eq!(d.prefixes, 4 * d.streams, "--help says 4 x streams");
    assert!(help_entry(&help, "--prefixes").contains("4 x streams"));
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
        // a config's tiers are its own: an embedded server would serve nothing
        vec!["--config", cfg, "--s3-embedded"],
        // every instance would write one trace file, and each start a server of its own
        vec![
            "--instances",
            "2",
            "--fs-cap-gb",
            "1",
            "--trace",
            "/tmp/t.jsonl",
        ],
        vec!["--instances", "2", "--fs-cap-gb", "1", "--s3-embedded"],
        vec![
            "--instances",
            "2",
            "--fs-cap-gb",
            "1",
            "--restart-after",
            "5",
        ],
        vec!["--compare-admission", "--trace", "/tmp/t.jsonl"],
        vec!["--restart-at", "5", "--restart-after", "5"],
        vec!["--s3-embedded", "--s3-endpoint", "http://127.0.0.1:1"],
        // no fs tier: none of its flags
        vec!["--no-fs", "--s3-embedded", "--fs-cap-gb", "1"],
        vec!["--no-fs", "--s3-embedded", "--root-dir", "/tmp"],
        // no fs admission to compare
        vec!["--no-fs", "--s3-embedded", "--compare-admission"],
    ] {
        let out = sim(&args, 30);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.all());
        assert_clean_refusal(&out, &[args[0]]);
    }
}

/// `--no-fs` with no obj tier would leave nothing below DRAM: refused, naming the flags
/// that give one.
#[test]
fn no_fs_tier_and_no_obj_tier_is_refused() {
    let mut args = small_args();
    args.push("--no-fs".into());
    let out = sim(&args, 30);
    assert_clean_refusal(&out, &["--no-fs"]);
    assert!(out.stderr.contains("--s3-embedded"), "{}", out.all());
}

#[test]
fn a_config_that_is_a_fifo_does_not_hang() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("kv.json");
    mkfifo(&fifo);
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

/// "DRAM and fs sizes scale with the model's block size unless given": the tiny model's
/// 8 KiB blocks get 512 blocks of DRAM and a 2048-block fs cap, as the default model's 2 MiB
/// blocks get 1 GiB and 4 GiB; given sizes are kept; a workload preset sets the sizes no
/// flag gives.
#[test]
fn sizes_scale_with_the_block_size_unless_given_and_presets_fill_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let json = json.to_str().unwrap();
    let read = || -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
    };
    let out = sim(&with(&["--json", json]), 120);
    assert_eq!(out.code, Some(0), "{}", out.all());
    let v = read();
    let sim_cfg = &v["inputs"]["sim"];
    assert_eq!(sim_cfg["dram_bytes"], 512 * 8192);
    let cap = sim_cfg["fs_cap_gb"].as_f64().unwrap();
    assert!(
        (cap * (1u64 << 30) as f64 - 2048.0 * 8192.0).abs() < 1.0,
        "{cap}"
    );
    assert_eq!(v["model"]["dram_blocks"], 512);
    // the attribution is in the JSON too, and sums to the prompt tokens
    let buckets: u64 = v["attribution"]
        .as_object()
        .expect("a map of buckets")
        .values()
        .map(|n| n.as_u64().unwrap())
        .sum();
    assert_eq!(Some(buckets), v["prompt_tokens"].as_u64());
    let out = sim(
        &with(&[
            "--json",
            json,
            "--dram-mb",
            "3",
            "--fs-cap-gb",
            "0.01",
            "--workload",
            "shared-prompt",
        ]),
        120,
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    let v = read();
    let sim_cfg = &v["inputs"]["sim"];
    assert_eq!(sim_cfg["dram_bytes"], 3 << 20);
    assert_eq!(sim_cfg["fs_cap_gb"], 0.01);
    // small_args gives --streams and --turns; the preset gives the prefix and prompt sizes
    assert_eq!(sim_cfg["streams"], 2);
    assert_eq!(sim_cfg["prefix_tokens"], 2048);
    assert_eq!(sim_cfg["prompt_tokens"], 128);
    assert_eq!(sim_cfg["workload"], "custom (from shared-prompt)");
}

/// `--trace` and `--json` naming one file would have the report overwrite the trace: refused.
#[test]
fn a_trace_and_a_report_in_one_file_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("same.out");
    let f = f.to_str().unwrap();
    let out = sim(&with(&["--trace", f, "--json", f]), 30);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert_clean_refusal(&out, &["--trace", "--json"]);
    let d = dir.path().to_str().unwrap();
    let out = sim(&with(&["--trace", d]), 30);
    assert_eq!(out.code, Some(2), "{}", out.all());
    assert!(out.stderr.contains("is a directory"), "{}", out.all());
}

/// `--config` in vLLM's own shape (no `block_size_bytes`: the engine gives it, here the model
/// shape) runs, its fs tier in the config's directory; serve_sim makes no temporary cache
/// directory of its own then, and says nothing of removing one.
#[test]
fn a_config_in_vllms_shape_runs_in_its_own_directories() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("cache");
    let cfg = dir.path().join("vllm.json");
    std::fs::write(
        &cfg,
        format!(
            r#"{{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1048576,
                "secondary_tiers": [{{"type": "fs", "root_dir": {root:?}}}]}}"#
        ),
    )
    .unwrap();
    // progress on: it is where the removal of a temporary directory would be said
    let mut args = small_args();
    args.retain(|a| a != "--no-progress");
    args.extend(["--config".to_string(), cfg.to_str().unwrap().to_string()]);
    let out = sim(&args, 120);
    assert_ok(&out);
    assert!(
        !out.stderr.contains("temporary cache directory"),
        "{}",
        out.all()
    );
    let blocks = kv_tier_testkit::find_files(&root, ".bin").len();
    assert!(
        blocks > 0,
        "no block in the config's root_dir: {}",
        out.all()
    );
}
