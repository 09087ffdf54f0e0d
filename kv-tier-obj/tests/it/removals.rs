//! A removal is never hidden: what the tier answers after its own deletes and the 404s it
//! sees, whatever a request sent before them answers later (a HEAD, a GET, a LIST, a store's
//! confirmation or PUT), in the existence cache and in a bounded tier's index; and a store is
//! never skipped on such a stale answer.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{Error, SecondaryTier};
use kv_tier_obj::ObjTierConfig;
use kv_tier_testkit::controlled_store::{ControlledStore, Op, PutFault};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, test_key, verify_block};
use object_store::ObjectStoreExt as _;
use object_store::path::Path;

use crate::support::*;

/// A load that began while a sweep was deleting its key, and whose GET read the object
/// before the DELETE landed, serves the bytes it read; the removed key is not answered
/// present after it (the load's "present" is older than the removal).
#[tokio::test(start_paused = true)]
async fn a_load_overlapping_a_sweeps_delete_does_not_answer_the_removed_key_present() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(4)).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    let delete = s.hold_path(Op::Delete, &path);
    // past the bound: the sweep deletes the oldest, `k` first
    let more: Vec<_> = (10..14).map(test_key).collect();
    assert!(obj_store(&tier, &more).await.is_success());
    delete.wait_arrived(1).await;
    s.delay_replies(Op::Get, Duration::from_secs(10));
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[k], BS).await });
    wait_until_async("the GET ran", SETTLE_LIMIT, || s.count(Op::Get) == 1).await;
    s.release(Op::Delete);
    wait_sweeps_done(&tier).await;
    assert!(!s.exists(&path).await, "the sweep kept the key");
    let (r, data) = loading.await.unwrap();
    assert!(r.is_success(), "{:?}", r.failed);
    assert!(verify_block(&k, 0, &data[0].1));
    assert_eq!(
        tier.holds(&k),
        Some(false),
        "a key the sweep removed is held again after a load that overlapped its delete"
    );
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![false]);
}

/// A lookup's HEAD that saw the object, answered after a load found it gone, does not bring
/// "present" back: the next lookup asks again, and answers absent.
#[tokio::test(start_paused = true)]
async fn a_head_answered_after_a_load_found_the_key_gone_does_not_bring_back_present() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let mut cfg = heads_only(ObjTierConfig::new("mem"));
    cfg.lookup_timeout_s = 30.0;
    let tier = tier_on(&s, cfg).await;
    let heads = s.count(Op::Head);
    s.delay_replies(Op::Head, Duration::from_secs(10));
    let t = tier.clone();
    let looking = tokio::spawn(async move { t.lookup(&[k]).await });
    wait_until_async("the HEAD ran", SETTLE_LIMIT, || {
        s.count(Op::Head) == heads + 1
    })
    .await;
    s.inner
        .delete(&Path::from(tier.object_path(&k)))
        .await
        .unwrap();
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::NotFound { .. })]),
        "{:?}",
        r.failed
    );
    assert_eq!(
        looking.await.unwrap().unwrap(),
        vec![true],
        "the HEAD saw it"
    );
    assert_eq!(
        tier.holds(&k),
        None,
        "a HEAD sent before the load found the key gone cached it present"
    );
    s.release_all();
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![false]);
}

/// The same for the existence listing: a LIST that saw the object, answered after a load
/// found it gone, lists the key (it is not answered absent) but does not cache it present.
#[tokio::test(start_paused = true)]
async fn a_list_answered_after_a_load_found_the_key_gone_does_not_bring_back_present() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    wait_until_async("the first listing", SETTLE_LIMIT, || {
        tier.stats().listings >= 1
    })
    .await;
    // the next relist sees the object, and answers once the load found it gone
    let lists = s.hold_lists();
    lists.wait_arrived(1).await;
    s.inner
        .delete(&Path::from(tier.object_path(&k)))
        .await
        .unwrap();
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::NotFound { .. })]),
        "{:?}",
        r.failed
    );
    s.release_lists();
    wait_until_async("the second listing", SETTLE_LIMIT, || {
        tier.stats().listings >= 2
    })
    .await;
    assert_eq!(
        tier.holds(&k),
        None,
        "a LIST sent before the load found the key gone cached it present"
    );
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![false]);
}

/// A store's HEAD sees the object; the object is then deleted behind the tier's back and a
/// load of the tier sees the 404 *before* the HEAD's answer arrives. The store's
/// confirmation is older than the 404: the store is not skipped on it, it writes the block
/// (and what the tier answers after is what is there).
#[tokio::test(start_paused = true)]
async fn a_store_confirmed_by_a_head_older_than_a_404_writes_the_block() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let mut cfg = heads_only(ObjTierConfig::new("mem"));
    cfg.request_timeout_s = 60.0;
    cfg.max_retries = 0;
    cfg.lookup_timeout_s = 60.0;
    let tier = tier_on(&s, cfg).await;
    let path = tier.object_path(&k);
    // the store's create-only PUT answers "already exists"; its HEAD runs (sees the object)
    // and its answer takes 10 s to arrive
    s.delay_replies(Op::Head, Duration::from_secs(10));
    let heads = s.count(Op::Head);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    wait_until_async("the store's HEAD ran", SETTLE_LIMIT, || {
        s.count(Op::Head) == heads + 1
    })
    .await;
    // removed behind the tier's back; a load of this tier sees it gone
    s.inner.delete(&Path::from(path.clone())).await.unwrap();
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::NotFound { .. })]),
        "{:?}",
        r.failed
    );
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    s.release_all();
    assert!(
        s.exists(&path).await,
        "the store was skipped on a stale confirmation"
    );
    assert_eq!(tier.stats().blocks.stores_skipped, 0, "{:?}", tier.stats());
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(r.is_success(), "{:?}", r.failed);
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![true]);
}

/// The same for a bounded tier (whose index would answer "held" from the confirmation).
#[tokio::test(start_paused = true)]
async fn a_bounded_store_confirmed_by_a_head_older_than_a_404_writes_the_block() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let mut cfg = bounded(64);
    cfg.request_timeout_s = 60.0;
    cfg.max_retries = 0;
    cfg.lookup_timeout_s = 60.0;
    let tier = tier_on(&s, cfg).await;
    let path = tier.object_path(&k);
    s.delay_replies(Op::Head, Duration::from_secs(10));
    let heads = s.count(Op::Head);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    wait_until_async("the store's HEAD ran", SETTLE_LIMIT, || {
        s.count(Op::Head) == heads + 1
    })
    .await;
    s.inner.delete(&Path::from(path.clone())).await.unwrap();
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::NotFound { .. })]),
        "{:?}",
        r.failed
    );
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    s.release_all();
    assert!(
        s.exists(&path).await,
        "the store was skipped on a stale confirmation"
    );
    assert_eq!(tier.stats().blocks.stores_skipped, 0, "{:?}", tier.stats());
    assert_eq!(tier.holds(&k), Some(true));
    assert_eq!(tier.stats().objects, 1, "{:?}", tier.stats());
}

/// `clear_exists_cache`'s doc: "A HEAD, GET or LIST under way keeps what it found to
/// itself". A store's confirming HEAD under way when the cache is cleared (the object gone
/// behind the tier's back meanwhile) confirms nothing: the store writes the block.
#[tokio::test(start_paused = true)]
async fn a_store_confirmation_under_way_across_a_clear_writes_the_block() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let mut cfg = heads_only(ObjTierConfig::new("mem"));
    cfg.request_timeout_s = 60.0;
    cfg.max_retries = 0;
    let tier = tier_on(&s, cfg).await;
    s.delay_replies(Op::Head, Duration::from_secs(10));
    let heads = s.count(Op::Head);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    wait_until_async("the store's HEAD ran", SETTLE_LIMIT, || {
        s.count(Op::Head) == heads + 1
    })
    .await;
    // the object goes behind the tier's back while the HEAD's answer is on its way
    s.inner
        .delete(&Path::from(tier.object_path(&k)))
        .await
        .unwrap();
    tier.clear_exists_cache();
    assert!(storing.await.unwrap().is_success());
    s.release_all();
    assert!(
        s.exists(&tier.object_path(&k)).await,
        "a HEAD under way across clear_exists_cache skipped the store"
    );
    assert_eq!(tier.stats().blocks.stores_skipped, 0, "{:?}", tier.stats());
}

/// A PUT of this tier lands, its reply is slow; meanwhile the object is deleted behind the
/// tier's back and a load sees the 404. The PUT's late "stored" is older than the 404.
#[tokio::test(start_paused = true)]
async fn a_put_reply_answered_after_a_404_does_not_hide_the_removal() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = heads_only(ObjTierConfig::new("mem"));
    cfg.request_timeout_s = 60.0;
    cfg.max_retries = 0;
    cfg.lookup_timeout_s = 60.0;
    let tier = tier_on(&s, cfg).await;
    let k = test_key(1);
    let path = tier.object_path(&k);
    s.delay_replies(Op::Put, Duration::from_secs(10));
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    wait_until_async("the PUT landed", SETTLE_LIMIT, || s.count(Op::Put) == 1).await;
    tokio::task::yield_now().await;
    assert!(s.exists(&path).await);
    s.inner.delete(&Path::from(path.clone())).await.unwrap();
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::NotFound { .. })]),
        "{:?}",
        r.failed
    );
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    s.release_all();
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "a 404 the tier saw is hidden by a PUT's late reply"
    );
}

/// A bounded tier: a key found by its LIST at open, deleted behind its back; a lookup's
/// HEAD sees the 404 (and answers absent). `holds` must not go on answering "held".
#[tokio::test(start_paused = true)]
async fn a_bounded_tier_does_not_hold_a_key_its_lookup_saw_gone() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let tier = tier_on(&s, bounded(64)).await;
    assert_eq!(tier.holds(&k), Some(true), "listed at open");
    s.inner
        .delete(&Path::from(tier.object_path(&k)))
        .await
        .unwrap();
    assert_eq!(
        tier.lookup(&[k]).await.unwrap(),
        vec![false],
        "the HEAD saw 404"
    );
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "holds answers held for a key the tier's own lookup just found missing (404)"
    );
}

/// A bounded tier: a store of an indexed key whose object went behind the tier's back; the
/// store's HEAD sees the 404 and its PUT fails. The tier saw the key gone: `holds` must not
/// answer "held".
#[tokio::test(start_paused = true)]
async fn a_bounded_tier_does_not_hold_a_key_whose_store_saw_it_gone_and_failed() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    s.inner
        .delete(&Path::from(tier.object_path(&k)))
        .await
        .unwrap();
    s.fail_puts(PutFault::Refused, "", usize::MAX);
    let r = obj_store(&tier, &[k]).await;
    assert!(!r.is_success());
    s.stop_failing_puts();
    assert!(!s.exists(&tier.object_path(&k)).await);
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![false]);
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "held though the store's HEAD and the lookup both saw it missing"
    );
}

/// A bounded tier's sweep DELETEs run on the store, their replies lost past the deadline:
/// the victims are reported removed and gone. `holds` must not answer "held" for them
/// (lookup answers absent).
#[tokio::test(start_paused = true)]
async fn a_bounded_tier_does_not_hold_a_victim_it_reported_removed() {
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
    s.delay_replies(Op::Delete, Duration::from_secs(3600));
    assert!(obj_store(&tier, &keys[4..]).await.is_success());
    tier.sweep_now().await;
    wait_sweeps_done(&tier).await;
    let removed: Vec<_> = tier
        .take_events()
        .into_iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys)
        .collect();
    let mut gone = Vec::new();
    for k in &keys {
        if !s.exists(&tier.object_path(k)).await {
            gone.push(*k);
        }
    }
    assert!(!gone.is_empty());
    let mut wrong = Vec::new();
    for k in &gone {
        assert!(removed.contains(k));
        if tier.holds(k) == Some(true) {
            wrong.push(*k);
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} keys reported removed and gone from the store are answered held: {:?}",
        wrong.len(),
        gone.len(),
        tier.stats()
    );
}

/// A bounded tier: its load finds an indexed key gone (404), and a `touch` of the key (the
/// manager's, on a hit elsewhere) landed while the GET was in flight. The load saw the
/// removal; the index must not keep answering "held".
#[tokio::test(start_paused = true)]
async fn a_load_that_finds_a_touched_key_gone_takes_it_out_of_the_index() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 60.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    s.inner
        .delete(&Path::from(tier.object_path(&k)))
        .await
        .unwrap();
    s.delay_replies(Op::Get, Duration::from_secs(5));
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[k], BS).await });
    wait_until_async("the GET ran", SETTLE_LIMIT, || s.count(Op::Get) == 1).await;
    tier.touch(&[k]);
    let (r, _) = loading.await.unwrap();
    assert!(
        matches!(r.failed[..], [(_, Error::NotFound { .. })]),
        "{:?}",
        r.failed
    );
    s.release_all();
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "held after the tier's own load found it missing: {:?}",
        tier.stats()
    );
}

/// Without the touch the same load takes the key out of the index (the control).
#[tokio::test(start_paused = true)]
async fn a_load_that_finds_an_indexed_key_gone_takes_it_out_of_the_index() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 60.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    s.inner
        .delete(&Path::from(tier.object_path(&k)))
        .await
        .unwrap();
    s.delay_replies(Op::Get, Duration::from_secs(5));
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(matches!(r.failed[..], [(_, Error::NotFound { .. })]));
    s.release_all();
    assert_eq!(tier.holds(&k), Some(false));
}

/// More than 65,536 keys seen gone (lookups of absent keys, each a 404), with a HEAD sent
/// before them answered after: its "present" is refused; and a removal seen before the
/// overflow still refuses a HEAD of its key sent before it.
#[tokio::test(start_paused = true)]
async fn many_keys_seen_gone_never_let_an_older_present_in() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let mut cfg = heads_only(ObjTierConfig::new("mem"));
    cfg.io_threads = 1024;
    cfg.lookup_timeout_s = 3600.0;
    cfg.request_timeout_s = 600.0;
    let tier = tier_on(&s, cfg).await;
    let path = tier.object_path(&k);
    // scenario proper
    s.delay_replies(Op::Head, Duration::from_secs(100));
    tier.clear_exists_cache();
    let heads = s.count(Op::Head);
    let t = tier.clone();
    let looking = tokio::spawn(async move { t.lookup(&[k]).await });
    wait_until_async("the HEAD ran", SETTLE_LIMIT, || s.count(Op::Head) > heads).await;
    s.inner.delete(&Path::from(path.clone())).await.unwrap();
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(matches!(r.failed[..], [(_, Error::NotFound { .. })]));
    // then 70,000 other keys seen gone: loads of absent keys (GETs, 404)
    let absent: Vec<_> = (0..70_000u64).map(|i| test_key(10_000_000 + i)).collect();
    for chunk in absent.chunks(4096) {
        let (r, _) = load_keys(&*tier, chunk, BS).await;
        assert_eq!(r.failed.len(), chunk.len());
    }
    assert_eq!(
        looking.await.unwrap().unwrap(),
        vec![true],
        "the HEAD saw it"
    );
    s.release_all();
    assert_ne!(tier.holds(&k), Some(true));
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![false]);
}
