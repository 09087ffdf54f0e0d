//! [`ObjTier`]: blocks as objects, one per block, keyed like the fs tier's paths.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kv_tier_core::prelude::*;
use kv_tier_core::registry::Opener;
use object_store::ObjectStore;
use rustc_hash::FxHashMap;
use tokio::sync::Semaphore;

use crate::block::{PutBody, Shared, bump, lock};
use crate::capacity::Cap;
use crate::config::{ObjChecksum, ObjTierConfig};
use crate::stats::Counters;

/// The object-store tier: one object per block under `prefix/`, keyed by the fs layout's
/// path relative to its root (`<model>_<digest>_r<rank>/<hex[0..3]>/<hex[3..5]>_g<group>/<hex>.bin`).
///
/// Unlike the reference, keys never start with `/` and never contain `//` (an empty prefix
/// gives keys at the bucket root; a prefix `a/b/` gives `a/b/<...>`).
///
/// Every request ends within [`ObjTierConfig::request_deadline`] and every lookup within
/// `lookup_timeout_s`; every async method can be dropped at any await point.
pub struct ObjTier {
    pub(crate) shared: Arc<Shared>,
    pub(crate) cfg: ObjTierConfig,
    /// Background sweeps; shutdown stops and awaits them.
    pub(crate) sweeps: Mutex<tokio::task::JoinSet<()>>,
    /// A shared bucket's coordination task; shutdown awaits it (it releases the lease).
    pub(crate) coordination: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The existence listing's relists (unbounded, not shared); shutdown stops it.
    pub(crate) listing: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// A shutdown ran to its end: later ones do nothing (no second recency snapshot, no
    /// second request deadline against a server gone silent). One that was dropped midway
    /// did not set it: the next one does its work again.
    pub(crate) shut_down: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for ObjTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjTier")
            .field("name", &self.shared.name)
            .field("store", &self.shared.store.to_string())
            .field("prefix", &self.shared.prefix)
            .finish()
    }
}

impl ObjTier {
    /// Builds the object store from the config (S3 or S3-compatible), probes it, and opens
    /// the tier. Bad credentials, a missing bucket or an unreachable endpoint fail here,
    /// saying which. With no keys (in the config or the environment) the credential chain is
    /// asked first, within the request deadline: if it finds none or does not answer, the
    /// error says so and names the source it asked (the instance metadata service and its
    /// address, a web identity, the ECS or EKS endpoint).
    pub async fn connect(
        name: &str,
        cfg: ObjTierConfig,
        ns: Namespace,
        block_size: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        let counters = Arc::new(Counters::default());
        let (store, credentials) = crate::client::build_s3(&cfg, counters.clone())?;
        if let Some(from) = &credentials {
            crate::client::check_credentials(name, from, cfg.request_deadline()).await?;
        }
        // the S3 client drops a request's body when the request ends: PUTs send views
        Self::open(name, store, cfg, ns, block_size, counters, PutBody::View).await
    }

    /// Opens the tier on any object store (S3, GCS, Azure, local, in-memory). Probes it, and
    /// in bounded mode seeds the capacity index with a LIST. Never panics on a config that
    /// passes [`ObjTierConfig::validate`] (which it calls).
    ///
    /// A store given here may keep what it is given (an in-memory store keeps a PUT's body
    /// for good), so each PUT sends a copy of the block and the source is released before
    /// the upload; [`ObjTier::connect`]'s S3 client sends a view of the source instead,
    /// which stays held until its request ends.
    pub async fn with_store(
        name: &str,
        store: Arc<dyn ObjectStore>,
        cfg: ObjTierConfig,
        ns: Namespace,
        block_size: usize,
    ) -> Result<Self> {
        Self::open(
            name,
            store,
            cfg,
            ns,
            block_size,
            Arc::default(),
            PutBody::Copy,
        )
        .await
    }

    async fn open(
        name: &str,
        store: Arc<dyn ObjectStore>,
        cfg: ObjTierConfig,
        ns: Namespace,
        block_size: usize,
        counters: Arc<Counters>,
        put_body: PutBody,
    ) -> Result<Self> {
        cfg.validate()?;
        if block_size == 0 {
            return Err(Error::config("block_size_bytes", "must be positive"));
        }
        // the longest key a block can have: the prefix, the rank directory, a 64-digit hash
        // in its two directories, a group of up to 10 digits
        let longest = cfg.normalized_prefix().len() + 1 + ns.rank_dir_name().len() + 88;
        if longest > crate::config::MAX_KEY_BYTES {
            return Err(Error::config(
                "prefix",
                format!(
                    "with the namespace directory {:?} a block's key takes up to {longest} bytes, \
                     over S3's {}: shorten the prefix (or the model name)",
                    ns.rank_dir_name(),
                    crate::config::MAX_KEY_BYTES
                ),
            ));
        }
        let bound = cfg
            .max_size_gb
            .map(|gb| (gb * (1u64 << 30) as f64).min(u64::MAX as f64) as u64);
        if let Some(b) = bound.filter(|_| cfg.shared)
            && b < block_size as u64
        {
            return Err(Error::config(
                "max_size_gb",
                format!(
                    "{b} bytes hold no block of {block_size} bytes: a shared bucket's bound must hold one"
                ),
            ));
        }
        // a shared bucket's index is its leader's, in the coordination
        let cap = bound
            .filter(|_| !cfg.shared)
            .map(|bytes| Cap::new(bytes, cfg.low_watermark));
        let coord = match bound.filter(|_| cfg.shared) {
            Some(bytes) => {
                let id = cfg
                    .instance_id
                    .clone()
                    .unwrap_or_else(kv_tier_core::config::default_instance_id);
                // beside the rank's objects, not under them (a LIST of the blocks never
                // walks the coordination objects, nor theirs the blocks)
                let dir = if cfg.normalized_prefix().is_empty() {
                    format!("kv-tier-shared/{}", ns.rank_dir_name())
                } else {
                    format!(
                        "{}/kv-tier-shared/{}",
                        cfg.normalized_prefix(),
                        ns.rank_dir_name()
                    )
                };
                Some(Arc::new(crate::shared::Coord::new(
                    &id,
                    dir,
                    cfg.shared_lease(),
                    bytes,
                    cfg.low_watermark,
                    block_size,
                )))
            }
            None => None,
        };
        let inner = Arc::new(Shared {
            name: name.to_string(),
            store,
            prefix: cfg.normalized_prefix().to_string(),
            ns,
            block_size,
            checksum: cfg.checksum,
            accept_unverified: cfg.accept_unverified,
            put_body,
            sem: Semaphore::new(cfg.io_threads),
            probe_sem: Semaphore::new(cfg.io_threads),
            write_sem: Semaphore::new(cfg.io_threads),
            io_threads: cfg.io_threads,
            in_flight: AtomicUsize::new(0),
            reads_active: AtomicUsize::new(0),
            writes_active: AtomicUsize::new(0),
            budget_changed: tokio::sync::Notify::new(),
            log_deadlines: kv_tier_core::stats::Throttle::new(kv_tier_core::stats::LOG_INTERVAL),
            log_probe_errors: kv_tier_core::stats::Throttle::new(kv_tier_core::stats::LOG_INTERVAL),
            presence: crate::presence::Presence::new(1 << 20, exists_ttl(&cfg)),
            absent_ttl: Duration::from_secs_f64(cfg.absent_ttl_s),
            listing: Mutex::new(Default::default()),
            create_only: AtomicBool::new(true),
            protection: ProtectionSet::new(),
            events: Arc::new(EventLog::new(name, Medium::Storage, Locality::Remote)),
            counters,
            cap,
            coord,
            request_deadline: cfg.request_deadline(),
            lookup_deadline: Duration::from_secs_f64(cfg.lookup_timeout_s),
            puts: Mutex::new(FxHashMap::default()),
            damaged: Mutex::new(Default::default()),
            closed: AtomicBool::new(false),
        });
        let tier = Self {
            shared: inner,
            cfg,
            sweeps: Mutex::new(tokio::task::JoinSet::new()),
            coordination: Mutex::new(None),
            listing: Mutex::new(None),
            shut_down: std::sync::atomic::AtomicBool::new(false),
        };
        crate::client::probe(&tier.shared, &tier.cfg.bucket).await?;
        if tier.shared.cap.is_some() {
            tier.shared.seed_index().await?;
        }
        *lock(&tier.listing) = crate::listing::spawn(&tier.shared, tier.cfg.shared);
        if let Some(c) = &tier.shared.coord {
            crate::shared::tasks::check_conditional_writes(c, &tier.shared).await?;
            let task = tokio::spawn(crate::shared::tasks::run(c.clone(), tier.shared.clone()));
            *lock(&tier.coordination) = Some(task);
        }
        Ok(tier)
    }

    /// Registers the type `"obj"` in `registry` (an error if it is there already).
    pub fn register(registry: &mut TierRegistry) -> Result<()> {
        // the client connects on the manager's runtime (its I/O lives there)
        registry.register_tier(
            "obj",
            ObjTierConfig::from_spec,
            Opener::Connect(|name, cfg, ns, block_size| {
                Box::pin(async move { ObjTier::connect(&name, cfg, ns, block_size).await })
            }),
        )?;
        Ok(())
    }

    async fn run_store(&self, job: StoreJob) -> JobResult {
        let inner = &self.shared;
        // each object is recorded as it lands: reported even if the job is dropped
        let published = EventBatch::new(inner.events.clone(), false);
        let published = &published;
        // a shared bucket's stores wait for credit up to one deadline for the whole job
        let credit_deadline = crate::shared::Coord::credit_deadline();
        let links = job.links;
        let results: Vec<(BlockKey, Result<bool>)> = futures::stream::iter(job.blocks)
            .map(|(k, src)| async move {
                let r = inner.store_block(k, src, published, credit_deadline).await;
                (k, r)
            })
            .buffer_unordered(inner.io_threads)
            .collect()
            .await;
        if let Some(cap) = &inner.cap
            && !links.is_empty()
        {
            // the stored objects' places in their chains (an object not indexed, its store
            // failed, is not linked): a sweep takes a chain's tail first
            let mut idx = cap.lock();
            for (k, l) in &links {
                idx.link(k, l);
            }
        }
        JobResult::from_results(results, |_| bump(&inner.counters.blocks.store_failures, 1))
    }

    async fn run_load(&self, job: LoadJob) -> JobResult {
        let inner = &self.shared;
        let progress = &job.progress;
        let results: Vec<(BlockKey, Result<()>)> = futures::stream::iter(job.blocks)
            .map(|(k, mut sink)| async move {
                let r = inner.load_block(k, &mut sink).await;
                (k, progress.finish(k, sink, r))
            })
            .buffer_unordered(inner.io_threads)
            .collect()
            .await;
        JobResult::from_results(results, |e| {
            if !matches!(e, Error::NotFound { .. }) {
                bump(&inner.counters.blocks.load_failures, 1);
            }
        })
    }

    fn spawn_sweep(&self) {
        let mut set = lock(&self.sweeps);
        while set.try_join_next().is_some() {}
        if !self.shared.closed.load(Ordering::SeqCst) && set.is_empty() {
            let inner = self.shared.clone();
            set.spawn(async move {
                // stores that cross the bound while this sweep runs start none of their own:
                // sweep again while it is still over and the last pass deleted something
                loop {
                    let deleted = inner.clone().sweep(false).await;
                    let over = inner.cap.as_ref().is_some_and(|c| c.over());
                    if deleted == 0 || !over || inner.closed.load(Ordering::SeqCst) {
                        break;
                    }
                }
            });
        }
    }
}

/// A tier dropped without `shutdown` stops its background work: its sweeps end after their
/// current batch and a shared bucket's coordination task ends at its next tick, releasing the
/// lease (another instance takes it at once) and deleting its heartbeat.
impl Drop for ObjTier {
    fn drop(&mut self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        if let Some(c) = &self.shared.coord {
            c.close();
        }
    }
}

#[async_trait]
impl SecondaryTier for ObjTier {
    fn info(&self) -> TierInfo {
        let capability = Capability::new()
            .persistent(true)
            .shared(true)
            .bounded(self.cfg.max_size_gb.is_some())
            .checksums(self.shared.checksum == ObjChecksum::Crc32c);
        TierInfo::new(
            &self.shared.name,
            Medium::Storage,
            Locality::Remote,
            capability,
        )
    }

    /// Batched HEADs (at most `io_threads` at once, cached positive answers first), answered
    /// within `lookup_timeout_s`: a key whose HEAD has not answered by then, or failed, is
    /// absent. Fails only if every key's HEAD failed.
    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let inner = &self.shared;
        inner.check_open()?;
        let deadline = tokio::time::Instant::now() + inner.lookup_deadline;
        let mut out = vec![false; keys.len()];
        let mut answered = 0;
        let mut errors = 0;
        let mut last = None;
        let mut heads = futures::stream::iter(keys.iter().copied().enumerate())
            .map(|(i, k)| async move { (i, inner.head(&k, true).await) })
            .buffer_unordered(inner.io_threads);
        loop {
            match tokio::time::timeout_at(deadline, heads.next()).await {
                Ok(Some((i, r))) => {
                    answered += 1;
                    match r {
                        Ok(b) => out[i] = b,
                        Err(e) => {
                            errors += 1;
                            last = Some(e);
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => {
                    bump(&inner.counters.own.lookup_timeouts, 1);
                    if let Some(n) = inner.log_deadlines.note() {
                        tracing::warn!(tier = %inner.name, lookups = n, keys = keys.len(), answered, deadline = ?inner.lookup_deadline, "lookups passed their deadline (this many since the last such line, counted in lookup_timeouts); the unanswered keys count as absent");
                    }
                    break;
                }
            }
        }
        match last {
            Some(e) if errors == keys.len() => Err(e),
            Some(e) => {
                if let Some(n) = inner.log_probe_errors.note() {
                    tracing::warn!(tier = %inner.name, lookups = n, errors, error = %e, "lookups with failed existence probes (this many since the last such line); their keys count as absent");
                }
                Ok(out)
            }
            None => Ok(out),
        }
    }

    /// From what the tier knows, with no request: a key with a store of this tier in
    /// flight, or a sweep deleting it, is unknown (`None`: a HEAD tells); a bounded tier
    /// (not shared) holds what its capacity index or its existence cache holds, and nothing
    /// else: the index is what its LIST at open and its own stores, loads and sweeps keep
    /// (objects another writer put under its prefix since are outside its bound and not seen:
    /// several writers share a bound with `shared`). Otherwise a key the existence cache
    /// holds is held (what lookups trust too); an unbounded tier's existence listing answers
    /// "absent" for a key its last LIST did not find (see `absent_ttl_s`); any other key is
    /// unknown.
    fn holds(&self, key: &BlockKey) -> Option<bool> {
        self.shared.holds(key)
    }

    async fn store(&self, job: StoreJob) -> JobResult {
        let keys = job.keys();
        if let Err(e) = self.shared.check_open() {
            return JobResult::all_failed(keys, &e);
        }
        let _protect = self.shared.protection.protect(&keys);
        let res = self.run_store(job).await;
        if self.shared.cap.as_ref().is_some_and(|c| c.over()) {
            self.spawn_sweep();
        }
        res
    }

    async fn load(&self, job: LoadJob) -> JobResult {
        let keys = job.keys();
        if let Err(e) = self.shared.check_open() {
            return JobResult::all_failed(keys, &e);
        }
        let _protect = self.shared.protection.protect(&keys);
        self.run_load(job).await
    }

    fn touch(&self, keys: &[BlockKey]) {
        self.shared.touch_index(keys);
    }

    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.shared.protection.protect(keys)
    }

    fn is_protected(&self, key: &BlockKey) -> bool {
        self.shared.protection.contains(key)
    }

    fn take_events(&self) -> Vec<TierEvent> {
        self.shared.events.take()
    }

    fn configure_events(&self, settings: kv_tier_core::EventSettings) {
        self.shared.events.configure(settings);
    }

    fn events_dropped(&self) -> u64 {
        self.shared.events.dropped()
    }

    /// [`ObjTier::stats`] as a snapshot: bounded, its indexed bytes against its bound.
    fn stats(&self) -> kv_tier_core::TierSnapshot {
        let s = ObjTier::stats(self);
        let snap = kv_tier_core::TierSnapshot::new("obj", s.blocks, &s);
        match &self.shared.cap {
            Some(cap) => snap.with_usage(s.bytes, Some(cap.cap)),
            None => snap,
        }
    }

    /// Refuses new work, then stops the background sweeps (each ends after its current
    /// batch of deletes, or is aborted a request deadline after shutdown began) and awaits
    /// them.
    async fn shutdown(&self) -> Result<()> {
        self.shared.closed.store(true, Ordering::SeqCst);
        if self.shut_down.load(Ordering::SeqCst) {
            return Ok(());
        }
        if let Some(c) = &self.shared.coord {
            c.close();
        }
        if let Some(task) = lock(&self.listing).take() {
            task.abort();
        }
        let mut set = std::mem::take(&mut *lock(&self.sweeps));
        let started = Instant::now();
        let drained = tokio::time::timeout(self.shared.request_deadline, async {
            while set.join_next().await.is_some() {}
        })
        .await;
        if drained.is_err() {
            set.abort_all();
            while set.join_next().await.is_some() {}
        }
        let coordination = lock(&self.coordination).take();
        if let Some(mut task) = coordination {
            // its last tick, a journal flush and the lease's release: a few requests
            let wait = self.shared.request_deadline * 4;
            if tokio::time::timeout(wait, &mut task).await.is_err() {
                task.abort();
                let _ = task.await;
            }
        }
        self.shared.save_recency().await;
        self.shut_down.store(true, Ordering::SeqCst);
        tracing::debug!(tier = %self.shared.name, took_ms = started.elapsed().as_millis() as u64, "obj tier shut down");
        Ok(())
    }
}

/// How long a positive existence answer is cached: `exists_ttl_s`, and on a shared bucket
/// at most a quarter lease (another instance's leader deletes objects this one cannot
/// hear of).
fn exists_ttl(cfg: &ObjTierConfig) -> Duration {
    let ttl = Duration::from_secs_f64(cfg.exists_ttl_s);
    if cfg.shared {
        ttl.min(cfg.shared_lease() / 4)
    } else {
        ttl
    }
}
