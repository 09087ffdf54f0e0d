//! An obj tier on an S3 server below the fs tier: it serves what fs swept, a slow one drops
//! writes and answers late without refusing stores, the README's S3 commands run as written;
//! an endpoint that is no URL or that nobody listens on, a bucket name that is a path.

use kv_tier_examples::sim::run;
use kv_tier_testkit::s3;

use crate::support::*;

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
    // unbounded: it knows what it stored, and its existence listing what is not there
    assert!(r.tiers[1].known_held > 0, "{:?}", r.tiers[1]);
    assert!(r.tiers[1].known_absent > 0, "{:?}", r.tiers[1]);
    drop(server);
}

/// `--obj-cap-gb`: a bounded obj tier answers the manager's lookups from its capacity index,
/// held and not held, so keys it does not hold cost no HEAD; it still serves what fs swept,
/// and the offline model takes its bound as the level below DRAM.
#[test]
fn a_bounded_obj_tier_answers_lookups_from_its_index() {
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
    cfg.obj_cap_gb = Some(5000.0 * block / (1u64 << 30) as f64);
    cfg.s3_endpoint = Some(server.endpoint.clone());
    cfg.s3_bucket = s3::BUCKET.into();
    cfg.s3_access_key = s3::AK.into();
    cfg.s3_secret_key = s3::SK.into();
    cfg.s3_region = "us-east-1".into();
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    let obj = &r.tiers[1];
    assert!(obj.blocks_loaded > 0, "obj served nothing: {obj:?}");
    assert!(obj.known_held > 0 && obj.known_absent > 0, "{obj:?}");
    let text = kv_tier_examples::sim::render(&r);
    assert!(
        text.contains(&format!(
            "{} keys known without a probe ({} held, {} not)",
            obj.known_held + obj.known_absent,
            obj.known_held,
            obj.known_absent
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "lookups the tier cut at its own deadline {}",
            obj.own_deadline_lookups
        )),
        "{text}"
    );
    assert_eq!(r.model.model_blocks, Some(5000), "{:?}", r.model);
    assert!(!r.model.unbounded_below);
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
             // (every key asked: the subject is a slow server's late answers)
             "absent_ttl_s": 0,
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

/// The README's recipe: `kv-tier s3-server`, then serve_sim with the endpoint and keys and
/// no bucket (its default is the server's).
#[test]
fn the_readme_s3_commands_run_as_written() {
    let s3 = s3_server();
    let endpoint = format!("http://127.0.0.1:{}", s3.port);
    let mut args: Vec<String> = [
        "--s3-endpoint",
        &endpoint,
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
