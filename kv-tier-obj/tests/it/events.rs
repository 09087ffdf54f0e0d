//! The stored and removed events: a key reported stored and not reported removed since is
//! found, a successful store after a removal is reported after it, and work a dropped store
//! did is still reported; around damaged loads' deletes and sweeps whose DELETEs time out or
//! lose their replies.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt as _;
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::ObjTierConfig;
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, test_key};

use crate::support::*;

/// A load finds `k` damaged (bit rot: checksum mismatch) and deletes it; its DELETE is in
/// flight when a store of `k` arrives. The store reports `k` ok (after the removal was
/// taken), then the load's DELETE lands: the key is reported stored, never removed after,
/// and gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_during_a_damaged_loads_delete_is_not_lost() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let mut h = History::default();
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    h.take(&tier);
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let deletes = s.hold_path(Op::Delete, &path);
    let t2 = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t2, &[k], BS).await.0 });
    deletes.wait_arrived(1).await;
    let ev = h.take(&tier);
    assert_eq!(
        ev,
        vec![(k, true)],
        "the damaged object is reported removed first"
    );
    // a store of k now: it waits for the delete (the load holds k's claim), then writes k,
    // reported after the removal
    let t3 = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&t3, &[k]).await });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert!(
        !storing.is_finished(),
        "the store did not wait for the delete"
    );
    s.release(Op::Delete);
    let lres = loading.await.unwrap();
    assert!(matches!(lres.failed[0].1, Error::Corrupt { .. }));
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    let after = h.take(&tier);
    assert_eq!(after, vec![(k, false)], "stored again, after the removal");
    let cached = tier.lookup(&[k]).await.unwrap()[0];
    assert!(
        found(&tier, k).await,
        "stored (job ok after the removal event), never reported removed after, and gone (lookup from the cache: {cached}); events {:?}; object exists: {}",
        h.0,
        s.exists(&path).await
    );
}

/// A store job of [k, slow] wrote k (reported stored as it landed, not at the job's end); a
/// load of k meanwhile finds it damaged (bit rot) and deletes it (removal event now). The
/// job then ends: the last word for k is the removal, and k is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_event_of_a_job_after_a_damaged_load_removed_the_key() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let mut h = History::default();
    let (k, slow) = (test_key(1), test_key(2));
    let puts = s.hold_path(Op::Put, &tier.object_path(&slow));
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&t2, &[k, slow]).await });
    puts.wait_arrived(1).await;
    wait_until_async("k's PUT to land", SETTLE_LIMIT, || {
        s.exists(&tier.object_path(&k)).now_or_never() == Some(true)
    })
    .await;
    assert!(s.exists(&tier.object_path(&k)).await);
    rot(&s, &tier.object_path(&k)).await;
    let (lres, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(lres.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        lres.failed
    );
    assert_eq!(
        h.take(&tier),
        vec![(k, false), (k, true)],
        "in the order they happened"
    );
    s.release(Op::Put);
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    h.take(&tier);
    let last = h.last(&k);
    let found = found(&tier, k).await;
    assert!(
        last != Some(false) || found,
        "last event for k is 'stored' but lookup says absent; events {:?}; object exists: {}",
        h.0,
        s.exists(&tier.object_path(&k)).await
    );
}

/// A sweep's DELETEs time out without running: the victims were reported removed and are
/// still there. A store of one succeeds (confirmed, not rewritten): the last word of the
/// event stream must not stay "removed".
#[tokio::test(start_paused = true)]
async fn store_after_a_timed_out_sweep_delete_is_reported_after_the_removal() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(4)).await;
    let mut h = History::default();
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    s.hold(Op::Delete);
    assert!(obj_store(&tier, &keys[4..]).await.is_success()); // over: a sweep starts
    wait_sweeps_done(&tier).await; // its DELETEs time out
    s.release(Op::Delete);
    let ev = h.take(&tier);
    let k = keys[0];
    assert!(ev.contains(&(k, true)), "{ev:?}");
    let res = obj_store(&tier, &[k]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    let found = found(&tier, k).await;
    assert_eq!(
        h.last(&k),
        Some(false),
        "the store of k succeeded after its removal, yet the last event for k is a removal (lookup: {found}); events {:?}",
        h.0
    );
}

/// Same, with the replies of the DELETEs lost (they ran): the victims are gone, counted,
/// and a store writes them again.
#[tokio::test(start_paused = true)]
async fn lost_delete_replies_then_restore() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(4)).await;
    let mut h = History::default();
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    s.delay_replies(Op::Delete, Duration::from_secs(100));
    assert!(obj_store(&tier, &keys[4..]).await.is_success());
    wait_sweeps_done(&tier).await;
    s.release_all();
    h.take(&tier);
    assert!(tier.stats().bytes >= present_bytes(&s.inner));
    for k in &keys {
        let res = obj_store(&tier, &[*k]).await;
        assert!(res.is_success(), "{:?}", res.failed);
        h.take(&tier);
        assert!(tier.stats().bytes >= present_bytes(&s.inner));
    }
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    for k in &keys {
        if h.last(k) == Some(false) {
            assert!(found(&tier, *k).await, "{k}");
        }
    }
    assert!(tier.stats().bytes >= present_bytes(&s.inner));
}

// Real concurrency: stores, loads, lookups and sweeps with slow deletes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_stores_during_sweeps() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(16);
    c.request_timeout_s = 0.05; // deadline 1.05 s: lost DELETE replies time out
    c.io_threads = 8;
    let tier = tier_on(&s, c).await;
    s.delay(Op::Delete, Duration::from_millis(20));
    let mut h = History::default();
    let results = Arc::new(std::sync::Mutex::new(Vec::new()));
    for round in 0..6u64 {
        if round % 2 == 1 {
            s.delay_replies(Op::Delete, Duration::from_millis(1200));
        } else {
            s.release_all();
            s.delay(Op::Delete, Duration::from_millis(20));
        }
        let mut tasks = Vec::new();
        for w in 0..4u64 {
            let t = tier.clone();
            let results = results.clone();
            tasks.push(tokio::spawn(async move {
                for j in 0..12u64 {
                    let k = test_key((w * 7 + j * 3 + round) % 40);
                    let r = obj_store(&t, &[k]).await;
                    results.lock().unwrap().push((k, r.is_success()));
                    if j % 4 == 0 {
                        let _ = tokio::time::timeout(Duration::from_millis(5), t.sweep_now()).await;
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }
    s.release_all();
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    let mut bad = Vec::new();
    let mut last: HashMap<BlockKey, bool> = HashMap::new();
    for (k, r) in &h.0 {
        last.insert(*k, *r);
    }
    for (k, removed) in &last {
        if !removed && !found(&tier, *k).await {
            bad.push(*k);
        }
    }
    let mut removed_but_present = 0;
    for (k, removed) in &last {
        if *removed && s.exists(&tier.object_path(k)).await {
            removed_but_present += 1;
        }
    }
    eprintln!(
        "f1: {} keys whose last event is 'removed' are present",
        removed_but_present
    );
    let st = tier.stats();
    eprintln!(
        "f1: sweeps {} evicted {} request_timeouts {} removal events {}",
        st.sweeps,
        st.evicted,
        st.request_timeouts,
        h.0.iter().filter(|e| e.1).count()
    );
    assert!(bad.is_empty(), "last event 'stored' but absent: {bad:?}");
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner));
    assert!(counted >= present, "{counted} < {present}");
    // nothing wedged
    for i in 0..40 {
        let r = tokio::time::timeout(Duration::from_secs(5), obj_store(&tier, &[test_key(i)]))
            .await
            .expect("wedged");
        assert!(r.is_success(), "{:?}", r.failed);
    }
}

/// Work a dropped store did is still reported: the objects it wrote have their events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_store_still_reports_what_it_stored() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    let (k1, k2) = (test_key(1), test_key(2));
    let held = s.hold_path(Op::Put, &tier.object_path(&k2));
    let t = tier.clone();
    let job = tokio::spawn(async move { obj_store(&t, &[k1, k2]).await });
    held.wait_arrived(1).await;
    while !s.exists(&tier.object_path(&k1)).await {
        tokio::task::yield_now().await;
    }
    job.abort();
    let _ = job.await;
    let stored: Vec<BlockKey> = tier
        .take_events()
        .into_iter()
        .filter(|e| !e.removed)
        .flat_map(|e| e.keys)
        .collect();
    assert_eq!(
        stored,
        vec![k1],
        "the stored object's event was lost with the job"
    );
}
