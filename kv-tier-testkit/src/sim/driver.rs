//! The driver: its state, the draw of each operation and the run loop.

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_tier_core::{BlockKey, RequestContext, TieringManager};

use super::{CHECKPOINT_EVERY, HANG_AFTER, Rng, SimOptions, SimReport, World, fault};
use crate::faulty::FaultyTier;
use crate::util::{Gate, test_key_in_group};

/// Conversations whose keys requests draw (prefixes shared between requests).
pub(super) const CONVERSATIONS: u64 = 12;
/// Blocks per conversation.
pub(super) const CHAIN: u64 = 20;
/// Requests in flight at most.
const MAX_ACTIVE: usize = 4;

pub(super) fn key_of(conv: u64, i: u64) -> BlockKey {
    test_key_in_group(conv * 64 + i, 0)
}

pub(super) fn all_keys() -> Vec<BlockKey> {
    (0..CONVERSATIONS)
        .flat_map(|c| (0..CHAIN).map(move |i| key_of(c, i)))
        .collect()
}

pub(super) struct Request {
    pub(super) ctx: RequestContext,
    pub(super) keys: Vec<BlockKey>,
    /// Per key of the prefix: steps after a full wait that its answer has stayed `Retry` or
    /// `HitPending` in a row.
    pub(super) stuck: Vec<u32>,
    /// The operation that made it.
    pub(super) created: u64,
}

/// A tier as the driver holds it: the fault wrapper and the gates it closed.
pub(super) struct Tier {
    pub(super) faulty: Arc<FaultyTier>,
    pub(super) gates: Vec<Gate>,
}

pub(super) struct Driver<'w> {
    pub(super) world: &'w mut dyn World,
    pub(super) opts: SimOptions,
    /// One draw per operation: the seed of that operation's own generator, so the sequence
    /// of operations depends on the seed alone, never on how many draws an earlier
    /// operation made (which can depend on what the tiers did in time).
    pub(super) ops: Rng,
    /// The current operation's generator.
    pub(super) rng: Rng,
    pub(super) manager: Option<TieringManager>,
    pub(super) tiers: Vec<Tier>,
    pub(super) names: Vec<String>,
    pub(super) requests: Vec<Request>,
    pub(super) next_req: u64,
    /// A full wait happened since the last step.
    pub(super) waited: bool,
    /// Per tier: keys it reported stored and not removed, not tampered with.
    pub(super) durable: Vec<BTreeSet<BlockKey>>,
    /// Per tier: keys deleted behind its back (an audit stores them again directly).
    pub(super) deleted: Vec<BTreeSet<BlockKey>>,
    /// Per tier: deletes behind its back since the manager was opened.
    pub(super) deletes_since_open: Vec<u64>,
    /// Per tier: durable keys, with the operation of the first full wait after they became
    /// durable (from then on the manager has applied their store).
    pub(super) settled: Vec<std::collections::BTreeMap<BlockKey, u64>>,
    /// Per tier: the last operation at which something made a probe or promotion of it fail
    /// for the requests asking (a probe error, timeout, panic or late answer, a failed or
    /// abandoned job, an absence the tier reported without knowing), and the counters that say
    /// so.
    pub(super) noise: Vec<(u64, [u64; 5])>,
    /// Per tier: the last operation at which a promotion was refused (no DRAM room) or
    /// cancelled, and the counters. Such a `Miss` holds for that lookup only (the next one
    /// probes again), so it excuses the `Miss` answers of its own step alone.
    pub(super) transient: Vec<(u64, [u64; 2])>,
    /// Per tier: keys stored there behind the manager's back (audits): a request may keep an
    /// honest `Miss` for them, as the manager never saw the store.
    pub(super) outside: Vec<BTreeSet<BlockKey>>,
    /// Per tier: keys stored through the manager since it opened, with the operation at which
    /// the store was first seen (the manager applies it then or at its next drain, and that
    /// ends every request's negative answer for the key). Keys held from before a crash are
    /// not here: a request may keep a `Miss` for them from a probe that failed.
    pub(super) stored_here: Vec<std::collections::BTreeMap<BlockKey, u64>>,
    pub(super) trace: Arc<Mutex<VecDeque<String>>>,
    pub(super) report: SimReport,
    pub(super) op: u64,
}

pub(super) type Check = Result<(), String>;

pub(super) async fn bounded<F: Future>(what: &str, fut: F) -> Result<F::Output, String> {
    tokio::time::timeout(HANG_AFTER, fut)
        .await
        .map_err(|_| format!("{what} hung for {HANG_AFTER:?}"))
}

impl<'w> Driver<'w> {
    pub(super) fn note(&self, line: String) {
        let mut t = self.trace.lock().expect("trace");
        if t.len() >= self.opts.trace_len.max(1) {
            t.pop_front();
        }
        t.push_back(format!("#{} {line}", self.op));
    }

    pub(super) fn m(&self) -> &TieringManager {
        self.manager.as_ref().expect("manager open")
    }

    pub(super) fn enabled(&self, kind: u32) -> bool {
        self.opts.faults & kind != 0
    }

    async fn one(&mut self) -> Check {
        self.rng = Rng::new(self.ops.next_u64());
        let roll = self.rng.below(1000);
        match roll {
            0..=449 => self.step_checked().await?,
            450..=599 => {
                if self.requests.len() < MAX_ACTIVE {
                    self.new_request();
                } else {
                    self.step_checked().await?;
                }
            }
            600..=659 => {
                self.wait_idle().await?;
                self.note("wait_idle".into());
            }
            660..=689 => self.wait_jobs().await?,
            690..=719 => {
                let k = key_of(self.rng.below(CONVERSATIONS), self.rng.below(CHAIN));
                self.m().touch(&[k]);
                self.note(format!("touch {k}"));
            }
            720..=779 => self.inject(),
            780..=829 => {
                let t = self.rng.below(self.tiers.len() as u64) as usize;
                self.heal(t);
                self.note(format!("heal tier {}", self.names[t]));
            }
            830..=859 if self.enabled(fault::TAMPER) => self.tamper().await,
            860..=889 if self.enabled(fault::SWEEPS) => {
                let t = self.rng.below(self.tiers.len() as u64) as usize;
                // a jump past every grace window, then (mostly) a sweep at once: the worst
                // moment for keys that probes found and promotions have not read yet
                self.world.clock_jump(t, Duration::from_secs(120));
                if self.rng.chance(700) {
                    // a deep pass reaches the keys a probe found recently: only their
                    // protection keeps them
                    let deep = self.rng.chance(300);
                    let sweep = if deep {
                        self.world.sweep_deep(t)
                    } else {
                        self.world.sweep(t)
                    };
                    tokio::time::timeout(HANG_AFTER, sweep)
                        .await
                        .map_err(|_| "a forced sweep hung".to_string())?;
                    let kind = if deep { "deep sweep" } else { "sweep" };
                    self.note(format!("clock jump and {kind}, tier {}", self.names[t]));
                } else {
                    self.note(format!("clock jump tier {}", self.names[t]));
                }
                self.take_events();
            }
            890..=919 if self.enabled(fault::ABORTS) => {
                if self.rng.chance(200) {
                    let m = self.manager.as_ref().expect("manager open");
                    tokio::time::timeout(HANG_AFTER, m.reset_cache())
                        .await
                        .map_err(|_| "reset_cache hung".to_string())?;
                    self.note("reset_cache".into());
                } else if !self.requests.is_empty() {
                    let i = self.rng.below(self.requests.len() as u64) as usize;
                    let r = self.requests.swap_remove(i);
                    self.m().on_request_finished(r.ctx.id);
                    self.note(format!("abort r{}", r.ctx.id.0));
                }
            }
            920 if self.enabled(fault::CRASHES) => self.crash().await,
            921..=939 => self.audit().await?,
            940..=954 if self.enabled(fault::RACES) => self.stale_probe_race().await?,
            _ => self.step_checked().await?,
        }
        Ok(())
    }

    pub(super) async fn run(&mut self) -> Check {
        self.open().await;
        while self.op < self.opts.ops {
            self.one().await?;
            self.check_bounds()?;
            self.op += 1;
            self.report.ops = self.op;
            if self.op.is_multiple_of(CHECKPOINT_EVERY) {
                self.checkpoint().await?;
            }
        }
        self.checkpoint().await?;
        self.audit().await?;
        let m = self.manager.take().expect("manager open");
        tokio::time::timeout(HANG_AFTER, m.shutdown())
            .await
            .map_err(|_| "shutdown hung".to_string())?
            .map_err(|e| format!("shutdown failed: {e}"))?;
        Ok(())
    }
}
