//! A running tier's mark on its root, so that an operator's command can tell a root in use
//! from one no engine has open: `<namespace dir>/.kv-tier-live-<host>-<pid>-<salt>` (beside
//! the namespace's `config.json`, outside the rank directories that hold blocks), a small file
//! saying who holds it, locked (`flock`, exclusive) by the tier for as long as it is open and
//! removed when it is shut down or dropped. A tier killed without its drop leaves the file, but the kernel
//! drops the lock with the process: a file whose lock can be taken is a stale mark, reaped
//! by the next tier that opens the root.
//!
//! `flock` is local to a machine (and not reliable on every network filesystem): a root
//! shared between machines is seen live only from the machine whose tier holds it.

use std::fs::File;
use std::io::{self, Read as _, Write as _};
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};

/// How a mark's file name begins, in a namespace directory.
pub const LIVE_PREFIX: &str = ".kv-tier-live-";

/// A mark's file is at most this long when read (it holds a line of JSON).
const MAX_MARK_BYTES: u64 = 4096;

/// This tier's mark: the locked file, removed (then unlocked, by closing it) on drop.
#[derive(Debug)]
pub(crate) struct LiveMark {
    path: PathBuf,
    _file: File,
}

impl Drop for LiveMark {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// `flock(fd, how | LOCK_NB)`: `Ok(true)` taken, `Ok(false)` another holds it (exclusively,
/// for a shared `how`).
fn try_lock(f: &File, how: libc::c_int) -> io::Result<bool> {
    // SAFETY: flock on a descriptor this `File` owns; no memory is passed.
    let r = unsafe { libc::flock(f.as_raw_fd(), how | libc::LOCK_NB) };
    if r == 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
        Ok(false)
    } else {
        Err(e)
    }
}

/// Marks namespace directory `dir` as in use by this process's tier of rank directory `rank`
/// (reaping the stale marks of tiers that ended without removing theirs).
pub(crate) fn mark(dir: &Path, rank: &str) -> io::Result<LiveMark> {
    for h in scan(dir)? {
        if !h.live {
            let _ = std::fs::remove_file(&h.path);
        }
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .unwrap_or_default();
    let pid = std::process::id();
    let path = dir.join(format!(
        "{LIVE_PREFIX}{}-{pid}-{:016x}",
        if host.is_empty() { "host" } else { &host },
        crate::block::random_salt()
    ));
    // locked under a temp name first, then renamed into place (the lock goes with the file):
    // a scan never sees a mark before its lock is held, and so never takes it for stale
    let mut tmp = path.clone().into_os_string();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    let mut file = File::create_new(&tmp)?;
    if !try_lock(&file, libc::LOCK_EX)? {
        let _ = std::fs::remove_file(&tmp);
        return Err(io::Error::other(format!(
            "{} was locked at its creation",
            tmp.display()
        )));
    }
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let what = serde_json::json!({
        "pid": pid,
        "host": host,
        "rank_dir": rank,
        "started_unix_s": started,
    });
    let published = writeln!(file, "{what}").and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = published {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(LiveMark { path, _file: file })
}

/// A mark found under a root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Holder {
    /// The mark's file.
    pub path: PathBuf,
    /// What it says of its holder (a line of JSON: pid, host, namespace, start time), or
    /// why it could not be read.
    pub says: String,
    /// Whether its lock is held: a tier has the root open on this machine.
    pub live: bool,
}

/// The marks under `root` (in its namespace directories): the tiers that have it open (live)
/// and those that ended without removing theirs.
///
/// ```
/// # fn main() -> Result<(), Box<dyn std::error::Error>> {
/// # let root = tempfile::tempdir()?;
/// # let ns = kv_tier_core::Namespace::new(kv_tier_core::RunFields::new("org/m", "torch.bfloat16", 16), 0)?;
/// use kv_tier_fs::offline::holders;
/// let tier = kv_tier_fs::FsTier::open("fs", kv_tier_fs::FsTierConfig::new(root.path()), ns, 4096)?;
/// let live: Vec<_> = holders(root.path())?.into_iter().filter(|h| h.live).collect();
/// assert_eq!(live.len(), 1);
/// assert!(live[0].says.contains(&format!("\"pid\":{}", std::process::id())));
/// drop(tier);
/// assert!(holders(root.path())?.is_empty());
/// # Ok(()) }
/// ```
pub fn holders(root: &Path) -> io::Result<Vec<Holder>> {
    let entries = std::fs::read_dir(root)
        .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", root.display())))?;
    let mut out = Vec::new();
    for e in entries {
        let e = e?;
        // a namespace directory: the one with a `config.json` (not a rank directory, nor
        // another program's); one this process cannot read holds no mark it can see
        if e.file_type().is_ok_and(|t| t.is_dir()) && e.path().join("config.json").exists() {
            match scan(&e.path()) {
                Ok(h) => out.extend(h),
                Err(e) if e.kind() == io::ErrorKind::PermissionDenied => {}
                Err(e) => return Err(e),
            }
        }
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}

fn scan(dir: &Path) -> io::Result<Vec<Holder>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        // gone, or not ours to read: no mark of a tier there
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound | io::ErrorKind::NotADirectory
            ) =>
        {
            return Ok(Vec::new());
        }
        Err(e) => return Err(io::Error::new(e.kind(), format!("{}: {e}", dir.display()))),
    };
    let mut out = Vec::new();
    for e in entries {
        let e = e?;
        let path = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        // a mark being made is `.tmp` until its lock is held
        if !name.starts_with(LIVE_PREFIX) || name.ends_with(".tmp") {
            continue;
        }
        // regular files only, opened without following a link nor blocking on a FIFO
        let opened = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path);
        let f = match opened {
            Ok(f) if f.metadata().is_ok_and(|m| m.is_file()) => f,
            Ok(_) => continue,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => {
                out.push(Holder {
                    path,
                    says: format!("unreadable: {e}"),
                    live: true,
                });
                continue;
            }
        };
        // a shared lock: scans never see each other as holders; a lock that cannot be asked
        // (some network filesystems) counts as held
        let live = !try_lock(&f, libc::LOCK_SH).unwrap_or(false);
        let mut says = String::new();
        if let Err(e) = (&f).take(MAX_MARK_BYTES).read_to_string(&mut says) {
            says = format!("unreadable: {e}");
        }
        out.push(Holder {
            path,
            says: says.trim().to_string(),
            live,
        });
    }
    out.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(out)
}
