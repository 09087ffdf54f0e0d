//! The engine's side: new requests, one scheduling step over every request in flight, and
//! the check of the step's `Miss` answers.

use kv_tier_core::{BlockKey, LookupResult, RequestContext};

use super::STUCK_AFTER;
use super::driver::{CHAIN, CONVERSATIONS, Check, Driver, Request, bounded, key_of};
use super::model::quiet_since;
use crate::util::{fill_block, verify_block};

/// A step's verdicts, one letter each: `[HHPRM]` for Hit, Hit, HitPending, Retry, Miss.
fn verdicts(v: &[LookupResult]) -> String {
    let letters: String = v
        .iter()
        .map(|x| match x {
            LookupResult::Hit => 'H',
            LookupResult::HitPending => 'P',
            LookupResult::Retry => 'R',
            LookupResult::Miss => 'M',
        })
        .collect();
    format!("[{letters}]")
}

impl Driver<'_> {
    pub(super) fn new_request(&mut self) {
        let conv = self.rng.below(CONVERSATIONS);
        let len = 1 + self.rng.below(CHAIN);
        self.next_req += 1;
        let keys: Vec<BlockKey> = (0..len).map(|i| key_of(conv, i)).collect();
        self.note(format!("request r{} conv {conv} len {len}", self.next_req));
        self.requests.push(Request {
            created: self.op,
            ctx: RequestContext::new(self.next_req),
            stuck: vec![0; keys.len()],
            keys,
        });
    }

    /// One scheduling step: every request looks its prefix up; a decided one loads its hits
    /// (verified), stores the rest, and ends.
    fn step(&mut self) -> Result<Vec<(u64, BlockKey, usize, u64)>, String> {
        let waited = std::mem::take(&mut self.waited);
        let mut suspects = Vec::new();
        let mut done = Vec::new();
        let mut line = String::from("step");
        for (i, r) in self.requests.iter_mut().enumerate() {
            let m = self.manager.as_ref().expect("manager open");
            let v = m.lookup_many(&r.keys, &r.ctx);
            let undecided = v
                .iter()
                .any(|v| matches!(v, LookupResult::Retry | LookupResult::HitPending));
            let hits = v.iter().take_while(|v| **v == LookupResult::Hit).count();
            line.push_str(&format!(" r{}:{hits}/{}", r.ctx.id.0, r.keys.len()));
            line.push_str(&verdicts(&v));
            for (i, answer) in v.iter().enumerate() {
                if matches!(answer, LookupResult::Retry | LookupResult::HitPending) {
                    r.stuck[i] += u32::from(waited);
                    if r.stuck[i] > STUCK_AFTER {
                        return Err(format!(
                            "r{}: {} stayed {answer:?} for {} steps after full waits: {v:?}",
                            r.ctx.id.0, r.keys[i], r.stuck[i]
                        ));
                    }
                } else {
                    r.stuck[i] = 0;
                }
            }
            if let Some(LookupResult::Miss) = v.last() {
                // a key whose store the manager applied (settled), with no noise in its tier
                // since that store was seen or since the request began, whichever is later:
                // the Miss has no reason
                let k = r.keys[v.len() - 1];
                for t in 0..self.settled.len() {
                    if let Some(since) =
                        quiet_since(&self.settled[t], &self.stored_here[t], &k, r.created)
                        && self.noise[t].0 < since
                    {
                        suspects.push((r.ctx.id.0, k, t, since));
                    }
                }
            }
            if undecided {
                continue;
            }
            if hits > 0 {
                let sources = m
                    .prepare_load(&r.keys[..hits])
                    .map_err(|e| format!("r{}: a Hit is not readable: {e}", r.ctx.id.0))?;
                for (k, s) in r.keys.iter().zip(&sources) {
                    if !verify_block(k, 0, s.as_slice()) {
                        return Err(format!("r{}: DRAM served wrong bytes for {k}", r.ctx.id.0));
                    }
                }
                self.report.verified_blocks += hits as u64;
            }
            let rest = &r.keys[hits..];
            if !rest.is_empty()
                && let Ok(mut p) = m.prepare_store(rest)
            {
                for (k, sink) in p.slots() {
                    fill_block(k, 0, sink.as_mut_slice());
                }
                p.commit(r.ctx.id);
            }
            m.on_request_finished(r.ctx.id);
            done.push(i);
        }
        for i in done.into_iter().rev() {
            self.requests.swap_remove(i);
        }
        self.m().on_schedule_end();
        self.note(line);
        self.take_events();
        self.note_noise();
        Ok(suspects)
    }

    /// A step, then a check of its `Miss` answers: a key a tier holds (settled, found there
    /// now), with nothing since it settled that could make its probe or promotion fail, is
    /// not a miss. (A stale probe answer applied over a completed store would be one.)
    pub(super) async fn step_checked(&mut self) -> Check {
        let suspects = self.step()?;
        for (req, k, t, since) in suspects {
            if !self.durable[t].contains(&k)
                || self.noise[t].0 >= since
                || self.transient[t].0 == self.op
            {
                continue;
            }
            // the driver's own look at the storage: past the fault wrapper
            let tier = self.tiers[t].faulty.inner().clone();
            let found = bounded("a check lookup", tier.lookup(&[k])).await?;
            self.take_events();
            if found.is_ok_and(|f| f == vec![true]) && self.durable[t].contains(&k) {
                return Err(format!(
                    "r{req}: {k} answered Miss while tier {} holds it (stored through the manager, applied by operation {}, and no fault, failed probe or promotion since operation {since})",
                    self.names[t], self.settled[t][&k]
                ));
            }
        }
        Ok(())
    }
}
