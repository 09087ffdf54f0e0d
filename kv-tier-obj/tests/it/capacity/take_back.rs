//! A store of a sweep's victim whose DELETE is not sent yet takes it back: the store ends at
//! once, the victim stays counted however the store ends (refused, timed out, dropped), and a
//! store that succeeds reports it stored and held.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_obj::ObjTier;
use kv_tier_testkit::controlled_store::{ControlledStore, Op, PutFault};
use kv_tier_testkit::{Gate, test_key};

use crate::support::*;

/// Lets the held sweep end; `v`, taken back and never deleted, is there and counted.
async fn the_sweep_ends_with_the_victim_counted(
    s: &ControlledStore,
    tier: &ObjTier,
    first: &Gate,
    v: &BlockKey,
) {
    first.open();
    s.release(Op::Delete);
    wait_sweeps_done(tier).await;
    assert!(
        s.exists(&tier.object_path(v)).await,
        "the taken-back victim was never deleted"
    );
    if let Some(e) = under_count(tier, s) {
        panic!("{e}; holds {:?}", tier.holds(v));
    }
}

/// A bounded tier of 8 blocks (io_threads 2: one DELETE at a time), `timeout_s` requests,
/// filled and then over by one: a background sweep whose first DELETE (of keys[0]) is held.
/// Returns the tier, the keys, the victims reported removed and the held DELETE's gate.
async fn sweep_with_first_delete_held(
    s: &Arc<ControlledStore>,
    timeout_s: f64,
) -> (Arc<ObjTier>, Vec<BlockKey>, Vec<BlockKey>, Gate, History) {
    let mut c = bounded(8);
    c.request_timeout_s = timeout_s;
    c.lookup_timeout_s = timeout_s;
    c.max_retries = 0;
    c.io_threads = 2;
    let tier = tier_on(s, c).await;
    let keys: Vec<_> = (0..9).map(test_key).collect();
    for k in &keys[..8] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    let mut h = History::default();
    h.take(&tier);
    let first = s.hold_path(Op::Delete, &tier.object_path(&keys[0]));
    assert!(obj_store(&tier, &keys[8..]).await.is_success()); // over: a sweep
    first.wait_arrived(1).await;
    let victims: Vec<_> = h
        .take(&tier)
        .into_iter()
        .filter(|(_, r)| *r)
        .map(|(k, _)| k)
        .collect();
    assert!(victims.len() >= 3, "{victims:?}");
    assert_eq!(victims[0], keys[0]);
    (tier, keys, victims, first, h)
}

/// On a store without create-only writes (a store looks before it writes), a store of a
/// sweep's victim whose DELETE is not sent takes it back ("the object is still there; the
/// store counts it again"), and its HEAD then times out. The victim's object was never
/// deleted: it must stay counted.
#[tokio::test(start_paused = true)]
async fn a_victim_taken_back_by_a_store_whose_head_times_out_stays_counted() {
    let s = Arc::new(ControlledStore::new());
    s.refuse_create(true);
    let (tier, _keys, victims, first, _h) = sweep_with_first_delete_held(&s, 1.0).await;
    let v = *victims.last().unwrap();
    let path = tier.object_path(&v);
    let _heads = s.hold_path(Op::Head, &path);
    let r = obj_store(&tier, &[v]).await;
    assert!(!r.is_success(), "its HEAD was held past its deadline");
    s.release(Op::Head);
    the_sweep_ends_with_the_victim_counted(&s, &tier, &first, &v).await;
}

/// The same, the store dropped in its HEAD (cancellation): the taken-back victim's object
/// is still there and must stay counted.
#[tokio::test(start_paused = true)]
async fn a_victim_taken_back_by_a_store_dropped_in_its_head_stays_counted() {
    let s = Arc::new(ControlledStore::new());
    s.refuse_create(true);
    let (tier, _keys, victims, first, _h) = sweep_with_first_delete_held(&s, 600.0).await;
    let v = *victims.last().unwrap();
    let path = tier.object_path(&v);
    let heads = s.hold_path(Op::Head, &path);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[v]).await });
    heads.wait_arrived(1).await;
    storing.abort();
    let _ = storing.await;
    s.release(Op::Head);
    the_sweep_ends_with_the_victim_counted(&s, &tier, &first, &v).await;
}

/// Create-only writes: a store of an unsent victim takes it back and its PUT is refused
/// with a 503. The object is still there: counted, not answered held unless confirmed;
/// a later store reports it stored, events end "stored".
#[tokio::test(start_paused = true)]
async fn a_victim_taken_back_by_a_refused_store_stays_counted_and_comes_back() {
    let s = Arc::new(ControlledStore::new());
    let (tier, _keys, victims, first, mut h) = sweep_with_first_delete_held(&s, 1.0).await;
    let v = *victims.last().unwrap();
    let path = tier.object_path(&v);
    s.fail_puts(PutFault::Refused, "", 1);
    let r = obj_store(&tier, &[v]).await;
    assert!(!r.is_success(), "{:?}", r.failed);
    first.open();
    s.release(Op::Delete);
    wait_sweeps_done(&tier).await;
    assert!(s.exists(&path).await);
    if let Some(e) = under_count(&tier, &s) {
        panic!("{e}; holds {:?}", tier.holds(&v));
    }
    let r = obj_store(&tier, &[v]).await;
    assert!(r.is_success(), "{:?}", r.failed);
    h.take(&tier);
    assert_eq!(h.last(&v), Some(false), "stored again after its removal");
    assert!(found(&tier, v).await);
    if let Some(e) = under_count(&tier, &s) {
        panic!("{e}");
    }
}

/// Create-only writes: a store of an unsent victim takes it back and succeeds (confirmed
/// present). Reported removed then stored; held; the sweep ends within the bound.
#[tokio::test(start_paused = true)]
async fn a_victim_taken_back_and_stored_is_reported_stored_and_held() {
    let s = Arc::new(ControlledStore::new());
    let (tier, keys, victims, first, mut h) = sweep_with_first_delete_held(&s, 600.0).await;
    let v = *victims.last().unwrap();
    let t0 = tokio::time::Instant::now();
    let r = obj_store(&tier, &[v]).await;
    assert!(r.is_success(), "{:?}", r.failed);
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "it waited for the held DELETE"
    );
    assert_eq!(tier.holds(&v), Some(true));
    first.open();
    s.release(Op::Delete);
    wait_sweeps_done(&tier).await;
    tier.sweep_now().await;
    h.take(&tier);
    assert_eq!(h.last(&v), Some(false));
    assert!(found(&tier, v).await, "reported stored last, then lost");
    if let Some(e) = under_count(&tier, &s) {
        panic!("{e}");
    }
    assert!(tier.stats().bytes <= 8 * BS as u64, "{:?}", tier.stats());
    for k in &keys {
        if h.last(k) == Some(false) {
            assert!(found(&tier, *k).await, "{k} reported stored, then missing");
        }
    }
}
