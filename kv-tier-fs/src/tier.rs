//! [`FsTier`]: blocks as files in vLLM's layout, read and written on dedicated I/O threads.

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use kv_tier_core::prelude::*;
use kv_tier_core::registry::Opener;

use crate::block::{Counters, FsOp, Shared, bump, random_salt};
use crate::config::{Checksum, FsTierConfig};
use crate::gc::{Gc, Place};
use crate::io::{Class, Collector, Engine, Task};
use crate::root::{prepare_root, probe_dir, reap_tmp, spawn_top_dirs, write_or_check_config};

/// The filesystem tier.
///
/// Blocks are files in vLLM's layout under `root_dir` (see [`kv_tier_core::layout`]): a cache
/// directory written by vLLM's fs tier is readable here and the other way round. All I/O runs
/// on the tier's own read and write threads; the async methods only queue work and await it.
pub struct FsTier {
    pub(crate) shared: Arc<Shared>,
    engine: Engine,
    /// The GC thread and the thread pre-creating top directories, joined when the tier stops.
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    shut_down: AtomicBool,
    pub(crate) cfg: FsTierConfig,
    /// This tier's mark on its root, until it is shut down or dropped (see
    /// `offline::holders`).
    live: Mutex<Option<crate::live::LiveMark>>,
}

impl std::fmt::Debug for FsTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsTier")
            .field("name", &self.shared.name)
            .field("root", &self.shared.root)
            .field("direct_io", &self.shared.direct)
            .finish()
    }
}

impl FsTier {
    /// Opens (creating what is missing) the tier at `cfg.root_dir` for namespace `ns` and
    /// blocks of `block_size` bytes. Blocking: call it off async workers (the registry's
    /// builder does).
    pub fn open(
        name: impl Into<String>,
        cfg: FsTierConfig,
        ns: Namespace,
        block_size: usize,
    ) -> Result<Self> {
        cfg.validate()?;
        if block_size == 0 || block_size as u64 > kv_tier_core::config::MAX_BLOCK_SIZE {
            return Err(Error::config(
                "block_size_bytes",
                format!("must be between 1 and 1 GiB, got {block_size}"),
            ));
        }
        let name = name.into();
        let root = cfg.root_dir.clone();
        prepare_root(&root)?;
        let ns_dir = ns.namespace_dir(&root);
        std::fs::create_dir_all(&ns_dir).map_err(|e| Error::io("mkdir", &ns_dir, e))?;
        write_or_check_config(&ns, &root)?;
        let rank_dir = root.join(ns.rank_dir_name());
        std::fs::create_dir_all(&rank_dir).map_err(|e| Error::io("mkdir", &rank_dir, e))?;
        // not fatal: the tier works without it; the operator's commands cannot see it then
        let live = crate::live::mark(&ns_dir, &ns.rank_dir_name())
            .inspect_err(|e| tracing::warn!(root = %root.display(), error = %e, "cannot mark the root as in use; `kv-tier gc` and `verify --repair` will not see this tier"))
            .ok();
        let probe = probe_dir(
            &rank_dir,
            cfg.direct_io,
            cfg.checksum == Checksum::Crc32c,
            cfg.tmpfile_publish,
        )?;
        let direct = match probe.direct_align {
            Some(a) if block_size.is_multiple_of(a) => true,
            Some(a) => {
                tracing::warn!(
                    block_size,
                    align = a,
                    "block size is not a multiple of the O_DIRECT alignment; using buffered I/O"
                );
                false
            }
            None => false,
        };
        let alloc_unit = match std::fs::metadata(&rank_dir) {
            Ok(m) => m.blksize().max(512),
            Err(e) => return Err(Error::io("stat", &rank_dir, e)),
        };
        let dir_alloc = probe.dir_alloc;
        let alloc_block = (block_size as u64).div_ceil(alloc_unit) * alloc_unit;
        let sidecar_unit = if cfg.checksum == Checksum::Crc32c && !probe.xattrs {
            alloc_unit
        } else {
            0
        };
        let gc_cfg = cfg.gc();
        // The 4,096 top directories are pre-created (and counted as a fixed part of the
        // total) only where they are a small part of the cap; otherwise each counts, and
        // goes, with its last file.
        let precreate_tops = gc_cfg
            .as_ref()
            .is_none_or(|g| 4096 * dir_alloc <= g.cap_bytes / 20);
        if let Some(g) = &gc_cfg {
            let least = alloc_block + sidecar_unit + 2 * dir_alloc;
            if g.cap_bytes < least {
                return Err(Error::config(
                    "gc_max_size_gb",
                    format!(
                        "{} bytes cannot hold one block file with its directories ({least} bytes here)",
                        g.cap_bytes
                    ),
                ));
            }
        }
        let protection = ProtectionSet::new();
        let events = Arc::new(EventLog::new(
            name.clone(),
            Medium::Storage,
            Locality::Local,
        ));
        let gc = gc_cfg.map(|g| {
            let base = if precreate_tops { 4096 * dir_alloc } else { 0 };
            let at = Place {
                name: name.clone(),
                root: root.clone(),
                ns: ns.clone(),
                protection: protection.clone(),
                events: events.clone(),
            };
            let checkpoint = (g.checkpoint_interval.is_some() && !cfg.shared)
                .then(|| crate::gc::checkpoint_path(&ns_dir, &ns.rank_dir_name()));
            let mut gc = Gc::new(g, at, dir_alloc, base, !precreate_tops);
            if let Some(path) = checkpoint {
                gc = gc.with_checkpoint(path);
            }
            gc.set_sidecar_unit(sidecar_unit);
            Arc::new(gc)
        });
        let coord = match (&gc, cfg.shared) {
            (Some(gc), true) => {
                // the coordination thread makes this instance the leader when it takes the
                // lease; until then it does not sweep
                gc.set_may_sweep(false);
                let g = &gc.cfg;
                let sizes = crate::shared::Sizes {
                    block_credit: alloc_block + sidecar_unit + 2 * dir_alloc,
                    file_bytes: alloc_block + sidecar_unit,
                    cap: g.cap_bytes,
                    hard: g.hard_bytes,
                    low: g.low_bytes,
                    stamp_interval: Duration::from_nanos(g.stamp_interval_ns.max(0) as u64),
                };
                let id = cfg
                    .instance_id
                    .clone()
                    .unwrap_or_else(kv_tier_core::config::default_instance_id);
                let lease = Duration::from_secs_f64(
                    cfg.shared_lease_s
                        .unwrap_or(crate::config::defaults::SHARED_LEASE_S),
                );
                let c = crate::shared::Coord::new(&root, &ns, id, lease, sizes).map_err(|e| {
                    // a setting that differs from the leader's names itself
                    let msg = e.to_string();
                    match msg.split_once(": ") {
                        Some((field, reason)) if e.kind() == std::io::ErrorKind::InvalidInput => {
                            Error::config(field, reason)
                        }
                        _ => Error::config("shared", msg),
                    }
                })?;
                Some(Arc::new(c))
            }
            _ => None,
        };
        let files = Arc::new(Shared {
            name: name.clone(),
            root: root.clone(),
            ns,
            block_size,
            alloc_block,
            dir_alloc,
            direct,
            align: probe.direct_align.unwrap_or(kv_tier_core::PAGE_SIZE),
            checksum: cfg.checksum,
            accept_unverified: cfg.accept_unverified,
            vllm_crc: cfg.vllm_checksum && probe.xattrs,
            xattrs: probe.xattrs,
            tmpfile: probe.tmpfile,
            sidecar_grace_ns: AtomicU64::new(crate::block::SIDECAR_GRACE.as_nanos() as u64),
            fsync: cfg.fsync,
            faults: RwLock::new(None),
            counters: Counters::default(),
            tmp_seq: AtomicU64::new(0),
            tmp_salt: random_salt(),
            leaves: crate::block::LeafDirs::new(),
            top_dirs_ready: AtomicBool::new(false),
            stop_top_dirs: AtomicBool::new(false),
            protection,
            stamped: std::sync::Mutex::new(Default::default()),
            events,
            gc,
            coord,
        });
        let tmp_age = Duration::from_secs(cfg.tmp_reap_age_s);
        let (mut reaped, _) = reap_tmp(std::slice::from_ref(&ns_dir), tmp_age);
        match &files.gc {
            None => {
                let (tmps, sidecars) = reap_tmp(std::slice::from_ref(&rank_dir), tmp_age);
                reaped += tmps;
                bump(&files.counters.own.sidecars_reaped, sidecars);
            }
            // a shared root: the leader walks when it takes the lease
            Some(_) if cfg.shared => {}
            Some(gc) => {
                // The checkpoint of the last close, which the GC thread reconciles with the
                // disk (reaping temp files) as its first step; else one walk adopts what is
                // on disk (with its mtimes) and reaps temp files.
                let from_checkpoint = gc.cfg.background && gc.read_checkpoint().is_some();
                if !from_checkpoint {
                    let r = gc.adopt_tree(cfg.n_read_threads.clamp(1, 8), tmp_age);
                    reaped += r.tmp;
                    bump(&files.counters.own.sidecars_reaped, r.sidecars);
                }
            }
        }
        let mut threads = Vec::new();
        if precreate_tops {
            threads.extend(spawn_top_dirs(files.clone()));
        }
        bump(&files.counters.own.tmp_reaped, reaped);
        if reaped > 0 {
            tracing::info!(reaped, root = %root.display(), "deleted stray temp files of killed writers");
        }
        let engine = Engine::start(cfg.n_read_threads, cfg.n_write_threads)
            .map_err(|e| Error::io("spawn I/O threads", &root, e))?;
        tracing::debug!(root = %root.display(), direct, xattrs = probe.xattrs, "fs tier open");
        if let Some(gc) = files.gc.as_ref().filter(|g| g.cfg.background) {
            let h =
                crate::gc::spawn(gc.clone()).map_err(|e| Error::io("spawn GC thread", &root, e))?;
            threads.push(h);
        }
        if let (Some(c), Some(gc)) = (&files.coord, &files.gc) {
            let h = crate::shared::spawn(c.clone(), gc.clone())
                .map_err(|e| Error::io("spawn the shared root's thread", &root, e))?;
            threads.push(h);
        }
        Ok(Self {
            shared: files,
            engine,
            threads: Mutex::new(threads),
            shut_down: AtomicBool::new(false),
            cfg,
            live: Mutex::new(live),
        })
    }

    /// Registers the type `"fs"` in `registry` (an error if it is there already).
    pub fn register(registry: &mut TierRegistry) -> Result<()> {
        registry.register_tier(
            "fs",
            FsTierConfig::from_spec,
            Opener::Blocking(FsTier::open),
        )?;
        Ok(())
    }

    /// Runs `op` once per block on the I/O threads (one task per block, so a job spreads over
    /// every idle thread), with the keys protected meanwhile (by `protect`, the caller's
    /// guard of them, held by the tasks: if the caller drops this future, the keys stay
    /// protected until the I/O on them has ended). `None` after shutdown.
    ///
    /// A load's block not started when the job's future is dropped is not read.
    ///
    /// `op` records the keys a store published in the batch it is given, each logged as it
    /// is added, so a dropped job's work is still reported (removals are logged where they
    /// happen: a load's removal of a damaged file by that removal).
    async fn run_blocks<B, R>(
        &self,
        class: Class,
        blocks: Vec<(BlockKey, B)>,
        (protect, hold): (Arc<ProtectGuard>, Option<Arc<crate::shared::Finish>>),
        op: fn(&Shared, &BlockKey, B, &EventBatch) -> R,
    ) -> Option<Vec<(BlockKey, R)>>
    where
        B: Send + 'static,
        R: Send + 'static,
    {
        if blocks.is_empty() {
            return Some(Vec::new());
        }
        let batch = Arc::new(EventBatch::new(self.shared.events.clone(), false));
        let (col, rx) = Collector::new(blocks.len());
        let tasks: Vec<Task> = blocks
            .into_iter()
            .map(|(key, buf)| {
                let (files, col, protect) = (self.shared.clone(), col.clone(), protect.clone());
                let (batch, hold) = (batch.clone(), hold.clone());
                Box::new(move || {
                    if class == Class::Load && col.abandoned() {
                        // a load nobody waits for (its job was cut or dropped) reads nothing:
                        // its DRAM slot and its key's protection go now
                        return;
                    }
                    let r = op(&files, &key, buf, &batch);
                    drop(batch);
                    // (a shared root's store: the last task closes the job's announcements)
                    drop(hold);
                    // released before the result is handed over: when the job's future sees
                    // its results, no protection of its own is left
                    drop(protect);
                    col.push((key, r));
                }) as Task
            })
            .collect();
        drop(protect);
        drop(batch);
        drop(hold);
        drop(col);
        if !self.engine.submit(class, tasks) {
            return None;
        }
        rx.await.ok()
    }

    /// A store job's blocks with their room: bounded, reserved for every block in the job's
    /// order before any is written, on one I/O thread (see `Shared::reserve_rooms`); a
    /// block refused room goes to `refused`, unwritten (its DRAM slot unpinned here).
    /// Unbounded: no room to reserve. `None` after shutdown. `protect` guards the keys.
    async fn with_rooms(
        &self,
        blocks: Vec<(BlockKey, kv_tier_core::BlockSource)>,
        protect: &Arc<ProtectGuard>,
        refused: &mut Vec<(BlockKey, Error)>,
    ) -> Option<
        Vec<(
            BlockKey,
            (kv_tier_core::BlockSource, Option<crate::capacity::Room>),
        )>,
    > {
        if self.shared.gc.is_none() || blocks.is_empty() {
            return Some(
                blocks
                    .into_iter()
                    .map(|(k, src)| (k, (src, None)))
                    .collect(),
            );
        }
        let keys: Vec<BlockKey> = blocks.iter().map(|(k, _)| *k).collect();
        let (files, guard) = (self.shared.clone(), protect.clone());
        let rooms = self
            .on_io(Class::Store, move || {
                let rooms = files.reserve_rooms(&keys);
                drop(guard);
                rooms
            })
            .await?;
        let mut with_room = Vec::with_capacity(blocks.len());
        for ((key, src), room) in blocks.into_iter().zip(rooms) {
            match room {
                Ok(room) => with_room.push((key, (src, room))),
                Err(e) => refused.push((key, e)),
            }
        }
        Some(with_room)
    }

    /// Runs `f` once on an I/O thread of `class` and returns what it returned; `None` after
    /// shutdown (then `f` is dropped unrun, or what it returned is dropped).
    async fn on_io<T: Send + 'static>(
        &self,
        class: Class,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (col, rx) = Collector::new(1);
        let task = Box::new(move || col.push(f())) as Task;
        if !self.engine.submit(class, vec![task]) {
            return None;
        }
        rx.await.ok()?.pop()
    }

    /// Signals the I/O and GC threads to stop; returns them, to be joined.
    fn stop_threads(&self) -> Vec<std::thread::JoinHandle<()>> {
        let mut threads = self.engine.stop();
        if let Some(gc) = &self.shared.gc {
            gc.stop();
        }
        if let Some(c) = &self.shared.coord {
            c.stop();
        }
        self.shared.stop_top_dirs.store(true, Ordering::Relaxed);
        threads.extend(std::mem::take(
            &mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()),
        ));
        threads
    }

    fn closed(&self) -> Error {
        Error::Shutdown {
            what: format!("fs tier `{}`", self.shared.name),
        }
    }
}

impl Drop for FsTier {
    fn drop(&mut self) {
        crate::io::join_threads(self.stop_threads());
        // (after `shutdown`, which wrote it, unchanged: not written again)
        if let Some(gc) = &self.shared.gc {
            gc.write_checkpoint();
        }
    }
}

#[async_trait]
impl SecondaryTier for FsTier {
    fn info(&self) -> TierInfo {
        let f = &self.shared;
        let capability = Capability::new()
            .persistent(true)
            .shared(true)
            .bounded(f.gc.is_some())
            .checksums(f.checksum == Checksum::Crc32c);
        TierInfo::new(&f.name, Medium::Storage, Locality::Local, capability)
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        bump(&self.shared.counters.own.keys_probed, keys.len() as u64);
        const CHUNK: usize = 64;
        let chunks: Vec<Vec<BlockKey>> = keys.chunks(CHUNK).map(<[BlockKey]>::to_vec).collect();
        let (col, rx) = Collector::new(chunks.len());
        let tasks: Vec<Task> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, chunk)| {
                let (files, col) = (self.shared.clone(), col.clone());
                Box::new(move || {
                    let rank_dir = files.root.join(files.ns.rank_dir_name());
                    let found: Vec<bool> = match files.fault(FsOp::Probe, &rank_dir) {
                        Ok(()) => chunk.iter().map(|k| files.exists(k)).collect(),
                        Err(_) => vec![false; chunk.len()],
                    };
                    col.push((i, found));
                }) as Task
            })
            .collect();
        drop(col);
        if !self.engine.submit(Class::Probe, tasks) {
            return Err(self.closed());
        }
        let mut parts = rx.await.map_err(|_| self.closed())?;
        parts.sort_by_key(|(i, _)| *i);
        Ok(parts.into_iter().flat_map(|(_, v)| v).collect())
    }

    /// A bounded tier answers from its index, which holds every block file it stored or
    /// found: its opening walk adopts what is on disk, rescans (`gc_rescan_interval_s`) and
    /// loads adopt files other processes wrote since. On a shared root only the leader keeps
    /// an index, and it answers only for what it holds (stores reach it through the
    /// members' journals, late); the rest is probed. An unbounded tier keeps no index:
    /// every key is probed.
    fn holds(&self, key: &BlockKey) -> Option<bool> {
        let gc = self.shared.gc.as_ref()?;
        if !gc.may_sweep() {
            return None;
        }
        match gc.indexed(key)? {
            true => Some(true),
            false if self.shared.coord.is_none() => Some(false),
            false => None,
        }
    }

    async fn store(&self, job: StoreJob) -> JobResult {
        let keys = job.keys();
        let links = job.links;
        let mut blocks = job.blocks;
        // The job's keys are protected from here until their writes end (the guard goes to
        // the tasks, see `run_blocks`): from before a shared root's credit announces them,
        // so this process's own sweep never deletes the file of a key it is about to store
        // (the store would find the path empty and publish a file no index counts).
        let protect = Arc::new(self.shared.protection.protect(&keys));
        let (refused, hold) = match &self.shared.coord {
            Some(c) => {
                // made before the wait for credit: if this future is dropped during it, the
                // stores announced so far are closed (`D`) as it drops
                let mut finish = crate::shared::Finish {
                    coord: c.clone(),
                    keys: Vec::new(),
                };
                let refused = c
                    .credit_for(&self.shared.name, &self.shut_down, &mut blocks, &mut finish)
                    .await;
                (refused, Some(Arc::new(finish)))
            }
            None => (Vec::new(), None),
        };
        let mut refused = refused;
        let Some(blocks) = self.with_rooms(blocks, &protect, &mut refused).await else {
            return JobResult::all_failed(keys, &self.closed());
        };
        let Some(results) = self
            .run_blocks(
                Class::Store,
                blocks,
                (protect, hold),
                |files, key, (src, room), batch| {
                    // reports the block stored if this store wrote it (a block found present
                    // was reported when written: the fs tier reports a removal only once the
                    // file is gone)
                    let r = files.store_block(key, &src, room, batch);
                    drop(src); // unpin the DRAM slot as soon as the bytes are written
                    r
                },
            )
            .await
        else {
            return JobResult::all_failed(keys, &self.closed());
        };
        if let Some(gc) = &self.shared.gc
            && !links.is_empty()
        {
            // the stored blocks' places in their chains (a block not indexed, its store
            // failed, is not linked): eviction takes a chain's tail first
            gc.link(&links);
        }
        let c = &self.shared.counters;
        let results = results
            .into_iter()
            .chain(refused.into_iter().map(|(k, e)| (k, Err(e))));
        JobResult::from_results(results, |e| {
            bump(&c.blocks.store_failures, 1);
            if matches!(e, Error::NoSpace { .. }) {
                bump(&c.own.no_space, 1);
            }
        })
    }

    async fn load(&self, job: LoadJob) -> JobResult {
        let keys = job.keys();
        if let Some(coord) = &self.shared.coord {
            // announced before the reads: the leader keeps what is about to be read
            coord.note_reads(&keys);
        }
        let progress = job.progress.clone();
        let blocks = job
            .blocks
            .into_iter()
            .map(|(k, sink)| (k, (sink, job.progress.clone())))
            .collect();
        let Some(results) = self
            .run_blocks(
                Class::Load,
                blocks,
                (Arc::new(self.shared.protection.protect(&keys)), None),
                // (a damaged file a load removes is reported removed by the removal)
                |files, key, (mut sink, progress), _| {
                    let r = files.load_block(key, &mut sink);
                    progress.finish(*key, sink, r)
                },
            )
            .await
        else {
            // shut down mid-job: the blocks that landed whole (and were reported so) are
            // loaded; the others fail
            return JobResult::landed_or(keys, &progress.keys(), &self.closed());
        };
        let c = &self.shared.counters.blocks;
        JobResult::from_results(results, |e| {
            if matches!(e, Error::NotFound { .. }) {
                bump(&c.load_misses, 1);
            } else {
                bump(&c.load_failures, 1);
            }
        })
    }

    /// Bounded: queues mtime stamps for the GC thread. Unbounded: stamps the keys' files on an
    /// I/O thread, as a task of the store queue (at most once per key per minute), so this process's reads count as
    /// recency for bounded tiers of other processes on the same root. Never blocks.
    fn touch(&self, keys: &[BlockKey]) {
        if let Some(c) = &self.shared.coord {
            c.note_reads(keys);
        }
        if let Some(gc) = &self.shared.gc {
            gc.queue_stamps(keys);
            return;
        }
        let due = self.shared.due_for_stamp(keys);
        if due.is_empty() {
            return;
        }
        let files = self.shared.clone();
        let task: Task = Box::new(move || {
            let now = crate::gc::to_ns(SystemTime::now());
            for k in due {
                // a missing file is nothing to stamp
                let _ = crate::gc::stamp(&files.ns.block_path(&files.root, &k), now);
            }
        });
        self.engine.submit(Class::Store, vec![task]);
    }

    /// Protects `keys` from the GC. If a sweep is unlinking one of them right now, waits for
    /// that one unlink (microseconds): once this returns, no file of `keys` is deleted while
    /// the guard lives.
    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        let guard = self.shared.protection.protect(keys);
        if let Some(gc) = &self.shared.gc {
            gc.wait_not_unlinking(keys);
        }
        guard
    }

    fn is_protected(&self, key: &BlockKey) -> bool {
        self.shared.protection.contains(key)
    }

    fn take_events(&self) -> Vec<TierEvent> {
        self.shared.events.take()
    }

    fn configure_events(&self, settings: kv_tier_core::EventSettings) {
        self.shared.events.configure(settings);
    }

    fn events_dropped(&self) -> u64 {
        self.shared.events.dropped()
    }

    /// [`FsTier::stats`] as a snapshot: bounded, its allocated bytes against its cap.
    fn stats(&self) -> kv_tier_core::TierSnapshot {
        let s = FsTier::stats(self);
        let snap = kv_tier_core::TierSnapshot::new("fs", s.blocks, &s);
        match &s.gc {
            Some(g) => snap.with_usage(g.bytes, Some(g.cap_bytes)),
            None => snap,
        }
    }

    /// Stops the I/O threads (after their current block) and the GC thread, and waits for them
    /// on tokio's blocking pool, never on an async worker; then removes the tier's mark on
    /// its root (`offline::holders` no longer lists it). A store job with blocks still queued
    /// fails whole with `Shutdown`, also for its blocks already written (they are published
    /// files, found by later lookups; only the report is conservative); a load job reports
    /// the blocks that landed whole loaded, and fails the others.
    async fn shutdown(&self) -> Result<()> {
        if self.shut_down.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let threads = self.stop_threads();
        let gc = self.shared.gc.clone();
        let joined = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
            // every thread that changes the index has ended: the checkpoint is the index
            // the next open starts from
            if let Some(gc) = gc {
                gc.write_checkpoint();
            }
        })
        .await;
        // nothing of this tier runs on the root any more
        drop(self.live.lock().unwrap_or_else(|p| p.into_inner()).take());
        joined.map_err(|e| Error::Backend {
            tier: self.shared.name.clone(),
            message: format!("joining the I/O threads failed: {e}"),
            transient: false,
        })
    }
}
