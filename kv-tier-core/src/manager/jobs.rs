//! Jobs: submitting store and load jobs with their deadlines, applying what completed (in
//! submission order), sending queued promotions and probes, cancelling promotions, and
//! cutting load jobs that fell behind their estimate.

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use futures::FutureExt;
use futures::future::Either;
use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::{Notify, oneshot};

use super::{State, TieringManager, lock};
use crate::buf::BlockSink;
use crate::error::Error;
use crate::key::BlockKey;
use crate::request::RequestId;
use crate::tier::{JobResult, LoadJob, LoadProgress, ProtectGuard, StoreJob, protect_caught};

pub(super) enum Job {
    Store(StoreJob),
    Load(LoadJob),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum JobKind {
    Store,
    Load,
}

pub(super) struct JobInfo {
    kind: JobKind,
    tier: usize,
    /// The request the job is for (`None`: the manager's own, a promotion that measures a
    /// tier).
    req: Option<RequestId>,
    keys: Vec<BlockKey>,
    bytes: u64,
    /// A load job's: bytes of the tier's load jobs in flight (and promotions queued) when it
    /// was submitted.
    ahead: u64,
    started: Instant,
    /// A load job's, under the load-or-recompute policy: what the tier's estimate gave it
    /// when it was sent, where it reports its blocks as they land, and how to cut it (taken
    /// when sent).
    cut: Option<Cut>,
    _protect: ProtectGuard,
}

/// What cutting a load job needs.
struct Cut {
    expected: Duration,
    progress: LoadProgress,
    send: Option<oneshot::Sender<()>>,
}

impl JobInfo {
    /// Bytes of a load job of tier `tier`; 0 for any other job.
    pub(super) fn load_bytes_of(&self, tier: usize) -> u64 {
        if self.kind == JobKind::Load && self.tier == tier {
            self.bytes
        } else {
            0
        }
    }
}

/// A tier's load jobs in flight, for its `load_busy`: how many, since when it has had one,
/// and when the last of them applied so far ended.
#[derive(Debug, Clone, Copy)]
pub(super) struct Loading {
    pub(super) jobs: usize,
    since: Instant,
    last_end: Instant,
}

impl Default for Loading {
    fn default() -> Self {
        let now = Instant::now();
        Self {
            jobs: 0,
            since: now,
            last_end: now,
        }
    }
}

pub(super) struct Completion {
    pub(super) job: u64,
    /// When the job's task ended (its result is applied later, at a drain).
    ended: Instant,
    result: JobResult,
    /// The job passed its deadline (`Timeout`) or panicked (`Panicked`): every key failed.
    abandoned: Option<Error>,
    /// The job was cut: the keys that had not landed failed.
    cut: bool,
}

/// Hands a job's result to the manager exactly once, even if the job's task is dropped (its
/// runtime shut down): then every key fails with [`Error::Shutdown`].
struct JobReport {
    job: u64,
    keys: Option<Vec<BlockKey>>,
    tier: String,
    inbox: Arc<Mutex<Vec<Completion>>>,
    notify: Arc<Notify>,
}

impl JobReport {
    fn send(&mut self, result: JobResult, abandoned: Option<Error>) {
        self.complete(result, abandoned, false);
    }

    /// A cut job: the keys of `landed` are loaded, every other one fails.
    fn send_cut(&mut self, landed: &[BlockKey], after: Duration) {
        let err = Error::Timeout {
            op: format!(
                "load job on tier `{}`, cut behind its estimate (recomputing was faster)",
                self.tier
            ),
            after,
        };
        let result = JobResult::landed_or(self.keys.clone().unwrap_or_default(), landed, &err);
        self.complete(result, None, true);
    }

    fn complete(&mut self, result: JobResult, abandoned: Option<Error>, cut: bool) {
        if self.keys.take().is_some() {
            lock(&self.inbox).push(Completion {
                job: self.job,
                ended: Instant::now(),
                result,
                abandoned,
                cut,
            });
            self.notify.notify_waiters();
        }
    }
}

impl Drop for JobReport {
    fn drop(&mut self) {
        if let Some(keys) = self.keys.clone() {
            let err = Error::Shutdown {
                what: format!("the runtime of tier `{}`'s job", self.tier),
            };
            self.send(JobResult::all_failed(keys, &err), Some(err));
        }
    }
}

impl TieringManager {
    /// Queues one job on the runtime: the tier protects its keys until the job is applied.
    pub(super) fn submit(&self, st: &mut State, tier: usize, req: Option<RequestId>, job: Job) {
        let (kind, keys, bytes, progress) = match &job {
            Job::Store(j) => (
                JobKind::Store,
                j.keys(),
                j.blocks.iter().map(|(_, s)| s.len() as u64).sum(),
                None,
            ),
            Job::Load(j) => (
                JobKind::Load,
                j.keys(),
                j.blocks.iter().map(|(_, s)| s.len() as u64).sum(),
                Some(j.progress.clone()),
            ),
        };
        let ahead = if kind == JobKind::Load {
            self.bytes_ahead(st, tier)
        } else {
            0
        };
        // a load job the policy may cut: one the tier's estimate gave a time
        let estimate = self
            .recompute
            .as_ref()
            .and_then(|_| st.load_models[tier].estimate(ahead));
        let (cut, cut_rx) = match (progress, estimate) {
            (Some(progress), Some(e)) => {
                let (send, rx) = oneshot::channel();
                let expected = e.ready_in(bytes);
                let send = Some(send);
                let cut = Cut {
                    expected,
                    progress,
                    send,
                };
                (Some(cut), Some(rx))
            }
            _ => (None, None),
        };
        let landed = cut.as_ref().map(|c| c.progress.clone());
        let t = self.tiers[tier].clone();
        // first, so a panic of the tier cannot leave half-made bookkeeping behind
        let protect = protect_caught(&*t, &keys);
        if kind == JobKind::Store {
            if let Some(req) = req {
                *st.pending_stores.entry(req).or_default() += 1;
            }
        } else {
            let l = &mut st.loading[tier];
            if l.jobs == 0 {
                (l.since, l.last_end) = (Instant::now(), Instant::now());
            }
            l.jobs += 1;
        }
        let id = st.next_job;
        st.next_job += 1;
        let deadline = self.config.job_timeout(keys.len());
        let n_keys = keys.len();
        let mut report = JobReport {
            job: id,
            keys: Some(keys.clone()),
            tier: self.names[tier].clone(),
            inbox: self.inbox.clone(),
            notify: self.notify.clone(),
        };
        st.jobs.insert(
            id,
            JobInfo {
                kind,
                tier,
                req,
                _protect: protect,
                keys,
                bytes,
                ahead,
                started: Instant::now(),
                cut,
            },
        );
        let op = match kind {
            JobKind::Store => "store job",
            JobKind::Load => "load job",
        };
        // the job's span: the tier's own events (per block failures, retries) nest in it
        let span = tracing::debug_span!(
            "kv_tier_job",
            job = id,
            tier = %self.names[tier],
            direction = if kind == JobKind::Store { "store" } else { "load" },
            blocks = n_keys,
            bytes,
        );
        self.runtime.spawn(tracing::Instrument::instrument(
            async move {
                let started = Instant::now();
                let run = AssertUnwindSafe(async {
                    match job {
                        Job::Store(j) => t.store(j).await,
                        Job::Load(j) => t.load(j).await,
                    }
                })
                .catch_unwind();
                // At the deadline, or when the manager cuts the job, the job's future is
                // dropped (tiers are cancellation-safe) and its buffers with it: the DRAM
                // slots are released, whatever the tier was doing.
                let timed = Box::pin(tokio::time::timeout(deadline, run));
                let cut = Box::pin(async move {
                    if let Some(rx) = cut_rx
                        && rx.await.is_ok()
                    {
                        return;
                    }
                    // not cut: the job was applied, or cannot be cut
                    std::future::pending::<()>().await
                });
                let finished = match futures::future::select(timed, cut).await {
                    Either::Left((finished, _)) => finished,
                    Either::Right(((), timed)) => {
                        // dropped before the landed blocks are read; a block reported after
                        // (a tier's own thread may still hold a sink, pinning its slot until
                        // it drops) is not served
                        drop(timed);
                        let landed = landed.map(|p| p.keys()).unwrap_or_default();
                        return report.send_cut(&landed, started.elapsed());
                    }
                };
                let abandoned = match finished {
                    Ok(Ok(result)) => return report.send(result, None),
                    Ok(Err(_)) => Error::Panicked {
                        tier: report.tier.clone(),
                        op: op.into(),
                    },
                    Err(_) => Error::Timeout {
                        op: format!("{op} on tier `{}`", report.tier),
                        after: deadline,
                    },
                };
                let keys = report.keys.clone().unwrap_or_default();
                report.send(JobResult::all_failed(keys, &abandoned), Some(abandoned));
            },
            span,
        ));
    }

    /// Cuts the load jobs that fell behind their estimate (see `promotion_cut_margin`): one
    /// running longer than the margin times its estimate, at a pace at which the blocks it has
    /// not landed would take longer than recomputing them (with none landed, the pace says
    /// they take at least as long again as it ran). The cut job ends with the blocks that
    /// landed; its result is applied as any other.
    pub(super) fn cut_behind(&self, st: &mut State) {
        let Some(recompute) = &self.recompute else {
            return;
        };
        let margin = self.config.promotion_cut_margin;
        let now = Instant::now();
        for info in st.jobs.values_mut() {
            let Some(c) = &mut info.cut else { continue };
            let ran = now.saturating_duration_since(info.started);
            if c.send.is_none() || ran < c.expected.mul_f64(margin) {
                continue;
            }
            let landed = c.progress.len().min(info.keys.len());
            let rest = info.keys.len() - landed;
            // the rest at the pace so far (none landed: at least as long again as it ran)
            let remaining = if landed == 0 {
                ran
            } else {
                ran.mul_f64(rest as f64 / landed as f64)
            };
            if rest > 0
                && remaining > recompute.of(rest)
                && let Some(send) = c.send.take()
            {
                let _ = send.send(());
            }
        }
    }

    /// Cuts the load jobs that fell behind (see [`TieringManager::cut_behind`]), then applies
    /// finished jobs and probe answers.
    pub(super) fn drain(&self, st: &mut State) {
        self.cut_behind(st);
        let mut done = std::mem::take(&mut *lock(&self.inbox));
        // In submission order, whatever order they finished in: what a step applies does not
        // depend on thread timing.
        done.sort_by_key(|c| c.job);
        for Completion {
            job,
            ended,
            result,
            abandoned,
            cut,
        } in done
        {
            let Some(info) = st.jobs.remove(&job) else {
                continue;
            };
            match &abandoned {
                Some(Error::Timeout { .. }) => st.stats.tiers[info.tier].jobs_timed_out += 1,
                Some(Error::Panicked { .. }) => st.stats.tiers[info.tier].jobs_panicked += 1,
                _ => {}
            }
            if let Some(e) = &abandoned
                && let Some(jobs) = self.log_abandoned.note()
            {
                tracing::warn!(tier = %self.names[info.tier], jobs, kind = ?info.kind, blocks = info.keys.len(), error = %e, "job abandoned (jobs abandoned since the last such line; counted in the tier's jobs_timed_out, jobs_panicked and failures)");
            }
            let errors: FxHashMap<BlockKey, &Error> =
                result.failed.iter().map(|(k, e)| (*k, e)).collect();
            // the job's own time: from its submission to its end, not to this drain (a step
            // later, perhaps), or a tier would be measured at the engine's step
            let elapsed = ended.saturating_duration_since(info.started);
            let ok: FxHashSet<BlockKey> = result.ok.iter().copied().collect();
            // Keys a tier forgot to report count as failed.
            let failed: Vec<BlockKey> = info
                .keys
                .iter()
                .filter(|k| !ok.contains(k))
                .copied()
                .collect();
            let ok_keys: Vec<BlockKey> = info
                .keys
                .iter()
                .filter(|k| ok.contains(k))
                .copied()
                .collect();
            let per_block = if info.keys.is_empty() {
                0
            } else {
                info.bytes / info.keys.len() as u64
            };
            if let Some((k, e)) = result.failed.first()
                && let Some(jobs) = self.log_failed.note()
            {
                tracing::warn!(tier = %self.names[info.tier], jobs, blocks = result.failed.len(), key = %k, error = %e, kind = ?info.kind, "block transfer failed (jobs with failed blocks since the last such line; the first failed block of this one; every block counted in the tier's store or load failures)");
            }
            match info.kind {
                JobKind::Store => {
                    st.write_back.release(info.tier, &info.keys, per_block);
                    let ts = &mut st.stats.tiers[info.tier];
                    ts.store_jobs += 1;
                    ts.blocks_stored += ok_keys.len() as u64;
                    ts.bytes_stored += per_block * ok_keys.len() as u64;
                    ts.store_failures += failed.len() as u64;
                    for k in &failed {
                        ts.store_failure_causes.record(errors.get(k).copied());
                    }
                    ts.store_latency.record(elapsed);
                    crate::metrics::record_job(&self.names[info.tier], "store", elapsed);
                    st.lookups[info.tier].mark_stored(&ok_keys);
                    if let Some(req) = info.req {
                        let left = st.pending_stores.get_mut(&req).map(|n| {
                            *n -= 1;
                            *n
                        });
                        if left == Some(0) {
                            st.pending_stores.remove(&req);
                            if st.finishing.remove(&req) {
                                self.request_done(st, req);
                            }
                        }
                    }
                }
                JobKind::Load => {
                    let now = Instant::now();
                    // what the tier's loads take now: a job that moved blocks, or ran into its
                    // deadline or was cut (a slow tier is slow); not one that only failed fast
                    if !ok_keys.is_empty()
                        || cut
                        || matches!(abandoned, Some(Error::Timeout { .. }))
                    {
                        // a cut job is taken at its pace: the time all its blocks would
                        // have taken (none landed: at least twice what it ran, as the cut
                        // judged it)
                        let took = match (cut, ok_keys.len()) {
                            (false, _) => elapsed,
                            (true, 0) => elapsed * 2,
                            (true, n) => elapsed.mul_f64(info.keys.len() as f64 / n as f64),
                        };
                        st.load_models[info.tier].record(info.ahead, info.bytes, took);
                    }
                    let l = &mut st.loading[info.tier];
                    l.jobs -= 1;
                    l.last_end = l.last_end.max(ended);
                    if l.jobs == 0 {
                        st.stats.tiers[info.tier].load_busy +=
                            l.last_end.saturating_duration_since(l.since);
                    }
                    let mut links = Vec::new();
                    for k in &info.keys {
                        if let Some((since, _, link)) = st.promoting.remove(k)
                            && ok.contains(k)
                        {
                            crate::metrics::record_promotion_wait(
                                &self.names[info.tier],
                                now.saturating_duration_since(since),
                            );
                            links.extend(link.map(|l| (*k, l)));
                        }
                    }
                    let ts = &mut st.stats.tiers[info.tier];
                    ts.load_jobs += 1;
                    ts.blocks_loaded += ok_keys.len() as u64;
                    ts.bytes_loaded += per_block * ok_keys.len() as u64;
                    if cut {
                        ts.load_jobs_cut += 1;
                        ts.promotions_cut += failed.len() as u64;
                    } else {
                        ts.load_failures += failed.len() as u64;
                        for k in &failed {
                            ts.load_failure_causes.record(errors.get(k).copied());
                        }
                    }
                    ts.load_latency.record(elapsed);
                    crate::metrics::record_job(&self.names[info.tier], "load", elapsed);
                    let landed = self.primary.complete_store(&ok_keys, true);
                    if !links.is_empty() {
                        // (the links of what did not land are ignored: those slots are free)
                        self.primary.link(&links);
                    }
                    // held for the requests promised them (readable views pin them)
                    for (k, pin) in landed.iter().zip(self.primary.sources(&landed)) {
                        st.holds.landed(*k, pin);
                    }
                    for k in &info.keys {
                        st.holds.failed(*k);
                    }
                    // the promotion ended: its keys' leases in the tier end with it, and so
                    // do the leases other tiers (probed at the same time) took on the keys
                    // it promoted, which no promotion will read now
                    st.lookups[info.tier].release(&info.keys);
                    for (i, l) in st.lookups.iter_mut().enumerate() {
                        if i != info.tier {
                            l.release(&ok_keys);
                        }
                    }
                    if !failed.is_empty() {
                        self.primary.complete_store(&failed, false);
                        if cut {
                            // the tier has them: a miss for this request only, as declined
                            // (by every tier: another one does not serve them instead),
                            // while the request lives (its tier tracks it until it ends)
                            if let Some(req) = info.req
                                && st.lookups[info.tier].tracks(req)
                            {
                                for l in &mut st.lookups {
                                    l.mark_declined(&failed, req);
                                }
                            }
                        } else {
                            match info.req {
                                Some(req) => st.lookups[info.tier].mark_miss(&failed, req),
                                None => st.lookups[info.tier].mark_load_failed(&failed),
                            }
                        }
                    }
                }
            }
        }
        for l in &mut st.lookups {
            l.apply_results();
        }
    }
    /// Sends the queued promotions and probes, after applying what has ended: a job sent
    /// follows every job that ended before it (its `ahead` and the tier's busy time count
    /// only jobs still running).
    pub(super) fn flush(&self, st: &mut State) {
        self.drain(st);
        for ((tier, req), blocks) in std::mem::take(&mut st.promotions) {
            self.submit(
                st,
                tier,
                req,
                Job::Load(LoadJob {
                    requests: req.into_iter().collect(),
                    blocks,
                    progress: LoadProgress::default(),
                }),
            );
        }
        for l in &mut st.lookups {
            l.flush();
        }
    }
    pub(super) fn cancel_promotions(&self) {
        let mut st = lock(&self.state);
        for ((tier, _), blocks) in std::mem::take(&mut st.promotions) {
            self.cancel(&mut st, tier, blocks);
        }
    }

    /// Drops a queued promotion: its DRAM slots are freed and its keys' leases end.
    pub(super) fn cancel(&self, st: &mut State, tier: usize, blocks: Vec<(BlockKey, BlockSink)>) {
        let keys: Vec<BlockKey> = blocks.iter().map(|(k, _)| *k).collect();
        drop(blocks);
        for k in &keys {
            st.promoting.remove(k);
            st.holds.failed(*k);
        }
        self.primary.complete_store(&keys, false);
        st.lookups[tier].release(&keys);
    }
}
