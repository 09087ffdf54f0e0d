//! Reading and writing one block file: publish-if-absent stores, verified loads, damage
//! handling; what the I/O threads run.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use kv_tier_core::{
    AlignedBuf, BlockKey, BlockSink, BlockSource, Error, EventLog, Namespace, ProtectionSet, Result,
};

use crate::config::Checksum;
use crate::file;
use crate::gc::Gc;

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
    pub(crate) bytes_written: AtomicU64,
    pub(crate) bytes_read: AtomicU64,
    pub(crate) tmp_reaped: AtomicU64,
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
    pub(crate) direct: bool,
    pub(crate) align: usize,
    pub(crate) checksum: Checksum,
    pub(crate) xattrs: bool,
    pub(crate) fsync: bool,
    pub(crate) faults: RwLock<Option<FaultInjector>>,
    pub(crate) counters: Counters,
    pub(crate) tmp_seq: AtomicU64,
    pub(crate) tmp_salt: u64,
    pub(crate) top_dirs_ready: AtomicBool,
    pub(crate) protection: ProtectionSet,
    pub(crate) events: EventLog,
    pub(crate) gc: Option<Gc>,
}

/// What a load did besides failing: whether it deleted the file.
pub(crate) fn key_from_path(ns: &Namespace, root: &Path, path: &Path) -> Option<BlockKey> {
    let rel = path.strip_prefix(root.join(ns.rank_dir_name())).ok()?;
    let mut parts = rel.iter().map(|p| p.to_str().unwrap_or(""));
    let (top, leaf, file) = (parts.next()?, parts.next()?, parts.next()?);
    crate::gc::parse_block(ns, top, leaf, file)
}

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

impl Files {
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

    /// Writes one block: skip if present, temp file with O_EXCL, publish without replacing.
    /// `Ok(true)` when this call published the file.
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

    pub(crate) fn rank_dir(&self) -> PathBuf {
        self.root.join(self.ns.rank_dir_name())
    }

    /// One sweep (when over the cap); emits `BlockRemoved` for what it deleted.
    pub(crate) fn sweep(&self) -> usize {
        let Some(gc) = &self.gc else { return 0 };
        let report = gc.sweep(&self.ns, &self.root, &self.protection);
        let n = report.deleted.len();
        self.events.push(report.deleted, true);
        n
    }

    /// A full walk of the tree: adopts new files, forgets (and reports) vanished ones.
    pub(crate) fn rescan(&self, tmp_age: Option<Duration>) {
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
    pub(crate) fn exists(&self, key: &BlockKey) -> bool {
        if let Some(gc) = &self.gc {
            gc.wait_not_deleting(key);
        }
        std::fs::symlink_metadata(self.ns.block_path(&self.root, key)).is_ok()
    }
}
