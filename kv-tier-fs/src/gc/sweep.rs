//! The sweep: deletes least-recently-used block files down to the low watermark.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use kv_tier_core::{BlockKey, Namespace};

use super::{Entry, Gc, SweepPoint, mtime_ns};

/// What a sweep did.
#[derive(Debug, Default, Clone)]
pub(crate) struct SweepReport {
    pub(crate) deleted: Vec<BlockKey>,
}

impl Gc {
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
}

enum Skip {
    Deleted(Entry),
    InFlight,
    Recent,
    Gone,
}
