//! Loading one block: served whole and (with checksums) verified, or a miss; damage is
//! removed and reported.

use std::fs::File;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use kv_tier_core::checksum::{self, Verdict};
use kv_tier_core::{AlignedBuf, BlockKey, BlockSink, Error, Result};

use crate::block::{FsOp, Shared, bump};
use crate::config::Checksum;
use crate::file;

impl Shared {
    /// Whether `m` (a block file without its sidecar) was published within the sidecar grace
    /// (its inode changed that recently).
    fn sidecar_pending(&self, m: &std::fs::Metadata) -> bool {
        if self.xattrs {
            return false; // the xattr is set before publishing: there is no window
        }
        let grace = Duration::from_nanos(self.sidecar_grace_ns.load(Ordering::Relaxed));
        SystemTime::now()
            .duration_since(file::changed_at(m))
            .map_or(true, |age| age < grace)
    }
    /// Why a present path cannot stand for its block (`None`: it can): not a regular file, or
    /// (checksums required) a regular file whose checksum is missing or malformed. Cheap: one
    /// `lgetxattr` or sidecar read, no data.
    pub(crate) fn present_damage(&self, path: &Path, m: &std::fs::Metadata) -> Option<String> {
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
            // vLLM's checksum stands for it (checked when the block is loaded)
            Ok(file::StoredCrc::Missing)
                if self.vllm_crc && matches!(file::get_vllm_crc_path(path), Ok(Some(Ok(_)))) =>
            {
                None
            }
            Ok(file::StoredCrc::Missing) => Some("it has no checksum".into()),
            Ok(file::StoredCrc::Malformed(r)) => Some(r),
        }
    }
    /// Deletes the sidecar of the block file `path` if the block is not there and the sidecar
    /// was last changed before `before`: the block was deleted by someone else (vLLM's own
    /// eviction, a reaper) and its sidecar, which the index stopped counting with the block,
    /// would stay on disk until a walk. A store of the key under way keeps its sidecar (see
    /// `file::reap_orphan_sidecar`).
    fn reap_orphan_sidecar(&self, path: &Path, before: SystemTime) {
        if !self.xattrs && file::reap_orphan_sidecar(path, |m| file::changed_at(m) < before) {
            bump(&self.counters.own.sidecars_reaped, 1);
        }
    }

    /// Removes what stands at a block's path (a file, a link or a whole directory) and its
    /// sidecar, and reports the removal (`BlockRemoved`). With `opened`, only if the same
    /// file is still there (publishing never replaces, so it is ours to remove unless someone
    /// replaced it meanwhile).
    pub(crate) fn remove_damaged(
        &self,
        key: &BlockKey,
        path: &Path,
        opened: Option<&File>,
    ) -> bool {
        // what the index held before the removal: a store that publishes the key again in
        // between replaces the entry, and that one stays
        let seq = self.gc.as_ref().and_then(|gc| gc.seq_of(key));
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
            bump(&self.counters.blocks.corrupt_deleted, 1);
            match &self.gc {
                // (whether a file is at the path again: a store's, published since)
                Some(gc) => gc.removed_damaged(key, seq, std::fs::symlink_metadata(path).is_ok()),
                None => self.events.push(vec![*key], true),
            }
        }
        ok
    }

    /// A block that cannot be served for a reason that will not go away: it is removed (the
    /// next store rewrites it) and the load fails as `Corrupt`.
    fn damaged(&self, key: &BlockKey, path: &Path, opened: Option<&File>, reason: String) -> Error {
        let deleted = self.remove_damaged(key, path, opened);
        tracing::warn!(tier = %self.name, %key, path = %path.display(), %reason, deleted, "damaged block file");
        Error::Corrupt {
            key: *key,
            tier: self.name.clone(),
            reason: format!("{reason} ({})", path.display()),
        }
    }

    /// Reads one block straight into its sink. A block is served only whole, and with
    /// checksums on only verified (or, with `accept_unverified`, carrying no checksum at
    /// all); anything at its path that cannot be served for good is removed and reported.
    pub(crate) fn load_block(&self, key: &BlockKey, sink: &mut BlockSink) -> Result<()> {
        if sink.len() != self.block_size {
            return Err(Error::WrongSize {
                key: *key,
                got: sink.len(),
                expected: self.block_size,
            });
        }
        let path = self.ns.block_path(&self.root, key);
        // the index entry this load may find gone (see `remove_damaged`)
        let seq = self.gc.as_ref().and_then(|gc| gc.seq_of(key));
        let began = SystemTime::now();
        let f = match self
            .fault(FsOp::OpenRead, &path)
            .and_then(|()| file::open_read(&path, self.direct))
        {
            Ok(f) => f,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                if let (Some(gc), Some(seq)) = (&self.gc, seq) {
                    gc.forget(&[(*key, seq)]);
                }
                self.reap_orphan_sidecar(&path, began);
                return Err(Error::NotFound {
                    key: *key,
                    tier: self.name.clone(),
                });
            }
            Err(e) => {
                // a link (ELOOP), or a directory where O_DIRECT is refused (EINVAL, EISDIR)
                if let Ok(m) = std::fs::symlink_metadata(&path)
                    && !m.is_file()
                {
                    let reason = format!("not a regular file ({:?})", m.file_type());
                    return Err(self.damaged(key, &path, None, reason));
                }
                return Err(self.io_err("open", &path, e));
            }
        };
        // read first: the count tells the file's size (`read_sized`), so a whole block
        // costs no `fstat`; the rare paths that need the inode stat it then
        let mut meta: Option<std::fs::Metadata> = None;
        let stat = |meta: &mut Option<std::fs::Metadata>| -> io::Result<std::fs::Metadata> {
            if let Some(m) = meta {
                return Ok(m.clone());
            }
            let m = f.metadata()?;
            *meta = Some(m.clone());
            Ok(m)
        };
        let read = |buf: &mut [u8]| {
            self.fault(FsOp::Read, &path)
                .and_then(|()| with_tail(self.align, |tail| file::read_sized(&f, buf, tail)))
        };
        let got = if self.direct && !sink.is_aligned(self.align) {
            let mut bounce = AlignedBuf::zeroed(self.block_size);
            let got = read(bounce.as_mut_slice());
            let n = got.as_ref().map_or(0, |n| (*n).min(self.block_size));
            sink.as_mut_slice()[..n].copy_from_slice(&bounce.as_slice()[..n]);
            got
        } else {
            read(sink.as_mut_slice())
        };
        let n = match got {
            Ok(n) => n,
            Err(e) => {
                // a directory (EISDIR) or a FIFO (ESPIPE) is damage; anything else an error
                if let Ok(m) = stat(&mut meta)
                    && !m.is_file()
                {
                    let reason = format!("not a regular file ({:?})", m.file_type());
                    return Err(self.damaged(key, &path, Some(&f), reason));
                }
                return Err(self.io_err("read", &path, e));
            }
        };
        if n != self.block_size {
            let reason = match stat(&mut meta) {
                Ok(m) if !m.is_file() => format!("not a regular file ({:?})", m.file_type()),
                Ok(m) if m.len() != self.block_size as u64 => format!(
                    "file is {} bytes, the block size is {}",
                    m.len(),
                    self.block_size
                ),
                _ if n < self.block_size => format!("read {n} of {} bytes", self.block_size),
                _ => format!("file is longer than the block size {}", self.block_size),
            };
            return Err(self.damaged(key, &path, Some(&f), reason));
        }
        // vLLM's checksum, where the block has one: the bytes as vLLM wrote them
        let mut vllm_verified = false;
        if self.vllm_crc {
            match file::get_vllm_crc(&f).map_err(|e| self.io_err("read checksum", &path, e))? {
                None => {}
                Some(Ok(stored)) => {
                    let got = crc32c::crc32c(sink.as_slice());
                    if got != stored {
                        bump(&self.counters.blocks.checksum_mismatches, 1);
                        let reason = format!("vLLM's crc32c is {got:08x}, stored {stored:08x}");
                        return Err(self.damaged(key, &path, Some(&f), reason));
                    }
                    vllm_verified = true;
                }
                Some(Err(reason)) => return Err(self.damaged(key, &path, Some(&f), reason)),
            }
        }
        if self.checksum == Checksum::Crc32c {
            let stored = if self.xattrs {
                file::get_crc_xattr(&f)
            } else {
                stat(&mut meta).and_then(|m| file::read_sidecar(&path, m.ino()))
            }
            .map_err(|e| self.io_err("read checksum", &path, e))?;
            let verdict = checksum::verify(&stored, key, sink.as_slice(), self.accept_unverified);
            let pending = |meta: &mut Option<std::fs::Metadata>| {
                stat(meta).is_ok_and(|m| self.sidecar_pending(&m))
            };
            match verdict {
                Verdict::Verified => {}
                // written by vLLM with its checksum only, and that one matched
                Verdict::Missing if vllm_verified => {}
                Verdict::Mismatch { got, stored } => {
                    bump(&self.counters.blocks.checksum_mismatches, 1);
                    let reason = format!("crc32c is {got:08x}, stored {stored:08x}");
                    return Err(self.damaged(key, &path, Some(&f), reason));
                }
                Verdict::Unverified => bump(&self.counters.blocks.unverified_loads, 1),
                Verdict::Missing if pending(&mut meta) => {
                    return Err(Error::Backend {
                        tier: self.name.clone(),
                        message: format!(
                            "block {key} was published a moment ago and its checksum sidecar is not written yet ({})",
                            path.display()
                        ),
                        transient: true,
                    });
                }
                Verdict::Missing => {
                    bump(&self.counters.blocks.unverified_refused, 1);
                    let reason = "it has no checksum (checksums are required; set \
                                  accept_unverified to serve blocks of writers that keep none)"
                        .to_string();
                    return Err(self.damaged(key, &path, Some(&f), reason));
                }
                Verdict::Malformed(reason) => {
                    return Err(self.damaged(key, &path, Some(&f), reason));
                }
            }
        }
        bump(&self.counters.blocks.blocks_read, 1);
        bump(&self.counters.blocks.bytes_read, self.block_size as u64);
        if let Some(gc) = &self.gc {
            // the index learns a file it did not know (written by another process, or
            // adopted late) from its inode; a known one only gets its recency stamped
            if seq.is_none()
                && let Ok(m) = stat(&mut meta)
            {
                gc.on_seen(*key, &m, None);
            }
            gc.queue_stamps(std::slice::from_ref(key));
        }
        Ok(())
    }
}

/// Runs `f` with this thread's scratch tail for [`file::read_sized`]: one aligned logical
/// block (`align` bytes, at least 512), kept per I/O thread.
fn with_tail<R>(align: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    thread_local! {
        static TAIL: std::cell::RefCell<Option<AlignedBuf>> = const { std::cell::RefCell::new(None) };
    }
    let len = align.max(512);
    TAIL.with(|t| {
        let mut t = t.borrow_mut();
        if t.as_ref().is_none_or(|b| b.len() != len) {
            *t = Some(AlignedBuf::zeroed(len));
        }
        f(t.as_mut().expect("just set").as_mut_slice())
    })
}
