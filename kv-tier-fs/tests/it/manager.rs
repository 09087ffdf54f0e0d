//! The fs tier under a `TieringManager`: a block found damaged is a miss for the request (no
//! livelock) and a new store heals it; a key a probe found stays through a sweep until its
//! promotion ends.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use kv_tier_core::{
    EvictionPolicy, KvTierConfig, LookupResult, RequestContext, SecondaryTier, TieringManager,
};
use kv_tier_fs::FsTier;
use kv_tier_testkit::util::lru_dram;
use kv_tier_testkit::{temp_root, test_key, verify_block};

use crate::support::*;

/// Through the manager: a failed load is a Miss for the request with no livelock, and a later
/// successful store makes the block a hit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn through_the_manager_a_failed_load_misses_and_a_new_store_heals() {
    use kv_tier_core::{LookupResult, RequestContext, RequestId, TieringManager};
    let root = temp_root();
    let fs = Arc::new(open_checksummed(root.path()));
    let m = TieringManager::builder(kv_tier_core::KvTierConfig::new(16 * BS as u64, BS as u64))
        .primary(lru_dram(16, BS))
        .tier(fs.clone())
        .build()
        .await
        .unwrap();
    let k = test_key(42);
    let put = |m: &TieringManager| {
        let mut p = m.prepare_store(&[k]).unwrap();
        for (key, sink) in p.slots() {
            kv_tier_testkit::fill_block(key, 0, sink.as_mut_slice());
        }
        p.commit(RequestId(1));
    };
    put(&m);
    m.wait_idle().await;
    assert!(fs.block_path(&k).exists());
    m.reset_cache().await;
    // damage the file behind the tier's back
    let path = fs.block_path(&k);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&path, bytes).unwrap();
    let req = RequestContext::new(2);
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(m.lookup(&k, &req));
        m.on_schedule_end();
        m.wait_idle().await;
    }
    assert_eq!(
        seen,
        vec![
            LookupResult::Retry,
            LookupResult::HitPending,
            LookupResult::Miss
        ]
    );
    let probed = fs.stats().keys_probed;
    for _ in 0..3 {
        assert_eq!(m.lookup(&k, &req), LookupResult::Miss);
        m.on_schedule_end();
        m.wait_idle().await;
    }
    assert_eq!(
        fs.stats().keys_probed,
        probed,
        "the failed key was probed again"
    );
    assert_eq!(fs.stats().blocks.checksum_mismatches, 1);
    // a new store (cascaded to fs) heals it, for the same request too
    put(&m);
    m.wait_idle().await;
    m.reset_cache().await;
    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(m.lookup(&k, &req));
        m.on_schedule_end();
        m.wait_idle().await;
    }
    assert_eq!(seen.last(), Some(&LookupResult::Hit), "{seen:?}");
    let views = m.prepare_load(&[k]).unwrap();
    assert!(verify_block(&k, 0, views[0].as_slice()));
}

/// Between the lookup that found a key (in the tier's index) and the promotion that reads it,
/// a sweep runs that would take that key first (it is the oldest). The key is leased: it
/// stays, and the promotion reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_found_by_a_lookup_survives_a_sweep_until_its_promotion_ends() {
    let root = temp_root();
    let fs = Arc::new(FsTier::open("fs", block_cap_cfg(root.path(), 10), ns(), BS).unwrap());
    let keys: Vec<_> = (0..15).map(test_key).collect();
    assert!(fs_store(&*fs, &keys, 0).await.is_success());
    for (i, k) in keys.iter().enumerate() {
        let f = std::fs::File::options()
            .write(true)
            .open(fs.block_path(k))
            .unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs((15 - i as u64) * 1000))
            .unwrap(); // key 0 is the oldest, all are past the grace window
    }
    fs.gc_rescan_now().unwrap();
    let cpu = Arc::new(
        kv_tier_cpu::CpuTier::new(kv_tier_cpu::CpuTierConfig {
            capacity_bytes: (16 * BS) as u64,
            block_size: BS,
            policy: EvictionPolicy::Lru,
            prefault: false,
        })
        .unwrap(),
    );
    let m = TieringManager::builder(KvTierConfig::new((16 * BS) as u64, BS as u64))
        .primary(cpu)
        .tier(fs.clone())
        .build()
        .await
        .unwrap();
    let req = RequestContext::new(1);
    let k = keys[0];
    // found in the index at once, leased, its promotion queued (sent at the step's end)
    assert_eq!(m.lookup(&k, &req), LookupResult::HitPending);
    assert!(fs.is_protected(&k), "a found key is not leased");
    let swept = fs.gc_sweep_now().unwrap();
    assert!(swept > 0, "the sweep deleted nothing");
    assert!(fs.block_path(&k).exists(), "the sweep deleted a leased key");
    assert!(!fs.block_path(&keys[1]).exists(), "the next oldest goes");
    m.on_schedule_end();
    m.wait_idle().await;
    assert_eq!(m.lookup(&k, &req), LookupResult::Hit);
    let s = m.stats();
    assert_eq!(s.tiers[0].load_failures, 0);
    assert!(!fs.is_protected(&k), "the lease outlived the promotion");
    m.on_request_finished(req.id);
    assert_eq!(m.stats().tiers[0].tracked_keys, 0);
}
