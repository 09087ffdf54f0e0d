//! Shutdown: it stops and awaits background sweeps, ends with requests hung forever, is done
//! once (a second call writes nothing), and later calls fail with `Shutdown`.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{Error, SecondaryTier};
use kv_tier_obj::ObjTierConfig;
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, test_key};

use crate::support::*;

#[tokio::test(start_paused = true)]
async fn shutdown_stops_and_awaits_background_sweeps() {
    let s = Arc::new(ControlledStore::new());
    let mut c = one_second();
    c.max_size_gb = Some((4 * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = 0.5;
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    let deletes = s.hold(Op::Delete);
    assert!(obj_store(&tier, &keys[4..]).await.is_success()); // a sweep starts
    deletes.wait_arrived(1).await;
    assert_eq!(tier.sweeps_running(), 1);
    tier.shutdown().await.unwrap();
    assert_eq!(tier.sweeps_running(), 0, "shutdown left a sweep running");
    // later calls fail cleanly
    let res = obj_store(&tier, &[test_key(9)]).await;
    assert!(matches!(res.failed[0].1, Error::Shutdown { .. }));
    assert!(matches!(
        tier.lookup(&keys).await.unwrap_err(),
        Error::Shutdown { .. }
    ));
    let (res, _) = load_keys(&*tier, &keys[..1], BS).await;
    assert!(matches!(res.failed[0].1, Error::Shutdown { .. }));
}

/// Shutdown while a sweep's DELETEs are held (short deadline, paused clock).
#[tokio::test(start_paused = true)]
async fn shutdown_mid_sweep() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(4)).await;
    let mut h = History::default();
    let keys: Vec<_> = (0..6).map(test_key).collect();
    for k in &keys {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    s.hold(Op::Delete);
    for i in 6..9 {
        assert!(obj_store(&tier, &[test_key(i)]).await.is_success());
    }
    tier.shutdown().await.unwrap();
    s.release(Op::Delete);
    h.take(&tier);
    assert!(tier.stats().bytes >= present_bytes(&s.inner));
    // reopen over the same store: keys not reported removed are there
    let t2 = tier_on(&s, bounded_checked_1s(4)).await;
    for i in 0..9 {
        let k = test_key(i);
        if h.last(&k) != Some(true) {
            assert!(found(&t2, k).await, "{i} lost");
        }
    }
    assert!(t2.stats().bytes >= present_bytes(&s.inner));
}

#[tokio::test(start_paused = true)]
async fn shutdown_with_requests_hung_forever() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = bounded_checked_2s(64, 0.5);
    cfg.request_timeout_s = 30.0;
    let tier = tier_on(&s, cfg).await;
    let a = test_key(1);
    assert!(obj_store(&*tier, &[a]).await.is_success());
    s.hold_all();
    let started = s.started();
    let t1 = tier.clone();
    let st = tokio::spawn(async move { obj_store(&*t1, &[test_key(2)]).await });
    let t2 = tier.clone();
    let ld = tokio::spawn(async move { load_keys(&*t2, &[a], BS).await });
    wait_until_async("the store and the load in flight", SETTLE_LIMIT, || {
        s.started() >= started + 2
    })
    .await;
    let r = tokio::time::timeout(Duration::from_secs(120), tier.shutdown()).await;
    assert!(r.is_ok(), "shutdown hung with requests in flight");
    // a bounded tier saves its recency order at shutdown: bounded by one request deadline
    let r2 = tokio::time::timeout(Duration::from_secs(40), tier.shutdown()).await;
    assert!(r2.is_ok(), "a second shutdown hung");
    let r = obj_store(&*tier, &[test_key(3)]).await;
    assert!(
        matches!(r.failed.first(), Some((_, Error::Shutdown { .. }))),
        "{r:?}"
    );
    assert!(matches!(
        tier.lookup(&[a]).await,
        Err(Error::Shutdown { .. })
    ));
    s.release_all();
    let st = tokio::time::timeout(Duration::from_secs(300), st).await;
    let ld = tokio::time::timeout(Duration::from_secs(300), ld).await;
    assert!(st.is_ok() && ld.is_ok(), "in-flight calls never ended");
}

/// Shutdown is done once: a second call ("later calls fail with `Shutdown`") does no more
/// I/O. Observed: every shutdown of a bounded tier PUTs its recency snapshot again, so a
/// repeated shutdown against a backend that stopped answering waits a whole request deadline
/// each time, and a late repeat rewrites the snapshot.
#[tokio::test(start_paused = true)]
async fn a_second_shutdown_writes_nothing() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_2s(64, 0.5)).await;
    assert!(obj_store(&*tier, &[test_key(1)]).await.is_success());
    tier.shutdown().await.unwrap();
    let puts = s.count(Op::Put);
    let _ = tier.shutdown().await;
    assert_eq!(
        s.count(Op::Put) - puts,
        0,
        "a second shutdown PUT the recency snapshot again"
    );
}

/// Shutdown while a relist's LIST is held and stores run: shutdown ends, later calls fail
/// with Shutdown, holds answers nothing, and nothing is left in flight past the LIST's
/// deadline.
#[tokio::test(start_paused = true)]
async fn shutdown_during_a_held_list_and_stores() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = ObjTierConfig::new("mem");
    cfg.absent_ttl_s = 2.0;
    cfg.request_timeout_s = 5.0;
    cfg.max_retries = 0;
    cfg.io_threads = 1;
    let tier = tier_on(&s, cfg.clone()).await;
    wait_until_async("a listing", SETTLE_LIMIT, || tier.stats().listings >= 1).await;
    let lists = s.hold_lists();
    lists.wait_arrived(1).await;
    let put = s.hold(Op::Put);
    let t = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&*t, &[test_key(1)]).await });
    put.wait_arrived(1).await;
    tokio::time::timeout(cfg.request_deadline(), tier.shutdown())
        .await
        .expect("shutdown waited past a request deadline")
        .unwrap();
    s.release(Op::Put);
    let r = storing.await.unwrap();
    let _ = r;
    assert!(matches!(
        tier.lookup(&[test_key(1)]).await,
        Err(Error::Shutdown { .. })
    ));
    assert_eq!(tier.holds(&test_key(1)), None);
    s.release_lists();
    tokio::time::sleep(Duration::from_secs(30)).await;
    let listings = tier.stats().listings;
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(tier.stats().listings, listings, "a listing after shutdown");
}

/// A shutdown dropped while it awaits a sweep whose DELETE is held: no key stays "being
/// deleted", a second shutdown ends, and the reopened tier's index matches the store.
#[tokio::test(start_paused = true)]
async fn a_shutdown_dropped_mid_sweep_then_shutdown_again() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(4);
    c.request_timeout_s = 5.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c.clone()).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    let del = s.hold(Op::Delete);
    assert!(obj_store(&tier, &keys[4..]).await.is_success());
    del.wait_arrived(1).await;
    assert!(
        tokio::time::timeout(Duration::from_millis(10), tier.shutdown())
            .await
            .is_err()
    );
    s.release(Op::Delete);
    tokio::time::timeout(c.request_deadline() * 2, tier.shutdown())
        .await
        .expect("the second shutdown did not end")
        .unwrap();
    for k in &keys {
        assert_eq!(tier.holds(k), None, "closed");
    }
    let again = tier_on(&s, c).await;
    for k in &keys {
        let there = s.exists(&tier.object_path(k)).await;
        assert_eq!(again.holds(k), Some(there), "{k}");
    }
}

/// Shutdown of a bounded tier (io_threads 1) while several store jobs queue behind a held PUT
/// and a sweep's DELETE is held: shutdown ends (within a few request deadlines of tokio's
/// clock), and no store hangs.
#[tokio::test(start_paused = true)]
async fn shutdown_with_queued_stores_and_a_held_sweep_ends() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(4);
    c.request_timeout_s = 2.0;
    c.max_retries = 0;
    c.io_threads = 1;
    let deadline = c.request_deadline();
    let tier = tier_on(&s, c).await;
    for i in 0..4 {
        assert!(obj_store(&tier, &[test_key(i)]).await.is_success());
    }
    let _d = s.hold(Op::Delete);
    assert!(obj_store(&tier, &[test_key(4)]).await.is_success()); // over: a sweep
    let _p = s.hold(Op::Put);
    let mut jobs = Vec::new();
    for j in 0..4u64 {
        let t = tier.clone();
        let ks: Vec<_> = (0..3).map(|i| test_key(100 + j * 10 + i)).collect();
        jobs.push(tokio::spawn(async move { obj_store(&*t, &ks).await }));
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
    let t0 = tokio::time::Instant::now();
    tokio::time::timeout(deadline * 20, tier.shutdown())
        .await
        .expect("shutdown did not end")
        .unwrap();
    eprintln!("shutdown took {:?} (deadline {deadline:?})", t0.elapsed());
    for j in jobs {
        let _ = tokio::time::timeout(deadline * 20, j)
            .await
            .expect("a store hung past shutdown");
    }
    assert_eq!(tier.sweeps_running(), 0);
}

/// Shutdown while a sweep's per-victim DELETEs hang and a store of a victim waits for its
/// DELETE: shutdown ends, and so does the store.
#[tokio::test(start_paused = true)]
async fn shutdown_with_a_victims_store_waiting_for_hung_deletes_ends() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(4);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    c.io_threads = 1;
    let deadline = c.request_deadline();
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(obj_store(&tier, &[*k]).await.is_success());
    }
    let _d = s.hold(Op::Delete);
    assert!(obj_store(&tier, &keys[4..]).await.is_success()); // over: a sweep
    wait_until_async("a DELETE", SETTLE_LIMIT, || s.count(Op::Delete) >= 1).await;
    let t = tier.clone();
    let last = keys[2];
    let storing = tokio::spawn(async move { obj_store(&*t, &[last]).await });
    tokio::task::yield_now().await;
    let t0 = tokio::time::Instant::now();
    let r = tokio::time::timeout(deadline * 20, tier.shutdown()).await;
    assert!(
        r.is_ok(),
        "shutdown did not end within 20 request deadlines"
    );
    let r = tokio::time::timeout(deadline * 20, storing).await;
    assert!(r.is_ok(), "the store did not end");
    assert!(t0.elapsed() <= deadline * 20);
}
