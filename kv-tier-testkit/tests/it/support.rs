//! Helpers of the testkit's tests.

use std::sync::Arc;

use kv_tier_testkit::{FaultyTier, MemoryTier, TierFixture};

/// A fault wrapper around a fresh 4 KiB `MemoryTier` (no faults planned yet) and a fixture of
/// the suite on it.
pub(crate) fn faulty() -> (Arc<FaultyTier>, TierFixture) {
    let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("memory", 4096))));
    (t.clone(), TierFixture::new(t, 4096))
}
