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
    delete_behind_the_back(&s, &tier, &k).await;
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
    delete_behind_the_back(&s, &tier, &k).await;
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

/// How the tier learns that the object went while a store's confirming HEAD is answering.
enum Learns {
    /// A load of it finds it missing (a 404).
    ByALoad,
    /// Its existence cache is cleared (`clear_exists_cache`).
    ByAClear,
}

/// A store of a key another writer stored (its create-only PUT answers "already exists",
/// its HEAD runs and sees the object, the HEAD's answer takes 10 s); meanwhile the object is
/// deleted behind the tier's back, and the tier learns it as `learns` says, before the
/// HEAD's answer arrives. The store ends, succeeded; what it found is left to the caller.
async fn a_store_confirmed_by_a_stale_head(
    mut cfg: ObjTierConfig,
    learns: Learns,
) -> (
    Arc<ControlledStore>,
    Arc<kv_tier_obj::ObjTier>,
    kv_tier_core::BlockKey,
) {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
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
    s.inner.delete(&Path::from(path)).await.unwrap();
    match learns {
        Learns::ByALoad => {
            let (r, _) = load_keys(&*tier, &[k], BS).await;
            assert!(
                matches!(r.failed[..], [(_, Error::NotFound { .. })]),
                "{:?}",
                r.failed
            );
        }
        Learns::ByAClear => tier.clear_exists_cache(),
    }
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    s.release_all();
    (s, tier, k)
}

/// A store's confirmation older than a 404 the tier saw (see
/// [`a_store_confirmed_by_a_stale_head`]) does not skip the store: it writes the block, and
/// what the tier answers after is what is there.
#[tokio::test(start_paused = true)]
async fn a_store_confirmed_by_a_head_older_than_a_404_writes_the_block() {
    let heads_only_cfg = heads_only(ObjTierConfig::new("mem"));
    let (s, tier, k) = a_store_confirmed_by_a_stale_head(heads_only_cfg, Learns::ByALoad).await;
    assert!(
        s.exists(&tier.object_path(&k)).await,
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
    let (s, tier, k) = a_store_confirmed_by_a_stale_head(bounded(64), Learns::ByALoad).await;
    assert!(
        s.exists(&tier.object_path(&k)).await,
        "the store was skipped on a stale confirmation"
    );
    assert_eq!(tier.stats().blocks.stores_skipped, 0, "{:?}", tier.stats());
    assert_eq!(tier.holds(&k), Some(true));
    assert_eq!(tier.stats().objects, 1, "{:?}", tier.stats());
}

/// `clear_exists_cache`'s doc: "A HEAD, GET or LIST under way keeps what it found to
/// itself". A store's confirming HEAD under way when the cache is cleared confirms
/// nothing: the store writes the block.
#[tokio::test(start_paused = true)]
async fn a_store_confirmation_under_way_across_a_clear_writes_the_block() {
    let heads_only_cfg = heads_only(ObjTierConfig::new("mem"));
    let (s, tier, k) = a_store_confirmed_by_a_stale_head(heads_only_cfg, Learns::ByAClear).await;
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
    delete_behind_the_back(&s, &tier, &k).await;
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
    delete_behind_the_back(&s, &tier, &k).await;
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
    delete_behind_the_back(&s, &tier, &k).await;
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
    delete_behind_the_back(&s, &tier, &k).await;
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

/// A load finds a damaged object; before its check of the object (HEAD) the object goes
/// behind the tier's back, and the HEAD sees 404. A request of the tier found the key
/// missing: it must leave the index (`holds` not "held").
#[tokio::test(start_paused = true)]
async fn a_damaged_loads_head_that_finds_the_key_gone_takes_it_out_of_the_index() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 600.0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let heads = s.hold_path(Op::Head, &path);
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[k], BS).await });
    heads.wait_arrived(1).await;
    s.inner.delete(&Path::from(path.clone())).await.unwrap();
    heads.open();
    let (r, _) = loading.await.unwrap();
    assert!(
        matches!(r.failed[..], [(_, Error::Corrupt { .. })]),
        "{:?}",
        r.failed
    );
    s.release_all();
    assert!(!s.exists(&path).await);
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "held after the tier's own HEAD found it missing: {:?}",
        tier.stats()
    );
}

/// A load finds a damaged object and deletes it; the DELETE runs but its reply is lost past
/// the deadline. The key was reported removed and is gone: `holds` must not answer "held".
#[tokio::test(start_paused = true)]
async fn a_damaged_object_deleted_with_a_lost_reply_is_not_answered_held() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let mut h = History::default();
    h.take(&tier);
    s.delay_replies(Op::Delete, Duration::from_secs(3600));
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::Corrupt { .. })]),
        "{:?}",
        r.failed
    );
    h.take(&tier);
    assert_eq!(h.last(&k), Some(true), "reported removed");
    assert!(!s.exists(&path).await, "the DELETE ran");
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "a key reported removed and gone is answered held: {:?}",
        tier.stats()
    );
}

/// A bounded tier (index seeded at open, so its existence cache is empty) stores a key whose
/// object went behind its back; while the PUT is in flight a lookup's HEAD sees the 404;
/// then the PUT fails. The tier saw the key missing and its store wrote nothing: `holds`
/// must not answer "held".
#[tokio::test(start_paused = true)]
async fn a_failed_store_across_a_lookups_404_does_not_leave_the_key_held() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let tier = tier_on(&s, bounded_long(64)).await;
    assert_eq!(tier.holds(&k), Some(true), "listed at open");
    let path = tier.object_path(&k);
    s.inner.delete(&Path::from(path.clone())).await.unwrap();
    let puts = s.hold(Op::Put);
    s.fail_puts(PutFault::Refused, "", usize::MAX);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    puts.wait_arrived(1).await;
    assert_eq!(
        tier.lookup(&[k]).await.unwrap(),
        vec![false],
        "the lookup's HEAD saw 404"
    );
    s.release(Op::Put);
    let r = storing.await.unwrap();
    assert!(!r.is_success(), "the PUT was refused");
    s.stop_failing_puts();
    assert!(!s.exists(&path).await);
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "held though a lookup saw it missing and its store wrote nothing: {:?}",
        tier.stats()
    );
}

/// Two writes of one key end in doubt (each contradicted by a 404 that was on its way), and a
/// lookup sent while the key was indexed in doubt, answering 404 after the second write
/// landed, takes the key out of the index: the in-doubt 0 of the first matches that of the
/// second. The object is there (the store reported it), uncounted, and `holds` answers it
/// absent.
#[tokio::test(start_paused = true)]
async fn a_stale_404_does_not_uncount_a_later_write_in_doubt() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_long(64)).await;
    let k = test_key(1);
    let path = tier.object_path(&k);
    s.delay_replies(Op::Head, Duration::from_secs(10));
    let spawn_lookup = |t: &Arc<kv_tier_obj::ObjTier>| {
        let t = t.clone();
        tokio::spawn(async move { t.lookup(&[k]).await.unwrap() })
    };
    let head_ran = |n: usize| {
        let s = s.clone();
        async move {
            wait_until_async("the HEAD ran", SETTLE_LIMIT, || s.count(Op::Head) >= n).await;
        }
    };
    // 1. a first write in doubt: a lookup's 404 (sent before it) answers while its PUT runs
    let l0 = spawn_lookup(&tier);
    head_ran(1).await;
    let puts = s.hold(Op::Put);
    let t = tier.clone();
    let s1 = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    puts.wait_arrived(1).await;
    tokio::time::sleep(Duration::from_secs(11)).await; // l0's 404 arrives
    s.release(Op::Put);
    assert!(s1.await.unwrap().is_success());
    assert_eq!(l0.await.unwrap(), vec![false]);
    assert!(s.exists(&path).await);
    assert_eq!(tier.holds(&k), None, "in doubt");
    // 2. the object goes behind the tier's back (a lifecycle rule); two lookups' HEADs see
    // the 404, their answers on the way
    s.inner.delete(&Path::from(path.clone())).await.unwrap();
    let l1 = spawn_lookup(&tier);
    head_ran(2).await;
    tokio::time::sleep(Duration::from_secs(5)).await;
    let l2 = spawn_lookup(&tier);
    head_ran(3).await;
    // 3. the block is stored again; l1's 404 answers while its PUT runs (in doubt again)
    let puts = s.hold(Op::Put);
    let t = tier.clone();
    let s2 = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    puts.wait_arrived(1).await;
    tokio::time::sleep(Duration::from_secs(6)).await; // l1's 404 arrives
    s.release(Op::Put);
    let r = s2.await.unwrap();
    assert!(r.is_success(), "{:?}", r.failed);
    assert_eq!(l1.await.unwrap(), vec![false]);
    // 4. l2's 404 (sent before the second write) arrives after it
    assert_eq!(l2.await.unwrap(), vec![false]);
    s.release_all();
    assert!(s.exists(&path).await, "the second store wrote the block");
    let st = tier.stats();
    let present = present_bytes(&s.inner);
    assert!(
        st.bytes >= present,
        "under-count: stats().bytes {} < {present} bytes present, holds {:?} ({st:?})",
        st.bytes,
        tier.holds(&k)
    );
    assert_ne!(
        tier.holds(&k),
        Some(false),
        "a block the tier stored (and is there) is answered absent"
    );
}

/// A load finds a block damaged (bit rot) and its DELETE times out without running: the tier
/// reported the key removed and knows the object there is damaged. A store of the key then
/// reports it stored: the block there must be a readable one ("a reported store is a
/// readable block").
#[tokio::test(start_paused = true)]
async fn a_store_after_a_damaged_objects_delete_timed_out_leaves_a_readable_block() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let _d = s.hold(Op::Delete);
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::Corrupt { .. })]),
        "{:?}",
        r.failed
    );
    s.release(Op::Delete);
    assert!(s.exists(&path).await, "the DELETE never ran");
    let r = obj_store(&tier, &[k]).await;
    assert!(r.is_success(), "{:?}", r.failed);
    let (r, data) = load_keys(&*tier, &[k], BS).await;
    assert!(
        r.is_success() && kv_tier_testkit::verify_block(&k, 0, &data[0].1),
        "a store reported after the tier saw the object damaged left it damaged: {:?} {:?}",
        r.failed,
        tier.stats().blocks
    );
}

/// A sweep's batch: the DELETEs of victims `a` and `b` are held. A load of `a` reads it
/// meanwhile (its GET was sent after the batch began: its "present" is allowed). Then `a`'s
/// DELETE runs and settles (gone), while `b`'s still waits: `a` is gone and was reported
/// removed; `holds` and `lookup` must not answer it present.
#[tokio::test(start_paused = true)]
async fn a_victim_settled_gone_while_its_batch_runs_on_is_not_answered_present() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_long(4)).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(obj_store(&tier, &[a]).await.is_success());
    assert!(obj_store(&tier, &[b]).await.is_success());
    let pa = tier.object_path(&a);
    let ga = s.hold_path(Op::Delete, &pa);
    let gb = s.hold_path(Op::Delete, &tier.object_path(&b));
    let mut h = History::default();
    h.take(&tier);
    let more: Vec<_> = (10..14).map(test_key).collect();
    assert!(obj_store(&tier, &more).await.is_success()); // over: a sweep
    ga.wait_arrived(1).await;
    gb.wait_arrived(1).await;
    h.take(&tier);
    assert_eq!(h.last(&a), Some(true), "a is a victim");
    let (r, data) = load_keys(&*tier, &[a], BS).await;
    assert!(
        r.is_success() && verify_block(&a, 0, &data[0].1),
        "{:?}",
        r.failed
    );
    ga.open();
    wait_until_async("a's DELETE ran", SETTLE_LIMIT, || {
        futures::FutureExt::now_or_never(s.exists(&pa)) == Some(false)
    })
    .await;
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !gb.is_open() && tier.sweeps_running() == 1,
        "b's DELETE still waits"
    );
    let held = tier.holds(&a);
    let looked = tier.lookup(&[a]).await.unwrap();
    gb.open();
    wait_sweeps_done(&tier).await;
    assert!(
        held != Some(true) && looked == vec![false],
        "a victim deleted and reported removed is answered present: holds {held:?}, lookup {looked:?}"
    );
}

/// A load finds a damaged object (bit rot, metadata whole); its check of the object (HEAD)
/// before the DELETE times out, so the object "is left for the next load". A store of the key
/// then reports it stored: the block there must be a readable one ("a reported store is a
/// readable block"), as it is when the DELETE itself fails.
#[tokio::test(start_paused = true)]
async fn a_store_after_a_damaged_loads_head_timed_out_leaves_a_readable_block() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let heads = s.hold_path(Op::Head, &path);
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, kv_tier_core::Error::Corrupt { .. })]),
        "{:?}",
        r.failed
    );
    assert_eq!(heads.arrived(), 1, "the load's HEAD timed out");
    s.release(Op::Head);
    assert!(s.exists(&path).await, "the damaged object is still there");
    let r = obj_store(&tier, &[k]).await;
    assert!(r.is_success(), "{:?}", r.failed);
    let (r, data) = load_keys(&*tier, &[k], BS).await;
    assert!(
        r.is_success() && verify_block(&k, 0, &data[0].1),
        "a store reported after a load found the object damaged left it damaged: {:?} {:?}",
        r.failed,
        tier.stats().blocks
    );
}
