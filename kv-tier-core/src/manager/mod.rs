//! [`TieringManager`]: the DRAM primary plus ordered secondary tiers, driven from the
//! engine's scheduler thread without ever blocking it.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::time::Instant;

use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::Notify;

use crate::buf::{BlockSink, BlockSource};
use crate::config::KvTierConfig;
use crate::error::{Error, Result};
use crate::event::TierEvent;
use crate::key::BlockKey;
use crate::probe_cache::{Absence, Presence, ProbeCache};
use crate::request::{
    LookupResult, MissCause, PrefixCount, RequestContext, RequestId, count_prefix,
};
use crate::stats::ManagerStats;
pub(crate) use crate::sync::lock;
mod admission;
mod builder;
mod chains;
mod estimate;
mod holds;
mod jobs;
mod lifecycle;
mod pending;
mod requests;
mod write_back;

use builder::OwnedRuntime;
pub use builder::TieringManagerBuilder;
pub use estimate::{LoadEstimate, RecomputeTime};
use jobs::{Completion, Job, JobInfo};
pub use pending::{NotWritten, PendingStore, StoreReceipt};

use crate::tier::{
    PreparedStore, PrimaryTier, SecondaryTier, StoreJob, stats_caught, take_events_caught,
    touch_caught,
};
/// Whom a promotion is for: a request, or (`None`) the manager itself, measuring a tier.
type Promoter = Option<RequestId>;

struct State {
    in_step: bool,
    lookups: Vec<ProbeCache>,
    /// Promotions queued this step: one load job per (tier, request) at schedule end.
    promotions: BTreeMap<(usize, Promoter), Vec<(BlockKey, BlockSink)>>,
    /// Keys whose DRAM slot is reserved by a promotion (queued or in flight). Only the
    /// promotion completes them: an engine's `complete_store` of the same key must not mark a
    /// slot readable before (or although) its load ended.
    /// With when the first ask for it came, the tier it comes from, and its chain link as
    /// the request's lookups showed it (for DRAM's chain order, kept past the request's end).
    promoting: FxHashMap<BlockKey, (Instant, usize, Option<crate::tier::ChainLink>)>,
    /// Promoted blocks held for the requests promised them (see `holds`).
    holds: holds::Holds,
    jobs: FxHashMap<u64, JobInfo>,
    /// Per tier, its load jobs in `jobs` (for `load_busy`).
    loading: Vec<jobs::Loading>,
    /// Per tier, its recent load jobs, for [`TieringManager::load_estimate`].
    load_models: Vec<estimate::LoadModel>,
    /// The engine's scheduling steps, for the whole steps a wait spans.
    steps: estimate::StepClock,
    /// The (key, tier) waits for a probe the current `lookup_many` counted (`retry_waits`),
    /// every one for a key it answers `Retry`: taken back when the policy does not wait.
    retried: Vec<(BlockKey, usize)>,
    next_job: u64,
    pending_stores: FxHashMap<RequestId, usize>,
    finishing: FxHashSet<RequestId>,
    stats: ManagerStats,
    shut_down: bool,
    write_back: write_back::WriteBack,
    admission: admission::Admission,
    /// Per request, the tiers that asked for its blocks at request level.
    request_level: FxHashMap<RequestId, Vec<usize>>,
    /// Per request, why its last `Miss` was one (until it finishes).
    last_miss: FxHashMap<RequestId, MissCause>,
    /// Per request, which of its blocks follows which (until it finishes).
    chains: chains::Chains,
}
/// The tiering manager: answers lookups without blocking, cascades stores to every secondary
/// tier, and promotes secondary hits into DRAM in batched background jobs.
///
/// All methods but the `async` ones are synchronous, cheap and non-blocking: call them from
/// the scheduler's loop. Completed jobs and probes are applied at the first call of a step
/// and at [`TieringManager::on_schedule_end`], so verdicts change only there.
///
/// ```
/// # async fn demo(manager: kv_tier_core::TieringManager) -> kv_tier_core::Result<()> {
/// use kv_tier_core::{BlockKey, LookupResult, RequestContext};
/// let req = RequestContext::new(1);
/// let key = BlockKey::from_hash32([7; 32], 0);
/// let mut pending = manager.prepare_store(&[key])?;
/// for (_, sink) in pending.slots() {
///     sink.as_mut_slice().fill(42); // the engine copies GPU -> DRAM here
/// }
/// pending.commit(req.id);
/// assert_eq!(manager.lookup(&key, &req), LookupResult::Hit);
/// manager.on_schedule_end();
/// # Ok(()) }
/// ```
///
/// # Dropping
///
/// [`TieringManager::shutdown`] is the orderly end. Dropping the manager without it is safe
/// but abrupt: jobs still running go on, on the runtime they run on, until they end (each
/// has a deadline); a runtime the manager owns (`build_blocking`) is shut down in the
/// background, and those jobs stop at their next await. No tier is left with a torn block:
/// tiers publish a block only whole, and a tier's own threads stop when its last handle
/// goes. Blocks that were only in DRAM are gone, and cascades not yet sent are not sent.
pub struct TieringManager {
    state: Mutex<State>,
    primary: Arc<dyn PrimaryTier>,
    tiers: Vec<Arc<dyn SecondaryTier>>,
    names: Vec<String>,
    /// Per tier: whether its events are reported, and the locality they carry.
    events: Vec<(bool, Option<crate::event::Locality>)>,
    config: KvTierConfig,
    /// The engine's recompute time: given, promotions that do not pay are declined.
    recompute: Option<RecomputeTime>,
    notify: Arc<Notify>,
    inbox: Arc<Mutex<Vec<Completion>>>,
    runtime: tokio::runtime::Handle,
    _owned_runtime: OwnedRuntime,
    /// What [`TieringManager::publish_metrics`] published of each counter.
    metrics: crate::metrics::MetricsPublisher,
    /// The WARNs of abandoned jobs and of jobs with failed blocks: once per
    /// [`crate::stats::LOG_INTERVAL`] each, with the count (every one is counted in the
    /// tiers' stats).
    log_abandoned: crate::stats::Throttle,
    log_failed: crate::stats::Throttle,
}

impl fmt::Debug for TieringManager {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TieringManager")
            .field("primary", &self.primary)
            .field("tiers", &self.names)
            .finish()
    }
}

impl TieringManager {
    /// A builder from a validated config.
    pub fn builder(config: KvTierConfig) -> TieringManagerBuilder {
        TieringManagerBuilder::new(config)
    }

    /// The secondary tiers' names, in lookup order.
    pub fn tier_names(&self) -> &[String] {
        &self.names
    }

    /// The secondary tiers, in lookup order.
    pub fn tiers(&self) -> &[Arc<dyn SecondaryTier>] {
        &self.tiers
    }

    /// The secondary tier named `name`, as its own type: how an embedder reaches a tier's
    /// own API (its stats, its config) on a tier the manager built from the config. `None`
    /// if no tier has that name or it is of another type.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use kv_tier_core::{TieringManager, SecondaryTier};
    /// fn tier_of<T: SecondaryTier>(manager: &TieringManager, name: &str) -> Option<Arc<T>> {
    ///     manager.tier::<T>(name)
    /// }
    /// ```
    pub fn tier<T: SecondaryTier>(&self, name: &str) -> Option<Arc<T>> {
        let i = self.names.iter().position(|n| n == name)?;
        let any: Arc<dyn std::any::Any + Send + Sync> = self.tiers[i].clone();
        any.downcast::<T>().ok()
    }

    /// The primary tier.
    pub fn primary(&self) -> &Arc<dyn PrimaryTier> {
        &self.primary
    }

    /// The runtime jobs run on.
    pub fn runtime(&self) -> &tokio::runtime::Handle {
        &self.runtime
    }

    /// Bytes per block.
    pub fn block_size(&self) -> usize {
        self.primary.block_size()
    }

    /// The resolved manager settings of the `i`-th secondary tier (probe budget, write-back
    /// limit and policy).
    pub fn tier_settings(&self, i: usize) -> crate::tier_options::TierSettings {
        *lock(&self.state).write_back.settings(i)
    }

    /// The validated config the manager was built from.
    pub fn config(&self) -> &KvTierConfig {
        &self.config
    }

    /// Locks the state; the first call of a step applies what completed since the last step.
    fn begin(&self) -> MutexGuard<'_, State> {
        let mut st = lock(&self.state);
        if !st.in_step {
            self.drain(&mut st);
            st.in_step = true;
        }
        st
    }

    /// Whether `key` is available for request `req`; see [`LookupResult`].
    ///
    /// DRAM answers first. Otherwise the secondary tiers the request may load from are asked
    /// in order through their probe caches; a hit reserves a DRAM slot and queues a promotion
    /// (one load job per tier and request, sent at [`TieringManager::on_schedule_end`]).
    /// The promoted block is then held in DRAM for `req` (not evicted) until `req` reads it
    /// (a `Hit` and `prepare_load` of it in one step), its prefix stops before it (a `Miss`
    /// at or before it), or `req` finishes.
    pub fn lookup(&self, key: &BlockKey, req: &RequestContext) -> LookupResult {
        let mut st = self.begin();
        st.admission.asked(key, req.id);
        self.lookup_inner(&mut st, key, req, || {})
    }

    /// Looks up `keys` in prefix order and counts the contiguous run of hits. Stops at the
    /// first `Miss`; keys after a `Retry` are still looked up so their probes share a batch.
    ///
    /// A promotion's DRAM reservation never evicts a block this call has already answered
    /// `Hit` for: those are made most recent first.
    ///
    /// The count says when its present run is expected to be all in DRAM
    /// ([`PrefixCount::ready_in`], from the tiers' [`TieringManager::load_estimate`]s), for a
    /// scheduler that weighs the wait against recomputing; with the manager's own policy on
    /// (see [`TieringManager::lookup_many`]) the run is only what pays already.
    pub fn lookup_prefix(&self, keys: &[BlockKey], req: &RequestContext) -> PrefixCount {
        let results = self.lookup_many(keys, req);
        let mut count = count_prefix(results.iter().copied());
        let st = lock(&self.state);
        let mut ready = Some(Duration::ZERO);
        let mut tiers = FxHashSet::default();
        for k in &keys[..count.present] {
            if let Some((_, i, _)) = st.promoting.get(k) {
                tiers.insert(*i);
            }
        }
        for i in tiers {
            ready = match (ready, self.estimate(&st, i)) {
                (Some(r), Some(e)) => Some(r.max(e.ready_in(0))),
                _ => None,
            };
        }
        count.ready_in = ready;
        count
    }

    /// How long loading blocks from tier `tier` into DRAM would take now: fitted to its last
    /// load jobs, with what is queued and in flight ahead of a new one; `None` for a tier
    /// not configured, or before its first load job ended.
    ///
    /// ```
    /// # fn demo(manager: &kv_tier_core::TieringManager) {
    /// if let Some(e) = manager.load_estimate("fs") {
    ///     // a job of 16 blocks, submitted now
    ///     let wait = e.ready_in(16 * manager.block_size() as u64);
    ///     println!("fs: 16 blocks in {wait:?} ({:.0} MB/s, {:?} a job)", e.bytes_per_s / 1e6, e.latency);
    /// }
    /// # }
    /// ```
    pub fn load_estimate(&self, tier: &str) -> Option<LoadEstimate> {
        let i = self.names.iter().position(|n| n == tier)?;
        self.estimate(&lock(&self.state), i)
    }

    /// Tier `i`'s estimate now.
    fn estimate(&self, st: &State, i: usize) -> Option<LoadEstimate> {
        st.load_models[i].estimate(self.bytes_ahead(st, i))
    }

    /// Bytes of tier `i`'s load jobs in flight (not yet ended) and of its promotions queued
    /// this step.
    fn bytes_ahead(&self, st: &State, i: usize) -> u64 {
        // a job that ended is not ahead, though its result waits for the next drain (a step
        // applies what ended once, at its start)
        let ended = lock(&self.inbox);
        let in_flight: u64 = st
            .jobs
            .iter()
            .filter(|(id, _)| !ended.iter().any(|c| c.job == **id))
            .map(|(_, j)| j.load_bytes_of(i))
            .sum();
        drop(ended);
        let queued: u64 = st
            .promotions
            .iter()
            .filter(|((t, _), _)| *t == i)
            .flat_map(|(_, blocks)| blocks.iter().map(|(_, s)| s.len() as u64))
            .sum();
        in_flight + queued
    }

    /// [`TieringManager::lookup_prefix`] with the verdict of every key looked up (it stops
    /// after the first `Miss`, so the result may be shorter than `keys`).
    ///
    /// A promotion's DRAM reservation never evicts a block this call answered `Hit` for: before
    /// reserving, those blocks are pinned (until the call returns) and made most recent. When
    /// nothing else can make room, the promotion is refused and that key is a `Miss`.
    ///
    /// # Load or recompute
    ///
    /// Given the engine's recompute time (the config's `prefill_tokens_per_s`, or
    /// [`TieringManagerBuilder::recompute_time`]), the call serves only the part of the
    /// present run that saves the most time: of each length `k`, the time to recompute its
    /// `k` blocks less the wait for them (nothing for blocks in DRAM; for the others, the
    /// [`TieringManager::load_estimate`] of the slowest tier they come from, with what is
    /// queued ahead of them). A request that waits resumes only at a scheduling step, so a
    /// wait costs the whole steps it spans, at least one (the step: the median interval of
    /// the last 15 [`TieringManager::on_schedule_end`] calls; taken as it is before two
    /// steps ended). The promotions past it are declined: their DRAM slots and the tiers'
    /// leases are released, their blocks are a `Miss` for the request
    /// ([`MissCause::RecomputeFaster`], again at its later lookups, in every tier: it
    /// recomputes them), and they count in the tier's `promotions_declined`.
    ///
    /// A `Retry` just past the run (a probe not answered yet) is weighed the same way: if
    /// even every key asked found present could not save more than the run alone once the
    /// request waits a step for it, the request does not wait: that key and the rest are a
    /// `Miss` (`RecomputeFaster`) for it, and the probe goes on for others.
    ///
    /// No request waits on a guess: before the steps are measured a `Retry` is not waited
    /// for, and the run ends before the first block of a tier whose loads are not measured
    /// yet. That tier's promotion is still sent if it has no other load (counted declined:
    /// it is held for no request); it lands in DRAM for the requests after, and its time
    /// measures the tier. It is sent at the end of the step, as the request's own promotions
    /// are, but it is the manager's: the request finishing before then does not cancel it.
    ///
    /// A single-key [`TieringManager::lookup`] is not judged: a prefix is.
    pub fn lookup_many(&self, keys: &[BlockKey], req: &RequestContext) -> Vec<LookupResult> {
        let mut st = self.begin();
        // every key asked for counts towards admission, past a miss too (as vLLM counts)
        for k in keys {
            st.admission.asked(k, req.id);
        }
        if self.wants_chains(&st) {
            st.chains.learn(req.id, req.follows, keys);
        }
        st.retried.clear();
        let mut results = Vec::with_capacity(keys.len());
        let mut pins: Vec<BlockSource> = Vec::new();
        let mut unpinned = 0;
        for (i, key) in keys.iter().enumerate() {
            let recent = &keys[unpinned..i];
            let mut pinned = false;
            let r = self.lookup_inner(&mut st, key, req, || {
                if !recent.is_empty() {
                    pins.extend(self.primary.sources(recent).into_iter().flatten());
                    self.primary.touch(recent);
                    pinned = true;
                }
            });
            if pinned {
                unpinned = i;
            }
            results.push(r);
            if r == LookupResult::Miss {
                // the request's prefix stops here: what comes after is not read
                for k in &keys[i + 1..] {
                    st.holds.release(req.id, *k);
                }
                break;
            }
        }
        drop(pins);
        if let Some(recompute) = &self.recompute {
            self.load_or_recompute(&mut st, keys, req.id, &mut results, recompute);
        }
        results
    }

    /// The load-or-recompute policy of [`TieringManager::lookup_many`] over its `results`
    /// for `keys`: cuts the present run to the length that saves the most time, weighing a
    /// wait at the whole scheduling steps it spans; and answers `Miss` in place of a `Retry`
    /// just past the run when even every key past it found at once could not pay for the step
    /// the request would wait.
    fn load_or_recompute(
        &self,
        st: &mut State,
        keys: &[BlockKey],
        req: RequestId,
        results: &mut Vec<LookupResult>,
        recompute: &RecomputeTime,
    ) {
        let asked = results.len();
        let present = results
            .iter()
            .take_while(|r| matches!(r, LookupResult::Hit | LookupResult::HitPending))
            .count();
        // per position asked: the tier its promotion reads from (none: in DRAM, written there
        // by a store, or not found yet), and the keys this request queued this step
        let queued: FxHashSet<BlockKey> = st
            .promotions
            .iter()
            .filter(|((_, r), _)| *r == Some(req))
            .flat_map(|(_, blocks)| blocks.iter().map(|(k, _)| *k))
            .collect();
        let from: Vec<Option<usize>> = keys[..asked]
            .iter()
            .map(|k| st.promoting.get(k).map(|(_, i, _)| *i))
            .collect();
        // this request's blocks queued in the run, per tier, in prefix order: they count
        // ahead of a prefix only as far as it reaches (a key twice in it is one block queued)
        let bs = self.primary.block_size() as u64;
        let mut not_counted = queued.clone();
        let own: Vec<u64> = keys[..present]
            .iter()
            .map(|k| if not_counted.remove(k) { bs } else { 0 })
            .collect();
        let mut own_in_run: FxHashMap<usize, u64> = FxHashMap::default();
        for (f, b) in from.iter().zip(&own) {
            if let Some(i) = f {
                *own_in_run.entry(*i).or_default() += b;
            }
        }
        // per tier the request waits for: its estimate, with the work ahead of those blocks
        let mut estimates: FxHashMap<usize, LoadEstimate> = FxHashMap::default();
        for (i, own) in &own_in_run {
            if let Some(mut e) = self.estimate(st, *i) {
                e.bytes_ahead = e.bytes_ahead.saturating_sub(*own);
                estimates.insert(*i, e);
            }
        }
        let step = st.steps.interval();
        // the run as far as it is judged: up to the first block of a tier not measured yet
        let judged = (0..present)
            .find(|&p| from[p].is_some_and(|i| !estimates.contains_key(&i)))
            .unwrap_or(present);
        let mut own_so_far: FxHashMap<usize, u64> = FxHashMap::default();
        let mut saved = vec![0.0; judged + 1];
        let mut wait = Duration::ZERO;
        // a wait at all: some block of the prefix is not in DRAM yet
        let mut waits = false;
        for k in 1..=judged {
            if let Some(i) = from[k - 1] {
                waits = true;
                let so_far = own_so_far.entry(i).or_default();
                *so_far += own[k - 1];
                if let Some(e) = estimates.get(&i) {
                    wait = wait.max(e.ready_in(*so_far));
                }
            }
            let cost = if waits {
                estimate::whole_steps(wait, step)
            } else {
                Duration::ZERO
            };
            saved[k] = recompute.of(k).as_secs_f64() - cost.as_secs_f64();
        }
        let keep = estimate::paying_prefix(judged, |k| saved[k]);
        // a `Retry` past the run: waiting for it costs at least a step (more if the run's own
        // wait is longer), and at best every key asked is found; if that cannot save more
        // than the run does, or the steps are not measured yet, the request goes on without
        // waiting
        let retry_declined = keep == present
            && results.get(present) == Some(&LookupResult::Retry)
            && step.is_none_or(|step| {
                let best = recompute.of(asked).as_secs_f64()
                    - estimate::whole_steps(wait.max(step), Some(step)).as_secs_f64();
                best <= saved[keep]
            });
        if keep == present && !retry_declined {
            return;
        }
        // a tier not measured yet is not waited for: its first promotion of the run is still
        // sent, if the tier has no other load (it lands in DRAM for the requests after, and
        // measures the tier); the others are dropped
        let measure = (judged < present)
            .then(|| from[judged])
            .flatten()
            .filter(|&i| {
                !estimates.contains_key(&i)
                    && st.loading[i].jobs == 0
                    && !st.promotions.keys().any(|&(t, r)| t == i && r != Some(req))
            });
        // the tier it would have waited for: the first a declined block loads from, or whose
        // probe this lookup waited for
        let tier = (keep..asked)
            .find_map(|p| {
                from[p].or_else(|| {
                    st.retried
                        .iter()
                        .find_map(|(k, i)| (*k == keys[p]).then_some(*i))
                })
            })
            .map_or_else(String::new, |i| self.names[i].clone());
        let declined = Declined {
            keep,
            asked,
            measure,
            from,
            queued,
        };
        self.decline(st, keys, req, declined, results);
        results.truncate(keep);
        st.stats.lookups += 1;
        results.push(miss(st, req, MissCause::RecomputeFaster { tier }));
    }

    /// Declines `keys[keep..asked]` for `req` (see [`TieringManager::load_or_recompute`]):
    /// their promotions queued by it are dropped (DRAM slots and leases released), its holds
    /// on them end, every tier that knows the request answers them absent for it from now on,
    /// and the answers given for them are taken back from the counts.
    /// A promotion of `measure`'s stays queued, for no request now (see [`Declined`]).
    fn decline(
        &self,
        st: &mut State,
        keys: &[BlockKey],
        req: RequestId,
        Declined {
            keep,
            asked,
            measure,
            from,
            queued,
        }: Declined,
        results: &[LookupResult],
    ) {
        let mut declined: FxHashMap<usize, Vec<BlockKey>> = FxHashMap::default();
        // a key also in the part kept is served there: its hold, promotion and answer stay
        let kept: FxHashSet<BlockKey> = keys[..keep].iter().copied().collect();
        let mut seen = FxHashSet::default();
        for (p, key) in keys.iter().enumerate().skip(keep) {
            if kept.contains(key) {
                continue;
            }
            st.holds.release(req, *key);
            let Some(i) = from.get(p).copied().flatten() else {
                continue;
            };
            // a key twice in the prefix was reserved (and counted) once
            if queued.contains(key) && seen.insert(*key) {
                declined.entry(i).or_default().push(*key);
            }
        }
        for (i, ks) in declined {
            let set: FxHashSet<BlockKey> = ks.iter().copied().collect();
            if let Some(blocks) = st.promotions.get_mut(&(i, Some(req))) {
                let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(blocks)
                    .into_iter()
                    .partition(|(k, _)| set.contains(k));
                *blocks = kept;
                if blocks.is_empty() {
                    st.promotions.remove(&(i, Some(req)));
                }
                if measure == Some(i) {
                    // sent for no request: the request's end does not take it along
                    st.promotions.entry((i, None)).or_default().extend(gone);
                } else {
                    self.cancel(st, i, gone);
                }
            }
            let ts = &mut st.stats.tiers[i];
            ts.hits = ts.hits.saturating_sub(ks.len() as u64);
            ts.promotions_declined += ks.len() as u64;
        }
        // the answers past the cut are taken back, one `Miss` given for them: the counts
        // follow (lookups = hits + pending + retries + misses, misses by cause)
        for r in results.iter().skip(keep) {
            let s = &mut st.stats;
            s.lookups -= 1;
            match r {
                LookupResult::Hit => s.hits -= 1,
                LookupResult::HitPending => s.hits_pending -= 1,
                LookupResult::Retry => s.retries -= 1,
                LookupResult::Miss => {
                    s.misses -= 1;
                    if let Some(cause) = st.last_miss.get(&req) {
                        s.misses_by_cause.unrecord(cause);
                    }
                }
            }
        }
        // every wait for a probe this lookup counted was for a `Retry`, all of them past the
        // run and so past the cut: the request waits for none of them now
        for (_, i) in std::mem::take(&mut st.retried) {
            let t = &mut st.stats.tiers[i];
            t.retry_waits = t.retry_waits.saturating_sub(1);
            t.probes_not_waited += 1;
        }
        // absent for the request in every tier: no other tier serves what was declined
        let gone: Vec<BlockKey> = keys[keep..asked]
            .iter()
            .filter(|k| !kept.contains(k))
            .copied()
            .collect();
        for l in &mut st.lookups {
            l.mark_declined(&gone, req);
        }
    }

    fn lookup_inner(
        &self,
        st: &mut State,
        key: &BlockKey,
        req: &RequestContext,
        before_reserve: impl FnOnce(),
    ) -> LookupResult {
        st.stats.lookups += 1;
        match self.primary.lookup(key) {
            LookupResult::Hit => {
                st.stats.hits += 1;
                st.holds.hit(req.id, *key);
                return LookupResult::Hit;
            }
            LookupResult::HitPending => {
                if let Some(&(_, i, _)) = st.promoting.get(key) {
                    // declined for this request (in any tier: a tier keeps the first reason a
                    // key is absent): it recomputes the block, whoever promotes it
                    if st
                        .lookups
                        .iter()
                        .any(|l| l.absence(key, req.id) == Some(Absence::Declined))
                    {
                        st.holds.release(req.id, *key);
                        let tier = self.names[i].clone();
                        return miss(st, req.id, MissCause::RecomputeFaster { tier });
                    }
                    // riding on another request's promotion: promised the block too
                    st.holds.wait(req.id, *key);
                }
                st.stats.hits_pending += 1;
                return LookupResult::HitPending;
            }
            _ => {}
        }
        if st.shut_down {
            return miss(st, req.id, MissCause::ShutDown);
        }
        // Every allowed tier is asked at once (each queues its probe if it does not know);
        // the first tier in order that has the key serves it, once no tier before it could
        // still have it. A tier's probe budget bounds how long a lookup waits for it.
        let mut pending = false;
        for i in 0..self.tiers.len() {
            if !req.filter.allows(&self.names[i]) {
                continue;
            }
            match st.lookups[i].ask(key, req.id) {
                Presence::Absent => {}
                Presence::Retry => {
                    pending = true;
                    st.stats.tiers[i].retry_waits += 1;
                    st.retried.push((*key, i));
                }
                Presence::Present if !pending => {
                    before_reserve();
                    return self.reserve_promotion(st, i, key, req.id);
                }
                // a tier before it may still have it (and is the faster one)
                Presence::Present => break,
            }
        }
        if pending {
            st.stats.retries += 1;
            return LookupResult::Retry;
        }
        st.holds.release(req.id, *key);
        // the first tier in order whose absence is not a plain "not there" names the cause
        let cause = (0..self.tiers.len())
            .filter(|&i| req.filter.allows(&self.names[i]))
            .find_map(|i| {
                let tier = || self.names[i].clone();
                match st.lookups[i].absence(key, req.id)? {
                    Absence::NotFound => None,
                    Absence::OverBudget | Absence::TimedOut => {
                        Some(MissCause::ProbeOverBudget { tier: tier() })
                    }
                    Absence::ProbeFailed => Some(MissCause::ProbeFailed { tier: tier() }),
                    Absence::LoadFailed => Some(MissCause::LoadFailed { tier: tier() }),
                    Absence::Declined => Some(MissCause::RecomputeFaster { tier: tier() }),
                }
            })
            .unwrap_or(MissCause::NotFound);
        miss(st, req.id, cause)
    }

    /// Why the last [`LookupResult::Miss`] answered for `req` was one, until `req` finishes
    /// ([`TieringManager::on_request_finished`]). [`TieringManager::lookup_prefix`] and
    /// [`TieringManager::lookup_many`] stop at their first `Miss`: after one of them, it is
    /// the cause of the miss that ended the request's prefix.
    pub fn last_miss(&self, req: RequestId) -> Option<MissCause> {
        lock(&self.state).last_miss.get(&req).cloned()
    }

    /// The tier a promotion of `key` into DRAM (queued or in flight) reads from: after a
    /// `HitPending`, where the block comes from; `None` when no promotion of it is under way
    /// (it is in DRAM, or being written there by a store).
    pub fn promotion_tier(&self, key: &BlockKey) -> Option<&str> {
        let i = lock(&self.state).promoting.get(key)?.1;
        Some(&self.names[i])
    }

    /// A secondary tier has `key`: reserve a DRAM slot and queue the promotion, or answer
    /// `Miss` when DRAM has no room.
    fn reserve_promotion(
        &self,
        st: &mut State,
        i: usize,
        key: &BlockKey,
        req: RequestId,
    ) -> LookupResult {
        match self.primary.prepare_store(std::slice::from_ref(key)) {
            Ok(PreparedStore { mut to_store, .. }) => {
                if let Some(block) = to_store.pop() {
                    st.holds.wait(req, block.0);
                    // the wait is counted from the request's first ask (the probe's time too)
                    let since = st.lookups[i].asked_since(key).unwrap_or_else(Instant::now);
                    let link = match self.primary_chains() {
                        true => st.chains.known(req, &[block.0]).pop().map(|(_, l)| l),
                        false => None,
                    };
                    st.promoting.insert(block.0, (since, i, link));
                    st.promotions.entry((i, Some(req))).or_default().push(block);
                    st.stats.tiers[i].hits += 1;
                }
                st.stats.hits_pending += 1;
                LookupResult::HitPending
            }
            Err(err) => {
                tracing::debug!(%key, error = %err, "no DRAM slot to promote into; answering Miss");
                st.lookups[i].release(std::slice::from_ref(key));
                st.holds.release(req, *key);
                st.stats.promotions_refused += 1;
                let tier = self.names[i].clone();
                miss(st, req, MissCause::NoDramRoom { tier })
            }
        }
    }

    /// Pins readable DRAM blocks for the engine's DRAM -> GPU copy; each view pins its slot
    /// until dropped. Fails, pinning nothing, if a key is not readable (`Hit`).
    pub fn prepare_load(&self, keys: &[BlockKey]) -> Result<Vec<BlockSource>> {
        let mut st = self.begin();
        let views = keys
            .iter()
            .zip(self.primary.sources(keys))
            .map(|(k, s)| {
                s.ok_or_else(|| Error::NotFound {
                    key: *k,
                    tier: crate::tier::PRIMARY_TIER_NAME.into(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        st.holds.read(keys);
        Ok(views)
    }

    /// Reserves DRAM slots for `keys` (evicting least-recently-used unpinned blocks). Fill the
    /// returned [`PendingStore`]'s slots, then commit it (or abort it, or drop it: the slots
    /// are freed).
    ///
    /// Where a tier's write-back policy is `wait`, refused with [`Error::WriteBackFull`]
    /// (changing nothing) when the new blocks would take its write-back past its limit, or
    /// the DRAM pinned by write-back past `write_back_max_dram_fraction`, counting the stores
    /// prepared and not yet completed: ask again after the next step.
    pub fn prepare_store(&self, keys: &[BlockKey]) -> Result<PendingStore<'_>> {
        let mut st = self.begin();
        let per_block = self.primary.block_size() as u64;
        // one DRAM lookup per key: a key already there is not a store (neither admitted nor
        // left out); a missing one enters only if vLLM's store_threshold admits it
        // the chain is the caller's order, keys left out included (a block not admitted still
        // comes between its neighbours)
        let chain = if self.wants_chains(&st) {
            keys.to_vec()
        } else {
            Vec::new()
        };
        let mut admitted = Vec::with_capacity(keys.len());
        let mut new: FxHashSet<&BlockKey> = FxHashSet::default();
        for k in keys {
            let missing = self.primary.lookup(k) == LookupResult::Miss;
            if missing && !st.admission.dram_admits(k) {
                st.stats.stores_not_admitted += 1;
                continue;
            }
            if missing {
                new.insert(k);
            }
            admitted.push(*k);
        }
        let keys = &admitted[..];
        if let Some(e) = st
            .write_back
            .refusal(&self.names, new.len() as u64 * per_block)
        {
            st.stats.stores_refused_for_write_back += 1;
            return Err(e);
        }
        let prepared = self.primary.prepare_store(keys)?;
        st.write_back
            .reserve(prepared.to_store.iter().map(|(k, _)| *k), per_block);
        Ok(PendingStore::new(self, prepared, chain))
    }

    /// Ends a store begun by `prepare_store`, with the keys of its slots (their sinks are
    /// dropped; see [`PendingStore`]). Committed for a request, the blocks become `Hit` in
    /// DRAM and one store job per secondary tier copies them down; aborted (`None`), the slots
    /// are freed and nothing cascades.
    ///
    /// A tier that asked for the request's blocks at request level
    /// ([`OffloadPolicy::RequestLevel`](crate::OffloadPolicy::RequestLevel) from [`SecondaryTier::on_new_request`]) also gets the
    /// store's keys that were already in DRAM (`present`), as vLLM sends prefix hits to such
    /// tiers.
    fn finish_store(
        &self,
        keys: &[BlockKey],
        present: &[BlockKey],
        commit: Option<(RequestId, Option<crate::request::ChainLink>, &[BlockKey])>,
    ) -> StoreReceipt {
        let mut receipt = StoreReceipt::default();
        let mut st = self.begin();
        // a store's slots are its own: a slot a promotion reserved is never handed to one
        debug_assert!(!keys.iter().any(|k| st.promoting.contains_key(k)));
        st.write_back
            .unreserve(keys, self.primary.block_size() as u64);
        let stored = self.primary.complete_store(keys, commit.is_some());
        let Some((req, first, chain)) = commit else {
            return receipt;
        };
        let request_level = st.request_level.get(&req).cloned().unwrap_or_default();
        let present: &[BlockKey] = if request_level.is_empty() {
            &[]
        } else {
            present
        };
        let links = if self.wants_chains(&st) && !(stored.is_empty() && present.is_empty()) {
            st.chains.links(req, first, chain)
        } else {
            Vec::new()
        };
        if self.primary_chains() && !stored.is_empty() {
            self.primary.link(&links_of(&links, &stored));
        }
        if (stored.is_empty() && present.is_empty()) || self.tiers.is_empty() || st.shut_down {
            return receipt;
        }
        let sources = self.primary.sources(&stored);
        let present_sources = self.primary.sources(present);
        st.stats.cascades += 1;
        for i in 0..self.tiers.len() {
            let mut blocks: Vec<_> = stored
                .iter()
                .zip(&sources)
                .filter_map(|(k, s)| s.clone().map(|s| (*k, s)))
                .collect();
            if request_level.contains(&i) {
                blocks.extend(
                    present
                        .iter()
                        .zip(&present_sources)
                        .filter_map(|(k, s)| s.clone().map(|s| (*k, s))),
                );
            }
            if blocks.is_empty() {
                continue;
            }
            // the tier's admission rule and write budget, then its write-back bound (its
            // policy decides past it)
            let adm = st
                .admission
                .for_tier(i, blocks, self.primary.block_size() as u64);
            st.stats.tiers[i].not_admitted += adm.not_admitted.len() as u64;
            st.stats.tiers[i].over_write_budget += adm.over_budget.len() as u64;
            receipt.note(&self.names[i], &adm.not_admitted, NotWritten::NotAdmitted);
            receipt.note(
                &self.names[i],
                &adm.over_budget,
                NotWritten::OverWriteBudget,
            );
            let a = st.write_back.admit(i, adm.blocks);
            // what the write-back did not take was not written: its budget is not spent
            st.admission.refund(
                i,
                a.dropped.len() as u64 + a.duplicates,
                self.primary.block_size() as u64,
            );
            st.stats.tiers[i].writes_dropped += a.dropped.len() as u64;
            receipt.note(&self.names[i], &a.dropped, NotWritten::WriteBackFull);
            st.stats.tiers[i].writes_deduplicated += a.duplicates;
            if a.blocks.is_empty() {
                continue;
            }
            let job_links = if st.write_back.settings(i).chain_eviction {
                links_of(&links, a.blocks.iter().map(|(k, _)| k))
            } else {
                Vec::new()
            };
            self.submit(
                &mut st,
                i,
                Some(req),
                Job::Store(StoreJob {
                    requests: vec![req],
                    links: job_links,
                    blocks: a.blocks,
                }),
            );
        }
        receipt
    }

    /// Whether DRAM (`eviction_policy` `"chain"`) or a tier (`chain_eviction`) takes its
    /// blocks' chain links: only then are the requests' chains learned.
    fn wants_chains(&self, st: &State) -> bool {
        self.primary_chains()
            || (0..self.tiers.len()).any(|i| st.write_back.settings(i).chain_eviction)
    }

    /// Whether DRAM takes its blocks' chain links (`eviction_policy` `"chain"`).
    pub(super) fn primary_chains(&self) -> bool {
        self.config.eviction_policy == crate::config::EvictionPolicy::Chain
    }

    /// Ends the scheduling step: applies what has completed, then sends the queued promotions
    /// (one load job per tier and request) and the queued existence probes.
    pub fn on_schedule_end(&self) {
        let mut st = lock(&self.state);
        // Apply what completed during the step, then send the new work (whose results the
        // next step applies, all together): `flush` does both.
        self.flush(&mut st);
        st.holds.end_step();
        st.in_step = false;
        st.steps.tick(Instant::now());
    }
    /// Refreshes recency of `keys` in DRAM (the first key ends most recent) and in every
    /// secondary tier. Never blocks.
    pub fn touch(&self, keys: &[BlockKey]) {
        let _st = self.begin();
        self.primary.touch(keys);
        for t in &self.tiers {
            touch_caught(&**t, keys);
        }
    }

    /// Events since the last call: the primary's first, then each secondary tier's in order.
    /// A tier's events are reported only if its entry says `enable_kv_events: true` (vLLM's
    /// key; off by default), with the `locality` its entry gives. Buffers hold at most
    /// `event_buffer_keys` keys each until taken; past that the oldest are dropped and
    /// counted in [`ManagerStats::events_dropped`].
    pub fn take_events(&self) -> Vec<TierEvent> {
        let _st = self.begin();
        let mut out = self.primary.take_events();
        for (t, &(on, locality)) in self.tiers.iter().zip(&self.events) {
            let evs = take_events_caught(&**t);
            if on {
                out.extend(evs.into_iter().map(|mut e| {
                    if let Some(l) = locality {
                        e.locality = l;
                    }
                    e
                }));
            }
        }
        out
    }

    /// Writes [`TieringManager::stats`] (with every tier's own) to the installed `metrics`
    /// recorder, as counters and gauges named `kv_tier_...` (see [`crate::metrics`]); a
    /// no-op without a recorder. Call it before each scrape, or every few seconds. Counters
    /// grow by what this manager counted since its last call: they are the process's, summed
    /// over every manager it had (one replaced by another does not hide the new one's counts).
    pub fn publish_metrics(&self) {
        self.metrics.publish(&self.stats(), self.block_size());
    }

    /// A snapshot of the counters.
    pub fn stats(&self) -> ManagerStats {
        let st = lock(&self.state);
        let mut s = st.stats.clone();
        s.primary = self.primary.stats();
        (s.write_back_pinned_bytes, s.write_back_pinned_peak_bytes) = st.write_back.pinned();
        for (i, (t, l)) in s.tiers.iter_mut().zip(&st.lookups).enumerate() {
            (t.write_back_bytes, t.write_back_peak_bytes) = st.write_back.queued(i);
            t.probe_latency = l.latency().clone();
            t.probes = l.stats();
            t.tracked_keys = l.tracked_keys();
            t.tracked_requests = l.tracked_requests();
            t.leased_keys = l.leased_keys();
        }
        s.held_blocks = st.holds.held_blocks();
        s.holding_requests = st.holds.requests();
        drop(st);
        // the tiers' own, off the manager's lock (a tier's may take locks of its own)
        s.events_dropped = self.primary.events_dropped();
        for (t, tier) in s.tiers.iter_mut().zip(&self.tiers) {
            t.own = stats_caught(&**tier);
            t.events_dropped = tier.events_dropped();
            s.events_dropped += t.events_dropped;
        }
        s
    }
}

/// What the load-or-recompute policy declines of a request's lookup: `keys[keep..asked]`; a
/// promotion from tier `measure` (not measured yet) among them is still sent, for no request.
#[derive(Debug)]
struct Declined {
    keep: usize,
    asked: usize,
    measure: Option<usize>,
    /// Per position asked, the tier its promotion reads from.
    from: Vec<Option<usize>>,
    /// The keys the request queued promotions of this step.
    queued: FxHashSet<BlockKey>,
}

/// Counts a `Miss` of `cause` for `req` and returns it.
fn miss(st: &mut State, req: RequestId, cause: MissCause) -> LookupResult {
    st.stats.misses += 1;
    st.stats.misses_by_cause.record(&cause);
    st.last_miss.insert(req, cause);
    LookupResult::Miss
}

/// The links of `keys` among `links`.
fn links_of<'a>(
    links: &[(BlockKey, crate::tier::ChainLink)],
    keys: impl IntoIterator<Item = &'a BlockKey>,
) -> Vec<(BlockKey, crate::tier::ChainLink)> {
    if links.is_empty() {
        return Vec::new();
    }
    let keys: FxHashSet<&BlockKey> = keys.into_iter().collect();
    links
        .iter()
        .filter(|(k, _)| keys.contains(k))
        .copied()
        .collect()
}
