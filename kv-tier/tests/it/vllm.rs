//! vLLM's config shapes (its `kv_connector_extra_config` for the tiering spec) build a manager with
//! the built-in tiers unchanged, the engine adding only what vLLM's connector reads off the engine;
//! and the obj tier's object keys are vLLM's.

use std::sync::Arc;

use kv_tier::{BlockKey, KvTierConfig, Locality, RequestId, SecondaryTier, TierEvent};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{s3, test_key};

use crate::support::*;

#[test]
fn the_fs_only_shape_builds_unchanged_with_events_and_locality() {
    let dir = tempfile::tempdir().unwrap();
    // as vLLM's usage guide writes it
    let text = format!(
        r#"{{
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": {},
        "block_size": 16,
        "eviction_policy": "lru",
        "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies",
        "store_threshold": 0,
        "secondary_tiers": [
            {{"type": "fs", "module_path": "vllm.v1.kv_offload.tiering.fs.manager",
              "root_dir": {:?}, "n_read_threads": 16, "n_write_threads": 16,
              "enable_kv_events": true, "locality": "LOCAL"}}
        ]}}"#,
        64 * BS,
        dir.path()
    );
    // `kv-tier config check` before the engine adds anything
    let as_given = KvTierConfig::from_json_str(&text).unwrap();
    let eff = kv_tier::effective_config(&as_given, &kv_tier::registry()).unwrap();
    assert_eq!(eff["block_size_bytes"], serde_json::Value::Null);
    assert_eq!(eff["block_size"], 16);
    assert_eq!(eff["store_threshold"], 0);
    assert_eq!(eff["max_tracker_size"], 64000);
    assert_eq!(
        eff["cache_policy_module_path"],
        "vllm.v1.kv_offload.cpu.policies"
    );
    let fs = &eff["secondary_tiers"][0];
    assert_eq!(fs["type"], "fs");
    assert_eq!(fs["module_path"], "vllm.v1.kv_offload.tiering.fs.manager");
    assert_eq!(fs["root_dir"], dir.path().to_str().unwrap());
    assert_eq!(
        (
            fs["n_read_threads"].as_u64(),
            fs["n_write_threads"].as_u64()
        ),
        (Some(16), Some(16))
    );
    assert_eq!(fs["enable_kv_events"], true);
    assert_eq!(fs["locality"], "LOCAL");
    assert_eq!(fs["checksum"], "none", "a default, filled in");

    let m = kv_tier::builder(engine_config(&text))
        .unwrap()
        .namespace(model_namespace())
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..3).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    m.runtime().block_on(m.wait_idle());
    let fs_events: Vec<_> = m
        .take_events()
        .into_iter()
        .filter(|e| e.tier == "fs")
        .collect();
    assert!(
        fs_events
            .iter()
            .all(|e| e.locality == Locality::Local && !e.removed)
    );
    let mut got: Vec<BlockKey> = fs_events.iter().flat_map(|e| e.keys.clone()).collect();
    got.sort();
    let mut want = keys.clone();
    want.sort();
    assert_eq!(got, want, "the blocks are written in parallel: any order");
    // in vLLM's directory: <root>/<model>_<digest>_r0/...
    let ns = model_namespace();
    assert!(
        dir.path()
            .join(ns.rank_dir_name())
            .join(ns.block_rel_path(&keys[0]).split_once('/').unwrap().1)
            .is_file()
    );
}

#[test]
fn the_fs_and_obj_shape_builds_unchanged_and_events_follow_each_tier() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(s3::S3Server::start());
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"{{
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": {},
        "secondary_tiers": [
            {{"type": "fs", "root_dir": {:?}}},
            {{"type": "obj", "prefix": "kv", "io_threads": 4,
              "enable_kv_events": true, "locality": "remote",
              "store_config": {{"bucket": "{}", "endpoint_override": "{}", "scheme": "http",
                                "access_key": "{}", "secret_key": "{}",
                                "session_token": "", "region": "", "ca_bundle": ""}}}}
        ]}}"#,
        64 * BS,
        dir.path(),
        s3::BUCKET,
        // vLLM's form: host:port, the scheme in its own key
        server.endpoint.trim_start_matches("http://"),
        s3::AK,
        s3::SK
    );
    let as_given = KvTierConfig::from_json_str(&text).unwrap();
    let eff = kv_tier::effective_config(&as_given, &kv_tier::registry()).unwrap();
    let (fs, obj) = (&eff["secondary_tiers"][0], &eff["secondary_tiers"][1]);
    assert_eq!(fs["enable_kv_events"], false, "off by default, as in vLLM");
    assert_eq!(obj["bucket"], s3::BUCKET);
    assert_eq!(obj["endpoint_override"], server.endpoint.as_str());
    assert_eq!(obj["scheme"], "http", "vLLM's store_config default");
    assert_eq!(obj["region"], serde_json::Value::Null, "\"\" is unset");
    assert_eq!(obj["io_threads"], 4);
    assert_eq!(obj["locality"], "REMOTE");

    let m = rt.block_on(async {
        kv_tier::builder(engine_config(&text))
            .unwrap()
            .namespace(model_namespace())
            .build()
            .await
            .unwrap()
    });
    let keys: Vec<_> = (0..3).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    rt.block_on(m.wait_idle());
    let ev = m.take_events();
    assert!(
        ev.iter().all(|e| e.tier != "fs"),
        "fs events are off: {ev:?}"
    );
    let mut obj_keys: Vec<BlockKey> = ev
        .iter()
        .filter(|e| e.tier == "obj")
        .inspect(|e| assert_eq!(e.locality, Locality::Remote))
        .flat_map(|e| e.keys.clone())
        .collect();
    obj_keys.sort();
    let mut want = keys.clone();
    want.sort();
    assert_eq!(obj_keys, want, "uploads run concurrently: any order");
    // the fs tier recorded nothing at all: nothing grows while its events are off
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    assert_eq!(fs.stats().blocks.blocks_written, 3);
    assert!(kv_tier::SecondaryTier::take_events(&*fs).is_empty());
    rt.block_on(m.shutdown()).unwrap();
}

#[test]
fn the_bounded_fs_shape_of_the_fork_builds_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"{{
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": {},
        "blocks_per_chunk": 1,
        "secondary_tiers": [
            {{"type": "fs", "root_dir": {:?}, "n_read_threads": 8, "n_write_threads": 8,
              "max_storage_size_gb": 0.5, "evictor_type": "lru",
              "gc_low_watermark": 0.8, "gc_grace_s": 60,
              "gc_interval_s": 10, "gc_stamp_interval_s": 30, "enable_kv_events": false}}
        ]}}"#,
        64 * BS,
        dir.path()
    );
    let eff = kv_tier::effective_config(
        &KvTierConfig::from_json_str(&text).unwrap(),
        &kv_tier::registry(),
    )
    .unwrap();
    let fs = &eff["secondary_tiers"][0];
    assert_eq!(fs["gc_max_size_gb"], 0.5);
    assert_eq!(fs["gc_low_watermark"], 0.8);
    assert_eq!(fs["gc_grace_s"], 60.0);
    assert_eq!(eff["blocks_per_chunk"], 1);
    let m = kv_tier::builder(engine_config(&text))
        .unwrap()
        .namespace(model_namespace())
        .build_blocking()
        .unwrap();
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    assert_eq!(
        fs.stats().gc.map(|g| g.cap_bytes),
        Some(1 << 29),
        "bounded at gc_max_size_gb"
    );
}

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
        .namespace(model_namespace())
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
        format!("kv//{}", model_namespace().block_rel_path(&keys[0]))
    );
    rt.block_on(m.shutdown()).unwrap();
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
            let t =
                kv_tier::obj::ObjTier::with_store("obj", store.clone(), cfg, model_namespace(), BS)
                    .await
                    .unwrap();
            let k = test_key(1);
            let rel = model_namespace().block_rel_path(&k);
            assert_eq!(t.vllm_object_key(&k), format!("{want_vllm}{rel}"));
            assert_eq!(t.object_path(&k), format!("{want_kv}{rel}"));
            t.shutdown().await.unwrap();
        }
    });
}
