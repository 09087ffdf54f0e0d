//! The serving-workload simulator: plays an inference engine's scheduler driving
//! `TieringManager` over real tiers, with every loaded block verified byte for byte.

use std::collections::{HashMap, VecDeque};
use std::io::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_tier::fs::FsTier;
use kv_tier::{BlockKey, KvTierConfig, Namespace, RequestContext, RunFields, TieringManager};
use kv_tier_testkit::{Turn, Workload, WorkloadConfig, fill_block, verify_block};
use serde::Serialize;

/// Everything the simulator can be told.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Concurrent conversations.
    pub streams: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Shared prefixes in the pool (default 4 x streams).
    pub prefixes: usize,
    /// Tokens of a shared prefix.
    pub prefix_tokens: usize,
    /// New prompt tokens per turn.
    pub prompt_tokens: usize,
    /// Output tokens per turn.
    pub output_tokens: usize,
    /// Tokens per block (and per prefix hash).
    pub tokens_per_block: usize,
    /// Model shape: layers.
    pub layers: usize,
    /// Model shape: KV heads.
    pub kv_heads: usize,
    /// Model shape: head dimension.
    pub head_dim: usize,
    /// Model shape: bytes per element.
    pub dtype_bytes: usize,
    /// Simulated GPU prefix cache, in blocks.
    pub gpu_cache_blocks: usize,
    /// Requests the scheduler runs at once.
    pub max_batch: usize,
    /// Simulated prefill speed of missed tokens.
    pub prefill_tokens_per_s: f64,
    /// Stop admitting new turns after this long.
    pub duration: Duration,
    /// Workload seed.
    pub seed: u64,
    /// DRAM for the primary tier, in bytes.
    pub dram_bytes: u64,
    /// The fs tier's root (default: a fresh temp dir, removed at the end).
    pub root_dir: Option<PathBuf>,
    /// The fs tier's cap in GiB (`None`: unbounded).
    pub fs_cap_gb: Option<f64>,
    /// A tier config JSON (vLLM-shaped) replacing the built-in one.
    pub config_json: Option<String>,
    /// An S3 endpoint: adds an `obj` tier below the fs tier.
    pub s3_endpoint: Option<String>,
    /// The bucket of the `obj` tier.
    pub s3_bucket: String,
    /// Access key of the `obj` tier (empty: the AWS credential chain).
    pub s3_access_key: String,
    /// Secret key of the `obj` tier.
    pub s3_secret_key: String,
    /// Region of the `obj` tier.
    pub s3_region: String,
    /// The fs tier's GC timing (seconds): capacity-check interval, stamp interval, grace.
    /// Seconds-scale by default, for a run that lasts a minute.
    pub fs_gc_interval_s: f64,
    /// See `fs_gc_interval_s`.
    pub fs_gc_stamp_s: f64,
    /// See `fs_gc_interval_s`.
    pub fs_gc_grace_s: f64,
    /// Wait for every job at the end of each step, and run the fs GC there (stamps, then a
    /// sweep) instead of on its thread: same seed, same hit counts while the fs tier is under
    /// its cap, and the cap is checked after every sweep.
    pub sync_steps: bool,
    /// Print a live progress line.
    pub progress: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            streams: 64,
            turns: 5,
            prefixes: 256,
            prefix_tokens: 10_000,
            prompt_tokens: 4096,
            output_tokens: 512,
            tokens_per_block: 16,
            layers: 1,
            kv_heads: 2,
            head_dim: 64,
            dtype_bytes: 2,
            gpu_cache_blocks: 4096,
            max_batch: 8,
            prefill_tokens_per_s: 200_000.0,
            duration: Duration::from_secs(70),
            seed: 1,
            dram_bytes: 512 << 20,
            root_dir: None,
            fs_cap_gb: Some(0.75),
            config_json: None,
            s3_endpoint: None,
            s3_bucket: "kv-tier".into(),
            s3_access_key: String::new(),
            s3_secret_key: String::new(),
            s3_region: "us-east-1".into(),
            fs_gc_interval_s: 1.0,
            fs_gc_stamp_s: 1.0,
            fs_gc_grace_s: 2.0,
            sync_steps: false,
            progress: true,
        }
    }
}

impl SimConfig {
    /// Bytes of one block: layers x KV heads x head dim x dtype x 2 (K and V) x tokens.
    pub fn block_bytes(&self) -> usize {
        self.layers * self.kv_heads * self.head_dim * self.dtype_bytes * 2 * self.tokens_per_block
    }

    fn tier_config(&self, root: &std::path::Path) -> Result<KvTierConfig, kv_tier_core::Error> {
        let mut cfg = self.tier_config_as_given(root)?;
        if self.sync_steps {
            // the simulator runs the fs GC at the end of each step, not on its thread
            for t in cfg.secondary_tiers.iter_mut().filter(|t| t.kind == "fs") {
                t.options.insert("gc_background".into(), false.into());
            }
        }
        Ok(cfg)
    }

    fn tier_config_as_given(
        &self,
        root: &std::path::Path,
    ) -> Result<KvTierConfig, kv_tier_core::Error> {
        if let Some(text) = &self.config_json {
            return KvTierConfig::from_json_str(text);
        }
        let mut fs = serde_json::json!({
            "type": "fs",
            "root_dir": root,
            "n_read_threads": 8,
            "n_write_threads": 8,
            "checksum": "crc32c",
        });
        if let Some(cap) = self.fs_cap_gb {
            // Seconds-scale GC for a run that lasts a minute.
            let o = fs.as_object_mut().expect("object");
            o.insert("gc_max_size_gb".into(), cap.into());
            o.insert("gc_interval_s".into(), self.fs_gc_interval_s.into());
            o.insert("gc_stamp_interval_s".into(), self.fs_gc_stamp_s.into());
            o.insert("gc_grace_s".into(), self.fs_gc_grace_s.into());
        }
        let mut tiers = vec![fs];
        if let Some(endpoint) = &self.s3_endpoint {
            tiers.push(serde_json::json!({
                "type": "obj",
                "bucket": self.s3_bucket,
                "endpoint_override": endpoint,
                "access_key": self.s3_access_key,
                "secret_key": self.s3_secret_key,
                "region": self.s3_region,
                "scheme": if endpoint.starts_with("http://") { "http" } else { "https" },
                "prefix": "serve-sim",
                "io_threads": 16,
                "checksum": "crc32c",
            }));
        }
        let v = serde_json::json!({
            "cpu_bytes_to_use": self.dram_bytes,
            "block_size_bytes": self.block_bytes(),
            "eviction_policy": "lru",
            "secondary_tiers": tiers,
        });
        KvTierConfig::from_value(v)
    }
}

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
}

/// GC figures of the fs tier.
#[derive(Debug, Clone, Serialize, PartialEq, Default)]
pub struct GcReport {
    /// The cap, bytes.
    pub cap_bytes: u64,
    /// What the tier holds on disk at the end: allocated bytes of its files and directories.
    pub bytes: u64,
    /// The most it held at any time.
    pub peak_bytes: u64,
    /// The part of `bytes` that is directories.
    pub dir_bytes: u64,
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
    /// Events emitted (stored + removed).
    pub events: u64,
    /// Removal events.
    pub removal_events: u64,
    /// Prefill time the tiers saved at the configured rate, seconds.
    pub prefill_seconds_saved: f64,
}

/// A simulated GPU prefix cache: LRU over block keys.
struct GpuCache {
    cap: usize,
    order: VecDeque<(BlockKey, u64)>,
    seq: HashMap<BlockKey, u64>,
    next: u64,
}

impl GpuCache {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            order: VecDeque::new(),
            seq: HashMap::new(),
            next: 0,
        }
    }
    fn contains(&self, k: &BlockKey) -> bool {
        self.seq.contains_key(k)
    }
    fn insert(&mut self, k: BlockKey) {
        self.next += 1;
        self.seq.insert(k, self.next);
        self.order.push_back((k, self.next));
        while self.seq.len() > self.cap {
            let Some((old, s)) = self.order.pop_front() else {
                break;
            };
            if self.seq.get(&old) == Some(&s) {
                self.seq.remove(&old);
            }
        }
        if self.order.len() > 4 * self.cap + 64 {
            let seq = &self.seq;
            self.order.retain(|(k, s)| seq.get(k) == Some(s));
        }
    }
}

enum Phase {
    Lookup { waited: u32 },
    Finish,
}

struct Active {
    turn: Turn,
    ctx: RequestContext,
    phase: Phase,
    /// Keys answered `HitPending` for this request: a promotion brought them up from a
    /// secondary tier. The other hits were already in DRAM.
    promoted: std::collections::HashSet<BlockKey>,
}

/// Runs the simulation and returns its report. Fails on a bad config, an I/O error, or a
/// block that came back with wrong bytes.
pub fn run(cfg: &SimConfig) -> Result<Report, Box<dyn std::error::Error>> {
    if cfg.streams == 0 || cfg.turns == 0 || cfg.tokens_per_block == 0 {
        return Err("--streams, --turns and --tokens-per-block must be positive".into());
    }
    let mut tmp = None;
    let root = match &cfg.root_dir {
        Some(r) => r.clone(),
        None => {
            let t = tempfile::Builder::new().prefix("kv-tier-sim-").tempdir()?;
            let p = t.path().to_path_buf();
            tmp = Some(t);
            p
        }
    };
    let tier_cfg = cfg.tier_config(&root)?;
    let block = tier_cfg.block_size_bytes as usize;
    if block != cfg.block_bytes() {
        return Err(format!(
            "the config's block_size_bytes ({block}) differs from the model shape's block size ({})",
            cfg.block_bytes()
        )
        .into());
    }
    let ns = Namespace::new(
        RunFields::new(
            "kv-tier/serve-sim",
            "torch.bfloat16",
            cfg.tokens_per_block as u64,
        ),
        0,
    )?;
    let mut registry = kv_tier::registry();
    kv_tier_testkit::MemoryTier::register(&mut registry);
    let manager = kv_tier::builder(tier_cfg)?
        .registry(registry)
        .namespace(ns)
        .build_blocking()?;
    let rt = manager.runtime().clone();
    // the first fs tier, typed, for its GC figures and (with `sync_steps`) to drive its GC
    let fs: Option<Arc<FsTier>> = manager
        .config()
        .secondary_tiers
        .iter()
        .find(|t| t.kind == "fs")
        .and_then(|t| manager.tier::<FsTier>(&t.name));
    let fs_gc = || fs.as_ref().and_then(|t| t.stats().gc);

    let bpb = cfg.tokens_per_block;
    let mut workload = Workload::new(WorkloadConfig {
        seed: cfg.seed,
        streams: cfg.streams,
        turns: cfg.turns,
        prefix_pool: cfg.prefixes.max(1),
        prefix_blocks: cfg.prefix_tokens / bpb,
        prompt_blocks: cfg.prompt_tokens / bpb,
        output_blocks: cfg.output_tokens / bpb,
        group: 0,
    });
    let planned = workload.total_turns() as u64;
    let mut gpu = GpuCache::new(cfg.gpu_cache_blocks);
    let mut active: Vec<Active> = Vec::new();
    let mut r = Report {
        seconds: 0.0,
        drain_seconds: 0.0,
        requests: 0,
        requests_planned: planned,
        steps: 0,
        block_bytes: block as u64,
        prompt_tokens: 0,
        tokens_from_gpu_cache: 0,
        tokens_from_dram: 0,
        tokens_from_secondary: 0,
        tokens_recomputed: 0,
        lookups: 0,
        lookup_hits: 0,
        lookup_hits_pending: 0,
        lookup_retries: 0,
        lookup_misses: 0,
        blocks_verified: 0,
        blocks_corrupt: 0,
        hit_rate: 0.0,
        dram_evictions: 0,
        stores_refused: 0,
        stores_refused_write_back: 0,
        write_back_pinned_peak_bytes: 0,
        tiers: Vec::new(),
        gc: None,
        events: 0,
        removal_events: 0,
        prefill_seconds_saved: 0.0,
    };
    let started = Instant::now();
    let mut last_progress = Instant::now() - Duration::from_secs(1);
    let mut exhausted = false;
    let mut events = (0u64, 0u64);
    let mut corrupt_keys: Vec<BlockKey> = Vec::new();
    let mut max_after_sweep: Option<u64> = None;
    while !(active.is_empty() && exhausted) {
        r.steps += 1;
        // admit new turns
        while active.len() < cfg.max_batch && !exhausted {
            if started.elapsed() >= cfg.duration {
                exhausted = true;
                break;
            }
            match workload.next() {
                Some(turn) => active.push(Active {
                    ctx: RequestContext::new(turn.request),
                    turn,
                    phase: Phase::Lookup { waited: 0 },
                    promoted: Default::default(),
                }),
                None => exhausted = true,
            }
        }
        let mut computed_this_step = 0u64;
        let mut i = 0;
        while i < active.len() {
            let a = &mut active[i];
            match a.phase {
                Phase::Lookup { waited } => {
                    let keys = &a.turn.keys;
                    let g = keys.iter().take_while(|k| gpu.contains(k)).count();
                    let verdicts = manager.lookup_many(&keys[g..], &a.ctx);
                    for (k, v) in keys[g..].iter().zip(&verdicts) {
                        if *v == kv_tier_core::LookupResult::HitPending {
                            a.promoted.insert(*k);
                        }
                    }
                    let c = kv_tier_core::count_prefix(verdicts);
                    let settled = !c.retry && c.present == c.hit;
                    if !settled && waited < 200 {
                        a.phase = Phase::Lookup { waited: waited + 1 };
                        i += 1;
                        continue;
                    }
                    let h = c.hit;
                    // the engine copies the hit blocks DRAM -> GPU: verify every byte
                    let views = manager.prepare_load(&keys[g..g + h])?;
                    for (k, v) in keys[g..g + h].iter().zip(&views) {
                        if verify_block(k, 0, v.as_slice()) {
                            r.blocks_verified += 1;
                        } else {
                            r.blocks_corrupt += 1;
                            corrupt_keys.push(*k);
                        }
                    }
                    drop(views);
                    manager.touch(&keys[..g + h]);
                    for k in &keys[..g + h] {
                        gpu.insert(*k);
                    }
                    let total = keys.len() as u64 * bpb as u64;
                    r.prompt_tokens += total;
                    r.tokens_from_gpu_cache += (g * bpb) as u64;
                    let served = (h * bpb) as u64;
                    let promoted = keys[g..g + h]
                        .iter()
                        .filter(|k| a.promoted.contains(k))
                        .count();
                    r.tokens_from_secondary += (promoted * bpb) as u64;
                    r.tokens_from_dram += ((h - promoted) * bpb) as u64;
                    let recomputed = total - (g * bpb) as u64 - served;
                    r.tokens_recomputed += recomputed;
                    computed_this_step += recomputed + (a.turn.output.len() * bpb) as u64;
                    // prefill computes the rest; offload it with the output
                    let mut new: Vec<BlockKey> = keys[g + h..].to_vec();
                    new.extend(&a.turn.output);
                    for chunk in new.chunks(64) {
                        match manager.prepare_store(chunk) {
                            Ok(mut p) => {
                                for (k, sink) in p.slots() {
                                    fill_block(k, 0, sink.as_mut_slice());
                                }
                                p.commit(a.ctx.id);
                                if cfg.sync_steps {
                                    // the cascade lands before any probe of this step is sent
                                    rt.block_on(manager.wait_jobs());
                                }
                            }
                            // DRAM full of pinned blocks, or write-back at its limit: these
                            // are not offloaded (recomputed next time), as an engine would do.
                            Err(kv_tier_core::Error::WriteBackFull { .. }) => {
                                r.stores_refused_write_back += 1
                            }
                            Err(_) => r.stores_refused += 1,
                        }
                        for k in chunk {
                            gpu.insert(*k);
                        }
                    }
                    a.phase = Phase::Finish;
                    i += 1;
                }
                Phase::Finish => {
                    manager.on_request_finished(a.ctx.id);
                    r.requests += 1;
                    active.swap_remove(i);
                }
            }
        }
        manager.on_schedule_end();
        // the GPU is busy prefilling (and decoding) while the tiers move data
        if computed_this_step > 0 && cfg.prefill_tokens_per_s > 0.0 {
            let secs = computed_this_step as f64 / cfg.prefill_tokens_per_s;
            std::thread::sleep(Duration::from_secs_f64(secs.min(1.0)));
        }
        if cfg.sync_steps {
            rt.block_on(manager.wait_idle());
            if let Some(fs) = &fs
                && let Some(before) = fs.stats().gc
            {
                fs.gc_apply_stamps_now()?;
                fs.gc_sweep_now()?;
                let after = fs.stats().gc.expect("bounded");
                if after.sweeps > before.sweeps {
                    max_after_sweep = Some(max_after_sweep.unwrap_or(0).max(after.bytes));
                }
            }
        }
        for e in manager.take_events() {
            events.0 += 1;
            if e.removed {
                events.1 += 1;
            }
        }
        if cfg.progress && last_progress.elapsed() >= Duration::from_millis(250) {
            last_progress = Instant::now();
            progress_line(&manager, &r, started.elapsed());
        }
        if r.blocks_corrupt > 0 {
            break;
        }
    }
    let run_secs = started.elapsed().as_secs_f64();
    let drain_started = Instant::now();
    rt.block_on(manager.wait_idle());
    r.drain_seconds = drain_started.elapsed().as_secs_f64();
    for e in manager.take_events() {
        events.0 += 1;
        if e.removed {
            events.1 += 1;
        }
    }
    if cfg.progress {
        progress_line(&manager, &r, started.elapsed());
        eprintln!();
    }
    let secs = run_secs;
    let s = manager.stats();
    r.seconds = secs;
    r.write_back_pinned_peak_bytes = s.write_back_pinned_peak_bytes;
    r.lookups = s.lookups;
    r.lookup_hits = s.hits;
    r.lookup_hits_pending = s.hits_pending;
    r.lookup_retries = s.retries;
    r.lookup_misses = s.misses;
    r.dram_evictions = s.primary.evictions;
    for t in &s.tiers {
        r.tiers.push(TierReport {
            name: t.name.clone(),
            hits: t.hits,
            blocks_loaded: t.blocks_loaded,
            bytes_read: t.bytes_loaded,
            bytes_written: t.bytes_stored,
            blocks_stored: t.blocks_stored,
            read_gb_per_s: t.bytes_loaded as f64 / secs / 1e9,
            write_gb_per_s: t.bytes_stored as f64 / secs / 1e9,
            load_p50_ms: t.load_latency.quantile(0.5).as_secs_f64() * 1e3,
            load_p99_ms: t.load_latency.quantile(0.99).as_secs_f64() * 1e3,
            load_failures: t.load_failures,
            load_failure_causes: t.load_failure_causes,
            store_failures: t.store_failures,
            store_failure_causes: t.store_failure_causes,
            probe_timeouts: t.probes.probe_timeouts,
            probe_errors: t.probes.probe_errors + t.probes.probe_panics,
            writes_dropped: t.writes_dropped,
            write_back_peak_bytes: t.write_back_peak_bytes,
            probe_p50_ms: t.probe_latency.quantile(0.5).as_secs_f64() * 1e3,
            probe_p99_ms: t.probe_latency.quantile(0.99).as_secs_f64() * 1e3,
            probes_over_budget: t.probes.over_budget,
            late_answers: t.probes.late_answers,
        });
    }
    if let Some(g) = fs_gc() {
        r.gc = Some(GcReport {
            cap_bytes: g.cap_bytes,
            bytes: g.bytes,
            peak_bytes: g.peak_bytes,
            dir_bytes: g.dir_bytes,
            grace_overridden: g.grace_overridden,
            sweeps_over_cap: g.sweeps_over_cap,
            max_bytes_after_step_sweep: max_after_sweep,
            sweeps: g.sweeps,
            swept_files: g.swept_files,
            skipped_in_flight: g.skipped_in_flight,
            skipped_in_grace: g.skipped_in_grace,
            stamps: g.stamps,
        });
    }
    r.events = events.0;
    r.removal_events = events.1;
    r.hit_rate = if r.prompt_tokens == 0 {
        0.0
    } else {
        1.0 - r.tokens_recomputed as f64 / r.prompt_tokens as f64
    };
    let from_tiers = r.prompt_tokens - r.tokens_recomputed - r.tokens_from_gpu_cache;
    r.prefill_seconds_saved = if cfg.prefill_tokens_per_s > 0.0 {
        from_tiers as f64 / cfg.prefill_tokens_per_s
    } else {
        0.0
    };
    rt.block_on(manager.shutdown())?;
    drop(manager);
    if let Some(t) = tmp {
        // The layout makes a directory per block or two: delete in parallel, it is quicker.
        if cfg.progress {
            eprintln!(
                "removing the temporary cache directory {}",
                t.path().display()
            );
        }
        remove_tree(t.path(), 4);
    }
    if let Some(k) = corrupt_keys.first() {
        return Err(format!(
            "correctness oracle: {} block(s) came back with wrong bytes (first: {k})",
            corrupt_keys.len()
        )
        .into());
    }
    Ok(r)
}

/// Removes a directory tree with `threads` threads (one subtree of the second level each).
fn remove_tree(root: &std::path::Path, threads: usize) {
    let mut subtrees = Vec::new();
    for top in std::fs::read_dir(root).into_iter().flatten().flatten() {
        for sub in std::fs::read_dir(top.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            subtrees.push(sub.path());
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(p) = subtrees.get(i) else { break };
                    if p.is_dir() {
                        let _ = std::fs::remove_dir_all(p);
                    } else {
                        let _ = std::fs::remove_file(p);
                    }
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(root);
}

fn progress_line(m: &TieringManager, r: &Report, elapsed: Duration) {
    let s = m.stats();
    let secs = elapsed.as_secs_f64().max(1e-9);
    let read: u64 = s.tiers.iter().map(|t| t.bytes_loaded).sum();
    let wrote: u64 = s.tiers.iter().map(|t| t.bytes_stored).sum();
    let hit = if r.prompt_tokens == 0 {
        0.0
    } else {
        100.0 * (1.0 - r.tokens_recomputed as f64 / r.prompt_tokens as f64)
    };
    let done = r.requests as f64 / r.requests_planned.max(1) as f64;
    let width = 24;
    let filled = (done * width as f64) as usize;
    eprint!(
        "\r[{}{}] {:>4}/{} req {:>5.1}s  hit {:>5.1}%  read {:>5.2} GB/s  write {:>5.2} GB/s  ",
        "#".repeat(filled),
        "-".repeat(width - filled.min(width)),
        r.requests,
        r.requests_planned,
        secs,
        hit,
        read as f64 / secs / 1e9,
        wrote as f64 / secs / 1e9
    );
    let _ = std::io::stderr().flush();
}

/// The report as text.
pub fn render(r: &Report) -> String {
    let mut o = String::new();
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    o += &format!(
        "kv-tier serve_sim report ({:.1} s, {} steps; then {:.1} s draining write-back)\n",
        r.seconds, r.steps, r.drain_seconds
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
        "  hit rate              {:.1}% of prompt tokens not recomputed\n",
        100.0 * r.hit_rate
    );
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
    for t in &r.tiers {
        o += &format!(
            "  tier {:<16} {} blocks promoted, read {:.2} GiB ({:.2} GB/s), wrote {:.2} GiB ({:.2} GB/s), load job p50 {:.1} ms p99 {:.1} ms\n",
            t.name,
            t.blocks_loaded,
            gib(t.bytes_read),
            t.read_gb_per_s,
            gib(t.bytes_written),
            t.write_gb_per_s,
            t.load_p50_ms,
            t.load_p99_ms,
        );
        o += &format!(
            "  {:<21} failed loads {} ({}), failed stores {} ({}), probes timed out {} / failed {}\n",
            "",
            t.load_failures,
            t.load_failure_causes.summary(),
            t.store_failures,
            t.store_failure_causes.summary(),
            t.probe_timeouts,
            t.probe_errors
        );
        o += &format!(
            "  {:<21} probe p50 {:.1} ms p99 {:.1} ms, {} lookups past the probe budget, {} late answers; write-back peak {:.1} MiB, {} writes dropped\n",
            "",
            t.probe_p50_ms,
            t.probe_p99_ms,
            t.probes_over_budget,
            t.late_answers,
            t.write_back_peak_bytes as f64 / (1u64 << 20) as f64,
            t.writes_dropped
        );
    }
    if let Some(g) = &r.gc {
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
        o += &format!(
            "  fs on disk            {:.3} GiB allocated at the end ({:.2}x the {:.2} GiB cap; {:.3} GiB of it directories), peak {:.3} GiB ({:.2}x)\n",
            gib(g.bytes),
            g.bytes as f64 / g.cap_bytes as f64,
            gib(g.cap_bytes),
            gib(g.dir_bytes),
            gib(g.peak_bytes),
            g.peak_bytes as f64 / g.cap_bytes as f64
        );
    }
    o += &format!(
        "  events                {} ({} removals)\n",
        r.events, r.removal_events
    );
    o += &format!(
        "  prefill time saved    {:.1} s at the configured rate\n",
        r.prefill_seconds_saved
    );
    o
}
