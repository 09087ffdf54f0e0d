//! mtime stamps: recency that survives restarts and that other processes see.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::Ordering;

use kv_tier_core::BlockKey;

use super::{Gc, Index, Walking};

/// Sets atime and mtime of `path` to `ns` (since the epoch).
pub(crate) fn stamp(path: &Path, ns: i64) -> io::Result<()> {
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

/// A stamp to apply: the key, its index entry's `seq` (`None`: another process's file), and
/// the time to stamp (the touch's, for an indexed key).
type Queued = (BlockKey, Option<u64>, i64);

/// Touches the index has not seen yet. `touch` only appends here (no index lock, no lookup
/// of 1M-entry maps on the engine's thread); whoever takes the index lock next applies them
/// first, in the order they came, each batch at the clock of its `touch` (see `Gc::lock`).
#[derive(Default)]
pub(super) struct Touched {
    queued: Batches,
    /// The buffers applied last, emptied: the next ones (their memory is warm, so an append
    /// faults in no page).
    spare: Batches,
}

/// Keys touched, a batch per `touch`.
#[derive(Default)]
struct Batches {
    keys: Vec<BlockKey>,
    /// Per `touch`: where its keys end in `keys`, and the clock then.
    ends: Vec<(usize, i64)>,
}

/// The most keys [`Touched`] holds (32 B each) before a `touch` applies them itself.
const TOUCHED_MAX: usize = 1 << 16;

impl Gc {
    /// Queues mtime stamps: at most one per key per stamp interval, at most `max_tracked`
    /// pending. Keys the index does not hold (written by another process on the same root)
    /// are stamped too, if their file exists, so every process's reads count as recency. No
    /// I/O, and in the common case no index lock: the keys are appended for the index's next
    /// holder to apply (a sweep deciding a key has applied every touch before it); the GC
    /// thread applies the stamps.
    pub(crate) fn queue_stamps(&self, keys: &[BlockKey]) {
        if keys.is_empty() {
            return;
        }
        let now = self.now_ns();
        {
            let mut t = self.touched.lock().unwrap_or_else(|p| p.into_inner());
            let q = &mut t.queued;
            if q.keys.len() + keys.len() <= TOUCHED_MAX.min(self.cfg.max_tracked) {
                q.keys.extend_from_slice(keys);
                q.ends.push((q.keys.len(), now));
                self.touched_any.store(true, Ordering::Release);
                return;
            }
        }
        // full: apply them all now (the lock applies those waiting first)
        let mut idx = self.lock();
        self.note_touches(&mut idx, keys, now);
    }

    /// Applies the touches waiting in [`Touched`] to `idx` (the index lock held).
    pub(super) fn apply_touched(&self, idx: &mut Index) {
        if !self.touched_any.load(Ordering::Acquire) {
            return;
        }
        let mut q = {
            let mut t = self.touched.lock().unwrap_or_else(|p| p.into_inner());
            self.touched_any.store(false, Ordering::Release);
            let spare = std::mem::take(&mut t.spare);
            std::mem::replace(&mut t.queued, spare)
        };
        let mut start = 0;
        for &(end, now) in &q.ends {
            self.note_touches(idx, &q.keys[start..end], now);
            start = end;
        }
        q.keys.clear();
        q.ends.clear();
        self.touched.lock().unwrap_or_else(|p| p.into_inner()).spare = q;
    }

    /// A touch of `keys` at `now`, in the index: due stamps queued, the rest rate-limited.
    fn note_touches(&self, idx: &mut Index, keys: &[BlockKey], now: i64) {
        let mut dropped = 0u64;
        let Index {
            lru,
            pending,
            foreign,
            foreign_pending,
            seq,
            ..
        } = idx;
        for k in keys {
            if pending.len() + foreign_pending.len() >= self.cfg.max_tracked {
                dropped += 1;
                continue;
            }
            let due = lru.update(k, |e| {
                // stored or touched within the interval: recent enough
                if e.pending() || now - e.mtime < self.cfg.stamp_interval_ns {
                    return false;
                }
                // the touch is its recency from now on, in the index at once and on disk
                // when the stamp is applied; a change, like an insert: newer than a walk
                // that started before it
                e.set_pending(true);
                e.mtime = now;
                *seq += 1;
                e.set_seq(*seq);
                true
            });
            match due {
                Some(true) => pending.push(*k),
                Some(false) => {}
                None => {
                    if foreign.len() >= self.cfg.max_tracked {
                        // the rate-limit memory of foreign keys is bounded too
                        foreign.clear();
                    }
                    let last = foreign.entry(*k).or_insert(i64::MIN);
                    if *last != i64::MIN && now - *last < self.cfg.stamp_interval_ns {
                        continue;
                    }
                    *last = now;
                    foreign_pending.push(*k);
                }
            }
        }
        if dropped > 0 {
            self.counters
                .stamps_dropped
                .fetch_add(dropped, Ordering::Relaxed);
        }
    }

    /// Applies the queued stamps (off the caller's thread: the GC thread runs this), on a few
    /// threads when there are many: each is a metadata update the kernel does at its pace.
    /// Keys found gone leave the index (unless the file was published again since the stamp
    /// was queued) and are reported as `BlockRemoved`. Keys of other processes that were
    /// stamped join the index.
    pub(crate) fn apply_stamps(&self) {
        let (ns, root) = (&self.at.ns, &self.at.root);
        // the stamps look at files with no lock held: a file a sweep deletes meanwhile is
        // not learned back from what they saw
        let walking = Walking::begin(self);
        let queued: Vec<Queued> = {
            let mut idx = self.lock();
            let own = std::mem::take(&mut idx.pending);
            let foreign = std::mem::take(&mut idx.foreign_pending);
            let mut q: Vec<Queued> = own
                .into_iter()
                .filter_map(|k| idx.lru.get(&k).map(|e| (k, Some(e.seq()), e.mtime)))
                .collect();
            let now = self.now_ns();
            q.extend(foreign.into_iter().map(|k| (k, None, now)));
            q
        };
        if queued.is_empty() {
            return;
        }
        let threads = if queued.len() >= 512 { 4 } else { 1 };
        let per = queued.len().div_ceil(threads);
        type Done = Vec<(BlockKey, Option<u64>)>;
        type Outcome = (Done, Done, Vec<(BlockKey, std::fs::Metadata)>);
        let results: Vec<Outcome> = std::thread::scope(|s| {
            let handles: Vec<_> = queued
                .chunks(per)
                .map(|chunk| {
                    s.spawn(move || {
                        let (mut done, mut gone, mut learned) =
                            (Vec::new(), Vec::new(), Vec::new());
                        for &(k, seq, at) in chunk {
                            let path = ns.block_path(root, &k);
                            match stamp(&path, at) {
                                Ok(()) if seq.is_none() => {
                                    if let Ok(m) = std::fs::symlink_metadata(&path)
                                        && m.is_file()
                                    {
                                        learned.push((k, m));
                                    }
                                }
                                Ok(()) => done.push((k, seq)),
                                Err(e) if e.kind() == io::ErrorKind::NotFound => {
                                    if seq.is_some() {
                                        gone.push((k, seq));
                                    }
                                }
                                Err(e) => {
                                    self.counters.stamp_errors.fetch_add(1, Ordering::Relaxed);
                                    tracing::debug!(key = %k, error = %e, "mtime stamp failed");
                                    if seq.is_some() {
                                        done.push((k, seq));
                                    }
                                }
                            }
                        }
                        (done, gone, learned)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_default())
                .collect()
        });
        self.hook(super::SweepPoint::StampsDone);
        let mut removed = Vec::new();
        let mut n_done = 0u64;
        {
            let mut idx = self.lock();
            for (done, gone, _) in &results {
                let Index { lru, seq, .. } = &mut *idx;
                for (k, _) in done {
                    // its entry holds the touch's time already; the file has it now: a
                    // change, newer than a walk that started before it (which may have seen
                    // the file's older time)
                    lru.update(k, |e| {
                        e.set_pending(false);
                        *seq += 1;
                        e.set_seq(*seq);
                    });
                }
                n_done += done.len() as u64;
                for (k, seq) in gone {
                    // published again after the stamp was queued: the new file stands
                    if seq.is_some_and(|seq| self.found_gone(&idx, k, seq)) {
                        idx.remove(k);
                        removed.push(*k);
                    }
                }
            }
            // reported before the index lock drops: a store publishing one of these keys
            // again indexes it after this, so its `BlockStored` comes after the removal
            self.at.events.push(removed.clone(), true);
        }
        for (_, _, learned) in &results {
            for (k, m) in learned {
                self.on_seen(*k, m, Some(walking.seq0));
            }
            n_done += learned.len() as u64;
        }
        if !removed.is_empty() {
            self.freed();
        }
        self.counters.stamps.fetch_add(n_done, Ordering::Relaxed);
        self.counters
            .external_removals
            .fetch_add(removed.len() as u64, Ordering::Relaxed);
    }
}
