//! Load-or-recompute: per tier, a live estimate of how long loading blocks into DRAM takes
//! now ([`LoadEstimate`]), fitted to the tier's recent load jobs; and the policy that, given
//! the engine's recompute time ([`RecomputeTime`]), declines the part of a prefix whose load
//! would end later than recomputing it.
//!
//! The model: a load job of `bytes`, submitted while `ahead` bytes of the tier's other load
//! jobs are in flight or queued, takes `latency + (ahead + bytes) / bytes_per_s`. Both
//! parameters are a least-squares fit over the tier's last [`WINDOW`] load jobs (their
//! measured time against their `ahead + bytes`), so the estimate follows the tier as it
//! speeds up or slows down, and what is queued ahead of a new job counts as it did for the
//! jobs measured.
//!
//! A request that waits for a load resumes only at a scheduling step: its wait is a whole
//! number of steps, at least one. The manager measures the engine's steps ([`StepClock`]: the
//! median of the last [`STEPS`] intervals between `on_schedule_end` calls) and weighs a wait
//! at the steps it spans.

use std::collections::VecDeque;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// Load jobs a tier's estimate is fitted to (the most recent).
pub(super) const WINDOW: usize = 32;

/// How long loading blocks from one tier into DRAM would take now
/// ([`crate::TieringManager::load_estimate`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoadEstimate {
    /// A job's fixed cost: its time with no bytes to move (requests, opens, scheduling).
    pub latency: Duration,
    /// The tier's throughput for the bytes of its load jobs, those ahead included (infinite
    /// when the jobs measured took as long whatever their bytes: all fixed cost).
    pub bytes_per_s: f64,
    /// Bytes of the tier's load jobs in flight or queued now, which a new job waits behind.
    pub bytes_ahead: u64,
    /// Load jobs the estimate is fitted to (the last 32 at most).
    pub jobs: usize,
}

impl LoadEstimate {
    /// How long from now a new load job of `bytes` would take to end.
    ///
    /// ```
    /// use std::time::Duration;
    /// use kv_tier_core::LoadEstimate;
    /// let e = LoadEstimate {
    ///     latency: Duration::from_millis(10),
    ///     bytes_per_s: 1e9,
    ///     bytes_ahead: 500_000_000,
    ///     jobs: 8,
    /// };
    /// // 10 ms, then the 0.5 GB ahead and its own 0.5 GB at 1 GB/s
    /// assert_eq!(e.ready_in(500_000_000), Duration::from_millis(1010));
    /// ```
    pub fn ready_in(&self, bytes: u64) -> Duration {
        let secs = (self.bytes_ahead as f64 + bytes as f64) / self.bytes_per_s;
        self.latency + Duration::try_from_secs_f64(secs.min(1e9)).unwrap_or(Duration::MAX)
    }
}

/// The engine's time to recompute (prefill) a number of blocks: given to the manager's
/// builder ([`crate::TieringManagerBuilder::recompute_time`]) for engines whose rate depends
/// on the batch, or made from the config's `prefill_tokens_per_s`.
#[derive(Clone)]
pub struct RecomputeTime(Arc<dyn Fn(usize) -> Duration + Send + Sync>);

impl RecomputeTime {
    /// The time `f(blocks)` to recompute `blocks` blocks.
    pub fn new(f: impl Fn(usize) -> Duration + Send + Sync + 'static) -> Self {
        Self(Arc::new(f))
    }

    /// At `tokens_per_s` of prefill, `tokens_per_block` tokens a block.
    pub fn at_rate(tokens_per_s: f64, tokens_per_block: u64) -> Self {
        Self::new(move |blocks| {
            let secs = blocks as f64 * tokens_per_block as f64 / tokens_per_s;
            Duration::try_from_secs_f64(secs.min(1e9)).unwrap_or(Duration::MAX)
        })
    }

    /// The time to recompute `blocks` blocks.
    pub fn of(&self, blocks: usize) -> Duration {
        (self.0)(blocks)
    }
}

impl fmt::Debug for RecomputeTime {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RecomputeTime").field(&self.of(1)).finish()
    }
}

/// Scheduling steps the step interval is the median of (the most recent).
pub(super) const STEPS: usize = 15;

/// The engine's scheduling steps: the instants `on_schedule_end` was called at, the last
/// [`STEPS`] + 1 of them.
#[derive(Debug, Default)]
pub(super) struct StepClock {
    ends: VecDeque<tokio::time::Instant>,
}

impl StepClock {
    /// A step ended at `now`.
    pub(super) fn tick(&mut self, now: tokio::time::Instant) {
        if self.ends.len() == STEPS + 1 {
            self.ends.pop_front();
        }
        self.ends.push_back(now);
    }

    /// The median interval between the steps measured; `None` before two steps ended. Zero
    /// when the median step took no measurable time (a wait is then taken as it is).
    pub(super) fn interval(&self) -> Option<Duration> {
        let mut gaps: Vec<Duration> = self
            .ends
            .iter()
            .zip(self.ends.iter().skip(1))
            .map(|(a, b)| b.saturating_duration_since(*a))
            .collect();
        if gaps.is_empty() {
            return None;
        }
        gaps.sort_unstable();
        Some(gaps[gaps.len() / 2])
    }
}

/// What waiting `wait` costs a request at steps of `step`: the whole steps it spans (at least
/// one), or `wait` itself when the steps are not known or take no time.
pub(super) fn whole_steps(wait: Duration, step: Option<Duration>) -> Duration {
    let Some(step) = step.filter(|s| !s.is_zero()) else {
        return wait;
    };
    let n = (wait.as_secs_f64() / step.as_secs_f64()).ceil().max(1.0);
    // never less than the wait itself (the product may round, or saturate)
    Duration::try_from_secs_f64((n * step.as_secs_f64()).min(1e9))
        .unwrap_or(Duration::MAX)
        .max(wait)
}

/// One tier's recent load jobs: `(ahead + bytes, seconds)` each.
#[derive(Debug, Default)]
pub(super) struct LoadModel {
    jobs: VecDeque<(f64, f64)>,
}

impl LoadModel {
    /// A load job of `bytes` with `ahead` bytes before it took `took`.
    pub(super) fn record(&mut self, ahead: u64, bytes: u64, took: Duration) {
        if bytes == 0 {
            return;
        }
        if self.jobs.len() == WINDOW {
            self.jobs.pop_front();
        }
        self.jobs
            .push_back(((ahead + bytes) as f64, took.as_secs_f64()));
    }

    /// The estimate with `ahead` bytes in flight or queued now; `None` before a job was
    /// measured.
    pub(super) fn estimate(&self, ahead: u64) -> Option<LoadEstimate> {
        let n = self.jobs.len();
        if n == 0 {
            return None;
        }
        let nf = n as f64;
        let mx = self.jobs.iter().map(|j| j.0).sum::<f64>() / nf;
        let my = self.jobs.iter().map(|j| j.1).sum::<f64>() / nf;
        let sxx: f64 = self.jobs.iter().map(|j| (j.0 - mx).powi(2)).sum();
        let sxy: f64 = self.jobs.iter().map(|j| (j.0 - mx) * (j.1 - my)).sum();
        // the fit, where the jobs' sizes differ enough to tell a fixed cost from a rate and
        // it makes sense (a positive time per byte, no negative fixed cost); else all rate
        let slope = sxy / sxx;
        let (latency, per_byte) = if sxx > 0.0 && slope >= 0.0 && my - slope * mx >= 0.0 {
            (my - slope * mx, slope)
        } else {
            (0.0, my / mx)
        };
        // a tier whose jobs' time does not grow with their bytes has no limit to its rate
        let bytes_per_s = if per_byte > 0.0 {
            1.0 / per_byte
        } else {
            f64::INFINITY
        };
        Some(LoadEstimate {
            latency: Duration::try_from_secs_f64(latency.min(1e9)).unwrap_or(Duration::MAX),
            bytes_per_s,
            bytes_ahead: ahead,
            jobs: n,
        })
    }
}

/// Of a prefix whose blocks `0..n` cost `load(k)` to have (the wait for the first `k`: zero
/// for blocks in DRAM, the estimate of the slowest tier for the rest) and `recompute(k)` to
/// recompute (`k` counting only the blocks not in DRAM), the length to serve: the `k` with the
/// most time saved, `recompute(k) - load(k)`, none when nothing saves time. Ties go to the
/// longer prefix (more tokens not recomputed).
pub(super) fn paying_prefix(n: usize, mut saved: impl FnMut(usize) -> f64) -> usize {
    let (mut best, mut best_saved) = (0, 0.0);
    for k in 1..=n {
        let s = saved(k);
        if s >= best_saved {
            (best, best_saved) = (k, s);
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_separates_a_fixed_cost_from_a_rate() {
        let mut m = LoadModel::default();
        // 5 ms + 1 GB/s
        for mb in [1u64, 4, 16, 2, 8] {
            let bytes = mb << 20;
            m.record(
                0,
                bytes,
                Duration::from_secs_f64(0.005 + bytes as f64 / 1e9),
            );
        }
        let e = m.estimate(0).unwrap();
        assert!((e.latency.as_secs_f64() - 0.005).abs() < 1e-6, "{e:?}");
        assert!((e.bytes_per_s - 1e9).abs() < 1e3, "{e:?}");
        assert_eq!(e.jobs, 5);
    }

    #[test]
    fn jobs_of_any_size_taking_one_time_are_a_fixed_cost() {
        let mut m = LoadModel::default();
        for bytes in [1000, 4000, 2000] {
            m.record(0, bytes, Duration::from_millis(50));
        }
        let e = m.estimate(0).unwrap();
        assert_eq!(e.latency, Duration::from_millis(50));
        assert!(e.bytes_per_s > 1e15, "{e:?}");
        assert_eq!(e.ready_in(1 << 30), Duration::from_millis(50));
    }

    #[test]
    fn jobs_of_one_size_give_a_rate_and_no_fixed_cost() {
        let mut m = LoadModel::default();
        m.record(0, 1000, Duration::from_millis(10));
        m.record(0, 1000, Duration::from_millis(30));
        let e = m.estimate(3000).unwrap();
        assert_eq!(e.latency, Duration::ZERO);
        assert!((e.bytes_per_s - 50_000.0).abs() < 1e-6, "{e:?}");
        // 4000 bytes at 50 kB/s
        assert_eq!(e.ready_in(1000), Duration::from_millis(80));
    }

    #[test]
    fn the_estimate_follows_the_last_window_of_jobs() {
        let mut m = LoadModel::default();
        for _ in 0..WINDOW {
            m.record(0, 1000, Duration::from_millis(1));
        }
        for _ in 0..WINDOW {
            m.record(0, 1000, Duration::from_millis(100));
        }
        let e = m.estimate(0).unwrap();
        assert_eq!(e.ready_in(1000), Duration::from_millis(100));
        assert_eq!(m.estimate(0).unwrap().jobs, WINDOW);
        assert!(LoadModel::default().estimate(0).is_none());
    }

    #[test]
    fn a_wait_costs_the_whole_steps_it_spans() {
        let ms = Duration::from_millis;
        let step = Some(ms(100));
        assert_eq!(whole_steps(ms(1), step), ms(100));
        assert_eq!(whole_steps(ms(100), step), ms(100));
        assert_eq!(whole_steps(ms(101), step), ms(200));
        assert_eq!(whole_steps(ms(101), None), ms(101));
        assert_eq!(whole_steps(Duration::MAX, step), Duration::MAX);
    }

    #[test]
    fn the_step_interval_is_the_median_of_the_last_steps() {
        let t0 = tokio::time::Instant::now();
        let mut c = StepClock::default();
        assert_eq!(c.interval(), None);
        c.tick(t0);
        assert_eq!(c.interval(), None);
        // one long step among short ones does not move the median
        let mut t = t0;
        for gap in [10, 10, 500, 10, 12] {
            t += Duration::from_millis(gap);
            c.tick(t);
        }
        assert_eq!(c.interval(), Some(Duration::from_millis(10)));
        // the last STEPS intervals only
        for _ in 0..STEPS {
            t += Duration::from_millis(40);
            c.tick(t);
        }
        assert_eq!(c.interval(), Some(Duration::from_millis(40)));
        // steps that take no time: a wait costs itself
        let mut c = StepClock::default();
        c.tick(t0);
        c.tick(t0);
        assert_eq!(c.interval(), Some(Duration::ZERO));
        assert_eq!(
            whole_steps(Duration::from_millis(3), c.interval()),
            Duration::from_millis(3)
        );
    }

    #[test]
    fn the_paying_prefix_is_the_one_that_saves_most() {
        // a fixed cost of 3 blocks' recompute, then each block loads at half its recompute
        let saved = |k: usize| k as f64 - (3.0 + 0.5 * k as f64);
        assert_eq!(paying_prefix(4, saved), 0);
        assert_eq!(paying_prefix(10, saved), 10);
        // blocks dearer to load than to recompute past the third
        let saved = |k: usize| {
            if k <= 3 {
                k as f64
            } else {
                3.0 - (k - 3) as f64
            }
        };
        assert_eq!(paying_prefix(8, saved), 3);
        assert_eq!(paying_prefix(0, saved), 0);
    }
}
