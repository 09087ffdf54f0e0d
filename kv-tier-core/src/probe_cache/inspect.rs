//! What a [`ProbeCache`] holds: for the manager's waits and stats, and for tests.

use tokio::time::Instant;

use super::{ProbeCache, ProbeCacheStats};
use crate::key::BlockKey;
use crate::sync::lock;

impl ProbeCache {
    /// When a request still tracked first asked for `key` (`None` if none is tracked).
    pub fn asked_since(&self, key: &BlockKey) -> Option<Instant> {
        self.keys.get(key).and_then(|e| e.since)
    }

    /// Whether request `req` is tracked (it asked, and has not finished).
    pub fn tracks(&self, req: crate::request::RequestId) -> bool {
        self.requests.contains_key(&req)
    }

    /// Probe batches sent and not yet applied.
    pub fn in_flight(&self) -> usize {
        self.outstanding.len()
    }

    /// Whether every probe batch sent has answered (answers may await `apply_results`).
    pub fn all_arrived(&self) -> bool {
        lock(&self.inbox).len() == self.outstanding.len()
    }

    /// How many probe batches were sent so far: a mark for [`ProbeCache::arrived_before`].
    pub fn batches_sent(&self) -> u64 {
        self.batches_sent
    }

    /// Whether every probe batch sent before `mark` (a [`ProbeCache::batches_sent`] figure)
    /// has answered or been applied; batches sent since do not count, so a caller waiting
    /// for this is not kept waiting by probes other callers keep sending.
    pub fn arrived_before(&self, mark: u64) -> bool {
        let arrived = lock(&self.inbox).iter().filter(|b| b.seq < mark).count();
        self.outstanding.range(..mark).count() == arrived
    }

    /// Whether probe answers are waiting to be applied.
    pub fn has_results(&self) -> bool {
        !lock(&self.inbox).is_empty()
    }

    /// Keys queued for the next flush.
    pub fn queued(&self) -> usize {
        self.queue.len()
    }

    /// Keys currently tracked (bounded by the keys of live requests plus probes in flight).
    pub fn tracked_keys(&self) -> usize {
        self.keys.len()
    }

    /// Requests currently tracked (those that asked and have not finished).
    pub fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    /// Keys currently leased (known present and protected in the tier; an expired lease is
    /// dropped by a reaper within a quarter lease, even while nobody calls the lookup).
    pub fn leased_keys(&self) -> usize {
        lock(&self.leases).len()
    }

    /// Counters.
    pub fn stats(&self) -> ProbeCacheStats {
        self.stats
    }
}
