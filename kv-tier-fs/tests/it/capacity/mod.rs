//! Bounded capacity (`gc_max_size_gb` and its GC), by what it promises:
//!
//! - [`bound`]: the hard ceiling holds on disk, and stores at it make room or fail `NoSpace`;
//! - [`sweep`]: what a sweep deletes (oldest first, to the watermark, grace and its limit);
//! - [`protection`]: what is never swept (protected keys, jobs in flight);
//! - [`chains`]: chain-aware eviction (tails first) and dead bytes;
//! - [`recency`]: touches and stamps, from this tier and others;
//! - [`gc_thread`]: the background GC thread (wakes, panics).

mod bound;
mod chains;
mod gc_thread;
mod protection;
mod recency;
mod sweep;
