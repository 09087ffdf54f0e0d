//! Configuration: the `secondary_tiers` entry built by type name through the registry, every
//! option checked at construction naming its field (numbers across and past their ranges never
//! make `open` panic), a bad `root_dir`, the GC options at the ends of their ranges.

use std::time::Duration;

use kv_tier_core::{Error, SecondaryTier, TierSpec};
use kv_tier_fs::{FsTier, FsTierConfig};
use kv_tier_testkit::fixtures::files::{Mount, allocation_units};
use kv_tier_testkit::util::lru_dram;
use kv_tier_testkit::{load_keys, temp_root, test_key};

use crate::support::*;

#[test]
fn a_bad_root_dir_fails_at_construction() {
    let root = temp_root();
    let file = root.path().join("not-a-dir");
    std::fs::write(&file, b"x").unwrap();
    let err = FsTier::open("fs", cfg(&file), ns(), BS).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidConfig { field, reason } if field == "root_dir" && reason.contains("not a directory")),
        "{err}"
    );
    let ro = Mount::new("tmpfs", "ro,size=1m");
    let err = FsTier::open("fs", cfg(&ro.dir), ns(), BS).unwrap_err();
    assert!(
        err.to_string().contains("root_dir") || matches!(err, Error::Io { .. }),
        "{err}"
    );
    assert!(
        err.to_string().contains(&ro.dir.display().to_string()),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_by_type_name_through_the_config_json() {
    let root = temp_root();
    let json = format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": 4096,
            "layout": {{"model_name": "m", "dtype": "float16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": "{}", "n_read_threads": 2, "n_write_threads": 2, "checksum": "crc32c"}}]}}"#,
        root.path().display()
    );
    let cfg = kv_tier_core::KvTierConfig::from_json_str(&json).unwrap();
    let mut reg = kv_tier_core::TierRegistry::new();
    FsTier::register(&mut reg).unwrap();
    let cpu = lru_dram(16, 4096);
    let m = kv_tier_core::TieringManager::builder(cfg.clone())
        .primary(cpu)
        .registry(reg.clone())
        .build()
        .await
        .unwrap();
    assert_eq!(m.tier_names(), ["fs"]);
    assert!(m.tiers()[0].info().capability.checksums);
    // a bad option is refused naming the field
    let bad = json.replace("\"n_read_threads\": 2", "\"n_read_threads\": 0");
    let err = kv_tier_core::TieringManager::builder(
        kv_tier_core::KvTierConfig::from_json_str(&bad).unwrap(),
    )
    .primary(lru_dram(16, 4096))
    .registry(reg.clone())
    .build()
    .await
    .unwrap_err();
    assert!(
        err.to_string()
            .contains("secondary_tiers[0].n_read_threads"),
        "{err}"
    );
    // and a missing layout is refused naming it
    let mut no_layout = cfg;
    no_layout.layout = None;
    let err = kv_tier_core::TieringManager::builder(no_layout)
        .primary(lru_dram(16, 4096))
        .registry(reg)
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("layout"), "{err}");
}

/// Every numeric option, at values across and beyond its range (as JSON a user could write):
/// parsing either refuses it naming the field, or the tier opens; nothing panics.
#[test]
fn no_config_that_deserialises_makes_open_panic() {
    let root = temp_root();
    let mut opened = 0;
    for &(field, _, _) in kv_tier_fs::RANGES {
        for &v in kv_tier_testkit::CONFIG_NUMBERS {
            let mut json = format!(r#"{{"root_dir": {:?}, "{field}": {v}"#, root.path());
            if field.starts_with("gc_") && field != "gc_max_size_gb" {
                json.push_str(r#", "gc_max_size_gb": 1"#);
            }
            json.push('}');
            let mut spec = TierSpec::new("fs");
            spec.options = serde_json::from_str::<serde_json::Value>(&json)
                .unwrap()
                .as_object()
                .unwrap()
                .clone();
            let cfg = match FsTierConfig::from_spec(&spec) {
                Ok(c) => c,
                Err(kv_tier_core::Error::InvalidConfig { field: f, reason }) => {
                    let interplay = f == "gc_grace_s" && field == "gc_stamp_interval_s";
                    assert!(
                        f == field || interplay,
                        "{json}: refused naming {f}: {reason}"
                    );
                    continue;
                }
                Err(e) => panic!("{json}: {e}"),
            };
            let opened_ok = std::panic::catch_unwind(|| {
                let mut c = cfg.clone();
                c.gc_background = true; // the GC thread's own timing is part of what must not panic
                FsTier::open("fs", c, ns(), BS).map(drop)
            });
            match opened_ok {
                Ok(Ok(())) => opened += 1,
                // a cap too small for one block is found at open (it depends on the block
                // size and the filesystem)
                Ok(Err(kv_tier_core::Error::InvalidConfig { field: f, .. }))
                    if f == "gc_max_size_gb" => {}
                Ok(Err(e)) => panic!("{json}: a valid config failed to open: {e}"),
                Err(_) => panic!("{json}: open panicked"),
            }
        }
    }
    assert!(opened > 10, "too few configs opened: {opened}");
}

/// config.rs / `RANGES`: `gc_max_size_gb` "1e-9 to 1e9", `gc_hard_ceiling` "range 1 to 1,000",
/// `gc_low_watermark` "In (0, 1]", `gc_max_tracked` "range 1 to 100,000,000"; "every number has
/// a range ... checked at construction".
///
/// The ends of the ranges: the smallest cap is refused at open naming `gc_max_size_gb` (it
/// cannot hold a block); the largest cap with the largest ceiling opens, stores and loads
/// (no overflow); a watermark of 1e-9 sweeps every unprotected old block, directories with
/// them (index and du 0); `gc_max_tracked` 1 drops touches (counted) and nothing breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn options_at_the_ends_of_their_ranges() {
    let root = temp_root();
    match FsTier::open("fs", capped_cfg(root.path(), 1), ns(), BS) {
        Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, "gc_max_size_gb"),
        other => panic!("a 1-byte cap: {other:?}"),
    }
    let mut c = cfg(root.path());
    c.gc_max_size_gb = Some(1e9);
    c.gc_hard_ceiling = Some(1000.0);
    c.gc_background = false;
    let big = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks: Vec<_> = (0..8).map(|i| test_key(24_000_000 + i)).collect();
    assert!(store_sized(&big, &ks, BS).await.is_success());
    let (res, _) = load_keys(&big, &ks, BS).await;
    assert!(res.is_success());
    let s = gc_stats(&big);
    assert!(
        s.hard_ceiling_bytes >= s.cap_bytes && s.cap_bytes > 0,
        "{s:?}"
    );
    assert_eq!(big.gc_sweep_now().unwrap(), 0);
    big.shutdown().await.unwrap();
    drop(big);

    let root = temp_root();
    let (dir, unit) = allocation_units(root.path());
    let per_block = unit.max(BS as u64) + 2 * dir;
    let mut c = capped_hand_swept_cfg(root.path(), 20 * per_block);
    c.gc_low_watermark = Some(1e-9);
    c.gc_max_tracked = Some(1);
    let tier = FsTier::open("fs", c, ns(), BS).unwrap();
    let ks: Vec<_> = (0..30).map(|i| test_key(24_100_000 + i)).collect();
    assert!(store_sized(&tier, &ks, BS).await.is_success());
    tier.advance_gc_clock(Duration::from_secs(10_000)).unwrap();
    tier.touch(&ks);
    let s = gc_stats(&tier);
    assert!(s.stamps_dropped > 0 && s.pending_stamps <= 1, "{s:?}");
    tier.gc_apply_stamps_now().unwrap();
    tier.advance_gc_clock(Duration::from_secs(10_000)).unwrap();
    let deleted = tier.gc_sweep_now().unwrap();
    let s = gc_stats(&tier);
    assert_eq!(deleted, 30, "{s:?}");
    assert_eq!(s.bytes, 0, "{s:?}");
    assert_eq!(
        du(root.path()),
        0,
        "directories left after sweeping everything"
    );
}
