//! A short serve_sim scenario, its report checked for consistency; the binary's flags,
//! `--json` and error handling.

use std::process::Command;

use kv_tier_testkit::s3;

use kv_tier_examples::sim::{Report, SimConfig, ideal_hit_rate, run};

fn small(seed: u64) -> SimConfig {
    SimConfig {
        streams: 4,
        turns: 3,
        prefixes: 4,
        prefix_tokens: 512,
        prompt_tokens: 256,
        output_tokens: 64,
        tokens_per_block: 16,
        model: "tiny".into(),
        layers: 1,
        kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
        gpu_cache_blocks: 16,
        max_batch: 4,
        prefill_tokens_per_s: 0.0,
        duration: std::time::Duration::from_secs(60),
        seed,
        dram_bytes: 1 << 20, // 128 blocks of 8 KiB: the fs tier gets the rest
        root_dir: None,
        fs_cap_gb: None,
        fs_admit_after_lookups: 0,
        fs_write_budget_mb_per_s: None,
        config_json: None,
        s3_endpoint: None,
        s3_bucket: String::new(),
        s3_access_key: String::new(),
        s3_secret_key: String::new(),
        s3_region: String::new(),
        fs_gc_interval_s: 0.01,
        fs_gc_stamp_s: 0.000_001,
        fs_gc_grace_s: 0.000_002,
        sync_steps: true,
        progress: false,
        metrics_addr: None,
        fs_instance_id: None,
    }
}

fn check_consistent(r: &Report) {
    assert_eq!(r.requests, r.requests_planned);
    assert_eq!(r.blocks_corrupt, 0);
    assert!(r.blocks_verified > 0, "nothing was read back: {r:?}");
    assert_eq!(
        r.lookups,
        r.lookup_hits + r.lookup_hits_pending + r.lookup_retries + r.lookup_misses,
        "hits + misses = lookups"
    );
    assert_eq!(
        r.prompt_tokens,
        r.tokens_from_gpu_cache
            + r.tokens_from_dram
            + r.tokens_from_secondary
            + r.tokens_recomputed
    );
    for t in &r.tiers {
        assert_eq!(
            t.bytes_read,
            t.blocks_loaded * r.block_bytes,
            "bytes loaded = blocks loaded x block size"
        );
        assert_eq!(t.bytes_written, t.blocks_stored * r.block_bytes);
        assert_eq!(t.store_failures, 0);
    }
    // every Retry waited for at least one tier's probe, and each tier counts its waits
    let waits: u64 = r.tiers.iter().map(|t| t.retry_waits).sum();
    assert!(waits >= r.lookup_retries, "{waits} < {}", r.lookup_retries);
    assert_eq!(waits > 0, r.lookup_retries > 0);
    let promoted: u64 = r.tiers.iter().map(|t| t.blocks_loaded).sum();
    assert_eq!(
        r.tokens_from_secondary > 0,
        promoted > 0,
        "promotions and tokens served from them disagree"
    );
    let hit_tokens = r.tokens_from_gpu_cache + r.tokens_from_dram + r.tokens_from_secondary;
    assert!((r.hit_rate - hit_tokens as f64 / r.prompt_tokens as f64).abs() < 1e-9);
}

#[test]
fn a_short_scenario_reports_consistent_figures_and_is_deterministic() {
    let a = run(&small(7)).unwrap();
    check_consistent(&a);
    assert!(
        a.tokens_from_secondary > 0,
        "the fs tier served nothing: {a:?}"
    );
    assert!(a.tiers[0].blocks_stored > 0);
    let b = run(&small(7)).unwrap();
    let counts = |r: &Report| {
        (
            r.tokens_from_gpu_cache,
            r.tokens_from_dram,
            r.tokens_from_secondary,
            r.tokens_recomputed,
            r.lookups,
            r.lookup_hits,
            r.lookup_misses,
            r.tiers[0].blocks_loaded,
        )
    };
    assert_eq!(
        counts(&a),
        counts(&b),
        "the same seed gave different hit counts"
    );
    let c = run(&small(8)).unwrap();
    check_consistent(&c);
}

#[test]
fn the_fs_tier_stays_within_its_cap_after_each_sweep() {
    let mut cfg = small(3);
    cfg.turns = 4;
    let block = cfg.block_bytes() as f64;
    cfg.fs_cap_gb = Some(300.0 * block / (1u64 << 30) as f64); // 300 blocks of files, about half of them with their directories
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    let g = r.gc.expect("bounded fs tier");
    assert!(
        g.sweeps > 0 && g.swept_files > 0,
        "no sweep happened: {g:?}"
    );
    let max = g.max_bytes_after_step_sweep.expect("measured in sync mode");
    assert!(
        max <= g.cap_bytes,
        "{max} bytes after a sweep, cap {}",
        g.cap_bytes
    );
    assert!(r.removal_events > 0);
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_serve_sim"))
}

#[test]
fn the_binary_writes_its_report_as_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("report.json");
    let out = bin()
        .args([
            "--streams",
            "2",
            "--turns",
            "2",
            "--prefix-tokens",
            "256",
            "--prompt-tokens",
            "128",
            "--output-tokens",
            "32",
            "--layers",
            "1",
            "--dram-mb",
            "1",
            "--fs-cap-gb",
            "0",
            "--prefill-tokens-per-s",
            "0",
            "--no-progress",
            "--sync-steps",
            "--json",
        ])
        .arg(&json)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("verified blocks") && text.contains("hit rate"),
        "{text}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["requests"], 4);
    assert_eq!(v["blocks_corrupt"], 0);
    assert!(v["tiers"][0]["name"] == "fs");
    // the inputs are recorded: version, command line, the simulator's and the tiers' configs
    let inputs = &v["inputs"];
    assert_eq!(inputs["version"], env!("CARGO_PKG_VERSION"));
    assert!(
        inputs["argv"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--streams")
    );
    assert_eq!(inputs["sim"]["streams"], 2);
    assert_eq!(
        inputs["sim"]["model"], "custom (from llama-8b)",
        "--layers 1 changed the preset"
    );
    assert_eq!(inputs["tiers"]["secondary_tiers"][0]["type"], "fs");
    assert_eq!(inputs["tiers"]["secondary_tiers"][0]["checksum"], "crc32c");
    assert_eq!(inputs["tiers"]["cpu_bytes_to_use"], 1 << 20);
    // the whole run's time, the ceiling of the hit rate, the disk's speed
    assert!(v["wall_seconds"].as_f64().unwrap() >= v["seconds"].as_f64().unwrap());
    assert!(v["ideal_hit_rate"].as_f64().unwrap() >= v["hit_rate"].as_f64().unwrap());
    assert!(
        v["disk"]["read_gb_per_s"].as_f64().unwrap() > 0.0,
        "{}",
        v["disk"]
    );
    assert!(
        text.contains("an unbounded cache") && text.contains("O_DIRECT"),
        "{text}"
    );
}

/// The ideal hit rate is the workload's own: one conversation, two turns, prefixes of two
/// blocks, one new prompt block and one output block a turn. Turn 0 hits nothing of its
/// three blocks; turn 1's five blocks are the prefix, turn 0's prompt and output (seen),
/// then its own new block: 4 of 5. In all 4 of 8.
#[test]
fn the_ideal_hit_rate_is_that_of_an_unbounded_cache_on_the_workload() {
    let mut cfg = small(1);
    (cfg.streams, cfg.turns, cfg.prefixes) = (1, 2, 1);
    (cfg.prefix_tokens, cfg.prompt_tokens, cfg.output_tokens) = (32, 16, 16);
    assert_eq!(ideal_hit_rate(&cfg, 2), 0.5);
    assert_eq!(ideal_hit_rate(&cfg, 1), 0.0);
    // two conversations on the one shared prefix: the second's turn 0 hits the prefix
    cfg.streams = 2;
    assert_eq!(ideal_hit_rate(&cfg, 2), 2.0 / 6.0);
}

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

/// The lines of `help` that describe `flag`: its line and the lines after it up to the next
/// flag or heading.
fn help_entry(help: &str, flag: &str) -> String {
    let mut lines = help
        .lines()
        .skip_while(|l| !l.trim_start().split([' ', ',']).any(|w| w == flag));
    let mut entry = lines
        .next()
        .unwrap_or_else(|| panic!("{flag} not in\n{help}"))
        .to_string();
    for l in lines {
        let t = l.trim_start();
        if t.is_empty() || t.starts_with('-') || !l.starts_with(' ') {
            break;
        }
        entry += " ";
        entry += t;
    }
    entry
}

/// With an obj tier below a small fs tier, blocks the fs GC swept come back from S3 (a real
/// S3 server on 127.0.0.1), verified byte for byte.
#[test]
fn an_obj_tier_below_fs_serves_what_fs_swept() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt.block_on(s3::S3Server::start());
    let mut cfg = small(11);
    cfg.turns = 4;
    let block = cfg.block_bytes() as f64;
    cfg.fs_cap_gb = Some(300.0 * block / (1u64 << 30) as f64);
    cfg.s3_endpoint = Some(server.endpoint.clone());
    cfg.s3_bucket = s3::BUCKET.into();
    cfg.s3_access_key = s3::AK.into();
    cfg.s3_secret_key = s3::SK.into();
    cfg.s3_region = "us-east-1".into();
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    let names: Vec<&str> = r.tiers.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["fs", "obj"]);
    assert!(
        r.tiers[1].blocks_stored > 0,
        "nothing cascaded to obj: {r:?}"
    );
    assert!(r.tiers[1].blocks_loaded > 0, "obj served nothing: {r:?}");
    assert!(r.gc.as_ref().unwrap().swept_files > 0);
    drop(server);
}

/// The obj tier on an S3 server that takes 20 ms per request (a remote store) and a
/// write-back limit of 4 blocks: its probes pass their budget and their late answers are
/// counted, cascades past the limit are dropped (the default policy of the lowest tier) and
/// counted, no DRAM store is refused for write-back, and the report shows all of it.
#[test]
fn a_slow_obj_tier_drops_writes_and_answers_late_without_refusing_stores() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt.block_on(s3::S3Server::start());
    server.set_latency(std::time::Duration::from_millis(20));
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small(13);
    cfg.sync_steps = false;
    let block = cfg.block_bytes();
    let config = serde_json::json!({
        "cpu_bytes_to_use": cfg.dram_bytes,
        "block_size_bytes": block,
        "secondary_tiers": [
            {"type": "fs", "root_dir": dir.path()},
            {"type": "obj", "bucket": s3::BUCKET, "endpoint_override": server.endpoint,
             "access_key": s3::AK, "secret_key": s3::SK, "region": "us-east-1",
             "scheme": "http", "prefix": "slow",
             "write_back_limit_mb": 4.0 * block as f64 / (1u64 << 20) as f64}]
    });
    cfg.config_json = Some(config.to_string());
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    let obj = &r.tiers[1];
    assert_eq!(obj.name, "obj");
    assert_eq!(r.stores_refused_write_back, 0, "{r:?}");
    assert!(
        obj.writes_dropped > 0,
        "nothing dropped past the limit: {obj:?}"
    );
    assert!(
        obj.blocks_stored > 0,
        "nothing written within the limit: {obj:?}"
    );
    assert!(
        obj.write_back_peak_bytes <= 4 * block as u64,
        "write-back past its limit: {obj:?}"
    );
    assert!(
        obj.probes_over_budget > 0,
        "no lookup passed the budget: {obj:?}"
    );
    assert!(obj.late_answers > 0, "no late answer counted: {obj:?}");
    let text = kv_tier_examples::sim::render(&r);
    for want in [
        "writes dropped",
        "past the probe budget",
        "late answers",
        "draining",
    ] {
        assert!(text.contains(want), "{want:?} missing from\n{text}");
    }
    drop(server);
}

/// One HTTP GET of `path` on `addr`: the status line and the body.
fn http_get(addr: &str, path: &str) -> std::io::Result<(String, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Ok((
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    ))
}

/// The value of the sample `series` (name with its labels, as rendered) in a scrape.
fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// serve_sim with `--metrics-addr`, scraped while it runs, as Prometheus would: the metrics
/// of lookups, probes, jobs, promotions, DRAM and the fs tier's GC are there, non-zero.
#[test]
fn the_metrics_endpoint_serves_prometheus_metrics_during_a_run() {
    use std::io::BufRead;
    let mut child = bin()
        .args([
            "--streams",
            "8",
            "--turns",
            "100000",
            "--prefix-tokens",
            "512",
            "--prompt-tokens",
            "128",
            "--output-tokens",
            "32",
            "--model",
            "tiny",
            "--layers",
            "2",
            "--dram-mb",
            "1",
            "--fs-cap-gb",
            "0.002",
            "--prefill-tokens-per-s",
            "0",
            "--duration",
            "8",
            "--no-progress",
            "--metrics-addr",
            "127.0.0.1:0",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = std::io::BufReader::new(child.stderr.take().unwrap());
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let addr = loop {
        let line = rx
            .recv_timeout(std::time::Duration::from_secs(120))
            .expect("serve_sim printed no metrics address");
        if let Some(rest) = line.strip_prefix("serve_sim: metrics at http://") {
            break rest.trim_end_matches("/metrics").to_string();
        }
    };
    let (status, _) = http_get(&addr, "/nothing-here").unwrap();
    assert!(status.contains("404"), "{status}");
    // scrapes until the run ends; the last one that answered is checked
    let mut last = None;
    while child.try_wait().unwrap().is_none() {
        if let Ok((status, body)) = http_get(&addr, "/metrics") {
            assert!(status.contains("200"), "{status}");
            last = Some(body);
        }
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let status = child.wait().unwrap();
    let rest: Vec<String> = rx.try_iter().collect();
    assert!(status.success(), "serve_sim failed: {rest:?}");
    let body = last.expect("no scrape answered during the run");
    for series in [
        r#"kv_tier_lookups_total{verdict="hit"}"#,
        r#"kv_tier_lookups_total{verdict="miss"}"#,
        r#"kv_tier_retry_waits_total{tier="fs"}"#,
        r#"kv_tier_probe_seconds_count{tier="fs"}"#,
        r#"kv_tier_probe_keys_total{tier="fs",outcome="found"}"#,
        r#"kv_tier_job_seconds_count{tier="fs",direction="store"}"#,
        r#"kv_tier_job_seconds_count{tier="fs",direction="load"}"#,
        r#"kv_tier_promotion_wait_seconds_count{tier="fs"}"#,
        r#"kv_tier_blocks_stored_total{tier="fs"}"#,
        r#"kv_tier_stored_bytes_total{tier="fs"}"#,
        r#"kv_tier_blocks_loaded_total{tier="fs"}"#,
        r#"kv_tier_loaded_bytes_total{tier="fs"}"#,
        "kv_tier_dram_capacity_bytes",
        "kv_tier_dram_used_bytes",
        "kv_tier_dram_evictions_total",
        r#"kv_tier_tier_capacity_bytes{tier="fs"}"#,
        r#"kv_tier_tier_used_bytes{tier="fs"}"#,
        r#"kv_tier_tier_blocks_written_total{tier="fs"}"#,
        r#"kv_tier_fs_gc_sweeps_total{tier="fs"}"#,
        r#"kv_tier_fs_gc_swept_files_total{tier="fs"}"#,
        r#"kv_tier_fs_gc_swept_bytes_total{tier="fs"}"#,
        r#"kv_tier_fs_gc_bytes{tier="fs"}"#,
        r#"kv_tier_fs_gc_cap_bytes{tier="fs"}"#,
    ] {
        let v = sample(&body, series).unwrap_or_else(|| panic!("{series} missing:\n{body}"));
        assert!(v > 0.0, "{series} is {v}");
    }
    // present, zero or not: failures by cause, GC skips, the stamp queue
    for series in [
        r#"kv_tier_load_failures_total{tier="fs",cause="missing"}"#,
        r#"kv_tier_store_failures_total{tier="fs",cause="no_space"}"#,
        r#"kv_tier_probe_failures_total{tier="fs",outcome="deadline"}"#,
        r#"kv_tier_fs_gc_skipped_in_flight_total{tier="fs"}"#,
        r#"kv_tier_fs_gc_skipped_in_grace_total{tier="fs"}"#,
        r#"kv_tier_fs_gc_pending_stamps{tier="fs"}"#,
        r#"kv_tier_fs_gc_last_sweep_seconds{tier="fs"}"#,
    ] {
        assert!(sample(&body, series).is_some(), "{series} missing:\n{body}");
    }
    assert!(
        body.contains("# TYPE kv_tier_job_seconds histogram"),
        "latencies are histograms"
    );
    assert!(body.contains("# HELP kv_tier_fs_gc_swept_files_total Files deleted by sweeps."));
    // every metric the Grafana dashboard charts is one kv-tier exports: in this scrape, or
    // (the obj tier's, absent from an fs-only run) among the obj tier's figures
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../dashboards/grafana-kv-tier.json"
    ))
    .unwrap();
    let obj_names: Vec<String> = {
        let stats = kv_tier::obj::ObjStats::default();
        kv_tier::TierSnapshot::new("obj", stats.blocks, &stats)
            .figures
            .iter()
            .map(|f| kv_tier::core::metrics::figure_metric("obj", f).0)
            .collect()
    };
    let mut charted = 0;
    for (i, _) in dashboard.match_indices("kv_tier_") {
        let name: String = dashboard[i..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        let base = ["_bucket", "_count", "_sum"]
            .iter()
            .find_map(|sfx| name.strip_suffix(sfx))
            .unwrap_or(&name);
        if base == "kv_tier_" {
            continue; // the description's kv_tier_*
        }
        charted += 1;
        if base.starts_with("kv_tier_obj_") {
            assert!(
                obj_names.iter().any(|n| n == base),
                "the dashboard charts {base}, not an obj figure: {obj_names:?}"
            );
        } else {
            assert!(
                body.contains(&format!("# TYPE {base} ")),
                "the dashboard charts {base}, which is not exported"
            );
        }
    }
    assert!(charted > 20, "the dashboard charts {charted} metrics");
}

#[test]
fn admission_after_two_lookups_writes_less_to_the_fs_tier_and_the_comparison_shows_it() {
    let without = run(&small(21)).unwrap();
    let mut cfg = small(21);
    cfg.fs_admit_after_lookups = 2;
    let with = run(&cfg).unwrap();
    check_consistent(&without);
    check_consistent(&with);
    let (a, b) = (&without.tiers[0], &with.tiers[0]);
    assert_eq!((a.not_admitted, a.over_write_budget), (0, 0));
    assert!(b.not_admitted > 0, "{b:?}");
    // sync_steps makes both runs deterministic: the rule keeps writes out
    assert!(b.blocks_written_new > 0, "{b:?}");
    assert!(
        b.blocks_written_new < a.blocks_written_new,
        "with admission {} blocks written, without {}",
        b.blocks_written_new,
        a.blocks_written_new
    );
    assert!(b.blocks_written_new <= b.blocks_stored, "{b:?}");
    assert_eq!(without.requests, with.requests, "the same workload");
    let text = kv_tier_examples::sim::render_admission_comparison(&without, &with);
    eprintln!("{text}");
    for want in [
        "hit rate",
        "tier fs written (device)",
        "not admitted",
        "fs admit_after_lookups 2",
    ] {
        assert!(text.contains(want), "{want:?} missing from\n{text}");
    }
    // the report says what was kept out
    assert!(kv_tier_examples::sim::render(&with).contains("blocks not admitted"));
}

/// `--instances 3`: three serve_sim processes on one shared fs root with one cap; each
/// verifies every block it loads (prefixes the others stored among them), the shared
/// directory's peak stays within 1.10x the one cap, one instance leads, and the parent's
/// `--json` holds each instance's report and the global figures.
#[test]
fn several_instances_share_one_root_under_one_cap() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("instances.json");
    let root = dir.path().join("shared");
    let out = bin()
        .args([
            "--instances",
            "3",
            "--model",
            "tiny",
            "--streams",
            "4",
            "--turns",
            "6",
            "--duration",
            "20",
            "--dram-mb",
            "1",
            "--fs-cap-gb",
            "0.005",
            "--prefill-tokens-per-s",
            "0",
            "--seed",
            "5",
            "--json",
        ])
        .arg(&json)
        .arg("--root-dir")
        .arg(&root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("global: peak") && text.contains("sim-2"),
        "{text}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let instances = v["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 3);
    let seeds: Vec<u64> = instances
        .iter()
        .map(|i| i["seed"].as_u64().unwrap())
        .collect();
    assert_eq!(seeds, [5, 6, 7]);
    assert_eq!(v["blocks_corrupt"], 0);
    assert!(v["blocks_verified"].as_u64().unwrap() > 0);
    // each instance reports as it ends (one may lead after another released the lease):
    // never two leaders of one epoch
    let mut epochs: Vec<u64> = instances
        .iter()
        .filter(|i| i["report"]["shared"]["leader"] == true)
        .map(|i| i["report"]["shared"]["epoch"].as_u64().unwrap())
        .collect();
    let leaders = epochs.len();
    epochs.sort_unstable();
    epochs.dedup();
    assert_eq!(
        epochs.len(),
        leaders,
        "two leaders of one epoch: {instances:?}"
    );
    assert!(v["takeovers"].as_u64().unwrap() >= 1);
    let (peak, cap) = (
        v["peak_bytes"].as_u64().unwrap(),
        v["cap_bytes"].as_u64().unwrap(),
    );
    assert!(
        peak > 0 && peak as f64 <= 1.10 * cap as f64,
        "peak {peak} of cap {cap}"
    );
    for i in instances {
        assert_eq!(i["report"]["inputs"]["sim"]["fs_instance_id"], i["id"]);
        assert_eq!(i["report"]["requests"], 24, "{}", i["id"]);
    }
}
