//! Every documented range (the manager's, the tier options', the fs and obj tiers' `RANGES`) is
//! checked at its edges, naming the field.

use std::time::Duration;

use kv_tier::Error;
use kv_tier_core::{KvTierConfig, TieringManager};
use kv_tier_testkit::MemoryTier;

use crate::support::*;

#[test]
fn every_numeric_option_out_of_range_is_refused_naming_it() {
    let fields = [
        "probe_timeout_s",
        "job_timeout_s",
        "job_timeout_per_block_s",
        "lease_s",
        "promotion_cut_margin",
    ];
    for f in fields {
        assert!(
            kv_tier_core::config::RANGES.iter().any(|r| r.0 == f),
            "{f} has no documented range"
        );
        for v in ["-1", "1e300", "1e19", "0.0000000001", "\"1\""] {
            if f == "job_timeout_per_block_s" && v == "0.0000000001" {
                continue; // in range: 0 is allowed
            }
            let json =
                format!(r#"{{"cpu_bytes_to_use": 8192, "block_size_bytes": 4096, "{f}": {v}}}"#);
            match KvTierConfig::from_json_str(&json) {
                Err(kv_tier_core::Error::InvalidConfig { field, .. }) => {
                    assert_eq!(field, f, "{json}")
                }
                other => panic!("{json}: {other:?}"),
            }
        }
    }
    let ok = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 8192, "block_size_bytes": 4096, "probe_timeout_s": 600,
            "job_timeout_s": 86400, "job_timeout_per_block_s": 3600, "lease_s": 86400,
            "promotion_cut_margin": 1000}"#,
    )
    .unwrap();
    let at_one =
        r#"{"cpu_bytes_to_use": 8192, "block_size_bytes": 4096, "promotion_cut_margin": 1}"#;
    assert_eq!(
        KvTierConfig::from_json_str(at_one)
            .unwrap()
            .promotion_cut_margin,
        1.0
    );
    // the largest deadline of any job converts without overflow
    assert!(ok.job_timeout(usize::MAX) > Duration::from_secs(86_400));
}

/// `KvTierConfig::store_threshold`'s doc: "(default 0; 0 and 1: every block, as in vLLM;
/// range 0 to 1,000,000)". Values inside the documented range must be accepted.
#[test]
fn store_threshold_inside_its_documented_range_is_accepted() {
    // the field's doc says "range 0 to 10,000" (it said 1,000,000 once, against the code)
    let at = |v: u64| {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "store_threshold": {v}}}"#
        ))
    };
    for v in [0, 1, 10_000u64] {
        assert!(at(v).is_ok(), "store_threshold {v}: {}", at(v).unwrap_err());
    }
    for v in [10_001u64, 1_000_000] {
        let e = at(v).expect_err("past the documented range").to_string();
        assert!(e.contains("store_threshold"), "{e}");
    }
    // and the RANGES table agrees with the doc
    let row = kv_tier::core::config::RANGES
        .iter()
        .find(|r| r.0 == "store_threshold")
        .unwrap();
    assert_eq!(row.2, 10_000.0, "RANGES says {row:?}, the field doc 10,000");
}

/// Every RANGES row of the manager, fs and obj configs: min and max accepted, just outside
/// refused naming the field (under `secondary_tiers[0]` for tiers).
#[test]
fn every_ranges_row_is_enforced_at_its_edges_naming_the_field() {
    let mut bad = Vec::new();
    let int_fields = [
        "blocks_per_chunk",
        "store_threshold",
        "max_tracker_size",
        "event_buffer_keys",
        "n_read_threads",
        "n_write_threads",
        "tmp_reap_age_s",
        "gc_max_tracked",
        "io_threads",
        "max_retries",
    ];
    let fmt = |f: &str, v: f64| -> String {
        if int_fields.contains(&f) {
            format!("{}", v as i128)
        } else {
            format!("{v:e}")
        }
    };
    let outside = |f: &str, lo: f64, hi: f64| -> Vec<f64> {
        if int_fields.contains(&f) {
            vec![lo - 1.0, hi + 1.0]
        } else {
            let below = if lo == 0.0 { -1e-9 } else { lo * (1.0 - 1e-6) };
            vec![below, hi * (1.0 + 1e-6)]
        }
    };
    // manager
    for &(f, lo, hi) in kv_tier::core::config::RANGES {
        let extra = if f == "blocks_per_chunk" {
            format!(", {LAYOUT}")
        } else {
            String::new()
        };
        for (v, ok) in [(lo, true), (hi, true)]
            .into_iter()
            .chain(outside(f, lo, hi).into_iter().map(|v| (v, false)))
        {
            let text = format!(
                r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "{f}": {}{extra}}}"#,
                fmt(f, v)
            );
            match (config_check(&text), ok) {
                (Ok(_), true) => {}
                (Err(e), false) if field_of(&e) == f => {}
                (r, _) => bad.push(format!("{f} = {}: {:?}", fmt(f, v), r.map(|_| "accepted"))),
            }
        }
    }
    // fs
    for &(f, lo, hi) in kv_tier::fs::RANGES {
        let dir = "/tmp/kv-tier-never-created";
        let mut base = format!(r#""type": "fs", "root_dir": "{dir}""#);
        if f.starts_with("gc_") && f != "gc_max_size_gb" {
            base.push_str(r#", "gc_max_size_gb": 1"#);
        }
        if f == "gc_stamp_interval_s" {
            base.push_str(r#", "gc_grace_s": 31536000"#);
        }
        if f == "gc_grace_s" {
            base.push_str(r#", "gc_stamp_interval_s": 0.000001"#);
        }
        if f == "shared_lease_s" {
            base.push_str(r#", "shared": true, "gc_max_size_gb": 1"#);
        }
        let mut cases = vec![(hi, true)];
        if f != "gc_grace_s" {
            // gc_grace_s must exceed gc_stamp_interval_s, whose min is gc_grace_s's min
            cases.push((lo, true));
        }
        for v in outside(f, lo, hi) {
            if f == "gc_rescan_interval_s" && v < 1.0 && v > 0.0 {
                continue;
            }
            cases.push((v, false));
        }
        for (v, ok) in cases {
            let text = format!(
                r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{{{base}, "{f}": {}}}]}}"#,
                fmt(f, v)
            );
            let want = format!("secondary_tiers[0].{f}");
            match (config_check(&text), ok) {
                (Ok(_), true) => {}
                (Err(e), false) if field_of(&e) == want => {}
                (r, _) => bad.push(format!(
                    "fs {f} = {}: {:?}",
                    fmt(f, v),
                    r.map(|_| "accepted").map_err(|e| e.to_string())
                )),
            }
        }
    }
    // obj
    for &(f, lo, hi) in kv_tier::obj::RANGES {
        let mut base = r#""type": "obj", "bucket": "b", "endpoint_override": "http://127.0.0.1:1""#
            .to_string();
        if f == "low_watermark" {
            base.push_str(r#", "max_size_gb": 1"#);
        }
        if f == "shared_lease_s" {
            base.push_str(r#", "shared": true, "max_size_gb": 1"#);
        }
        for (v, ok) in [(lo, true), (hi, true)]
            .into_iter()
            .chain(outside(f, lo, hi).into_iter().map(|v| (v, false)))
        {
            let text = format!(
                r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{{{base}, "{f}": {}}}]}}"#,
                fmt(f, v)
            );
            let want = format!("secondary_tiers[0].{f}");
            match (config_check(&text), ok) {
                (Ok(_), true) => {}
                (Err(e), false) if field_of(&e) == want => {}
                (r, _) => bad.push(format!(
                    "obj {f} = {}: {:?}",
                    fmt(f, v),
                    r.map(|_| "accepted").map_err(|e| e.to_string())
                )),
            }
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// A number JSON cannot hold as f64 (1e309) or a huge integer literal: the error should name the
/// field, like every other bad value.
#[test]
fn out_of_range_json_numbers_name_the_field() {
    let mut bad = Vec::new();
    for (f, v) in [
        ("probe_timeout_s", "1e309"),
        ("lease_s", "-1e309"),
        ("cpu_bytes_to_use", "1e309"),
        ("cpu_bytes_to_use", "184467440737095516160000000000"),
    ] {
        let text = if f == "cpu_bytes_to_use" {
            format!(r#"{{"cpu_bytes_to_use": {v}, "block_size_bytes": 65536}}"#)
        } else {
            format!(r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "{f}": {v}}}"#)
        };
        match config_check(&text) {
            Err(e) if e.to_string().contains(f) => {}
            Err(e) => bad.push(format!("{f} = {v}: {e} (field {:?})", field_of(&e))),
            Ok(_) => bad.push(format!("{f} = {v}: accepted")),
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// vLLM's `blocks_per_chunk` has a range (1 to 65,536) and is the layout's `blocks_per_file`; the
/// same number given as `layout.blocks_per_file` (or other layout numbers) must have one too.
#[test]
fn layout_numbers_have_ranges() {
    let mut accepted = Vec::new();
    for (k, v) in [
        ("blocks_per_file", "65537"),
        ("blocks_per_file", "18446744073709551615"),
        ("tokens_per_hash", "18446744073709551615"),
        ("pp_size", "18446744073709551615"),
    ] {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "layout": {{"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "parallel_agnostic": false, "{k}": {v}}}}}"#
        );
        if config_check(&text).is_ok() {
            accepted.push(format!("layout.{k} = {v} accepted"));
        }
    }
    let groups = r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "kv_cache_groups": [{"tokens_per_block": 0, "layer_names": []}]}}"#;
    if config_check(groups).is_ok() {
        accepted.push("layout.kv_cache_groups[0].tokens_per_block = 0 accepted".into());
    }
    assert!(accepted.is_empty(), "{accepted:#?}");
}

/// Every documented range: both ends accepted, just beyond refused naming the field.
#[test]
fn every_manager_range_is_checked_at_its_documented_ends() {
    // (field, documented min, documented max, integer)
    let ranges: &[(&str, f64, f64, bool)] = &[
        ("probe_timeout_s", 0.001, 600.0, false),
        ("job_timeout_s", 0.01, 86_400.0, false),
        ("job_timeout_per_block_s", 0.0, 3_600.0, false),
        ("lease_s", 0.001, 86_400.0, false),
        ("shutdown_timeout_s", 0.01, 86_400.0, false),
        ("write_back_max_dram_fraction", 0.01, 1.0, false),
        ("blocks_per_chunk", 1.0, 65_536.0, true),
        // `store_threshold`: "range 0 to 10,000" (KvTierConfig::store_threshold)
        ("store_threshold", 0.0, 10_000.0, true),
        ("max_tracker_size", 1.0, 100_000_000.0, true),
        ("event_buffer_keys", 1.0, 1e10, true),
    ];
    let mut problems = Vec::new();
    for &(field, min, max, int) in ranges {
        let text = |v: String| {
            format!(r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536, "{field}": {v}}}"#)
        };
        let fmt = |v: f64| {
            if int {
                format!("{}", v as u64)
            } else {
                format!("{v}")
            }
        };
        for v in [min, max] {
            if let Err(e) = KvTierConfig::from_json_str(&text(fmt(v))).and_then(|c| c.validate()) {
                problems.push(format!("{field} = {} refused: {e}", fmt(v)));
            }
        }
        let below = if int {
            (min - 1.0, min >= 1.0)
        } else {
            (min - min.max(1e-9) * 0.5 - 1e-9, true)
        };
        let above = if int { max + 1.0 } else { max * 1.001 };
        let mut outs = vec![fmt(above)];
        if below.1 {
            outs.push(fmt(below.0));
        }
        outs.push("-1".into());
        for v in outs {
            match KvTierConfig::from_json_str(&text(v.clone())) {
                Ok(_) => problems.push(format!("{field} = {v} accepted")),
                Err(e) if !e.to_string().contains(field) => {
                    problems.push(format!("{field} = {v} refused without naming it: {e}"))
                }
                Err(_) => {}
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
}

/// The per-tier manager options: both documented ends accepted, beyond refused naming the
/// field at construction.
#[test]
fn every_tier_option_range_is_checked_at_its_documented_ends() {
    let ranges: &[(&str, &[&str], &[&str])] = &[
        (
            "probe_budget_s",
            &["0.0001", "600"],
            &["0.00009", "601", "-1", "0"],
        ),
        (
            "write_back_limit_mb",
            &["0.000001", "1e9"],
            &["0.0000009", "1.1e9", "-1", "0"],
        ),
        ("admit_after_lookups", &["0", "10000"], &["10001", "-1"]),
        (
            "write_budget_mb_per_s",
            &["0.001", "1e9"],
            &["0.0009", "1.1e9", "-1", "0"],
        ),
    ];
    let mut problems = Vec::new();
    for &(field, ok, bad) in ranges {
        let attempt = |v: &str| -> Result<TieringManager, Error> {
            let c = KvTierConfig::from_json_str(&format!(
                r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536,
                    "secondary_tiers": [{{"type": "memory", "{field}": {v}}}]}}"#
            ))?;
            let mut reg = kv_tier::registry();
            MemoryTier::register(&mut reg).unwrap();
            kv_tier::builder(c)?.registry(reg).build_blocking()
        };
        for v in ok {
            match attempt(v) {
                Ok(m) => m.shutdown_blocking().unwrap(),
                Err(e) => problems.push(format!("{field} = {v} refused: {e}")),
            }
        }
        for v in bad {
            match attempt(v) {
                Ok(m) => {
                    problems.push(format!("{field} = {v} accepted"));
                    m.shutdown_blocking().unwrap();
                }
                Err(e) if !field_of(&e).contains(field) && !e.to_string().contains(field) => {
                    problems.push(format!("{field} = {v} refused without naming it: {e}"))
                }
                Err(_) => {}
            }
        }
    }
    assert!(problems.is_empty(), "{problems:#?}");
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
    assert_eq!(field_of(&e.unwrap_err()), "block_size");
}
