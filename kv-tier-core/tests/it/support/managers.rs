//! Managers as the tests build them: over the DRAM tier and test tiers with core's builder
//! ([`Fx`], [`evented_manager`], [`manager`], [`manager_with`], [`manager_and_dram`],
//! [`two_tier_manager`]), or with the facade's builder over a config ([`build`],
//! [`build_with`], [`memory_manager`]), and the runtime and requests of a test.

use std::sync::Arc;

use kv_tier_core::{
    EvictionPolicy, KvTierConfig, RequestContext, SecondaryTier, TierOptions, TieringManager,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::util::lru_dram;
use kv_tier_testkit::{FaultyTier, MemoryTier};

use super::*;

/// A manager and its DRAM tier (to look at DRAM past the manager).
pub(crate) struct Fx {
    /// The manager (shared: some tests wait on it from other tasks).
    pub(crate) m: Arc<TieringManager>,
    /// Its DRAM tier.
    pub(crate) cpu: Arc<CpuTier>,
}

/// A manager over a prefaulted LRU DRAM tier of `slots` blocks and `tiers` (in that order),
/// each tier's events reported (vLLM's `enable_kv_events`: the tests read them).
pub(crate) async fn evented_manager(slots: usize, tiers: Vec<Arc<dyn SecondaryTier>>) -> Fx {
    let cpu = Arc::new(
        CpuTier::new(CpuTierConfig {
            capacity_bytes: (slots * BS) as u64,
            block_size: BS,
            policy: EvictionPolicy::Lru,
            prefault: true,
        })
        .unwrap(),
    );
    let mut b = TieringManager::builder(KvTierConfig::new((slots * BS) as u64, BS as u64))
        .primary(cpu.clone());
    for t in tiers {
        // the tests read the tiers' events: reported (vLLM's enable_kv_events)
        b = b.tier_with_options(t, kv_tier_core::TierOptions::default().with_events());
    }
    Fx {
        m: Arc::new(b.build().await.unwrap()),
        cpu,
    }
}

/// A manager over an LRU DRAM tier of `slots` blocks and `tiers` (in that order), its config
/// changed by `tune` first.
pub(crate) async fn manager_with(
    slots: usize,
    tiers: Vec<Arc<dyn SecondaryTier>>,
    tune: impl FnOnce(&mut KvTierConfig),
) -> Fx {
    let cpu = lru_dram(slots, BS);
    let mut cfg = KvTierConfig::new((slots * BS) as u64, BS as u64);
    tune(&mut cfg);
    let mut b = TieringManager::builder(cfg).primary(cpu.clone());
    for t in tiers {
        b = b.tier(t);
    }
    Fx {
        m: Arc::new(b.build().await.unwrap()),
        cpu,
    }
}

/// [`manager_with`] the default config.
pub(crate) async fn manager(slots: usize, tiers: Vec<Arc<dyn SecondaryTier>>) -> Fx {
    manager_with(slots, tiers, |_| {}).await
}

/// A manager over an LRU DRAM tier of `slots` blocks and one `tier`, and that DRAM tier.
pub(crate) async fn manager_and_dram(
    slots: usize,
    tier: Arc<dyn SecondaryTier>,
) -> (TieringManager, Arc<CpuTier>) {
    let cpu = lru_dram(slots, BS);
    let m = TieringManager::builder(KvTierConfig::new((slots * BS) as u64, BS as u64))
        .primary(cpu.clone())
        .tier(tier)
        .build()
        .await
        .unwrap();
    (m, cpu)
}

/// A manager over tiers A and B (in that order), with the manager's options for each.
pub(crate) async fn two_tier_manager(
    slots: usize,
    a: Arc<dyn SecondaryTier>,
    b: Arc<dyn SecondaryTier>,
    tune: impl FnOnce(&mut KvTierConfig, &mut [TierOptions; 2]),
) -> TieringManager {
    let mut cfg = KvTierConfig::new((slots * BS) as u64, BS as u64);
    let mut opts = [TierOptions::default(); 2];
    tune(&mut cfg, &mut opts);
    TieringManager::builder(cfg)
        .primary(lru_dram(slots, BS))
        .tier_with_options(a, opts[0])
        .tier_with_options(b, opts[1])
        .build()
        .await
        .unwrap()
}

/// Tier A (fast, a memory tier) and tier B: a memory tier behind a fault-injecting one (to
/// hold it at gates); returns A, B's memory tier and B.
pub(crate) fn two_tiers() -> (Arc<MemoryTier>, Arc<MemoryTier>, Arc<FaultyTier>) {
    let a = Arc::new(MemoryTier::new("a", BS));
    let b_inner = Arc::new(MemoryTier::new("b", BS));
    let b = Arc::new(FaultyTier::new(b_inner.clone()));
    (a, b_inner, b)
}

/// A memory tier named `name` of [`BS`] blocks.
pub(crate) fn mem(name: &str) -> Arc<MemoryTier> {
    Arc::new(MemoryTier::new(name, BS))
}

/// A fault-injecting tier over `inner`.
pub(crate) fn faulty_over(inner: &Arc<MemoryTier>) -> Arc<FaultyTier> {
    Arc::new(FaultyTier::new(inner.clone()))
}

/// A memory tier named `mem` and a fault-injecting tier over it (for gates).
pub(crate) fn faulty_mem() -> (Arc<MemoryTier>, Arc<FaultyTier>) {
    faulty_mem_named("mem")
}

/// A memory tier named `name` and a fault-injecting tier over it.
pub(crate) fn faulty_mem_named(name: &str) -> (Arc<MemoryTier>, Arc<FaultyTier>) {
    let mem = Arc::new(MemoryTier::new(name, BS));
    let faulty = Arc::new(FaultyTier::new(mem.clone()));
    (mem, faulty)
}

/// The facade's builder over `c` (the DRAM tier it sizes and the built-in tier types), built
/// on a runtime of its own.
pub(crate) fn build(c: KvTierConfig) -> TieringManager {
    build_with(c, Vec::new())
}

/// [`build`] with `tiers` added after the config's own.
pub(crate) fn build_with(c: KvTierConfig, tiers: Vec<Arc<dyn SecondaryTier>>) -> TieringManager {
    let mut b = kv_tier::builder(c).unwrap();
    for t in tiers {
        b = b.tier(t);
    }
    b.build_blocking().unwrap()
}

/// [`build`], returning the error instead of panicking.
pub(crate) fn try_build(cfg: KvTierConfig) -> kv_tier::Result<TieringManager> {
    kv_tier::builder(cfg)?.build_blocking()
}

/// A manager with 64 blocks of DRAM of [`BS_64K`] bytes over the `secondary_tiers` entries
/// `tiers` (the reference `"memory"` type registered), `top` added to the config's top level.
pub(crate) fn memory_manager(top: &str, tiers: &str) -> kv_tier::TieringManager {
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS_64K}{top}, "secondary_tiers": [{tiers}]}}"#,
        64 * BS_64K
    ))
    .unwrap();
    let mut registry = kv_tier::registry();
    kv_tier_testkit::MemoryTier::register(&mut registry).unwrap();
    kv_tier::builder(cfg)
        .unwrap()
        .registry(registry)
        .build_blocking()
        .unwrap()
}

/// A multi-threaded runtime of two workers, its threads named `adv-rt` (the thread-counting
/// tests tell them from the threads they count).
pub(crate) fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("adv-rt")
        .enable_all()
        .build()
        .unwrap()
}

/// Runs `f` to its end on `m`'s runtime.
pub(crate) fn block_on<F: std::future::Future>(m: &TieringManager, f: F) -> F::Output {
    m.runtime().block_on(f)
}

/// A request of id `id` asking every tier.
pub(crate) fn ctx(id: u64) -> RequestContext {
    RequestContext::new(id)
}
