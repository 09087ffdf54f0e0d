//! The index's count (`stats().bytes`, `objects`) follows what is in the bucket, and is never
//! below it: failed PUTs of new and present keys, damaged objects deleted or not, loads that
//! miss a key being stored, late NotFounds, and sweep victims already gone.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{Error, SecondaryTier};
use kv_tier_testkit::controlled_store::{ControlledStore, Op, PutFault};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, test_key};
use object_store::ObjectStoreExt as _;
use object_store::path::Path;

use crate::support::*;

#[tokio::test]
async fn a_block_gone_at_load_leaves_the_bound() {
    let s = Arc::new(ControlledStore::new());
    let t = tier_on(&s, bounded(8)).await;
    let k = test_key(1);
    assert!(obj_store(&t, &[k]).await.is_success());
    assert_eq!(t.stats().bytes, BS as u64);
    delete_behind_the_back(&s, &t, &k).await;
    let (res, _) = load_keys(&*t, &[k], BS).await;
    assert_eq!(res.failed_keys(), vec![k]);
    assert_eq!((t.stats().objects, t.stats().bytes), (0, 0));
}

/// The count follows what is there exactly where the tier knows: a damaged object it
/// deleted leaves it, and so does a new key whose PUT failed (nothing was written).
#[tokio::test]
async fn a_deleted_damaged_object_leaves_the_count_and_a_failed_put_stays_in_doubt() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let (k, fresh) = (test_key(1), test_key(2));
    assert!(obj_store(&tier, &[k]).await.is_success());
    assert_eq!((tier.stats().objects, tier.stats().bytes), (1, BS as u64));
    rot(&s, &tier.object_path(&k)).await;
    let (res, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(res.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        res.failed
    );
    assert!(!s.exists(&tier.object_path(&k)).await);
    assert_eq!(
        (tier.stats().objects, tier.stats().bytes),
        (0, 0),
        "a deleted object is still counted"
    );
    // a PUT refused with a transient error (it may have landed before its answer): counted
    // in doubt, not held; the lookup's 404 takes it out
    s.fail_puts(PutFault::Refused, "", usize::MAX);
    assert!(!obj_store(&tier, &[fresh]).await.is_success());
    s.stop_failing_puts();
    assert_eq!((tier.stats().objects, tier.stats().bytes), (1, BS as u64));
    assert_eq!(tier.holds(&fresh), None);
    assert_eq!(tier.lookup(&[fresh]).await.unwrap(), vec![false]);
    assert_eq!(
        (tier.stats().objects, tier.stats().bytes),
        (0, 0),
        "a PUT found missing left a count"
    );
}

/// A load deletes a damaged object, the DELETE times out without running: the object is
/// still there, and must stay counted.
#[tokio::test(start_paused = true)]
async fn damaged_objects_whose_delete_failed_stay_counted() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let keys: Vec<_> = (0..8).map(test_key).collect();
    assert!(obj_store(&tier, &keys).await.is_success());
    for k in &keys {
        rot(&s, &tier.object_path(k)).await;
    }
    s.hold(Op::Delete);
    let (res, _) = load_keys(&*tier, &keys, BS).await;
    assert_eq!(res.failed.len(), 8);
    s.release(Op::Delete);
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present"
    );
}

/// A store of a key already there (and counted) whose PUT fails with a server error (a
/// 503) uncounts the key, whose object is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_put_of_a_present_key_keeps_it_counted() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let keys: Vec<_> = (0..8).map(test_key).collect();
    assert!(obj_store(&tier, &keys).await.is_success());
    tier.clear_exists_cache(); // or its TTL passed
    s.fail_puts(PutFault::Refused, "", usize::MAX);
    let res = obj_store(&tier, &keys).await;
    s.stop_failing_puts();
    eprintln!(
        "second store: ok {} failed {}",
        res.ok.len(),
        res.failed.len()
    );
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present"
    );
}

/// A load of `k` while its store's PUT is in flight: the GET finds nothing and the load
/// uncounts `k`; then the PUT lands. The object is there, uncounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_missing_a_key_being_stored_does_not_uncount_it() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    let puts = s.hold(Op::Put);
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&t2, &[k]).await });
    puts.wait_arrived(1).await;
    let (lres, _) = load_keys(&*tier, &[k], BS).await;
    assert!(matches!(lres.failed[0].1, Error::NotFound { .. }));
    s.release(Op::Put);
    assert!(storing.await.unwrap().is_success());
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present"
    );
}

/// A load's GET answers NotFound late; meanwhile a store of the key counted and wrote it.
/// The late NotFound must not take back the store's count (the object is there).
#[tokio::test(start_paused = true)]
async fn a_late_not_found_does_not_uncount_a_key_stored_meanwhile() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    delete_behind_the_back(&s, &tier, &k).await;
    s.delay_replies(Op::Get, Duration::from_millis(500));
    let gets = s.count(Op::Get);
    let t2 = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t2, &[k], BS).await.0 });
    // the GET ran: NotFound, late
    wait_until_async("the load's GET", SETTLE_LIMIT, || s.count(Op::Get) > gets).await;
    s.delay_replies(Op::Get, Duration::ZERO);
    assert!(obj_store(&tier, &[k]).await.is_success()); // writes it again
    let lres = loading.await.unwrap();
    assert!(
        matches!(lres.failed[0].1, Error::NotFound { .. }),
        "{:?}",
        lres.failed
    );
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert!(
        counted >= present,
        "under-count: {counted} counted, {present} present"
    );
}

/// A sweep's victim already gone answers NotFound naming another path (a local store names
/// the file): it is confirmed gone all the same (answers match victims by position), and
/// leaves the count; before, it went back to the index for good and every later sweep
/// deleted a live object in its place.
#[tokio::test]
async fn a_victim_gone_before_its_delete_leaves_the_count_whatever_path_its_answer_names() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(4)).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    // the two oldest vanish behind the tier's back
    for k in &keys[..2] {
        s.inner
            .delete(&Path::from(tier.object_path(k)))
            .await
            .unwrap();
    }
    s.misname_missing_deletes(true);
    assert!(obj_store(&tier, &keys[4..]).await.is_success()); // over: a sweep
    wait_sweeps_done(&tier).await;
    assert_eq!(tier.sweep_now().await, 0, "within the bound now");
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert_eq!(
        counted, present,
        "the vanished objects are still counted ({counted} counted, {present} present)"
    );
    // down to the low watermark (2 of the 5 counted): the 2 vanished ones and the oldest live
    // one went; the newer live ones stay
    for k in &keys[3..] {
        assert!(
            found(&tier, *k).await,
            "a live object was swept for phantom bytes"
        );
    }
}

/// A bounded tier's PUT lands and its reply is lost (the connection reset after the request
/// was sent): the store fails, and the object the tier wrote is there. The index must not
/// under-count it.
#[tokio::test(start_paused = true)]
async fn a_put_that_landed_with_its_reply_lost_stays_counted() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let k = test_key(1);
    s.fail_puts(PutFault::ReplyLost, "", 1);
    let r = obj_store(&tier, &[k]).await;
    s.stop_failing_puts();
    assert!(!r.is_success(), "the reply was lost");
    assert!(s.exists(&tier.object_path(&k)).await, "the PUT landed");
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present ({:?})",
        tier.stats()
    );
}

/// The same for a PUT that wrote half its body (a store whose writes are not atomic) and
/// failed: the half object is in the bucket, under the tier's prefix, uncounted.
#[tokio::test(start_paused = true)]
async fn a_put_that_failed_half_written_stays_counted() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let k = test_key(1);
    s.fail_puts(PutFault::HalfWritten, "", 1);
    let r = obj_store(&tier, &[k]).await;
    s.stop_failing_puts();
    assert!(!r.is_success());
    assert!(s.exists(&tier.object_path(&k)).await, "half a body landed");
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present ({:?})",
        tier.stats()
    );
}

/// A bounded tier's PUT times out and lands later (the server ran it after the client gave
/// up: the store counts it "if it is cancelled or times out, the object may exist"). A
/// lookup before it lands sees 404 and takes the count back; then it lands: the object the
/// tier wrote is in the bucket, uncounted.
#[tokio::test(start_paused = true)]
async fn a_timed_out_put_that_lands_after_a_404_stays_counted() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    s.land_puts_late("", Some(Duration::from_secs(10)));
    let r = obj_store(&tier, &[k]).await;
    assert!(
        matches!(&r.failed[..], [(_, e)] if is_timeout(e)),
        "{:?}",
        r.failed
    );
    s.land_puts_late("", None);
    assert_eq!(tier.stats().objects, 1, "counted: it may land");
    assert_eq!(
        tier.lookup(&[k]).await.unwrap(),
        vec![false],
        "not landed yet"
    );
    wait_until_async("the PUT landed", SETTLE_LIMIT, || s.landed_late() == 1).await;
    assert!(s.exists(&tier.object_path(&k)).await);
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present ({:?})",
        tier.stats()
    );
}

/// A mixed workload (io_threads 1) on a bounded tier with every kind of fault: each kind of
/// request stays within io_threads (3 in flight at most), and afterwards the index never
/// under-counts what is in the store, and every key answered held is there.
#[tokio::test(start_paused = true)]
async fn a_mixed_faulty_workload_stays_in_bounds_and_never_under_counts() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_2s(16, 0.5);
    c.io_threads = 1;
    c.lookup_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..40).map(test_key).collect();
    for round in 0..6u64 {
        match round % 3 {
            0 => s.delay_replies(Op::Delete, Duration::from_secs(3)),
            1 => s.fail_puts(PutFault::Refused, "", 3),
            _ => s.delay_replies(Op::Head, Duration::from_millis(700)),
        }
        let chunk: Vec<_> = keys
            .iter()
            .cycle()
            .skip((round * 7) as usize)
            .take(12)
            .copied()
            .collect();
        let t = tier.clone();
        let st = chunk.clone();
        let storing = tokio::spawn(async move { obj_store(&*t, &st).await });
        let t = tier.clone();
        let lk = chunk.clone();
        let looking = tokio::spawn(async move { t.lookup(&lk).await });
        let t = tier.clone();
        let ld = chunk.clone();
        let loading = tokio::spawn(async move { load_keys(&*t, &ld, BS).await });
        if round == 2 && s.exists(&tier.object_path(&keys[0])).await {
            rot(&s, &tier.object_path(&keys[0])).await;
        }
        let _ = storing.await.unwrap();
        let _ = looking.await.unwrap();
        let _ = loading.await.unwrap();
        s.release_all();
        s.stop_failing_puts();
        s.delay_replies(Op::Delete, Duration::ZERO);
        s.delay_replies(Op::Head, Duration::ZERO);
        tier.sweep_now().await;
        wait_sweeps_done(&tier).await;
        tokio::time::sleep(Duration::from_secs(10)).await;
    }
    let st = tier.stats();
    assert!(st.max_in_flight <= 3, "{st:?}");
    let present = present_bytes(&s.inner);
    assert!(
        st.bytes >= present,
        "under-count: {} counted, {present} present",
        st.bytes
    );
    for k in &keys {
        if tier.holds(k) == Some(true) {
            assert!(
                s.exists(&tier.object_path(k)).await,
                "{k} answered held, not there"
            );
        }
    }
}

/// A bounded tier's PUT times out and lands later (counted Unended: "it may still land, so a
/// request that finds it missing does not take it out"). The engine stores the key again and
/// that PUT is refused with a 503: the entry turns Unknown, and a lookup's 404 (the first PUT
/// has not landed yet) takes it out. Then the first PUT lands: the tier's own object is in the
/// bucket, uncounted.
#[tokio::test(start_paused = true)]
async fn a_refused_retry_does_not_uncount_an_earlier_put_still_landing() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    let path = tier.object_path(&k);
    s.land_puts_late("", Some(Duration::from_secs(30)));
    let r = obj_store(&tier, &[k]).await;
    assert!(
        matches!(&r.failed[..], [(_, e)] if is_timeout(e)),
        "{:?}",
        r.failed
    );
    s.land_puts_late("", None);
    assert_eq!(tier.stats().objects, 1, "counted: it may land");
    s.fail_puts(PutFault::Refused, "", 1);
    let r = obj_store(&tier, &[k]).await;
    assert!(!r.is_success(), "the retry was refused");
    assert_eq!(s.failed_puts(), 1);
    assert_eq!(
        tier.lookup(&[k]).await.unwrap(),
        vec![false],
        "not landed yet"
    );
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert_eq!(s.landed_late(), 1);
    assert!(s.exists(&path).await, "the first PUT landed");
    if let Some(e) = under_count(&tier, &s) {
        panic!("{e}; holds {:?}", tier.holds(&k));
    }
}

/// A PUT lands and its reply is lost (a transport error: counted Unknown, "stays counted until
/// a request finds it missing"). A lookup's HEAD that ran while the PUT was in flight (before
/// it landed) answers 404 after the PUT failed: the stale 404 takes the tier's own object out
/// of the count.
#[tokio::test(start_paused = true)]
async fn a_404_sent_while_a_put_was_under_way_does_not_uncount_it_after_its_reply_is_lost() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_long(64)).await;
    let k = test_key(1);
    let path = tier.object_path(&k);
    let puts = s.hold(Op::Put);
    s.fail_puts(PutFault::ReplyLost, "", 1);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    puts.wait_arrived(1).await;
    s.delay_replies(Op::Head, Duration::from_secs(10));
    let heads = s.count(Op::Head);
    let t = tier.clone();
    let looking = tokio::spawn(async move { t.lookup(&[k]).await.unwrap() });
    wait_until_async("the HEAD ran", SETTLE_LIMIT, || s.count(Op::Head) > heads).await;
    tokio::task::yield_now().await;
    s.release(Op::Put);
    let r = storing.await.unwrap();
    assert!(!r.is_success(), "the reply was lost");
    assert!(s.exists(&path).await, "the PUT landed");
    assert_eq!(
        looking.await.unwrap(),
        vec![false],
        "the HEAD ran before it landed"
    );
    s.release_all();
    s.stop_failing_puts();
    if let Some(e) = under_count(&tier, &s) {
        panic!("{e}; holds {:?}", tier.holds(&k));
    }
}

/// On a store without create-only writes: a PUT times out and lands later (Unended: "a
/// request that finds it missing does not take it out"). The retry looks first (a HEAD: 404,
/// not landed yet) and its PUT is refused with a 503; a lookup's 404 then takes it out, and
/// the first PUT lands uncounted. (Round 4 fixed this for create-only writes.)
#[tokio::test(start_paused = true)]
async fn a_refused_retry_that_looked_first_does_not_uncount_an_earlier_put_still_landing() {
    let s = Arc::new(ControlledStore::new());
    s.refuse_create(true);
    let mut c = bounded(64);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    assert!(obj_store(&tier, &[test_key(0)]).await.is_success());
    let k = test_key(1);
    let path = tier.object_path(&k);
    s.land_puts_late("", Some(Duration::from_secs(30)));
    let r = obj_store(&tier, &[k]).await;
    assert!(
        matches!(&r.failed[..], [(_, e)] if is_timeout(e)),
        "{:?}",
        r.failed
    );
    s.land_puts_late("", None);
    assert_eq!(tier.stats().objects, 2, "counted: it may land");
    s.fail_puts(PutFault::Refused, "", 1);
    let r = obj_store(&tier, &[k]).await;
    assert!(!r.is_success(), "the retry was refused");
    assert_eq!(s.failed_puts(), 1);
    assert_eq!(
        tier.lookup(&[k]).await.unwrap(),
        vec![false],
        "not landed yet"
    );
    tokio::time::sleep(Duration::from_secs(40)).await;
    assert_eq!(s.landed_late(), 1);
    assert!(s.exists(&path).await, "the first PUT landed");
    if let Some(e) = under_count(&tier, &s) {
        panic!("{e}; holds {:?}", tier.holds(&k));
    }
}
