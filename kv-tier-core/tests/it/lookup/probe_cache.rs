//! The `ProbeCache` on its own: its counters, probes of the wrong size, budgets with several
//! waiting requests, misses per request, what a request's end takes with it, its reaper and its
//! `Debug`.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, Presence, RequestId, SecondaryTier};
use kv_tier_testkit::{FaultyTier, MemoryTier, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn probes_are_counted_by_batch_key_and_failure() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let t = Arc::new(FaultyTier::new(inner.clone()));
    let (mut al, notify) = probe_cache(t.clone());
    let ks: Vec<BlockKey> = (0..3).map(test_key).collect();
    seed(&*inner, &ks[..1]).await;
    let r = RequestId(1);
    for k in &ks {
        assert_eq!(al.ask(k, r), Presence::Retry);
    }
    assert_eq!(al.queued(), 3);
    assert_eq!(al.flush(), 3, "flush reports the keys it sent");
    assert_eq!((al.queued(), al.in_flight()), (0, 1));
    settle_probes(&mut al, &notify).await;
    assert_eq!(al.in_flight(), 0);
    let s = al.stats();
    assert_eq!((s.probes, s.probed_keys, s.probe_errors), (1, 3, 0));
    assert_eq!((s.keys_found, s.keys_absent), (1, 2), "one of three seeded");
    assert!(
        al.asked_since(&ks[0]).is_some(),
        "a tracked key has its first ask"
    );
    assert!(al.asked_since(&test_key(99)).is_none());
    assert_eq!(al.ask(&ks[0], r), Presence::Present);
    assert_eq!(al.ask(&ks[1], r), Presence::Absent);
    // a failing probe: its keys are absent, and it is counted once
    t.fail_lookups(true);
    let k = test_key(10);
    seed(&*inner, &[k]).await;
    assert_eq!(al.ask(&k, r), Presence::Retry);
    assert_eq!(al.flush(), 1);
    settle_probes(&mut al, &notify).await;
    let s = al.stats();
    assert_eq!((s.probes, s.probed_keys, s.probe_errors), (2, 4, 1));
    assert_eq!(
        (s.keys_found, s.keys_absent),
        (1, 2),
        "a failed batch's keys are not answers"
    );
    assert_eq!(al.ask(&k, r), Presence::Absent);
    assert!(!al.has_results());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_with_the_wrong_number_of_answers_counts_every_key_absent() {
    let (mut al, notify) = probe_cache(Arc::new(OneAnswer(MemoryTier::new("m", BS))));
    let r = RequestId(1);
    let (a, b) = (test_key(1), test_key(2));
    al.ask(&a, r);
    al.ask(&b, r);
    al.flush();
    settle_probes(&mut al, &notify).await;
    assert_eq!(al.stats().probe_errors, 1);
    assert_eq!(
        al.ask(&a, r),
        Presence::Absent,
        "one answer for two keys was believed"
    );
    assert_eq!(al.ask(&b, r), Presence::Absent);
}

/// Two requests wait on one probe of a key the tier does not have. The first gives up at the
/// budget; the second keeps waiting. When the answer (absent) comes, both are misses, for good.
#[tokio::test(start_paused = true)]
async fn a_request_past_the_budget_leaves_the_others_waiting_and_stays_a_miss() {
    let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("m", BS))));
    let (al, notify) = probe_cache(t.clone());
    let mut al = al.with_budget(Duration::from_millis(10));
    let k = test_key(1);
    let (r1, r2) = (RequestId(1), RequestId(2));
    let gate = t.hold_lookups();
    assert_eq!(al.ask(&k, r1), Presence::Retry);
    assert_eq!(al.ask(&k, r2), Presence::Retry);
    al.flush();
    // the paused clock passes the 10 ms budget
    tokio::time::sleep(Duration::from_millis(20)).await;
    al.apply_results(); // a new step: nothing has answered
    assert_eq!(al.ask(&k, r1), Presence::Absent, "past the budget");
    assert_eq!(al.ask(&k, r1), Presence::Absent);
    assert_eq!(
        al.stats().over_budget,
        1,
        "counted once per request and key"
    );
    gate.open();
    settle_probes(&mut al, &notify).await;
    assert_eq!(al.ask(&k, r1), Presence::Absent, "r1 forgot its miss");
    assert_eq!(
        al.ask(&k, r2),
        Presence::Absent,
        "r2 stopped waiting when r1 gave up"
    );
    assert_eq!(al.queued(), 0, "a miss sent another probe");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_load_is_a_miss_for_its_request_until_it_ends() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let (mut al, notify) = probe_cache(inner.clone());
    let (k0, k1) = (test_key(1), test_key(2));
    let r = RequestId(1);
    assert_eq!(al.ask(&k0, r), Presence::Retry); // r is known
    al.mark_miss(&[k1], r);
    assert_eq!(al.ask(&k1, r), Presence::Absent);
    assert_eq!(al.ask(&k1, RequestId(2)), Presence::Retry);
    assert_eq!((al.tracked_keys(), al.tracked_requests()), (2, 2));
    al.flush();
    settle_probes(&mut al, &notify).await;
    al.finish_request(r);
    al.finish_request(RequestId(2));
    assert_eq!((al.tracked_keys(), al.tracked_requests()), (0, 0));
}

/// A probe queued and not sent yet, whose only request finishes, goes with its key: nothing
/// is tracked afterwards and the next flush sends nothing. A key another request still asks
/// for keeps its queued probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_request_takes_its_unsent_probes_with_it() {
    let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("m", BS))));
    let (mut al, notify) = probe_cache(t.clone());
    let (k, j) = (test_key(1), test_key(2));
    let (r1, r2) = (RequestId(1), RequestId(2));
    assert_eq!(al.ask(&k, r1), Presence::Retry);
    assert_eq!(al.ask(&j, r1), Presence::Retry);
    assert_eq!(al.ask(&j, r2), Presence::Retry);
    assert_eq!((al.queued(), al.tracked_keys()), (2, 2));
    al.finish_request(r1);
    assert_eq!(
        (al.queued(), al.tracked_keys()),
        (1, 1),
        "k's probe asked by nobody stays queued"
    );
    let gate = t.hold_lookups();
    assert_eq!(al.flush(), 1, "only j is probed");
    gate.open();
    settle_probes(&mut al, &notify).await;
    assert_eq!(al.ask(&j, r2), Presence::Absent);
    al.finish_request(r2);
    assert_eq!((al.queued(), al.tracked_keys(), al.in_flight()), (0, 0, 0));
    assert_eq!(al.flush(), 0);
}

#[tokio::test(start_paused = true)]
async fn ending_one_request_keeps_the_misses_and_waits_of_the_others() {
    let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("m", BS))));
    let (mut al, notify) = probe_cache(t.clone());
    let (k, j) = (test_key(1), test_key(2));
    let (r1, r2) = (RequestId(1), RequestId(2));
    // both missed k
    al.ask(&k, r1);
    al.ask(&k, r2);
    al.flush();
    settle_probes(&mut al, &notify).await;
    assert_eq!(al.ask(&k, r2), Presence::Absent);
    al.finish_request(r1);
    assert_eq!(
        al.ask(&k, r2),
        Presence::Absent,
        "r1's end cleared r2's miss"
    );
    // both wait on a probe of j; r1 ends before the answer (absent)
    let gate = t.hold_lookups();
    al.ask(&j, r1);
    al.ask(&j, r2);
    al.flush();
    al.finish_request(r1);
    gate.open();
    settle_probes(&mut al, &notify).await;
    assert_eq!(
        al.ask(&j, r2),
        Presence::Absent,
        "r1's end dropped r2's wait"
    );
    al.finish_request(r1);
    al.finish_request(r2);
    assert_eq!(al.tracked_keys(), 0);
}

/// Dropping the lookup ends its lease reaper at once (no task left on the engine's runtime
/// until the next tick) and every lease's protection with it. Real time: a paused clock
/// would jump to the reaper's tick as soon as the runtime idles.
#[tokio::test(flavor = "current_thread")]
async fn dropping_the_lookup_leaves_no_task_and_no_protection() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let (al, notify) = probe_cache(inner.clone());
    let mut al = al.with_timeouts(Duration::from_secs(1), Duration::from_secs(60));
    let r = RequestId(1);
    al.ask(&k, r);
    al.flush();
    settle_probes(&mut al, &notify).await;
    assert_eq!(al.ask(&k, r), Presence::Present);
    assert!(inner.is_protected(&k));
    assert_eq!(al.leased_keys(), 1);
    let text = format!("{al:?}");
    assert!(
        text.contains("ProbeCache") && text.contains("tracked_keys: 1") && text.contains("\"m\""),
        "{text}"
    );
    let metrics = tokio::runtime::Handle::current().metrics();
    assert_eq!(metrics.num_alive_tasks(), 1, "the reaper runs");
    drop(al);
    tokio::task::yield_now().await;
    assert_eq!(
        metrics.num_alive_tasks(),
        0,
        "the reaper outlived its lookup"
    );
    assert!(
        !inner.is_protected(&k),
        "a dropped lookup's lease still protects"
    );
}

/// The boundaries, on a paused clock where durations are exact: an answer that takes exactly
/// the budget is not late, and a lease ends at its expiry instant (not one tick after).
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn an_answer_at_the_budget_is_not_late_and_a_lease_ends_at_its_expiry() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let faulty = Arc::new(FaultyTier::new(inner.clone()));
    let (k, r) = (test_key(1), RequestId(1));
    seed(&*inner, &[k]).await;
    faulty.delay_answers(Some(Duration::from_millis(100)));
    let (al, notify) = probe_cache(faulty.clone());
    let mut al = al
        .with_timeouts(Duration::from_secs(1), Duration::from_secs(5))
        .with_budget(Duration::from_millis(100));
    assert_eq!(al.ask(&k, r), Presence::Retry);
    al.flush();
    settle_probes(&mut al, &notify).await;
    assert_eq!(
        al.stats().late_answers,
        0,
        "an answer at the budget was late"
    );
    assert_eq!(al.ask(&k, r), Presence::Present);
    tokio::time::advance(Duration::from_millis(4_900)).await;
    assert_eq!(al.ask(&k, r), Presence::Present, "the lease ended early");
    tokio::time::advance(Duration::from_millis(100)).await;
    assert_eq!(
        al.ask(&k, r),
        Presence::Retry,
        "a lease outlived its expiry instant"
    );
}
