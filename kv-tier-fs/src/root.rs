//! Opening a root: the directory, `config.json`, the capability probe, the layout's
//! first-level directories, stray temp files.

use std::io;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use kv_tier_core::{AlignedBuf, Error, Namespace, Result};

use crate::block::{Shared, random_salt};
use crate::file;

pub(crate) fn prepare_root(root: &Path) -> Result<()> {
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

/// Writes `config.json` once, durably (the file and its directory are fsynced) and only if
/// absent; otherwise checks that the one present describes this namespace (layouts are never
/// mixed: a valid one that disagrees is refused, naming the differing fields).
///
/// An empty or unparsable `config.json` (a power loss before it reached the disk, or a
/// writer that wrote it in place and was killed) is rewritten, logged: the namespace folder's
/// name carries the digest of the run fields, so the folder is ours whatever the file says.
pub(crate) fn write_or_check_config(ns: &Namespace, root: &Path) -> Result<()> {
    let path = ns.config_path(root);
    for _ in 0..3 {
        // non-blocking, regular files only: a FIFO here must not hang the open
        match file::read_regular(&path) {
            Ok(Some(bytes)) => match String::from_utf8(bytes) {
                Ok(text) if !is_damaged_config(&text) => {
                    return ns.check_config_json(&path, &text);
                }
                Ok(text) => {
                    tracing::warn!(path = %path.display(), bytes = text.len(), "config.json is empty or not valid JSON; rewriting it (the folder name carries this layout's digest)");
                    return write_config(ns, &path, true);
                }
                Err(_) => {
                    tracing::warn!(path = %path.display(), "config.json is not UTF-8; rewriting it");
                    return write_config(ns, &path, true);
                }
            },
            Ok(None) if std::fs::symlink_metadata(&path).is_ok_and(|m| m.is_dir()) => {
                return Err(Error::LayoutMismatch {
                    path: path.clone(),
                    reason: "config.json is a directory".into(),
                });
            }
            Ok(None) => {
                tracing::warn!(path = %path.display(), "config.json is not a regular file; replacing it");
                return write_config(ns, &path, true);
            }
            Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
                tracing::warn!(path = %path.display(), "config.json is a link; replacing it");
                return write_config(ns, &path, true);
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io("read", &path, e)),
        }
        if write_config(ns, &path, false).is_ok() {
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

/// Whether `text` cannot be a `config.json` at all (as opposed to one of another layout).
fn is_damaged_config(text: &str) -> bool {
    !matches!(
        serde_json::from_str::<serde_json::Value>(text),
        Ok(serde_json::Value::Object(_))
    )
}

/// Writes `config.json` through a temp file, fsynced, then published (replacing with
/// `replace`, else only if absent: `Err` when another writer was first) and the directory
/// fsynced.
fn write_config(ns: &Namespace, path: &Path, replace: bool) -> Result<()> {
    let mut tmp = path.as_os_str().to_os_string();
    tmp.push(format!("_{:016x}.tmp", random_salt()));
    let tmp = PathBuf::from(tmp);
    let written = (|| {
        let mut f = std::fs::File::create_new(&tmp)?;
        std::io::Write::write_all(&mut f, ns.config_json().as_bytes())?;
        f.sync_all()
    })();
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io("write", &tmp, e));
    }
    let published = if replace {
        std::fs::rename(&tmp, path).map(|()| true)
    } else {
        file::publish_noreplace(&tmp, path)
    };
    let _ = std::fs::remove_file(&tmp);
    match published {
        Ok(true) => {}
        Ok(false) => {
            return Err(Error::io(
                "publish",
                path,
                io::Error::from(io::ErrorKind::AlreadyExists),
            ));
        }
        Err(e) => return Err(Error::io("publish", path, e)),
    }
    if let Some(dir) = path.parent() {
        file::fsync_dir(dir).map_err(|e| Error::io("fsync", dir, e))?;
    }
    Ok(())
}

pub(crate) struct Probe {
    pub(crate) direct_align: Option<usize>,
    pub(crate) xattrs: bool,
    /// Whether a block can be written unnamed and linked into place (`O_TMPFILE`).
    pub(crate) tmpfile: bool,
    /// Allocated bytes of a fresh, empty directory here: what a new leaf or top directory
    /// costs (4 KiB on ext4, 0 where small directories live in their inode or in memory).
    pub(crate) dir_alloc: u64,
}

/// One probe file per open: writability, O_DIRECT (and its alignment), user xattrs, and
/// (`want_tmpfile`) publishing an `O_TMPFILE` file by `linkat`; and one probe directory, for
/// the allocated size of a fresh directory (not the rank directory's own, which grows with
/// its entries: a populated one is many times a fresh one).
pub(crate) fn probe_dir(
    dir: &Path,
    want_direct: bool,
    want_xattrs: bool,
    want_tmpfile: bool,
) -> Result<Probe> {
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
    let tmpfile = want_tmpfile
        && {
            let linked = file::create_unnamed(dir, direct_align.is_some()).and_then(|f| {
                use std::os::unix::fs::FileExt;
                let buf = AlignedBuf::zeroed(direct_align.unwrap_or(512));
                f.write_all_at(buf.as_slice(), 0)?;
                file::link_unnamed(&f, &path)
            });
            let _ = std::fs::remove_file(&path);
            match linked {
                Ok(true) => true,
                r => {
                    tracing::info!(dir = %dir.display(), result = ?r, "no O_TMPFILE publish here; blocks are written to named temp files and renamed");
                    false
                }
            }
        };
    let dir_alloc = fresh_dir_alloc(dir, &path);
    Ok(Probe {
        direct_align,
        xattrs,
        tmpfile,
        dir_alloc,
    })
}

/// Allocated bytes of an empty directory made at `at` (then removed) in `dir`. Where none
/// can be made, the smaller of `dir`'s own size and its filesystem's block size.
fn fresh_dir_alloc(dir: &Path, at: &Path) -> u64 {
    let made = std::fs::create_dir(at).and_then(|()| std::fs::symlink_metadata(at));
    let _ = std::fs::remove_dir(at);
    match made {
        Ok(m) => m.blocks() * 512,
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "could not make a probe directory");
            std::fs::metadata(dir).map_or(4096, |m| (m.blocks() * 512).min(m.blksize()))
        }
    }
}

/// Creates the layout's 4,096 first-level directories (`<hex[0..3]>`) in the background.
///
/// Creating a first-level directory is the expensive part of a store into a fresh cache (on
/// ext4 it halves the throughput of 256 KiB stores, while a second-level directory inside an
/// existing one costs little); doing them all once, off the I/O path, takes that cost away.
/// Stores that arrive first create what they need themselves. Empty directories are harmless
/// to vLLM's reader.
pub(crate) fn spawn_top_dirs(files: Arc<Shared>) -> Option<std::thread::JoinHandle<()>> {
    let spawned = std::thread::Builder::new()
        .name("kv-fs-dirs".into())
        .spawn(move || {
            let rank_dir = files.root.join(files.ns.rank_dir_name());
            for i in 0..4096u32 {
                if files.stop_top_dirs.load(Ordering::Relaxed) {
                    return;
                }
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
    match spawned {
        Ok(h) => Some(h),
        Err(e) => {
            tracing::debug!(error = %e, "no thread to pre-create layout directories");
            None
        }
    }
}

/// Deletes `*.tmp` files older than `age` below `dirs`, and checksum sidecars whose block
/// file is gone whatever their age, if they were last changed before this walk began (a
/// store writes its sidecar after publishing the block, so no block of theirs is on its way;
/// the rule of [`crate::gc::walk`], with which bounded tiers walk; this is the walk of an
/// unbounded tier's open). Returns (temp files, sidecars) deleted.
pub(crate) fn reap_tmp(dirs: &[PathBuf], age: Duration) -> (u64, u64) {
    let now = SystemTime::now();
    let (mut tmps, mut sidecars) = (0, 0);
    let mut stack: Vec<PathBuf> = dirs.to_vec();
    let old = |e: &std::fs::DirEntry| {
        e.metadata()
            .and_then(|m| m.modified())
            .map(|m| now.duration_since(m).unwrap_or_default() >= age)
            .unwrap_or(false)
    };
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(ft) = e.file_type() else { continue };
            let p = e.path();
            let name = e.file_name();
            let name = name.to_string_lossy();
            if ft.is_dir() {
                if !dirs.contains(&p) {
                    stack.push(p);
                }
            } else if name.ends_with(".tmp") {
                if old(&e) && std::fs::remove_file(&p).is_ok() {
                    tmps += 1;
                }
            } else if let Some(bin) = name.strip_suffix(file::CRC_SIDECAR_SUFFIX)
                && bin.ends_with(".bin")
                && file::reap_orphan_sidecar(&d.join(bin), |m| file::changed_at(m) < now)
            {
                sidecars += 1;
            }
        }
    }
    (tmps, sidecars)
}
