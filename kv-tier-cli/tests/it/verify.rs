//! `kv-tier verify`: damaged blocks listed with their reasons, `--repair` removing only them,
//! and block sizes that are none.

use std::path::PathBuf;

use crate::support::*;

#[test]
fn verify_lists_damage_and_repair_removes_only_it() {
    let (dir, tier, keys) = written_root(10);
    let flipped = tier.block_path(&keys[1]);
    let mut b = std::fs::read(&flipped).unwrap();
    b[100] ^= 0xff;
    overwrite(&flipped, 100, &b[100..101]);
    let short = tier.block_path(&keys[2]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&short)
        .unwrap()
        .set_len(BS as u64 - 1)
        .unwrap();
    let out = run(&["verify", arg(dir.path()), "--json"]);
    assert_eq!(out.code, Some(1), "damage left: exit 1");
    let v = json(&out);
    assert_eq!(v["checked"], 10);
    assert_eq!(v["verified"], 8);
    let damaged = v["damaged"].as_array().unwrap();
    let paths: Vec<PathBuf> = damaged
        .iter()
        .map(|d| PathBuf::from(d["path"].as_str().unwrap()))
        .collect();
    assert_eq!(paths.len(), 2, "{v}");
    assert!(paths.contains(&flipped) && paths.contains(&short), "{v}");
    let reasons: Vec<&str> = damaged
        .iter()
        .map(|d| d["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("checksum"))
            && reasons.iter().any(|r| r.contains("16383 bytes")),
        "{reasons:?}"
    );
    assert!(
        flipped.exists() && short.exists(),
        "verify without --repair removes nothing"
    );
    let out = run(&["verify", arg(dir.path()), "--repair"]);
    assert!(out.success(), "{out:?}");
    let text = &out.stdout;
    assert!(text.contains("2 damaged (2 removed)"), "{text}");
    assert!(!flipped.exists() && !short.exists());
    for k in [0, 3, 4, 5, 6, 7, 8, 9] {
        assert!(
            tier.block_path(&keys[k]).exists(),
            "a good block was removed"
        );
    }
    let out = run(&["verify", arg(dir.path()), "--json"]);
    assert!(out.success());
    assert_eq!(json(&out)["verified"], 8);
}

/// `verify --block-size` 0 or absurdly large is not a block size: a usage error (or a refusal
/// naming it), never a panic, and with `--repair` it must not delete the good blocks.
#[test]
fn verify_with_a_zero_or_huge_block_size_deletes_nothing() {
    let mut bad = Vec::new();
    for bs in [
        "0",
        "18446744073709551615",
        "1099511627776",
        "9223372036854775808",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (tier, keys) = write_root(dir.path(), 4);
        let out = run(&[
            "verify",
            arg(dir.path()),
            "--block-size",
            bs,
            "--repair",
            "--json",
        ]);
        let left = keys.iter().filter(|k| tier.block_path(k).exists()).count();
        if out.panicked() || out.timed_out || left != 4 {
            bad.push(format!(
                "--block-size {bs} --repair: {left}/4 blocks left; {out:?}"
            ));
        } else if out.code == Some(0) {
            bad.push(format!(
                "--block-size {bs}: exit 0 (every block checked at that size?) {out:?}"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}
