//! Audits, checkpoints, and the checks they run: bounds, promotions' leases, stores that
//! still end, keys deleted behind a tier's back stored again.

use std::collections::BTreeSet;
use std::time::Duration;

use kv_tier_core::{BlockKey, SecondaryTier};

use super::driver::{Check, Driver, all_keys, bounded};
use super::{BLOCK_SIZE, HANG_AFTER};
use crate::util::verify_block;

impl Driver<'_> {
    /// With faults healed and work drained, the keys tiers reported stored are found there.
    pub(super) async fn audit(&mut self) -> Check {
        self.heal_all();
        self.wait_idle().await?;
        for t in 0..self.tiers.len() {
            let sample: Vec<BlockKey> = {
                let d = &self.durable[t];
                let n = d.len().min(8);
                let start = self.rng.below(d.len().max(1) as u64) as usize;
                d.iter().cycle().skip(start).take(n).copied().collect()
            };
            if sample.is_empty() {
                continue;
            }
            let (tier, name) = (self.tiers[t].faulty.clone(), self.names[t].clone());
            let mut missing = not_found(&*tier, &name, &sample).await?;
            self.report.audited_keys += sample.len() as u64;
            if missing.is_empty() {
                continue;
            }
            // An eviction may have raced the lookup (its removal event says so), or the lookup
            // passed its own short deadline on a busy machine (a remote tier answers keys it
            // had no answer for as absent): ask again, bounded, before calling a key lost.
            let patience = tokio::time::Instant::now() + Duration::from_secs(10);
            loop {
                tokio::time::sleep(Duration::from_millis(20)).await;
                self.take_events();
                missing.retain(|k| self.durable[t].contains(k));
                if missing.is_empty() || tokio::time::Instant::now() >= patience {
                    break;
                }
                missing = not_found(&*tier, &name, &missing).await?;
            }
            let lost: Vec<&BlockKey> = missing.iter().collect();
            if !lost.is_empty() {
                let mut seen = Vec::new();
                for k in &lost {
                    seen.push(format!("{k}: {}", self.world.describe(t, **k).await));
                }
                return Err(format!(
                    "tier {} reported {} keys stored and never removed, and does not find them: {}",
                    self.names[t],
                    lost.len(),
                    seen.join("; ")
                ));
            }
        }
        self.restore_deleted().await?;
        self.check_stores_live().await?;
        self.check_promotions()?;
        self.note("audit".into());
        Ok(())
    }

    /// Every bounded tier is within its hard bound, at every operation.
    pub(super) fn check_bounds(&self) -> Check {
        for t in 0..self.tiers.len() {
            if let Some((used, bound)) = self.world.usage(t)
                && used > bound
            {
                return Err(format!(
                    "tier {} uses {used} bytes, over its hard bound {bound}",
                    self.names[t]
                ));
            }
        }
        Ok(())
    }

    /// A key a probe found is leased in its tier until its promotion ends, so a promotion
    /// finds its key missing only where the simulation deleted one behind the tier's back.
    fn check_promotions(&self) -> Check {
        let s = self.m().stats();
        for (t, ts) in s.tiers.iter().enumerate() {
            let missing = ts.load_failure_causes.missing;
            if missing > self.deletes_since_open[t] {
                return Err(format!(
                    "tier {}: {missing} promotions found their key missing, and only {} keys were deleted behind its back: a key found by a probe was evicted before its promotion",
                    self.names[t], self.deletes_since_open[t]
                ));
            }
        }
        Ok(())
    }

    /// With faults healed, a store of any key ends, in every tier: nothing a cancelled or
    /// failed job left behind (a claim, a lock, a "being written" mark) keeps a key from being
    /// stored again.
    async fn check_stores_live(&mut self) -> Check {
        let keys = all_keys();
        for t in 0..self.tiers.len() {
            let sample: Vec<BlockKey> = (0..4)
                .map(|_| keys[self.rng.below(keys.len() as u64) as usize])
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            let fresh: Vec<BlockKey> = sample
                .iter()
                .filter(|k| !self.durable[t].contains(k))
                .copied()
                .collect();
            let tier = self.tiers[t].faulty.clone();
            let res = tokio::time::timeout(
                HANG_AFTER,
                crate::util::store_keys(&*tier, &sample, 0, BLOCK_SIZE),
            )
            .await
            .map_err(|_| {
                format!(
                    "tier {}: a store of {sample:?} did not end within {HANG_AFTER:?} with every fault healed (a key wedged by an earlier job?)",
                    self.names[t]
                )
            })?;
            for k in res.ok.iter().filter(|k| fresh.contains(k)) {
                self.outside[t].insert(*k);
                self.settled[t].remove(k);
            }
            self.take_events();
            if let Some((k, e)) = res.failed.first() {
                return Err(format!(
                    "tier {}: with every fault healed, a store of {k} failed: {e}",
                    self.names[t]
                ));
            }
        }
        Ok(())
    }

    /// Keys deleted behind a tier's back are stored again directly (with faults healed): a
    /// store that reports success leaves a block that loads whole.
    async fn restore_deleted(&mut self) -> Check {
        for t in 0..self.tiers.len() {
            let keys: Vec<BlockKey> = self.deleted[t].iter().take(4).copied().collect();
            if keys.is_empty() {
                continue;
            }
            for k in &keys {
                self.deleted[t].remove(k);
            }
            let tier = self.tiers[t].faulty.clone();
            let res = bounded(
                "a direct store",
                crate::util::store_keys(&*tier, &keys, 0, BLOCK_SIZE),
            )
            .await?;
            self.outside[t].extend(res.ok.iter().copied());
            for k in &res.ok {
                self.settled[t].remove(k);
            }
            if res.ok.is_empty() {
                continue;
            }
            let (loaded, data) = bounded(
                "a direct load",
                crate::util::load_keys(&*tier, &res.ok, BLOCK_SIZE),
            )
            .await?;
            if let Some((k, e)) = loaded.failed.first() {
                return Err(format!(
                    "tier {} reported {k} stored (it had been deleted behind its back) and it does not load: {e}",
                    self.names[t]
                ));
            }
            if let Some((k, _)) = data.iter().find(|(k, d)| !verify_block(k, 0, d)) {
                return Err(format!(
                    "tier {}: {k} stored again loads wrong bytes",
                    self.names[t]
                ));
            }
            self.take_events();
        }
        Ok(())
    }

    /// Every request ended and the work drained: nothing tracked, leased, pinned or
    /// protected remains, and bounded tiers are within their hard bounds.
    pub(super) async fn checkpoint(&mut self) -> Check {
        self.heal_all();
        for r in self.requests.drain(..) {
            self.manager
                .as_ref()
                .expect("manager open")
                .on_request_finished(r.ctx.id);
        }
        self.m().on_schedule_end();
        self.wait_idle().await?;
        self.m().on_schedule_end();
        self.wait_idle().await?;
        let s = self.m().stats();
        for (t, ts) in s.tiers.iter().enumerate() {
            if (ts.tracked_keys, ts.tracked_requests, ts.leased_keys) != (0, 0, 0) {
                return Err(format!(
                    "tier {}: lookup state left with no request alive: {} keys, {} requests, {} leases",
                    self.names[t], ts.tracked_keys, ts.tracked_requests, ts.leased_keys
                ));
            }
            if ts.write_back_bytes != 0 {
                return Err(format!(
                    "tier {}: {} write-back bytes left after the drain",
                    self.names[t], ts.write_back_bytes
                ));
            }
        }
        if s.write_back_pinned_bytes != 0
            || s.primary.writing_blocks != 0
            || s.held_blocks != 0
            || s.holding_requests != 0
        {
            return Err(format!(
                "DRAM: {} bytes pinned by write-back, {} slots being written, {} promoted \
                 blocks held for {} requests after the drain",
                s.write_back_pinned_bytes,
                s.primary.writing_blocks,
                s.held_blocks,
                s.holding_requests
            ));
        }
        self.check_promotions()?;
        let pinned = self.m().primary().reset();
        if pinned != 0 {
            return Err(format!("{pinned} DRAM slots still pinned after the drain"));
        }
        let keys = all_keys();
        for (t, tier) in self.tiers.iter().enumerate() {
            if let Some(k) = keys.iter().find(|k| tier.faulty.is_protected(k)) {
                return Err(format!(
                    "tier {}: {k} still protected after the drain",
                    self.names[t]
                ));
            }
            if let Some((used, bound)) = self.world.usage(t)
                && used > bound
            {
                return Err(format!(
                    "tier {} uses {used} bytes, over its hard bound {bound}",
                    self.names[t]
                ));
            }
            if let (Some(measured), Some((used, bound))) =
                (self.world.measured_usage(t), self.world.usage(t))
                && measured > bound
            {
                return Err(format!(
                    "tier {} occupies {measured} bytes as measured on its storage, over its hard bound {bound} (it counts {used})",
                    self.names[t]
                ));
            }
        }
        self.note("checkpoint".into());
        Ok(())
    }
}

/// The keys of `keys` the tier `name` does not find (one bounded lookup).
async fn not_found(
    tier: &dyn SecondaryTier,
    name: &str,
    keys: &[BlockKey],
) -> Result<Vec<BlockKey>, String> {
    let found = bounded("an audit lookup", tier.lookup(keys))
        .await?
        .map_err(|e| format!("audit lookup in {name} failed: {e}"))?;
    Ok(keys
        .iter()
        .zip(&found)
        .filter(|(_, f)| !**f)
        .map(|(k, _)| *k)
        .collect())
}
