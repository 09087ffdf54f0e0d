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
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
pub use crate::json::from_value;
use crate::layout::{Namespace, RunFields};
pub use crate::ranges::{check_range, check_range_u64};
use crate::tier_options::{TierOptions, TierSettings};

/// DRAM eviction policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EvictionPolicy {
    /// Least recently used.
    #[default]
    Lru,
    /// Adaptive replacement cache (recency + frequency).
    Arc,
}

/// One entry of `secondary_tiers`: `{"type": "...", "name": "...", ...options}`.
#[derive(Debug, Clone, PartialEq)]
pub struct TierSpec {
    /// The registered type name (`"fs"`, `"obj"`, `"memory"`, or a user's own).
    pub kind: String,
    /// A unique name for this tier (defaults to the type); used in request tier filters,
    /// statistics and events.
    pub name: String,
    /// The type-specific options (every key but `type`, `name` and the manager's own).
    pub options: Map<String, Value>,
    /// What the manager does with this tier: probe budget, write-back limit and policy
    /// (`probe_budget_s`, `write_back_limit_mb`, `write_back_policy`).
    pub tiering: TierOptions,
}

impl TierSpec {
    /// A spec of the given type with no options.
    pub fn new(kind: impl Into<String>) -> Self {
        let kind = kind.into();
        Self {
            name: kind.clone(),
            kind,
            options: Map::new(),
            tiering: TierOptions::default(),
        }
    }

    /// Adds an option.
    pub fn option(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.options.insert(key.to_string(), value.into());
        self
    }

    /// Parses the options into a tier's own config type (use `#[serde(deny_unknown_fields)]`);
    /// errors name the field relative to the tier entry.
    pub fn parse_options<T: DeserializeOwned>(&self) -> Result<T> {
        from_value(Value::Object(self.options.clone()), "")
    }

    fn from_value(v: Value, field: &str) -> Result<Self> {
        let Value::Object(mut map) = v else {
            return Err(Error::config(
                field,
                "must be an object with a \"type\" key",
            ));
        };
        let kind = match map.remove("type") {
            Some(Value::String(s)) if !s.is_empty() => s,
            Some(other) => {
                return Err(Error::config(
                    format!("{field}.type"),
                    format!("must be a non-empty string, got {other}"),
                ));
            }
            None => return Err(Error::config(format!("{field}.type"), "is required")),
        };
        let name = match map.remove("name") {
            Some(Value::String(s)) if !s.is_empty() => s,
            Some(other) => {
                return Err(Error::config(
                    format!("{field}.name"),
                    format!("must be a non-empty string, got {other}"),
                ));
            }
            None => kind.clone(),
        };
        let tiering = TierOptions::take_from(&mut map, field)?;
        Ok(Self {
            kind,
            name,
            options: map,
            tiering,
        })
    }
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
    block_size_bytes: u64,
    #[serde(default)]
    eviction_policy: EvictionPolicy,
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
    #[serde(default = "default_write_back_fraction")]
    write_back_max_dram_fraction: f64,
}

fn default_write_back_fraction() -> f64 {
    0.75
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

/// The whole configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct KvTierConfig {
    /// Bytes of DRAM for the primary tier (`cpu_bytes_to_use`). Must hold at least one block.
    pub cpu_bytes_to_use: u64,
    /// Bytes per block (`block_size_bytes`): all layers' KV of one block, as the engine lays
    /// it out. Fixed per deployment.
    pub block_size_bytes: u64,
    /// DRAM eviction policy (`eviction_policy`: `"lru"`, the default, or `"arc"`).
    pub eviction_policy: EvictionPolicy,
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
    /// is probed again.
    pub lease_s: f64,
    /// At most this fraction of the DRAM pool stays pinned by store jobs to secondary tiers
    /// (`write_back_max_dram_fraction`, default 0.75, range 0.01 to 1). Pinned blocks still
    /// serve hits; the rest of the pool takes new stores and promotions. Past it, cascades to
    /// `drop` tiers are dropped and, where a tier's policy is `wait`, `prepare_store` refuses.
    pub write_back_max_dram_fraction: f64,
}

/// The documented range of every numeric field of [`KvTierConfig`], checked by
/// [`KvTierConfig::validate`]: `(field, min, max)`, both ends included.
pub const RANGES: &[(&str, f64, f64)] = &[
    ("probe_timeout_s", PROBE_TIMEOUT.0, PROBE_TIMEOUT.1),
    ("job_timeout_s", JOB_TIMEOUT.0, JOB_TIMEOUT.1),
    (
        "job_timeout_per_block_s",
        JOB_TIMEOUT_PER_BLOCK.0,
        JOB_TIMEOUT_PER_BLOCK.1,
    ),
    ("lease_s", LEASE.0, LEASE.1),
    (
        "write_back_max_dram_fraction",
        WRITE_BACK_FRACTION.0,
        WRITE_BACK_FRACTION.1,
    ),
];
const PROBE_TIMEOUT: (f64, f64) = (0.001, 600.0);
const JOB_TIMEOUT: (f64, f64) = (0.01, 86_400.0);
const JOB_TIMEOUT_PER_BLOCK: (f64, f64) = (0.0, 3_600.0);
const LEASE: (f64, f64) = (0.001, 86_400.0);
const WRITE_BACK_FRACTION: (f64, f64) = (0.01, 1.0);

/// The largest block size accepted (1 GiB): larger is a units mistake.
pub const MAX_BLOCK_SIZE: u64 = 1 << 30;

impl KvTierConfig {
    /// A config with `cpu_bytes_to_use` and `block_size_bytes`, LRU, no secondary tiers.
    pub fn new(cpu_bytes_to_use: u64, block_size_bytes: u64) -> Self {
        Self {
            cpu_bytes_to_use,
            block_size_bytes,
            eviction_policy: EvictionPolicy::Lru,
            secondary_tiers: Vec::new(),
            layout: None,
            probe_timeout_s: default_probe_timeout(),
            job_timeout_s: default_job_timeout(),
            job_timeout_per_block_s: default_job_timeout_per_block(),
            lease_s: default_lease(),
            write_back_max_dram_fraction: default_write_back_fraction(),
        }
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

    /// Parses and validates the JSON text.
    pub fn from_json_str(text: &str) -> Result<Self> {
        let mut de = serde_json::Deserializer::from_str(text);
        let value: Value = Value::deserialize(&mut de)
            .map_err(|e| Error::config("", format!("not valid JSON: {e}")))?;
        de.end()
            .map_err(|e| Error::config("", format!("not valid JSON: {e}")))?;
        Self::from_value(value)
    }

    /// Parses and validates a JSON value.
    pub fn from_value(value: Value) -> Result<Self> {
        let raw: RawConfig = from_value(value, "")?;
        if let Some(name) = &raw.spec_name
            && name != "TieringOffloadingSpec"
        {
            return Err(Error::config(
                "spec_name",
                format!("only \"TieringOffloadingSpec\" is supported, got {name:?}"),
            ));
        }
        let _ = raw.spec_module_path;
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
                let fields: RunFields = from_value(Value::Object(m), "layout")?;
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
            block_size_bytes: raw.block_size_bytes,
            eviction_policy: raw.eviction_policy,
            secondary_tiers: tiers,
            layout,
            probe_timeout_s: raw.probe_timeout_s,
            job_timeout_s: raw.job_timeout_s,
            job_timeout_per_block_s: raw.job_timeout_per_block_s,
            lease_s: raw.lease_s,
            write_back_max_dram_fraction: raw.write_back_max_dram_fraction,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every value; the manager calls this at construction.
    pub fn validate(&self) -> Result<()> {
        if self.block_size_bytes == 0 {
            return Err(Error::config("block_size_bytes", "must be positive"));
        }
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
        if self.cpu_bytes_to_use < self.block_size_bytes {
            return Err(Error::config(
                "cpu_bytes_to_use",
                format!(
                    "{} bytes cannot hold one block of block_size_bytes = {}",
                    self.cpu_bytes_to_use, self.block_size_bytes
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
                "write_back_max_dram_fraction",
                self.write_back_max_dram_fraction,
                WRITE_BACK_FRACTION,
            ),
        ] {
            check_range(field, v, min, max)?;
        }
        if let Some(l) = &self.layout {
            l.namespace()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_field(text: &str) -> (String, String) {
        match KvTierConfig::from_json_str(text).unwrap_err() {
            Error::InvalidConfig { field, reason } => (field, reason),
            other => panic!("expected InvalidConfig, got {other}"),
        }
    }

    #[test]
    fn full_config_parses() {
        let cfg = KvTierConfig::from_json_str(
            r#"{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8192, "block_size_bytes": 4096,
                "eviction_policy": "lru",
                "secondary_tiers": [{"type": "fs", "root_dir": "/x", "n_read_threads": 4},
                                    {"type": "fs", "name": "fs2", "root_dir": "/y"}],
                "layout": {"model_name": "m", "dtype": "float16", "tokens_per_hash": 16, "rank": 2}}"#,
        )
        .unwrap();
        assert_eq!(cfg.secondary_tiers.len(), 2);
        assert_eq!(cfg.secondary_tiers[0].name, "fs");
        assert_eq!(cfg.secondary_tiers[1].name, "fs2");
        assert_eq!(cfg.secondary_tiers[0].options["n_read_threads"], 4);
        assert!(!cfg.secondary_tiers[0].options.contains_key("type"));
        assert_eq!(cfg.layout.unwrap().rank, 2);
    }

    #[test]
    fn every_invalid_value_names_its_field() {
        let cases = [
            (
                r#"{"cpu_bytes_to_use": 0, "block_size_bytes": 1}"#,
                "cpu_bytes_to_use",
            ),
            (
                r#"{"cpu_bytes_to_use": -5, "block_size_bytes": 1}"#,
                "cpu_bytes_to_use",
            ),
            (
                r#"{"cpu_bytes_to_use": "1G", "block_size_bytes": 1}"#,
                "cpu_bytes_to_use",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 0}"#,
                "block_size_bytes",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 20}"#,
                "cpu_bytes_to_use",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "eviction_policy": "lfu"}"#,
                "eviction_policy",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "cpu_byte_to_use": 3}"#,
                "cpu_byte_to_use",
            ),
            (r#"{"block_size_bytes": 1}"#, "cpu_bytes_to_use"),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "secondary_tiers": [{"root_dir": "/x"}]}"#,
                "secondary_tiers[0].type",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "secondary_tiers": [{"type": 3}]}"#,
                "secondary_tiers[0].type",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "secondary_tiers": [{"type": "a"}, {"type": "a"}]}"#,
                "secondary_tiers[1].name",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "secondary_tiers": {}}"#,
                "secondary_tiers",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 0}}"#,
                "layout.tokens_per_hash",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 1, "rank": -1}}"#,
                "layout.rank",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 1, "tp": 1}}"#,
                "layout.tp",
            ),
            (
                r#"{"cpu_bytes_to_use": 10, "block_size_bytes": 1, "spec_name": "CPUOffloadingSpec"}"#,
                "spec_name",
            ),
        ];
        for (text, want) in cases {
            let (field, reason) = err_field(text);
            assert_eq!(field, want, "for {text}: reason {reason}");
            assert!(!reason.is_empty());
        }
    }

    #[test]
    fn syntax_errors_are_reported() {
        let (field, reason) = err_field("{\"cpu_bytes_to_use\": ");
        assert_eq!(field, "");
        assert!(reason.contains("not valid JSON"), "{reason}");
    }

    #[test]
    fn tier_options_parse_with_field_paths() {
        #[derive(Deserialize, Debug)]
        #[serde(deny_unknown_fields)]
        #[allow(dead_code)]
        struct Opts {
            root_dir: String,
            #[serde(default)]
            n_read_threads: Option<u32>,
        }
        let spec = TierSpec::new("fs")
            .option("root_dir", "/x")
            .option("n_read_threads", "many");
        let err = spec
            .parse_options::<Opts>()
            .unwrap_err()
            .within("secondary_tiers[0]");
        assert!(
            err.to_string()
                .contains("`secondary_tiers[0].n_read_threads`"),
            "{err}"
        );
    }
}
