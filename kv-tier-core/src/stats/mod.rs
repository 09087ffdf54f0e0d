//! Statistics: hits per tier, bytes moved per tier and direction, job latencies.

use std::time::Duration;

mod snapshot;
mod throttle;
pub use snapshot::{Figure, FigureKind, Figures, TierSnapshot, figure_name};
pub use throttle::{LOG_INTERVAL, Throttle};

/// A latency histogram with about 9% resolution (16 log-linear buckets per power of two),
/// from 1 µs to about nine years. Fixed size, no allocation per sample. A quantile is the
/// mean of the samples in its bucket: a measured figure, not a bucket's edge.
#[derive(Clone, PartialEq, Eq)]
pub struct LatencyHistogram {
    counts: Vec<u64>,
    /// Per bucket, the sum of its samples in µs.
    sums_us: Vec<u64>,
    total: u64,
    sum_us: u128,
    max_us: u64,
}

const SUB: u32 = 16;
const BUCKETS: usize = (48 * SUB) as usize;

impl Default for LatencyHistogram {
    fn default() -> Self {
        Self {
            counts: vec![0; BUCKETS],
            sums_us: vec![0; BUCKETS],
            total: 0,
            sum_us: 0,
            max_us: 0,
        }
    }
}

impl std::fmt::Debug for LatencyHistogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LatencyHistogram")
            .field("count", &self.total)
            .field("p50", &self.quantile(0.5))
            .field("p99", &self.quantile(0.99))
            .field("max", &self.max())
            .finish()
    }
}

/// Serialised as its summary: `count`, then `mean`, `p50`, `p90`, `p99` and `max` in
/// seconds.
impl serde::Serialize for LatencyHistogram {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut st = s.serialize_struct("LatencyHistogram", 6)?;
        st.serialize_field("count", &self.total)?;
        st.serialize_field("mean_s", &self.mean().as_secs_f64())?;
        st.serialize_field("p50_s", &self.quantile(0.5).as_secs_f64())?;
        st.serialize_field("p90_s", &self.quantile(0.9).as_secs_f64())?;
        st.serialize_field("p99_s", &self.quantile(0.99).as_secs_f64())?;
        st.serialize_field("max_s", &self.max().as_secs_f64())?;
        st.end()
    }
}

fn bucket_of(us: u64) -> usize {
    let us = us.max(1);
    let exp = 63 - us.leading_zeros();
    let frac = if exp >= 4 {
        ((us >> (exp - 4)) & (SUB as u64 - 1)) as u32
    } else {
        ((us << (4 - exp)) & (SUB as u64 - 1)) as u32
    };
    ((exp * SUB + frac) as usize).min(BUCKETS - 1)
}

fn bucket_upper_us(b: usize) -> u64 {
    let exp = b as u32 / SUB;
    let frac = b as u64 % SUB as u64;
    // the bucket covers [2^exp * (1 + frac/16), 2^exp * (1 + (frac+1)/16))
    ((1u128 << exp) * (SUB as u128 + frac as u128 + 1) / SUB as u128) as u64
}

impl LatencyHistogram {
    /// Records one sample.
    pub fn record(&mut self, d: Duration) {
        let us = d.as_micros().min(u64::MAX as u128) as u64;
        let b = bucket_of(us);
        self.counts[b] += 1;
        self.sums_us[b] = self.sums_us[b].saturating_add(us);
        self.total += 1;
        self.sum_us += us as u128;
        self.max_us = self.max_us.max(us);
    }

    /// Number of samples.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The `q`-quantile (0..=1): the mean of the samples in the bucket that holds it (within
    /// the bucket's 9% of the exact sample); zero when empty.
    pub fn quantile(&self, q: f64) -> Duration {
        if self.total == 0 {
            return Duration::ZERO;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                let mean = self.sums_us[b] / c;
                return Duration::from_micros(mean.min(bucket_upper_us(b)).min(self.max_us));
            }
        }
        Duration::from_micros(self.max_us)
    }

    /// Mean of the samples.
    pub fn mean(&self) -> Duration {
        if self.total == 0 {
            return Duration::ZERO;
        }
        Duration::from_micros((self.sum_us / self.total as u128) as u64)
    }

    /// Largest sample.
    pub fn max(&self) -> Duration {
        Duration::from_micros(self.max_us)
    }

    /// Adds another histogram's samples.
    pub fn merge(&mut self, other: &LatencyHistogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        for (a, b) in self.sums_us.iter_mut().zip(&other.sums_us) {
            *a = a.saturating_add(*b);
        }
        self.total += other.total;
        self.sum_us += other.sum_us;
        self.max_us = self.max_us.max(other.max_us);
    }
}

/// Counters of one secondary tier, as seen by the manager.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct TierStats {
    /// The tier's name.
    pub name: String,
    /// Lookups answered `HitPending` because this tier had the block (promotions queued).
    pub hits: u64,
    /// Keys of lookups that waited for this tier's probe (answered `Retry` while it was
    /// out): where a slow tier stalls admission.
    pub retry_waits: u64,
    /// Event keys this tier dropped because its buffer was full (`event_buffer_keys`).
    pub events_dropped: u64,
    /// Blocks not written to this tier because lookups had not asked for them
    /// `admit_after_lookups` times.
    pub not_admitted: u64,
    /// Blocks not written to this tier because its `write_budget_mb_per_s` was spent.
    pub over_write_budget: u64,
    /// Store jobs finished.
    pub store_jobs: u64,
    /// Blocks stored (including already-present ones).
    pub blocks_stored: u64,
    /// Bytes written to the tier.
    pub bytes_stored: u64,
    /// Blocks whose store failed.
    pub store_failures: u64,
    /// Load (promotion) jobs finished.
    pub load_jobs: u64,
    /// Time with at least one load job of this tier in flight (from its submission until it
    /// ended, not until its result was applied): `bytes_loaded` over it is the rate the tier
    /// read at while it read, where the run's average also counts the time nothing asked for
    /// its blocks.
    pub load_busy: Duration,
    /// Blocks this tier had whose promotion the load-or-recompute policy declined (their load
    /// would have ended later than recomputing them); not in `hits`.
    pub promotions_declined: u64,
    /// Key lookups whose probe of this tier the load-or-recompute policy did not wait for
    /// (waiting a step for it could not pay, or the steps were not measured yet); not in
    /// `retry_waits`.
    pub probes_not_waited: u64,
    /// Load jobs cut mid-way by the load-or-recompute policy: running longer than
    /// `promotion_cut_margin` times their estimate, at a pace slower than recomputing what
    /// had not landed.
    pub load_jobs_cut: u64,
    /// Blocks of those jobs that had not landed when cut, recomputed instead; not in
    /// `load_failures` (the blocks that had landed are in `blocks_loaded` and served).
    pub promotions_cut: u64,
    /// Blocks loaded into DRAM.
    pub blocks_loaded: u64,
    /// Bytes read from the tier.
    pub bytes_loaded: u64,
    /// Blocks whose load failed.
    pub load_failures: u64,
    /// Why loads failed, per block (the parts sum to `load_failures`).
    pub load_failure_causes: FailureCauses,
    /// Why stores failed, per block (the parts sum to `store_failures`).
    pub store_failure_causes: FailureCauses,
    /// Jobs abandoned at their deadline (every key of them failed with `timed_out`).
    pub jobs_timed_out: u64,
    /// Jobs whose tier panicked (every key of them failed with `panicked`).
    pub jobs_panicked: u64,
    /// Queued promotions not sent because their request finished first.
    pub promotions_cancelled: u64,
    /// Bytes of store jobs queued or in flight to this tier now (its write-back).
    pub write_back_bytes: u64,
    /// The most write-back this tier has had.
    pub write_back_peak_bytes: u64,
    /// Blocks not written to this tier because its write-back (or the DRAM pinned by
    /// write-back) was at its limit and its policy is `drop`; they stay in the tiers above.
    pub writes_dropped: u64,
    /// Blocks not queued for this tier because a store of the same key already was.
    pub writes_deduplicated: u64,
    /// Latency of this tier's probe batches.
    pub probe_latency: LatencyHistogram,
    /// Store job latencies (from submission to the job's end).
    pub store_latency: LatencyHistogram,
    /// Load job latencies (from submission to the job's end, not to when the manager applied
    /// its result).
    pub load_latency: LatencyHistogram,
    /// Probe counters of the tier's probe cache.
    pub probes: ProbeCacheStats,
    /// Keys the tier's probe cache tracks (live requests' keys and probes in flight).
    pub tracked_keys: usize,
    /// Requests the tier's probe cache tracks (asked and not finished).
    pub tracked_requests: usize,
    /// Keys leased in the tier (found present, protected until promoted).
    pub leased_keys: usize,
    /// The tier's own statistics ([`SecondaryTier::stats`](crate::SecondaryTier::stats)).
    pub own: TierSnapshot,
}

/// Why blocks of jobs failed, by the kind of error their tier reported.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FailureCauses {
    /// The block was not in the tier (evicted or deleted since it was found).
    pub missing: u64,
    /// The block was damaged (short, wrong size, checksum mismatch); never returned.
    pub corrupt: u64,
    /// The job or a request of it passed its deadline.
    pub timed_out: u64,
    /// The tier panicked during the job.
    pub panicked: u64,
    /// The device or bucket was full.
    pub no_space: u64,
    /// The tier was shut down.
    pub shutdown: u64,
    /// I/O or backend errors, wrong buffer sizes, keys the tier did not report, and the rest.
    pub other: u64,
}

impl FailureCauses {
    /// Counts one failed block with `error` (`None`: the tier did not report the key).
    pub fn record(&mut self, error: Option<&crate::Error>) {
        use crate::Error as E;
        let slot = match error {
            Some(E::NotFound { .. }) => &mut self.missing,
            Some(E::Corrupt { .. }) => &mut self.corrupt,
            Some(E::Timeout { .. }) => &mut self.timed_out,
            Some(E::Panicked { .. }) => &mut self.panicked,
            Some(E::NoSpace { .. }) => &mut self.no_space,
            Some(E::Shutdown { .. }) => &mut self.shutdown,
            _ => &mut self.other,
        };
        *slot += 1;
    }

    /// The causes with a non-zero count, as `name count` pairs (`"missing 3, timed_out 1"`),
    /// or `"none"`.
    pub fn summary(&self) -> String {
        let parts: Vec<String> = [
            ("missing", self.missing),
            ("corrupt", self.corrupt),
            ("timed_out", self.timed_out),
            ("panicked", self.panicked),
            ("no_space", self.no_space),
            ("shutdown", self.shutdown),
            ("other", self.other),
        ]
        .iter()
        .filter(|(_, n)| *n > 0)
        .map(|(name, n)| format!("{name} {n}"))
        .collect();
        if parts.is_empty() {
            "none".into()
        } else {
            parts.join(", ")
        }
    }

    /// All failures counted.
    pub fn total(&self) -> u64 {
        self.missing
            + self.corrupt
            + self.timed_out
            + self.panicked
            + self.no_space
            + self.shutdown
            + self.other
    }
}

/// Counters of the primary tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
pub struct PrimaryStats {
    /// Total slots.
    pub capacity_blocks: usize,
    /// Slots holding a readable block.
    pub ready_blocks: usize,
    /// Slots being written.
    pub writing_blocks: usize,
    /// Blocks evicted since start.
    pub evictions: u64,
    /// `prepare_store` calls refused for lack of room.
    pub refused_stores: u64,
}

/// Counters of a [`crate::TieringManager`], with its tiers' (serialisable: a report or an
/// endpoint can hand it out whole).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct ManagerStats {
    /// `lookup` calls.
    pub lookups: u64,
    /// Answered `Hit` (from DRAM).
    pub hits: u64,
    /// Answered `HitPending` (in DRAM being written, or a promotion queued or in flight).
    pub hits_pending: u64,
    /// Answered `Retry`.
    pub retries: u64,
    /// Answered `Miss`.
    pub misses: u64,
    /// Lookups that found a block in a secondary tier but no DRAM slot to promote it into.
    pub promotions_refused: u64,
    /// Store cascades started (one per successful `complete_store` with new blocks).
    pub cascades: u64,
    /// Keys `prepare_store` left out because lookups had not asked for them
    /// `store_threshold` times.
    pub stores_not_admitted: u64,
    /// `prepare_store` calls refused because a `wait` tier's write-back (or the DRAM pinned by
    /// write-back) was at its limit.
    pub stores_refused_for_write_back: u64,
    /// DRAM bytes pinned by store jobs now.
    pub write_back_pinned_bytes: u64,
    /// The most DRAM bytes store jobs have pinned at once.
    pub write_back_pinned_peak_bytes: u64,
    /// Promoted DRAM blocks pinned now for requests that were told `HitPending` for them and
    /// have not read them yet (see [`crate::TieringManager::lookup`]).
    pub held_blocks: usize,
    /// Requests waiting for a promoted block or holding one.
    pub holding_requests: usize,
    /// The primary tier's counters.
    pub primary: PrimaryStats,
    /// Per secondary tier, in order.
    pub tiers: Vec<TierStats>,
    /// Event keys dropped, DRAM's and every tier's, because their buffer was full
    /// (`event_buffer_keys`) when the engine had not taken them.
    pub events_dropped: u64,
    /// `Miss` answers by cause (see [`crate::MissCause`]).
    pub misses_by_cause: MissCounts,
}

/// `Miss` answers of the manager by [`crate::MissCause`] (summed over tiers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct MissCounts {
    /// No tier has the block.
    pub not_found: u64,
    /// A tier's probe was past its budget or deadline.
    pub probe_over_budget: u64,
    /// A tier's probe failed.
    pub probe_failed: u64,
    /// A load of the block failed.
    pub load_failed: u64,
    /// No DRAM slot to promote into.
    pub no_dram_room: u64,
    /// Its load would have ended later than recomputing it (the load-or-recompute policy).
    pub recompute_faster: u64,
    /// After shutdown.
    pub shut_down: u64,
}

impl MissCounts {
    /// Counts one miss of `cause`.
    pub fn record(&mut self, cause: &crate::MissCause) {
        use crate::MissCause as C;
        match cause {
            C::NotFound => self.not_found += 1,
            C::ProbeOverBudget { .. } => self.probe_over_budget += 1,
            C::ProbeFailed { .. } => self.probe_failed += 1,
            C::LoadFailed { .. } => self.load_failed += 1,
            C::NoDramRoom { .. } => self.no_dram_room += 1,
            C::RecomputeFaster { .. } => self.recompute_faster += 1,
            C::ShutDown => self.shut_down += 1,
        }
    }

    /// Takes back one miss of `cause` (an answer the manager replaced).
    pub(crate) fn unrecord(&mut self, cause: &crate::MissCause) {
        use crate::MissCause as C;
        let n = match cause {
            C::NotFound => &mut self.not_found,
            C::ProbeOverBudget { .. } => &mut self.probe_over_budget,
            C::ProbeFailed { .. } => &mut self.probe_failed,
            C::LoadFailed { .. } => &mut self.load_failed,
            C::NoDramRoom { .. } => &mut self.no_dram_room,
            C::RecomputeFaster { .. } => &mut self.recompute_faster,
            C::ShutDown => &mut self.shut_down,
        };
        *n = n.saturating_sub(1);
    }

    /// Each count with its cause's name (the metrics' `cause` label).
    pub fn by_cause(&self) -> [(&'static str, u64); 7] {
        [
            ("not_found", self.not_found),
            ("probe_over_budget", self.probe_over_budget),
            ("probe_failed", self.probe_failed),
            ("load_failed", self.load_failed),
            ("no_dram_room", self.no_dram_room),
            ("recompute_faster", self.recompute_faster),
            ("shut_down", self.shut_down),
        ]
    }

    /// All misses counted.
    pub fn total(&self) -> u64 {
        self.by_cause().iter().map(|(_, n)| n).sum()
    }

    /// Adds `other`'s counts (another manager's).
    pub fn add(&mut self, other: &MissCounts) {
        let MissCounts {
            not_found,
            probe_over_budget,
            probe_failed,
            load_failed,
            no_dram_room,
            recompute_faster,
            shut_down,
        } = *other;
        self.not_found += not_found;
        self.probe_over_budget += probe_over_budget;
        self.probe_failed += probe_failed;
        self.load_failed += load_failed;
        self.no_dram_room += no_dram_room;
        self.recompute_faster += recompute_faster;
        self.shut_down += shut_down;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_bucket() {
        let mut h = LatencyHistogram::default();
        for us in 1..=1000u64 {
            h.record(Duration::from_micros(us));
        }
        let p50 = h.quantile(0.5).as_micros() as f64;
        let p99 = h.quantile(0.99).as_micros() as f64;
        assert!((p50 - 500.0).abs() / 500.0 < 0.08, "p50 {p50}");
        assert!((p99 - 990.0).abs() / 990.0 < 0.08, "p99 {p99}");
        assert_eq!(h.max(), Duration::from_micros(1000));
        assert_eq!(h.count(), 1000);
        assert_eq!(LatencyHistogram::default().quantile(0.5), Duration::ZERO);
    }

    /// The quantile is a figure the samples had: loads of 520, 540 and 557 ms each read as
    /// themselves, not as the upper edge of their bucket.
    #[test]
    fn a_quantile_is_a_measured_figure_not_a_bucket_edge() {
        for ms in [520u64, 540, 557] {
            let mut h = LatencyHistogram::default();
            for _ in 0..10 {
                h.record(Duration::from_millis(ms));
            }
            h.record(Duration::from_secs(5));
            assert_eq!(h.quantile(0.5), Duration::from_millis(ms));
        }
        let mut h = LatencyHistogram::default();
        h.record(Duration::from_micros(1000));
        h.record(Duration::from_micros(1010));
        assert_eq!(
            h.quantile(0.5),
            Duration::from_micros(1005),
            "the bucket's mean"
        );
        let mut m = LatencyHistogram::default();
        m.merge(&h);
        assert_eq!(
            m.quantile(0.99),
            Duration::from_micros(1005),
            "merged with its sums"
        );
    }

    #[test]
    fn buckets_are_monotonic() {
        let mut last = 0;
        for us in [1u64, 2, 3, 15, 16, 17, 100, 1_000, 65_536, 1 << 40] {
            let b = bucket_of(us);
            assert!(b >= last);
            assert!(bucket_upper_us(b) >= us, "{us}");
            last = b;
        }
    }
}

/// Declares a tier's statistics once: the public snapshot type (its own fields, then the
/// counters as `u64`s) and the live counters behind it (one relaxed `AtomicU64` each, to bump
/// from any thread), with `fill` (the counters now, into a snapshot) and `snapshot`.
///
/// ```
/// kv_tier_core::counters! {
///     /// What my tier did.
///     #[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
///     pub struct MyStats;
///     /// The live counters behind [`MyStats`].
///     pub struct MyCounters;
///     fields {
///         /// Bytes it holds now (not a counter: the tier fills it in).
///         bytes: u64,
///     }
///     counted {
///         /// Requests sent.
///         requests,
///         /// Requests that failed.
///         failures,
///     }
/// }
///
/// let c = MyCounters::default();
/// kv_tier_core::stats::bump(&c.requests, 2);
/// let mut s = MyStats { bytes: 10, ..Default::default() };
/// c.fill(&mut s);
/// assert_eq!((s.bytes, s.requests, s.failures), (10, 2, 0));
/// assert_eq!(c.snapshot().requests, 2);
/// ```
#[macro_export]
macro_rules! counters {
    (
        $(#[$smeta:meta])*
        $svis:vis struct $stats:ident;
        $(#[$cmeta:meta])*
        $cvis:vis struct $cells:ident;
        fields {
            $( $(#[doc = $odoc:literal])* $ofield:ident : $oty:ty, )*
        }
        counted {
            $( $(#[doc = $doc:literal])* $field:ident, )*
        }
    ) => {
        $(#[$smeta])*
        $svis struct $stats {
            $( $(#[doc = $odoc])* pub $ofield: $oty, )*
            $( $(#[doc = $doc])* pub $field: u64, )*
        }

        $(#[$cmeta])*
        #[derive(Debug, Default)]
        $cvis struct $cells {
            $( $(#[doc = $doc])* $cvis $field: ::std::sync::atomic::AtomicU64, )*
        }

        impl $cells {
            /// Writes the counters as they are now into `s`'s counted fields (relaxed loads:
            /// each is exact, together they are not one instant).
            $cvis fn fill(&self, s: &mut $stats) {
                $( s.$field = self.$field.load(::std::sync::atomic::Ordering::Relaxed); )*
            }

            /// The counters now, the other fields at their defaults.
            #[allow(dead_code)]
            $cvis fn snapshot(&self) -> $stats {
                let mut s = <$stats as ::std::default::Default>::default();
                self.fill(&mut s);
                s
            }
        }

        impl $crate::stats::Figures for $stats {
            fn figures(&self, prefix: &str, _help: &str, out: &mut Vec<$crate::stats::Figure>) {
                $(
                    $crate::stats::Figures::figures(
                        &self.$ofield,
                        &$crate::stats::figure_name(prefix, stringify!($ofield)),
                        concat!($($odoc, " ",)*),
                        out,
                    );
                )*
                $(
                    out.push($crate::stats::Figure::new(
                        $crate::stats::figure_name(prefix, stringify!($field)),
                        concat!($($doc, " ",)*),
                        $crate::stats::FigureKind::Counter,
                        self.$field,
                    ));
                )*
            }
        }
    };
}

counters! {
    /// What every block-storing tier counts, as a snapshot of its [`BlockCounters`].
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
    pub struct BlockStats;
    /// The live counters behind [`BlockStats`], for a tier to embed and bump from any
    /// thread (relaxed atomics: each is exact, a snapshot is not one instant).
    pub struct BlockCounters;
    fields {}
    counted {
    /// Blocks written by this tier.
    blocks_written,
    /// Stores that found the block present (or lost the race to another writer).
    stores_skipped,
    /// Blocks whose store failed.
    store_failures,
    /// Blocks loaded whole.
    blocks_read,
    /// Loads of missing blocks.
    load_misses,
    /// Other load failures (damage, I/O errors, deadlines).
    load_failures,
    /// Blocks removed as damaged: short, long, failing or lacking their checksum, or not a
    /// block at all.
    corrupt_deleted,
    /// Loads whose checksum did not match (the obj tier counts malformed ones here too).
    checksum_mismatches,
    /// Loads of blocks that carry no checksum, served unverified (`accept_unverified`).
    unverified_loads,
    /// Loads of blocks without a valid checksum, refused (a miss) and the block removed.
    unverified_refused,
    /// Bytes of blocks written.
    bytes_written,
    /// Bytes of blocks read.
    bytes_read,
    }
}

/// A tier's live counters: what every block-storing tier counts, and its own (declared with
/// [`counters!`](crate::counters)).
#[derive(Debug, Default)]
pub struct TierCounters<C> {
    /// What every block-storing tier counts.
    pub blocks: BlockCounters,
    /// The tier's own counters.
    pub own: C,
}

/// Adds `n` to a counter.
pub fn bump(counter: &std::sync::atomic::AtomicU64, n: u64) {
    counter.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
}

/// Counters of a [`ProbeCache`](crate::ProbeCache).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProbeCacheStats {
    /// Probe batches sent.
    pub probes: u64,
    /// Keys probed.
    pub probed_keys: u64,
    /// Keys probe answers found present.
    pub keys_found: u64,
    /// Keys probe answers found absent (failed, timed-out and panicked batches not
    /// included: they count in `probe_errors`, `probe_timeouts`, `probe_panics`).
    pub keys_absent: u64,
    /// Probe answers discarded because a store or failed load superseded them.
    pub stale_answers: u64,
    /// Probe batches that failed, answered the wrong number of keys, or were dropped (their
    /// keys count as absent).
    pub probe_errors: u64,
    /// Probe batches that passed their deadline (their keys count as absent).
    pub probe_timeouts: u64,
    /// Probe batches whose tier panicked (their keys count as absent).
    pub probe_panics: u64,
    /// Asks that found their key's lease expired (the key is probed again). An expired lease
    /// stops protecting its key within a quarter lease whether or not the key is asked again.
    pub leases_expired: u64,
    /// Failed-load answers for requests this lookup does not know (finished): ignored.
    pub ignored_answers: u64,
    /// Lookups that stopped waiting for this tier's probe at the probe budget (the key
    /// counted as absent here for that request).
    pub over_budget: u64,
    /// Probe batches that answered after the budget (their answers serve later lookups);
    /// batches that timed out, failed or panicked are not answers and count elsewhere.
    pub late_answers: u64,
    /// Keys the tier answered held from what it knows in memory
    /// ([`SecondaryTier::holds`](crate::SecondaryTier::holds)), with no probe.
    pub known_present: u64,
    /// Keys the tier answered not held from what it knows in memory, with no probe.
    pub known_absent: u64,
}
