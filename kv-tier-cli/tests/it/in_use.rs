//! A root a running tier has open: `gc` and `verify --repair` refuse it, naming the tier,
//! and delete nothing unless `--force`; `inspect` and `gc --dry-run` say who holds it. Once
//! the tier is shut down (or its process ended), the root is no longer in use.

use kv_tier::core::SecondaryTier as _;
use kv_tier::fs::{Checksum, FsTier, FsTierConfig};

use crate::support::*;

/// A tier open on `dir` (checksums on, as [`write_root`] writes).
fn open_tier(dir: &std::path::Path) -> FsTier {
    let mut cfg = FsTierConfig::new(dir);
    cfg.checksum = Checksum::Crc32c;
    FsTier::open("fs", cfg, root_namespace(), BS).unwrap()
}

#[test]
fn deleting_commands_refuse_a_root_in_use_and_name_the_tier() {
    let (dir, _, keys) = written_root(8);
    let tier = open_tier(dir.path());
    let pid = format!("\"pid\":{}", std::process::id());
    let gc = gc_all(dir.path(), &[]);
    let mut refused = Vec::new();
    for args in [&gc[..], &["verify", arg(dir.path()), "--repair"][..]] {
        let out = run(args);
        assert_eq!(out.code, Some(1), "{args:?}: {out:?}");
        assert!(
            out.stderr.contains("in use by 1 running tier") && out.stderr.contains(&pid),
            "{args:?}: {out:?}"
        );
        refused.push(out);
    }
    let present = || keys.iter().filter(|k| tier.block_path(k).exists()).count();
    assert_eq!(present(), 8, "{refused:?}");
    // a dry run deletes nothing: it runs, and inspect names the holder
    assert!(run(&gc_all(dir.path(), &["--dry-run"])).success());
    let v = json(&run(&["inspect", arg(dir.path()), "--json"]));
    let holders = v["in_use_by"].as_array().unwrap();
    assert_eq!(holders.len(), 1, "{v}");
    assert!(holders[0]["holder"].as_str().unwrap().contains(&pid), "{v}");
    // forced, it goes on, with a warning
    let out = run(&gc_all(dir.path(), &["--force"]));
    assert!(out.success() && out.stderr.contains("--force"), "{out:?}");
    assert_eq!(present(), 0, "{out:?}");
    // shut down: no longer in use
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(tier.shutdown()).unwrap();
    let v = json(&run(&["inspect", arg(dir.path()), "--json"]));
    assert_eq!(v["in_use_by"].as_array().map(Vec::len), Some(0), "{v}");
    let out = run(&["verify", arg(dir.path()), "--repair"]);
    assert!(out.success(), "{out:?}");
}

/// A tier whose process ended without its shutdown (killed) leaves its mark, but not its
/// lock: the root is not in use, and the next tier to open it reaps the mark.
#[test]
fn a_mark_left_by_an_ended_process_is_not_a_root_in_use() {
    let (dir, _, _) = written_root(2);
    let stale = root_namespace().namespace_dir(dir.path()).join(format!(
        "{}host-1-00000000deadbeef",
        kv_tier::fs::offline::LIVE_PREFIX
    ));
    std::fs::write(&stale, "{\"pid\":1}\n").unwrap();
    let out = run(&["gc", arg(dir.path()), "--max-size-gb", "1e-12"]);
    assert!(out.success(), "{out:?}");
    let v = json(&run(&["inspect", arg(dir.path()), "--json"]));
    assert_eq!(v["in_use_by"].as_array().map(Vec::len), Some(0), "{v}");
    let tier = open_tier(dir.path());
    assert!(!stale.exists(), "the stale mark is reaped at open");
    drop(tier);
}
