//! `--load-policy`: the manager, told the prefill rate, declines the promotions whose load
//! would end later than recomputing; their tokens are in a bucket of their own, and the run's
//! figures still agree with each other.

use kv_tier_examples::sim::run;

use crate::support::*;

/// With recompute nearly free (1e9 tokens/s) no wait pays, not even a step's for a probe:
/// with the policy, no request waits, the probes are not waited for and those tokens are
/// attributed to `lost/recompute_faster/fs`; without it, the same seed declines none.
#[test]
fn with_recompute_nearly_free_promotions_are_declined_and_attributed() {
    let mut cfg = small(5);
    cfg.turns = 6;
    cfg.prefill_tokens_per_s = 1e9;
    cfg.load_policy = true;
    let on = run(&cfg).unwrap();
    check_consistent(&on);
    check_attribution(&on);
    assert!(on.per_request.load_policy);
    assert!(
        on.per_request.probes_not_waited > 0 && on.per_request.requests_waited == 0,
        "{:?}",
        on.per_request
    );
    let declined: u64 = on
        .attribution
        .iter()
        .filter(|(l, _)| l.starts_with("lost/recompute_faster/fs"))
        .map(|(_, n)| *n)
        .sum();
    assert!(declined > 0, "{:?}", on.attribution);
    cfg.load_policy = false;
    let off = run(&cfg).unwrap();
    check_consistent(&off);
    assert_eq!(
        (
            off.per_request.promotions_declined,
            off.per_request.probes_not_waited,
            off.per_request.load_jobs_cut,
            off.per_request.promotions_cut
        ),
        (0, 0, 0, 0)
    );
    assert!(
        !off.attribution
            .keys()
            .any(|l| l.starts_with("lost/recompute_faster")),
        "{:?}",
        off.attribution
    );
    assert!(off.tiers[0].blocks_loaded > on.tiers[0].blocks_loaded);
}
