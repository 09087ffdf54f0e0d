//! The report: its figures agree with each other (lookups, tokens, bytes, waits), a seed's run
//! is deterministic, the ideal hit rate is an unbounded cache's on the workload, a long run
//! prints progress, and the README's default run prints what the README promises.

use std::process::{Command, Stdio};
use std::time::Duration;

use kv_tier_examples::sim::{Report, ideal_hit_rate, run};
use kv_tier_testkit::fixtures::process::finish;

use crate::support::*;

#[test]
fn a_short_scenario_reports_consistent_figures_and_is_deterministic() {
    let a = run(&small(7)).unwrap();
    check_consistent(&a);
    assert!(
        a.tokens_from_secondary > 0,
        "the fs tier served nothing: {a:?}"
    );
    assert!(a.tiers[0].blocks_stored > 0);
    let b = run(&small(7)).unwrap();
    let counts = |r: &Report| {
        (
            r.tokens_from_gpu_cache,
            r.tokens_from_dram,
            r.tokens_from_secondary,
            r.tokens_recomputed,
            r.lookups,
            r.lookup_hits,
            r.lookup_misses,
            r.tiers[0].blocks_loaded,
        )
    };
    assert_eq!(
        counts(&a),
        counts(&b),
        "the same seed gave different hit counts"
    );
    let c = run(&small(8)).unwrap();
    check_consistent(&c);
}

/// The ideal hit rate is the workload's own: one conversation, two turns, prefixes of two
/// blocks, one new prompt block and one output block a turn. Turn 0 hits nothing of its
/// three blocks; turn 1's five blocks are the prefix, turn 0's prompt and output (seen),
/// then its own new block: 4 of 5. In all 4 of 8.
#[test]
fn the_ideal_hit_rate_is_that_of_an_unbounded_cache_on_the_workload() {
    let mut cfg = small(1);
    (cfg.streams, cfg.turns, cfg.prefixes) = (1, 2, 1);
    (cfg.prefix_tokens, cfg.prompt_tokens, cfg.output_tokens) = (32, 16, 16);
    assert_eq!(ideal_hit_rate(&cfg, 2), 0.5);
    assert_eq!(ideal_hit_rate(&cfg, 1), 0.0);
    // two conversations on the one shared prefix: the second's turn 0 hits the prefix
    cfg.streams = 2;
    assert_eq!(ideal_hit_rate(&cfg, 2), 2.0 / 6.0);
}

#[test]
fn a_run_of_several_seconds_prints_progress_on_stderr() {
    // house rule: long runs print progress (here stderr is a pipe, as in CI or a log)
    let dir = tempfile::tempdir().unwrap();
    let mut args = long_workload(&dir.path().join("root"));
    args.retain(|a| a != "--no-progress");
    let i = args.iter().position(|a| a == "--duration").unwrap();
    args[i + 1] = "6".into();
    let out = sim(&args, 60);
    assert_eq!(out.code, Some(0), "{}", out.all());
    let lines = out.stderr.lines().count();
    assert!(
        lines >= 3 && out.stderr.contains(" requests, "),
        "a {:.0} s run printed no progress on stderr ({lines} lines): {}",
        out.secs,
        out.all()
    );
}

#[test]
fn the_readme_default_run_prints_what_the_readme_promises_and_cleans_up() {
    // README: `cargo run --release -p kv-tier-examples --bin serve_sim` (here the debug
    // binary, cut short with --duration 5)
    let tmp = tempfile::tempdir().unwrap();
    let json = tmp.path().join("r.json");
    let scratch = tmp.path().join("tmp");
    std::fs::create_dir(&scratch).unwrap();
    let child = Command::new(SERVE_SIM)
        .args(["--duration", "5", "--no-progress", "--json"])
        .arg(&json)
        .env("TMPDIR", &scratch)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = finish(child, Duration::from_secs(90));
    assert_ok(&out);
    for want in [
        "llama-8b (2048 KiB blocks of 16 tokens)",
        "an unbounded cache",
        "O_DIRECT",
        "p50",
        "p99",
        "failed loads",
        "failed stores",
        "late answers",
        "writes dropped",
        "fs GC",
        "allocated at the end",
        "4.00 GiB cap",
        "peak",
        "events",
        "prefill time saved",
        "draining",
    ] {
        assert!(out.stdout.contains(want), "{want:?} missing: {}", out.all());
    }
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["blocks_corrupt"], 0);
    assert!(v["lookup_hits"].as_u64().unwrap() <= v["lookups"].as_u64().unwrap());
    let left: Vec<_> = std::fs::read_dir(&scratch)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .collect();
    assert!(left.is_empty(), "temp cache dir not removed: {left:?}");
}
