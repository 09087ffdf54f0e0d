//! Storing one block: room under the hard ceiling, a temp file, publish-if-absent, the
//! checksum; damage at the path is removed first.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kv_tier_core::{AlignedBuf, BlockKey, BlockSource, Error, Result};

use crate::block::{FsOp, Shared, bump};
use crate::config::Checksum;
use crate::file;
use crate::gc::{Gc, Goal};

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
        let written = match self.write_block(key, &dest, src) {
            Err(Error::NoSpace { .. }) if self.gc.is_some() => {
                // The filesystem is full (a cap larger than the disk, or other files): make
                // room by the oldest files and try once more.
                if let Some(gc) = &self.gc {
                    gc.counters.enospc_sweeps.fetch_add(1, Ordering::Relaxed);
                }
                self.sweep(Goal::Space);
                self.write_block(key, &dest, src)
            }
            r => r,
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
