//! The contracts tiers implement: [`SecondaryTier`] (async, for storage tiers) and
//! [`PrimaryTier`] (sync, for the DRAM pool), their jobs, results and protection guards.

use std::any::Any;
use std::fmt;
use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use rustc_hash::FxHashMap;

use crate::buf::{BlockSink, BlockSource};
use crate::error::{Error, Result};
use crate::event::{Locality, Medium, TierEvent};
use crate::key::BlockKey;
use crate::request::{LookupResult, RequestContext, RequestId};
pub use crate::stats::PrimaryStats;
use crate::stats::TierSnapshot;
use crate::sync::lock;

/// A batch of blocks to copy from pinned DRAM slots into a tier.
#[derive(Debug, Default)]
pub struct StoreJob {
    /// The keys and their bytes. Each source pins its slot until dropped.
    pub blocks: Vec<(BlockKey, BlockSource)>,
    /// The requests the job serves (the manager's cascades: the request whose store
    /// completed), so a tier can apply request-level policies (vLLM's `REQUEST_LEVEL`
    /// offload) or route peer-to-peer transfers. Empty when none is known.
    pub requests: Vec<RequestId>,
    /// Where blocks of the job sit in their request's chain, for those the manager knows
    /// (see [`ChainLink`]): a bounded tier evicts a chain's later blocks before its earlier
    /// ones. Empty when none is known; a tier may ignore it.
    pub links: Vec<(BlockKey, ChainLink)>,
}

impl StoreJob {
    /// The keys, in order.
    pub fn keys(&self) -> Vec<BlockKey> {
        self.blocks.iter().map(|(k, _)| *k).collect()
    }
}

pub use crate::request::ChainLink;

/// A batch of blocks to copy from a tier into reserved DRAM slots.
#[derive(Debug, Default)]
pub struct LoadJob {
    /// The keys and the buffers to fill. Each sink is exclusive and pins its slot until dropped.
    pub blocks: Vec<(BlockKey, BlockSink)>,
    /// The requests the job serves (the manager's promotions: one load job per tier and
    /// request). Empty when none is known.
    pub requests: Vec<RequestId>,
    /// Where the tier reports each block as it lands, before the job ends: the manager may
    /// cut a job that falls behind its estimate and keeps the blocks reported here (see
    /// [`LoadProgress::landed`]). A tier that reports nothing is still correct; a cut job of
    /// it keeps nothing.
    pub progress: LoadProgress,
}

impl LoadJob {
    /// A job of these blocks, for no known request, whose progress nobody reads.
    pub fn new(blocks: Vec<(BlockKey, BlockSink)>) -> Self {
        Self {
            blocks,
            ..Self::default()
        }
    }

    /// The keys, in order.
    pub fn keys(&self) -> Vec<BlockKey> {
        self.blocks.iter().map(|(k, _)| *k).collect()
    }
}

/// The blocks of a [`LoadJob`] that have landed so far, reported by the tier as it goes.
/// Cloning shares it (a tier handing blocks to tasks of its own gives each a clone).
///
/// ```
/// use kv_tier_core::{BlockKey, BlockSink, LoadJob};
/// let key = BlockKey::from_hash32([7; 32], 0);
/// let (sink, reader) = BlockSink::pair(4);
/// let job = LoadJob { blocks: vec![(key, sink)], ..LoadJob::default() };
/// let progress = job.progress.clone();
/// for (key, mut sink) in job.blocks {
///     sink.as_mut_slice().copy_from_slice(b"abcd"); // the whole block, verified
///     drop(sink);
///     progress.landed(key);
/// }
/// assert_eq!(progress.keys(), vec![key]);
/// assert_eq!(&reader.into_bytes().unwrap()[..], b"abcd");
/// ```
#[derive(Debug, Clone, Default)]
pub struct LoadProgress(Arc<Mutex<Vec<BlockKey>>>);

impl LoadProgress {
    /// `key`'s block is in its sink, complete and verified (what would make the job report
    /// it in [`JobResult::ok`]), and the tier writes it no more: its sink is dropped, or only
    /// the job's future still holds it. From then on the manager may drop the job's future
    /// and serve this block. Report a block at most once, and never one that then fails.
    pub fn landed(&self, key: BlockKey) {
        lock(&self.0).push(key);
    }

    /// [`LoadProgress::landed`] of `key` once its load ended well, after `sink` is dropped:
    /// what a tier calls with each block's outcome. Returns `result`.
    pub fn finish<T, E>(
        &self,
        key: BlockKey,
        sink: BlockSink,
        result: std::result::Result<T, E>,
    ) -> std::result::Result<T, E> {
        drop(sink);
        if result.is_ok() {
            self.landed(key);
        }
        result
    }

    /// The keys reported landed so far, in the order they landed.
    pub fn keys(&self) -> Vec<BlockKey> {
        lock(&self.0).clone()
    }

    /// How many keys were reported landed so far.
    pub fn len(&self) -> usize {
        lock(&self.0).len()
    }

    /// Whether none was.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The outcome of a job, per key: every key of the job is in exactly one of the two lists.
#[derive(Debug, Default, Clone)]
pub struct JobResult {
    /// Keys that were stored (or already present) / loaded completely.
    pub ok: Vec<BlockKey>,
    /// Keys that failed, with why.
    pub failed: Vec<(BlockKey, Error)>,
}

impl JobResult {
    /// Every key succeeded.
    pub fn all_ok(keys: Vec<BlockKey>) -> Self {
        Self {
            ok: keys,
            failed: Vec::new(),
        }
    }

    /// Every key failed with `err`.
    pub fn all_failed(keys: impl IntoIterator<Item = BlockKey>, err: &Error) -> Self {
        Self {
            ok: Vec::new(),
            failed: keys.into_iter().map(|k| (k, err.clone())).collect(),
        }
    }

    /// A load job ended before its end (cut, shut down): each of `keys` reported `landed`
    /// ([`LoadProgress::keys`]) is loaded, as many times as it was reported; the others
    /// failed with `err`.
    ///
    /// ```
    /// use kv_tier_core::{BlockKey, Error, JobResult};
    /// let (a, b) = (BlockKey::from_hash32([1; 32], 0), BlockKey::from_hash32([2; 32], 0));
    /// let r = JobResult::landed_or([a, b, a], &[a], &Error::Shutdown { what: "t".into() });
    /// assert_eq!(r.ok, vec![a]);
    /// assert_eq!(r.failed_keys(), vec![b, a]);
    /// ```
    pub fn landed_or(
        keys: impl IntoIterator<Item = BlockKey>,
        landed: &[BlockKey],
        err: &Error,
    ) -> Self {
        let mut left: rustc_hash::FxHashMap<BlockKey, usize> = Default::default();
        for k in landed {
            *left.entry(*k).or_default() += 1;
        }
        let mut r = Self::default();
        for k in keys {
            match left.get_mut(&k).filter(|n| **n > 0) {
                Some(n) => {
                    *n -= 1;
                    r.ok.push(k);
                }
                None => r.failed.push((k, err.clone())),
            }
        }
        r
    }

    /// The outcome from each key's own result, calling `on_error` with each failure (where a
    /// tier counts them).
    ///
    /// ```
    /// use kv_tier_core::{BlockKey, Error, JobResult};
    /// let (a, b) = (BlockKey::from_hash32([1; 32], 0), BlockKey::from_hash32([2; 32], 0));
    /// let missing = Error::NotFound { key: b, tier: "t".into() };
    /// let mut failures = 0;
    /// let res = JobResult::from_results([(a, Ok(())), (b, Err(missing))], |_| failures += 1);
    /// assert_eq!((res.failed_keys(), res.ok, failures), (vec![b], vec![a], 1));
    /// ```
    pub fn from_results<T>(
        results: impl IntoIterator<Item = (BlockKey, Result<T>)>,
        mut on_error: impl FnMut(&Error),
    ) -> Self {
        let mut res = Self::default();
        for (key, r) in results {
            match r {
                Ok(_) => res.ok.push(key),
                Err(e) => {
                    on_error(&e);
                    res.failed.push((key, e));
                }
            }
        }
        res
    }

    /// Whether no key failed.
    pub fn is_success(&self) -> bool {
        self.failed.is_empty()
    }

    /// The failed keys.
    pub fn failed_keys(&self) -> Vec<BlockKey> {
        self.failed.iter().map(|(k, _)| *k).collect()
    }
}

/// What a tier supports; lets callers and the conformance suite adapt. Built with
/// [`Capability::new`] and its setters (new capabilities may be added):
///
/// ```
/// use kv_tier_core::Capability;
/// let cap = Capability::new().persistent(true).checksums(true);
/// assert!(cap.persistent && cap.checksums && !cap.bounded && !cap.shared);
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Capability {
    /// Blocks survive a restart of the process.
    pub persistent: bool,
    /// The tier keeps itself within a capacity (and so evicts).
    pub bounded: bool,
    /// Blocks are verified by checksum on load.
    pub checksums: bool,
    /// Other processes may write the same keys (create-only publishing matters).
    pub shared: bool,
}

/// A tier's self-description, built with [`TierInfo::new`] (fields may be added).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TierInfo {
    /// The tier's name (unique within a manager).
    pub name: String,
    /// Its medium, for events.
    pub medium: Medium,
    /// Its locality, for events.
    pub locality: Locality,
    /// What it supports.
    pub capability: Capability,
}

impl Capability {
    /// Nothing supported: not persistent, not bounded, no checksums, not shared.
    pub const fn new() -> Self {
        Self {
            persistent: false,
            bounded: false,
            checksums: false,
            shared: false,
        }
    }

    /// Sets [`Capability::persistent`].
    pub const fn persistent(mut self, yes: bool) -> Self {
        self.persistent = yes;
        self
    }

    /// Sets [`Capability::bounded`].
    pub const fn bounded(mut self, yes: bool) -> Self {
        self.bounded = yes;
        self
    }

    /// Sets [`Capability::checksums`].
    pub const fn checksums(mut self, yes: bool) -> Self {
        self.checksums = yes;
        self
    }

    /// Sets [`Capability::shared`].
    pub const fn shared(mut self, yes: bool) -> Self {
        self.shared = yes;
        self
    }
}

impl TierInfo {
    /// A tier's description.
    pub fn new(
        name: impl Into<String>,
        medium: Medium,
        locality: Locality,
        capability: Capability,
    ) -> Self {
        Self {
            name: name.into(),
            medium,
            locality,
            capability,
        }
    }
}

/// A storage tier below DRAM: files, object storage, or a user's own.
///
/// Implementations must be cheap to call from many tasks at once. `touch` and `protect` are
/// synchronous and must never block on I/O; the async methods must not block tokio's workers
/// (run blocking I/O on threads of your own or via `spawn_blocking`).
///
/// # Cancellation, deadlines and panics
///
/// Every async method must be **cancellation-safe**: its future may be dropped at any await
/// point (the manager drops a probe at its deadline, `probe_timeout_s`, and a job at its
/// deadline, `job_timeout_s + job_timeout_per_block_s x blocks`; callers may drop theirs), and
/// the tier must stay consistent: no entry, claim, pin, permit or protection created by the
/// call may outlive the call's own work. State created before an `.await` belongs to a guard
/// whose `Drop` undoes it, not to cleanup code after the await. Work the call handed to
/// threads of its own may finish after the drop (its buffers keep their DRAM slots pinned
/// until then, and its keys may stay protected until then), but never longer.
///
/// A tier should bound its own calls too (every request it makes has a deadline): a call the
/// manager abandons costs a miss or a failed block, and a tier that ends its calls itself can
/// report exactly which keys it handled. A panic in a call is caught by the manager: the
/// probe's keys count as absent, the job's keys fail.
///
/// The `kv-tier-testkit` crate's conformance suite checks every rule below; run it against
/// your tier with its `conformance_tests!` macro.
#[async_trait]
pub trait SecondaryTier: std::any::Any + Send + Sync + fmt::Debug {
    /// The tier's name, medium, locality and capabilities.
    fn info(&self) -> TierInfo;

    /// Batched existence probe: one answer per key, in order. Cheap; may be cached (a cached
    /// positive answer must never make a `store` skip its write).
    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<bool>>;

    /// Whether the tier holds `key`, answered from what it knows in memory (an index of its
    /// blocks) without I/O: `Some(true)` held, `Some(false)` not held, `None` only a
    /// [`lookup`](Self::lookup) can tell. Never waits for I/O (a short lock is fine: the
    /// manager calls it with its own lock held); the default: `None` (every key is probed).
    ///
    /// The manager asks it first and probes only the keys it answers `None` for; it asks
    /// with `key` protected ([`protect`](Self::protect)), so an answer must hold while that
    /// protection lasts as a probe's would: `Some(true)` only for a key a load would find
    /// then (a load still verifies what it reads), and never `Some(false)` for a key a
    /// `store` reported stored and nothing removed since.
    fn holds(&self, _key: &BlockKey) -> Option<bool> {
        None
    }

    /// Copies the job's blocks into the tier. Publish-if-absent: storing a key that is present
    /// succeeds without replacing it, and of concurrent stores of one key exactly one copy
    /// survives, whole. A store that reports success leaves a readable block: a key is
    /// reported stored only if this call wrote it or the storage itself confirmed it exists.
    async fn store(&self, job: StoreJob) -> JobResult;

    /// Copies the job's blocks into their sinks, reporting exactly which keys were loaded
    /// whole. A key that is missing, short or corrupt fails alone; the others are kept.
    async fn load(&self, job: LoadJob) -> JobResult;

    /// Marks keys as recently used. Never blocks; missing keys are ignored.
    fn touch(&self, keys: &[BlockKey]);

    /// Keeps `keys` from being evicted while the guard lives. Refcounted: protections nest.
    /// Missing keys may be protected (a store in flight protects keys before they exist).
    /// The manager protects the keys of every job, of every probe in flight, and (as a lease)
    /// of every key a probe found until its promotion ends.
    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard;

    /// Whether `key` is currently protected.
    fn is_protected(&self, key: &BlockKey) -> bool;

    /// Takes the events accumulated since the last call (stores, then removals, in order).
    fn take_events(&self) -> Vec<TierEvent>;

    /// How to record events, from the tier's entry (vLLM's `enable_kv_events`, `locality`)
    /// and the config's `event_buffer_keys`; the manager calls it once, when it is built.
    /// A tier should record nothing while `enabled` is false (nothing grows), give its
    /// events `locality` when set, and hold at most `max_keys` keys, dropping the oldest
    /// ([`EventLog::configure`](crate::EventLog::configure) does all three). The manager
    /// also filters and relabels what `take_events` returns, so a tier that ignores this
    /// (the default) is still reported as configured; only its buffer is not bounded.
    fn configure_events(&self, _settings: crate::event::EventSettings) {}

    /// Event keys dropped because the tier's buffer was full. The default: none.
    fn events_dropped(&self) -> u64 {
        0
    }

    /// A request the engine started ([`crate::TieringManager::on_new_request`], vLLM's
    /// `on_new_request`), for tiers with request-level policies or peer-to-peer transfers;
    /// the manager's jobs for it carry its id ([`StoreJob::requests`], [`LoadJob::requests`]).
    /// Answering [`OffloadPolicy::RequestLevel`] asks for every block the request stores,
    /// the ones already in DRAM (its prefix hits) included, as vLLM's `REQUEST_LEVEL`
    /// tiers get them. Never blocks. The default: [`OffloadPolicy::ChunkLevel`] (the blocks
    /// the request newly stores).
    fn on_new_request(&self, _req: &RequestContext) -> OffloadPolicy {
        OffloadPolicy::ChunkLevel
    }

    /// The request is done and every store job it committed has ended (as vLLM forwards
    /// it). Called with the manager's lock held, like `touch`: it must not block or call
    /// back into the manager. The default: nothing.
    fn on_request_finished(&self, _req: RequestId) {}

    /// The tier's own statistics as a serialisable snapshot (see [`TierSnapshot`]); the
    /// manager includes it in [`TierStats::own`](crate::TierStats::own) and metrics export
    /// it. Cheap and non-blocking (it is called from the scheduler's thread and on every
    /// scrape). The default reports nothing.
    fn stats(&self) -> TierSnapshot {
        TierSnapshot::default()
    }

    /// Stops background work and releases resources. Calls after shutdown may fail.
    async fn shutdown(&self) -> Result<()>;
}

/// Keeps keys protected from eviction until dropped. See [`SecondaryTier::protect`].
#[must_use = "protection ends when the guard is dropped"]
pub struct ProtectGuard {
    _inner: Option<Box<dyn Any + Send + Sync>>,
}

impl ProtectGuard {
    /// A guard that releases by dropping `inner`.
    pub fn new<T: Any + Send + Sync>(inner: T) -> Self {
        Self {
            _inner: Some(Box::new(inner)),
        }
    }

    /// A guard that protects nothing (for tiers that never evict).
    pub fn noop() -> Self {
        Self { _inner: None }
    }
}

impl fmt::Debug for ProtectGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ProtectGuard")
    }
}

/// A refcounted set of protected keys, for tiers to embed.
///
/// The lock is exposed through [`ProtectionSet::with_lock`] so an evictor can decide and act
/// (check, then unlink) atomically with respect to `protect()`.
#[derive(Debug, Clone, Default)]
pub struct ProtectionSet {
    inner: Arc<Mutex<FxHashMap<BlockKey, u32>>>,
}

impl ProtectionSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Protects `keys` until the guard drops.
    pub fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        {
            let mut m = lock(&self.inner);
            for k in keys {
                *m.entry(*k).or_insert(0) += 1;
            }
        }
        ProtectGuard::new(Release {
            set: self.inner.clone(),
            keys: keys.to_vec(),
        })
    }

    /// Whether `key` is protected.
    pub fn contains(&self, key: &BlockKey) -> bool {
        lock(&self.inner).contains_key(key)
    }

    /// Number of distinct protected keys.
    pub fn len(&self) -> usize {
        lock(&self.inner).len()
    }

    /// Whether nothing is protected.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Runs `f` with the set locked: `f` gets a predicate "is this key protected"; no
    /// `protect()` can start or end while `f` runs.
    pub fn with_lock<R>(&self, f: impl FnOnce(&dyn Fn(&BlockKey) -> bool) -> R) -> R {
        let m = lock(&self.inner);
        f(&|k| m.contains_key(k))
    }
}

struct Release {
    set: Arc<Mutex<FxHashMap<BlockKey, u32>>>,
    keys: Vec<BlockKey>,
}

impl Drop for Release {
    fn drop(&mut self) {
        let mut m = lock(&self.set);
        for k in &self.keys {
            if let Some(c) = m.get_mut(k) {
                *c -= 1;
                if *c == 0 {
                    m.remove(k);
                }
            }
        }
    }
}

/// The outcome of [`PrimaryTier::prepare_store`].
#[derive(Debug, Default)]
pub struct PreparedStore {
    /// The keys that need writing, with exclusive writable slots; fill them, drop them, then
    /// call `PrimaryTier::complete_store`.
    pub to_store: Vec<(BlockKey, BlockSink)>,
    /// Keys already present (or being written, which may yet fail): nothing to do for them.
    pub present: Vec<BlockKey>,
    /// Keys evicted to make room.
    pub evicted: Vec<BlockKey>,
}

/// The name the primary (DRAM) tier goes by in errors, events and stats, whatever its
/// implementation (vLLM's medium `CPU`): `kv_tier_cpu::CPU_TIER_NAME` is this.
pub const PRIMARY_TIER_NAME: &str = "cpu";

/// The DRAM primary tier as the manager sees it. Synchronous and non-blocking: it is called
/// from the scheduler's thread.
pub trait PrimaryTier: Send + Sync + fmt::Debug + 'static {
    /// Bytes per block.
    fn block_size(&self) -> usize;

    /// `Hit` when readable, `HitPending` while being written, otherwise `Miss`.
    fn lookup(&self, key: &BlockKey) -> LookupResult;

    /// Reserves writable slots for the keys not present, evicting least-recently-used
    /// unpinned blocks (never a key of the same batch). Refuses with
    /// [`Error::CapacityExhausted`] and changes nothing when it cannot make room.
    fn prepare_store(&self, keys: &[BlockKey]) -> Result<PreparedStore>;

    /// Ends writes started by `prepare_store`: on success the blocks become readable and
    /// the keys that changed state are returned; on failure the slots are freed.
    fn complete_store(&self, keys: &[BlockKey], success: bool) -> Vec<BlockKey>;

    /// Read-only, pinning views of readable blocks (`None` for keys not readable).
    fn sources(&self, keys: &[BlockKey]) -> Vec<Option<BlockSource>>;

    /// Marks keys recently used; the first key ends up the most recent.
    fn touch(&self, keys: &[BlockKey]);

    /// Where readable blocks sit in their requests' chains (see [`ChainLink`]), for an
    /// eviction that takes a chain's later blocks before its earlier ones. The manager calls
    /// it when the config's `eviction_policy` is `"chain"` (not the default), with the blocks
    /// a store or a promotion has just made readable whose links it knows. Keys not readable
    /// are ignored; so are links the tier cannot use. The default ignores them all.
    fn link(&self, _links: &[(BlockKey, ChainLink)]) {}

    /// Takes the events since the last call (removals before the stores that caused them).
    fn take_events(&self) -> Vec<TierEvent>;

    /// Bounds the events held until taken (the config's `event_buffer_keys`): past it the
    /// oldest are dropped and counted ([`PrimaryTier::events_dropped`]). The manager calls
    /// it once, when it is built. The default does nothing.
    fn bound_events(&self, _max_keys: u64) {}

    /// Event keys dropped because the buffer was full. The default: none.
    fn events_dropped(&self) -> u64 {
        0
    }

    /// Drops every block not pinned by I/O; returns how many remain pinned.
    fn reset(&self) -> usize;

    /// Counters.
    fn stats(&self) -> PrimaryStats;
}

/// `tier.protect(keys)`, with a panic of the tier caught: then nothing is protected (logged).
/// The manager calls tiers' synchronous methods through these, so a tier that panics costs
/// protection or recency, never the scheduler's thread.
pub(crate) fn protect_caught(tier: &dyn SecondaryTier, keys: &[BlockKey]) -> ProtectGuard {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tier.protect(keys))) {
        Ok(g) => g,
        Err(_) => {
            tracing::error!(
                keys = keys.len(),
                "a tier panicked in protect(); the keys are not protected"
            );
            ProtectGuard::noop()
        }
    }
}

/// `tier.holds(key)`, with a panic of the tier caught (logged; the key is then probed).
pub(crate) fn holds_caught(tier: &dyn SecondaryTier, key: &BlockKey) -> Option<bool> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tier.holds(key))) {
        Ok(h) => h,
        Err(_) => {
            tracing::error!("a tier panicked in holds(); the key is probed instead");
            None
        }
    }
}

/// `tier.touch(keys)`, with a panic of the tier caught (logged).
pub(crate) fn touch_caught(tier: &dyn SecondaryTier, keys: &[BlockKey]) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tier.touch(keys))).is_err() {
        tracing::error!(keys = keys.len(), "a tier panicked in touch()");
    }
}

/// Which of a request's blocks a tier is sent (vLLM's `OffloadPolicy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadPolicy {
    /// The blocks the request newly stores (vLLM's `CHUNK_LEVEL`; the default).
    #[default]
    ChunkLevel,
    /// Every block the request stores, those already in DRAM included (`REQUEST_LEVEL`).
    RequestLevel,
}

/// A request hook of a tier, with a panic of the tier caught (logged).
pub(crate) fn hook_caught(
    tier: &dyn SecondaryTier,
    what: &str,
    f: impl FnOnce(&dyn SecondaryTier),
) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(tier))).is_err() {
        tracing::error!(hook = what, "a tier panicked in a request hook");
    }
}

/// `tier.take_events()`, with a panic of the tier caught (logged; no events).
pub(crate) fn take_events_caught(tier: &dyn SecondaryTier) -> Vec<TierEvent> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tier.take_events())).unwrap_or_else(
        |_| {
            tracing::error!("a tier panicked in take_events()");
            Vec::new()
        },
    )
}

/// `tier.stats()`, with a panic of the tier caught (logged; an empty snapshot).
pub(crate) fn stats_caught(tier: &dyn SecondaryTier) -> TierSnapshot {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| tier.stats())).unwrap_or_else(|_| {
        tracing::error!("a tier panicked in stats()");
        TierSnapshot::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic inside `with_lock` (an evictor's bug) poisons the lock; protecting, checking
    /// and releasing still work afterwards, with the counts intact.
    #[test]
    fn a_panic_under_the_protection_lock_leaves_the_set_usable() {
        let set = ProtectionSet::new();
        let (a, b) = (
            BlockKey::from_hash32([1; 32], 0),
            BlockKey::from_hash32([2; 32], 0),
        );
        let guard_a = set.protect(&[a]);
        let s = set.clone();
        let r = std::panic::catch_unwind(move || s.with_lock(|_| panic!("evictor bug")));
        assert!(r.is_err());
        let guard_b = set.protect(&[b, b]);
        assert!(set.contains(&a) && set.contains(&b));
        assert_eq!(set.len(), 2);
        assert!(set.with_lock(|p| p(&a) && p(&b)));
        drop(guard_a);
        assert!(!set.contains(&a));
        drop(guard_b);
        assert!(set.is_empty());
    }
}
