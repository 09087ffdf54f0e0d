//! `kv-tier verify ROOT [--repair [--force]]`.

use std::collections::HashMap;
use std::path::Path;

use kv_tier::fs::offline::{Health, check_block, remove_block};
use serde_json::{Value, json};

use crate::inspect::walk_root;
use crate::live::refuse_if_live;
use crate::{Outcome, print_json};

/// A progress bar on stderr with an ETA, hidden when stderr is not a terminal.
fn progress(total: u64) -> indicatif::ProgressBar {
    let target = if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        indicatif::ProgressDrawTarget::stderr()
    } else {
        indicatif::ProgressDrawTarget::hidden()
    };
    let bar = indicatif::ProgressBar::with_draw_target(Some(total), target);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "verifying {bar:40} {pos}/{len} blocks, {per_sec}, ETA {eta}",
        )
        .expect("a valid template"),
    );
    bar
}

/// `repair`: `None` checks only; `Some(force)` removes the damaged blocks, with `force` also
/// on a root in use and under a namespace without a usable `config.json`.
pub(crate) fn run(
    root: &Path,
    repair: Option<bool>,
    block_size: Option<u64>,
    json: bool,
) -> Outcome {
    if let Some(force) = repair {
        refuse_if_live(root, "verify --repair", force)?;
    }
    let force = repair == Some(true);
    let walked = walk_root(root)?;
    let total: u64 = walked
        .iter()
        .flat_map(|(_, ranks)| ranks)
        .map(|r| r.scan.blocks.len() as u64)
        .sum();
    let bar = progress(total);
    let (mut verified, mut unchecked) = (0u64, 0u64);
    let mut damaged: Vec<Value> = Vec::new();
    let mut unreadable: Vec<Value> = Vec::new();
    for (_, ranks) in &walked {
        for r in ranks {
            // the block size: given, or the one most blocks of this rank directory have
            let expected = block_size.unwrap_or_else(|| {
                let mut counts: HashMap<u64, u64> = HashMap::new();
                for b in &r.scan.blocks {
                    *counts.entry(b.size).or_default() += 1;
                }
                counts
                    .into_iter()
                    .max_by_key(|(size, n)| (*n, *size))
                    .map_or(0, |(size, _)| size)
            });
            for b in &r.scan.blocks {
                let health = check_block(&b.path, b.key.as_ref(), expected);
                bar.inc(1);
                match &health {
                    Health::Verified => verified += 1,
                    Health::Unchecked => unchecked += 1,
                    Health::Unreadable(e) => {
                        unreadable.push(json!({"path": b.path.to_string_lossy(), "error": e}));
                    }
                    _ => {
                        let reason = match &health {
                            Health::WrongSize { size, expected } => {
                                format!("{size} bytes, the block size is {expected}")
                            }
                            Health::Mismatch => "its bytes do not match its checksum".into(),
                            Health::MalformedChecksum(why) => {
                                format!("its checksum is malformed: {why}")
                            }
                            _ => unreachable!("damage only"),
                        };
                        // without the layout, a file at a block's path may be another's
                        let kept = (r.ns.is_none() && !force).then_some(
                            "no usable config.json in its namespace; --force removes it",
                        );
                        let removed = if repair.is_some() && kept.is_none() {
                            match remove_block(&b.path) {
                                Ok(()) => Some(true),
                                Err(e) => {
                                    bar.suspend(|| {
                                        eprintln!("kv-tier: removing {}: {e}", b.path.display())
                                    });
                                    Some(false)
                                }
                            }
                        } else {
                            None
                        };
                        damaged.push(json!({
                            "path": b.path.to_string_lossy(),
                            "key": b.key.map(|k| k.to_string()),
                            "reason": reason,
                            "removed": removed,
                            "kept": kept.filter(|_| repair.is_some()),
                        }));
                    }
                }
            }
        }
    }
    bar.finish_and_clear();
    let left = damaged.iter().filter(|d| d["removed"] != true).count();
    let report = json!({
        "root": root.to_string_lossy(),
        "checked": total,
        "verified": verified,
        "unchecked": unchecked,
        "damaged": damaged,
        "unreadable": unreadable,
        "damaged_left": left,
    });
    if json {
        print_json(&report);
    } else {
        for d in &damaged {
            println!(
                "damaged: {}: {}{}",
                d["path"].as_str().unwrap_or("?"),
                d["reason"].as_str().unwrap_or("?"),
                match (d["removed"].as_bool(), d["kept"].as_str()) {
                    (Some(true), _) => " (removed)".to_string(),
                    (Some(false), _) => " (could not be removed)".to_string(),
                    (None, Some(why)) => format!(" (not removed: {why})"),
                    (None, None) => String::new(),
                }
            );
        }
        for u in &unreadable {
            println!(
                "unreadable: {}: {}",
                u["path"].as_str().unwrap_or("?"),
                u["error"].as_str().unwrap_or("?")
            );
        }
        println!(
            "{total} blocks checked: {verified} verified, {unchecked} without a checksum to check, {} damaged{}, {} unreadable",
            damaged.len(),
            if repair.is_some() {
                format!(" ({} removed)", damaged.len() - left)
            } else if damaged.is_empty() {
                String::new()
            } else {
                " (run with --repair to remove them)".into()
            },
            unreadable.len()
        );
    }
    Ok(left == 0 && unreadable.is_empty())
}
