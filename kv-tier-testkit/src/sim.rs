//! A seeded fault simulation: an engine played against a [`TieringManager`] over real tiers
//! (provided by a [`World`]) wrapped in [`FaultyTier`]s, with invariants checked as it goes.
//!
//! Each seed draws a sequence of operations (engine steps over requests sharing prefixes,
//! request aborts, waits, touches, DRAM resets, fault toggles, damage and deletes behind the
//! tiers' backs, forced sweeps, clock jumps, crashes with a reopen on the same storage) from
//! a deterministic generator: the same seed and options draw the same operations. What the
//! tiers do concurrently (their threads, the deadlines) is real, so a timing-dependent failure
//! may need a few replays; the operation sequence never changes.
//!
//! Invariants:
//! - a block served from DRAM is exactly the bytes stored for its key (every writer of a key
//!   writes the same bytes, as prefix caching does);
//! - a key a tier reported stored (an event) and never reported removed, and not damaged
//!   behind its back, is found there (checked in audits, with faults healed); a key deleted
//!   behind a tier's back and stored again loads whole;
//! - a promotion finds its key missing only where one was deleted behind the tier's back
//!   (a key a probe found is leased until its promotion ends);
//! - no `Miss` for a key a tier holds when nothing since the key settled there (a full wait
//!   after its store) could make a probe or promotion fail: no fault, failed or late probe,
//!   failed load or refused promotion;
//! - no key of a request stays `Retry`/`HitPending` for more than [`STUCK_AFTER`] steps
//!   that follow a wait for all in-flight work;
//! - at checkpoints (every [`CHECKPOINT_EVERY`] operations and at the end), once every request
//!   has ended and the work has drained: no lookup state, lease, write-back byte, DRAM pin or
//!   tier protection remains;
//! - every bounded tier is within its hard bound after every operation;
//! - nothing panics, and no wait hangs.

use std::collections::{BTreeSet, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_tier_core::{
    BlockKey, KvTierConfig, LookupResult, RequestContext, SecondaryTier, TierOptions,
    TieringManager,
};

use crate::faulty::FaultyTier;
use crate::util::{Gate, fill_block, test_key_in_group, verify_block};
use kv_tier_core::RequestId;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// Steps after a full wait that a request may stay undecided before it is a violation.
pub const STUCK_AFTER: u32 = 8;
/// Operations between checkpoints.
pub const CHECKPOINT_EVERY: u64 = 1_000;
/// How long any single wait may take before it counts as a hang.
pub const HANG_AFTER: Duration = Duration::from_secs(30);

/// Bytes per block in the simulation.
pub const BLOCK_SIZE: usize = 4096;
/// DRAM slots.
pub const DRAM_SLOTS: usize = 48;

/// Damage done to a stored block behind its tier's back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tamper {
    /// The block is deleted.
    Delete,
    /// The block is cut short.
    Truncate,
    /// One byte of the block is flipped.
    FlipByte,
    /// The block is replaced by other bytes of the same size, written without a checksum.
    Replace,
    /// The block is replaced by another key's stored block, checksum and all.
    CopyOf(BlockKey),
}

/// The real tiers a simulation runs over, and what it may do to them behind their backs.
/// Only `open` is required: a world that cannot tamper, sweep or measure keeps the defaults
/// (no damage, no sweeps, no bounds to check).
pub trait World: Send {
    /// Opens every tier (again on the same storage after a crash), in order, with the
    /// manager's options for each.
    fn open(&mut self) -> BoxFuture<'_, Vec<(Arc<dyn SecondaryTier>, TierOptions)>>;
    /// A crash: drops every handle to the tiers opened last, without shutdown, and returns
    /// once they are gone (their last users, work the dropped manager had in flight, end at
    /// their deadlines), as a killed process's tiers would be.
    fn crash(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// Damages `key`'s stored block in tier `tier`; `false` when it has none there (or the
    /// world cannot).
    fn tamper(&mut self, _tier: usize, _key: BlockKey, _how: Tamper) -> BoxFuture<'_, bool> {
        Box::pin(async { false })
    }
    /// Runs an eviction pass of tier `tier` now (nothing for unbounded tiers).
    fn sweep(&mut self, _tier: usize) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// Runs an eviction pass of tier `tier` that goes below its bound (as when its storage
    /// runs out of space): only protected keys are spared. Defaults to [`World::sweep`].
    fn sweep_deep(&mut self, tier: usize) -> BoxFuture<'_, ()> {
        self.sweep(tier)
    }
    /// Makes tier `tier`'s backend stop answering (requests hang inside the tier, past its
    /// deadlines) until [`World::heal_backend`]; `false` where the world cannot.
    fn hang_backend(&mut self, _tier: usize) -> bool {
        false
    }
    /// Lets tier `tier`'s backend answer again.
    fn heal_backend(&mut self, _tier: usize) {}
    /// A count that grows whenever tier `tier` answers a probe "absent" without knowing (its
    /// own lookup deadline passed, a request failed) while reporting no error; such an answer
    /// excuses a `Miss`. 0 for tiers that report every such case as an error.
    fn quiet_absences(&self, _tier: usize) -> u64 {
        0
    }
    /// Moves tier `tier`'s clock forward (grace windows, stamp limits).
    fn clock_jump(&mut self, _tier: usize, _by: Duration) {}
    /// `(used, hard bound)` of a bounded tier, `None` for an unbounded one.
    fn usage(&self, _tier: usize) -> Option<(u64, u64)> {
        None
    }
    /// What tier `tier` occupies on its storage as measured there (for a file tier: what `du`
    /// counts), when the world can measure it: checked against the hard bound at checkpoints,
    /// so a tier that miscounts is caught.
    fn measured_usage(&self, _tier: usize) -> Option<u64> {
        None
    }
    /// What the storage holds for `key` in tier `tier`, for a violation's report.
    fn describe(&self, _tier: usize, key: BlockKey) -> BoxFuture<'_, String> {
        Box::pin(async move { format!("{key}: the world cannot look") })
    }
}

/// Kinds of fault, as bits of [`SimOptions::faults`].
pub mod fault {
    /// Probes fail.
    pub const PROBE_ERRORS: u32 = 1;
    /// Every n-th block stored or loaded fails.
    pub const JOB_ERRORS: u32 = 1 << 1;
    /// Probes and jobs sleep first.
    pub const DELAYS: u32 = 1 << 2;
    /// Probes or jobs hang (past the manager's deadlines).
    pub const HANGS: u32 = 1 << 3;
    /// Probes or loads panic.
    pub const PANICS: u32 = 1 << 4;
    /// Blocks deleted, cut short or flipped behind the tier's back.
    pub const TAMPER: u32 = 1 << 5;
    /// Eviction passes forced and clocks moved.
    pub const SWEEPS: u32 = 1 << 6;
    /// The process "crashes": the manager and tiers are dropped without shutdown and the
    /// tiers reopened on the same storage.
    pub const CRASHES: u32 = 1 << 7;
    /// Requests aborted mid-flight, DRAM reset while work runs.
    pub const ABORTS: u32 = 1 << 8;
    /// Directed interleavings (a stale probe answer raced against a store, with stores that
    /// fill DRAM in between).
    pub const RACES: u32 = 1 << 9;
    /// Every kind.
    pub const ALL: u32 = (1 << 10) - 1;
    /// Names, in bit order.
    pub const NAMES: [&str; 10] = [
        "probe-errors",
        "job-errors",
        "delays",
        "hangs",
        "panics",
        "tamper",
        "sweeps",
        "crashes",
        "aborts",
        "races",
    ];
}

/// What one seed runs.
#[derive(Debug, Clone)]
pub struct SimOptions {
    /// The seed.
    pub seed: u64,
    /// Operations to run.
    pub ops: u64,
    /// Which kinds of fault are drawn ([`fault`] bits).
    pub faults: u32,
    /// How many of the last operations a violation's trace shows.
    pub trace_len: usize,
}

impl SimOptions {
    /// `ops` operations of `seed` with every kind of fault.
    pub fn new(seed: u64, ops: u64) -> Self {
        Self {
            seed,
            ops,
            faults: fault::ALL,
            trace_len: 40,
        }
    }
}

/// A broken invariant.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The operation at which it was seen (0-based).
    pub op: u64,
    /// What broke.
    pub what: String,
    /// The last operations before it, oldest first.
    pub trace: Vec<String>,
}

/// What a seed did.
#[derive(Debug, Clone, Default)]
pub struct SimReport {
    /// Operations run.
    pub ops: u64,
    /// Blocks verified byte for byte from DRAM.
    pub verified_blocks: u64,
    /// Faults turned on.
    pub faults_injected: u64,
    /// Audit lookups of keys the model expects present.
    pub audited_keys: u64,
    /// Crashes survived.
    pub crashes: u64,
    /// The first violation, if any (the run stops there).
    pub violation: Option<Violation>,
}

/// A small deterministic generator (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed ^ 0x5851_f42d_4c95_7f2d)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// `true` with probability `p` per mille.
    pub fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

/// Conversations whose keys requests draw (prefixes shared between requests).
const CONVERSATIONS: u64 = 12;
/// Blocks per conversation.
const CHAIN: u64 = 20;
/// Requests in flight at most.
const MAX_ACTIVE: usize = 4;

fn key_of(conv: u64, i: u64) -> BlockKey {
    test_key_in_group(conv * 64 + i, 0)
}

fn all_keys() -> Vec<BlockKey> {
    (0..CONVERSATIONS)
        .flat_map(|c| (0..CHAIN).map(move |i| key_of(c, i)))
        .collect()
}

struct Request {
    ctx: RequestContext,
    keys: Vec<BlockKey>,
    /// Per key of the prefix: steps after a full wait that its answer has stayed `Retry` or
    /// `HitPending` in a row.
    stuck: Vec<u32>,
    /// The operation that made it.
    created: u64,
}

/// A tier as the driver holds it: the fault wrapper and the gates it closed.
struct Tier {
    faulty: Arc<FaultyTier>,
    gates: Vec<Gate>,
}

struct Driver<'w> {
    world: &'w mut dyn World,
    opts: SimOptions,
    rng: Rng,
    manager: Option<TieringManager>,
    tiers: Vec<Tier>,
    names: Vec<String>,
    requests: Vec<Request>,
    next_req: u64,
    /// A full wait happened since the last step.
    waited: bool,
    /// Per tier: keys it reported stored and not removed, not tampered with.
    durable: Vec<BTreeSet<BlockKey>>,
    /// Per tier: keys deleted behind its back (an audit stores them again directly).
    deleted: Vec<BTreeSet<BlockKey>>,
    /// Per tier: deletes behind its back since the manager was opened.
    deletes_since_open: Vec<u64>,
    /// Per tier: durable keys, with the operation of the first full wait after they became
    /// durable (from then on the manager has applied their store).
    settled: Vec<std::collections::BTreeMap<BlockKey, u64>>,
    /// Per tier: the last operation at which something made a probe or promotion of it fail
    /// for the requests asking (a probe error, timeout, panic or late answer, a failed or
    /// abandoned job, an absence the tier reported without knowing), and the counters that say
    /// so.
    noise: Vec<(u64, [u64; 5])>,
    /// Per tier: the last operation at which a promotion was refused (no DRAM room) or
    /// cancelled, and the counters. Such a `Miss` holds for that lookup only (the next one
    /// probes again), so it excuses the `Miss` answers of its own step alone.
    transient: Vec<(u64, [u64; 2])>,
    /// Per tier: keys stored there behind the manager's back (audits): a request may keep an
    /// honest `Miss` for them, as the manager never saw the store.
    outside: Vec<BTreeSet<BlockKey>>,
    /// Per tier: keys stored through the manager since it opened, with the operation at which
    /// the store was first seen (the manager applies it then or at its next drain, and that
    /// ends every request's negative answer for the key). Keys held from before a crash are
    /// not here: a request may keep a `Miss` for them from a probe that failed.
    stored_here: Vec<std::collections::BTreeMap<BlockKey, u64>>,
    trace: Arc<Mutex<VecDeque<String>>>,
    report: SimReport,
    op: u64,
}

type Check = Result<(), String>;

/// For a `Miss` of `key` to a request made at operation `created`: if the manager applied the
/// key's store in the tier (`settled`, from `stored_here`) before this step, the operation
/// from which any noise of the tier would excuse the `Miss` (the store's, or the request's if
/// later).
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

fn quiet_since(
    settled: &std::collections::BTreeMap<BlockKey, u64>,
    stored_here: &std::collections::BTreeMap<BlockKey, u64>,
    key: &BlockKey,
    created: u64,
) -> Option<u64> {
    settled.get(key)?;
    Some((*stored_here.get(key)?).max(created))
}

async fn bounded<F: Future>(what: &str, fut: F) -> Result<F::Output, String> {
    tokio::time::timeout(HANG_AFTER, fut)
        .await
        .map_err(|_| format!("{what} hung for {HANG_AFTER:?}"))
}

impl<'w> Driver<'w> {
    fn note(&self, line: String) {
        let mut t = self.trace.lock().expect("trace");
        if t.len() >= self.opts.trace_len.max(1) {
            t.pop_front();
        }
        t.push_back(format!("#{} {line}", self.op));
    }

    fn m(&self) -> &TieringManager {
        self.manager.as_ref().expect("manager open")
    }

    fn enabled(&self, kind: u32) -> bool {
        self.opts.faults & kind != 0
    }

    async fn open(&mut self) {
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
            b = b.tier_with_options(faulty.clone(), o);
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

    fn heal(&mut self, t: usize) {
        self.world.heal_backend(t);
        let tier = &mut self.tiers[t];
        tier.faulty.heal();
        for g in tier.gates.drain(..) {
            g.open();
        }
    }

    fn heal_all(&mut self) {
        for t in 0..self.tiers.len() {
            self.heal(t);
        }
    }

    /// Applies the manager's events to the model.
    fn take_events(&mut self) {
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

    async fn wait_idle(&mut self) -> Check {
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
    async fn wait_jobs(&mut self) -> Check {
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

    /// A directed interleaving: a probe of a key looks (absent) and holds its answer; the key
    /// is stored through the manager and applied; DRAM lets go of it; the request asks again
    /// (a new probe); only then does the old answer arrive. The old answer is stale and must
    /// not make the key a miss for the request (the manager's generation guard). The race
    /// needs every step within the probe deadline; when one is late the op ends as noise.
    async fn stale_probe_race(&mut self) -> Check {
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

    /// Records, per tier, whether anything happened that may make a probe or a promotion of
    /// it fail (so a `Miss` may be honest).
    fn note_noise(&mut self) {
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

    fn new_request(&mut self) {
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
    async fn step_checked(&mut self) -> Check {
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

    fn inject(&mut self) {
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

    async fn tamper(&mut self) {
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

    /// With faults healed and work drained, the keys tiers reported stored are found there.
    async fn audit(&mut self) -> Check {
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
            let tier = self.tiers[t].faulty.clone();
            let found = bounded("an audit lookup", tier.lookup(&sample))
                .await?
                .map_err(|e| format!("audit lookup in {} failed: {e}", self.names[t]))?;
            self.report.audited_keys += sample.len() as u64;
            let missing: Vec<BlockKey> = sample
                .iter()
                .zip(&found)
                .filter(|(_, f)| !**f)
                .map(|(k, _)| *k)
                .collect();
            if missing.is_empty() {
                continue;
            }
            // an eviction may have raced the lookup: its removal event says so
            tokio::time::sleep(Duration::from_millis(20)).await;
            self.take_events();
            let lost: Vec<&BlockKey> = missing
                .iter()
                .filter(|k| self.durable[t].contains(k))
                .collect();
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
    fn check_bounds(&self) -> Check {
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
    async fn checkpoint(&mut self) -> Check {
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

    async fn crash(&mut self) {
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

    async fn one(&mut self) -> Check {
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

    async fn run(&mut self) -> Check {
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

/// Runs one seed over `world` (fresh storage) on the current runtime. A panic anywhere in the
/// driver or the library is a violation too.
pub async fn run(world: Box<dyn World>, opts: SimOptions) -> SimReport {
    let trace = Arc::new(Mutex::new(VecDeque::new()));
    let shared = trace.clone();
    let o = opts.clone();
    let task = tokio::spawn(async move {
        let mut world = world;
        let mut d = Driver {
            world: &mut *world,
            rng: Rng::new(o.seed),
            opts: o,
            manager: None,
            tiers: Vec::new(),
            names: Vec::new(),
            requests: Vec::new(),
            next_req: 0,
            waited: false,
            durable: Vec::new(),
            deleted: Vec::new(),
            deletes_since_open: Vec::new(),
            settled: Vec::new(),
            noise: Vec::new(),
            transient: Vec::new(),
            outside: Vec::new(),
            stored_here: Vec::new(),
            trace: shared,
            report: SimReport::default(),
            op: 0,
        };
        let res = d.run().await;
        let mut report = std::mem::take(&mut d.report);
        if let Err(what) = res {
            report.violation = Some(Violation {
                op: d.op,
                what,
                trace: Vec::new(),
            });
        }
        // drop what is left (a crashed run's manager) off the runtime's async context
        let m = d.manager.take();
        drop(d);
        if let Some(m) = m {
            let _ = tokio::time::timeout(HANG_AFTER, m.shutdown()).await;
        }
        report
    });
    let mut report = match task.await {
        Ok(r) => r,
        Err(e) => {
            let msg = if e.is_panic() {
                let p = e.into_panic();
                p.downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "a panic".into())
            } else {
                "the driver was cancelled".into()
            };
            SimReport {
                violation: Some(Violation {
                    op: u64::MAX,
                    what: format!("panic: {msg}"),
                    trace: Vec::new(),
                }),
                ..SimReport::default()
            }
        }
    };
    if let Some(v) = &mut report.violation {
        v.trace = trace.lock().expect("trace").iter().cloned().collect();
        if v.op == u64::MAX {
            v.op = v
                .trace
                .last()
                .and_then(|l| l.split_whitespace().next())
                .and_then(|n| n.trim_start_matches('#').parse().ok())
                .unwrap_or(0);
        }
    }
    report
}
