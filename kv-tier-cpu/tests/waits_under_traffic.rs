//! `wait_idle`, `wait_jobs`, `reset_cache` and `shutdown` end while other threads keep the
//! tiers busy, and still wait for what was in flight when they were called.
//!
//! The tier here is a relay: a store (or probe) ends only once the next one has started (or
//! after a fallback of 300 ms), so while traffic flows there is no moment at which nothing is
//! in flight. A wait for such a moment would last as long as the traffic does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use kv_tier_core::{
    BlockKey, EvictionPolicy, JobResult, KvTierConfig, LoadJob, LookupResult, RequestContext,
    RequestId, SecondaryTier, StoreJob, TieringManager,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::util::{engine_store, try_engine_store};
use kv_tier_testkit::{MemoryTier, source_for, test_key};
use tokio::sync::watch;

const BS: usize = 4096;
/// Bounds a wait under test: one that never ends fails its test instead of hanging the suite.
const LIMIT: Duration = Duration::from_secs(60);
/// How long a relayed operation waits for the next one before ending on its own.
const FALLBACK: Duration = Duration::from_millis(300);

/// One relay: operation `i` ends once operation `i + 1` has started.
#[derive(Debug)]
struct Relay {
    started: AtomicUsize,
    tx: watch::Sender<usize>,
}

impl Relay {
    fn new() -> Self {
        Self {
            started: AtomicUsize::new(0),
            tx: watch::Sender::new(0),
        }
    }

    async fn pass(&self) {
        let mut rx = self.tx.subscribe();
        let i = self.started.fetch_add(1, Ordering::SeqCst);
        self.tx.send_modify(|n| *n = (*n).max(i + 1));
        let _ = tokio::time::timeout(FALLBACK, rx.wait_for(|n| *n > i + 1)).await;
    }
}

#[derive(Debug)]
struct RelayTier {
    inner: Arc<MemoryTier>,
    stores: Relay,
    probes: Relay,
}

#[kv_tier_core::async_trait]
impl SecondaryTier for RelayTier {
    fn info(&self) -> kv_tier_core::TierInfo {
        self.inner.info()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> kv_tier_core::Result<Vec<bool>> {
        self.probes.pass().await;
        self.inner.lookup(keys).await
    }
    async fn store(&self, job: StoreJob) -> JobResult {
        self.stores.pass().await;
        self.inner.store(job).await
    }
    async fn load(&self, job: LoadJob) -> JobResult {
        self.inner.load(job).await
    }
    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch(keys)
    }
    fn protect(&self, keys: &[BlockKey]) -> kv_tier_core::ProtectGuard {
        self.inner.protect(keys)
    }
    fn is_protected(&self, key: &BlockKey) -> bool {
        self.inner.is_protected(key)
    }
    fn take_events(&self) -> Vec<kv_tier_core::TierEvent> {
        self.inner.take_events()
    }
    async fn shutdown(&self) -> kv_tier_core::Result<()> {
        self.inner.shutdown().await
    }
}

struct Fx {
    m: Arc<TieringManager>,
    inner: Arc<MemoryTier>,
    stop: Arc<AtomicBool>,
    traffic: Option<std::thread::JoinHandle<u64>>,
}

impl Fx {
    async fn new() -> Self {
        let slots = 256;
        let cpu = Arc::new(
            CpuTier::new(CpuTierConfig {
                capacity_bytes: (slots * BS) as u64,
                block_size: BS,
                policy: EvictionPolicy::Lru,
                prefault: true,
            })
            .unwrap(),
        );
        let inner = Arc::new(MemoryTier::new("relay", BS));
        let tier = Arc::new(RelayTier {
            inner: inner.clone(),
            stores: Relay::new(),
            probes: Relay::new(),
        });
        let m = TieringManager::builder(KvTierConfig::new((slots * BS) as u64, BS as u64))
            .primary(cpu)
            .tier(tier)
            .build()
            .await
            .unwrap();
        Self {
            m: Arc::new(m),
            inner,
            stop: Arc::new(AtomicBool::new(false)),
            traffic: None,
        }
    }

    /// Another thread: each step stores a new block and asks for a key no tier has (one
    /// store job and one probe per step), without pause.
    fn start_traffic(&mut self) {
        let (m, stop) = (self.m.clone(), self.stop.clone());
        self.traffic = Some(std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let r = RequestContext::new(1_000_000 + i);
                let _ = m.lookup(&test_key(2_000_000 + i), &r);
                let _ = try_engine_store(&m, r.id, &[test_key(3_000_000 + i)]);
                m.on_schedule_end();
                m.on_request_finished(r.id);
                i += 1;
                std::thread::sleep(Duration::from_millis(1));
            }
            i
        }));
    }

    /// Stops the traffic; returns how many steps it made.
    fn stop_traffic(&mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.traffic.take().map_or(0, |t| t.join().unwrap())
    }

    /// Waits (bounded) until the traffic has sent a few steps' work.
    async fn traffic_flowing(&self) {
        let t0 = std::time::Instant::now();
        while self.m.stats().tiers[0].store_jobs < 3 {
            self.m.poll();
            assert!(t0.elapsed() < LIMIT, "the traffic thread sent nothing");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A store committed and a probe sent before the wait are in flight when it is called: they
/// must have been applied when it returns.
async fn in_flight_before_the_wait(fx: &Fx, tag: u64) -> (BlockKey, BlockKey, RequestContext) {
    let stored = test_key(4_000_000 + tag);
    engine_store(&fx.m, RequestId(5_000_000 + tag), &[stored]);
    let probed = test_key(6_000_000 + tag);
    let job = StoreJob {
        requests: Vec::new(),
        blocks: vec![(probed, source_for(&probed, 0, BS))],
    };
    let seeded = fx.inner.store(job).await;
    assert!(seeded.is_success());
    let r = RequestContext::new(7_000_000 + tag);
    assert_eq!(fx.m.lookup(&probed, &r), LookupResult::Retry);
    fx.m.on_schedule_end();
    (stored, probed, r)
}

async fn bounded<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {LIMIT:?} under traffic"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_idle_ends_under_traffic_and_applies_what_was_in_flight() {
    let mut fx = Fx::new().await;
    fx.start_traffic();
    fx.traffic_flowing().await;
    for tag in 0..3 {
        let (stored, probed, r) = in_flight_before_the_wait(&fx, tag).await;
        let jobs_before = fx.m.stats().tiers[0].store_jobs;
        bounded("wait_idle", fx.m.wait_idle()).await;
        assert!(
            fx.inner.contains(&stored),
            "wait_idle returned before the store in flight at its call reached the tier"
        );
        assert!(fx.m.stats().tiers[0].store_jobs > jobs_before);
        // the probe's answer was applied by the wait: the key is known present (a promotion
        // is now queued), not asked again
        assert_ne!(fx.m.lookup(&probed, &r), LookupResult::Retry);
        fx.m.on_request_finished(r.id);
    }
    assert!(fx.stop_traffic() > 0);
    bounded("wait_idle after the traffic", fx.m.wait_idle()).await;
    assert!(fx.m.is_idle(), "nothing sends any more, yet work is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_jobs_ends_under_traffic_and_applies_the_stores_in_flight() {
    let mut fx = Fx::new().await;
    fx.start_traffic();
    fx.traffic_flowing().await;
    for tag in 10..13 {
        let (stored, _probed, r) = in_flight_before_the_wait(&fx, tag).await;
        let jobs_before = fx.m.stats().tiers[0].store_jobs;
        bounded("wait_jobs", fx.m.wait_jobs()).await;
        assert!(fx.inner.contains(&stored));
        assert!(fx.m.stats().tiers[0].store_jobs > jobs_before);
        fx.m.on_request_finished(r.id);
    }
    fx.stop_traffic();
    bounded("wait_idle after the traffic", fx.m.wait_idle()).await;
    assert!(fx.m.is_idle());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_cache_and_shutdown_end_under_traffic() {
    let mut fx = Fx::new().await;
    fx.start_traffic();
    fx.traffic_flowing().await;
    let (stored, _probed, r) = in_flight_before_the_wait(&fx, 20).await;
    bounded("reset_cache", fx.m.reset_cache()).await;
    assert!(fx.inner.contains(&stored));
    fx.m.on_request_finished(r.id);
    let (stored, _probed, _r) = in_flight_before_the_wait(&fx, 21).await;
    bounded("shutdown", fx.m.shutdown())
        .await
        .expect("shutdown failed");
    assert!(
        fx.inner.contains(&stored),
        "shutdown returned before the store in flight at its call reached the tier"
    );
    fx.stop_traffic();
}
