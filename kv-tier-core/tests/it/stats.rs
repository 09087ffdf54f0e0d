//! The manager's statistics: every verdict counted once, DRAM's figures match what the API shows,
//! cascade counters agree once idle, each tier's own statistics serialised.

use std::sync::Arc;

use kv_tier_core::{BlockKey, KvTierConfig, LookupResult, RequestContext, RequestId};
use kv_tier_testkit::{MemoryTier, fill_block, test_key, verify_block};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_verdict_is_counted_once_by_kind() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let (in_tier, nowhere, in_dram, writing) = (test_key(1), test_key(2), test_key(3), test_key(4));
    seed(&*inner, &[in_tier]).await;
    let (m, _cpu) = manager_and_dram(8, inner.clone()).await;
    let req = RequestContext::new(1);
    engine_store(&m, RequestId(9), &[in_dram]);
    let prepared = m.prepare_store(&[writing]).unwrap();
    assert_eq!(m.lookup(&in_dram, &req), LookupResult::Hit);
    assert_eq!(m.lookup(&writing, &req), LookupResult::HitPending);
    assert_eq!(m.lookup(&in_tier, &req), LookupResult::Retry);
    assert_eq!(m.lookup(&nowhere, &req), LookupResult::Retry);
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.lookup(&in_tier, &req), LookupResult::HitPending);
    assert_eq!(m.lookup(&nowhere, &req), LookupResult::Miss);
    let s = m.stats();
    assert_eq!(
        (s.lookups, s.hits, s.hits_pending, s.retries, s.misses),
        (6, 1, 2, 2, 1)
    );
    assert_eq!(s.tiers[0].hits, 1, "the promotion counted for its tier");
    prepared.abort();
}

/// Promise (kv-tier-core/src/stats/mod.rs `PrimaryStats`): "capacity_blocks: Total slots",
/// "ready_blocks: Slots holding a readable block", "writing_blocks: Slots being written",
/// "evictions: Blocks evicted since start"; `ManagerStats`: "lookups: `lookup` calls" and
/// one counter per verdict. Under a seeded random mix of stores, aborts, drops, loads,
/// touches and lookups, the counters always match what the API shows.
#[test]
fn primary_stats_always_match_what_is_observable() {
    let cap = 6usize;
    let m = build(dram_cfg(cap, BS, ""));
    let pool: Vec<_> = (0..15).map(test_key).collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut evicted_seen = 0u64;
    let mut my_lookups = 0u64;
    let mut verdicts = [0u64; 4];
    for step in 0..600 {
        let n = 1 + rnd(3) as usize;
        let keys: Vec<_> = (0..n).map(|_| pool[rnd(15) as usize]).collect();
        match rnd(6) {
            0 | 1 => {
                if let Ok(mut p) = m.prepare_store(&keys) {
                    evicted_seen += p.evicted().len() as u64;
                    let writing = p.keys().len();
                    assert!(m.stats().primary.writing_blocks >= writing);
                    for (key, s) in p.slots() {
                        fill_block(key, 0, s.as_mut_slice());
                    }
                    match rnd(3) {
                        0 => p.abort(),
                        1 => drop(p),
                        _ => {
                            let _ = p.commit(RequestId(step));
                        }
                    }
                }
            }
            2 => {
                if let Ok(v) = m.prepare_load(&keys) {
                    for (key, view) in keys.iter().zip(&v) {
                        assert!(verify_block(key, 0, view.as_slice()));
                    }
                }
            }
            3 => m.touch(&keys),
            _ => {
                let r = m.lookup(&keys[0], &RequestContext::new(step));
                my_lookups += 1;
                verdicts[match r {
                    LookupResult::Hit => 0,
                    LookupResult::HitPending => 1,
                    LookupResult::Retry => 2,
                    LookupResult::Miss => 3,
                }] += 1;
            }
        }
        let st = m.stats();
        let p = &st.primary;
        assert_eq!(p.capacity_blocks, cap);
        assert_eq!(p.writing_blocks, 0, "step {step}: {p:?}");
        assert!(p.ready_blocks <= cap);
        assert_eq!(p.evictions, evicted_seen, "step {step}: {p:?}");
        assert_eq!(st.lookups, my_lookups, "step {step}");
        assert_eq!(
            [st.hits, st.hits_pending, st.retries, st.misses],
            verdicts,
            "step {step}"
        );
        if step % 50 == 0 {
            // count readable keys without counting the lookups above
            let readable = pool
                .iter()
                .filter(|key| m.prepare_load(&[**key]).is_ok())
                .count();
            assert_eq!(p.ready_blocks, readable, "step {step}: {p:?}");
        }
    }
}

/// Promise (kv-tier-core/src/stats/mod.rs): `cascades`: "Store cascades started (one per
/// successful `complete_store` with new blocks)"; `store_jobs`: "Store jobs finished";
/// `blocks_stored`; `write_back_pinned_bytes`: "DRAM bytes pinned by store jobs now";
/// `write_back_bytes`: "Bytes of store jobs queued or in flight to this tier now";
/// pending.rs `commit`: "one store job per secondary tier". Once idle, the counters agree
/// with each other and with the tier's own.
#[test]
fn cascade_counters_agree_once_idle() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
        16 * BS,
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    for b in 0..3u64 {
        let keys: Vec<_> = (0..4).map(|i| test_key(b * 10 + i)).collect();
        store_evicting(&m, 1, &keys);
        block_on_idle(&m);
    }
    // present only: nothing new, no cascade
    store_evicting(&m, 1, &[test_key(0), test_key(1)]);
    block_on_idle(&m);
    let st = m.stats();
    let t = &st.tiers[0];
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    assert_eq!(st.cascades, 3, "{st:?}");
    assert_eq!(t.store_jobs, 3, "{t:?}");
    assert_eq!(t.blocks_stored, 12, "{t:?}");
    assert_eq!(t.bytes_stored, 12 * BS as u64, "{t:?}");
    assert_eq!(fs.stats().blocks.blocks_written, 12);
    assert_eq!(
        (st.write_back_pinned_bytes, t.write_back_bytes),
        (0, 0),
        "{st:?}"
    );
    assert!(st.write_back_pinned_peak_bytes >= 4 * BS as u64, "{st:?}");
    assert!(t.write_back_peak_bytes >= 4 * BS as u64, "{t:?}");
    assert_eq!((t.writes_dropped, t.store_failures), (0, 0));
    m.shutdown_blocking().unwrap();
}

/// The manager's statistics carry each tier's own (through `SecondaryTier::stats`) and
/// serialise whole: what a report or an endpoint hands out.
#[test]
fn the_manager_reports_each_tiers_own_statistics_serialisable() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS_64K},
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "name": "disk",
                                  "gc_max_size_gb": 1}}]}}"#,
        8 * BS_64K,
        dir.path()
    ))
    .unwrap();
    let m = kv_tier::builder(cfg).unwrap().build_blocking().unwrap();
    let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    m.on_request_finished(RequestId(1));
    m.runtime().block_on(m.wait_idle());
    let s = m.stats();
    let own = &s.tiers[0].own;
    assert_eq!(own.kind, "fs");
    assert_eq!(own.blocks.blocks_written, 3);
    assert_eq!(own.capacity_bytes, Some(1 << 30));
    assert!(own.used_bytes.unwrap() >= 3 * BS_64K as u64, "{own:?}");
    let swept = own
        .figures
        .iter()
        .find(|f| f.name == "gc_swept_files")
        .expect("the GC's figures are listed");
    assert_eq!(swept.kind, kv_tier::core::stats::FigureKind::Counter);
    assert_eq!(swept.help, "Files deleted by sweeps.");
    assert!(
        !own.figures.iter().any(|f| f.name.starts_with("blocks_")),
        "the block counters are not listed twice"
    );
    let v = serde_json::to_value(&s).unwrap();
    assert_eq!(v["tiers"][0]["name"], "disk");
    assert_eq!(v["tiers"][0]["blocks_stored"], 3);
    assert_eq!(
        v["tiers"][0]["own"]["detail"]["blocks"]["blocks_written"],
        3
    );
    assert_eq!(
        v["tiers"][0]["own"]["detail"]["gc"]["cap_bytes"],
        1u64 << 30
    );
    assert_eq!(v["tiers"][0]["store_latency"]["count"], 1);
    assert!(v["tiers"][0]["store_latency"]["p50_s"].as_f64().unwrap() > 0.0);
    m.shutdown_blocking().unwrap();
}
