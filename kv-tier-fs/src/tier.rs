//! [`FsTier`]: blocks as files in vLLM's layout, read and written on dedicated I/O threads.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime};

use kv_tier_core::{
    AlignedBuf, BlockKey, BlockSink, BlockSource, BuildContext, Capability, Error, EventLog,
    JobResult, LoadJob, Locality, Medium, Namespace, ProtectGuard, ProtectionSet, Result,
    SecondaryTier, StoreJob, TierEvent, TierInfo, TierRegistry, TierSpec, async_trait,
};

use crate::config::{Checksum, FsTierConfig};
use crate::file;
use crate::gc::{Gc, SweepHook};
use crate::io::{Class, Collector, Engine, Task};

/// The operations a fault injector can fail (for tests of error paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FsOp {
    /// Opening a block file for a load.
    OpenRead,
    /// Reading a block file.
    Read,
    /// Creating a temp file for a store.
    CreateTmp,
    /// Writing a temp file.
    Write,
    /// Publishing a temp file as the block file.
    Publish,
    /// An existence probe of a batch of keys (the path is the rank directory); runs on an
    /// I/O thread.
    Probe,
}

/// Decides, per operation and path, whether to fail it with an error.
pub type FaultInjector = Arc<dyn Fn(FsOp, &Path) -> Option<io::Error> + Send + Sync>;

/// Counters of an [`FsTier`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FsStats {
    /// Block files published by this tier.
    pub blocks_written: u64,
    /// Stores skipped because the file existed (or another writer published first).
    pub stores_skipped: u64,
    /// Blocks whose store failed.
    pub store_failures: u64,
    /// Store failures for lack of space.
    pub no_space: u64,
    /// Blocks loaded whole.
    pub blocks_read: u64,
    /// Loads of missing files.
    pub load_misses: u64,
    /// Other load failures (corrupt or I/O errors).
    pub load_failures: u64,
    /// Files deleted because they were short, long or failed their checksum.
    pub corrupt_deleted: u64,
    /// Loads whose checksum did not match.
    pub checksum_mismatches: u64,
    /// Loads in checksum mode of files that carry no checksum (written by another tool).
    pub unverified_loads: u64,
    /// Bytes written to block files.
    pub bytes_written: u64,
    /// Bytes read from block files.
    pub bytes_read: u64,
    /// Stray temp files deleted at open.
    pub tmp_reaped: u64,
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
    /// Bytes of block files in the index (logical sizes).
    pub bytes: u64,
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
    /// Whether the GC thread is running (false after it died or with background GC off).
    pub thread_alive: bool,
    /// How long the last sweep took to choose its victims, in microseconds.
    pub last_decision_us: u64,
    /// How long the last sweep took in all, in microseconds.
    pub last_sweep_us: u64,
    /// How long the startup adopt walk took, in milliseconds.
    pub adopt_ms: u64,
    /// Sweeps that ended still over the cap (everything left was protected or within the
    /// grace window; each is logged).
    pub sweeps_over_cap: u64,
}

#[derive(Default)]
struct Counters {
    blocks_written: AtomicU64,
    stores_skipped: AtomicU64,
    store_failures: AtomicU64,
    no_space: AtomicU64,
    blocks_read: AtomicU64,
    load_misses: AtomicU64,
    load_failures: AtomicU64,
    corrupt_deleted: AtomicU64,
    checksum_mismatches: AtomicU64,
    unverified_loads: AtomicU64,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    tmp_reaped: AtomicU64,
    keys_probed: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Everything the I/O threads need, shared by reference count.
struct Files {
    name: String,
    root: PathBuf,
    ns: Namespace,
    block_size: usize,
    direct: bool,
    align: usize,
    checksum: Checksum,
    xattrs: bool,
    fsync: bool,
    faults: RwLock<Option<FaultInjector>>,
    counters: Counters,
    tmp_seq: AtomicU64,
    tmp_salt: u64,
    top_dirs_ready: AtomicBool,
    protection: ProtectionSet,
    events: EventLog,
    gc: Option<Gc>,
}

/// What a load did besides failing: whether it deleted the file.
fn key_from_path(ns: &Namespace, root: &Path, path: &Path) -> Option<BlockKey> {
    let rel = path.strip_prefix(root.join(ns.rank_dir_name())).ok()?;
    let mut parts = rel.iter().map(|p| p.to_str().unwrap_or(""));
    let (top, leaf, file) = (parts.next()?, parts.next()?, parts.next()?);
    crate::gc::parse_block(ns, top, leaf, file)
}

struct LoadFailure {
    error: Error,
    deleted: bool,
}

fn random_salt() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

/// Removes a temp file on drop unless disarmed.
struct TmpGuard<'a> {
    path: &'a Path,
    armed: bool,
}

impl Drop for TmpGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(self.path);
        }
    }
}

impl Files {
    fn fault(&self, op: FsOp, path: &Path) -> io::Result<()> {
        match &*self.faults.read().expect("fault injector") {
            Some(f) => f(op, path).map_or(Ok(()), Err),
            None => Ok(()),
        }
    }

    fn io_err(&self, op: &'static str, path: &Path, e: io::Error) -> Error {
        match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) => Error::NoSpace {
                tier: self.name.clone(),
                detail: format!("{op} {}: {e}", path.display()),
            },
            _ => Error::io(op, path, e),
        }
    }

    fn tmp_path(&self, dest: &Path) -> PathBuf {
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let r =
            (self.tmp_salt ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)).rotate_left((n % 63) as u32);
        let mut s = dest.as_os_str().to_os_string();
        s.push(format!("_{r:016x}.tmp"));
        s.into()
    }

    /// Writes one block: skip if present, temp file with O_EXCL, publish without replacing.
    /// `Ok(true)` when this call published the file.
    fn store_block(&self, key: &BlockKey, src: &BlockSource) -> Result<bool> {
        if src.len() != self.block_size {
            return Err(Error::WrongSize {
                key: *key,
                got: src.len(),
                expected: self.block_size,
            });
        }
        let dest = self.ns.block_path(&self.root, key);
        if let Some(gc) = &self.gc {
            // the key is protected by this job: a sweep that decided on it before may still
            // be unlinking it; look for the file only after that
            gc.wait_not_deleting(key);
        }
        if let Ok(m) = std::fs::symlink_metadata(&dest) {
            bump(&self.counters.stores_skipped, 1);
            if let Some(gc) = &self.gc {
                // stored again: the block is in use (and maybe written by another process)
                gc.on_seen(
                    *key,
                    m.len(),
                    crate::gc::to_ns(m.modified().unwrap_or(SystemTime::now())),
                );
                gc.touch(std::slice::from_ref(key));
            }
            return Ok(false);
        }
        let tmp = self.tmp_path(&dest);
        self.fault(FsOp::CreateTmp, &tmp)
            .map_err(|e| self.io_err("create", &tmp, e))?;
        let f = match file::create_excl(&tmp, self.direct) {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let parent = dest.parent().expect("block paths have a parent");
                std::fs::create_dir_all(parent).map_err(|e| self.io_err("mkdir", parent, e))?;
                file::create_excl(&tmp, self.direct).map_err(|e| self.io_err("create", &tmp, e))?
            }
            Err(e) => return Err(self.io_err("create", &tmp, e)),
        };
        let mut guard = TmpGuard {
            path: &tmp,
            armed: true,
        };
        let bounce;
        let data: &[u8] = if self.direct && !src.is_aligned(self.align) {
            bounce = AlignedBuf::copy_from(src.as_slice());
            bounce.as_slice()
        } else {
            src.as_slice()
        };
        self.fault(FsOp::Write, &tmp)
            .and_then(|()| file::write_full(&f, data))
            .map_err(|e| self.io_err("write", &tmp, e))?;
        let crc = (self.checksum == Checksum::Crc32c).then(|| crc32c::crc32c(data));
        if let (Some(crc), true) = (crc, self.xattrs) {
            file::set_crc_xattr(&f, crc).map_err(|e| self.io_err("fsetxattr", &tmp, e))?;
        }
        if self.fsync {
            f.sync_all().map_err(|e| self.io_err("fsync", &tmp, e))?;
        }
        drop(f);
        self.fault(FsOp::Publish, &dest)
            .map_err(|e| self.io_err("publish", &dest, e))?;
        let published =
            file::publish_noreplace(&tmp, &dest).map_err(|e| self.io_err("publish", &dest, e))?;
        if !published {
            // Another writer was first: its file stands, ours goes (the guard removes it).
            bump(&self.counters.stores_skipped, 1);
            return Ok(false);
        }
        guard.armed = false;
        drop(guard);
        if let (Some(crc), false) = (crc, self.xattrs) {
            self.write_sidecar(&dest, crc);
        }
        if self.fsync
            && let Some(parent) = dest.parent()
        {
            file::fsync_dir(parent).map_err(|e| self.io_err("fsync", parent, e))?;
        }
        bump(&self.counters.blocks_written, 1);
        bump(&self.counters.bytes_written, self.block_size as u64);
        if let Some(gc) = &self.gc {
            gc.on_published(*key, self.block_size as u64);
        }
        Ok(true)
    }

    /// Only the publisher writes the sidecar, after publishing: a `.bin` without one loads
    /// unverified, never with a wrong checksum.
    fn write_sidecar(&self, dest: &Path, crc: u32) {
        let side = file::sidecar_path(dest);
        let tmp = self.tmp_path(&side);
        let res =
            std::fs::write(&tmp, crc.to_le_bytes()).and_then(|()| std::fs::rename(&tmp, &side));
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %side.display(), error = %e, "could not write the checksum sidecar; the block will load unverified");
        }
    }

    fn delete_corrupt(&self, f: &File, path: &Path) -> bool {
        // Publishing never replaces, so the file at `path` is still ours unless someone
        // deleted it meanwhile; checking the inode keeps us from deleting a newer file.
        if !file::same_file(f, path) {
            return false;
        }
        let ok = std::fs::remove_file(path).is_ok();
        let _ = std::fs::remove_file(file::sidecar_path(path));
        if ok {
            bump(&self.counters.corrupt_deleted, 1);
            if let (Some(gc), Some(key)) = (&self.gc, key_from_path(&self.ns, &self.root, path)) {
                gc.on_removed(&key);
            }
        }
        ok
    }

    fn corrupt(&self, key: &BlockKey, f: &File, path: &Path, reason: String) -> LoadFailure {
        let deleted = self.delete_corrupt(f, path);
        tracing::warn!(tier = %self.name, %key, path = %path.display(), %reason, deleted, "corrupt block file");
        LoadFailure {
            error: Error::Corrupt {
                key: *key,
                tier: self.name.clone(),
                reason: format!("{reason} ({})", path.display()),
            },
            deleted,
        }
    }

    /// Reads one block straight into its sink.
    fn load_block(
        &self,
        key: &BlockKey,
        sink: &mut BlockSink,
    ) -> std::result::Result<(), LoadFailure> {
        let plain = |error| LoadFailure {
            error,
            deleted: false,
        };
        if sink.len() != self.block_size {
            return Err(plain(Error::WrongSize {
                key: *key,
                got: sink.len(),
                expected: self.block_size,
            }));
        }
        let path = self.ns.block_path(&self.root, key);
        let f = self
            .fault(FsOp::OpenRead, &path)
            .and_then(|()| file::open_read(&path, self.direct))
            .map_err(|e| {
                if e.kind() == io::ErrorKind::NotFound {
                    if let Some(gc) = &self.gc {
                        gc.on_removed(key);
                    }
                    plain(Error::NotFound {
                        key: *key,
                        tier: self.name.clone(),
                    })
                } else {
                    plain(self.io_err("open", &path, e))
                }
            })?;
        let size = f
            .metadata()
            .map_err(|e| plain(self.io_err("fstat", &path, e)))?
            .len();
        if size != self.block_size as u64 {
            return Err(self.corrupt(
                key,
                &f,
                &path,
                format!(
                    "file is {size} bytes, the block size is {}",
                    self.block_size
                ),
            ));
        }
        let n = if self.direct && !sink.is_aligned(self.align) {
            let mut bounce = AlignedBuf::zeroed(self.block_size);
            let n = self
                .fault(FsOp::Read, &path)
                .and_then(|()| file::read_full(&f, bounce.as_mut_slice()))
                .map_err(|e| plain(self.io_err("read", &path, e)))?;
            sink.as_mut_slice()[..n].copy_from_slice(&bounce.as_slice()[..n]);
            n
        } else {
            self.fault(FsOp::Read, &path)
                .and_then(|()| file::read_full(&f, sink.as_mut_slice()))
                .map_err(|e| plain(self.io_err("read", &path, e)))?
        };
        if n < self.block_size {
            return Err(self.corrupt(
                key,
                &f,
                &path,
                format!("read {n} of {} bytes", self.block_size),
            ));
        }
        if self.checksum == Checksum::Crc32c {
            let stored = if self.xattrs {
                file::get_crc_xattr(&f)
            } else {
                file::read_sidecar(&path)
            }
            .map_err(|e| plain(self.io_err("read checksum", &path, e)))?;
            match stored {
                Some(want) => {
                    let got = crc32c::crc32c(sink.as_slice());
                    if got != want {
                        bump(&self.counters.checksum_mismatches, 1);
                        return Err(self.corrupt(
                            key,
                            &f,
                            &path,
                            format!("crc32c is {got:08x}, stored {want:08x}"),
                        ));
                    }
                }
                None => bump(&self.counters.unverified_loads, 1),
            }
        }
        bump(&self.counters.blocks_read, 1);
        bump(&self.counters.bytes_read, self.block_size as u64);
        if let Some(gc) = &self.gc {
            gc.touch(std::slice::from_ref(key));
        }
        Ok(())
    }

    fn rank_dir(&self) -> PathBuf {
        self.root.join(self.ns.rank_dir_name())
    }

    /// One sweep (when over the cap); emits `BlockRemoved` for what it deleted.
    fn sweep(&self) -> usize {
        let Some(gc) = &self.gc else { return 0 };
        let report = gc.sweep(&self.ns, &self.root, &self.protection);
        let n = report.deleted.len();
        self.events.push(report.deleted, true);
        n
    }

    /// A full walk of the tree: adopts new files, forgets (and reports) vanished ones.
    fn rescan(&self, tmp_age: Option<Duration>) {
        let Some(gc) = &self.gc else { return };
        let w = crate::gc::walk(&self.ns, &self.rank_dir(), 4, tmp_age, SystemTime::now());
        let gone = gc.adopt(w.blocks);
        gc.counters.rescans.fetch_add(1, Ordering::Relaxed);
        gc.counters
            .external_removals
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        self.events.push(gone, true);
    }

    /// Whether `key`'s file exists. A key a sweep has chosen is looked at only after its
    /// unlink: the probe's caller protects its keys first, so the answer holds until the
    /// protection ends.
    fn exists(&self, key: &BlockKey) -> bool {
        if let Some(gc) = &self.gc {
            gc.wait_not_deleting(key);
        }
        std::fs::symlink_metadata(self.ns.block_path(&self.root, key)).is_ok()
    }
}

/// The filesystem tier.
///
/// Blocks are files in vLLM's layout under `root_dir` (see `spec/vllm-layout.md`): a cache
/// directory written by vLLM's fs tier is readable here and the other way round. All I/O runs
/// on the tier's own read and write threads; the async methods only queue work and await it.
pub struct FsTier {
    files: Arc<Files>,
    engine: Engine,
    gc_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    shut_down: AtomicBool,
    cfg: FsTierConfig,
}

impl std::fmt::Debug for FsTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FsTier")
            .field("name", &self.files.name)
            .field("root", &self.files.root)
            .field("direct_io", &self.files.direct)
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
        if block_size == 0 {
            return Err(Error::config("block_size_bytes", "must be positive"));
        }
        let name = name.into();
        let root = cfg.root_dir.clone();
        prepare_root(&root)?;
        let ns_dir = ns.namespace_dir(&root);
        std::fs::create_dir_all(&ns_dir).map_err(|e| Error::io("mkdir", &ns_dir, e))?;
        write_or_check_config(&ns, &root)?;
        let rank_dir = root.join(ns.rank_dir_name());
        std::fs::create_dir_all(&rank_dir).map_err(|e| Error::io("mkdir", &rank_dir, e))?;
        let probe = probe_dir(&rank_dir, cfg.direct_io, cfg.checksum == Checksum::Crc32c)?;
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
        let files = Arc::new(Files {
            name: name.clone(),
            root: root.clone(),
            ns,
            block_size,
            direct,
            align: probe.direct_align.unwrap_or(kv_tier_core::PAGE_SIZE),
            checksum: cfg.checksum,
            xattrs: probe.xattrs,
            fsync: cfg.fsync,
            faults: RwLock::new(None),
            counters: Counters::default(),
            tmp_seq: AtomicU64::new(0),
            tmp_salt: random_salt(),
            top_dirs_ready: AtomicBool::new(false),
            protection: ProtectionSet::new(),
            events: EventLog::new(name.clone(), Medium::Storage, Locality::Local),
            gc: cfg.gc().map(Gc::new),
        });
        if let Some(gc) = &files.gc {
            gc.sidecars.store(
                cfg.checksum == Checksum::Crc32c && !probe.xattrs,
                Ordering::Relaxed,
            );
        }
        let tmp_age = Duration::from_secs(cfg.tmp_reap_age_s);
        let mut reaped = reap_tmp(std::slice::from_ref(&ns_dir), tmp_age);
        match &files.gc {
            None => reaped += reap_tmp(std::slice::from_ref(&rank_dir), tmp_age),
            Some(gc) => {
                // One walk adopts what is on disk (with its mtimes) and reaps temp files.
                let t = std::time::Instant::now();
                let threads = cfg.n_read_threads.clamp(1, 8);
                let w = crate::gc::walk(
                    &files.ns,
                    &rank_dir,
                    threads,
                    Some(tmp_age),
                    SystemTime::now(),
                );
                reaped += w.tmp_reaped;
                let n = w.blocks.len();
                gc.adopt(w.blocks);
                gc.counters
                    .adopt_ms
                    .store(t.elapsed().as_millis() as u64, Ordering::Relaxed);
                tracing::info!(
                    files = n,
                    bytes = gc.total_bytes(),
                    ms = t.elapsed().as_millis() as u64,
                    foreign = w.foreign,
                    "fs tier adopted its directory"
                );
            }
        }
        spawn_top_dirs(files.clone());
        bump(&files.counters.tmp_reaped, reaped);
        if reaped > 0 {
            tracing::info!(reaped, root = %root.display(), "deleted stray temp files of killed writers");
        }
        let engine = Engine::start(cfg.n_read_threads, cfg.n_write_threads)
            .map_err(|e| Error::io("spawn I/O threads", &root, e))?;
        tracing::debug!(root = %root.display(), direct, xattrs = probe.xattrs, "fs tier open");
        let gc_thread = match &files.gc {
            Some(gc) if gc.cfg.background => {
                let f = files.clone();
                gc.alive.store(true, Ordering::SeqCst);
                let h = std::thread::Builder::new()
                    .name("kv-fs-gc".into())
                    .spawn(move || gc_loop(f))
                    .map_err(|e| Error::io("spawn GC thread", &root, e))?;
                Some(h)
            }
            _ => None,
        };
        Ok(Self {
            files,
            engine,
            gc_thread: Mutex::new(gc_thread),
            shut_down: AtomicBool::new(false),
            cfg,
        })
    }

    /// Registers the type `"fs"` in `registry`.
    pub fn register(registry: &mut TierRegistry) {
        registry.register("fs", FsBuilder);
    }

    /// The options the tier was opened with.
    pub fn config(&self) -> &FsTierConfig {
        &self.cfg
    }

    /// The namespace.
    pub fn namespace(&self) -> &Namespace {
        &self.files.ns
    }

    /// The path of `key`'s block file.
    pub fn block_path(&self, key: &BlockKey) -> PathBuf {
        self.files.ns.block_path(&self.files.root, key)
    }

    /// Counters.
    pub fn stats(&self) -> FsStats {
        let c = &self.files.counters;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        FsStats {
            blocks_written: g(&c.blocks_written),
            stores_skipped: g(&c.stores_skipped),
            store_failures: g(&c.store_failures),
            no_space: g(&c.no_space),
            blocks_read: g(&c.blocks_read),
            load_misses: g(&c.load_misses),
            load_failures: g(&c.load_failures),
            corrupt_deleted: g(&c.corrupt_deleted),
            checksum_mismatches: g(&c.checksum_mismatches),
            unverified_loads: g(&c.unverified_loads),
            bytes_written: g(&c.bytes_written),
            bytes_read: g(&c.bytes_read),
            tmp_reaped: g(&c.tmp_reaped),
            keys_probed: g(&c.keys_probed),
            direct_io: self.files.direct,
            top_dirs_ready: self.files.top_dirs_ready.load(Ordering::Acquire),
            gc: self.files.gc.as_ref().map(|gc| {
                let c = &gc.counters;
                GcStats {
                    cap_bytes: gc.cfg.cap_bytes,
                    bytes: gc.total_bytes(),
                    files: gc.files() as u64,
                    sweeps: g(&c.sweeps),
                    swept_files: g(&c.swept_files),
                    swept_bytes: g(&c.swept_bytes),
                    skipped_in_flight: g(&c.skipped_in_flight),
                    skipped_in_grace: g(&c.skipped_in_grace),
                    skipped_recent: g(&c.skipped_recent),
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
                    sweeps_over_cap: g(&c.sweeps_over_cap),
                }
            }),
        }
    }

    /// Installs (or with `None` removes) a fault injector: every file operation asks it first
    /// and fails with the error it returns. For tests of error paths.
    pub fn set_fault_injector(&self, f: Option<FaultInjector>) {
        *self.files.faults.write().expect("fault injector") = f;
    }

    /// Runs `op` once per block on the I/O threads (one task per block, so a job spreads over
    /// every idle thread), with the keys protected meanwhile. `None` after shutdown.
    async fn run_blocks<B, R>(
        &self,
        class: Class,
        blocks: Vec<(BlockKey, B)>,
        op: fn(&Files, &BlockKey, B) -> R,
    ) -> Option<Vec<(BlockKey, R)>>
    where
        B: Send + 'static,
        R: Send + 'static,
    {
        if blocks.is_empty() {
            return Some(Vec::new());
        }
        let keys: Vec<BlockKey> = blocks.iter().map(|(k, _)| *k).collect();
        // Held by the tasks, not by this future: if the caller drops the future, the keys
        // stay protected until the I/O on them has ended.
        let protect = Arc::new(self.files.protection.protect(&keys));
        let (col, rx) = Collector::new(blocks.len());
        let tasks: Vec<Task> = blocks
            .into_iter()
            .map(|(key, buf)| {
                let (files, col, protect) = (self.files.clone(), col.clone(), protect.clone());
                Box::new(move || {
                    let r = op(&files, &key, buf);
                    // released before the result is handed over: when the job's future sees
                    // its results, no protection of its own is left
                    drop(protect);
                    col.push((key, r));
                }) as Task
            })
            .collect();
        drop(protect);
        drop(col);
        if !self.engine.submit(class, tasks) {
            return None;
        }
        rx.await.ok()
    }

    /// Signals the I/O and GC threads to stop; returns them, to be joined.
    fn stop_threads(&self) -> Vec<std::thread::JoinHandle<()>> {
        let mut threads = self.engine.stop();
        if let Some(gc) = &self.files.gc {
            gc.stop();
        }
        threads.extend(self.gc_thread.lock().expect("gc thread").take());
        threads
    }

    fn gc(&self) -> Result<&Gc> {
        self.files.gc.as_ref().ok_or_else(|| {
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
        Ok(self.files.sweep())
    }

    /// Applies the queued mtime stamps now, on the caller's thread.
    pub fn gc_apply_stamps_now(&self) -> Result<()> {
        self.gc()?.apply_stamps(&self.files.ns, &self.files.root);
        Ok(())
    }

    /// Walks the tree now and repairs the index (external deletes, files of other processes).
    pub fn gc_rescan_now(&self) -> Result<()> {
        self.gc()?;
        self.files.rescan(None);
        Ok(())
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

    fn closed(&self) -> Error {
        Error::Shutdown {
            what: format!("fs tier `{}`", self.files.name),
        }
    }
}

impl Drop for FsTier {
    fn drop(&mut self) {
        crate::io::join_threads(self.stop_threads());
    }
}

/// The GC thread: applies stamps every tick, sweeps when over the cap (each interval, or at
/// once when a store crossed the cap), rescans now and then. An error or panic is logged and
/// counted and the loop goes on; if the thread ends anyway, the stats say so.
fn gc_loop(files: Arc<Files>) {
    struct Alive<'a>(&'a Gc);
    impl Drop for Alive<'_> {
        fn drop(&mut self) {
            self.0.alive.store(false, Ordering::SeqCst);
        }
    }
    let gc = files.gc.as_ref().expect("gc thread without gc");
    let _alive = Alive(gc);
    let tick = gc.cfg.interval.min(Duration::from_secs(1));
    let now = std::time::Instant::now();
    let mut next_sweep = now + gc.cfg.interval;
    let mut next_rescan = gc.cfg.rescan_interval.map(|d| now + d);
    let tmp_age = Some(Duration::from_secs(600));
    loop {
        let (stop, kicked) = gc.wait(tick);
        if stop {
            return;
        }
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // Capacity first: keys with a stamp still pending are skipped by the sweep anyway.
            let now = std::time::Instant::now();
            let due = now >= next_sweep;
            if due {
                next_sweep = now + gc.cfg.interval;
            }
            if (due || kicked) && gc.over_cap() {
                files.sweep();
            }
            gc.apply_stamps(&files.ns, &files.root);
            if let Some(at) = next_rescan
                && now >= at
            {
                next_rescan = gc.cfg.rescan_interval.map(|d| now + d);
                files.rescan(tmp_age);
            }
        }));
        if step.is_err() {
            gc.counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(tier = %files.name, "the fs tier's GC step panicked; the GC goes on");
        }
    }
}

struct FsBuilder;

#[async_trait]
impl kv_tier_core::TierBuilder for FsBuilder {
    async fn build(&self, spec: &TierSpec, ctx: &BuildContext) -> Result<Arc<dyn SecondaryTier>> {
        let cfg = FsTierConfig::from_spec(spec)?;
        let ns = ctx.require_namespace()?.clone();
        let (name, bs) = (ctx.name.clone(), ctx.block_size);
        let tier = tokio::task::spawn_blocking(move || FsTier::open(name, cfg, ns, bs))
            .await
            .map_err(|e| Error::Backend {
                tier: ctx.name.clone(),
                message: format!("opening the tier panicked: {e}"),
                transient: false,
            })??;
        Ok(Arc::new(tier))
    }
}

fn prepare_root(root: &Path) -> Result<()> {
    match std::fs::metadata(root) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::config(
            "root_dir",
            format!("{} exists and is not a directory", root.display()),
        )),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::create_dir_all(root).map_err(|e| {
                Error::config("root_dir", format!("cannot create {}: {e}", root.display()))
            })
        }
        Err(e) => Err(Error::config(
            "root_dir",
            format!("cannot use {}: {e}", root.display()),
        )),
    }
}

/// Writes `config.json` once, atomically and only if absent; otherwise checks that the one
/// present describes this namespace (layouts are never mixed).
fn write_or_check_config(ns: &Namespace, root: &Path) -> Result<()> {
    let path = ns.config_path(root);
    for _ in 0..3 {
        match std::fs::read_to_string(&path) {
            Ok(text) => return ns.check_config_json(&path, &text),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("read", &path, e)),
        }
        let mut tmp = path.as_os_str().to_os_string();
        tmp.push(format!("_{:016x}.tmp", random_salt()));
        let tmp = PathBuf::from(tmp);
        std::fs::write(&tmp, ns.config_json()).map_err(|e| Error::io("write", &tmp, e))?;
        let published = file::publish_noreplace(&tmp, &path);
        let _ = std::fs::remove_file(&tmp);
        if published.map_err(|e| Error::io("publish", &path, e))? {
            return Ok(());
        }
        // Another process wrote it first: check theirs.
    }
    Err(Error::io(
        "write",
        &path,
        io::Error::other("config.json kept appearing and disappearing"),
    ))
}

struct Probe {
    direct_align: Option<usize>,
    xattrs: bool,
}

/// One probe file per open: writability, O_DIRECT (and its alignment), user xattrs.
fn probe_dir(dir: &Path, want_direct: bool, want_xattrs: bool) -> Result<Probe> {
    let path = dir.join(format!(".kv-tier-probe-{:016x}.tmp", random_salt()));
    let unwritable = |e: io::Error| {
        Error::config(
            "root_dir",
            format!("{} is not writable: {e}", dir.display()),
        )
    };
    let mut direct_align = None;
    if want_direct {
        match file::create_excl(&path, true) {
            Ok(f) => {
                for align in [512usize, 4096] {
                    let buf = AlignedBuf::zeroed(align);
                    use std::os::unix::fs::FileExt;
                    if f.write_at(buf.as_slice(), 0).is_ok() {
                        direct_align = Some(align);
                        break;
                    }
                }
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
            Err(e) => return Err(unwritable(e)),
        }
        // O_CREAT may have created the file before O_DIRECT was refused.
        let _ = std::fs::remove_file(&path);
        if direct_align.is_none() {
            tracing::warn!(dir = %dir.display(), "the filesystem refuses O_DIRECT; falling back to buffered I/O");
        }
    }
    let f = file::create_excl(&path, false).map_err(unwritable)?;
    let xattrs = want_xattrs
        && {
            let ok = file::set_crc_xattr(&f, 0).is_ok();
            if !ok {
                tracing::warn!(dir = %dir.display(), "no user xattrs here; checksums go to .crc32c sidecar files");
            }
            ok
        };
    drop(f);
    let _ = std::fs::remove_file(&path);
    Ok(Probe {
        direct_align,
        xattrs,
    })
}

/// Creates the layout's 4,096 first-level directories (`<hex[0..3]>`) in the background.
///
/// Creating a first-level directory is the expensive part of a store into a fresh cache (on
/// ext4 it halves the throughput of 256 KiB stores, while a second-level directory inside an
/// existing one costs little); doing them all once, off the I/O path, takes that cost away.
/// Stores that arrive first create what they need themselves. Empty directories are harmless
/// to vLLM's reader.
fn spawn_top_dirs(files: Arc<Files>) {
    let spawned = std::thread::Builder::new()
        .name("kv-fs-dirs".into())
        .spawn(move || {
            let rank_dir = files.root.join(files.ns.rank_dir_name());
            for i in 0..4096u32 {
                let d = rank_dir.join(format!("{i:03x}"));
                if let Err(e) = std::fs::create_dir(&d)
                    && e.kind() != io::ErrorKind::AlreadyExists
                {
                    tracing::debug!(dir = %d.display(), error = %e, "could not pre-create a layout directory");
                    return;
                }
            }
            files.top_dirs_ready.store(true, Ordering::Release);
        });
    if let Err(e) = spawned {
        tracing::debug!(error = %e, "no thread to pre-create layout directories");
    }
}

/// Deletes `*.tmp` files older than `age` below `dirs`. Returns how many.
fn reap_tmp(dirs: &[PathBuf], age: Duration) -> u64 {
    let now = SystemTime::now();
    let mut n = 0;
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(ft) = e.file_type() else { continue };
            let p = e.path();
            if ft.is_dir() {
                if !dirs.contains(&p) {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "tmp") {
                let old = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .map(|m| now.duration_since(m).unwrap_or_default() >= age)
                    .unwrap_or(false);
                if old && std::fs::remove_file(&p).is_ok() {
                    n += 1;
                }
            }
        }
    }
    n
}

#[async_trait]
impl SecondaryTier for FsTier {
    fn info(&self) -> TierInfo {
        TierInfo {
            name: self.files.name.clone(),
            medium: Medium::Storage,
            locality: Locality::Local,
            capability: Capability {
                persistent: true,
                bounded: false,
                checksums: self.files.checksum == Checksum::Crc32c,
                shared: true,
            },
        }
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        bump(&self.files.counters.keys_probed, keys.len() as u64);
        const CHUNK: usize = 64;
        let chunks: Vec<Vec<BlockKey>> = keys.chunks(CHUNK).map(<[BlockKey]>::to_vec).collect();
        let (col, rx) = Collector::new(chunks.len());
        let tasks: Vec<Task> = chunks
            .into_iter()
            .enumerate()
            .map(|(i, chunk)| {
                let (files, col) = (self.files.clone(), col.clone());
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

    async fn store(&self, job: StoreJob) -> JobResult {
        let keys = job.keys();
        let Some(results) = self
            .run_blocks(Class::Store, job.blocks, |files, key, src| {
                let r = files.store_block(key, &src);
                drop(src); // unpin the DRAM slot as soon as the bytes are written
                r
            })
            .await
        else {
            return JobResult::all_failed(keys, &self.closed());
        };
        let mut res = JobResult::default();
        let mut published = Vec::new();
        for (key, r) in results {
            match r {
                Ok(p) => {
                    if p {
                        published.push(key);
                    }
                    res.ok.push(key);
                }
                Err(e) => {
                    bump(&self.files.counters.store_failures, 1);
                    if matches!(e, Error::NoSpace { .. }) {
                        bump(&self.files.counters.no_space, 1);
                    }
                    res.failed.push((key, e));
                }
            }
        }
        self.files.events.push(published, false);
        res
    }

    async fn load(&self, job: LoadJob) -> JobResult {
        let keys = job.keys();
        let Some(results) = self
            .run_blocks(Class::Load, job.blocks, |files, key, mut sink| {
                files.load_block(key, &mut sink)
            })
            .await
        else {
            return JobResult::all_failed(keys, &self.closed());
        };
        let mut res = JobResult::default();
        let mut deleted = Vec::new();
        for (key, r) in results {
            match r {
                Ok(()) => res.ok.push(key),
                Err(LoadFailure { error, deleted: d }) => {
                    if matches!(error, Error::NotFound { .. }) {
                        bump(&self.files.counters.load_misses, 1);
                    } else {
                        bump(&self.files.counters.load_failures, 1);
                    }
                    if d {
                        deleted.push(key);
                    }
                    res.failed.push((key, error));
                }
            }
        }
        self.files.events.push(deleted, true);
        res
    }

    fn touch(&self, keys: &[BlockKey]) {
        // Unbounded tiers keep no recency (as before); bounded ones queue mtime stamps.
        if let Some(gc) = &self.files.gc {
            gc.touch(keys);
        }
    }

    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.files.protection.protect(keys)
    }

    fn is_protected(&self, key: &BlockKey) -> bool {
        self.files.protection.contains(key)
    }

    fn take_events(&self) -> Vec<TierEvent> {
        self.files.events.take()
    }

    /// Stops the I/O threads (after their current block; queued blocks fail with
    /// `Shutdown`) and the GC thread, and waits for them on tokio's blocking pool, never on
    /// an async worker.
    async fn shutdown(&self) -> Result<()> {
        if self.shut_down.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        let threads = self.stop_threads();
        let joined = tokio::task::spawn_blocking(move || {
            for t in threads {
                let _ = t.join();
            }
        })
        .await;
        joined.map_err(|e| Error::Backend {
            tier: self.files.name.clone(),
            message: format!("joining the I/O threads failed: {e}"),
            transient: false,
        })
    }
}
