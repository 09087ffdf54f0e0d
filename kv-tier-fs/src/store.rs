//! Storing one block: room under the hard ceiling, a temp file, publish-if-absent, the
//! checksum; damage at the path is removed first.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::Ordering;

use kv_tier_core::{AlignedBuf, BlockKey, BlockSource, Error, Result};

use crate::block::{FsOp, Shared, bump};
use crate::config::Checksum;
use crate::file;
use crate::gc::Goal;

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

impl Shared {
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
                    bump(&self.counters.blocks.stores_skipped, 1);
                    if let Some(gc) = &self.gc {
                        // stored again: the block is in use (and maybe written by another
                        // process)
                        gc.on_seen(*key, &m);
                        gc.queue_stamps(std::slice::from_ref(key));
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
        let written = match (self.write_block(key, &dest, src), &self.gc) {
            (Err(Error::NoSpace { .. }), Some(gc)) => {
                // The filesystem is full (a cap larger than the disk, or other files): make
                // room by the oldest files and try once more.
                gc.counters.enospc_sweeps.fetch_add(1, Ordering::Relaxed);
                gc.sweep(Goal::Space);
                self.write_block(key, &dest, src)
            }
            (r, _) => r,
        }?;
        if !written {
            // Another writer was first: its file stands.
            bump(&self.counters.blocks.stores_skipped, 1);
            return Ok(false);
        }
        bump(&self.counters.blocks.blocks_written, 1);
        bump(&self.counters.blocks.bytes_written, self.block_size as u64);
        if let (Some(gc), Some(mut room)) = (&self.gc, room)
            && gc.on_published(*key, gc.file_bytes(self.alloc_block), room.take())
            && let Some(Ok(m)) = dest.parent().map(std::fs::symlink_metadata)
        {
            gc.set_leaf_bytes(key, crate::gc::allocated(&m));
        }
        Ok(true)
    }

    /// Writes `src` to a temp file next to `dest` and publishes it there without replacing.
    /// `Ok(false)` when another writer published first.
    fn write_block(&self, key: &BlockKey, dest: &Path, src: &BlockSource) -> Result<bool> {
        let tmp = self.tmp_path(dest);
        let mut tries = 0;
        let f = loop {
            let created = self
                .fault(FsOp::CreateTmp, &tmp)
                .and_then(|()| file::create_excl(&tmp, self.direct));
            match created {
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
        let crc = (self.checksum == Checksum::Crc32c).then(|| file::block_crc(key, data));
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
}
