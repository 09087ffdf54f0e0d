//! How the manager answers a lookup: verdicts and when they change, the generation guard against
//! late answers, the probe cache, how long a lookup waits for a slow tier, which tier serves, and
//! leases.

/// How long a lookup waits: the probe budget and the probe deadline.
mod budget;
/// The generation guard: a late answer never overrides a newer fact.
mod generations;
/// Keys a tier answers for from memory (`holds`), with no probe.
mod known;
/// Leases: held from the probe to the promotion, reaped, renewed once.
mod leases;
/// Why a lookup missed: `last_miss`, `misses_by_cause`, `promotion_tier`.
mod miss_causes;
/// The `ProbeCache` on its own: counters, budgets, request scope, reaper.
mod probe_cache;
/// Several tiers: all probed at once, the first in order serves, filters.
mod tiers;
/// Verdicts as steps see them: they change only at step boundaries.
mod verdicts;
