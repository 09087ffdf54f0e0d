//! Bounded capacity: an in-memory index of the block files (size and mtime), kept up to date
//! incrementally, mtime stamps for recency, and a sweep that deletes least-recently-used files
//! down to a low watermark.
//!
//! Recency is the file's mtime: a store sets it, `touch` queues a stamp (`utimensat`) at most
//! once per key per stamp interval, applied by the GC thread. So recency survives restarts and
//! is what `du`, `find` and external reapers see.
//!
//! The sweep decides from the index (no directory walk) and deletes oldest first. Whether a key
//! is protected or has a pending stamp is decided under the protection lock and the index lock;
//! a key decided for deletion leaves the index and is marked "being deleted" before those
//! locks drop, and a store (which protects its keys first) waits for such a key's unlink
//! before it checks for the file. So a store that protects a key during a sweep either keeps
//! it from being deleted or finds it gone and writes it again; a touch that lands after the
//! sweep chose its victims but before the decision on that key keeps it. Unlinks run in
//! batches on a few threads, holding no lock.

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use kv_tier_core::BlockKey;

mod stamps;
mod sweep;
mod walk;

use rustc_hash::FxHashMap;
pub(crate) use walk::{Found, parse_block, walk};

/// Where the sweep is, for test hooks that drive interleavings deterministically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SweepPoint {
    /// Victims are chosen; nothing is deleted yet.
    Selected,
    /// About to take the locks and decide on this key.
    BeforeDelete(BlockKey),
    /// A batch is decided (out of the index, marked as being deleted) and about to be unlinked.
    Unlinking,
}

/// A hook called by the sweep at each [`SweepPoint`] (it may block to hold the sweep there).
pub type SweepHook = Arc<dyn Fn(SweepPoint) + Send + Sync>;

#[derive(Debug, Clone)]
pub(crate) struct GcConfig {
    pub(crate) cap_bytes: u64,
    pub(crate) low_bytes: u64,
    pub(crate) interval: Duration,
    pub(crate) stamp_interval_ns: i64,
    pub(crate) grace_ns: i64,
    pub(crate) max_tracked: usize,
    pub(crate) rescan_interval: Option<Duration>,
    pub(crate) background: bool,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    size: u64,
    /// mtime, ns since the epoch.
    mtime: i64,
    /// When the last stamp was queued (ns), for the rate limit.
    last_stamp: i64,
    pending: bool,
}

#[derive(Default)]
struct Index {
    map: FxHashMap<BlockKey, Entry>,
    total: u64,
    pending: Vec<BlockKey>,
}

impl Index {
    fn insert(&mut self, key: BlockKey, size: u64, mtime: i64) {
        let old = self.map.insert(
            key,
            Entry {
                size,
                mtime,
                last_stamp: mtime,
                pending: false,
            },
        );
        self.total += size;
        if let Some(o) = old {
            self.total -= o.size;
        }
    }

    fn remove(&mut self, key: &BlockKey) -> Option<Entry> {
        let e = self.map.remove(key)?;
        self.total -= e.size;
        Some(e)
    }
}

#[derive(Default)]
pub(crate) struct GcCounters {
    pub(crate) sweeps: AtomicU64,
    pub(crate) swept_files: AtomicU64,
    pub(crate) swept_bytes: AtomicU64,
    pub(crate) skipped_in_flight: AtomicU64,
    pub(crate) skipped_in_grace: AtomicU64,
    pub(crate) skipped_recent: AtomicU64,
    pub(crate) stamps: AtomicU64,
    pub(crate) stamp_errors: AtomicU64,
    pub(crate) stamps_dropped: AtomicU64,
    pub(crate) errors: AtomicU64,
    pub(crate) rescans: AtomicU64,
    pub(crate) external_removals: AtomicU64,
    pub(crate) last_decision_us: AtomicU64,
    pub(crate) last_sweep_us: AtomicU64,
    pub(crate) adopt_ms: AtomicU64,
    pub(crate) sweeps_over_cap: AtomicU64,
}

#[derive(Default)]
struct Wake {
    stop: bool,
    kick: bool,
}

/// The GC state shared by the tier, its I/O threads and the GC thread.
pub(crate) struct Gc {
    pub(crate) cfg: GcConfig,
    index: Mutex<Index>,
    wake: Mutex<Wake>,
    cv: Condvar,
    pub(crate) counters: GcCounters,
    pub(crate) alive: AtomicBool,
    skew_ns: AtomicI64,
    hook: RwLock<Option<SweepHook>>,
    /// Whether checksums live in sidecar files, which go with their block.
    pub(crate) sidecars: AtomicBool,
    /// Keys a sweep decided to delete and is unlinking.
    deleting: Mutex<rustc_hash::FxHashSet<BlockKey>>,
    deleting_cv: Condvar,
}

pub(crate) fn to_ns(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i64,
        Err(e) => -(e.duration().as_nanos() as i64),
    }
}

fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}

impl Gc {
    pub(crate) fn new(cfg: GcConfig) -> Self {
        Self {
            cfg,
            index: Mutex::new(Index::default()),
            wake: Mutex::new(Wake::default()),
            cv: Condvar::new(),
            counters: GcCounters::default(),
            alive: AtomicBool::new(false),
            skew_ns: AtomicI64::new(0),
            hook: RwLock::new(None),
            sidecars: AtomicBool::new(false),
            deleting: Mutex::new(Default::default()),
            deleting_cv: Condvar::new(),
        }
    }

    /// The GC clock: wall time plus a skew that tests may advance.
    pub(crate) fn now_ns(&self) -> i64 {
        to_ns(SystemTime::now()) + self.skew_ns.load(Ordering::Relaxed)
    }

    pub(crate) fn advance_clock(&self, d: Duration) {
        self.skew_ns
            .fetch_add(d.as_nanos() as i64, Ordering::Relaxed);
    }

    pub(crate) fn set_hook(&self, h: Option<SweepHook>) {
        *self.hook.write().expect("sweep hook") = h;
    }

    fn hook(&self, p: SweepPoint) {
        let h = self.hook.read().expect("sweep hook").clone();
        if let Some(h) = h {
            h(p);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        self.index.lock().expect("gc index")
    }

    /// Adopts what a walk found (replacing the index).
    pub(crate) fn adopt(&self, found: Vec<Found>) -> Vec<BlockKey> {
        let mut idx = self.lock();
        let mut fresh = Index::default();
        fresh.map.reserve(found.len());
        for f in found {
            let pending = idx.map.get(&f.key).is_some_and(|e| e.pending);
            fresh.insert(f.key, f.size, f.mtime);
            if pending {
                // keep a queued stamp: the key was touched
                fresh.map.get_mut(&f.key).expect("just inserted").pending = true;
                fresh.pending.push(f.key);
            }
        }
        let gone: Vec<BlockKey> = idx
            .map
            .keys()
            .filter(|k| !fresh.map.contains_key(k))
            .copied()
            .collect();
        *idx = fresh;
        gone
    }

    /// Waits while a sweep is unlinking `key` (a store checks for the file only after it).
    pub(crate) fn wait_not_deleting(&self, key: &BlockKey) {
        let mut del = self.deleting.lock().expect("gc deleting");
        while del.contains(key) {
            del = self.deleting_cv.wait(del).expect("gc deleting");
        }
    }

    /// A file this tier published (mtime: now).
    pub(crate) fn on_published(&self, key: BlockKey, size: u64) {
        let now = self.now_ns();
        let over = {
            let mut idx = self.lock();
            idx.insert(key, size, now);
            idx.total > self.cfg.cap_bytes
        };
        if over {
            self.kick();
        }
    }

    /// A file was deleted (failed load) or found missing.
    pub(crate) fn on_removed(&self, key: &BlockKey) {
        self.lock().remove(key);
    }

    /// Queues mtime stamps: at most one per key per stamp interval, at most `max_tracked`
    /// pending. No I/O: the GC thread applies them.
    pub(crate) fn on_seen(&self, key: BlockKey, size: u64, mtime: i64) {
        let mut idx = self.lock();
        if !idx.map.contains_key(&key) {
            idx.insert(key, size, mtime);
        }
    }

    pub(crate) fn total_bytes(&self) -> u64 {
        self.lock().total
    }

    pub(crate) fn files(&self) -> usize {
        self.lock().map.len()
    }

    pub(crate) fn pending_stamps(&self) -> usize {
        self.lock().pending.len()
    }

    /// Applies the queued stamps (off the caller's thread: the GC thread runs this), on a few
    /// threads when there are many: each is a metadata update the kernel does at its pace.
    pub(crate) fn kick(&self) {
        if !self.cfg.background {
            return;
        }
        self.wake.lock().expect("gc wake").kick = true;
        self.cv.notify_one();
    }

    pub(crate) fn stop(&self) {
        self.wake.lock().expect("gc wake").stop = true;
        self.cv.notify_all();
    }

    /// Waits for the next tick (or a kick or stop). Returns (stop, kicked).
    pub(crate) fn wait(&self, tick: Duration) -> (bool, bool) {
        let w = self.wake.lock().expect("gc wake");
        let (mut w, _) = self
            .cv
            .wait_timeout_while(w, tick, |w| !w.stop && !w.kick)
            .expect("gc wake");
        let kicked = std::mem::take(&mut w.kick);
        (w.stop, kicked)
    }
}
