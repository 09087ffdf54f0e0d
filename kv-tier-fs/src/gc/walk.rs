//! Walking the rank directory: what is on disk, and stray temp files.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use kv_tier_core::{BlockKey, Namespace};
use rustc_hash::FxHashMap;

use super::{allocated, mtime_ns};

/// One block file found on disk.
pub(crate) struct Found {
    pub(crate) key: BlockKey,
    pub(crate) size: u64,
    pub(crate) mtime: i64,
}

/// What a walk of the rank directory found.
#[derive(Default)]
pub(crate) struct Walk {
    pub(crate) blocks: Vec<Found>,
    pub(crate) tmp_reaped: u64,
    pub(crate) sidecars_reaped: u64,
    pub(crate) foreign: u64,
    /// Allocated bytes of each leaf directory holding blocks, named by one of its keys.
    pub(crate) leaves: Vec<(BlockKey, u64)>,
    /// Empty directories removed (leaf directories; top ones where they count per use).
    pub(crate) dirs_reaped: u64,
}

/// Parses `<top>/<leaf>/<hex>.bin` under the rank dir into a key, checking it is where the
/// layout puts that key.
pub(crate) fn parse_block(ns: &Namespace, top: &str, leaf: &str, file: &str) -> Option<BlockKey> {
    if !file.ends_with(".bin") {
        return None; // the common case of a sidecar or temp file: no path to build
    }
    ns.parse_block_rel_path(&format!("{}/{top}/{leaf}/{file}", ns.rank_dir_name()))
}

/// Walks the rank directory on `threads` threads: adopts every block file (with its
/// allocated size, its sidecar's included, and its mtime), deletes `.tmp` files older than
/// `tmp_age` (`None`: leaves them; this includes temp files directly in the rank directory,
/// such as an open's capability probe killed mid-way) and, when it reaps (`tmp_age` given),
/// checksum sidecars whose block file is gone, whatever their age, if they were written
/// before the walk began (a sidecar written since may belong to a block published since:
/// a publisher writes it right after its block).
/// Empty leaf directories are removed (files deleted behind the tier's back leave them, and
/// an index counts only directories that hold blocks), and so are
/// empty top directories with `reap_empty_tops` (where tops count per use; pre-created ones
/// are a fixed part of the total and stay). A store racing a removal makes the directory
/// again. `.bin` entries where no block can be (the rank or a top directory) count as foreign.
pub(crate) fn walk(
    ns: &Namespace,
    rank_dir: &Path,
    threads: usize,
    tmp_age: Option<Duration>,
    now: SystemTime,
    reap_empty_tops: bool,
) -> Walk {
    let Ok(rd) = std::fs::read_dir(rank_dir) else {
        return Walk::default();
    };
    let began = SystemTime::now();
    let orphan_reapable = |m: &std::fs::Metadata| {
        tmp_age.is_some() && m.is_file() && crate::file::changed_at(m) < began
    };
    let is_old = |m: &std::fs::Metadata| {
        tmp_age.is_some_and(|age| {
            m.modified()
                .map(|t| now.duration_since(t).unwrap_or_default() >= age)
                .unwrap_or(false)
        })
    };
    let mut tops: Vec<PathBuf> = Vec::new();
    let mut here = Walk::default();
    for e in rd.flatten() {
        let is_dir = e.file_type().is_ok_and(|t| t.is_dir());
        let name = e.file_name().to_string_lossy().into_owned();
        if is_dir && name.ends_with(".tmp") {
            // an open's probe directory, left by a process killed mid-way
            if e.metadata().is_ok_and(|m| is_old(&m)) && std::fs::remove_dir(e.path()).is_ok() {
                here.dirs_reaped += 1;
            }
        } else if is_dir {
            tops.push(e.path());
        } else if name.ends_with(".tmp") {
            if e.metadata().is_ok_and(|m| is_old(&m)) && std::fs::remove_file(e.path()).is_ok() {
                here.tmp_reaped += 1;
            }
        } else if name.ends_with(".bin") {
            here.foreign += 1;
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = Mutex::new(here);
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let mut local = Walk::default();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(top) = tops.get(i) else { break };
                    let top_name = top
                        .file_name()
                        .and_then(|n| n.to_str())
                        .unwrap_or("")
                        .to_string();
                    let Ok(leaves) = std::fs::read_dir(top) else {
                        continue;
                    };
                    for leaf in leaves.flatten() {
                        let lp = leaf.path();
                        let leaf_name = leaf.file_name().to_string_lossy().into_owned();
                        if !leaf.file_type().is_ok_and(|t| t.is_dir()) {
                            if leaf_name.ends_with(".tmp") {
                                if leaf.metadata().is_ok_and(|m| is_old(&m))
                                    && std::fs::remove_file(&lp).is_ok()
                                {
                                    local.tmp_reaped += 1;
                                }
                            } else if leaf_name.ends_with(".bin") {
                                local.foreign += 1;
                            }
                            continue;
                        }
                        walk_leaf(
                            ns,
                            &top_name,
                            &leaf_name,
                            &lp,
                            (&is_old, &orphan_reapable),
                            &mut local,
                        );
                    }
                    // removed only if empty (a leaf made meanwhile keeps it)
                    if reap_empty_tops && std::fs::remove_dir(top).is_ok() {
                        local.dirs_reaped += 1;
                    }
                }
                let mut o = out.lock().unwrap_or_else(|p| p.into_inner());
                o.blocks.append(&mut local.blocks);
                o.leaves.append(&mut local.leaves);
                o.tmp_reaped += local.tmp_reaped;
                o.sidecars_reaped += local.sidecars_reaped;
                o.foreign += local.foreign;
                o.dirs_reaped += local.dirs_reaped;
            });
        }
    });
    out.into_inner().unwrap_or_else(|p| p.into_inner())
}

/// One leaf directory: its block files (with their sidecars' bytes), stray temp files and
/// orphan sidecars.
/// `(is_old, orphan_reapable)`: whether a temp file is old enough to reap, and whether a
/// sidecar without its block may go.
type Reap<'a> = (
    &'a dyn Fn(&std::fs::Metadata) -> bool,
    &'a dyn Fn(&std::fs::Metadata) -> bool,
);

fn walk_leaf(ns: &Namespace, top: &str, leaf: &str, dir: &Path, reap: Reap<'_>, local: &mut Walk) {
    let (is_old, orphan_reapable) = reap;
    let Ok(files) = std::fs::read_dir(dir) else {
        return;
    };
    let mut bins: Vec<(String, BlockKey, std::fs::Metadata)> = Vec::new();
    let mut sidecars: FxHashMap<String, std::fs::Metadata> = FxHashMap::default();
    // entries that stay (all but reaped temp files and sidecars)
    let mut kept = 0usize;
    for f in files.flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        if name.ends_with(".tmp") {
            if f.metadata().is_ok_and(|m| is_old(&m)) && std::fs::remove_file(f.path()).is_ok() {
                local.tmp_reaped += 1;
            } else {
                kept += 1;
            }
            continue;
        }
        kept += 1;
        if let Some(bin) = name.strip_suffix(crate::file::CRC_SIDECAR_SUFFIX) {
            if let Ok(m) = f.metadata() {
                sidecars.insert(bin.to_string(), m);
            }
            continue;
        }
        if !name.ends_with(".bin") {
            continue;
        }
        match (parse_block(ns, top, leaf, &name), f.metadata()) {
            (Some(key), Ok(m)) if m.is_file() => bins.push((name, key, m)),
            _ => local.foreign += 1,
        }
    }
    if let (Some((_, key, _)), Ok(m)) = (bins.first(), std::fs::symlink_metadata(dir)) {
        local.leaves.push((*key, allocated(&m)));
    }
    for (name, key, m) in bins {
        let side = sidecars.remove(&name).map_or(0, |s| allocated(&s));
        local.blocks.push(Found {
            key,
            size: allocated(&m) + side,
            mtime: mtime_ns(&m),
        });
    }
    // what is left has no block file: reaped if still so, and written before the walk
    // (stat again: a sidecar renamed into place since is another file)
    for (bin, _) in sidecars {
        if crate::file::reap_orphan_sidecar(&dir.join(&bin), orphan_reapable) {
            local.sidecars_reaped += 1;
            kept -= 1;
        }
    }
    // removed only if still empty (a store's file made meanwhile keeps it; a store whose
    // directory went makes it again, as after a sweep that emptied it)
    if kept == 0 && std::fs::remove_dir(dir).is_ok() {
        local.dirs_reaped += 1;
    }
}
