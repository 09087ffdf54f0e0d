//! [`AsyncLookup`]: non-blocking existence answers for one secondary tier, with batched probes
//! and a generation per key so that a completed store is authoritative over a late probe.

use std::fmt;
use std::sync::{Arc, Mutex};

use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::Notify;

use crate::key::BlockKey;
use crate::request::RequestId;
use crate::tier::SecondaryTier;

/// The async lookup's answer for one key and request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Presence {
    /// The tier has the block.
    Present,
    /// The tier does not have it (for this request).
    Absent,
    /// Not known yet: a probe is queued or in flight; ask again next step.
    Retry,
}

#[derive(Debug, Default)]
struct KeyState {
    /// Bumped by `mark_present` / `mark_miss`: probes started under an older generation are stale.
    generation: u64,
    /// Known present (from a completed store or a probe).
    present: bool,
    /// Generation of the probe in flight for this key, if any.
    pending: Option<u64>,
    /// Requests waiting for the pending probe.
    waiters: Vec<RequestId>,
    /// Requests for which the key is a miss (negative answers live only in request scope).
    missed_by: Vec<RequestId>,
    /// Requests that reference this entry; it is dropped when none do and no probe is pending.
    refs: u32,
}

struct ProbeBatch {
    keys: Vec<(BlockKey, u64)>,
    result: crate::Result<Vec<bool>>,
}

/// Counters of an [`AsyncLookup`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AsyncLookupStats {
    /// Probe batches sent.
    pub probes: u64,
    /// Keys probed.
    pub probed_keys: u64,
    /// Probe answers discarded because a store or failed load superseded them.
    pub stale_answers: u64,
    /// Probe batches that failed (counted as misses).
    pub probe_errors: u64,
}

/// Non-blocking existence answers for one secondary tier.
///
/// The first [`AsyncLookup::lookup`] of a key returns [`Presence::Retry`] and queues one probe;
/// queued probes are sent as one batch by [`AsyncLookup::flush`] (at schedule end) and run on
/// the runtime, off the caller's thread; their answers apply at [`AsyncLookup::apply_results`]
/// (the start of the next step). Positive answers are shared by all requests; negative answers
/// are kept per request and dropped when it finishes.
///
/// A completed store ([`AsyncLookup::mark_present`]) or failed load
/// ([`AsyncLookup::mark_miss`]) bumps the key's generation, so a probe that was in flight
/// when it happened can never overwrite it.
pub struct AsyncLookup {
    tier: Arc<dyn SecondaryTier>,
    runtime: tokio::runtime::Handle,
    keys: FxHashMap<BlockKey, KeyState>,
    requests: FxHashMap<RequestId, FxHashSet<BlockKey>>,
    queue: Vec<(BlockKey, u64)>,
    inbox: Arc<Mutex<Vec<ProbeBatch>>>,
    notify: Arc<Notify>,
    in_flight: usize,
    stats: AsyncLookupStats,
}

impl fmt::Debug for AsyncLookup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AsyncLookup")
            .field("tier", &self.tier.info().name)
            .field("tracked_keys", &self.keys.len())
            .field("queued", &self.queue.len())
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

impl AsyncLookup {
    /// An async lookup over `tier`, running probes on `runtime` and waking `notify` when a
    /// probe's answer arrives.
    pub fn new(
        tier: Arc<dyn SecondaryTier>,
        runtime: tokio::runtime::Handle,
        notify: Arc<Notify>,
    ) -> Self {
        Self {
            tier,
            runtime,
            keys: FxHashMap::default(),
            requests: FxHashMap::default(),
            queue: Vec::new(),
            inbox: Arc::new(Mutex::new(Vec::new())),
            notify,
            in_flight: 0,
            stats: AsyncLookupStats::default(),
        }
    }

    /// The answer for `key` in request `req`, queueing a probe when unknown.
    pub fn lookup(&mut self, key: &BlockKey, req: RequestId) -> Presence {
        let e = self.keys.entry(*key).or_default();
        if self.requests.entry(req).or_default().insert(*key) {
            e.refs += 1;
        }
        if e.missed_by.contains(&req) {
            return Presence::Absent;
        }
        if e.present {
            return Presence::Present;
        }
        if e.pending.is_none() {
            e.pending = Some(e.generation);
            self.queue.push((*key, e.generation));
        }
        if !e.waiters.contains(&req) {
            e.waiters.push(req);
        }
        Presence::Retry
    }

    /// A completed store: the keys are present, whatever a probe in flight says, and no
    /// longer a miss for any request.
    pub fn mark_present(&mut self, keys: &[BlockKey]) {
        for k in keys {
            if let Some(e) = self.keys.get_mut(k) {
                e.generation += 1;
                e.present = true;
                e.pending = None;
                e.waiters.clear();
                e.missed_by.clear();
                if e.refs == 0 {
                    self.keys.remove(k);
                }
            }
        }
    }

    /// A failed load for request `req`: the keys are a miss for it, no longer known present
    /// for anyone, and a probe in flight for them is stale (other waiters probe again).
    pub fn mark_miss(&mut self, keys: &[BlockKey], req: RequestId) {
        for k in keys {
            let e = self.keys.entry(*k).or_default();
            if self.requests.entry(req).or_default().insert(*k) {
                e.refs += 1;
            }
            e.generation += 1;
            e.present = false;
            e.pending = None;
            e.waiters.clear();
            if !e.missed_by.contains(&req) {
                e.missed_by.push(req);
            }
        }
    }

    /// Forgets a finished request's negative answers and references.
    pub fn finish_request(&mut self, req: RequestId) {
        let Some(keys) = self.requests.remove(&req) else {
            return;
        };
        for k in keys {
            if let Some(e) = self.keys.get_mut(&k) {
                e.refs = e.refs.saturating_sub(1);
                e.missed_by.retain(|r| *r != req);
                e.waiters.retain(|r| *r != req);
                if e.refs == 0 && e.pending.is_none() {
                    self.keys.remove(&k);
                }
            }
        }
    }

    /// Sends the queued probes as one batch on the runtime. Returns how many keys were sent.
    pub fn flush(&mut self) -> usize {
        if self.queue.is_empty() {
            return 0;
        }
        let batch = std::mem::take(&mut self.queue);
        let n = batch.len();
        self.in_flight += 1;
        self.stats.probes += 1;
        self.stats.probed_keys += n as u64;
        let tier = self.tier.clone();
        let inbox = self.inbox.clone();
        let notify = self.notify.clone();
        self.runtime.spawn(async move {
            let keys: Vec<BlockKey> = batch.iter().map(|(k, _)| *k).collect();
            let result = tier.lookup(&keys).await;
            inbox.lock().expect("probe inbox").push(ProbeBatch {
                keys: batch,
                result,
            });
            notify.notify_one();
        });
        n
    }

    /// Applies the probe answers that have arrived. Returns how many batches were applied.
    pub fn apply_results(&mut self) -> usize {
        let batches = std::mem::take(&mut *self.inbox.lock().expect("probe inbox"));
        let n = batches.len();
        for batch in batches {
            self.in_flight -= 1;
            let answers = match batch.result {
                Ok(a) if a.len() == batch.keys.len() => a,
                Ok(a) => {
                    self.stats.probe_errors += 1;
                    tracing::warn!(
                        tier = %self.tier.info().name,
                        expected = batch.keys.len(),
                        got = a.len(),
                        "existence probe returned the wrong number of answers; counting all as misses"
                    );
                    vec![false; batch.keys.len()]
                }
                Err(err) => {
                    self.stats.probe_errors += 1;
                    tracing::warn!(
                        tier = %self.tier.info().name,
                        keys = batch.keys.len(),
                        error = %err,
                        "existence probe failed; counting its keys as misses"
                    );
                    vec![false; batch.keys.len()]
                }
            };
            for ((key, generation), present) in batch.keys.into_iter().zip(answers) {
                let Some(e) = self.keys.get_mut(&key) else {
                    continue;
                };
                if e.pending != Some(generation) {
                    self.stats.stale_answers += 1;
                    continue;
                }
                e.pending = None;
                let waiters = std::mem::take(&mut e.waiters);
                if present {
                    e.present = true;
                } else {
                    for w in waiters {
                        if !e.missed_by.contains(&w) {
                            e.missed_by.push(w);
                        }
                    }
                }
                if e.refs == 0 {
                    self.keys.remove(&key);
                }
            }
        }
        n
    }

    /// Probe batches sent and not yet applied.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether every probe batch sent has answered (answers may await `apply_results`).
    pub fn all_arrived(&self) -> bool {
        self.inbox.lock().expect("probe inbox").len() == self.in_flight
    }

    /// Whether probe answers are waiting to be applied.
    pub fn has_results(&self) -> bool {
        !self.inbox.lock().expect("probe inbox").is_empty()
    }

    /// Keys queued for the next flush.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Keys currently tracked (bounded by the keys of live requests plus probes in flight).
    pub fn tracked_keys(&self) -> usize {
        self.keys.len()
    }

    /// Counters.
    pub fn stats(&self) -> AsyncLookupStats {
        self.stats
    }
}
