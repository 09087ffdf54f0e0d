//! Events that tell consumers (a KV-events publisher, a router) where blocks are.

use std::fmt;

use crate::key::BlockKey;

/// Where a tier keeps its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Host DRAM (the primary tier).
    Cpu,
    /// Persistent storage: local files or object storage.
    Storage,
}

impl Medium {
    /// The name used in event streams (`"CPU"`, `"STORAGE"`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
        }
    }
}

impl fmt::Display for Medium {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a tier is private to this host or shared over a network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Locality {
    /// On this host (DRAM, local NVMe).
    Local,
    /// Reached over the network, possibly shared by many hosts (object storage).
    Remote,
}

/// Blocks were stored in (`removed == false`) or removed from (`removed == true`) a tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierEvent {
    /// The tier's name.
    pub tier: String,
    /// The blocks concerned, in the order they were handled.
    pub keys: Vec<BlockKey>,
    /// The tier's medium.
    pub medium: Medium,
    /// The tier's locality.
    pub locality: Locality,
    /// `true` for removals (evictions, deletions), `false` for stores.
    pub removed: bool,
}

impl TierEvent {
    /// A `BlockStored` event.
    pub fn stored(tier: &str, keys: Vec<BlockKey>, medium: Medium, locality: Locality) -> Self {
        Self {
            tier: tier.to_string(),
            keys,
            medium,
            locality,
            removed: false,
        }
    }

    /// A `BlockRemoved` event.
    pub fn removed(tier: &str, keys: Vec<BlockKey>, medium: Medium, locality: Locality) -> Self {
        Self {
            tier: tier.to_string(),
            keys,
            medium,
            locality,
            removed: true,
        }
    }
}

/// The event queue a tier keeps for [`crate::SecondaryTier::take_events`]: one tier name,
/// medium and locality, events appended in order, taken all at once.
///
/// ```
/// use kv_tier_core::{BlockKey, EventLog, Locality, Medium};
/// let log = EventLog::new("fs", Medium::Storage, Locality::Local);
/// log.push(vec![BlockKey::from_hash32([1; 32], 0)], false);
/// log.push(vec![], true); // nothing to say: no event
/// let ev = log.take();
/// assert_eq!(ev.len(), 1);
/// assert!(!ev[0].removed && ev[0].tier == "fs");
/// assert!(log.take().is_empty());
/// ```
#[derive(Debug)]
pub struct EventLog {
    tier: String,
    medium: Medium,
    locality: Locality,
    events: std::sync::Mutex<LogState>,
    next_batch: std::sync::atomic::AtomicU64,
}

#[derive(Debug, Default)]
struct LogState {
    events: Vec<TierEvent>,
    /// The [`EventBatch`] whose keys the last event gathers, while nothing else came after.
    open: Option<u64>,
}

impl EventLog {
    /// An empty log for the tier `tier`.
    pub fn new(tier: impl Into<String>, medium: Medium, locality: Locality) -> Self {
        Self {
            tier: tier.into(),
            medium,
            locality,
            events: std::sync::Mutex::new(LogState::default()),
            next_batch: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn event(&self, keys: Vec<BlockKey>, removed: bool) -> TierEvent {
        TierEvent {
            tier: self.tier.clone(),
            keys,
            medium: self.medium,
            locality: self.locality,
            removed,
        }
    }

    /// Appends a stored (`removed == false`) or removed event; empty key lists are skipped.
    pub fn push(&self, keys: Vec<BlockKey>, removed: bool) {
        if keys.is_empty() {
            return;
        }
        let ev = self.event(keys, removed);
        let mut st = self.lock();
        st.events.push(ev);
        st.open = None;
    }

    /// Appends `key` to the last event if batch `batch` opened it and nothing came after,
    /// else opens a new event with it.
    fn push_in_batch(&self, batch: u64, key: BlockKey, removed: bool) {
        let mut st = self.lock();
        if st.open == Some(batch)
            && let Some(last) = st.events.last_mut()
        {
            last.keys.push(key);
            return;
        }
        let ev = self.event(vec![key], removed);
        st.events.push(ev);
        st.open = Some(batch);
    }

    /// Takes every event so far, oldest first.
    pub fn take(&self) -> Vec<TierEvent> {
        let mut st = self.lock();
        st.open = None;
        std::mem::take(&mut st.events)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LogState> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The keys of one event, gathered while a call runs: each key is in the log as soon as it
/// is added (so the log keeps the order things happened in, a removal of a key between two
/// of a job's stores included, and a call that is cancelled has reported what it did), in one
/// event with the batch's other keys as long as nothing else was logged between them.
///
/// ```
/// use std::sync::Arc;
/// use kv_tier_core::{BlockKey, EventBatch, EventLog, Locality, Medium};
/// let log = Arc::new(EventLog::new("fs", Medium::Storage, Locality::Local));
/// let (a, b, c) = (
///     BlockKey::from_hash32([1; 32], 0),
///     BlockKey::from_hash32([2; 32], 0),
///     BlockKey::from_hash32([3; 32], 0),
/// );
/// let batch = EventBatch::new(log.clone(), false);
/// batch.add(a);
/// batch.add(b);
/// log.push(vec![a], true); // a removal in between: it comes after a's store
/// batch.add(c);
/// drop(batch); // e.g. the store future was dropped: what it did is reported already
/// let ev = log.take();
/// assert_eq!(ev.len(), 3);
/// assert_eq!((ev[0].keys.clone(), ev[0].removed), (vec![a, b], false));
/// assert_eq!((ev[1].keys.clone(), ev[1].removed), (vec![a], true));
/// assert_eq!((ev[2].keys.clone(), ev[2].removed), (vec![c], false));
/// ```
#[derive(Debug)]
pub struct EventBatch {
    log: std::sync::Arc<EventLog>,
    removed: bool,
    id: u64,
}

impl EventBatch {
    /// A batch of stored (`removed == false`) or removed keys for `log`.
    pub fn new(log: std::sync::Arc<EventLog>, removed: bool) -> Self {
        let id = log
            .next_batch
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Self { log, removed, id }
    }

    /// Adds a key (to the log, now).
    pub fn add(&self, key: BlockKey) {
        self.log.push_in_batch(self.id, key, self.removed);
    }
}
