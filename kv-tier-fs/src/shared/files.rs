//! The coordination files' formats and how they are written: whole files through a temp
//! file and a rename, the lease, the leader's state, journal records.

use std::fs::File;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use kv_tier_core::{BlockKey, Namespace};

/// Why a path of the coordination directory could not be used.
pub(super) fn ctx(what: &str, p: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", p.display()))
}

/// Writes `path` whole through a temp file and a rename (readers see the old or the new).
pub(super) fn replace(path: &Path, content: &str) -> io::Result<()> {
    // the whole name, this process and random bits: ids may hold dots, and containers on
    // several hosts may all run as pid 1
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(
        ".new-{}-{:08x}",
        std::process::id(),
        random_bits() as u32
    ));
    let tmp = path.with_file_name(name);
    std::fs::write(&tmp, content)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// A few random bits (the std hasher's random keys: no dependency).
pub(super) fn random_bits() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish()
}

/// Whether a name in the coordination directory is a temp file (`.new-`) or another
/// process's leftover (dotfiles, such as NFS's `.nfsXXXX` of a removed open file), not an
/// instance.
pub(super) fn not_an_instance(name: &str) -> bool {
    name.starts_with('.') || name.contains(".new-")
}

pub(super) fn read_opt(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// A grant file's `(epoch, granted)`.
pub(super) fn read_grant(path: &Path) -> Option<(u64, u64)> {
    let s = read_opt(path)?;
    let mut it = s.split_whitespace();
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// The lease file's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Lease {
    pub(super) epoch: u64,
    pub(super) owner: String,
    pub(super) beat: u64,
}

impl Lease {
    pub(super) fn parse(s: &str) -> Option<Self> {
        let mut it = s.split_whitespace();
        Some(Self {
            epoch: it.next()?.parse().ok()?,
            owner: it.next()?.to_string(),
            beat: it.next()?.parse().ok()?,
        })
    }
    pub(super) fn render(&self) -> String {
        format!("{} {} {}\n", self.epoch, self.owner, self.beat)
    }
}

/// The leader's published view (`state`): for the others' stats, and the settings every
/// instance must share.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct State {
    pub(super) epoch: u64,
    pub(super) bytes: u64,
    pub(super) cap: u64,
    pub(super) members: u64,
    pub(super) lease_ms: u64,
    pub(super) stamp_ms: u64,
}

impl State {
    pub(super) fn parse(s: &str) -> Option<Self> {
        let f: Vec<u64> = s
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        let [epoch, bytes, cap, members, lease_ms, stamp_ms] = f[..] else {
            return None;
        };
        Some(Self {
            epoch,
            bytes,
            cap,
            members,
            lease_ms,
            stamp_ms,
        })
    }

    pub(super) fn render(&self) -> String {
        format!(
            "{} {} {} {} {} {}\n",
            self.epoch, self.bytes, self.cap, self.members, self.lease_ms, self.stamp_ms
        )
    }
}

/// What a journal line says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Record {
    /// `P <path> <credit>`: a store announced, its credit spent.
    Store,
    /// `D <path>`: that store's job ended.
    Done,
    /// `R <path>`: a block about to be read.
    Read,
}

impl Record {
    fn tag(self) -> &'static str {
        match self {
            Record::Store => "P",
            Record::Done => "D",
            Record::Read => "R",
        }
    }

    /// A journal line's record, path and credit (0 but for stores).
    pub(super) fn parse(line: &str) -> Option<(Self, &str, u64)> {
        let mut it = line.split_whitespace();
        let kind = match it.next()? {
            "P" => Record::Store,
            "D" => Record::Done,
            "R" => Record::Read,
            _ => return None,
        };
        let rel = it.next()?;
        let credit = it.next().and_then(|x| x.parse().ok()).unwrap_or(0);
        Some((kind, rel, credit))
    }

    /// Journal lines of this record for `keys` (stores with `credit` each).
    pub(super) fn lines(self, ns: &Namespace, keys: &[BlockKey], credit: u64) -> String {
        let mut out = String::with_capacity(keys.len() * 120);
        for k in keys {
            out.push_str(self.tag());
            out.push(' ');
            out.push_str(&ns.block_rel_path(k));
            if self == Record::Store {
                out.push(' ');
                out.push_str(&credit.to_string());
            }
            out.push('\n');
        }
        out
    }
}

/// Opens (making it if missing) a journal for appending.
pub(super) fn open_journal(path: &Path) -> io::Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
}
