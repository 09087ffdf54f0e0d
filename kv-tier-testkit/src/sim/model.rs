//! The model of what each tier holds (from the manager's events), the waits that settle its
//! keys, and the noise that may excuse a `Miss`.

use std::collections::BTreeSet;

use kv_tier_core::BlockKey;

use super::HANG_AFTER;
use super::driver::{Check, Driver};

/// For a `Miss` of `key` to a request made at operation `created`: if the manager applied the
/// key's store in the tier (`settled`, from `stored_here`) before this step, the operation
/// from which any noise of the tier would excuse the `Miss` (the store's, or the request's if
/// later).
pub(super) fn quiet_since(
    settled: &std::collections::BTreeMap<BlockKey, u64>,
    stored_here: &std::collections::BTreeMap<BlockKey, u64>,
    key: &BlockKey,
    created: u64,
) -> Option<u64> {
    settled.get(key)?;
    Some((*stored_here.get(key)?).max(created))
}

impl Driver<'_> {
    /// Applies the manager's events to the model.
    pub(super) fn take_events(&mut self) {
        // a store the manager abandoned may land without the manager knowing: such a key is
        // held there as if stored behind its back
        for t in 0..self.tiers.len() {
            for k in self.tiers[t].faulty.take_abandoned_stores() {
                self.outside[t].insert(k);
                self.settled[t].remove(&k);
            }
        }
        for e in self.m().take_events() {
            let Some(t) = self.names.iter().position(|n| *n == e.tier) else {
                continue;
            };
            for k in e.keys {
                if e.removed {
                    self.durable[t].remove(&k);
                    self.settled[t].remove(&k);
                    self.stored_here[t].remove(&k);
                } else {
                    self.durable[t].insert(k);
                    self.stored_here[t].entry(k).or_insert(self.op);
                    // written again: no longer a key deleted behind the tier's back
                    self.deleted[t].remove(&k);
                }
            }
        }
    }

    pub(super) async fn wait_idle(&mut self) -> Check {
        let m = self.manager.as_ref().expect("manager open");
        tokio::time::timeout(HANG_AFTER, m.wait_idle())
            .await
            .map_err(|_| format!("wait_idle hung for {HANG_AFTER:?}"))?;
        self.waited = true;
        self.take_events();
        self.note_noise();
        for t in 0..self.tiers.len() {
            for k in &self.durable[t] {
                if !self.outside[t].contains(k) && self.stored_here[t].contains_key(k) {
                    self.settled[t].entry(*k).or_insert(self.op);
                }
            }
        }
        Ok(())
    }

    /// Waits for the jobs in flight only (probes may still be out): the stores whose events
    /// were seen before the wait have been applied by the manager when it returns, so their
    /// keys settle now, while a slow probe of them may still be on its way.
    pub(super) async fn wait_jobs(&mut self) -> Check {
        self.take_events();
        let before: Vec<BTreeSet<BlockKey>> = self.durable.clone();
        let m = self.manager.as_ref().expect("manager open");
        tokio::time::timeout(HANG_AFTER, m.wait_jobs())
            .await
            .map_err(|_| format!("wait_jobs hung for {HANG_AFTER:?}"))?;
        self.take_events();
        self.note_noise();
        for (t, keys) in before.iter().enumerate() {
            for k in keys {
                if self.durable[t].contains(k)
                    && !self.outside[t].contains(k)
                    && self.stored_here[t].contains_key(k)
                {
                    self.settled[t].entry(*k).or_insert(self.op);
                }
            }
        }
        self.note("wait_jobs".into());
        Ok(())
    }

    /// Records, per tier, whether anything happened that may make a probe or a promotion of
    /// it fail (so a `Miss` may be honest).
    pub(super) fn note_noise(&mut self) {
        let s = self.m().stats();
        for t in 0..self.tiers.len() {
            let ts = &s.tiers[t];
            let sig = [
                ts.probes.probe_errors + ts.probes.probe_timeouts + ts.probes.probe_panics,
                ts.probes.over_budget,
                ts.load_failures,
                ts.jobs_timed_out + ts.jobs_panicked,
                self.world.quiet_absences(t),
            ];
            // the faults act through these counters: a delay or a hang that ends before the
            // deadlines fails nothing (and is where a stale answer would show)
            if sig != self.noise[t].1 {
                self.noise[t] = (self.op, sig);
            }
            let sig = [s.promotions_refused, ts.promotions_cancelled];
            if sig != self.transient[t].1 {
                self.transient[t] = (self.op, sig);
            }
        }
    }
}
