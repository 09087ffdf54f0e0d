//! Traffic for the waits and shutdown tests: a random seed, the relay tier (an
//! operation ends once the next has started, so under traffic something is always in
//! flight) and its fixture, and the fixture of a manager over two slow tiers with traffic
//! threads ([`Mx`]).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_tier_core::{
    BlockKey, EvictionPolicy, JobResult, KvTierConfig, LoadJob, LookupResult, RequestContext,
    RequestId, SecondaryTier, StoreJob, TierOptions, TieringManager, WriteBackPolicy,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::util::{engine_store, try_engine_store};
use kv_tier_testkit::{
    FaultyTier, MemoryTier, dram_manager_builder, source_for, store_keys, test_key, verify_block,
};
use tokio::sync::watch;

use super::*;

/// A seed from the clock and the process id, printed (to replay a failure).
pub(crate) fn random_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    let s = t ^ (std::process::id() as u64) << 32;
    eprintln!("seed {s}");
    s
}

/// One relay: operation `i` ends once operation `i + 1` has started.
#[derive(Debug)]
pub(crate) struct Relay {
    pub(crate) started: AtomicUsize,
    pub(crate) tx: watch::Sender<usize>,
}

impl Relay {
    /// A relay none of whose operations has started.
    pub(crate) fn new() -> Self {
        Self {
            started: AtomicUsize::new(0),
            tx: watch::Sender::new(0),
        }
    }

    /// Called by a relayed operation: ends once the next one has started, or after [`FALLBACK`].
    pub(crate) async fn pass(&self) {
        let mut rx = self.tx.subscribe();
        let i = self.started.fetch_add(1, Ordering::SeqCst);
        self.tx.send_modify(|n| *n = (*n).max(i + 1));
        let _ = tokio::time::timeout(FALLBACK, rx.wait_for(|n| *n > i + 1)).await;
    }
}

/// A memory tier whose stores and probes are relayed ([`Relay`]).
#[derive(Debug)]
pub(crate) struct RelayTier {
    pub(crate) inner: Arc<MemoryTier>,
    pub(crate) stores: Relay,
    pub(crate) probes: Relay,
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

/// A manager of 256 DRAM blocks over a [`RelayTier`], and a traffic thread.
pub(crate) struct RelayFx {
    pub(crate) m: Arc<TieringManager>,
    pub(crate) inner: Arc<MemoryTier>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) traffic: Option<std::thread::JoinHandle<u64>>,
}

impl RelayFx {
    /// The manager over a fresh relay tier; no traffic yet.
    pub(crate) async fn new() -> Self {
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
    pub(crate) fn start_traffic(&mut self) {
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
                // the traffic's pace
                std::thread::sleep(Duration::from_millis(1));
            }
            i
        }));
    }

    /// Stops the traffic; returns how many steps it made.
    pub(crate) fn stop_traffic(&mut self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.traffic.take().map_or(0, |t| t.join().unwrap())
    }

    /// Waits (bounded) until the traffic has sent a few steps' work.
    pub(crate) async fn traffic_flowing(&self) {
        wait_until_async("the traffic thread's store jobs", LIMIT, || {
            self.m.poll();
            self.m.stats().tiers[0].store_jobs >= 3
        })
        .await;
    }
}

/// A store committed and a probe sent before the wait are in flight when it is called: they
/// must have been applied when it returns.
pub(crate) async fn in_flight_before_the_wait(
    fx: &RelayFx,
    tag: u64,
) -> (BlockKey, BlockKey, RequestContext) {
    let stored = test_key(4_000_000 + tag);
    engine_store(&fx.m, RequestId(5_000_000 + tag), &[stored]);
    let probed = test_key(6_000_000 + tag);
    let job = StoreJob {
        links: Vec::new(),
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

/// A manager over two slow memory tiers (each behind a `FaultyTier` that delays every job and
/// probe), write-back policy `wait` so no admitted block is dropped, and traffic threads.
pub(crate) struct Mx {
    pub(crate) m: Arc<TieringManager>,
    pub(crate) mems: Vec<Arc<MemoryTier>>,
    pub(crate) faults: Vec<Arc<FaultyTier>>,
    pub(crate) stop: Arc<AtomicBool>,
    pub(crate) threads: Vec<std::thread::JoinHandle<()>>,
    /// Keys the store threads committed, with whether a tier's shutdown had been called
    /// before their `prepare_store`.
    pub(crate) committed: Arc<Mutex<Vec<(BlockKey, bool)>>>,
    /// Keys seeded in the second tier only: lookups of them promote.
    pub(crate) seeded: Arc<Vec<BlockKey>>,
    pub(crate) steps: Arc<AtomicU64>,
}

/// An [`Mx`] whose two tiers delay every job and probe by `delays_ms`; the second tier holds
/// 64 seeded keys.
pub(crate) async fn mx(delays_ms: [u64; 2]) -> Mx {
    let slots = 1024usize;
    let cfg = KvTierConfig::new((slots * BS) as u64, BS as u64);
    let mut b = dram_manager_builder(cfg).unwrap();
    let mut mems = Vec::new();
    let mut faults = Vec::new();
    for (i, d) in delays_ms.iter().enumerate() {
        let mem = Arc::new(MemoryTier::new(format!("mem{i}"), BS));
        let f = Arc::new(FaultyTier::new(mem.clone()));
        f.delay(Some(Duration::from_millis(*d)));
        let opts = TierOptions {
            write_back_policy: Some(WriteBackPolicy::Wait),
            write_back_limit_mb: Some(256.0),
            ..Default::default()
        };
        b = b.tier_with_options(f.clone(), opts);
        mems.push(mem);
        faults.push(f);
    }
    let m = Arc::new(b.build().await.unwrap());
    let seeded: Vec<BlockKey> = (0..64).map(|i| test_key(70_000_000 + i)).collect();
    let r = store_keys(&*mems[1], &seeded, 0, BS).await;
    assert!(r.is_success());
    Mx {
        m,
        mems,
        faults,
        stop: Arc::new(AtomicBool::new(false)),
        threads: Vec::new(),
        committed: Arc::new(Mutex::new(Vec::new())),
        seeded: Arc::new(seeded),
        steps: Arc::new(AtomicU64::new(0)),
    }
}

impl Mx {
    /// Three threads without pause (1 ms sleeps): fresh stores; lookups (and promotions and
    /// loads) of keys only the second tier has; lookups of absent keys and touches.
    pub(crate) fn start_traffic(&mut self, tag: u64) {
        for t in 0..3u64 {
            let m = self.m.clone();
            let stop = self.stop.clone();
            let committed = self.committed.clone();
            let faults = self.faults.clone();
            let seeded = self.seeded.clone();
            let steps = self.steps.clone();
            self.threads.push(std::thread::spawn(move || {
                let mut rng = Rng::new(tag * 31 + t);
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let req = RequestContext::new(1_000_000_000 * (t + 1) + tag * 10_000_000 + i);
                    match t {
                        0 => {
                            let k = test_key(100_000_000 + tag * 10_000_000 + i);
                            let after = faults.iter().any(|f| f.shutdowns() > 0);
                            if try_engine_store(&m, req.id, &[k]).is_ok() {
                                committed.lock().unwrap().push((k, after));
                            }
                            let _ = m.lookup(&k, &req);
                            m.on_schedule_end();
                        }
                        1 => {
                            let k = seeded[rng.below(seeded.len() as u64) as usize];
                            for _ in 0..4 {
                                let v = m.lookup(&k, &req);
                                if v == LookupResult::Hit
                                    && let Ok(views) = m.prepare_load(&[k])
                                {
                                    for v in &views {
                                        assert!(
                                            verify_block(&k, 0, v.as_slice()),
                                            "a promoted block holds wrong bytes"
                                        );
                                    }
                                }
                                m.on_schedule_end();
                                if matches!(v, LookupResult::Hit | LookupResult::Miss) {
                                    break;
                                }
                                // the next step of this request
                                std::thread::sleep(Duration::from_millis(1));
                            }
                        }
                        _ => {
                            let k = test_key(200_000_000 + tag * 10_000_000 + i);
                            let _ = m.lookup_many(&[k, seeded[(i % 64) as usize]], &req);
                            m.touch(&[k]);
                            m.on_schedule_end();
                        }
                    }
                    m.on_request_finished(req.id);
                    steps.fetch_add(1, Ordering::Relaxed);
                    i += 1;
                    // the traffic's pace
                    std::thread::sleep(Duration::from_millis(1));
                }
            }));
        }
    }

    /// Stops the traffic threads and joins them (a traffic thread that panicked fails the test).
    pub(crate) fn stop_traffic(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().expect("a traffic thread panicked");
        }
    }

    /// Waits (bounded) until the traffic has made some steps and sent store jobs.
    pub(crate) async fn flowing(&self) {
        wait_until_async("the traffic's steps and store jobs", LIMIT, || {
            self.steps.load(Ordering::Relaxed) >= 30
                && self
                    .m
                    .stats()
                    .tiers
                    .iter()
                    .map(|t| t.store_jobs)
                    .sum::<u64>()
                    >= 5
        })
        .await;
    }

    /// The engine's store of `k` (retried while write-back pushes back).
    pub(crate) async fn store(&self, req: u64, k: BlockKey) {
        wait_until_async(&format!("a store of {k} not refused"), LIMIT, || {
            try_engine_store(&self.m, RequestId(req), &[k]).is_ok()
        })
        .await;
    }
}

impl Drop for Mx {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
