//! Low-level file operations: direct-I/O opens, positioned reads and writes, publish without
//! replacing, checksums in extended attributes.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::FromRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

/// The extended attribute holding a block's CRC32C over its key and bytes (4 bytes,
/// little-endian).
pub const CRC_XATTR: &str = "user.kv_tier.crc32c";

/// The xattr of vLLM's per-block checksum (`vllm_checksum`): the CRC32C of the block's bytes,
/// four bytes big-endian.
pub const VLLM_CRC_XATTR: &str = "user.vllm.kv_crc32c";

/// Suffix of the sidecar file holding a block's CRC32C where xattrs are unsupported.
pub const CRC_SIDECAR_SUFFIX: &str = ".crc32c";

fn cstr(p: &Path) -> io::Result<CString> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// Opens a block file for reading, by its whole path (so a rank directory moved away or a
/// link to it retargeted under a running tier is never read from again: a descriptor of the
/// directory, held open, would still read the old one; and it measured no faster on cold
/// loads), never through a symbolic link at the block's own path (`ELOOP`): a link there is
/// damage, not a block. `O_NONBLOCK`: a FIFO at the path must not block the open (it changes
/// nothing for the reads of a regular file).
/// `create_dir_all`, made again when a directory it made (or found) is removed before the
/// next one is made in it: sweeps and `kv-tier gc` remove emptied leaf and top directories
/// while stores make them. Gives up after a few rounds of that.
pub(crate) fn make_dirs(dir: &Path) -> io::Result<()> {
    let mut tries = 0;
    loop {
        match std::fs::create_dir_all(dir) {
            Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 8 => tries += 1,
            r => return r,
        }
    }
}

pub(crate) fn open_read(path: &Path, direct: bool) -> io::Result<File> {
    let c = cstr(path)?;
    let mut flags = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NONBLOCK;
    if direct {
        flags |= libc::O_DIRECT;
    }
    // SAFETY: a NUL-terminated path; the returned descriptor is owned by the File.
    let fd = unsafe { libc::open(c.as_ptr(), flags) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Opens an unnamed temp file in `dir` (`O_TMPFILE`), mode 0644: invisible until
/// [`link_unnamed`] gives it a name, gone with its descriptor otherwise.
pub(crate) fn create_unnamed(dir: &Path, direct: bool) -> io::Result<File> {
    let c = cstr(dir)?;
    let mut flags = libc::O_TMPFILE | libc::O_WRONLY | libc::O_CLOEXEC;
    if direct {
        flags |= libc::O_DIRECT;
    }
    // SAFETY: a valid NUL-terminated path; the returned descriptor is owned by the File.
    let fd = unsafe { libc::open(c.as_ptr(), flags, 0o644 as libc::c_uint) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and is owned by nobody else.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Gives the unnamed file `f` ([`create_unnamed`]) the name `dest`, never replacing:
/// `Ok(false)` when `dest` exists. Links through `/proc/self/fd` (`AT_EMPTY_PATH` needs a
/// capability).
pub(crate) fn link_unnamed(f: &File, dest: &Path) -> io::Result<bool> {
    let from = CString::new(format!("/proc/self/fd/{}", f.as_raw_fd())).expect("no NUL");
    let to = cstr(dest)?;
    // SAFETY: valid NUL-terminated paths; AT_FDCWD resolves them like link(2).
    let rc = unsafe {
        libc::linkat(
            libc::AT_FDCWD,
            from.as_ptr(),
            libc::AT_FDCWD,
            to.as_ptr(),
            libc::AT_SYMLINK_FOLLOW,
        )
    };
    if rc == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::EEXIST) => Ok(false),
        _ => Err(e),
    }
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

/// Reads the file from offset 0 into `buf` and, in the same `preadv`, up to `tail.len()`
/// bytes past it: returns the bytes read in all, so `buf.len()` exactly means the file is
/// exactly `buf.len()` bytes long (fewer: short; more: long) with no `fstat`. Under
/// `O_DIRECT` `tail` must be aligned like `buf` (a whole logical block).
pub(crate) fn read_sized(f: &File, buf: &mut [u8], tail: &mut [u8]) -> io::Result<usize> {
    let mut done = 0;
    loop {
        let n = if done < buf.len() {
            let iov = [
                libc::iovec {
                    iov_base: buf[done..].as_mut_ptr().cast(),
                    iov_len: buf.len() - done,
                },
                libc::iovec {
                    iov_base: tail.as_mut_ptr().cast(),
                    iov_len: tail.len(),
                },
            ];
            // SAFETY: both vectors point into live, exclusively borrowed buffers of the
            // given lengths; the fd is open for reading.
            let rc = unsafe { libc::preadv(f.as_raw_fd(), iov.as_ptr(), 2, done as libc::off_t) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            rc as usize
        } else {
            // the block is whole; only the tail is left (a partial read at the end)
            let from = done - buf.len();
            if from >= tail.len() {
                return Ok(done);
            }
            match f.read_at(&mut tail[from..], done as u64) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        };
        if n == 0 {
            return Ok(done);
        }
        let asked = buf.len() + tail.len() - done;
        done += n;
        // a regular file reads short only at its end: a whole block read short of the tail
        // is the file's size (no second call to see the end)
        if done >= buf.len() + tail.len() || (n < asked && done >= buf.len()) {
            return Ok(done);
        }
    }
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
        Some(libc::EINVAL) | Some(libc::ENOSYS) | Some(libc::ENOTSUP) => link_noreplace(tmp, dest),
        _ => Err(e),
    }
}

/// A temp name beside `path` for a file moved aside (unique in this process; `*.tmp`, so a
/// crash that leaves it is reaped with the other temp files).
pub(crate) fn aside_path(path: &Path) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut s = path.as_os_str().to_os_string();
    s.push(format!("_aside{:x}_{n:x}.tmp", std::process::id()));
    s.into()
}

/// Deletes the checksum sidecar of the block file `bin` if `bin` is not there and `reapable`
/// says so of the sidecar, without ever deleting a sidecar a store writes meanwhile. A store
/// publishes its block and only then renames its sidecar into place, so the sidecar is first
/// moved aside and the block looked for after: still absent, what was moved is older than any
/// store's sidecar, and goes; there, what was moved may be that store's, and is put back
/// unless a sidecar stands at the path again (then that one is the store's, and the one aside
/// goes). Returns whether a sidecar was deleted.
pub(crate) fn reap_orphan_sidecar(
    bin: &Path,
    reapable: impl Fn(&std::fs::Metadata) -> bool,
) -> bool {
    let side = sidecar_path(bin);
    if std::fs::symlink_metadata(bin).is_ok()
        || !std::fs::symlink_metadata(&side).is_ok_and(|m| m.is_file() && reapable(&m))
    {
        return false;
    }
    let aside = aside_path(&side);
    if std::fs::rename(&side, &aside).is_err() {
        return false;
    }
    if std::fs::symlink_metadata(bin).is_err() {
        return std::fs::remove_file(&aside).is_ok();
    }
    if !matches!(publish_noreplace(&aside, &side), Ok(true)) {
        let _ = std::fs::remove_file(&aside);
    }
    false
}

/// [`publish_noreplace`] with link(2) and unlink(2), for filesystems without
/// `RENAME_NOREPLACE`.
fn link_noreplace(tmp: &Path, dest: &Path) -> io::Result<bool> {
    match std::fs::hard_link(tmp, dest) {
        Ok(()) => {
            let _ = std::fs::remove_file(tmp);
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(false),
        Err(e) => Err(e),
    }
}

/// Sets the xattr `name` of `f` to `v`.
fn set_xattr(f: &File, name: &str, v: &[u8]) -> io::Result<()> {
    let name = CString::new(name).expect("a static name");
    // SAFETY: valid fd, name and value buffer of `v.len()` bytes.
    let rc =
        unsafe { libc::fsetxattr(f.as_raw_fd(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A checksum xattr as read: its 4 bytes, its size when it is not 4 bytes, or none.
enum Xattr4 {
    Bytes([u8; 4]),
    /// Its size in bytes (`None`: more than 8).
    Sized(Option<isize>),
    Missing,
}

/// What `fgetxattr`/`lgetxattr` into an 8-byte buffer returned, read at once (before anything
/// else can change `errno`).
fn xattr4(rc: isize, v: [u8; 8]) -> io::Result<Xattr4> {
    match rc {
        4 => Ok(Xattr4::Bytes(v[..4].try_into().expect("4 bytes"))),
        0.. => Ok(Xattr4::Sized(Some(rc))),
        _ => {
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::ENODATA) => Ok(Xattr4::Missing),
                Some(libc::ERANGE) => Ok(Xattr4::Sized(None)),
                _ => Err(e),
            }
        }
    }
}

/// The xattr `name` of `f`, as [`Xattr4`].
fn get_xattr4(f: &File, name: &str) -> io::Result<Xattr4> {
    let name = CString::new(name).expect("a static name");
    let mut v = [0u8; 8];
    // SAFETY: valid fd, name and an 8-byte buffer.
    let rc =
        unsafe { libc::fgetxattr(f.as_raw_fd(), name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    xattr4(rc, v)
}

/// [`get_xattr4`] of the file at `path`, not following a link.
fn get_xattr4_path(path: &Path, name: &str) -> io::Result<Xattr4> {
    let (p, name) = (cstr(path)?, CString::new(name).expect("a static name"));
    let mut v = [0u8; 8];
    // SAFETY: valid path, name and an 8-byte buffer.
    let rc = unsafe { libc::lgetxattr(p.as_ptr(), name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    xattr4(rc, v)
}

pub(crate) fn set_crc_xattr(f: &File, crc: u32) -> io::Result<()> {
    set_xattr(f, CRC_XATTR, &crc.to_le_bytes())
}

/// Sets vLLM's checksum xattr of `data` on `f`.
pub(crate) fn set_vllm_crc(f: &File, data: &[u8]) -> io::Result<()> {
    set_xattr(f, VLLM_CRC_XATTR, &crc32c::crc32c(data).to_be_bytes())
}

/// vLLM's checksum in the xattr of `f`: `Ok(None)` without one, `Err` naming what is wrong
/// with one that is not 4 bytes (`Ok(Err(..))`), or the I/O error.
pub(crate) fn get_vllm_crc(f: &File) -> io::Result<Option<std::result::Result<u32, String>>> {
    get_xattr4(f, VLLM_CRC_XATTR).map(vllm_crc_of)
}

/// [`get_vllm_crc`] of the file at `path` (not following a link).
pub(crate) fn get_vllm_crc_path(
    path: &Path,
) -> io::Result<Option<std::result::Result<u32, String>>> {
    get_xattr4_path(path, VLLM_CRC_XATTR).map(vllm_crc_of)
}

fn vllm_crc_of(x: Xattr4) -> Option<std::result::Result<u32, String>> {
    match x {
        Xattr4::Bytes(b) => Some(Ok(u32::from_be_bytes(b))),
        Xattr4::Sized(Some(n)) => Some(Err(format!("its vLLM checksum xattr is {n} bytes, not 4"))),
        Xattr4::Sized(None) => Some(Err("its vLLM checksum xattr is longer than 4 bytes".into())),
        Xattr4::Missing => None,
    }
}

/// Opens `path` for reading without blocking (a FIFO at a path would otherwise block the
/// open until a writer came), and only if it is a regular file: `Ok(None)` otherwise.
pub(crate) fn open_regular(path: &Path) -> io::Result<Option<File>> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(path)?;
    Ok(f.metadata()?.is_file().then_some(f))
}

/// Reads a regular file whole (`Ok(None)`: something else is at the path), into a buffer
/// sized from `fstat` once (no copy as it grows: a checkpoint is hundreds of MB); a length no
/// allocation can hold (a sparse file can claim any) is read as it comes.
pub(crate) fn read_regular(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let Some(mut f) = open_regular(path)? else {
        return Ok(None);
    };
    let len = f.metadata()?.len();
    let mut v = Vec::new();
    // one past its length sees the end without a grow
    let _ = v.try_reserve_exact(usize::try_from(len).unwrap_or(usize::MAX).saturating_add(1));
    std::io::Read::read_to_end(&mut f, &mut v)?;
    Ok(Some(v))
}

pub(crate) use kv_tier_core::checksum::{StoredCrc, block_crc};

/// The checksum in the file's xattr (`fgetxattr`, no extra path lookup).
pub(crate) fn get_crc_xattr(f: &File) -> io::Result<StoredCrc> {
    get_xattr4(f, CRC_XATTR).map(crc_of)
}

/// The checksum in the xattr of the file at `path` (not following a link).
pub(crate) fn get_crc_xattr_path(path: &Path) -> io::Result<StoredCrc> {
    get_xattr4_path(path, CRC_XATTR).map(crc_of)
}

fn crc_of(x: Xattr4) -> StoredCrc {
    match x {
        Xattr4::Bytes(b) => StoredCrc::Crc(u32::from_le_bytes(b)),
        Xattr4::Sized(Some(n)) => {
            StoredCrc::Malformed(format!("its checksum xattr is {n} bytes, not 4"))
        }
        Xattr4::Sized(None) => {
            StoredCrc::Malformed("its checksum xattr is longer than 4 bytes".into())
        }
        Xattr4::Missing => StoredCrc::Missing,
    }
}

/// When the inode of `m` last changed (its ctime: a publish, a rename, a chmod).
pub(crate) fn changed_at(m: &std::fs::Metadata) -> std::time::SystemTime {
    use std::os::unix::fs::MetadataExt as _;
    std::time::UNIX_EPOCH
        + std::time::Duration::new(
            m.ctime().max(0) as u64,
            m.ctime_nsec().clamp(0, 999_999_999) as u32,
        )
}

pub(crate) fn sidecar_path(bin: &Path) -> std::path::PathBuf {
    let mut s = bin.as_os_str().to_os_string();
    s.push(CRC_SIDECAR_SUFFIX);
    s.into()
}

/// The sidecar's bytes: the CRC32C (4 bytes, little-endian) and the inode number of the
/// block file it belongs to (8 bytes, little-endian), so a sidecar left behind by a deleted
/// block is never taken for the checksum of a file written at the same path since.
pub(crate) fn sidecar_bytes(crc: u32, ino: u64) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[..4].copy_from_slice(&crc.to_le_bytes());
    b[4..].copy_from_slice(&ino.to_le_bytes());
    b
}

/// The checksum in the sidecar of the block file `bin` whose inode is `ino`; one of another
/// inode is stale (`Missing`); anything but 12 bytes of a regular file is malformed.
pub(crate) fn read_sidecar(bin: &Path, ino: u64) -> io::Result<StoredCrc> {
    match read_regular(&sidecar_path(bin)) {
        Ok(None) => Ok(StoredCrc::Malformed(
            "its checksum sidecar is not a regular file".into(),
        )),
        Ok(Some(v)) => sidecar_crc(&v, ino),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(StoredCrc::Missing),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => Ok(StoredCrc::Malformed(
            "its checksum sidecar is a link".into(),
        )),
        Err(e) => Err(e),
    }
}

fn sidecar_crc(v: &[u8], ino: u64) -> io::Result<StoredCrc> {
    let Ok(v) = <[u8; 12]>::try_from(v) else {
        return Ok(StoredCrc::Malformed(format!(
            "its checksum sidecar is {} bytes, not 12",
            v.len()
        )));
    };
    let crc = u32::from_le_bytes(v[..4].try_into().expect("4 bytes"));
    let owner = u64::from_le_bytes(v[4..].try_into().expect("8 bytes"));
    Ok(if owner == ino {
        StoredCrc::Crc(crc)
    } else {
        StoredCrc::Missing // left by a block deleted since
    })
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

#[cfg(test)]
mod tests {
    #[test]
    fn make_dirs_makes_the_whole_path_again_after_a_remover() {
        let d = tempfile::tempdir().unwrap();
        let leaf = d.path().join("top").join("leaf");
        super::make_dirs(&leaf).unwrap();
        std::fs::remove_dir(&leaf).unwrap();
        std::fs::remove_dir(d.path().join("top")).unwrap();
        super::make_dirs(&leaf).unwrap();
        assert!(leaf.is_dir());
        // a path under a file is refused, not retried for ever
        std::fs::write(d.path().join("f"), b"x").unwrap();
        assert!(super::make_dirs(&d.path().join("f").join("x")).is_err());
    }

    use super::*;

    /// Makes `renameat2` fail with `EINVAL` on the calling thread only (a seccomp filter, as
    /// a filesystem without `RENAME_NOREPLACE` answers). Returns false where that cannot be
    /// set up (another architecture, a kernel without seccomp).
    fn refuse_renameat2_on_this_thread() -> bool {
        #[cfg(target_arch = "x86_64")]
        const ARCH: u32 = 0xC000_003E; // AUDIT_ARCH_X86_64
        #[cfg(target_arch = "aarch64")]
        const ARCH: u32 = 0xC000_00B7; // AUDIT_ARCH_AARCH64
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        return false;
        #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
        {
            let op = |code: u32, jt: u8, jf: u8, k: u32| libc::sock_filter {
                code: code as u16,
                jt,
                jf,
                k,
            };
            let filter = [
                // seccomp_data: nr at offset 0, arch at offset 4
                op(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, 4),
                op(libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K, 0, 3, ARCH),
                op(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, 0, 0, 0),
                op(
                    libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K,
                    0,
                    1,
                    libc::SYS_renameat2 as u32,
                ),
                op(
                    libc::BPF_RET | libc::BPF_K,
                    0,
                    0,
                    libc::SECCOMP_RET_ERRNO | libc::EINVAL as u32,
                ),
                op(libc::BPF_RET | libc::BPF_K, 0, 0, libc::SECCOMP_RET_ALLOW),
            ];
            let prog = libc::sock_fprog {
                len: filter.len() as u16,
                filter: filter.as_ptr().cast_mut(),
            };
            // SAFETY: prctl with constant arguments; the filter outlives the call (the
            // kernel copies it). Without SECCOMP_FILTER_FLAG_TSYNC it binds this thread only.
            unsafe {
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) == 0
                    && libc::prctl(
                        libc::PR_SET_SECCOMP,
                        libc::SECCOMP_MODE_FILTER,
                        &prog as *const libc::sock_fprog,
                    ) == 0
            }
        }
    }

    /// On a filesystem without `RENAME_NOREPLACE` (renameat2 refused with `EINVAL`), a
    /// publish falls back to link(2): the block is published, the temp name is gone, and a
    /// second publish to the same path still never replaces the first.
    #[test]
    fn publishing_falls_back_to_link_without_rename_noreplace() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path().to_path_buf();
        let out = std::thread::spawn(move || {
            if !refuse_renameat2_on_this_thread() {
                return None;
            }
            let (a, b, dest) = (d.join("a.tmp"), d.join("b.tmp"), d.join("block.bin"));
            std::fs::write(&a, b"first").unwrap();
            std::fs::write(&b, b"second").unwrap();
            let renames = std::fs::rename(&a, d.join("x")).is_ok(); // plain rename still works
            std::fs::rename(d.join("x"), &a).unwrap();
            Some((
                renames,
                publish_noreplace(&a, &dest).unwrap(),
                a.exists(),
                publish_noreplace(&b, &dest).unwrap(),
                std::fs::read(&dest).unwrap(),
            ))
        })
        .join()
        .unwrap();
        let Some((renames, first, tmp_left, second, content)) = out else {
            eprintln!("skipped: seccomp is not available here");
            return;
        };
        assert!(renames);
        assert!(first, "the first publish did not publish");
        assert!(!tmp_left, "the temp name of a published block stays");
        assert!(!second, "a second publish replaced the first");
        assert_eq!(content, b"first");
    }

    /// A read error other than an interruption is returned, not retried: reading a
    /// directory (`EISDIR`) ends with that error (on a thread, so a retry loop fails the
    /// test instead of hanging it).
    #[test]
    fn a_read_error_is_returned_not_retried() {
        let dir = tempfile::tempdir().unwrap();
        let f = File::open(dir.path()).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (mut buf, mut tail) = ([0u8; 16], [0u8; 4]);
            let _ = tx.send(read_sized(&f, &mut buf, &mut tail).map_err(|e| e.raw_os_error()));
        });
        let r = rx
            .recv_timeout(std::time::Duration::from_secs(30))
            .expect("read_sized kept retrying an error");
        assert_eq!(r, Err(Some(libc::EISDIR)));
    }

    /// `read_sized` tells a short, an exact and a long file apart by its count alone, with
    /// and without O_DIRECT.
    #[test]
    fn read_sized_tells_short_exact_and_long_files_apart() {
        let dir = tempfile::tempdir().unwrap();
        let bs = 8192;
        for (len, expect) in [
            (3usize, 3usize),
            (bs, bs),
            (bs + 1, bs + 1),
            (3 * bs, bs + 512),
        ] {
            let p = dir.path().join(format!("f{len}"));
            let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            std::fs::write(&p, &data).unwrap();
            for direct in [false, true] {
                let f = open_read(&dir.path().join(format!("f{len}")), direct).unwrap();
                let mut buf = kv_tier_core::AlignedBuf::zeroed(bs);
                let mut tail = kv_tier_core::AlignedBuf::zeroed(512);
                let n = match read_sized(&f, buf.as_mut_slice(), tail.as_mut_slice()) {
                    Ok(n) => n,
                    // O_DIRECT refuses a read ending in a partial block on some filesystems
                    Err(e) if direct && e.raw_os_error() == Some(libc::EINVAL) => continue,
                    Err(e) => panic!("{len} bytes, direct {direct}: {e}"),
                };
                assert_eq!(n, expect, "{len} bytes, direct {direct}");
                let m = n.min(bs);
                assert_eq!(
                    &buf.as_slice()[..m],
                    &data[..m],
                    "{len} bytes, direct {direct}"
                );
                if n > bs {
                    assert_eq!(&tail.as_slice()[..n - bs], &data[bs..n]);
                }
            }
        }
    }

    #[test]
    fn publishing_by_link_never_replaces_and_reports_other_failures() {
        let dir = tempfile::tempdir().unwrap();
        let (tmp, dest) = (dir.path().join("a.tmp"), dir.path().join("a.bin"));
        std::fs::write(&tmp, b"new").unwrap();
        std::fs::write(&dest, b"old").unwrap();
        assert!(!link_noreplace(&tmp, &dest).unwrap(), "replaced");
        assert_eq!(std::fs::read(&dest).unwrap(), b"old");
        std::fs::remove_file(&dest).unwrap();
        assert!(link_noreplace(&tmp, &dest).unwrap());
        assert_eq!(std::fs::read(&dest).unwrap(), b"new");
        assert!(!tmp.exists(), "the temp name stays");
        // a failure that is not "it exists" is an error, not "someone else published"
        std::fs::write(&tmp, b"new").unwrap();
        let e = link_noreplace(&tmp, &dir.path().join("no-such-dir/a.bin")).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::NotFound);
    }

    #[test]
    fn a_sidecar_that_cannot_be_opened_is_an_error_unless_it_is_a_link() {
        let dir = tempfile::tempdir().unwrap();
        // a path under a regular file: ENOTDIR, an I/O failure (not damage of the sidecar)
        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        let e = read_sidecar(&file.join("a.bin"), 1).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOTDIR));
        // a link where the sidecar should be: damage
        let bin = dir.path().join("b.bin");
        std::os::unix::fs::symlink(&file, sidecar_path(&bin)).unwrap();
        assert!(matches!(
            read_sidecar(&bin, 1).unwrap(),
            StoredCrc::Malformed(_)
        ));
        assert_eq!(
            read_sidecar(&dir.path().join("c.bin"), 1).unwrap(),
            StoredCrc::Missing
        );
    }
}
