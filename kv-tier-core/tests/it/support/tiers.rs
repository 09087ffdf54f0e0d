//! Tiers written for the tests: one that answers one `true` whatever it is asked
//! ([`OneAnswer`]), two that record the request hooks and the requests their jobs carry
//! ([`Recording`], with a semaphore on stores and the keys in its log; [`Recorder`], with a
//! watch gate on stores and a shared log), a scripted tier that hangs, lies or answers the
//! wrong number of probes ([`Script`]); tier builders that wait at a gate or always fail;
//! block sources that count themselves while alive ([`Tracked`]); and a tier that answers
//! `holds` from memory, truthfully or by script ([`Knowing`]).

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use kv_tier_core::{
    AlignedBuf, BlockKey, BlockSource, BuildContext, Capability, Error, JobResult, KvTierConfig,
    LoadJob, Locality, Medium, OffloadPolicy, ProtectGuard, ProtectionSet, RequestContext,
    RequestId, SecondaryTier, StoreJob, TierBuilder, TierEvent, TierInfo, TierSpec, async_trait,
};
use kv_tier_testkit::{Gate, MemoryTier, fill_block};

use super::*;

/// A tier that answers one `true` whatever it is asked.
#[derive(Debug)]
pub(crate) struct OneAnswer(pub(crate) MemoryTier);

#[async_trait]
impl SecondaryTier for OneAnswer {
    fn info(&self) -> TierInfo {
        self.0.info()
    }
    async fn lookup(&self, _keys: &[BlockKey]) -> kv_tier_core::Result<Vec<bool>> {
        Ok(vec![true])
    }
    async fn store(&self, job: StoreJob) -> JobResult {
        self.0.store(job).await
    }
    async fn load(&self, job: LoadJob) -> JobResult {
        self.0.load(job).await
    }
    fn touch(&self, keys: &[BlockKey]) {
        self.0.touch(keys)
    }
    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.0.protect(keys)
    }
    fn is_protected(&self, key: &BlockKey) -> bool {
        self.0.is_protected(key)
    }
    fn take_events(&self) -> Vec<TierEvent> {
        self.0.take_events()
    }
    async fn shutdown(&self) -> kv_tier_core::Result<()> {
        Ok(())
    }
}

/// A memory tier that records the request hooks and the requests its jobs carry.
#[derive(Debug)]
pub(crate) struct Recording {
    pub(crate) inner: Arc<MemoryTier>,
    pub(crate) log: std::sync::Mutex<Vec<String>>,
    /// Stores wait for a permit while this is closed.
    pub(crate) gate: tokio::sync::Semaphore,
    /// What it answers `on_new_request`.
    pub(crate) policy: kv_tier_core::OffloadPolicy,
}

impl Recording {
    /// A recording tier named `name` answering `policy`; its stores pass at once if `open`.
    pub(crate) fn new(name: &str, policy: kv_tier_core::OffloadPolicy, open: bool) -> Arc<Self> {
        Arc::new(Self {
            inner: mem(name),
            log: Default::default(),
            gate: tokio::sync::Semaphore::new(if open { 1 << 20 } else { 0 }),
            policy,
        })
    }
}

impl Recording {
    /// Appends `s` to the log.
    pub(crate) fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
    /// The log so far.
    pub(crate) fn log(&self) -> Vec<String> {
        self.log.lock().unwrap().clone()
    }
}

#[kv_tier_core::async_trait]
impl SecondaryTier for Recording {
    fn info(&self) -> kv_tier_core::TierInfo {
        self.inner.info()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> kv_tier_core::Result<Vec<bool>> {
        self.inner.lookup(keys).await
    }
    async fn store(&self, job: StoreJob) -> kv_tier_core::JobResult {
        let mut keys = job.keys();
        keys.sort();
        self.note(format!(
            "store {:?} x{} {keys:?}",
            job.requests,
            job.blocks.len()
        ));
        let _pass = self.gate.acquire().await;
        let r = self.inner.store(job).await;
        self.note("stored".into());
        r
    }
    async fn load(&self, job: kv_tier_core::LoadJob) -> kv_tier_core::JobResult {
        self.note(format!("load {:?} x{}", job.requests, job.blocks.len()));
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
    fn on_new_request(&self, req: &RequestContext) -> kv_tier_core::OffloadPolicy {
        self.note(format!("new {:?}", req.id));
        self.policy
    }
    fn on_request_finished(&self, req: RequestId) {
        self.note(format!("finished {req:?}"));
    }
    async fn shutdown(&self) -> kv_tier_core::Result<()> {
        self.inner.shutdown().await
    }
}

/// A memory tier that records the request hooks and the requests its jobs carry in a shared log;
/// its stores wait while `gate` is false.
#[derive(Debug)]
pub(crate) struct Recorder {
    pub(crate) inner: MemoryTier,
    pub(crate) log: Arc<Mutex<Vec<String>>>,
    pub(crate) gate: tokio::sync::watch::Sender<bool>,
}

impl Recorder {
    /// A recorder named `rec` of 64 KiB blocks logging into `log`, its stores passing.
    pub(crate) fn new(log: Arc<Mutex<Vec<String>>>) -> Self {
        Self {
            inner: MemoryTier::new("rec", BS_64K),
            log,
            gate: tokio::sync::watch::channel(true).0,
        }
    }
    /// Appends `s` to the log.
    pub(crate) fn note(&self, s: String) {
        self.log.lock().unwrap().push(s);
    }
}

#[async_trait]
impl SecondaryTier for Recorder {
    fn info(&self) -> TierInfo {
        self.inner.info()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> kv_tier::Result<Vec<bool>> {
        self.inner.lookup(keys).await
    }
    async fn store(&self, job: StoreJob) -> JobResult {
        self.note(format!("store_start {:?}", job.requests));
        let mut rx = self.gate.subscribe();
        let _ = rx.wait_for(|open| *open).await;
        let r = self.inner.store(job).await;
        self.note("store_end".into());
        r
    }
    async fn load(&self, job: LoadJob) -> JobResult {
        self.note(format!("load {:?}", job.requests));
        self.inner.load(job).await
    }
    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch(keys)
    }
    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.inner.protect(keys)
    }
    fn is_protected(&self, key: &BlockKey) -> bool {
        self.inner.is_protected(key)
    }
    fn take_events(&self) -> Vec<TierEvent> {
        self.inner.take_events()
    }
    fn on_new_request(&self, req: &RequestContext) -> OffloadPolicy {
        self.note(format!("new {:?}", req.id));
        OffloadPolicy::ChunkLevel
    }
    fn on_request_finished(&self, req: RequestId) {
        self.note(format!("finished {req:?}"));
    }
    async fn shutdown(&self) -> kv_tier::Result<()> {
        self.inner.shutdown().await
    }
}

/// A manager over 64 blocks of [`BS_64K`] DRAM and one [`Recorder`]: the manager, the tier and
/// its log.
pub(crate) fn rec_manager() -> (
    kv_tier::TieringManager,
    Arc<Recorder>,
    Arc<Mutex<Vec<String>>>,
) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let rec = Arc::new(Recorder::new(log.clone()));
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS_64K}}}"#,
        64 * BS_64K
    ))
    .unwrap();
    let m = kv_tier::builder(cfg)
        .unwrap()
        .tier(rec.clone())
        .build_blocking()
        .unwrap();
    (m, rec, log)
}

/// A tier over a `MemoryTier` that can hang, lie about its loads or give a wrong number of
/// probe answers.
#[derive(Debug)]
pub(crate) struct Script {
    pub(crate) name: String,
    pub(crate) inner: Arc<MemoryTier>,
    pub(crate) hang_lookup: AtomicBool,
    pub(crate) hang_store: AtomicBool,
    pub(crate) hang_load: AtomicBool,
    pub(crate) hang_shutdown: AtomicBool,
    pub(crate) all_present: AtomicBool,
    pub(crate) answer_delta: AtomicI64,
    pub(crate) extra_ok: Mutex<Vec<BlockKey>>,
    pub(crate) ok_and_failed: AtomicBool,
    pub(crate) shutdowns: AtomicU64,
    pub(crate) loads: AtomicU64,
    pub(crate) protection: ProtectionSet,
}

impl Script {
    /// A scripted tier named `name` of `bs`-byte blocks that behaves until told otherwise.
    pub(crate) fn new(name: &str, bs: usize) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            inner: Arc::new(MemoryTier::new(name, bs)),
            hang_lookup: AtomicBool::new(false),
            hang_store: AtomicBool::new(false),
            hang_load: AtomicBool::new(false),
            hang_shutdown: AtomicBool::new(false),
            all_present: AtomicBool::new(false),
            answer_delta: AtomicI64::new(0),
            extra_ok: Mutex::new(Vec::new()),
            ok_and_failed: AtomicBool::new(false),
            shutdowns: AtomicU64::new(0),
            loads: AtomicU64::new(0),
            protection: ProtectionSet::new(),
        })
    }
}

#[async_trait]
impl SecondaryTier for Script {
    fn info(&self) -> TierInfo {
        TierInfo::new(
            self.name.clone(),
            Medium::Storage,
            Locality::Local,
            Capability::new(),
        )
    }
    async fn lookup(&self, keys: &[BlockKey]) -> kv_tier::Result<Vec<bool>> {
        if self.hang_lookup.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let mut v = if self.all_present.load(Ordering::SeqCst) {
            vec![true; keys.len()]
        } else {
            self.inner.lookup(keys).await?
        };
        let d = self.answer_delta.load(Ordering::SeqCst);
        if d < 0 {
            v.truncate(v.len().saturating_sub((-d) as usize));
        } else {
            v.extend(std::iter::repeat_n(true, d as usize));
        }
        Ok(v)
    }
    async fn store(&self, job: StoreJob) -> JobResult {
        if self.hang_store.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.store(job).await
    }
    async fn load(&self, job: LoadJob) -> JobResult {
        self.loads.fetch_add(1, Ordering::SeqCst);
        if self.hang_load.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        let mut r = self.inner.load(job).await;
        r.ok.extend(self.extra_ok.lock().unwrap().iter().copied());
        if self.ok_and_failed.load(Ordering::SeqCst) {
            let dup: Vec<(BlockKey, Error)> =
                r.ok.iter()
                    .map(|k| {
                        (
                            *k,
                            Error::NotFound {
                                key: *k,
                                tier: self.name.clone(),
                            },
                        )
                    })
                    .collect();
            r.failed.extend(dup);
        }
        r
    }
    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch(keys)
    }
    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.protection.protect(keys)
    }
    fn is_protected(&self, key: &BlockKey) -> bool {
        self.protection.contains(key)
    }
    fn take_events(&self) -> Vec<TierEvent> {
        Vec::new()
    }
    async fn shutdown(&self) -> kv_tier::Result<()> {
        self.shutdowns.fetch_add(1, Ordering::SeqCst);
        if self.hang_shutdown.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        Ok(())
    }
}

/// A tier type whose builder waits at a gate: parks `build()` after the tiers before it.
pub(crate) struct GatedBuilder {
    pub(crate) gate: Gate,
}

#[async_trait]
impl TierBuilder for GatedBuilder {
    async fn build(
        &self,
        _spec: &TierSpec,
        c: &BuildContext,
    ) -> kv_tier::Result<Arc<dyn SecondaryTier>> {
        self.gate.pass().await;
        Ok(Arc::new(MemoryTier::new(c.name.clone(), c.block_size)))
    }
}

/// A tier type whose builder always fails.
pub(crate) struct FailingBuilder;

#[async_trait]
impl TierBuilder for FailingBuilder {
    async fn build(
        &self,
        _spec: &TierSpec,
        _c: &BuildContext,
    ) -> kv_tier::Result<Arc<dyn SecondaryTier>> {
        Err(Error::config("failing", "this tier never builds"))
    }
}

/// A block source over the key's bytes whose owner counts itself while alive (a DRAM pin).
pub(crate) struct Tracked {
    pub(crate) buf: AlignedBuf,
    pub(crate) live: Arc<AtomicUsize>,
}

impl AsRef<[u8]> for Tracked {
    fn as_ref(&self) -> &[u8] {
        self.buf.as_slice()
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A block source over `key`'s bytes (salt 0) that counts itself in `live` while alive.
pub(crate) fn tracked_source(key: &BlockKey, bs: usize, live: &Arc<AtomicUsize>) -> BlockSource {
    let mut buf = AlignedBuf::zeroed(bs);
    fill_block(key, 0, buf.as_mut_slice());
    live.fetch_add(1, Ordering::SeqCst);
    BlockSource::from_owner(Tracked {
        buf,
        live: live.clone(),
    })
}

/// A store job of `keys`, each block a [`tracked_source`].
pub(crate) fn store_job(keys: &[BlockKey], bs: usize, live: &Arc<AtomicUsize>) -> StoreJob {
    StoreJob {
        links: Vec::new(),
        requests: Vec::new(),
        blocks: keys
            .iter()
            .map(|k| (*k, tracked_source(k, bs, live)))
            .collect(),
    }
}

/// Every sink of `readers` has been let go of (the reader gets its bytes back).
pub(crate) fn sinks_released(readers: &mut Vec<kv_tier::SinkReader>) -> bool {
    let mut left = Vec::new();
    for r in readers.drain(..) {
        if let Err(r) = r.into_bytes() {
            left.push(r);
        }
    }
    *readers = left;
    readers.is_empty()
}

/// What [`Knowing::holds`] answers next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Known {
    /// The truth: whether its memory tier has the key.
    Truth,
    /// This answer, whatever the tier has.
    Says(Option<bool>),
    /// A panic.
    Panics,
}

/// A memory tier that answers [`SecondaryTier::holds`] from memory: with [`Known::Truth`]
/// once its script of answers is used up, and with each scripted answer before that.
#[derive(Debug)]
pub(crate) struct Knowing {
    pub(crate) inner: Arc<MemoryTier>,
    pub(crate) script: Mutex<std::collections::VecDeque<Known>>,
    /// How many times `holds` was asked.
    pub(crate) asked: AtomicU64,
}

impl Knowing {
    pub(crate) fn new(inner: Arc<MemoryTier>, script: &[Known]) -> Self {
        Self {
            inner,
            script: Mutex::new(script.iter().copied().collect()),
            asked: AtomicU64::new(0),
        }
    }
}

#[async_trait]
impl SecondaryTier for Knowing {
    fn info(&self) -> TierInfo {
        self.inner.info()
    }
    async fn lookup(&self, keys: &[BlockKey]) -> kv_tier_core::Result<Vec<bool>> {
        self.inner.lookup(keys).await
    }
    fn holds(&self, key: &BlockKey) -> Option<bool> {
        self.asked.fetch_add(1, Ordering::SeqCst);
        let next = self.script.lock().unwrap().pop_front();
        match next.unwrap_or(Known::Truth) {
            Known::Truth => Some(self.inner.contains(key)),
            Known::Says(a) => a,
            Known::Panics => panic!("holds() of a test tier panics"),
        }
    }
    async fn store(&self, job: StoreJob) -> JobResult {
        self.inner.store(job).await
    }
    async fn load(&self, job: LoadJob) -> JobResult {
        self.inner.load(job).await
    }
    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch(keys)
    }
    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.inner.protect(keys)
    }
    fn is_protected(&self, key: &BlockKey) -> bool {
        self.inner.is_protected(key)
    }
    fn take_events(&self) -> Vec<TierEvent> {
        self.inner.take_events()
    }
    async fn shutdown(&self) -> kv_tier_core::Result<()> {
        Ok(())
    }
}
