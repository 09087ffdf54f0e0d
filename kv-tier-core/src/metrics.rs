//! Metrics through the [`metrics`] facade: kv-tier records to whatever recorder the process
//! installed (Prometheus, OpenTelemetry, statsd...), and to nothing when none is (each call is
//! then a no-op). The library installs no recorder; the `kv-tier` crate's `prometheus`
//! feature has a helper that does, and serves the Prometheus text format.
//!
//! Two kinds of figures, all named `kv_tier_...` with the tier's name as the label `tier`:
//!
//! - **Histograms, recorded as they happen**: probe latency
//!   ([`PROBE_SECONDS`]), job latency per direction ([`JOB_SECONDS`]), and the promotion wait
//!   ([`PROMOTION_WAIT_SECONDS`]: from the first lookup of a key by a request still tracked to
//!   its block being readable in DRAM).
//! - **Counters and gauges, published from the statistics**:
//!   [`TieringManager::publish_metrics`](crate::TieringManager::publish_metrics) writes the
//!   manager's counters (lookups by verdict, blocks and bytes per tier and direction, failures
//!   by cause, probe outcomes, write-back, DRAM occupancy) and every tier's own
//!   ([`SecondaryTier::stats`](crate::SecondaryTier::stats): `kv_tier_<type>_<figure>`, e.g.
//!   `kv_tier_fs_gc_swept_files_total`) as they are now. Call it before each scrape (the
//!   `kv-tier` helper does) or every few seconds.
//!
//! The recorder's counters belong to the process: each manager adds what it counted since
//! it last published ([`MetricsPublisher`]), so a counter is the sum over every manager the
//! process had, and never goes back (a manager replaced by a new one, or two at once, do
//! not hide each other's counts). Gauges are levels: with several managers alive, the one
//! that published last sets them. Histograms are recorded by every manager as it goes.
//!
//! Counters end in `_total`; sizes are in bytes (`_bytes`), times in seconds (`_seconds`: a
//! tier's figures in microseconds or milliseconds are converted).

use std::sync::Mutex;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};
use rustc_hash::FxHashMap;

use crate::stats::{FailureCauses, Figure, FigureKind, Figures, ManagerStats};
use crate::sync::lock;

/// What one manager has published of each counter (name and labels): the next publication
/// adds only what it counted since.
type Book = Mutex<FxHashMap<String, u64>>;

/// Probe batch latency, per tier (histogram, seconds).
pub const PROBE_SECONDS: &str = "kv_tier_probe_seconds";
/// Job latency, per tier and `direction` (`store` or `load`) (histogram, seconds).
pub const JOB_SECONDS: &str = "kv_tier_job_seconds";
/// From a request's first lookup of a key to its block readable in DRAM, per tier the block
/// was promoted from (histogram, seconds).
pub const PROMOTION_WAIT_SECONDS: &str = "kv_tier_promotion_wait_seconds";
/// Lookups answered, by `verdict` (`hit`, `hit_pending`, `retry`, `miss`).
pub const LOOKUPS_TOTAL: &str = "kv_tier_lookups_total";

pub(crate) fn record_probe(tier: &str, took: std::time::Duration) {
    histogram!(PROBE_SECONDS, "tier" => tier.to_string()).record(took.as_secs_f64());
}

pub(crate) fn record_job(tier: &str, direction: &'static str, took: std::time::Duration) {
    histogram!(JOB_SECONDS, "tier" => tier.to_string(), "direction" => direction)
        .record(took.as_secs_f64());
}

pub(crate) fn record_promotion_wait(tier: &str, waited: std::time::Duration) {
    histogram!(PROMOTION_WAIT_SECONDS, "tier" => tier.to_string()).record(waited.as_secs_f64());
}

fn describe() {
    describe_histogram!(
        PROBE_SECONDS,
        metrics::Unit::Seconds,
        "Latency of a tier's existence probe batches."
    );
    describe_histogram!(
        JOB_SECONDS,
        metrics::Unit::Seconds,
        "Latency of store and load jobs, per tier and direction."
    );
    describe_histogram!(
        PROMOTION_WAIT_SECONDS,
        metrics::Unit::Seconds,
        "From a request's first lookup of a key to its block readable in DRAM."
    );
    describe_counter!(LOOKUPS_TOTAL, "Lookups answered, by verdict.");
}

fn to_labels(labels: &[(&'static str, String)]) -> Vec<metrics::Label> {
    labels
        .iter()
        .map(|(k, v)| metrics::Label::new(*k, v.clone()))
        .collect()
}

/// Adds to the process's counter `name{labels}` what this manager counted since it last
/// published it (`v` is the manager's total). A total below the last one published (two
/// publications racing, the older last) adds nothing.
fn set_counter(book: &Book, name: &str, help: &str, labels: &[(&'static str, String)], v: u64) {
    describe_counter!(name.to_string(), help.to_string());
    let mut key = name.to_string();
    for (l, lv) in labels {
        key.push('\u{0}');
        key.push_str(l);
        key.push('=');
        key.push_str(lv);
    }
    let mut book = lock(book);
    let last = book.entry(key).or_insert(0);
    // registered even at 0, so every series is there from the first scrape
    counter!(name.to_string(), to_labels(labels)).increment(v.saturating_sub(*last));
    *last = (*last).max(v);
}

fn set_gauge(name: &str, help: &str, labels: &[(&'static str, String)], v: f64) {
    describe_gauge!(name.to_string(), help.to_string());
    gauge!(name.to_string(), to_labels(labels)).set(v);
}

fn causes(book: &Book, name: &str, help: &str, tier: &str, c: &FailureCauses) {
    for (cause, v) in [
        ("missing", c.missing),
        ("corrupt", c.corrupt),
        ("timed_out", c.timed_out),
        ("panicked", c.panicked),
        ("no_space", c.no_space),
        ("shutdown", c.shutdown),
        ("other", c.other),
    ] {
        set_counter(
            book,
            name,
            help,
            &[("tier", tier.to_string()), ("cause", cause.to_string())],
            v,
        );
    }
}

/// The metric a tier's figure becomes: `kv_tier_<prefix>_<name>`, `_total` added to
/// counters. A figure in microseconds or milliseconds (`_us`, `_ms`: how long something
/// took) becomes a gauge in seconds. Returns the name, its kind and the value.
pub fn figure_metric(prefix: &str, f: &Figure) -> (String, FigureKind, f64) {
    let (stem, kind, value) = if let Some(stem) = f.name.strip_suffix("_us") {
        (stem, FigureKind::Gauge, f.value as f64 / 1e6)
    } else if let Some(stem) = f.name.strip_suffix("_ms") {
        (stem, FigureKind::Gauge, f.value as f64 / 1e3)
    } else {
        (f.name.as_str(), f.kind, f.value as f64)
    };
    let mut name = format!("kv_tier_{prefix}_{stem}");
    if stem.len() != f.name.len() {
        name.push_str("_seconds");
    }
    if kind == FigureKind::Counter && !name.ends_with("_total") {
        name.push_str("_total");
    }
    (name, kind, value)
}

fn publish_figure(book: &Book, prefix: &str, f: &Figure, tier: &str) {
    let (name, kind, v) = figure_metric(prefix, f);
    let labels = [("tier", tier.to_string())];
    match kind {
        FigureKind::Counter => set_counter(book, &name, &f.help, &labels, v as u64),
        FigureKind::Gauge => set_gauge(&name, &f.help, &labels, v),
    }
}

/// Publishes one manager's statistics to the installed recorder (a manager holds one:
/// [`TieringManager::publish_metrics`](crate::TieringManager::publish_metrics)). It remembers
/// what it published of each counter, so each publication adds only what was counted since:
/// the process's counters sum every manager's (see the module docs).
#[derive(Debug, Default)]
pub struct MetricsPublisher {
    book: Book,
}

impl MetricsPublisher {
    /// A publisher that has published nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Writes `s` (the manager's statistics, DRAM blocks of `block_size` bytes) to the
    /// installed recorder: counters by what they grew since this publisher's last call,
    /// gauges as levels.
    pub fn publish(&self, s: &ManagerStats, block_size: usize) {
        publish(&self.book, s, block_size);
    }
}

fn publish(book: &Book, s: &ManagerStats, block_size: usize) {
    describe();
    let none: &[(&'static str, String)] = &[];
    for (verdict, v) in [
        ("hit", s.hits),
        ("hit_pending", s.hits_pending),
        ("retry", s.retries),
        ("miss", s.misses),
    ] {
        set_counter(
            book,
            LOOKUPS_TOTAL,
            "Lookups answered, by verdict.",
            &[("verdict", verdict.to_string())],
            v,
        );
    }
    for (cause, v) in s.misses_by_cause.by_cause() {
        set_counter(
            book,
            "kv_tier_misses_total",
            "Lookups answered Miss, by cause (see MissCause).",
            &[("cause", cause.to_string())],
            v,
        );
    }
    set_counter(
        book,
        "kv_tier_promotions_refused_total",
        "Lookups that found a block in a secondary tier but no DRAM slot to promote it into.",
        none,
        s.promotions_refused,
    );
    set_counter(
        book,
        "kv_tier_dram_events_dropped_total",
        "DRAM event keys dropped because its buffer was full.",
        none,
        s.events_dropped
            .saturating_sub(s.tiers.iter().map(|t| t.events_dropped).sum::<u64>()),
    );
    set_counter(
        book,
        "kv_tier_stores_not_admitted_total",
        "Keys prepare_store left out: not looked up store_threshold times.",
        none,
        s.stores_not_admitted,
    );
    set_counter(
        book,
        "kv_tier_stores_refused_for_write_back_total",
        "prepare_store calls refused because a wait tier's write-back was at its limit.",
        none,
        s.stores_refused_for_write_back,
    );
    set_gauge(
        "kv_tier_write_back_pinned_bytes",
        "DRAM bytes pinned by store jobs now.",
        none,
        s.write_back_pinned_bytes as f64,
    );
    set_gauge(
        "kv_tier_held_blocks",
        "Promoted DRAM blocks held for requests that have not read them yet.",
        none,
        s.held_blocks as f64,
    );
    let bs = block_size as f64;
    let p = &s.primary;
    set_gauge(
        "kv_tier_dram_capacity_bytes",
        "DRAM tier capacity.",
        none,
        p.capacity_blocks as f64 * bs,
    );
    set_gauge(
        "kv_tier_dram_used_bytes",
        "DRAM slots holding a readable block or being written.",
        none,
        (p.ready_blocks + p.writing_blocks) as f64 * bs,
    );
    set_counter(
        book,
        "kv_tier_dram_evictions_total",
        "Blocks evicted from DRAM.",
        none,
        p.evictions,
    );
    set_counter(
        book,
        "kv_tier_dram_refused_stores_total",
        "DRAM store reservations refused for lack of room.",
        none,
        p.refused_stores,
    );
    for t in &s.tiers {
        let tier = || vec![("tier", t.name.clone())];
        let c = |name: &str, help: &str, v: u64| set_counter(book, name, help, &tier(), v);
        let g = |name: &str, help: &str, v: f64| set_gauge(name, help, &tier(), v);
        c(
            "kv_tier_tier_hits_total",
            "Lookups answered HitPending because this tier had the block.",
            t.hits,
        );
        c(
            "kv_tier_retry_waits_total",
            "Keys of lookups answered Retry while this tier's probe was out.",
            t.retry_waits,
        );
        c(
            "kv_tier_events_dropped_total",
            "Event keys dropped because the tier's buffer was full.",
            t.events_dropped,
        );
        c(
            "kv_tier_not_admitted_total",
            "Blocks not written to the tier: not looked up admit_after_lookups times.",
            t.not_admitted,
        );
        c(
            "kv_tier_over_write_budget_total",
            "Blocks not written to the tier: its write budget (bytes/s) was spent.",
            t.over_write_budget,
        );
        c(
            "kv_tier_store_jobs_total",
            "Store jobs finished.",
            t.store_jobs,
        );
        c(
            "kv_tier_load_jobs_total",
            "Load jobs finished.",
            t.load_jobs,
        );
        c(
            "kv_tier_blocks_stored_total",
            "Blocks stored in the tier (present ones included).",
            t.blocks_stored,
        );
        c(
            "kv_tier_stored_bytes_total",
            "Bytes stored in the tier.",
            t.bytes_stored,
        );
        c(
            "kv_tier_blocks_loaded_total",
            "Blocks loaded from the tier into DRAM.",
            t.blocks_loaded,
        );
        c(
            "kv_tier_loaded_bytes_total",
            "Bytes loaded from the tier.",
            t.bytes_loaded,
        );
        causes(
            book,
            "kv_tier_store_failures_total",
            "Blocks whose store failed, by cause.",
            &t.name,
            &t.store_failure_causes,
        );
        causes(
            book,
            "kv_tier_load_failures_total",
            "Blocks whose load failed, by cause.",
            &t.name,
            &t.load_failure_causes,
        );
        c(
            "kv_tier_jobs_timed_out_total",
            "Jobs abandoned at their deadline.",
            t.jobs_timed_out,
        );
        c(
            "kv_tier_jobs_panicked_total",
            "Jobs whose tier panicked.",
            t.jobs_panicked,
        );
        c(
            "kv_tier_promotions_cancelled_total",
            "Queued promotions not sent because their request finished first.",
            t.promotions_cancelled,
        );
        c(
            "kv_tier_promotions_declined_total",
            "Blocks whose promotion the load-or-recompute policy declined.",
            t.promotions_declined,
        );
        c(
            "kv_tier_probes_not_waited_total",
            "Key lookups whose probe the load-or-recompute policy did not wait for.",
            t.probes_not_waited,
        );
        c(
            "kv_tier_load_jobs_cut_total",
            "Load jobs the load-or-recompute policy cut mid-way.",
            t.load_jobs_cut,
        );
        c(
            "kv_tier_promotions_cut_total",
            "Blocks of cut load jobs that had not landed, recomputed instead.",
            t.promotions_cut,
        );
        g(
            "kv_tier_write_back_bytes",
            "Bytes of store jobs queued or in flight to the tier.",
            t.write_back_bytes as f64,
        );
        c(
            "kv_tier_writes_dropped_total",
            "Blocks not written to the tier because its write-back was full (policy drop).",
            t.writes_dropped,
        );
        let pr = &t.probes;
        c("kv_tier_probes_total", "Probe batches sent.", pr.probes);
        for (outcome, v) in [("found", pr.keys_found), ("absent", pr.keys_absent)] {
            set_counter(
                book,
                "kv_tier_probe_keys_total",
                "Keys answered by probes, by outcome.",
                &[("tier", t.name.clone()), ("outcome", outcome.to_string())],
                v,
            );
        }
        for (outcome, v) in [("held", pr.known_present), ("absent", pr.known_absent)] {
            set_counter(
                book,
                "kv_tier_known_keys_total",
                "Keys the tier answered from its own index, with no probe, by outcome.",
                &[("tier", t.name.clone()), ("outcome", outcome.to_string())],
                v,
            );
        }
        for (outcome, v) in [
            ("error", pr.probe_errors),
            ("deadline", pr.probe_timeouts),
            ("panic", pr.probe_panics),
        ] {
            set_counter(
                book,
                "kv_tier_probe_failures_total",
                "Probe batches that failed, by outcome (their keys count as absent).",
                &[("tier", t.name.clone()), ("outcome", outcome.to_string())],
                v,
            );
        }
        c(
            "kv_tier_probe_over_budget_total",
            "Lookups that stopped waiting for the tier's probe at the probe budget.",
            pr.over_budget,
        );
        c(
            "kv_tier_probe_late_answers_total",
            "Probe batches that answered after the budget.",
            pr.late_answers,
        );
        c(
            "kv_tier_probe_stale_answers_total",
            "Probe answers discarded because a store or failed load superseded them.",
            pr.stale_answers,
        );
        g(
            "kv_tier_tracked_keys",
            "Keys the tier's lookup state tracks.",
            t.tracked_keys as f64,
        );
        g(
            "kv_tier_leased_keys",
            "Keys found present and protected until promoted.",
            t.leased_keys as f64,
        );
        let own = &t.own;
        if let Some(used) = own.used_bytes {
            g(
                "kv_tier_tier_used_bytes",
                "Bytes the tier holds, as it counts them.",
                used as f64,
            );
        }
        if let Some(cap) = own.capacity_bytes {
            g(
                "kv_tier_tier_capacity_bytes",
                "The tier's bound.",
                cap as f64,
            );
        }
        if own.kind.is_empty() {
            continue;
        }
        // what every block-storing tier counts: kv_tier_tier_blocks_written_total, ...
        let mut figures = Vec::new();
        own.blocks.figures("", "", &mut figures);
        for f in &figures {
            publish_figure(book, "tier", f, &t.name);
        }
        for f in &own.figures {
            publish_figure(book, &own.kind, f, &t.name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figures_become_prometheus_names_in_base_units() {
        let f = |name: &str, kind, value| Figure::new(name.into(), "", kind, value);
        use FigureKind::{Counter, Gauge};
        assert_eq!(
            figure_metric("fs", &f("gc_swept_files", Counter, 3)),
            ("kv_tier_fs_gc_swept_files_total".into(), Counter, 3.0)
        );
        assert_eq!(
            figure_metric("fs", &f("gc_last_sweep_us", Counter, 1_500_000)),
            ("kv_tier_fs_gc_last_sweep_seconds".into(), Gauge, 1.5)
        );
        assert_eq!(
            figure_metric("fs", &f("gc_adopt_ms", Counter, 250)),
            ("kv_tier_fs_gc_adopt_seconds".into(), Gauge, 0.25)
        );
        assert_eq!(
            figure_metric("obj", &f("bytes", Gauge, 7)),
            ("kv_tier_obj_bytes".into(), Gauge, 7.0)
        );
        assert_eq!(
            figure_metric("x", &f("sent_total", Counter, 1)),
            ("kv_tier_x_sent_total".into(), Counter, 1.0)
        );
    }
}
