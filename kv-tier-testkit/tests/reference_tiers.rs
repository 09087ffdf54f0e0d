//! The reference tier and the fault wrapper (with no faults planned) pass the suite.

use std::sync::Arc;

use kv_tier_testkit::{FaultyTier, MemoryTier, TierFixture};

kv_tier_testkit::conformance_tests!(|| async {
    TierFixture::new(Arc::new(MemoryTier::new("memory", 8192)), 8192)
});

mod wrapped {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let inner = Arc::new(MemoryTier::new("memory", 4096));
        TierFixture::new(Arc::new(FaultyTier::new(inner)), 4096)
    });
}

/// The suite is not vacuous: a tier that fails or tears loads is caught.
mod suite_catches_broken_tiers {
    use super::*;
    use kv_tier_testkit::conformance;

    fn faulty() -> (Arc<FaultyTier>, TierFixture) {
        let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("memory", 4096))));
        (t.clone(), TierFixture::new(t, 4096))
    }

    #[tokio::test]
    #[should_panic(expected = "load of 1 failed")]
    async fn failing_loads_fail_the_round_trip() {
        let (t, fx) = faulty();
        t.fail_every_nth_load(Some(1));
        conformance::round_trip_preserves_bytes(&fx).await;
    }

    #[tokio::test]
    #[should_panic(expected = "changed in a round trip")]
    async fn torn_loads_fail_the_round_trip() {
        let (t, fx) = faulty();
        // tear every key the case will use: they are deterministic
        let keys: Vec<_> = (0..64u64)
            .flat_map(|i| (0..5u64).map(move |b| kv_tier_testkit::test_key((3 << 8 | b) << 32 | i)))
            .collect();
        t.tear_load(&keys);
        conformance::round_trip_preserves_bytes(&fx).await;
    }

    #[tokio::test]
    #[should_panic(expected = "store failed")]
    async fn failing_stores_are_caught() {
        let (t, fx) = faulty();
        t.fail_every_nth_store(Some(2));
        conformance::store_then_lookup_hits(&fx).await;
    }
}
