//! Walking the rank directory: what is on disk, and stray temp files.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use kv_tier_core::{BlockKey, Namespace};

use super::mtime_ns;

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
    pub(crate) foreign: u64,
}

/// Parses `<top>/<leaf>/<hex>.bin` under the rank dir into a key, checking it is where the
/// layout puts that key.
pub(crate) fn parse_block(ns: &Namespace, top: &str, leaf: &str, file: &str) -> Option<BlockKey> {
    let hex = file.strip_suffix(".bin")?;
    let group: u32 = leaf.rsplit_once("_g")?.1.parse().ok()?;
    let key = BlockKey::from_hex(hex, group).ok()?;
    let want = ns.block_rel_path(&key);
    let got = format!("{}/{top}/{leaf}/{file}", ns.rank_dir_name());
    (want == got).then_some(key)
}

/// Walks the rank directory on `threads` threads: adopts every block file (with its size and
/// mtime) and deletes `.tmp` files older than `tmp_age` (`None`: leaves them).
pub(crate) fn walk(
    ns: &Namespace,
    rank_dir: &Path,
    threads: usize,
    tmp_age: Option<Duration>,
    now: SystemTime,
) -> Walk {
    let tops: Vec<PathBuf> = match std::fs::read_dir(rank_dir) {
        Ok(rd) => rd
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| e.path())
            .collect(),
        Err(_) => return Walk::default(),
    };
    let next = std::sync::atomic::AtomicUsize::new(0);
    let out = Mutex::new(Walk::default());
    let is_old_tmp = |m: &std::fs::Metadata| {
        tmp_age.is_some_and(|age| {
            m.modified()
                .map(|t| now.duration_since(t).unwrap_or_default() >= age)
                .unwrap_or(false)
        })
    };
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
                            if leaf_name.ends_with(".tmp")
                                && leaf.metadata().is_ok_and(|m| is_old_tmp(&m))
                                && std::fs::remove_file(&lp).is_ok()
                            {
                                local.tmp_reaped += 1;
                            }
                            continue;
                        }
                        let Ok(files) = std::fs::read_dir(&lp) else {
                            continue;
                        };
                        for f in files.flatten() {
                            let name = f.file_name();
                            let name = name.to_string_lossy();
                            if name.ends_with(".tmp") {
                                if f.metadata().is_ok_and(|m| is_old_tmp(&m))
                                    && std::fs::remove_file(f.path()).is_ok()
                                {
                                    local.tmp_reaped += 1;
                                }
                                continue;
                            }
                            if !name.ends_with(".bin") {
                                continue;
                            }
                            match (parse_block(ns, &top_name, &leaf_name, &name), f.metadata()) {
                                (Some(key), Ok(m)) if m.is_file() => local.blocks.push(Found {
                                    key,
                                    size: m.len(),
                                    mtime: mtime_ns(&m),
                                }),
                                _ => local.foreign += 1,
                            }
                        }
                    }
                }
                let mut o = out.lock().expect("walk results");
                o.blocks.append(&mut local.blocks);
                o.tmp_reaped += local.tmp_reaped;
                o.foreign += local.foreign;
            });
        }
    });
    out.into_inner().expect("walk results")
}
