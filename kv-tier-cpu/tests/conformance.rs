//! The primary-tier conformance cases against the DRAM tier, with both eviction policies.

use std::sync::Arc;

use kv_tier_core::EvictionPolicy;
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::conformance::PrimaryFixture;

fn fixture(policy: EvictionPolicy) -> PrimaryFixture {
    let tier = CpuTier::new(CpuTierConfig {
        capacity_bytes: 16 * 4096,
        block_size: 4096,
        policy,
        prefault: false,
    })
    .unwrap();
    PrimaryFixture {
        tier: Arc::new(tier),
        capacity_blocks: 16,
        lru: policy == EvictionPolicy::Lru,
    }
}

kv_tier_testkit::primary_conformance_tests!(|| fixture(EvictionPolicy::Lru));

mod arc {
    use super::*;
    kv_tier_testkit::primary_conformance_tests!(|| fixture(EvictionPolicy::Arc));
}
