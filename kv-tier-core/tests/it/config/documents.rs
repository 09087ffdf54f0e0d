//! Documents that are not a config object, and keys given twice, are errors, never panics.

use crate::support::*;

/// Whole documents that are not a config object: errors, no panics.
#[test]
fn degenerate_documents_are_errors() {
    watch_panics();
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let deep_layout = format!(
        r#"{{"cpu_bytes_to_use": 4194304, "layout": {}{}}}"#,
        "{\"a\":".repeat(5000),
        "}".repeat(5000)
    );
    for text in [
        "",
        " ",
        "null",
        "[]",
        "1",
        "\"x\"",
        "{}",
        "{",
        r#"{"cpu_bytes_to_use": 4194304} trailing"#,
        r#"{"cpu_bytes_to_use": 4194304}{"cpu_bytes_to_use": 1}"#,
        "\u{feff}{\"cpu_bytes_to_use\": 4194304}",
        &deep,
        &deep_layout,
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": {}}"#,
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [null]}"#,
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [[]]}"#,
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{}]}"#,
        r#"{"cpu_bytes_to_use": 4194304, "secondary_tiers": [{"type": null}]}"#,
        r#"{"cpu_bytes_to_use": 4194304, "layout": []}"#,
        r#"{"cpu_bytes_to_use": 4194304, "layout": {}}"#,
    ] {
        let t = text.to_string();
        let r = std::panic::catch_unwind(move || config_check(&t));
        let short: String = text.chars().take(60).collect();
        assert!(r.is_ok(), "panic for {short:?}");
        assert!(r.unwrap().is_err(), "accepted: {short:?}");
    }
    // {} names the one required key
    let e = config_check("{}").unwrap_err();
    assert_eq!(field_of(&e), "cpu_bytes_to_use", "{e}");
    assert_no_panics("degenerate documents");
}

/// A key given twice: JSON parsers differ on which wins (serde_json: the last; Python's json
/// used by vLLM: the last too). A value that is refused alone must not slip through because a
/// later duplicate is valid... at least the config should refuse the ambiguity.
#[test]
fn duplicated_keys_are_refused() {
    let mut accepted = Vec::new();
    for text in [
        r#"{"cpu_bytes_to_use": 0, "cpu_bytes_to_use": 4194304, "block_size_bytes": 65536}"#,
        r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "probe_timeout_s": -1, "probe_timeout_s": 1}"#,
        r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{"type": "fs", "root_dir": "/a", "root_dir": "/b"}]}"#,
    ] {
        if let Ok(eff) = config_check(text) {
            accepted.push(format!(
                "{text}\n  -> accepted (effective cpu {}, probe {}, tiers {})",
                eff["cpu_bytes_to_use"], eff["probe_timeout_s"], eff["secondary_tiers"]
            ));
        }
    }
    assert!(accepted.is_empty(), "{}", accepted.join("\n"));
}
