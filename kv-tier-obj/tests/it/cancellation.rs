//! Store, load, lookup and sweep futures dropped at any point: no claim, permit or protection
//! is left behind, and the same keys store, load and look up normally after.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_obj::{ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, test_key, verify_block};

use crate::support::*;

/// Drops a store, load or lookup future while it waits at each of its await points; the tier
/// keeps no claim, permit or protection, and the same keys store and load normally after.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_dropped_at_each_await_point_leave_no_trace() {
    let s = Arc::new(ControlledStore::new());
    let mut c = ObjTierConfig::new("mem");
    c.io_threads = 1;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    let spawn_store = |t: &Arc<ObjTier>| {
        let t = t.clone();
        tokio::spawn(async move { obj_store(&t, &[k]).await })
    };

    // 1. in the PUT
    let puts = s.hold(Op::Put);
    let a = spawn_store(&tier);
    puts.wait_arrived(1).await;
    // 2. waiting for another store's upload of the same key
    let b = spawn_store(&tier);
    // 3. waiting for the one permit (io_threads = 1), on a key of its own
    let t3 = tier.clone();
    let other = test_key(2);
    let c3 = tokio::spawn(async move { obj_store(&t3, &[other]).await });
    tokio::task::yield_now().await;
    assert_eq!(s.count(Op::Put), 1);
    a.abort(); // drops the uploader: its claim and permit go
    let _ = a.await;
    // b now uploads (or c3 does first); let them through
    s.release(Op::Put);
    let rb = b.await.unwrap();
    assert!(rb.is_success(), "the waiting store wedged: {:?}", rb.failed);
    assert!(c3.await.unwrap().is_success());
    assert!(s.exists(&tier.object_path(&k)).await);

    // 4. in the backend confirmation of a cached key
    let heads = s.hold(Op::Head);
    let d = spawn_store(&tier);
    heads.wait_arrived(1).await;
    d.abort();
    let _ = d.await;
    s.release(Op::Head);

    // 5. a load in its GET, and a lookup in its HEAD
    tier.clear_exists_cache();
    let gets = s.hold(Op::Get);
    let t5 = tier.clone();
    let e = tokio::spawn(async move { load_keys(&*t5, &[k], BS).await });
    gets.wait_arrived(1).await;
    e.abort();
    let _ = e.await;
    s.release(Op::Get);
    let heads = s.hold(Op::Head);
    let t6 = tier.clone();
    let f = tokio::spawn(async move { t6.lookup(&[k]).await });
    heads.wait_arrived(1).await;
    f.abort();
    let _ = f.await;
    s.release(Op::Head);

    assert!(!tier.is_protected(&k) && !tier.is_protected(&other));
    assert!(obj_store(&tier, &[k, other]).await.is_success());
    let (res, data) = load_keys(&*tier, &[k, other], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert_eq!(tier.lookup(&[k, other]).await.unwrap(), vec![true, true]);
}

/// Store, load and lookup futures dropped at many points in time (every request slowed, one
/// permit of each kind, a damaged object on the load's path): no protection left, and afterwards every
/// key stores, loads and looks up within its deadline.
#[tokio::test(start_paused = true)]
async fn futures_dropped_at_every_moment_leave_nothing_behind() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = checked_half_second();
    cfg.io_threads = 1;
    cfg.request_timeout_s = 5.0;
    let tier = tier_on(&s, cfg).await;
    for op in Op::ALL {
        s.delay(op, Duration::from_millis(7));
    }
    let keys: Vec<_> = (0..4).map(test_key).collect();
    for step in 0..40u64 {
        let at = Duration::from_millis(step * 2 + 1);
        // damage one key's object so a load takes its delete path
        if step % 3 == 0 {
            let p = tier.object_path(&keys[(step % 4) as usize]);
            if s.exists(&p).await {
                put_raw(&s.inner, &p, vec![1u8; BS], Some("00000000")).await;
            }
        }
        let t1 = tier.clone();
        let ks = keys.clone();
        let _ = tokio::time::timeout(at, async move { obj_store(&*t1, &ks).await }).await;
        let t2 = tier.clone();
        let ks = keys.clone();
        let _ = tokio::time::timeout(at, async move { load_keys(&*t2, &ks, BS).await }).await;
        let _ = tokio::time::timeout(at, tier.lookup(&keys)).await;
        // two overlapping stores of the same keys, one dropped
        let t3 = tier.clone();
        let ks = keys.clone();
        let h = tokio::spawn(async move { obj_store(&*t3, &ks).await });
        let _ = tokio::time::timeout(at, obj_store(&*tier, &keys)).await;
        let r = tokio::time::timeout(Duration::from_secs(60), h)
            .await
            .expect("a store wedged after another store of its keys was dropped")
            .unwrap();
        assert!(r.is_success(), "step {step}: {:?}", r.failed);
        for k in &keys {
            assert!(!tier.is_protected(k), "step {step}: {k} still protected");
        }
    }
    s.release_all();
    for op in Op::ALL {
        s.delay(op, Duration::ZERO);
    }
    let r = tokio::time::timeout(Duration::from_secs(30), obj_store(&*tier, &keys))
        .await
        .expect("store wedged");
    assert!(r.is_success(), "{:?}", r.failed);
    let (r, data) = load_keys(&*tier, &keys, BS).await;
    assert!(r.is_success(), "{:?}", r.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    tier.clear_exists_cache();
    assert_eq!(tier.lookup(&keys).await.unwrap(), vec![true; 4]);
    // one permit of each kind: a lookup's HEAD, a read, a write
    assert!(tier.stats().max_in_flight <= 3, "{:?}", tier.stats());
}

/// `sweep_now` dropped while its DELETEs are held; then stores of the victims must not hang,
/// keys never reported removed stay found, and the count stays on the safe side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_sweep_now_leaves_nothing_wedged() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(16);
    c.request_timeout_s = 10.0;
    let tier = tier_on(&s, c).await;
    let mut h = History::default();
    let keys: Vec<_> = (0..16).map(test_key).collect();
    for k in &keys {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    let deletes = s.hold(Op::Delete);
    // over the cap: the store spawns a sweep; sweep_now waits for it
    let extra = test_key(100);
    assert!(obj_store(&tier, &[extra]).await.is_success());
    deletes.wait_arrived(1).await;
    let r = tokio::time::timeout(Duration::from_millis(50), tier.sweep_now()).await;
    assert!(r.is_err());
    // the background sweep is stuck on its DELETEs; stores of its victims wait for it; drop
    // some of those stores midway as well
    let victims: Vec<BlockKey> = h
        .take(&tier)
        .into_iter()
        .filter(|(_, r)| *r)
        .map(|(k, _)| k)
        .collect();
    assert!(!victims.is_empty());
    let r = tokio::time::timeout(Duration::from_millis(50), obj_store(&tier, &victims[..1])).await;
    assert!(
        r.is_err(),
        "the store of a victim did not wait for its delete"
    );
    // shut the background sweep down? no: release the deletes instead
    s.release(Op::Delete);
    wait_sweeps_done(&tier).await;
    for k in keys.iter().chain([&extra]) {
        let r = tokio::time::timeout(Duration::from_secs(5), obj_store(&tier, &[*k])).await;
        let r = r.unwrap_or_else(|_| panic!("store of {k} wedged"));
        assert!(r.is_success(), "{:?}", r.failed);
    }
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    for k in keys.iter().chain([&extra]) {
        if h.last(k) != Some(true) {
            assert!(found(&tier, *k).await, "{k} lost");
        }
    }
    assert!(tier.stats().bytes >= present_bytes(&s.inner));
}

/// A load dropped while its GET waits for a read permit counts off the reads that hold
/// writes back: once the reads end, a store's writes run side by side again, none held back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_dropped_while_it_waits_for_a_permit_holds_no_write_back() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.io_threads = 4;
    let tier = tier_on(&s, cfg).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    assert!(obj_store(&*tier, &keys).await.is_success());
    let get = s.hold(Op::Get);
    // four loads take every read permit; a fifth waits for one, and is dropped there
    let t = tier.clone();
    let ks = keys.clone();
    let holding = tokio::spawn(async move {
        futures::future::join_all(
            ks[..4]
                .iter()
                .map(|k| load_keys(&*t, std::slice::from_ref(k), BS)),
        )
        .await
    });
    wait_until_async("four GETs held", SETTLE_LIMIT, || get.arrived() == 4).await;
    let waiting = load_keys(&*tier, &keys[4..], BS);
    assert!(
        tokio::time::timeout(Duration::from_millis(50), waiting)
            .await
            .is_err(),
        "a fifth GET ran with four permits"
    );
    s.release(Op::Get);
    for (r, _) in holding.await.unwrap() {
        assert!(r.is_success(), "{:?}", r.failed);
    }
    // PUTs held: all four run at once, as when nothing ever read
    let deferred = tier.stats().writes_deferred;
    let put = s.hold(Op::Put);
    let t = tier.clone();
    let storing = tokio::spawn(async move {
        let more: Vec<_> = (10..14).map(test_key).collect();
        obj_store(&*t, &more).await
    });
    wait_until_async("four PUTs side by side", SETTLE_LIMIT, || {
        put.arrived() == 4
    })
    .await;
    s.release(Op::Put);
    assert!(storing.await.unwrap().is_success());
    assert_eq!(tier.stats().writes_deferred, deferred, "{:?}", tier.stats());
}

/// A bounded tier's store dropped while its PUT is held (never ran): nothing at the path;
/// `holds` must not answer "held" (cancellation leaves nothing claimed as held).
#[tokio::test(start_paused = true)]
async fn a_store_dropped_in_its_put_is_not_answered_held() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_long(64)).await;
    let k = test_key(1);
    let puts = s.hold(Op::Put);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    puts.wait_arrived(1).await;
    storing.abort();
    let _ = storing.await;
    s.release(Op::Put);
    assert!(!s.exists(&tier.object_path(&k)).await);
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "a store dropped before its PUT ran left the key answered held: {:?}",
        tier.stats()
    );
}

/// The same, dropped while it waits for the one write permit (io_threads 1, another key's
/// PUT held): it never sent a PUT at all.
#[tokio::test(start_paused = true)]
async fn a_store_dropped_waiting_for_a_write_permit_is_not_answered_held() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_long(64);
    c.io_threads = 1;
    let tier = tier_on(&s, c).await;
    let (a, k) = (test_key(1), test_key(2));
    let puts = s.hold(Op::Put);
    let t = tier.clone();
    let first = tokio::spawn(async move { obj_store(&*t, &[a]).await });
    puts.wait_arrived(1).await;
    let t = tier.clone();
    let second = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    wait_until_async("the second store counted", SETTLE_LIMIT, || {
        tier.stats().objects == 2
    })
    .await;
    assert_eq!(s.count(Op::Put), 1, "the second store sent no PUT");
    second.abort();
    let _ = second.await;
    s.release(Op::Put);
    assert!(first.await.unwrap().is_success());
    assert!(!s.exists(&tier.object_path(&k)).await);
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "a store dropped before it sent its PUT left the key answered held: {:?}",
        tier.stats()
    );
}

/// A bounded tier's store whose PUT never ran (held at the server) and timed out: the store
/// reports a timeout and nothing is at the path. `holds` must not answer "held" (the index
/// may count it, in doubt, but the tier cannot tell it is there).
#[tokio::test(start_paused = true)]
async fn a_store_whose_put_timed_out_unrun_is_not_answered_held() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    let _puts = s.hold(Op::Put);
    let r = obj_store(&tier, &[k]).await;
    assert!(
        matches!(&r.failed[..], [(_, e)] if is_timeout(e)),
        "{:?}",
        r.failed
    );
    s.release(Op::Put);
    assert!(
        !s.exists(&tier.object_path(&k)).await,
        "the held PUT never ran"
    );
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "a key whose only store timed out without writing is answered held: {:?}",
        tier.stats()
    );
}

/// A load finds a damaged object and deletes it; the DELETE runs, its reply is slow, and the
/// load is dropped meanwhile (the engine gave up). The key was reported removed and is gone:
/// `holds` must not answer "held" (cancellation: nothing counted wrongly).
#[tokio::test(start_paused = true)]
async fn a_load_dropped_in_its_damaged_delete_does_not_leave_the_key_held() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 600.0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let mut h = History::default();
    h.take(&tier);
    s.delay_replies(Op::Delete, Duration::from_secs(3600));
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[k], BS).await });
    wait_until_async("the DELETE ran", SETTLE_LIMIT, || s.count(Op::Delete) >= 1).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    loading.abort();
    let _ = loading.await;
    s.release_all();
    assert!(!s.exists(&path).await, "the DELETE ran");
    h.take(&tier);
    assert_eq!(h.last(&k), Some(true), "reported removed");
    assert_ne!(
        tier.holds(&k),
        Some(true),
        "a key reported removed and gone is answered held after its load was dropped: {:?}",
        tier.stats()
    );
}

/// A load finds a damaged object (bit rot, metadata whole) and is dropped while its DELETE
/// waits (it never runs). A later store of the key reports it stored: the block must be a
/// readable one ("a reported store is a readable block").
#[tokio::test(start_paused = true)]
async fn a_store_after_a_load_dropped_in_its_damaged_delete_leaves_a_readable_block() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 600.0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let deletes = s.hold(Op::Delete);
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[k], BS).await });
    deletes.wait_arrived(1).await;
    loading.abort();
    let _ = loading.await;
    s.release(Op::Delete);
    assert!(s.exists(&path).await, "the DELETE never ran");
    let r = obj_store(&tier, &[k]).await;
    assert!(r.is_success(), "{:?}", r.failed);
    let (r, data) = load_keys(&*tier, &[k], BS).await;
    assert!(
        r.is_success() && verify_block(&k, 0, &data[0].1),
        "a store reported after a dropped damaged-object delete left it damaged: {:?} {:?}",
        r.failed,
        tier.stats().blocks
    );
}

/// A load finds a damaged object (bit rot, metadata whole) and is dropped during its HEAD
/// before the DELETE (the engine gave up). A later store of the key reports it stored: the
/// block must be a readable one, as when the load is dropped in the DELETE or the HEAD fails.
#[tokio::test(start_paused = true)]
async fn a_store_after_a_load_dropped_in_its_damaged_head_leaves_a_readable_block() {
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
    loading.abort();
    let _ = loading.await;
    s.release(Op::Head);
    assert!(s.exists(&path).await, "the DELETE never ran");
    let r = obj_store(&tier, &[k]).await;
    assert!(r.is_success(), "{:?}", r.failed);
    let (r, data) = load_keys(&*tier, &[k], BS).await;
    assert!(
        r.is_success() && verify_block(&k, 0, &data[0].1),
        "a store reported after a load dropped before its damaged-object delete left it \
         damaged: {:?} {:?}",
        r.failed,
        tier.stats().blocks
    );
}

/// The same, the load dropped while it waits for the key's put claim (a store of the key
/// holds it, its PUT held), before its HEAD.
#[tokio::test(start_paused = true)]
async fn a_load_dropped_waiting_for_its_damaged_claim_leaves_no_damaged_block_stored() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 600.0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    tier.clear_exists_cache();
    // a store of the key holds its claim: its HEAD (presence cache cleared, create-only PUT
    // answered AlreadyExists, then a HEAD) held
    let heads = s.hold_path(Op::Head, &path);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[k]).await });
    heads.wait_arrived(1).await;
    let gets = s.count(Op::Get);
    let t = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t, &[k], BS).await });
    wait_until_async("the load's GET", SETTLE_LIMIT, || s.count(Op::Get) > gets).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    loading.abort();
    let _ = loading.await;
    s.release(Op::Head);
    let _ = storing.await.unwrap();
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
