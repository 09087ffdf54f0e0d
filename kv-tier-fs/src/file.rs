//! Low-level file operations: direct-I/O opens, positioned reads and writes, publish without
//! replacing, checksums in extended attributes.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// The extended attribute holding a block's CRC32C (4 bytes, little-endian).
pub const CRC_XATTR: &str = "user.kv_tier.crc32c";

/// Suffix of the sidecar file holding a block's CRC32C where xattrs are unsupported.
pub const CRC_SIDECAR_SUFFIX: &str = ".crc32c";

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

pub(crate) fn open_read(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.read(true);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Creates `path` exclusively (`O_CREAT | O_EXCL`), mode 0644.
pub(crate) fn create_excl(path: &Path, direct: bool) -> io::Result<File> {
    let mut o = OpenOptions::new();
    o.write(true).create_new(true).mode(0o644);
    if direct {
        o.custom_flags(libc::O_DIRECT);
    }
    o.open(path)
}

/// Reads from offset 0 until `buf` is full or end of file; returns the bytes read.
pub(crate) fn read_full(f: &File, buf: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

pub(crate) fn write_full(f: &File, buf: &[u8]) -> io::Result<()> {
    f.write_all_at(buf, 0)
}

/// Moves `tmp` to `dest` unless `dest` exists. Returns `Ok(true)` when published, `Ok(false)`
/// when `dest` already existed (then `tmp` is left for the caller to remove).
pub(crate) fn publish_noreplace(tmp: &Path, dest: &Path) -> io::Result<bool> {
    let (t, d) = (cstr(tmp)?, cstr(dest)?);
    // SAFETY: valid NUL-terminated paths; AT_FDCWD resolves them like rename(2).
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::AT_FDCWD,
            d.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EEXIST) => Ok(false),
        // The filesystem has no RENAME_NOREPLACE: link(2) never replaces either.
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::ENOTSUP) => {
            match std::fs::hard_link(tmp, dest) {
                Ok(()) => {
                    let _ = std::fs::remove_file(tmp);
                    Ok(true)
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
                Err(e) => Err(e),
            }
        }
        _ => Err(e),
    }
}

pub(crate) fn set_crc_xattr(f: &File, crc: u32) -> io::Result<()> {
    let name = CString::new(CRC_XATTR).expect("static name");
    let v = crc.to_le_bytes();
    // SAFETY: valid fd, name and a 4-byte value buffer.
    let rc =
        unsafe { libc::fsetxattr(f.as_raw_fd(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The stored CRC32C, `Ok(None)` when the file has none (written by another tool).
pub(crate) fn get_crc_xattr(f: &File) -> io::Result<Option<u32>> {
    let name = CString::new(CRC_XATTR).expect("static name");
    let mut v = [0u8; 4];
    // SAFETY: valid fd, name and a 4-byte buffer.
    let rc =
        unsafe { libc::fgetxattr(f.as_raw_fd(), name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    if rc == 4 {
        return Ok(Some(u32::from_le_bytes(v)));
    }
    if rc >= 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "checksum xattr is not 4 bytes",
        ));
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::ENODATA) {
        Ok(None)
    } else {
        Err(e)
    }
}

pub(crate) fn sidecar_path(bin: &Path) -> std::path::PathBuf {
    let mut s = bin.as_os_str().to_os_string();
    s.push(CRC_SIDECAR_SUFFIX);
    s.into()
}

pub(crate) fn read_sidecar(bin: &Path) -> io::Result<Option<u32>> {
    match std::fs::read(sidecar_path(bin)) {
        Ok(v) if v.len() == 4 => Ok(Some(u32::from_le_bytes(v.try_into().expect("4 bytes")))),
        Ok(_) => Ok(None),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

pub(crate) fn fsync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Whether the same file (device and inode) is still at `path`.
pub(crate) fn same_file(f: &File, path: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (f.metadata(), std::fs::symlink_metadata(path)) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}
