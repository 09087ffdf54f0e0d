//! The obj tier's counters.

use kv_tier_core::BlockStats;
use kv_tier_core::stats::TierCounters;

kv_tier_core::counters! {
    /// Counters of an [`ObjTier`](crate::ObjTier).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
    pub struct ObjStats;
    /// The live counters behind [`ObjStats`].
    pub(crate) struct ObjCounters;
    fields {
        /// What every block-storing tier counts: blocks and bytes written and read, skipped
        /// stores (the backend confirmed the object), failures, damaged objects deleted,
        /// checksum outcomes (a malformed checksum counts as a mismatch).
        blocks: BlockStats,
        /// Bytes in the capacity index (bounded mode).
        bytes: u64,
        /// Objects in the capacity index (bounded mode; on a shared bucket the leader's index
        /// of every instance's objects, empty on the others).
        objects: u64,
        /// The part of `bytes` in objects whose chain is broken before them (the block they
        /// follow is not indexed), so a prefix lookup never reaches them here. One pass over
        /// the index when the stats are taken.
        dead_bytes: u64,
        /// The shared bucket's coordination (`None` unless `shared`).
        shared: Option<SharedStats>,
    }
    counted {
        /// Requests sent (HEAD, PUT, GET, DELETE, LIST).
        requests,
        /// The most requests in flight at once, every kind (each of the three kinds is
        /// bounded by `io_threads`: at most 3 x `io_threads` in all).
        max_in_flight,
        /// Writes (PUT, DELETE) held back at their gate because reads were waiting or in
        /// flight (each counted once, however long it waited).
        writes_deferred,
        /// Requests abandoned at their deadline.
        request_timeouts,
        /// Lookups that answered some keys absent because their deadline passed.
        lookup_timeouts,
        /// Existence answers served from the cache, without a request.
        exists_cache_hits,
        /// Keys answered absent from the existence listing, without a request (unbounded
        /// tier, not shared: see `exists_ttl_s`).
        listed_absent,
        /// LISTs of the rank that replaced the existence listing.
        listings,
        /// Objects deleted to keep the tier under `max_size_gb`.
        evicted,
        /// Capacity sweeps run.
        sweeps,
        /// Sweep candidates kept because they were protected.
        skipped_in_flight,
        /// HTTP requests the S3 client sent, its own retries included (S3 client from the
        /// config only; a store handed to `with_store` counts none).
        http_attempts,
        /// HTTP attempts that failed the way the S3 client retries them (a transport error,
        /// 5xx, 429 or 408): each was retried, unless it was its request's last attempt
        /// (`max_retries`, `request_timeout_s`), which then failed the request.
        http_retryable_failures,
    }
}

/// The tier's live counters: what every block-storing tier counts, and its own.
pub(crate) type Counters = TierCounters<ObjCounters>;

kv_tier_core::counters! {
    /// Figures of a shared bucket, as this instance sees them.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
    pub struct SharedStats;
    /// The live counters behind [`SharedStats`].
    pub(crate) struct SharedCounters;
    fields {
        /// Whether this instance holds the leader lease now.
        leader: bool,
        /// The highest lease epoch seen (each takeover goes above it).
        epoch: u64,
        /// Instances alive, as the leader counts them (0 on the others).
        members: u64,
        /// The leader's total: indexed objects, stores in flight and credit granted but not
        /// spent, in bytes (0 on the others).
        global_bytes: u64,
        /// Credit granted to this instance by the current leader, in bytes.
        granted_bytes: u64,
        /// Credit this instance spent of it, in bytes.
        consumed_bytes: u64,
    }
    counted {
        /// Times this instance took the lease.
        takeovers,
        /// Store jobs that waited for credit.
        credit_waits,
        /// Blocks not stored for lack of credit (within the wait).
        no_credit,
        /// Journal batches written.
        batches,
        /// Failed requests on the coordination objects (journal, heartbeat, lease, grants).
        coord_errors,
        /// Objects the leader deleted for everyone.
        evicted,
    }
}
