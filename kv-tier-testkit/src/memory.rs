//! [`MemoryTier`]: the in-memory reference secondary tier. It passes the conformance suite,
//! drives the manager's tests, and documents the contract in the simplest possible code.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use bytes::Bytes;
use kv_tier_core::{
    BlockKey, BuildContext, Capability, Error, JobResult, Locality, LoadJob, Medium, ProtectGuard,
    ProtectionSet, Result, SecondaryTier, StoreJob, TierEvent, TierInfo, TierRegistry, TierSpec,
    async_trait,
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
    blocks: Mutex<FxHashMap<BlockKey, Bytes>>,
    protection: ProtectionSet,
    events: Mutex<Vec<TierEvent>>,
    lookups: AtomicU64,
    lookup_batches: AtomicU64,
}

impl MemoryTier {
    /// An empty tier for blocks of `block_size` bytes.
    pub fn new(name: impl Into<String>, block_size: usize) -> Self {
        Self {
            name: name.into(),
            block_size,
            blocks: Mutex::new(FxHashMap::default()),
            protection: ProtectionSet::new(),
            events: Mutex::new(Vec::new()),
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
        self.blocks.lock().expect("memory tier").get(key).cloned()
    }

    /// Removes `key` behind the tier's back (simulates an external delete).
    pub fn remove(&self, key: &BlockKey) -> bool {
        self.blocks.lock().expect("memory tier").remove(key).is_some()
    }

    /// (keys looked up, lookup batches) since creation.
    pub fn lookup_counts(&self) -> (u64, u64) {
        (
            self.lookups.load(Ordering::Relaxed),
            self.lookup_batches.load(Ordering::Relaxed),
        )
    }

    /// Registers the type `"memory"` (no options) in `registry`.
    pub fn register(registry: &mut TierRegistry) {
        registry.register(
            "memory",
            |spec: &TierSpec, ctx: &BuildContext| -> Result<std::sync::Arc<dyn SecondaryTier>> {
                let NoOptions {} = spec.parse_options()?;
                Ok(std::sync::Arc::new(MemoryTier::new(ctx.name.clone(), ctx.block_size)))
            },
        );
    }
}

/// The `memory` tier takes no options; any key is rejected by name.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoOptions {}

#[async_trait]
impl SecondaryTier for MemoryTier {
    fn info(&self) -> TierInfo {
        TierInfo {
            name: self.name.clone(),
            medium: Medium::Storage,
            locality: Locality::Local,
            capability: Capability::default(),
        }
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
            let copy = Bytes::copy_from_slice(src.as_slice());
            let mut m = self.blocks.lock().expect("memory tier");
            if let std::collections::hash_map::Entry::Vacant(e) = m.entry(key) {
                e.insert(copy);
                published.push(key);
            }
            res.ok.push(key);
        }
        if !published.is_empty() {
            self.events.lock().expect("memory tier events").push(TierEvent::stored(
                &self.name,
                published,
                Medium::Storage,
                Locality::Local,
            ));
        }
        res
    }

    async fn load(&self, job: LoadJob) -> JobResult {
        let mut res = JobResult::default();
        for (key, mut sink) in job.blocks {
            let Some(data) = self.get(&key) else {
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
        std::mem::take(&mut *self.events.lock().expect("memory tier events"))
    }

    async fn shutdown(&self) -> Result<()> {
        Ok(())
    }
}
