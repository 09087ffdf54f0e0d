//! What `lookup` answers: HEADs, the positive-answer cache (hits, and what invalidates it:
//! failed loads, deletes, objects changed behind the tier's back), and lookups bounded by
//! `lookup_timeout_s` when HEADs hang.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{Error, SecondaryTier};
use kv_tier_obj::ObjTierConfig;
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, test_key, verify_block};
use object_store::ObjectStoreExt as _;
use object_store::path::Path;

use crate::support::*;

/// An object another instance wrote is found by one HEAD; the answer is cached, so a second
/// lookup within `exists_ttl_s` sends no request.
#[tokio::test]
async fn an_existence_answer_from_a_head_is_cached() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, ObjTierConfig::new("mem")).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    // (no existence listing: every key the cache does not hold is asked for)
    let reader = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let heads = s.count(Op::Head);
    assert_eq!(reader.lookup(&[k]).await.unwrap(), vec![true]);
    assert_eq!(s.count(Op::Head), heads + 1);
    assert_eq!(reader.lookup(&[k]).await.unwrap(), vec![true]);
    assert_eq!(
        s.count(Op::Head),
        heads + 1,
        "the second lookup asked again"
    );
    assert_eq!(reader.stats().exists_cache_hits, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_are_bounded_by_io_threads_and_answer_from_the_cache_after_stores() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.io_threads = 4;
    // (no existence listing: every key the cache does not hold is asked for)
    let tier = server.tier(heads_only(cfg)).await;
    let keys: Vec<_> = (0..2000).map(test_key).collect();
    let found = tier.lookup(&keys).await.unwrap();
    assert!(found.iter().all(|b| !b));
    assert!(tier.stats().max_in_flight <= 4, "{:?}", tier.stats());
    let res = obj_store(&tier, &keys).await;
    assert!(res.is_success());
    assert!(tier.stats().max_in_flight <= 4);
    let before = server.requests.load(std::sync::atomic::Ordering::SeqCst);
    let found = tier.lookup(&keys).await.unwrap();
    assert!(found.iter().all(|&b| b));
    assert_eq!(
        server.requests.load(std::sync::atomic::Ordering::SeqCst),
        before,
        "a lookup of blocks this tier stored went to the server"
    );
    // a failed load (404) invalidates the cached answer
    let sdk = server.sdk();
    sdk.delete_object()
        .bucket(BUCKET)
        .key(tier.object_path(&keys[0]))
        .send()
        .await
        .unwrap();
    let (res, _) = load_keys(&tier, &keys[..1], BS).await;
    assert!(matches!(res.failed[0].1, Error::NotFound { .. }));
    assert_eq!(tier.lookup(&keys[..1]).await.unwrap(), vec![false]);
}

#[tokio::test(start_paused = true)]
async fn lookups_after_objects_change_behind_the_tiers_back() {
    let s = Arc::new(ControlledStore::new());
    // (no existence listing: every key the cache does not hold is asked for)
    let tier = tier_on(&s, heads_only(checked_half_second())).await;
    let other = tier_on(&s, checked_half_second()).await;
    let (gone, replaced, fresh) = (test_key(1), test_key(2), test_key(3));
    assert!(obj_store(&*tier, &[gone, replaced]).await.is_success());
    assert_eq!(
        tier.lookup(&[gone, replaced, fresh]).await.unwrap(),
        vec![true, true, false]
    );
    delete_behind_the_back(&s, &tier, &gone).await;
    put_raw(&s.inner, &tier.object_path(&replaced), vec![3u8; BS], None).await;
    assert!(obj_store(&*other, &[fresh]).await.is_success());
    // fresh: written by another writer, never answered absent from a cache
    assert_eq!(tier.lookup(&[fresh]).await.unwrap(), vec![true]);
    // gone and replaced may be answered present from the cache; a load is a miss, and
    // from then on the lookup answers absent
    let (r, data) = load_keys(&*tier, &[gone, replaced], BS).await;
    assert!(data.is_empty(), "{r:?}");
    assert_eq!(
        tier.lookup(&[gone, replaced]).await.unwrap(),
        vec![false, false],
        "lookup still answers present after loads found the objects missing/damaged"
    );
    // a store rewrites both
    assert!(obj_store(&*tier, &[gone, replaced]).await.is_success());
    let (r, data) = load_keys(&*tier, &[gone, replaced, fresh], BS).await;
    assert!(r.is_success(), "{:?}", r.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// A lookup while a damaged load's DELETE is in flight caches "present"; once the DELETE
/// lands the key (reported removed, not stored since) is still answered present. (The sweep
/// guards against this with a second epoch bump after its delete; the damaged-load delete
/// bumps only before.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookup_after_a_damaged_loads_delete_answers_absent() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let mut h = History::default();
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let deletes = s.hold_path(Op::Delete, &path);
    let t2 = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t2, &[k], BS).await.0 });
    deletes.wait_arrived(1).await;
    let during = tier.lookup(&[k]).await.unwrap()[0]; // HEAD: still there
    s.release(Op::Delete);
    loading.await.unwrap();
    h.take(&tier);
    assert_eq!(h.last(&k), Some(true));
    assert!(!s.exists(&path).await);
    let after = tier.lookup(&[k]).await.unwrap()[0];
    assert!(
        !after,
        "removed, gone, and still answered present (during the delete: {during})"
    );
}

/// A lookup whose HEADs hang for one key answers the others within `lookup_timeout_s`.
#[tokio::test(start_paused = true)]
async fn a_lookup_with_one_hanging_head_answers_the_others() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = checked_half_second();
    cfg.lookup_timeout_s = 0.3;
    let tier = tier_on(&s, cfg).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(obj_store(&*tier, &[a, b]).await.is_success());
    tier.clear_exists_cache();
    let _g = s.hold_path(Op::Head, &tier.object_path(&b));
    let t0 = tokio::time::Instant::now();
    let r = tier.lookup(&[a, b]).await;
    assert!(
        t0.elapsed() <= Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(
        r.expect("lookup failed though one key answered"),
        vec![true, false]
    );
    s.release(Op::Head);
}

#[tokio::test(start_paused = true)]
async fn a_lookup_answers_within_its_deadline_when_the_store_never_answers() {
    let s = Arc::new(ControlledStore::new());
    let mut c = one_second();
    c.lookup_timeout_s = 1.0;
    c.request_timeout_s = 600.0;
    // (no existence listing: every key the cache does not hold is asked for)
    let tier = tier_on(&s, heads_only(c)).await;
    s.hold(Op::Head);
    let keys: Vec<_> = (0..16).map(test_key).collect();
    let started = tokio::time::Instant::now();
    let found = tier.lookup(&keys).await.unwrap();
    assert_eq!(found, vec![false; 16]);
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert_eq!(tier.stats().lookup_timeouts, 1);
    // the cancelled HEADs released their permits: later requests run
    s.release(Op::Head);
    assert!(obj_store(&tier, &keys[..1]).await.is_success());
    assert_eq!(tier.lookup(&keys[..2]).await.unwrap(), vec![true, false]);
}

/// Lookups that pass their deadline again and again: each is counted (`lookup_timeouts`),
/// and the log says so once per interval with how many its line stands for, not a line per
/// lookup.
#[tokio::test(start_paused = true)]
async fn lookups_past_their_deadline_are_counted_each_and_logged_once_per_interval() {
    let (warnings, _log) = kv_tier_testkit::fixtures::logs::Warnings::capture();
    let s = Arc::new(ControlledStore::new());
    let mut c = one_second();
    c.lookup_timeout_s = 1.0;
    c.request_timeout_s = 600.0;
    // (no existence listing: every key the cache does not hold is asked for)
    let tier = tier_on(&s, heads_only(c)).await;
    s.hold(Op::Head);
    let keys: Vec<_> = (0..4).map(test_key).collect();
    for _ in 0..5 {
        assert_eq!(tier.lookup(&keys).await.unwrap(), vec![false; 4]);
    }
    assert_eq!(tier.stats().lookup_timeouts, 5);
    let lines = warnings.lines();
    let deadline: Vec<_> = lines.iter().filter(|l| l.contains("deadline")).collect();
    assert_eq!(deadline.len(), 1, "{lines:?}");
    assert!(deadline[0].contains("lookups=1 "), "{lines:?}");
    s.release(Op::Head);
}

/// `holds` of a bounded tier (not shared) answers from its capacity index, with no
/// request: what it stored is held, what it never stored is not; a key whose store is in
/// flight, or that a sweep is deleting, is unknown (a HEAD tells); a key a sweep deleted is
/// not held; after a reopen, what its LIST found is held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_tier_holds_what_its_index_holds() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(4)).await;
    let (a, never) = (test_key(1), test_key(2));
    assert!(obj_store(&tier, &[a]).await.is_success());
    let requests = s.started();
    assert_eq!(tier.holds(&a), Some(true));
    assert_eq!(tier.holds(&never), Some(false));
    assert_eq!(s.started(), requests, "holds sent a request");
    // a store in flight: not yet known either way
    let pending = test_key(3);
    let put = s.hold(Op::Put);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[pending]).await });
    wait_until_async("the PUT is held", SETTLE_LIMIT, || put.arrived() == 1).await;
    assert_eq!(tier.holds(&pending), None);
    s.release(Op::Put);
    assert!(storing.await.unwrap().is_success());
    assert_eq!(tier.holds(&pending), Some(true));
    // past the bound: the store's sweep deletes the oldest (`a` first), unknown while its
    // DELETE is held, not held once it is gone
    let more: Vec<_> = (10..14).map(test_key).collect();
    let delete = s.hold(Op::Delete);
    assert!(obj_store(&tier, &more).await.is_success());
    wait_until_async("the DELETE is held", SETTLE_LIMIT, || delete.arrived() >= 1).await;
    assert_eq!(tier.holds(&a), None, "a key being deleted");
    s.release(Op::Delete);
    wait_sweeps_done(&tier).await;
    assert!(!s.exists(&tier.object_path(&a)).await);
    assert_eq!(tier.holds(&a), Some(false));
    // reopened: its LIST is the index
    let kept: Vec<_> = more
        .iter()
        .copied()
        .filter(|k| tier.holds(k) == Some(true))
        .collect();
    assert!(!kept.is_empty());
    tier.shutdown().await.unwrap();
    let again = tier_on(&s, bounded(4)).await;
    for k in &kept {
        assert_eq!(again.holds(k), Some(true), "{k}");
    }
    assert_eq!(again.holds(&a), Some(false));
}

/// `holds` of an unbounded tier without the existence listing (`absent_ttl_s` 0) knows only
/// what its existence cache holds: a key it stored is held; one it never saw, or whose
/// object a load found gone, is unknown (a HEAD tells: the tier may share its prefix with
/// other writers).
#[tokio::test]
async fn an_unbounded_tier_without_a_listing_holds_what_it_stored_and_asks_for_the_rest() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let (a, b) = (test_key(1), test_key(2));
    assert_eq!(tier.holds(&a), None);
    assert!(obj_store(&tier, &[a]).await.is_success());
    assert_eq!(tier.holds(&a), Some(true));
    assert_eq!(tier.holds(&b), None);
    // deleted behind the tier's back: the failed load forgets it
    delete_behind_the_back(&s, &tier, &a).await;
    let (r, _) = load_keys(&*tier, &[a], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::NotFound { .. })]),
        "{:?}",
        r.failed
    );
    assert_eq!(tier.holds(&a), None);
}

/// An unbounded tier's existence listing: what its LIST found is held, anything else absent,
/// both without a request (`holds` and `lookup` alike), as long as the LIST began at most
/// `absent_ttl_s` ago.
#[tokio::test]
async fn an_unbounded_tier_answers_from_its_listing_without_a_request() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(obj_store(&writer, &[a]).await.is_success());
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    wait_until_async("the first listing", SETTLE_LIMIT, || {
        tier.stats().listings >= 1
    })
    .await;
    let heads = s.count(Op::Head);
    assert_eq!(tier.holds(&a), Some(true));
    assert_eq!(tier.holds(&b), Some(false));
    assert_eq!(tier.lookup(&[a, b]).await.unwrap(), vec![true, false]);
    assert_eq!(
        s.count(Op::Head),
        heads,
        "a listed or unlisted key was asked for"
    );
    assert_eq!(tier.stats().listed_absent, 2);
    // what it stores after its LIST began is held from its existence cache
    assert!(obj_store(&tier, &[b]).await.is_success());
    assert_eq!(tier.holds(&b), Some(true));
    assert_eq!(tier.lookup(&[b]).await.unwrap(), vec![true]);
}

/// Another writer's new object is answered absent from the listing only until the next LIST
/// (every half `absent_ttl_s`), so it is found within `absent_ttl_s`; a listing whose relists
/// fail stops answering once its LIST began `absent_ttl_s` ago (its keys are asked for).
#[tokio::test(start_paused = true)]
async fn another_writers_object_is_found_within_absent_ttl_s() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.absent_ttl_s = 2.0;
    let tier = tier_on(&s, cfg).await;
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    wait_until_async("the first listing", SETTLE_LIMIT, || {
        tier.stats().listings >= 1
    })
    .await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let stored = tokio::time::Instant::now();
    assert_eq!(
        tier.holds(&k),
        Some(false),
        "a fresh listing answers what it found"
    );
    wait_until_async("the new object held", SETTLE_LIMIT, || {
        tier.holds(&k) == Some(true)
    })
    .await;
    assert!(
        stored.elapsed() <= Duration::from_secs(2),
        "{:?}",
        stored.elapsed()
    );
    // relists fail from now on: the last listing answers until it is absent_ttl_s old
    s.fail_lists(Some(tier.object_path(&k).split('/').next().unwrap()));
    let listed = tier.stats().listings;
    let other = test_key(2);
    assert_eq!(tier.holds(&other), Some(false));
    wait_until_async("the listing aged out", SETTLE_LIMIT, || {
        tier.holds(&other).is_none()
    })
    .await;
    assert_eq!(
        tier.stats().listings,
        listed,
        "a failed LIST replaced the listing"
    );
    assert_eq!(tier.lookup(&[other]).await.unwrap(), vec![false]);
}

/// A key the tier finds removed is not held from its listing: the failed load forgets the
/// existence cache's answer, and the listing answers only "absent" (the key is asked for).
#[tokio::test]
async fn a_removed_listed_key_is_asked_for() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    assert!(obj_store(&writer, &[k]).await.is_success());
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    wait_until_async("the first listing", SETTLE_LIMIT, || {
        tier.stats().listings >= 1
    })
    .await;
    assert_eq!(tier.holds(&k), Some(true));
    delete_behind_the_back(&s, &tier, &k).await;
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, Error::NotFound { .. })]),
        "{:?}",
        r.failed
    );
    assert_eq!(tier.holds(&k), None);
    let heads = s.count(Op::Head);
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![false]);
    assert_eq!(s.count(Op::Head), heads + 1);
}

/// The listing answers for at most `exists_ttl_s`: a key the tier stored after a LIST began is
/// never answered "absent" from that LIST once its cached answer expired.
#[tokio::test]
async fn a_stored_key_is_not_listed_absent_after_its_cached_answer_expires() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.exists_ttl_s = 0.2;
    cfg.absent_ttl_s = 60.0;
    let tier = tier_on(&s, cfg).await;
    wait_until_async("the first listing", SETTLE_LIMIT, || {
        tier.stats().listings >= 1
    })
    .await;
    let k = test_key(1);
    s.fail_lists(Some(tier.object_path(&k).split('/').next().unwrap()));
    assert!(obj_store(&tier, &[k]).await.is_success());
    assert_eq!(tier.holds(&k), Some(true));
    // the subject: the cached answer's TTL running out
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_ne!(tier.holds(&k), Some(false), "{:?}", tier.stats());
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![true]);
}

/// With `absent_ttl_s` 0 nothing is listed: every key the existence cache does not hold is
/// asked for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_with_absent_ttl_s_0_lists_nothing() {
    let server = S3Server::start().await;
    let tier = server.tier(heads_only(server.config())).await;
    let keys: Vec<_> = (0..64).map(test_key).collect();
    let before = server.requests.load(std::sync::atomic::Ordering::SeqCst);
    assert_eq!(tier.lookup(&keys).await.unwrap(), vec![false; 64]);
    assert_eq!(tier.holds(&keys[0]), None);
    assert_eq!(
        server.requests.load(std::sync::atomic::Ordering::SeqCst),
        before + 64,
        "{:?}",
        tier.stats()
    );
    assert_eq!(tier.stats().listings, 0);
}

/// A key the tier stores is never answered absent from its listing, also when the existence
/// cache cannot hold it: a rank that fills the cache (1,048,576 objects, the most a listing
/// keeps), then stores the tier makes; each is held, or asked for, never listed absent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_key_is_not_listed_absent_when_the_rank_fills_the_existence_cache() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let rank: Vec<_> = (1..=1u32 << 20)
        .map(|i| test_key(1_000_000_000 + i as u64))
        .collect();
    for k in &rank[..rank.len() - 1] {
        // (any size: the listing counts keys)
        s.inner
            .put(
                &Path::from(writer.object_path(k)),
                object_store::PutPayload::new(),
            )
            .await
            .unwrap();
    }
    assert!(
        obj_store(&writer, &rank[rank.len() - 1..])
            .await
            .is_success()
    );
    let mut cfg = ObjTierConfig::new("mem");
    cfg.absent_ttl_s = 600.0;
    let tier = tier_on(&s, cfg).await;
    wait_until_async("the first listing", Duration::from_secs(600), || {
        tier.stats().listings >= 1
    })
    .await;
    assert_eq!(tier.holds(&test_key(1)), Some(false), "not listed");
    let stored: Vec<_> = (1..=128).map(test_key).collect();
    assert!(obj_store(&tier, &stored).await.is_success());
    let absent: Vec<_> = stored
        .iter()
        .filter(|k| tier.holds(k) == Some(false))
        .collect();
    assert!(
        absent.is_empty(),
        "{} of {} stored keys answered absent: {:?}",
        absent.len(),
        stored.len(),
        tier.stats()
    );
    assert_eq!(tier.lookup(&stored).await.unwrap(), vec![true; 128]);
}

/// LISTs racing stores and clears: a listing whose LIST is held while the tier stores keys
/// and its cache is cleared; no key this tier stored is ever answered absent (holds or
/// lookup), and after the LIST lands every stored key is held or asked.
#[tokio::test(start_paused = true)]
async fn stores_and_clears_racing_a_held_list_never_answer_a_stored_key_absent() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.absent_ttl_s = 4.0;
    cfg.request_timeout_s = 30.0;
    cfg.max_retries = 0;
    let tier = tier_on(&s, cfg).await;
    wait_until_async("the first listing", SETTLE_LIMIT, || {
        tier.stats().listings >= 1
    })
    .await;
    let mut stored = Vec::new();
    for round in 0..6u64 {
        let lists = s.hold_lists();
        lists.wait_arrived(1).await;
        let a = test_key(100 + round * 2);
        let b = test_key(101 + round * 2);
        assert!(obj_store(&tier, &[a]).await.is_success());
        stored.push(a);
        if round % 2 == 0 {
            tier.clear_exists_cache();
        }
        assert!(obj_store(&tier, &[b]).await.is_success());
        stored.push(b);
        for k in &stored {
            assert_ne!(
                tier.holds(k),
                Some(false),
                "round {round}: {k} listed absent"
            );
        }
        s.release_lists();
        let n = tier.stats().listings;
        tokio::time::sleep(Duration::from_millis(2100)).await;
        let _ = n;
        for k in &stored {
            assert_ne!(
                tier.holds(k),
                Some(false),
                "round {round} after: {k} listed absent"
            );
        }
        assert_eq!(
            tier.lookup(&stored).await.unwrap(),
            vec![true; stored.len()]
        );
    }
}

/// A LIST that breaks part way (after its first object) while stores run: the old listing
/// keeps the stored keys, and ages out; no stored key is answered absent.
#[tokio::test(start_paused = true)]
async fn a_list_breaking_part_way_keeps_stored_keys_out_of_absent() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.absent_ttl_s = 2.0;
    let tier = tier_on(&s, cfg).await;
    let seed: Vec<_> = (0..8).map(test_key).collect();
    assert!(obj_store(&tier, &seed).await.is_success());
    wait_until_async("a listing", SETTLE_LIMIT, || tier.stats().listings >= 2).await;
    let rank = tier
        .object_path(&seed[0])
        .split('/')
        .next()
        .unwrap()
        .to_string();
    s.fail_lists(Some(&rank));
    let mut stored = seed.clone();
    for i in 0..10u64 {
        let k = test_key(1000 + i);
        assert!(obj_store(&tier, &[k]).await.is_success());
        stored.push(k);
        tier.clear_exists_cache();
        tokio::time::sleep(Duration::from_millis(700)).await;
        for k in &stored {
            assert_ne!(tier.holds(k), Some(false), "step {i}: {k}");
        }
    }
    s.fail_lists(None);
    tokio::time::sleep(Duration::from_secs(3)).await;
    for k in &stored {
        assert_ne!(tier.holds(k), Some(false));
    }
    assert_eq!(
        tier.lookup(&stored).await.unwrap(),
        vec![true; stored.len()]
    );
}

/// The listing is refreshed every half absent_ttl_s while LISTs are quick: 2 s, over 10 s.
#[tokio::test(start_paused = true)]
async fn the_listing_is_refreshed_every_half_absent_ttl_s() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.absent_ttl_s = 2.0;
    let tier = tier_on(&s, cfg).await;
    wait_until_async("a listing", SETTLE_LIMIT, || tier.stats().listings >= 1).await;
    let n0 = tier.stats().listings;
    tokio::time::sleep(Duration::from_millis(10_050)).await;
    let n = tier.stats().listings - n0;
    assert!((9..=11).contains(&n), "{n} listings in 10 s");
}

/// Lookups that pass their deadline concurrently, many of them, over several log intervals:
/// the WARN lines' counts add up to `lookup_timeouts` (counting the last line's as of then).
#[tokio::test(start_paused = true)]
async fn concurrent_lookup_deadlines_are_counted_once_in_lines_and_stats() {
    let (warnings, _log) = kv_tier_testkit::fixtures::logs::Warnings::capture();
    let s = Arc::new(ControlledStore::new());
    let mut c = one_second();
    c.lookup_timeout_s = 0.25;
    c.request_timeout_s = 600.0;
    c.io_threads = 1;
    let tier = tier_on(&s, heads_only(c)).await;
    s.hold(Op::Head);
    let keys: Vec<_> = (0..4).map(test_key).collect();
    for round in 0..5 {
        let mut hs = Vec::new();
        for _ in 0..7 {
            let t = tier.clone();
            let ks = keys.clone();
            hs.push(tokio::spawn(async move { t.lookup(&ks).await }));
        }
        for h in hs {
            assert_eq!(h.await.unwrap().unwrap(), vec![false; 4]);
        }
        tokio::time::sleep(Duration::from_secs(if round % 2 == 0 { 11 } else { 3 })).await;
    }
    // one more, after the interval: its line carries what was only counted before
    tokio::time::sleep(Duration::from_secs(11)).await;
    assert_eq!(tier.lookup(&keys).await.unwrap(), vec![false; 4]);
    let total = tier.stats().lookup_timeouts;
    assert_eq!(total, 36);
    let lines = warnings.lines();
    let sum: u64 = lines
        .iter()
        .filter(|l| l.contains("passed their deadline"))
        .map(|l| {
            let at = l.find("lookups=").expect("a count") + "lookups=".len();
            l[at..]
                .split(|c: char| !c.is_ascii_digit())
                .next()
                .unwrap()
                .parse::<u64>()
                .unwrap()
        })
        .sum();
    assert_eq!(sum, total, "{lines:#?}");
    s.release_all();
}

/// An unbounded tier with its existence listing: a store runs while a LIST is held (the LIST
/// saw no object); once the LIST installs, the stored key is not answered absent.
#[tokio::test(start_paused = true)]
async fn a_key_stored_during_a_held_list_is_not_listed_absent() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    wait_until_async("a listing", SETTLE_LIMIT, || tier.stats().listings >= 1).await;
    let lists = s.hold_lists();
    lists.wait_arrived(1).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let before = tier.stats().listings;
    s.release_lists();
    wait_until_async("the held listing installs", SETTLE_LIMIT, || {
        tier.stats().listings > before
    })
    .await;
    tier.clear_exists_cache();
    wait_until_async("a listing after the clear", SETTLE_LIMIT, || {
        tier.stats().listings > before + 1
    })
    .await;
    assert_ne!(tier.holds(&k), Some(false));
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![true]);
}

/// The same with the existence cache cleared while the held LIST is under way (it installs
/// nothing) and a confirmed (skipped) store during it: never answered absent.
#[tokio::test(start_paused = true)]
async fn a_key_confirmed_during_a_held_list_across_a_clear_is_not_listed_absent() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, heads_only(ObjTierConfig::new("mem"))).await;
    let k = test_key(1);
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    wait_until_async("a listing", SETTLE_LIMIT, || tier.stats().listings >= 1).await;
    assert_eq!(tier.holds(&k), Some(false));
    let lists = s.hold_lists();
    lists.wait_arrived(1).await;
    assert!(obj_store(&writer, &[k]).await.is_success());
    tier.clear_exists_cache();
    assert!(obj_store(&tier, &[k]).await.is_success()); // create-only: already exists
    assert_ne!(
        tier.holds(&k),
        Some(false),
        "confirmed, then answered absent"
    );
    s.release_lists();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_ne!(tier.holds(&k), Some(false));
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![true]);
}
