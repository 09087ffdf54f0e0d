//! The integration tests of kv-tier-core: the `TieringManager` and its `ProbeCache` driven as an
//! engine drives them, over the DRAM tier, reference and fault-injecting tiers (kv-tier-testkit)
//! and the built-in fs and obj tiers (through the facade's builder, a dev-dependency: the test
//! binary links the one kv-tier-core library the other crates use); the config; the layout. One
//! binary, a module per subject. A test that needs its process to itself (it counts threads,
//! installs a global subscriber or may abort) re-runs itself alone in a child process
//! (`support::process::in_own_process`).

/// Building a manager: registry types, runtimes, typed access, defaults.
mod build;
/// Dropped calls leave nothing behind: the manager's and the built-in tiers'.
mod cancellation;
/// The config: ranges, types, documents, `config check`, vLLM keys, odd values.
mod config;
/// The DRAM tier through the manager: pinned views, LRU and ARC eviction, refusals.
mod dram;
/// Events: DRAM's and the tiers', their order, locality, bounds and losses.
mod events;
/// Tiers that fail, panic, hang or lie; jobs and probes whose task dies.
mod faults;
/// The fs tier alone under churn: events, accounting, `kv-tier gc` on a live root.
mod fs_tier;
/// The layout: vLLM's namespace digests and decisions, the layout vectors.
mod layout;
/// Lookups: verdicts, late answers, the probe cache, budgets, tiers, leases.
mod lookup;
/// The manager's metrics as a Prometheus scrape shows them, and the endpoint.
mod metrics;
/// Promotion into DRAM: load jobs, the DRAM reservation, the hold.
mod promotion;
/// A request's lifecycle as the manager and the tiers see it.
mod requests;
/// `reset_cache`.
mod reset;
/// Serving loops end to end under real concurrency.
mod serving;
/// `shutdown`, `shutdown_blocking` and dropping a manager without either.
mod shutdown;
/// Extreme sizes: one-block DRAM, odd block sizes, huge lookups.
mod sizes;
/// The library's tracing spans (in a child process: a global subscriber).
mod spans;
/// The manager's statistics and each tier's own.
mod stats;
/// The engine's store: typestate, cascade, write-back bounds, admission.
mod store;
/// Helpers of this binary's tests, each defined once.
mod support;
/// `wait_idle`, `wait_jobs`, `is_idle`, `poll`, also under continuous traffic.
mod waits;
