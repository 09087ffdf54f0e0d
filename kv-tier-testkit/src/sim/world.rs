//! The [`World`] a simulation runs over, and the [`Tamper`] it may do behind a tier's back.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, SecondaryTier, TierOptions};

use super::BoxFuture;

/// Damage done to a stored block behind its tier's back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tamper {
    /// The block is deleted.
    Delete,
    /// The block is cut short.
    Truncate,
    /// One byte of the block is flipped.
    FlipByte,
    /// The block is replaced by other bytes of the same size, written without a checksum.
    Replace,
    /// The block is replaced by another key's stored block, checksum and all.
    CopyOf(BlockKey),
}

/// The real tiers a simulation runs over, and what it may do to them behind their backs.
/// Only `open` is required: a world that cannot tamper, sweep or measure keeps the defaults
/// (no damage, no sweeps, no bounds to check).
pub trait World: Send {
    /// Opens every tier (again on the same storage after a crash), in order, with the
    /// manager's options for each.
    fn open(&mut self) -> BoxFuture<'_, Vec<(Arc<dyn SecondaryTier>, TierOptions)>>;
    /// A crash: drops every handle to the tiers opened last, without shutdown, and returns
    /// once they are gone (their last users, work the dropped manager had in flight, end at
    /// their deadlines), as a killed process's tiers would be.
    fn crash(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// Damages `key`'s stored block in tier `tier`; `false` when it has none there (or the
    /// world cannot).
    fn tamper(&mut self, _tier: usize, _key: BlockKey, _how: Tamper) -> BoxFuture<'_, bool> {
        Box::pin(async { false })
    }
    /// Runs an eviction pass of tier `tier` now (nothing for unbounded tiers).
    fn sweep(&mut self, _tier: usize) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
    /// Runs an eviction pass of tier `tier` that goes below its bound (as when its storage
    /// runs out of space): only protected keys are spared. Defaults to [`World::sweep`].
    fn sweep_deep(&mut self, tier: usize) -> BoxFuture<'_, ()> {
        self.sweep(tier)
    }
    /// Makes tier `tier`'s backend stop answering (requests hang inside the tier, past its
    /// deadlines) until [`World::heal_backend`]; `false` where the world cannot.
    fn hang_backend(&mut self, _tier: usize) -> bool {
        false
    }
    /// Makes tier `tier`'s backend run every request but answer past every deadline (the
    /// client cannot tell a PUT landed or a DELETE removed its object) until
    /// [`World::heal_backend`]; `false` where the world cannot.
    fn lose_replies(&mut self, _tier: usize) -> bool {
        false
    }
    /// Lets tier `tier`'s backend answer again.
    fn heal_backend(&mut self, _tier: usize) {}
    /// A count that grows whenever tier `tier` answers a probe "absent" without knowing (its
    /// own lookup deadline passed, a request failed) while reporting no error; such an answer
    /// excuses a `Miss`. 0 for tiers that report every such case as an error.
    fn quiet_absences(&self, _tier: usize) -> u64 {
        0
    }
    /// Moves tier `tier`'s clock forward (grace windows, stamp limits).
    fn clock_jump(&mut self, _tier: usize, _by: Duration) {}
    /// `(used, hard bound)` of a bounded tier, `None` for an unbounded one.
    fn usage(&self, _tier: usize) -> Option<(u64, u64)> {
        None
    }
    /// What tier `tier` occupies on its storage as measured there (for a file tier: what `du`
    /// counts), when the world can measure it: checked against the hard bound at checkpoints,
    /// so a tier that miscounts is caught.
    fn measured_usage(&self, _tier: usize) -> Option<u64> {
        None
    }
    /// What the storage holds for `key` in tier `tier`, for a violation's report.
    fn describe(&self, _tier: usize, key: BlockKey) -> BoxFuture<'_, String> {
        Box::pin(async move { format!("{key}: the world cannot look") })
    }
}
