//! A promoted block is held in DRAM for the request that asked for it until that request reads
//! it (its lookup answers `Hit`, and the step ends) or finishes. Found by the seeded simulation:
//! with stores filling DRAM between a promotion landing and the request's next step, the
//! request promoted its prefix again and again and never read it.

use std::sync::Arc;

use kv_tier_core::{
    BlockKey, Error, EvictionPolicy, KvTierConfig, LookupResult, PrimaryTier, RequestContext,
    RequestId, SecondaryTier, StoreJob, TieringManager,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::util::{test_key_in_group, try_engine_store};
use kv_tier_testkit::{MemoryTier, source_for, test_key, verify_block};

const BS: usize = 4096;
const SLOTS: usize = 4;

struct Fx {
    m: TieringManager,
    cpu: Arc<CpuTier>,
    k: BlockKey,
}

/// A manager with a 4-slot DRAM over a tier that holds `k`.
async fn fx() -> Fx {
    let t = Arc::new(MemoryTier::new("fs", BS));
    let k = test_key(1);
    let job = StoreJob {
        blocks: vec![(k, source_for(&k, 0, BS))],
    };
    assert!(t.store(job).await.is_success());
    let cpu = Arc::new(
        CpuTier::new(CpuTierConfig {
            capacity_bytes: (SLOTS * BS) as u64,
            block_size: BS,
            policy: EvictionPolicy::Lru,
            prefault: true,
        })
        .unwrap(),
    );
    let m = TieringManager::builder(KvTierConfig::new((SLOTS * BS) as u64, BS as u64))
        .primary(cpu.clone())
        .tier(t)
        .build()
        .await
        .unwrap();
    Fx { m, cpu, k }
}

/// Keys no test request asks for; `n` of them fill `n` DRAM slots.
fn fillers(from: u64, n: usize) -> Vec<BlockKey> {
    (0..n as u64)
        .map(|i| test_key_in_group(1_000 + from + i, 0))
        .collect()
}

impl Fx {
    /// Probes `k` for `req` and lets the promotion land: `k` is Ready in DRAM, not yet read.
    async fn promote(&self, req: &RequestContext) {
        assert_eq!(self.m.lookup(&self.k, req), LookupResult::Retry);
        self.m.on_schedule_end();
        self.m.wait_idle().await;
        assert_eq!(self.m.lookup(&self.k, req), LookupResult::HitPending);
        self.m.on_schedule_end();
        self.m.wait_idle().await;
        assert_eq!(self.cpu.lookup(&self.k), LookupResult::Hit, "landed");
        assert_eq!(self.m.stats().held_blocks, 1);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_block_is_not_evicted_before_its_request_reads_it() {
    let fx = fx().await;
    let req = RequestContext::new(1);
    fx.promote(&req).await;
    // another request wants all of DRAM: the held block is not a victim, so the store is
    // refused (three free slots for four blocks)
    let err = try_engine_store(&fx.m, RequestId(2), &fillers(0, SLOTS)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::CapacityExhausted {
                needed: 4,
                evictable: 3,
                ..
            }
        ),
        "{err}"
    );
    // three fit beside it
    try_engine_store(&fx.m, RequestId(2), &fillers(10, SLOTS - 1)).unwrap();
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    // the request's next step reads it
    assert_eq!(fx.m.lookup(&fx.k, &req), LookupResult::Hit);
    // held to the end of that step (the engine's prepare_load comes after its lookup)
    assert_eq!(fx.m.stats().held_blocks, 1);
    assert!(try_engine_store(&fx.m, RequestId(3), &fillers(20, SLOTS)).is_err());
    let views = fx.m.prepare_load(&[fx.k]).unwrap();
    assert!(verify_block(&fx.k, 0, views[0].as_slice()));
    drop(views);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 0);
    // read and the step over: an ordinary block again, the least recently used one
    try_engine_store(&fx.m, RequestId(3), &fillers(20, SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&fx.k), LookupResult::Miss, "evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_requests_hit_does_not_release_the_hold() {
    let fx = fx().await;
    let req = RequestContext::new(1);
    fx.promote(&req).await;
    let other = RequestContext::new(2);
    assert_eq!(fx.m.lookup(&fx.k, &other), LookupResult::Hit);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 1, "held for request 1, not 2");
    assert!(try_engine_store(&fx.m, RequestId(3), &fillers(0, SLOTS)).is_err());
    assert_eq!(fx.m.lookup(&fx.k, &req), LookupResult::Hit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_request_holds_nothing() {
    // finished after the promotion landed
    let fx = fx().await;
    let req = RequestContext::new(1);
    fx.promote(&req).await;
    fx.m.on_request_finished(req.id);
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(0, SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&fx.k), LookupResult::Miss, "evicted");

    // finished while the promotion was in flight: it lands for others, held for no one
    let fx = self::fx().await;
    assert_eq!(fx.m.lookup(&fx.k, &req), LookupResult::Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&fx.k, &req), LookupResult::HitPending);
    fx.m.on_schedule_end(); // the load job is sent
    fx.m.on_request_finished(req.id);
    fx.m.wait_idle().await;
    assert_eq!(fx.cpu.lookup(&fx.k), LookupResult::Hit, "landed");
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(0, SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&fx.k), LookupResult::Miss, "evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_cache_and_shutdown_release_holds() {
    let fx = fx().await;
    let req = RequestContext::new(1);
    fx.promote(&req).await;
    assert_eq!(fx.m.reset_cache().await, 0, "no block kept by a hold");
    assert_eq!(fx.cpu.lookup(&fx.k), LookupResult::Miss);
    assert_eq!(fx.m.stats().held_blocks, 0);

    let fx = self::fx().await;
    fx.promote(&req).await;
    fx.m.shutdown().await.unwrap();
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(0, SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&fx.k), LookupResult::Miss, "evicted");
}
