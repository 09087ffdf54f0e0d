//! `--instances N`: serve_sim processes on one shared fs root under one cap: each verifies
//! what it loads, the peak stays within 1.10x the cap, never two leaders of one epoch, the
//! root left valid; the seeds `seed..seed+N-1` do not overflow.

use crate::support::*;

/// `--instances 3`: three serve_sim processes on one shared fs root with one cap; each
/// verifies every block it loads (prefixes the others stored among them), the shared
/// directory's peak stays within 1.10x the one cap, one instance leads, and the parent's
/// `--json` holds each instance's report and the global figures.
#[test]
fn several_instances_share_one_root_under_one_cap() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("instances.json");
    let root = dir.path().join("shared");
    let out = bin()
        .args([
            "--instances",
            "3",
            "--model",
            "tiny",
            "--streams",
            "4",
            "--turns",
            "6",
            "--duration",
            "20",
            "--dram-mb",
            "1",
            "--fs-cap-gb",
            "0.005",
            "--prefill-tokens-per-s",
            "0",
            "--seed",
            "5",
            "--json",
        ])
        .arg(&json)
        .arg("--root-dir")
        .arg(&root)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("global: peak") && text.contains("sim-2"),
        "{text}"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let instances = v["instances"].as_array().unwrap();
    assert_eq!(instances.len(), 3);
    let seeds: Vec<u64> = instances
        .iter()
        .map(|i| i["seed"].as_u64().unwrap())
        .collect();
    assert_eq!(seeds, [5, 6, 7]);
    assert_eq!(v["blocks_corrupt"], 0);
    assert!(v["blocks_verified"].as_u64().unwrap() > 0);
    // each instance reports as it ends (one may lead after another released the lease):
    // never two leaders of one epoch
    let mut epochs: Vec<u64> = instances
        .iter()
        .filter(|i| i["report"]["shared"]["leader"] == true)
        .map(|i| i["report"]["shared"]["epoch"].as_u64().unwrap())
        .collect();
    let leaders = epochs.len();
    epochs.sort_unstable();
    epochs.dedup();
    assert_eq!(
        epochs.len(),
        leaders,
        "two leaders of one epoch: {instances:?}"
    );
    assert!(v["takeovers"].as_u64().unwrap() >= 1);
    let (peak, cap) = (
        v["peak_bytes"].as_u64().unwrap(),
        v["cap_bytes"].as_u64().unwrap(),
    );
    assert!(
        peak > 0 && peak as f64 <= 1.10 * cap as f64,
        "peak {peak} of cap {cap}"
    );
    for i in instances {
        assert_eq!(i["report"]["inputs"]["sim"]["fs_instance_id"], i["id"]);
        assert_eq!(i["report"]["requests"], 24, "{}", i["id"]);
    }
}

#[test]
fn instances_on_one_root_share_it_and_leave_it_valid() {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("shared");
    let json = dir.path().join("i.json");
    let out = sim(
        &[
            "--instances",
            "2",
            "--model",
            "tiny",
            "--streams",
            "2",
            "--turns",
            "4",
            "--dram-mb",
            "1",
            "--fs-cap-gb",
            "0.003",
            "--prefill-tokens-per-s",
            "0",
            "--duration",
            "10",
            "--root-dir",
            root.to_str().unwrap(),
            "--json",
            json.to_str().unwrap(),
        ],
        60,
    );
    assert_eq!(out.code, Some(0), "{}", out.all());
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["blocks_corrupt"], 0);
    let (peak, cap) = (
        v["peak_bytes"].as_u64().unwrap(),
        v["cap_bytes"].as_u64().unwrap(),
    );
    assert!(peak as f64 <= 1.10 * cap as f64, "peak {peak} cap {cap}");
    assert_verifies(&root);
}

#[test]
fn instances_with_the_largest_seed_do_not_overflow() {
    // documented: "seeds seed..seed+N-1"; u64::MAX + 1 overflows
    let dir = tempfile::tempdir().unwrap();
    let out = sim(
        &[
            "--instances",
            "2",
            "--model",
            "tiny",
            "--streams",
            "2",
            "--turns",
            "2",
            "--dram-mb",
            "1",
            "--fs-cap-gb",
            "0.01",
            "--prefill-tokens-per-s",
            "0",
            "--no-progress",
            "--seed",
            "18446744073709551615",
            "--root-dir",
            dir.path().join("shared").to_str().unwrap(),
        ],
        60,
    );
    assert!(!out.timed_out, "{}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
    assert_ne!(out.code, Some(101), "{}", out.all());
    if out.code != Some(0) {
        assert_clean_refusal(&out, &["--seed"]);
    }
}
