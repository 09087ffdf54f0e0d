//! The tier under a [`TieringManager`]: built by type name from its config JSON when the
//! fixture says how, driven through a store cascade, a probe, a promotion and request ends.

use kv_tier_core::registry::TierRegistry;
use kv_tier_core::{KvTierConfig, LookupResult, RequestContext, TieringManager};

use super::TierFixture;
use super::cases::{keys, within};
use crate::util::{fill_block, verify_block};

const SLOTS: usize = 16;

async fn build(fx: &TierFixture) -> TieringManager {
    let bs = fx.block_size;
    match &fx.registration {
        Some(r) => {
            let mut json = r.config.clone();
            json["cpu_bytes_to_use"] = serde_json::json!(SLOTS * bs);
            json["block_size_bytes"] = serde_json::json!(bs);
            let cfg = KvTierConfig::from_json_str(&json.to_string())
                .unwrap_or_else(|e| panic!("the fixture's config is refused: {e}\n{json}"));
            let mut registry = TierRegistry::new();
            (r.register)(&mut registry).expect("registering the tier's type");
            crate::util::dram_manager_builder(cfg)
                .expect("DRAM tier")
                .registry(registry)
                .build()
                .await
                .unwrap_or_else(|e| panic!("no manager from the fixture's config: {e}\n{json}"))
        }
        None => {
            let cfg = KvTierConfig::new((SLOTS * bs) as u64, bs as u64);
            crate::util::dram_manager_builder(cfg)
                .expect("DRAM tier")
                .tier(fx.tier.clone())
                .build()
                .await
                .expect("manager")
        }
    }
}

/// Under a manager (built from the fixture's config by type name when it has one): a block
/// stored in DRAM cascades to the tier; with DRAM emptied, a lookup probes the tier, promotes
/// the block and serves the same bytes from DRAM within a bounded number of steps; when the
/// requests end and jobs drain, no lookup state, lease or protection remains.
pub async fn manager_drives_the_tier_from_its_config(fx: &TierFixture) {
    let m = build(fx).await;
    assert_eq!(m.tiers().len(), 1, "the config has one secondary tier");
    let tier = m.tiers()[0].clone();
    let ks = keys(60, 6);
    let r1 = RequestContext::new(1);
    let mut p = m.prepare_store(&ks).expect("DRAM has room");
    assert_eq!(p.keys(), ks);
    for (k, sink) in p.slots() {
        fill_block(k, 5, sink.as_mut_slice());
    }
    p.commit(r1.id);
    m.on_request_finished(r1.id);
    within("the cascade", m.wait_idle()).await;
    assert_eq!(
        within("a lookup", tier.lookup(&ks)).await.unwrap(),
        vec![true; ks.len()],
        "the store did not cascade to the tier"
    );
    assert!(m.stats().tiers[0].blocks_stored >= ks.len() as u64);

    within("reset", m.reset_cache()).await;
    let r2 = RequestContext::new(2);
    let mut verdicts = Vec::new();
    for _ in 0..50 {
        verdicts = m.lookup_many(&ks, &r2);
        m.on_schedule_end();
        if verdicts.iter().all(|v| *v == LookupResult::Hit) {
            break;
        }
        within("a step's jobs", m.wait_idle()).await;
    }
    assert!(
        verdicts.iter().all(|v| *v == LookupResult::Hit),
        "after 50 steps the keys are not promoted: {verdicts:?}"
    );
    let sources = m.prepare_load(&ks).expect("promoted blocks are readable");
    for (k, s) in ks.iter().zip(&sources) {
        assert!(
            verify_block(k, 5, s.as_slice()),
            "the promoted block of {k} is not the stored one"
        );
    }
    drop(sources);
    assert!(m.stats().tiers[0].hits >= ks.len() as u64);
    m.on_request_finished(r2.id);
    within("the drain", m.wait_idle()).await;
    let s = m.stats();
    let t = &s.tiers[0];
    assert_eq!(
        (t.tracked_keys, t.tracked_requests, t.leased_keys),
        (0, 0, 0),
        "lookup state left after every request ended (keys, requests, leases)"
    );
    assert!(
        ks.iter().all(|k| !tier.is_protected(k)),
        "the tier still protects keys after every request ended"
    );
    within("the manager's shutdown", m.shutdown())
        .await
        .expect("shutdown");
}
