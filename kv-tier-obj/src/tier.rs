//! [`ObjTier`]: blocks as objects, one per block, keyed like the fs tier's paths.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use kv_tier_core::{
    BlockKey, BlockSink, BlockSource, BuildContext, Capability, Error, EventLog, JobResult,
    LoadJob, Locality, Medium, Namespace, ProtectGuard, ProtectionSet, Result, SecondaryTier,
    StoreJob, TierEvent, TierInfo, TierRegistry, TierSpec, async_trait,
};
use object_store::path::Path as ObjPath;
use object_store::{
    Attribute, AttributeValue, Attributes, ObjectStore, PutMode, PutOptions, PutPayload,
};
use rustc_hash::{FxHashMap, FxHashSet};
use tokio::sync::{Notify, Semaphore};

use crate::config::{ObjChecksum, ObjTierConfig, Scheme};

/// The user-metadata key of a block's CRC32C (8 hex digits).
pub const CRC_METADATA_KEY: &str = "kv-tier-crc32c";

/// Counters of an [`ObjTier`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ObjStats {
    /// Requests sent (HEAD, PUT, GET, DELETE, LIST).
    pub requests: u64,
    /// The most requests in flight at once (bounded by `io_threads`).
    pub max_in_flight: u64,
    /// Existence answers served from the cache, without a request.
    pub exists_cache_hits: u64,
    /// Objects written by this tier.
    pub blocks_written: u64,
    /// Stores that found the object present (or lost the create-only race).
    pub stores_skipped: u64,
    /// Blocks whose store failed.
    pub store_failures: u64,
    /// Blocks loaded whole.
    pub blocks_read: u64,
    /// Loads of missing objects.
    pub load_misses: u64,
    /// Other load failures.
    pub load_failures: u64,
    /// Objects deleted because they were short or failed their checksum.
    pub corrupt_deleted: u64,
    /// Loads whose checksum did not match.
    pub checksum_mismatches: u64,
    /// Objects deleted to keep the tier under `max_size_gb`.
    pub evicted: u64,
    /// Capacity sweeps run.
    pub sweeps: u64,
    /// Sweep candidates kept because a job had them protected.
    pub skipped_in_flight: u64,
    /// Bytes in the capacity index (bounded mode).
    pub bytes: u64,
    /// Objects in the capacity index (bounded mode).
    pub objects: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// Bytes read.
    pub bytes_read: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    max_in_flight: AtomicU64,
    exists_cache_hits: AtomicU64,
    blocks_written: AtomicU64,
    stores_skipped: AtomicU64,
    store_failures: AtomicU64,
    blocks_read: AtomicU64,
    load_misses: AtomicU64,
    load_failures: AtomicU64,
    corrupt_deleted: AtomicU64,
    checksum_mismatches: AtomicU64,
    evicted: AtomicU64,
    sweeps: AtomicU64,
    skipped_in_flight: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// The capacity index: size and last use of every object, oldest evicted first.
#[derive(Default)]
struct CapIndex {
    map: FxHashMap<BlockKey, (u64, u64)>,
    total: u64,
    clock: u64,
    deleting: FxHashSet<BlockKey>,
}

impl CapIndex {
    fn insert(&mut self, key: BlockKey, size: u64, last_use: u64) {
        if let Some((old, _)) = self.map.insert(key, (size, last_use)) {
            self.total -= old;
        }
        self.total += size;
    }
    fn remove(&mut self, key: &BlockKey) {
        if let Some((size, _)) = self.map.remove(key) {
            self.total -= size;
        }
    }
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }
}

struct Cap {
    cap: u64,
    low: u64,
    index: Mutex<CapIndex>,
    deleted: Notify,
    /// One sweep at a time: background sweeps skip when one runs, `sweep_now` waits.
    sweeping: tokio::sync::Mutex<()>,
}

struct Inner {
    name: String,
    store: Arc<dyn ObjectStore>,
    ns: Namespace,
    prefix: String,
    block_size: usize,
    checksum: ObjChecksum,
    sem: Semaphore,
    io_threads: usize,
    in_flight: AtomicUsize,
    exists: moka::sync::Cache<BlockKey, ()>,
    create_only: AtomicBool,
    protection: ProtectionSet,
    events: EventLog,
    counters: Counters,
    cap: Option<Cap>,
    job_deadline: Duration,
    /// Keys with a PUT in flight from this tier: a second store of the same key waits for it
    /// instead of uploading the same bytes again (and racing it on stores whose writes are
    /// not atomic).
    puts: Mutex<FxHashMap<BlockKey, Arc<Notify>>>,
}

/// The object-store tier: one object per block under `prefix/`, keyed by the fs layout's
/// path relative to its root (`<model>_<digest>_r<rank>/<hex[0..3]>/<hex[3..5]>_g<group>/<hex>.bin`).
///
/// Unlike the reference, keys never start with `/` and never contain `//` (an empty prefix
/// gives keys at the bucket root; a prefix `a/b/` gives `a/b/<...>`).
pub struct ObjTier {
    inner: Arc<Inner>,
    cfg: ObjTierConfig,
}

impl std::fmt::Debug for ObjTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ObjTier")
            .field("name", &self.inner.name)
            .field("store", &self.inner.store.to_string())
            .field("prefix", &self.inner.prefix)
            .finish()
    }
}

/// Tracks one request in flight, holding a permit of the `io_threads` bound.
struct InFlight<'a> {
    inner: &'a Inner,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn classify(tier: &str, what: &str, e: &object_store::Error) -> Error {
    use object_store::Error as E;
    let text = e.to_string();
    let transient = !matches!(
        e,
        E::NotFound { .. } | E::AlreadyExists { .. } | E::Precondition { .. } | E::NotImplemented
    ) && !text.contains("403")
        && !text.contains("AccessDenied");
    Error::Backend {
        tier: tier.to_string(),
        message: format!("{what}: {text}"),
        transient,
    }
}

impl Inner {
    async fn slot(&self) -> InFlight<'_> {
        let permit = self.sem.acquire().await.expect("semaphore never closes");
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.counters
            .max_in_flight
            .fetch_max(now as u64, Ordering::Relaxed);
        bump(&self.counters.requests, 1);
        InFlight {
            inner: self,
            _permit: permit,
        }
    }

    fn path(&self, key: &BlockKey) -> ObjPath {
        let rel = self.ns.block_rel_path(key);
        if self.prefix.is_empty() {
            ObjPath::from(rel)
        } else {
            ObjPath::from(format!("{}/{rel}", self.prefix))
        }
    }

    fn rank_prefix(&self) -> ObjPath {
        let rank = self.ns.rank_dir_name();
        if self.prefix.is_empty() {
            ObjPath::from(rank)
        } else {
            ObjPath::from(format!("{}/{rank}", self.prefix))
        }
    }

    /// The key of an object path under the rank prefix, if it is a block of this layout.
    fn key_of(&self, path: &ObjPath) -> Option<BlockKey> {
        let s = path.as_ref();
        let rel = if self.prefix.is_empty() {
            s
        } else {
            s.strip_prefix(&self.prefix)?.strip_prefix('/')?
        };
        let file = rel.rsplit('/').next()?;
        let leaf = rel.rsplit('/').nth(1)?;
        let hex = file.strip_suffix(".bin")?;
        let group: u32 = leaf.rsplit_once("_g")?.1.parse().ok()?;
        let key = BlockKey::from_hex(hex, group).ok()?;
        (self.ns.block_rel_path(&key) == rel).then_some(key)
    }

    async fn head(&self, key: &BlockKey) -> std::result::Result<bool, object_store::Error> {
        if self.exists.contains_key(key) {
            bump(&self.counters.exists_cache_hits, 1);
            return Ok(true);
        }
        let _s = self.slot().await;
        match self.store.head(&self.path(key)).await {
            Ok(_) => {
                self.exists.insert(*key, ());
                Ok(true)
            }
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn wait_not_deleting(&self, key: &BlockKey) {
        let Some(cap) = &self.cap else { return };
        loop {
            let notified = cap.deleted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !cap.index.lock().expect("cap index").deleting.contains(key) {
                return;
            }
            notified.await;
        }
    }

    /// Stores one block: `Ok(true)` when this call created the object. Concurrent stores of
    /// one key in this tier upload once: the others wait for that upload and then find the
    /// block present (or upload themselves if it failed).
    async fn store_block(&self, key: BlockKey, src: BlockSource) -> Result<bool> {
        if src.len() != self.block_size {
            return Err(Error::WrongSize {
                key,
                got: src.len(),
                expected: self.block_size,
            });
        }
        let done = loop {
            let waiting = {
                let mut puts = self.puts.lock().expect("obj puts");
                match puts.get(&key) {
                    Some(n) => {
                        let n = n.clone();
                        // register before the lock drops: the uploader notifies under it
                        let fut = n.notified_owned();
                        Some(fut)
                    }
                    None => {
                        let n = Arc::new(Notify::new());
                        puts.insert(key, n.clone());
                        break n;
                    }
                }
            };
            if let Some(fut) = waiting {
                fut.await;
            }
        };
        let res = self.upload(key, src).await;
        {
            let mut puts = self.puts.lock().expect("obj puts");
            puts.remove(&key);
            done.notify_waiters();
        }
        res
    }

    async fn upload(&self, key: BlockKey, src: BlockSource) -> Result<bool> {
        self.wait_not_deleting(&key).await;
        if self.exists.contains_key(&key) {
            bump(&self.counters.exists_cache_hits, 1);
            bump(&self.counters.stores_skipped, 1);
            self.touch_index(&[key]);
            return Ok(false);
        }
        let bytes: Bytes = src.bytes(); // zero-copy view of the DRAM slot
        let mut attributes = Attributes::new();
        if self.checksum == ObjChecksum::Crc32c {
            let crc = crc32c::crc32c(&bytes);
            attributes.insert(
                Attribute::Metadata(CRC_METADATA_KEY.into()),
                AttributeValue::from(format!("{crc:08x}")),
            );
        }
        let path = self.path(&key);
        loop {
            let create = self.create_only.load(Ordering::Relaxed);
            if !create {
                // No conditional writes here: look first (a race may still replace a block
                // with an identical one: blocks are content-addressed).
                match self.head(&key).await {
                    Ok(true) => {
                        bump(&self.counters.stores_skipped, 1);
                        return Ok(false);
                    }
                    Ok(false) => {}
                    Err(e) => return Err(classify(&self.name, "HEAD", &e)),
                }
            }
            let opts = PutOptions {
                mode: if create {
                    PutMode::Create
                } else {
                    PutMode::Overwrite
                },
                attributes: attributes.clone(),
                ..PutOptions::default()
            };
            let res = {
                let _s = self.slot().await;
                self.store
                    .put_opts(&path, PutPayload::from(bytes.clone()), opts)
                    .await
            };
            match res {
                Ok(_) => {
                    self.exists.insert(key, ());
                    bump(&self.counters.blocks_written, 1);
                    bump(&self.counters.bytes_written, self.block_size as u64);
                    if let Some(cap) = &self.cap {
                        let mut idx = cap.index.lock().expect("cap index");
                        let t = idx.tick();
                        idx.insert(key, self.block_size as u64, t);
                    }
                    return Ok(true);
                }
                Err(object_store::Error::AlreadyExists { .. })
                | Err(object_store::Error::Precondition { .. }) => {
                    self.exists.insert(key, ());
                    bump(&self.counters.stores_skipped, 1);
                    self.touch_index(&[key]);
                    return Ok(false);
                }
                Err(object_store::Error::NotImplemented) if create => {
                    tracing::warn!(tier = %self.name, "the store has no create-only writes; checking before writing instead");
                    self.create_only.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(classify(&self.name, &format!("PUT {path}"), &e)),
            }
        }
    }

    async fn delete_corrupt(&self, key: &BlockKey, path: &ObjPath) {
        self.exists.invalidate(key);
        if let Some(cap) = &self.cap {
            cap.index.lock().expect("cap index").remove(key);
        }
        let _s = self.slot().await;
        if self.store.delete(path).await.is_ok() {
            bump(&self.counters.corrupt_deleted, 1);
            self.events.push(vec![*key], true);
        }
    }

    async fn load_block(&self, key: BlockKey, sink: &mut BlockSink) -> Result<()> {
        if sink.len() != self.block_size {
            return Err(Error::WrongSize {
                key,
                got: sink.len(),
                expected: self.block_size,
            });
        }
        let path = self.path(&key);
        let _s = self.slot().await;
        let got = match self.store.get(&path).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => {
                self.exists.invalidate(&key);
                if let Some(cap) = &self.cap {
                    cap.index.lock().expect("cap index").remove(&key);
                }
                bump(&self.counters.load_misses, 1);
                return Err(Error::NotFound {
                    key,
                    tier: self.name.clone(),
                });
            }
            Err(e) => return Err(classify(&self.name, &format!("GET {path}"), &e)),
        };
        let want_crc = got
            .attributes
            .get(&Attribute::Metadata(CRC_METADATA_KEY.into()))
            .and_then(|v| u32::from_str_radix(v.as_ref(), 16).ok());
        let size = got.meta.size as usize;
        let mut stream = got.into_stream();
        let buf = sink.as_mut_slice();
        let mut filled = 0usize;
        let mut overflow = size != self.block_size;
        while !overflow && let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| classify(&self.name, &format!("GET {path}"), &e))?;
            if filled + chunk.len() > buf.len() {
                overflow = true;
                break;
            }
            buf[filled..filled + chunk.len()].copy_from_slice(&chunk);
            filled += chunk.len();
        }
        drop(_s);
        if overflow || filled != self.block_size {
            let reason = format!(
                "object is {size} bytes, the block size is {}",
                self.block_size
            );
            self.delete_corrupt(&key, &path).await;
            return Err(Error::Corrupt {
                key,
                tier: self.name.clone(),
                reason,
            });
        }
        if self.checksum == ObjChecksum::Crc32c
            && let Some(want) = want_crc
        {
            let crc = crc32c::crc32c(buf);
            if crc != want {
                bump(&self.counters.checksum_mismatches, 1);
                tracing::warn!(tier = %self.name, %key, "checksum mismatch; the object is deleted");
                self.delete_corrupt(&key, &path).await;
                return Err(Error::Corrupt {
                    key,
                    tier: self.name.clone(),
                    reason: format!("crc32c is {crc:08x}, stored {want:08x} ({path})"),
                });
            }
        }
        self.exists.insert(key, ());
        self.touch_index(&[key]);
        bump(&self.counters.blocks_read, 1);
        bump(&self.counters.bytes_read, self.block_size as u64);
        Ok(())
    }

    fn touch_index(&self, keys: &[BlockKey]) {
        if let Some(cap) = &self.cap {
            let mut idx = cap.index.lock().expect("cap index");
            for k in keys {
                let t = idx.tick();
                if let Some(e) = idx.map.get_mut(k) {
                    e.1 = t;
                }
            }
        }
    }

    /// Deletes least-recently-used objects down to the low watermark, skipping protected
    /// keys. Deciding is atomic with `protect()`; a store of a key being deleted waits.
    async fn sweep(self: Arc<Self>, wait: bool) -> usize {
        let Some(cap) = &self.cap else { return 0 };
        let _one = if wait {
            cap.sweeping.lock().await
        } else {
            match cap.sweeping.try_lock() {
                Ok(g) => g,
                Err(_) => return 0,
            }
        };
        let mut victims = Vec::new();
        let mut skipped = 0u64;
        self.protection.with_lock(|is_protected| {
            let mut idx = cap.index.lock().expect("cap index");
            if idx.total <= cap.cap {
                return;
            }
            let mut order: Vec<(u64, BlockKey, u64)> =
                idx.map.iter().map(|(k, (s, t))| (*t, *k, *s)).collect();
            order.sort_unstable();
            let mut total = idx.total;
            for (_, k, size) in order {
                if total <= cap.low {
                    break;
                }
                if is_protected(&k) {
                    skipped += 1;
                    continue;
                }
                total -= size;
                victims.push(k);
            }
            for k in &victims {
                idx.remove(k);
                idx.deleting.insert(*k);
            }
        });
        bump(&self.counters.skipped_in_flight, skipped);
        let mut deleted = Vec::new();
        if !victims.is_empty() {
            for k in &victims {
                self.exists.invalidate(k);
            }
            let paths: Vec<ObjPath> = victims.iter().map(|k| self.path(k)).collect();
            let results: Vec<_> = {
                let _s = self.slot().await;
                let stream = futures::stream::iter(paths.into_iter().map(Ok)).boxed();
                self.store.delete_stream(stream).collect().await
            };
            for (k, r) in victims.iter().zip(results) {
                match r {
                    Ok(_) | Err(object_store::Error::NotFound { .. }) => deleted.push(*k),
                    Err(e) => {
                        tracing::warn!(tier = %self.name, key = %k, error = %e, "capacity delete failed")
                    }
                }
            }
            let mut idx = cap.index.lock().expect("cap index");
            for k in &victims {
                idx.deleting.remove(k);
            }
        }
        cap.deleted.notify_waiters();
        bump(&self.counters.evicted, deleted.len() as u64);
        bump(&self.counters.sweeps, 1);
        let n = deleted.len();
        self.events.push(deleted, true);
        n
    }
}

impl ObjTier {
    /// Builds the object store from the config (S3 or S3-compatible), probes it, and opens
    /// the tier. Bad credentials or an unreachable endpoint fail here, saying which.
    pub async fn connect(
        name: &str,
        cfg: ObjTierConfig,
        ns: Namespace,
        block_size: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        let store = build_s3(&cfg)?;
        Self::with_store(name, store, cfg, ns, block_size).await
    }

    /// Opens the tier on any object store (S3, GCS, Azure, local, in-memory). Probes it, and
    /// in bounded mode seeds the capacity index with a LIST.
    pub async fn with_store(
        name: &str,
        store: Arc<dyn ObjectStore>,
        cfg: ObjTierConfig,
        ns: Namespace,
        block_size: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        let cap = cfg.max_size_gb.map(|gb| {
            let cap = (gb * (1u64 << 30) as f64) as u64;
            Cap {
                cap,
                low: (cap as f64 * cfg.low_watermark) as u64,
                index: Mutex::new(CapIndex::default()),
                deleted: Notify::new(),
                sweeping: tokio::sync::Mutex::new(()),
            }
        });
        let attempt = Duration::from_secs_f64(cfg.request_timeout_s);
        let inner = Arc::new(Inner {
            name: name.to_string(),
            store,
            prefix: cfg.normalized_prefix().to_string(),
            ns,
            block_size,
            checksum: cfg.checksum,
            sem: Semaphore::new(cfg.io_threads),
            io_threads: cfg.io_threads,
            in_flight: AtomicUsize::new(0),
            exists: moka::sync::Cache::builder()
                .max_capacity(1 << 20)
                .time_to_live(Duration::from_secs_f64(cfg.exists_ttl_s))
                .build(),
            create_only: AtomicBool::new(true),
            protection: ProtectionSet::new(),
            events: EventLog::new(name, Medium::Storage, Locality::Remote),
            counters: Counters::default(),
            cap,
            job_deadline: attempt * (cfg.max_retries as u32 + 1) + Duration::from_secs(1),
            puts: Mutex::new(FxHashMap::default()),
        });
        let tier = Self { inner, cfg };
        tier.probe().await?;
        if tier.inner.cap.is_some() {
            tier.seed_index().await?;
        }
        Ok(tier)
    }

    /// Registers the type `"obj"` in `registry`.
    pub fn register(registry: &mut TierRegistry) {
        registry.register("obj", ObjBuilder);
    }

    /// The options the tier was opened with.
    pub fn config(&self) -> &ObjTierConfig {
        &self.cfg
    }

    /// The object path of `key`.
    pub fn object_path(&self, key: &BlockKey) -> String {
        self.inner.path(key).to_string()
    }

    /// The underlying store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner.store
    }

    /// Counters.
    pub fn stats(&self) -> ObjStats {
        let c = &self.inner.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let (bytes, objects) = self.inner.cap.as_ref().map_or((0, 0), |cap| {
            let i = cap.index.lock().expect("cap index");
            (i.total, i.map.len() as u64)
        });
        ObjStats {
            requests: g(&c.requests),
            max_in_flight: g(&c.max_in_flight),
            exists_cache_hits: g(&c.exists_cache_hits),
            blocks_written: g(&c.blocks_written),
            stores_skipped: g(&c.stores_skipped),
            store_failures: g(&c.store_failures),
            blocks_read: g(&c.blocks_read),
            load_misses: g(&c.load_misses),
            load_failures: g(&c.load_failures),
            corrupt_deleted: g(&c.corrupt_deleted),
            checksum_mismatches: g(&c.checksum_mismatches),
            evicted: g(&c.evicted),
            sweeps: g(&c.sweeps),
            skipped_in_flight: g(&c.skipped_in_flight),
            bytes,
            objects,
            bytes_written: g(&c.bytes_written),
            bytes_read: g(&c.bytes_read),
        }
    }

    /// Runs a capacity sweep now (bounded mode), after any sweep in progress; returns the
    /// objects it deleted.
    pub async fn sweep_now(&self) -> usize {
        self.inner.clone().sweep(true).await
    }

    /// Forgets cached existence answers (for tests of the cache).
    pub fn clear_exists_cache(&self) {
        self.inner.exists.invalidate_all();
    }

    async fn probe(&self) -> Result<()> {
        let key = BlockKey::from_hash32([0; 32], u32::MAX);
        let path = self.inner.path(&key);
        let res = {
            let _s = self.inner.slot().await;
            tokio::time::timeout(self.inner.job_deadline, self.inner.store.head(&path)).await
        };
        let err = match res {
            Ok(Ok(_)) | Ok(Err(object_store::Error::NotFound { .. })) => return Ok(()),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.inner.job_deadline),
        };
        let hint = if [
            "403",
            "AccessDenied",
            "SignatureDoesNotMatch",
            "InvalidAccessKeyId",
            "Forbidden",
        ]
        .iter()
        .any(|s| err.contains(s))
        {
            "the credentials were refused: check access_key, secret_key and session_token"
        } else if err.contains("404") || err.contains("NoSuchBucket") {
            "the bucket does not exist"
        } else {
            "the endpoint cannot be reached: check endpoint_override, scheme and region"
        };
        Err(Error::Backend {
            tier: self.inner.name.clone(),
            message: format!(
                "startup probe of bucket {:?} failed: {hint} ({err})",
                self.cfg.bucket
            ),
            transient: false,
        })
    }

    async fn seed_index(&self) -> Result<()> {
        let Some(cap) = &self.inner.cap else {
            return Ok(());
        };
        let prefix = self.inner.rank_prefix();
        let mut listing = self.inner.store.list(Some(&prefix));
        let mut found = Vec::new();
        while let Some(meta) = listing
            .try_next()
            .await
            .map_err(|e| classify(&self.inner.name, "LIST", &e))?
        {
            if let Some(k) = self.inner.key_of(&meta.location) {
                let t = meta.last_modified.timestamp_micros().max(0) as u64;
                found.push((t, k, meta.size));
            }
        }
        bump(&self.inner.counters.requests, 1);
        found.sort_unstable();
        let mut idx = cap.index.lock().expect("cap index");
        for (_, k, size) in found {
            let t = idx.tick();
            idx.insert(k, size, t);
        }
        Ok(())
    }

    async fn run_store(&self, job: StoreJob) -> JobResult {
        let inner = &self.inner;
        let results: Vec<(BlockKey, Result<bool>)> = futures::stream::iter(job.blocks)
            .map(|(k, src)| async move { (k, inner.store_block(k, src).await) })
            .buffer_unordered(inner.io_threads)
            .collect()
            .await;
        let mut res = JobResult::default();
        let mut published = Vec::new();
        for (k, r) in results {
            match r {
                Ok(p) => {
                    if p {
                        published.push(k);
                    }
                    res.ok.push(k);
                }
                Err(e) => {
                    bump(&inner.counters.store_failures, 1);
                    res.failed.push((k, e));
                }
            }
        }
        inner.events.push(published, false);
        res
    }

    async fn run_load(&self, job: LoadJob) -> JobResult {
        let inner = &self.inner;
        let results: Vec<(BlockKey, Result<()>)> = futures::stream::iter(job.blocks)
            .map(|(k, mut sink)| async move { (k, inner.load_block(k, &mut sink).await) })
            .buffer_unordered(inner.io_threads)
            .collect()
            .await;
        let mut res = JobResult::default();
        for (k, r) in results {
            match r {
                Ok(()) => res.ok.push(k),
                Err(e) => {
                    if !matches!(e, Error::NotFound { .. }) {
                        bump(&inner.counters.load_failures, 1);
                    }
                    res.failed.push((k, e));
                }
            }
        }
        res
    }

    fn timed_out(&self, op: &str) -> Error {
        Error::Timeout {
            op: format!("{op} job on tier `{}`", self.inner.name),
            after: self.inner.job_deadline,
        }
    }
}

/// The S3 client from the config.
fn build_s3(cfg: &ObjTierConfig) -> Result<Arc<dyn ObjectStore>> {
    use object_store::aws::AmazonS3Builder;
    use object_store::{BackoffConfig, ClientOptions, RetryConfig};
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(&cfg.bucket)
        .with_region(cfg.region.clone().unwrap_or_else(|| "us-east-1".into()))
        .with_allow_http(cfg.scheme == Scheme::Http);
    if let Some(e) = &cfg.endpoint_override {
        b = b.with_endpoint(e.trim_end_matches('/'));
    }
    let nonempty = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    if let (Some(ak), Some(sk)) = (nonempty(&cfg.access_key), nonempty(&cfg.secret_key)) {
        b = b.with_access_key_id(ak).with_secret_access_key(sk);
        if let Some(t) = nonempty(&cfg.session_token) {
            b = b.with_token(t);
        }
    }
    let attempt = Duration::from_secs_f64(cfg.request_timeout_s);
    let mut opts = ClientOptions::new()
        .with_timeout(attempt)
        .with_connect_timeout(attempt.min(Duration::from_secs(5)))
        .with_allow_http(cfg.scheme == Scheme::Http);
    if let Some(path) = &cfg.ca_bundle {
        let pem = std::fs::read(path)
            .map_err(|e| Error::config("ca_bundle", format!("cannot read {path}: {e}")))?;
        let certs = object_store::Certificate::from_pem_bundle(&pem)
            .map_err(|e| Error::config("ca_bundle", format!("{path}: {e}")))?;
        for c in certs {
            opts = opts.with_root_certificate(c);
        }
    }
    b = b.with_client_options(opts).with_retry(RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: cfg.max_retries,
        retry_timeout: attempt * (cfg.max_retries as u32 + 1),
    });
    let store = b
        .build()
        .map_err(|e| Error::config("bucket", format!("cannot build the S3 client: {e}")))?;
    Ok(Arc::new(store))
}

struct ObjBuilder;

#[async_trait]
impl kv_tier_core::TierBuilder for ObjBuilder {
    async fn build(&self, spec: &TierSpec, ctx: &BuildContext) -> Result<Arc<dyn SecondaryTier>> {
        let cfg = ObjTierConfig::from_spec(spec)?;
        let ns = ctx.require_namespace()?.clone();
        // Connect on the manager's runtime (the client's I/O lives there).
        let name = ctx.name.clone();
        let bs = ctx.block_size;
        let tier = ctx
            .runtime
            .spawn(async move { ObjTier::connect(&name, cfg, ns, bs).await })
            .await
            .map_err(|e| Error::Backend {
                tier: ctx.name.clone(),
                message: format!("connecting panicked: {e}"),
                transient: false,
            })??;
        Ok(Arc::new(tier))
    }
}

#[async_trait]
impl SecondaryTier for ObjTier {
    fn info(&self) -> TierInfo {
        TierInfo {
            name: self.inner.name.clone(),
            medium: Medium::Storage,
            locality: Locality::Remote,
            capability: Capability {
                persistent: true,
                bounded: self.inner.cap.is_some(),
                checksums: self.inner.checksum == ObjChecksum::Crc32c,
                shared: true,
            },
        }
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let inner = &self.inner;
        let results: Vec<std::result::Result<bool, object_store::Error>> =
            futures::stream::iter(keys.iter().copied())
                .map(|k| async move { inner.head(&k).await })
                .buffered(inner.io_threads)
                .collect()
                .await;
        let mut out = Vec::with_capacity(keys.len());
        let mut errors = 0;
        let mut last = None;
        for r in results {
            match r {
                Ok(b) => out.push(b),
                Err(e) => {
                    errors += 1;
                    last = Some(e);
                    out.push(false);
                }
            }
        }
        match last {
            Some(e) if errors == keys.len() => Err(classify(&inner.name, "HEAD", &e)),
            Some(e) => {
                tracing::warn!(tier = %inner.name, errors, error = %e, "some existence probes failed; counted as misses");
                Ok(out)
            }
            None => Ok(out),
        }
    }

    async fn store(&self, job: StoreJob) -> JobResult {
        let keys = job.keys();
        let _protect = self.inner.protection.protect(&keys);
        let res = match tokio::time::timeout(self.inner.job_deadline, self.run_store(job)).await {
            Ok(r) => r,
            Err(_) => JobResult::all_failed(keys, &self.timed_out("store")),
        };
        if let Some(cap) = &self.inner.cap
            && cap.index.lock().expect("cap index").total > cap.cap
        {
            tokio::spawn(self.inner.clone().sweep(false));
        }
        res
    }

    async fn load(&self, job: LoadJob) -> JobResult {
        let keys = job.keys();
        let _protect = self.inner.protection.protect(&keys);
        match tokio::time::timeout(self.inner.job_deadline, self.run_load(job)).await {
            Ok(r) => r,
            Err(_) => JobResult::all_failed(keys, &self.timed_out("load")),
        }
    }

    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch_index(keys);
    }

    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.inner.protection.protect(keys)
    }

    fn is_protected(&self, key: &BlockKey) -> bool {
        self.inner.protection.contains(key)
    }

    fn take_events(&self) -> Vec<TierEvent> {
        self.inner.events.take()
    }

    async fn shutdown(&self) -> Result<()> {
        Ok(())
    }
}
