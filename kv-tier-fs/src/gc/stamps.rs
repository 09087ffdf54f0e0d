//! mtime stamps: recency that survives restarts and that other processes see.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::Ordering;

use kv_tier_core::{BlockKey, Namespace};

use super::{Gc, Index};

/// Sets atime and mtime of `path` to `ns` (since the epoch).
fn stamp(path: &Path, ns: i64) -> io::Result<()> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let ts = libc::timespec {
        tv_sec: ns.div_euclid(1_000_000_000),
        tv_nsec: ns.rem_euclid(1_000_000_000),
    };
    let times = [ts, ts];
    // SAFETY: valid path and a two-element timespec array.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

impl Gc {
    pub(crate) fn touch(&self, keys: &[BlockKey]) {
        let now = self.now_ns();
        let mut queued = false;
        let mut dropped = 0u64;
        {
            let mut idx = self.lock();
            let Index { map, pending, .. } = &mut *idx;
            for k in keys {
                let Some(e) = map.get_mut(k) else { continue };
                if e.pending || now - e.last_stamp < self.cfg.stamp_interval_ns {
                    continue;
                }
                if pending.len() >= self.cfg.max_tracked {
                    dropped += 1;
                    continue;
                }
                e.pending = true;
                e.last_stamp = now;
                pending.push(*k);
                queued = true;
            }
        }
        if dropped > 0 {
            self.counters
                .stamps_dropped
                .fetch_add(dropped, Ordering::Relaxed);
        }
        let _ = queued; // the GC thread applies stamps at its next tick
    }

    /// A file found on disk that the index does not know yet (written by another process).
    pub(crate) fn apply_stamps(&self, ns: &Namespace, root: &Path) {
        let pending = std::mem::take(&mut self.lock().pending);
        if pending.is_empty() {
            return;
        }
        let now = self.now_ns();
        let threads = if pending.len() >= 512 { 4 } else { 1 };
        let per = pending.len().div_ceil(threads);
        let results: Vec<(Vec<BlockKey>, Vec<BlockKey>)> = std::thread::scope(|s| {
            let handles: Vec<_> = pending
                .chunks(per)
                .map(|chunk| {
                    s.spawn(move || {
                        let (mut done, mut gone) = (Vec::with_capacity(chunk.len()), Vec::new());
                        for k in chunk {
                            match stamp(&ns.block_path(root, k), now) {
                                Ok(()) => done.push(*k),
                                Err(e) if e.kind() == io::ErrorKind::NotFound => gone.push(*k),
                                Err(e) => {
                                    self.counters.stamp_errors.fetch_add(1, Ordering::Relaxed);
                                    tracing::debug!(key = %k, error = %e, "mtime stamp failed");
                                    done.push(*k);
                                }
                            }
                        }
                        (done, gone)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("stamp thread"))
                .collect()
        });
        let mut idx = self.lock();
        let (mut n_done, mut n_gone) = (0u64, 0u64);
        for (done, gone) in &results {
            for k in done {
                if let Some(e) = idx.map.get_mut(k) {
                    e.mtime = e.mtime.max(now);
                    e.pending = false;
                }
            }
            for k in gone {
                idx.remove(k);
            }
            n_done += done.len() as u64;
            n_gone += gone.len() as u64;
        }
        drop(idx);
        self.counters.stamps.fetch_add(n_done, Ordering::Relaxed);
        self.counters
            .external_removals
            .fetch_add(n_gone, Ordering::Relaxed);
    }
}
