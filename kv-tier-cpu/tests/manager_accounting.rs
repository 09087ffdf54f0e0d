//! What the manager counts and reports: every verdict once, cascades only for new blocks, jobs
//! by outcome, and its idle/wait/poll answers while work is held in flight. Work is held at
//! the fault-injecting tier's gates; every wait has a deadline.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{
    BlockKey, KvTierConfig, LookupResult, RequestContext, RequestId, SecondaryTier, StoreJob,
    TieringManager,
};
use kv_tier_cpu::CpuTier;
use kv_tier_testkit::util::{engine_store as store, lru_dram};
use kv_tier_testkit::{FaultyTier, MemoryTier, source_for, test_key};

const BS: usize = 4096;

async fn manager(slots: usize, tier: Arc<dyn SecondaryTier>) -> (TieringManager, Arc<CpuTier>) {
    let cpu = lru_dram(slots, BS);
    let m = TieringManager::builder(KvTierConfig::new((slots * BS) as u64, BS as u64))
        .primary(cpu.clone())
        .tier(tier)
        .build()
        .await
        .unwrap();
    (m, cpu)
}

async fn seed(t: &dyn SecondaryTier, keys: &[BlockKey]) {
    let job = StoreJob {
        requests: Vec::new(),
        blocks: keys.iter().map(|k| (*k, source_for(k, 0, BS))).collect(),
    };
    assert!(t.store(job).await.is_success());
    t.take_events();
}

/// Runs `f` until it returns true, at most 10 s.
async fn until(what: &str, mut f: impl FnMut() -> bool) {
    let done = tokio::time::timeout(Duration::from_secs(10), async {
        while !f() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert!(done.is_ok(), "{what}: not within 10 s");
}

async fn bounded<F: Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(10), f)
        .await
        .unwrap_or_else(|_| panic!("{what} hung"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_verdict_is_counted_once_by_kind() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let (in_tier, nowhere, in_dram, writing) = (test_key(1), test_key(2), test_key(3), test_key(4));
    seed(&*inner, &[in_tier]).await;
    let (m, _cpu) = manager(8, inner.clone()).await;
    let req = RequestContext::new(1);
    store(&m, RequestId(9), &[in_dram]);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_new_blocks_of_a_successful_store_cascade() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let (m, _cpu) = manager(8, inner.clone()).await;
    let (a, b) = (test_key(1), test_key(2));
    m.prepare_store(&[a]).unwrap().abort();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.stats().cascades, 0, "a failed store cascaded");
    store(&m, RequestId(1), &[b]);
    bounded("wait_idle", m.wait_idle()).await;
    let again = m.prepare_store(&[b]).unwrap(); // already stored: nothing new
    assert!(again.keys().is_empty());
    again.commit(RequestId(1));
    bounded("wait_idle", m.wait_idle()).await;
    let s = m.stats();
    assert_eq!(s.cascades, 1, "a store with nothing new cascaded");
    assert_eq!((s.tiers[0].store_jobs, s.tiers[0].blocks_stored), (1, 1));
    assert_eq!(s.tiers[0].bytes_stored, BS as u64);
    assert_eq!(inner.len(), 1);
    bounded("shutdown", m.shutdown()).await.unwrap();
    let c = test_key(3);
    store(&m, RequestId(2), &[c]);
    assert!(m.is_idle(), "a store after shutdown cascaded");
    assert_eq!(m.stats().cascades, 1);
    assert!(!inner.contains(&c));
    // past DRAM, a shut-down manager answers Miss, counted
    let misses = m.stats().misses;
    let req = RequestContext::new(5);
    assert_eq!(m.lookup(&test_key(9), &req), LookupResult::Miss);
    assert_eq!(m.stats().misses, misses + 1);
}

/// A key a tier has, with no DRAM slot to promote it into: `Miss`, counted as a miss and as a
/// refused promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_without_dram_room_is_a_counted_miss() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let (m, _cpu) = manager(1, inner.clone()).await;
    let pinned = test_key(2);
    store(&m, RequestId(9), &[pinned]);
    bounded("wait_idle", m.wait_idle()).await;
    let view = m.prepare_load(&[pinned]).unwrap(); // the only slot, pinned by a reader
    let req = RequestContext::new(1);
    assert_eq!(m.lookup(&k, &req), LookupResult::Retry);
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.lookup(&k, &req), LookupResult::Miss);
    let s = m.stats();
    assert_eq!((s.promotions_refused, s.misses), (1, 1));
    drop(view);
}

/// `is_idle` is false while anything is queued or in flight: a store job, a queued probe, a
/// probe in flight, a queued promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_means_nothing_queued_or_in_flight() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let faulty = Arc::new(FaultyTier::new(inner.clone()));
    let (m, _cpu) = manager(8, faulty.clone()).await;
    assert!(m.is_idle());
    // a store job in flight, nothing else
    let stores = faulty.hold_stores();
    store(&m, RequestId(1), &[test_key(1)]);
    m.on_schedule_end();
    assert!(!m.is_idle(), "idle with a store job in flight");
    stores.open();
    bounded("wait_idle", m.wait_idle()).await;
    assert!(m.is_idle());
    // a probe queued (not yet sent), then in flight
    let probes = faulty.hold_lookups();
    let req = RequestContext::new(2);
    let k = test_key(2);
    seed(&*inner, &[k]).await;
    assert_eq!(m.lookup(&k, &req), LookupResult::Retry);
    assert!(!m.is_idle(), "idle with a probe queued");
    m.on_schedule_end();
    assert!(!m.is_idle(), "idle with a probe in flight");
    probes.open();
    bounded("probe", async {
        while !m.is_idle() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    // a promotion queued (sent at schedule end)
    assert_eq!(m.lookup(&k, &req), LookupResult::HitPending);
    assert!(!m.is_idle(), "idle with a promotion queued");
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.lookup(&k, &req), LookupResult::Hit);
}

/// `poll` applies what completed without a step; `wait_jobs` returns with every job in
/// flight applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poll_and_wait_jobs_apply_completed_jobs() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let (m, _cpu) = manager(8, inner.clone()).await;
    store(&m, RequestId(1), &[test_key(1)]);
    m.on_schedule_end();
    bounded("wait_jobs", m.wait_jobs()).await;
    assert_eq!(m.stats().tiers[0].store_jobs, 1, "wait_jobs returned early");
    store(&m, RequestId(1), &[test_key(2)]);
    m.on_schedule_end();
    until("the tier holds the block", || inner.contains(&test_key(2))).await;
    until("poll applies the job", || {
        m.poll();
        m.stats().tiers[0].store_jobs == 2
    })
    .await;
}

/// A job whose task dies with its runtime is reported (failed), never lost: nothing waits
/// for it forever and its DRAM pins are released.
#[test]
fn a_job_dropped_with_its_runtime_is_reported_failed() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let inner = Arc::new(MemoryTier::new("m", BS));
    let faulty = Arc::new(FaultyTier::new(inner.clone()));
    let _held = faulty.hold_stores();
    let cpu = lru_dram(4, BS);
    let builder = TieringManager::builder(KvTierConfig::new((4 * BS) as u64, BS as u64))
        .primary(cpu.clone())
        .runtime(rt.handle().clone())
        .tier(faulty.clone());
    let m = rt.block_on(builder.build()).unwrap();
    store(&m, RequestId(1), &[test_key(1)]);
    m.on_schedule_end();
    assert!(!m.is_idle());
    assert!(m.stats().write_back_pinned_bytes > 0);
    drop(rt); // drops the job's task unrun
    assert!(m.is_idle(), "a dropped job never reported");
    let s = m.stats();
    assert_eq!((s.tiers[0].store_jobs, s.tiers[0].store_failures), (1, 1));
    assert_eq!(
        s.write_back_pinned_bytes, 0,
        "a dropped job still pins DRAM"
    );
    assert!(!faulty.is_protected(&test_key(1)));
}

/// A job whose tier panics is counted as panicked; its keys fail and nothing else breaks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_load_is_counted_and_its_keys_fail() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let faulty = Arc::new(FaultyTier::new(inner.clone()));
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let (m, _cpu) = manager(8, faulty.clone()).await;
    faulty.panic_on_load(true);
    let req = RequestContext::new(1);
    assert_eq!(m.lookup(&k, &req), LookupResult::Retry);
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.lookup(&k, &req), LookupResult::HitPending);
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    let s = m.stats();
    assert_eq!(s.tiers[0].jobs_panicked, 1);
    assert_eq!(s.tiers[0].jobs_timed_out, 0);
    assert_eq!(s.tiers[0].load_failures, 1);
    assert_eq!(m.lookup(&k, &req), LookupResult::Miss);
    assert!(!faulty.is_protected(&k));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_manager_shows_its_parts() {
    let inner = Arc::new(MemoryTier::new("memory-tier", BS));
    let (m, _cpu) = manager(8, inner.clone()).await;
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
