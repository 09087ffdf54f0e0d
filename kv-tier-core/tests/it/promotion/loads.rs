//! Promotion loads: `Retry` then `HitPending` then `Hit`, one load job per tier and request, one
//! promotion for many asking requests, partial failures, duplicate keys.

use std::time::{Duration, Instant};

use kv_tier_core::{LookupResult, RequestContext, RequestId};
use kv_tier_testkit::test_key;

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promotion_goes_retry_then_pending_then_hit() {
    let t = mem("fs");
    let keys: Vec<_> = (0..4).map(test_key).collect();
    seed(&*t, &keys).await;
    let fx = evented_manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Retry; 4]);
    fx.m.wait_idle().await; // the probe's answer arrives
    assert_eq!(t.lookup_counts(), (4, 1), "one batched probe for the step");
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 4]);
    fx.m.wait_idle().await; // the promotion lands
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Hit; 4]);
    assert_dram_bytes(&fx.cpu, &keys);
    let s = fx.m.stats();
    assert_eq!(
        (
            s.tiers[0].hits,
            s.tiers[0].load_jobs,
            s.tiers[0].blocks_loaded
        ),
        (4, 1, 4)
    );
    assert_eq!(s.tiers[0].bytes_loaded, 4 * BS as u64);
    assert_eq!(s.lookups, 12);
    assert_eq!((s.retries, s.hits_pending, s.hits, s.misses), (4, 4, 4, 0));
    let c = fx.m.lookup_prefix(&keys, &req);
    assert_eq!((c.hit, c.present, c.retry), (4, 4, false));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_promotion_keeps_what_loaded_and_misses_the_rest() {
    let inner = mem("fs");
    let keys: Vec<_> = (0..3).map(test_key).collect();
    seed(&*inner, &keys).await;
    let t = faulty_over(&inner);
    t.fail_load(&keys[1..2]);
    let fx = evented_manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &keys, &req);
    fx.m.wait_idle().await;
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::HitPending; 3]);
    fx.m.wait_idle().await;
    assert_eq!(
        step(&fx.m, &keys, &req),
        vec![LookupResult::Hit, LookupResult::Miss, LookupResult::Hit]
    );
    assert_dram_bytes(&fx.cpu, &[keys[0], keys[2]]);
    // no livelock: the failed key stays a Miss for this request, with no new probe or load
    let probes = inner.lookup_counts();
    for _ in 0..3 {
        assert_eq!(fx.m.lookup(&keys[1], &req), LookupResult::Miss);
        fx.m.on_schedule_end();
        fx.m.wait_idle().await;
    }
    assert_eq!(inner.lookup_counts(), probes);
    assert_eq!(fx.m.stats().tiers[0].load_failures, 1);
    assert_eq!(fx.m.stats().tiers[0].load_jobs, 1);
    // a later successful store makes it Hit again
    t.heal();
    engine_store(&fx.m, RequestId(2), &keys[1..2]);
    assert_eq!(fx.m.lookup(&keys[1], &req), LookupResult::Hit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_requests_for_one_block_cause_one_promotion() {
    let t = mem("fs");
    let k = test_key(1);
    seed(&*t, &[k]).await;
    let fx = evented_manager(8, vec![t.clone()]).await;
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    assert_eq!(fx.m.lookup(&k, &r1), LookupResult::Retry);
    assert_eq!(fx.m.lookup(&k, &r2), LookupResult::Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(t.lookup_counts(), (1, 1), "one probe for both requests");
    assert_eq!(fx.m.lookup(&k, &r1), LookupResult::HitPending);
    assert_eq!(fx.m.lookup(&k, &r2), LookupResult::HitPending);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &r1), LookupResult::Hit);
    assert_eq!(fx.m.lookup(&k, &r2), LookupResult::Hit);
    let s = fx.m.stats();
    assert_eq!((s.tiers[0].load_jobs, s.tiers[0].blocks_loaded), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn promotions_are_one_job_per_tier_and_request() {
    let t = mem("fs");
    let keys: Vec<_> = (0..6).map(test_key).collect();
    seed(&*t, &keys).await;
    let fx = evented_manager(16, vec![t.clone()]).await;
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    for k in &keys[..3] {
        fx.m.lookup(k, &r1);
    }
    for k in &keys[3..] {
        fx.m.lookup(k, &r2);
    }
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    for k in &keys[..3] {
        assert_eq!(fx.m.lookup(k, &r1), LookupResult::HitPending);
    }
    for k in &keys[3..] {
        assert_eq!(fx.m.lookup(k, &r2), LookupResult::HitPending);
    }
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.stats().tiers[0].load_jobs, 2);
    assert_dram_bytes(&fx.cpu, &keys);
}

/// Duplicate keys in one lookup whose block comes from a secondary tier.
#[test]
fn duplicate_keys_in_one_lookup_with_promotion() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(4, BS, ""), vec![t.clone()]);
    let (a, b) = (test_key(1), test_key(2));
    put(&m, &t, &[a, b]);
    let req = RequestContext::new(1);
    let keys = [a, a, b, a, b];
    let t0 = Instant::now();
    loop {
        let c = m.lookup_prefix(&keys, &req);
        if c.hit == keys.len() {
            break;
        }
        step_and_wait(&m);
        assert!(t0.elapsed() < Duration::from_secs(5), "{c:?}");
    }
    assert!(load_and_verify(&m, &keys));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_eq!(m.stats().primary.ready_blocks, 2);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// `TierStats::load_busy` is the time the tier had a load job in flight: two jobs that run at
/// once count their time once (3 s each, side by side: 3 s, not 6).
#[tokio::test(start_paused = true)]
async fn load_busy_counts_overlapping_load_jobs_once() {
    let inner = mem("fs");
    let (a, b) = (test_key(1), test_key(2));
    seed(&*inner, &[a, b]).await;
    let t = faulty_over(&inner);
    let fx = evented_manager(8, vec![t.clone()]).await;
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    step_requests(&fx.m, &[(&[a][..], &r1), (&[b][..], &r2)]);
    fx.m.wait_idle().await; // both probes answered
    assert_eq!(fx.m.stats().tiers[0].load_busy, Duration::ZERO);
    t.delay(Some(Duration::from_secs(3)));
    assert_eq!(
        step_requests(&fx.m, &[(&[a][..], &r1), (&[b][..], &r2)]),
        vec![vec![LookupResult::HitPending]; 2]
    );
    fx.m.wait_idle().await; // both loads land, side by side
    assert_eq!(
        step_requests(&fx.m, &[(&[a][..], &r1), (&[b][..], &r2)]),
        vec![vec![LookupResult::Hit]; 2]
    );
    let s = &fx.m.stats().tiers[0];
    assert_eq!(s.load_jobs, 2);
    assert!(
        s.load_busy >= Duration::from_secs(3) && s.load_busy < Duration::from_secs(6),
        "{:?}",
        s.load_busy
    );
}
