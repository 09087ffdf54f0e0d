use super::*;

fn err_field(text: &str) -> (String, String) {
    match KvTierConfig::from_json_str(text).unwrap_err() {
        Error::InvalidConfig { field, reason } => (field, reason),
        other => panic!("expected InvalidConfig, got {other}"),
    }
}

#[test]
fn full_config_parses() {
    let cfg = KvTierConfig::from_json_str(
        r#"{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8192, "block_size_bytes": 4096,
            "eviction_policy": "lru",
            "secondary_tiers": [{"type": "fs", "root_dir": "/x", "n_read_threads": 4},
                                {"type": "fs", "name": "fs2", "root_dir": "/y"}],
            "layout": {"model_name": "m", "dtype": "float16", "tokens_per_hash": 16, "rank": 2}}"#,
    )
    .unwrap();
    assert_eq!(cfg.secondary_tiers.len(), 2);
    assert_eq!(cfg.secondary_tiers[0].name, "fs");
    assert_eq!(cfg.secondary_tiers[1].name, "fs2");
    assert_eq!(cfg.secondary_tiers[0].options["n_read_threads"], 4);
    assert!(!cfg.secondary_tiers[0].options.contains_key("type"));
    assert_eq!(cfg.layout.unwrap().rank, 2);
}

#[test]
fn every_invalid_value_names_its_field() {
    let cases = [
        (
            r#"{"cpu_bytes_to_use": 0, "block_size_bytes": 1}"#,
            "cpu_bytes_to_use",
        ),
        (
            r#"{"cpu_bytes_to_use": -5, "block_size_bytes": 1}"#,
            "cpu_bytes_to_use",
        ),
        (
            r#"{"cpu_bytes_to_use": "1G", "block_size_bytes": 1}"#,
            "cpu_bytes_to_use",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 0}"#,
            "block_size_bytes",
        ),
        (
            r#"{"cpu_bytes_to_use": 4095, "block_size_bytes": 20}"#,
            "cpu_bytes_to_use",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "eviction_policy": "lfu"}"#,
            "eviction_policy",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "cpu_byte_to_use": 3}"#,
            "cpu_byte_to_use",
        ),
        (r#"{"block_size_bytes": 1}"#, "cpu_bytes_to_use"),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "secondary_tiers": [{"root_dir": "/x"}]}"#,
            "secondary_tiers[0].type",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "secondary_tiers": [{"type": 3}]}"#,
            "secondary_tiers[0].type",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "secondary_tiers": [{"type": "a"}, {"type": "a"}]}"#,
            "secondary_tiers[1].name",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "secondary_tiers": {}}"#,
            "secondary_tiers",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 0}}"#,
            "layout.tokens_per_hash",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 1, "rank": -1}}"#,
            "layout.rank",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 1, "tp": 1}}"#,
            "layout.tp",
        ),
        (
            r#"{"cpu_bytes_to_use": 4096, "block_size_bytes": 1, "spec_name": "CPUOffloadingSpec"}"#,
            "spec_name",
        ),
    ];
    for (text, want) in cases {
        let (field, reason) = err_field(text);
        assert_eq!(field, want, "for {text}: reason {reason}");
        assert!(!reason.is_empty());
    }
}

#[test]
fn syntax_errors_are_reported() {
    // cut inside a value: the value's key is named
    let (field, reason) = err_field("{\"cpu_bytes_to_use\": ");
    assert_eq!(field, "cpu_bytes_to_use");
    assert!(reason.contains("not valid JSON"), "{reason}");
    let (field, reason) = err_field("{\"cpu_bytes_to_use\": 1} trailing");
    assert_eq!(field, "");
    assert!(reason.contains("not valid JSON"), "{reason}");
}

#[test]
fn tier_options_parse_with_field_paths() {
    #[derive(Deserialize, Debug)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Opts {
        root_dir: String,
        #[serde(default)]
        n_read_threads: Option<u32>,
    }
    let spec = TierSpec::new("fs")
        .option("root_dir", "/x")
        .option("n_read_threads", "many");
    let err = spec
        .parse_options::<Opts>()
        .unwrap_err()
        .within("secondary_tiers[0]");
    assert!(
        err.to_string()
            .contains("`secondary_tiers[0].n_read_threads`"),
        "{err}"
    );
}
