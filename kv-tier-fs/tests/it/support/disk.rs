//! Paths, files, xattrs and allocated bytes on disk.

use std::ffi::CString;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kv_tier_core::BlockKey;
use kv_tier_fs::{CRC_XATTR, FsTier};
use kv_tier_testkit::util::walk;
use kv_tier_testkit::{allocated_bytes, find_files};

use super::*;

/// Key of a block file, from its path (`.../<hex[0..3]>/<hex[3..5]>_g<group>/<hex>.bin`).
pub(crate) fn key_of(path: &Path) -> BlockKey {
    let hex = path.file_stem().unwrap().to_str().unwrap();
    let dir = path
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap();
    let group: u32 = dir.rsplit("_g").next().unwrap().parse().unwrap();
    BlockKey::from_hex(hex, group).unwrap()
}

/// Sets the block checksum xattr of the file at `p` to `v` (any bytes: tests damage it).
pub(crate) fn set_crc_xattr(p: &Path, v: &[u8]) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let name = std::ffi::CString::new(kv_tier_fs::CRC_XATTR).unwrap();
    // SAFETY: valid path, name and value buffer.
    let rc = unsafe { libc::setxattr(c.as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(rc, 0, "setxattr {}", p.display());
}

/// Whether each key's block file is there.
pub(crate) fn present(tier: &FsTier, keys: &[BlockKey]) -> Vec<bool> {
    keys.iter().map(|k| tier.block_path(k).exists()).collect()
}

/// Sets or clears the immutable flag of a file (root on ext4): its unlink then fails.
pub(crate) fn set_immutable(path: &Path, on: bool) {
    use std::os::fd::AsRawFd;
    const FS_IMMUTABLE_FL: libc::c_long = 0x10;
    let f = std::fs::File::open(path).unwrap();
    let mut flags: libc::c_long = 0;
    // SAFETY: a valid fd and a pointer to a c_long, as FS_IOC_GETFLAGS/SETFLAGS take.
    unsafe {
        assert_eq!(
            libc::ioctl(f.as_raw_fd(), libc::FS_IOC_GETFLAGS, &mut flags),
            0
        );
        flags = if on {
            flags | FS_IMMUTABLE_FL
        } else {
            flags & !FS_IMMUTABLE_FL
        };
        assert_eq!(libc::ioctl(f.as_raw_fd(), libc::FS_IOC_SETFLAGS, &flags), 0);
    }
}

/// The rank directory of the test namespace on `root`.
pub(crate) fn rank_dir(root: &Path) -> PathBuf {
    root.join(ns().rank_dir_name())
}

/// `du` of the rank directory (the directory itself not counted): what the docs say the
/// index sums.
pub(crate) fn du(root: &Path) -> u64 {
    allocated_bytes(&rank_dir(root))
}

/// Allocated bytes of the directories only, below `dir`.
pub(crate) fn du_dirs(dir: &Path) -> u64 {
    let mut n = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if m.is_dir() {
                n += m.blocks() * 512;
                stack.push(e.path());
            }
        }
    }
    n
}

/// The `.bin` files below the rank directory on `root`.
pub(crate) fn bins(root: &Path) -> Vec<PathBuf> {
    find_files(&rank_dir(root), ".bin")
}

/// Sets the mtime of the file at `p` to `secs_ago` seconds ago.
pub(crate) fn set_mtime(p: &Path, secs_ago: u64) {
    let f = std::fs::File::options().write(true).open(p).unwrap();
    f.set_modified(SystemTime::now() - Duration::from_secs(secs_ago))
        .unwrap();
}

/// How many seconds ago the file at `p` was modified (`None` if it is not there).
pub(crate) fn mtime_age_s(p: &Path) -> Option<f64> {
    let m = std::fs::metadata(p).ok()?.modified().ok()?;
    Some(
        SystemTime::now()
            .duration_since(m)
            .unwrap_or_default()
            .as_secs_f64(),
    )
}

/// The leaf directory of `k`'s block file.
pub(crate) fn leaf_dir(tier: &FsTier, k: &BlockKey) -> PathBuf {
    tier.block_path(k).parent().unwrap().to_path_buf()
}

/// The top directory of `k`'s block file.
pub(crate) fn top_dir(tier: &FsTier, k: &BlockKey) -> PathBuf {
    tier.block_path(k)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The rank directory of `k`'s block file (the third parent of its path).
pub(crate) fn rank_dir_of(tier: &FsTier, k: &BlockKey) -> PathBuf {
    tier.block_path(k)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every non-directory entry below `dir` (not following links), sorted.
pub(crate) fn all_entries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    walk(dir, |p, m| {
        if !m.is_dir() {
            out.push(p);
        }
    });
    out.sort();
    out
}

/// Every entry below `dir` (links not followed) whose name has `.tmp` in it.
pub(crate) fn tmp_files(dir: &Path) -> Vec<PathBuf> {
    all_entries(dir)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(".tmp"))
        .collect()
}

/// The `.bin` files below `dir`.
pub(crate) fn bin_files(dir: &Path) -> Vec<PathBuf> {
    find_files(dir, ".bin")
}

/// Whether a regular file (not a link, not a directory) is at `p`.
pub(crate) fn is_regular(p: &Path) -> bool {
    std::fs::symlink_metadata(p)
        .map(|m| m.is_file())
        .unwrap_or(false)
}

/// Whether anything (a dangling link included) is at `p`.
pub(crate) fn exists_nofollow(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

/// `p` as a C string.
pub(crate) fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).unwrap()
}

/// The block checksum xattr of the file at `p` (links not followed); `None` if it has none.
pub(crate) fn crc_xattr(p: &Path) -> Option<Vec<u8>> {
    let c = cpath(p);
    let name = CString::new(CRC_XATTR).unwrap();
    let mut buf = vec![0u8; 256];
    // SAFETY: valid path, name and buffer.
    let n = unsafe {
        libc::lgetxattr(
            c.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(buf)
}

/// Sets the block checksum xattr of the file at `p` (links not followed) to `v`, returning
/// the error if that fails ([`set_crc_xattr`] panics instead).
pub(crate) fn try_set_crc_xattr(p: &Path, v: &[u8]) -> std::io::Result<()> {
    let c = cpath(p);
    let name = CString::new(CRC_XATTR).unwrap();
    // SAFETY: valid path, name and value.
    let rc = unsafe { libc::lsetxattr(c.as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Flips the low bit of the byte at `off` of the file at `p`, in place.
pub(crate) fn flip_byte(p: &Path, off: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off).unwrap();
    b[0] ^= 0x01;
    f.write_all_at(&b, off).unwrap();
}

/// Makes a device node at `p` (`mode`: its type and permissions, `dev`: its numbers).
pub(crate) fn mknod(p: &Path, mode: libc::mode_t, dev: libc::dev_t) {
    let c = cpath(p);
    // SAFETY: a valid path.
    let rc = unsafe { libc::mknod(c.as_ptr(), mode, dev) };
    assert_eq!(
        rc,
        0,
        "mknod {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

/// Removes whatever is at `p` (a directory with its contents, a file, a link), if anything.
pub(crate) fn rm_rf(p: &Path) {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir_all(p);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// Regular files (links not followed) below `dir` whose names end with `suffix`.
pub(crate) fn regular_files(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = std::fs::symlink_metadata(e.path()) else {
                continue;
            };
            if m.is_dir() {
                stack.push(e.path());
            } else if m.is_file() && e.path().to_string_lossy().ends_with(suffix) {
                out.push(e.path());
            }
        }
    }
    out
}

/// Truncates the file at `p` to `len` bytes.
pub(crate) fn truncate_file(p: &Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(len)
        .unwrap();
}

/// The shared root's coordination directory (rank 0) on `root`.
pub(crate) fn coord_dir(root: &Path) -> PathBuf {
    ns().namespace_dir(root).join("shared-r0")
}

/// Entries below `dir`, directories included.
pub(crate) fn count_files(dir: &Path) -> usize {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            total += 1;
            if e.metadata().is_ok_and(|m| m.is_dir()) {
                stack.push(e.path());
            }
        }
    }
    total
}

/// The names in the coordination directory `d` and in its `claims`, `members`, `journal`
/// and `grants` directories, as `sub/name`.
pub(crate) fn walk_names(d: &Path) -> Vec<String> {
    let mut v = Vec::new();
    for sub in ["", "claims", "members", "journal", "grants"] {
        if let Ok(rd) = std::fs::read_dir(d.join(sub)) {
            for e in rd.flatten() {
                v.push(format!("{sub}/{}", e.file_name().to_string_lossy()));
            }
        }
    }
    v
}
