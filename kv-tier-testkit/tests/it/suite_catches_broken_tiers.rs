//! The suite is not vacuous: a tier that fails or tears loads is caught, and so is one that
//! fails stores or keeps its buffers. And why the suite checks buffers: under a manager, a
//! tier that keeps them starves the DRAM pool.

use std::sync::Arc;

use kv_tier_testkit::conformance;
use kv_tier_testkit::{FaultyTier, MemoryTier};

use crate::support::faulty;

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
#[should_panic(expected = "zero-copy retention")]
async fn a_tier_keeping_its_buffers_is_caught() {
    let (t, fx) = faulty();
    t.retain_sources(true);
    conformance::stores_and_loads_give_their_buffers_back(&fx).await;
}

#[tokio::test(start_paused = true)]
#[should_panic(expected = "DRAM buffers for good")]
async fn a_tier_keeping_the_buffers_of_dropped_stores_is_caught() {
    let (t, fx) = faulty();
    t.retain_sources(true);
    conformance::dropped_calls_leave_no_trace(&fx).await;
}

#[tokio::test]
#[should_panic(expected = "store failed")]
async fn failing_stores_are_caught() {
    let (t, fx) = faulty();
    t.fail_every_nth_store(Some(2));
    conformance::store_then_lookup_hits(&fx).await;
}

/// Why the suite checks buffers: under a manager, a tier that keeps its stores' buffers pins
/// DRAM slot after slot until the pool refuses stores; the same tier without the fault never
/// does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_keeping_buffers_starves_the_dram_pool() {
    async fn refusals(retain: bool) -> u64 {
        let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("m", 4096))));
        t.retain_sources(retain);
        let cfg = kv_tier_core::KvTierConfig::new(8 * 4096, 4096);
        let m = kv_tier_testkit::dram_manager_builder(cfg)
            .unwrap()
            .tier(t.clone())
            .build()
            .await
            .unwrap();
        let mut refused = 0;
        for i in 0..32u64 {
            let k = kv_tier_testkit::test_key(i);
            match m.prepare_store(&[k]) {
                Ok(mut p) => {
                    for (k, s) in p.slots() {
                        kv_tier_testkit::fill_block(k, 0, s.as_mut_slice());
                    }
                    p.commit(kv_tier_core::RequestId(1));
                }
                Err(_) => refused += 1,
            }
            m.wait_idle().await;
        }
        m.shutdown().await.unwrap();
        refused
    }
    assert_eq!(refusals(false).await, 0);
    assert!(
        refusals(true).await > 0,
        "a retaining tier never starved the pool"
    );
}
