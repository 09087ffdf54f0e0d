//! Lookup verdicts and the request context.

use crate::BlockKey;
use std::sync::Arc;

/// The answer to "do we have this block?".
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LookupResult {
    /// Not present in any tier the request may load from: recompute it.
    Miss,
    /// In DRAM and readable now.
    Hit,
    /// Present, but a write or a promotion into DRAM is still in flight: ask again next step.
    HitPending,
    /// Not known yet: an existence probe was started; ask again next step.
    Retry,
}

impl LookupResult {
    /// `Hit` or `HitPending`.
    pub fn is_present(&self) -> bool {
        matches!(self, LookupResult::Hit | LookupResult::HitPending)
    }
}

/// Why the manager answered [`LookupResult::Miss`] for a block
/// ([`TieringManager::last_miss`](crate::TieringManager::last_miss)): what an engine or a
/// report needs to tell capacity from a slow or failing tier.
#[derive(Debug, Clone, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(tag = "cause", rename_all = "snake_case")]
#[non_exhaustive]
pub enum MissCause {
    /// No tier the request may load from has it (each one's probe answered "absent", or
    /// there is none).
    NotFound,
    /// `tier`'s probe was still out when the request stopped waiting for it (its probe
    /// budget), or passed its deadline.
    ProbeOverBudget {
        /// The tier.
        tier: String,
    },
    /// `tier`'s probe failed (an error, a panic, a dropped task).
    ProbeFailed {
        /// The tier.
        tier: String,
    },
    /// `tier` had it, but its load for this request failed.
    LoadFailed {
        /// The tier.
        tier: String,
    },
    /// `tier` has it, but DRAM had no slot to promote it into (everything pinned).
    NoDramRoom {
        /// The tier.
        tier: String,
    },
    /// `tier` has it, but loading it would have ended later than recomputing it (the
    /// manager's load-or-recompute policy: `prefill_tokens_per_s` or
    /// [`crate::TieringManagerBuilder::recompute_time`]), or its promotion was started and
    /// then cut behind its estimate (`promotion_cut_margin`).
    RecomputeFaster {
        /// The tier.
        tier: String,
    },
    /// The manager is shut down.
    ShutDown,
}

/// An engine's request identity. Engines with string ids hash them to a `u64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

impl From<u64> for RequestId {
    fn from(v: u64) -> Self {
        RequestId(v)
    }
}

/// Which secondary tiers a request may load from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum TierFilter {
    /// Every configured tier (the default).
    #[default]
    All,
    /// Only the named tiers (by tier name).
    Only(Arc<[String]>),
    /// Every tier but the named ones.
    Except(Arc<[String]>),
}

impl TierFilter {
    /// Whether the request may load from the tier named `name`.
    pub fn allows(&self, name: &str) -> bool {
        match self {
            TierFilter::All => true,
            TierFilter::Only(names) => names.iter().any(|n| n == name),
            TierFilter::Except(names) => !names.iter().any(|n| n == name),
        }
    }
}

/// Where a block sits in its request's chain of blocks: the block it follows (its parent:
/// the block before it in the prompt) and its position (`depth`, at least 1; the chain's
/// first block is at 0 and has no parent). The manager learns these from the key lists the
/// engine passes to `lookup_prefix`/`lookup_many` and `prepare_store`, which are in prefix
/// order, and from [`RequestContext::follows`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChainLink {
    /// The block before it in its chain.
    pub parent: BlockKey,
    /// Its position in the chain (its parent's is less).
    pub depth: u32,
}

impl ChainLink {
    /// The link of a block at `position` in its chain (the blocks before it; 0 is taken as
    /// 1: a block with a parent is not a chain's first), following `parent`: what an engine
    /// says with [`RequestContext::follows`] or `PendingStore::follows`.
    pub(crate) fn after(parent: BlockKey, position: u32) -> Self {
        Self {
            parent,
            depth: position.max(1),
        }
    }
}

/// What the manager needs to know about the request a call is made for.
///
/// ```
/// use kv_tier_core::{BlockKey, RequestContext, TierFilter};
/// let ctx = RequestContext::new(7).only_tiers(["fs"]);
/// assert!(ctx.filter.allows("fs"));
/// assert!(!ctx.filter.allows("obj"));
/// // the engine's GPU cache holds the prompt's first 12 blocks; it asks for the rest
/// let held = BlockKey::from_hash32([11; 32], 0);
/// let ctx = RequestContext::new(7).follows(held, 12);
/// assert_eq!(ctx.follows.map(|l| (l.parent, l.depth)), Some((held, 12)));
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestContext {
    /// The request.
    pub id: RequestId,
    /// The secondary tiers it may load from.
    pub filter: TierFilter,
    /// Where the first key of a lookup made with this context sits in its chain, when the
    /// blocks before it are not in the lookup (the engine holds them itself: its GPU prefix
    /// cache): the block it follows and its position. See [`RequestContext::follows`].
    pub follows: Option<ChainLink>,
}

impl RequestContext {
    /// A context for request `id` that may load from every tier.
    pub fn new(id: impl Into<RequestId>) -> Self {
        Self {
            id: id.into(),
            filter: TierFilter::All,
            follows: None,
        }
    }

    /// The first key of the lookups made with this context follows `parent` in its chain and
    /// is at `position` in it (the number of blocks before it, so at least 1): what an
    /// engine that looks up only the blocks past its own prefix cache (as vLLM does) tells
    /// the manager, so the chain links sent to the tiers (`chain_eviction`) join the blocks
    /// it stores to the ones before them. Without it the lookup's first key starts a chain of
    /// its own: a tier then may evict the block before it first, and count the blocks after
    /// it live when they are not. A position of 0 is taken as 1.
    pub fn follows(mut self, parent: BlockKey, position: u32) -> Self {
        self.follows = Some(ChainLink::after(parent, position));
        self
    }

    /// Restricts loads to the named tiers.
    pub fn only_tiers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, names: I) -> Self {
        self.filter = TierFilter::Only(names.into_iter().map(Into::into).collect());
        self
    }

    /// Excludes the named tiers from loads.
    pub fn skip_tiers<I: IntoIterator<Item = S>, S: Into<String>>(mut self, names: I) -> Self {
        self.filter = TierFilter::Except(names.into_iter().map(Into::into).collect());
        self
    }
}

/// How much of a prefix is available, as counted by [`count_prefix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PrefixCount {
    /// Leading keys that are `Hit`.
    pub hit: usize,
    /// Leading keys that are `Hit` or `HitPending`.
    pub present: usize,
    /// Whether a `Retry` ended the present run (the count may grow next step).
    pub retry: bool,
    /// When the present run is expected to be all in DRAM, from now
    /// ([`crate::TieringManager::lookup_prefix`] fills it in: zero when it all is, the
    /// estimate of the slowest tier it waits for otherwise, `None` when a tier it waits for
    /// has no estimate yet); [`count_prefix`] leaves it `None`.
    pub ready_in: Option<std::time::Duration>,
}

/// Counts the contiguous prefix of hits in per-key verdicts given in prefix order.
///
/// ```
/// use kv_tier_core::{count_prefix, LookupResult::*};
/// let c = count_prefix([Hit, Hit, HitPending, Retry, Hit]);
/// assert_eq!((c.hit, c.present, c.retry), (2, 3, true));
/// ```
pub fn count_prefix(results: impl IntoIterator<Item = LookupResult>) -> PrefixCount {
    let mut c = PrefixCount::default();
    let mut all_hit = true;
    for r in results {
        match r {
            LookupResult::Hit => {
                c.present += 1;
                if all_hit {
                    c.hit += 1;
                }
            }
            LookupResult::HitPending => {
                c.present += 1;
                all_hit = false;
            }
            LookupResult::Retry => {
                c.retry = true;
                break;
            }
            LookupResult::Miss => break,
        }
    }
    c
}
