//! Helpers of kv-tier-core's integration tests, each defined once: the block sizes and bounds
//! (here), managers and their fixtures ([`managers`]), the engine's side of a step
//! ([`engine`]), tiers written for the tests ([`tiers`]), fs and obj tiers ([`fs`], [`obj`]),
//! configs ([`config`]), the promotion-hold fixture ([`holds`]), process-wide concerns (child
//! runs of this binary, threads, panics: [`process`]), traffic ([`traffic`]) and the
//! Prometheus text parser ([`prom`]). The testkit's helpers (`kv_tier_testkit::wait`,
//! `kv_tier_testkit::fixtures::manager`, `engine_store`, `sim::Rng`, ...) are re-exported
//! here, so a test module needs `use crate::support::*` and its own imports only.

use std::time::Duration;

pub(crate) mod config;
pub(crate) mod engine;
pub(crate) mod fs;
pub(crate) mod holds;
pub(crate) mod managers;
pub(crate) mod obj;
pub(crate) mod process;
pub(crate) mod prom;
pub(crate) mod tiers;
pub(crate) mod traffic;

pub(crate) use config::*;
pub(crate) use engine::*;
pub(crate) use fs::*;
pub(crate) use holds::*;
pub(crate) use managers::*;
pub(crate) use obj::*;
pub(crate) use process::*;
pub(crate) use tiers::*;
pub(crate) use traffic::*;

pub(crate) use kv_tier_testkit::fixtures::manager::*;
pub(crate) use kv_tier_testkit::sim::Rng;
pub(crate) use kv_tier_testkit::util::{engine_store, lru_dram, try_engine_store};
pub(crate) use kv_tier_testkit::wait::*;
pub(crate) use kv_tier_testkit::{FaultyTier, Gate, MemoryTier, find_files};

/// Bytes per block of most tests (one page: a DRAM slot holds exactly one block).
pub(crate) const BS: usize = 4096;

/// Bytes per block of the tests written in 64 KiB blocks (vLLM-shaped configs, the facade's
/// and the namespace's tests, the admission tests' write budgets).
pub(crate) const BS_64K: usize = 65536;

/// Bounds a wait under traffic or on a slow tier: one that never ends fails its test instead
/// of hanging the suite (the testkit's waits use [`SETTLE_LIMIT`] otherwise).
pub(crate) const LIMIT: Duration = Duration::from_secs(60);

/// Bytes in a GiB, for the fs tier's `gc_max_size_gb`.
pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// The `layout` of a config for the test model of [`model_namespace`] (`org/model`,
/// `torch.bfloat16`, 16 tokens per hash), as a JSON member to splice into a config.
pub(crate) const LAYOUT: &str =
    r#""layout": {"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}"#;

/// The DRAM tier's name in events and statistics.
pub(crate) const CPU: &str = kv_tier::cpu::CPU_TIER_NAME;

/// DRAM slots of the promotion-hold tests' managers ([`hold_fx`]).
pub(crate) const SLOTS: usize = 4;

/// How long a relayed operation of [`RelayTier`] waits for the next one before ending on
/// its own.
pub(crate) const FALLBACK: Duration = Duration::from_millis(300);

/// The model of the namespace tests (an MLA model vLLM does not share across TP ranks unless
/// replicated).
pub(crate) const MODEL: &str = "deepseek-ai/DeepSeek-V2-Lite";
