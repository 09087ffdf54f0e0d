//! The fs tier's counters.

use std::sync::atomic::{AtomicU64, Ordering};

use kv_tier_core::BlockStats;

use crate::FsTier;

/// Counters of an [`FsTier`](crate::FsTier).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FsStats {
    /// What every block-storing tier counts: blocks and bytes written and read, skipped
    /// stores, failures, damaged files removed, checksum outcomes.
    pub blocks: BlockStats,
    /// Store failures for lack of space.
    pub no_space: u64,
    /// Stray temp files deleted (at open and by rescans).
    pub tmp_reaped: u64,
    /// Checksum sidecars whose block file was gone, deleted (at open and by rescans).
    pub sidecars_reaped: u64,
    /// Keys probed for existence.
    pub keys_probed: u64,
    /// Whether I/O uses `O_DIRECT`.
    pub direct_io: bool,
    /// Whether the 4,096 first-level directories of the layout exist (created in the
    /// background after open).
    pub top_dirs_ready: bool,
    /// Garbage collection (bounded mode only; `None` when unbounded).
    pub gc: Option<GcStats>,
}

/// Counters of the bounded mode's garbage collection.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcStats {
    /// The cap, in bytes.
    pub cap_bytes: u64,
    /// The hard ceiling (`gc_hard_ceiling x cap`), in bytes.
    pub hard_ceiling_bytes: u64,
    /// What the tier holds on disk: allocated bytes of its block files, their sidecars and
    /// the directories they keep, plus bytes reserved by stores in flight.
    pub bytes: u64,
    /// The most `bytes` has been since open.
    pub peak_bytes: u64,
    /// The part of `bytes` that is directories.
    pub dir_bytes: u64,
    /// Block files in the index.
    pub files: u64,
    /// Sweeps run.
    pub sweeps: u64,
    /// Files deleted by sweeps.
    pub swept_files: u64,
    /// Bytes deleted by sweeps.
    pub swept_bytes: u64,
    /// Sweep candidates kept because a job had them protected.
    pub skipped_in_flight: u64,
    /// Sweep candidates kept because they were used within the grace window.
    pub skipped_in_grace: u64,
    /// Sweep candidates kept because they were touched after the sweep chose them.
    pub skipped_recent: u64,
    /// Files deleted within the grace window because the total was above the hard ceiling
    /// (or the filesystem was full).
    pub grace_overridden: u64,
    /// Stores that had to make room (or wait for it) under the hard ceiling.
    pub store_waits: u64,
    /// Stores that failed with `NoSpace` because no room could be made.
    pub no_room: u64,
    /// Sweeps run because the filesystem answered `ENOSPC`.
    pub enospc_sweeps: u64,
    /// Emptied leaf and top directories removed by sweeps.
    pub dirs_removed: u64,
    /// Times the GC thread's loop panicked and was restarted.
    pub thread_restarts: u64,
    /// mtime stamps applied.
    pub stamps: u64,
    /// Stamps that failed (other than for a vanished file).
    pub stamp_errors: u64,
    /// Touches dropped because `gc_max_tracked` stamps were already pending.
    pub stamps_dropped: u64,
    /// Stamps waiting to be applied.
    pub pending_stamps: u64,
    /// Files found deleted behind the tier's back (by rescans, stamps or sweeps).
    pub external_removals: u64,
    /// Full rescans run.
    pub rescans: u64,
    /// Errors and panics in the GC loop (it goes on after each).
    pub errors: u64,
    /// Whether the GC thread is running (false after shutdown or with background GC off; a
    /// panicking loop is restarted, see `thread_restarts`).
    pub thread_alive: bool,
    /// How long the last sweep took to choose its victims, in microseconds.
    pub last_decision_us: u64,
    /// How long the last sweep took in all, in microseconds.
    pub last_sweep_us: u64,
    /// How long the startup adopt walk took, in milliseconds.
    pub adopt_ms: u64,
    /// Files in the tree that are not block files of this layout (a `.bin` that is not a
    /// regular file, or whose name or place is not a block's), as the last walk (at open or a
    /// rescan) found them: left alone, not counted toward the cap.
    pub foreign_files: u64,
    /// Times a store, a load or a rescan found the tier over its cap and woke the GC (without
    /// waiting for `gc_interval_s`; counted with the GC off the background thread too).
    pub kicks: u64,
    /// Sweeps that ended still over the cap (everything left was protected or within the
    /// grace window; each is logged).
    pub sweeps_over_cap: u64,
}

impl FsTier {
    /// Counters.
    pub fn stats(&self) -> FsStats {
        let c = &self.shared.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FsStats {
            blocks: c.blocks.snapshot(),
            no_space: g(&c.no_space),
            // the opening's reaping, plus the rescans'
            tmp_reaped: g(&c.tmp_reaped)
                + self
                    .shared
                    .gc
                    .as_ref()
                    .map_or(0, |gc| g(&gc.counters.tmp_reaped)),
            sidecars_reaped: g(&c.sidecars_reaped)
                + self
                    .shared
                    .gc
                    .as_ref()
                    .map_or(0, |gc| g(&gc.counters.sidecars_reaped)),
            keys_probed: g(&c.keys_probed),
            direct_io: self.shared.direct,
            top_dirs_ready: self.shared.top_dirs_ready.load(Ordering::Acquire),
            gc: self.shared.gc.as_ref().map(|gc| {
                let c = &gc.counters;
                GcStats {
                    cap_bytes: gc.cfg.cap_bytes,
                    hard_ceiling_bytes: gc.cfg.hard_bytes,
                    bytes: gc.total_bytes(),
                    peak_bytes: gc.peak_bytes(),
                    dir_bytes: gc.dir_bytes(),
                    files: gc.files() as u64,
                    sweeps: g(&c.sweeps),
                    swept_files: g(&c.swept_files),
                    swept_bytes: g(&c.swept_bytes),
                    skipped_in_flight: g(&c.skipped_in_flight),
                    skipped_in_grace: g(&c.skipped_in_grace),
                    skipped_recent: g(&c.skipped_recent),
                    grace_overridden: g(&c.grace_overridden),
                    store_waits: g(&c.store_waits),
                    no_room: g(&c.no_room),
                    enospc_sweeps: g(&c.enospc_sweeps),
                    dirs_removed: g(&c.dirs_removed),
                    thread_restarts: g(&c.thread_restarts),
                    stamps: g(&c.stamps),
                    stamp_errors: g(&c.stamp_errors),
                    stamps_dropped: g(&c.stamps_dropped),
                    pending_stamps: gc.pending_stamps() as u64,
                    external_removals: g(&c.external_removals),
                    rescans: g(&c.rescans),
                    errors: g(&c.errors),
                    thread_alive: gc.alive.load(Ordering::SeqCst),
                    last_decision_us: g(&c.last_decision_us),
                    last_sweep_us: g(&c.last_sweep_us),
                    adopt_ms: g(&c.adopt_ms),
                    foreign_files: g(&c.foreign_files),
                    kicks: g(&c.kicks),
                    sweeps_over_cap: g(&c.sweeps_over_cap),
                }
            }),
        }
    }
}
