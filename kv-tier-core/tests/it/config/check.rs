//! What `config check` (`effective_config`) says agrees with building, and keeps secrets out of
//! what it prints.

use kv_tier::KvTierConfig;

use crate::support::*;

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
        let checked = config_check(&text);
        let built = KvTierConfig::from_json_str(&text)
            .and_then(try_build)
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
        let checked = config_check(&text).is_ok();
        let built = KvTierConfig::from_json_str(&text)
            .and_then(try_build)
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

/// Secrets never reach what `config check` prints: masked in the effective config, and not
/// echoed by the errors about them.
#[test]
fn secrets_stay_out_of_effective_configs_and_errors() {
    let secret = "TOPSECRETvalue123";
    let ok = format!(
        r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "secondary_tiers": [{{"type": "obj", "store_config": {{"bucket": "b", "endpoint_override": "127.0.0.1:9000", "access_key": "AK", "secret_key": "{secret}", "session_token": "{secret}"}}}}]}}"#
    );
    let mut eff = config_check(&ok).unwrap();
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
        match config_check(&text) {
            Ok(_) => leaks.push(format!("accepted: {tier}")),
            Err(e) if e.to_string().contains(secret) => {
                leaks.push(format!("error echoes the secret: {e}"))
            }
            Err(_) => {}
        }
    }
    assert!(leaks.is_empty(), "{leaks:#?}");
}
