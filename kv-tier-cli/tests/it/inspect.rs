//! `kv-tier inspect`: the namespaces, ranks, blocks, bytes, ages and strays of a root.

use crate::support::*;

#[test]
fn inspect_reports_namespaces_blocks_bytes_and_strays() {
    let (dir, tier, keys) = written_root(12);
    let block = tier.block_path(&keys[0]);
    let leaf = block.parent().unwrap();
    std::fs::write(leaf.join("stray.tmp"), b"half").unwrap();
    std::fs::write(leaf.join(format!("{}.crc32c", "ab".repeat(32))), b"orphan").unwrap();
    std::fs::write(leaf.join("notes.txt"), b"mine").unwrap();
    let out = run(&["inspect", arg(dir.path()), "--json"]);
    assert!(out.success(), "{out:?}");
    let v = json(&out);
    assert_eq!(v["blocks"], 12);
    let ns = &v["namespaces"][0];
    assert_eq!(ns["name"], ns_dir_name());
    assert_eq!(ns["config"]["model_name"], "org/model");
    let r = &ns["ranks"][0];
    assert_eq!(r["rank"], 0);
    assert_eq!(r["blocks"], 12);
    assert_eq!(r["block_sizes"][BS.to_string()], 12);
    assert_eq!(r["temp_files"], 1);
    assert_eq!(r["orphan_sidecars"], 1);
    assert_eq!(r["foreign_files"], 1);
    assert_eq!(r["ages"]["under_1m"], 12);
    let (files, dirs) = (
        r["file_bytes"].as_u64().unwrap(),
        r["dir_bytes"].as_u64().unwrap(),
    );
    assert!(files >= 12 * BS as u64, "{r}");
    assert!(dirs > 0);
    assert_eq!(r["allocated_bytes"].as_u64().unwrap(), files + dirs);
    // for people: the same figures
    let out = run(&["inspect", arg(dir.path())]);
    let text = &out.stdout;
    assert!(
        text.contains("12 blocks (all 16384 bytes, 16.0 KiB)")
            && text.contains("temp files 1, orphan sidecars 1, foreign files 1"),
        "{text}"
    );
    // a config.json without groups reads as vLLM takes it, one group (0), not "0 groups"
    assert!(
        text.contains("kv_cache_groups: none listed (one group, 0)")
            && !text.contains("kv_cache_groups: 0"),
        "{text}"
    );
    // not a directory: an error naming it, exit 1
    let out = run(&["inspect", "/nonexistent/kv"]);
    assert_eq!(out.code, Some(1));
    assert!(out.stderr.contains("/nonexistent/kv"));
}
