//! `kv-tier gc ROOT --max-size-gb X [--dry-run] [--list] [--force]`.

use std::path::Path;
use std::time::SystemTime;

use kv_tier::fs::offline::{BlockFile, remove_block, sweep_order};
use serde_json::{Value, json};

use crate::inspect::walk_root;
use crate::live::refuse_if_live;
use crate::{Outcome, human, print_json};

/// What a `gc` run sweeps to, and what it may delete.
pub(crate) struct Sweep {
    /// The cap, GiB.
    pub(crate) max_size_gb: f64,
    /// Down to this fraction of the cap.
    pub(crate) low_watermark: f64,
    /// Delete nothing.
    pub(crate) dry_run: bool,
    /// Also on a root in use, and blocks under a namespace without a usable `config.json`.
    pub(crate) force: bool,
}

pub(crate) fn run(root: &Path, sweep: Sweep, list: bool, json: bool) -> Outcome {
    let Sweep {
        max_size_gb,
        low_watermark,
        dry_run,
        force,
    } = sweep;
    if !dry_run {
        refuse_if_live(root, "gc", force)?;
    }
    let walked = walk_root(root)?;
    // blocks of a namespace whose layout is not known are candidates only with --force
    let mut kept_unknown: Vec<(String, u64, u64)> = Vec::new();
    let mut blocks: Vec<BlockFile> = Vec::new();
    for (nsd, ranks) in &walked {
        for r in ranks {
            if r.ns.is_some() || force {
                blocks.extend(r.scan.blocks.iter().cloned());
            } else if !r.scan.blocks.is_empty() {
                let why = nsd
                    .config_error
                    .clone()
                    .unwrap_or_else(|| "its config.json does not describe this directory".into());
                kept_unknown.push((
                    format!("{} ({why})", r.path.display()),
                    r.scan.blocks.len() as u64,
                    r.scan.blocks.iter().map(|b| b.allocated).sum(),
                ));
            }
        }
    }
    let total: u64 = walked
        .iter()
        .flat_map(|(_, ranks)| ranks)
        .map(|r| r.scan.allocated())
        .sum();
    let cap = (max_size_gb * (1u64 << 30) as f64) as u64;
    let target = (cap as f64 * low_watermark) as u64;
    let victims = if total > cap {
        sweep_order(&blocks, total, target)
    } else {
        Vec::new()
    };
    let now = SystemTime::now();
    let mut listed = Vec::new();
    let (mut deleted, mut freed, mut failed, mut gone) = (0u64, 0u64, 0u64, 0u64);
    for b in &victims {
        let age = now.duration_since(b.mtime).unwrap_or_default().as_secs();
        let outcome = if dry_run {
            "would delete".to_string()
        } else {
            match remove_block(&b.path) {
                Ok(()) => {
                    deleted += 1;
                    freed += b.allocated;
                    // emptied leaf and top directories go too (as the tier's sweep does)
                    for dir in b.path.ancestors().skip(1).take(2) {
                        if std::fs::remove_dir(dir).is_err() {
                            break;
                        }
                    }
                    "deleted".to_string()
                }
                // deleted since the walk (an engine's own sweep on a root in use): not a
                // failure, and not freed by this run
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    gone += 1;
                    "already gone".to_string()
                }
                Err(e) => {
                    failed += 1;
                    format!("not deleted: {e}")
                }
            }
        };
        if !json && list {
            println!(
                "{outcome}: {} ({} bytes, last used {age} s ago)",
                b.path.display(),
                b.allocated
            );
        }
        listed.push(json!({
            "path": b.path.to_string_lossy(),
            "key": b.key.map(|k| k.to_string()),
            "allocated_bytes": b.allocated,
            "age_s": age,
            "outcome": outcome,
        }));
    }
    let would_free: u64 = victims.iter().map(|b| b.allocated).sum();
    let report: Value = json!({
        "root": root.to_string_lossy(),
        "allocated_bytes": total,
        "cap_bytes": cap,
        "target_bytes": target,
        "dry_run": dry_run,
        "victims": listed,
        "victim_bytes": would_free,
        "deleted": deleted,
        "freed_bytes": freed,
        "failed": failed,
        "already_gone": gone,
        "not_deleted_layout_unknown": kept_unknown
            .iter()
            .map(|(dir, n, bytes)| json!({"rank_dir": dir, "blocks": n, "allocated_bytes": bytes}))
            .collect::<Vec<_>>(),
    });
    if !json {
        for (dir, n, bytes) in &kept_unknown {
            println!(
                "not deleted: {n} blocks ({}) under {dir}: without the namespace's layout they may not be blocks; --force deletes them too",
                human(*bytes)
            );
        }
    }
    if json {
        print_json(&report);
    } else if total <= cap {
        println!(
            "{} allocated, within the cap of {}: nothing to delete",
            human(total),
            human(cap)
        );
    } else if dry_run {
        println!(
            "{} allocated, over the cap of {}: a sweep to {} would delete {} blocks ({}){}",
            human(total),
            human(cap),
            human(target),
            victims.len(),
            human(would_free),
            if list || victims.is_empty() {
                ""
            } else {
                " (--list lists them)"
            }
        );
    } else {
        println!(
            "{} allocated, over the cap of {}: deleted {deleted} blocks ({}) toward {}{}",
            human(total),
            human(cap),
            human(freed),
            human(target),
            match (failed, gone) {
                (0, 0) => String::new(),
                (0, g) => format!(", {g} were already gone"),
                (f, 0) => format!(", {f} could not be deleted"),
                (f, g) => format!(", {f} could not be deleted, {g} were already gone"),
            }
        );
    }
    Ok(failed == 0)
}
