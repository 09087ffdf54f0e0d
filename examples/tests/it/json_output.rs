//! `--json`: the report with its inputs (version, command line, configs), agreeing with the
//! text report and with itself; a path that cannot be written refused before the run, a FIFO
//! never a hang.

use kv_tier_testkit::fixtures::files::mkfifo;

use crate::support::*;

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
            "{:.1} MiB ({:.2}x)",
            peak as f64 / (1u64 << 20) as f64,
            peak as f64 / cap as f64
        )),
        "the text's peak differs from the json's {peak}/{cap}:\n{t}"
    );
    for tier in v["tiers"].as_array().unwrap() {
        assert_eq!(tier["store_failures"], 0, "{tier}");
    }
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
    mkfifo(&fifo);
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
