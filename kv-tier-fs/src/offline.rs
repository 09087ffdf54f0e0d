//! Tools for a cache directory that no engine has open (the `kv-tier` command's `inspect`,
//! `verify` and `gc`): its namespaces, what their rank directories hold, a block file's
//! health, and the oldest-first order a sweep deletes in.
//!
//! ```
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! use kv_tier_fs::offline::{Health, check_block, namespaces, scan_rank};
//! let root = tempfile::tempdir()?;
//! // a root written by the fs tier (or by vLLM's): namespaces with their config.json
//! # let ns = kv_tier_core::Namespace::new(kv_tier_core::RunFields::new("org/m", "torch.bfloat16", 16), 0)?;
//! # let tier = kv_tier_fs::FsTier::open("fs", kv_tier_fs::FsTierConfig::new(root.path()), ns, 4096)?;
//! # drop(tier);
//! for ns in namespaces(root.path())? {
//!     for (rank, dir) in &ns.ranks {
//!         let scan = scan_rank(dir, ns.namespace(*rank).as_ref())?;
//!         for b in &scan.blocks {
//!             let health = check_block(&b.path, b.key.as_ref(), 4096);
//!             assert!(!health.is_damage(), "{}: {health:?}", b.path.display());
//!         }
//!     }
//! }
//! # Ok(()) }
//! ```

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use kv_tier_core::checksum::{self, StoredCrc, Verdict};
use kv_tier_core::{BlockKey, Namespace};

use crate::file;
pub use crate::live::{Holder, LIVE_PREFIX, holders};

/// A namespace directory under a root: `<model>_<digest>` with its `config.json`, and the
/// rank directories beside it (`<model>_<digest>_r<rank>`).
#[derive(Debug, Clone)]
pub struct NamespaceDir {
    /// The directory's name.
    pub name: String,
    /// Its path.
    pub path: PathBuf,
    /// The run fields of its `config.json`, if it has one that parses.
    pub fields: Option<serde_json::Value>,
    /// Why `config.json` could not be read (missing, unreadable, not JSON).
    pub config_error: Option<String>,
    /// Its rank directories, by rank.
    pub ranks: Vec<(u32, PathBuf)>,
}

impl NamespaceDir {
    /// The layout of rank `rank` of this namespace, from its `config.json` (`None` without
    /// one, or when the fields do not describe this directory: then block names are not
    /// checked against the layout and checksums cannot be verified).
    pub fn namespace(&self, rank: u32) -> Option<Namespace> {
        let ns = Namespace::from_json(self.fields.as_ref()?, rank).ok()?;
        let root = self.path.parent()?;
        (ns.namespace_dir(root) == self.path).then_some(ns)
    }
}

/// The namespaces under `root`, by name: every directory with a `config.json` or with rank
/// directories beside it.
pub fn namespaces(root: &Path) -> io::Result<Vec<NamespaceDir>> {
    let mut dirs: Vec<(String, PathBuf)> = Vec::new();
    for e in std::fs::read_dir(root)? {
        let e = e?;
        if e.file_type()?.is_dir()
            && let Some(name) = e.file_name().to_str()
        {
            dirs.push((name.to_string(), e.path()));
        }
    }
    dirs.sort();
    let mut out: Vec<NamespaceDir> = Vec::new();
    for (name, path) in &dirs {
        if rank_of(name).is_some_and(|(base, _)| dirs.iter().any(|(n, _)| n == base)) {
            continue; // a rank directory of a namespace listed on its own
        }
        let config = path.join("config.json");
        // read without blocking and only a regular file (a FIFO there must not hang an
        // operator's command)
        let (fields, config_error) = match crate::file::read_regular(&config) {
            Ok(Some(bytes)) => match serde_json::from_slice::<serde_json::Value>(&bytes) {
                Ok(v) => (Some(v), None),
                Err(e) => (None, Some(format!("{}: not JSON ({e})", config.display()))),
            },
            Ok(None) => (
                None,
                Some(format!("{}: not a regular file", config.display())),
            ),
            Err(e) => (None, Some(format!("{}: {e}", config.display()))),
        };
        let ranks: Vec<(u32, PathBuf)> = dirs
            .iter()
            .filter_map(|(n, p)| match rank_of(n) {
                Some((base, rank)) if base == name => Some((rank, p.clone())),
                _ => None,
            })
            .collect();
        if fields.is_none() && ranks.is_empty() {
            continue; // not a namespace
        }
        out.push(NamespaceDir {
            name: name.clone(),
            path: path.clone(),
            fields,
            config_error,
            ranks,
        });
    }
    Ok(out)
}

/// `("<base>", rank)` for a directory named `<base>_r<rank>`.
fn rank_of(name: &str) -> Option<(&str, u32)> {
    let (base, rank) = name.rsplit_once("_r")?;
    if rank.is_empty() || !rank.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((base, rank.parse().ok()?))
}

/// One block file.
#[derive(Debug, Clone)]
pub struct BlockFile {
    /// Its path.
    pub path: PathBuf,
    /// Its key, where the namespace is known and the path is where the layout puts it.
    pub key: Option<BlockKey>,
    /// Its size in bytes.
    pub size: u64,
    /// Bytes allocated to it on disk (its sidecar's included).
    pub allocated: u64,
    /// Its mtime: the fs tier's recency.
    pub mtime: SystemTime,
}

/// What a rank directory holds.
#[derive(Debug, Clone, Default)]
pub struct RankScan {
    /// The block files, in path order: regular files at the layout's paths
    /// (`<hex[0..3]>/<hex[3..5]>_g<group>/<hex>.bin`, the name's hex agreeing with its
    /// directories; with the namespace known, the paths it gives). Any other file is
    /// [`RankScan::foreign`].
    pub blocks: Vec<BlockFile>,
    /// Directories under the rank directory (the layout's two levels).
    pub dirs: u64,
    /// Bytes allocated to those directories and the rank directory itself.
    pub dir_bytes: u64,
    /// Temp files (`*.tmp`): a store in flight, or left by one that was killed.
    pub temp_files: Vec<PathBuf>,
    /// Checksum sidecars whose block file is gone.
    pub orphan_sidecars: Vec<PathBuf>,
    /// Other files: not this layout's (left alone by the tier, not counted to its cap).
    pub foreign: Vec<PathBuf>,
}

impl RankScan {
    /// Allocated bytes of the block files, their sidecars and the directories.
    pub fn allocated(&self) -> u64 {
        self.blocks.iter().map(|b| b.allocated).sum::<u64>() + self.dir_bytes
    }
}

fn allocated(m: &std::fs::Metadata) -> u64 {
    m.blocks() * 512
}

/// Walks a rank directory (`<top>/<leaf>/<file>`); with `ns`, block names are checked
/// against the layout and keyed. A root in use may change under the walk: a directory or file
/// gone meanwhile (a sweep removed it and its emptied directories) is skipped, not an error.
pub fn scan_rank(rank_dir: &Path, ns: Option<&Namespace>) -> io::Result<RankScan> {
    let mut s = RankScan {
        dir_bytes: allocated(&std::fs::symlink_metadata(rank_dir)?),
        ..RankScan::default()
    };
    let Some(tops) = list(rank_dir)? else {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{} is gone", rank_dir.display()),
        ));
    };
    for top in tops {
        let Some(m) = gone_is_none(top.metadata())? else {
            continue;
        };
        if !m.is_dir() {
            classify_file(&mut s, top.path(), None, ns);
            continue;
        }
        let Some(leaves) = list(&top.path())? else {
            continue;
        };
        s.dirs += 1;
        s.dir_bytes += allocated(&m);
        for leaf in leaves {
            let Some(m) = gone_is_none(leaf.metadata())? else {
                continue;
            };
            if !m.is_dir() {
                classify_file(&mut s, leaf.path(), None, ns);
                continue;
            }
            let Some(files) = list(&leaf.path())? else {
                continue;
            };
            s.dirs += 1;
            s.dir_bytes += allocated(&m);
            let rel = |f: &std::fs::DirEntry| {
                format!(
                    "{}/{}/{}",
                    top.file_name().to_string_lossy(),
                    leaf.file_name().to_string_lossy(),
                    f.file_name().to_string_lossy()
                )
            };
            for f in files {
                let r = rel(&f);
                classify_file(&mut s, f.path(), Some(r), ns);
            }
        }
    }
    Ok(s)
}

/// `Ok(None)` for an error saying the thing is gone.
fn gone_is_none<T>(r: io::Result<T>) -> io::Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// A directory's entries sorted by name; `None` if the directory is gone. An error names the
/// directory.
fn list(dir: &Path) -> io::Result<Option<Vec<std::fs::DirEntry>>> {
    let named = |e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", dir.display()));
    let Some(entries) = gone_is_none(std::fs::read_dir(dir)).map_err(named)? else {
        return Ok(None);
    };
    let mut out = Vec::new();
    for e in entries {
        if let Some(e) = gone_is_none(e).map_err(named)? {
            out.push(e);
        }
    }
    out.sort_by_key(|e| e.file_name());
    Ok(Some(out))
}

fn classify_file(s: &mut RankScan, path: PathBuf, rel: Option<String>, ns: Option<&Namespace>) {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let Ok(m) = std::fs::symlink_metadata(&path) else {
        return; // gone meanwhile
    };
    if name.ends_with(".tmp") {
        s.temp_files.push(path);
    } else if let Some(bin) = name.strip_suffix(file::CRC_SIDECAR_SUFFIX) {
        if !path.with_file_name(bin).exists() {
            s.orphan_sidecars.push(path);
        }
    } else if let Some(rel) = rel.filter(|_| name.ends_with(".bin") && m.is_file()) {
        // a block only at the layout's path: its name a hash whose hex gives its directories
        // (and, with the namespace known, the key the namespace puts there)
        let key =
            ns.and_then(|ns| ns.parse_block_rel_path(&format!("{}/{rel}", ns.rank_dir_name())));
        if kv_tier_core::layout::parse_rank_rel_path(&rel).is_none()
            || (ns.is_some() && key.is_none())
        {
            s.foreign.push(path);
            return;
        }
        let sidecar = std::fs::symlink_metadata(file::sidecar_path(&path))
            .map(|m| allocated(&m))
            .unwrap_or(0);
        s.blocks.push(BlockFile {
            key,
            size: m.len(),
            allocated: allocated(&m) + sidecar,
            mtime: m.modified().unwrap_or(SystemTime::UNIX_EPOCH),
            path,
        });
    } else {
        s.foreign.push(path);
    }
}

/// A block file's health, as a load with checksums would judge it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// Whole, and its checksum matches.
    Verified,
    /// Whole; it carries no checksum (written with checksums off), or its key is unknown so
    /// its checksum cannot be checked.
    Unchecked,
    /// Not the block size.
    WrongSize {
        /// Its size.
        size: u64,
        /// The block size.
        expected: u64,
    },
    /// Its bytes do not match its checksum.
    Mismatch,
    /// Its stored checksum is not one.
    MalformedChecksum(String),
    /// It could not be read.
    Unreadable(String),
}

impl Health {
    /// Whether a load would refuse it for good (a size, a checksum); an unreadable file is
    /// not counted as damage (the error may pass).
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            Health::WrongSize { .. } | Health::Mismatch | Health::MalformedChecksum(_)
        )
    }
}

/// Reads the block file at `path` whole and checks its size against `block_size` and (with
/// its `key`) its bytes against the checksum stored beside it (xattr or sidecar).
pub fn check_block(path: &Path, key: Option<&BlockKey>, block_size: u64) -> Health {
    let data = match std::fs::read(path) {
        Ok(d) => d,
        Err(e) => return Health::Unreadable(e.to_string()),
    };
    if data.len() as u64 != block_size {
        return Health::WrongSize {
            size: data.len() as u64,
            expected: block_size,
        };
    }
    let Some(key) = key else {
        return Health::Unchecked;
    };
    let stored = match file::get_crc_xattr_path(path) {
        Ok(StoredCrc::Missing) | Err(_) => {
            let ino = std::fs::metadata(path).map(|m| m.ino()).unwrap_or(0);
            match file::read_sidecar(path, ino) {
                Ok(s) => s,
                Err(e) => return Health::Unreadable(format!("its checksum sidecar: {e}")),
            }
        }
        Ok(s) => s,
    };
    match checksum::verify(&stored, key, &data, true) {
        Verdict::Verified => Health::Verified,
        Verdict::Unverified | Verdict::Missing => Health::Unchecked,
        Verdict::Mismatch { .. } => Health::Mismatch,
        Verdict::Malformed(why) => Health::MalformedChecksum(why),
    }
}

/// Removes a damaged block file and its sidecar (what a load with checksums does).
pub fn remove_block(path: &Path) -> io::Result<()> {
    std::fs::remove_file(path)?;
    match std::fs::remove_file(file::sidecar_path(path)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The block files a sweep to `target` allocated bytes would delete, least recently used
/// (oldest mtime) first, given `total` allocated bytes now.
pub fn sweep_order(blocks: &[BlockFile], total: u64, target: u64) -> Vec<&BlockFile> {
    let mut by_age: Vec<&BlockFile> = blocks.iter().collect();
    by_age.sort_by_key(|b| (b.mtime, b.path.clone()));
    let mut left = total;
    by_age
        .into_iter()
        .take_while(|b| {
            let go = left > target;
            left = left.saturating_sub(b.allocated);
            go
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A root in use changes under a walk: files, leaf and top directories go (a sweep and
    /// the directories it empties) and come back (stores). The walk never fails on that.
    #[test]
    fn a_walk_of_a_root_that_changes_under_it_does_not_fail() {
        let dir = tempfile::tempdir().unwrap();
        let rank = dir.path().to_path_buf();
        use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let rounds = std::sync::Arc::new(AtomicU64::new(0));
        let churn = {
            let (rank, stop, rounds) = (rank.clone(), stop.clone(), rounds.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    for t in 0..4 {
                        for l in 0..4 {
                            let leaf = rank.join(format!("{t:03x}")).join(format!("{l:02x}_g0"));
                            std::fs::create_dir_all(&leaf).unwrap();
                            for f in 0..4 {
                                std::fs::write(leaf.join(format!("{f:064x}.bin")), b"x").unwrap();
                            }
                        }
                    }
                    for t in 0..4 {
                        let _ = std::fs::remove_dir_all(rank.join(format!("{t:03x}")));
                    }
                    rounds.fetch_add(1, Ordering::Relaxed);
                }
            })
        };
        // walks for as long as the tree changes 50 times (and at least 50 walks)
        let t0 = std::time::Instant::now();
        while rounds.load(Ordering::Relaxed) == 0 {
            assert!(t0.elapsed().as_secs() < 60, "the churn never began");
            std::thread::yield_now();
        }
        let (mut walks, mut seen) = (0, 0);
        while walks < 50 || rounds.load(Ordering::Relaxed) < 50 {
            let s = scan_rank(&rank, None).unwrap_or_else(|e| panic!("walk {walks}: {e}"));
            seen += s.blocks.len();
            walks += 1;
        }
        stop.store(true, Ordering::Relaxed);
        churn.join().unwrap();
        assert!(seen > 0, "the walks never met a file: no churn to speak of");
    }
}
