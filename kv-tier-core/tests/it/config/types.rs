//! Values of the wrong JSON type, top level and nested, are refused naming their full path.

use kv_tier::KvTierConfig;

use crate::support::*;

/// Each numeric top-level field given a string, an object, an array, a bool, a float where an
/// integer goes, a negative, 2^64: refused, naming exactly that field.
#[test]
fn wrong_types_of_top_level_numbers_name_the_field() {
    let ints = [
        "cpu_bytes_to_use",
        "block_size_bytes",
        "block_size",
        "blocks_per_chunk",
        "store_threshold",
        "max_tracker_size",
        "event_buffer_keys",
    ];
    let reals = [
        "probe_timeout_s",
        "job_timeout_s",
        "job_timeout_per_block_s",
        "lease_s",
        "shutdown_timeout_s",
        "write_back_max_dram_fraction",
    ];
    let mut bad = Vec::new();
    for f in ints.iter().chain(reals.iter()) {
        let mut vals = vec!["\"1\"", "{\"a\": 1}", "[1]", "true", "-1", "-1e300"];
        if ints.contains(f) {
            vals.extend(["18446744073709551616", "1.5", "65536.0", "1e5"]);
        }
        for v in vals {
            let text = if *f == "cpu_bytes_to_use" {
                format!(r#"{{"cpu_bytes_to_use": {v}, "block_size_bytes": 65536, {LAYOUT}}}"#)
            } else {
                format!(r#"{{"cpu_bytes_to_use": 4194304, "{f}": {v}, {LAYOUT}}}"#)
            };
            match config_check(&text) {
                Err(e) if field_of(&e) == *f => {}
                Err(e) => bad.push(format!("{f} = {v}: named {:?}: {e}", field_of(&e))),
                Ok(_) => bad.push(format!("{f} = {v}: accepted")),
            }
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Tier options given the wrong type, nested objects, floats for integers, 2^64, negative: every
/// one refused naming `secondary_tiers[0].<field>`.
#[test]
fn wrong_types_of_tier_options_name_the_field() {
    let fs = r#""type": "fs", "root_dir": "/tmp/kv-tier-never""#;
    let obj = r#""type": "obj", "bucket": "b", "endpoint_override": "http://127.0.0.1:1""#;
    let cases: Vec<(&str, &str, &str)> = vec![
        (fs, "n_read_threads", "1.5"),
        (fs, "n_read_threads", "\"16\""),
        (fs, "n_read_threads", "18446744073709551616"),
        (fs, "n_write_threads", "-1"),
        (fs, "n_write_threads", "{\"n\": 1}"),
        (fs, "tmp_reap_age_s", "600.5"),
        (fs, "tmp_reap_age_s", "null"),
        (fs, "checksum", "\"md5\""),
        (fs, "checksum", "1"),
        (fs, "fsync", "\"yes\""),
        (fs, "direct_io", "1"),
        (fs, "gc_max_size_gb", "\"10\""),
        (fs, "gc_max_size_gb", "[10]"),
        (fs, "gc_max_size_gb", "-0.0"),
        (fs, "gc_max_size_gb", "1e-320"),
        (fs, "probe_budget_s", "{}"),
        (fs, "write_back_limit_mb", "0"),
        (fs, "write_back_policy", "\"WAIT\""),
        (fs, "admit_after_lookups", "10001"),
        (fs, "admit_after_lookups", "1e3"),
        (fs, "shared", "\"true\""),
        (obj, "io_threads", "0"),
        (obj, "io_threads", "4.0"),
        (obj, "max_retries", "101"),
        (obj, "request_timeout_s", "\"5\""),
        (obj, "exists_ttl_s", "0"),
        (obj, "absent_ttl_s", "-0.5"),
        (obj, "absent_ttl_s", "3601"),
        (obj, "absent_ttl_s", "\"5\""),
        (obj, "lookup_timeout_s", "-1"),
        (obj, "max_size_gb", "0"),
        (obj, "low_watermark", "0"),
        (obj, "prefix", "[\"a\"]"),
        (obj, "region", "\"us east\""),
        (obj, "checksum", "\"CRC32C\""),
        (obj, "scheme", "\"ftp\""),
    ];
    let mut bad = Vec::new();
    for (base, f, v) in cases {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{{{base}, "{f}": {v}}}]}}"#
        );
        let want = format!("secondary_tiers[0].{f}");
        match config_check(&text) {
            Err(e) if field_of(&e) == want => {}
            Err(e) => bad.push(format!("{f} = {v}: named {:?}: {e}", field_of(&e))),
            Ok(eff) => {
                // -0.0 and 1e-320 are below 1e-9: refused
                bad.push(format!(
                    "{f} = {v}: accepted as {}",
                    eff["secondary_tiers"][0][f]
                ))
            }
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// layout.rank of the wrong type or out of u32 range: refused naming `layout.rank`.
#[test]
fn layout_rank_errors_name_it() {
    for v in ["-1", "1.5", "\"0\"", "4294967296", "null", "[0]", "true"] {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "layout": {{"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "rank": {v}}}}}"#
        );
        let e = config_check(&text).expect_err(v);
        assert_eq!(field_of(&e), "layout.rank", "{v}: {e}");
    }
    let e = config_check(
        r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "modle": 1}}"#,
    )
    .unwrap_err();
    assert!(field_of(&e).starts_with("layout"), "{e}");
}

/// Promise (kv-tier-core/src/config/mod.rs module docs): "Every invalid value is rejected
/// with an error naming the field"; kv-tier/src/lib.rs: "an error naming the field". Values
/// of the wrong JSON type (a string for a number, a fraction for an integer, a number for a
/// bool or a string), top-level and nested, are refused naming their full path.
#[test]
fn wrongly_typed_values_are_refused_naming_their_path() {
    let tier = |t: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, "secondary_tiers": [{t}]}}"#
        )
    };
    let top =
        |kv: &str| format!(r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, {kv}}}"#);
    let cases: Vec<(String, &str)> = vec![
        (
            r#"{"cpu_bytes_to_use": "1048576", "block_size_bytes": 4096}"#.into(),
            "cpu_bytes_to_use",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576.5, "block_size_bytes": 4096}"#.into(),
            "cpu_bytes_to_use",
        ),
        (top(r#""store_threshold": "2""#), "store_threshold"),
        (top(r#""store_threshold": 1.5"#), "store_threshold"),
        (top(r#""max_tracker_size": -1"#), "max_tracker_size"),
        (top(r#""event_buffer_keys": "10""#), "event_buffer_keys"),
        (top(r#""blocks_per_chunk": 2.5"#), "blocks_per_chunk"),
        (top(r#""eviction_policy": 1"#), "eviction_policy"),
        (top(r#""probe_timeout_s": "1""#), "probe_timeout_s"),
        (
            tier(r#"{"type": "fs", "root_dir": "/tmp/kv", "n_read_threads": "16"}"#),
            "secondary_tiers[0].n_read_threads",
        ),
        (
            tier(r#"{"type": "fs", "root_dir": "/tmp/kv", "n_write_threads": 2.5}"#),
            "secondary_tiers[0].n_write_threads",
        ),
        (
            tier(r#"{"type": "fs", "root_dir": "/tmp/kv", "enable_kv_events": "yes"}"#),
            "secondary_tiers[0].enable_kv_events",
        ),
        (
            tier(r#"{"type": "fs", "root_dir": "/tmp/kv", "locality": 1}"#),
            "secondary_tiers[0].locality",
        ),
        (
            tier(r#"{"type": "fs", "root_dir": 5}"#),
            "secondary_tiers[0].root_dir",
        ),
        (
            tier(r#"{"type": "obj", "store_config": {"bucket": 5}}"#),
            "secondary_tiers[0].store_config.bucket",
        ),
        (
            tier(r#"{"type": "obj", "bucket": "b", "io_threads": "4"}"#),
            "secondary_tiers[0].io_threads",
        ),
        (tier(r#"{"type": 3}"#), "secondary_tiers[0].type"),
        (tier(r#""fs""#), "secondary_tiers[0]"),
    ];
    let mut bad = Vec::new();
    for (json, path) in &cases {
        let e = err_of(json);
        if !e.contains(path) {
            bad.push(format!("{path}: {e}"));
        }
    }
    assert!(bad.is_empty(), "not named by path:\n{}", bad.join("\n"));
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
        let got = field_of(&err);
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
        let got = field_of(&err);
        if &got != want {
            bad.push(format!("{kv}: named {got}, want {want}"));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}
