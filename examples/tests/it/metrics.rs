//! `--metrics-addr`: Prometheus metrics served while a run lasts (every metric the Grafana
//! dashboard charts among them); an address in use fails cleanly.

use crate::support::*;

/// serve_sim with `--metrics-addr`, scraped while it runs, as Prometheus would: the metrics
/// of lookups, keys answered from the fs index, jobs, promotions, DRAM and the fs tier's GC
/// are there, non-zero; those of probes are there.
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
            "5",
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
        // paces the scrapes (Prometheus's interval): a scrape every 200 ms for the run's 5 s
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let status = child.wait().unwrap();
    let rest: Vec<String> = rx.try_iter().collect();
    assert!(status.success(), "serve_sim failed: {rest:?}");
    let body = last.expect("no scrape answered during the run");
    for series in [
        r#"kv_tier_lookups_total{verdict="hit"}"#,
        r#"kv_tier_lookups_total{verdict="miss"}"#,
        r#"kv_tier_known_keys_total{tier="fs",outcome="held"}"#,
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
    // present, zero or not: probe counters and their retries (a bounded fs tier answers most
    // keys from its index, so few or none are probed: the probe latency histogram, exported
    // from its first probe, may be absent), failures by cause, GC skips, the stamp queue
    for series in [
        r#"kv_tier_retry_waits_total{tier="fs"}"#,
        r#"kv_tier_probe_keys_total{tier="fs",outcome="found"}"#,
        r#"kv_tier_known_keys_total{tier="fs",outcome="absent"}"#,
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
        if base == kv_tier::core::metrics::PROBE_SECONDS
            && !body.contains(&format!("# TYPE {base} "))
        {
            // exported from a tier's first probe; this run's fs tier may answer every key
            // from its index (see the series above)
            continue;
        }
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
fn metrics_addr_already_in_use_fails_cleanly() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let out = sim(&with(&["--dram-mb", "1", "--metrics-addr", &addr]), 30);
    assert_clean_refusal(&out, &["--metrics-addr", "metrics", &addr]);
}
