//! Why a lookup missed: `TieringManager::last_miss` names the cause of a request's last
//! `Miss` (no tier has it, a probe past its budget, a failed probe, a failed load, no DRAM
//! room), `ManagerStats::misses_by_cause` counts them, and `promotion_tier` says where a
//! `HitPending` comes from.

use std::time::Duration;

use kv_tier_core::{LookupResult, MissCause, RequestContext};
use kv_tier_testkit::test_key;

use crate::support::*;

/// "Why the last `Miss` answered for `req` was one": a key no tier has is `NotFound`, and
/// the cause is forgotten when the request finishes.
#[tokio::test]
async fn a_key_no_tier_has_is_not_found_until_the_request_finishes() {
    let (a, _b_inner, b) = two_tiers();
    let m = two_tier_manager(8, a, b, |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(m.last_miss(req.id), None, "no miss yet");
    assert_eq!(step(&m, &[test_key(1)], &req), vec![LookupResult::Retry]);
    m.wait_idle().await;
    assert_eq!(step(&m, &[test_key(1)], &req), vec![LookupResult::Miss]);
    assert_eq!(m.last_miss(req.id), Some(MissCause::NotFound));
    let s = m.stats();
    assert_eq!(s.misses_by_cause.not_found, 1);
    assert_eq!(s.misses_by_cause.total(), s.misses);
    m.on_request_finished(req.id);
    assert_eq!(m.last_miss(req.id), None, "forgotten with the request");
}

/// A probe still out at the tier's probe budget: the miss names that tier and the budget.
#[tokio::test(start_paused = true)]
async fn a_probe_past_its_budget_is_named_with_its_tier() {
    let (a, b_inner, b) = two_tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    let gate = b.hold_lookups();
    let m = two_tier_manager(8, a, b.clone(), |_, o| o[1].probe_budget_s = Some(0.02)).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    tokio::time::sleep(Duration::from_millis(25)).await;
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Miss]);
    assert_eq!(
        m.last_miss(req.id),
        Some(MissCause::ProbeOverBudget { tier: "b".into() })
    );
    assert_eq!(m.stats().misses_by_cause.probe_over_budget, 1);
    gate.open();
    m.wait_idle().await;
}

/// A probe that fails counts its keys absent; the miss says the probe failed, not that the
/// block is not there.
#[tokio::test]
async fn a_failed_probe_is_not_a_block_not_found() {
    let (a, b_inner, b) = two_tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    b.fail_lookups(true);
    let m = two_tier_manager(8, a, b.clone(), |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    m.wait_idle().await;
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Miss]);
    assert_eq!(
        m.last_miss(req.id),
        Some(MissCause::ProbeFailed { tier: "b".into() })
    );
    assert_eq!(m.stats().misses_by_cause.probe_failed, 1);
}

/// A block found in a tier whose load then fails: the next lookup misses it for that
/// request, as a failed load of that tier; the `HitPending` before named the tier.
#[tokio::test]
async fn a_failed_load_is_named_with_its_tier_and_a_pending_hit_with_its_source() {
    let (a, b_inner, b) = two_tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    b.fail_load(&[k]);
    let m = two_tier_manager(8, a, b.clone(), |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    m.wait_idle().await;
    let v = m.lookup(&k, &req);
    assert_eq!(v, LookupResult::HitPending);
    assert_eq!(
        m.promotion_tier(&k),
        Some("b"),
        "the promotion reads tier b"
    );
    m.on_schedule_end();
    m.wait_idle().await;
    assert_eq!(m.promotion_tier(&k), None, "the promotion ended");
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Miss]);
    assert_eq!(
        m.last_miss(req.id),
        Some(MissCause::LoadFailed { tier: "b".into() })
    );
    assert_eq!(m.stats().misses_by_cause.load_failed, 1);
}

/// A tier has the block, but every DRAM slot is pinned: the miss is for want of DRAM, and
/// names the tier that had it.
#[tokio::test]
async fn a_block_with_no_dram_slot_to_promote_into_is_named_so() {
    let (a, b_inner, b) = two_tiers();
    let (k, held) = (test_key(1), test_key(2));
    seed(&*b_inner, &[k]).await;
    let m = two_tier_manager(1, a, b, |_, _| {}).await;
    let req = RequestContext::new(1);
    // the one DRAM slot holds `held`, pinned by a view the engine keeps
    let mut p = m.prepare_store(&[held]).unwrap();
    for (_, sink) in p.slots() {
        sink.as_mut_slice().fill(1);
    }
    let _ = p.commit(req.id);
    let view = m.prepare_load(&[held]).unwrap();
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    m.wait_idle().await;
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Miss]);
    assert_eq!(
        m.last_miss(req.id),
        Some(MissCause::NoDramRoom { tier: "b".into() })
    );
    let s = m.stats();
    assert_eq!(
        (s.misses_by_cause.no_dram_room, s.promotions_refused),
        (1, 1)
    );
    drop(view);
}

/// After shutdown every lookup past DRAM is a miss of that cause.
#[tokio::test]
async fn a_lookup_after_shutdown_misses_as_shut_down() {
    let (a, _b_inner, b) = two_tiers();
    let m = two_tier_manager(8, a, b, |_, _| {}).await;
    m.shutdown().await.unwrap();
    let req = RequestContext::new(1);
    assert_eq!(m.lookup(&test_key(1), &req), LookupResult::Miss);
    assert_eq!(m.last_miss(req.id), Some(MissCause::ShutDown));
    assert_eq!(m.stats().misses_by_cause.shut_down, 1);
}
