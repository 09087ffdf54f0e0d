//! Helpers of the facade's tests: the block size of vLLM-shaped configs and what an engine
//! does with vLLM's config. The testkit's manager fixtures these tests use
//! (`model_namespace`, `disk_tier_config`) are re-exported here.

use kv_tier::KvTierConfig;

pub(crate) use kv_tier_testkit::fixtures::manager::{disk_tier_config, model_namespace};

/// Bytes per block of the facade's tests (64 KiB: vLLM-sized blocks).
pub(crate) const BS: usize = 65536;

/// What an engine does with vLLM's config: parse it as is, set the block's bytes.
pub(crate) fn engine_config(text: &str) -> KvTierConfig {
    let mut cfg = KvTierConfig::from_json_str(text).expect("vLLM's shape parses");
    assert_eq!(cfg.block_size_bytes, 0, "vLLM's shape has no byte size");
    cfg.block_size_bytes = BS as u64;
    cfg
}
