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

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant, SystemTime};

use kv_tier_core::{BlockKey, Namespace};
use rustc_hash::FxHashMap;

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

/// Sets atime and mtime of `path` to `ns` (since the epoch).
fn stamp(path: &Path, ns: i64) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let ts = libc::timespec {
        tv_sec: ns.div_euclid(1_000_000_000),
        tv_nsec: ns.rem_euclid(1_000_000_000),
    };
    let times = [ts, ts];
    // SAFETY: valid path and a two-element timespec array.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// One block file found on disk.
pub(crate) struct Found {
    pub(crate) key: BlockKey,
    pub(crate) size: u64,
    pub(crate) mtime: i64,
}

/// What a walk of the rank directory found.
#[derive(Default)]
pub(crate) struct Walk {
    pub(crate) blocks: Vec<Found>,
    pub(crate) tmp_reaped: u64,
    pub(crate) foreign: u64,
}

/// Parses `<top>/<leaf>/<hex>.bin` under the rank dir into a key, checking it is where the
/// layout puts that key.
pub(crate) fn parse_block(ns: &Namespace, top: &str, leaf: &str, file: &str) -> Option<BlockKey> {
    let hex = file.strip_suffix(".bin")?;
    let group: u32 = leaf.rsplit_once("_g")?.1.parse().ok()?;
    let key = BlockKey::from_hex(hex, group).ok()?;
    let want = ns.block_rel_path(&key);
    let got = format!("{}/{top}/{leaf}/{file}", ns.rank_dir_name());
    (want == got).then_some(key)
}

/// Walks the rank directory on `threads` threads: adopts every block file (with its size and
/// mtime) and deletes `.tmp` files older than `tmp_age` (`None`: leaves them).
pub(crate) fn walk(
    ns: &Namespace,
    rank_dir: &Path,
    threads: usize,
    tmp_age: Option<Duration>,
    now: SystemTime,
) -> Walk {
    let tops: Vec<PathBuf> = match std::fs::read_dir(rank_dir) {
        Ok(rd) => rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect(),
        Err(_) => return Walk::default(),
    };
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = Mutex::new(Walk::default());
    let is_old_tmp = |m: &std::fs::Metadata| {
        tmp_age.is_some_and(|age| {
            m.modified()
                .map(|t| now.duration_since(t).unwrap_or_default() >= age)
                .unwrap_or(false)
        })
    };
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let mut local = Walk::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(top) = tops.get(i) else { break };
                    let top_name = top
                        .file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or("")
                        .to_string();
                    let Ok(leaves) = std::fs::read_dir(top) else {
                        continue;
                    };
                    for leaf in leaves.flatten() {
                        let lp = leaf.path();
                        let leaf_name = leaf.file_name().to_string_lossy().into_owned();
                        if !leaf.file_type().is_ok_and(|t| t.is_dir()) {
                            if leaf_name.ends_with(".tmp")
                                && leaf.metadata().is_ok_and(|m| is_old_tmp(&m))
                                && std::fs::remove_file(&lp).is_ok()
                            {
                                local.tmp_reaped += 1;
                            }
                            continue;
                        }
                        let Ok(files) = std::fs::read_dir(&lp) else {
                            continue;
                        };
                        for f in files.flatten() {
                            let name = f.file_name();
                            let name = name.to_string_lossy();
                            if name.ends_with(".tmp") {
                                if f.metadata().is_ok_and(|m| is_old_tmp(&m))
                                    && std::fs::remove_file(f.path()).is_ok()
                                {
                                    local.tmp_reaped += 1;
                                }
                                continue;
                            }
                            if !name.ends_with(".bin") {
                                continue;
                            }
                            match (parse_block(ns, &top_name, &leaf_name, &name), f.metadata()) {
                                (Some(key), Ok(m)) if m.is_file() => local.blocks.push(Found {
                                    key,
                                    size: m.len(),
                                    mtime: mtime_ns(&m),
                                }),
                                _ => local.foreign += 1,
                            }
                        }
                    }
                }
                let mut o = out.lock().expect("walk results");
                o.blocks.append(&mut local.blocks);
                o.tmp_reaped += local.tmp_reaped;
                o.foreign += local.foreign;
            });
        }
    });
    out.into_inner().expect("walk results")
}

/// What a sweep did.
#[derive(Debug, Default, Clone)]
pub(crate) struct SweepReport {
    pub(crate) deleted: Vec<BlockKey>,
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
    pub(crate) fn touch(&self, keys: &[BlockKey]) {
        let now = self.now_ns();
        let mut queued = false;
        let mut dropped = 0u64;
        {
            let mut idx = self.lock();
            let Index { map, pending, .. } = &mut *idx;
            for k in keys {
                let Some(e) = map.get_mut(k) else { continue };
                if e.pending || now - e.last_stamp < self.cfg.stamp_interval_ns {
                    continue;
                }
                if pending.len() >= self.cfg.max_tracked {
                    dropped += 1;
                    continue;
                }
                e.pending = true;
                e.last_stamp = now;
                pending.push(*k);
                queued = true;
            }
        }
        if dropped > 0 {
            self.counters
                .stamps_dropped
                .fetch_add(dropped, Ordering::Relaxed);
        }
        let _ = queued; // the GC thread applies stamps at its next tick
    }

    /// A file found on disk that the index does not know yet (written by another process).
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
    pub(crate) fn apply_stamps(&self, ns: &Namespace, root: &Path) {
        let pending = std::mem::take(&mut self.lock().pending);
        if pending.is_empty() {
            return;
        }
        let now = self.now_ns();
        let threads = if pending.len() >= 512 { 4 } else { 1 };
        let per = pending.len().div_ceil(threads);
        let results: Vec<(Vec<BlockKey>, Vec<BlockKey>)> = std::thread::scope(|s| {
            let handles: Vec<_> = pending
                .chunks(per)
                .map(|chunk| {
                    s.spawn(move || {
                        let (mut done, mut gone) = (Vec::with_capacity(chunk.len()), Vec::new());
                        for k in chunk {
                            match stamp(&ns.block_path(root, k), now) {
                                Ok(()) => done.push(*k),
                                Err(e) if e.kind() == io::ErrorKind::NotFound => gone.push(*k),
                                Err(e) => {
                                    self.counters.stamp_errors.fetch_add(1, Ordering::Relaxed);
                                    tracing::debug!(key = %k, error = %e, "mtime stamp failed");
                                    done.push(*k);
                                }
                            }
                        }
                        (done, gone)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("stamp thread"))
                .collect()
        });
        let mut idx = self.lock();
        let (mut n_done, mut n_gone) = (0u64, 0u64);
        for (done, gone) in &results {
            for k in done {
                if let Some(e) = idx.map.get_mut(k) {
                    e.mtime = e.mtime.max(now);
                    e.pending = false;
                }
            }
            for k in gone {
                idx.remove(k);
            }
            n_done += done.len() as u64;
            n_gone += gone.len() as u64;
        }
        drop(idx);
        self.counters.stamps.fetch_add(n_done, Ordering::Relaxed);
        self.counters
            .external_removals
            .fetch_add(n_gone, Ordering::Relaxed);
    }

    pub(crate) fn over_cap(&self) -> bool {
        self.lock().total > self.cfg.cap_bytes
    }

    /// Deletes least-recently-used files down to the low watermark. Each deletion runs under
    /// the protection lock and the index lock.
    pub(crate) fn sweep(
        &self,
        ns: &Namespace,
        root: &Path,
        protection: &kv_tier_core::ProtectionSet,
    ) -> SweepReport {
        let started = Instant::now();
        let now = self.now_ns();
        let mut cands: Vec<(i64, BlockKey)> = {
            let idx = self.lock();
            if idx.total <= self.cfg.cap_bytes {
                return SweepReport::default();
            }
            idx.map.iter().map(|(k, e)| (e.mtime, *k)).collect()
        };
        cands.sort_unstable(); // oldest first; ties by key, so the order is deterministic
        let decided = started.elapsed();
        self.counters
            .last_decision_us
            .store(decided.as_micros() as u64, Ordering::Relaxed);
        self.hook(SweepPoint::Selected);
        let mut report = SweepReport::default();
        let (mut in_flight, mut recent, mut in_grace, mut bytes) = (0u64, 0u64, 0u64, 0u64);
        let mut i = 0;
        let mut stop = false;
        while !stop && i < cands.len() {
            // Decide a batch, each key under the protection and index locks. A decided key
            // leaves the index and is marked "being deleted" before the locks drop: a store
            // that protects it afterwards waits for the unlink, then writes the file again.
            let mut batch: Vec<(BlockKey, PathBuf, Entry)> = Vec::new();
            while batch.len() < 256 && i < cands.len() {
                let (mtime, key) = cands[i];
                if self.lock().total <= self.cfg.low_bytes {
                    stop = true;
                    break;
                }
                if now - mtime < self.cfg.grace_ns {
                    // sorted oldest first: everything from here on is within the grace window
                    in_grace = (cands.len() - i) as u64;
                    stop = true;
                    break;
                }
                i += 1;
                self.hook(SweepPoint::BeforeDelete(key));
                let path = ns.block_path(root, &key);
                // Another process may have used (or deleted) the file since it was indexed.
                // Looked at before the locks: no lock is held across I/O, and anything this
                // process did to the key meanwhile shows in the index checks below.
                let on_disk = std::fs::symlink_metadata(&path).map(|m| mtime_ns(&m));
                let mut outcome = None;
                protection.with_lock(|is_protected| {
                    let mut idx = self.lock();
                    let Some(e) = idx.map.get(&key).copied() else {
                        return;
                    };
                    if e.pending || e.mtime != mtime {
                        outcome = Some(Skip::Recent);
                        return;
                    }
                    if is_protected(&key) {
                        outcome = Some(Skip::InFlight);
                        return;
                    }
                    match on_disk {
                        Ok(fresh) if fresh > e.mtime => {
                            if let Some(e) = idx.map.get_mut(&key) {
                                e.mtime = fresh;
                            }
                            outcome = Some(Skip::Recent);
                            return;
                        }
                        Err(ref err) if err.kind() == io::ErrorKind::NotFound => {
                            idx.remove(&key);
                            outcome = Some(Skip::Gone);
                            return;
                        }
                        _ => {}
                    }
                    idx.remove(&key);
                    self.deleting.lock().expect("gc deleting").insert(key);
                    outcome = Some(Skip::Deleted(e));
                });
                match outcome {
                    Some(Skip::Deleted(e)) => batch.push((key, path, e)),
                    Some(Skip::InFlight) => in_flight += 1,
                    Some(Skip::Recent) => recent += 1,
                    Some(Skip::Gone) => {
                        self.counters
                            .external_removals
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    None => {}
                }
            }
            if batch.is_empty() {
                continue;
            }
            self.hook(SweepPoint::Unlinking);
            // Unlink the batch on a few threads: no lock is held, each unlink waits on the
            // filesystem's journal at its own pace.
            let sidecars = self.sidecars.load(Ordering::Relaxed);
            let threads = if batch.len() >= 32 { 4 } else { 1 };
            let per = batch.len().div_ceil(threads);
            let failed: Vec<usize> = std::thread::scope(|s| {
                let handles: Vec<_> = batch
                    .chunks(per)
                    .enumerate()
                    .map(|(c, chunk)| {
                        s.spawn(move || {
                            let mut failed = Vec::new();
                            for (j, (_, path, _)) in chunk.iter().enumerate() {
                                match std::fs::remove_file(path) {
                                    Ok(()) => {
                                        if sidecars {
                                            let _ = std::fs::remove_file(crate::file::sidecar_path(path));
                                        }
                                    }
                                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                                    Err(e) => {
                                        tracing::warn!(path = %path.display(), error = %e, "sweep could not delete a block file");
                                        failed.push(c * per + j);
                                    }
                                }
                            }
                            failed
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().expect("unlink thread"))
                    .collect()
            });
            {
                let mut idx = self.lock();
                for &f in &failed {
                    let (key, _, e) = batch[f];
                    self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    idx.insert(key, e.size, e.mtime); // still on disk: keep accounting for it
                }
            }
            {
                let mut del = self.deleting.lock().expect("gc deleting");
                for (key, _, _) in &batch {
                    del.remove(key);
                }
            }
            self.deleting_cv.notify_all();
            for (j, (key, _, e)) in batch.iter().enumerate() {
                if !failed.contains(&j) {
                    report.deleted.push(*key);
                    bytes += e.size;
                }
            }
        }
        let c = &self.counters;
        c.sweeps.fetch_add(1, Ordering::Relaxed);
        c.swept_files
            .fetch_add(report.deleted.len() as u64, Ordering::Relaxed);
        c.swept_bytes.fetch_add(bytes, Ordering::Relaxed);
        c.skipped_in_flight.fetch_add(in_flight, Ordering::Relaxed);
        c.skipped_in_grace.fetch_add(in_grace, Ordering::Relaxed);
        c.skipped_recent.fetch_add(recent, Ordering::Relaxed);
        c.last_sweep_us
            .store(started.elapsed().as_micros() as u64, Ordering::Relaxed);
        let total = self.total_bytes();
        if total > self.cfg.cap_bytes {
            c.sweeps_over_cap.fetch_add(1, Ordering::Relaxed);
            tracing::info!(
                total,
                cap = self.cfg.cap_bytes,
                in_grace,
                in_flight,
                "fs tier stays over its cap: the rest is protected or used within the grace window"
            );
        }
        tracing::debug!(
            deleted = report.deleted.len(),
            bytes,
            in_flight,
            in_grace,
            recent,
            decision_us = decided.as_micros() as u64,
            took_ms = started.elapsed().as_millis() as u64,
            "fs tier sweep"
        );
        report
    }

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

enum Skip {
    Deleted(Entry),
    InFlight,
    Recent,
    Gone,
}
