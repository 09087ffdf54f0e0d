//! `kv-tier inspect ROOT`, and the walk of a root the other commands share.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use kv_tier::Namespace;
use kv_tier::fs::offline::{NamespaceDir, RankScan, namespaces, scan_rank};
use serde_json::{Value, json};

use crate::{Outcome, human, print_json};

/// One rank directory of a namespace, walked.
pub(crate) struct Rank {
    pub(crate) rank: u32,
    pub(crate) path: PathBuf,
    /// The layout, from the namespace's `config.json` (keys and checksums need it).
    pub(crate) ns: Option<Namespace>,
    pub(crate) scan: RankScan,
}

/// Every namespace under `root` with its rank directories walked.
pub(crate) fn walk_root(root: &Path) -> Result<Vec<(NamespaceDir, Vec<Rank>)>, String> {
    let meta = std::fs::metadata(root).map_err(|e| format!("{}: {e}", root.display()))?;
    if !meta.is_dir() {
        return Err(format!("{}: not a directory", root.display()));
    }
    let mut out = Vec::new();
    for nsd in namespaces(root).map_err(|e| format!("{}: {e}", root.display()))? {
        let mut ranks = Vec::new();
        for (rank, path) in &nsd.ranks {
            let ns = nsd.namespace(*rank);
            let scan =
                scan_rank(path, ns.as_ref()).map_err(|e| format!("{}: {e}", path.display()))?;
            ranks.push(Rank {
                rank: *rank,
                path: path.clone(),
                ns,
                scan,
            });
        }
        out.push((nsd, ranks));
    }
    Ok(out)
}

/// Age buckets, by upper bound.
const AGES: [(&str, Duration); 5] = [
    ("under_1m", Duration::from_secs(60)),
    ("under_1h", Duration::from_secs(3600)),
    ("under_1d", Duration::from_secs(86_400)),
    ("under_7d", Duration::from_secs(7 * 86_400)),
    ("older", Duration::MAX),
];

fn ages(scan: &RankScan, now: SystemTime) -> BTreeMap<&'static str, u64> {
    let mut h: BTreeMap<&'static str, u64> = AGES.iter().map(|(n, _)| (*n, 0)).collect();
    for b in &scan.blocks {
        let age = now.duration_since(b.mtime).unwrap_or_default();
        let bucket = AGES
            .iter()
            .find(|(_, bound)| age < *bound)
            .map_or("older", |(n, _)| *n);
        *h.entry(bucket).or_default() += 1;
    }
    h
}

fn rank_json(r: &Rank, now: SystemTime) -> Value {
    let s = &r.scan;
    let mut sizes: BTreeMap<String, u64> = BTreeMap::new();
    for b in &s.blocks {
        *sizes.entry(b.size.to_string()).or_default() += 1;
    }
    let file_bytes: u64 = s.blocks.iter().map(|b| b.allocated).sum();
    json!({
        "rank": r.rank,
        "path": r.path.to_string_lossy(),
        "blocks": s.blocks.len(),
        "block_sizes": sizes,
        "file_bytes": file_bytes,
        "dir_bytes": s.dir_bytes,
        "allocated_bytes": s.allocated(),
        "directories": s.dirs,
        "ages": ages(s, now),
        "temp_files": s.temp_files.len(),
        "orphan_sidecars": s.orphan_sidecars.len(),
        "foreign_files": s.foreign.len(),
        "layout_known": r.ns.is_some(),
    })
}

/// The report of `root`, as JSON.
pub(crate) fn report(root: &Path) -> Result<Value, String> {
    let now = SystemTime::now();
    let mut nss = Vec::new();
    let (mut blocks, mut allocated) = (0u64, 0u64);
    for (nsd, ranks) in walk_root(root)? {
        let ranks: Vec<Value> = ranks
            .iter()
            .map(|r| {
                blocks += r.scan.blocks.len() as u64;
                allocated += r.scan.allocated();
                rank_json(r, now)
            })
            .collect();
        nss.push(json!({
            "name": nsd.name,
            "path": nsd.path.to_string_lossy(),
            "config": nsd.fields,
            "config_error": nsd.config_error,
            "ranks": ranks,
        }));
    }
    let in_use: Vec<Value> = crate::live::live_holders(root)?
        .iter()
        .map(|h| json!({"mark": h.path.to_string_lossy(), "holder": h.says}))
        .collect();
    Ok(json!({
        "root": root.to_string_lossy(),
        "in_use_by": in_use,
        "namespaces": nss,
        "blocks": blocks,
        "allocated_bytes": allocated,
    }))
}

pub(crate) fn run(root: &Path, json: bool) -> Outcome {
    let r = report(root)?;
    if json {
        print_json(&r);
        return Ok(true);
    }
    println!("{}", root.display());
    for h in r["in_use_by"].as_array().into_iter().flatten() {
        println!(
            "  in use by a running tier: {}",
            h["holder"].as_str().unwrap_or("?")
        );
    }
    let nss = r["namespaces"].as_array().cloned().unwrap_or_default();
    if nss.is_empty() {
        println!("  no namespace (no directory with a config.json or rank directories)");
    }
    for ns in &nss {
        println!("namespace {}", ns["name"].as_str().unwrap_or("?"));
        match &ns["config"] {
            Value::Object(c) => {
                let fields: Vec<String> = c
                    .iter()
                    .filter(|(k, _)| k.as_str() != "kv_cache_groups")
                    .map(|(k, v)| format!("{k} {v}"))
                    .collect();
                println!("  config.json: {}", fields.join(", "));
                match c.get("kv_cache_groups") {
                    Some(Value::Array(g)) if !g.is_empty() => {
                        println!("  kv_cache_groups: {} groups", g.len());
                    }
                    Some(_) => println!("  kv_cache_groups: none listed (one group, 0)"),
                    None => {}
                }
            }
            _ => println!(
                "  config.json: {}",
                ns["config_error"].as_str().unwrap_or("missing")
            ),
        }
        for rank in ns["ranks"].as_array().into_iter().flatten() {
            let n = |k: &str| rank[k].as_u64().unwrap_or(0);
            let sizes = rank["block_sizes"]
                .as_object()
                .into_iter()
                .flatten()
                .map(|(size, count)| {
                    let size: u64 = size.parse().unwrap_or(0);
                    (
                        count.as_u64().unwrap_or(0),
                        format!("{size} bytes, {}", human(size)),
                    )
                })
                .collect::<Vec<_>>();
            println!(
                "  rank {}: {} blocks ({}), {} allocated ({} files and sidecars, {} in {} directories)",
                n("rank"),
                n("blocks"),
                match &sizes[..] {
                    [] => "none".into(),
                    // one size: all of them
                    [(_, size)] => format!("all {size}"),
                    _ => sizes
                        .iter()
                        .map(|(n, size)| format!("{n} of {size}"))
                        .collect::<Vec<_>>()
                        .join("; "),
                },
                human(n("allocated_bytes")),
                human(n("file_bytes")),
                human(n("dir_bytes")),
                n("directories"),
            );
            let a = &rank["ages"];
            println!(
                "    last used: under 1 min {}, under 1 h {}, under 1 day {}, under 7 days {}, older {}",
                a["under_1m"], a["under_1h"], a["under_1d"], a["under_7d"], a["older"]
            );
            println!(
                "    temp files {}, orphan sidecars {}, foreign files {}{}",
                n("temp_files"),
                n("orphan_sidecars"),
                n("foreign_files"),
                if rank["layout_known"] == true {
                    ""
                } else {
                    " (no usable config.json: blocks told by the layout's path shape only, and left alone by gc and verify --repair without --force)"
                }
            );
        }
    }
    println!(
        "total: {} blocks, {} allocated",
        r["blocks"],
        human(r["allocated_bytes"].as_u64().unwrap_or(0))
    );
    Ok(true)
}
