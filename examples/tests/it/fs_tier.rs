//! The fs tier under the simulator: within its cap after each sweep; admission after two
//! lookups writes less, and the comparison shows it.

use kv_tier_examples::sim::run;

use crate::support::*;

#[test]
fn the_fs_tier_stays_within_its_cap_after_each_sweep() {
    let mut cfg = small(3);
    cfg.turns = 4;
    let block = cfg.block_bytes() as f64;
    cfg.fs_cap_gb = Some(300.0 * block / (1u64 << 30) as f64); // 300 blocks of files, about half of them with their directories
    let r = run(&cfg).unwrap();
    check_consistent(&r);
    let g = r.gc.expect("bounded fs tier");
    assert!(
        g.sweeps > 0 && g.swept_files > 0,
        "no sweep happened: {g:?}"
    );
    let max = g.max_bytes_after_step_sweep.expect("measured in sync mode");
    assert!(
        max <= g.cap_bytes,
        "{max} bytes after a sweep, cap {}",
        g.cap_bytes
    );
    assert!(r.removal_events > 0);
}

#[test]
fn admission_after_two_lookups_writes_less_to_the_fs_tier_and_the_comparison_shows_it() {
    let without = run(&small(21)).unwrap();
    let mut cfg = small(21);
    cfg.fs_admit_after_lookups = 2;
    let with = run(&cfg).unwrap();
    check_consistent(&without);
    check_consistent(&with);
    let (a, b) = (&without.tiers[0], &with.tiers[0]);
    assert_eq!((a.not_admitted, a.over_write_budget), (0, 0));
    assert!(b.not_admitted > 0, "{b:?}");
    // sync_steps makes both runs deterministic: the rule keeps writes out
    assert!(b.blocks_written_new > 0, "{b:?}");
    assert!(
        b.blocks_written_new < a.blocks_written_new,
        "with admission {} blocks written, without {}",
        b.blocks_written_new,
        a.blocks_written_new
    );
    assert!(b.blocks_written_new <= b.blocks_stored, "{b:?}");
    assert_eq!(without.requests, with.requests, "the same workload");
    let text = kv_tier_examples::sim::render_admission_comparison(&without, &with);
    eprintln!("{text}");
    for want in [
        "hit rate",
        "tier fs written (device)",
        "not admitted",
        "fs admit_after_lookups 2",
    ] {
        assert!(text.contains(want), "{want:?} missing from\n{text}");
    }
    // the report says what was kept out
    assert!(kv_tier_examples::sim::render(&with).contains("blocks not admitted"));
}
