//! Helpers the facade's test binaries share.

use kv_tier::KvTierConfig;

/// Bytes per block of the helpers' managers.
pub(crate) const BS: usize = 65536;

/// A manager with 64 blocks of DRAM over the `secondary_tiers` entries `tiers` (the
/// reference `"memory"` type registered), `top` added to the config's top level.
pub(crate) fn memory_manager(top: &str, tiers: &str) -> kv_tier::TieringManager {
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}{top}, "secondary_tiers": [{tiers}]}}"#,
        64 * BS
    ))
    .unwrap();
    let mut registry = kv_tier::registry();
    kv_tier_testkit::MemoryTier::register(&mut registry).unwrap();
    kv_tier::builder(cfg)
        .unwrap()
        .registry(registry)
        .build_blocking()
        .unwrap()
}
