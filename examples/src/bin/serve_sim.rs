//! serve_sim: plays an inference engine's scheduler over kv-tier's real tiers (DRAM, fs in a
//! temp dir with a GC cap) on a multi-turn, prefix-sharing workload, with a live progress line
//! and a report. Every block loaded from any tier is verified byte for byte.
//!
//! `cargo run --release -p kv-tier-examples --bin serve_sim -- --help`
//!
//! Every default `--help` shows is read from `SimConfig::default()`, so the two cannot
//! disagree.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser};
use kv_tier_examples::sim::offline::{Policy, Trace, replay};
use kv_tier_examples::sim::{
    DEFAULT_DRAM_BLOCKS, DEFAULT_FS_BLOCKS, DEFAULT_MODEL, PRESETS, SimConfig, WORKLOADS, preset,
    render, run, workload_preset,
};

/// serve_sim: a serving-workload simulator over kv-tier's tiers
#[derive(Debug, Parser)]
#[command(name = "serve_sim")]
struct Cli {
    #[command(flatten)]
    workload: WorkloadArgs,
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    tiers: TierArgs,
    #[command(flatten)]
    output: OutputArgs,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Workload")]
struct WorkloadArgs {
    /// A workload preset: default (8 conversations x 20 turns over 32 shared 1k-token
    /// prefixes), long-context (4 x 24 turns growing to ~30k tokens), shared-prompt (32 users
    /// x 4 short turns over 2 shared 2k-token system prompts); the flags below change one
    /// size of it
    #[arg(long, value_name = "NAME", value_parser = workload_name, default_value = "default")]
    workload: String,
    /// Concurrent conversations (1 to 100,000)
    #[arg(long, value_name = "N", value_parser = bounded::<1, 100_000>, allow_negative_numbers = true, default_value_t = SimConfig::default().streams)]
    streams: usize,
    /// Turns per conversation (1 to 1,000,000)
    #[arg(long, value_name = "N", value_parser = bounded::<1, 1_000_000>, allow_negative_numbers = true, default_value_t = SimConfig::default().turns)]
    turns: usize,
    /// Shared prefixes in the pool, 1 to 1,000,000 [default: 4 x streams]
    #[arg(long, value_name = "N", value_parser = bounded::<1, 1_000_000>)]
    prefixes: Option<usize>,
    /// Tokens per shared prefix (0 to 1,000,000)
    #[arg(long, value_name = "N", value_parser = bounded::<0, 1_000_000>, allow_negative_numbers = true, default_value_t = SimConfig::default().prefix_tokens)]
    prefix_tokens: usize,
    /// New prompt tokens per turn (0 to 1,000,000)
    #[arg(long, value_name = "N", value_parser = bounded::<0, 1_000_000>, allow_negative_numbers = true, default_value_t = SimConfig::default().prompt_tokens)]
    prompt_tokens: usize,
    /// Output tokens per turn (0 to 1,000,000)
    #[arg(long, value_name = "N", value_parser = bounded::<0, 1_000_000>, allow_negative_numbers = true, default_value_t = SimConfig::default().output_tokens)]
    output_tokens: usize,
    /// Tokens per block (1 to 65,536)
    #[arg(long, value_name = "N", value_parser = bounded::<1, 65_536>, allow_negative_numbers = true, default_value_t = SimConfig::default().tokens_per_block)]
    tokens_per_block: usize,
    /// Workload seed
    #[arg(long, value_name = "N", allow_negative_numbers = true, default_value_t = SimConfig::default().seed)]
    seed: u64,
    /// Stop admitting turns after this long
    #[arg(long, value_name = "SECONDS", value_parser = seconds, allow_negative_numbers = true,
          default_value_t = SimConfig::default().duration.as_secs_f64())]
    duration: f64,
}

#[derive(Debug, Args)]
#[command(
    next_help_heading = "Model shape (block bytes = layers x kv-heads x head-dim x dtype-bytes x 2 x tokens-per-block)"
)]
struct ModelArgs {
    /// A model preset: tiny (8 KiB blocks), qwen3-0.6b (1.75 MiB), llama-8b (2 MiB),
    /// llama-70b (5 MiB); the flags below change one dimension of it
    #[arg(long, value_name = "NAME", value_parser = model_name, default_value = DEFAULT_MODEL)]
    model: String,
    /// Layers, 1 to 4,096 [default: the preset's]
    #[arg(long, value_name = "N", value_parser = bounded::<1, 4_096>)]
    layers: Option<usize>,
    /// KV heads, 1 to 4,096 [default: the preset's]
    #[arg(long, value_name = "N", value_parser = bounded::<1, 4_096>)]
    kv_heads: Option<usize>,
    /// Head dimension, 1 to 65,536 [default: the preset's]
    #[arg(long, value_name = "N", value_parser = bounded::<1, 65_536>)]
    head_dim: Option<usize>,
    /// Bytes per element, 1 to 16 [default: the preset's]
    #[arg(long, value_name = "N", value_parser = bounded::<1, 16>)]
    dtype_bytes: Option<usize>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Engine")]
struct EngineArgs {
    /// Simulated GPU prefix cache, in blocks (0 to 100,000,000)
    #[arg(long, value_name = "N", value_parser = bounded::<0, 100_000_000>, allow_negative_numbers = true, default_value_t = SimConfig::default().gpu_cache_blocks)]
    gpu_cache_blocks: usize,
    /// Requests scheduled at once (1 to 100,000)
    #[arg(long, value_name = "N", value_parser = bounded::<1, 100_000>, allow_negative_numbers = true, default_value_t = SimConfig::default().max_batch)]
    max_batch: usize,
    /// Steps a request waits for its promotions at most before it takes what is there and
    /// recomputes the rest (1 to 1,000,000)
    #[arg(long, value_name = "N", value_parser = bounded_u64::<1, 1_000_000>, allow_negative_numbers = true,
          default_value_t = SimConfig::default().max_wait_steps as u64)]
    max_wait_steps: u64,
    /// Shut the manager down mid-run and reopen it on the same root after this long (the
    /// engine finishes its running requests first; its GPU cache goes too)
    #[arg(long, value_name = "SECONDS", value_parser = seconds, conflicts_with = "restart_after")]
    restart_at: Option<f64>,
    /// As --restart-at, after this many requests (deterministic with --sync-steps)
    #[arg(long, value_name = "N", value_parser = bounded_u64::<1, 1_000_000_000>)]
    restart_after: Option<u64>,
    /// Simulated prefill speed of missed tokens, tokens/s (0: none; finite)
    #[arg(long, value_name = "X", allow_negative_numbers = true, value_parser = rate,
          default_value_t = SimConfig::default().prefill_tokens_per_s)]
    prefill_tokens_per_s: f64,
    /// Give the manager the prefill rate: it declines the part of a prefix whose load would
    /// end later than recomputing it (load or recompute)
    #[arg(long)]
    load_policy: bool,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Tiers")]
struct TierArgs {
    /// DRAM for the primary tier, in MiB (1 to 16,777,216: 16 TiB); not given, 512 blocks of
    /// the model's (the default below is 512 of the default model's 2 MiB blocks)
    #[arg(long, value_name = "N", value_parser = bounded_u64::<1, 16_777_216>, allow_negative_numbers = true,
          default_value_t = SimConfig::default().dram_bytes >> 20)]
    dram_mb: u64,
    /// DRAM's eviction (the config's `eviction_policy`): lru (the library's default), chain (a
    /// chain's later blocks go before its earlier ones, least recent chain tail first) or arc
    #[arg(long, value_name = "POLICY", value_parser = ["lru", "chain", "arc"], default_value = "lru")]
    dram_eviction: String,
    /// The fs tier's directory [default: a fresh temp dir, removed at the end of the run
    /// (a run killed or interrupted leaves it, a valid cache directory)]
    #[arg(long, value_name = "DIR")]
    root_dir: Option<PathBuf>,
    /// The fs tier's GC cap in GiB, 0 for none, else 1e-9 to 1e9; not given, 2048 blocks of
    /// the model's (the default below is 2048 of the default model's 2 MiB blocks)
    #[arg(long, value_name = "X", value_parser = cap_gb, allow_negative_numbers = true,
          default_value_t = SimConfig::default().fs_cap_gb.unwrap_or(0.0))]
    fs_cap_gb: f64,
    /// The fs tier writes a block only once lookups asked for it N times (0: every block)
    #[arg(long, value_name = "N", default_value_t = 0)]
    fs_admit_after_lookups: u64,
    /// The fs tier's write budget in MiB/s (stores past it are dropped, counted)
    #[arg(long, value_name = "X", value_parser = budget_mb)]
    fs_write_budget_mb_per_s: Option<f64>,
    /// Eviction on the bounded fs and obj tiers: chain (a chain's later blocks go before its
    /// earlier ones, least recent chain tail first: the tiers' `chain_eviction`, the library's
    /// default) or lru (plain LRU)
    #[arg(long, value_name = "POLICY", value_parser = ["chain", "lru"], default_value = "chain")]
    eviction: String,
    /// No fs tier: DRAM, then the obj tier alone (the obj-only hierarchy; needs
    /// --s3-endpoint or --s3-embedded)
    #[arg(long, conflicts_with_all = ["root_dir", "fs_cap_gb", "fs_admit_after_lookups", "fs_write_budget_mb_per_s", "config_json", "instances", "compare_admission"])]
    no_fs: bool,
    /// Also an obj tier below fs (or alone, with --no-fs), on this S3 endpoint
    #[arg(long, value_name = "URL")]
    s3_endpoint: Option<String>,
    /// Also an obj tier below fs (or alone, with --no-fs), on an S3 server started in this
    /// process (objects in a temp dir; its own bucket and keys)
    #[arg(long, conflicts_with_all = ["s3_endpoint", "s3_bucket", "s3_access_key", "s3_secret_key"])]
    s3_embedded: bool,
    /// Its bucket
    #[arg(long, value_name = "NAME", default_value_t = SimConfig::default().s3_bucket)]
    s3_bucket: String,
    /// Its access key [default: the AWS credential chain]
    #[arg(long, value_name = "KEY", default_value_t = SimConfig::default().s3_access_key,
          hide_default_value = true)]
    s3_access_key: String,
    /// Its secret key
    #[arg(long, value_name = "KEY", default_value_t = SimConfig::default().s3_secret_key,
          hide_default_value = true)]
    s3_secret_key: String,
    /// Its region
    #[arg(long, value_name = "REGION", default_value_t = SimConfig::default().s3_region)]
    s3_region: String,
    /// The obj tier's bound in GiB (0: none): its capacity index then answers lookups
    #[arg(long, value_name = "X", value_parser = cap_gb, allow_negative_numbers = true,
          default_value_t = 0.0)]
    obj_cap_gb: f64,
    /// A vLLM-shaped tier config JSON instead of the tier flags above
    #[arg(long = "config", value_name = "FILE", value_parser = read_file)]
    config_json: Option<String>,
    /// Run this many instances (processes) of serve_sim on one shared fs root with one cap
    /// (`shared: true`): each its own engine and conversations (seeds seed..seed+N-1,
    /// wrapping past 2^64-1) over
    /// the same shared prefixes; prints each and the global figures (peak of the shared
    /// directory against its cap, wrong blocks, the leader lease). Needs --fs-cap-gb
    #[arg(long, value_name = "N", value_parser = positive, default_value_t = 1,
          conflicts_with_all = ["config_json", "compare_admission", "sync_steps", "trace", "s3_embedded", "restart_at", "restart_after"])]
    instances: usize,
    /// (set by --instances for each instance) this instance's id on the shared root
    #[arg(long, value_name = "ID", hide = true)]
    instance_id: Option<String>,
}

#[derive(Debug, Args)]
#[command(next_help_heading = "Output")]
struct OutputArgs {
    /// Also write the report as JSON
    #[arg(long, value_name = "FILE", value_parser = json_out)]
    json: Option<PathBuf>,
    /// Write the run's request trace (JSON lines): `serve_sim replay FILE` replays it
    /// offline under LRU, Belady's rule or no bound
    #[arg(long, value_name = "FILE", value_parser = json_out)]
    trace: Option<PathBuf>,
    /// Wait for every transfer at each step and run the fs GC there, on a clock of steps
    /// (same seed, same counts; not for a run cut by --duration, with an fs write budget or
    /// with an obj tier: the report says so)
    #[arg(long)]
    sync_steps: bool,
    /// No progress line
    #[arg(long)]
    no_progress: bool,
    /// Serve Prometheus metrics at ADDR (e.g. 127.0.0.1:9464; port 0: any) while it runs
    #[arg(long, value_name = "ADDR")]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Run the workload twice, without and with the fs tier's admission rule (the
    /// --fs-admit-after-lookups / --fs-write-budget-mb-per-s given, else admit after 2
    /// lookups), each in a fresh directory, and print them side by side
    #[arg(long, conflicts_with_all = ["root_dir", "config_json", "trace", "restart_at", "restart_after"])]
    compare_admission: bool,
}

/// A count that must be positive.
fn positive(v: &str) -> Result<usize, String> {
    match v.parse::<usize>() {
        Ok(0) => Err("must be positive".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a valid number ({e})")),
    }
}

/// A positive, finite number of seconds that fits a `Duration`.
fn seconds(v: &str) -> Result<f64, String> {
    let s: f64 = v.parse().map_err(|e| format!("not a valid number ({e})"))?;
    if !(s.is_finite() && s > 0.0) {
        return Err(format!("must be positive and finite (seconds), got {s}"));
    }
    Duration::try_from_secs_f64(s).map_err(|e| e.to_string())?;
    Ok(s)
}

/// A cap in GiB: 0 (none) or positive.
fn cap_gb(v: &str) -> Result<f64, String> {
    let gb: f64 = v.parse().map_err(|e| format!("not a valid number ({e})"))?;
    if !(gb == 0.0 || (1e-9..=1e9).contains(&gb)) {
        return Err(format!("must be 0 (none) or 1e-9 to 1e9, got {gb}"));
    }
    Ok(gb)
}

/// A count from `MIN` to `MAX`.
fn bounded_u64<const MIN: u64, const MAX: u64>(v: &str) -> Result<u64, String> {
    match v.parse::<u64>() {
        Ok(n) if (MIN..=MAX).contains(&n) => Ok(n),
        Ok(n) => Err(format!("must be {MIN} to {MAX}, got {n}")),
        Err(e) => Err(format!("not a valid number ({e})")),
    }
}

/// [`bounded_u64`] for `usize` fields (every `MAX` here fits one).
fn bounded<const MIN: u64, const MAX: u64>(v: &str) -> Result<usize, String> {
    bounded_u64::<MIN, MAX>(v).map(|n| n as usize)
}

/// A rate: 0 or positive, finite.
fn rate(v: &str) -> Result<f64, String> {
    let x: f64 = v.parse().map_err(|e| format!("not a valid number ({e})"))?;
    if !(x.is_finite() && x >= 0.0) {
        return Err(format!("must be 0 or positive and finite, got {x}"));
    }
    Ok(x)
}

/// The JSON report's path, checked before the run (its results are not lost at the end): not
/// a directory or a FIFO (writing one without a reader would block), in a directory that
/// exists.
fn json_out(v: &str) -> Result<PathBuf, String> {
    let p = PathBuf::from(v);
    match std::fs::metadata(&p) {
        Ok(m) if m.is_file() => Ok(p),
        Ok(m) if m.is_dir() => Err("is a directory".into()),
        Ok(_) => Err("is not a regular file (a device, a FIFO or a socket)".into()),
        Err(_) => {
            let dir = p
                .parent()
                .filter(|d| !d.as_os_str().is_empty())
                .unwrap_or(std::path::Path::new("."));
            if dir.is_dir() {
                Ok(p)
            } else {
                Err(format!("its directory {} does not exist", dir.display()))
            }
        }
    }
}

/// `v` if it is one of `names`, else an error listing them as `what`.
fn one_of<'a>(v: &str, names: impl Iterator<Item = &'a str>, what: &str) -> Result<String, String> {
    let names: Vec<&str> = names.collect();
    if names.contains(&v) {
        Ok(v.to_string())
    } else {
        Err(format!("no such {what}; {what}s: {}", names.join(", ")))
    }
}

/// A preset's name.
fn model_name(v: &str) -> Result<String, String> {
    one_of(v, PRESETS.iter().map(|p| p.name), "preset")
}

/// A workload preset's name.
fn workload_name(v: &str) -> Result<String, String> {
    one_of(v, WORKLOADS.iter().map(|w| w.name), "workload")
}

/// A write budget in MiB/s: positive.
fn budget_mb(v: &str) -> Result<f64, String> {
    match v.parse::<f64>() {
        Ok(x) if x.is_finite() && (0.001..=1e9).contains(&x) => Ok(x),
        Ok(x) => Err(format!("{x} is outside 0.001 to 1e9")),
        Err(e) => Err(e.to_string()),
    }
}

/// The text of a regular file, read without blocking on a FIFO.
fn read_file(path: &str) -> Result<String, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| e.to_string())?;
    let m = f.metadata().map_err(|e| e.to_string())?;
    if !m.is_file() {
        return Err(format!("not a regular file ({:?})", m.file_type()));
    }
    let mut text = String::new();
    f.read_to_string(&mut text).map_err(|e| e.to_string())?;
    Ok(text)
}

impl Cli {
    /// The simulator's config, the path of the JSON report if asked for, and whether to
    /// compare admission; `given` says which flags the command line gave (a workload preset
    /// and the model's block size fill in the others).
    fn into_config(
        self,
        given: &dyn Fn(&str) -> bool,
    ) -> (SimConfig, Option<PathBuf>, bool, usize) {
        let Self {
            workload: w,
            model: m,
            engine: e,
            tiers: t,
            output: o,
        } = self;
        let p = preset(&m.model).expect("checked by the parser");
        let layers = m.layers.unwrap_or(p.layers);
        let kv_heads = m.kv_heads.unwrap_or(p.kv_heads);
        let head_dim = m.head_dim.unwrap_or(p.head_dim);
        let dtype_bytes = m.dtype_bytes.unwrap_or(p.dtype_bytes);
        let model = if (layers, kv_heads, head_dim, dtype_bytes)
            == (p.layers, p.kv_heads, p.head_dim, p.dtype_bytes)
        {
            p.name.to_string()
        } else {
            format!("custom (from {})", p.name)
        };
        // a workload preset sets the sizes the command line did not
        let wp = workload_preset(&w.workload).expect("checked by the parser");
        let pick = |id: &str, flag: usize, preset: usize| if given(id) { flag } else { preset };
        let streams = pick("streams", w.streams, wp.streams);
        let turns = pick("turns", w.turns, wp.turns);
        let prefix_tokens = pick("prefix_tokens", w.prefix_tokens, wp.prefix_tokens);
        let prompt_tokens = pick("prompt_tokens", w.prompt_tokens, wp.prompt_tokens);
        let output_tokens = pick("output_tokens", w.output_tokens, wp.output_tokens);
        let prefixes = match w.prefixes {
            Some(n) => n,
            None if wp.name == "default" => 4 * streams,
            None => wp.prefixes,
        };
        let custom = [
            "streams",
            "turns",
            "prefixes",
            "prefix_tokens",
            "prompt_tokens",
            "output_tokens",
        ]
        .iter()
        .any(|id| given(id));
        let workload = if custom {
            format!("custom (from {})", wp.name)
        } else {
            wp.name.to_string()
        };
        let block_bytes =
            (layers * kv_heads * head_dim * dtype_bytes * 2 * w.tokens_per_block) as u64;
        // sizes not given: as many blocks of this model as the defaults hold of the default's
        let dram_bytes = if given("dram_mb") {
            t.dram_mb << 20
        } else {
            DEFAULT_DRAM_BLOCKS.saturating_mul(block_bytes)
        };
        let fs_cap_gb = if t.no_fs {
            None
        } else if given("fs_cap_gb") || t.config_json.is_some() {
            (t.fs_cap_gb > 0.0).then_some(t.fs_cap_gb)
        } else {
            Some(DEFAULT_FS_BLOCKS.saturating_mul(block_bytes) as f64 / (1u64 << 30) as f64)
        };
        let cfg = SimConfig {
            streams,
            turns,
            prefixes,
            prefix_tokens,
            prompt_tokens,
            output_tokens,
            workload,
            tokens_per_block: w.tokens_per_block,
            seed: w.seed,
            duration: Duration::from_secs_f64(w.duration),
            model,
            layers,
            kv_heads,
            head_dim,
            dtype_bytes,
            gpu_cache_blocks: e.gpu_cache_blocks,
            max_batch: e.max_batch,
            prefill_tokens_per_s: e.prefill_tokens_per_s,
            load_policy: e.load_policy,
            max_wait_steps: e.max_wait_steps as u32,
            restart_at: e.restart_at.map(Duration::from_secs_f64),
            restart_after: e.restart_after,
            dram_bytes,
            root_dir: t.root_dir,
            fs_cap_gb,
            fs_admit_after_lookups: t.fs_admit_after_lookups,
            fs_write_budget_mb_per_s: t.fs_write_budget_mb_per_s,
            chain_eviction: t.eviction == "chain",
            dram_eviction: t.dram_eviction,
            config_json: t.config_json,
            s3_endpoint: t.s3_endpoint,
            s3_embedded: t.s3_embedded,
            no_fs: t.no_fs,
            s3_bucket: t.s3_bucket,
            s3_access_key: t.s3_access_key,
            s3_secret_key: t.s3_secret_key,
            s3_region: t.s3_region,
            obj_cap_gb: (t.obj_cap_gb > 0.0).then_some(t.obj_cap_gb),
            sync_steps: o.sync_steps,
            progress: !o.no_progress,
            metrics_addr: o.metrics_addr,
            fs_instance_id: t.instance_id,
            trace: o.trace,
            ..SimConfig::default()
        };
        (cfg, o.json, o.compare_admission, t.instances)
    }
}

/// The tier flags `--config` replaces, by argument id.
const TIER_FLAGS: [&str; 14] = [
    "dram_mb",
    "dram_eviction",
    "root_dir",
    "fs_cap_gb",
    "fs_admit_after_lookups",
    "fs_write_budget_mb_per_s",
    "eviction",
    "s3_endpoint",
    "s3_bucket",
    "s3_access_key",
    "s3_secret_key",
    "s3_region",
    "obj_cap_gb",
    "s3_embedded",
];

/// The command line, parsed; with `--config`, the tier flags it replaces are refused rather
/// than silently ignored. A usage error exits with 2, `--help` with 0.
fn parse() -> (Cli, clap::ArgMatches) {
    use clap::{CommandFactory, FromArgMatches};
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if cli.tiers.config_json.is_some() {
        let given: Vec<String> = TIER_FLAGS
            .iter()
            .filter(|id| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine))
            .map(|id| format!("--{}", id.replace('_', "-")))
            .collect();
        if !given.is_empty() {
            Cli::command()
                .error(
                    clap::error::ErrorKind::ArgumentConflict,
                    format!(
                        "--config replaces the tier flags, and {} would be ignored: put them in the config (cpu_bytes_to_use, and each tier's own options)",
                        given.join(", ")
                    ),
                )
                .exit();
        }
    }
    (cli, matches)
}

/// Whether the command line gave the argument `id`.
fn given_in(matches: &clap::ArgMatches) -> impl Fn(&str) -> bool + '_ {
    |id| matches.value_source(id) == Some(clap::parser::ValueSource::CommandLine)
}

/// `serve_sim replay FILE --policy P`: a trace replayed offline.
#[derive(Debug, Parser)]
#[command(name = "serve_sim replay")]
struct ReplayCli {
    /// A trace `serve_sim --trace FILE` wrote
    file: PathBuf,
    /// The eviction policy: lru, opt (Belady's rule), pooled (Belady's rule on DRAM + fs
    /// blocks as one level), unbounded, or all
    #[arg(long, value_name = "POLICY", default_value = "all", value_parser = policy_name)]
    policy: String,
}

fn policy_name(v: &str) -> Result<String, String> {
    if v == "all" || Policy::parse(v).is_some() {
        Ok(v.to_string())
    } else {
        Err("must be lru, opt, pooled, unbounded or all".into())
    }
}

/// Runs `serve_sim replay`.
fn replay_main(args: Vec<String>) -> ExitCode {
    let cli = ReplayCli::parse_from(args);
    let trace = match Trace::read(&cli.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("serve_sim replay: {e}");
            return ExitCode::FAILURE;
        }
    };
    let policies: Vec<Policy> = match Policy::parse(&cli.policy) {
        Some(p) => vec![p],
        None => vec![Policy::Lru, Policy::Opt, Policy::Pooled, Policy::Unbounded],
    };
    let h = &trace.header;
    println!(
        "replay of {} ({} records; model: {} blocks, DRAM {}, below it {}, GPU cache {})",
        cli.file.display(),
        trace.records.len(),
        h.model_blocks()
            .map_or("unbounded".to_string(), |b| b.to_string()),
        h.dram_blocks,
        h.fs_blocks.map_or("none".to_string(), |b| b.to_string()),
        h.gpu_blocks
    );
    for p in policies {
        let s = replay(&trace, p);
        println!(
            "  {:<10} hit rate {:.1}% ({} of {} prompt blocks: {} from the GPU cache, {} from the cache below)",
            p.name(),
            100.0 * s.hit_rate(),
            s.from_gpu + s.from_cache,
            s.prompt_blocks,
            s.from_gpu,
            s.from_cache
        );
    }
    ExitCode::SUCCESS
}

/// The shared prefixes' tokens the workload holds at most (they are kept in memory).
const MAX_PREFIX_POOL_TOKENS: usize = 10_000_000;

fn main() -> ExitCode {
    let argv: Vec<String> = std::env::args().collect();
    if argv.get(1).map(String::as_str) == Some("replay") {
        return replay_main(argv[1..].to_vec());
    }
    let (cli, matches) = parse();
    let (cfg, json, compare, instances) = cli.into_config(&given_in(&matches));
    let usage = |msg: String| -> ! {
        use clap::CommandFactory;
        Cli::command()
            .error(clap::error::ErrorKind::ValueValidation, msg)
            .exit()
    };
    let max_block = kv_tier::core::config::MAX_BLOCK_SIZE;
    if cfg.block_bytes() as u64 > max_block {
        usage(format!(
            "--layers x --kv-heads x --head-dim x --dtype-bytes x 2 x --tokens-per-block make \
             blocks of {} bytes, over the {max_block} a manager takes",
            cfg.block_bytes()
        ));
    }
    if cfg.prefixes.saturating_mul(cfg.prefix_tokens) > MAX_PREFIX_POOL_TOKENS {
        usage(format!(
            "--prefixes ({}) x --prefix-tokens ({}) is over {MAX_PREFIX_POOL_TOKENS} tokens held \
             in memory",
            cfg.prefixes, cfg.prefix_tokens
        ));
    }
    if let (Some(t), Some(j)) = (&cfg.trace, &json)
        && (t == j
            || std::fs::canonicalize(t)
                .ok()
                .is_some_and(|t| std::fs::canonicalize(j).ok() == Some(t)))
    {
        usage(format!(
            "--trace and --json name one file ({}): the report would overwrite the trace",
            t.display()
        ));
    }
    kv_tier_examples::init_logging();
    // the workload is in whole blocks: say so where a size is not one
    for (flag, tokens) in [
        ("--prefix-tokens", cfg.prefix_tokens),
        ("--prompt-tokens", cfg.prompt_tokens),
        ("--output-tokens", cfg.output_tokens),
    ] {
        if tokens % cfg.tokens_per_block != 0 {
            eprintln!(
                "serve_sim: {flag} {tokens} is not a multiple of --tokens-per-block {}: it counts as {} whole blocks ({} tokens)",
                cfg.tokens_per_block,
                tokens / cfg.tokens_per_block,
                tokens / cfg.tokens_per_block * cfg.tokens_per_block
            );
        }
    }
    eprintln!(
        "serve_sim: model {} ({} KiB blocks), {} streams x {} turns over {} shared prefixes of {} tokens",
        cfg.model,
        cfg.block_bytes() >> 10,
        cfg.streams,
        cfg.turns,
        cfg.prefixes,
        cfg.prefix_tokens
    );
    if compare {
        return compare_admission(cfg, json);
    }
    if instances > 1 {
        return several_instances(&cfg, instances, json);
    }
    match run(&cfg) {
        Ok(mut report) => {
            report.inputs.argv = std::env::args().collect();
            print!("{}", render(&report));
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report).expect("report serializes");
                if let Err(e) = std::fs::write(&path, text + "\n") {
                    eprintln!("serve_sim: --json {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("serve_sim: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `--compare-admission`: the workload without, then with, the fs tier's admission rule.
fn compare_admission(cfg: SimConfig, json: Option<PathBuf>) -> ExitCode {
    let mut without = cfg.clone();
    without.fs_admit_after_lookups = 0;
    without.fs_write_budget_mb_per_s = None;
    let mut with = cfg;
    if with.fs_admit_after_lookups == 0 && with.fs_write_budget_mb_per_s.is_none() {
        with.fs_admit_after_lookups = 2;
    }
    let mut reports = Vec::new();
    for (what, c) in [("without admission", &without), ("with admission", &with)] {
        eprintln!("serve_sim: run {} of 2, {what}", reports.len() + 1);
        match run(c) {
            Ok(mut r) => {
                r.inputs.argv = std::env::args().collect();
                print!("{what}:\n{}", render(&r));
                reports.push(r);
            }
            Err(e) => {
                eprintln!("serve_sim: {e}");
                return ExitCode::FAILURE;
            }
        }
    }
    print!(
        "{}",
        kv_tier_examples::sim::render_admission_comparison(&reports[0], &reports[1])
    );
    if let Some(path) = json {
        let v = serde_json::json!({"without": reports[0], "with": reports[1]});
        let text = serde_json::to_string_pretty(&v).expect("reports serialize");
        if let Err(e) = std::fs::write(&path, text + "\n") {
            eprintln!("serve_sim: --json {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

fn several_instances(cfg: &SimConfig, k: usize, json: Option<PathBuf>) -> ExitCode {
    let Some(cap_gb) = cfg.fs_cap_gb else {
        eprintln!(
            "serve_sim: --instances needs --fs-cap-gb: a shared root is one bounded directory"
        );
        return ExitCode::FAILURE;
    };
    let scratch;
    let root = match &cfg.root_dir {
        Some(r) => r.clone(),
        None => match tempfile::Builder::new()
            .prefix("kv-tier-sim-shared-")
            .tempdir()
        {
            Ok(t) => {
                scratch = t;
                scratch.path().to_path_buf()
            }
            Err(e) => {
                eprintln!("serve_sim: a temp dir for the shared root: {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let args: Vec<String> = std::env::args().skip(1).collect();
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("serve_sim: this binary's path: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cap_bytes = (cap_gb * (1u64 << 30) as f64) as u64;
    match kv_tier_examples::sim::run_instances(
        &exe,
        &kv_tier_examples::sim::child_args(&args),
        &root,
        k,
        cfg.seed,
        cap_bytes,
    ) {
        Ok(report) => {
            print!("{}", kv_tier_examples::sim::render_instances(&report));
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report).expect("report serializes");
                if let Err(e) = std::fs::write(&path, text + "\n") {
                    eprintln!("serve_sim: --json {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            if report.blocks_corrupt > 0 {
                eprintln!(
                    "serve_sim: {} blocks came back with wrong bytes",
                    report.blocks_corrupt
                );
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("serve_sim: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_flags_give_the_default_config() {
        let (cfg, json, compare, instances) =
            Cli::parse_from(["serve_sim"]).into_config(&|_| false);
        assert_eq!(cfg, SimConfig::default());
        assert_eq!(json, None);
        assert!(!compare);
        assert_eq!(instances, 1);
    }
}
