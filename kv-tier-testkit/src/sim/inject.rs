//! What the driver does to the tiers: faults turned on, damage behind their backs, and the
//! directed stale-probe race.

use std::time::Duration;

use kv_tier_core::{BlockKey, LookupResult, RequestContext, RequestId};

use super::driver::{Check, Driver, Request, all_keys, bounded};
use super::{DRAM_SLOTS, Tamper, fault};
use crate::util::{Gate, test_key_in_group};

impl Driver<'_> {
    pub(super) fn inject(&mut self) {
        let t = self.rng.below(self.tiers.len() as u64) as usize;
        let mut kinds = Vec::new();
        for k in [
            fault::PROBE_ERRORS,
            fault::JOB_ERRORS,
            fault::DELAYS,
            fault::HANGS,
            fault::PANICS,
        ] {
            if self.enabled(k) {
                kinds.push(k);
            }
        }
        if kinds.is_empty() {
            return;
        }
        let kind = kinds[self.rng.below(kinds.len() as u64) as usize];
        let variant = self.rng.below(3);
        let f = self.tiers[t].faulty.clone();
        let what = match kind {
            fault::PROBE_ERRORS => {
                f.fail_lookups(true);
                "probes fail"
            }
            fault::JOB_ERRORS => {
                let n = 2 + self.rng.below(5);
                if variant == 0 {
                    f.fail_every_nth_store(Some(n));
                    "every n-th store fails"
                } else {
                    f.fail_every_nth_load(Some(n));
                    "every n-th load fails"
                }
            }
            fault::DELAYS if variant == 0 => {
                // probes look, then answer late but within their deadline: an answer that
                // may land after a store of its key was applied (a stale answer). In every
                // tier at once: a key is a miss only if every tier answers absent.
                let d = Duration::from_millis(4 + self.rng.below(12));
                for t in &self.tiers {
                    t.faulty.delay_answers(Some(d));
                }
                "probe answers late (every tier)"
            }
            fault::DELAYS => {
                f.delay(Some(Duration::from_millis(1 + self.rng.below(3))));
                "delays"
            }
            fault::HANGS if self.rng.chance(125) && self.world.lose_replies(t) => {
                // requests run, their replies come too late: the tier cannot tell what it
                // wrote or deleted
                "backend replies lost"
            }
            fault::HANGS if self.rng.chance(250) && self.world.hang_backend(t) => {
                // inside the tier, with its uploads and claims in flight: the manager's
                // deadline drops the tier's futures mid-request
                "backend hangs"
            }
            fault::HANGS => {
                let g = match variant {
                    0 => f.hold_lookups(),
                    1 => f.hold_stores(),
                    _ => f.hold_loads(),
                };
                self.tiers[t].gates.push(g);
                ["probes hang", "stores hang", "loads hang"][variant as usize]
            }
            _ => {
                if variant == 0 {
                    f.panic_on_lookup(true);
                    "probes panic"
                } else {
                    f.panic_on_load(true);
                    "loads panic"
                }
            }
        };
        self.report.faults_injected += 1;
        self.note(format!("fault tier {}: {what}", self.names[t]));
    }

    pub(super) async fn tamper(&mut self) {
        let t = self.rng.below(self.tiers.len() as u64) as usize;
        if self.durable[t].is_empty() {
            return;
        }
        let i = self.rng.below(self.durable[t].len() as u64) as usize;
        let key = *self.durable[t].iter().nth(i).expect("in range");
        let other = *self.durable[t]
            .iter()
            .nth(self.rng.below(self.durable[t].len() as u64) as usize)
            .expect("in range");
        let how = match self.rng.below(5) {
            0 => Tamper::Delete,
            1 => Tamper::Truncate,
            2 => Tamper::FlipByte,
            3 => Tamper::Replace,
            _ if other != key => Tamper::CopyOf(other),
            _ => Tamper::Delete,
        };
        let done = self.world.tamper(t, key, how).await;
        self.note(format!(
            "tamper tier {} {key} {how:?}: {done}",
            self.names[t]
        ));
        self.durable[t].remove(&key);
        self.settled[t].remove(&key);
        self.deleted[t].remove(&key);
        self.noise[t].0 = self.op;
        if how == Tamper::Delete && done {
            self.deleted[t].insert(key);
            self.deletes_since_open[t] += 1;
        }
        self.report.faults_injected += 1;
    }

    /// A directed interleaving: a probe of a key looks (absent) and holds its answer; the key
    /// is stored through the manager and applied; DRAM lets go of it; the request asks again
    /// (a new probe); only then does the old answer arrive. The old answer is stale and must
    /// not make the key a miss for the request (the manager's generation guard). The race
    /// needs every step within the probe deadline; when one is late the op ends as noise.
    pub(super) async fn stale_probe_race(&mut self) -> Check {
        let m = self.manager.as_ref().expect("manager open");
        let keys = all_keys();
        let start = self.rng.below(keys.len() as u64) as usize;
        let Some(k) = keys
            .iter()
            .cycle()
            .skip(start)
            .take(keys.len())
            .copied()
            .find(|k| {
                m.primary().lookup(k) == LookupResult::Miss
                    && self.durable.iter().all(|d| !d.contains(k))
            })
        else {
            return Ok(());
        };
        self.next_req += 1;
        let r = Request {
            created: self.op,
            ctx: RequestContext::new(self.next_req),
            keys: vec![k],
            stuck: vec![0],
        };
        self.note(format!("stale-probe race on {k} for r{}", r.ctx.id.0));
        let gates: Vec<Gate> = self.tiers.iter().map(|t| t.faulty.hold_lookups()).collect();
        let m = self.manager.as_ref().expect("manager open");
        m.lookup(&k, &r.ctx); // Retry: the probes look (absent) and wait at the gates
        m.on_schedule_end();
        // the store, through the manager, applied
        self.next_req += 1;
        let writer = RequestId(self.next_req);
        if crate::util::try_engine_store(m, writer, &[k]).is_err() {
            // no DRAM room: no race this time
            for g in gates {
                g.open();
            }
            self.requests.push(r);
            return Ok(());
        }
        m.on_request_finished(writer);
        m.on_schedule_end();
        bounded("wait_jobs", m.wait_jobs()).await?;
        // DRAM lets go of it: fillers outside the simulation's keys take every free slot
        let fillers: Vec<BlockKey> = (0..DRAM_SLOTS as u64)
            .map(|i| test_key_in_group(1_000_000 + i, 0))
            .collect();
        if let Ok(p) = m.prepare_store(&fillers) {
            p.abort();
        }
        m.lookup(&k, &r.ctx); // a new probe, queued
        for g in gates {
            g.open(); // the old answers arrive first
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
        m.on_schedule_end();
        self.requests.push(r);
        self.wait_idle().await
    }
}
