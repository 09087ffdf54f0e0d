//! The shared bucket (`shared: true`): several instances on one bucket under one global bound,
//! coordinated by a leader lease, credit granted by the leader, and records (heartbeats,
//! journals, grants) in the bucket. In one process on a controlled in-memory store or the S3
//! test server, and as several processes.
//!
//! - `bound`: the bucket's block bytes stay within 1.10x the bound under floods (late PUTs,
//!   the same keys from several instances), and keys loaded again and again are never deleted;
//! - `lease`: the lease handed over at shutdown or drop, taken over after the leader's death
//!   within two periods (lost replies too), forged leases, the lease's range;
//! - `credit`: grants in even shares (bounds of a few blocks, idle members), grants that fail
//!   or lapse, stores waiting for credit, a leader whose listing broke, dropped futures;
//! - `records`: the lease, grants, heartbeats and journals deleted or garbled under live
//!   instances;
//! - `members`: instances restarting, reusing an id, joining and leaving;
//! - `processes`: four processes on the S3 test server, the leader killed with SIGKILL.

mod bound;
mod credit;
mod lease;
mod members;
mod processes;
mod records;
