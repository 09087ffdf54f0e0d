//! vLLM's config shapes (its `kv_connector_extra_config` for the tiering spec) build a
//! manager unchanged, with their keys' meaning: the engine adds only what vLLM's connector
//! reads off the engine itself (the block's bytes and the namespace); events are gated and
//! labelled per tier, and their buffers are bounded.

mod common;
use common::{BS, memory_manager};
use kv_tier::{BlockKey, KvTierConfig, Locality, Namespace, RequestId, RunFields};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{fill_block, s3, test_key};

fn namespace() -> Namespace {
    Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap()
}

/// What an engine does with vLLM's config: parse it as is, set the block's bytes.
fn engine_config(text: &str) -> KvTierConfig {
    let mut cfg = KvTierConfig::from_json_str(text).expect("vLLM's shape parses");
    assert_eq!(cfg.block_size_bytes, 0, "vLLM's shape has no byte size");
    cfg.block_size_bytes = BS as u64;
    cfg
}

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
        .namespace(namespace())
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
    let ns = namespace();
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
            .namespace(namespace())
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
        .namespace(namespace())
        .build_blocking()
        .unwrap();
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    assert_eq!(
        fs.stats().gc.map(|g| g.cap_bytes),
        Some(1 << 29),
        "bounded at gc_max_size_gb"
    );
}

fn refused(text: &str) -> (String, String) {
    let r = KvTierConfig::from_json_str(text)
        .and_then(|c| kv_tier::effective_config(&c, &kv_tier::registry()).map(|_| ()));
    match r {
        Err(kv_tier::Error::InvalidConfig { field, reason }) => (field, reason),
        other => panic!("{text}: expected a refusal, got {other:?}"),
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
fn a_config_without_the_block_size_is_refused_at_build_naming_it() {
    let cfg = KvTierConfig::from_json_str(r#"{"cpu_bytes_to_use": 1048576}"#).unwrap();
    let err = kv_tier::builder(cfg).unwrap_err();
    assert!(err.to_string().contains("`block_size_bytes`"), "{err}");
}

#[test]
fn vllm_chunking_keys_must_agree_with_the_namespace() {
    let mut cfg = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 1048576, "block_size": 32, "secondary_tiers": []}"#,
    )
    .unwrap();
    cfg.block_size_bytes = BS as u64;
    // 32 tokens per offloaded block over 16-token engine blocks: 2 per file, not 1
    let err = kv_tier::builder(cfg)
        .unwrap()
        .namespace(namespace())
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
fn event_buffers_are_bounded_and_their_losses_counted() {
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "event_buffer_keys": 4,
            "secondary_tiers": [{{"type": "memory", "name": "loud", "enable_kv_events": true}},
                                {{"type": "memory", "name": "quiet"}}]}}"#,
        64 * BS
    ))
    .unwrap();
    let mut registry = kv_tier::registry();
    kv_tier_testkit::MemoryTier::register(&mut registry).unwrap();
    let m = kv_tier::builder(cfg)
        .unwrap()
        .registry(registry)
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..10).map(test_key).collect();
    for k in &keys {
        engine_store(&m, RequestId(1), &[*k]); // one event per block
        m.runtime().block_on(m.wait_idle());
    }
    // nobody took the events: each buffer kept the newest 4 keys and counted the rest
    let s = m.stats();
    assert_eq!(s.tiers[0].events_dropped, 6, "loud");
    assert_eq!(s.tiers[1].events_dropped, 0, "quiet records nothing");
    assert_eq!(s.events_dropped, 6 + 6, "DRAM's 6 and loud's 6");
    let ev = m.take_events();
    let loud: Vec<BlockKey> = ev
        .iter()
        .filter(|e| e.tier == "loud")
        .flat_map(|e| e.keys.clone())
        .collect();
    assert_eq!(loud, keys[6..], "the oldest went first");
    let dram: Vec<BlockKey> = ev
        .iter()
        .filter(|e| e.tier == "cpu" && !e.removed)
        .flat_map(|e| e.keys.clone())
        .collect();
    assert_eq!(dram, keys[6..]);
    assert!(ev.iter().all(|e| e.tier != "quiet"));
    let quiet = m.tier::<kv_tier_testkit::MemoryTier>("quiet").unwrap();
    assert_eq!(quiet.len(), 10, "stored all the same");
    assert!(kv_tier::SecondaryTier::take_events(&*quiet).is_empty());
}

#[test]
fn store_threshold_admits_to_dram_only_blocks_looked_up_that_often() {
    let m = memory_manager(r#", "store_threshold": 2"#, "");
    let req = kv_tier::RequestContext::new(1);
    let (a, b) = (test_key(1), test_key(2));
    // one lookup each: neither is admitted yet
    m.lookup_prefix(&[a, b], &req);
    let mut p = m.prepare_store(&[a, b]).unwrap();
    assert!(p.slots().is_empty(), "no slot before the second lookup");
    drop(p);
    assert_eq!(m.stats().stores_not_admitted, 2);
    // the same request asking again (polling while it waits) does not count twice
    m.lookup(&a, &req);
    let mut p = m.prepare_store(&[a]).unwrap();
    assert!(p.slots().is_empty(), "one request asked, twice");
    drop(p);
    // another request's lookup of a: two requests asked for it (b, past the miss at a,
    // was asked for by one)
    m.lookup(&a, &kv_tier::RequestContext::new(2));
    let mut p = m.prepare_store(&[a, b]).unwrap();
    let slots: Vec<BlockKey> = p.slots().iter().map(|(k, _)| *k).collect();
    assert_eq!(slots, [a], "a asked twice, b once");
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(RequestId(1));
    assert_eq!(m.lookup(&a, &req), kv_tier::LookupResult::Hit);
    assert_eq!(m.stats().stores_not_admitted, 4);
}

#[test]
fn a_tier_admits_after_n_lookups_and_within_its_write_budget() {
    // 1 MiB/s of 64 KiB blocks: a bucket of 16 blocks, then 16 a second
    let m = memory_manager(
        "",
        r#"{"type": "memory", "name": "ssd", "admit_after_lookups": 2},
           {"type": "memory", "name": "budget", "write_budget_mb_per_s": 1},
           {"type": "memory", "name": "all"}"#,
    );
    let (r1, r2) = (
        kv_tier::RequestContext::new(1),
        kv_tier::RequestContext::new(2),
    );
    let twice: Vec<_> = (0..4).map(test_key).collect();
    let once: Vec<_> = (10..30).map(test_key).collect();
    m.lookup_prefix(&twice, &r1);
    m.lookup_prefix(&twice, &r2);
    // one request polling: counts once
    m.lookup_prefix(&once, &r1);
    m.lookup_prefix(&once, &r1);
    let mut all = twice.clone();
    all.extend(&once);
    engine_store(&m, RequestId(1), &all);
    m.runtime().block_on(m.wait_idle());
    let tier = |n: &str| m.tier::<kv_tier_testkit::MemoryTier>(n).unwrap();
    assert_eq!(tier("all").len(), 24);
    let ssd = tier("ssd");
    assert_eq!(ssd.len(), 4, "only the blocks asked for twice");
    assert!(twice.iter().all(|k| ssd.get(k).is_some()));
    assert!(
        (16..=17).contains(&tier("budget").len()),
        "one second of budget (16 blocks, one more if the clock ticked): {}",
        tier("budget").len()
    );
    let s = m.stats();
    let by = |n: &str| s.tiers.iter().find(|t| t.name == n).unwrap();
    assert_eq!(by("ssd").not_admitted, 20);
    assert_eq!(by("ssd").over_write_budget, 0);
    assert_eq!(
        by("budget").over_write_budget + tier("budget").len() as u64,
        24,
        "every block written or counted"
    );
    assert_eq!(
        (by("all").not_admitted, by("all").over_write_budget),
        (0, 0)
    );
}
