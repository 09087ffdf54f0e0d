//! Opening the tiers and the manager over them, healing faults, and crashes.

use std::collections::BTreeSet;
use std::sync::Arc;

use kv_tier_core::{BlockKey, KvTierConfig, SecondaryTier};

use super::driver::{Driver, Tier, bounded};
use super::{BLOCK_SIZE, DRAM_SLOTS};
use crate::faulty::FaultyTier;

impl Driver<'_> {
    pub(super) async fn open(&mut self) {
        let tiers = self.world.open().await;
        let mut cfg = KvTierConfig::new((DRAM_SLOTS * BLOCK_SIZE) as u64, BLOCK_SIZE as u64);
        // short deadlines: a hung tier costs a simulated step little
        cfg.probe_timeout_s = 0.02;
        cfg.job_timeout_s = 0.05;
        cfg.job_timeout_per_block_s = 0.002;
        cfg.lease_s = 5.0;
        let mut b = crate::util::dram_manager_builder(cfg).expect("DRAM tier");
        self.tiers.clear();
        self.names.clear();
        for (t, o) in tiers {
            self.names.push(t.info().name);
            let faulty = Arc::new(FaultyTier::new(t));
            // the model reads the tiers' events (vLLM's enable_kv_events)
            b = b.tier_with_options(faulty.clone(), o.with_events());
            self.tiers.push(Tier {
                faulty,
                gates: Vec::new(),
            });
        }
        self.manager = Some(b.build().await.expect("manager"));
        self.deletes_since_open = vec![0; self.tiers.len()];
        self.stored_here = vec![std::collections::BTreeMap::new(); self.tiers.len()];
        self.noise = vec![(0, [0; 5]); self.tiers.len()];
        self.transient = vec![(0, [0; 2]); self.tiers.len()];
        if self.durable.len() != self.tiers.len() {
            self.durable = vec![BTreeSet::new(); self.tiers.len()];
            self.deleted = vec![BTreeSet::new(); self.tiers.len()];
            self.settled = vec![std::collections::BTreeMap::new(); self.tiers.len()];
            self.outside = vec![BTreeSet::new(); self.tiers.len()];
        }
    }

    pub(super) fn heal(&mut self, t: usize) {
        self.world.heal_backend(t);
        let tier = &mut self.tiers[t];
        tier.faulty.heal();
        for g in tier.gates.drain(..) {
            g.open();
        }
    }

    pub(super) fn heal_all(&mut self) {
        for t in 0..self.tiers.len() {
            self.heal(t);
        }
    }

    pub(super) async fn crash(&mut self) {
        self.note("crash: manager and tiers dropped without shutdown; reopened".into());
        self.take_events();
        self.requests.clear();
        for t in &mut self.tiers {
            for g in t.gates.drain(..) {
                g.open();
            }
        }
        // the restarted process finds its backends answering (an open against a hung
        // backend fails, naming it: tested with the tiers)
        for t in 0..self.tiers.len() {
            self.world.heal_backend(t);
        }
        self.manager = None;
        self.tiers.clear();
        self.world.crash().await;
        self.open().await;
        // A crash loses the events not yet taken (an eviction just before it is never
        // reported): what each tier holds after the reopen is what the model knows.
        for t in 0..self.tiers.len() {
            let keys: Vec<BlockKey> = self.durable[t].iter().copied().collect();
            if keys.is_empty() {
                continue;
            }
            let tier = self.tiers[t].faulty.clone();
            if let Ok(Ok(found)) = bounded("a lookup after a crash", tier.lookup(&keys)).await {
                for (k, f) in keys.iter().zip(found) {
                    if !f {
                        self.durable[t].remove(k);
                    }
                }
            } else {
                self.durable[t].clear();
            }
            self.settled[t].clear();
            self.outside[t].clear();
        }
        self.report.crashes += 1;
    }
}
