//! The sweep: deletes least-recently-used block files down to the low watermark.

use std::io;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Instant;

use std::ops::Bound;

use kv_tier_core::lru::Rank;
use kv_tier_core::{BlockKey, ProtectionSet};
use rustc_hash::FxHashSet;

use super::index::Entry;
use super::{Gc, SweepPoint, mtime_ns};

/// What a sweep is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Goal {
    /// Over the cap: down to the low watermark, sparing files within the grace window unless
    /// the total is past halfway from the cap to the hard ceiling (then they go, oldest first,
    /// down to the cap, so stores seldom reach the ceiling and wait).
    Cap,
    /// The filesystem is full (`ENOSPC`): whatever the cap, down to `gc_low_watermark` of the
    /// current total, oldest first, grace or not.
    Space,
    /// A store needs this many bytes under the hard ceiling: down to the cap (or to
    /// `hard - bytes`, if lower), oldest first, grace or not, so one sweep makes room for
    /// many stores.
    Room(u64),
}

/// Victims decided (and unlinked) per batch.
const BATCH: usize = 256;

enum Decision {
    /// With the victim's link (parent, depth), to put it back as it was if it stays.
    Delete(Entry, super::index::Removed, Option<(BlockKey, u32)>),
    InFlight,
    Recent,
    Gone,
}

struct Victim {
    key: BlockKey,
    path: PathBuf,
    entry: Entry,
    removed: super::index::Removed,
    /// The block it followed and its depth, if linked.
    link: Option<(BlockKey, u32)>,
    /// Kept (protected at its unlink, or the unlink failed) and counted in the index again:
    /// its bytes left the batch's unlinking count then, not at the batch's end.
    requeued: std::sync::atomic::AtomicBool,
}

/// What became of a victim at its unlink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unlinked {
    /// Its file is gone (deleted now, or already).
    Gone,
    /// The unlink failed: the file stays.
    Failed,
    /// Protected since its decision: kept, its file still there.
    Kept,
    /// Protected since its decision, but its file went meanwhile (a load removed it as
    /// damaged, or someone else deleted it).
    KeptGone,
}

/// The victims of one batch: out of the index and marked deleting until the batch ends.
/// Dropped before its end (a panic between the decisions and the unlinks' end: a bug, or a
/// test's hook), it puts back in the index those whose file is still there and clears every
/// mark, so no store waits for a deletion that will never come.
struct Batch<'a> {
    gc: &'a Gc,
    victims: Vec<Victim>,
}

impl Batch<'_> {
    /// Ends the batch once its unlinks are done (kept and failed victims are back in the
    /// index): the marks are cleared and the stores waiting for them woken.
    fn end(mut self) {
        self.clear(&[]);
    }

    /// Clears the marks, putting back first the victims whose file `stays` says is there.
    fn clear(&mut self, stays: &[bool]) {
        {
            let mut idx = self.gc.lock();
            for (i, v) in self.victims.drain(..).enumerate() {
                if !v.requeued.load(Ordering::Relaxed) {
                    let held = idx.victim_bytes(v.entry.size, &v.removed);
                    idx.unlinking_bytes = idx.unlinking_bytes.saturating_sub(held);
                }
                if stays.get(i).copied().unwrap_or(false) && !idx.lru.contains(&v.key) {
                    idx.insert(v.key, v.entry.size, v.entry.mtime);
                    if let Some((p, d)) = v.link {
                        idx.lru.link(&v.key, p, d);
                    }
                }
                if idx.lru.end_deletion(&v.key) {
                    self.gc.deleting_now.fetch_sub(1, Ordering::SeqCst);
                }
                // its file went only now: a rescan that walked meanwhile may have seen it
                // (after the decision took it out of the index) and must not put it back
                idx.note_removed(&v.key);
            }
        }
        self.gc.deleting_cv.notify_all();
        self.gc.freed();
    }
}

impl Drop for Batch<'_> {
    fn drop(&mut self) {
        if self.victims.is_empty() {
            return;
        }
        // looked at before the index lock (no I/O under it)
        let stays: Vec<bool> = self
            .victims
            .iter()
            .map(|v| std::fs::symlink_metadata(&v.path).is_ok())
            .collect();
        self.clear(&stays);
    }
}

/// A key whose unlink is under way: marked in `Gc::unlinking` from its re-check to the end
/// of its unlink, and unmarked on drop (a panic included), waking `protect()` calls that wait.
struct Unlinking<'a> {
    gc: &'a Gc,
    key: BlockKey,
}

impl Drop for Unlinking<'_> {
    fn drop(&mut self) {
        self.gc
            .unlinking
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&self.key);
        self.gc.unlinking_cv.notify_all();
    }
}

impl Gc {
    /// Runs one sweep toward `goal` (one at a time: a second caller waits for the first).
    /// Candidates come oldest first from the index's mtime order; each is decided under the
    /// protection lock and the index lock, and protection is checked again right before its
    /// unlink. Emptied leaf directories (and top ones, where they count per use) are removed.
    /// Emits `BlockRemoved` for the files it deleted; returns how many.
    pub(crate) fn sweep(&self, goal: Goal) -> usize {
        if !self.may_sweep() {
            return 0; // a shared root's follower: the leader sweeps
        }
        let (ns, root, protection) = (&self.at.ns, &self.at.root, &self.at.protection);
        let _one = self.sweeping.lock().unwrap_or_else(|p| p.into_inner());
        let _span =
            tracing::info_span!("kv_tier_fs_sweep", tier = %self.at.name, goal = ?goal).entered();
        let started = Instant::now();
        let now = self.now_ns();
        let (target, grace_floor) = {
            let total = self.lock().settled();
            let cfg = &self.cfg;
            match goal {
                Goal::Cap if total <= cfg.cap_bytes => return 0,
                Goal::Cap if total > cfg.cap_bytes + (cfg.hard_bytes - cfg.cap_bytes) / 2 => {
                    (cfg.low_bytes, cfg.cap_bytes)
                }
                Goal::Cap => (cfg.low_bytes, u64::MAX),
                Goal::Space => {
                    let ratio = cfg.low_bytes as f64 / cfg.cap_bytes.max(1) as f64;
                    let t = (total as f64 * ratio) as u64;
                    (t, t)
                }
                Goal::Room(bytes) => {
                    let t = cfg.hard_bytes.saturating_sub(bytes).min(cfg.cap_bytes);
                    (t, t)
                }
            }
        };
        let mut deleted: Vec<BlockKey> = Vec::new();
        let (mut in_flight, mut recent, mut in_grace, mut bytes) = (0u64, 0u64, 0u64, 0u64);
        // candidates from here on; a victim's parent that became a candidate before the
        // batch's end moves it back (its chain goes tail first within one sweep)
        let mut cursor: Bound<Rank<i64>> = Bound::Unbounded;
        let mut decided: FxHashSet<BlockKey> = FxHashSet::default();
        let mut first = true;
        'batches: loop {
            let cands: Vec<Rank<i64>> = {
                let idx = self.lock();
                if idx.settled() <= target {
                    break;
                }
                idx.lru.oldest_from(cursor, BATCH)
            };
            let Some(&last) = cands.last() else { break };
            let mut next_from = Bound::Excluded(last);
            if first {
                first = false;
                self.counters
                    .last_decision_us
                    .store(started.elapsed().as_micros() as u64, Ordering::Relaxed);
                self.hook(SweepPoint::Selected);
            }
            // Decide a batch, each key under the protection and index locks. A decided key
            // leaves the index and is marked "being deleted" before the locks drop: a store
            // that protects it afterwards waits for the unlink, then writes the file again.
            let mut batch = Batch {
                gc: self,
                victims: Vec::new(),
            };
            let mut stop = false;
            for rank in cands {
                let (mtime, key) = (rank.at, rank.key);
                if !decided.insert(key) {
                    continue;
                }
                if !self.may_sweep() || self.stopped() {
                    // a shared root's leader stepped down (its index is no longer the one),
                    // or the tier is shutting down: what is decided is unlinked, no more
                    stop = true;
                    break;
                }
                let total = self.lock().settled();
                if total <= target {
                    stop = true;
                    break;
                }
                let within_grace = now - mtime < self.cfg.grace_ns;
                if within_grace && total <= grace_floor {
                    // oldest first: everything from here on is within the grace window
                    let idx = self.lock();
                    in_grace = idx.lru.count_from(rank) as u64;
                    stop = true;
                    break;
                }
                self.hook(SweepPoint::BeforeDelete(key));
                let path = ns.block_path(root, &key);
                // Another process may have used (or deleted) the file since it was indexed.
                // Looked at before the locks: no lock is held across I/O, and anything this
                // process did to the key meanwhile shows in the index checks below.
                let on_disk = std::fs::symlink_metadata(&path).map(|m| mtime_ns(&m));
                // the touches made meanwhile, applied outside the protection lock (the
                // decision's own lock then applies only those of the next moments)
                drop(self.lock());
                let mut decision = None;
                protection.with_lock(|is_protected| {
                    let mut idx = self.lock();
                    let Some(e) = idx.lru.get(&key).copied() else {
                        return;
                    };
                    if e.pending()
                        || idx.lru.rank(&key) != Some(rank)
                        || self.read_recently(&key, now)
                    {
                        decision = Some(Decision::Recent);
                        return;
                    }
                    // a store of it in flight: this process's (protected), or on a shared
                    // root another instance's (announced in its journal, not ended). Such
                    // a store may find the path empty and publish a file nobody counts.
                    if is_protected(&key) || self.announced(&key) {
                        decision = Some(Decision::InFlight);
                        return;
                    }
                    match on_disk {
                        Ok(fresh) if fresh > e.mtime => {
                            idx.set_mtime(&key, fresh);
                            decision = Some(Decision::Recent);
                            return;
                        }
                        Err(ref err) if err.kind() == io::ErrorKind::NotFound => {
                            idx.remove(&key);
                            // reported under the locks: a store of the key protects it (and
                            // indexes its file) only after this, so its event comes after
                            self.at.events.push(vec![key], true);
                            decision = Some(Decision::Gone);
                            return;
                        }
                        _ => {}
                    }
                    let link = idx.lru.parent(&key).map(|p| (p, rank.depth));
                    let removed = idx.remove(&key).expect("checked above");
                    // its parent may be a candidate now, before this batch's last one (never
                    // before this victim): the batch ends here and the next reads on from it
                    if let Some(pr) = link.and_then(|(p, _)| idx.lru.rank(&p))
                        && pr < last
                    {
                        next_from = Bound::Excluded(rank);
                    }
                    // on disk until its unlink: counted until the batch ends
                    idx.unlinking_bytes += idx.victim_bytes(e.size, &removed);
                    idx.lru.mark_deleting(key);
                    self.deleting_now.fetch_add(1, Ordering::SeqCst);
                    decision = Some(Decision::Delete(e, removed, link));
                });
                let reread = next_from != Bound::Excluded(last);
                match decision {
                    Some(Decision::Delete(entry, removed, link)) => {
                        if within_grace {
                            self.counters
                                .grace_overridden
                                .fetch_add(1, Ordering::Relaxed);
                        }
                        batch.victims.push(Victim {
                            key,
                            path,
                            entry,
                            removed,
                            link,
                            requeued: std::sync::atomic::AtomicBool::new(false),
                        });
                    }
                    Some(Decision::InFlight) => in_flight += 1,
                    Some(Decision::Recent) => recent += 1,
                    Some(Decision::Gone) => {
                        self.counters
                            .external_removals
                            .fetch_add(1, Ordering::Relaxed);
                    }
                    None => {}
                }
                if reread {
                    break;
                }
            }
            if !batch.victims.is_empty() {
                self.hook(SweepPoint::Unlinking);
                let (gone, kept, vanished) = self.unlink(&batch.victims, protection);
                in_flight += kept;
                for v in &gone {
                    deleted.push(v.key);
                    bytes += v.entry.size;
                }
                self.counters
                    .external_removals
                    .fetch_add(vanished.len() as u64, Ordering::Relaxed);
                // Reported while the victims are still marked deleting: a store of one of
                // them publishes only after `batch.end()`, so its `BlockStored` comes after.
                self.at
                    .events
                    .push(gone.iter().chain(&vanished).map(|v| v.key).collect(), true);
                self.remove_empty_dirs(&gone);
                batch.end();
            }
            if stop {
                break 'batches;
            }
            cursor = next_from;
        }
        let c = &self.counters;
        c.sweeps.fetch_add(1, Ordering::Relaxed);
        c.swept_files
            .fetch_add(deleted.len() as u64, Ordering::Relaxed);
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
            deleted = deleted.len(),
            bytes,
            in_flight,
            in_grace,
            recent,
            took_ms = started.elapsed().as_millis() as u64,
            ?goal,
            "fs tier sweep"
        );
        // (every removal was reported as it happened: victims per batch, files found gone
        // behind the tier's back at their decision)
        deleted.len()
    }

    /// Unlinks a decided batch on a few threads, holding no lock across an unlink. Right
    /// before each unlink the key's protection is checked again, atomically with marking it
    /// "unlinking" (which `protect()` waits out): a key protected since its decision is kept.
    /// Kept keys and failed unlinks go back to the index, unless the file of a kept key went
    /// meanwhile (a load removed it as damaged, or someone else deleted it: reported removed
    /// with the batch, as found gone). Returns (gone, kept count, vanished).
    fn unlink<'a>(
        &self,
        batch: &'a [Victim],
        protection: &ProtectionSet,
    ) -> (Vec<&'a Victim>, u64, Vec<&'a Victim>) {
        let unlink_chunk = |chunk: &[Victim]| {
            let mut out = Vec::with_capacity(chunk.len());
            for v in chunk {
                let go = protection.with_lock(|is_protected| {
                    if is_protected(&v.key) {
                        return false;
                    }
                    self.unlinking
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .insert(v.key);
                    true
                });
                if !go {
                    // (looked at with no lock held; the key stays marked deleting, so a
                    // load's removal of it is reported here, not by the load)
                    out.push(if std::fs::symlink_metadata(&v.path).is_ok() {
                        Unlinked::Kept
                    } else {
                        Unlinked::KeptGone
                    });
                    continue;
                }
                // unmarked when this unlink ends, however it ends: `protect()` waits for it
                let unlinking = Unlinking {
                    gc: self,
                    key: v.key,
                };
                self.hook(super::SweepPoint::UnlinkingKey(v.key));
                let r = std::fs::remove_file(&v.path);
                drop(unlinking);
                out.push(match r {
                    Ok(()) => {
                        // its sidecar too, whatever the tier's mode: a root written where
                        // xattrs were missing keeps sidecars
                        let _ = std::fs::remove_file(crate::file::sidecar_path(&v.path));
                        Unlinked::Gone
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => Unlinked::Gone,
                    Err(e) => {
                        tracing::warn!(path = %v.path.display(), error = %e, "sweep could not delete a block file");
                        Unlinked::Failed
                    }
                });
            }
            out
        };
        // a few threads for a big batch (each unlink waits on the journal at its pace)
        let outcome: Vec<Unlinked> = if batch.len() < 32 {
            unlink_chunk(batch)
        } else {
            let per = batch.len().div_ceil(4);
            std::thread::scope(|s| {
                let handles: Vec<_> = batch
                    .chunks(per)
                    .map(|chunk| s.spawn(move || unlink_chunk(chunk)))
                    .collect();
                // a chunk that panicked has no outcomes to pair with its victims: the panic
                // goes on up, and the batch's guard restores what is left
                handles
                    .into_iter()
                    .flat_map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
                    .collect()
            })
        };
        let (mut gone, mut vanished) = (Vec::new(), Vec::new());
        let mut kept = 0;
        let mut idx = self.lock();
        for (v, o) in batch.iter().zip(outcome) {
            match o {
                Unlinked::Gone => gone.push(v),
                Unlinked::KeptGone => {
                    // kept, but its file is gone: out of the index for good
                    if !v.requeued.swap(true, Ordering::Relaxed) {
                        let held = idx.victim_bytes(v.entry.size, &v.removed);
                        idx.unlinking_bytes = idx.unlinking_bytes.saturating_sub(held);
                    }
                    vanished.push(v);
                }
                Unlinked::Failed | Unlinked::Kept => {
                    if o == Unlinked::Failed {
                        self.counters.errors.fetch_add(1, Ordering::Relaxed);
                    } else {
                        kept += 1;
                    }
                    // still on disk: counted in the index again, and no longer as being
                    // unlinked (once: not both at a time)
                    if !v.requeued.swap(true, Ordering::Relaxed) {
                        let held = idx.victim_bytes(v.entry.size, &v.removed);
                        idx.unlinking_bytes = idx.unlinking_bytes.saturating_sub(held);
                    }
                    if !idx.lru.contains(&v.key) {
                        idx.insert(v.key, v.entry.size, v.entry.mtime);
                        if let Some((p, d)) = v.link {
                            idx.lru.link(&v.key, p, d);
                        }
                    }
                }
            }
        }
        (gone, kept, vanished)
    }

    /// Removes the leaf (and top) directories the deleted files left empty. A directory that
    /// is not empty (a store is writing into it, or other files are there) stays; a store that
    /// finds its directory gone creates it again.
    fn remove_empty_dirs(&self, gone: &[&Victim]) {
        for v in gone {
            if !v.removed.leaf_empty {
                continue;
            }
            let Some(leaf) = v.path.parent() else {
                continue;
            };
            if std::fs::remove_dir(leaf).is_ok() {
                self.counters.dirs_removed.fetch_add(1, Ordering::Relaxed);
                if v.removed.top_empty
                    && let Some(top) = leaf.parent()
                    && std::fs::remove_dir(top).is_ok()
                {
                    self.counters.dirs_removed.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}
