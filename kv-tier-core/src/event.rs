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
    events: std::sync::Mutex<Vec<TierEvent>>,
}

impl EventLog {
    /// An empty log for the tier `tier`.
    pub fn new(tier: impl Into<String>, medium: Medium, locality: Locality) -> Self {
        Self {
            tier: tier.into(),
            medium,
            locality,
            events: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Appends a stored (`removed == false`) or removed event; empty key lists are skipped.
    pub fn push(&self, keys: Vec<BlockKey>, removed: bool) {
        if keys.is_empty() {
            return;
        }
        let ev = TierEvent {
            tier: self.tier.clone(),
            keys,
            medium: self.medium,
            locality: self.locality,
            removed,
        };
        self.lock().push(ev);
    }

    /// Takes every event so far, oldest first.
    pub fn take(&self) -> Vec<TierEvent> {
        std::mem::take(&mut *self.lock())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<TierEvent>> {
        self.events.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The keys of one event, gathered while a call runs and pushed to the log when the batch
/// drops: when the call ends, and also when it is cancelled, so what was done before the
/// cancellation is still reported.
///
/// ```
/// use std::sync::Arc;
/// use kv_tier_core::{BlockKey, EventBatch, EventLog, Locality, Medium};
/// let log = Arc::new(EventLog::new("fs", Medium::Storage, Locality::Local));
/// let batch = EventBatch::new(log.clone(), false);
/// batch.add(BlockKey::from_hash32([1; 32], 0));
/// assert!(log.take().is_empty());
/// drop(batch); // e.g. the store future was dropped mid-way
/// assert_eq!(log.take()[0].keys.len(), 1);
/// ```
#[derive(Debug)]
pub struct EventBatch {
    log: std::sync::Arc<EventLog>,
    removed: bool,
    keys: std::sync::Mutex<Vec<BlockKey>>,
}

impl EventBatch {
    /// An empty batch of stored (`removed == false`) or removed keys for `log`.
    pub fn new(log: std::sync::Arc<EventLog>, removed: bool) -> Self {
        Self {
            log,
            removed,
            keys: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Adds a key.
    pub fn add(&self, key: BlockKey) {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(key);
    }
}

impl Drop for EventBatch {
    fn drop(&mut self) {
        let keys = std::mem::take(&mut *self.keys.lock().unwrap_or_else(|p| p.into_inner()));
        self.log.push(keys, self.removed);
    }
}
