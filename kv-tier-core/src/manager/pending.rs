//! [`PendingStore`]: a store between [`TieringManager::prepare_store`] and its commit. The
//! DRAM slots' sinks live inside it, and `commit`/`abort` consume it, so a completed store
//! whose sinks are still being written cannot be expressed.

use std::fmt;

use super::TieringManager;
use crate::buf::BlockSink;
use crate::key::BlockKey;
use crate::request::{ChainLink, RequestId};
use crate::tier::PreparedStore;

/// DRAM slots reserved by [`TieringManager::prepare_store`], to fill with the engine's
/// GPU -> DRAM copy and then [`commit`](PendingStore::commit) (or
/// [`abort`](PendingStore::abort)).
///
/// Dropping it without either aborts: the slots are freed and nothing is stored or cascaded.
///
/// ```
/// # fn demo(manager: &kv_tier_core::TieringManager) -> kv_tier_core::Result<()> {
/// use kv_tier_core::{BlockKey, LookupResult, RequestContext};
/// let req = RequestContext::new(1);
/// let keys = [BlockKey::from_hash32([7; 32], 0), BlockKey::from_hash32([8; 32], 0)];
/// let mut pending = manager.prepare_store(&keys)?;
/// for (_key, sink) in pending.slots() {
///     sink.as_mut_slice().fill(42); // the engine copies GPU -> DRAM here
/// }
/// pending.commit(req.id); // readable in DRAM now; cascades to every secondary tier
/// assert_eq!(manager.lookup(&keys[0], &req), LookupResult::Hit);
/// # Ok(()) }
/// ```
#[must_use = "the reserved DRAM slots are freed unless the store is committed"]
pub struct PendingStore<'m> {
    manager: &'m TieringManager,
    prepared: PreparedStore,
    /// The keys of the `prepare_store` call, in the engine's (prefix) order.
    chain: Vec<BlockKey>,
    /// Where its first key sits in its request's chain, if the engine said
    /// ([`PendingStore::follows`]).
    first: Option<ChainLink>,
}

impl<'m> PendingStore<'m> {
    pub(super) fn new(
        manager: &'m TieringManager,
        prepared: PreparedStore,
        chain: Vec<BlockKey>,
    ) -> Self {
        Self {
            manager,
            prepared,
            chain,
            first: None,
        }
    }

    /// The first key of this store follows `parent` in its request's chain and is at
    /// `position` in it (the blocks before it; 0 is taken as 1), as
    /// [`RequestContext::follows`](crate::RequestContext::follows) says of a lookup's: for a
    /// store whose first block continues neither the request's lookup nor its last store (a
    /// batch after one DRAM refused, or blocks the request computed past its prompt), so the
    /// chain links sent to the tiers (`chain_eviction`) join it to the block before.
    ///
    /// ```
    /// # fn demo(manager: &kv_tier_core::TieringManager) -> kv_tier_core::Result<()> {
    /// use kv_tier_core::{BlockKey, RequestId};
    /// let (before, next) = (BlockKey::from_hash32([7; 32], 0), BlockKey::from_hash32([8; 32], 0));
    /// let pending = manager.prepare_store(&[next])?.follows(before, 40);
    /// pending.commit(RequestId(1));
    /// # Ok(()) }
    /// ```
    pub fn follows(mut self, parent: BlockKey, position: u32) -> Self {
        self.first = Some(ChainLink::after(parent, position));
        self
    }

    /// The keys that need writing, each with its exclusive writable DRAM slot.
    pub fn slots(&mut self) -> &mut [(BlockKey, BlockSink)] {
        &mut self.prepared.to_store
    }

    /// The keys that need writing, in the order of [`PendingStore::slots`].
    pub fn keys(&self) -> Vec<BlockKey> {
        self.prepared.to_store.iter().map(|(k, _)| *k).collect()
    }

    /// Keys already present in DRAM, or being written there (by another store, or by a
    /// promotion from a secondary tier): nothing to do. A key being written can still fail to
    /// arrive (a promotion whose load fails): then it is not in DRAM, the next lookup misses
    /// it, and the block is computed again (its bytes were not kept for this).
    pub fn present(&self) -> &[BlockKey] {
        &self.prepared.present
    }

    /// Keys evicted from DRAM to make room.
    pub fn evicted(&self) -> &[BlockKey] {
        &self.prepared.evicted
    }

    /// The slots hold the blocks: they become `Hit` in DRAM, and one store job per secondary
    /// tier copies them down for `req`. Each job pins a slot until its tier has taken the
    /// block's bytes, and counts against the tier's write-back limit until the job ends.
    ///
    /// The receipt names the blocks a tier will not get and why (its admission rule, its
    /// write budget, its write-back bound); a store job that fails later is counted in the
    /// tier's stats, not here.
    pub fn commit(mut self, req: RequestId) -> StoreReceipt {
        let keys = self.take_keys();
        let present = std::mem::take(&mut self.prepared.present);
        let chain = std::mem::take(&mut self.chain);
        self.manager
            .finish_store(&keys, &present, Some((req, self.first, &chain)))
    }

    /// Frees the slots; nothing is stored or cascaded. The same as dropping it.
    pub fn abort(self) {}

    /// Drops the sinks (ending the writes) and returns their keys.
    fn take_keys(&mut self) -> Vec<BlockKey> {
        std::mem::take(&mut self.prepared.to_store)
            .into_iter()
            .map(|(k, _sink)| k)
            .collect()
    }
}

/// Why a committed block is not written to a secondary tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
#[non_exhaustive]
pub enum NotWritten {
    /// Lookups had not asked for it the tier's `admit_after_lookups` times.
    NotAdmitted,
    /// The tier's `write_budget_mb_per_s` was spent.
    OverWriteBudget,
    /// The tier's write-back (or the DRAM it may pin) was at its limit and its policy is
    /// `drop`.
    WriteBackFull,
}

/// What [`PendingStore::commit`] left out of the cascade: per tier, the blocks that tier
/// will not be sent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreReceipt {
    /// (tier name, block, why), in tier order then block order.
    pub left_out: Vec<(String, BlockKey, NotWritten)>,
}

impl StoreReceipt {
    /// Every block went to every tier it was meant for.
    pub fn is_complete(&self) -> bool {
        self.left_out.is_empty()
    }

    pub(super) fn note(&mut self, tier: &str, keys: &[BlockKey], why: NotWritten) {
        self.left_out
            .extend(keys.iter().map(|k| (tier.to_string(), *k, why)));
    }
}

impl Drop for PendingStore<'_> {
    fn drop(&mut self) {
        if !self.prepared.to_store.is_empty() {
            let keys = self.take_keys();
            let _ = self.manager.finish_store(&keys, &[], None);
        }
    }
}

impl fmt::Debug for PendingStore<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingStore")
            .field("to_store", &self.keys())
            .field("present", &self.prepared.present)
            .field("evicted", &self.prepared.evicted)
            .finish()
    }
}
