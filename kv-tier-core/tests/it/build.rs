//! Building a manager: tier types from the registry (unknown ones refused), a runtime of its own or
//! the engine's (one without timers refused), typed access to its tiers, a local tier's defaults,
//! what the manager shows of itself.

use std::sync::Arc;

use kv_tier_core::{KvTierConfig, RequestId, SecondaryTier, TieringManager};
use kv_tier_testkit::util::lru_dram;
use kv_tier_testkit::{FaultyTier, MemoryTier, test_key};

use crate::support::*;

#[test]
fn build_blocking_owns_a_runtime_and_unknown_types_are_refused() {
    let cfg = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 16384, "block_size_bytes": 4096, "secondary_tiers": [{"type": "memory"}, {"type": "nvme"}]}"#,
    )
    .unwrap();
    let mut reg = kv_tier_core::TierRegistry::new();
    MemoryTier::register(&mut reg).unwrap();
    let err = kv_tier_testkit::dram_manager_builder(cfg.clone())
        .unwrap()
        .registry(reg.clone())
        .build_blocking()
        .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("secondary_tiers[1].type") && msg.contains("\"nvme\""),
        "{msg}"
    );
    let bad = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 16384, "block_size_bytes": 4096, "secondary_tiers": [{"type": "memory", "size": 3}]}"#,
    )
    .unwrap();
    let err = kv_tier_testkit::dram_manager_builder(bad)
        .unwrap()
        .registry(reg.clone())
        .build_blocking()
        .unwrap_err();
    assert!(err.to_string().contains("secondary_tiers[0].size"), "{err}");
    let mut ok = cfg;
    ok.secondary_tiers.pop();
    let m = kv_tier_testkit::dram_manager_builder(ok)
        .unwrap()
        .registry(reg)
        .build_blocking()
        .unwrap();
    assert_eq!(m.tier_names(), ["memory"]);
    let k = test_key(1);
    engine_store(&m, RequestId(1), &[k]);
    m.runtime().clone().block_on(m.wait_idle());
    assert_eq!(m.stats().tiers[0].blocks_stored, 1);
}

/// Typed access finds a tier the manager built by its name, as its own type, and nothing
/// under another name or type.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn typed_access_finds_the_tier_of_that_name_and_type() {
    let (a, b) = (mem("a"), mem("b"));
    let fx = evented_manager(8, vec![a.clone(), b.clone()]).await;
    let got = fx.m.tier::<MemoryTier>("b").expect("tier b");
    assert!(Arc::ptr_eq(&got, &b));
    assert!(Arc::ptr_eq(&fx.m.tier::<MemoryTier>("a").unwrap(), &a));
    assert!(fx.m.tier::<FaultyTier>("a").is_none(), "another type");
    assert!(fx.m.tier::<MemoryTier>("c").is_none(), "no such name");
}

/// A local tier gets the local defaults (no probe budget of its own: the probe deadline
/// bounds it); the manager's stats name every tier; `Debug` of the builder and of a pending
/// store shows what they hold.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_tier_gets_local_defaults_and_stats_and_debug_name_things() {
    let t = mem("fs");
    assert_eq!(t.info().locality, kv_tier_core::Locality::Local);
    let b = TieringManager::builder(KvTierConfig::new((8 * BS) as u64, BS as u64));
    assert!(format!("{b:?}").contains("TieringManagerBuilder"), "{b:?}");
    let fx = evented_manager(8, vec![t.clone()]).await;
    assert_eq!(fx.m.tier_settings(0).probe_budget, std::time::Duration::MAX);
    assert_eq!(fx.m.stats().tiers[0].name, "fs");
    let (a, b) = (test_key(1), test_key(2));
    engine_store(&fx.m, RequestId(1), &[a]);
    let p = fx.m.prepare_store(&[a, b]).unwrap();
    assert_eq!(
        p.present(),
        &[a],
        "a block in DRAM is present, not stored again"
    );
    assert_eq!(p.keys(), vec![b]);
    let shown = format!("{p:?}");
    assert!(
        shown.contains("present") && shown.contains(&a.to_string()),
        "{shown}"
    );
    p.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manager_shows_its_parts() {
    let inner = Arc::new(MemoryTier::new("memory-tier", BS));
    let (m, _cpu) = manager_and_dram(8, inner.clone()).await;
    assert_eq!(m.block_size(), BS);
    assert_eq!(m.tiers().len(), 1);
    assert_eq!(m.tiers()[0].info().name, "memory-tier");
    assert_eq!(m.tier_names(), ["memory-tier".to_string()]);
    assert_eq!(m.primary().block_size(), BS);
    let text = format!("{m:?}");
    assert!(
        text.contains("TieringManager") && text.contains("memory-tier"),
        "{text}"
    );
}

#[test]
fn a_runtime_without_timers_is_refused_at_build() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let cfg = KvTierConfig::new((8 * BS) as u64, BS as u64);
    let err = rt
        .block_on(
            TieringManager::builder(cfg)
                .primary(lru_dram(8, BS))
                .tier(mem("fs"))
                .build(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("timers"), "{err}");
}

/// A runtime without timers is refused at construction (deadlines need them), not at the
/// first probe; `shutdown_blocking` inside a runtime is refused, not a panic.
#[test]
fn runtime_misuse_is_refused_cleanly() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .build()
        .unwrap();
    let r = kv_tier::builder(dram_cfg(4, BS, ""))
        .unwrap()
        .tier(Script::new("mem", BS))
        .runtime(rt.handle().clone())
        .build_blocking();
    assert!(r.is_err(), "a runtime without timers was accepted");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let m = rt.block_on(async {
        kv_tier::builder(dram_cfg(4, BS, ""))
            .unwrap()
            .tier(Script::new("mem", BS))
            .build()
            .await
            .unwrap()
    });
    let r = rt.block_on(async { m.shutdown_blocking() });
    assert!(
        r.is_err(),
        "shutdown_blocking inside a runtime was not refused"
    );
    rt.block_on(m.shutdown()).unwrap();
}
