//! [`TieringManagerBuilder`]: the primary, the tiers from the config and the registry, the
//! runtime (given, current or owned), and the checks made at construction.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::Notify;

use super::{State, TieringManager};
use crate::config::KvTierConfig;
use crate::error::{Error, Result};
use crate::layout::Namespace;
use crate::probe_cache::ProbeCache;
use crate::registry::{BuildContext, TierRegistry};
use crate::stats::{ManagerStats, TierStats};
use crate::tier::{PrimaryTier, SecondaryTier};
use crate::tier_options::TierOptions;

pub(super) struct OwnedRuntime(Option<tokio::runtime::Runtime>);

impl Drop for OwnedRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// Builds a [`TieringManager`]; see [`TieringManager::builder`].
pub struct TieringManagerBuilder {
    config: KvTierConfig,
    primary: Option<Arc<dyn PrimaryTier>>,
    registry: TierRegistry,
    runtime: Option<tokio::runtime::Handle>,
    namespace: Option<Namespace>,
    extra: Vec<(Arc<dyn SecondaryTier>, TierOptions)>,
    recompute: Option<super::RecomputeTime>,
}

impl fmt::Debug for TieringManagerBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TieringManagerBuilder")
            .field("config", &self.config)
            .field("registry", &self.registry)
            .finish()
    }
}

impl TieringManagerBuilder {
    pub(super) fn new(config: KvTierConfig) -> Self {
        Self {
            config,
            primary: None,
            registry: TierRegistry::new(),
            runtime: None,
            namespace: None,
            extra: Vec::new(),
            recompute: None,
        }
    }

    /// The engine's time to recompute (prefill) a number of blocks, for engines whose rate
    /// depends on the batch: with it (or the config's `prefill_tokens_per_s`, which it
    /// overrides), the manager loads only the part of a prefix that is ready sooner than
    /// recomputing it ([`TieringManager::lookup_many`]).
    ///
    /// ```
    /// # async fn demo(config: kv_tier_core::KvTierConfig) -> kv_tier_core::Result<()> {
    /// use std::time::Duration;
    /// use kv_tier_core::{RecomputeTime, TieringManager};
    /// // 16 tokens a block, 8,000 tokens a second
    /// let manager = TieringManager::builder(config)
    ///     .recompute_time(RecomputeTime::at_rate(8_000.0, 16))
    ///     .build()
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub fn recompute_time(mut self, recompute: super::RecomputeTime) -> Self {
        self.recompute = Some(recompute);
        self
    }

    /// The DRAM primary (required; `kv_tier_cpu::CpuTier` is the standard one).
    pub fn primary(mut self, primary: Arc<dyn PrimaryTier>) -> Self {
        self.primary = Some(primary);
        self
    }

    /// The registry that builds `secondary_tiers` entries by type.
    pub fn registry(mut self, registry: TierRegistry) -> Self {
        self.registry = registry;
        self
    }

    /// Runs jobs on this runtime (default: the current one, or a small owned one with
    /// [`TieringManagerBuilder::build_blocking`]).
    pub fn runtime(mut self, handle: tokio::runtime::Handle) -> Self {
        self.runtime = Some(handle);
        self
    }

    /// The namespace (the engine's). With a `layout` in the config too, the two must name
    /// the same directory (building fails naming `layout` otherwise).
    pub fn namespace(mut self, ns: Namespace) -> Self {
        self.namespace = Some(ns);
        self
    }

    /// Appends an already-built tier after the configured ones (with default
    /// [`TierOptions`]).
    pub fn tier(self, tier: Arc<dyn SecondaryTier>) -> Self {
        self.tier_with_options(tier, TierOptions::default())
    }

    /// Appends an already-built tier after the configured ones, with the manager's options
    /// for it (probe budget, write-back limit and policy), as a `secondary_tiers` entry would
    /// set them.
    pub fn tier_with_options(mut self, tier: Arc<dyn SecondaryTier>, options: TierOptions) -> Self {
        self.extra.push((tier, options));
        self
    }

    /// Builds on the given runtime or the current one.
    pub async fn build(self) -> Result<TieringManager> {
        let handle = match &self.runtime {
            Some(h) => h.clone(),
            None => tokio::runtime::Handle::try_current().map_err(|_| {
                Error::config(
                    "runtime",
                    "no tokio runtime: pass one with .runtime() or use build_blocking()",
                )
            })?,
        };
        self.build_on(handle, OwnedRuntime(None)).await
    }

    /// Builds from synchronous code: on the given runtime, or on a small runtime of its own
    /// (2 worker threads) that the manager owns. Must not be called from async code.
    pub fn build_blocking(self) -> Result<TieringManager> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::config(
                "runtime",
                "build_blocking() called inside a tokio runtime; use build().await",
            ));
        }
        let (handle, owned) = match &self.runtime {
            Some(h) => (h.clone(), OwnedRuntime(None)),
            None => {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("kv-tier")
                    .enable_all() // timers, and sockets for network tiers
                    .build()
                    .map_err(|e| Error::io("start runtime", "tokio", e))?;
                (rt.handle().clone(), OwnedRuntime(Some(rt)))
            }
        };
        handle.clone().block_on(self.build_on(handle, owned))
    }

    async fn build_on(
        self,
        handle: tokio::runtime::Handle,
        owned: OwnedRuntime,
    ) -> Result<TieringManager> {
        self.config.validate()?;
        let primary = self.primary.ok_or_else(|| {
            Error::config("primary", "no primary tier: pass one with .primary() (kv_tier_cpu::CpuTier::from_config builds it)")
        })?;
        if primary.block_size() as u64 != self.config.block_size_bytes {
            return Err(Error::config(
                "block_size_bytes",
                format!(
                    "is {} but the primary tier's block size is {}",
                    self.config.block_size_bytes,
                    primary.block_size()
                ),
            ));
        }
        let namespace = match self.namespace {
            Some(ns) => {
                // two namespaces that disagree: refused, not one silently chosen
                if let Some(l) = &self.config.layout {
                    let from_config = l.namespace()?;
                    if from_config.rank_dir_name() != ns.rank_dir_name() {
                        return Err(Error::config(
                            "layout",
                            format!(
                                "the config's layout names {} but the engine's namespace is {}: drop one, or make them agree",
                                from_config.rank_dir_name(),
                                ns.rank_dir_name()
                            ),
                        ));
                    }
                }
                Some(ns)
            }
            None => self
                .config
                .layout
                .as_ref()
                .map(|l| l.namespace())
                .transpose()?,
        };
        let mut tiers: Vec<Arc<dyn SecondaryTier>> = Vec::new();
        let mut names: Vec<String> = Vec::new();
        for (i, spec) in self.config.secondary_tiers.iter().enumerate() {
            let ctx = BuildContext {
                name: spec.name.clone(),
                block_size: primary.block_size(),
                namespace: namespace.clone(),
                runtime: handle.clone(),
            };
            let tier = self.registry.build(i, spec, &ctx).await?;
            tiers.push(tier);
            names.push(spec.name.clone());
        }
        let mut options: Vec<TierOptions> = self
            .config
            .secondary_tiers
            .iter()
            .map(|t| t.tiering)
            .collect();
        for (t, o) in self.extra {
            o.validate("tier_with_options")?;
            let name = t.info().name;
            tiers.push(t);
            names.push(name);
            options.push(o);
        }
        for (i, n) in names.iter().enumerate() {
            if names[..i].contains(n) {
                return Err(Error::config(
                    "secondary_tiers",
                    format!("two tiers are named {n:?}"),
                ));
            }
        }
        if let Some(ns) = &namespace {
            self.config.check_namespace(ns)?;
        }
        let recompute = match (self.recompute, self.config.prefill_tokens_per_s) {
            (Some(r), _) => Some(r),
            (None, Some(rate)) => {
                let tokens = self
                    .config
                    .tokens_per_block(namespace.as_ref())
                    .ok_or_else(|| {
                        Error::config(
                            "prefill_tokens_per_s",
                            "needs the tokens per block: give `block_size`, or a layout (or the engine's namespace) with `tokens_per_hash`",
                        )
                    })?;
                Some(super::RecomputeTime::at_rate(rate, tokens))
            }
            (None, None) => None,
        };
        check_timers(&handle).await?;
        let notify = Arc::new(Notify::new());
        let settings: Vec<_> = options
            .iter()
            .zip(&tiers)
            .map(|(o, t)| {
                o.resolve(
                    t.info().locality == crate::event::Locality::Remote,
                    self.config.write_back_budget(),
                    self.config.block_size_bytes,
                )
            })
            .collect();
        primary.bound_events(self.config.event_buffer_keys);
        let events: Vec<_> = settings.iter().map(|s| (s.events, s.locality)).collect();
        for (t, s) in tiers.iter().zip(&settings) {
            t.configure_events(crate::event::EventSettings {
                enabled: s.events,
                locality: s.locality,
                max_keys: self.config.event_buffer_keys,
            });
        }
        let lookups = tiers
            .iter()
            .zip(&settings)
            .map(|(t, s)| {
                ProbeCache::new(t.clone(), handle.clone(), notify.clone())
                    .with_timeouts(self.config.probe_timeout(), self.config.lease())
                    .with_budget(s.probe_budget.min(self.config.probe_timeout()))
            })
            .collect();
        let pool = primary.stats().capacity_blocks as u64 * primary.block_size() as u64;
        let max_pinned = ((pool as f64 * self.config.write_back_max_dram_fraction) as u64)
            .max(primary.block_size() as u64);
        let admission = super::admission::Admission::new(
            self.config.store_threshold,
            self.config.max_tracker_size,
            &settings,
            self.config.block_size_bytes,
        );
        let write_back = super::write_back::WriteBack::new(settings, max_pinned);
        let stats = ManagerStats {
            tiers: names
                .iter()
                .map(|n| TierStats {
                    name: n.clone(),
                    ..TierStats::default()
                })
                .collect(),
            ..ManagerStats::default()
        };
        Ok(TieringManager {
            state: Mutex::new(State {
                in_step: false,
                lookups,
                promotions: BTreeMap::new(),
                promoting: FxHashMap::default(),
                last_miss: FxHashMap::default(),
                holds: Default::default(),
                jobs: FxHashMap::default(),
                loading: vec![super::jobs::Loading::default(); tiers.len()],
                load_models: tiers.iter().map(|_| Default::default()).collect(),
                steps: Default::default(),
                retried: Vec::new(),
                next_job: 0,
                pending_stores: FxHashMap::default(),
                finishing: FxHashSet::default(),
                stats,
                shut_down: false,
                write_back,
                admission,
                request_level: FxHashMap::default(),
                chains: Default::default(),
            }),
            primary,
            tiers,
            names,
            events,
            config: self.config,
            recompute,
            notify,
            inbox: Arc::new(Mutex::new(Vec::new())),
            runtime: handle,
            _owned_runtime: owned,
            metrics: crate::metrics::MetricsPublisher::new(),
            log_abandoned: crate::stats::Throttle::new(crate::stats::LOG_INTERVAL),
            log_failed: crate::stats::Throttle::new(crate::stats::LOG_INTERVAL),
        })
    }
}

/// Deadlines need the runtime's timers: refuse a runtime built without them, at construction
/// rather than at the first probe.
async fn check_timers(handle: &tokio::runtime::Handle) -> Result<()> {
    let probe = handle.spawn(async {
        std::panic::catch_unwind(|| drop(tokio::time::sleep(Duration::ZERO))).is_ok()
    });
    match probe.await {
        Ok(true) => Ok(()),
        _ => Err(Error::config(
            "runtime",
            "the runtime has no timers (deadlines need them): build it with enable_time() or enable_all()",
        )),
    }
}
