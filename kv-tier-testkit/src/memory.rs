//! [`MemoryTier`]: the in-memory reference secondary tier. It passes the conformance suite,
//! drives the manager's tests, and documents the contract in the simplest possible code.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use std::sync::Arc;

use bytes::Bytes;
use kv_tier_core::{
    BlockKey, BuildContext, Capability, Error, EventLog, JobResult, LoadJob, Locality, Medium,
    ProtectGuard, ProtectionSet, Result, SecondaryTier, StoreJob, TierEvent, TierInfo,
    TierRegistry, TierSpec, async_trait,
};
use rustc_hash::FxHashMap;

/// The reference secondary tier: a map from key to bytes. Unbounded; never evicts.
///
/// Stores copy the block (a tier must not keep DRAM slots pinned), publish-if-absent under
/// the map's lock; loads copy into the sink. Copies run on the calling task.
#[derive(Debug)]
pub struct MemoryTier {
    name: String,
    block_size: usize,
    blocks: Mutex<FxHashMap<BlockKey, Arc<Vec<u8>>>>,
    /// Buffers of removed blocks, reused by later stores (pre-faulted memory, like a device).
    pool: Mutex<Vec<Vec<u8>>>,
    protection: ProtectionSet,
    events: EventLog,
    lookups: AtomicU64,
    lookup_batches: AtomicU64,
}

impl MemoryTier {
    /// An empty tier for blocks of `block_size` bytes.
    pub fn new(name: impl Into<String>, block_size: usize) -> Self {
        let name = name.into();
        Self {
            events: EventLog::new(name.clone(), Medium::Storage, Locality::Local),
            name,
            block_size,
            blocks: Mutex::new(FxHashMap::default()),
            pool: Mutex::new(Vec::new()),
            protection: ProtectionSet::new(),
            lookups: AtomicU64::new(0),
            lookup_batches: AtomicU64::new(0),
        }
    }

    /// Number of blocks held.
    pub fn len(&self) -> usize {
        self.blocks.lock().expect("memory tier").len()
    }

    /// Whether the tier is empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` is held (synchronously, for tests).
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.blocks.lock().expect("memory tier").contains_key(key)
    }

    /// The bytes held for `key`.
    pub fn get(&self, key: &BlockKey) -> Option<Bytes> {
        let data = self.blocks.lock().expect("memory tier").get(key).cloned()?;
        Some(Bytes::copy_from_slice(&data))
    }

    /// Removes `key` behind the tier's back (simulates an external delete).
    pub fn remove(&self, key: &BlockKey) -> bool {
        let removed = self.blocks.lock().expect("memory tier").remove(key);
        removed.map(|b| self.recycle(b)).is_some()
    }

    /// Removes every block, keeping their buffers for reuse.
    pub fn clear(&self) {
        let all: Vec<_> = self
            .blocks
            .lock()
            .expect("memory tier")
            .drain()
            .map(|(_, b)| b)
            .collect();
        for b in all {
            self.recycle(b);
        }
    }

    /// Pre-allocates (and faults in) buffers for `n` more blocks, as a device has its
    /// capacity up front; stores then copy at memory speed.
    pub fn reserve(&self, n: usize) {
        let mut pool = self.pool.lock().expect("memory tier pool");
        for _ in 0..n {
            pool.push(vec![0xa5u8; self.block_size]);
        }
    }

    fn recycle(&self, b: Arc<Vec<u8>>) {
        // A buffer still being read by a load is simply dropped when that load ends.
        if let Ok(v) = Arc::try_unwrap(b) {
            self.pool.lock().expect("memory tier pool").push(v);
        }
    }

    fn buffer(&self, data: &[u8]) -> Arc<Vec<u8>> {
        let recycled = self.pool.lock().expect("memory tier pool").pop();
        match recycled {
            Some(mut b) if b.len() == data.len() => {
                b.copy_from_slice(data);
                Arc::new(b)
            }
            _ => Arc::new(data.to_vec()),
        }
    }

    /// (keys looked up, lookup batches) since creation.
    pub fn lookup_counts(&self) -> (u64, u64) {
        (
            self.lookups.load(Ordering::Relaxed),
            self.lookup_batches.load(Ordering::Relaxed),
        )
    }

    /// Registers the type `"memory"` (no options) in `registry` (an error if it is there
    /// already).
    pub fn register(registry: &mut TierRegistry) -> Result<()> {
        registry.register(
            "memory",
            |spec: &TierSpec, ctx: &BuildContext| -> Result<std::sync::Arc<dyn SecondaryTier>> {
                let NoOptions {} = spec.parse_options()?;
                Ok(std::sync::Arc::new(MemoryTier::new(
                    ctx.name.clone(),
                    ctx.block_size,
                )))
            },
        )?;
        Ok(())
    }
}

/// The `memory` tier takes no options; any key is rejected by name.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoOptions {}

#[async_trait]
impl SecondaryTier for MemoryTier {
    fn info(&self) -> TierInfo {
        TierInfo::new(
            &self.name,
            Medium::Storage,
            Locality::Local,
            Capability::new(),
        )
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        self.lookups.fetch_add(keys.len() as u64, Ordering::Relaxed);
        self.lookup_batches.fetch_add(1, Ordering::Relaxed);
        let m = self.blocks.lock().expect("memory tier");
        Ok(keys.iter().map(|k| m.contains_key(k)).collect())
    }

    async fn store(&self, job: StoreJob) -> JobResult {
        let mut res = JobResult::default();
        let mut published = Vec::new();
        for (key, src) in job.blocks {
            if src.len() != self.block_size {
                res.failed.push((
                    key,
                    Error::WrongSize {
                        key,
                        got: src.len(),
                        expected: self.block_size,
                    },
                ));
                continue;
            }
            if self.contains(&key) {
                res.ok.push(key);
                continue;
            }
            let copy = self.buffer(src.as_slice());
            let mut m = self.blocks.lock().expect("memory tier");
            if let std::collections::hash_map::Entry::Vacant(e) = m.entry(key) {
                e.insert(copy);
                published.push(key);
            }
            res.ok.push(key);
        }
        self.events.push(published, false);
        res
    }

    async fn load(&self, job: LoadJob) -> JobResult {
        let mut res = JobResult::default();
        for (key, mut sink) in job.blocks {
            let data = self.blocks.lock().expect("memory tier").get(&key).cloned();
            let Some(data) = data else {
                res.failed.push((
                    key,
                    Error::NotFound {
                        key,
                        tier: self.name.clone(),
                    },
                ));
                continue;
            };
            if sink.len() != data.len() {
                res.failed.push((
                    key,
                    Error::WrongSize {
                        key,
                        got: sink.len(),
                        expected: data.len(),
                    },
                ));
                continue;
            }
            sink.as_mut_slice().copy_from_slice(&data);
            drop(sink);
            job.progress.landed(key);
            res.ok.push(key);
        }
        res
    }

    fn touch(&self, _keys: &[BlockKey]) {
        // Unbounded: recency is not tracked.
    }

    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.protection.protect(keys)
    }

    fn is_protected(&self, key: &BlockKey) -> bool {
        self.protection.contains(key)
    }

    fn take_events(&self) -> Vec<TierEvent> {
        self.events.take()
    }

    fn configure_events(&self, settings: kv_tier_core::EventSettings) {
        self.events.configure(settings);
    }

    fn events_dropped(&self) -> u64 {
        self.events.dropped()
    }

    async fn shutdown(&self) -> Result<()> {
        Ok(())
    }
}
