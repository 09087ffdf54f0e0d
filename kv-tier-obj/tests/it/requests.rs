//! What the tier asks of its store: a new block is one PUT, a block already there is
//! confirmed (one HEAD) and not rewritten, an object in the way is replaced, and without
//! create-only writes a store looks first. Counted on a controlled in-memory store.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::SecondaryTier;
use kv_tier_obj::{CRC_METADATA_KEY, ObjTierConfig, block_crc};
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{block_bytes, load_keys, test_key, verify_block};
use object_store::path::Path;
use object_store::{
    Attribute, AttributeValue, Attributes, ObjectStore, ObjectStoreExt as _, PutMode, PutOptions,
    PutPayload,
};

use crate::support::*;

#[tokio::test]
async fn a_new_block_is_one_put_and_one_already_there_is_confirmed_not_rewritten() {
    let s = Arc::new(ControlledStore::new());
    let a = tier_on(&s, ObjTierConfig::new("mem")).await;
    let k = test_key(1);
    let (heads, gets) = (s.count(Op::Head), s.count(Op::Get));
    assert!(obj_store(&a, &[k]).await.is_success());
    assert_eq!(s.count(Op::Put), 1);
    assert_eq!(
        (s.count(Op::Head), s.count(Op::Get)),
        (heads, gets),
        "a new block was looked up first"
    );
    assert_eq!(a.take_events().len(), 1, "a new block is reported stored");
    let st = a.stats();
    assert_eq!((st.blocks.blocks_written, st.blocks.stores_skipped), (1, 0));
    assert!((1..=st.requests).contains(&st.max_in_flight), "{st:?}");
    let path = a.object_path(&k);
    let before = etag(&s, &path).await;
    // another instance (nothing cached) stores the same block
    let b = tier_on(&s, bounded(8)).await;
    assert!(obj_store(&b, &[k]).await.is_success());
    assert_eq!(etag(&s, &path).await, before, "the block was written again");
    let st = b.stats();
    assert_eq!((st.blocks.blocks_written, st.blocks.stores_skipped), (0, 1));
    assert_eq!(
        (st.objects, st.bytes),
        (1, BS as u64),
        "a confirmed block is not counted"
    );
    // reported stored all the same: this tier holds it now, and had not said so (after a
    // removal of the key, this is what says it is back)
    let ev = b.take_events();
    assert_eq!(ev.len(), 1, "{ev:?}");
    assert!(!ev[0].removed && ev[0].keys == vec![k]);
}

/// A store of a key the tier knows present asks the backend once (one HEAD tells presence,
/// size and checksum), writes nothing, and reports it stored; without create-only writes a
/// new key costs one HEAD and one PUT.
#[tokio::test]
async fn a_store_of_a_present_key_is_one_head() {
    let s = Arc::new(ControlledStore::new());
    let t = tier_on(&s, checked()).await;
    let k = test_key(1);
    assert!(obj_store(&t, &[k]).await.is_success());
    let (heads, puts, gets) = (s.count(Op::Head), s.count(Op::Put), s.count(Op::Get));
    assert!(obj_store(&t, &[k]).await.is_success());
    assert_eq!(
        (
            s.count(Op::Head) - heads,
            s.count(Op::Put) - puts,
            s.count(Op::Get) - gets
        ),
        (1, 0, 0),
        "requests of a store of a present key (HEAD, PUT, GET)"
    );
    assert_eq!(t.stats().blocks.stores_skipped, 1);
    s.refuse_create(true);
    let u = tier_on(&s, checked()).await;
    // its first store learns that create-only PUTs are refused
    assert!(obj_store(&u, &[test_key(3)]).await.is_success());
    let k2 = test_key(2);
    let (heads, puts) = (s.count(Op::Head), s.count(Op::Put));
    assert!(obj_store(&u, &[k2]).await.is_success());
    assert_eq!(
        (s.count(Op::Head) - heads, s.count(Op::Put) - puts),
        (1, 1),
        "requests of a new key's store without create-only writes (HEAD, PUT)"
    );
    let (res, data) = load_keys(&*u, &[k, k2], BS).await;
    assert!(res.is_success() && data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

#[tokio::test]
async fn an_object_in_the_way_is_replaced_by_a_head_and_the_block() {
    let s = Arc::new(ControlledStore::new());
    let t = tier_on(&s, checked()).await;
    let k = test_key(1);
    let path = t.object_path(&k);
    // half a block, with a well-formed checksum of the half
    let half = block_bytes(&k, 0, BS / 2);
    let mut attributes = Attributes::new();
    attributes.insert(
        Attribute::Metadata(CRC_METADATA_KEY.into()),
        AttributeValue::from(format!("{:08x}", block_crc(&k, &half))),
    );
    let opts = PutOptions {
        mode: PutMode::Overwrite,
        attributes,
        ..Default::default()
    };
    s.inner
        .put_opts(&Path::from(path.clone()), PutPayload::from(half), opts)
        .await
        .unwrap();
    let gets = s.count(Op::Get);
    assert!(obj_store(&t, &[k]).await.is_success());
    assert_eq!(
        s.count(Op::Get),
        gets,
        "the object in the way was read, not HEADed"
    );
    assert_eq!(
        s.inner.head(&Path::from(path)).await.unwrap().size,
        BS as u64
    );
    let (res, data) = load_keys(&*t, &[k], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&k, 0, &data[0].1));
}

/// Without create-only writes the tier looks before it writes: a new block still stores, an
/// object in the way is replaced once, and one that cannot be deleted fails the store
/// (naming it) instead of looping.
#[tokio::test(start_paused = true)]
async fn without_conditional_writes_a_store_looks_first_and_replaces_once() {
    let s = Arc::new(ControlledStore::new());
    s.refuse_create(true);
    let mut c = checked();
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let t = tier_on(&s, c).await;
    let (k1, k2, k3) = (test_key(1), test_key(2), test_key(3));
    assert!(
        obj_store(&t, &[k1]).await.is_success(),
        "no fallback without create-only PUTs"
    );
    assert!(s.exists(&t.object_path(&k1)).await);
    put_in_the_way(&s, &t.object_path(&k2)).await;
    let res = obj_store(&t, &[k2]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = load_keys(&*t, &[k2], BS).await;
    assert!(res.is_success() && verify_block(&k2, 0, &data[0].1));
    put_in_the_way(&s, &t.object_path(&k3)).await;
    let _deletes = s.hold(Op::Delete); // the object in the way cannot be deleted
    let res = tokio::time::timeout(std::time::Duration::from_secs(60), obj_store(&t, &[k3]))
        .await
        .expect("a store looped on an object it cannot replace");
    assert_eq!(res.failed_keys(), vec![k3]);
    let msg = res.failed[0].1.to_string();
    assert!(
        msg.contains("could not be replaced") && msg.contains(&t.object_path(&k3)),
        "{msg}"
    );
}

/// Reads go before write-back: while a read (a lookup's HEAD, a load's GET) waits or runs,
/// writes start a quarter of `io_threads` at a time (one of four here); the others are held back (counted in `writes_deferred`) until
/// the reads end, then run side by side. A lookup's HEADs have permits of
/// their own: one answers while loads hold every read permit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_go_before_writes_and_probes_before_loads() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.io_threads = 4;
    let tier = tier_on(&s, cfg).await;
    let read = test_key(100);
    assert!(obj_store(&tier, &[read]).await.is_success());
    let (get, put) = (s.hold(Op::Get), s.hold(Op::Put));
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[read], BS).await });
    wait_until_async("the GET is held", SETTLE_LIMIT, || get.arrived() == 1).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    let t = tier.clone();
    let ks = keys.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &ks).await });
    wait_until_async("two writes held back", SETTLE_LIMIT, || {
        tier.stats().writes_deferred == 2
    })
    .await;
    assert_eq!(put.arrived(), 1, "writes started beside a read");
    s.release(Op::Get);
    let (r, _) = loading.await.unwrap();
    assert!(r.is_success(), "{:?}", r.failed);
    // no read now: the writes run at once
    wait_until_async("three PUTs in flight", SETTLE_LIMIT, || put.arrived() == 3).await;
    s.release(Op::Put);
    let r = storing.await.unwrap();
    assert!(r.is_success(), "{:?}", r.failed);
    assert_eq!(s.count(Op::Put), 4);
    assert!(tier.stats().max_in_flight <= 3 * 4, "{:?}", tier.stats());
    // four loads hold every read permit; a lookup still answers
    let held: Vec<_> = (200..204).map(test_key).collect();
    assert!(obj_store(&tier, &held).await.is_success());
    let get = s.hold(Op::Get);
    let t = tier.clone();
    let hs = held.clone();
    let loading = tokio::spawn(async move {
        futures::future::join_all(
            hs.iter()
                .map(|k| load_keys(&*t, std::slice::from_ref(k), BS)),
        )
        .await
    });
    wait_until_async("four GETs held", SETTLE_LIMIT, || get.arrived() == 4).await;
    tier.clear_exists_cache();
    assert_eq!(tier.lookup(&held[..1]).await.unwrap(), vec![true]);
    s.release(Op::Get);
    for (r, _) in loading.await.unwrap() {
        assert!(r.is_success(), "{:?}", r.failed);
    }
}

/// A load that finds its object damaged deletes it as a read: it ends while write-back holds
/// every write permit, and the upload is left to run.
#[tokio::test(start_paused = true)]
async fn a_load_of_a_damaged_object_does_not_wait_behind_uploads() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = checked();
    cfg.io_threads = 1;
    let tier = tier_on(&s, cfg).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    rot(&s, &tier.object_path(&k)).await;
    let put = s.hold(Op::Put);
    let t = tier.clone();
    let uploading = tokio::spawn(async move { obj_store(&*t, &[test_key(2)]).await });
    wait_until_async("the PUT is held", SETTLE_LIMIT, || put.arrived() == 1).await;
    let (r, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(r.failed[..], [(_, kv_tier_core::Error::Corrupt { .. })]),
        "{:?}",
        r.failed
    );
    assert!(
        !s.exists(&tier.object_path(&k)).await,
        "the damaged object stayed"
    );
    assert!(
        !uploading.is_finished(),
        "the load ended only once the upload had"
    );
    assert_eq!(tier.stats().request_timeouts, 0, "{:?}", tier.stats());
    s.release(Op::Put);
    assert!(uploading.await.unwrap().is_success());
}

/// A write held back behind reads ends within one request deadline of getting its permit:
/// the hold at the gate (at most a quarter of it) is part of that deadline, not added to it.
#[tokio::test(start_paused = true)]
async fn a_store_held_back_by_reads_ends_within_one_request_deadline() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = one_second();
    cfg.io_threads = 4;
    cfg.validate().unwrap();
    let deadline = cfg.request_deadline();
    let tier = tier_on(&s, cfg).await;
    let read = test_key(100);
    assert!(obj_store(&tier, &[read]).await.is_success());
    // a read in flight, and one write beside it (a quarter of io_threads): both held
    let (get, put) = (s.hold(Op::Get), s.hold(Op::Put));
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[read], BS).await });
    wait_until_async("the GET is held", SETTLE_LIMIT, || get.arrived() == 1).await;
    let t = tier.clone();
    let first = tokio::spawn(async move { obj_store(&*t, &[test_key(1)]).await });
    wait_until_async("the first PUT is held", SETTLE_LIMIT, || put.arrived() == 1).await;
    let started = tokio::time::Instant::now();
    let r = obj_store(&tier, &[test_key(2)]).await;
    let took = started.elapsed();
    assert!(
        took <= deadline,
        "a one-block store took {took:?}; its request deadline is {deadline:?}"
    );
    assert!(
        r.failed.iter().all(|(_, e)| is_timeout(e)),
        "{:?}",
        r.failed
    );
    assert_eq!(put.arrived(), 2, "the held-back write never started");
    s.release_all();
    let _ = loading.await.unwrap();
    let _ = first.await.unwrap();
}

/// A write held back behind a read that never ends starts within a quarter of its request
/// deadline of getting its permit (io_threads 8: two run, six are held back).
#[tokio::test(start_paused = true)]
async fn a_held_back_write_starts_within_a_quarter_of_its_deadline() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.io_threads = 8;
    cfg.request_timeout_s = 4.0;
    cfg.max_retries = 0;
    cfg.validate().unwrap();
    let quarter = cfg.request_deadline() / 4;
    let tier = tier_on(&s, cfg).await;
    let read = test_key(100);
    assert!(obj_store(&tier, &[read]).await.is_success());
    let get = s.hold(Op::Get);
    let t = tier.clone();
    let _loading = tokio::spawn(async move { load_keys(&*t, &[read], BS).await });
    get.wait_arrived(1).await;
    let put = s.hold(Op::Put);
    let t0 = tokio::time::Instant::now();
    let t = tier.clone();
    let storing =
        tokio::spawn(
            async move { obj_store(&*t, &(0..8).map(test_key).collect::<Vec<_>>()).await },
        );
    put.wait_arrived(2).await;
    tokio::time::sleep(quarter / 2).await;
    assert_eq!(put.arrived(), 2, "more than a quarter ran beside the read");
    put.wait_arrived(8).await;
    assert!(t0.elapsed() <= quarter, "{:?} > {quarter:?}", t0.elapsed());
    assert_eq!(tier.stats().writes_deferred, 6);
    s.release_all();
    assert!(storing.await.unwrap().is_success());
}

/// A store dropped while its write waits at the gate leaves no count: once reads end,
/// io_threads writes run side by side.
#[tokio::test(start_paused = true)]
async fn a_write_dropped_at_its_gate_leaves_nothing_behind() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.io_threads = 4;
    cfg.request_timeout_s = 40.0;
    cfg.max_retries = 0;
    let tier = tier_on(&s, cfg).await;
    let read = test_key(100);
    assert!(obj_store(&tier, &[read]).await.is_success());
    let get = s.hold(Op::Get);
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[read], BS).await });
    get.wait_arrived(1).await;
    let put = s.hold(Op::Put);
    let t = tier.clone();
    let first = tokio::spawn(async move { obj_store(&*t, &[test_key(1)]).await });
    put.wait_arrived(1).await;
    // three more held back at the gate, dropped there
    let dropped = tokio::time::timeout(
        Duration::from_secs(1),
        obj_store(&*tier, &(2..5).map(test_key).collect::<Vec<_>>()),
    )
    .await;
    assert!(dropped.is_err());
    assert_eq!(tier.stats().writes_deferred, 3);
    s.release(Op::Get);
    let _ = loading.await.unwrap();
    let t = tier.clone();
    let more =
        tokio::spawn(
            async move { obj_store(&*t, &(10..13).map(test_key).collect::<Vec<_>>()).await },
        );
    put.wait_arrived(4).await;
    assert_eq!(tier.stats().writes_deferred, 3, "{:?}", tier.stats());
    s.release_all();
    assert!(first.await.unwrap().is_success());
    assert!(more.await.unwrap().is_success());
    assert!(!tier.is_protected(&test_key(2)));
}

/// Each kind's bound across concurrent callers: io_threads 2; three lookups (HEADs held),
/// a relist's LIST held with three loads (GETs held), and stores beside a sweep (PUTs and
/// DELETEs held): at most two of each kind arrive at the store.
#[tokio::test(start_paused = true)]
async fn each_kind_stays_within_io_threads_across_callers() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = bounded(4);
    cfg.io_threads = 2;
    cfg.request_timeout_s = 600.0;
    cfg.lookup_timeout_s = 600.0;
    cfg.max_retries = 0;
    let tier = tier_on(&s, cfg).await;
    let keys: Vec<_> = (0..4).map(test_key).collect();
    assert!(obj_store(&tier, &keys).await.is_success());
    tier.clear_exists_cache();
    // probes
    let head = s.hold(Op::Head);
    let mut hs = Vec::new();
    for _ in 0..3 {
        let t = tier.clone();
        let ks = keys.clone();
        hs.push(tokio::spawn(async move { t.lookup(&ks).await }));
    }
    head.wait_arrived(2).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(head.arrived(), 2, "probes over io_threads");
    // reads
    let get = s.hold(Op::Get);
    let mut ls = Vec::new();
    for k in keys.iter().take(3) {
        let t = tier.clone();
        let k = *k;
        ls.push(tokio::spawn(async move { load_keys(&*t, &[k], BS).await }));
    }
    get.wait_arrived(2).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(get.arrived(), 2, "reads over io_threads");
    s.release(Op::Head);
    s.release(Op::Get);
    for h in hs {
        let _ = h.await.unwrap();
    }
    for h in ls {
        let _ = h.await.unwrap();
    }
    // writes: stores past the bound start a sweep
    let (put, del) = (s.hold(Op::Put), s.hold(Op::Delete));
    let t = tier.clone();
    let storing =
        tokio::spawn(
            async move { obj_store(&*t, &(10..16).map(test_key).collect::<Vec<_>>()).await },
        );
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert!(
        put.arrived() + del.arrived() <= 2,
        "writes over io_threads: {} PUTs, {} DELETEs",
        put.arrived(),
        del.arrived()
    );
    assert!(tier.stats().max_in_flight <= 6, "{:?}", tier.stats());
    s.release_all();
    let _ = storing.await.unwrap();
}

/// io_threads 1024 and tiny/huge timeouts: lookups of 5,000 keys with every HEAD delayed
/// answer within lookup_timeout_s (tiny), probes stay within io_threads.
#[tokio::test(start_paused = true)]
async fn a_thousand_io_threads_answer_within_a_tiny_lookup_timeout() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = heads_only(ObjTierConfig::new("mem"));
    cfg.io_threads = 1024;
    cfg.lookup_timeout_s = 0.001;
    cfg.request_timeout_s = 3600.0;
    cfg.max_retries = 100;
    let tier = tier_on(&s, cfg).await;
    s.delay(Op::Head, Duration::from_millis(5));
    let keys: Vec<_> = (0..5000).map(test_key).collect();
    let t0 = tokio::time::Instant::now();
    assert_eq!(tier.lookup(&keys).await.unwrap(), vec![false; 5000]);
    assert!(
        t0.elapsed() <= Duration::from_millis(1),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(tier.stats().lookup_timeouts, 1);
    assert!(tier.stats().max_in_flight <= 1024);
    s.delay(Op::Head, Duration::ZERO);
    assert!(obj_store(&tier, &keys[..3]).await.is_success());
    tier.clear_exists_cache();
    let mut cfg2 = heads_only(ObjTierConfig::new("mem"));
    cfg2.lookup_timeout_s = 3600.0;
    cfg2.request_timeout_s = 0.01;
    let t2 = tier_on(&s, cfg2).await;
    assert_eq!(
        t2.lookup(&keys[..4]).await.unwrap(),
        vec![true, true, true, false]
    );
}

/// io_threads 1: a relist's LIST page held, a load of a damaged object (GET, HEAD, DELETE
/// as reads) and a store beside it; everything ends within its deadlines and nothing wedges.
#[tokio::test(start_paused = true)]
async fn one_io_thread_serves_a_held_list_a_damaged_load_and_a_store() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = checked_half_second();
    cfg.io_threads = 1;
    cfg.absent_ttl_s = 2.0;
    cfg.request_timeout_s = 2.0;
    let tier = tier_on(&s, cfg.clone()).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    rot(&s, &tier.object_path(&k)).await;
    wait_until_async("a listing", SETTLE_LIMIT, || tier.stats().listings >= 1).await;
    let lists = s.hold_lists();
    lists.wait_arrived(1).await;
    let started = tokio::time::Instant::now();
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[k], BS).await });
    let r = obj_store(&tier, &[test_key(2), k]).await;
    assert!(r.is_success(), "{:?}", r.failed);
    let (lr, _) = loading.await.unwrap();
    assert!(lr.failed.len() <= 1);
    assert!(
        started.elapsed() <= cfg.request_deadline() * 6,
        "{:?}",
        started.elapsed()
    );
    s.release_lists();
    assert!(obj_store(&tier, &[k, test_key(2)]).await.is_success());
    let (lr, _) = load_keys(&*tier, &[test_key(2)], BS).await;
    assert!(lr.is_success(), "{:?}", lr.failed);
}
