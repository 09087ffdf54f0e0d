//! Adversarial round 32: the config's promises attacked through the public API only.
//!
//! Promises: every number has a documented range checked at construction; no value that
//! deserialises may panic later (build, open, store, load, lookup, shutdown); errors name the
//! field; unknown keys are refused; vLLM's keys keep vLLM's meaning or are refused saying why;
//! `effective_config` (what `kv-tier config check` prints) "fails naming the field, as
//! building would".
//!
//! Tests with extreme allocations run their body in a child process (this binary re-run on
//! one test), so an abort cannot take the other tests down.

use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kv_tier::{BlockKey, Error, KvTierConfig, RequestContext, SecondaryTier, TieringManager};
use serde_json::Value;

// ------------------------------------------------------------------------------ helpers

static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Records every panic of this process (background threads included), then runs the default
/// hook. Tests take the list at their end: a panic caught and turned into an error, or one on
/// a tier's own thread, still breaks "never panics".
fn watch_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let where_ = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let thread = std::thread::current().name().unwrap_or("?").to_string();
            PANICS
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(format!("[{thread}] {where_}: {msg}"));
            default(info);
        }));
    });
    PANICS.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

fn take_panics() -> Vec<String> {
    std::mem::take(&mut *PANICS.lock().unwrap_or_else(|e| e.into_inner()))
}

fn assert_no_panics(ctx: &str) {
    let p = take_panics();
    assert!(p.is_empty(), "{ctx}: panics recorded: {p:#?}");
}

/// Runs `body` in a child process (this test binary, only `name`, with ADV32_CHILD set).
fn isolated(name: &str, body: impl FnOnce()) {
    if std::env::var("ADV32_CHILD").as_deref() == Ok(name) {
        body();
        return;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env("ADV32_CHILD", name)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: String = err
        .chars()
        .rev()
        .take(3000)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    assert!(
        out.status.success(),
        "child {name} failed: {:?}\nstdout: {}\nstderr (tail): {tail}",
        out.status,
        String::from_utf8_lossy(&out.stdout)
    );
}

fn field_of(e: &Error) -> String {
    match e {
        Error::InvalidConfig { field, .. } => field.clone(),
        other => format!("<not InvalidConfig: {other}>"),
    }
}

/// Parse + effective config (what `config check` runs).
fn check(text: &str) -> Result<Value, Error> {
    let cfg = KvTierConfig::from_json_str(text)?;
    kv_tier::effective_config(&cfg, &kv_tier::registry())
}

fn build(cfg: KvTierConfig) -> kv_tier::Result<TieringManager> {
    kv_tier::builder(cfg)?.build_blocking()
}

const LAYOUT: &str =
    r#""layout": {"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}"#;

fn keys(n: u64, salt: u8) -> Vec<BlockKey> {
    (0..n)
        .map(|i| {
            let mut h = [salt; 32];
            h[..8].copy_from_slice(&(i + 1).to_le_bytes());
            BlockKey::from_hash32(h, 0)
        })
        .collect()
}

fn fill_byte(k: &BlockKey) -> u8 {
    k.hash_bytes()[0] ^ 0x5a
}

/// Stores `n` blocks, waits for the cascade, empties DRAM, then asks for them until they are
/// back (or `steps` steps pass). Returns how many came back with the right bytes. Panics
/// only on wrong bytes.
fn roundtrip(m: &TieringManager, n: u64, salt: u8, steps: usize) -> usize {
    let ks = keys(n, salt);
    let req = RequestContext::new(1000 + salt as u64);
    match m.prepare_store(&ks) {
        Ok(mut pending) => {
            for (k, s) in pending.slots() {
                s.as_mut_slice().fill(fill_byte(k));
            }
            pending.commit(req.id);
        }
        Err(e) => {
            eprintln!("prepare_store refused: {e}");
            return 0;
        }
    }
    m.on_request_finished(req.id);
    m.runtime().block_on(m.wait_idle());
    m.runtime().block_on(m.reset_cache());
    let r = RequestContext::new(2000 + salt as u64);
    let mut hit = 0;
    for _ in 0..steps {
        let f = m.lookup_prefix(&ks, &r);
        m.on_schedule_end();
        hit = f.hit;
        if f.hit == ks.len() {
            break;
        }
        m.runtime().block_on(m.wait_idle());
        std::thread::sleep(Duration::from_millis(2));
    }
    if hit > 0 {
        let views = m.prepare_load(&ks[..hit]).expect("hits load");
        for (k, v) in ks.iter().zip(&views) {
            assert!(
                v.as_slice().iter().all(|&b| b == fill_byte(k)),
                "wrong bytes for a block loaded back"
            );
        }
    }
    m.on_request_finished(r.id);
    hit
}

// ------------------------------------------------------------------------------ documented ranges

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
            match (check(&text), ok) {
                (Ok(_), true) => {}
                (Err(e), false) if field_of(&e) == f => {}
                (r, _) => bad.push(format!("{f} = {}: {:?}", fmt(f, v), r.map(|_| "accepted"))),
            }
        }
    }
    // fs
    for &(f, lo, hi) in kv_tier::fs::RANGES {
        let dir = "/tmp/adv32-never-created";
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
            match (check(&text), ok) {
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
            match (check(&text), ok) {
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

// ------------------------------------------------------------------------------ wrong types

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
            match check(&text) {
                Err(e) if field_of(&e) == *f => {}
                Err(e) => bad.push(format!("{f} = {v}: named {:?}: {e}", field_of(&e))),
                Ok(_) => bad.push(format!("{f} = {v}: accepted")),
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
        match check(&text) {
            Err(e) if e.to_string().contains(f) => {}
            Err(e) => bad.push(format!("{f} = {v}: {e} (field {:?})", field_of(&e))),
            Ok(_) => bad.push(format!("{f} = {v}: accepted")),
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Tier options given the wrong type, nested objects, floats for integers, 2^64, negative: every
/// one refused naming `secondary_tiers[0].<field>`.
#[test]
fn wrong_types_of_tier_options_name_the_field() {
    let fs = r#""type": "fs", "root_dir": "/tmp/adv32-never""#;
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
        match check(&text) {
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
        let r = std::panic::catch_unwind(move || check(&t));
        let short: String = text.chars().take(60).collect();
        assert!(r.is_ok(), "panic for {short:?}");
        assert!(r.unwrap().is_err(), "accepted: {short:?}");
    }
    // {} names the one required key
    let e = check("{}").unwrap_err();
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
        if let Ok(eff) = check(text) {
            accepted.push(format!(
                "{text}\n  -> accepted (effective cpu {}, probe {}, tiers {})",
                eff["cpu_bytes_to_use"], eff["probe_timeout_s"], eff["secondary_tiers"]
            ));
        }
    }
    assert!(accepted.is_empty(), "{}", accepted.join("\n"));
}

// ------------------------------------------------------------------------------ check vs build

/// effective_config "Fails naming the field, as building would": a block size just over a page
/// with cpu_bytes_to_use of one block passes the check (cpu >= block) but the DRAM tier rounds
/// each slot up to a page and holds none.
#[test]
fn config_check_and_build_agree_on_dram_that_holds_one_block() {
    let mut bad = Vec::new();
    for (cpu, bs) in [
        (4097u64, 4097u64),
        (8191, 4097),
        (65537, 65537),
        (1, 1),
        (3, 3),
    ] {
        let text = format!(r#"{{"cpu_bytes_to_use": {cpu}, "block_size_bytes": {bs}}}"#);
        let checked = check(&text);
        let built = KvTierConfig::from_json_str(&text)
            .and_then(build)
            .map(|m| m.shutdown_blocking());
        match (&checked, &built) {
            (Ok(_), Ok(_)) | (Err(_), Err(_)) => {}
            (Ok(_), Err(e)) => bad.push(format!(
                "cpu {cpu} block {bs}: config check says valid, building fails: {e}"
            )),
            (Err(e), Ok(_)) => bad.push(format!(
                "cpu {cpu} block {bs}: config check refuses ({e}), building succeeds"
            )),
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// vLLM's fs-evictor key `max_storage_size_gb` is taken as `gc_max_size_gb`: an invalid value must
/// be reported under the key the user wrote.
#[test]
fn max_storage_size_gb_errors_name_the_key_written() {
    let mut bad = Vec::new();
    for v in ["0", "-1", "1e10", "\"10\""] {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{{"type": "fs", "root_dir": "/tmp/x", "max_storage_size_gb": {v}, "evictor_type": "lru"}}]}}"#
        );
        let e = check(&text).expect_err(v);
        let f = field_of(&e);
        if f != "secondary_tiers[0].max_storage_size_gb" {
            bad.push(format!("max_storage_size_gb = {v}: named {f:?} ({e})"));
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

// ------------------------------------------------------------------------------ layout numbers

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
        if check(&text).is_ok() {
            accepted.push(format!("layout.{k} = {v} accepted"));
        }
    }
    let groups = r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "kv_cache_groups": [{"tokens_per_block": 0, "layer_names": []}]}}"#;
    if check(groups).is_ok() {
        accepted.push("layout.kv_cache_groups[0].tokens_per_block = 0 accepted".into());
    }
    assert!(accepted.is_empty(), "{accepted:#?}");
}

/// layout.rank of the wrong type or out of u32 range: refused naming `layout.rank`.
#[test]
fn layout_rank_errors_name_it() {
    for v in ["-1", "1.5", "\"0\"", "4294967296", "null", "[0]", "true"] {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "layout": {{"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "rank": {v}}}}}"#
        );
        let e = check(&text).expect_err(v);
        assert_eq!(field_of(&e), "layout.rank", "{v}: {e}");
    }
    let e = check(
        r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16, "modle": 1}}"#,
    )
    .unwrap_err();
    assert!(field_of(&e).starts_with("layout"), "{e}");
}

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
            let m = build(cfg).map_err(|e| format!("build: {e}"))?;
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

// ------------------------------------------------------------------------------ names and roots

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
            let m = build(cfg)?;
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
            let m = build(cfg)?;
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
    match KvTierConfig::from_json_str(&text).and_then(build) {
        Err(e) => assert!(field_of(&e).starts_with("secondary_tiers[1]"), "{e}"),
        Ok(m) => {
            let n = roundtrip(&m, 8, 3, 300);
            m.shutdown_blocking().unwrap();
            assert_eq!(n, 8);
        }
    }
    assert_no_panics("two fs tiers on one root");
}

// ------------------------------------------------------------------------------ build at the edges

/// The fs tier's gc_* numbers all at their documented minimum (a ~100 KiB cap, as the
/// documented 1e-9 GiB does not build: see the next test; swept every 10 ms,
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
    let m = build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
    for salt in 1..4 {
        let n = roundtrip(&m, 4, salt, 30);
        eprintln!("round {salt}: {n}/4 back");
    }
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

/// `gc_max_size_gb`'s documented minimum is 1e-9 (`kv_tier_fs::RANGES`, the field doc "1e-9 to
/// 1e9"): `config check` accepts it, so building must too, or the check must refuse it the way
/// building does ("Fails naming the field, as building would").
#[test]
fn fs_cap_at_its_documented_minimum_check_and_build_agree() {
    // `gc_max_size_gb` must also hold one block file with its directories on the root's
    // filesystem, which only opening the tier can tell (its doc): the check takes these caps,
    // and building refuses them naming the field, never panicking
    let mut bad = Vec::new();
    for gb in [1e-9, 1e-6, 1e-5] {
        let dir = tempfile::tempdir().unwrap();
        let text = serde_json::json!({
            "cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "fs", "root_dir": dir.path(), "gc_max_size_gb": gb}]
        })
        .to_string();
        let checked = check(&text).is_ok();
        let built = KvTierConfig::from_json_str(&text)
            .and_then(build)
            .map(|m| m.shutdown_blocking());
        match &built {
            Err(e) if !e.to_string().contains("gc_max_size_gb") => bad.push(format!(
                "gc_max_size_gb {gb}: build refused without naming it: {e}"
            )),
            Err(_) if !checked => bad.push(format!("gc_max_size_gb {gb}: check refused it too")),
            _ => {}
        }
    }
    assert!(bad.is_empty(), "{bad:#?}");
}

/// ... and at their documented maximum (child process: 2,048 threads, 1e8 tracked stamps).
#[test]
fn fs_numbers_at_their_maximum_run_and_shut_down_promptly() {
    isolated(
        "fs_numbers_at_their_maximum_run_and_shut_down_promptly",
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
            let m = build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
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
        let m = build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
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
        let m = build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
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
    let m = build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
    let req = RequestContext::new(1);
    let ks = keys(6, 7);
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

/// Block sizes that are valid but awkward for O_DIRECT (1, 3, 511, 4097 bytes) and DRAM of exactly
/// one slot: stored to fs (direct I/O, checksums) and loaded back byte for byte.
#[test]
fn awkward_block_sizes_round_trip_through_fs() {
    watch_panics();
    let mut bad = Vec::new();
    for (bs, cpu) in [
        (1u64, 1u64 << 20),
        (3, 1 << 20),
        (511, 1 << 20),
        (4097, 1 << 20),
        (4096, 4096),
        (65536, 65536),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let text = serde_json::json!({
            "cpu_bytes_to_use": cpu, "block_size_bytes": bs,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "fs", "root_dir": dir.path(), "checksum": "crc32c", "direct_io": true}]
        })
        .to_string();
        let m = match KvTierConfig::from_json_str(&text).and_then(build) {
            Ok(m) => m,
            Err(e) => {
                bad.push(format!("block {bs}, cpu {cpu}: does not build: {e}"));
                continue;
            }
        };
        let want = if cpu / bs.div_ceil(4096).max(1) / 4096 >= 2 {
            2
        } else {
            1
        };
        let n = roundtrip(&m, want, 8, 300);
        if n != want as usize {
            bad.push(format!("block {bs}, cpu {cpu}: {n}/{want} came back"));
        }
        m.shutdown_blocking().unwrap();
    }
    let p = take_panics();
    assert!(bad.is_empty() && p.is_empty(), "{bad:#?}\npanics: {p:#?}");
}

/// The largest block size (1 GiB) builds; one more byte is refused naming block_size_bytes.
#[test]
fn the_largest_block_size_builds_and_one_more_is_refused() {
    let e =
        check(r#"{"cpu_bytes_to_use": 4294967296, "block_size_bytes": 1073741825}"#).unwrap_err();
    assert_eq!(field_of(&e), "block_size_bytes", "{e}");
    isolated(
        "the_largest_block_size_builds_and_one_more_is_refused",
        || {
            watch_panics();
            let m = build(
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
    isolated("unallocatable_dram_is_an_error", || {
        for (cpu, bs) in [(1u64 << 50, 1u64 << 30), (1 << 43, 4096), (1 << 44, 4096)] {
            let cfg = KvTierConfig::from_json_str(&format!(
                r#"{{"cpu_bytes_to_use": {cpu}, "block_size_bytes": {bs}}}"#
            ))
            .unwrap();
            let r = build(cfg);
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
    isolated("tracker_and_event_buffers_at_their_maximum", || {
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
        let m = build(KvTierConfig::from_json_str(&text).unwrap()).unwrap();
        roundtrip(&m, 4, 9, 20);
        let ev = m.take_events();
        eprintln!("{} events", ev.len());
        m.shutdown_blocking().unwrap();
        assert_no_panics("max trackers");
    });
}

// ------------------------------------------------------------------------------ obj tier

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
        if check(&text).is_ok() {
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
            let ks = keys(1, 10);
            let mut p = m.prepare_store(&ks).unwrap();
            p.slots()[0].1.as_mut_slice().fill(1);
            p.commit(req.id);
            m.on_request_finished(req.id);
            rt.block_on(m.wait_idle());
            let obj = m.tier::<kv_tier::obj::ObjTier>("obj").unwrap();
            let written = obj.stats().blocks.blocks_written;
            rt.block_on(m.shutdown()).unwrap();
            let mut found = Vec::new();
            for e in walk(parent.path()) {
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

fn walk(p: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(p) {
        for e in rd.flatten() {
            let path = e.path();
            if path.is_dir() {
                out.extend(walk(&path));
            } else {
                out.push(path);
            }
        }
    }
    out
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
                let ks = keys(1, 11);
                let src = kv_tier::BlockSource::from_bytes(vec![0xab; 4096]);
                let stored = obj
                    .store(kv_tier::StoreJob {
                        requests: Vec::new(),
                        blocks: vec![(ks[0], src)],
                    })
                    .await
                    .is_success();
                let found = obj.lookup(&ks).await?;
                let (sink, reader) = kv_tier::BlockSink::pair(4096);
                let loaded = obj
                    .load(kv_tier::LoadJob {
                        requests: Vec::new(),
                        blocks: vec![(ks[0], sink)],
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
                let ks = keys(4, 12);
                let blocks = ks
                    .iter()
                    .map(|k| (*k, kv_tier::BlockSource::from_bytes(vec![7; 4096])))
                    .collect();
                let _ = obj
                    .store(kv_tier::StoreJob {
                        requests: Vec::new(),
                        blocks,
                    })
                    .await;
                let _ = obj.lookup(&ks).await;
                let (sink, _reader) = kv_tier::BlockSink::pair(4096);
                let _ = obj
                    .load(kv_tier::LoadJob {
                        requests: Vec::new(),
                        blocks: vec![(ks[0], sink)],
                    })
                    .await;
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

/// Secrets never reach what `config check` prints: masked in the effective config, and not
/// echoed by the errors about them.
#[test]
fn secrets_stay_out_of_effective_configs_and_errors() {
    let secret = "TOPSECRETvalue123";
    let ok = format!(
        r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{{"type": "obj", "store_config": {{"bucket": "b", "endpoint_override": "127.0.0.1:9000", "access_key": "AK", "secret_key": "{secret}", "session_token": "{secret}"}}}}]}}"#
    );
    let mut eff = check(&ok).unwrap();
    kv_tier::redact_secrets(&mut eff);
    assert!(!eff.to_string().contains(secret), "{eff}");
    let mut leaks = Vec::new();
    for tier in [
        format!(
            r#"{{"type": "obj", "bucket": "b", "access_key": "AK", "secret_key": "{secret} x"}}"#
        ),
        format!(
            r#"{{"type": "obj", "bucket": "b", "access_key": "AK", "secret_key": ["{secret}"]}}"#
        ),
        format!(
            r#"{{"type": "obj", "bucket": "b", "access_key": "AK", "secret_key": {{"v": "{secret}"}}}}"#
        ),
        format!(
            r#"{{"type": "obj", "bucket": "b", "access_key": "AK", "secret_key": "{secret}", "session_token": "{secret}\u00e9"}}"#
        ),
        format!(
            r#"{{"type": "obj", "bucket": "b", "store_config": {{"access_key": "AK", "secret_key": "{secret}", "secret_keyy": "x"}}}}"#
        ),
        format!(
            r#"{{"type": "obj", "bucket": "b", "endpoint_override": "http://AK:{secret}@h:1"}}"#
        ),
        format!(r#"{{"type": "obj", "bucket": "b", "access_key": "{secret}\n"}}"#),
    ] {
        let text = format!(
            r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{tier}]}}"#
        );
        match check(&text) {
            Ok(_) => leaks.push(format!("accepted: {tier}")),
            Err(e) if e.to_string().contains(secret) => {
                leaks.push(format!("error echoes the secret: {e}"))
            }
            Err(_) => {}
        }
    }
    assert!(leaks.is_empty(), "{leaks:#?}");
}
