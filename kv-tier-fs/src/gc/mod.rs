//! Bounded capacity: an in-memory index of what the tier holds on disk (the allocated bytes of
//! its block files, their sidecars and the directories they keep alive, plus what stores in
//! flight have reserved), kept up to date incrementally; mtime stamps for recency; and a sweep
//! that deletes least-recently-used files down to a low watermark.
//!
//! Recency is the file's mtime: a store sets it, `touch` queues a stamp (`utimensat`) at most
//! once per key per stamp interval (a file stored or touched within the interval is not
//! stamped again), applied by the GC thread with the touch's time, which the index holds from
//! the touch on (`touch` itself only appends its keys; whoever takes the index next applies
//! them, see `stamps::Touched`). So recency
//! survives restarts and is what `du`, `find`, external reapers and other kv-tier processes
//! on the same root see.
//!
//! The cap is a bound, not a wish. A sweep over the cap spares files used within the grace
//! window, unless the total is past halfway from the cap to the hard ceiling
//! (`gc_hard_ceiling x cap`): then those go too, oldest first, until the total is back at the
//! cap. A store that would cross the ceiling first makes room (a sweep that ignores the grace
//! window) or waits for one, failing with `NoSpace` if none can be made; `ENOSPC` from the
//! filesystem triggers such a sweep and one retry. Protected keys are never swept.
//!
//! The sweep decides from the index (no directory walk) and deletes oldest first. Whether a key
//! is protected or has a pending stamp is decided under the protection lock and the index lock;
//! a key decided for deletion leaves the index and is marked "being deleted" before those
//! locks drop, and a store (which protects its keys first) waits for such a key's unlink
//! before it checks for the file. Right before each unlink the protection is checked again,
//! atomically with marking the key "unlinking"; `protect()` waits for the (one) unlink of a key
//! so marked. So once `protect()` has returned, the key's file is not deleted while the guard
//! lives. Unlinks run in batches on a few threads, holding no lock.

use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use kv_tier_core::{BlockKey, EventLog, Namespace, ProtectionSet};
use rustc_hash::FxHashSet;

use crate::stats::GcCounters;

mod checkpoint;
mod index;
mod remote;
mod rescan;
mod stamps;
mod sweep;
mod thread;
mod walk;

pub(crate) use checkpoint::path as checkpoint_path;
use index::Index;
pub(crate) use stamps::stamp;
pub(crate) use sweep::Goal;
pub(crate) use thread::spawn;
pub(crate) use walk::{Found, walk};

/// Where the GC is, for test hooks that drive interleavings deterministically.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum SweepPoint {
    /// Victims are chosen; nothing is deleted yet.
    Selected,
    /// About to take the locks and decide on this key.
    BeforeDelete(BlockKey),
    /// A batch is decided (out of the index, marked as being deleted) and about to be unlinked.
    Unlinking,
    /// This key's unlink is under way (checked unprotected and marked; the file is not yet
    /// removed): `protect()` of it waits until the unlink ends.
    UnlinkingKey(BlockKey),
    /// A rescan has walked the tree and is about to merge what it found into the index.
    RescanWalked,
    /// Queued stamps are applied on disk and about to be applied to the index.
    StampsDone,
    /// The GC thread woke for a tick (outside the step that catches panics).
    Tick,
}

/// A hook called by the sweep at each [`SweepPoint`] (it may block to hold the sweep there).
pub type SweepHook = Arc<dyn Fn(SweepPoint) + Send + Sync>;

#[derive(Debug, Clone)]
pub(crate) struct GcConfig {
    pub(crate) cap_bytes: u64,
    pub(crate) low_bytes: u64,
    /// A store never takes the total above this: it makes room first (see `Goal`).
    pub(crate) hard_bytes: u64,
    pub(crate) interval: Duration,
    pub(crate) stamp_interval_ns: i64,
    pub(crate) grace_ns: i64,
    pub(crate) max_tracked: usize,
    pub(crate) rescan_interval: Option<Duration>,
    /// How often the index is checkpointed (`None`: never, and none is read).
    pub(crate) checkpoint_interval: Option<Duration>,
    pub(crate) background: bool,
    /// Temp files and orphan sidecars older than this are reaped by walks.
    pub(crate) tmp_age: Duration,
}

/// What the GC works on, shared with the tier: where the blocks are, which keys jobs and
/// probes protect, and where removals are reported.
pub(crate) struct Place {
    /// The tier's name, for logs.
    pub(crate) name: String,
    pub(crate) root: PathBuf,
    pub(crate) ns: Namespace,
    pub(crate) protection: ProtectionSet,
    pub(crate) events: Arc<EventLog>,
}

impl Place {
    pub(crate) fn rank_dir(&self) -> PathBuf {
        self.root.join(self.ns.rank_dir_name())
    }
}

#[derive(Default)]
struct Wake {
    stop: bool,
    kick: bool,
}

/// The GC state shared by the tier, its I/O threads and the GC thread.
pub(crate) struct Gc {
    pub(crate) cfg: GcConfig,
    pub(crate) at: Place,
    index: Mutex<Index>,
    /// Touches for the index's next holder to apply (taken after `index`, never before).
    touched: Mutex<stamps::Touched>,
    /// Whether `touched` holds any (the index's holders look at it only then).
    touched_any: AtomicBool,
    wake: Mutex<Wake>,
    cv: Condvar,
    pub(crate) counters: GcCounters,
    pub(crate) alive: AtomicBool,
    skew_ns: AtomicI64,
    /// Where the clock stands still ([`RUNNING`]: it follows the wall clock).
    frozen_ns: AtomicI64,
    hook: RwLock<Option<SweepHook>>,
    /// Allocated bytes of a checksum sidecar (0 when checksums are not in sidecars).
    sidecar_unit: AtomicU64,
    /// Woken (with the index lock) when keys a sweep took out to delete leave the index's
    /// deleting set: stores wait for them.
    deleting_cv: Condvar,
    /// How many keys the index's deleting set holds: a store or probe looks at the index
    /// (and waits on its lock) only when some are.
    deleting_now: AtomicUsize,
    /// Keys whose unlink is under way right now (`protect()` waits for them).
    unlinking: Mutex<FxHashSet<BlockKey>>,
    unlinking_cv: Condvar,
    /// One sweep at a time.
    sweeping: Mutex<()>,
    /// Woken when bytes are freed: stores waiting for room under the hard ceiling.
    room_cv: Condvar,
    /// Whether this process sweeps (and rescans): always, except on a shared root where only
    /// the leader does.
    may_sweep: AtomicBool,
    /// Shared root (leader): when each key was last read by any instance; a sweep never takes
    /// a key read within two stamp intervals (pruned past that).
    recent_reads: Mutex<rustc_hash::FxHashMap<BlockKey, i64>>,
    /// Shared root (leader): keys announced for a store whose job has not ended, with how
    /// many announcements of each are open. A sweep keeps them, file or not (a store under
    /// way may find the path empty and publish), and a rescan that finds one missing keeps
    /// it.
    announced: Mutex<rustc_hash::FxHashMap<BlockKey, u32>>,
    /// Where the index is checkpointed (`None`: it is not), and what it held when last
    /// written (held while writing: one writer at a time).
    checkpoint: Option<PathBuf>,
    written: Mutex<Option<checkpoint::Mark>>,
    /// False from an open that read a checkpoint until a walk has reconciled the index with
    /// the disk: until then a key the index lacks may still be on disk.
    reconciled: AtomicBool,
    /// When the tier opened: the walk that reconciles a checkpointed index reaps the temp
    /// files that were `tmp_age` old then (none of this run's), as the opening walk would.
    opened: SystemTime,
}

pub(crate) fn to_ns(t: SystemTime) -> i64 {
    match t.duration_since(SystemTime::UNIX_EPOCH) {
        Ok(d) => d.as_nanos().min(i64::MAX as u128) as i64,
        Err(e) => -(e.duration().as_nanos().min(i64::MAX as u128) as i64),
    }
}

/// A file's mtime in ns since the epoch, saturating (a file stamped in the year 2318 or
/// 1600 is just very new or very old).
fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    m.mtime()
        .saturating_mul(1_000_000_000)
        .saturating_add(m.mtime_nsec())
}

/// Allocated bytes of a file (`st_blocks` x 512).
pub(crate) fn allocated(m: &std::fs::Metadata) -> u64 {
    m.blocks() * 512
}

impl Gc {
    /// `dir_unit`: allocated bytes of one directory on this filesystem; `base_bytes`: what
    /// exists whatever is stored (pre-created top directories), with `count_tops` false then.
    pub(crate) fn new(
        cfg: GcConfig,
        at: Place,
        dir_unit: u64,
        base_bytes: u64,
        count_tops: bool,
    ) -> Self {
        Self {
            cfg,
            at,
            index: Mutex::new(Index::new(dir_unit, base_bytes, count_tops)),
            touched: Mutex::default(),
            touched_any: AtomicBool::new(false),
            wake: Mutex::new(Wake::default()),
            cv: Condvar::new(),
            counters: GcCounters::default(),
            alive: AtomicBool::new(false),
            skew_ns: AtomicI64::new(0),
            frozen_ns: AtomicI64::new(RUNNING),
            hook: RwLock::new(None),
            sidecar_unit: AtomicU64::new(0),
            deleting_cv: Condvar::new(),
            deleting_now: AtomicUsize::new(0),
            unlinking: Mutex::new(FxHashSet::default()),
            unlinking_cv: Condvar::new(),
            sweeping: Mutex::new(()),
            room_cv: Condvar::new(),
            may_sweep: AtomicBool::new(true),
            recent_reads: Mutex::new(Default::default()),
            announced: Mutex::new(Default::default()),
            checkpoint: None,
            written: Mutex::new(None),
            reconciled: AtomicBool::new(true),
            opened: SystemTime::now(),
        }
    }

    /// Whether this process sweeps and rescans (see `may_sweep`).
    pub(crate) fn set_may_sweep(&self, on: bool) {
        self.may_sweep.store(on, Ordering::SeqCst);
    }

    pub(crate) fn may_sweep(&self) -> bool {
        self.may_sweep.load(Ordering::SeqCst)
    }

    /// Checksums live in sidecars of `unit` allocated bytes each (counted with their block).
    pub(crate) fn set_sidecar_unit(&self, unit: u64) {
        self.sidecar_unit.store(unit, Ordering::Relaxed);
    }

    /// The GC clock: wall time (or the time it was frozen at) plus a skew that tests may
    /// advance.
    pub(crate) fn now_ns(&self) -> i64 {
        let frozen = self.frozen_ns.load(Ordering::Relaxed);
        let base = if frozen == RUNNING {
            to_ns(SystemTime::now())
        } else {
            frozen
        };
        base + self.skew_ns.load(Ordering::Relaxed)
    }

    /// The GC clock's time while it is frozen (a test's or a simulator's clock), else `None`.
    /// A store then gives its file that mtime, as a stamp does, so what a reopen reads from
    /// the disk is the recency the index held (not the wall time the file was written at).
    pub(crate) fn frozen_now_ns(&self) -> Option<i64> {
        (self.frozen_ns.load(Ordering::Relaxed) != RUNNING).then(|| self.now_ns())
    }

    /// Stops the clock at the current wall time: from then on only
    /// [`advance_clock`](Self::advance_clock) moves it.
    pub(crate) fn freeze_clock(&self) {
        let _ = self.frozen_ns.compare_exchange(
            RUNNING,
            to_ns(SystemTime::now()),
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
    }

    pub(crate) fn advance_clock(&self, d: Duration) {
        self.skew_ns
            .fetch_add(d.as_nanos() as i64, Ordering::Relaxed);
    }

    pub(crate) fn set_hook(&self, h: Option<SweepHook>) {
        *self.hook.write().unwrap_or_else(|p| p.into_inner()) = h;
    }

    pub(crate) fn hook(&self, p: SweepPoint) {
        let h = self.hook.read().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(h) = h {
            h(p);
        }
    }

    /// Whether `key`, whose file was found missing when its entry had `seq`, is gone for
    /// the index: not (re)inserted since, and no shared root's store of it under way (taken
    /// under the index lock, as the sweep takes it: announcements come before the entries
    /// they make).
    fn found_gone(&self, idx: &Index, key: &BlockKey, seq: u64) -> bool {
        idx.lru.get(key).is_some_and(|e| e.seq() == seq) && !self.announced(key)
    }

    /// The index, with every `touch` made before this applied to it.
    fn lock(&self) -> std::sync::MutexGuard<'_, Index> {
        let mut idx = self.lock_unstamped();
        self.apply_touched(&mut idx);
        idx
    }

    /// The index, touches waiting or not: for a question no touch changes the answer to
    /// (which keys it holds), asked on the engine's thread, which then does not apply
    /// them.
    fn lock_unstamped(&self) -> std::sync::MutexGuard<'_, Index> {
        // every critical section leaves the index consistent before anything can panic
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Forgets keys whose files were verified absent, unless they were (re)inserted since
    /// or a shared root's store of them is under way (announced: its file may not be there
    /// yet, and once published it must be counted), and reports them removed
    /// (`BlockRemoved`). Returns those forgotten. Every removal of a key found gone goes
    /// through here (see [`Gc::found_gone`]).
    pub(crate) fn forget(&self, keys: &[(BlockKey, u64)]) -> Vec<BlockKey> {
        let mut idx = self.lock();
        let mut out = Vec::new();
        for (k, seq) in keys {
            if self.found_gone(&idx, k, *seq) {
                idx.remove(k);
                out.push(*k);
            }
        }
        // Reported before the index lock drops: a store that publishes one of these keys
        // again indexes it after this, so its `BlockStored` comes after this removal.
        self.at.events.push(out.clone(), true);
        drop(idx);
        if !out.is_empty() {
            self.freed();
        }
        out
    }

    /// A damaged file of `key` was removed (by a load or a store; `seq`: its index entry's
    /// before the removal; `replaced`: a file is at the path again): reported removed once,
    /// under the index lock. A sweep's victim (marked deleting) is reported by that sweep,
    /// which finds it gone; an entry a store indexed since (another `seq`, or a file there
    /// again) is that store's own file and stays, its `BlockStored` the key's last event.
    pub(crate) fn removed_damaged(&self, key: &BlockKey, seq: Option<u64>, replaced: bool) {
        let mut idx = self.lock();
        if idx.lru.is_deleting(key) {
            return;
        }
        match (idx.lru.get(key).map(|e| e.seq()), seq) {
            (Some(now), Some(before)) if now != before => return,
            (Some(_), None) if replaced => return,
            (Some(_), _) => {
                idx.remove(key);
            }
            // its entry left the index since: whoever took it out (a load or a rescan that
            // found the file gone after this removal) reported it
            (None, Some(_)) => return,
            (None, None) => {}
        }
        self.at.events.push(vec![*key], true);
        drop(idx);
        self.freed();
    }

    fn kick_if_over(&self) {
        if self.over_cap() {
            self.kick();
        }
    }

    /// Whether a sweep is running now (a sweep that panicked poisons the lock and is over).
    pub(crate) fn sweep_running(&self) -> bool {
        matches!(
            self.sweeping.try_lock(),
            Err(std::sync::TryLockError::WouldBlock)
        )
    }

    /// Waits while `key` is marked deleting: from a sweep's decision on it to the end of that
    /// sweep's batch (a store checks for the file only after it). The caller protects `key`
    /// first, so a sweep that decides after this call returns skips it; with nothing marked
    /// (the common case) it returns without taking the index lock.
    pub(crate) fn wait_not_deleting(&self, key: &BlockKey) {
        if self.deleting_now.load(Ordering::SeqCst) == 0 {
            return;
        }
        let mut idx = self.lock();
        while idx.lru.is_deleting(key) {
            idx = self
                .deleting_cv
                .wait(idx)
                .unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Waits while any of `keys` is being unlinked right now (at most one unlink each): after
    /// `protect()` returns, no unlink of its keys is under way or can start.
    pub(crate) fn wait_not_unlinking(&self, keys: &[BlockKey]) {
        let mut u = self.unlinking.lock().unwrap_or_else(|p| p.into_inner());
        while !u.is_empty() && keys.iter().any(|k| u.contains(k)) {
            u = self.unlinking_cv.wait(u).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Allocated bytes of a block file this tier writes (`alloc_block`) with its sidecar.
    pub(crate) fn file_bytes(&self, alloc_block: u64) -> u64 {
        alloc_block + self.sidecar_unit.load(Ordering::Relaxed)
    }

    /// Reserves room for one new block file of `key` (its bytes, any directory it creates,
    /// and what its entry may add to a well-filled leaf directory) under the hard ceiling;
    /// `None` when it does not fit now.
    /// Returns the reservation's number, and whether it holds room for the leaf directory's
    /// growth (then the leaf is measured before the reservation is given up).
    pub(crate) fn try_reserve(&self, key: &BlockKey, file_bytes: u64) -> Option<(u64, bool)> {
        let mut idx = self.lock();
        let slack = idx.growth_slack(key);
        idx.reserve_for(*key, file_bytes + slack, self.cfg.hard_bytes)
            .map(|n| (n, slack > 0))
    }

    /// Ends reservation `n` of `key` (if a file of the key has not taken it over).
    pub(crate) fn unreserve(&self, key: &BlockKey, n: u64) {
        self.lock().release(key, n);
    }

    /// Waits (at most `d`) for bytes to be freed.
    pub(crate) fn wait_for_room(&self, d: Duration) -> bool {
        let idx = self.lock();
        match self.room_cv.wait_timeout(idx, d) {
            Ok((_, t)) => !t.timed_out(),
            Err(p) => !p.into_inner().1.timed_out(),
        }
    }

    fn freed(&self) {
        self.room_cv.notify_all();
    }

    /// A file this tier published (mtime: now), replacing the reservation made for it (unless
    /// a file of the key indexed first took it over), with `leaf_bytes`, its leaf directory's
    /// size measured after the publish, when the reservation held room for the leaf's growth:
    /// the growth is counted in the same step as that room is given up, so no other store can
    /// take the room meanwhile. Returns whether the leaf directory is due for a measurement
    /// ([`Gc::set_leaf_bytes`]) still: directories grow with their entries, and a leaf of
    /// [`index::LEAF_GROWS_FROM`] files or more is measured after every store. The block is
    /// added to `stored` (`BlockStored`) under the index lock.
    pub(crate) fn on_published(
        &self,
        key: BlockKey,
        file_bytes: u64,
        reservation: Option<u64>,
        leaf_bytes: Option<u64>,
        stored: &kv_tier_core::EventBatch,
    ) -> bool {
        let now = self.now_ns();
        let (over, measure) = {
            let mut idx = self.lock();
            let claim = reservation.map_or(index::Claim::Nothing, index::Claim::Number);
            idx.insert_claiming(key, file_bytes, now, claim);
            // reported in the step that indexes it: whoever finds the file gone later takes
            // the entry out after this and reports the removal after this `BlockStored`
            stored.add(key);
            if let Some(b) = leaf_bytes {
                idx.set_leaf_bytes(&key, b);
            }
            (
                self.is_over(&idx),
                leaf_bytes.is_none() && idx.leaf_files(&key) >= index::LEAF_GROWS_FROM,
            )
        };
        if over {
            self.kick();
        }
        measure
    }

    /// Where stored blocks sit in their chains (see [`kv_tier_core::lru`]): a sweep takes a
    /// chain's later blocks before its earlier ones.
    pub(crate) fn link(&self, links: &[(BlockKey, kv_tier_core::ChainLink)]) {
        let mut idx = self.lock();
        for (k, l) in links {
            if idx.lru.link(k, l.parent, l.depth) {
                idx.links += 1;
            }
        }
    }

    /// Whether the index holds `key`: `None` while a sweep has it on its way out (decided,
    /// not yet unlinked or put back; only a look at the disk, after that, tells), and for a
    /// key it lacks while it is not reconciled with the disk (see [`Gc::reconciled`]).
    pub(crate) fn indexed(&self, key: &BlockKey) -> Option<bool> {
        let idx = self.lock_unstamped();
        if idx.lru.is_deleting(key) {
            return None;
        }
        match idx.lru.contains(key) {
            false if !self.reconciled() => None,
            held => Some(held),
        }
    }

    /// Whether a walk has reconciled the index with the disk since it was read from a
    /// checkpoint (always, for an index that a walk built).
    pub(crate) fn reconciled(&self) -> bool {
        self.reconciled.load(Ordering::SeqCst)
    }

    /// Bytes of indexed blocks whose chain is broken before them (their parent is not
    /// indexed): a prefix lookup never reaches them here. One pass over the index.
    pub(crate) fn dead_bytes(&self) -> u64 {
        self.lock().lru.dead_bytes()
    }

    /// The measured allocated bytes of `key`'s leaf directory.
    pub(crate) fn set_leaf_bytes(&self, key: &BlockKey, bytes: u64) {
        self.lock().set_leaf_bytes(key, bytes);
    }

    /// The `seq` of `key`'s entry, if indexed: what [`Gc::forget`] checks, so removing an
    /// entry after I/O never removes one a store inserted meanwhile.
    pub(crate) fn seq_of(&self, key: &BlockKey) -> Option<u64> {
        self.lock().lru.get(key).map(|e| e.seq())
    }

    /// A block file found on disk (by a store that skipped, a load, a stamp): indexed if the
    /// index does not know it yet (written by another process).
    ///
    /// With `since` (a [`Walking`]'s `seq0`), the file was looked at with no lock held since
    /// then: not indexed if it left the index or the disk meanwhile (what the look saw of it is
    /// stale).
    pub(crate) fn on_seen(&self, key: BlockKey, m: &std::fs::Metadata, since: Option<u64>) {
        if !self.may_sweep() {
            // a shared root's follower keeps no index of its own (the leader's is the one;
            // a takeover rebuilds it from a walk)
            return;
        }
        self.index_seen(key, m, since);
    }

    /// [`Gc::on_seen`] whoever sweeps (a shared root's new leader, before it does).
    pub(crate) fn index_seen(&self, key: BlockKey, m: &std::fs::Metadata, since: Option<u64>) {
        if std::os::unix::fs::MetadataExt::nlink(m) == 0 {
            // looked at through an open file since deleted (a load's): not on disk any more
            return;
        }
        let size = allocated(m) + self.sidecar_unit.load(Ordering::Relaxed);
        let over = {
            let mut idx = self.lock();
            // known, or a sweep's victim on its way out (still counted until its unlink; the
            // batch puts it back itself if it stays)
            if idx.lru.contains(&key)
                || idx.lru.is_deleting(&key)
                || since.is_some_and(|s| idx.removed_since(&key, s))
            {
                return;
            }
            idx.foreign.remove(&key);
            // a store of this process may have just published it: its reservation is this
            // entry now (counted once)
            idx.insert_claiming(key, size, mtime_ns(m), index::Claim::Any);
            self.is_over(&idx)
        };
        if over {
            self.kick();
        }
    }

    pub(crate) fn total_bytes(&self) -> u64 {
        self.lock().total()
    }

    pub(crate) fn peak_bytes(&self) -> u64 {
        self.lock().peak
    }

    pub(crate) fn dir_bytes(&self) -> u64 {
        self.lock().dir_bytes()
    }

    pub(crate) fn files(&self) -> usize {
        self.lock().lru.len()
    }

    pub(crate) fn pending_stamps(&self) -> usize {
        let idx = self.lock();
        idx.pending.len() + idx.foreign_pending.len()
    }

    pub(crate) fn over_cap(&self) -> bool {
        self.is_over(&self.lock())
    }

    /// Whether the index's total is past the cap (at the cap is within it).
    fn is_over(&self, idx: &Index) -> bool {
        idx.total() > self.cfg.cap_bytes
    }

    /// Wakes the GC thread to sweep now (a store, load or rescan found the tier over its cap).
    pub(crate) fn kick(&self) {
        self.counters.kicks.fetch_add(1, Ordering::Relaxed);
        if !self.cfg.background {
            return;
        }
        self.wake.lock().unwrap_or_else(|p| p.into_inner()).kick = true;
        self.cv.notify_one();
    }

    pub(crate) fn stop(&self) {
        self.wake.lock().unwrap_or_else(|p| p.into_inner()).stop = true;
        self.cv.notify_all();
    }

    pub(crate) fn stopped(&self) -> bool {
        self.wake.lock().unwrap_or_else(|p| p.into_inner()).stop
    }

    /// Waits for the next tick (or a kick or stop). Returns (stop, kicked).
    pub(crate) fn wait(&self, tick: Duration) -> (bool, bool) {
        let w = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        let (mut w, _) = self
            .cv
            .wait_timeout_while(w, tick, |w| !w.stop && !w.kick)
            .unwrap_or_else(|p| p.into_inner());
        let kicked = std::mem::take(&mut w.kick);
        (w.stop, kicked)
    }
}

/// `Gc::frozen_ns` when the clock runs.
const RUNNING: i64 = i64::MIN;

/// A look at the disk made with no lock held (a rescan's walk, a stamps run) under way in
/// the index ([`Index::begin_walk`]): what leaves the index or the disk meanwhile is
/// remembered until it ends (on drop), so what the look saw of it is not put back.
pub(super) struct Walking<'a> {
    gc: &'a Gc,
    pub(super) seq0: u64,
}

impl<'a> Walking<'a> {
    pub(super) fn begin(gc: &'a Gc) -> Self {
        let seq0 = gc.lock().begin_walk();
        Self { gc, seq0 }
    }
}

impl Drop for Walking<'_> {
    fn drop(&mut self) {
        self.gc.lock().end_walk(self.seq0);
    }
}

/// How long a store waits for another thread's sweep to free something: a sweep that frees
/// nothing for this long (stuck on the disk, or held) is not waited for further.
pub(crate) fn room_deadline() -> Instant {
    Instant::now() + Duration::from_secs(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_before_the_epoch_are_negative() {
        let t = SystemTime::UNIX_EPOCH - Duration::from_secs(5);
        assert_eq!(to_ns(t), -5_000_000_000);
        assert_eq!(to_ns(SystemTime::UNIX_EPOCH + Duration::from_nanos(7)), 7);
    }
}
