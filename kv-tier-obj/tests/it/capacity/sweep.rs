//! The sweep: over the bound the oldest unprotected keys go first, down to the low watermark;
//! protected keys stay; stores, lookups and loads racing its DELETEs (a key being deleted is
//! absent, and its store waits for the delete); DELETEs whose replies are lost.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_obj::ObjTierConfig;
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_bound_the_oldest_go_first_and_protected_keys_stay() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.max_size_gb = Some((10 * BS) as f64 / (1u64 << 30) as f64);
    cfg.low_watermark = 0.8;
    let tier = server.tier(cfg.clone()).await;
    let keys: Vec<_> = (0..10).map(test_key).collect();
    for k in &keys {
        assert!(obj_store(&tier, &[*k]).await.is_success()); // one at a time: ascending age
    }
    tier.touch(&keys[..1]); // key 0 becomes the most recent
    let guard = tier.protect(&keys[1..2]);
    tier.take_events();
    let more: Vec<_> = (100..103).map(test_key).collect();
    assert!(obj_store(&tier, &more).await.is_success()); // 13 > 10: over the bound
    tier.sweep_now().await; // after the sweep the store woke, if it still runs
    let s = tier.stats();
    assert!(s.bytes <= 8 * BS as u64, "{s:?}");
    let exists = tier.lookup(&keys).await.unwrap();
    assert!(exists[0], "the touched key went");
    assert!(exists[1], "the protected key went");
    assert_eq!(
        &exists[2..7],
        &[false; 5],
        "the oldest unprotected go first: {exists:?}"
    );
    assert!(exists[7..].iter().all(|&b| b));
    assert!(s.skipped_in_flight >= 1);
    let removed: Vec<BlockKey> = kv_tier_testkit::removed_keys(tier.take_events());
    assert_eq!(removed.len(), 5);
    assert_eq!(s.evicted, 5);
    drop(guard);
    // a restart seeds the index from a LIST
    let again = server.tier(cfg).await;
    assert_eq!(again.stats().objects, 8);
}

/// Keys protected before they exist, then stored, survive a flood_until far past the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn protected_keys_survive_a_flood() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_2s(8, 0.5)).await;
    let keep: Vec<_> = (0..3).map(|i| test_key(500 + i)).collect();
    let guard = tier.protect(&keep);
    assert!(obj_store(&*tier, &keep).await.is_success());
    for i in 0..60 {
        assert!(obj_store(&*tier, &[test_key(i)]).await.is_success());
        if i % 10 == 0 {
            tier.sweep_now().await;
        }
    }
    tier.sweep_now().await;
    wait_sweeps_done(&tier).await;
    for k in &keep {
        assert!(
            s.exists(&tier.object_path(k)).await,
            "protected {k} evicted"
        );
    }
    let (r, _) = load_keys(&*tier, &keep, BS).await;
    assert!(r.is_success(), "{:?}", r.failed);
    drop(guard);
    assert!(keep.iter().all(|k| !tier.is_protected(k)));
    assert!(present_bytes(&s.inner) <= (8 * BS) as u64);
}

/// Concurrent stores while every DELETE is slow (sweeps overlap stores): once the stores
/// and sweeps are over, the objects are within the bound, and the index counts them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_stores_during_slow_sweeps_end_within_the_bound() {
    let s = Arc::new(ControlledStore::new());
    let blocks = 16;
    let tier = tier_on(&s, bounded_checked_2s(blocks, 0.75)).await;
    s.delay(Op::Delete, Duration::from_millis(40));
    let mut hs = Vec::new();
    for w in 0..4u64 {
        let t = tier.clone();
        hs.push(tokio::spawn(async move {
            for i in 0..15u64 {
                let k = test_key(w * 1000 + i);
                let r = obj_store(&*t, &[k]).await;
                assert!(r.is_success(), "{:?}", r.failed);
                // the writers' pace: their stores spread over the slow sweeps
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }));
    }
    for h in hs {
        h.await.unwrap();
    }
    wait_sweeps_done(&tier).await;
    let present = present_bytes(&s.inner);
    let bound = (blocks * BS) as u64;
    assert!(
        present <= bound,
        "after all stores and sweeps ended: {} blocks present, bound {blocks} (index says {})",
        present / BS as u64,
        tier.stats().bytes / BS as u64
    );
    assert!(tier.stats().bytes >= present, "{:?}", tier.stats());
}

/// A sweep chose keys and their DELETEs are in flight: those keys are absent for lookups,
/// and a store of one waits for its delete and then writes it. On one thread, so the store
/// runs as far as it can before the delete is let go.
#[tokio::test]
async fn a_key_being_deleted_is_absent_and_its_store_waits_for_the_delete() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(4)).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    let deletes = s.hold(Op::Delete);
    assert!(obj_store(&tier, &keys[4..]).await.is_success()); // over: a sweep starts
    deletes.wait_arrived(1).await;
    let k = keys[0];
    assert_eq!(
        tier.lookup(&[k]).await.unwrap(),
        vec![false],
        "a key being deleted was found"
    );
    // absent from now on, so reported removed from now on (not when the sweep ends)
    let removed: Vec<_> = tier
        .take_events()
        .into_iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys)
        .collect();
    assert!(
        removed.contains(&k),
        "a key lookups answer absent for is not reported removed: {removed:?}"
    );
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&t2, &[k]).await });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    s.release(Op::Delete);
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(
        s.exists(&tier.object_path(&k)).await,
        "the store wrote before the delete and the delete removed it"
    );
    // the store's copy is reported after the removal, so the last word on `k` is "stored"
    let last = tier
        .take_events()
        .into_iter()
        .rfind(|e| e.keys.contains(&k))
        .expect("the store reported its copy");
    assert!(!last.removed, "the removal was reported after the new copy");
}

/// A sweep chose `k` and its DELETE is in flight; a lookup and a store of `k` arrive. The
/// store must leave the object in the bucket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_a_key_being_swept_is_not_lost() {
    let s = Arc::new(ControlledStore::new());
    let mut c = ObjTierConfig::new("mem");
    c.max_size_gb = Some((4 * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = 0.5;
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success()); // ascending age, at the cap
    }
    let deletes = s.hold(Op::Delete);
    assert!(obj_store(&tier, &keys[4..]).await.is_success()); // over: a sweep starts
    deletes.wait_arrived(1).await; // it chose the oldest (keys 0..3) and is deleting them
    let k = keys[0];
    // A lookup while the delete is in flight must not cache "present" for later.
    let _ = tier.lookup(&[k]).await.unwrap();
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&t2, &[k]).await });
    tokio::task::yield_now().await;
    s.release(Op::Delete);
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(
        s.exists(&tier.object_path(&k)).await,
        "a store reported success while the sweep deleted its object"
    );
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![true]);
}

/// A sweep's DELETEs run on the server, and their replies never arrive within the request
/// deadline: the sweep cannot tell the objects are gone. Each is reported removed anyway
/// (a key reported stored never goes missing unreported), and each is still counted
/// toward the bound (it may be there), in doubt (not held: a lookup asks); a lookup's 404
/// takes it out of the count.
#[tokio::test(start_paused = true)]
async fn a_delete_whose_reply_is_lost_is_reported_removed_and_still_counted() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(4);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    tier.take_events();
    s.delay_replies(Op::Delete, std::time::Duration::from_secs(3600));
    assert!(obj_store(&tier, &keys[4..]).await.is_success()); // over: a sweep starts
    assert_eq!(tier.sweep_now().await, 0, "no delete was confirmed");
    let mut gone = Vec::new();
    for k in &keys {
        if !s.exists(&tier.object_path(k)).await {
            gone.push(*k);
        }
    }
    assert!(!gone.is_empty(), "the sweep deleted nothing");
    let removed: Vec<_> = tier
        .take_events()
        .into_iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys)
        .collect();
    for k in &gone {
        assert!(
            removed.contains(k),
            "{k} is gone from the store and was never reported removed (removed: {removed:?})"
        );
        assert_eq!(tier.holds(k), None, "{k}: in doubt, yet known");
    }
    assert_eq!(
        tier.stats().bytes,
        5 * BS as u64,
        "objects the sweep could not confirm gone left the count"
    );
    // a lookup's 404 takes one out of the count
    assert_eq!(tier.lookup(&gone[..1]).await.unwrap(), vec![false]);
    assert_eq!(tier.holds(&gone[0]), Some(false));
    assert_eq!(tier.stats().bytes, 4 * BS as u64);
    // the others go as they are found missing
    for k in &gone {
        assert_eq!(tier.lookup(&[*k]).await.unwrap(), vec![false]);
    }
    assert_eq!(tier.stats().bytes, (5 - gone.len() as u64) * BS as u64);
}

/// A sweep's DELETEs are writes like the PUTs: at most `io_threads` in flight (one here),
/// whatever the number of victims.
#[tokio::test(start_paused = true)]
async fn a_sweeps_deletes_stay_within_io_threads() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let keys: Vec<BlockKey> = (0..12).map(test_key).collect();
    assert!(obj_store(&writer, &keys).await.is_success());
    let deletes = s.hold(Op::Delete);
    let mut cfg = bounded(4);
    cfg.io_threads = 1;
    let tier = tier_on(&s, cfg).await;
    let t = tier.clone();
    let sweeping = tokio::spawn(async move { t.sweep_now().await });
    wait_until_async("a DELETE is held", SETTLE_LIMIT, || deletes.arrived() >= 1).await;
    // (every task waits on the gate or a timer far off: nothing else can start meanwhile)
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        deletes.arrived(),
        1,
        "DELETEs in flight beyond io_threads 1"
    );
    s.release(Op::Delete);
    sweeping.await.unwrap();
    wait_sweeps_done(&tier).await;
    assert!(tier.stats().max_in_flight <= 1, "{:?}", tier.stats());
    // down to the low watermark (two blocks)
    assert_eq!(present_bytes(&s.inner), (2 * BS) as u64);
}

/// Which victim of a sweep's batch a store asks for.
enum Victim {
    /// The oldest, whose DELETE is sent first.
    First,
    /// The newest, whose DELETE comes after all the others.
    Last,
}

/// A sweep deletes a batch of 17 victims one DELETE at a time (io_threads 1), every reply
/// lost past its deadline; a one-block store of `which` victim (reported removed) ends
/// within a few request deadlines: it waits for that victim's DELETE at most (a victim whose
/// DELETE is not sent yet is taken back), never for the rest of the batch.
async fn a_store_of_a_victim_while_its_batch_hangs(which: Victim) {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(32);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    c.io_threads = 1;
    let deadline = c.request_deadline();
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..33).map(test_key).collect();
    for k in &keys[..32] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    let mut h = History::default();
    h.take(&tier);
    s.delay_replies(Op::Delete, Duration::from_secs(3600));
    assert!(obj_store(&tier, &keys[32..]).await.is_success()); // over: a sweep
    wait_until_async("the first DELETE", SETTLE_LIMIT, || {
        s.count(Op::Delete) >= 1
    })
    .await;
    h.take(&tier);
    let victims: Vec<_> = h.0.iter().filter(|(_, r)| *r).map(|(k, _)| *k).collect();
    assert!(victims.len() > 8, "{victims:?}");
    let k = match which {
        Victim::First => keys[0],
        Victim::Last => *victims.last().unwrap(),
    };
    assert!(victims.contains(&k));
    let t0 = tokio::time::Instant::now();
    let r = obj_store(&tier, &[k]).await;
    let took = t0.elapsed();
    assert!(r.is_success(), "{:?}", r.failed);
    assert!(
        took <= deadline * 4,
        "a one-block store waited {took:?} (request deadline {deadline:?}) behind {} DELETEs",
        victims.len()
    );
}

#[tokio::test(start_paused = true)]
async fn a_store_of_a_swept_key_does_not_wait_for_the_whole_batch() {
    a_store_of_a_victim_while_its_batch_hangs(Victim::First).await;
}

#[tokio::test(start_paused = true)]
async fn a_store_of_a_batchs_last_victim_does_not_wait_for_the_whole_batch() {
    a_store_of_a_victim_while_its_batch_hangs(Victim::Last).await;
}

/// The five oldest objects' DELETEs never answer (an object lock, a server partition that
/// hangs): each sweep takes them first, they go back in doubt with their old recency, and the
/// sweep ends "done" there. The bound is 8 blocks, the low watermark 4: the count must come
/// back within the bound, deleting the real, deletable objects behind the stuck ones.
#[tokio::test(start_paused = true)]
async fn a_sweep_reads_on_past_victims_whose_deletes_never_end() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(8);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..16).map(test_key).collect();
    for k in &keys[..8] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    let _stuck: Vec<_> = keys[..5]
        .iter()
        .map(|k| s.hold_path(Op::Delete, &tier.object_path(k)))
        .collect();
    for k in &keys[8..] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
        wait_sweeps_done(&tier).await;
    }
    tier.sweep_now().await;
    let st = tier.stats();
    assert!(
        st.bytes <= 8 * BS as u64,
        "the count stays over the bound ({} of {} bytes; {} bytes present) while {} real \
         objects could go: {st:?}",
        st.bytes,
        8 * BS,
        present_bytes(&s.inner),
        st.objects.saturating_sub(5)
    );
}

/// A sweep's DELETEs run "at most half of `io_threads` (at least one) at once, so write-back
/// keeps the rest": with io_threads 3, at most one.
#[tokio::test(start_paused = true)]
async fn a_sweep_with_three_io_threads_runs_at_most_half_of_them() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let keys: Vec<_> = (0..12).map(test_key).collect();
    assert!(obj_store(&writer, &keys).await.is_success());
    let deletes = s.hold(Op::Delete);
    let mut cfg = bounded(4);
    cfg.io_threads = 3;
    let tier = tier_on(&s, cfg).await;
    let t = tier.clone();
    let sweeping = tokio::spawn(async move { t.sweep_now().await });
    wait_until_async("a DELETE is held", SETTLE_LIMIT, || deletes.arrived() >= 1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let n = deletes.arrived();
    s.release(Op::Delete);
    sweeping.await.unwrap();
    assert!(
        2 * n <= 3,
        "{n} DELETEs in flight at once with io_threads 3: more than half of them"
    );
}

/// An index full of in-doubt entries (six PUTs that timed out and never ran: Unended, over a
/// bound of four) still gets swept down to the low watermark.
#[tokio::test(start_paused = true)]
async fn an_index_of_unended_writes_is_swept_down() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(4);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let _puts = s.hold(Op::Put);
    let keys: Vec<_> = (0..6).map(test_key).collect();
    for k in &keys {
        let r = obj_store(&tier, &[*k]).await;
        assert!(
            matches!(&r.failed[..], [(_, e)] if is_timeout(e)),
            "{:?}",
            r.failed
        );
    }
    wait_sweeps_done(&tier).await;
    tier.sweep_now().await;
    let st = tier.stats();
    assert!(st.bytes <= 4 * BS as u64, "{st:?}");
    for k in &keys {
        assert_ne!(tier.holds(k), Some(true));
    }
}

/// `sweep_now` dropped while one victim's DELETE is held and the others have settled: no key
/// is left deleting (a store of the held victim goes on at once), nothing is under-counted,
/// and keys never reported removed are still found.
#[tokio::test(start_paused = true)]
async fn sweep_now_dropped_part_way_through_its_settled_victims_leaves_nothing_behind() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let keys: Vec<_> = (0..8).map(test_key).collect();
    for k in &keys {
        assert!(obj_store(&writer, &[*k]).await.is_success());
    }
    let tier = tier_on(&s, bounded_long(4)).await;
    let mut h = History::default();
    h.take(&tier);
    let held = s.hold_path(Op::Delete, &tier.object_path(&keys[1]));
    let _ = tokio::time::timeout(Duration::from_secs(5), tier.sweep_now()).await;
    assert_eq!(held.arrived(), 1);
    h.take(&tier);
    held.open();
    let k = keys[1];
    let r = tokio::time::timeout(Duration::from_secs(5), obj_store(&*tier, &[k])).await;
    let r = r.expect("a store of the dropped sweep's victim wedged");
    assert!(r.is_success(), "{:?}", r.failed);
    h.take(&tier);
    if let Some(e) = under_count(&tier, &s) {
        panic!("{e}");
    }
    for k in &keys {
        if h.last(k) != Some(true) {
            assert!(found(&tier, *k).await, "{k} lost");
        }
    }
}

/// A sweep on a backend that deletes nothing (every DELETE hangs) ends within two request
/// deadlines, whatever the number of victims: each batch within one deadline, and no reading
/// on past two batches that confirmed nothing. The victims stay counted.
#[tokio::test(start_paused = true)]
async fn a_sweep_on_a_backend_that_deletes_nothing_ends_within_two_deadlines() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let keys: Vec<BlockKey> = (0..40).map(test_key).collect();
    assert!(obj_store(&writer, &keys).await.is_success());
    let _hung = s.hold(Op::Delete);
    let mut cfg = bounded(4);
    cfg.io_threads = 1;
    cfg.request_timeout_s = 1.0;
    cfg.max_retries = 0;
    cfg.validate().unwrap();
    let deadline = cfg.request_deadline();
    let tier = tier_on(&s, cfg).await;
    wait_sweeps_done(&tier).await;
    let t0 = tokio::time::Instant::now();
    assert_eq!(tier.sweep_now().await, 0);
    let took = t0.elapsed();
    assert!(
        took <= deadline * 2,
        "a sweep of a backend that deletes nothing took {took:?} (request deadline {deadline:?})"
    );
    assert_eq!(tier.stats().objects, 40, "{:?}", tier.stats());
}
