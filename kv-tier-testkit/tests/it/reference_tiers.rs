//! The reference tier (`MemoryTier`, also registered from a config) and the fault wrapper
//! (`FaultyTier` with no faults planned) pass the conformance suite.

use std::sync::Arc;

use kv_tier_testkit::{FaultyTier, MemoryTier, TierFixture};

kv_tier_testkit::conformance_tests!(|| async {
    TierFixture::new(Arc::new(MemoryTier::new("memory", 8192)), 8192).registered(
        MemoryTier::register,
        serde_json::json!({"secondary_tiers": [{"type": "memory", "name": "reference"}]}),
    )
});

mod wrapped {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let inner = Arc::new(MemoryTier::new("memory", 4096));
        TierFixture::new(Arc::new(FaultyTier::new(inner)), 4096)
    });
}
