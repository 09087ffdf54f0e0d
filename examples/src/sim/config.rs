//! What the simulator can be told: [`SimConfig`], its defaults (the binary's `--help` shows
//! these), and the tier config it makes of them.

use std::path::{Path, PathBuf};
use std::time::Duration;

use kv_tier::KvTierConfig;

/// A model shape: what makes a block's size (with the tokens per block).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ModelPreset {
    /// Its name (`--model`).
    pub name: &'static str,
    /// What it stands for.
    pub about: &'static str,
    /// Layers.
    pub layers: usize,
    /// KV heads (grouped-query attention).
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Bytes per element (2: bf16).
    pub dtype_bytes: usize,
}

/// The model shapes `--model` knows. Blocks of 16 tokens: 8 KiB, 1.75 MiB, 2 MiB, 5 MiB.
pub const PRESETS: &[ModelPreset] = &[
    ModelPreset {
        name: "tiny",
        about: "a toy shape (1 layer, 2 KV heads): tests and quick runs",
        layers: 1,
        kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
    },
    ModelPreset {
        name: "qwen3-0.6b",
        about: "a 0.6B-class model (Qwen3-0.6B: 28 layers, 8 KV heads, head dim 128, bf16)",
        layers: 28,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    },
    ModelPreset {
        name: "llama-8b",
        about: "an 8B-class model (Llama-3.1-8B: 32 layers, 8 KV heads, head dim 128, bf16)",
        layers: 32,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    },
    ModelPreset {
        name: "llama-70b",
        about: "a 70B-class model (Llama-3.1-70B: 80 layers, 8 KV heads, head dim 128, bf16)",
        layers: 80,
        kv_heads: 8,
        head_dim: 128,
        dtype_bytes: 2,
    },
];

/// The preset named `name`.
pub fn preset(name: &str) -> Option<&'static ModelPreset> {
    PRESETS.iter().find(|p| p.name == name)
}

/// The default model: MiB-sized blocks, so the run's GB/s say something about the disk.
pub const DEFAULT_MODEL: &str = "llama-8b";

/// A workload shape serving engines have (`--workload`): the conversation's sizes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct WorkloadPreset {
    /// Its name.
    pub name: &'static str,
    /// What it stands for.
    pub about: &'static str,
    /// Concurrent conversations.
    pub streams: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Shared prefixes in the pool.
    pub prefixes: usize,
    /// Tokens per shared prefix.
    pub prefix_tokens: usize,
    /// New prompt tokens per turn.
    pub prompt_tokens: usize,
    /// Output tokens per turn.
    pub output_tokens: usize,
}

/// The workloads `--workload` knows.
pub const WORKLOADS: &[WorkloadPreset] = &[
    WorkloadPreset {
        name: "default",
        about: "8 conversations x 20 turns over 32 shared 1k-token prefixes, 256 new tokens a turn",
        streams: 8,
        turns: 20,
        prefixes: 32,
        prefix_tokens: 1024,
        prompt_tokens: 256,
        output_tokens: 64,
    },
    WorkloadPreset {
        name: "long-context",
        about: "4 conversations x 24 turns growing to ~30k tokens (1k prompt + 256 output a turn over a 2k prefix): early blocks are touched less",
        streams: 4,
        turns: 24,
        prefixes: 4,
        prefix_tokens: 2048,
        prompt_tokens: 1024,
        output_tokens: 256,
    },
    WorkloadPreset {
        name: "shared-prompt",
        about: "32 users x 4 short turns over 2 shared 2k-token system prompts",
        streams: 32,
        turns: 4,
        prefixes: 2,
        prefix_tokens: 2048,
        prompt_tokens: 128,
        output_tokens: 64,
    },
];

/// The workload preset named `name`.
pub fn workload_preset(name: &str) -> Option<&'static WorkloadPreset> {
    WORKLOADS.iter().find(|w| w.name == name)
}

/// DRAM in blocks when `--dram-mb` is not given (1 GiB of the default model's 2 MiB blocks).
pub const DEFAULT_DRAM_BLOCKS: u64 = 512;

/// The fs cap in blocks when `--fs-cap-gb` is not given (4 GiB of 2 MiB blocks).
pub const DEFAULT_FS_BLOCKS: u64 = 2048;

/// Steps a request waits for its promotions at most before it takes what is there, by
/// default (`--max-wait-steps`).
pub const DEFAULT_MAX_WAIT_STEPS: u32 = 200;

/// Everything the simulator can be told.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
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
    /// The model preset the shape below came from (`custom` when a dimension was changed).
    pub model: String,
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
    /// Give the manager the prefill rate (its load-or-recompute policy): it declines the
    /// part of a prefix whose load would end later than recomputing it.
    pub load_policy: bool,
    /// Stop admitting new turns after this long.
    pub duration: Duration,
    /// The workload preset the sizes above came from (`custom` when one was changed).
    pub workload: String,
    /// Steps a request waits for its promotions at most before it takes what is there (1 to
    /// 1,000,000).
    pub max_wait_steps: u32,
    /// Shut the manager down and reopen it on the same root after this long (the engine
    /// first finishes the requests it runs; its GPU cache is lost too).
    pub restart_at: Option<Duration>,
    /// As `restart_at`, after this many requests instead (deterministic with `sync_steps`).
    pub restart_after: Option<u64>,
    /// Write the run's request trace here (JSON lines; `serve_sim replay` reads it).
    pub trace: Option<PathBuf>,
    /// Workload seed.
    pub seed: u64,
    /// DRAM for the primary tier, in bytes.
    pub dram_bytes: u64,
    /// The fs tier's root (default: a fresh temp dir, removed at the end).
    pub root_dir: Option<PathBuf>,
    /// The fs tier's cap in GiB (`None`: unbounded).
    pub fs_cap_gb: Option<f64>,
    /// The fs tier's `admit_after_lookups` (0: every block).
    pub fs_admit_after_lookups: u64,
    /// The fs tier's `write_budget_mb_per_s` (`None`: no budget).
    pub fs_write_budget_mb_per_s: Option<f64>,
    /// `chain_eviction` on the fs and obj tiers (default true, as the library's): a chain's
    /// later blocks are evicted before its earlier ones; false: plain LRU.
    pub chain_eviction: bool,
    /// DRAM's `eviction_policy`: `lru` (the default, as the library's), `chain` or `arc`.
    pub dram_eviction: String,
    /// A tier config JSON (vLLM-shaped) replacing the built-in one.
    pub config_json: Option<String>,
    /// No fs tier: DRAM, then the `obj` tier alone (the obj-only hierarchy; needs
    /// `s3_endpoint` or `s3_embedded`).
    pub no_fs: bool,
    /// An S3 endpoint: adds an `obj` tier below the fs tier.
    pub s3_endpoint: Option<String>,
    /// Start an S3 server in this process (objects in a temp dir) for the `obj` tier, in
    /// place of `s3_endpoint` and its bucket and keys.
    pub s3_embedded: bool,
    /// The bucket of the `obj` tier.
    pub s3_bucket: String,
    /// The `obj` tier's bound in GiB (`max_size_gb`; `None`: unbounded).
    pub obj_cap_gb: Option<f64>,
    /// Access key of the `obj` tier (empty: the AWS credential chain).
    pub s3_access_key: String,
    /// Secret key of the `obj` tier.
    #[serde(serialize_with = "masked")]
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
    /// sweep) instead of on its thread, on a clock of steps (a step's files are equally
    /// recent, every use is stamped, nothing is spared for its age; the `fs_gc_*_s`
    /// windows are not used): same seed, same hit counts, over the fs tier's cap
    /// too, while no obj tier answers late; the cap is checked after every sweep.
    pub sync_steps: bool,
    /// Print a live progress line.
    pub progress: bool,
    /// Serve the Prometheus metrics at this address while the run lasts (port 0: one the OS
    /// picks; the address is printed).
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// This run is one instance of several on one shared fs root (`shared: true`), with this
    /// `instance_id` (set by `serve_sim --instances`).
    pub fs_instance_id: Option<String>,
}

/// A secret, serialised as `***` when set.
fn masked<S: serde::Serializer>(v: &str, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(if v.is_empty() { "" } else { "***" })
}

impl Default for SimConfig {
    fn default() -> Self {
        let m = preset(DEFAULT_MODEL).expect("the default preset exists");
        Self {
            streams: DEFAULT_STREAMS,
            turns: 20,
            prefixes: 4 * DEFAULT_STREAMS,
            prefix_tokens: 1024,
            prompt_tokens: 256,
            output_tokens: 64,
            tokens_per_block: 16,
            model: m.name.into(),
            layers: m.layers,
            kv_heads: m.kv_heads,
            head_dim: m.head_dim,
            dtype_bytes: m.dtype_bytes,
            gpu_cache_blocks: 512,
            max_batch: 8,
            prefill_tokens_per_s: 10_000.0,
            duration: Duration::from_secs(70),
            workload: "default".into(),
            max_wait_steps: DEFAULT_MAX_WAIT_STEPS,
            restart_at: None,
            restart_after: None,
            trace: None,
            seed: 1,
            dram_bytes: 1 << 30,
            root_dir: None,
            fs_cap_gb: Some(4.0),
            fs_admit_after_lookups: 0,
            chain_eviction: true,
            dram_eviction: "lru".into(),
            fs_write_budget_mb_per_s: None,
            config_json: None,
            s3_endpoint: None,
            s3_embedded: false,
            no_fs: false,
            // the bucket `kv-tier s3-server` makes (the README's recipe)
            s3_bucket: kv_tier_testkit::s3::BUCKET.into(),
            s3_access_key: String::new(),
            s3_secret_key: String::new(),
            s3_region: "us-east-1".into(),
            obj_cap_gb: None,
            fs_gc_interval_s: 1.0,
            fs_gc_stamp_s: 1.0,
            fs_gc_grace_s: 2.0,
            sync_steps: false,
            load_policy: false,
            progress: true,
            metrics_addr: None,
            fs_instance_id: None,
        }
    }
}

/// Concurrent conversations by default.
const DEFAULT_STREAMS: usize = 8;

impl SimConfig {
    /// Bytes of one block: layers x KV heads x head dim x dtype x 2 (K and V) x tokens.
    pub fn block_bytes(&self) -> usize {
        self.layers * self.kv_heads * self.head_dim * self.dtype_bytes * 2 * self.tokens_per_block
    }

    /// The tier config of the run: `config_json` as given, or one built of the fields, the
    /// fs tier in `root`. With `sync_steps` its fs tiers' GC runs on the simulator's steps.
    pub(super) fn tier_config(&self, root: &Path) -> Result<KvTierConfig, kv_tier_core::Error> {
        let mut cfg = self.tier_config_as_given(root)?;
        if self.sync_steps {
            // the simulator runs the fs GC at the end of each step, not on its thread
            for t in cfg.secondary_tiers.iter_mut().filter(|t| t.kind == "fs") {
                t.options.insert("gc_background".into(), false.into());
            }
        }
        Ok(cfg)
    }

    fn tier_config_as_given(&self, root: &Path) -> Result<KvTierConfig, kv_tier_core::Error> {
        if let Some(text) = &self.config_json {
            let mut cfg = KvTierConfig::from_json_str(text)?;
            // vLLM's shape has no block size: the engine (here the model shape) gives it
            if cfg.block_size_bytes == 0 {
                cfg.block_size_bytes = self.block_bytes() as u64;
                cfg.validate()?;
            }
            // the attribution follows every tier's events
            for t in &mut cfg.secondary_tiers {
                t.tiering.enable_kv_events = Some(true);
            }
            return Ok(cfg);
        }
        let mut fs = serde_json::json!({
            "type": "fs",
            "root_dir": root,
            "n_read_threads": 8,
            "n_write_threads": 8,
            "checksum": "crc32c",
            "enable_kv_events": true,
        });
        if let Some(cap) = self.fs_cap_gb {
            // Seconds-scale GC for a run that lasts a minute; with `sync_steps`, on the GC's
            // clock of steps (4 us each, see `Engine::settle`): every use stamped, nothing
            // spared for its age. (Windows of a few steps, 6 us and 13 us, left the tier near
            // its ceiling, where a store's own sweep, mid-step, takes what is not in flight:
            // the same seed gave 33.8% then 33.6%.)
            let (stamp, grace) = match self.sync_steps {
                true => (1e-6, 2e-6),
                false => (self.fs_gc_stamp_s, self.fs_gc_grace_s),
            };
            let o = fs.as_object_mut().expect("object");
            o.insert("gc_max_size_gb".into(), cap.into());
            o.insert("gc_interval_s".into(), self.fs_gc_interval_s.into());
            o.insert("gc_stamp_interval_s".into(), stamp.into());
            o.insert("gc_grace_s".into(), grace.into());
        }
        {
            let o = fs.as_object_mut().expect("object");
            if self.fs_admit_after_lookups > 0 {
                o.insert(
                    "admit_after_lookups".into(),
                    self.fs_admit_after_lookups.into(),
                );
            }
            if let Some(mb) = self.fs_write_budget_mb_per_s {
                o.insert("write_budget_mb_per_s".into(), mb.into());
            }
            o.insert("chain_eviction".into(), self.chain_eviction.into());
            if let Some(id) = &self.fs_instance_id {
                o.insert("shared".into(), true.into());
                o.insert("instance_id".into(), id.clone().into());
            }
        }
        let mut tiers = match self.no_fs {
            true => Vec::new(),
            false => vec![fs],
        };
        if let Some(endpoint) = &self.s3_endpoint {
            let mut obj = serde_json::json!({
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
                "enable_kv_events": true,
                "chain_eviction": self.chain_eviction,
            });
            if let (Some(gb), Some(o)) = (self.obj_cap_gb, obj.as_object_mut()) {
                o.insert("max_size_gb".into(), gb.into());
            }
            tiers.push(obj);
        }
        let v = serde_json::json!({
            "cpu_bytes_to_use": self.dram_bytes,
            "block_size_bytes": self.block_bytes(),
            "eviction_policy": self.dram_eviction,
            "secondary_tiers": tiers,
        });
        KvTierConfig::from_value(v)
    }
}
