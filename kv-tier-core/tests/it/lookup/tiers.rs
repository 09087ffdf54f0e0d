//! Several secondary tiers: all are probed at once, a slow or hanging one never hides another's
//! block, the first in order that has a key serves it, a failed promotion falls back to the next
//! tier, and a request's tier filter.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use LookupResult::{Hit, Retry};
use kv_tier_core::{LookupResult, RequestContext};
use kv_tier_testkit::{FaultyTier, MemoryTier, store_keys, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_filter_skips_a_tier() {
    let (a, b) = (mem("a"), mem("b"));
    let k = test_key(1);
    seed(&*b, &[k]).await;
    let fx = evented_manager(4, vec![a.clone(), b.clone()]).await;
    let skip_b = RequestContext::new(1).skip_tiers(["b"]);
    step(&fx.m, &[k], &skip_b);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &skip_b), LookupResult::Miss);
    assert_eq!(b.lookup_counts(), (0, 0), "tier b was probed");
    let only_b = RequestContext::new(2).only_tiers(["b"]);
    assert_eq!(step(&fx.m, &[k], &only_b), vec![LookupResult::Retry]);
    fx.m.wait_idle().await;
    assert_eq!(
        a.lookup_counts(),
        (1, 1),
        "tier a was probed for the filtered request"
    );
    assert_eq!(step(&fx.m, &[k], &only_b), vec![LookupResult::HitPending]);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &only_b), LookupResult::Hit);
    assert_eq!(fx.m.stats().tiers[1].blocks_loaded, 1);
}

/// A key tier A has is served as soon as A answers, whatever B is doing.
#[tokio::test(start_paused = true)]
async fn a_key_in_the_fast_tier_does_not_wait_for_the_slow_one() {
    let (a, _b_inner, b) = two_tiers();
    let k = test_key(1);
    seed(&*a, &[k]).await;
    let b_gate = b.hold_lookups();
    let m = two_tier_manager(8, a.clone(), b.clone(), |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    tokio::time::sleep(Duration::from_millis(5)).await; // A has answered; B has not
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::HitPending]);
    assert!(!b_gate.is_open());
}

/// A key absent from A and present in B is answered in the step B answers: B is probed in
/// the same step as A, not one step later.
#[tokio::test(start_paused = true)]
async fn a_key_only_the_slow_tier_has_is_answered_when_it_answers() {
    let (a, b_inner, b) = two_tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    let m = two_tier_manager(8, a.clone(), b.clone(), |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    m.wait_idle().await; // both probes answered: A absent, B present
    assert_eq!(
        step(&m, &[k], &req),
        vec![LookupResult::HitPending],
        "B was not probed with A"
    );
    assert_eq!(b_inner.lookup_counts().1, 1);
}

/// Promise (README: "A key that misses DRAM is probed in every secondary tier at once; the
/// first tier in order that has it serves it"; ARCHITECTURE.md §1: "a `Present` behind a
/// pending tier is ignored for now"). Two tiers have the key; the first answers late: the
/// block is promoted from the first, never from the second.
#[test]
fn the_first_tier_in_order_serves_even_when_it_answers_last() {
    let rt = runtime();
    let (mem_a, a) = faulty_mem_named("a");
    let (mem_b, b) = faulty_mem_named("b");
    let k = test_key(361);
    assert!(rt.block_on(store_keys(&*mem_a, &[k], 0, BS)).is_success());
    assert!(rt.block_on(store_keys(&*mem_b, &[k], 0, BS)).is_success());
    let m = build_with(
        mcfg(4, r#", "probe_timeout_s": 30"#),
        vec![a.clone(), b.clone()],
    );
    let gate = a.hold_lookups();
    let r = ctx(1);
    assert_eq!(m.lookup(&k, &r), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    assert!(
        poll_until(SETTLE_LIMIT, || {
            // the second tier's answer lands; the first is still out
            let v = m.lookup(&k, &r);
            m.on_schedule_end();
            v != Retry || m.stats().tiers[1].probes.keys_found >= 1
        }),
        "{:?}",
        m.stats().tiers[1].probes
    );
    for _ in 0..5 {
        assert_eq!(m.lookup(&k, &r), Retry, "served past a pending first tier");
        m.on_schedule_end();
        // steps pass while the first tier has not answered
        std::thread::sleep(Duration::from_millis(5));
    }
    gate.open();
    let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    let s = m.stats();
    assert_eq!(
        (s.tiers[0].blocks_loaded, s.tiers[1].blocks_loaded),
        (1, 0),
        "served by the wrong tier"
    );
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_nothing_left(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// The first tier hangs, the second has the block: the key is served from the second once
/// the first's probe passes its deadline, with the right bytes.
#[test]
fn a_hanging_first_tier_does_not_hide_the_second_tiers_block() {
    let hang = Script::new("hang", BS);
    hang.hang_lookup.store(true, Ordering::SeqCst);
    let good = Script::new("good", BS);
    // the deadline applies to the good tier's probe too: long enough that it answers in time
    // on a loaded machine
    let m = build_with(
        dram_cfg(8, BS, r#", "probe_timeout_s": 2"#),
        vec![hang.clone(), good.clone()],
    );
    let k = test_key(7);
    put(&m, &good, &[k]);
    let req = RequestContext::new(1);
    let v = settle_lookup(&m, &k, &req, Duration::from_secs(30)).0;
    assert_eq!(
        v,
        LookupResult::Hit,
        "the second tier's block was not served"
    );
    assert!(load_and_verify(&m, &[k]));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A promotion from the first tier fails; the second tier has the block: the request gets
/// it from there rather than recomputing.
#[test]
fn a_failed_promotion_falls_back_to_the_next_tier() {
    let a = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("a", BS))));
    let b = Script::new("b", BS);
    let m = build_with(dram_cfg(8, BS, ""), vec![a.clone(), b.clone()]);
    let k = test_key(5);
    let r = m.runtime().block_on(store_keys(&**a.inner(), &[k], 0, BS));
    assert!(r.is_success());
    put(&m, &b, &[k]);
    a.fail_load(&[k]);
    let req = RequestContext::new(1);
    let v = settle_lookup(&m, &k, &req, Duration::from_secs(5)).0;
    assert_eq!(
        v,
        LookupResult::Hit,
        "the block in the second tier was not used after the first tier's load failed"
    );
    assert!(load_and_verify(&m, &[k]));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// A request allowed no tier (or an unknown one) gets `Miss` at once, never `Retry`.
#[test]
fn a_request_filtering_out_every_tier_misses_at_once() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(8, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    put(&m, &t, &[k]);
    for req in [
        RequestContext::new(1).only_tiers(["nope"]),
        RequestContext::new(2).skip_tiers(["mem"]),
    ] {
        assert_eq!(m.lookup(&k, &req), LookupResult::Miss);
        m.on_schedule_end();
        m.on_request_finished(req.id);
    }
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
