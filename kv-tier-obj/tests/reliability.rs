//! The obj tier keeps its promises under slow, stuck and cancelled requests, outside
//! deletes, sweeps and shutdown. Requests are held at gates of a controlled store; deadlines
//! run on tokio's paused clock where a test waits for one, so nothing here sleeps.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::{BS, ns, store, tier_on};
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::{ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::{load_keys, store_keys, test_key, verify_block};
use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;

fn cfg() -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    c
}

fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. })
}

#[tokio::test(start_paused = true)]
async fn a_store_past_its_deadline_frees_its_key_for_the_next_store() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, cfg()).await;
    let k = test_key(1);
    s.hold(Op::Put);
    let res = store(&tier, &[k]).await; // the PUT never answers: its deadline passes
    assert_eq!(res.failed_keys(), vec![k]);
    assert!(is_timeout(&res.failed[0].1), "{}", res.failed[0].1);
    s.release(Op::Put);
    let res = store(&tier, &[k]).await;
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
    let tier = tier_on(&s, cfg()).await;
    let (k1, k2, k3) = (test_key(1), test_key(2), test_key(3));
    s.hold_path(Op::Put, &tier.object_path(&k2));
    let res = store(&tier, &[k1, k2, k3]).await;
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
    let mut c = cfg();
    c.io_threads = 1; // one PUT at a time: a job of n blocks takes n PUTs in a row
    let tier = tier_on(&s, c).await;
    s.delay(Op::Put, Duration::from_millis(700)); // each PUT well within its 1 s attempt
    let keys: Vec<_> = (0..6).map(test_key).collect();
    let started = tokio::time::Instant::now();
    let res = store(&tier, &keys).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(started.elapsed() >= Duration::from_millis(6 * 700));
    let (res, data) = load_keys(&*tier, &keys, BS).await;
    assert!(res.is_success());
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_after_an_outside_delete_writes_the_object() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    let k = test_key(1);
    assert!(store(&tier, &[k]).await.is_success());
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![true]); // cached
    // a lifecycle rule or another instance's GC deletes it
    let path = tier.object_path(&k);
    s.inner
        .delete(&object_store::path::Path::from(path.clone()))
        .await
        .unwrap();
    let res = store(&tier, &[k]).await;
    assert!(res.is_success());
    assert!(
        s.exists(&path).await,
        "the store reported success without the object existing"
    );
    let (res, data) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success() && verify_block(&k, 0, &data[0].1));
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
        assert!(store(&tier, &[*k]).await.is_success()); // ascending age, at the cap
    }
    let deletes = s.hold(Op::Delete);
    assert!(store(&tier, &keys[4..]).await.is_success()); // over: a sweep starts
    deletes.wait_arrived(1).await; // it chose the oldest (keys 0..3) and is deleting them
    let k = keys[0];
    // A lookup while the delete is in flight must not cache "present" for later.
    let _ = tier.lookup(&[k]).await.unwrap();
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { store(&t2, &[k]).await });
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

#[tokio::test(start_paused = true)]
async fn a_lookup_answers_within_its_deadline_when_the_store_never_answers() {
    let s = Arc::new(ControlledStore::new());
    let mut c = cfg();
    c.lookup_timeout_s = 1.0;
    c.request_timeout_s = 600.0;
    let tier = tier_on(&s, c).await;
    s.hold(Op::Head);
    let keys: Vec<_> = (0..16).map(test_key).collect();
    let started = tokio::time::Instant::now();
    let found = tier.lookup(&keys).await.unwrap();
    assert_eq!(found, vec![false; 16]);
    assert_eq!(started.elapsed(), Duration::from_secs(1));
    assert_eq!(tier.stats().lookup_timeouts, 1);
    // the cancelled HEADs released their permits: later requests run
    s.release(Op::Head);
    assert!(store(&tier, &keys[..1]).await.is_success());
    assert_eq!(tier.lookup(&keys[..2]).await.unwrap(), vec![true, false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_to_a_black_holed_endpoint_fails_within_the_request_deadline() {
    // accepts connections and never answers; on a port whose digits hold "403" and "404"
    // (the diagnosis must not read them as HTTP statuses), else any port
    let mut listener = None;
    for port in [40403, 14034, 24035, 34036, 44037] {
        if let Ok(l) = tokio::net::TcpListener::bind(("127.0.0.1", port)).await {
            listener = Some(l);
            break;
        }
    }
    let listener = match listener {
        Some(l) => l,
        None => tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let addr = listener.local_addr().unwrap();
    let _hole = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((sock, _)) = listener.accept().await {
            held.push(sock);
        }
    });
    let mut c = ObjTierConfig::new("b");
    c.endpoint_override = Some(format!("http://{addr}"));
    c.scheme = kv_tier_obj::Scheme::Http;
    c.access_key = Some("a".into());
    c.secret_key = Some("s".into());
    c.request_timeout_s = 0.2;
    c.max_retries = 0;
    let deadline = c.request_deadline();
    let started = std::time::Instant::now();
    let err = ObjTier::connect("obj", c, ns(), BS).await.unwrap_err();
    assert!(err.to_string().contains("endpoint"), "{err}");
    // a generous outer bound (this is not a timing test): it did not take minutes
    assert!(started.elapsed() < deadline * 10, "{:?}", started.elapsed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_fails_at_startup_saying_so() {
    use common::S3ServerExt as _;
    let server = common::S3Server::start().await;
    let mut c = server.config();
    c.bucket = "no-such-bucket".into();
    c.request_timeout_s = 60.0; // a loaded machine must not turn this into "unreachable"
    let err = ObjTier::connect("obj", c, ns(), BS).await.unwrap_err();
    assert!(
        err.to_string().contains("the bucket does not exist"),
        "{err}"
    );
}

#[tokio::test(start_paused = true)]
async fn shutdown_stops_and_awaits_background_sweeps() {
    let s = Arc::new(ControlledStore::new());
    let mut c = cfg();
    c.max_size_gb = Some((4 * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = 0.5;
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(store(&tier, &[*k]).await.is_success());
    }
    let deletes = s.hold(Op::Delete);
    assert!(store(&tier, &keys[4..]).await.is_success()); // a sweep starts
    deletes.wait_arrived(1).await;
    assert_eq!(tier.sweeps_running(), 1);
    tier.shutdown().await.unwrap();
    assert_eq!(tier.sweeps_running(), 0, "shutdown left a sweep running");
    // later calls fail cleanly
    let res = store(&tier, &[test_key(9)]).await;
    assert!(matches!(res.failed[0].1, Error::Shutdown { .. }));
    assert!(matches!(
        tier.lookup(&keys).await.unwrap_err(),
        Error::Shutdown { .. }
    ));
    let (res, _) = load_keys(&*tier, &keys[..1], BS).await;
    assert!(matches!(res.failed[0].1, Error::Shutdown { .. }));
}

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
        tokio::spawn(async move { store(&t, &[k]).await })
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
    let c3 = tokio::spawn(async move { store(&t3, &[other]).await });
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
    assert!(store(&tier, &[k, other]).await.is_success());
    let (res, data) = load_keys(&*tier, &[k, other], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert_eq!(tier.lookup(&[k, other]).await.unwrap(), vec![true, true]);
}

/// Every numeric option, at values across and beyond its range (as JSON a user could write):
/// parsing either refuses it naming the field, or the tier opens; nothing panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_config_that_deserialises_makes_open_panic() {
    let mut opened = 0;
    for &(field, _, _) in kv_tier_obj::RANGES {
        for &v in kv_tier_testkit::CONFIG_NUMBERS {
            // the shared bucket's options, on a shared bucket
            let shared = if field.starts_with("shared_") {
                r#", "shared": true, "max_size_gb": 1"#
            } else {
                ""
            };
            let json = format!(r#"{{"bucket": "b", "{field}": {v}{shared}}}"#);
            let mut spec = kv_tier_core::TierSpec::new("obj");
            spec.options = serde_json::from_str::<serde_json::Value>(&json)
                .unwrap()
                .as_object()
                .unwrap()
                .clone();
            let cfg = match ObjTierConfig::from_spec(&spec) {
                Ok(c) => c,
                Err(Error::InvalidConfig { field: f, reason }) => {
                    assert_eq!(f, field, "{json}: {reason}");
                    continue;
                }
                Err(e) => panic!("{json}: {e}"),
            };
            let store: Arc<dyn ObjectStore> = Arc::new(object_store::memory::InMemory::new());
            let open = tokio::spawn(async move {
                let t = ObjTier::with_store("obj", store, cfg, ns(), BS).await?;
                let k = test_key(1);
                // a shared bucket's first credit comes a few coordination ticks after open
                let until = std::time::Instant::now() + Duration::from_secs(15);
                loop {
                    let res = store_keys(&t, &[k], 0, BS).await;
                    if res.is_success() {
                        break;
                    }
                    assert!(
                        std::time::Instant::now() < until
                            && matches!(res.failed[0].1, Error::NoSpace { .. }),
                        "{:?}",
                        res.failed
                    );
                }
                t.lookup(&[k]).await?;
                t.shutdown().await
            });
            match open.await {
                Ok(Ok(())) => opened += 1,
                Ok(Err(e)) => panic!("{json}: a valid config failed: {e}"),
                Err(e) => panic!("{json}: open or use panicked: {e}"),
            }
        }
    }
    assert!(opened > 10, "too few configs opened: {opened}");
}

/// Values that reach request lines, headers and signatures are checked at construction:
/// refused naming their field, and `connect` never panics on what passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_credentials_and_bucket_are_refused_naming_the_field_never_panicking() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    drop(l); // connections are refused from now on
    let ep = format!("http://127.0.0.1:{port}");
    let bad: &[(&str, &str, &str)] = &[
        ("endpoint_override", "\"http://\"", "endpoint_override"),
        ("endpoint_override", "\"http://[\"", "endpoint_override"),
        (
            "endpoint_override",
            "\"http://127.0.0.1:99999\"",
            "endpoint_override",
        ),
        (
            "endpoint_override",
            "\"http://127.0.0.1:1/a b\"",
            "endpoint_override",
        ),
        (
            "endpoint_override",
            "\"http://127.0.0.1:1?x=1#f\"",
            "endpoint_override",
        ),
        (
            "endpoint_override",
            "\"https://u:p@127.0.0.1:1\"",
            "endpoint_override",
        ),
        ("region", "\"a\\nb\"", "region"),
        ("region", "\"\\u0000\"", "region"),
        ("session_token", "\"\\n\"", "session_token"),
        ("access_key", "\"a\\n\"", "access_key"),
        ("bucket", "\"\\u0000\"", "bucket"),
        ("bucket", "\"b/c\"", "bucket"),
    ];
    for (key, value, field) in bad {
        let mut json = serde_json::json!({
            "bucket": "b", "access_key": "a", "secret_key": "s", "scheme": "http",
            "endpoint_override": ep, "request_timeout_s": 0.05, "max_retries": 0
        });
        json[*key] = serde_json::from_str(value).unwrap();
        let mut spec = kv_tier_core::TierSpec::new("obj");
        spec.options = json.as_object().unwrap().clone();
        match ObjTierConfig::from_spec(&spec) {
            Err(Error::InvalidConfig { field: f, .. }) => assert_eq!(&f, field, "{json}"),
            other => panic!("{json}: {other:?}"),
        }
    }
    // what passes connects or fails cleanly (here: refused connections), never panics
    for extra in [
        serde_json::json!({}),
        serde_json::json!({"region": ""}),
        serde_json::json!({"prefix": "a/../b"}),
        serde_json::json!({"endpoint_override": format!("{ep}/some/path")}),
    ] {
        let mut json = serde_json::json!({
            "bucket": "b", "access_key": "a", "secret_key": "s", "scheme": "http",
            "endpoint_override": ep, "request_timeout_s": 0.05, "max_retries": 0
        });
        for (k, v) in extra.as_object().unwrap() {
            json[k] = v.clone();
        }
        let mut spec = kv_tier_core::TierSpec::new("obj");
        spec.options = json.as_object().unwrap().clone();
        let cfg = ObjTierConfig::from_spec(&spec).unwrap();
        let joined =
            tokio::spawn(async move { ObjTier::connect("obj", cfg, ns(), BS).await }).await;
        assert!(matches!(joined, Ok(Err(_))), "{json}: {joined:?}");
    }
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

/// Work a dropped store did is still reported: the objects it wrote have their events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_store_still_reports_what_it_stored() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    let (k1, k2) = (test_key(1), test_key(2));
    let held = s.hold_path(Op::Put, &tier.object_path(&k2));
    let t = tier.clone();
    let job = tokio::spawn(async move { store(&t, &[k1, k2]).await });
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
