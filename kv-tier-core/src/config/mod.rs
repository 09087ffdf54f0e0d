//! Configuration: one JSON in the shape of vLLM's `kv_connector_extra_config` for the
//! tiering offloading spec. Every invalid value is rejected with an error naming the field.
//!
//! ```
//! use kv_tier_core::config::{EvictionPolicy, KvTierConfig};
//! let cfg = KvTierConfig::from_json_str(r#"{
//!     "cpu_bytes_to_use": 1048576,
//!     "block_size_bytes": 65536,
//!     "eviction_policy": "arc",
//!     "secondary_tiers": [{"type": "memory"}]
//! }"#)?;
//! assert_eq!(cfg.eviction_policy, EvictionPolicy::Arc);
//! assert_eq!(cfg.secondary_tiers[0].kind, "memory");
//!
//! let err = KvTierConfig::from_json_str(r#"{"cpu_bytes_to_use": 0, "block_size_bytes": 4096}"#)
//!     .unwrap_err();
//! assert!(err.to_string().contains("`cpu_bytes_to_use`"));
//! # Ok::<(), kv_tier_core::Error>(())
//! ```

use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};
pub use crate::instance::{check_instance_id, default_instance_id};
pub use crate::json::from_value;
use crate::layout::{Namespace, RunFields};
pub use crate::ranges::{check_range, check_range_u64};
use crate::tier_options::{TierOptions, TierSettings};

mod tier_spec;
mod vllm;

pub use tier_spec::{TierSpec, parse_tier_options};
use vllm::{VLLM_KEYS_NOT_HERE, apply_chunking};

/// DRAM eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionPolicy {
    /// Least recently used (vLLM's `"lru"`, the default).
    #[default]
    Lru,
    /// Least recently used over chain tails: a block goes only once no later block of its
    /// chain is in DRAM, and a chain's recency is that of its most recently used block (see
    /// [`crate::lru`]). The manager passes each block's place in its chain
    /// ([`crate::PrimaryTier::link`]); a block with no link is a chain of one. Not the
    /// default: in front of a bounded fs tier that holds what DRAM evicts, it served fewer
    /// prompt tokens than LRU on serve_sim's default workload (30.8% against 34.4% and
    /// 31.4% against 32.7% on two seeds, the same on a third) and more on its long-context
    /// one (13.2% against 11.4%); see the README.
    Chain,
    /// Adaptive replacement cache (recency + frequency).
    Arc,
}

/// The namespace of the blocks: run fields plus the worker rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayoutConfig {
    /// The run fields.
    pub fields: RunFields,
    /// The worker rank (forced to 0 when parallelism-agnostic).
    pub rank: u32,
}

impl LayoutConfig {
    /// Resolves the namespace.
    pub fn namespace(&self) -> Result<Namespace> {
        Namespace::new(self.fields.clone(), self.rank)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    cpu_bytes_to_use: u64,
    #[serde(default)]
    block_size_bytes: Option<u64>,
    #[serde(default)]
    block_size: Option<u64>,
    #[serde(default)]
    blocks_per_chunk: Option<u64>,
    #[serde(default)]
    eviction_policy: Option<String>,
    #[serde(default)]
    cache_policy_module_path: Option<String>,
    #[serde(default)]
    store_threshold: u64,
    #[serde(default = "default_max_tracker_size")]
    max_tracker_size: u64,
    #[serde(default = "default_event_buffer_keys")]
    event_buffer_keys: u64,
    #[serde(default)]
    secondary_tiers: Vec<Value>,
    #[serde(default)]
    layout: Option<Value>,
    #[serde(default)]
    spec_name: Option<String>,
    #[serde(default)]
    spec_module_path: Option<String>,
    #[serde(default = "default_probe_timeout")]
    probe_timeout_s: f64,
    #[serde(default = "default_job_timeout")]
    job_timeout_s: f64,
    #[serde(default = "default_job_timeout_per_block")]
    job_timeout_per_block_s: f64,
    #[serde(default = "default_lease")]
    lease_s: f64,
    #[serde(default = "default_shutdown_timeout")]
    shutdown_timeout_s: f64,
    #[serde(default = "default_write_back_fraction")]
    write_back_max_dram_fraction: f64,
    #[serde(default)]
    prefill_tokens_per_s: Option<f64>,
    #[serde(default = "default_promotion_cut_margin")]
    promotion_cut_margin: f64,
}

fn default_promotion_cut_margin() -> f64 {
    2.0
}

fn default_write_back_fraction() -> f64 {
    0.75
}
fn default_max_tracker_size() -> u64 {
    64_000
}
fn default_event_buffer_keys() -> u64 {
    1_000_000
}

fn default_probe_timeout() -> f64 {
    1.0
}
fn default_job_timeout() -> f64 {
    30.0
}
fn default_job_timeout_per_block() -> f64 {
    0.25
}
fn default_lease() -> f64 {
    30.0
}
fn default_shutdown_timeout() -> f64 {
    30.0
}

/// The whole configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTierConfig {
    /// Bytes of DRAM for the primary tier (`cpu_bytes_to_use`). Must hold at least one block
    /// slot (the block rounded up to a page) and fewer than 2^32 - 1 of them.
    pub cpu_bytes_to_use: u64,
    /// Bytes per block (`block_size_bytes`): all layers' KV of one block, as the engine lays
    /// it out. Fixed per deployment. vLLM's config has no such key (its connector reads the
    /// size off the KV cache): absent, it is 0 here and the engine sets it before building
    /// (the manager refuses to build without it, naming this field).
    pub block_size_bytes: u64,
    /// vLLM's `block_size`: tokens per offloaded block (a multiple of the layout's
    /// `tokens_per_hash`, the engine's block size; it sets the layout's `blocks_per_file`,
    /// as vLLM sets `blocks_per_chunk`). Not with `blocks_per_chunk`. vLLM divides by its KV
    /// group's block size times the decode context-parallel size; here `tokens_per_hash`
    /// stands for both, which is the same for a single-group model without decode context
    /// parallelism: other runs give `blocks_per_chunk` instead.
    pub block_size_tokens: Option<u64>,
    /// vLLM's `blocks_per_chunk`: engine blocks per offloaded block (default 1, range 1 to
    /// 65,536); the layout's `blocks_per_file`. Not with `block_size`.
    pub blocks_per_chunk: Option<u64>,
    /// DRAM eviction policy (`eviction_policy`: `"lru"`, the default, `"chain"` or `"arc"`;
    /// see [`EvictionPolicy`]).
    pub eviction_policy: EvictionPolicy,
    /// vLLM's `cache_policy_module_path`: accepted when `eviction_policy` names a built-in
    /// policy (then unused, as in vLLM); a policy from a Python module is refused naming
    /// this field (policies here are compiled in).
    pub cache_policy_module_path: Option<String>,
    /// vLLM's `store_threshold`: a block enters DRAM (`prepare_store` admits it) only once
    /// this many distinct requests have looked it up (default 0; 0 and 1: every block, as in vLLM;
    /// range 0 to 10,000). Counted over the last `max_tracker_size` keys asked for; a
    /// request asking again while it waits counts once (vLLM counts every lookup call). vLLM
    /// refuses it for its tiering spec; here it applies with secondary tiers too.
    pub store_threshold: u64,
    /// vLLM's `max_tracker_size`: how many keys the lookup counts of `store_threshold` and
    /// of the tiers' `admit_after_lookups` remember, least recently asked forgotten first
    /// (default 64,000, range 1 to 100,000,000).
    pub max_tracker_size: u64,
    /// The most keys a tier's (and DRAM's) event buffer holds until the engine takes them
    /// (`event_buffer_keys`, default 1,000,000, range 1 to 1e10): past it the oldest events
    /// are dropped and counted (`ManagerStats::events_dropped`), so an engine that never
    /// takes events costs bounded memory and can tell it lost some.
    pub event_buffer_keys: u64,
    /// Secondary tiers in lookup order (`secondary_tiers`).
    pub secondary_tiers: Vec<TierSpec>,
    /// The namespace (`layout`: the run fields of `config.json` plus `"rank"`); tiers that
    /// persist blocks need it, unless the engine passes one to the manager builder.
    pub layout: Option<LayoutConfig>,
    /// Deadline of one existence probe batch, in seconds (`probe_timeout_s`, default 1, range
    /// 0.001 to 600). A probe that has not answered by then (or that errs or panics) answers
    /// "absent in this tier" for its keys, so no key waits in `Retry` longer than this.
    pub probe_timeout_s: f64,
    /// Base deadline of one store or load job, in seconds (`job_timeout_s`, default 30, range
    /// 0.01 to 86,400). A job gets `job_timeout_s + job_timeout_per_block_s x blocks`; one that
    /// has not ended by then is abandoned (its future dropped) and every key of it fails.
    pub job_timeout_s: f64,
    /// Added to a job's deadline per block, in seconds (`job_timeout_per_block_s`, default
    /// 0.25, range 0 to 3,600).
    pub job_timeout_per_block_s: f64,
    /// How long a key a probe found stays leased (protected from eviction) in that tier while
    /// its promotion is pending, in seconds (`lease_s`, default 30, range 0.001 to 86,400).
    /// The lease ends when the promotion ends or every request that asked for the key has
    /// finished; the expiry only bounds a lease nothing ends. An expired "present" answer
    /// is probed again, unless no lookup had used it yet (the scheduler came back later than
    /// the lease): then it is renewed once and used, a promotion of a key the tier evicted
    /// meanwhile failing as a miss.
    pub lease_s: f64,
    /// Deadline of each secondary tier's shutdown, in seconds (`shutdown_timeout_s`, default
    /// 30, range 0.01 to 86,400). A tier's shutdown waits for work its abandoned jobs left
    /// running (an fs read or write under way when its job passed `job_timeout_s`), so it
    /// has a deadline of its own: a short job deadline does not make shutdowns fail. One that
    /// passes it is reported ([`crate::Error::Timeout`]) and the other tiers are still shut
    /// down.
    pub shutdown_timeout_s: f64,
    /// At most this fraction of the DRAM pool stays pinned by store jobs to secondary tiers
    /// (`write_back_max_dram_fraction`, default 0.75, range 0.01 to 1). Pinned blocks still
    /// serve hits; the rest of the pool takes new stores and promotions. Past it, cascades to
    /// `drop` tiers are dropped and, where a tier's policy is `wait`, `prepare_store` refuses.
    pub write_back_max_dram_fraction: f64,
    /// The engine's prefill rate, in tokens a second (`prefill_tokens_per_s`, range 1 to 1e9;
    /// absent by default). Given, the manager loads only the part of a prefix that is ready
    /// sooner than recomputing it ([`crate::TieringManager::lookup_many`]): it needs the
    /// tokens per block, `block_size` (`block_size_tokens`) or the layout's `tokens_per_hash`
    /// times `blocks_per_chunk`. Engines whose rate depends on the batch give
    /// [`crate::TieringManagerBuilder::recompute_time`] instead.
    pub prefill_tokens_per_s: Option<f64>,
    /// How far behind its estimate a promotion may fall before the load-or-recompute policy
    /// may cut it (`promotion_cut_margin`, default 2, range 1 to 1,000; with a recompute time
    /// only): a load job still running after this many times the time the tier's estimate
    /// gave it when it was sent, at a pace at which the blocks it has not landed would take
    /// longer than recomputing them (with none landed: when it ran longer than recomputing
    /// them), is cut, at the next scheduling step. The blocks that landed are served, the rest are
    /// a miss for its request ([`crate::MissCause::RecomputeFaster`]) and counted in the
    /// tier's `promotions_cut`.
    pub promotion_cut_margin: f64,
}

/// The documented range of every numeric field of [`KvTierConfig`], checked by
/// [`KvTierConfig::validate`]: `(field, min, max)`, both ends included.
pub const RANGES: &[(&str, f64, f64)] = &[
    ("probe_timeout_s", PROBE_TIMEOUT.0, PROBE_TIMEOUT.1),
    ("prefill_tokens_per_s", PREFILL_RATE.0, PREFILL_RATE.1),
    ("promotion_cut_margin", CUT_MARGIN.0, CUT_MARGIN.1),
    ("job_timeout_s", JOB_TIMEOUT.0, JOB_TIMEOUT.1),
    (
        "job_timeout_per_block_s",
        JOB_TIMEOUT_PER_BLOCK.0,
        JOB_TIMEOUT_PER_BLOCK.1,
    ),
    ("lease_s", LEASE.0, LEASE.1),
    ("shutdown_timeout_s", SHUTDOWN_TIMEOUT.0, SHUTDOWN_TIMEOUT.1),
    (
        "write_back_max_dram_fraction",
        WRITE_BACK_FRACTION.0,
        WRITE_BACK_FRACTION.1,
    ),
    (
        "blocks_per_chunk",
        BLOCKS_PER_CHUNK.0 as f64,
        BLOCKS_PER_CHUNK.1 as f64,
    ),
    (
        "store_threshold",
        STORE_THRESHOLD.0 as f64,
        STORE_THRESHOLD.1 as f64,
    ),
    (
        "max_tracker_size",
        MAX_TRACKER_SIZE.0 as f64,
        MAX_TRACKER_SIZE.1 as f64,
    ),
    (
        "event_buffer_keys",
        EVENT_BUFFER_KEYS.0 as f64,
        EVENT_BUFFER_KEYS.1 as f64,
    ),
];
const PROBE_TIMEOUT: (f64, f64) = (0.001, 600.0);
const PREFILL_RATE: (f64, f64) = (1.0, 1e9);
const CUT_MARGIN: (f64, f64) = (1.0, 1_000.0);
const JOB_TIMEOUT: (f64, f64) = (0.01, 86_400.0);
const JOB_TIMEOUT_PER_BLOCK: (f64, f64) = (0.0, 3_600.0);
const LEASE: (f64, f64) = (0.001, 86_400.0);
const SHUTDOWN_TIMEOUT: (f64, f64) = (0.01, 86_400.0);
const WRITE_BACK_FRACTION: (f64, f64) = (0.01, 1.0);
const BLOCKS_PER_CHUNK: (u64, u64) = (1, 65_536);
const STORE_THRESHOLD: (u64, u64) = (0, 10_000);
const MAX_TRACKER_SIZE: (u64, u64) = (1, 100_000_000);
const EVENT_BUFFER_KEYS: (u64, u64) = (1, 10_000_000_000);

/// The largest block size accepted (1 GiB): larger is a units mistake.
pub const MAX_BLOCK_SIZE: u64 = 1 << 30;

impl KvTierConfig {
    /// A config with `cpu_bytes_to_use` and `block_size_bytes`, LRU, no secondary tiers.
    pub fn new(cpu_bytes_to_use: u64, block_size_bytes: u64) -> Self {
        Self {
            cpu_bytes_to_use,
            block_size_bytes,
            block_size_tokens: None,
            blocks_per_chunk: None,
            eviction_policy: EvictionPolicy::Lru,
            cache_policy_module_path: None,
            store_threshold: 0,
            max_tracker_size: default_max_tracker_size(),
            event_buffer_keys: default_event_buffer_keys(),
            secondary_tiers: Vec::new(),
            layout: None,
            probe_timeout_s: default_probe_timeout(),
            job_timeout_s: default_job_timeout(),
            job_timeout_per_block_s: default_job_timeout_per_block(),
            lease_s: default_lease(),
            shutdown_timeout_s: default_shutdown_timeout(),
            write_back_max_dram_fraction: default_write_back_fraction(),
            prefill_tokens_per_s: None,
            promotion_cut_margin: default_promotion_cut_margin(),
        }
    }

    /// Tokens per offloaded block in namespace `ns` (the engine's, or the config's layout):
    /// `block_size` (`block_size_tokens`), else `tokens_per_hash` times `blocks_per_chunk`
    /// (the layout's `blocks_per_file` without it); `None` without either.
    pub fn tokens_per_block(&self, ns: Option<&Namespace>) -> Option<u64> {
        self.block_size_tokens.or_else(|| {
            let f = match ns {
                Some(ns) => ns.fields().clone(),
                None => self.layout.as_ref()?.fields.clone(),
            };
            Some(f.tokens_per_hash * self.blocks_per_chunk.unwrap_or(f.blocks_per_file))
        })
    }

    /// The probe deadline.
    pub fn probe_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.probe_timeout_s)
    }

    /// The deadline of a job of `blocks` blocks.
    pub fn job_timeout(&self, blocks: usize) -> Duration {
        let secs = self.job_timeout_s + self.job_timeout_per_block_s * blocks as f64;
        // Both terms are range-checked; capped (at ~31 years) so any block count converts.
        Duration::try_from_secs_f64(secs.min(1e9)).unwrap_or(Duration::MAX)
    }

    /// The deadline of each secondary tier's shutdown.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_secs_f64(self.shutdown_timeout_s)
    }

    /// The lease of a key a probe found.
    pub fn lease(&self) -> Duration {
        Duration::from_secs_f64(self.lease_s)
    }

    /// The DRAM bytes all write-back may pin (`cpu_bytes_to_use x
    /// write_back_max_dram_fraction`): also each tier's default write-back limit.
    pub fn write_back_budget(&self) -> u64 {
        (self.cpu_bytes_to_use as f64 * self.write_back_max_dram_fraction) as u64
    }

    /// The settings of the `i`-th configured secondary tier, were it a local one (a remote
    /// tier's default probe budget is shorter: see [`TierOptions::probe_budget_s`]).
    pub fn tier_settings(&self, i: usize) -> TierSettings {
        self.secondary_tiers
            .get(i)
            .map_or_else(TierOptions::default, |t| t.tiering)
            .resolve(false, self.write_back_budget(), self.block_size_bytes)
    }

    /// Parses and validates the JSON text. A key given twice in one object is refused, naming
    /// it (JSON parsers differ on which one wins).
    pub fn from_json_str(text: &str) -> Result<Self> {
        Self::from_value(crate::json::parse_strict(text)?)
    }

    /// Parses and validates a JSON value. `block_size_bytes` may be absent (vLLM's shape):
    /// then it is 0 and must be set before building (see [`KvTierConfig::block_size_bytes`]).
    pub fn from_value(value: Value) -> Result<Self> {
        if let Value::Object(m) = &value {
            for (key, why) in VLLM_KEYS_NOT_HERE {
                if m.contains_key(*key) {
                    return Err(Error::config(
                        *key,
                        format!("a vLLM key kv-tier does not implement: {why}"),
                    ));
                }
            }
        }
        let raw: RawConfig = from_value(value, "")?;
        if let Some(name) = &raw.spec_name
            && name != "TieringOffloadingSpec"
        {
            return Err(Error::config(
                "spec_name",
                format!("only \"TieringOffloadingSpec\" is supported, got {name:?}"),
            ));
        }
        if let Some(m) = &raw.spec_module_path
            && raw.spec_name.is_none()
        {
            return Err(Error::config(
                "spec_module_path",
                format!(
                    "{m:?} without spec_name: kv-tier implements the tiering spec (\"TieringOffloadingSpec\") only and loads nothing from Python modules"
                ),
            ));
        }
        let eviction_policy = match raw.eviction_policy.as_deref() {
            None => EvictionPolicy::Lru,
            Some(p) if p.eq_ignore_ascii_case("chain") => EvictionPolicy::Chain,
            Some(p) if p.eq_ignore_ascii_case("lru") => EvictionPolicy::Lru,
            Some(p) if p.eq_ignore_ascii_case("arc") => EvictionPolicy::Arc,
            Some(p) => {
                return Err(match &raw.cache_policy_module_path {
                    Some(m) => Error::config(
                        "cache_policy_module_path",
                        format!(
                            "policy {p:?} from module {m:?}: kv-tier does not load policies from Python modules; eviction_policy is \"lru\", \"chain\" or \"arc\""
                        ),
                    ),
                    None => Error::config(
                        "eviction_policy",
                        format!("must be \"lru\", \"chain\" or \"arc\", got {p:?}"),
                    ),
                });
            }
        };
        if raw.cache_policy_module_path.as_deref() == Some("") {
            return Err(Error::config(
                "cache_policy_module_path",
                "must be a non-empty module path",
            ));
        }
        if raw.block_size.is_some() && raw.blocks_per_chunk.is_some() {
            return Err(Error::config(
                "block_size",
                "specify only one of 'block_size' or 'blocks_per_chunk' (as vLLM requires)",
            ));
        }
        if raw.block_size_bytes == Some(0) {
            return Err(Error::config("block_size_bytes", "must be positive"));
        }
        if raw.block_size == Some(0) {
            return Err(Error::config(
                "block_size",
                "must be positive (tokens per offloaded block)",
            ));
        }
        let mut tiers = Vec::with_capacity(raw.secondary_tiers.len());
        for (i, v) in raw.secondary_tiers.into_iter().enumerate() {
            tiers.push(TierSpec::from_value(v, &format!("secondary_tiers[{i}]"))?);
        }
        let layout = match raw.layout {
            None => None,
            Some(Value::Object(mut m)) => {
                let rank = match m.remove("rank") {
                    None => 0,
                    Some(v) => v
                        .as_u64()
                        .and_then(|r| u32::try_from(r).ok())
                        .ok_or_else(|| {
                            Error::config("layout.rank", format!("must be a u32, got {v}"))
                        })?,
                };
                let bpf_given = m.contains_key("blocks_per_file");
                let mut fields = RunFields::from_layout(m, "layout")?;
                apply_chunking(raw.block_size, raw.blocks_per_chunk, bpf_given, &mut fields)?;
                Some(LayoutConfig { fields, rank })
            }
            Some(other) => {
                return Err(Error::config(
                    "layout",
                    format!("must be an object, got {other}"),
                ));
            }
        };
        let cfg = Self {
            cpu_bytes_to_use: raw.cpu_bytes_to_use,
            block_size_bytes: raw.block_size_bytes.unwrap_or(0),
            block_size_tokens: raw.block_size,
            blocks_per_chunk: raw.blocks_per_chunk,
            eviction_policy,
            cache_policy_module_path: raw.cache_policy_module_path,
            store_threshold: raw.store_threshold,
            max_tracker_size: raw.max_tracker_size,
            event_buffer_keys: raw.event_buffer_keys,
            secondary_tiers: tiers,
            layout,
            probe_timeout_s: raw.probe_timeout_s,
            job_timeout_s: raw.job_timeout_s,
            job_timeout_per_block_s: raw.job_timeout_per_block_s,
            lease_s: raw.lease_s,
            shutdown_timeout_s: raw.shutdown_timeout_s,
            write_back_max_dram_fraction: raw.write_back_max_dram_fraction,
            prefill_tokens_per_s: raw.prefill_tokens_per_s,
            promotion_cut_margin: raw.promotion_cut_margin,
        };
        cfg.validate_as_given()?;
        Ok(cfg)
    }

    /// The namespace `ns` (the engine's, or the config's layout) checked against vLLM's
    /// chunking keys (`block_size`, `blocks_per_chunk`): each offloaded block is
    /// `blocks_per_file` engine blocks of `tokens_per_hash` tokens.
    pub fn check_namespace(&self, ns: &Namespace) -> Result<()> {
        let mut fields = ns.fields().clone();
        apply_chunking(
            self.block_size_tokens,
            self.blocks_per_chunk,
            true,
            &mut fields,
        )
    }

    /// Checks every value, `block_size_bytes` included; the manager calls this at
    /// construction.
    pub fn validate(&self) -> Result<()> {
        if self.block_size_bytes == 0 {
            return Err(Error::config(
                "block_size_bytes",
                "is required: the bytes of one offloaded block (all layers' K and V of its tokens); vLLM's config leaves it to the engine, so an engine using that config sets KvTierConfig::block_size_bytes before building",
            ));
        }
        self.validate_as_given()
    }

    /// Checks every value as the config gives it: a `block_size_bytes` of 0 (vLLM's shape,
    /// left to the engine) passes. What `kv-tier config check` runs.
    pub fn validate_as_given(&self) -> Result<()> {
        if self.block_size_bytes > MAX_BLOCK_SIZE {
            return Err(Error::config(
                "block_size_bytes",
                format!(
                    "{} is more than the 1 GiB limit (is it in bytes?)",
                    self.block_size_bytes
                ),
            ));
        }
        if self.cpu_bytes_to_use == 0 {
            return Err(Error::config("cpu_bytes_to_use", "must be positive"));
        }
        // a DRAM slot is a block rounded up to a page (as the DRAM tier allocates it)
        let page = crate::PAGE_SIZE as u64;
        let slot = self.block_size_bytes.div_ceil(page) * page;
        if self.block_size_bytes > 0 && self.cpu_bytes_to_use < slot {
            return Err(Error::config(
                "cpu_bytes_to_use",
                format!(
                    "{} bytes cannot hold one block of block_size_bytes = {} (a slot of {slot} \
                     bytes: the block rounded up to a page)",
                    self.cpu_bytes_to_use, self.block_size_bytes
                ),
            ));
        }
        // the DRAM tier numbers its slots in 32 bits
        if self.block_size_bytes > 0 && self.cpu_bytes_to_use / slot >= u64::from(u32::MAX) {
            return Err(Error::config(
                "cpu_bytes_to_use",
                format!(
                    "{} bytes make {} slots of {slot} bytes (block_size_bytes = {} rounded up \
                     to a page): more than the {} a DRAM tier holds",
                    self.cpu_bytes_to_use,
                    self.cpu_bytes_to_use / slot,
                    self.block_size_bytes,
                    u32::MAX - 1
                ),
            ));
        }
        for (i, t) in self.secondary_tiers.iter().enumerate() {
            t.tiering.validate(&format!("secondary_tiers[{i}]"))?;
            if let Some(j) = self.secondary_tiers[..i]
                .iter()
                .position(|o| o.name == t.name)
            {
                return Err(Error::config(
                    format!("secondary_tiers[{i}].name"),
                    format!(
                        "tier name {:?} is already used by secondary_tiers[{j}]; give one of them a distinct \"name\"",
                        t.name
                    ),
                ));
            }
        }
        for (field, v, (min, max)) in [
            ("probe_timeout_s", self.probe_timeout_s, PROBE_TIMEOUT),
            ("job_timeout_s", self.job_timeout_s, JOB_TIMEOUT),
            (
                "job_timeout_per_block_s",
                self.job_timeout_per_block_s,
                JOB_TIMEOUT_PER_BLOCK,
            ),
            ("lease_s", self.lease_s, LEASE),
            (
                "shutdown_timeout_s",
                self.shutdown_timeout_s,
                SHUTDOWN_TIMEOUT,
            ),
            (
                "write_back_max_dram_fraction",
                self.write_back_max_dram_fraction,
                WRITE_BACK_FRACTION,
            ),
            (
                "promotion_cut_margin",
                self.promotion_cut_margin,
                CUT_MARGIN,
            ),
        ] {
            check_range(field, v, min, max)?;
        }
        if let Some(rate) = self.prefill_tokens_per_s {
            check_range("prefill_tokens_per_s", rate, PREFILL_RATE.0, PREFILL_RATE.1)?;
        }
        let mut ints = vec![
            ("store_threshold", self.store_threshold, STORE_THRESHOLD),
            ("max_tracker_size", self.max_tracker_size, MAX_TRACKER_SIZE),
            (
                "event_buffer_keys",
                self.event_buffer_keys,
                EVENT_BUFFER_KEYS,
            ),
        ];
        if let Some(n) = self.blocks_per_chunk {
            ints.push(("blocks_per_chunk", n, BLOCKS_PER_CHUNK));
        }
        for (field, v, (min, max)) in ints {
            check_range_u64(field, v, min, max)?;
        }
        if let Some(l) = &self.layout {
            l.namespace()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
