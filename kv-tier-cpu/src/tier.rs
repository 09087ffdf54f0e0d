//! [`CpuTier`]: the DRAM primary tier.

use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use kv_tier_core::{
    BlockKey, BlockSource, ChainLink, Error, EvictionPolicy, KvTierConfig, Locality, LookupResult,
    Medium, PreparedStore, PrimaryStats, PrimaryTier, Result, TierEvent,
};
use rustc_hash::{FxHashMap, FxHashSet};

use crate::policy::Order;
use crate::region::Region;

/// The name used in events and statistics.
pub const CPU_TIER_NAME: &str = kv_tier_core::tier::PRIMARY_TIER_NAME;

/// Settings of a [`CpuTier`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CpuTierConfig {
    /// Bytes of DRAM to use (`cpu_bytes_to_use`); the pool holds
    /// `capacity_bytes / slot_size` blocks, where the slot size is the block size rounded up
    /// to a page.
    pub capacity_bytes: u64,
    /// Bytes per block.
    pub block_size: usize,
    /// LRU or ARC.
    pub policy: EvictionPolicy,
    /// Fault every page in at construction (default), so the first copies run at memcpy speed.
    pub prefault: bool,
}

impl CpuTierConfig {
    /// The DRAM part of a manager config.
    pub fn from_config(cfg: &KvTierConfig) -> Self {
        Self {
            capacity_bytes: cfg.cpu_bytes_to_use,
            block_size: cfg.block_size_bytes as usize,
            policy: cfg.eviction_policy,
            prefault: true,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    Free,
    Writing(BlockKey),
    Ready(BlockKey),
}

struct State {
    map: FxHashMap<BlockKey, usize>,
    status: Vec<Status>,
    free: Vec<usize>,
    order: Order,
    events: kv_tier_core::BoundedEvents,
    ready: usize,
    writing: usize,
    evictions: u64,
    refused: u64,
}

/// The DRAM primary: one page-aligned, pre-faulted region cut into slots, with LRU, chain or
/// ARC eviction over unpinned blocks (see [`kv_tier_core::EvictionPolicy`]).
///
/// Slots reach I/O code as owned, `Send` handles ([`kv_tier_core::BlockSource`] to read,
/// [`kv_tier_core::BlockSink`] to write) that keep the slot pinned until dropped: a pinned
/// slot is never evicted or reused.
///
/// ```
/// use kv_tier_core::{BlockKey, LookupResult, PrimaryTier};
/// use kv_tier_cpu::{CpuTier, CpuTierConfig};
/// let tier = CpuTier::new(CpuTierConfig {
///     capacity_bytes: 4 * 4096, block_size: 4096,
///     policy: Default::default(), prefault: true,
/// })?;
/// let key = BlockKey::from_hash32([1; 32], 0);
/// let mut prepared = tier.prepare_store(&[key])?;
/// prepared.to_store[0].1.as_mut_slice().fill(7);
/// drop(prepared);
/// assert_eq!(tier.lookup(&key), LookupResult::HitPending);
/// tier.complete_store(&[key], true);
/// assert_eq!(tier.lookup(&key), LookupResult::Hit);
/// let views = tier.prepare_load(&[key])?; // pinned until dropped
/// assert!(views[0].as_slice().iter().all(|&b| b == 7));
/// # Ok::<(), kv_tier_core::Error>(())
/// ```
pub struct CpuTier {
    region: Arc<Region>,
    block_size: usize,
    n_slots: usize,
    state: Mutex<State>,
}

impl fmt::Debug for CpuTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CpuTier")
            .field("block_size", &self.block_size)
            .field("slots", &self.n_slots)
            .finish()
    }
}

impl CpuTier {
    /// Allocates (and by default pre-faults) the pool.
    pub fn new(cfg: CpuTierConfig) -> Result<Self> {
        if cfg.block_size == 0 {
            return Err(Error::config("block_size_bytes", "must be positive"));
        }
        let slot_size = cfg.block_size.div_ceil(kv_tier_core::PAGE_SIZE) * kv_tier_core::PAGE_SIZE;
        let n_slots = (cfg.capacity_bytes / slot_size as u64) as usize;
        if n_slots == 0 {
            return Err(Error::config(
                "cpu_bytes_to_use",
                format!(
                    "{} bytes hold no slot of {slot_size} bytes (block size {} rounded up to a page)",
                    cfg.capacity_bytes, cfg.block_size
                ),
            ));
        }
        if n_slots >= u32::MAX as usize {
            return Err(Error::config(
                "cpu_bytes_to_use",
                "too many slots (more than 2^32)",
            ));
        }
        let region = Arc::new(Region::new(n_slots, cfg.block_size, cfg.prefault)?);
        debug_assert_eq!(region.slot_size(), slot_size);
        tracing::debug!(n_slots, slot_size, policy = ?cfg.policy, "DRAM tier ready");
        Ok(Self {
            region,
            block_size: cfg.block_size,
            n_slots,
            state: Mutex::new(State {
                map: FxHashMap::with_capacity_and_hasher(n_slots, Default::default()),
                status: vec![Status::Free; n_slots],
                free: (0..n_slots).rev().collect(),
                order: Order::new(n_slots, cfg.policy),
                events: kv_tier_core::BoundedEvents::new(1_000_000),
                ready: 0,
                writing: 0,
                evictions: 0,
                refused: 0,
            }),
        })
    }

    /// The DRAM tier described by a manager config.
    pub fn from_config(cfg: &KvTierConfig) -> Result<Self> {
        cfg.validate()?;
        Self::new(CpuTierConfig::from_config(cfg))
    }

    /// Number of slots.
    pub fn capacity_blocks(&self) -> usize {
        self.n_slots
    }

    /// Pins readable blocks for the engine to copy DRAM -> GPU; the views pin their slots
    /// until dropped. Fails (pinning nothing) if a key is not readable.
    pub fn prepare_load(&self, keys: &[BlockKey]) -> Result<Vec<BlockSource>> {
        let st = self.lock();
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            match st.map.get(k).map(|&s| (s, st.status[s])) {
                Some((s, Status::Ready(_))) => out.push(self.region.source(s)),
                _ => {
                    return Err(Error::NotFound {
                        key: *k,
                        tier: CPU_TIER_NAME.into(),
                    });
                }
            }
        }
        Ok(out)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("cpu tier state")
    }

    fn event(st: &mut State, keys: Vec<BlockKey>, removed: bool) {
        if keys.is_empty() {
            return;
        }
        st.events.push(TierEvent {
            tier: CPU_TIER_NAME.into(),
            keys,
            medium: Medium::Cpu,
            locality: Locality::Local,
            removed,
        });
    }
}

impl PrimaryTier for CpuTier {
    fn block_size(&self) -> usize {
        self.block_size
    }

    fn lookup(&self, key: &BlockKey) -> LookupResult {
        let st = self.lock();
        match st.map.get(key).map(|&s| st.status[s]) {
            Some(Status::Ready(_)) => LookupResult::Hit,
            Some(Status::Writing(_)) => LookupResult::HitPending,
            _ => LookupResult::Miss,
        }
    }

    fn prepare_store(&self, keys: &[BlockKey]) -> Result<PreparedStore> {
        let mut st = self.lock();
        let st = &mut *st;
        let batch: FxHashSet<BlockKey> = keys.iter().copied().collect();
        let mut seen = FxHashSet::default();
        let mut new = Vec::new();
        let mut present = Vec::new();
        for k in keys {
            if !seen.insert(*k) {
                continue;
            }
            if st.map.contains_key(k) {
                present.push(*k);
            } else {
                new.push(*k);
            }
        }
        // Free slots still pinned by a stale handle are not usable yet.
        let usable_free = st
            .free
            .iter()
            .filter(|&&s| self.region.pins(s) == 0)
            .count();
        let need = new.len().saturating_sub(usable_free);
        let region = &self.region;
        let (status, map) = (&st.status, &st.map);
        let victims = st.order.take_victims(
            need,
            |k| map[k],
            |s| match status[s] {
                Status::Ready(k) if region.pins(s) == 0 && !batch.contains(&k) => Some(k),
                _ => None,
            },
        );
        let Some(victims) = victims else {
            st.refused += 1;
            let evictable = usable_free
                + (0..self.n_slots)
                    .filter(|&s| matches!(status[s], Status::Ready(k) if region.pins(s) == 0 && !batch.contains(&k)))
                    .count();
            return Err(Error::CapacityExhausted {
                needed: new.len(),
                evictable,
                capacity: self.n_slots,
            });
        };
        let mut evicted = Vec::with_capacity(victims.len());
        for s in victims {
            if let Status::Ready(k) = st.status[s] {
                st.map.remove(&k);
                st.status[s] = Status::Free;
                st.free.push(s);
                st.ready -= 1;
                st.evictions += 1;
                evicted.push(k);
            }
        }
        Self::event(st, evicted.clone(), true);
        let mut to_store = Vec::with_capacity(new.len());
        for k in new {
            let pos = st
                .free
                .iter()
                .rposition(|&s| self.region.pins(s) == 0)
                .expect("room was made above");
            let s = st.free.swap_remove(pos);
            st.status[s] = Status::Writing(k);
            st.map.insert(k, s);
            st.writing += 1;
            to_store.push((k, self.region.sink(s)));
        }
        Ok(PreparedStore {
            to_store,
            present,
            evicted,
        })
    }

    fn complete_store(&self, keys: &[BlockKey], success: bool) -> Vec<BlockKey> {
        let mut st = self.lock();
        let st = &mut *st;
        let mut done = Vec::new();
        for k in keys {
            let Some(&s) = st.map.get(k) else { continue };
            if st.status[s] != Status::Writing(*k) {
                continue;
            }
            st.writing -= 1;
            let ok = success
                && {
                    let alive = self.region.writer_alive(s);
                    if alive {
                        tracing::error!(key = %k, "complete_store while the block's sink is still alive; dropping the block");
                    }
                    !alive
                };
            if ok {
                st.status[s] = Status::Ready(*k);
                st.order.insert(s, k);
                st.ready += 1;
                done.push(*k);
            } else {
                st.status[s] = Status::Free;
                st.map.remove(k);
                st.free.push(s);
            }
        }
        Self::event(st, done.clone(), false);
        done
    }

    fn sources(&self, keys: &[BlockKey]) -> Vec<Option<BlockSource>> {
        let st = self.lock();
        keys.iter()
            .map(|k| match st.map.get(k).map(|&s| (s, st.status[s])) {
                Some((s, Status::Ready(_))) => Some(self.region.source(s)),
                _ => None,
            })
            .collect()
    }

    fn touch(&self, keys: &[BlockKey]) {
        let mut st = self.lock();
        let st = &mut *st;
        // In reverse, so the first key (the shortest prefix, the most shared) ends most recent.
        for k in keys.iter().rev() {
            if let Some(&s) = st.map.get(k)
                && matches!(st.status[s], Status::Ready(_))
            {
                st.order.touch(s, k);
            }
        }
    }

    fn link(&self, links: &[(BlockKey, ChainLink)]) {
        let mut st = self.lock();
        let st = &mut *st;
        for (k, l) in links {
            if let Some(&s) = st.map.get(k)
                && matches!(st.status[s], Status::Ready(_))
            {
                st.order.link(k, l.parent, l.depth);
            }
        }
    }

    fn take_events(&self) -> Vec<TierEvent> {
        self.lock().events.take()
    }

    fn bound_events(&self, max_keys: u64) {
        self.lock().events.set_max_keys(max_keys);
    }

    fn events_dropped(&self) -> u64 {
        self.lock().events.dropped()
    }

    fn reset(&self) -> usize {
        let mut st = self.lock();
        let st = &mut *st;
        let mut removed = Vec::new();
        let mut kept = 0;
        for s in 0..self.n_slots {
            if let Status::Ready(k) = st.status[s] {
                if self.region.pins(s) == 0 {
                    st.order.remove(s, &k);
                    st.map.remove(&k);
                    st.status[s] = Status::Free;
                    st.free.push(s);
                    st.ready -= 1;
                    removed.push(k);
                } else {
                    kept += 1;
                }
            }
        }
        if kept == 0 {
            st.order.clear();
        }
        Self::event(st, removed, true);
        kept
    }

    fn stats(&self) -> PrimaryStats {
        let st = self.lock();
        PrimaryStats {
            capacity_blocks: self.n_slots,
            ready_blocks: st.ready,
            writing_blocks: st.writing,
            evictions: st.evictions,
            refused_stores: st.refused,
        }
    }
}
