//! The report: its types, filling it from the engine's tally and the manager's stats,
//! [`render`]ing it as text, and the live progress line.

use std::time::{Duration, Instant};

use kv_tier::fs::GcStats;
use kv_tier::{ManagerStats, TierStats, TieringManager};
use serde::Serialize;

use super::SimConfig;
use super::attribution::{Attribution, describe};
use super::offline::{Policy, Trace, TraceHeader, replay};
pub use super::setup::{DiskProbe, ServerProbe};
use super::step::Tally;

/// The capacities of the run in blocks, the offline model's, and the run's working set.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct ModelReport {
    /// DRAM, in blocks.
    pub dram_blocks: u64,
    /// The fs tier's cap, in blocks: the cap over what the tier held per block file at the
    /// end of the run (its file, checksum and share of the directories) (`None`: no fs tier
    /// or no cap).
    pub fs_blocks: Option<u64>,
    /// The obj tier's bound, in blocks (`None`: no obj tier or no bound).
    pub obj_blocks: Option<u64>,
    /// A tier without a bound is below DRAM (an fs tier without a cap, an obj tier).
    pub unbounded_below: bool,
    /// The offline model's one level (`None`: unbounded).
    pub model_blocks: Option<u64>,
    /// Distinct blocks the run's requests read or stored.
    pub working_set_blocks: u64,
    /// What the offline model assumes.
    pub assumes: String,
}

/// The run's trace replayed offline: hit rates of the same requests at the same capacity.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Default)]
pub struct OfflineReport {
    /// Under LRU (what kv-tier runs).
    pub lru: f64,
    /// Under Belady's rule.
    pub opt: f64,
    /// Under Belady's rule with DRAM and fs pooled (their blocks summed: any placement).
    pub pooled: f64,
    /// With no bound.
    pub unbounded: f64,
}

/// Per-request figures: waits, modelled time to first token, waits that did not pay.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct PerRequest {
    /// The prefill rate the model uses, tokens/s (0: none).
    pub prefill_tokens_per_s: f64,
    /// Steps a request waited at most before taking what was there.
    pub max_wait_steps: u32,
    /// Requests that waited at least one step for their blocks.
    pub requests_waited: u64,
    /// Their wait, from the first lookup to the blocks: p50 and p99, ms (measured values).
    pub wait_p50_ms: f64,
    /// See `wait_p50_ms`.
    pub wait_p99_ms: f64,
    /// Modelled time to first token (wait + recompute of the missed tokens), p50, ms.
    pub ttft_p50_ms: f64,
    /// See `ttft_p50_ms`.
    pub ttft_p99_ms: f64,
    /// Requests that waited longer than recomputing the tier tokens they waited for.
    pub waited_longer_than_recompute: u64,
    /// The tier tokens of those requests.
    pub tokens_of_those: u64,
    /// Those of them that got no tier token at all (they waited for probes, or for blocks
    /// that did not come).
    pub waited_for_nothing: u64,
    /// A waiting request's wait less the time to recompute the tier tokens it got: p50 and
    /// p99, ms (at most 0: no wait took longer than recomputing what it brought).
    pub wait_over_recompute_p50_ms: f64,
    /// See `wait_over_recompute_p50_ms`.
    pub wait_over_recompute_p99_ms: f64,
    /// Whether the manager ran its load-or-recompute policy (`--load-policy`).
    pub load_policy: bool,
    /// Blocks whose promotion the policy declined (every tier).
    pub promotions_declined: u64,
    /// Key lookups whose probe the policy did not wait for (every tier).
    pub probes_not_waited: u64,
    /// Load jobs the policy cut, behind their estimate (every tier).
    pub load_jobs_cut: u64,
    /// Blocks those cut jobs had not landed (every tier).
    pub promotions_cut: u64,
}

/// Hits before and after a restart of the manager on the same root.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct RestartReport {
    /// Requests served before it.
    pub after_requests: u64,
    /// Seconds the shutdown and reopen took.
    pub reopen_s: f64,
    /// Seconds from the reopen to the first token served from a tier (`None`: none was).
    pub first_tier_hit_after_s: Option<f64>,
    /// Prompt tokens before.
    pub before_prompt_tokens: u64,
    /// Hit rate before.
    pub before_hit_rate: f64,
    /// Prompt tokens after.
    pub after_prompt_tokens: u64,
    /// Hit rate after.
    pub after_hit_rate: f64,
}

/// What the offline model assumes (the report prints it).
pub(super) const MODEL_ASSUMES: &str = "one level of max(DRAM, the largest bounded tier below it) blocks (stores go to all, a hit in any serves; a tier without a bound keeps everything), the GPU cache in front as the engine's LRU, whole requests with no timing (no write-back delay, probe budget or give-up), a restart empties DRAM only; opt is Belady's rule per block; pooled is Belady's rule on DRAM + the largest bounded tier's blocks as one level (any placement across the two)";

/// Per-tier figures of the report.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TierReport {
    /// Tier name.
    pub name: String,
    /// Lookups that found the block in this tier (promotions queued).
    pub hits: u64,
    /// Blocks loaded (promoted into DRAM).
    pub blocks_loaded: u64,
    /// Bytes read from the tier.
    pub bytes_read: u64,
    /// Bytes written to the tier.
    pub bytes_written: u64,
    /// Blocks written.
    pub blocks_stored: u64,
    /// Read throughput over the run, GB/s.
    pub read_gb_per_s: f64,
    /// Read throughput while the tier had a load job in flight, GB/s (`None`: no load job).
    pub read_gb_per_s_loading: Option<f64>,
    /// Write throughput over the run, GB/s.
    pub write_gb_per_s: f64,
    /// Load job latency p50, ms.
    pub load_p50_ms: f64,
    /// Load job latency p99, ms.
    pub load_p99_ms: f64,
    /// Failed block loads (misses for their request).
    pub load_failures: u64,
    /// Why loads failed (`missing`: the block was gone when its promotion read it).
    pub load_failure_causes: kv_tier_core::stats::FailureCauses,
    /// Failed block stores.
    pub store_failures: u64,
    /// Why stores failed.
    pub store_failure_causes: kv_tier_core::stats::FailureCauses,
    /// Blocks not written here because its write-back was at its limit (policy `drop`).
    pub writes_dropped: u64,
    /// Blocks the tier itself wrote (its own count: stores of blocks already present are
    /// not writes), the figure for the device's endurance.
    pub blocks_written_new: u64,
    /// Blocks not written here: not looked up `admit_after_lookups` times.
    pub not_admitted: u64,
    /// Blocks not written here: its `write_budget_mb_per_s` was spent.
    pub over_write_budget: u64,
    /// The most bytes of write-back queued or in flight to this tier.
    pub write_back_peak_bytes: u64,
    /// Probe batch latency p50 and p99, ms.
    pub probe_p50_ms: f64,
    /// See `probe_p50_ms`.
    pub probe_p99_ms: f64,
    /// Lookups that stopped waiting for this tier at its probe budget.
    pub probes_over_budget: u64,
    /// Probe batches answered after the budget.
    pub late_answers: u64,
    /// Probes given up at their deadline.
    pub probe_timeouts: u64,
    /// Probes that failed or panicked.
    pub probe_errors: u64,
    /// Keys of lookups answered Retry while this tier's probe was out (where it stalled
    /// admission).
    pub retry_waits: u64,
    /// Keys the tier answered from what it knows (its index, its existence cache), with no
    /// probe: held, and not held.
    pub known_held: u64,
    /// See `known_held`.
    pub known_absent: u64,
    /// Lookups the tier itself answered part way at its own deadline (the obj tier's
    /// `lookup_timeouts`, below the manager's probe deadline: its unanswered keys were
    /// absent). The same events its log's deadline lines count.
    pub own_deadline_lookups: u64,
    /// What the tier holds at the end by its own count (a bounded obj tier's capacity
    /// index; `None` where the tier does not say: the fs tier's figures are in `gc`).
    pub held_bytes: Option<u64>,
    /// The bound on `held_bytes` (the obj tier's `max_size_gb`).
    pub bound_bytes: Option<u64>,
    /// Blocks the tier holds at the end, by its events.
    pub blocks_at_end: u64,
    /// Those of them behind a block of their chain (by the workload's chains) that the
    /// tier does not hold: dead there, a prefix lookup in the tier stops before them.
    /// Whatever the eviction policy (the tier's own `dead_bytes` counts by the links it
    /// was sent, so only with `chain_eviction`).
    pub dead_blocks_at_end: u64,
}

/// GC figures of the fs tier.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct GcReport {
    /// The cap, bytes.
    pub cap_bytes: u64,
    /// The hard ceiling (`gc_hard_ceiling x cap`), bytes: the bound the tier never passes
    /// (between the cap and it, stores go on while sweeps make room).
    pub hard_ceiling_bytes: u64,
    /// What the tier holds on disk at the end: allocated bytes of its files and directories.
    pub bytes: u64,
    /// The most it held at any time.
    pub peak_bytes: u64,
    /// The part of `bytes` that is directories.
    pub dir_bytes: u64,
    /// Block files in the tier's index at the end.
    pub files: u64,
    /// The part of `bytes` in blocks whose chain is broken before them in the tier (dead
    /// bytes: a prefix lookup never reaches them there).
    pub dead_bytes: u64,
    /// Files deleted within the grace window because the hard ceiling was near.
    pub grace_overridden: u64,
    /// Sweeps that ended over the cap (the rest was in flight or within the grace window).
    pub sweeps_over_cap: u64,
    /// With `sync_steps`: the largest size right after a step's sweep (nothing in flight).
    pub max_bytes_after_step_sweep: Option<u64>,
    /// Sweeps run.
    pub sweeps: u64,
    /// Files swept.
    pub swept_files: u64,
    /// Files kept because jobs had them protected.
    pub skipped_in_flight: u64,
    /// Files kept because they were used within the grace window.
    pub skipped_in_grace: u64,
    /// Stamps applied.
    pub stamps: u64,
    /// Stores that reached the hard ceiling and had to make room (a sweep of their own,
    /// mid-step) or wait for it.
    pub store_waits: u64,
    /// Stores refused because no room could be made under the hard ceiling.
    pub no_room: u64,
}

/// The report: printed at the end and written by `--json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Report {
    /// Seconds of wall time of the run: until the last request finished (the final drain of
    /// write-back is `drain_seconds`).
    pub seconds: f64,
    /// Seconds the final drain took (jobs still queued or in flight when the last request
    /// finished: write-back to slow tiers, mostly).
    pub drain_seconds: f64,
    /// Requests (turns) completed.
    pub requests: u64,
    /// Requests in the workload.
    pub requests_planned: u64,
    /// Scheduler steps.
    pub steps: u64,
    /// Bytes per block.
    pub block_bytes: u64,
    /// Prompt tokens in all (in whole blocks).
    pub prompt_tokens: u64,
    /// Tokens found in the simulated GPU prefix cache.
    pub tokens_from_gpu_cache: u64,
    /// Tokens served from DRAM without waiting for a promotion.
    pub tokens_from_dram: u64,
    /// Tokens that waited for a promotion from a secondary tier.
    pub tokens_from_secondary: u64,
    /// Tokens recomputed.
    pub tokens_recomputed: u64,
    /// `lookup` calls.
    pub lookups: u64,
    /// Lookups answered Hit.
    pub lookup_hits: u64,
    /// Lookups answered HitPending.
    pub lookup_hits_pending: u64,
    /// Lookups answered Retry.
    pub lookup_retries: u64,
    /// Lookups answered Miss.
    pub lookup_misses: u64,
    /// Blocks read from kv-tier and verified byte for byte.
    pub blocks_verified: u64,
    /// Blocks whose bytes were wrong (must be 0).
    pub blocks_corrupt: u64,
    /// Fraction of prompt tokens not recomputed.
    pub hit_rate: f64,
    /// The hit rate an unbounded cache would have on the same requests (every block stored,
    /// prompt and output, kept forever): the ceiling of `hit_rate`.
    pub ideal_hit_rate: f64,
    /// DRAM evictions.
    pub dram_evictions: u64,
    /// `prepare_store` calls refused because DRAM was full of pinned blocks.
    pub stores_refused: u64,
    /// `prepare_store` calls refused because write-back was at its limit (a `wait` tier, or
    /// the DRAM pinned by write-back).
    pub stores_refused_write_back: u64,
    /// DRAM bytes pinned by write-back at most.
    pub write_back_pinned_peak_bytes: u64,
    /// Per secondary tier.
    pub tiers: Vec<TierReport>,
    /// The fs tier's GC, when bounded.
    pub gc: Option<GcReport>,
    /// The fs tier's shared-root coordination, as this instance saw it (`--instances`).
    pub shared: Option<kv_tier_fs::SharedStats>,
    /// Events emitted (stored + removed).
    pub events: u64,
    /// Removal events.
    pub removal_events: u64,
    /// Prefill time the tiers saved at the configured rate, seconds.
    pub prefill_seconds_saved: f64,
    /// The disk under the fs tier's directory, measured at startup (`None` without an fs
    /// tier or where O_DIRECT is refused).
    pub disk: Option<DiskProbe>,
    /// The first obj tier's server, measured at startup (`None` without an obj tier).
    pub server: Option<ServerProbe>,
    /// Seconds of wall time of the whole run: setup, the run, the drain and the teardown
    /// (the temporary directory's removal included).
    pub wall_seconds: f64,
    /// What the run was given.
    pub inputs: Inputs,
    /// Every prompt token in one bucket (labels: `served/...`, `lost/...`); they sum to
    /// `prompt_tokens`.
    pub attribution: Attribution,
    /// The capacities in blocks and the working set.
    pub model: ModelReport,
    /// The run's trace replayed offline at the same capacity.
    pub offline: OfflineReport,
    /// Per-request figures.
    pub per_request: PerRequest,
    /// Blocks a promotion brought into DRAM that no request was served from then on.
    pub promotions_unused: u64,
    /// Their bytes.
    pub promotions_unused_bytes: u64,
    /// The restart, if the run had one.
    pub restart: Option<RestartReport>,
    /// Event keys dropped (`event_buffer_keys`): the attribution's histories miss them.
    pub events_dropped: u64,
    /// Block files the fs tier found when it opened (a reused `--root-dir`; `None`: no fs
    /// tier): they have no history in the attribution (a miss of one reads as first use).
    pub blocks_found_at_open: Option<u64>,
    /// The run's request trace (`--trace` writes it).
    #[serde(skip)]
    pub trace: Trace,
}

/// The exact `q`-quantile of `v` (sorted here), ms.
/// The `q` quantile of `v` (nearest rank; 0 for none).
fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1]
}

fn quantile_ms(v: &[Duration], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort();
    let rank = ((q * v.len() as f64).ceil() as usize).clamp(1, v.len());
    v[rank - 1].as_secs_f64() * 1e3
}

/// Adds the counters of `earlier` (a manager a restart shut down) to `s`, tier by tier.
pub(super) fn accumulate(s: &mut ManagerStats, earlier: &ManagerStats) {
    s.lookups += earlier.lookups;
    s.hits += earlier.hits;
    s.hits_pending += earlier.hits_pending;
    s.retries += earlier.retries;
    s.misses += earlier.misses;
    s.promotions_refused += earlier.promotions_refused;
    s.misses_by_cause.add(&earlier.misses_by_cause);
    s.primary.evictions += earlier.primary.evictions;
    s.write_back_pinned_peak_bytes = s
        .write_back_pinned_peak_bytes
        .max(earlier.write_back_pinned_peak_bytes);
    for (t, e) in s.tiers.iter_mut().zip(&earlier.tiers) {
        for (a, b) in [
            (&mut t.hits, e.hits),
            (&mut t.promotions_declined, e.promotions_declined),
            (&mut t.load_jobs_cut, e.load_jobs_cut),
            (&mut t.probes_not_waited, e.probes_not_waited),
            (&mut t.promotions_cut, e.promotions_cut),
            (&mut t.retry_waits, e.retry_waits),
            (&mut t.not_admitted, e.not_admitted),
            (&mut t.over_write_budget, e.over_write_budget),
            (&mut t.blocks_stored, e.blocks_stored),
            (&mut t.bytes_stored, e.bytes_stored),
            (&mut t.store_failures, e.store_failures),
            (&mut t.blocks_loaded, e.blocks_loaded),
            (&mut t.bytes_loaded, e.bytes_loaded),
            (&mut t.load_failures, e.load_failures),
            (&mut t.writes_dropped, e.writes_dropped),
            (&mut t.probes.over_budget, e.probes.over_budget),
            (&mut t.probes.known_present, e.probes.known_present),
            (&mut t.probes.known_absent, e.probes.known_absent),
            (&mut t.probes.late_answers, e.probes.late_answers),
            (&mut t.probes.probe_timeouts, e.probes.probe_timeouts),
            (&mut t.probes.probe_errors, e.probes.probe_errors),
            (&mut t.probes.probe_panics, e.probes.probe_panics),
            (
                &mut t.own.blocks.blocks_written,
                e.own.blocks.blocks_written,
            ),
        ] {
            *a += b;
        }
        t.write_back_peak_bytes = t.write_back_peak_bytes.max(e.write_back_peak_bytes);
        t.load_latency.merge(&e.load_latency);
        t.probe_latency.merge(&e.probe_latency);
        t.store_latency.merge(&e.store_latency);
    }
}

/// What a run was given, recorded in its report.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct Inputs {
    /// serve_sim's version.
    pub version: String,
    /// The command line (set by the binary; empty from the library).
    pub argv: Vec<String>,
    /// The simulator's config (secrets masked).
    pub sim: SimConfig,
    /// The tier config as the manager used it, defaults filled in (secrets masked).
    pub tiers: serde_json::Value,
}

/// The report of a run: the engine's tally, the manager's stats and the fs tier's GC
/// figures at its end; throughputs over `seconds`, the run until the last request finished.
pub(super) fn fill(
    cfg: &SimConfig,
    t: &Tally,
    s: &ManagerStats,
    gc: Option<GcStats>,
    seconds: Duration,
    drain: Duration,
) -> Report {
    let secs = seconds.as_secs_f64();
    let block = cfg.block_bytes() as u64;
    // the largest bounded tier below DRAM (an obj tier's bound may pass the fs tier's cap)
    let obj_blocks = cfg
        .s3_endpoint
        .as_ref()
        .or(cfg.s3_embedded.then_some(&cfg.s3_bucket))
        .and(cfg.obj_cap_gb)
        .map(|gb| (gb * (1u64 << 30) as f64) as u64 / block.max(1));
    // the blocks the cap holds: it counts each block's file with its checksum and its share
    // of the directories, so a block costs what the tier held per file at the end of the
    // run (2x the block for 8 KiB blocks, where the directories weigh; ~1x at 2 MiB)
    let fs_blocks = gc.as_ref().map(|g| {
        let per_block = match g.files {
            0 => block,
            n => (g.bytes / n).max(block),
        };
        g.cap_bytes / per_block.max(1)
    });
    let header = TraceHeader {
        dram_blocks: s.primary.capacity_blocks as u64,
        fs_blocks: fs_blocks.max(obj_blocks),
        // an fs tier without a cap, or a tier below the bounded one without one
        unbounded_below: !s.tiers.is_empty()
            && match cfg.no_fs {
                true => obj_blocks.is_none(),
                false => gc.is_none() || (s.tiers.len() > 1 && obj_blocks.is_none()),
            },
        gpu_blocks: cfg.gpu_cache_blocks as u64,
        tokens_per_block: cfg.tokens_per_block as u64,
    };
    let trace = Trace {
        header,
        records: t.trace.records.clone(),
    };
    let offline = OfflineReport {
        lru: replay(&trace, Policy::Lru).hit_rate(),
        opt: replay(&trace, Policy::Opt).hit_rate(),
        pooled: replay(&trace, Policy::Pooled).hit_rate(),
        unbounded: replay(&trace, Policy::Unbounded).hit_rate(),
    };
    let restart = t.before_restart.map(|(prompt, hit)| {
        let rate = |h: u64, p: u64| if p == 0 { 0.0 } else { h as f64 / p as f64 };
        let (ap, ah) = (t.prompt_tokens - prompt, t.hit_tokens() - hit);
        RestartReport {
            after_requests: t
                .trace
                .records
                .iter()
                .position(|r| *r == super::offline::TraceRecord::Restart)
                .unwrap_or(0) as u64,
            reopen_s: t.reopen.unwrap_or_default().as_secs_f64(),
            first_tier_hit_after_s: t.first_tier_hit_after_restart.map(|d| d.as_secs_f64()),
            before_prompt_tokens: prompt,
            before_hit_rate: rate(hit, prompt),
            after_prompt_tokens: ap,
            after_hit_rate: rate(ah, ap),
        }
    });
    let from_tiers = t.prompt_tokens - t.tokens_recomputed - t.tokens_from_gpu_cache;
    let prefill_seconds_saved = if cfg.prefill_tokens_per_s > 0.0 {
        from_tiers as f64 / cfg.prefill_tokens_per_s
    } else {
        0.0
    };
    Report {
        seconds: secs,
        drain_seconds: drain.as_secs_f64(),
        requests: t.requests,
        requests_planned: t.requests_planned,
        steps: t.steps,
        block_bytes: cfg.block_bytes() as u64,
        prompt_tokens: t.prompt_tokens,
        tokens_from_gpu_cache: t.tokens_from_gpu_cache,
        tokens_from_dram: t.tokens_from_dram,
        tokens_from_secondary: t.tokens_from_secondary,
        tokens_recomputed: t.tokens_recomputed,
        lookups: s.lookups,
        lookup_hits: s.hits,
        lookup_hits_pending: s.hits_pending,
        lookup_retries: s.retries,
        lookup_misses: s.misses,
        blocks_verified: t.blocks_verified,
        blocks_corrupt: t.corrupt_keys.len() as u64,
        hit_rate: t.hit_rate(),
        ideal_hit_rate: offline.unbounded,
        dram_evictions: s.primary.evictions,
        stores_refused: t.stores_refused,
        stores_refused_write_back: t.stores_refused_write_back,
        write_back_pinned_peak_bytes: s.write_back_pinned_peak_bytes,
        tiers: s
            .tiers
            .iter()
            .map(|ts| {
                let mut r = tier_report(ts, secs);
                if let Some(c) = t.chains_held.iter().find(|c| c.tier == r.name) {
                    (r.blocks_at_end, r.dead_blocks_at_end) = (c.blocks, c.dead);
                }
                r
            })
            .collect(),
        gc: gc.map(|g| gc_report(&g, t.max_bytes_after_step_sweep)),
        shared: None,
        events: t.events,
        removal_events: t.removal_events,
        prefill_seconds_saved,
        disk: None,
        server: None,
        wall_seconds: 0.0,
        inputs: Inputs::default(),
        attribution: t.attribution.clone(),
        model: ModelReport {
            dram_blocks: header.dram_blocks,
            fs_blocks,
            obj_blocks,
            unbounded_below: header.unbounded_below,
            model_blocks: header.model_blocks(),
            working_set_blocks: t.trace.blocks(),
            assumes: MODEL_ASSUMES.into(),
        },
        offline,
        per_request: PerRequest {
            prefill_tokens_per_s: cfg.prefill_tokens_per_s,
            max_wait_steps: cfg.max_wait_steps,
            requests_waited: t.waits.len() as u64,
            wait_p50_ms: quantile_ms(&t.waits, 0.5),
            wait_p99_ms: quantile_ms(&t.waits, 0.99),
            ttft_p50_ms: quantile_ms(&t.ttft, 0.5),
            ttft_p99_ms: quantile_ms(&t.ttft, 0.99),
            waited_longer_than_recompute: t.waited_longer,
            tokens_of_those: t.waited_longer_tokens,
            waited_for_nothing: t.waited_for_nothing,
            wait_over_recompute_p50_ms: quantile(&t.wait_over_recompute_ms, 0.5),
            wait_over_recompute_p99_ms: quantile(&t.wait_over_recompute_ms, 0.99),
            load_policy: cfg.load_policy,
            promotions_declined: s.tiers.iter().map(|t| t.promotions_declined).sum(),
            load_jobs_cut: s.tiers.iter().map(|t| t.load_jobs_cut).sum(),
            probes_not_waited: s.tiers.iter().map(|t| t.probes_not_waited).sum(),
            promotions_cut: s.tiers.iter().map(|t| t.promotions_cut).sum(),
        },
        promotions_unused: t.promoted_unused.len() as u64,
        promotions_unused_bytes: t.promoted_unused.len() as u64 * block,
        restart,
        events_dropped: s.events_dropped,
        blocks_found_at_open: None,
        trace,
    }
}

/// The hit rate of an unbounded cache over the first `requests` turns of the workload: a
/// turn hits the leading blocks of its prompt that any earlier turn's prompt or output
/// holds.
pub fn ideal_hit_rate(cfg: &SimConfig, requests: u64) -> f64 {
    let mut trace = super::offline::Recorder::default();
    for turn in super::setup::workload(cfg).take(requests as usize) {
        trace.request(&turn.keys, &turn.output);
    }
    let header = TraceHeader {
        dram_blocks: 0,
        fs_blocks: None,
        unbounded_below: true,
        gpu_blocks: 0,
        tokens_per_block: cfg.tokens_per_block as u64,
    };
    let trace = Trace {
        header,
        records: trace.records,
    };
    replay(&trace, Policy::Unbounded).hit_rate()
}

fn tier_report(t: &TierStats, secs: f64) -> TierReport {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    TierReport {
        name: t.name.clone(),
        hits: t.hits,
        blocks_loaded: t.blocks_loaded,
        bytes_read: t.bytes_loaded,
        bytes_written: t.bytes_stored,
        blocks_stored: t.blocks_stored,
        read_gb_per_s: t.bytes_loaded as f64 / secs / 1e9,
        read_gb_per_s_loading: (!t.load_busy.is_zero())
            .then(|| t.bytes_loaded as f64 / t.load_busy.as_secs_f64() / 1e9),
        write_gb_per_s: t.bytes_stored as f64 / secs / 1e9,
        load_p50_ms: ms(t.load_latency.quantile(0.5)),
        load_p99_ms: ms(t.load_latency.quantile(0.99)),
        load_failures: t.load_failures,
        load_failure_causes: t.load_failure_causes,
        store_failures: t.store_failures,
        store_failure_causes: t.store_failure_causes,
        writes_dropped: t.writes_dropped,
        blocks_written_new: t.own.blocks.blocks_written,
        not_admitted: t.not_admitted,
        over_write_budget: t.over_write_budget,
        write_back_peak_bytes: t.write_back_peak_bytes,
        probe_p50_ms: ms(t.probe_latency.quantile(0.5)),
        probe_p99_ms: ms(t.probe_latency.quantile(0.99)),
        probes_over_budget: t.probes.over_budget,
        late_answers: t.probes.late_answers,
        probe_timeouts: t.probes.probe_timeouts,
        probe_errors: t.probes.probe_errors + t.probes.probe_panics,
        retry_waits: t.retry_waits,
        known_held: t.probes.known_present,
        known_absent: t.probes.known_absent,
        own_deadline_lookups: t
            .own
            .figures
            .iter()
            .find(|f| f.name == "lookup_timeouts")
            .map_or(0, |f| f.value),
        held_bytes: t.own.used_bytes,
        bound_bytes: t.own.capacity_bytes,
        blocks_at_end: 0,
        dead_blocks_at_end: 0,
    }
}

fn gc_report(g: &GcStats, max_bytes_after_step_sweep: Option<u64>) -> GcReport {
    GcReport {
        cap_bytes: g.cap_bytes,
        hard_ceiling_bytes: g.hard_ceiling_bytes,
        bytes: g.bytes,
        peak_bytes: g.peak_bytes,
        dir_bytes: g.dir_bytes,
        files: g.files,
        dead_bytes: g.dead_bytes,
        grace_overridden: g.grace_overridden,
        sweeps_over_cap: g.sweeps_over_cap,
        max_bytes_after_step_sweep,
        sweeps: g.sweeps,
        swept_files: g.swept_files,
        skipped_in_flight: g.skipped_in_flight,
        skipped_in_grace: g.skipped_in_grace,
        stamps: g.stamps,
        store_waits: g.store_waits,
        no_room: g.no_room,
    }
}

/// The live progress bar on stderr (with an ETA), updated at most every 250 ms; where stderr
/// is not a terminal (a log file, a pipe), a plain line every 5 s instead; nothing when off.
pub(super) struct Progress {
    bar: indicatif::ProgressBar,
    last: Instant,
    /// Plain lines (stderr is not a terminal).
    plain: bool,
    planned: u64,
}

/// How often a plain progress line is printed.
const PLAIN_EVERY: Duration = Duration::from_secs(5);

impl Progress {
    pub(super) fn new(on: bool, planned: u64) -> Self {
        let tty = std::io::IsTerminal::is_terminal(&std::io::stderr());
        let target = if on && tty {
            indicatif::ProgressDrawTarget::stderr()
        } else {
            indicatif::ProgressDrawTarget::hidden()
        };
        let bar = indicatif::ProgressBar::with_draw_target(Some(planned), target);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "[{bar:24}] {pos}/{len} req {elapsed_precise} ETA {eta}  {msg}",
            )
            .expect("a valid template")
            .progress_chars("#>-"),
        );
        Self {
            bar,
            last: Instant::now(),
            plain: on && !tty,
            planned,
        }
    }

    /// After a step: the bar, if 250 ms have passed since the last update (a plain line, if
    /// 5 s have).
    pub(super) fn tick(&mut self, m: &TieringManager, t: &Tally, elapsed: Duration) {
        if self.plain && self.last.elapsed() >= PLAIN_EVERY {
            self.last = Instant::now();
            eprintln!(
                "serve_sim: {}/{} requests, {:.0} s, {}",
                t.requests,
                self.planned,
                elapsed.as_secs_f64(),
                figures(m, t, elapsed)
            );
        } else if !self.bar.is_hidden() && self.last.elapsed() >= Duration::from_millis(250) {
            self.last = Instant::now();
            self.update(m, t, elapsed);
        }
    }

    /// At the end: the last figures, left on screen.
    pub(super) fn finish(&self, m: &TieringManager, t: &Tally, elapsed: Duration) {
        if !self.bar.is_hidden() {
            self.update(m, t, elapsed);
            self.bar.finish();
        }
    }

    fn update(&self, m: &TieringManager, r: &Tally, elapsed: Duration) {
        self.bar.set_position(r.requests);
        self.bar.set_message(figures(m, r, elapsed));
    }
}

/// The progress figures: hit rate, and read and write GB/s so far.
fn figures(m: &TieringManager, r: &Tally, elapsed: Duration) -> String {
    let s = m.stats();
    let secs = elapsed.as_secs_f64().max(1e-9);
    let read: u64 = s.tiers.iter().map(|t| t.bytes_loaded).sum();
    let wrote: u64 = s.tiers.iter().map(|t| t.bytes_stored).sum();
    format!(
        "hit {:>5.1}%  read {:>5.2} GB/s  write {:>5.2} GB/s",
        100.0 * r.hit_rate(),
        read as f64 / secs / 1e9,
        wrote as f64 / secs / 1e9
    )
}

/// The report as text.
pub fn render(r: &Report) -> String {
    let mut o = String::new();
    o += &format!(
        "kv-tier serve_sim report ({:.1} s, {} steps; then {:.1} s draining write-back; {:.1} s in all with setup and teardown)\n",
        r.seconds, r.steps, r.drain_seconds, r.wall_seconds
    );
    o += &format!(
        "  model                 {} ({} KiB blocks of {} tokens)\n",
        r.inputs.sim.model,
        r.block_bytes >> 10,
        r.inputs.sim.tokens_per_block
    );
    o += &format!(
        "  requests              {} of {} planned\n",
        r.requests, r.requests_planned
    );
    o += &format!(
        "  prompt tokens         {} (block {} KiB)\n",
        r.prompt_tokens,
        r.block_bytes >> 10
    );
    o += &format!("    from GPU cache      {}\n", r.tokens_from_gpu_cache);
    o += &format!("    from DRAM           {}\n", r.tokens_from_dram);
    o += &format!(
        "    from {:<15}{} (promoted into DRAM while the request waited)\n",
        r.tiers
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join("+"),
        r.tokens_from_secondary
    );
    o += &format!("    recomputed          {}\n", r.tokens_recomputed);
    o += &format!(
        "  hit rate              {:.1}% of prompt tokens not recomputed (an unbounded cache{}: {:.1}%)\n",
        100.0 * r.hit_rate,
        if r.blocks_found_at_open.is_some_and(|n| n > 0) {
            " starting cold, unlike this run's reused root"
        } else {
            ""
        },
        100.0 * r.ideal_hit_rate
    );
    o += &render_yardstick(r);
    o += &format!(
        "  lookups               {} (hit {}, pending {}, retry {}, miss {})\n",
        r.lookups, r.lookup_hits, r.lookup_hits_pending, r.lookup_retries, r.lookup_misses
    );
    o += &format!(
        "  verified blocks       {} byte for byte, {} corrupt\n",
        r.blocks_verified, r.blocks_corrupt
    );
    o += &format!(
        "  DRAM                  {} evictions, {} stores refused (pinned), {} refused for write-back, write-back pinned at most {:.1} MiB\n",
        r.dram_evictions,
        r.stores_refused,
        r.stores_refused_write_back,
        r.write_back_pinned_peak_bytes as f64 / (1u64 << 20) as f64
    );
    if let Some(d) = &r.disk {
        o += &format!(
            "  disk                  {:.2} GB/s write, {:.2} GB/s read (O_DIRECT, {} threads writing then {} reading as the fs tier does, {} MiB in {} KiB blocks, at startup)\n",
            d.write_gb_per_s,
            d.read_gb_per_s,
            d.write_threads,
            d.read_threads,
            d.bytes >> 20,
            d.block_bytes >> 10
        );
    }
    if let Some(p) = &r.server {
        o += &format!(
            "  object server         {:.2} GB/s PUT, {:.2} GB/s GET (plain object_store, {} in flight as the {} tier's io_threads, {} MiB in {} KiB objects, at startup)\n",
            p.put_gb_per_s,
            p.get_gb_per_s,
            p.in_flight,
            p.tier,
            p.bytes >> 20,
            p.object_bytes >> 10
        );
    }
    for t in &r.tiers {
        o += &render_tier(t, r.disk.as_ref(), r.server.as_ref());
    }
    if let Some(g) = &r.gc {
        o += &render_gc(g);
    }
    o += &format!(
        "  events                {} ({} removals)\n",
        r.events, r.removal_events
    );
    o += &format!(
        "  prefill time saved    {:.1} s at {} tokens/s of prefill (--prefill-tokens-per-s)\n",
        r.prefill_seconds_saved, r.per_request.prefill_tokens_per_s
    );
    o
}

/// The hit rate against the offline model, where every prompt token went, the per-request
/// figures, the unused promotions and the restart.
fn render_yardstick(r: &Report) -> String {
    let pct = |x: f64| 100.0 * x;
    let m = &r.model;
    let blocks = |b: Option<u64>| b.map_or("unbounded".to_string(), |b| format!("{b} blocks"));
    // each tier below DRAM with its bound (the model's level is the largest of them)
    let below: Vec<String> = r
        .tiers
        .iter()
        .map(|t| {
            let bound = match t.name.as_str() {
                "fs" => m.fs_blocks,
                "obj" => m.obj_blocks,
                _ => return t.name.clone(),
            };
            let bound = bound.map_or("no cap".to_string(), |b| format!("{b} blocks"));
            format!("{} {bound}", t.name)
        })
        .collect();
    let mut o = format!(
        "  the same trace offline LRU {:.1}% | Belady {:.1}% | Belady pooled {:.1}% | unbounded {:.1}% (model: {}; DRAM {} blocks, below it {}, working set {} blocks)\n",
        pct(r.offline.lru),
        pct(r.offline.opt),
        pct(r.offline.pooled),
        pct(r.offline.unbounded),
        blocks(m.model_blocks),
        m.dram_blocks,
        match below.is_empty() {
            true => "nothing".to_string(),
            false => below.join(", "),
        },
        m.working_set_blocks
    );
    o += &format!(
        "  where the prompt tokens went ({} in all)\n",
        r.prompt_tokens
    );
    let total = r.prompt_tokens.max(1) as f64;
    // served: the GPU cache, DRAM, then the tiers in order; lost: the largest first
    let rank = |k: &str| match k {
        "served/gpu" => 0,
        "served/dram" => 1,
        _ => {
            2 + r
                .tiers
                .iter()
                .position(|t| k == format!("served/{}", t.name))
                .unwrap_or(r.tiers.len())
        }
    };
    type Rows<'a> = Vec<(&'a String, &'a u64)>;
    let (mut served, mut lost): (Rows<'_>, Rows<'_>) = r
        .attribution
        .iter()
        .partition(|(k, _)| k.starts_with("served/"));
    served.sort_by_key(|(k, _)| rank(k));
    lost.sort_by_key(|(_, n)| std::cmp::Reverse(**n));
    for (label, n) in served.into_iter().chain(lost) {
        o += &format!(
            "    {:<68} {:>10} {:>5.1}%\n",
            describe(label),
            n,
            100.0 * *n as f64 / total
        );
    }
    let p = &r.per_request;
    o += &format!(
        "  per request           {} waited for their blocks: p50 {:.1} ms, p99 {:.1} ms (limit {} steps, --max-wait-steps); modelled time to first token p50 {:.1} ms, p99 {:.1} ms at {} tokens/s of prefill; {} waited longer than recomputing the {} tier tokens they waited for ({} of them got no tier token)\n",
        p.requests_waited,
        p.wait_p50_ms,
        p.wait_p99_ms,
        p.max_wait_steps,
        p.ttft_p50_ms,
        p.ttft_p99_ms,
        p.prefill_tokens_per_s,
        p.waited_longer_than_recompute,
        p.tokens_of_those,
        p.waited_for_nothing
    );
    o += &format!(
        "  load or recompute     a wait less the recompute of the tier tokens it brought: p50 {:.1} ms, p99 {:.1} ms; load policy {} (--load-policy), {} promotions declined, {} probes not waited for, {} load jobs cut ({} blocks not landed)\n",
        p.wait_over_recompute_p50_ms,
        p.wait_over_recompute_p99_ms,
        if p.load_policy { "on" } else { "off" },
        p.promotions_declined,
        p.probes_not_waited,
        p.load_jobs_cut,
        p.promotions_cut
    );
    o += &format!(
        "  promotions unused     {} blocks ({:.2} GiB) promoted into DRAM that no request was served from afterwards\n",
        r.promotions_unused,
        gib(r.promotions_unused_bytes)
    );
    let planned = r.inputs.sim.restart_at.is_some() || r.inputs.sim.restart_after.is_some();
    if planned && r.restart.is_none() {
        let why = if r.requests < r.requests_planned {
            "the run reached --duration first"
        } else {
            "the run admitted its last turn first"
        };
        o += &format!(
            "  restart               not reached: {why} (--restart-at / --restart-after)\n"
        );
    }
    if let Some(x) = &r.restart {
        o += &format!(
            "  restart               after {} requests; reopen {:.2} s; first tier hit {} after it; hit rate before {:.1}% of {} tokens, after {:.1}% of {} tokens\n",
            x.after_requests,
            x.reopen_s,
            x.first_tier_hit_after_s
                .map_or("never".to_string(), |s| format!("{s:.2} s")),
            pct(x.before_hit_rate),
            x.before_prompt_tokens,
            pct(x.after_hit_rate),
            x.after_prompt_tokens
        );
    }
    o += &format!("  the offline model     {}\n", m.assumes);
    if let Some(n) = r.blocks_found_at_open.filter(|n| *n > 0) {
        o += &format!(
            "  reused root           {n} block files were there at open: they have no history here (a miss of one reads as first use, and the offline model starts cold)\n"
        );
    }
    if r.events_dropped > 0 {
        o += &format!(
            "  events dropped        {} event keys (event_buffer_keys): the attribution misses their histories\n",
            r.events_dropped
        );
    }
    let sim = &r.inputs.sim;
    if !sim.sync_steps {
        o += "  (to compare runs, use --sync-steps: the same seed gives the same counts while no obj tier answers late)\n";
    } else {
        // what --sync-steps cannot make the same from run to run
        let mut wall = Vec::new();
        if r.requests < r.requests_planned {
            wall.push("the run was cut by --duration, a wall-clock point");
        }
        if sim.fs_write_budget_mb_per_s.is_some() {
            wall.push("the fs write budget is a rate on the wall clock");
        }
        if sim.s3_endpoint.is_some() || sim.s3_embedded {
            wall.push("the obj tier's probes answer at their own pace");
        }
        if !wall.is_empty() {
            o += &format!(
                "  (--sync-steps, but another run of the same seed may differ: {})\n",
                wall.join("; ")
            );
        }
    }
    o
}

/// `GB/s` of a tier's run average, with its ratio to the startup probe's figure when there
/// is one (a tier's average over the whole run against what the disk or server does flat
/// out; `what` names it).
fn rate_vs(gb_per_s: f64, probe_gb_per_s: Option<f64>, what: &str) -> String {
    match probe_gb_per_s {
        Some(d) if d > 0.0 => format!("{gb_per_s:.2} GB/s, {:.2}x {what}", gb_per_s / d),
        _ => format!("{gb_per_s:.2} GB/s"),
    }
}

/// The three lines of a tier: its rates against the disk probe, or for the obj tier the
/// server probe measured, against that.
fn render_tier(t: &TierReport, disk: Option<&DiskProbe>, server: Option<&ServerProbe>) -> String {
    let server = server.filter(|s| s.tier == t.name);
    let (read, write, what) = match (server, disk) {
        (Some(s), _) => (Some(s.get_gb_per_s), Some(s.put_gb_per_s), "the server"),
        (None, Some(d)) => (Some(d.read_gb_per_s), Some(d.write_gb_per_s), "the disk"),
        (None, None) => (None, None, ""),
    };
    let loading = match t.read_gb_per_s_loading {
        Some(l) => format!("; {} while loading", rate_vs(l, read, what)),
        None => String::new(),
    };
    let mut o = String::new();
    o += &format!(
        "  tier {:<16} {} blocks promoted, read {:.2} GiB ({}{loading}), wrote {:.2} GiB ({}), a load job (its blocks for one request) p50 {:.1} ms p99 {:.1} ms\n",
        t.name,
        t.blocks_loaded,
        gib(t.bytes_read),
        rate_vs(t.read_gb_per_s, read, what),
        gib(t.bytes_written),
        rate_vs(t.write_gb_per_s, write, what),
        t.load_p50_ms,
        t.load_p99_ms,
    );
    o += &format!(
        "  {:<21} failed loads {} ({}), failed stores {} ({}), probes timed out {} / failed {}, lookups the tier cut at its own deadline {}\n",
        "",
        t.load_failures,
        t.load_failure_causes.summary(),
        t.store_failures,
        t.store_failure_causes.summary(),
        t.probe_timeouts,
        t.probe_errors,
        t.own_deadline_lookups
    );
    o += &format!(
        "  {:<21} {} keys known without a probe ({} held, {} not), probe p50 {:.1} ms p99 {:.1} ms, {} key lookups waited for it (Retry), {} past the probe budget, {} late answers; write-back peak {:.1} MiB, {} writes dropped\n",
        "",
        t.known_held + t.known_absent,
        t.known_held,
        t.known_absent,
        t.probe_p50_ms,
        t.probe_p99_ms,
        t.retry_waits,
        t.probes_over_budget,
        t.late_answers,
        t.write_back_peak_bytes as f64 / (1u64 << 20) as f64,
        t.writes_dropped
    );
    if let (Some(held), Some(bound)) = (t.held_bytes, t.bound_bytes) {
        o += &format!(
            "  {:<21} holds {} at the end by its own count, {:.2}x its {} bound\n",
            "",
            size(held, 3),
            held as f64 / bound.max(1) as f64,
            size(bound, 2)
        );
    }
    o += &format!(
        "  {:<21} holds {} blocks at the end by its events, {} of them dead ({:.1}%: behind a block of their chain it does not hold)\n",
        "",
        t.blocks_at_end,
        t.dead_blocks_at_end,
        100.0 * t.dead_blocks_at_end as f64 / t.blocks_at_end.max(1) as f64
    );
    if t.not_admitted + t.over_write_budget > 0 {
        o += &format!(
            "  {:<21} admission: {} blocks not admitted (too few lookups), {} over the write budget\n",
            "", t.not_admitted, t.over_write_budget
        );
    }
    o
}

/// The two lines of the fs GC.
fn render_gc(g: &GcReport) -> String {
    let mut o = String::new();
    o += &format!(
        "  fs GC                 {} sweeps ({} ended over the cap), {} files swept ({} within grace), {} mtime stamps, skipped {} in flight / {} in grace\n",
        g.sweeps,
        g.sweeps_over_cap,
        g.swept_files,
        g.grace_overridden,
        g.stamps,
        g.skipped_in_flight,
        g.skipped_in_grace
    );
    if g.store_waits > 0 {
        o += &format!(
            "  fs hard ceiling       {} stores reached it and made room (or waited for it), {} refused for want of room\n",
            g.store_waits, g.no_room
        );
    }
    o += &format!(
        "  fs on disk            {} allocated at the end ({:.2}x the {} cap, whose hard ceiling is {}, {:.2}x; {} of it directories, {} dead by the chain links it was sent: {:.1}% of the cap), peak {} ({:.2}x)\n",
        size(g.bytes, 3),
        g.bytes as f64 / g.cap_bytes as f64,
        size(g.cap_bytes, 2),
        size(g.hard_ceiling_bytes, 3),
        g.hard_ceiling_bytes as f64 / g.cap_bytes.max(1) as f64,
        size(g.dir_bytes, 3),
        size(g.dead_bytes, 3),
        100.0 * g.dead_bytes as f64 / g.cap_bytes.max(1) as f64,
        size(g.peak_bytes, 3),
        g.peak_bytes as f64 / g.cap_bytes as f64
    );
    o
}

/// `b` bytes in a unit that shows them: GiB with `digits` decimals from a GiB up (as the
/// sizes a run is configured in), else MiB or KiB with one (a cap of 0.005 GiB reads 5.1 MiB,
/// not 0.01 GiB). Zero is `0 B`.
pub(super) fn size(b: u64, digits: usize) -> String {
    let f = b as f64;
    match b {
        0 => "0 B".to_string(),
        b if b >= 1 << 30 => format!("{:.*} GiB", digits, gib(b)),
        b if b >= 1 << 20 => format!("{:.1} MiB", f / (1u64 << 20) as f64),
        _ => format!("{:.1} KiB", f / 1024.0),
    }
}

pub(super) fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The report of a run with no requests, to fill in by hand.
    fn empty_report() -> Report {
        fill(
            &SimConfig::default(),
            &Tally::default(),
            &ManagerStats::default(),
            None,
            Duration::from_secs(1),
            Duration::ZERO,
        )
    }

    /// A disk probe of 1.6 GB/s writing, 1.2 GB/s reading.
    fn disk_probe() -> DiskProbe {
        DiskProbe {
            bytes: 1 << 26,
            block_bytes: 1 << 21,
            write_gb_per_s: 1.6,
            read_gb_per_s: 1.2,
            write_threads: 8,
            read_threads: 8,
        }
    }

    #[test]
    fn a_tier_rate_is_shown_as_a_ratio_of_the_disk_probe() {
        assert_eq!(
            rate_vs(0.5, Some(2.0), "the disk"),
            "0.50 GB/s, 0.25x the disk"
        );
        assert_eq!(rate_vs(0.5, None, "the disk"), "0.50 GB/s");
        assert_eq!(rate_vs(0.5, Some(0.0), "the disk"), "0.50 GB/s");
        let mut r = empty_report();
        r.tiers.push(TierReport {
            read_gb_per_s: 0.3,
            write_gb_per_s: 0.4,
            ..tier_report(&TierStats::default(), 1.0)
        });
        r.disk = Some(disk_probe());
        let text = render(&r);
        assert!(
            text.contains("(0.30 GB/s, 0.25x the disk)")
                && text.contains("(0.40 GB/s, 0.25x the disk)"),
            "{text}"
        );
    }

    #[test]
    fn the_obj_tiers_rates_are_shown_against_the_server_probe_and_while_loading() {
        let mut r = empty_report();
        let named = |name: &str| TierStats {
            name: name.into(),
            ..TierStats::default()
        };
        r.tiers.push(TierReport {
            read_gb_per_s: 0.3,
            write_gb_per_s: 0.4,
            ..tier_report(&named("fs"), 1.0)
        });
        r.tiers.push(TierReport {
            read_gb_per_s: 0.1,
            read_gb_per_s_loading: Some(0.15),
            write_gb_per_s: 0.05,
            ..tier_report(&named("obj"), 1.0)
        });
        r.disk = Some(disk_probe());
        r.server = Some(ServerProbe {
            tier: "obj".into(),
            bytes: 1 << 27,
            object_bytes: 1 << 21,
            in_flight: 16,
            put_gb_per_s: 0.25,
            get_gb_per_s: 0.2,
        });
        let text = render(&r);
        assert!(
            text.contains("0.25 GB/s PUT, 0.20 GB/s GET (plain object_store, 16 in flight as the obj tier's io_threads, 128 MiB in 2048 KiB objects"),
            "{text}"
        );
        assert!(text.contains("(0.30 GB/s, 0.25x the disk)"), "{text}");
        assert!(
            text.contains(
                "(0.10 GB/s, 0.50x the server; 0.15 GB/s, 0.75x the server while loading)"
            ) && text.contains("(0.05 GB/s, 0.20x the server)"),
            "{text}"
        );
    }
}
