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

impl Locality {
    /// vLLM's name (`"LOCAL"`, `"REMOTE"`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Locality::Local => "LOCAL",
            Locality::Remote => "REMOTE",
        }
    }
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

/// How a tier reports its events, set by the manager from the tier's entry
/// (`enable_kv_events`, `locality`) and the config's `event_buffer_keys`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventSettings {
    /// Whether events are recorded at all (off: none is, nothing grows).
    pub enabled: bool,
    /// The locality events carry instead of the tier's own.
    pub locality: Option<Locality>,
    /// The most keys held until taken; past it the oldest are dropped, counted.
    pub max_keys: u64,
}

impl Default for EventSettings {
    /// Recorded, the tier's own locality, at most 1,000,000 keys held.
    fn default() -> Self {
        Self {
            enabled: true,
            locality: None,
            max_keys: 1_000_000,
        }
    }
}

/// A queue of events holding at most `max_keys` keys: past it the oldest keys go first
/// (whole events, or the oldest keys of the one event left), counted in
/// [`BoundedEvents::dropped`], so a consumer that never takes events costs bounded memory
/// and can tell that it lost some.
///
/// ```
/// use kv_tier_core::{BlockKey, BoundedEvents, Locality, Medium, TierEvent};
/// let k = |i: u8| BlockKey::from_hash32([i; 32], 0);
/// let mut q = BoundedEvents::new(3);
/// q.push(TierEvent::stored("fs", vec![k(1), k(2)], Medium::Storage, Locality::Local));
/// q.push(TierEvent::stored("fs", vec![k(3), k(4)], Medium::Storage, Locality::Local));
/// assert_eq!(q.dropped(), 1); // the oldest key went
/// q.push(TierEvent::stored("fs", vec![k(5)], Medium::Storage, Locality::Local));
/// assert_eq!(q.dropped(), 2); // then the rest of the oldest event
/// let ev = q.take();
/// assert_eq!(ev.len(), 2);
/// assert_eq!((ev[0].keys.clone(), ev[1].keys.clone()), (vec![k(3), k(4)], vec![k(5)]));
/// ```
#[derive(Debug)]
pub struct BoundedEvents {
    events: std::collections::VecDeque<TierEvent>,
    keys: u64,
    max_keys: u64,
    dropped: u64,
}

impl BoundedEvents {
    /// An empty queue holding at most `max_keys` keys (at least 1).
    pub fn new(max_keys: u64) -> Self {
        Self {
            events: std::collections::VecDeque::new(),
            keys: 0,
            max_keys: max_keys.max(1),
            dropped: 0,
        }
    }

    /// Changes the bound (dropping the oldest keys now if past it).
    pub fn set_max_keys(&mut self, max_keys: u64) {
        self.max_keys = max_keys.max(1);
        self.trim();
    }

    /// Appends an event (one with no keys is skipped), then drops the oldest keys past the
    /// bound.
    pub fn push(&mut self, ev: TierEvent) {
        if ev.keys.is_empty() {
            return;
        }
        self.keys += ev.keys.len() as u64;
        self.events.push_back(ev);
        self.trim();
    }

    /// Appends `key` to the newest event (the caller checked it is the one to extend).
    pub fn extend_last(&mut self, key: BlockKey) -> bool {
        match self.events.back_mut() {
            Some(last) => {
                last.keys.push(key);
                self.keys += 1;
                self.trim();
                true
            }
            None => false,
        }
    }

    fn trim(&mut self) {
        while self.keys > self.max_keys {
            let excess = self.keys - self.max_keys;
            let several = self.events.len() > 1;
            let Some(front) = self.events.front_mut() else {
                break;
            };
            let n = front.keys.len() as u64;
            if n <= excess && several {
                self.events.pop_front();
                self.keys -= n;
                self.dropped += n;
            } else {
                let cut = excess.min(n) as usize;
                front.keys.drain(..cut);
                self.keys -= cut as u64;
                self.dropped += cut as u64;
                if front.keys.is_empty() {
                    self.events.pop_front();
                }
            }
        }
    }

    /// Drops every event held, counting their keys as dropped.
    pub fn discard(&mut self) {
        self.dropped += self.keys;
        self.take();
    }

    /// Takes every event held, oldest first.
    pub fn take(&mut self) -> Vec<TierEvent> {
        self.keys = 0;
        std::mem::take(&mut self.events).into()
    }

    /// Whether no event is held.
    pub fn is_empty(&self) -> bool {
        self.events.is_empty()
    }

    /// Keys dropped so far because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped
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

#[derive(Debug)]
struct LogState {
    events: BoundedEvents,
    /// The [`EventBatch`] whose keys the last event gathers, while nothing else came after.
    open: Option<u64>,
    settings: EventSettings,
}

impl EventLog {
    /// An empty log for the tier `tier`.
    pub fn new(tier: impl Into<String>, medium: Medium, locality: Locality) -> Self {
        Self {
            tier: tier.into(),
            medium,
            locality,
            events: std::sync::Mutex::new(LogState {
                events: BoundedEvents::new(EventSettings::default().max_keys),
                open: None,
                settings: EventSettings::default(),
            }),
            next_batch: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Applies the manager's settings: off records nothing from now on (and drops what is
    /// held, counted as dropped), a locality overrides the tier's, `max_keys` bounds what is
    /// held.
    pub fn configure(&self, settings: EventSettings) {
        let mut st = self.lock();
        st.settings = settings;
        st.events.set_max_keys(settings.max_keys);
        if !settings.enabled {
            st.events.discard();
            st.open = None;
        }
    }

    /// Keys dropped because the log was full.
    pub fn dropped(&self) -> u64 {
        self.lock().events.dropped()
    }

    fn event(&self, locality: Option<Locality>, keys: Vec<BlockKey>, removed: bool) -> TierEvent {
        TierEvent {
            tier: self.tier.clone(),
            keys,
            medium: self.medium,
            locality: locality.unwrap_or(self.locality),
            removed,
        }
    }

    /// Appends a stored (`removed == false`) or removed event; empty key lists are skipped,
    /// and nothing is recorded while events are off.
    pub fn push(&self, keys: Vec<BlockKey>, removed: bool) {
        if keys.is_empty() {
            return;
        }
        let mut st = self.lock();
        if !st.settings.enabled {
            return;
        }
        let ev = self.event(st.settings.locality, keys, removed);
        st.events.push(ev);
        st.open = None;
    }

    /// Appends `key` to the last event if batch `batch` opened it and nothing came after,
    /// else opens a new event with it.
    fn push_in_batch(&self, batch: u64, key: BlockKey, removed: bool) {
        let mut st = self.lock();
        if !st.settings.enabled {
            return;
        }
        if st.open == Some(batch) && st.events.extend_last(key) {
            return;
        }
        let ev = self.event(st.settings.locality, vec![key], removed);
        st.events.push(ev);
        st.open = Some(batch);
    }

    /// Takes every event so far, oldest first.
    pub fn take(&self) -> Vec<TierEvent> {
        let mut st = self.lock();
        st.open = None;
        st.events.take()
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

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlockKey {
        BlockKey::from_hash32([i; 32], 0)
    }

    #[test]
    fn a_batch_under_the_bound_keeps_its_newest_keys_and_goes_on_in_one_event() {
        let log = std::sync::Arc::new(EventLog::new("fs", Medium::Storage, Locality::Local));
        log.configure(EventSettings {
            enabled: true,
            locality: Some(Locality::Remote),
            max_keys: 3,
        });
        let batch = EventBatch::new(log.clone(), false);
        for i in 0..5 {
            batch.add(k(i));
        }
        assert_eq!(log.dropped(), 2);
        let ev = log.take();
        assert_eq!(ev.len(), 1);
        assert_eq!(ev[0].keys, vec![k(2), k(3), k(4)]);
        assert_eq!(ev[0].locality, Locality::Remote, "the configured locality");
        // the batch goes on after a take: a new event
        batch.add(k(5));
        assert_eq!(log.take()[0].keys, vec![k(5)]);
    }

    #[test]
    fn turning_events_off_drops_what_is_held_counted_and_records_nothing_after() {
        let log = EventLog::new("fs", Medium::Storage, Locality::Local);
        log.push(vec![k(1), k(2)], false);
        log.configure(EventSettings {
            enabled: false,
            locality: None,
            max_keys: 10,
        });
        assert_eq!(log.dropped(), 2);
        log.push(vec![k(3)], true);
        assert!(log.take().is_empty());
        assert_eq!(log.dropped(), 2, "what is not recorded is not a loss");
    }
}
