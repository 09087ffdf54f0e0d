//! What the manager does with each secondary tier, set per entry of `secondary_tiers` next to
//! the tier's own options: how long a lookup waits for its probe, and how much write-back it
//! may hold and what happens beyond that.
//!
//! ```
//! use kv_tier_core::{KvTierConfig, WriteBackPolicy};
//! let cfg = KvTierConfig::from_json_str(r#"{
//!     "cpu_bytes_to_use": 1048576, "block_size_bytes": 65536,
//!     "secondary_tiers": [
//!         {"type": "memory", "name": "fast"},
//!         {"type": "memory", "name": "slow", "probe_budget_s": 0.02,
//!          "write_back_limit_mb": 0.25, "write_back_policy": "drop"}]
//! }"#)?;
//! let slow = cfg.tier_settings(1);
//! assert_eq!(slow.write_back_limit_bytes, 262144);
//! assert_eq!(slow.write_back_policy, WriteBackPolicy::Drop);
//! // by default a tier drops what its write-back cannot take; `wait` is asked for
//! assert_eq!(cfg.tier_settings(0).write_back_policy, WriteBackPolicy::Drop);
//! # Ok::<(), kv_tier_core::Error>(())
//! ```

use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::Result;
use crate::event::Locality;
use crate::ranges::check_range;

/// What happens to a store cascade that would take a tier's write-back past its limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WriteBackPolicy {
    /// The blocks are not written to this tier (they stay in the tiers above), counted as
    /// dropped writes. The default.
    Drop,
    /// Nothing is dropped; instead `prepare_store` refuses (an [`crate::Error::WriteBackFull`])
    /// a store that would take the tier's write-back, or the DRAM pinned by write-back, past
    /// its limit, counting the stores prepared and not yet completed. Neither ever passes its
    /// limit, except by a single store larger than the limit, taken alone when nothing else
    /// is queued. Asked for explicitly: the engine sees the backpressure.
    Wait,
}

/// The manager's options of one tier, as written in its `secondary_tiers` entry (absent:
/// defaults).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TierOptions {
    /// `probe_budget_s`: how long a lookup waits for this tier's probe before it counts the
    /// key as absent here for the asking request (default: the whole `probe_timeout_s` for a
    /// local tier, 0.005 for a remote one; range 0.0001 to 600). The probe goes on until
    /// `probe_timeout_s`; a late answer still serves later lookups. A remote tier's short
    /// default keeps a slow store from gating admission: its answers serve the next requests
    /// instead. A local tier's probes wait behind its own stores, and a lookup that gives up
    /// on one recomputes the rest of its prefix, so by default it waits.
    pub probe_budget_s: Option<f64>,
    /// `write_back_limit_mb`: bytes of store jobs queued or in flight to this tier, in MiB
    /// (default: as much as all write-back may pin, `cpu_bytes_to_use x
    /// write_back_max_dram_fraction`, for a local tier; at most
    /// [`REMOTE_WRITE_BACK_BLOCKS`] blocks of it for a remote one, whose uploads would
    /// otherwise queue for minutes and drain long after the engine stops; at least 64
    /// blocks; range 0.000001 to 1e9).
    pub write_back_limit_mb: Option<f64>,
    /// `write_back_policy`: `"drop"` (the default) or `"wait"`.
    pub write_back_policy: Option<WriteBackPolicy>,
    /// vLLM's `enable_kv_events`: whether the manager reports this tier's events
    /// ([`crate::TieringManager::take_events`]). Off by default, as in vLLM: the tier records
    /// none, so nothing grows.
    pub enable_kv_events: Option<bool>,
    /// vLLM's `locality` (`"LOCAL"` or `"REMOTE"`, any casing): the locality this tier's
    /// events carry. Absent: the tier's own ([`crate::TierInfo::locality`]). Events only: the
    /// manager's defaults (probe budget, write-back limit) follow the tier's own locality.
    pub locality: Option<Locality>,
    /// `admit_after_lookups`: write a block to this tier only once this many distinct
    /// requests have looked it up (a request asking again while it waits counts once;
    /// default 0: every block; range 0 to 10,000), counted over the last `max_tracker_size` keys asked
    /// for. Checked when the block cascades from DRAM (its store completes): a block first
    /// kept out is written if a later store of it passes. Saves writes (SSD endurance) of blocks that
    /// are never asked for again; blocks not admitted stay in the tiers above and are counted
    /// (`not_admitted`).
    pub admit_after_lookups: Option<u64>,
    /// `write_budget_mb_per_s`: the most bytes per second written to this tier, in MiB
    /// (absent: no budget; range 0.001 to 1e9), a token bucket holding one second of it (at
    /// least one block). Stores beyond it are dropped and counted (`over_write_budget`).
    pub write_budget_mb_per_s: Option<f64>,
    /// `chain_eviction`: whether the manager sends this tier each stored block's place in
    /// its request's chain ([`crate::StoreJob::links`]), so a bounded tier (fs, obj) evicts a
    /// chain's later blocks before its earlier ones, least recent chain tail first (see
    /// [`crate::lru`]). Default true; false: plain LRU, no links sent. The README's "The hit
    /// rate, measured" compares the two on every serve_sim scenario.
    pub chain_eviction: Option<bool>,
}

impl TierOptions {
    /// Each key of a tier entry's tiering options, with whether the entry gave it (the others
    /// take their defaults).
    pub fn given(&self) -> [(&'static str, bool); 8] {
        [
            ("probe_budget_s", self.probe_budget_s.is_some()),
            ("write_back_limit_mb", self.write_back_limit_mb.is_some()),
            ("write_back_policy", self.write_back_policy.is_some()),
            ("enable_kv_events", self.enable_kv_events.is_some()),
            ("locality", self.locality.is_some()),
            ("admit_after_lookups", self.admit_after_lookups.is_some()),
            (
                "write_budget_mb_per_s",
                self.write_budget_mb_per_s.is_some(),
            ),
            ("chain_eviction", self.chain_eviction.is_some()),
        ]
    }
}

/// The keys of [`TierOptions`] in a tier entry (named once, by [`TierOptions::given`]).
pub(crate) fn keys() -> [&'static str; 8] {
    TierOptions::default().given().map(|(k, _)| k)
}

/// Parses vLLM's `locality` value: `LOCAL` or `REMOTE`, any casing.
fn parse_locality(v: &Value, field: &str) -> Result<Locality> {
    match v.as_str() {
        Some(s) if s.eq_ignore_ascii_case("local") => Ok(Locality::Local),
        Some(s) if s.eq_ignore_ascii_case("remote") => Ok(Locality::Remote),
        _ => Err(crate::error::Error::config(
            field,
            format!("must be \"LOCAL\" or \"REMOTE\" (vLLM's Locality), got {v}"),
        )),
    }
}

/// The resolved settings of one tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TierSettings {
    /// See [`TierOptions::probe_budget_s`].
    pub probe_budget: Duration,
    /// See [`TierOptions::write_back_limit_mb`].
    pub write_back_limit_bytes: u64,
    /// See [`TierOptions::write_back_policy`].
    pub write_back_policy: WriteBackPolicy,
    /// See [`TierOptions::enable_kv_events`].
    pub events: bool,
    /// See [`TierOptions::locality`].
    pub locality: Option<Locality>,
    /// See [`TierOptions::admit_after_lookups`] (0: every block).
    pub admit_after_lookups: u64,
    /// See [`TierOptions::write_budget_mb_per_s`], in bytes per second.
    pub write_budget_bytes_per_s: Option<u64>,
    /// See [`TierOptions::chain_eviction`].
    pub chain_eviction: bool,
}

/// A remote tier's default write-back limit, in blocks: a queue its `io_threads` drain in
/// well under a second at tens of milliseconds per request.
pub const REMOTE_WRITE_BACK_BLOCKS: u64 = 256;

/// The default probe budget of a remote tier.
pub const DEFAULT_PROBE_BUDGET_REMOTE: Duration = Duration::from_millis(5);

impl TierOptions {
    /// Takes the manager's keys out of a tier entry's options (`field`: the entry's path,
    /// for errors).
    pub(crate) fn take_from(map: &mut Map<String, Value>, field: &str) -> Result<Self> {
        let mut mine = Map::new();
        for k in keys() {
            if let Some(v) = map.remove(k) {
                mine.insert(k.to_string(), v);
            }
        }
        let at = |k: &str| {
            if field.is_empty() {
                k.to_string()
            } else {
                format!("{field}.{k}")
            }
        };
        // null: unspecified, as vLLM's None
        let locality = mine
            .remove("locality")
            .filter(|v| !v.is_null())
            .map(|v| parse_locality(&v, &at("locality")))
            .transpose()?;
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            probe_budget_s: Option<f64>,
            write_back_limit_mb: Option<f64>,
            write_back_policy: Option<WriteBackPolicy>,
            enable_kv_events: Option<bool>,
            admit_after_lookups: Option<u64>,
            write_budget_mb_per_s: Option<f64>,
            chain_eviction: Option<bool>,
        }
        let raw: Raw = crate::json::from_value(Value::Object(mine), field)?;
        let o = Self {
            probe_budget_s: raw.probe_budget_s,
            write_back_limit_mb: raw.write_back_limit_mb,
            write_back_policy: raw.write_back_policy,
            enable_kv_events: raw.enable_kv_events,
            locality,
            admit_after_lookups: raw.admit_after_lookups,
            write_budget_mb_per_s: raw.write_budget_mb_per_s,
            chain_eviction: raw.chain_eviction,
        };
        o.validate(field)?;
        Ok(o)
    }

    /// Checks the ranges; errors name `field.key`.
    pub fn validate(&self, field: &str) -> Result<()> {
        let at = |k: &str| {
            if field.is_empty() {
                k.to_string()
            } else {
                format!("{field}.{k}")
            }
        };
        if let Some(v) = self.probe_budget_s {
            check_range(&at("probe_budget_s"), v, 0.0001, 600.0)?;
        }
        if let Some(v) = self.write_back_limit_mb {
            check_range(&at("write_back_limit_mb"), v, 0.000001, 1e9)?;
        }
        if let Some(v) = self.admit_after_lookups {
            crate::ranges::check_range_u64(&at("admit_after_lookups"), v, 0, 10_000)?;
        }
        if let Some(v) = self.write_budget_mb_per_s {
            check_range(&at("write_budget_mb_per_s"), v, 0.001, 1e9)?;
        }
        Ok(())
    }

    /// The settings, defaults applied: `remote` says whether the tier is reached over a
    /// network, `write_back_budget` is what all write-back may pin (the default limit) and
    /// `block_bytes` a block's size.
    pub fn resolve(&self, remote: bool, write_back_budget: u64, block_bytes: u64) -> TierSettings {
        TierSettings {
            probe_budget: self
                .probe_budget_s
                .and_then(|s| Duration::try_from_secs_f64(s).ok())
                .unwrap_or(if remote {
                    DEFAULT_PROBE_BUDGET_REMOTE
                } else {
                    Duration::MAX // the manager caps it at the probe deadline
                }),
            write_back_limit_bytes: self
                .write_back_limit_mb
                .map_or(
                    if remote {
                        write_back_budget.min(REMOTE_WRITE_BACK_BLOCKS * block_bytes)
                    } else {
                        write_back_budget
                    }
                    .max(64 * block_bytes),
                    |mb| (mb * (1u64 << 20) as f64) as u64,
                )
                .max(1),
            write_back_policy: self.write_back_policy.unwrap_or(WriteBackPolicy::Drop),
            events: self.enable_kv_events.unwrap_or(false),
            locality: self.locality,
            admit_after_lookups: self.admit_after_lookups.unwrap_or(0),
            write_budget_bytes_per_s: self
                .write_budget_mb_per_s
                .map(|mb| ((mb * (1u64 << 20) as f64) as u64).max(1)),
            chain_eviction: self.chain_eviction.unwrap_or(true),
        }
    }

    /// These options with the tier's events reported (`enable_kv_events: true`).
    pub fn with_events(mut self) -> Self {
        self.enable_kv_events = Some(true);
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    #[test]
    fn bad_values_name_their_field() {
        let cases = [
            (r#"{"probe_budget_s": 0}"#, "t.probe_budget_s"),
            (r#"{"probe_budget_s": "1"}"#, "t.probe_budget_s"),
            (r#"{"write_back_limit_mb": -1}"#, "t.write_back_limit_mb"),
            (r#"{"write_back_policy": "later"}"#, "t.write_back_policy"),
            (r#"{"locality": "nearby"}"#, "t.locality"),
            (r#"{"locality": ""}"#, "t.locality"),
            (r#"{"locality": 1}"#, "t.locality"),
            (r#"{"enable_kv_events": "yes"}"#, "t.enable_kv_events"),
            (r#"{"admit_after_lookups": -1}"#, "t.admit_after_lookups"),
            (
                r#"{"admit_after_lookups": 2000000}"#,
                "t.admit_after_lookups",
            ),
            (r#"{"write_budget_mb_per_s": 0}"#, "t.write_budget_mb_per_s"),
            (r#"{"chain_eviction": "yes"}"#, "t.chain_eviction"),
        ];
        for (json, want) in cases {
            let mut m: Map<String, Value> = serde_json::from_str(json).unwrap();
            match TierOptions::take_from(&mut m, "t").unwrap_err() {
                Error::InvalidConfig { field, .. } => assert_eq!(field, want, "{json}"),
                e => panic!("{e}"),
            }
        }
        let mut m: Map<String, Value> =
            serde_json::from_str(r#"{"root_dir": "/x", "probe_budget_s": 0.5}"#).unwrap();
        let o = TierOptions::take_from(&mut m, "t").unwrap();
        assert_eq!(o.probe_budget_s, Some(0.5));
        for (text, want) in [
            ("LOCAL", Locality::Local),
            ("local", Locality::Local),
            ("Remote", Locality::Remote),
            ("REMOTE", Locality::Remote),
        ] {
            let mut m: Map<String, Value> =
                serde_json::from_value(serde_json::json!({ "locality": text })).unwrap();
            let o = TierOptions::take_from(&mut m, "t").unwrap();
            assert_eq!(o.locality, Some(want), "{text}");
        }
        assert!(m.contains_key("root_dir") && !m.contains_key("probe_budget_s"));
    }

    #[test]
    fn defaults_depend_on_locality_and_explicit_values_win() {
        let (budget, block) = (100 << 20, 8192);
        let local = TierOptions::default().resolve(false, budget, block);
        assert_eq!(local.write_back_limit_bytes, budget);
        assert_eq!(local.probe_budget, Duration::MAX, "capped by the manager");
        assert_eq!(local.write_back_policy, WriteBackPolicy::Drop);
        let remote = TierOptions::default().resolve(true, budget, block);
        assert_eq!(
            remote.write_back_limit_bytes,
            REMOTE_WRITE_BACK_BLOCKS * block
        );
        assert_eq!(remote.probe_budget, DEFAULT_PROBE_BUDGET_REMOTE);
        // never below 64 blocks, whatever the budget
        let tiny = TierOptions::default().resolve(true, 1, block);
        assert_eq!(tiny.write_back_limit_bytes, 64 * block);
        let set = TierOptions {
            probe_budget_s: Some(0.25),
            write_back_limit_mb: Some(1.0),
            write_back_policy: Some(WriteBackPolicy::Wait),
            enable_kv_events: Some(true),
            locality: Some(Locality::Local),
            admit_after_lookups: Some(2),
            write_budget_mb_per_s: Some(0.5),
            chain_eviction: Some(true),
        }
        .resolve(true, budget, block);
        assert_eq!(
            set,
            TierSettings {
                probe_budget: Duration::from_millis(250),
                write_back_limit_bytes: 1 << 20,
                write_back_policy: WriteBackPolicy::Wait,
                events: true,
                locality: Some(Locality::Local),
                admit_after_lookups: 2,
                write_budget_bytes_per_s: Some(1 << 19),
                chain_eviction: true,
            }
        );
        assert!(!local.events, "events are off unless asked for, as in vLLM");
        assert!(local.chain_eviction, "chain eviction unless turned off");
        let lru = TierOptions {
            chain_eviction: Some(false),
            ..TierOptions::default()
        }
        .resolve(true, budget, block);
        assert!(!lru.chain_eviction, "turned off");
    }
}
