//! Where every prompt token went: the attribution's buckets sum to the prompt tokens in every
//! hierarchy (fs only, fs + obj, tiny caps, admission on, a restart), name the causes they
//! stand for, are the same for the same seed, and the run's trace replays offline from the
//! command line to the figures the report printed.

use kv_tier_examples::sim::{Report, run};

use crate::support::*;

/// The tokens of buckets whose label starts with `prefix`.
fn tokens(r: &Report, prefix: &str) -> u64 {
    r.attribution
        .iter()
        .filter(|(k, _)| k.starts_with(prefix))
        .map(|(_, n)| n)
        .sum()
}

/// A bounded fs tier below 1 MiB of DRAM: the buckets sum, DRAM and fs both serve, and what
/// the fs GC swept shows as evicted by fs.
#[test]
fn with_an_fs_tier_every_token_is_in_one_bucket() {
    let mut cfg = small(3);
    cfg.turns = 4;
    let block = cfg.block_bytes() as f64;
    cfg.fs_cap_gb = Some(300.0 * block / (1u64 << 30) as f64);
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    assert!(tokens(&r, "served/fs") > 0, "{:?}", r.attribution);
    assert!(tokens(&r, "lost/first_use") > 0, "{:?}", r.attribution);
    assert_eq!(r.model.dram_blocks, 128);
    // the cap over what a block cost the tier, its directories' share included: fewer
    // blocks than the cap over the block size
    let g = r.gc.as_ref().expect("bounded");
    assert!(g.dir_bytes > 0, "{g:?}");
    // (an 8 KiB file and its leaf directory: about half; never below a third)
    assert!(
        r.model.fs_blocks.is_some_and(|b| (100..300).contains(&b)),
        "{:?}",
        r.model
    );
    assert!(r.model.working_set_blocks > 0);
    let text = kv_tier_examples::sim::render(&r);
    for want in [
        "where the prompt tokens went",
        "the same trace offline LRU",
        "first use: never stored before",
        "per request",
        "--max-wait-steps",
        "the offline model",
    ] {
        assert!(text.contains(want), "{want:?} missing from\n{text}");
    }
    // the bound the tier keeps, and the rate the time saved is at
    let g = r.gc.as_ref().expect("a bounded fs tier");
    // (a ceiling of 2.5 MiB, in MiB: in GiB it would read 0.002)
    let ceiling = format!(
        "hard ceiling is {:.1} MiB",
        g.hard_ceiling_bytes as f64 / (1u64 << 20) as f64
    );
    assert!(g.hard_ceiling_bytes > g.cap_bytes, "{g:?}");
    let rate = format!("at {} tokens/s of prefill", cfg.prefill_tokens_per_s);
    for want in [ceiling, rate] {
        assert!(text.contains(&want), "{want:?} missing from\n{text}");
    }
}

/// Tiny caps (96 blocks of DRAM, a cap of 150 blocks' bytes for fs, which its directories
/// cut to fewer blocks, for a working set of about 380): evictions are named, and the offline
/// model runs at the larger of the two in blocks.
#[test]
fn with_tiny_caps_evictions_are_named_by_tier() {
    let mut cfg = small(5);
    cfg.turns = 4;
    cfg.dram_bytes = 96 * cfg.block_bytes() as u64;
    let block = cfg.block_bytes() as f64;
    cfg.fs_cap_gb = Some(150.0 * block / (1u64 << 30) as f64);
    let r = run(&cfg).unwrap();
    // stores may fail here (everything left in the tiny tier protected): they are named too
    check_attribution(&r);
    if r.tiers[0].store_failures > 0 {
        assert!(
            tokens(&r, "lost/write_in_flight_or_failed/fs") > 0
                || tokens(&r, "lost/evicted/fs") > 0
        );
    }
    assert!(
        tokens(&r, "lost/evicted/fs") + tokens(&r, "lost/chain_broken") > 0,
        "{:?}",
        r.attribution
    );
    let fs = r.model.fs_blocks.expect("bounded");
    assert!(fs < 150, "{:?}", r.model);
    assert_eq!(r.model.model_blocks, Some(fs.max(96)), "{:?}", r.model);
    assert!(r.offline.unbounded > r.offline.lru, "{:?}", r.offline);
}

/// The fs tier's admission rule keeps blocks out: a block it did not admit and DRAM lost is
/// in the `not_admitted` bucket of fs.
#[test]
fn blocks_admission_kept_out_are_named_so() {
    let mut cfg = small(21);
    cfg.fs_admit_after_lookups = 2;
    cfg.turns = 4;
    cfg.dram_bytes = 96 * cfg.block_bytes() as u64;
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    assert!(r.tiers[0].not_admitted > 0);
    assert!(
        tokens(&r, "lost/not_written/fs/not_admitted") > 0,
        "{:?}",
        r.attribution
    );
}

/// An obj tier (an S3 server in this process, `--s3-embedded`) below a small fs tier: the
/// buckets sum over both tiers, and obj serves some of them.
#[test]
fn with_an_obj_tier_below_fs_every_token_is_in_one_bucket() {
    let mut cfg = small(11);
    cfg.turns = 4;
    let block = cfg.block_bytes() as f64;
    cfg.fs_cap_gb = Some(150.0 * block / (1u64 << 30) as f64);
    cfg.s3_embedded = true;
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    let names: Vec<&str> = r.tiers.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["fs", "obj"]);
    assert!(r.model.unbounded_below, "obj has no cap");
    assert!(tokens(&r, "served/obj") > 0, "{:?}", r.attribution);
}

/// The obj-only hierarchy (`no_fs`): DRAM, then a bounded obj tier on an S3 server in this
/// process. The buckets sum, obj serves some tokens and loses others to its bound, the report
/// has no fs tier and no fs GC, and the offline model's level below DRAM is the obj bound.
#[test]
fn with_only_an_obj_tier_every_token_is_in_one_bucket() {
    let mut cfg = small(13);
    cfg.turns = 4;
    cfg.no_fs = true;
    cfg.s3_embedded = true;
    let block = cfg.block_bytes() as f64;
    cfg.obj_cap_gb = Some(150.0 * block / (1u64 << 30) as f64);
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    let names: Vec<&str> = r.tiers.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["obj"]);
    assert!(r.gc.is_none());
    assert!(!r.model.unbounded_below, "obj has a cap: {:?}", r.model);
    assert_eq!(r.model.model_blocks, Some(150), "{:?}", r.model);
    assert_eq!(r.model.obj_blocks, Some(150), "{:?}", r.model);
    let text = kv_tier_examples::sim::render(&r);
    assert!(text.contains("below it obj 150 blocks"), "{text}");
    assert!(tokens(&r, "served/obj") > 0, "{:?}", r.attribution);
    assert!(tokens(&r, "lost/evicted/obj") > 0, "{:?}", r.attribution);
    let obj = &r.tiers[0];
    let bound = obj.bound_bytes.expect("a bounded obj tier says its bound");
    assert_eq!(
        bound,
        (cfg.obj_cap_gb.unwrap() * (1u64 << 30) as f64) as u64
    );
    assert!(obj.held_bytes.is_some_and(|h| h > 0), "{obj:?}");
    assert!(text.contains("at the end by its own count"), "{text}");
}

/// With `sync_steps`, the report says when another run of the same seed may still differ:
/// a run cut by its duration, an fs write budget (both on the wall clock); and not when
/// neither is there.
#[test]
fn the_report_says_what_sync_steps_cannot_repeat() {
    let says = |cfg: &kv_tier_examples::sim::SimConfig| {
        let r = run(cfg).unwrap();
        (
            r.requests < r.requests_planned,
            kv_tier_examples::sim::render(&r),
        )
    };
    let (cut, text) = says(&small(2));
    assert!(!cut && !text.contains("may differ"), "{text}");
    let mut short = small(2);
    short.duration = std::time::Duration::from_millis(1);
    let (cut, text) = says(&short);
    assert!(cut, "the run was not cut: {text}");
    assert!(text.contains("the run was cut by --duration"), "{text}");
    let mut budget = small(2);
    budget.fs_write_budget_mb_per_s = Some(1000.0);
    let (_, text) = says(&budget);
    assert!(
        text.contains("the fs write budget is a rate on the wall clock"),
        "{text}"
    );
}

/// A promoted block that some request was served counts as used, whichever of the
/// requests that waited for it was served it. Here (the tiny model's default workload over
/// DRAM and a small obj tier) requests wait for the same promotions and some of them are
/// not served what they waited for: each such request counted the block unused again after
/// another was served it, so the report said every promoted block went unused.
#[test]
fn a_promotion_served_to_any_request_is_used() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let args = [
        "--model",
        "tiny",
        "--turns",
        "4",
        "--no-fs",
        "--s3-embedded",
        "--obj-cap-gb",
        "0.002",
        "--eviction",
        "chain",
        "--dram-mb",
        "2",
        "--sync-steps",
        "--no-progress",
        "--json",
        json.to_str().unwrap(),
    ];
    let out = sim(&args, 300);
    assert_eq!(out.code, Some(0), "{}", out.all());
    let r: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let promoted = r["tiers"][0]["blocks_loaded"].as_u64().unwrap();
    let served = r["attribution"]["served/obj"].as_u64().unwrap_or(0) / 16;
    let unused = r["promotions_unused"].as_u64().unwrap();
    assert!(served > 0, "nothing served from obj: {}", r["attribution"]);
    assert!(
        unused + served.min(promoted) <= promoted,
        "{promoted} promoted, {served} served, {unused} unused"
    );
}

/// What the fs tier holds at the end, as the report counts it from the tier's events against
/// the workload's chains, agrees with the tier's own index: its block files, and, with chain
/// eviction (the tier then knows the chains), its dead bytes at a block file's allocated size.
/// Under LRU the tier is sent no links and counts no dead bytes, while the report still finds
/// the blocks its sweeps left behind a missing one.
#[test]
fn blocks_and_dead_blocks_at_the_end_agree_with_the_tiers_index() {
    let block = small(5).block_bytes() as f64;
    let mut dead = Vec::new();
    for chain in [false, true] {
        let mut cfg = small(5);
        cfg.turns = 6;
        cfg.fs_cap_gb = Some(60.0 * block / (1u64 << 30) as f64);
        cfg.chain_eviction = chain;
        let r = run(&cfg).unwrap();
        let fs = r.tiers.iter().find(|t| t.name == "fs").unwrap();
        let gc = r.gc.as_ref().unwrap();
        assert!(gc.swept_files > 0, "chain {chain}: nothing swept");
        assert_eq!(fs.blocks_at_end, gc.files, "chain {chain}");
        let per_file = (gc.bytes - gc.dir_bytes) / gc.files.max(1);
        if chain {
            assert_eq!(fs.dead_blocks_at_end * per_file, gc.dead_bytes);
        } else {
            assert_eq!(gc.dead_bytes, 0, "no links were sent");
        }
        let text = kv_tier_examples::sim::render(&r);
        assert!(
            text.contains(&format!(
                "holds {} blocks at the end by its events, {} of them dead",
                fs.blocks_at_end, fs.dead_blocks_at_end
            )),
            "{text}"
        );
        dead.push(fs.dead_blocks_at_end);
    }
    assert!(dead[0] > 0, "LRU left no dead block: {dead:?}");
}

/// A reused `--root-dir` says how many block files were there at open, for a bounded fs
/// tier (its index counts them) and an unbounded one (its directory is walked): none on the
/// first run, what the first left on the second.
#[test]
fn a_reused_root_reports_the_blocks_found_at_open() {
    let block = small(5).block_bytes() as f64;
    for cap in [None, Some(200.0 * block / (1u64 << 30) as f64)] {
        let dir = tempfile::tempdir().unwrap();
        let mut cfg = small(5);
        cfg.root_dir = Some(dir.path().to_path_buf());
        cfg.fs_cap_gb = cap;
        let first = run(&cfg).unwrap();
        assert_eq!(first.blocks_found_at_open, Some(0), "cap {cap:?}");
        let second = run(&cfg).unwrap();
        let n = second.blocks_found_at_open.unwrap();
        assert!(n > 0, "cap {cap:?}: nothing found at the second open");
        let text = kv_tier_examples::sim::render(&second);
        assert!(
            text.contains(&format!(
                "reused root           {n} block files were there at open"
            )),
            "cap {cap:?}: {text}"
        );
    }
}

/// `restart_after`: the manager is shut down and reopened on the same root midway; the
/// report has hits before and after, their tokens sum to the run's, the tiers served after
/// the reopen, and what only DRAM held is named as lost at the restart.
#[test]
fn a_restart_splits_the_run_and_every_token_is_still_in_one_bucket() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small(7);
    cfg.turns = 6;
    cfg.root_dir = Some(dir.path().to_path_buf());
    cfg.restart_after = Some(12);
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    let x = r.restart.as_ref().expect("the run restarted");
    assert!(x.after_requests >= 12, "{x:?}");
    assert_eq!(
        x.before_prompt_tokens + x.after_prompt_tokens,
        r.prompt_tokens
    );
    assert!(
        x.after_hit_rate > 0.0,
        "nothing served after the reopen: {x:?}"
    );
    assert!(x.first_tier_hit_after_s.is_some(), "{x:?}");
    let text = kv_tier_examples::sim::render(&r);
    assert!(text.contains("restart               after"), "{text}");
}

/// With `sync_steps` the attribution, the offline figures and the fs GC's counts are the
/// same for the same seed, over the fs tier's cap and at its hard ceiling too: its GC runs on
/// a clock of steps (which of a step's files a sweep takes does not depend on how fast the
/// step ran), and a store job that meets the ceiling reserves its blocks' room in the job's
/// order before any is written (which files the sweep for room takes, and how many, does not
/// depend on how the job's writes interleave on the I/O threads).
#[test]
fn the_same_seed_gives_the_same_attribution() {
    let run_in = |dir: &std::path::Path| {
        let mut cfg = small(9);
        cfg.root_dir = Some(dir.to_path_buf());
        // 200 blocks of 8 KiB, under the default hard ceiling (1.05x)
        cfg.fs_cap_gb = Some(200.0 * cfg.block_bytes() as f64 / (1u64 << 30) as f64);
        run(&cfg).unwrap()
    };
    let (da, db) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (a, b) = (run_in(da.path()), run_in(db.path()));
    assert!(
        a.attribution.get("lost/evicted/fs").copied().unwrap_or(0) > 0,
        "the run never went over the cap: {:?}",
        a.attribution
    );
    let gc = a.gc.as_ref().expect("a bounded fs tier");
    assert!(gc.store_waits > 0, "no store met the hard ceiling: {gc:?}");
    assert_eq!(a.attribution, b.attribution);
    assert_eq!(a.offline, b.offline);
    assert_eq!(a.trace, b.trace);
    assert_eq!(a.gc, b.gc);
    assert_eq!(
        (a.per_request.requests_waited, a.promotions_unused),
        (b.per_request.requests_waited, b.promotions_unused)
    );
}

/// `--trace FILE` writes the trace; `serve_sim replay FILE` prints each policy's hit rate,
/// the same as the report's offline figures; a policy it does not know is a usage error.
#[test]
fn a_trace_replays_offline_to_the_reports_figures() {
    let dir = tempfile::tempdir().unwrap();
    let (trace, json) = (dir.path().join("t.jsonl"), dir.path().join("r.json"));
    let (trace, json) = (trace.to_str().unwrap(), json.to_str().unwrap());
    let args = with(&[
        "--fs-cap-gb",
        "0.002",
        "--sync-steps",
        "--trace",
        trace,
        "--json",
        json,
    ]);
    let out = sim(&args, 120);
    assert_eq!(out.code, Some(0), "{}", out.all());
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap();
    let out = sim(&["replay", trace], 60);
    assert_eq!(out.code, Some(0), "{}", out.all());
    for p in ["lru", "opt", "pooled", "unbounded"] {
        let want = format!(
            "{:.1}%",
            100.0 * report["offline"][p].as_f64().expect("a figure")
        );
        let line = out
            .stdout
            .lines()
            .find(|l| l.trim_start().starts_with(p))
            .unwrap_or_else(|| panic!("no {p} line in\n{}", out.stdout));
        assert!(line.contains(&want), "{p}: want {want} in {line:?}");
    }
    let bad = sim(&["replay", "--policy", "fifo", trace], 60);
    assert_eq!(bad.code, Some(2), "{}", bad.all());
    assert!(
        bad.stderr.contains("lru, opt, pooled, unbounded"),
        "{}",
        bad.all()
    );
}

/// A conversation's next turn arrives only once its last answer is out: one conversation of
/// three turns with room for eight requests at once runs them one after the other, so each
/// turn finds the one before it (prompt and output) and the run reaches the unbounded
/// cache's hit rate.
#[test]
fn a_conversations_turns_run_one_after_the_other() {
    let mut cfg = small(4);
    cfg.streams = 1;
    cfg.prefixes = 1;
    cfg.turns = 3;
    cfg.max_batch = 8;
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    assert_eq!(r.requests, 3);
    assert!(
        (r.hit_rate - r.offline.unbounded).abs() < 1e-9 && r.hit_rate > 0.0,
        "achieved {} against unbounded {}: {:?}",
        r.hit_rate,
        r.offline.unbounded,
        r.attribution
    );
    assert_eq!(tokens(&r, "lost/chain_broken"), 0, "{:?}", r.attribution);
}

/// A restart the run reaches (two conversations of three turns, after two requests) is in the
/// report; one it does not reach (after more requests than the run has) is said to be not
/// reached.
#[test]
fn a_restart_is_reported_reached_or_not() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = small(8);
    cfg.streams = 2;
    cfg.prefixes = 2;
    cfg.root_dir = Some(dir.path().to_path_buf());
    cfg.restart_after = Some(2);
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    assert!(
        r.restart.is_some(),
        "the restart after 2 of 6 requests did not happen"
    );
    cfg.restart_after = Some(100);
    cfg.root_dir = None;
    let r = run(&cfg).unwrap();
    assert!(r.restart.is_none());
    let text = kv_tier_examples::sim::render(&r);
    assert!(
        text.contains("restart               not reached: the run admitted its last turn first"),
        "{text}"
    );
    // cut by the duration instead: said so
    cfg.duration = std::time::Duration::ZERO;
    let r = run(&cfg).unwrap();
    assert!(r.restart.is_none() && r.requests < r.requests_planned);
    let text = kv_tier_examples::sim::render(&r);
    assert!(
        text.contains("restart               not reached: the run reached --duration first"),
        "{text}"
    );
}
