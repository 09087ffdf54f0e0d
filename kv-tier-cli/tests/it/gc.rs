//! `kv-tier gc`: the least recently used blocks deleted (or, `--dry-run`, listed) down to the
//! low watermark of the cap; caps at the extremes.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use crate::support::*;

#[test]
fn gc_deletes_the_least_recently_used_down_to_the_watermark_or_only_lists_them() {
    let (dir, tier, keys) = written_root(40);
    // ages: key 0 the least recently used, each next one a minute later
    let now = SystemTime::now();
    for (i, k) in keys.iter().enumerate() {
        let f = std::fs::File::options()
            .write(true)
            .open(tier.block_path(k))
            .unwrap();
        f.set_modified(now - Duration::from_secs(3600 - 60 * i as u64))
            .unwrap();
    }
    let inspect = json(&run(&["inspect", arg(dir.path()), "--json"]));
    let total = inspect["allocated_bytes"].as_u64().unwrap();
    let per_block = inspect["namespaces"][0]["ranks"][0]["file_bytes"]
        .as_u64()
        .unwrap()
        / 40;
    // a cap that ten blocks' worth must go for
    let cap = total - 10 * per_block;
    let gb = format!("{}", cap as f64 / (1u64 << 30) as f64);
    let out = run(&[
        "gc",
        arg(dir.path()),
        "--max-size-gb",
        &gb,
        "--low-watermark",
        "1",
        "--dry-run",
        "--json",
    ]);
    assert!(out.success(), "{out:?}");
    let v = json(&out);
    let victims: Vec<PathBuf> = v["victims"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| PathBuf::from(x["path"].as_str().unwrap()))
        .collect();
    let oldest: Vec<PathBuf> = keys[..victims.len()]
        .iter()
        .map(|k| tier.block_path(k))
        .collect();
    assert_eq!(victims, oldest, "oldest first");
    assert!((10..=11).contains(&victims.len()), "{}", victims.len());
    assert!(
        victims.iter().all(|p| p.exists()),
        "a dry run deletes nothing"
    );
    let out = run(&[
        "gc",
        arg(dir.path()),
        "--max-size-gb",
        &gb,
        "--low-watermark",
        "1",
    ]);
    assert!(out.success(), "{out:?}");
    assert!(victims.iter().all(|p| !p.exists()));
    assert!(
        keys[victims.len()..]
            .iter()
            .all(|k| tier.block_path(k).exists())
    );
    let after = json(&run(&["inspect", arg(dir.path()), "--json"]));
    assert!(after["allocated_bytes"].as_u64().unwrap() <= cap);
    // within the cap: nothing to do
    let out = run(&["gc", arg(dir.path()), "--max-size-gb", "1"]);
    assert!(out.stdout.contains("nothing to delete"));
    // a bad cap is a usage error
    assert_eq!(
        run(&["gc", arg(dir.path()), "--max-size-gb", "-1"]).code,
        Some(2)
    );
}

/// gc with caps at the extremes clap lets through: 1e300 GiB (nothing to do), 1e-320 GiB (a
/// subnormal: 0 bytes), --low-watermark 1e-300. No panic; exit 0.
#[test]
fn gc_with_extreme_caps() {
    let mut bad = Vec::new();
    for (cap, low) in [
        ("1e300", "0.9"),
        ("1.7976931348623157e308", "1"),
        ("1e-320", "1e-300"),
        ("4.9e-324", "1"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        write_root(dir.path(), 3);
        for dry in [true, false] {
            let mut args = vec![
                "gc",
                arg(dir.path()),
                "--max-size-gb",
                cap,
                "--low-watermark",
                low,
                "--json",
            ];
            if dry {
                args.push("--dry-run");
            }
            let out = run(&args);
            if out.panicked() || out.code != Some(0) {
                bad.push(format!("{args:?}: {out:?}"));
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// `gc --dry-run` prints its one-line summary (with a hint at `--list`); `--list` adds a line
/// per block, oldest first, and a real run is as quiet unless listed.
#[test]
fn a_dry_run_prints_a_summary_and_list_the_blocks() {
    let (dir, _tier, _) = written_root(20);
    let gc = |extra: &[&str]| {
        let out = run(&gc_all(dir.path(), extra));
        assert!(out.success(), "{out:?}");
        out.stdout.lines().map(str::to_string).collect::<Vec<_>>()
    };
    let summary = gc(&["--dry-run"]);
    assert_eq!(summary.len(), 1, "{summary:?}");
    assert!(
        summary[0].contains("would delete 20 blocks") && summary[0].contains("--list"),
        "{summary:?}"
    );
    let listed = gc(&["--dry-run", "--list"]);
    assert_eq!(listed.len(), 21, "{listed:?}");
    assert!(
        listed[..20].iter().all(|l| l.starts_with("would delete: ")),
        "{listed:?}"
    );
    let deleted = gc(&[]);
    assert_eq!(deleted.len(), 1, "{deleted:?}");
    assert!(deleted[0].contains("deleted 20 blocks"), "{deleted:?}");
}
