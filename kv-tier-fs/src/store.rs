//! Storing one block: room under the hard ceiling, a temp file, publish-if-absent, the
//! checksum; damage at the path is removed first.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::Ordering;

use kv_tier_core::{AlignedBuf, BlockKey, BlockSource, Error, EventBatch, Result};

use crate::block::{FsOp, Shared, bump};
use crate::capacity::Room;
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
    /// Writes one block: an unnamed (`O_TMPFILE`) or `O_EXCL` temp file, published without
    /// replacing, so the first writer wins with no look at the path first (a new block costs
    /// `openat`, `pwrite`, `linkat`, `close`; with a named temp file `renameat2` instead of
    /// `linkat`). When the publish finds a file there, that file is looked at:
    /// a regular block (with a checksum, when they are required) stands and the store is a
    /// skip; damage (a directory, a link, a file without the required checksum) is removed,
    /// reported, and the block written once more. `Ok(true)` when this call published it.
    /// `room`: what [`Shared::reserve_rooms`] reserved for it (bounded), released when this
    /// returns unless the published file took it over. A block this call published is added
    /// to `stored` (`BlockStored`); bounded, in the step that indexes it, so a removal that
    /// finds the file gone afterwards is reported after it.
    pub(crate) fn store_block(
        &self,
        key: &BlockKey,
        src: &BlockSource,
        room: Option<Room>,
        stored: &EventBatch,
    ) -> Result<bool> {
        if src.len() != self.block_size {
            return Err(Error::WrongSize {
                key: *key,
                got: src.len(),
                expected: self.block_size,
            });
        }
        let dest = self.ns.block_path(&self.root, key);
        let mut retried = false;
        loop {
            if self.write_block_making_room(key, &dest, src)? {
                bump(&self.counters.blocks.blocks_written, 1);
                bump(&self.counters.blocks.bytes_written, self.block_size as u64);
                match (&self.gc, room) {
                    (Some(gc), Some(mut room)) => {
                        let leaf = || {
                            let m = std::fs::symlink_metadata(dest.parent()?).ok()?;
                            Some(crate::gc::allocated(&m))
                        };
                        // measured before the room for its growth is given up (see
                        // `on_published`)
                        let grown = if room.grows() { leaf() } else { None };
                        let file_bytes = gc.file_bytes(self.alloc_block);
                        if gc.on_published(*key, file_bytes, room.take(), grown, stored)
                            && let Some(bytes) = leaf()
                        {
                            gc.set_leaf_bytes(key, bytes);
                        }
                    }
                    _ => stored.add(*key),
                }
                return Ok(true);
            }
            // something is at the path: a block another writer published, or damage
            let damage = match std::fs::symlink_metadata(&dest) {
                Ok(m) => match self.present_damage(&dest, &m) {
                    None => {
                        bump(&self.counters.blocks.stores_skipped, 1);
                        if let Some(gc) = &self.gc {
                            // stored again: the block is in use (and maybe written by
                            // another process)
                            gc.on_seen(*key, &m, None);
                            gc.queue_stamps(std::slice::from_ref(key));
                        }
                        return Ok(false);
                    }
                    Some(reason) => Some(reason),
                },
                // gone since (a sweep, another process): publish again
                Err(_) => None,
            };
            if retried {
                // damage again, or a file that keeps coming and going: another writer's
                // business now
                bump(&self.counters.blocks.stores_skipped, 1);
                return Ok(false);
            }
            retried = true;
            if let Some(reason) = damage
                && self.remove_damaged(key, &dest, None)
            {
                // (reported removed by `remove_damaged`)
                tracing::warn!(tier = %self.name, %key, path = %dest.display(), %reason, "removed a damaged block before storing it again");
            }
        }
    }

    /// [`Shared::write_block`]; on a full filesystem with a GC, room is made by the oldest
    /// files and the write tried once more.
    fn write_block_making_room(
        &self,
        key: &BlockKey,
        dest: &Path,
        src: &BlockSource,
    ) -> Result<bool> {
        match (self.write_block(key, dest, src), &self.gc) {
            (Err(Error::NoSpace { .. }), Some(gc)) => {
                // The filesystem is full (a cap larger than the disk, or other files): make
                // room by the oldest files and try once more.
                gc.counters.enospc_sweeps.fetch_add(1, Ordering::Relaxed);
                gc.sweep(Goal::Space);
                self.write_block(key, dest, src)
            }
            (r, _) => r,
        }
    }

    /// Writes `src` to a temp file next to `dest` (unnamed, where `O_TMPFILE` is used) and
    /// publishes it there without replacing. `Ok(false)` when another writer published first.
    fn write_block(&self, key: &BlockKey, dest: &Path, src: &BlockSource) -> Result<bool> {
        let parent = dest.parent().expect("block paths have a parent");
        if !self.leaves.known(key) {
            // a leaf not seen yet: make it before the create rather than after a failed one
            match std::fs::create_dir(parent) {
                Ok(()) => self.leaves.set(key, true),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => self.leaves.set(key, true),
                // its top directory is missing too: the create below makes both
                Err(_) => {}
            }
        }
        if self.tmpfile {
            return self.write_unnamed(key, dest, parent, src);
        }
        let tmp = self.tmp_path(dest);
        let f = self.create_in_leaf(key, parent, &tmp, || file::create_excl(&tmp, self.direct))?;
        let mut guard = TmpGuard {
            path: &tmp,
            armed: true,
        };
        let sidecar = self.fill(key, &f, &tmp, src)?;
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
        self.published(dest, sidecar)
    }

    /// [`Shared::write_block`] through an unnamed file: `O_TMPFILE` in the leaf directory,
    /// written, linked at `dest` (`linkat` never replaces). Nothing is left on any failure:
    /// the file has no name until the link.
    fn write_unnamed(
        &self,
        key: &BlockKey,
        dest: &Path,
        parent: &Path,
        src: &BlockSource,
    ) -> Result<bool> {
        let f = self.create_in_leaf(key, parent, parent, || {
            file::create_unnamed(parent, self.direct)
        })?;
        let sidecar = self.fill(key, &f, dest, src)?;
        self.fault(FsOp::Publish, dest)
            .map_err(|e| self.io_err("publish", dest, e))?;
        let published = match file::link_unnamed(&f, dest) {
            // the leaf was removed since the create (a sweep found it empty: an unnamed
            // file is no entry): make it again and link once more
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.leaves.set(key, false);
                file::make_dirs(parent).map_err(|e| self.io_err("mkdir", parent, e))?;
                self.leaves.set(key, true);
                file::link_unnamed(&f, dest)
            }
            r => r,
        }
        .map_err(|e| self.io_err("publish", dest, e))?;
        drop(f);
        if !published {
            return Ok(false);
        }
        self.published(dest, sidecar)
    }

    /// Creates a block's temp file with `create` in its leaf directory `parent`, making the
    /// directory when the create finds it missing (at most three times: a sweep may keep
    /// emptying it). `at` names the file in faults and errors.
    fn create_in_leaf(
        &self,
        key: &BlockKey,
        parent: &Path,
        at: &Path,
        create: impl Fn() -> io::Result<std::fs::File>,
    ) -> Result<std::fs::File> {
        let mut tries = 0;
        loop {
            match self.fault(FsOp::CreateTmp, at).and_then(|()| create()) {
                Ok(f) => return Ok(f),
                // the leaf directory does not exist (yet, or any more: a sweep removes
                // emptied ones)
                Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 3 => {
                    tries += 1;
                    self.leaves.set(key, false);
                    file::make_dirs(parent).map_err(|e| self.io_err("mkdir", parent, e))?;
                    self.leaves.set(key, true);
                }
                Err(e) => return Err(self.io_err("create", at, e)),
            }
        }
    }

    /// Writes the block's bytes (and its checksum xattr) into the temp file `f` (`at` in
    /// errors) and syncs it when asked; returns the sidecar to write after publishing, where
    /// checksums live in sidecars.
    fn fill(
        &self,
        key: &BlockKey,
        f: &std::fs::File,
        at: &Path,
        src: &BlockSource,
    ) -> Result<Option<[u8; 12]>> {
        let bounce;
        let data: &[u8] = if self.direct && !src.is_aligned(self.align) {
            bounce = AlignedBuf::copy_from(src.as_slice());
            bounce.as_slice()
        } else {
            src.as_slice()
        };
        self.fault(FsOp::Write, at)
            .and_then(|()| file::write_full(f, data))
            .map_err(|e| self.io_err("write", at, e))?;
        if let Some(ns) = self.gc.as_ref().and_then(|g| g.frozen_now_ns()) {
            // a frozen GC clock: the file's mtime is the clock's, as the index's entry is
            let t = std::time::SystemTime::UNIX_EPOCH
                + std::time::Duration::from_nanos(ns.max(0) as u64);
            f.set_modified(t)
                .map_err(|e| self.io_err("futimens", at, e))?;
        }
        if self.vllm_crc {
            // vLLM's checksum, before the publish (as vLLM sets it)
            file::set_vllm_crc(f, data).map_err(|e| self.io_err("fsetxattr", at, e))?;
        }
        let crc = (self.checksum == Checksum::Crc32c).then(|| file::block_crc(key, data));
        let mut sidecar = None;
        if let Some(crc) = crc {
            if self.xattrs {
                file::set_crc_xattr(f, crc).map_err(|e| self.io_err("fsetxattr", at, e))?;
            } else {
                let ino = f.metadata().map_err(|e| self.io_err("fstat", at, e))?.ino();
                sidecar = Some(file::sidecar_bytes(crc, ino));
            }
        }
        if self.fsync {
            f.sync_all().map_err(|e| self.io_err("fsync", at, e))?;
        }
        Ok(sidecar)
    }

    /// After a publish: the sidecar, and the directory's sync when asked.
    fn published(&self, dest: &Path, sidecar: Option<[u8; 12]>) -> Result<bool> {
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
        let mut res = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, &side));
        // something that is no file stands at the sidecar's path (a directory, say): no
        // sidecar of ours, and in the way of every store of the key; it goes, and the
        // rename is tried once more
        if res.is_err()
            && let Ok(m) = std::fs::symlink_metadata(&side)
            && !m.is_file()
        {
            let removed = if m.is_dir() {
                std::fs::remove_dir_all(&side)
            } else {
                std::fs::remove_file(&side)
            };
            tracing::warn!(path = %side.display(), kind = ?m.file_type(), removed = removed.is_ok(), "not a file at a checksum sidecar's path; removed");
            res = std::fs::rename(&tmp, &side);
        }
        if let Err(e) = res {
            let _ = std::fs::remove_file(&tmp);
            tracing::warn!(path = %side.display(), error = %e, "could not write the checksum sidecar; the block will be refused as unverified");
        }
    }
}
