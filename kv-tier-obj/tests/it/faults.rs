//! Requests that fail, hang or time out: every job ends within its request deadline with the
//! keys named, completed work is reported, server errors are retried, and nothing is wedged
//! once the backend answers again. On a controlled store, on the S3 test server, and on that
//! server behind a TCP proxy that black-holes, drops, resets or answers 503.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_obj::{ObjChecksum, ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::{BodyFault, ControlledStore, Op, PutFault};
use kv_tier_testkit::{load_keys, test_key, verify_block};

use crate::support::*;

#[tokio::test(start_paused = true)]
async fn a_store_past_its_deadline_frees_its_key_for_the_next_store() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, one_second()).await;
    let k = test_key(1);
    s.hold(Op::Put);
    let res = obj_store(&tier, &[k]).await; // the PUT never answers: its deadline passes
    assert_eq!(res.failed_keys(), vec![k]);
    assert!(is_timeout(&res.failed[0].1), "{}", res.failed[0].1);
    s.release(Op::Put);
    let res = obj_store(&tier, &[k]).await;
    assert!(
        res.is_success(),
        "the key is wedged after a timed-out upload: {:?}",
        res.failed
    );
    assert!(s.exists(&tier.object_path(&k)).await);
    assert!(!tier.is_protected(&k));
}

#[tokio::test(start_paused = true)]
async fn a_timed_out_job_reports_the_keys_whose_put_completed_as_stored() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, one_second()).await;
    let (k1, k2, k3) = (test_key(1), test_key(2), test_key(3));
    s.hold_path(Op::Put, &tier.object_path(&k2));
    let res = obj_store(&tier, &[k1, k2, k3]).await;
    let mut ok = res.ok.clone();
    ok.sort();
    let mut want = vec![k1, k3];
    want.sort();
    assert_eq!(ok, want, "completed PUTs must be reported stored");
    assert_eq!(res.failed_keys(), vec![k2]);
    assert!(is_timeout(&res.failed[0].1));
    assert!(s.exists(&tier.object_path(&k1)).await);
}

#[tokio::test(start_paused = true)]
async fn a_job_deadline_scales_with_its_blocks() {
    let s = Arc::new(ControlledStore::new());
    let mut c = one_second();
    c.io_threads = 1; // one PUT at a time: a job of n blocks takes n PUTs in a row
    let tier = tier_on(&s, c).await;
    s.delay(Op::Put, Duration::from_millis(700)); // each PUT well within its 1 s attempt
    let keys: Vec<_> = (0..6).map(test_key).collect();
    let started = tokio::time::Instant::now();
    let res = obj_store(&tier, &keys).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(started.elapsed() >= Duration::from_millis(6 * 700));
    let (res, data) = load_keys(&*tier, &keys, BS).await;
    assert!(res.is_success());
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

#[tokio::test(start_paused = true)]
async fn held_requests_fail_within_the_deadline_naming_op_and_key() {
    let s = Arc::new(ControlledStore::new());
    let cfg = checked_half_second();
    let deadline = {
        let c = cfg.clone();
        c.validate().unwrap();
        c.request_deadline()
    };
    let tier = tier_on(&s, cfg).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(obj_store(&*tier, &[a]).await.is_success());
    let _p = s.hold(Op::Put);
    let _h = s.hold(Op::Head);
    let t0 = tokio::time::Instant::now();
    let res = obj_store(&*tier, &[b]).await;
    assert!(
        t0.elapsed() <= deadline * 2 + Duration::from_millis(100),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(res.failed_keys(), vec![b]);
    let msg = res.failed[0].1.to_string();
    assert!(
        msg.contains("PUT") || msg.contains("HEAD"),
        "no op named: {msg}"
    );
    assert!(names(&res.failed[0].1, &tier, &b), "no key named: {msg}");
    let _g = s.hold(Op::Get);
    let t0 = tokio::time::Instant::now();
    let (res, _) = load_keys(&*tier, &[a], BS).await;
    assert!(t0.elapsed() <= deadline + Duration::from_millis(100));
    let msg = res.failed[0].1.to_string();
    assert!(msg.contains("GET"), "no op named: {msg}");
    assert!(names(&res.failed[0].1, &tier, &a), "no key named: {msg}");
    s.release_all();
    // nothing wedged
    assert!(obj_store(&*tier, &[b]).await.is_success());
    assert!(load_keys(&*tier, &[a, b], BS).await.0.is_success());
    assert!(!tier.is_protected(&a) && !tier.is_protected(&b));
}

/// A GET whose body stops half way and never ends: that key fails within the request
/// deadline, the other key of the job loads, and the key loads once the body flows again.
#[tokio::test(start_paused = true)]
async fn a_get_body_that_hangs_half_way_fails_alone_within_the_deadline() {
    let e = Arc::new(ControlledStore::new());
    let cfg = checked_half_second();
    let deadline = {
        let c = cfg.clone();
        c.validate().unwrap();
        c.request_deadline()
    };
    let tier = tier_on(&e, cfg).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(obj_store(&*tier, &[a, b]).await.is_success());
    e.break_bodies(&tier.object_path(&b), Some(BodyFault::Hang));
    let t0 = tokio::time::Instant::now();
    let (res, data) = load_keys(&*tier, &[a, b], BS).await;
    let took = t0.elapsed();
    assert!(
        took <= deadline + Duration::from_millis(100),
        "load took {took:?}, deadline {deadline:?}"
    );
    assert_eq!(res.ok, vec![a], "failed: {:?}", res.failed);
    assert_eq!(res.failed_keys(), vec![b]);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    let err = &res.failed[0].1;
    assert!(names(err, &tier, &b), "error does not name the key: {err}");
    e.break_bodies(&tier.object_path(&b), None);
    let (res, data) = load_keys(&*tier, &[b], BS).await;
    assert!(
        res.is_success(),
        "nothing should be wedged: {:?}",
        res.failed
    );
    assert!(verify_block(&b, 0, &data[0].1));
}

/// With every deadline at its default, the obj tier's own deadlines end its calls before the
/// manager's do, so the tier reports exactly what it did: a stuck PUT fails alone, the
/// others are stored (and reported as such, with their events), and a slow HEAD costs only
/// its own key.
#[tokio::test(start_paused = true)]
async fn with_default_deadlines_the_tier_reports_before_the_manager_gives_up() {
    let obj = ObjTierConfig::new("mem");
    let mgr = kv_tier_core::KvTierConfig::new((16 * BS) as u64, BS as u64);
    assert!(obj.request_deadline() < mgr.job_timeout(1));
    assert!(obj.lookup_timeout_s < mgr.probe_timeout_s);
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, obj).await;
    let cpu = Arc::new(
        kv_tier_cpu::CpuTier::new(kv_tier_cpu::CpuTierConfig {
            capacity_bytes: (16 * BS) as u64,
            block_size: BS,
            policy: kv_tier_core::EvictionPolicy::Lru,
            prefault: false,
        })
        .unwrap(),
    );
    let m = kv_tier_core::TieringManager::builder(mgr)
        .primary(cpu)
        .tier_with_options(
            tier.clone(),
            kv_tier_core::TierOptions::default().with_events(),
        )
        .build()
        .await
        .unwrap();
    let keys: Vec<_> = (0..4).map(test_key).collect();
    s.hold_path(Op::Put, &tier.object_path(&keys[2]));
    let mut p = m.prepare_store(&keys).unwrap();
    for (k, sink) in p.slots() {
        kv_tier_testkit::fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(kv_tier_core::RequestId(1));
    m.wait_idle().await;
    let ts = &m.stats().tiers[0];
    assert_eq!(
        (ts.blocks_stored, ts.store_failures, ts.jobs_timed_out),
        (3, 1, 0)
    );
    assert_eq!(ts.store_failure_causes.timed_out, 1);
    let stored: Vec<BlockKey> = m
        .take_events()
        .into_iter()
        .filter(|e| e.tier == "obj" && !e.removed)
        .flat_map(|e| e.keys)
        .collect();
    assert_eq!(stored.len(), 3);
    s.release(Op::Put);
    // a lookup with one slow HEAD: the others answer
    tier.clear_exists_cache();
    s.hold_path(Op::Head, &tier.object_path(&keys[0]));
    let found = tier.lookup(&keys).await.unwrap();
    assert_eq!(found, vec![false, true, false, true]);
}

/// A PUT that lands and then answers an error (its reply lost), and one that leaves half a
/// body without metadata and fails: never a false success; the key stores later and loads.
#[tokio::test(start_paused = true)]
async fn puts_that_fail_after_landing_or_half_way_then_the_key_recovers() {
    let e = Arc::new(ControlledStore::new());
    let tier = tier_on(&e, checked_half_second()).await;
    let (a, b) = (test_key(1), test_key(2));
    e.fail_puts(PutFault::ReplyLost, "", usize::MAX);
    let res = obj_store(&*tier, &[a]).await;
    if res.is_success() {
        assert!(exists(&e.inner, &tier.object_path(&a)).await);
    }
    e.fail_puts(PutFault::HalfWritten, "", usize::MAX);
    let res = obj_store(&*tier, &[b]).await;
    assert!(
        !res.is_success(),
        "a PUT that failed half way was reported stored"
    );
    assert!(names(&res.failed[0].1, &tier, &b), "{}", res.failed[0].1);
    e.stop_failing_puts();
    let res = obj_store(&*tier, &[a, b]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = load_keys(&*tier, &[a, b], BS).await;
    assert!(
        res.is_success(),
        "a later store of the key did not leave a readable block: {:?}",
        res.failed
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_answering_503_for_a_while_is_retried() {
    let server = S3Server::start().await;
    // (no existence listing: its LISTs would take some of the 503s)
    let tier = server.tier(heads_only(server.config())).await;
    let keys: Vec<_> = (0..4).map(test_key).collect();
    let sent = |tier: &ObjTier| tier.stats().http_attempts;
    let seen = || server.requests.load(std::sync::atomic::Ordering::SeqCst) as u64;
    // every request the server saw was one the tier's client sent (its startup probe too)
    assert_eq!(sent(&tier), seen());
    assert_eq!(tier.stats().http_retryable_failures, 0);
    server.fail_next(3);
    let res = obj_store(&tier, &keys).await;
    assert!(res.is_success(), "{:?}", res.failed);
    // the three 503s were each retried and counted
    assert_eq!(tier.stats().http_retryable_failures, 3);
    assert_eq!(sent(&tier), seen());
    server.fail_next(2);
    let (res, data) = load_keys(&tier, &keys, BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert_eq!(tier.stats().http_retryable_failures, 5);
    assert_eq!(sent(&tier), seen());
    assert_eq!(
        tier.stats().blocks.store_failures + tier.stats().blocks.load_failures,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_server_fails_jobs_within_their_deadline_and_lookups_miss() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.request_timeout_s = 1.0;
    cfg.max_retries = 1;
    let tier = server.tier(cfg).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    tier.clear_exists_cache();
    server.stop().await;
    // A generous outer bound: the job's own deadline is about 3 s.
    let bound = Duration::from_secs(30);
    let res = tokio::time::timeout(bound, obj_store(&tier, &[test_key(2)]))
        .await
        .expect("store hung");
    assert_eq!(res.failed.len(), 1);
    assert!(res.failed[0].1.is_transient(), "{}", res.failed[0].1);
    let (res, _) = tokio::time::timeout(bound, load_keys(&tier, &[k], BS))
        .await
        .expect("load hung");
    assert_eq!(res.failed.len(), 1);
    // the refused connections were attempts the client retried (up to max_retries each)
    assert!(
        tier.stats().http_retryable_failures >= 2,
        "{:?}",
        tier.stats()
    );
    let probe = tokio::time::timeout(bound, tier.lookup(&[k, test_key(3)]))
        .await
        .expect("lookup hung");
    assert!(probe.is_err() || probe.unwrap().iter().all(|b| !b));
}

/// A server that stops answering (connections open, nothing comes back): store, load and
/// lookup end within their deadlines with errors naming the key; once it answers again,
/// the same keys store and load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_black_hole_then_recovery() {
    let server = S3Server::start().await;
    let proxy = Proxy::start(&server.endpoint).await;
    let (tier, deadline) = proxied(&server, &proxy, 0.5, 1).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(obj_store(&tier, &[a]).await.is_success());
    proxy.set(Mode::Blackhole);
    let t0 = Instant::now();
    let res = obj_store(&tier, &[b]).await;
    let took = t0.elapsed();
    assert!(
        took <= deadline + DEADLINE_SLACK,
        "store took {took:?} (deadline {deadline:?})"
    );
    assert_eq!(res.failed_keys(), vec![b]);
    assert!(names(&res.failed[0].1, &tier, &b), "{}", res.failed[0].1);
    let t0 = Instant::now();
    let (res, _) = load_keys(&tier, &[a], BS).await;
    assert!(
        t0.elapsed() <= deadline + DEADLINE_SLACK,
        "load took {:?}",
        t0.elapsed()
    );
    assert_eq!(res.failed_keys(), vec![a]);
    assert!(names(&res.failed[0].1, &tier, &a), "{}", res.failed[0].1);
    tier.clear_exists_cache();
    let t0 = Instant::now();
    let l = tier.lookup(&[a, b]).await;
    assert!(
        t0.elapsed() <= Duration::from_millis(400) + DEADLINE_SLACK,
        "lookup took {:?}",
        t0.elapsed()
    );
    assert!(l.is_err() || l.unwrap() == vec![false, false]);
    proxy.set(Mode::Pass);
    // 0.5 s tries: on a loaded machine one may still time out; the store and load succeed
    // again within a few (bounded)
    let res = until_stored(&tier, &[b]).await;
    assert!(res.is_success(), "after recovery: {:?}", res.failed);
    let (res, data) = until_loaded(&tier, &[a, b]).await;
    assert!(res.is_success(), "after recovery: {:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    tokio::time::timeout(Duration::from_secs(10), tier.shutdown())
        .await
        .unwrap()
        .unwrap();
}

/// PUTs whose replies are lost (the connection drops after the request reached the server),
/// and PUTs whose connection is reset before anything lands: a reported store always has its
/// object; the key stores and loads later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_connections_dropping_around_puts() {
    let server = S3Server::start().await;
    let proxy = Proxy::start(&server.endpoint).await;
    let (tier, deadline) = proxied(&server, &proxy, 1.0, 2).await;
    for (i, mode) in [Mode::DropReply, Mode::Reset].into_iter().enumerate() {
        let keys: Vec<_> = (0..3).map(|j| test_key(10 * i as u64 + j)).collect();
        proxy.set(mode);
        let t0 = Instant::now();
        let res = obj_store(&tier, &keys).await;
        assert!(
            t0.elapsed() <= deadline + Duration::from_secs(1),
            "{mode:?}: {:?}",
            t0.elapsed()
        );
        proxy.set(Mode::Pass);
        for k in &res.ok {
            assert!(
                sdk_exists(&server, &tier.object_path(k)).await,
                "{mode:?}: {k} reported stored, no object"
            );
        }
        if mode == Mode::Reset {
            assert!(
                res.ok.is_empty(),
                "{mode:?}: nothing could land, yet {:?} stored",
                res.ok
            );
        }
        for (k, e) in &res.failed {
            assert!(names(e, &tier, k), "{mode:?}: {e}");
        }
        let res = obj_store(&tier, &keys).await;
        assert!(res.is_success(), "{mode:?}: later store: {:?}", res.failed);
        let (res, data) = load_keys(&tier, &keys, BS).await;
        assert!(res.is_success(), "{mode:?}: {:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    }
}

/// Every request answered 503 SlowDown: the job fails within the deadline (retries
/// included), naming the key; a few SlowDowns are retried through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_slowdown_forever_then_a_few() {
    let server = S3Server::start().await;
    let proxy = Proxy::start(&server.endpoint).await;
    let (tier, deadline) = proxied(&server, &proxy, 0.5, 2).await;
    let (a, b) = (test_key(1), test_key(2));
    proxy.set(Mode::SlowDown);
    let t0 = Instant::now();
    let res = obj_store(&tier, &[a]).await;
    let took = t0.elapsed();
    assert!(took <= deadline + DEADLINE_SLACK, "{took:?} > {deadline:?}");
    assert_eq!(res.failed_keys(), vec![a]);
    assert!(res.failed[0].1.is_transient(), "{}", res.failed[0].1);
    assert!(names(&res.failed[0].1, &tier, &a), "{}", res.failed[0].1);
    assert!(!sdk_exists(&server, &tier.object_path(&a)).await);
    proxy.set(Mode::Pass);
    server.fail_next(2);
    // two SlowDowns, two retries: retried through (a loaded machine's slow try may cost one
    // more round, bounded)
    let res = until_stored(&tier, &[a, b]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = until_loaded(&tier, &[a, b]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// A server slower than every attempt's timeout: jobs end within the deadline; the PUTs
/// that land late do no harm; at normal speed the same keys store and load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_slow_server() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.checksum = ObjChecksum::Crc32c;
    cfg.request_timeout_s = 0.3;
    cfg.max_retries = 1;
    let c = cfg.clone();
    c.validate().unwrap();
    let deadline = c.request_deadline();
    let tier = server.tier(cfg).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    server.set_latency(Duration::from_secs(2));
    let t0 = Instant::now();
    let res = obj_store(&tier, &keys).await;
    assert!(
        t0.elapsed() <= deadline + DEADLINE_SLACK,
        "{:?} > {deadline:?}",
        t0.elapsed()
    );
    assert!(res.ok.is_empty(), "{:?}", res.ok);
    server.set_latency(Duration::ZERO);
    // the server's 2 s latency passes: late PUTs land (if the server runs them at all)
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let res = until_stored(&tier, &keys).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = until_loaded(&tier, &keys).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}
