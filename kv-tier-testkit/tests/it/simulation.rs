//! CI's share of the fault simulation: a fixed set of short seeds over the real tiers (fs in
//! a temp dir, obj on an in-memory store), every kind of fault, zero violations. The longer
//! run is `cargo run --release -p kv-tier-testkit --example simulate`.

use kv_tier_testkit::sim::{SimOptions, fault, run};

use crate::world;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fixed_seeds_run_without_violations() {
    let mut total = 0;
    for seed in 1..=4u64 {
        let opts = SimOptions::new(seed, 2_500);
        let r = run(Box::new(world::RealWorld::new()), opts).await;
        total += r.ops;
        if let Some(v) = r.violation {
            panic!(
                "seed {seed}, operation {}: {}\n{}",
                v.op,
                v.what,
                v.trace.join("\n")
            );
        }
        assert_eq!(r.ops, 2_500);
        assert!(r.verified_blocks > 0 && r.audited_keys > 0 && r.faults_injected > 0);
    }
    assert_eq!(total, 10_000);
}

/// The simulation has teeth: a tier that serves wrong bytes is caught by the byte check, and a
/// tier that loses what it reported stored is caught by an audit.
mod teeth {
    use std::sync::Arc;

    use kv_tier_core::{BlockKey, SecondaryTier, TierOptions};
    use kv_tier_testkit::sim::{BoxFuture, Tamper, World};

    use super::*;

    /// One tier that forgets blocks without a removal event (at each forced "sweep").
    struct Forgetful(world::RealWorld, Option<Arc<kv_tier_testkit::MemoryTier>>);

    impl World for Forgetful {
        fn open(&mut self) -> BoxFuture<'_, Vec<(Arc<dyn SecondaryTier>, TierOptions)>> {
            Box::pin(async move {
                let m = Arc::new(kv_tier_testkit::MemoryTier::new("forgetful", 4096));
                self.1 = Some(m.clone());
                let _ = self.0.open().await;
                vec![(m as Arc<dyn SecondaryTier>, TierOptions::default())]
            })
        }
        fn crash(&mut self) -> BoxFuture<'_, ()> {
            self.0.crash()
        }
        fn tamper(&mut self, _: usize, key: BlockKey, _: Tamper) -> BoxFuture<'_, bool> {
            let m = self.1.clone();
            Box::pin(async move { m.is_some_and(|m| m.remove(&key)) })
        }
        fn sweep(&mut self, _: usize) -> BoxFuture<'_, ()> {
            // forgets everything without a removal event
            if let Some(m) = &self.1 {
                m.clear();
            }
            Box::pin(async {})
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tier_that_forgets_what_it_stored_is_caught() {
        let mut o = SimOptions::new(1, 5_000);
        o.faults = fault::SWEEPS;
        let r = run(Box::new(Forgetful(world::RealWorld::new(), None)), o).await;
        let v = r.violation.expect("a forgetful tier passed the simulation");
        // an audit finds the keys gone, or a request is told Miss for a key the tier
        // reported stored and never removed
        assert!(
            v.what.contains("does not find them") || v.what.contains("answered Miss while tier"),
            "{}",
            v.what
        );
    }

    /// One tier whose loads return torn bytes reported as loaded.
    struct Tearing;

    impl World for Tearing {
        fn open(&mut self) -> BoxFuture<'_, Vec<(Arc<dyn SecondaryTier>, TierOptions)>> {
            Box::pin(async move {
                let t = kv_tier_testkit::FaultyTier::new(Arc::new(
                    kv_tier_testkit::MemoryTier::new("tearing", 4096),
                ));
                let keys: Vec<BlockKey> = (0..12u64)
                    .flat_map(|c| {
                        (0..20u64)
                            .map(move |i| kv_tier_testkit::util::test_key_in_group(c * 64 + i, 0))
                    })
                    .collect();
                t.tear_load(&keys);
                vec![(
                    Arc::new(t) as Arc<dyn SecondaryTier>,
                    TierOptions::default(),
                )]
            })
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_tier_that_serves_torn_blocks_is_caught() {
        let mut o = SimOptions::new(1, 5_000);
        o.faults = fault::ABORTS;
        let r = run(Box::new(Tearing), o).await;
        let v = r.violation.expect("a tearing tier passed the simulation");
        assert!(v.what.contains("wrong bytes"), "{}", v.what);
    }
}
