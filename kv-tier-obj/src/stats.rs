//! The obj tier's counters.

use std::sync::atomic::AtomicU64;

use kv_tier_core::{BlockCounters, BlockStats};

/// Counters of an [`ObjTier`](crate::ObjTier).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ObjStats {
    /// What every block-storing tier counts: blocks and bytes written and read, skipped
    /// stores (the backend confirmed the object), failures, damaged objects deleted,
    /// checksum outcomes (a malformed checksum counts as a mismatch).
    pub blocks: BlockStats,
    /// Requests sent (HEAD, PUT, GET, DELETE, LIST).
    pub requests: u64,
    /// The most requests in flight at once (bounded by `io_threads`).
    pub max_in_flight: u64,
    /// Requests abandoned at their deadline.
    pub request_timeouts: u64,
    /// Lookups that answered some keys absent because their deadline passed.
    pub lookup_timeouts: u64,
    /// Existence answers served from the cache, without a request.
    pub exists_cache_hits: u64,
    /// Objects deleted to keep the tier under `max_size_gb`.
    pub evicted: u64,
    /// Capacity sweeps run.
    pub sweeps: u64,
    /// Sweep candidates kept because they were protected.
    pub skipped_in_flight: u64,
    /// Bytes in the capacity index (bounded mode).
    pub bytes: u64,
    /// Objects in the capacity index (bounded mode).
    pub objects: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) blocks: BlockCounters,
    pub(crate) requests: AtomicU64,
    pub(crate) max_in_flight: AtomicU64,
    pub(crate) request_timeouts: AtomicU64,
    pub(crate) lookup_timeouts: AtomicU64,
    pub(crate) exists_cache_hits: AtomicU64,
    pub(crate) evicted: AtomicU64,
    pub(crate) sweeps: AtomicU64,
    pub(crate) skipped_in_flight: AtomicU64,
}
