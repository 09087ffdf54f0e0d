//! Walks of the tree merged into the index: the opening walk that adopts a root, and the
//! rescans that repair the index (files of other processes, external deletes).

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use kv_tier_core::BlockKey;
use rustc_hash::FxHashSet;

use super::{Found, Gc, SweepPoint, Walking, walk};

/// Rescans reap temp files at least this old, whatever `tmp_reap_age_s` says: they run while
/// the tier's own writes are in flight.
pub(crate) const RESCAN_TMP_FLOOR: Duration = Duration::from_secs(60);

/// What the opening walk reaped.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Reaped {
    pub(crate) tmp: u64,
    pub(crate) sidecars: u64,
}

impl Gc {
    /// The opening walk, on `threads` threads: indexes every block file under the rank
    /// directory with its size and mtime, and reaps temp files and orphan sidecars older than
    /// `tmp_age`.
    pub(crate) fn adopt_tree(&self, threads: usize, tmp_age: Duration) -> Reaped {
        let _span = tracing::info_span!("kv_tier_fs_adopt", tier = %self.at.name).entered();
        let t = std::time::Instant::now();
        let reap_tops = self.lock().counts_tops();
        let w = walk(
            &self.at.ns,
            &self.at.rank_dir(),
            threads,
            Some(tmp_age),
            SystemTime::now(),
            reap_tops,
        );
        let n = w.blocks.len();
        self.adopt(w.blocks, &w.leaves);
        self.counters
            .adopt_ms
            .store(t.elapsed().as_millis() as u64, Ordering::Relaxed);
        self.counters
            .foreign_files
            .store(w.foreign, Ordering::Relaxed);
        tracing::info!(
            tier = %self.at.name,
            files = n,
            bytes = self.total_bytes(),
            ms = t.elapsed().as_millis() as u64,
            foreign = w.foreign,
            empty_dirs_removed = w.dirs_reaped,
            "fs tier adopted its directory"
        );
        Reaped {
            tmp: w.tmp_reaped,
            sidecars: w.sidecars_reaped,
        }
    }

    /// A full walk of the tree, merged into the index: adopts files other processes wrote,
    /// updates sizes and mtimes, and forgets (and reports as `BlockRemoved`) only files
    /// verified absent; entries that appeared while it walked stay. Reaps temp files and
    /// orphan sidecars older than `tmp_reap_age_s` (and never younger than a minute; the
    /// walk that reconciles a checkpointed index, those `tmp_reap_age_s` old at the open).
    pub(crate) fn rescan(&self) {
        let _span = tracing::info_span!("kv_tier_fs_rescan", tier = %self.at.name).entered();
        // removals from the index during the walk are remembered until it ends (however it
        // ends), so its merge does not put back a file a sweep deleted meanwhile
        let walking = Walking::begin(self);
        let seq0 = walking.seq0;
        // while the tier runs its own temp files are in flight: never younger than a minute;
        // but the walk that reconciles a checkpointed index reaps what the opening walk would
        // have (temp files `tmp_age` old at the open, none of them this run's)
        let (tmp_age, now) = if self.reconciled() {
            (self.cfg.tmp_age.max(RESCAN_TMP_FLOOR), SystemTime::now())
        } else {
            // (at least a nanosecond: a file of this run, newer than the open, is never as old)
            (self.cfg.tmp_age.max(Duration::from_nanos(1)), self.opened)
        };
        let reap_tops = self.lock().counts_tops();
        let w = walk(
            &self.at.ns,
            &self.at.rank_dir(),
            4,
            Some(tmp_age),
            now,
            reap_tops,
        );
        let c = &self.counters;
        c.tmp_reaped.fetch_add(w.tmp_reaped, Ordering::Relaxed);
        c.sidecars_reaped
            .fetch_add(w.sidecars_reaped, Ordering::Relaxed);
        c.foreign_files.store(w.foreign, Ordering::Relaxed);
        self.hook(SweepPoint::RescanWalked);
        let missing = self.merge(w.blocks, &w.leaves, seq0);
        let absent: Vec<(BlockKey, u64)> = missing
            .into_iter()
            .filter(|(k, _)| {
                // (`forget` keeps a shared root's announced stores, which may not have
                // landed yet)
                std::fs::symlink_metadata(self.at.ns.block_path(&self.at.root, k)).is_err()
            })
            .collect();
        let gone = self.forget(&absent);
        c.rescans.fetch_add(1, Ordering::Relaxed);
        self.mark_reconciled();
        // (reported by `forget`, in the index's order)
        c.external_removals
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
    }

    /// Adopts what the startup walk found (block files, then their leaf directories' sizes).
    fn adopt(&self, found: Vec<Found>, leaves: &[(BlockKey, u64)]) {
        let mut idx = self.lock();
        for f in found {
            idx.insert(f.key, f.size, f.mtime);
        }
        for (k, bytes) in leaves {
            idx.set_leaf_bytes(k, *bytes);
        }
    }

    /// Merges what a walk that started at `seq0` found. Found files update or join the index
    /// with their size and mtime on disk, except entries (re)inserted after the walk started,
    /// which are newer than what it saw, and files that left the index or the disk after it
    /// started (a sweep deleted them: what the walk saw is stale).
    /// Returns the indexed keys the walk did not find and that are older than it, with their
    /// `seq`: they are to be checked on disk before [`Gc::forget`].
    pub(super) fn merge(
        &self,
        found: Vec<Found>,
        leaves: &[(BlockKey, u64)],
        seq0: u64,
    ) -> Vec<(BlockKey, u64)> {
        let mut idx = self.lock();
        let mut seen = FxHashSet::default();
        seen.reserve(found.len());
        for f in found {
            seen.insert(f.key);
            match idx.lru.get(&f.key).copied() {
                // a sweep's victim on its way out: counted until its unlink
                None if idx.lru.is_deleting(&f.key) => {}
                // seen by the walk, then deleted (by a sweep, or found gone): what the walk
                // saw is stale (a store of it since indexes its own file)
                None if idx.removed_since(&f.key, seq0) => {}
                // newer than what the walk saw
                Some(e) if e.seq() > seq0 => {}
                // the disk is the truth for what predates the walk, but a queued stamp stays,
                // and with it the touch's newer time, which the stamp writes
                Some(e) => {
                    let mtime = if e.pending() {
                        e.mtime.max(f.mtime)
                    } else {
                        f.mtime
                    };
                    if (e.size, e.mtime) != (f.size, mtime) {
                        idx.insert(f.key, f.size, mtime);
                    }
                }
                // new to the index: a store of this process may have just published it (its
                // reservation is this entry now)
                None => idx.insert_claiming(f.key, f.size, f.mtime, super::index::Claim::Any),
            }
        }
        for (k, bytes) in leaves {
            idx.set_leaf_bytes(k, *bytes);
        }
        let missing = idx
            .lru
            .iter()
            .filter(|(k, e)| e.seq() <= seq0 && !seen.contains(k))
            .map(|(k, e)| (k, e.seq()))
            .collect();
        drop(idx);
        self.kick_if_over();
        missing
    }
}
