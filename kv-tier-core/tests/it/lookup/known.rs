//! Keys a tier answers for from what it knows in memory (`SecondaryTier::holds`): present and
//! leased, or a miss, at the first ask and with no probe; a key evicted between the answer and
//! its lease is not leased; a tier that cannot tell, or panics, is probed.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use kv_tier_core::{
    Absence, LookupResult, MissCause, Presence, RequestContext, RequestId, SecondaryTier,
};
use kv_tier_testkit::test_key;

use crate::support::*;

/// A held key is `Present` at its first ask, leased (protected in its tier) and asked again
/// under that protection; nothing is queued or probed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_tier_holds_is_present_at_its_first_ask_and_leased() {
    let inner = mem("m");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = Arc::new(Knowing::new(inner.clone(), &[]));
    let (mut al, _notify) = probe_cache(t.clone());
    assert_eq!(al.ask(&k, RequestId(1)), Presence::Present);
    assert!(inner.is_protected(&k), "a held key is not leased");
    assert_eq!(
        t.asked.load(Ordering::SeqCst),
        2,
        "asked once, then again under its lease"
    );
    assert_eq!((al.queued(), al.flush()), (0, 0), "a held key was probed");
    assert_eq!(inner.lookup_counts().0, 0, "the tier was probed");
    let s = al.stats();
    assert_eq!((s.known_present, s.known_absent, s.probes), (1, 0, 0));
    // another request rides on the same lease, with no new answer asked
    assert_eq!(al.ask(&k, RequestId(2)), Presence::Present);
    assert_eq!(t.asked.load(Ordering::SeqCst), 2);
    al.release(&[k]);
    assert!(!inner.is_protected(&k), "the lease outlived its release");
}

/// A key the tier does not hold is a miss for the request at its first ask, because it was
/// not found; another request asks the tier again, and a completed store lets it be found.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_tier_does_not_hold_is_a_miss_at_its_first_ask() {
    let inner = mem("m");
    let t = Arc::new(Knowing::new(inner.clone(), &[]));
    let (mut al, _notify) = probe_cache(t.clone());
    let k = test_key(1);
    assert_eq!(al.ask(&k, RequestId(1)), Presence::Absent);
    assert_eq!(al.absence(&k, RequestId(1)), Some(Absence::NotFound));
    assert!(!inner.is_protected(&k), "an absent key kept a protection");
    assert_eq!(al.queued(), 0, "an absent key was queued for a probe");
    // the answer is this request's: asked again, it is not asked of the tier again
    assert_eq!(al.ask(&k, RequestId(1)), Presence::Absent);
    assert_eq!(t.asked.load(Ordering::SeqCst), 1);
    seed(&*inner, &[k]).await;
    assert_eq!(al.ask(&k, RequestId(2)), Presence::Present);
    al.mark_stored(&[k]);
    assert_eq!(
        al.ask(&k, RequestId(1)),
        Presence::Present,
        "a completed store did not end the request's miss"
    );
    let s = al.stats();
    assert_eq!((s.known_present, s.known_absent, s.probes), (1, 1, 0));
}

/// The tier held the key, then (asked again under the lease's protection) no longer does: it
/// was evicted between the two answers. It is a miss, and not left protected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_evicted_between_the_answer_and_its_lease_is_a_miss() {
    let inner = mem("m");
    let k = test_key(1);
    let t = Arc::new(Knowing::new(
        inner.clone(),
        &[Known::Says(Some(true)), Known::Says(Some(false))],
    ));
    let (mut al, _notify) = probe_cache(t.clone());
    assert_eq!(al.ask(&k, RequestId(1)), Presence::Absent);
    assert!(!inner.is_protected(&k), "the lease of a gone key was kept");
    assert_eq!(al.leased_keys(), 0);
    assert_eq!(al.stats().known_absent, 1);
    // "cannot tell" under the lease: probed, and the lease dropped
    let k2 = test_key(2);
    t.script
        .lock()
        .unwrap()
        .extend([Known::Says(Some(true)), Known::Says(None)]);
    assert_eq!(al.ask(&k2, RequestId(1)), Presence::Retry);
    assert!(!inner.is_protected(&k2));
    assert_eq!(al.queued(), 1);
}

/// A tier that cannot tell (`None`) or panics in `holds` is probed as any other: `Retry`, and
/// the probe's answer serves the next step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_that_cannot_tell_or_panics_is_probed() {
    let inner = mem("m");
    let (a, b) = (test_key(1), test_key(2));
    seed(&*inner, &[a, b]).await;
    let t = Arc::new(Knowing::new(
        inner.clone(),
        &[Known::Says(None), Known::Panics],
    ));
    let (mut al, notify) = probe_cache(t.clone());
    let r = RequestId(1);
    assert_eq!(al.ask(&a, r), Presence::Retry);
    assert_eq!(al.ask(&b, r), Presence::Retry, "a panic was an answer");
    assert_eq!(al.flush(), 2);
    settle_probes(&mut al, &notify).await;
    assert_eq!(al.ask(&a, r), Presence::Present);
    assert_eq!(al.ask(&b, r), Presence::Present);
    let s = al.stats();
    assert_eq!((s.known_present, s.keys_found), (0, 2));
}

/// Through the manager: a prefix the tier holds is promoted from the first step (no `Retry`,
/// no probe), its first missing key ends it at once with `NotFound`, and the known answers
/// are in the tier's stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_prefix_is_promoted_from_the_first_step_without_a_probe() {
    let inner = mem("m");
    let keys: Vec<_> = (0..4).map(test_key).collect();
    seed(&*inner, &keys[..3]).await;
    let t: Arc<dyn SecondaryTier> = Arc::new(Knowing::new(inner.clone(), &[]));
    let fx = evented_manager(8, vec![t]).await;
    let req = RequestContext::new(1);
    use LookupResult::{Hit, HitPending, Miss};
    assert_eq!(
        step(&fx.m, &keys, &req),
        vec![HitPending, HitPending, HitPending, Miss]
    );
    assert_eq!(fx.m.last_miss(req.id), Some(MissCause::NotFound));
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup_many(&keys[..3], &req), vec![Hit, Hit, Hit]);
    let s = fx.m.stats();
    assert_eq!(s.retries, 0, "a known answer waited a step");
    let p = s.tiers[0].probes;
    assert_eq!((p.known_present, p.known_absent, p.probes), (3, 1, 0));
    assert_eq!(inner.lookup_counts().0, 0, "the tier was probed");
    assert_eq!(s.tiers[0].blocks_loaded, 3);
}
