//! The integration tests of the fs tier (`kv-tier-fs`), one binary, by subject:
//!
//! - [`store_load`]: stores and loads on real files, layout, publish-if-absent, I/O modes;
//! - [`directories`]: the tree changed under a running tier;
//! - [`integrity`]: checksums and damage: a load serves the stored bytes or a miss;
//! - [`io_faults`]: filesystem errors (injected, ENOSPC, EMFILE) fail cleanly and heal;
//! - [`capacity`]: the bound, sweeps, protection, recency, the GC thread;
//! - [`index_events`]: the index and the events against the disk;
//! - [`cancellation`]: dropped store and load futures;
//! - [`shutdown`]: shutdown and drop of the tier;
//! - [`open`]: opening a root (`config.json`, the opening walk's reaping);
//! - [`checkpoint`]: restart from the index checkpointed at close, reconciled in the background;
//! - [`config`]: options through the registry, their checks and ranges;
//! - [`manager`]: the fs tier under a `TieringManager`;
//! - [`shared`]: shared roots, leases and credit, the multi-process soak;
//! - [`crash`]: writers killed with SIGKILL;
//! - [`conformance`]: the `SecondaryTier` conformance suite;
//! - [`support`]: the helpers, each defined once.

mod cancellation;
mod capacity;
mod checkpoint;
mod config;
mod conformance;
mod crash;
mod directories;
mod index_events;
mod integrity;
mod io_faults;
mod manager;
mod open;
mod shared;
mod shutdown;
mod store_load;
mod support;
