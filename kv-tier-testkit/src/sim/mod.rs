//! A seeded fault simulation: an engine played against a [`TieringManager`] over real tiers
//! (provided by a [`World`]) wrapped in [`FaultyTier`]s, with invariants checked as it goes.
//!
//! [`TieringManager`]: kv_tier_core::TieringManager
//! [`FaultyTier`]: crate::faulty::FaultyTier
//!
//! Each seed draws a sequence of operations (engine steps over requests sharing prefixes,
//! request aborts, waits, touches, DRAM resets, fault toggles, damage and deletes behind the
//! tiers' backs, forced sweeps, clock jumps, crashes with a reopen on the same storage) from
//! a deterministic generator: the same seed and options draw the same operations. What the
//! tiers do concurrently (their threads, the deadlines) is real, so a timing-dependent failure
//! may need a few replays; the operation sequence never changes (each operation draws from a
//! generator of its own, seeded from one draw per operation).
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
//!
//! [`run`] plays one seed; a module a part:
//!
//! - `world`: the [`World`] trait (the real tiers, and what may be done to them behind their
//!   backs) and [`Tamper`];
//! - `fault`: the kinds of fault ([`fault`] bits of [`SimOptions::faults`]);
//! - `rng`: [`Rng`], the deterministic generator every draw comes from;
//! - `driver`: the driver's state, the draw of each operation and the run loop;
//! - `setup`: opening the tiers (wrapped in [`FaultyTier`]s) and the manager, healing, crashes;
//! - `model`: what the tiers hold as the manager's events report it, the waits that settle
//!   keys, and the noise that excuses a `Miss`;
//! - `step`: new requests, the engine's scheduling step and the check of its `Miss` answers;
//! - `inject`: faults turned on, damage behind the tiers' backs, the directed stale-probe race;
//! - `checks`: audits, checkpoints and the bounds, lease and liveness checks.

mod checks;
mod driver;
/// Kinds of fault, as bits of [`SimOptions::faults`].
pub mod fault;
mod inject;
mod model;
mod rng;
mod setup;
mod step;
mod world;

pub use rng::Rng;
pub use world::{Tamper, World};

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use driver::Driver;

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
            ops: Rng::new(o.seed),
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
