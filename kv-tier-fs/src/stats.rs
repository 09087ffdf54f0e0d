//! The fs tier's statistics and the live counters behind them.

use kv_tier_core::BlockStats;
use kv_tier_core::stats::TierCounters;

kv_tier_core::counters! {
    /// Counters of an [`FsTier`](crate::FsTier).
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
    pub struct FsStats;
    /// The live counters behind [`FsStats`].
    pub(crate) struct FsCounters;
    fields {
        /// What every block-storing tier counts: blocks and bytes written and read, skipped
        /// stores, failures, damaged files removed, checksum outcomes.
        blocks: BlockStats,
        /// Whether I/O uses `O_DIRECT`.
        direct_io: bool,
        /// Whether blocks are published by `linkat` of an unnamed `O_TMPFILE` file (else a
        /// named temp file and a rename).
        tmpfile_publish: bool,
        /// Whether the 4,096 first-level directories of the layout exist (created in the
        /// background after open).
        top_dirs_ready: bool,
        /// Garbage collection (bounded mode only; `None` when unbounded). On a shared root's
        /// followers its `bytes` is this process's view; `shared.global_bytes` is the
        /// leader's.
        gc: Option<GcStats>,
        /// The shared root's coordination (`None` unless `shared`).
        shared: Option<SharedStats>,
    }
    counted {
        /// Store failures for lack of space.
        no_space,
        /// Stray temp files deleted (at open and by rescans).
        tmp_reaped,
        /// Checksum sidecars whose block file was gone, deleted (at open and by rescans).
        sidecars_reaped,
        /// Keys probed for existence.
        keys_probed,
    }
}

kv_tier_core::counters! {
    /// Counters of the bounded mode's garbage collection.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
    pub struct GcStats;
    /// The live counters behind [`GcStats`].
    pub(crate) struct GcCounters;
    fields {
        /// The cap, in bytes.
        cap_bytes: u64,
        /// The hard ceiling (`gc_hard_ceiling x cap`), in bytes.
        hard_ceiling_bytes: u64,
        /// What the tier holds on disk: allocated bytes of its block files, their sidecars and
        /// the directories they keep, plus bytes reserved by stores in flight.
        bytes: u64,
        /// The most `bytes` has been since open.
        peak_bytes: u64,
        /// The part of `bytes` that is directories.
        dir_bytes: u64,
        /// Block files in the index.
        files: u64,
        /// Dead bytes: the part of `bytes` in block files whose chain is broken before them
        /// (the block they follow is not in the tier), so a prefix lookup never reaches them
        /// here. Only blocks stored with a chain link (`StoreJob::links`) can be dead.
        /// Computed by one pass over the index when the stats are taken.
        dead_bytes: u64,
        /// Stamps waiting to be applied.
        pending_stamps: u64,
        /// Whether the index is reconciled with the disk: false from an open that read a
        /// checkpoint until the walk that checks it against the files has run.
        reconciled: bool,
        /// Whether the GC thread is running (false after shutdown or with background GC off; a
        /// panicking loop is restarted, see `thread_restarts`).
        thread_alive: bool,
    }
    counted {
        /// Sweeps run.
        sweeps,
        /// Files deleted by sweeps.
        swept_files,
        /// Bytes deleted by sweeps.
        swept_bytes,
        /// Sweep candidates kept because a job had them protected.
        skipped_in_flight,
        /// Sweep candidates kept because they were used within the grace window.
        skipped_in_grace,
        /// Sweep candidates kept because they were touched after the sweep chose them.
        skipped_recent,
        /// Files deleted within the grace window: by a sweep over the cap while the total was
        /// past halfway from the cap to the hard ceiling, by a store's sweep for room under the
        /// ceiling, or by a sweep on `ENOSPC`.
        grace_overridden,
        /// Stores that had to make room (or wait for it) under the hard ceiling.
        store_waits,
        /// Stores that failed with `NoSpace` because no room could be made.
        no_room,
        /// Sweeps run because the filesystem answered `ENOSPC`.
        enospc_sweeps,
        /// Emptied leaf and top directories removed by sweeps.
        dirs_removed,
        /// Times the GC thread's loop panicked and was restarted.
        thread_restarts,
        /// mtime stamps applied.
        stamps,
        /// Stamps that failed (other than for a vanished file).
        stamp_errors,
        /// Touches dropped because `gc_max_tracked` stamps were already pending.
        stamps_dropped,
        /// Files found deleted behind the tier's back (by rescans, stamps or sweeps).
        external_removals,
        /// Full rescans run.
        rescans,
        /// Errors: panics in the GC loop (it goes on after each) and block files a sweep (on any
        /// thread) could not delete.
        errors,
        /// How long the last sweep took to read its first batch of candidates (oldest first)
        /// from the index, in microseconds: the index is ordered, so no walk and no sort.
        last_decision_us,
        /// How long the last sweep took in all, in microseconds.
        last_sweep_us,
        /// How long the startup adopt walk took, in milliseconds.
        adopt_ms,
        /// Files in the tree that are not block files of this layout (a `.bin` in the rank,
        /// a top or a leaf directory that is not a regular file, or whose name or place is not
        /// a block's; directories below the leaves are not walked), as the last walk (at open
        /// or a rescan) found them: left alone, not counted toward the cap.
        foreign_files,
        /// Times a store, a load or a rescan found the tier over its cap and woke the GC (without
        /// waiting for `gc_interval_s`; counted with the GC off the background thread too).
        kicks,
        /// Sweeps that ended still over the cap (everything left was protected or within the
        /// grace window; each is logged).
        sweeps_over_cap,
        /// Stray temp files deleted by rescans (`FsStats::tmp_reaped` counts these too).
        tmp_reaped,
        /// Orphan checksum sidecars deleted by rescans (counted in `FsStats::sidecars_reaped` too).
        sidecars_reaped,
        /// Files the index was read with from its checkpoint at open (0: it was walked).
        checkpoint_files,
        /// How long reading the checkpoint took at open, in milliseconds.
        checkpoint_read_ms,
        /// Checkpoints of the index written (periodically and at close, when it changed).
        checkpoints_written,
        /// How long the last checkpoint took to write, in milliseconds.
        checkpoint_ms,
        /// Checkpoints that could not be written (the previous one stays).
        checkpoint_errors,
        /// Checkpoints refused at open (damaged, cut short, foreign, unreadable): the open
        /// walked instead.
        checkpoints_refused,
    }
}

/// The tier's live counters: what every block-storing tier counts, and its own.
pub(crate) type Counters = TierCounters<FsCounters>;

kv_tier_core::counters! {
    /// Figures of a shared root, as this instance sees them.
    #[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
    pub struct SharedStats;
    /// The live counters behind [`SharedStats`].
    pub(crate) struct SharedCounters;
    fields {
        /// Whether this instance holds the leader lease now.
        leader: bool,
        /// The lease's epoch as last seen (each takeover adds one).
        epoch: u64,
        /// Instances alive, as the leader last published.
        members: u64,
        /// The directory's total as the leader last published (files, directories and
        /// credit granted but not spent), in bytes.
        global_bytes: u64,
        /// Credit granted to this instance so far, in bytes.
        granted_bytes: u64,
        /// Credit this instance spent so far, in bytes.
        consumed_bytes: u64,
        /// The leader: stores of every instance under way as it knows them (announced in
        /// their journals, their jobs not ended; a sweep keeps their keys). 0 elsewhere.
        stores_under_way: u64,
    }
    counted {
        /// Times this instance took the lease.
        takeovers,
        /// Store jobs that waited for credit.
        credit_waits,
        /// Blocks not stored for lack of credit (within the wait).
        no_credit,
        /// Failed reads and writes of the coordination files (journal, heartbeat, lease,
        /// grants).
        coord_errors,
    }
}
