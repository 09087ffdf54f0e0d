//! Reading and writing one block file: publish-if-absent stores, verified loads, damage
//! handling; what the I/O threads run.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use kv_tier_core::{
    AlignedBuf, BlockKey, BlockSink, BlockSource, Error, EventLog, Namespace, ProtectionSet, Result,
};

use crate::config::Checksum;
use crate::file;
use crate::gc::{Gc, Goal};

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

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) blocks_written: AtomicU64,
    pub(crate) stores_skipped: AtomicU64,
    pub(crate) store_failures: AtomicU64,
    pub(crate) no_space: AtomicU64,
    pub(crate) blocks_read: AtomicU64,
    pub(crate) load_misses: AtomicU64,
    pub(crate) load_failures: AtomicU64,
    pub(crate) corrupt_deleted: AtomicU64,
    pub(crate) checksum_mismatches: AtomicU64,
    pub(crate) unverified_loads: AtomicU64,
    pub(crate) unverified_refused: AtomicU64,
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) tmp_reaped: AtomicU64,
    pub(crate) sidecars_reaped: AtomicU64,
    pub(crate) keys_probed: AtomicU64,
}

pub(crate) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Everything the I/O threads need, shared by reference count.
pub(crate) struct Files {
    pub(crate) name: String,
    pub(crate) root: PathBuf,
    pub(crate) ns: Namespace,
    pub(crate) block_size: usize,
    /// Allocated bytes of one block file.
    pub(crate) alloc_block: u64,
    /// Allocated bytes of one directory.
    pub(crate) dir_alloc: u64,
    pub(crate) direct: bool,
    pub(crate) align: usize,
    pub(crate) checksum: Checksum,
    pub(crate) accept_unverified: bool,
    pub(crate) xattrs: bool,
    /// See [`SIDECAR_GRACE`].
    pub(crate) sidecar_grace_ns: AtomicU64,
    pub(crate) fsync: bool,
    pub(crate) faults: RwLock<Option<FaultInjector>>,
    pub(crate) counters: Counters,
    pub(crate) tmp_seq: AtomicU64,
    pub(crate) tmp_salt: u64,
    pub(crate) top_dirs_ready: AtomicBool,
    pub(crate) protection: ProtectionSet,
    pub(crate) events: Arc<EventLog>,
    pub(crate) gc: Option<Gc>,
}

/// What a load did besides failing: whether it deleted the file.
pub(crate) struct LoadFailure {
    pub(crate) error: Error,
    pub(crate) deleted: bool,
}

pub(crate) fn random_salt() -> u64 {
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

/// Bytes a store reserved under the hard ceiling; released on drop unless taken over by the
/// published file's entry.
struct Room<'a> {
    gc: &'a Gc,
    bytes: u64,
}

impl Room<'_> {
    fn take(&mut self) -> u64 {
        std::mem::take(&mut self.bytes)
    }
}

impl Drop for Room<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.gc.unreserve(self.bytes);
        }
    }
}

/// Removes a temp file on drop unless disarmed.
struct TmpGuard<'a> {
    path: &'a Path,
    pub(crate) armed: bool,
}

impl Drop for TmpGuard<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = std::fs::remove_file(self.path);
        }
    }
}

/// How long after its publication a block may lack its checksum sidecar by default (the
/// publisher writes it right after publishing): a load then fails without removing the block.
pub(crate) const SIDECAR_GRACE: Duration = Duration::from_secs(2);

impl Files {
    /// Whether `m` (a block file without its sidecar) was published within the sidecar grace
    /// (its inode changed that recently).
    fn sidecar_pending(&self, m: &std::fs::Metadata) -> bool {
        if self.xattrs {
            return false; // the xattr is set before publishing: there is no window
        }
        let grace = Duration::from_nanos(self.sidecar_grace_ns.load(Ordering::Relaxed));
        let changed = std::time::UNIX_EPOCH
            + Duration::new(
                m.ctime().max(0) as u64,
                m.ctime_nsec().clamp(0, 999_999_999) as u32,
            );
        SystemTime::now()
            .duration_since(changed)
            .map_or(true, |age| age < grace)
    }

    pub(crate) fn fault(&self, op: FsOp, path: &Path) -> io::Result<()> {
        match &*self.faults.read().expect("fault injector") {
            Some(f) => f(op, path).map_or(Ok(()), Err),
            None => Ok(()),
        }
    }

    pub(crate) fn io_err(&self, op: &'static str, path: &Path, e: io::Error) -> Error {
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

    /// Writes one block: skip if a regular file is present (with a checksum, when they are
    /// required), temp file with O_EXCL, publish without replacing. Damage at the block's path
    /// (a directory, a link, a file without the required checksum) is removed first and
    /// reported. `Ok(true)` when this call published the file.
    pub(crate) fn store_block(&self, key: &BlockKey, src: &BlockSource) -> Result<bool> {
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
            match self.present_damage(&dest, &m) {
                None => {
                    bump(&self.counters.stores_skipped, 1);
                    if let Some(gc) = &self.gc {
                        // stored again: the block is in use (and maybe written by another
                        // process)
                        gc.on_seen(*key, &m);
                        gc.touch(std::slice::from_ref(key));
                    }
                    return Ok(false);
                }
                Some(reason) => {
                    if self.remove_damaged(key, &dest, None) {
                        tracing::warn!(tier = %self.name, %key, path = %dest.display(), %reason, "removed a damaged block before storing it again");
                        self.events.push(vec![*key], true);
                    }
                }
            }
        }
        let room = self.reserve_room(key)?;
        let written = match self.write_block(&dest, src) {
            Err(Error::NoSpace { .. }) if self.gc.is_some() => {
                // The filesystem is full (a cap larger than the disk, or other files): make
                // room by the oldest files and try once more.
                if let Some(gc) = &self.gc {
                    gc.counters.enospc_sweeps.fetch_add(1, Ordering::Relaxed);
                }
                self.sweep(Goal::Space);
                self.write_block(&dest, src)
            }
            r => r,
        }?;
        if !written {
            // Another writer was first: its file stands.
            bump(&self.counters.stores_skipped, 1);
            return Ok(false);
        }
        bump(&self.counters.blocks_written, 1);
        bump(&self.counters.bytes_written, self.block_size as u64);
        if let (Some(gc), Some(mut room)) = (&self.gc, room) {
            gc.on_published(*key, gc.file_bytes(self.alloc_block), room.take());
        }
        Ok(true)
    }

    /// Reserves room for a new block file under the hard ceiling (bounded mode): when the
    /// total would cross it, runs a sweep for room here, or, if another sweep runs, waits
    /// for it (at most a second). Fails with `NoSpace` when no room can be made (everything
    /// left is protected or being written): the block is then not in this tier.
    fn reserve_room(&self, key: &BlockKey) -> Result<Option<Room<'_>>> {
        let Some(gc) = &self.gc else { return Ok(None) };
        let file_bytes = gc.file_bytes(self.alloc_block);
        let deadline = crate::gc::room_deadline();
        let mut waited = false;
        loop {
            if let Some(bytes) = gc.try_reserve(key, file_bytes) {
                return Ok(Some(Room { gc, bytes }));
            }
            if !waited {
                waited = true;
                gc.counters.store_waits.fetch_add(1, Ordering::Relaxed);
            }
            let hopeless = if gc.sweep_running() {
                gc.wait_for_room(Duration::from_millis(20));
                std::time::Instant::now() >= deadline || gc.stopped()
            } else {
                self.sweep(Goal::Room(file_bytes + 2 * self.dir_unit())) == 0
                    && gc
                        .try_reserve(key, file_bytes)
                        .map(|b| gc.unreserve(b))
                        .is_none()
            };
            if hopeless {
                gc.counters.no_room.fetch_add(1, Ordering::Relaxed);
                return Err(Error::NoSpace {
                    tier: self.name.clone(),
                    detail: format!(
                        "block {key} does not fit under the hard ceiling of {} bytes and no sweep could make room (everything left is protected or being written)",
                        gc.cfg.hard_bytes
                    ),
                });
            }
        }
    }

    fn dir_unit(&self) -> u64 {
        self.dir_alloc
    }

    /// Writes `src` to a temp file next to `dest` and publishes it there without replacing.
    /// `Ok(false)` when another writer published first.
    fn write_block(&self, dest: &Path, src: &BlockSource) -> Result<bool> {
        let tmp = self.tmp_path(dest);
        self.fault(FsOp::CreateTmp, &tmp)
            .map_err(|e| self.io_err("create", &tmp, e))?;
        let mut tries = 0;
        let f = loop {
            match file::create_excl(&tmp, self.direct) {
                Ok(f) => break f,
                // the leaf directory does not exist (yet, or any more: a sweep removes
                // emptied ones)
                Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 3 => {
                    tries += 1;
                    let parent = dest.parent().expect("block paths have a parent");
                    std::fs::create_dir_all(parent).map_err(|e| self.io_err("mkdir", parent, e))?;
                }
                Err(e) => return Err(self.io_err("create", &tmp, e)),
            }
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
        let mut sidecar = None;
        if let Some(crc) = crc {
            if self.xattrs {
                file::set_crc_xattr(&f, crc).map_err(|e| self.io_err("fsetxattr", &tmp, e))?;
            } else {
                let ino = f
                    .metadata()
                    .map_err(|e| self.io_err("fstat", &tmp, e))?
                    .ino();
                sidecar = Some(file::sidecar_bytes(crc, ino));
            }
        }
        if self.fsync {
            f.sync_all().map_err(|e| self.io_err("fsync", &tmp, e))?;
        }
        drop(f);
        self.fault(FsOp::Publish, dest)
            .map_err(|e| self.io_err("publish", dest, e))?;
        let published =
            file::publish_noreplace(&tmp, dest).map_err(|e| self.io_err("publish", dest, e))?;
        if !published {
            return Ok(false); // the guard removes our temp file
        }
        guard.armed = false;
        drop(guard);
        if let Some(bytes) = sidecar {
            self.write_sidecar(dest, &bytes);
        }
        if self.fsync
            && let Some(parent) = dest.parent()
        {
            file::fsync_dir(parent).map_err(|e| self.io_err("fsync", parent, e))?;
        }
        Ok(true)
    }

    /// Why a present path cannot stand for its block (`None`: it can): not a regular file, or
    /// (checksums required) a regular file whose checksum is missing or malformed. Cheap: one
    /// `lgetxattr` or sidecar read, no data.
    fn present_damage(&self, path: &Path, m: &std::fs::Metadata) -> Option<String> {
        if !m.is_file() {
            return Some(format!("not a regular file ({:?})", m.file_type()));
        }
        if self.checksum != Checksum::Crc32c || self.accept_unverified {
            return None;
        }
        let stored = if self.xattrs {
            file::get_crc_xattr_path(path)
        } else {
            file::read_sidecar(path, m.ino())
        };
        match stored {
            Ok(file::StoredCrc::Crc(_)) | Err(_) => None,
            Ok(file::StoredCrc::Missing) if self.sidecar_pending(m) => None,
            Ok(file::StoredCrc::Missing) => Some("it has no checksum".into()),
            Ok(file::StoredCrc::Malformed(r)) => Some(r),
        }
    }

    /// Only the publisher writes the sidecar, after publishing (a reader that finds the block
    /// within [`SIDECAR_GRACE`] of its publication and no sidecar yet fails the load without
    /// calling the block damaged).
    fn write_sidecar(&self, dest: &Path, bytes: &[u8]) {
        let side = file::sidecar_path(dest);
        let tmp = self.tmp_path(&side);
        let res = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &side));
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %side.display(), error = %e, "could not write the checksum sidecar; the block will be refused as unverified");
        }
    }

    /// Removes what stands at a block's path (a file, a link or a whole directory) and its
    /// sidecar. With `opened`, only if the same file is still there (publishing never
    /// replaces, so it is ours to remove unless someone replaced it meanwhile).
    fn remove_damaged(&self, key: &BlockKey, path: &Path, opened: Option<&File>) -> bool {
        let Ok(m) = std::fs::symlink_metadata(path) else {
            return false;
        };
        if let Some(f) = opened
            && !file::same_file(f, path)
        {
            return false;
        }
        let ok = if m.is_dir() {
            std::fs::remove_dir_all(path)
        } else {
            std::fs::remove_file(path)
        }
        .is_ok();
        let _ = std::fs::remove_file(file::sidecar_path(path));
        if ok {
            bump(&self.counters.corrupt_deleted, 1);
            if let Some(gc) = &self.gc {
                gc.on_removed(key);
            }
        }
        ok
    }

    /// A block that cannot be served for a reason that will not go away: it is removed (the
    /// next store rewrites it) and the load fails as `Corrupt`.
    fn damaged(
        &self,
        key: &BlockKey,
        path: &Path,
        opened: Option<&File>,
        reason: String,
    ) -> LoadFailure {
        let deleted = self.remove_damaged(key, path, opened);
        tracing::warn!(tier = %self.name, %key, path = %path.display(), %reason, deleted, "damaged block file");
        LoadFailure {
            error: Error::Corrupt {
                key: *key,
                tier: self.name.clone(),
                reason: format!("{reason} ({})", path.display()),
            },
            deleted,
        }
    }

    /// Reads one block straight into its sink. A block is served only whole, and with
    /// checksums on only verified (or, with `accept_unverified`, carrying no checksum at
    /// all); anything at its path that cannot be served for good is removed and reported.
    pub(crate) fn load_block(
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
        let f = match self
            .fault(FsOp::OpenRead, &path)
            .and_then(|()| file::open_read(&path, self.direct))
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if let Some(gc) = &self.gc {
                    gc.on_removed(key);
                }
                return Err(plain(Error::NotFound {
                    key: *key,
                    tier: self.name.clone(),
                }));
            }
            Err(e) => {
                // a link (ELOOP), or a directory where O_DIRECT is refused (EINVAL, EISDIR)
                if let Ok(m) = std::fs::symlink_metadata(&path)
                    && !m.is_file()
                {
                    let reason = format!("not a regular file ({:?})", m.file_type());
                    return Err(self.damaged(key, &path, None, reason));
                }
                return Err(plain(self.io_err("open", &path, e)));
            }
        };
        let meta = f
            .metadata()
            .map_err(|e| plain(self.io_err("fstat", &path, e)))?;
        if !meta.is_file() {
            let reason = format!("not a regular file ({:?})", meta.file_type());
            return Err(self.damaged(key, &path, Some(&f), reason));
        }
        if meta.len() != self.block_size as u64 {
            let reason = format!(
                "file is {} bytes, the block size is {}",
                meta.len(),
                self.block_size
            );
            return Err(self.damaged(key, &path, Some(&f), reason));
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
            let reason = format!("read {n} of {} bytes", self.block_size);
            return Err(self.damaged(key, &path, Some(&f), reason));
        }
        if self.checksum == Checksum::Crc32c {
            let stored = if self.xattrs {
                file::get_crc_xattr(&f)
            } else {
                file::read_sidecar(&path, meta.ino())
            }
            .map_err(|e| plain(self.io_err("read checksum", &path, e)))?;
            match stored {
                file::StoredCrc::Crc(want) => {
                    let got = crc32c::crc32c(sink.as_slice());
                    if got != want {
                        bump(&self.counters.checksum_mismatches, 1);
                        let reason = format!("crc32c is {got:08x}, stored {want:08x}");
                        return Err(self.damaged(key, &path, Some(&f), reason));
                    }
                }
                file::StoredCrc::Missing if self.accept_unverified => {
                    bump(&self.counters.unverified_loads, 1)
                }
                file::StoredCrc::Missing if self.sidecar_pending(&meta) => {
                    return Err(plain(Error::Backend {
                        tier: self.name.clone(),
                        message: format!(
                            "block {key} was published a moment ago and its checksum sidecar is not written yet ({})",
                            path.display()
                        ),
                        transient: true,
                    }));
                }
                file::StoredCrc::Missing => {
                    bump(&self.counters.unverified_refused, 1);
                    let reason = "it has no checksum (checksums are required; set \
                                  accept_unverified to serve blocks of writers that keep none)"
                        .to_string();
                    return Err(self.damaged(key, &path, Some(&f), reason));
                }
                file::StoredCrc::Malformed(reason) => {
                    return Err(self.damaged(key, &path, Some(&f), reason));
                }
            }
        }
        bump(&self.counters.blocks_read, 1);
        bump(&self.counters.bytes_read, self.block_size as u64);
        if let Some(gc) = &self.gc {
            gc.on_seen(*key, &meta);
            gc.touch(std::slice::from_ref(key));
        }
        Ok(())
    }

    pub(crate) fn rank_dir(&self) -> PathBuf {
        self.root.join(self.ns.rank_dir_name())
    }

    /// One sweep (when over the cap); emits `BlockRemoved` for what it deleted.
    pub(crate) fn sweep(&self, goal: Goal) -> usize {
        let Some(gc) = &self.gc else { return 0 };
        let report = gc.sweep(&self.ns, &self.root, &self.protection, goal);
        let n = report.deleted.len();
        self.events.push(report.deleted, true);
        n
    }

    /// Applies the queued mtime stamps; reports blocks found gone.
    pub(crate) fn apply_stamps(&self) {
        let Some(gc) = &self.gc else { return };
        let gone = gc.apply_stamps(&self.ns, &self.root);
        self.events.push(gone, true);
    }

    /// A full walk of the tree, merged into the index: adopts files other processes wrote,
    /// updates sizes and mtimes, and forgets (and reports) only files verified absent; entries
    /// that appeared while it walked stay. Reaps temp files and orphan sidecars older than
    /// `tmp_reap_age_s`.
    pub(crate) fn rescan(&self) {
        let Some(gc) = &self.gc else { return };
        let seq0 = gc.seq();
        let w = crate::gc::walk(
            &self.ns,
            &self.rank_dir(),
            4,
            Some(gc.cfg.tmp_age),
            SystemTime::now(),
        );
        bump(&self.counters.tmp_reaped, w.tmp_reaped);
        bump(&self.counters.sidecars_reaped, w.sidecars_reaped);
        gc.hook(crate::gc::SweepPoint::RescanWalked);
        let missing = gc.merge(w.blocks, seq0);
        let absent: Vec<(BlockKey, u64)> = missing
            .into_iter()
            .filter(|(k, _)| std::fs::symlink_metadata(self.ns.block_path(&self.root, k)).is_err())
            .collect();
        let gone = gc.forget(&absent);
        gc.counters.rescans.fetch_add(1, Ordering::Relaxed);
        gc.counters
            .external_removals
            .fetch_add(gone.len() as u64, Ordering::Relaxed);
        self.events.push(gone, true);
    }

    /// Whether `key`'s file exists. A key a sweep has chosen is looked at only after its
    /// unlink: the probe's caller protects its keys first, so the answer holds until the
    /// protection ends.
    pub(crate) fn exists(&self, key: &BlockKey) -> bool {
        if let Some(gc) = &self.gc {
            gc.wait_not_deleting(key);
        }
        std::fs::symlink_metadata(self.ns.block_path(&self.root, key)).is_ok_and(|m| m.is_file())
    }
}
