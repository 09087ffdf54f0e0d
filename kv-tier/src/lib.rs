//! # kv-tier: a KV-cache hierarchy for LLM serving engines
//!
//! Host DRAM, then local NVMe files, then object storage. The engine's scheduler asks which
//! prefix blocks it already has; kv-tier answers without blocking, moves blocks between tiers
//! in the background, keeps every tier within its capacity, and never returns a wrong or torn
//! block. This crate is the one to depend on: it re-exports the public types, builds a
//! [`TieringManager`] with the DRAM tier and the built-in secondary tiers already registered
//! ([`builder`]), and gives typed access to the tiers a manager built
//! ([`TieringManager::tier`]).
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `fs` | yes | the file tier, type `"fs"` ([`fs::FsTier`]) |
//! | `obj` | yes | the object-store tier, type `"obj"` ([`obj::ObjTier`]) |
//! | `prometheus` | no | a Prometheus endpoint for the metrics (`prometheus::serve`; see [`core::metrics`]) |
//!
//! ## The embedding guide
//!
//! ### 1. The config
//!
//! One JSON object in the shape of vLLM's `kv_connector_extra_config`. `cpu_bytes_to_use` and
//! `block_size_bytes` size the DRAM tier; `secondary_tiers` lists the tiers below it in lookup
//! order (each `{"type": ..., "name": ...}` plus the tier's own options; `name` defaults to
//! the type). `layout` names the run the blocks belong to (model, dtype, tokens per hash and
//! the parallel layout): tiers that persist blocks put them in a folder named after it, the
//! same one vLLM uses, and refuse a folder of another run. Unknown keys and out-of-range
//! numbers are refused at construction, with an error naming the field.
//!
//! ```
//! let cfg = kv_tier::KvTierConfig::from_json_str(r#"{
//!     "cpu_bytes_to_use": 67108864,
//!     "block_size_bytes": 65536,
//!     "layout": {
//!         "model_name": "meta-llama/Llama-3.1-8B-Instruct",
//!         "dtype": "torch.bfloat16",
//!         "tokens_per_hash": 16,
//!         "rank": 0
//!     },
//!     "secondary_tiers": [
//!         {"type": "fs", "root_dir": "/tmp/kv-cache", "checksum": "crc32c", "gc_max_size_gb": 100}
//!     ]
//! }"#)?;
//! assert_eq!(cfg.secondary_tiers[0].name, "fs");
//!
//! let err = kv_tier::KvTierConfig::from_json_str(
//!     r#"{"cpu_bytes_to_use": 67108864, "block_size_bytes": 65536, "probe_timeout_s": -1}"#,
//! )
//! .unwrap_err();
//! assert!(err.to_string().contains("probe_timeout_s"));
//! # Ok::<(), kv_tier::Error>(())
//! ```
//!
//! #### vLLM's config, unchanged
//!
//! A `kv_connector_extra_config` written for vLLM's tiering spec parses as is. vLLM's keys
//! keep their meaning: `spec_name` (`"TieringOffloadingSpec"`), `cpu_bytes_to_use`,
//! `block_size` or `blocks_per_chunk` (engine blocks per offloaded block: the layout's
//! `blocks_per_file`), `eviction_policy` with `cache_policy_module_path` (a built-in policy
//! only), `store_threshold` and `max_tracker_size` (DRAM admits a block once lookups asked for
//! it that often); per tier `type`, `module_path` (a registered type only: tiers are Rust types
//! registered at compile time), `enable_kv_events` (off by default, as in vLLM),
//! `locality` (`"LOCAL"`/`"REMOTE"`, the locality its events carry), the fs tier's `root_dir`,
//! `n_read_threads`, `n_write_threads` and the obj tier's `store_config`, `prefix`,
//! `io_threads`. vLLM keys kv-tier does not implement (`offload_prompt_only`,
//! `self_describing_kv_events`, `max_recompute_pending_tokens`, `canonical_layout`) are
//! refused saying why. What vLLM's connector reads off the engine, the engine gives: the bytes
//! of a block ([`KvTierConfig::block_size_bytes`]) and the namespace
//! ([`TieringManagerBuilder::namespace`], or a `layout` in the config; see
//! [`RunFields::from_layout`] for how `parallel_agnostic` and `replicated_layout` are decided
//! as vLLM decides them).
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! let mut cfg = kv_tier::KvTierConfig::from_json_str(&format!(r#"{{
//!     "spec_name": "TieringOffloadingSpec",
//!     "cpu_bytes_to_use": 4194304,
//!     "eviction_policy": "lru",
//!     "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "n_read_threads": 16,
//!                           "enable_kv_events": true, "locality": "LOCAL"}}]
//! }}"#, dir.path()))?;
//! cfg.block_size_bytes = 65536; // the engine's: all layers' K and V of one block
//! let ns = kv_tier::Namespace::new(
//!     kv_tier::RunFields::new("org/model", "torch.bfloat16", 16),
//!     0, // the worker rank
//! )?;
//! let manager = kv_tier::builder(cfg)?.namespace(ns).build_blocking()?;
//! assert_eq!(manager.tier_names(), ["fs"]);
//! # Ok(()) }
//! ```
//!
//! ### 2. Building the manager
//!
//! [`builder`] gives a [`TieringManagerBuilder`] whose primary is the DRAM tier the config
//! sizes and whose registry holds the enabled built-in tiers. A synchronous engine calls
//! `build_blocking()` (the manager then owns a small runtime for its background jobs); an
//! async engine calls `build().await` on its own runtime.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let dir = tempfile::tempdir()?;
//! let cfg = kv_tier::KvTierConfig::from_json_str(&format!(
//!     r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536,
//!         "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
//!         "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
//!     dir.path()
//! ))?;
//! let manager = kv_tier::builder(cfg)?.build_blocking()?;
//! assert_eq!(manager.tier_names(), ["fs"]);
//! // typed access to the tier the manager built: its own API, its stats
//! let fs = manager.tier::<kv_tier::fs::FsTier>("fs").expect("an fs tier named fs");
//! assert_eq!(fs.stats().blocks.blocks_written, 0);
//! manager.shutdown_blocking()?;
//! # Ok(()) }
//! ```
//!
//! ### 3. The step loop
//!
//! All methods but the `async` ones are synchronous, cheap and never block: call them from
//! the scheduler's loop. Answers change only at step boundaries: completed background work
//! is applied at the first call of a step and at
//! [`on_schedule_end`](TieringManager::on_schedule_end).
//!
//! - **Store after prefill**: [`prepare_store`](TieringManager::prepare_store) reserves DRAM
//!   slots and returns a [`PendingStore`]; copy GPU -> DRAM into its slots, then
//!   [`commit`](PendingStore::commit) it. The blocks are readable in DRAM at once and cascade
//!   to every secondary tier in the background. Dropping a `PendingStore` (or
//!   [`abort`](PendingStore::abort)) frees its slots; a committed store cannot have a sink
//!   still being written, by construction.
//! - **Prefix lookup**: [`lookup_prefix`](TieringManager::lookup_prefix) (or
//!   [`lookup`](TieringManager::lookup) per key, in prefix order) answers per key `Hit`
//!   (readable in DRAM), `HitPending` (being promoted from a secondary tier into DRAM, or
//!   being stored), `Retry` (a tier's existence probe is still out) or `Miss`. Ask again next
//!   step for `HitPending` and `Retry`; a probe has a deadline, so no key stays out of
//!   `Hit`/`Miss` for long.
//! - **Promotion**: a key found only in a secondary tier is promoted by a load job sent at
//!   `on_schedule_end`; the block is held in DRAM for the requests told `HitPending` until
//!   they read it.
//! - **Load to GPU**: [`prepare_load`](TieringManager::prepare_load) pins the `Hit` blocks;
//!   copy DRAM -> GPU from the views, then drop them.
//! - **Chains**: pass `lookup_prefix`/`lookup_many` and `prepare_store` a request's keys in
//!   prefix order (as vLLM does): one `prepare_store` call is taken for consecutive blocks of
//!   one chain. For every tier whose entry does not say `chain_eviction: false`, the manager
//!   learns from those lists which block follows which (per request, until it finishes; the
//!   first key of a store is linked to the key its request's lookup put before it) and sends
//!   the links with each store job ([`StoreJob::links`](kv_tier_core::StoreJob::links)); a
//!   bounded fs or obj tier then evicts a chain's later blocks before its earlier ones. An
//!   engine that looks up only the blocks past its own prefix cache says which block the
//!   first one follows ([`RequestContext::follows`](kv_tier_core::RequestContext::follows):
//!   `RequestContext::new(id).follows(last_cached_key, cached_blocks)`),
//!   so the chain does not start again there. A tier of your own reads the links in the
//!   job, or ignores them. With `"eviction_policy": "chain"` DRAM gets the links too (of the
//!   blocks each store and promotion makes readable: `PrimaryTier::link`) and evicts the same
//!   way; it is not the default (see the README's figures).
//! - **Request end**: [`on_request_finished`](TieringManager::on_request_finished) releases
//!   what the request held.
//! - **Shutdown**: [`shutdown`](TieringManager::shutdown) (or `shutdown_blocking`) stops
//!   sending work to the tiers (from then on the manager serves DRAM only), cancels queued
//!   promotions, waits for the jobs in flight and shuts every tier down.
//!
//! ```
//! use kv_tier::{BlockKey, LookupResult, RequestContext};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let dir = tempfile::tempdir()?;
//! # let cfg = kv_tier::KvTierConfig::from_json_str(&format!(
//! #     r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536,
//! #         "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
//! #         "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
//! #     dir.path()
//! # ))?;
//! let manager = kv_tier::builder(cfg)?.build_blocking()?;
//! let prompt: Vec<BlockKey> = (0..4u8).map(|i| BlockKey::from_hash32([i; 32], 0)).collect();
//!
//! // request 1: nothing cached; prefill computes every block, then offloads it
//! let r1 = RequestContext::new(1);
//! let found = manager.lookup_prefix(&prompt, &r1);
//! assert_eq!(found.hit, 0);
//! manager.on_schedule_end();
//! let mut pending = manager.prepare_store(&prompt)?;
//! for (key, sink) in pending.slots() {
//!     sink.as_mut_slice().fill(key.hash_bytes()[0]); // the GPU -> DRAM copy
//! }
//! pending.commit(r1.id);
//! manager.on_request_finished(r1.id);
//!
//! // request 2, same prompt: every block is a hit in DRAM
//! let r2 = RequestContext::new(2);
//! let found = manager.lookup_prefix(&prompt, &r2);
//! assert_eq!(found.hit, prompt.len());
//! let views = manager.prepare_load(&prompt[..found.hit])?;
//! assert!(views[3].as_slice().iter().all(|&b| b == 3)); // the DRAM -> GPU copy
//! drop(views);
//! manager.on_schedule_end();
//! manager.on_request_finished(r2.id);
//!
//! // DRAM emptied (say, restarted): the blocks come back from the fs tier
//! manager.runtime().block_on(manager.reset_cache());
//! let r3 = RequestContext::new(3);
//! let mut steps = 0;
//! loop {
//!     let found = manager.lookup_prefix(&prompt, &r3);
//!     manager.on_schedule_end(); // sends the probes and promotions of this step
//!     if found.hit == prompt.len() {
//!         break;
//!     }
//!     assert!(found.present == prompt.len() || found.retry, "{found:?}");
//!     steps += 1;
//!     assert!(steps < 1000, "a promotion never landed");
//!     manager.runtime().block_on(manager.wait_idle()); // an engine would run its step here
//! }
//! let views = manager.prepare_load(&prompt)?;
//! assert!(views[2].as_slice().iter().all(|&b| b == 2));
//! drop(views);
//! manager.on_request_finished(r3.id);
//! manager.shutdown_blocking()?;
//! # Ok(()) }
//! ```
//!
//! An async engine does the same from a task, building with `build().await` and ending with
//! `shutdown().await`; the step calls stay synchronous:
//!
//! ```
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use kv_tier::{BlockKey, LookupResult, RequestContext};
//! let cfg = kv_tier::KvTierConfig::from_json_str(
//!     r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536}"#,
//! )?;
//! let manager = kv_tier::builder(cfg)?.build().await?;
//! let (req, key) = (RequestContext::new(1), BlockKey::from_hash32([9; 32], 0));
//! let mut pending = manager.prepare_store(&[key])?;
//! pending.slots()[0].1.as_mut_slice().fill(1);
//! pending.commit(req.id);
//! assert_eq!(manager.lookup(&key, &req), LookupResult::Hit);
//! manager.on_schedule_end();
//! manager.on_request_finished(req.id);
//! manager.shutdown().await?;
//! # Ok(()) }
//! ```
//!
//! ### Load or recompute
//!
//! A hit is worth waiting for only while its load ends sooner than recomputing its tokens.
//! The manager keeps, per tier, an estimate of how long a load of `n` bytes takes now
//! ([`load_estimate`](TieringManager::load_estimate): a fixed cost and a rate fitted to the
//! tier's last load jobs, and the bytes queued ahead), and `lookup_prefix` says when its
//! present run is expected in DRAM ([`PrefixCount::ready_in`]). A scheduler can weigh that
//! itself; or the manager decides: with the engine's prefill rate in the config
//! (`prefill_tokens_per_s`, with `block_size` or a layout for the tokens per block) or a
//! [`RecomputeTime`] given to the builder, `lookup_prefix` serves only the part of the prefix
//! that saves the most time and answers `Miss` past it
//! ([`MissCause::RecomputeFaster`]): those promotions are never started, release their DRAM
//! slots and leases, and count in the tier's `promotions_declined`.
//!
//! A request that waits resumes only at the next scheduling step, so the manager weighs a
//! wait at the whole steps it spans, at least one: it measures the engine's step (the median
//! interval of the last 15 `on_schedule_end` calls). An engine with long steps waits for
//! less; a probe not answered yet (`Retry`) is not waited for when even finding every key
//! asked could not pay for the step the request would wait: the request goes on with what it
//! has, and the probe still answers for the requests after it. No request waits on a guess:
//! until two steps have ended no probe is waited for, and a tier whose loads are not measured
//! yet is not waited for either; its first promotion is sent anyway, held for no request, so
//! its blocks land in DRAM for the next requests and its time measures the tier.
//!
//! A promotion that was started can still fall behind: the tier slows down, a queue builds.
//! With the policy on, a load job that has run `promotion_cut_margin` times (default 2, range
//! 1 to 1000) the time its estimate gave it, at a pace at which its blocks not yet landed
//! would take longer than recomputing them, is cut at the next scheduling step: the blocks it
//! has landed are served, the rest are a `Miss` for their request (again
//! [`MissCause::RecomputeFaster`]), every hold and slot is released, and the tier counts
//! `load_jobs_cut` and `promotions_cut`. A tier tells the manager what landed through
//! [`LoadJob::progress`] ([`LoadProgress::landed`], once per block that is whole and
//! verified); a tier that reports nothing loses the whole job when it is cut.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let cfg = kv_tier::KvTierConfig::from_json_str(
//!     r#"{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536, "block_size": 16,
//!         "prefill_tokens_per_s": 10000}"#,
//! )?;
//! let manager = kv_tier::builder(cfg)?.build_blocking()?;
//! let req = kv_tier::RequestContext::new(1);
//! let keys = [kv_tier::BlockKey::from_hash32([1; 32], 0)];
//! let found = manager.lookup_prefix(&keys, &req);
//! // nothing present: nothing to wait for
//! assert_eq!((found.present, found.ready_in), (0, Some(std::time::Duration::ZERO)));
//! // no tier has loaded anything yet: no estimate
//! assert!(manager.load_estimate("fs").is_none());
//! manager.on_schedule_end();
//! manager.shutdown_blocking()?;
//! # Ok(()) }
//! ```
//!
//! ### 4. fs and obj from one config
//!
//! The tiers are consulted in the order given; a store cascades to each. Here an fs tier on
//! a local directory sits above an S3 bucket (an S3 server started in-process for the
//! example; point `endpoint_override` at MinIO, Ceph or R2, or leave it out for AWS):
//!
//! ```
//! # #[tokio::main(flavor = "multi_thread", worker_threads = 2)]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let s3 = kv_tier_testkit::s3::S3Server::start().await;
//! # let (endpoint, access_key, secret_key, bucket) =
//! #     (&s3.endpoint, kv_tier_testkit::s3::AK, kv_tier_testkit::s3::SK, kv_tier_testkit::s3::BUCKET);
//! let dir = tempfile::tempdir()?;
//! let cfg = kv_tier::KvTierConfig::from_json_str(&format!(
//!     r#"{{"cpu_bytes_to_use": 4194304, "block_size_bytes": 65536,
//!         "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
//!         "secondary_tiers": [
//!             {{"type": "fs", "root_dir": {dir:?}, "gc_max_size_gb": 1}},
//!             {{"type": "obj", "bucket": "{bucket}", "endpoint_override": "{endpoint}",
//!               "scheme": "http", "access_key": "{access_key}", "secret_key": "{secret_key}",
//!               "checksum": "crc32c", "probe_budget_s": 0.01}}
//!         ]}}"#,
//!     dir = dir.path(),
//! ))?;
//! let manager = kv_tier::builder(cfg)?.build().await?;
//! assert_eq!(manager.tier_names(), ["fs", "obj"]);
//! let req = kv_tier::RequestContext::new(1);
//! let key = kv_tier::BlockKey::from_hash32([5; 32], 0);
//! let mut pending = manager.prepare_store(&[key])?;
//! pending.slots()[0].1.as_mut_slice().fill(5);
//! pending.commit(req.id);
//! manager.on_request_finished(req.id);
//! manager.wait_idle().await; // the cascade to both tiers
//! let obj = manager.tier::<kv_tier::obj::ObjTier>("obj").unwrap();
//! assert_eq!(obj.stats().blocks.blocks_written, 1);
//! let fs = manager.tier::<kv_tier::fs::FsTier>("fs").unwrap();
//! assert_eq!(fs.stats().blocks.blocks_written, 1);
//! manager.shutdown().await?;
//! # Ok(()) }
//! ```
//!
//! ### 5. Dropping the manager
//!
//! [`shutdown`](TieringManager::shutdown) is the orderly end. Dropping the manager without
//! it is safe but abrupt: jobs still running go on, on the runtime they run on, until they
//! end (each has a deadline); if the manager owns its runtime (`build_blocking`), that runtime
//! is shut down in the background, and those jobs stop at their next await. No tier is left
//! with a torn block either way: the fs tier publishes a block only whole (a temp file renamed
//! into place, reaped at the next open if left behind) and stops its threads when the last
//! handle to it goes; the obj tier's PUTs are whole objects. Blocks that were only in DRAM
//! are gone, and cascades not yet sent are not sent.
//!
//! ### 6. Your own tier
//!
//! Implement [`SecondaryTier`] and register a [`TierBuilder`] under a type name in the
//! [`registry`] before building; `kv-tier-testkit`'s conformance suite checks every rule of
//! the trait against your tier. A tier that knows what it holds without I/O (an index)
//! should answer [`SecondaryTier::holds`]: the manager asks it before it probes, so a key it
//! answers for is a hit (promoted in the same step) or a miss at once, with no `Retry`
//! step; the bounded fs tier answers from its GC index.
//!
//! ```
//! # fn demo(cfg: kv_tier::KvTierConfig, my_builder: impl kv_tier::TierBuilder) -> kv_tier::Result<()> {
//! let mut registry = kv_tier::registry();
//! registry.register("my-tier", my_builder);
//! let manager = kv_tier::builder(cfg)?.registry(registry).build_blocking()?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

pub use kv_tier_core::{
    AlignedBuf, BlockKey, BlockSink, BlockSource, BuildContext, Capability, Error, EventBatch,
    EventLog, EvictionPolicy, FailureCauses, JobResult, KvTierConfig, LatencyHistogram,
    LoadEstimate, LoadJob, LoadProgress, Locality, LookupResult, ManagerStats, Medium, MissCause,
    MissCounts, Namespace, NotWritten, OffloadPolicy, PAGE_SIZE, PendingStore, PrefixCount,
    PreparedStore, Presence, PrimaryStats, PrimaryTier, ProbeCache, ProtectGuard, ProtectionSet,
    RecomputeTime, RequestContext, RequestId, Result, RunFields, SecondaryTier, SinkReader,
    StoreJob, StoreReceipt, TierBuilder, TierEvent, TierFilter, TierInfo, TierOptions,
    TierRegistry, TierSettings, TierSnapshot, TierSpec, TierStats, TieringManager,
    TieringManagerBuilder, WriteBackPolicy, async_trait, count_prefix,
};

/// Everything of the core crate: keys, layout, config, errors, events, the tier traits, the
/// manager.
pub use kv_tier_core as core;

/// The DRAM primary tier.
pub mod cpu {
    pub use kv_tier_cpu::*;
}

/// The file tier (type `"fs"`).
#[cfg(feature = "fs")]
pub mod fs {
    pub use kv_tier_fs::*;
}

/// The object-store tier (type `"obj"`).
#[cfg(feature = "obj")]
pub mod obj {
    pub use kv_tier_obj::*;
}

#[cfg(feature = "prometheus")]
pub mod prometheus;

/// A registry with the enabled built-in secondary tiers registered: `"fs"` and `"obj"`
/// (with the features of the same names). Register your own types on it too.
///
/// ```
/// let registry = kv_tier::registry();
/// assert!(registry.contains("fs") && registry.contains("obj"));
/// ```
pub fn registry() -> TierRegistry {
    #[allow(unused_mut)] // with neither feature, nothing is registered
    let mut registry = TierRegistry::new();
    #[cfg(feature = "fs")]
    kv_tier_fs::FsTier::register(&mut registry).expect("a fresh registry has no \"fs\"");
    #[cfg(feature = "obj")]
    kv_tier_obj::ObjTier::register(&mut registry).expect("a fresh registry has no \"obj\"");
    registry
}

/// The entry point: a manager builder whose primary is the DRAM tier `config` sizes
/// (`cpu_bytes_to_use`, `block_size_bytes`, `eviction_policy`) and whose registry is
/// [`registry`], so every `secondary_tiers` entry of a built-in type is built from the config.
/// Fails if the DRAM tier cannot be made (its size, or memory).
///
/// ```
/// let cfg = kv_tier::KvTierConfig::from_json_str(
///     r#"{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536}"#,
/// )?;
/// let manager = kv_tier::builder(cfg)?.build_blocking()?;
/// assert_eq!(manager.stats().tiers.len(), 0);
/// # Ok::<(), kv_tier::Error>(())
/// ```
pub fn builder(config: KvTierConfig) -> Result<TieringManagerBuilder> {
    let cpu = kv_tier_cpu::CpuTier::from_config(&config)?;
    Ok(TieringManager::builder(config)
        .primary(Arc::new(cpu))
        .registry(registry()))
}

/// `config` as a manager built with `registry` would use it, defaults filled in: the
/// manager's fields, the layout, and every tier's options checked by its type (without
/// building the tier: nothing is created or connected) with the manager's settings for it
/// resolved. Fails naming the field, as building would. What `kv-tier config check` prints.
///
/// ```
/// let cfg = kv_tier::KvTierConfig::from_json_str(r#"{
///     "cpu_bytes_to_use": 1048576, "block_size_bytes": 65536,
///     "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv", "gc_max_size_gb": 10}]
/// }"#)?;
/// let eff = kv_tier::effective_config(&cfg, &kv_tier::registry())?;
/// assert_eq!(eff["probe_timeout_s"], 1.0);
/// let fs = &eff["secondary_tiers"][0];
/// assert_eq!((fs["type"].as_str(), fs["name"].as_str()), (Some("fs"), Some("fs")));
/// assert_eq!(fs["gc_max_size_gb"], 10.0);
/// assert_eq!(fs["checksum"], "none"); // a default, filled in
/// assert_eq!(fs["write_back_policy"], "drop");
///
/// let bad = kv_tier::KvTierConfig::from_json_str(r#"{
///     "cpu_bytes_to_use": 1048576, "block_size_bytes": 65536,
///     "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv", "gc_max_size_gb": -1}]
/// }"#)?;
/// let err = kv_tier::effective_config(&bad, &kv_tier::registry()).unwrap_err();
/// assert!(err.to_string().contains("secondary_tiers[0].gc_max_size_gb"), "{err}");
/// # Ok::<(), kv_tier::Error>(())
/// ```
pub fn effective_config(
    config: &KvTierConfig,
    registry: &TierRegistry,
) -> Result<serde_json::Value> {
    effective_config_and_defaults(config, registry).map(|(v, _)| v)
}

/// [`effective_config`], and which of the tiers' options in it are defaults the config left
/// out (as `secondary_tiers[i].key`). An option that does not apply stays `null` (an fs
/// tier's GC options without `gc_max_size_gb`, its shared-root options without `shared`).
///
/// ```
/// let cfg = kv_tier::KvTierConfig::from_json_str(r#"{
///     "cpu_bytes_to_use": 1048576, "block_size_bytes": 65536,
///     "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv", "gc_max_size_gb": 10}]
/// }"#)?;
/// let (eff, defaults) = kv_tier::effective_config_and_defaults(&cfg, &kv_tier::registry())?;
/// assert_eq!(eff["secondary_tiers"][0]["gc_grace_s"], 300.0);
/// assert!(defaults.iter().any(|d| d == "secondary_tiers[0].gc_grace_s"));
/// assert!(!defaults.iter().any(|d| d == "secondary_tiers[0].gc_max_size_gb"));
/// # Ok::<(), kv_tier::Error>(())
/// ```
pub fn effective_config_and_defaults(
    config: &KvTierConfig,
    registry: &TierRegistry,
) -> Result<(serde_json::Value, Vec<String>)> {
    use serde_json::{Value, json};
    config.validate_as_given()?;
    let mut defaults: Vec<String> = Vec::new();
    let mut tiers = Vec::new();
    for (i, spec) in config.secondary_tiers.iter().enumerate() {
        let mut entry = serde_json::Map::new();
        entry.insert("type".into(), Value::from(spec.kind.clone()));
        entry.insert("name".into(), Value::from(spec.name.clone()));
        if let Some(m) = &spec.module_path {
            entry.insert("module_path".into(), Value::from(m.clone()));
        }
        // the tier's own options, with the defaults it fills in
        let (options, filled) = registry.effective_options(i, spec)?;
        match options {
            Value::Object(options) => entry.extend(options),
            other => {
                entry.insert("options".into(), other);
            }
        }
        defaults.extend(filled.iter().map(|k| format!("secondary_tiers[{i}].{k}")));
        // the built-in remote tier; a custom tier's locality is known once it is built
        let remote = spec.kind == "obj";
        let s = spec
            .tiering
            .resolve(remote, config.write_back_budget(), config.block_size_bytes);
        let budget = s.probe_budget.min(config.probe_timeout());
        entry.insert("probe_budget_s".into(), json!(budget.as_secs_f64()));
        entry.insert(
            "write_back_limit_mb".into(),
            json!(s.write_back_limit_bytes as f64 / (1u64 << 20) as f64),
        );
        entry.insert(
            "write_back_policy".into(),
            json!(match s.write_back_policy {
                WriteBackPolicy::Drop => "drop",
                WriteBackPolicy::Wait => "wait",
            }),
        );
        entry.insert("enable_kv_events".into(), json!(s.events));
        let locality = s.locality.unwrap_or(if remote {
            kv_tier_core::Locality::Remote
        } else {
            kv_tier_core::Locality::Local
        });
        entry.insert("locality".into(), json!(locality.as_str()));
        entry.insert("admit_after_lookups".into(), json!(s.admit_after_lookups));
        entry.insert(
            "write_budget_mb_per_s".into(),
            json!(
                s.write_budget_bytes_per_s
                    .map(|b| b as f64 / (1u64 << 20) as f64)
            ),
        );
        entry.insert("chain_eviction".into(), json!(s.chain_eviction));
        for (key, given) in spec.tiering.given() {
            if !given {
                defaults.push(format!("secondary_tiers[{i}].{key}"));
            }
        }
        tiers.push(Value::Object(entry));
    }
    let layout = config.layout.as_ref().map(|l| {
        let mut v = l.fields.to_json();
        if let Value::Object(m) = &mut v {
            m.insert("rank".into(), json!(l.rank));
        }
        v
    });
    let eff = json!({
        "cpu_bytes_to_use": config.cpu_bytes_to_use,
        // null: left to the engine (vLLM's shape)
        "block_size_bytes": (config.block_size_bytes > 0).then_some(config.block_size_bytes),
        "block_size": config.block_size_tokens,
        "blocks_per_chunk": config.blocks_per_chunk,
        "eviction_policy": match config.eviction_policy {
            EvictionPolicy::Chain => "chain",
            EvictionPolicy::Lru => "lru",
            EvictionPolicy::Arc => "arc",
        },
        "cache_policy_module_path": config.cache_policy_module_path,
        "store_threshold": config.store_threshold,
        "max_tracker_size": config.max_tracker_size,
        "event_buffer_keys": config.event_buffer_keys,
        "probe_timeout_s": config.probe_timeout_s,
        "job_timeout_s": config.job_timeout_s,
        "job_timeout_per_block_s": config.job_timeout_per_block_s,
        "lease_s": config.lease_s,
        "shutdown_timeout_s": config.shutdown_timeout_s,
        "write_back_max_dram_fraction": config.write_back_max_dram_fraction,
        "prefill_tokens_per_s": config.prefill_tokens_per_s,
        "promotion_cut_margin": config.promotion_cut_margin,
        "layout": layout,
        "secondary_tiers": tiers,
    });
    Ok((eff, defaults))
}

/// The option keys that hold secrets (`access_key`, `secret_key`, `session_token`).
pub const SECRET_KEYS: [&str; 3] = ["access_key", "secret_key", "session_token"];

/// Replaces, anywhere in `v`, the non-empty values of the [`SECRET_KEYS`] with `"***"`: an
/// [`effective_config`] to print or log.
///
/// ```
/// let mut v = serde_json::json!({"secondary_tiers": [{"secret_key": "s3cr3t", "access_key": ""}]});
/// kv_tier::redact_secrets(&mut v);
/// assert_eq!(v["secondary_tiers"][0]["secret_key"], "***");
/// assert_eq!(v["secondary_tiers"][0]["access_key"], "", "an empty one says it is unset");
/// ```
pub fn redact_secrets(v: &mut serde_json::Value) {
    use serde_json::Value;
    match v {
        Value::Object(m) => {
            for (k, v) in m.iter_mut() {
                if SECRET_KEYS.contains(&k.as_str()) {
                    if v.as_str().is_some_and(|s| !s.is_empty()) {
                        *v = Value::from("***");
                    }
                } else {
                    redact_secrets(v);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(redact_secrets),
        _ => {}
    }
}
