//! `kv_tier::builder` and `kv_tier::registry`: the built-in tiers registered (a type registered
//! twice is refused), typed access to them by name and type, and a config without the block's bytes
//! refused.

use kv_tier::{KvTierConfig, RequestId};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{MemoryTier, test_key};

use crate::support::*;

#[test]
fn typed_access_finds_the_tier_by_name_and_type_only() {
    let dir = tempfile::tempdir().unwrap();
    let m = kv_tier::builder(disk_tier_config(dir.path(), 8, BS))
        .unwrap()
        .build_blocking()
        .unwrap();
    let fs = m
        .tier::<kv_tier::fs::FsTier>("disk")
        .expect("the fs tier by its name");
    assert!(
        m.tier::<kv_tier::fs::FsTier>("fs").is_none(),
        "not its name"
    );
    assert!(
        m.tier::<kv_tier::obj::ObjTier>("disk").is_none(),
        "not its type"
    );
    engine_store(&m, RequestId(1), &[test_key(1)]);
    m.runtime().block_on(m.wait_idle());
    assert_eq!(
        fs.stats().blocks.blocks_written,
        1,
        "the handle is the manager's own tier"
    );
    assert!(fs.block_path(&test_key(1)).starts_with(dir.path()));
    m.shutdown_blocking().unwrap();
}

#[test]
fn a_config_without_the_block_size_is_refused_at_build_naming_it() {
    let cfg = KvTierConfig::from_json_str(r#"{"cpu_bytes_to_use": 1048576}"#).unwrap();
    let err = kv_tier::builder(cfg).unwrap_err();
    assert!(err.to_string().contains("`block_size_bytes`"), "{err}");
}

#[test]
fn registering_a_type_twice_is_an_error_and_keeps_the_first() {
    let mut reg = kv_tier::registry();
    assert!(MemoryTier::register(&mut reg).is_ok());
    assert!(MemoryTier::register(&mut reg).is_err(), "second memory");
    assert!(kv_tier::fs::FsTier::register(&mut reg).is_err(), "fs again");
    assert!(
        kv_tier::obj::ObjTier::register(&mut reg).is_err(),
        "obj again"
    );
    assert!(reg.contains("fs") && reg.contains("memory"));
}
