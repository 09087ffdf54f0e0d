//! Values that parse but are odd or extreme (layouts, tier names, root dirs, bucket names and
//! prefixes, numbers at their documented ends, huge allocations, CA bundles): they build and work,
//! or are refused naming the field; never a panic or an abort (the allocations run in a child
//! process).

use std::time::{Duration, Instant};

use kv_tier::{Error, KvTierConfig, RequestContext, SecondaryTier};

use crate::support::*;

/// Accepted-but-extreme layouts build an fs tier and store and load a block, without a panic.
#[test]
fn extreme_accepted_layouts_store_and_load_or_fail_cleanly() {
    watch_panics();
    let mut report = Vec::new();
    for layout in [
        r#"{"model_name": "m", "dtype": "f", "tokens_per_hash": 18446744073709551615}"#.to_string(),
        r#"{"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "blocks_per_file": 18446744073709551615}"#.to_string(),
        r#"{"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "kv_cache_groups": [{"tokens_per_block": 0, "layer_names": []}]}"#.to_string(),
        r#"{"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "parallel_agnostic": false, "tp_size": 2, "rank": 4294967295}"#.to_string(),
        r#"{"model_name": "..", "dtype": "f", "tokens_per_hash": 16}"#.to_string(),
        r#"{"model_name": "/", "dtype": "f", "tokens_per_hash": 16}"#.to_string(),
        r#"{"model_name": "a\u0000b", "dtype": "f", "tokens_per_hash": 16}"#.to_string(),
        format!(r#"{{"model_name": "{}", "dtype": "f", "tokens_per_hash": 16}}"#, "m".repeat(300)),
        r#"{"model_name": "m\n\t\u0001", "dtype": "\u0000", "tokens_per_hash": 16}"#.to_string(),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, "layout": {layout}, "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
            dir.path()
        );
        let short: String = layout.chars().take(90).collect();
        let t = text.clone();
        let r = std::panic::catch_unwind(move || -> Result<usize, String> {
            let cfg = KvTierConfig::from_json_str(&t).map_err(|e| format!("parse: {e}"))?;
            let m = try_build(cfg).map_err(|e| format!("build: {e}"))?;
            let n = roundtrip(&m, 3, 1, 300);
            m.shutdown_blocking().map_err(|e| format!("shutdown: {e}"))?;
            Ok(n)
        });
        match r {
            Err(_) => report.push(format!("PANIC for layout {short}")),
            Ok(Err(e)) => {
                if e.contains("panic") {
                    report.push(format!("a panic turned into an error for {short}: {e}"));
                }
                eprintln!("{short}: {e}");
            }
            Ok(Ok(n)) => {
                eprintln!("{short}: {n}/3 back");
                if n != 3 {
                    report.push(format!("built but only {n}/3 blocks came back for {short}"));
                }
            }
        }
    }
    let p = take_panics();
    assert!(
        report.is_empty() && p.is_empty(),
        "{report:#?}\npanics: {p:#?}"
    );
}

/// Tier names: any non-empty string deserialises; each must build and work or be refused
/// naming `secondary_tiers[0].name`, never panic (thread names, metric labels, paths).
#[test]
fn odd_tier_names_build_or_are_refused_naming_the_name() {
    watch_panics();
    let mut report = Vec::new();
    for name in [
        "a\u{0}b".to_string(),
        "cpu".to_string(),
        " ".to_string(),
        "a/b\\c\"d".to_string(),
        "x".repeat(10_000),
        "é漢字🦀".to_string(),
        "line\nbreak{label=\"x\"}".to_string(),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "fs", "name": name, "root_dir": dir.path()}]
        })
        .to_string();
        let short: String = name.escape_debug().take(40).collect();
        let r = std::panic::catch_unwind(move || -> Result<usize, Error> {
            let cfg = KvTierConfig::from_json_str(&text)?;
            let m = try_build(cfg)?;
            m.publish_metrics();
            let _ = m.stats();
            let n = roundtrip(&m, 2, 2, 300);
            m.shutdown_blocking()?;
            Ok(n)
        });
        match r {
            Err(_) => report.push(format!("PANIC for name {short:?}")),
            Ok(Err(e)) if field_of(&e) == "secondary_tiers[0].name" => {}
            Ok(Err(e)) => report.push(format!("name {short:?}: error not naming the name: {e}")),
            Ok(Ok(2)) => {}
            Ok(Ok(n)) => report.push(format!("name {short:?}: built, {n}/2 back")),
        }
    }
    let p = take_panics();
    assert!(
        report.is_empty() && p.is_empty(),
        "{report:#?}\npanics: {p:#?}"
    );
}

/// root_dir values that deserialise but cannot be a cache directory: building fails with an error
/// naming root_dir or the path, never a panic.
#[test]
fn unusable_root_dirs_fail_cleanly_naming_it() {
    watch_panics();
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let long = tmp.path().join("d".repeat(300));
    let roots: Vec<String> = vec![
        file.to_str().unwrap().to_string(),
        format!("{}/sub", file.display()),
        "/proc".into(),
        "/proc/self/status".into(),
        "/dev/null".into(),
        format!("{}/a\u{0}b", tmp.path().display()),
        long.to_str().unwrap().to_string(),
        format!("{}/{}", tmp.path().display(), "x/".repeat(3000)),
    ];
    let mut report = Vec::new();
    for root in roots {
        let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "fs", "root_dir": root}]
        })
        .to_string();
        let short: String = root.escape_debug().take(80).collect();
        let r = std::panic::catch_unwind(move || -> Result<(), Error> {
            let cfg = KvTierConfig::from_json_str(&text)?;
            let m = try_build(cfg)?;
            m.shutdown_blocking()?;
            Ok(())
        });
        match r {
            Err(_) => report.push(format!("PANIC for root {short}")),
            Ok(Ok(())) => report.push(format!("built on root {short}")),
            Ok(Err(e)) => {
                let s = e.to_string();
                let names = s.contains("root_dir")
                    || s.contains(&root.chars().take(30).collect::<String>());
                if !names || s.contains("panic") {
                    report.push(format!("root {short}: unclear error: {s}"));
                }
            }
        }
    }
    let p = take_panics();
    assert!(
        report.is_empty() && p.is_empty(),
        "{report:#?}\npanics: {p:#?}"
    );
}

/// Two fs tiers on one root_dir (distinct names): they would run two unshared GCs and two
/// writers on one rank directory. Either refused naming the second tier's root_dir, or it
/// works: stores land, loads come back, no panic.
#[test]
fn two_fs_tiers_on_one_root() {
    watch_panics();
    let dir = tempfile::tempdir().unwrap();
    let text = serde_json::json!({
        "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
        "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
        "secondary_tiers": [
            {"type": "fs", "name": "a", "root_dir": dir.path(), "gc_max_size_gb": 0.001, "checksum": "crc32c"},
            {"type": "fs", "name": "b", "root_dir": dir.path()}
        ]
    })
    .to_string();
    match KvTierConfig::from_json_str(&text).and_then(try_build) {
        Err(e) => assert!(field_of(&e).starts_with("secondary_tiers[1]"), "{e}"),
        Ok(m) => {
            let n = roundtrip(&m, 8, 3, 300);
            m.shutdown_blocking().unwrap();
            assert_eq!(n, 8);
        }
    }
    assert_no_panics("two fs tiers on one root");
}

/// The fs tier's gc_* numbers all at their documented minimum (a ~100 KiB cap, as the
/// documented 1e-9 GiB does not build: see
/// `config::check::fs_cap_at_its_documented_minimum_check_and_build_agree`; swept every 10 ms,
/// stamps every microsecond, one tracked stamp, rescans every second, temp files reaped at
/// once), with checksums and fsync: it builds, stores and loads (misses are fine), its GC runs
/// for a while, it shuts down, and nothing panics.
#[test]
fn fs_gc_numbers_at_their_minimum_run_without_panics() {
    watch_panics();
    let dir = tempfile::tempdir().unwrap();
    let text = serde_json::json!({
        "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
        "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
        "secondary_tiers": [{"type": "fs", "root_dir": dir.path(), "checksum": "crc32c", "fsync": true,
            "n_read_threads": 1, "n_write_threads": 1, "tmp_reap_age_s": 0,
            "gc_max_size_gb": 1e-4, "gc_hard_ceiling": 1, "gc_low_watermark": 1e-9,
            "gc_interval_s": 0.01, "gc_stamp_interval_s": 0.000001, "gc_grace_s": 0.000002,
            "gc_max_tracked": 1, "gc_rescan_interval_s": 1}]
    })
    .to_string();
    let m = try_build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
    for salt in 1..4 {
        let n = roundtrip(&m, 4, salt, 30);
        eprintln!("round {salt}: {n}/4 back");
    }
    // the GC runs a while at its minimum numbers (the subject)
    std::thread::sleep(Duration::from_millis(1500));
    let t = Instant::now();
    m.shutdown_blocking().unwrap();
    assert!(
        t.elapsed() < Duration::from_secs(10),
        "shutdown took {:?}",
        t.elapsed()
    );
    assert_no_panics("fs gc minimum");
}

/// ... and at their documented maximum (child process: 2,048 threads, 1e8 tracked stamps).
#[test]
fn fs_numbers_at_their_maximum_run_and_shut_down_promptly() {
    isolated(
        "config::odd_values::fs_numbers_at_their_maximum_run_and_shut_down_promptly",
        || {
            watch_panics();
            let dir = tempfile::tempdir().unwrap();
            let text = serde_json::json!({
                "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
                "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
                "secondary_tiers": [{"type": "fs", "root_dir": dir.path(),
                    "n_read_threads": 1024, "n_write_threads": 1024, "tmp_reap_age_s": 31536000,
                    "gc_max_size_gb": 1e9, "gc_hard_ceiling": 1000, "gc_low_watermark": 1,
                    "gc_interval_s": 86400, "gc_stamp_interval_s": 86400, "gc_grace_s": 31536000,
                    "gc_max_tracked": 100000000, "gc_rescan_interval_s": 31536000}]
            })
            .to_string();
            let m = try_build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
            let n = roundtrip(&m, 8, 4, 300);
            let t = Instant::now();
            m.shutdown_blocking().unwrap();
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "shutdown took {:?}",
                t.elapsed()
            );
            assert_eq!(n, 8);
            assert_no_panics("fs maximum");
        },
    );
}

/// A shared root at both lease ends (0.05 s: renewals every 12.5 ms; 600 s) and a 64-character
/// instance id: builds, stores, loads, shuts down promptly.
#[test]
fn fs_shared_root_at_lease_edges() {
    watch_panics();
    for lease in [0.05, 600.0] {
        let dir = tempfile::tempdir().unwrap();
        let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "fs", "root_dir": dir.path(), "shared": true,
                "gc_max_size_gb": 0.01, "shared_lease_s": lease, "instance_id": "i".repeat(64)}]
        })
        .to_string();
        let m = try_build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
        let n = roundtrip(&m, 4, 5, 500);
        let t = Instant::now();
        m.shutdown_blocking().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "lease {lease}: shutdown took {:?}",
            t.elapsed()
        );
        eprintln!("lease {lease}: {n}/4 back");
    }
    assert_no_panics("fs shared leases");
}

/// The manager's timing numbers at their minimum (probe 1 ms, job 10 ms + 0 per block, lease
/// 1 ms, 1% write-back) and maximum: builds, runs a store/lookup/load cycle over an fs tier,
/// shuts down promptly, no panic.
#[test]
fn manager_timings_at_their_edges() {
    watch_panics();
    for (probe, job, per_block, lease, frac) in [
        (0.001, 0.01, 0.0, 0.001, 0.01),
        (600.0, 86400.0, 3600.0, 86400.0, 1.0),
        (0.001, 86400.0, 3600.0, 0.001, 1.0),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "probe_timeout_s": probe, "job_timeout_s": job, "job_timeout_per_block_s": per_block,
            "lease_s": lease, "write_back_max_dram_fraction": frac,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "fs", "root_dir": dir.path(), "probe_budget_s": 0.0001,
                "write_budget_mb_per_s": 0.001, "admit_after_lookups": 0}]
        })
        .to_string();
        let m = try_build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
        let n = roundtrip(&m, 16, 6, 50);
        let t = Instant::now();
        m.shutdown_blocking().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "shutdown took {:?}",
            t.elapsed()
        );
        eprintln!("{probe} {job} {per_block} {lease} {frac}: {n}/16 back");
    }
    assert_no_panics("manager timings");
}

/// write_back_limit_mb at its minimum (1e-6 MiB = 1 byte) with policy "wait": the doc promises a
/// single store larger than the limit is taken alone when nothing else is queued; so stores keep
/// going through one at a time, and the rest is refused with WriteBackFull, never a panic.
#[test]
fn a_one_byte_write_back_limit_with_wait_still_stores_one_at_a_time() {
    watch_panics();
    let dir = tempfile::tempdir().unwrap();
    let text = serde_json::json!({
        "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
        "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
        "secondary_tiers": [{"type": "fs", "root_dir": dir.path(),
            "write_back_limit_mb": 0.000001, "write_back_policy": "wait"}]
    })
    .to_string();
    let m = try_build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
    let req = RequestContext::new(1);
    let ks = salted_keys(6, 7);
    let mut stored = 0;
    for k in &ks {
        // wait for the previous one so nothing else is queued
        m.runtime().block_on(m.wait_idle());
        m.on_schedule_end();
        match m.prepare_store(std::slice::from_ref(k)) {
            Ok(mut p) => {
                for (k, s) in p.slots() {
                    s.as_mut_slice().fill(fill_byte(k));
                }
                p.commit(req.id);
                stored += 1;
            }
            Err(e) => eprintln!("refused: {e}"),
        }
    }
    m.on_request_finished(req.id);
    m.runtime().block_on(m.wait_idle());
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    let written = fs.stats().blocks.blocks_written;
    m.shutdown_blocking().unwrap();
    assert_eq!(
        (stored, written),
        (6, 6),
        "one at a time, with nothing queued, each goes through"
    );
    assert_no_panics("1-byte write-back");
}

/// The largest block size (1 GiB) builds; one more byte is refused naming block_size_bytes.
#[test]
fn the_largest_block_size_builds_and_one_more_is_refused() {
    let e = config_check(r#"{"cpu_bytes_to_use": 4294967296, "block_size_bytes": 1073741825}"#)
        .unwrap_err();
    assert_eq!(field_of(&e), "block_size_bytes", "{e}");
    isolated(
        "config::odd_values::the_largest_block_size_builds_and_one_more_is_refused",
        || {
            watch_panics();
            let m = try_build(
                KvTierConfig::from_json_str(
                    r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 1073741824}"#,
                )
                .unwrap(),
            )
            .unwrap();
            m.shutdown_blocking().unwrap();
            assert_no_panics("1 GiB block");
        },
    );
}

/// DRAM sizes that pass the check but cannot be allocated: an error naming cpu_bytes_to_use (or
/// memory), not an abort (child process).
#[test]
fn unallocatable_dram_is_an_error() {
    isolated("config::odd_values::unallocatable_dram_is_an_error", || {
        // (2^44 bytes of 4 KiB blocks would be 2^32 slots: refused by the config itself)
        for (cpu, bs) in [
            (1u64 << 50, 1u64 << 30),
            (1 << 43, 4096),
            ((1 << 44) - 8192, 4096),
        ] {
            let cfg = KvTierConfig::from_json_str(&format!(
                r#"{{"cpu_bytes_to_use": {cpu}, "block_size_bytes": {bs}}}"#
            ))
            .unwrap();
            let r = try_build(cfg);
            let e = r
                .err()
                .unwrap_or_else(|| panic!("{cpu} bytes of DRAM built"));
            eprintln!("{cpu}/{bs}: {e}");
        }
    });
}

/// max_tracker_size and event_buffer_keys at their maximum with store_threshold / events on:
/// builds, stores and loads (child process).
#[test]
fn tracker_and_event_buffers_at_their_maximum() {
    isolated(
        "config::odd_values::tracker_and_event_buffers_at_their_maximum",
        || {
            watch_panics();
            let dir = tempfile::tempdir().unwrap();
            let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "max_tracker_size": 100000000u64, "event_buffer_keys": 10000000000u64, "store_threshold": 0,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "fs", "root_dir": dir.path(), "enable_kv_events": true,
                "admit_after_lookups": 10000}]
        })
        .to_string();
            let m = try_build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
            roundtrip(&m, 4, 9, 20);
            let ev = m.take_events();
            eprintln!("{} events", ev.len());
            m.shutdown_blocking().unwrap();
            assert_no_panics("max trackers");
        },
    );
}

/// Bucket names "." and ".." pass check_bucket (letters, digits, '.', '_', '-') but are no
/// bucket anywhere: with path-style addressing `http://host/../key` is normalised to
/// `http://host/key`, another bucket. They must be refused naming the bucket.
#[test]
fn dot_bucket_names_are_refused() {
    let mut accepted = Vec::new();
    for b in [".", "..", "...", "-", "_"] {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{{"type": "obj", "bucket": "{b}", "endpoint_override": "http://127.0.0.1:1"}}]}}"#
        );
        if config_check(&text).is_ok() {
            accepted.push(b);
        }
    }
    assert!(accepted.is_empty(), "bucket names accepted: {accepted:?}");
}

/// What a ".." bucket does when built against a real S3 server: the block must not land in
/// another bucket (here: the server's own bucket, reached through `/../`).
#[test]
fn a_dotdot_bucket_does_not_write_into_another_bucket() {
    watch_panics();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let parent = tempfile::tempdir().unwrap();
    let s3 = rt.block_on(kv_tier_testkit::s3::S3Server::start_in(parent.path()));
    let text = serde_json::json!({
        "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
        "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
        "secondary_tiers": [{"type": "obj", "bucket": "..", "endpoint_override": s3.endpoint,
            "scheme": "http", "access_key": kv_tier_testkit::s3::AK,
            "secret_key": kv_tier_testkit::s3::SK, "prefix": kv_tier_testkit::s3::BUCKET,
            "request_timeout_s": 2, "max_retries": 0}]
    })
    .to_string();
    let cfg = match KvTierConfig::from_json_str(&text) {
        Ok(c) => c,
        Err(e) => {
            assert!(field_of(&e).contains("bucket"), "{e}");
            return;
        }
    };
    let r = rt.block_on(async {
        let m = kv_tier::builder(cfg)?.build().await?;
        Ok::<_, Error>(m)
    });
    match r {
        Err(e) => eprintln!("build: {e}"),
        Ok(m) => {
            let req = RequestContext::new(1);
            let ks = salted_keys(1, 10);
            let mut p = m.prepare_store(&ks).unwrap();
            p.slots()[0].1.as_mut_slice().fill(1);
            p.commit(req.id);
            m.on_request_finished(req.id);
            rt.block_on(m.wait_idle());
            let obj = m.tier::<kv_tier::obj::ObjTier>("obj").unwrap();
            let written = obj.stats().blocks.blocks_written;
            rt.block_on(m.shutdown()).unwrap();
            let mut found = Vec::new();
            for e in find_files(parent.path(), "") {
                if e.extension().is_some_and(|x| x == "bin") {
                    found.push(e);
                }
            }
            assert!(
                written == 0 && found.is_empty(),
                "bucket \"..\" wrote {written} block(s), landing at {found:?}"
            );
        }
    }
    assert_no_panics("dotdot bucket");
}

/// Prefixes that deserialise (only "//" is refused): "..", "./x", "a/../b", control characters,
/// '%', non-ASCII, 1,500 characters. Against a real S3 server each builds and round-trips a
/// block, or fails cleanly naming the prefix; never a panic.
#[test]
fn odd_obj_prefixes_round_trip_or_fail_cleanly() {
    watch_panics();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let parent = tempfile::tempdir().unwrap();
    let s3 = rt.block_on(kv_tier_testkit::s3::S3Server::start_in(parent.path()));
    let mut report = Vec::new();
    for prefix in [
        "..".to_string(),
        "./x".to_string(),
        "a/../b".to_string(),
        "a\u{0}b".to_string(),
        "tab\there\n".to_string(),
        "100%25/%".to_string(),
        "ü/漢".to_string(),
        "/".to_string(),
        "p".repeat(1500),
    ] {
        let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "obj", "bucket": kv_tier_testkit::s3::BUCKET,
                "endpoint_override": s3.endpoint, "scheme": "http",
                "access_key": kv_tier_testkit::s3::AK, "secret_key": kv_tier_testkit::s3::SK,
                "prefix": prefix, "request_timeout_s": 30, "max_retries": 0, "probe_budget_s": 1,
                "lookup_timeout_s": 30}]
        })
        .to_string();
        let short: String = prefix.escape_debug().take(40).collect();
        let cfg = match KvTierConfig::from_json_str(&text) {
            Ok(c) => c,
            Err(e) => {
                if field_of(&e) != "secondary_tiers[0].prefix" {
                    report.push(format!(
                        "prefix {short}: refused naming {}: {e}",
                        field_of(&e)
                    ));
                }
                continue;
            }
        };
        let handle = rt.handle().clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            handle.block_on(async {
                let m = kv_tier::builder(cfg)?.build().await?;
                let obj = m.tier::<kv_tier::obj::ObjTier>("obj").unwrap();
                let ks = salted_keys(1, 11);
                let src = kv_tier::BlockSource::from_bytes(vec![0xab; 4096]);
                let stored = obj
                    .store(kv_tier::StoreJob {
                        links: Vec::new(),
                        requests: Vec::new(),
                        blocks: vec![(ks[0], src)],
                    })
                    .await
                    .is_success();
                let found = obj.lookup(&ks).await?;
                let (sink, reader) = kv_tier::BlockSink::pair(4096);
                let loaded = obj
                    .load(kv_tier::LoadJob {
                        blocks: vec![(ks[0], sink)],
                        ..Default::default()
                    })
                    .await
                    .is_success();
                let ok = loaded
                    && reader
                        .into_bytes()
                        .is_ok_and(|b| b.iter().all(|&x| x == 0xab));
                m.shutdown().await?;
                Ok::<_, Error>((stored, found, ok))
            })
        }));
        match r {
            Err(_) => report.push(format!("PANIC for prefix {short}")),
            Ok(Err(e)) => {
                let s = e.to_string();
                if !s.contains("prefix") || s.contains("panic") {
                    report.push(format!("prefix {short}: error not naming prefix: {s}"));
                }
            }
            Ok(Ok((stored, found, ok))) => {
                if !(stored && found == vec![true] && ok) {
                    report.push(format!(
                        "prefix {short}: builds but stored {stored}, lookup {found:?}, load ok {ok}"
                    ));
                }
            }
        }
    }
    let p = take_panics();
    assert!(
        report.is_empty() && p.is_empty(),
        "{report:#?}\npanics: {p:#?}"
    );
}

/// Obj numbers at their documented edges, against a real S3 server: build, store, lookup,
/// load, shutdown promptly, no panic.
#[test]
fn obj_numbers_at_their_edges_run_without_panics() {
    watch_panics();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let parent = tempfile::tempdir().unwrap();
    let s3 = rt.block_on(kv_tier_testkit::s3::S3Server::start_in(parent.path()));
    let mut report = Vec::new();
    for (io, timeout, retries, ttl, lookup, max, low) in [
        (1u64, 0.01, 0u64, 0.001, 0.001, Some(1e-9), 1e-9),
        (1024, 3600.0, 100, 604800.0, 3600.0, Some(1e9), 1.0),
        (1024, 0.01, 100, 604800.0, 0.001, None, 1.0),
    ] {
        let mut tier = serde_json::json!({"type": "obj", "bucket": kv_tier_testkit::s3::BUCKET,
            "endpoint_override": s3.endpoint, "scheme": "http",
            "access_key": kv_tier_testkit::s3::AK, "secret_key": kv_tier_testkit::s3::SK,
            "io_threads": io, "request_timeout_s": timeout, "max_retries": retries,
            "exists_ttl_s": ttl, "lookup_timeout_s": lookup, "checksum": "crc32c"});
        if let Some(max) = max {
            tier["max_size_gb"] = max.into();
            tier["low_watermark"] = low.into();
        }
        let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [tier]
        })
        .to_string();
        let label = format!(
            "io {io} timeout {timeout} retries {retries} ttl {ttl} lookup {lookup} max {max:?}"
        );
        let cfg = KvTierConfig::from_json_str(&text).unwrap();
        let handle = rt.handle().clone();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            handle.block_on(async {
                let m = kv_tier::builder(cfg)?.build().await?;
                let obj = m.tier::<kv_tier::obj::ObjTier>("obj").unwrap();
                let ks = salted_keys(4, 12);
                let blocks = ks
                    .iter()
                    .map(|k| (*k, kv_tier::BlockSource::from_bytes(vec![7; 4096])))
                    .collect();
                let _ = obj
                    .store(kv_tier::StoreJob {
                        links: Vec::new(),
                        requests: Vec::new(),
                        blocks,
                    })
                    .await;
                let _ = obj.lookup(&ks).await;
                let (sink, _reader) = kv_tier::BlockSink::pair(4096);
                let _ = obj
                    .load(kv_tier::LoadJob {
                        blocks: vec![(ks[0], sink)],
                        ..Default::default()
                    })
                    .await;
                // the background sweeps run a while at these numbers
                tokio::time::sleep(Duration::from_millis(300)).await;
                let t = Instant::now();
                let shut = m.shutdown().await;
                Ok::<_, Error>((t.elapsed(), shut.err()))
            })
        }));
        // With 10 ms tries a loaded machine may not even connect in time: building (its
        // startup probe) or shutting down (its recency snapshot's PUT) may then fail, cleanly
        // and promptly; that is no finding. A panic or a slow shutdown always is.
        let tries_may_time_out = timeout < 1.0;
        match r {
            Err(_) => report.push(format!("PANIC: {label}")),
            Ok(Err(e)) if tries_may_time_out => println!("{label}: build failed: {e}"),
            Ok(Err(e)) => report.push(format!("{label}: {e}")),
            Ok(Ok((d, _))) if d > Duration::from_secs(10) => {
                report.push(format!("{label}: shutdown took {d:?}"))
            }
            Ok(Ok((_, Some(e)))) if !tries_may_time_out => {
                report.push(format!("{label}: shutdown: {e}"))
            }
            Ok(Ok(_)) => {}
        }
    }
    let p = take_panics();
    assert!(
        report.is_empty() && p.is_empty(),
        "{report:#?}\npanics: {p:#?}"
    );
}

/// `ca_bundle` naming a missing or garbage file: building fails naming ca_bundle or the file,
/// not a panic and not a later connection error that hides it.
#[test]
fn a_bad_ca_bundle_is_refused_naming_it() {
    watch_panics();
    let tmp = tempfile::tempdir().unwrap();
    let garbage = tmp.path().join("garbage.pem");
    std::fs::write(
        &garbage,
        b"-----BEGIN CERTIFICATE-----\nnot base64 !!!\n-----END CERTIFICATE-----\n",
    )
    .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let mut report = Vec::new();
    for bundle in [
        tmp.path().join("missing.pem").to_str().unwrap().to_string(),
        garbage.to_str().unwrap().to_string(),
        tmp.path().to_str().unwrap().to_string(),
    ] {
        let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "obj", "bucket": "b",
                "endpoint_override": "https://127.0.0.1:1", "ca_bundle": bundle,
                "access_key": "a", "secret_key": "s", "request_timeout_s": 0.5, "max_retries": 0}]
        })
        .to_string();
        let cfg = match KvTierConfig::from_json_str(&text) {
            Ok(c) => c,
            Err(e) => {
                assert!(e.to_string().contains("ca_bundle"), "{e}");
                continue;
            }
        };
        let r = rt.block_on(async { kv_tier::builder(cfg)?.build().await.map(|_| ()) });
        match r {
            Ok(()) => report.push(format!("{bundle}: built")),
            Err(e) => {
                let s = e.to_string();
                if !(s.contains("ca_bundle") || s.contains(&bundle)) || s.contains("panic") {
                    report.push(format!("{bundle}: error does not name it: {s}"));
                }
            }
        }
    }
    let p = take_panics();
    assert!(
        report.is_empty() && p.is_empty(),
        "{report:#?}\npanics: {p:#?}"
    );
}

#[test]
fn odd_values_never_panic() {
    let dir = tempfile::tempdir().unwrap();
    let d = format!("{:?}", dir.path());
    let cases = [
        r#"{"cpu_bytes_to_use": 4194304, "block_size": 18446744073709551615}"#.to_string(),
        r#"{"cpu_bytes_to_use": 4194304, "blocks_per_chunk": 0}"#.to_string(),
        r#"{"cpu_bytes_to_use": 4194304, "store_threshold": 1000000, "max_tracker_size": 100000000}"#.to_string(),
        r#"{"cpu_bytes_to_use": 4194304, "event_buffer_keys": 10000000000}"#.to_string(),
        format!(r#"{{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{{"type": "fs", "root_dir": {d}, "write_budget_mb_per_s": 1e9, "admit_after_lookups": 1000000, "write_back_limit_mb": 1e9, "probe_budget_s": 600}}]}}"#),
        format!(r#"{{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{{"type": "fs", "root_dir": {d}, "write_budget_mb_per_s": 0.001, "locality": null, "enable_kv_events": null, "module_path": null}}]}}"#),
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "[::1]:1", "scheme": ""}, "request_timeout_s": 3600, "max_retries": 100}]}"#.to_string(),
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": ":"}}]}"#.to_string(),
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "h:99999999"}}]}"#.to_string(),
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "é:1"}}]}"#.to_string(),
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "scheme": null, "endpoint_override": "h:1"}}]}"#.to_string(),
        r#"{"cpu_bytes_to_use": 4194304, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 18446744073709551615}, "block_size": 18446744073709551615}"#.to_string(),
    ];
    for text in &cases {
        let t = text.clone();
        let r = std::panic::catch_unwind(move || parse_check_build(&t));
        assert!(r.is_ok(), "PANIC for {text}");
        eprintln!("{text}\n  -> {:?}", r.unwrap());
    }
}

/// cpu_bytes_to_use = u64::MAX must be an error, not a panic/abort: the config refuses it
/// (more DRAM slots than a DRAM tier numbers), naming the field; the largest it takes is
/// refused by the builder, as an error. Run in a child process.
#[test]
#[ignore]
fn child_huge_dram() {
    let e = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 18446744073709551615, "block_size_bytes": 65536}"#,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("cpu_bytes_to_use") && e.contains("slots"), "{e}");
    let most = (u64::from(u32::MAX) - 1) * 65536;
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {most}, "block_size_bytes": 65536}}"#
    ))
    .unwrap();
    let r = kv_tier::builder(cfg).and_then(|b| b.build_blocking());
    assert!(r.is_err());
}

#[test]
fn huge_dram_is_an_error_not_a_crash() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "config::odd_values::child_huge_dram",
            "--nocapture",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "child: {:?}\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A malformed host:port endpoint ("http:/h" is neither a URL nor host:port) is accepted as
/// "https://http:/h" (host "http", empty port).
#[test]
fn a_malformed_endpoint_is_refused() {
    for e in ["http:/h", "https//h:9000", "h:"] {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{{"type": "obj", "store_config": {{"bucket": "b", "endpoint_override": "{e}"}}}}]}}"#
        );
        let r = KvTierConfig::from_json_str(&text)
            .and_then(|c| kv_tier::effective_config(&c, &kv_tier::registry()));
        assert!(
            r.is_err(),
            "{e} accepted as {:?}",
            r.map(|v| v["secondary_tiers"][0]["endpoint_override"].clone())
        );
    }
}
