//! vLLM's keys keep vLLM's meaning (`block_size`, `blocks_per_chunk`, `spec_name`, policies,
//! `store_config`, the fs evictor's keys) or are refused saying why, and the engine's namespace
//! must agree with them.

use kv_tier::KvTierConfig;
use kv_tier_testkit::test_key;

use crate::support::*;

/// vLLM's fs-evictor key `max_storage_size_gb` is taken as `gc_max_size_gb`: an invalid value must
/// be reported under the key the user wrote.
#[test]
fn max_storage_size_gb_errors_name_the_key_written() {
    let mut bad = Vec::new();
    for v in ["0", "-1", "1e10", "\"10\""] {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{{"type": "fs", "root_dir": "/tmp/x", "max_storage_size_gb": {v}, "evictor_type": "lru"}}]}}"#
        );
        let e = config_check(&text).expect_err(v);
        let f = field_of(&e);
        if f != "secondary_tiers[0].max_storage_size_gb" {
            bad.push(format!("max_storage_size_gb = {v}: named {f:?} ({e})"));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Promise (kv-tier/src/lib.rs "vLLM's config, unchanged"): "A `kv_connector_extra_config`
/// written for vLLM's tiering spec parses as is. vLLM's keys keep their meaning" (the list of
/// keys there). A config using every listed key parses, and each key has its meaning in the
/// effective config.
#[test]
fn every_listed_vllm_key_is_accepted_with_its_meaning() {
    let json = r#"{
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8388608,
        "block_size": 64,
        "eviction_policy": "arc",
        "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.arc",
        "store_threshold": 3,
        "max_tracker_size": 1234,
        "layout": {"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16},
        "secondary_tiers": [
            {"type": "fs", "module_path": "vllm.v1.kv_offload.tiering.fs",
             "enable_kv_events": true, "locality": "LOCAL", "root_dir": "/tmp/kv-vllm",
             "n_read_threads": 7, "n_write_threads": 5},
            {"type": "obj", "module_path": "vllm.v1.kv_offload.tiering.obj",
             "enable_kv_events": false, "locality": "REMOTE",
             "store_config": {"bucket": "kv-cache", "endpoint_override": "http://127.0.0.1:9",
                              "access_key": "ak", "secret_key": "sk", "region": "us-east-1"},
             "prefix": "prod", "io_threads": 9}
        ]
    }"#;
    let c = KvTierConfig::from_json_str(json).unwrap();
    assert_eq!(c.eviction_policy, kv_tier::EvictionPolicy::Arc);
    assert_eq!((c.store_threshold, c.max_tracker_size), (3, 1234));
    assert_eq!(c.block_size_bytes, 0, "left to the engine");
    let eff = kv_tier::effective_config(&c, &kv_tier::registry()).unwrap();
    assert_eq!(eff["block_size"], 64);
    assert_eq!(eff["eviction_policy"], "arc");
    assert_eq!(eff["store_threshold"], 3);
    assert_eq!(eff["max_tracker_size"], 1234);
    assert_eq!(
        eff["layout"]["blocks_per_file"], 4,
        "block_size 64 / tokens_per_hash 16"
    );
    let fs = &eff["secondary_tiers"][0];
    assert_eq!(fs["n_read_threads"], 7);
    assert_eq!(fs["n_write_threads"], 5);
    assert_eq!(fs["enable_kv_events"], true);
    assert_eq!(fs["locality"], "LOCAL");
    assert_eq!(fs["module_path"], "vllm.v1.kv_offload.tiering.fs");
    let obj = &eff["secondary_tiers"][1];
    assert_eq!(obj["bucket"], "kv-cache");
    assert_eq!(obj["prefix"], "prod");
    assert_eq!(obj["io_threads"], 9);
    assert_eq!(obj["enable_kv_events"], false);
    assert_eq!(obj["locality"], "REMOTE");
}

/// Promise (kv-tier/src/lib.rs): "vLLM keys kv-tier does not implement
/// (`offload_prompt_only`, `self_describing_kv_events`, `max_recompute_pending_tokens`,
/// `canonical_layout`) are refused saying why"; "Unknown keys and out-of-range numbers are
/// refused at construction, with an error naming the field" — nested ones too, named by their
/// path.
#[test]
fn unimplemented_and_unknown_keys_are_refused_by_name_at_any_depth() {
    let base = |extra: &str, tier: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096{extra},
                "secondary_tiers": [{tier}]}}"#
        )
    };
    let fs = r#"{"type": "fs", "root_dir": "/tmp/kv""#;
    for key in [
        "offload_prompt_only",
        "self_describing_kv_events",
        "max_recompute_pending_tokens",
        "canonical_layout",
    ] {
        let e = err_of(&base(&format!(r#", "{key}": true"#), ""));
        assert!(e.contains(key), "{key}: {e}");
        assert!(e.len() > key.len() + 30, "refused without saying why: {e}");
    }
    let cases: Vec<(String, &str)> = vec![
        (base(r#", "bogus_top": 1"#, ""), "bogus_top"),
        (
            base("", &format!(r#"{fs}, "bogus_fs": 1}}"#)),
            "secondary_tiers[0].bogus_fs",
        ),
        (
            base(
                "",
                &format!(
                    r#"{fs}}}, {{"type": "fs", "name": "b", "root_dir": "/tmp/b", "bogus2": 1}}"#
                ),
            ),
            "secondary_tiers[1].bogus2",
        ),
        (
            base(
                "",
                r#"{"type": "obj", "store_config": {"bucket": "b", "bogus_nested": 1}}"#,
            ),
            "secondary_tiers[0].store_config.bogus_nested",
        ),
        (
            base(
                r#", "layout": {"model_name": "m", "dtype": "d", "tokens_per_hash": 16, "bogus_l": 1}"#,
                "",
            ),
            "layout.bogus_l",
        ),
    ];
    for (json, path) in cases {
        let e = err_of(&json);
        assert!(e.contains(path), "want {path:?} named: {e}");
    }
}

/// Promise (kv-tier-core/src/config/mod.rs): `block_size`: "tokens per offloaded block (a
/// multiple of the layout's `tokens_per_hash` ...; it sets the layout's `blocks_per_file`,
/// as vLLM sets `blocks_per_chunk`). Not with `blocks_per_chunk`"; `blocks_per_chunk`:
/// "(default 1, range 1 to 65,536); the layout's `blocks_per_file`. Not with `block_size`".
/// The fs tier then writes into the namespace folder of that `blocks_per_file`.
#[test]
fn block_size_and_blocks_per_chunk_meaning_and_exclusivity() {
    let with = |kv: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, {kv}, {}}}"#,
            LAYOUT
        )
    };
    let e = err_of(&with(r#""block_size": 32, "blocks_per_chunk": 2"#));
    assert!(e.contains("block_size"), "{e}");
    for bad in [
        r#""block_size": 40"#,
        r#""block_size": 8"#,
        r#""block_size": 0"#,
    ] {
        let e = err_of(&with(bad));
        assert!(e.contains("block_size"), "{bad}: {e}");
    }
    for bad in [r#""blocks_per_chunk": 0"#, r#""blocks_per_chunk": 65537"#] {
        let e = err_of(&with(bad));
        assert!(e.contains("blocks_per_chunk"), "{bad}: {e}");
    }
    // meaning: the same folder from block_size 48 and from blocks_per_chunk 3
    let mut dirs = Vec::new();
    for kv in [
        r#""block_size": 48"#,
        r#""blocks_per_chunk": 3"#,
        r#""blocks_per_chunk": 65536"#,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let c = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, {kv}, {},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
            LAYOUT,
            dir.path()
        ))
        .unwrap();
        let m = build(c);
        store_evicting(&m, 1, &[test_key(1)]);
        block_on_idle(&m);
        m.shutdown_blocking().unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.ends_with("_r0"))
            .collect();
        assert_eq!(names.len(), 1, "{kv}: {names:?}");
        let cfg_json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(&names[0]).join("config.json")).unwrap(),
        )
        .unwrap();
        dirs.push((names[0].clone(), cfg_json["blocks_per_file"].clone()));
    }
    assert_eq!(
        dirs[0], dirs[1],
        "block_size 48 and blocks_per_chunk 3 differ"
    );
    assert_eq!(dirs[0].1, 3);
    assert_eq!(dirs[2].1, 65536);
}

/// Promise (kv-tier/src/lib.rs): `eviction_policy` with `cache_policy_module_path` ("a
/// built-in policy only"); config/mod.rs: "accepted when `eviction_policy` names a built-in
/// policy (then unused, as in vLLM); a policy from a Python module is refused naming this
/// field"; `spec_name` (`"TieringOffloadingSpec"`) is vLLM's; per tier `module_path` "a
/// registered type only".
#[test]
fn spec_name_policy_module_and_module_path_keep_vllms_meaning() {
    let base = r#""cpu_bytes_to_use": 1048576, "block_size_bytes": 4096"#;
    let ok = |extra: &str| {
        KvTierConfig::from_json_str(&format!("{{{base}{extra}}}"))
            .unwrap_or_else(|e| panic!("{extra}: {e}"))
    };
    ok(r#", "spec_name": "TieringOffloadingSpec""#);
    let c = ok(r#", "eviction_policy": "lru", "cache_policy_module_path": "my.policies""#);
    assert_eq!(c.eviction_policy, kv_tier::EvictionPolicy::Lru);
    assert_eq!(
        ok("").eviction_policy,
        kv_tier::EvictionPolicy::Lru,
        "the default"
    );
    // kv-tier's own policy beside vLLM's two, named as given in the effective config
    let c = ok(r#", "eviction_policy": "Chain""#);
    assert_eq!(c.eviction_policy, kv_tier::EvictionPolicy::Chain);
    let eff = kv_tier::effective_config(&c, &kv_tier::registry()).unwrap();
    assert_eq!(eff["eviction_policy"], "chain");
    let e = err_of(&format!(
        r#"{{{base}, "eviction_policy": "lfu_custom", "cache_policy_module_path": "my.policies"}}"#
    ));
    assert!(e.contains("cache_policy_module_path"), "{e}");
    let e = err_of(&format!(r#"{{{base}, "eviction_policy": "fifo"}}"#));
    assert!(e.contains("eviction_policy"), "{e}");
    let e = err_of(&format!(r#"{{{base}, "spec_name": "CPUOffloadingSpec"}}"#));
    assert!(e.contains("spec_name"), "{e}");
    // module_path of an unregistered type: building fails naming it
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{{base}, "secondary_tiers": [{{"type": "redis", "module_path": "my.tiers.redis"}}]}}"#
    ))
    .unwrap();
    let e = kv_tier::builder(c)
        .unwrap()
        .build_blocking()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("redis") || e.contains("module_path"), "{e}");
}

/// Promise (kv-tier/src/lib.rs "vLLM's config, unchanged"): "`block_size` or
/// `blocks_per_chunk` (engine blocks per offloaded block: the layout's `blocks_per_file`)";
/// "What vLLM's connector reads off the engine, the engine gives: ... the namespace
/// ([`TieringManagerBuilder::namespace`] ...)"; config.rs `check_namespace`: "The namespace
/// `ns` (the engine's, or the config's layout) checked against vLLM's chunking keys". A vLLM
/// config with `block_size` and an engine namespace must not silently drop `block_size`:
/// either the blocks go to the folder of `blocks_per_file` = block_size / tokens_per_hash, or
/// building fails naming the key.
#[test]
fn block_size_with_an_engine_namespace_is_applied_or_refused_never_ignored() {
    for (key, v, bpf) in [("block_size", 32u64, 2u64), ("blocks_per_chunk", 4, 4)] {
        let dir = tempfile::tempdir().unwrap();
        let mut c = KvTierConfig::from_json_str(&format!(
            r#"{{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1048576, "{key}": {v},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
            dir.path()
        ))
        .unwrap();
        c.block_size_bytes = BS as u64;
        let ns = kv_tier::Namespace::new(
            kv_tier::RunFields::new("org/model", "torch.bfloat16", 16),
            0,
        )
        .unwrap();
        match kv_tier::builder(c).unwrap().namespace(ns).build_blocking() {
            Err(e) => assert!(
                e.to_string().contains(key),
                "{key}: refused without naming it: {e}"
            ),
            Ok(m) => {
                store_evicting(&m, 1, &[test_key(1)]);
                block_on_idle(&m);
                m.shutdown_blocking().unwrap();
                let cfgs: Vec<serde_json::Value> = std::fs::read_dir(dir.path())
                    .unwrap()
                    .filter_map(|e| {
                        let p = e.unwrap().path().join("config.json");
                        std::fs::read_to_string(p).ok()
                    })
                    .map(|t| serde_json::from_str(&t).unwrap())
                    .collect();
                assert_eq!(cfgs.len(), 1);
                assert_eq!(
                    cfgs[0]["blocks_per_file"], bpf,
                    "{key} {v} ignored: blocks written under {}",
                    cfgs[0]
                );
            }
        }
    }
}

#[test]
fn vllm_values_kv_tier_cannot_honour_are_refused_naming_the_field() {
    let base = |tier: &str, top: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": 1048576{top}, "secondary_tiers": [{{"type": "fs", "root_dir": "/tmp/x"{tier}}}]}}"#
        )
    };
    let cases = [
        (base(r#", "locality": "nearby""#, ""), "secondary_tiers[0].locality", "LOCAL"),
        (base(r#", "locality": """#, ""), "secondary_tiers[0].locality", "REMOTE"),
        (base(r#", "enable_kv_events": 1"#, ""), "secondary_tiers[0].enable_kv_events", ""),
        (base(r#", "module_path": 3"#, ""), "secondary_tiers[0].module_path", "string"),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "MyTier", "module_path": "my_pkg.tiers"}]}"#.to_string(),
            "secondary_tiers[0].module_path",
            "registered at compile time",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "MyTier"}]}"#.to_string(),
            "secondary_tiers[0].type",
            "unknown tier type",
        ),
        (
            base("", r#", "eviction_policy": "MyPolicy", "cache_policy_module_path": "my_pkg.p""#),
            "cache_policy_module_path",
            "Python modules",
        ),
        (base("", r#", "eviction_policy": "lfu""#), "eviction_policy", "lru"),
        (base("", r#", "block_size": 16, "blocks_per_chunk": 1"#), "block_size", "only one"),
        (base("", r#", "blocks_per_chunk": 0"#), "blocks_per_chunk", ""),
        (base("", r#", "store_threshold": -1"#), "store_threshold", ""),
        (base("", r#", "max_tracker_size": 0"#), "max_tracker_size", ""),
        (base("", r#", "offload_prompt_only": true"#), "offload_prompt_only", "engine"),
        (base("", r#", "canonical_layout": true"#), "canonical_layout", "canonical_format"),
        (base("", r#", "spec_module_path": "my.spec""#), "spec_module_path", "Python"),
        (base("", r#", "no_such_key": 1"#), "no_such_key", "unknown"),
        (base(r#", "no_such_key": 1"#, ""), "secondary_tiers[0].no_such_key", "unknown"),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "endpoint": "http://x"}}]}"#.to_string(),
            "secondary_tiers[0].store_config.endpoint",
            "unknown",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "obj", "bucket": "a", "store_config": {"bucket": "b"}}]}"#.to_string(),
            "secondary_tiers[0].store_config.bucket",
            "twice",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": 7}}]}"#.to_string(),
            "secondary_tiers[0].store_config.bucket",
            "",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "obj", "store_config": "b"}]}"#.to_string(),
            "secondary_tiers[0].store_config",
            "object",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "h:1", "use_virtual_addressing": true}}]}"#.to_string(),
            "secondary_tiers[0].store_config.use_virtual_addressing",
            "NIXL",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b", "endpoint_override": "h:notaport"}}]}"#.to_string(),
            "secondary_tiers[0].store_config.endpoint_override",
            "",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576, "secondary_tiers": [{"type": "obj", "store_config": {"bucket": "b b"}}]}"#.to_string(),
            "secondary_tiers[0].store_config.bucket",
            "",
        ),
        (base(r#", "evictor_type": "fail_on_full", "max_storage_size_gb": 1"#, ""), "secondary_tiers[0].evictor_type", "lru"),
        (base(r#", "evictor_type": "lru""#, ""), "secondary_tiers[0].evictor_type", "max_storage_size_gb"),
        (base(r#", "max_storage_size_gb": 1, "gc_max_size_gb": 1"#, ""), "secondary_tiers[0].max_storage_size_gb", "keep one"),
    ];
    for (text, field, hint) in cases {
        let (f, reason) = refused(&text);
        assert_eq!(f, field, "{text}: {reason}");
        assert!(reason.contains(hint), "{text}: {reason:?} lacks {hint:?}");
    }
}

#[test]
fn vllm_chunking_keys_must_agree_with_the_namespace() {
    let mut cfg = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 1048576, "block_size": 32, "secondary_tiers": []}"#,
    )
    .unwrap();
    cfg.block_size_bytes = BS_64K as u64;
    // 32 tokens per offloaded block over 16-token engine blocks: 2 per file, not 1
    let err = kv_tier::builder(cfg)
        .unwrap()
        .namespace(model_namespace())
        .build_blocking()
        .unwrap_err();
    assert!(err.to_string().contains("`block_size`"), "{err}");
    // in the config's own layout, block_size sets blocks_per_file (vLLM's blocks_per_chunk)
    let cfg = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536, "block_size": 32,
            "layout": {"model_name": "m", "dtype": "float16", "tokens_per_hash": 16}}"#,
    )
    .unwrap();
    assert_eq!(cfg.layout.unwrap().fields.blocks_per_file, 2);
    let (field, _) = refused(
        r#"{"cpu_bytes_to_use": 1048576, "block_size": 24,
            "layout": {"model_name": "m", "dtype": "float16", "tokens_per_hash": 16}}"#,
    );
    assert_eq!(field, "block_size");
    let (field, _) = refused(
        r#"{"cpu_bytes_to_use": 1048576, "blocks_per_chunk": 2,
            "layout": {"model_name": "m", "dtype": "float16", "tokens_per_hash": 16, "blocks_per_file": 1}}"#,
    );
    assert_eq!(field, "blocks_per_chunk");
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

/// The config's `layout` and the engine's `builder.namespace(ns)` disagree: which directory
/// the blocks go to is ambiguous, and should be refused rather than one silently winning.
#[test]
fn a_layout_and_a_different_engine_namespace_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "layout": {{"model_name": "other/model", "dtype": "torch.float16", "tokens_per_hash": 32}},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
        64 * BS_64K,
        dir.path()
    ))
    .unwrap();
    cfg.block_size_bytes = BS_64K as u64;
    let r = kv_tier::builder(cfg)
        .unwrap()
        .namespace(model_namespace())
        .build_blocking();
    let used: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(r.is_err(), "built; directories: {used:?}");
}
