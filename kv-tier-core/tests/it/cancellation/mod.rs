//! Cancellation safety: the manager's async calls and the built-in tiers' methods dropped at any
//! await point leave nothing behind.

/// A manager's `build()` dropped at any point or failing at a later tier.
mod build;
/// `wait_idle`, `wait_jobs`, `reset_cache` and `shutdown` dropped at any point.
mod calls;
/// The fs and obj tiers' `SecondaryTier` methods dropped at every point.
mod tiers;
