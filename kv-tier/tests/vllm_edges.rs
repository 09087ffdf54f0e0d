//! Adversarial tests for issue 14 (vLLM drop-in config, namespace, events, admission).

use std::sync::{Arc, Mutex};

use kv_tier::{
    BlockKey, Error, JobResult, KvTierConfig, LoadJob, Locality, LookupResult, Namespace,
    OffloadPolicy, ProtectGuard, RequestContext, RequestId, RunFields, SecondaryTier, StoreJob,
    TierEvent, TierInfo, async_trait,
};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{MemoryTier, s3, test_key};

mod common;
use common::{BS, memory_manager};

fn ns() -> Namespace {
    Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap()
}

fn field_of(e: Error) -> String {
    match e {
        Error::InvalidConfig { field, .. } => field,
        other => panic!("expected InvalidConfig, got {other}"),
    }
}

// ---------------------------------------------------------------- config errors and panics

/// Parse, check, and (with a namespace) build: an Err is fine, a panic is not.
fn parse_check_build(text: &str) -> std::result::Result<(), String> {
    let cfg = KvTierConfig::from_json_str(text).map_err(|e| e.to_string())?;
    kv_tier::effective_config(&cfg, &kv_tier::registry()).map_err(|e| e.to_string())?;
    let mut cfg = cfg;
    if cfg.block_size_bytes == 0 {
        cfg.block_size_bytes = BS as u64;
    }
    let mut b = kv_tier::builder(cfg).map_err(|e| e.to_string())?;
    b = b.namespace(ns());
    let m = b.build_blocking().map_err(|e| e.to_string())?;
    m.shutdown_blocking().map_err(|e| e.to_string())?;
    Ok(())
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

/// A block_size of 2^40 tokens makes 2^36 engine blocks per offloaded block: blocks_per_chunk
/// has a range (1..=65536); the equivalent block_size has none.
#[test]
fn a_huge_block_size_is_refused_like_blocks_per_chunk() {
    let e = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "block_size": 1099511627776,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16}}"#,
    );
    let e2 = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "blocks_per_chunk": 68719476736,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16}}"#,
    );
    assert!(e2.is_err(), "blocks_per_chunk 2^36 is refused");
    assert_eq!(field_of(e.unwrap_err()), "block_size");
}

/// cpu_bytes_to_use = u64::MAX must be an error, not a panic/abort. Run in a child process.
#[test]
#[ignore]
fn child_huge_dram() {
    let cfg = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 18446744073709551615, "block_size_bytes": 65536}"#,
    )
    .unwrap();
    let r = kv_tier::builder(cfg).and_then(|b| b.build_blocking());
    assert!(r.is_err());
}

#[test]
fn huge_dram_is_an_error_not_a_crash() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "child_huge_dram", "--nocapture"])
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

#[test]
fn errors_name_the_right_field() {
    let cases: &[(&str, &str)] = &[
        (
            r#"{"type": "fs", "root_dir": "/x", "locality": " LOCAL"}"#,
            "secondary_tiers[0].locality",
        ),
        (
            r#"{"type": "fs", "root_dir": "/x", "locality": "LOCALLY"}"#,
            "secondary_tiers[0].locality",
        ),
        (
            r#"{"type": "fs", "root_dir": "/x", "locality": []}"#,
            "secondary_tiers[0].locality",
        ),
        (
            r#"{"type": "fs", "root_dir": "/x", "enable_kv_events": 1}"#,
            "secondary_tiers[0].enable_kv_events",
        ),
        (
            r#"{"type": "fs", "root_dir": "/x", "admit_after_lookups": 1.5}"#,
            "secondary_tiers[0].admit_after_lookups",
        ),
        (
            r#"{"type": "fs", "root_dir": "/x", "write_budget_mb_per_s": -1}"#,
            "secondary_tiers[0].write_budget_mb_per_s",
        ),
        (
            r#"{"type": "fs", "root_dir": "/x", "module_path": 3}"#,
            "secondary_tiers[0].module_path",
        ),
        (
            r#"{"type": "fs", "root_dir": "/x", "module_path": ""}"#,
            "secondary_tiers[0].module_path",
        ),
        (
            r#"{"type": "mine", "module_path": "pkg.tiers"}"#,
            "secondary_tiers[0].module_path",
        ),
        (
            r#"{"type": "obj", "store_config": {"bucket": 5}}"#,
            "secondary_tiers[0].store_config.bucket",
        ),
        (
            r#"{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "http://"}}"#,
            "secondary_tiers[0].store_config.endpoint_override",
        ),
        (
            r#"{"type": "obj", "store_config": {"bucket": "b", "access_key": "a"}}"#,
            "secondary_tiers[0].store_config.secret_key",
        ),
        (
            r#"{"type": "obj", "store_config": {"bucket": "b", "region": "us east"}}"#,
            "secondary_tiers[0].store_config.region",
        ),
        (
            r#"{"type": "obj", "store_config": {"bucket": "b", "scheme": "ftp", "endpoint_override": "h:1"}}"#,
            "secondary_tiers[0].store_config.scheme",
        ),
        (
            r#"{"type": "obj", "bucket": "b", "store_config": {"bucket": "b"}}"#,
            "secondary_tiers[0].store_config.bucket",
        ),
        (
            r#"{"type": "obj", "store_config": {"bucket": "b", "use_virtual_addressing": false}}"#,
            "secondary_tiers[0].store_config.use_virtual_addressing",
        ),
        (
            r#"{"type": "obj", "store_config": {"bucket": "b", "bogus": 1}}"#,
            "secondary_tiers[0].store_config.bogus",
        ),
        (
            r#"{"type": "obj", "store_config": "b"}"#,
            "secondary_tiers[0].store_config",
        ),
        (
            r#"{"type": "obj", "store_config": {"bucket": "b"}, "prefix": 3}"#,
            "secondary_tiers[0].prefix",
        ),
    ];
    let mut bad = Vec::new();
    for (tier, want) in cases {
        let text = format!(r#"{{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{tier}]}}"#);
        let err = KvTierConfig::from_json_str(&text)
            .and_then(|c| kv_tier::effective_config(&c, &kv_tier::registry()).map(|_| ()))
            .expect_err(tier);
        let got = field_of(err);
        if &got != want {
            bad.push(format!("{tier}: named {got}, want {want}"));
        }
    }
    let top: &[(&str, &str)] = &[
        (r#""store_threshold": -1"#, "store_threshold"),
        (r#""store_threshold": 1.5"#, "store_threshold"),
        (r#""event_buffer_keys": 0"#, "event_buffer_keys"),
        (r#""enable_kv_events": true"#, "enable_kv_events"),
        (
            r#""eviction_policy": "lfu", "cache_policy_module_path": "x.y""#,
            "cache_policy_module_path",
        ),
        (
            r#""cache_policy_module_path": """#,
            "cache_policy_module_path",
        ),
        (
            r#""cache_policy_module_path": 7"#,
            "cache_policy_module_path",
        ),
        (r#""spec_name": 7"#, "spec_name"),
        (r#""block_size": 16, "blocks_per_chunk": 1"#, "block_size"),
        (r#""offload_prompt_only": false"#, "offload_prompt_only"),
    ];
    for (kv, want) in top {
        let text = format!(r#"{{"cpu_bytes_to_use": 4194304, {kv}}}"#);
        let err = KvTierConfig::from_json_str(&text).expect_err(kv);
        let got = field_of(err);
        if &got != want {
            bad.push(format!("{kv}: named {got}, want {want}"));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
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

#[test]
fn store_config_forms_resolve_as_vllm_means_them() {
    let eff = |tier: &str| {
        let text = format!(r#"{{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{tier}]}}"#);
        let c = KvTierConfig::from_json_str(&text).unwrap();
        kv_tier::effective_config(&c, &kv_tier::registry()).unwrap()["secondary_tiers"][0].clone()
    };
    let t = eff(
        r#"{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "minio:9000", "scheme": "https"}}"#,
    );
    assert_eq!(t["endpoint_override"], "https://minio:9000");
    assert_eq!(t["scheme"], "https");
    let t = eff(
        r#"{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "minio:9000", "scheme": ""}}"#,
    );
    assert_eq!(t["endpoint_override"], "http://minio:9000");
    assert_eq!(t["scheme"], "http");
    let t = eff(
        r#"{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "", "access_key": "", "secret_key": "", "session_token": "", "region": "", "ca_bundle": ""}}"#,
    );
    for k in [
        "endpoint_override",
        "access_key",
        "secret_key",
        "session_token",
        "region",
        "ca_bundle",
    ] {
        assert!(t[k].is_null(), "{k}: {}", t[k]);
    }
    // the flat form keeps working; https by default there
    let t = eff(r#"{"type": "obj", "bucket": "b", "endpoint_override": "minio:9000"}"#);
    assert_eq!(t["endpoint_override"], "https://minio:9000");
    let t = eff(
        r#"{"type": "obj", "bucket": "b", "endpoint_override": "minio:9000", "scheme": "http"}"#,
    );
    assert_eq!(t["endpoint_override"], "http://minio:9000");
    assert_eq!(t["locality"], "REMOTE");
    assert_eq!(t["enable_kv_events"], false);
}

// ---------------------------------------------------------------- registry

#[test]
fn registering_a_type_twice_is_an_error_and_keeps_the_first() {
    let mut reg = kv_tier::registry();
    assert!(MemoryTier::register(&mut reg).is_ok());
    assert!(MemoryTier::register(&mut reg).is_err(), "second memory");
    assert!(kv_tier::fs::FsTier::register(&mut reg).is_err(), "fs again");
    assert!(
        kv_tier::obj::ObjTier::register(&mut reg).is_err(),
        "obj again"
    );
    assert!(reg.contains("fs") && reg.contains("memory"));
}

// ---------------------------------------------------------------- vLLM shape builds

#[test]
fn vllm_fs_and_obj_shape_with_nested_store_config_builds_and_stores() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(s3::S3Server::start());
    let hostport = server.endpoint.split_once("://").unwrap().1.to_string();
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"{{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": {}, "block_size": 16,
            "eviction_policy": "lru", "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies",
            "store_threshold": 0,
            "secondary_tiers": [
              {{"type": "fs", "module_path": "vllm.v1.kv_offload.tiering.fs.manager", "root_dir": {:?},
                "n_read_threads": 4, "n_write_threads": 4, "enable_kv_events": true, "locality": "local"}},
              {{"type": "obj", "module_path": "vllm.v1.kv_offload.tiering.obj.manager",
                "store_config": {{"bucket": "{}", "endpoint_override": "{hostport}", "access_key": "{}",
                                  "secret_key": "{}", "session_token": "", "region": "", "scheme": "", "ca_bundle": ""}},
                "prefix": "kv", "io_threads": 4, "enable_kv_events": true, "locality": "Remote"}}
            ]}}"#,
        64 * BS,
        dir.path(),
        s3::BUCKET,
        s3::AK,
        s3::SK
    );
    let mut cfg = KvTierConfig::from_json_str(&text).unwrap();
    cfg.block_size_bytes = BS as u64;
    let m = kv_tier::builder(cfg)
        .unwrap()
        .runtime(rt.handle().clone())
        .namespace(ns())
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..3).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    m.on_request_finished(RequestId(1));
    rt.block_on(m.wait_idle());
    let ev = m.take_events();
    let of = |t: &str| -> Vec<&TierEvent> { ev.iter().filter(|e| e.tier == t).collect() };
    assert_eq!(of("fs").iter().map(|e| e.keys.len()).sum::<usize>(), 3);
    assert_eq!(of("obj").iter().map(|e| e.keys.len()).sum::<usize>(), 3);
    assert!(of("fs").iter().all(|e| e.locality == Locality::Local));
    assert!(of("obj").iter().all(|e| e.locality == Locality::Remote));
    let obj = m.tier::<kv_tier::obj::ObjTier>("obj").unwrap();
    assert!(obj.object_path(&keys[0]).starts_with("kv/org_model_"));
    assert_eq!(
        obj.vllm_object_key(&keys[0]),
        format!("kv//{}", ns().block_rel_path(&keys[0]))
    );
    rt.block_on(m.shutdown()).unwrap();
}

/// Locality overrides apply to what take_events returns, both directions.
#[test]
fn locality_override_applies_both_ways_and_off_records_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(s3::S3Server::start());
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS},
            "secondary_tiers": [
              {{"type": "fs", "root_dir": {:?}, "enable_kv_events": true, "locality": "REMOTE"}},
              {{"type": "fs", "name": "fs_quiet", "root_dir": {:?}, "enable_kv_events": false}},
              {{"type": "obj", "bucket": "{}", "endpoint_override": "{}", "scheme": "http",
                "access_key": "{}", "secret_key": "{}", "enable_kv_events": true, "locality": "local"}}
            ]}}"#,
        64 * BS,
        dir.path().join("a"),
        dir.path().join("b"),
        s3::BUCKET,
        server.endpoint,
        s3::AK,
        s3::SK
    );
    let cfg = KvTierConfig::from_json_str(&text).unwrap();
    let m = kv_tier::builder(cfg)
        .unwrap()
        .runtime(rt.handle().clone())
        .namespace(ns())
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..4).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    rt.block_on(m.wait_idle());
    let ev = m.take_events();
    assert!(
        ev.iter()
            .filter(|e| e.tier == "fs")
            .all(|e| e.locality == Locality::Remote)
    );
    assert!(
        ev.iter()
            .filter(|e| e.tier == "obj")
            .all(|e| e.locality == Locality::Local)
    );
    assert_eq!(
        ev.iter()
            .filter(|e| e.tier == "obj")
            .map(|e| e.keys.len())
            .sum::<usize>(),
        4
    );
    assert!(ev.iter().all(|e| e.tier != "fs_quiet"));
    let quiet = m.tier::<kv_tier::fs::FsTier>("fs_quiet").unwrap();
    assert!(
        SecondaryTier::take_events(&*quiet).is_empty(),
        "quiet tier's own buffer grew"
    );
    assert_eq!(m.stats().tiers[1].events_dropped, 0);
    rt.block_on(m.shutdown()).unwrap();
}

/// An fs tier with events off, reopened over a directory its GC must shrink at open: its
/// open-time removals are not "losses" a consumer who turned events off should see.
#[test]
fn events_off_counts_no_losses_from_open_time_gc() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = |extra: &str| {
        let mut c = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "secondary_tiers": [{{"type": "fs", "root_dir": {:?}{extra}}}]}}"#,
            64 * BS,
            dir.path()
        ))
        .unwrap();
        c.block_size_bytes = BS as u64;
        c
    };
    let m = kv_tier::builder(cfg(""))
        .unwrap()
        .namespace(ns())
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..40).map(test_key).collect();
    for c in keys.chunks(8) {
        engine_store(&m, RequestId(1), c);
        m.runtime().block_on(m.wait_idle());
    }
    m.shutdown_blocking().unwrap();
    // ~0.5 MiB bound over 2.5 MiB of blocks
    let m = kv_tier::builder(cfg(r#", "gc_max_size_gb": 0.0005"#))
        .unwrap()
        .namespace(ns())
        .build_blocking()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(500));
    m.runtime().block_on(m.wait_idle());
    let s = m.stats();
    assert_eq!(
        s.events_dropped, 0,
        "events off, yet losses counted: {:?}",
        s.tiers[0].events_dropped
    );
    assert!(m.take_events().iter().all(|e| e.tier != "fs"));
    m.shutdown_blocking().unwrap();
}

#[test]
fn fs_event_buffer_bound_within_one_job() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "event_buffer_keys": 2,
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "enable_kv_events": true}}]}}"#,
        64 * BS,
        dir.path()
    ))
    .unwrap();
    c.block_size_bytes = BS as u64;
    let m = kv_tier::builder(c)
        .unwrap()
        .namespace(ns())
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..5).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    m.runtime().block_on(m.wait_idle());
    let s = m.stats();
    assert_eq!(s.tiers[0].events_dropped, 3);
    assert_eq!(s.events_dropped, 6, "DRAM's 3 + fs's 3");
    let ev = m.take_events();
    assert_eq!(
        ev.iter()
            .filter(|e| e.tier == "fs")
            .map(|e| e.keys.len())
            .sum::<usize>(),
        2
    );
    m.shutdown_blocking().unwrap();
}

// ---------------------------------------------------------------- admission

/// "a request asking again while it waits counts once": two requests polling alternately
/// are still two requests.
#[test]
fn store_threshold_counts_requests_not_interleaved_polls() {
    let m = memory_manager(r#", "store_threshold": 3"#, "");
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    let a = test_key(1);
    m.lookup(&a, &r1);
    m.lookup(&a, &r2);
    m.lookup(&a, &r1); // r1 polling again
    m.lookup(&a, &r2); // r2 polling again
    let mut p = m.prepare_store(&[a]).unwrap();
    assert!(
        p.slots().is_empty(),
        "only 2 requests asked, store_threshold 3"
    );
}

#[test]
fn admit_after_lookups_counts_requests_not_interleaved_polls() {
    let m = memory_manager(
        "",
        r#"{"type": "memory", "name": "ssd", "admit_after_lookups": 3}"#,
    );
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    let a = test_key(1);
    for _ in 0..3 {
        m.lookup_prefix(&[a], &r1);
        m.lookup_prefix(&[a], &r2);
    }
    engine_store(&m, RequestId(1), &[a]);
    m.runtime().block_on(m.wait_idle());
    let ssd = m.tier::<MemoryTier>("ssd").unwrap();
    assert_eq!(ssd.len(), 0, "2 requests asked; 3 required");
    assert_eq!(m.stats().tiers[0].not_admitted, 1);
}

#[test]
fn exact_write_budget_and_admission_do_not_charge_each_other() {
    // 0.125 MiB/s of 64 KiB blocks: a bucket of 2 blocks
    let m = memory_manager(
        "",
        r#"{"type": "memory", "name": "b", "write_budget_mb_per_s": 0.125},
           {"type": "memory", "name": "ab", "admit_after_lookups": 1, "write_budget_mb_per_s": 0.0625}"#,
    );
    let r = RequestContext::new(1);
    let keys: Vec<_> = (0..5).map(test_key).collect();
    // only keys[3] and keys[4] asked for
    m.lookup(&keys[3], &r);
    m.lookup(&keys[4], &r);
    engine_store(&m, RequestId(1), &keys);
    m.runtime().block_on(m.wait_idle());
    let s = m.stats();
    let t = |n: &str| m.tier::<MemoryTier>(n).unwrap().len();
    assert_eq!(t("b"), 2);
    assert_eq!(
        (s.tiers[0].over_write_budget, s.tiers[0].not_admitted),
        (3, 0)
    );
    assert_eq!(t("ab"), 1, "1 block of budget, spent on an admitted key");
    assert_eq!(
        (s.tiers[1].not_admitted, s.tiers[1].over_write_budget),
        (3, 1)
    );
    let ab = m.tier::<MemoryTier>("ab").unwrap();
    assert!(ab.contains(&keys[3]));
}

#[test]
fn store_threshold_blocks_never_cascade_and_are_counted_once() {
    let m = memory_manager(r#", "store_threshold": 2"#, r#"{"type": "memory"}"#);
    let keys: Vec<_> = (0..3).map(test_key).collect();
    m.lookup_prefix(&keys, &RequestContext::new(1));
    m.lookup_prefix(&keys[..1], &RequestContext::new(2));
    engine_store(&m, RequestId(1), &keys);
    m.runtime().block_on(m.wait_idle());
    assert_eq!(m.tier::<MemoryTier>("memory").unwrap().len(), 1);
    assert_eq!(m.stats().stores_not_admitted, 2);
    assert_eq!(m.stats().tiers[0].not_admitted, 0);
}

// ---------------------------------------------------------------- request context

#[derive(Debug)]
struct Recorder {
    inner: MemoryTier,
    log: Arc<Mutex<Vec<String>>>,
    gate: tokio::sync::watch::Sender<bool>,
}

impl Recorder {
    fn new(log: Arc<Mutex<Vec<String>>>) -> Self {
        Self {
            inner: MemoryTier::new("rec", BS),
            log,
            gate: tokio::sync::watch::channel(true).0,
        }
    }
    fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
}

#[async_trait]
impl SecondaryTier for Recorder {
    fn info(&self) -> TierInfo {
        self.inner.info()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> kv_tier::Result<Vec<bool>> {
        self.inner.lookup(keys).await
    }
    async fn store(&self, job: StoreJob) -> JobResult {
        self.note(format!("store_start {:?}", job.requests));
        let mut rx = self.gate.subscribe();
        let _ = rx.wait_for(|open| *open).await;
        let r = self.inner.store(job).await;
        self.note("store_end".into());
        r
    }
    async fn load(&self, job: LoadJob) -> JobResult {
        self.note(format!("load {:?}", job.requests));
        self.inner.load(job).await
    }
    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch(keys)
    }
    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.inner.protect(keys)
    }
    fn is_protected(&self, key: &BlockKey) -> bool {
        self.inner.is_protected(key)
    }
    fn take_events(&self) -> Vec<TierEvent> {
        self.inner.take_events()
    }
    fn on_new_request(&self, req: &RequestContext) -> OffloadPolicy {
        self.note(format!("new {:?}", req.id));
        OffloadPolicy::ChunkLevel
    }
    fn on_request_finished(&self, req: RequestId) {
        self.note(format!("finished {req:?}"));
    }
    async fn shutdown(&self) -> kv_tier::Result<()> {
        self.inner.shutdown().await
    }
}

fn rec_manager() -> (
    kv_tier::TieringManager,
    Arc<Recorder>,
    Arc<Mutex<Vec<String>>>,
) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let rec = Arc::new(Recorder::new(log.clone()));
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}}}"#,
        64 * BS
    ))
    .unwrap();
    let m = kv_tier::builder(cfg)
        .unwrap()
        .tier(rec.clone())
        .build_blocking()
        .unwrap();
    (m, rec, log)
}

#[test]
fn jobs_carry_request_ids_and_finished_waits_for_every_store() {
    let (m, rec, log) = rec_manager();
    let r7 = RequestContext::new(7);
    assert_eq!(m.on_new_request(&r7), OffloadPolicy::ChunkLevel);
    rec.gate.send_replace(false);
    engine_store(&m, RequestId(7), &[test_key(1)]);
    engine_store(&m, RequestId(7), &[test_key(2)]); // a second store of the same request
    m.on_schedule_end();
    std::thread::sleep(std::time::Duration::from_millis(100));
    m.on_request_finished(RequestId(7));
    for _ in 0..5 {
        m.on_schedule_end();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(
        !log.lock()
            .unwrap()
            .iter()
            .any(|s| s.starts_with("finished")),
        "finished before the stores ended: {:?}",
        log.lock().unwrap()
    );
    rec.gate.send_replace(true);
    m.runtime().block_on(m.wait_idle());
    m.on_schedule_end();
    let l = log.lock().unwrap().clone();
    assert_eq!(l[0], "new RequestId(7)");
    assert_eq!(
        l.iter()
            .filter(|s| *s == "store_start [RequestId(7)]")
            .count(),
        2,
        "{l:?}"
    );
    let last_end = l.iter().rposition(|s| s == "store_end").unwrap();
    let fin = l
        .iter()
        .position(|s| s == "finished RequestId(7)")
        .expect("finished delivered");
    assert!(fin > last_end, "{l:?}");
}

#[test]
fn promotion_load_jobs_carry_the_request() {
    let (m, rec, log) = rec_manager();
    let k = test_key(5);
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    m.runtime().block_on(m.wait_idle());
    m.runtime().block_on(m.reset_cache());
    let r9 = RequestContext::new(9);
    let mut steps = 0;
    loop {
        let r = m.lookup(&k, &r9);
        m.on_schedule_end();
        if r == LookupResult::Hit {
            break;
        }
        steps += 1;
        assert!(steps < 1000);
        m.runtime().block_on(m.wait_idle());
    }
    drop(rec);
    assert!(
        log.lock()
            .unwrap()
            .iter()
            .any(|s| s == "load [RequestId(9)]"),
        "{:?}",
        log.lock().unwrap()
    );
}

// ---------------------------------------------------------------- namespace

fn python_digest(fields: &serde_json::Value) -> (String, String) {
    let script = r#"
import sys, json, hashlib
f = json.loads(sys.stdin.read())
s = json.dumps(f, sort_keys=True, separators=(",", ":"))
print(s)
print(hashlib.sha256(s.encode()).hexdigest()[:12])
"#;
    use std::io::Write;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(fields.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    (
        lines.next().unwrap().to_string(),
        lines.next().unwrap().to_string(),
    )
}

fn layout_ns(layout: serde_json::Value) -> kv_tier::Result<Namespace> {
    let cfg = KvTierConfig::from_value(serde_json::json!({
        "cpu_bytes_to_use": 4194304, "layout": layout
    }))?;
    cfg.layout.unwrap().namespace()
}

#[test]
fn digests_match_python() {
    use serde_json::json;
    let base = |extra: serde_json::Value| {
        let mut v = json!({"model_name": "org/Modèle-😀\u{7f}\u{2028}\"\\", "tokens_per_hash": 16,
            "blocks_per_file": 1, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
            "dtype": "torch.bfloat16", "kv_cache_groups": [], "inference_engine": "vllm"});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    // (layout as given, the fields vLLM digests)
    let cases = vec![
        (json!({}), base(json!({}))),
        (
            json!({"tp_size": 2, "parallel_agnostic": false}),
            base(json!({"tp_size": 2, "parallel_agnostic": false})),
        ),
        (
            json!({"tp_size": 2, "replicated_layout": true}),
            base(json!({"replicated_layout": true})),
        ),
        (
            json!({"dcp_size": 2}),
            base(json!({"dcp_size": 2, "parallel_agnostic": false})),
        ),
        (
            json!({"canonical_format": "nhd-v1", "kv_cache_groups": [
            {"tokens_per_block": 16, "layer_names": ["l.0", "l.1"]},
            {"tokens_per_block": 32, "layer_names": ["s.0"]}]}),
            base(json!({"canonical_format": "nhd-v1", "kv_cache_groups": [
            {"tokens_per_block": 16, "layer_names": ["l.0", "l.1"]},
            {"tokens_per_block": 32, "layer_names": ["s.0"]}]})),
        ),
        (
            json!({"storage_format": "fp8", "blocks_per_file": 4}),
            base(json!({"storage_format": "fp8", "blocks_per_file": 4})),
        ),
    ];
    for (given, want) in cases {
        let mut layout = json!({"model_name": "org/Modèle-😀\u{7f}\u{2028}\"\\", "dtype": "torch.bfloat16", "tokens_per_hash": 16, "rank": 3});
        for (k, x) in given.as_object().unwrap() {
            layout[k] = x.clone();
        }
        let ns = layout_ns(layout).unwrap();
        let (canon, digest) = python_digest(&want);
        assert_eq!(ns.canonical_json(), canon, "{given}");
        assert_eq!(ns.digest(), digest, "{given}");
    }
}

#[test]
fn replicated_tp2_and_tp4_share_one_directory_rank_0() {
    use serde_json::json;
    let l = |tp: u64, rank: u32| {
        layout_ns(
            json!({"model_name": "deepseek/V3", "dtype": "torch.bfloat16",
            "tokens_per_hash": 64, "tp_size": tp, "replicated_layout": true, "rank": rank}),
        )
        .unwrap()
    };
    let (a, b, c) = (l(2, 1), l(4, 3), l(8, 0));
    assert_eq!(a.rank_dir_name(), b.rank_dir_name());
    assert_eq!(a.rank_dir_name(), c.rank_dir_name());
    assert_eq!(a.rank(), 0);
    assert!(a.rank_dir_name().ends_with("_r0"));
    // and through Namespace::new directly
    let mut f = RunFields::new("deepseek/V3", "torch.bfloat16", 64);
    f.tp_size = 4;
    f.replicated_layout = true;
    let d = Namespace::new(f, 2).unwrap();
    assert_eq!(d.rank_dir_name(), a.rank_dir_name());
}

#[test]
fn vllm_object_key_for_an_unnormalized_prefix() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let store = Arc::new(kv_tier::obj::object_store::memory::InMemory::new());
        for (prefix, want_vllm, want_kv) in [
            ("", "/", ""),
            ("kv", "kv//", "kv/"),
            ("a/b", "a/b//", "a/b/"),
        ] {
            let mut cfg = kv_tier::obj::ObjTierConfig::new("b");
            cfg.prefix = prefix.into();
            let t = kv_tier::obj::ObjTier::with_store("obj", store.clone(), cfg, ns(), BS)
                .await
                .unwrap();
            let k = test_key(1);
            let rel = ns().block_rel_path(&k);
            assert_eq!(t.vllm_object_key(&k), format!("{want_vllm}{rel}"));
            assert_eq!(t.object_path(&k), format!("{want_kv}{rel}"));
            t.shutdown().await.unwrap();
        }
    });
}

/// The config's `layout` and the engine's `builder.namespace(ns)` disagree: which directory
/// the blocks go to is ambiguous, and should be refused rather than one silently winning.
#[test]
fn a_layout_and_a_different_engine_namespace_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "layout": {{"model_name": "other/model", "dtype": "torch.float16", "tokens_per_hash": 32}},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
        64 * BS,
        dir.path()
    ))
    .unwrap();
    cfg.block_size_bytes = BS as u64;
    let r = kv_tier::builder(cfg)
        .unwrap()
        .namespace(ns())
        .build_blocking();
    let used: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(r.is_err(), "built; directories: {used:?}");
}
