//! [`ProbeCache`]: non-blocking existence answers for one secondary tier, with batched probes
//! that have a deadline, a generation per probe so that a completed store is authoritative
//! over a late probe, and leases that keep a found key in its tier until it is promoted.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use futures::FutureExt;
use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::Notify;

use crate::key::BlockKey;
use crate::request::RequestId;
pub use crate::stats::ProbeCacheStats;
use crate::sync::lock;
use crate::tier::{ProtectGuard, SecondaryTier, holds_caught, protect_caught};

mod inspect;
mod lease;
use lease::{Lease, LeaseTable, reap_leases};

/// The probe cache's answer for one key and request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// The tier has the block (and it is leased there until its promotion ends).
    Present,
    /// The tier does not have it (for this request).
    Absent,
    /// Not known yet: a probe is queued or in flight; ask again next step.
    Retry,
}

/// Why a key is [`Presence::Absent`] for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Absence {
    /// The tier's probe answered that it does not have it.
    NotFound,
    /// The probe was still out when the request stopped waiting for it (the tier's probe
    /// budget).
    OverBudget,
    /// The probe passed its deadline.
    TimedOut,
    /// The probe failed, panicked, gave the wrong number of answers or was dropped.
    ProbeFailed,
    /// The tier had it, but loading it for this request failed.
    LoadFailed,
    /// The tier has it, but the manager declined to load it for this request: recomputing
    /// it is faster.
    Declined,
}

#[derive(Default)]
struct KeyState {
    /// Known present (from a completed store or a probe), with its lease.
    present: Option<Lease>,
    /// Generation of the probe in flight for this key, if any.
    pending: Option<u64>,
    /// When that probe was sent (`None` while it is queued).
    sent: Option<Instant>,
    /// Requests waiting for the pending probe.
    waiters: Vec<RequestId>,
    /// Requests for which the key is a miss, and why (negative answers live only in request
    /// scope).
    missed_by: Vec<(RequestId, Absence)>,
    /// Requests that reference this entry; it is dropped when none do and no probe is pending.
    refs: u32,
    /// When a request first asked for the key (since the entry exists).
    since: Option<Instant>,
}

/// How a probe batch ended.
enum Outcome {
    Answered(Vec<bool>),
    Failed(crate::Error),
    Panicked,
    TimedOut,
    /// The probe's task was dropped unrun or mid-way (its runtime shut down).
    Dropped,
}

struct ProbeBatch {
    /// The batch's number, in the order batches were sent.
    seq: u64,
    keys: Vec<(BlockKey, u64)>,
    outcome: Outcome,
    /// How long the probe took.
    took: Duration,
    /// Protects every key of the batch from the moment it was sent until its answer is
    /// applied (present keys then take leases of their own).
    _guard: ProtectGuard,
}

/// Hands a probe's outcome to the lookup exactly once, even if the probe's task is dropped.
struct Report {
    seq: u64,
    batch: Option<(Vec<(BlockKey, u64)>, ProtectGuard)>,
    inbox: Arc<Mutex<Vec<ProbeBatch>>>,
    notify: Arc<Notify>,
    sent: Instant,
}

impl Report {
    fn send(&mut self, outcome: Outcome) {
        if let Some((keys, guard)) = self.batch.take() {
            lock(&self.inbox).push(ProbeBatch {
                seq: self.seq,
                keys,
                outcome,
                took: self.sent.elapsed(),
                _guard: guard,
            });
            self.notify.notify_waiters();
        }
    }
}

impl Drop for Report {
    fn drop(&mut self) {
        self.send(Outcome::Dropped);
    }
}

/// Non-blocking existence answers for one secondary tier.
///
/// A key the tier answers for from memory ([`SecondaryTier::holds`]) is `Present` (leased) or
/// `Absent` at its first ask, with no probe. Otherwise the first [`ProbeCache::ask`] of a key
/// returns [`Presence::Retry`] and queues one probe;
/// queued probes are sent as one batch by [`ProbeCache::flush`] (at schedule end) and run on
/// the runtime, off the caller's thread, within a deadline; their answers apply at
/// [`ProbeCache::apply_results`] (the start of the next step). A probe that errs, panics or
/// passes its deadline answers "absent" for its keys. Positive answers are shared by all
/// requests; negative answers are kept per request and dropped when it finishes.
///
/// Every probe carries a generation from one counter per lookup: a completed store
/// ([`ProbeCache::mark_stored`]) or failed load ([`ProbeCache::mark_miss`]) makes every
/// probe in flight for its keys stale, so a late probe never overwrites it, even after the
/// key's state was dropped and re-created.
///
/// A key found present is leased: protected from eviction in the tier from the moment its
/// probe is sent until [`ProbeCache::release`] (the promotion ended), every request that
/// asked for it finished, or the lease expires (then the key is probed again if asked; but an
/// answer that expired before any ask used it is renewed once and answered `Present`, so a
/// lease shorter than the scheduler's steps cannot keep a key at `Retry`).
pub struct ProbeCache {
    tier: Arc<dyn SecondaryTier>,
    runtime: tokio::runtime::Handle,
    keys: FxHashMap<BlockKey, KeyState>,
    requests: FxHashMap<RequestId, FxHashSet<BlockKey>>,
    queue: Vec<(BlockKey, u64)>,
    inbox: Arc<Mutex<Vec<ProbeBatch>>>,
    notify: Arc<Notify>,
    /// Batches sent so far (the next batch's number).
    batches_sent: u64,
    /// Numbers of the batches sent and not yet applied (how many are in flight).
    outstanding: std::collections::BTreeSet<u64>,
    /// The one generation counter: probes and leases take numbers from it.
    next_gen: u64,
    probe_timeout: Duration,
    /// How long a lookup waits for a probe before counting the key absent for its request.
    budget: Duration,
    /// When answers were last applied (the step's start): the budget is judged against it,
    /// so a verdict changes only where answers are applied, never in the middle of a step.
    applied_at: Instant,
    lease_for: Duration,
    /// Latency of the probe batches.
    latency: crate::stats::LatencyHistogram,
    /// Every live lease's protection, by lease id; the reaper ends expired ones, an ask that
    /// finds its key's lease expired forgets it (see [`ProbeCache::ask`]).
    leases: LeaseTable,
    reaper: Option<tokio::task::JoinHandle<()>>,
    stats: ProbeCacheStats,
    /// The tier's name (the metrics' label).
    name: String,
    /// The WARN of probes past their deadline, and that of failed ones: once per
    /// [`crate::stats::LOG_INTERVAL`] each, with the count (every one is counted in `stats`).
    log_timeouts: crate::stats::Throttle,
    log_failures: crate::stats::Throttle,
}

impl Drop for ProbeCache {
    fn drop(&mut self) {
        if let Some(r) = self.reaper.take() {
            r.abort();
        }
    }
}

impl fmt::Debug for ProbeCache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProbeCache")
            .field("tier", &self.tier.info().name)
            .field("tracked_keys", &self.keys.len())
            .field("queued", &self.queue.len())
            .field("in_flight", &self.outstanding.len())
            .finish()
    }
}

/// The default probe deadline (see [`crate::KvTierConfig::probe_timeout_s`]).
pub const DEFAULT_PROBE_TIMEOUT: Duration = Duration::from_secs(1);
/// The default lease (see [`crate::KvTierConfig::lease_s`]).
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

impl ProbeCache {
    /// A probe cache over `tier`, running probes on `runtime` (which must have timers
    /// enabled) and waking `notify` when a probe's answer arrives; default deadline and lease.
    pub fn new(
        tier: Arc<dyn SecondaryTier>,
        runtime: tokio::runtime::Handle,
        notify: Arc<Notify>,
    ) -> Self {
        Self {
            name: tier.info().name,
            tier,
            runtime,
            keys: FxHashMap::default(),
            requests: FxHashMap::default(),
            queue: Vec::new(),
            inbox: Arc::new(Mutex::new(Vec::new())),
            notify,
            batches_sent: 0,
            outstanding: std::collections::BTreeSet::new(),
            next_gen: 0,
            probe_timeout: DEFAULT_PROBE_TIMEOUT,
            budget: DEFAULT_PROBE_TIMEOUT,
            lease_for: DEFAULT_LEASE,
            latency: crate::stats::LatencyHistogram::default(),
            leases: Arc::new(Mutex::new(FxHashMap::default())),
            reaper: None,
            applied_at: Instant::now(),
            stats: ProbeCacheStats::default(),
            log_timeouts: crate::stats::Throttle::new(crate::stats::LOG_INTERVAL),
            log_failures: crate::stats::Throttle::new(crate::stats::LOG_INTERVAL),
        }
    }

    /// Sets the probe deadline and the lease of found keys.
    pub fn with_timeouts(mut self, probe_timeout: Duration, lease: Duration) -> Self {
        self.probe_timeout = probe_timeout;
        self.lease_for = lease;
        if let Some(r) = self.reaper.take() {
            r.abort();
        }
        self
    }

    /// Sets the probe budget: how long a lookup waits for a probe before it counts the key as
    /// absent in this tier for its request (default: the whole probe deadline). The probe
    /// itself goes on until its deadline, and a late answer serves later lookups.
    ///
    /// The wait is judged where answers are applied ([`ProbeCache::apply_results`], at the
    /// start of a scheduling step): a key whose probe was sent at least the budget before
    /// that moment and had not answered by then is absent for the requests that asked for it
    /// then, for as long as they live (a request's verdict does not flip from `Miss` to a hit:
    /// its engine has planned to compute those tokens). The answer is not discarded when it
    /// arrives: it is applied at the next application and serves every other request from
    /// then on.
    pub fn with_budget(mut self, budget: Duration) -> Self {
        self.budget = budget;
        self
    }

    /// Latency of the probe batches so far.
    pub fn latency(&self) -> &crate::stats::LatencyHistogram {
        &self.latency
    }

    fn generation(&mut self) -> u64 {
        self.next_gen += 1;
        self.next_gen
    }

    fn lease(&mut self, key: &BlockKey) -> Lease {
        let id = self.generation();
        let expires = Instant::now() + self.lease_for;
        let guard = protect_caught(&*self.tier, std::slice::from_ref(key));
        lock(&self.leases).insert(id, (expires, guard));
        if self.reaper.is_none() {
            // a quarter of the lease: an expired lease is dropped within 1.25 leases
            let tick = (self.lease_for / 4).max(Duration::from_millis(1));
            let table = Arc::downgrade(&self.leases);
            self.reaper = Some(self.runtime.spawn(reap_leases(table, tick)));
        }
        Lease {
            id,
            expires,
            table: self.leases.clone(),
            seen: false,
        }
    }

    /// The answer for `key` in request `req`, queueing a probe when unknown.
    pub fn ask(&mut self, key: &BlockKey, req: RequestId) -> Presence {
        let new_ref = self.requests.entry(req).or_default().insert(*key);
        let expired = {
            let e = self.keys.entry(*key).or_default();
            if new_ref {
                e.refs += 1;
            }
            e.since.get_or_insert_with(Instant::now);
            if e.missed_by.iter().any(|(r, _)| *r == req) {
                return Presence::Absent;
            }
            match &mut e.present {
                Some(l) if l.expires > Instant::now() => {
                    l.seen = true;
                    return Presence::Present;
                }
                // an answer no ask has used yet (the scheduler came back later than the
                // lease): renewed below and used once, not probed again (with a lease shorter
                // than the scheduler's steps, every answer would expire unused and the key
                // stay `Retry` for good)
                Some(l) if !l.seen => Some(true),
                Some(_) => {
                    e.present = None;
                    Some(false)
                }
                None => None,
            }
        };
        if expired.is_some() {
            self.stats.leases_expired += 1;
        }
        if expired == Some(true) {
            let mut lease = self.lease(key);
            lease.seen = true;
            // the old lease drops here, after the new protection is taken
            self.keys.get_mut(key).expect("entry made above").present = Some(lease);
            return Presence::Present;
        }
        // a probe sent at least the budget before answers were last applied, and unanswered
        // then: this request goes on without it
        let (budget, applied_at) = (self.budget, self.applied_at);
        if let Some(e) = self.keys.get_mut(key)
            && e.pending.is_some()
            && e.sent
                .is_some_and(|t| applied_at.saturating_duration_since(t) >= budget)
        {
            e.waiters.retain(|r| *r != req);
            miss_for(&mut e.missed_by, req, Absence::OverBudget);
            self.stats.over_budget += 1;
            return Presence::Absent;
        }
        let need_probe = self.keys.get(key).is_some_and(|e| e.pending.is_none());
        if need_probe && let Some(p) = self.known(key, req) {
            return p;
        }
        let generation = if need_probe {
            Some(self.generation())
        } else {
            None
        };
        let e = self.keys.get_mut(key).expect("entry made above");
        if let Some(g) = generation {
            e.pending = Some(g);
            e.sent = None;
            self.queue.push((*key, g));
        }
        if !e.waiters.contains(&req) {
            e.waiters.push(req);
        }
        Presence::Retry
    }

    /// The tier's own answer for `key` ([`SecondaryTier::holds`]), if it has one: a held key
    /// is asked again under a new lease's protection (it may have been evicted between the
    /// two) and is `Present` on that lease; a key not held is a miss for `req`.
    fn known(&mut self, key: &BlockKey, req: RequestId) -> Option<Presence> {
        let mut held = holds_caught(&*self.tier, key)?;
        let mut lease = None;
        if held {
            let mut l = self.lease(key);
            l.seen = true;
            held = holds_caught(&*self.tier, key)?;
            lease = held.then_some(l);
        }
        let e = self.keys.get_mut(key).expect("asked above");
        if held {
            self.stats.known_present += 1;
            e.present = lease;
            Some(Presence::Present)
        } else {
            self.stats.known_absent += 1;
            miss_for(&mut e.missed_by, req, Absence::NotFound);
            Some(Presence::Absent)
        }
    }

    /// A completed store: every probe in flight for the keys is stale (it may have looked
    /// before the store), and the keys are no longer a miss for any request. Keys no request
    /// tracks are not kept.
    ///
    /// The store does not make a key "present" here: between the store and a promotion that
    /// may come much later, the tier may evict it. The next ask probes (and leases) it, so a
    /// promotion only ever reads a key that is protected in its tier.
    pub fn mark_stored(&mut self, keys: &[BlockKey]) {
        for k in keys {
            let Some(e) = self.keys.get_mut(k) else {
                continue;
            };
            if e.refs == 0 {
                // only a stale probe kept it: that probe is superseded, nobody asks
                self.keys.remove(k);
                continue;
            }
            e.pending = None;
            e.waiters.clear();
            e.missed_by.clear();
        }
    }

    /// The manager declined to load `keys` for request `req` (recomputing them is faster):
    /// they are absent for it ([`Absence::Declined`]) until it finishes, and it no longer
    /// waits for their probes (which go on, for everyone else); for everyone else they stay
    /// as they are. For a live request only, whether it asked this tier or not (what it
    /// keeps here goes when it finishes, [`ProbeCache::finish_request`]).
    pub fn mark_declined(&mut self, keys: &[BlockKey], req: RequestId) {
        let set = self.requests.entry(req).or_default();
        for k in keys {
            let fresh = set.insert(*k);
            let e = self.keys.entry(*k).or_default();
            if fresh {
                e.refs += 1;
            }
            e.waiters.retain(|r| *r != req);
            miss_for(&mut e.missed_by, req, Absence::Declined);
        }
    }

    /// A failed load for request `req`: the keys are a miss for it, no longer known present
    /// for anyone, and a probe in flight for them is stale (other waiters probe again).
    ///
    /// For a request this lookup does not know (it finished), nothing is created: the keys'
    /// shared state is updated and the answer is otherwise ignored.
    pub fn mark_miss(&mut self, keys: &[BlockKey], req: RequestId) {
        match self.requests.get_mut(&req) {
            Some(set) => {
                for k in keys {
                    let fresh = set.insert(*k);
                    let e = self.keys.entry(*k).or_default();
                    if fresh {
                        e.refs += 1;
                    }
                    miss_for(&mut e.missed_by, req, Absence::LoadFailed);
                }
            }
            None => self.stats.ignored_answers += 1,
        }
        self.mark_load_failed(keys);
    }

    /// A failed load for no request (the manager's own, measuring the tier): the keys are no
    /// longer known present for anyone, and a probe in flight for them is stale.
    pub fn mark_load_failed(&mut self, keys: &[BlockKey]) {
        for k in keys {
            let Some(e) = self.keys.get_mut(k) else {
                continue;
            };
            e.present = None;
            e.pending = None;
            e.waiters.clear();
            if e.refs == 0 {
                self.keys.remove(k);
            }
        }
    }

    /// The promotion of `keys` ended (the manager's load job protected them meanwhile), or
    /// will not happen (no DRAM room, request finished): their leases end, and their
    /// "present" answers with them (a later ask probes again).
    pub fn release(&mut self, keys: &[BlockKey]) {
        for k in keys {
            if let Some(e) = self.keys.get_mut(k) {
                e.present = None;
            }
        }
    }

    /// Forgets a finished request's negative answers and references; keys no live request
    /// asks for are dropped with their leases, and with their probes queued and not sent yet
    /// (a probe in flight keeps its key until its answer is applied).
    pub fn finish_request(&mut self, req: RequestId) {
        let Some(keys) = self.requests.remove(&req) else {
            return;
        };
        let mut unqueued = FxHashSet::default();
        for k in keys {
            if let Some(e) = self.keys.get_mut(&k) {
                e.refs = e.refs.saturating_sub(1);
                e.missed_by.retain(|(r, _)| *r != req);
                e.waiters.retain(|r| *r != req);
                if e.refs > 0 {
                    continue;
                }
                // a probe queued and not sent yet is asked of nobody now: it goes with the key
                let queued = e.pending.is_some() && e.sent.is_none();
                if e.pending.is_none() || queued {
                    self.keys.remove(&k);
                }
                if queued {
                    unqueued.insert(k);
                }
            }
        }
        if !unqueued.is_empty() {
            self.queue.retain(|(k, _)| !unqueued.contains(k));
        }
    }

    /// Sends the queued probes as one batch on the runtime. Returns how many keys were sent.
    ///
    /// The batch's keys are protected in the tier from now until the answer is applied; the
    /// probe runs within the probe deadline, and an error, panic, timeout or dropped task is
    /// reported as such (never lost).
    pub fn flush(&mut self) -> usize {
        if self.queue.is_empty() {
            return 0;
        }
        let batch = std::mem::take(&mut self.queue);
        let n = batch.len();
        let seq = self.batches_sent;
        self.batches_sent += 1;
        self.outstanding.insert(seq);
        self.stats.probes += 1;
        self.stats.probed_keys += n as u64;
        let keys: Vec<BlockKey> = batch.iter().map(|(k, _)| *k).collect();
        let guard = protect_caught(&*self.tier, &keys);
        let sent = Instant::now();
        for (k, g) in &batch {
            if let Some(e) = self.keys.get_mut(k)
                && e.pending == Some(*g)
            {
                e.sent = Some(sent);
            }
        }
        let mut report = Report {
            seq,
            batch: Some((batch, guard)),
            inbox: self.inbox.clone(),
            notify: self.notify.clone(),
            sent,
        };
        let tier = self.tier.clone();
        let deadline = self.probe_timeout;
        self.runtime.spawn(async move {
            let probe = AssertUnwindSafe(tier.lookup(&keys)).catch_unwind();
            let outcome = match tokio::time::timeout(deadline, probe).await {
                Ok(Ok(Ok(answers))) => Outcome::Answered(answers),
                Ok(Ok(Err(e))) => Outcome::Failed(e),
                Ok(Err(_)) => Outcome::Panicked,
                Err(_) => Outcome::TimedOut,
            };
            report.send(outcome);
        });
        n
    }

    /// Applies the probe answers that have arrived. Returns how many batches were applied.
    pub fn apply_results(&mut self) -> usize {
        self.applied_at = Instant::now();
        let batches = std::mem::take(&mut *lock(&self.inbox));
        let n = batches.len();
        for batch in batches {
            self.outstanding.remove(&batch.seq);
            self.latency.record(batch.took);
            crate::metrics::record_probe(&self.name, batch.took);
            if batch.took > self.budget && matches!(batch.outcome, Outcome::Answered(_)) {
                self.stats.late_answers += 1;
            }
            let (answers, absence) = self.answers(batch.keys.len(), batch.outcome);
            for ((key, generation), present) in batch.keys.into_iter().zip(answers) {
                let Some(e) = self.keys.get_mut(&key) else {
                    continue;
                };
                if e.pending != Some(generation) {
                    self.stats.stale_answers += 1;
                    continue;
                }
                e.pending = None;
                e.sent = None;
                let waiters = std::mem::take(&mut e.waiters);
                if e.refs == 0 {
                    self.keys.remove(&key);
                    continue;
                }
                if present {
                    // taken before the batch's guard drops: the key stays protected
                    let lease = self.lease(&key);
                    self.keys.get_mut(&key).expect("present above").present = Some(lease);
                } else {
                    for w in waiters {
                        miss_for(&mut e.missed_by, w, absence);
                    }
                }
            }
            // the batch's guard drops here
        }
        n
    }

    /// A batch's answers, and why its absent keys are absent.
    fn answers(&mut self, n: usize, outcome: Outcome) -> (Vec<bool>, Absence) {
        let name = || self.tier.info().name;
        match outcome {
            Outcome::Answered(a) if a.len() == n => {
                let found = a.iter().filter(|p| **p).count() as u64;
                self.stats.keys_found += found;
                self.stats.keys_absent += n as u64 - found;
                return (a, Absence::NotFound);
            }
            Outcome::Answered(a) => {
                self.stats.probe_errors += 1;
                if let Some(probes) = self.log_failures.note() {
                    tracing::warn!(tier = %name(), probes, expected = n, got = a.len(), "existence probe returned the wrong number of answers (failed probes since the last such line: probes, counted in probe_errors); counting all as absent");
                }
            }
            Outcome::Failed(err) => {
                self.stats.probe_errors += 1;
                if let Some(probes) = self.log_failures.note() {
                    tracing::warn!(tier = %name(), probes, keys = n, error = %err, "existence probe failed (failed probes since the last such line: probes, counted in probe_errors); counting its keys as absent");
                }
            }
            Outcome::Panicked => {
                // a bug in the tier: said every time
                self.stats.probe_panics += 1;
                tracing::error!(tier = %name(), keys = n, "existence probe panicked; counting its keys as absent");
            }
            Outcome::TimedOut => {
                self.stats.probe_timeouts += 1;
                if let Some(probes) = self.log_timeouts.note() {
                    tracing::warn!(tier = %name(), probes, keys = n, deadline = ?self.probe_timeout, "existence probe passed its deadline (probes since the last such line, counted in probe_timeouts); counting its keys as absent");
                }
                return (vec![false; n], Absence::TimedOut);
            }
            Outcome::Dropped => {
                self.stats.probe_errors += 1;
                if let Some(probes) = self.log_failures.note() {
                    tracing::warn!(tier = %name(), probes, keys = n, "existence probe was dropped (runtime shut down) (failed probes since the last such line: probes, counted in probe_errors); counting its keys as absent");
                }
            }
        }
        (vec![false; n], Absence::ProbeFailed)
    }

    /// Why `key` is absent for `req`, if it is ([`Presence::Absent`] from [`ProbeCache::ask`]).
    pub fn absence(&self, key: &BlockKey, req: RequestId) -> Option<Absence> {
        let e = self.keys.get(key)?;
        e.missed_by.iter().find(|(r, _)| *r == req).map(|(_, a)| *a)
    }
}

/// Notes `key` a miss for `req` with its first cause (a later one does not replace it).
fn miss_for(missed_by: &mut Vec<(RequestId, Absence)>, req: RequestId, why: Absence) {
    if !missed_by.iter().any(|(r, _)| *r == req) {
        missed_by.push((req, why));
    }
}
