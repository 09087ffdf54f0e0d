//! What an [`FsTier`] shows of itself and lets tests and tools drive: its options, paths and
//! statistics, fault injection, and the GC run by hand with a clock that tests move.

use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kv_tier_core::{BlockKey, Error, Namespace, Result};

use crate::block::FaultInjector;
use crate::config::FsTierConfig;
use crate::gc::{Gc, SweepHook};
use crate::stats::{FsStats, GcStats};
use crate::tier::FsTier;

impl FsTier {
    /// The options the tier was opened with.
    pub fn config(&self) -> &FsTierConfig {
        &self.cfg
    }

    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.shared.ns
    }

    /// The path of `key`'s block file.
    pub fn block_path(&self, key: &BlockKey) -> PathBuf {
        self.shared.ns.block_path(&self.shared.root, key)
    }

    /// Sets how long after its publication a block may lack its checksum sidecar (default
    /// 2 s: the publisher writes it right after publishing, and a load in between fails
    /// without calling the block damaged). Only where checksums live in sidecars (no user
    /// xattrs). For tests and tools.
    pub fn set_sidecar_grace(&self, d: Duration) {
        self.shared
            .sidecar_grace_ns
            .store(d.as_nanos().min(u64::MAX as u128) as u64, Ordering::Relaxed);
    }

    /// Installs (or with `None` removes) a fault injector: every file operation asks it first
    /// and fails with the error it returns. For tests of error paths.
    pub fn set_fault_injector(&self, f: Option<FaultInjector>) {
        *self.shared.faults.write().expect("fault injector") = f;
    }

    fn gc(&self) -> Result<&Gc> {
        self.shared.gc.as_deref().ok_or_else(|| {
            Error::config(
                "gc_max_size_gb",
                "the tier is unbounded: set gc_max_size_gb to use GC",
            )
        })
    }

    /// Runs one sweep now on the caller's thread (if over the cap); returns the files deleted.
    /// For tests, benchmarks and tools; the GC thread does this on its own.
    pub fn gc_sweep_now(&self) -> Result<usize> {
        self.gc()?;
        Ok(self.gc()?.sweep(crate::gc::Goal::Cap))
    }

    /// Runs one sweep now as when the filesystem reports `ENOSPC`: whatever the cap, down to
    /// `gc_low_watermark` of the current total, oldest first, grace window or not; protected
    /// keys and files with a job in flight are spared. Returns the files deleted. For tests
    /// and tools (the tier does this on its own when a write finds the disk full).
    pub fn gc_sweep_for_space_now(&self) -> Result<usize> {
        self.gc()?;
        Ok(self.gc()?.sweep(crate::gc::Goal::Space))
    }

    /// Applies the queued mtime stamps now, on the caller's thread.
    pub fn gc_apply_stamps_now(&self) -> Result<()> {
        self.gc()?.apply_stamps();
        Ok(())
    }

    /// Walks the tree now and repairs the index (external deletes, files of other processes).
    pub fn gc_rescan_now(&self) -> Result<()> {
        self.gc()?.rescan();
        Ok(())
    }

    /// Writes a checkpoint of the index now, if it changed since the last one and
    /// checkpoints are on (`gc_checkpoint_interval_s`); returns whether one was written.
    pub fn gc_checkpoint_now(&self) -> Result<bool> {
        Ok(self.gc()?.write_checkpoint())
    }

    /// Installs (or removes) a hook the sweep calls at each [`crate::SweepPoint`]; it may block to
    /// hold the sweep there. For deterministic interleaving tests.
    pub fn set_sweep_hook(&self, hook: Option<SweepHook>) -> Result<()> {
        self.gc()?.set_hook(hook);
        Ok(())
    }

    /// Moves the GC clock (grace windows, stamp rate limits, stamp times) forward. For tests.
    pub fn advance_gc_clock(&self, d: Duration) -> Result<()> {
        self.gc()?.advance_clock(d);
        Ok(())
    }

    /// Stops the GC clock at the current time; afterwards only
    /// [`advance_gc_clock`](Self::advance_gc_clock) moves it, so a test can stand exactly on
    /// the boundary of a grace window or a stamp interval. For tests.
    pub fn freeze_gc_clock(&self) -> Result<()> {
        self.gc()?.freeze_clock();
        Ok(())
    }

    /// Counters.
    pub fn stats(&self) -> FsStats {
        let sh = &self.shared;
        let mut s = FsStats {
            blocks: sh.counters.blocks.snapshot(),
            direct_io: sh.direct,
            tmpfile_publish: sh.tmpfile,
            shared: sh.coord.as_ref().map(|c| {
                let mut s = c.stats();
                s.stores_under_way = sh.gc.as_ref().map_or(0, |g| g.announced_stores());
                s
            }),
            top_dirs_ready: sh.top_dirs_ready.load(Ordering::Acquire),
            gc: sh.gc.as_ref().map(|gc| {
                let mut g = GcStats {
                    cap_bytes: gc.cfg.cap_bytes,
                    hard_ceiling_bytes: gc.cfg.hard_bytes,
                    bytes: gc.total_bytes(),
                    peak_bytes: gc.peak_bytes(),
                    dir_bytes: gc.dir_bytes(),
                    files: gc.files() as u64,
                    dead_bytes: gc.dead_bytes(),
                    pending_stamps: gc.pending_stamps() as u64,
                    reconciled: gc.reconciled(),
                    thread_alive: gc.alive.load(Ordering::SeqCst),
                    ..GcStats::default()
                };
                gc.counters.fill(&mut g);
                g
            }),
            ..FsStats::default()
        };
        sh.counters.own.fill(&mut s);
        // the opening's reaping, plus the rescans'
        if let Some(g) = &s.gc {
            s.tmp_reaped += g.tmp_reaped;
            s.sidecars_reaped += g.sidecars_reaped;
        }
        s
    }
}
