//! Configuration and opening: bad options are refused naming their field (the shared bucket's
//! too), no config that deserialises makes open panic, the tier registers as `"obj"`, and the
//! startup probe says what is wrong (credentials, endpoint, missing bucket, no conditional
//! writes for a shared bucket).

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{Error, SecondaryTier};
use kv_tier_obj::{ObjTier, ObjTierConfig};
use kv_tier_testkit::{store_keys, test_key};
use object_store::ObjectStore;

use crate::support::*;

#[test]
fn every_bad_option_names_its_field() {
    let cases = [
        (r#"{}"#, "bucket"),
        (r#"{"bucket": ""}"#, "bucket"),
        (r#"{"bucket": "b", "io_threads": 0}"#, "io_threads"),
        (r#"{"bucket": "b", "scheme": "ftp"}"#, "scheme"),
        (r#"{"bucket": "b", "access_key": "a"}"#, "secret_key"),
        (r#"{"bucket": "b", "max_size_gb": -1}"#, "max_size_gb"),
        (r#"{"bucket": "b", "low_watermark": 2}"#, "low_watermark"),
        (
            r#"{"bucket": "b", "endpoint_override": "localhost:notaport"}"#,
            "endpoint_override",
        ),
        (
            r#"{"bucket": "b", "request_timeout_s": 0}"#,
            "request_timeout_s",
        ),
        (r#"{"bucket": "b", "prefix": "a//b"}"#, "prefix"),
        (r#"{"bucket": "b", "buckets": "x"}"#, "buckets"),
    ];
    for (json, want) in cases {
        let mut spec = kv_tier_core::TierSpec::new("obj");
        spec.options = serde_json::from_str::<serde_json::Value>(json)
            .unwrap()
            .as_object()
            .unwrap()
            .clone();
        match ObjTierConfig::from_spec(&spec).unwrap_err() {
            Error::InvalidConfig { field, .. } => assert_eq!(field, want, "{json}"),
            e => panic!("{json}: {e}"),
        }
    }
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

#[test]
fn out_of_range_and_malformed_shared_options_are_refused_naming_the_field() {
    let ok = shared_mem_cfg("a", blocks(16.0), 1.0);
    ok.validate().unwrap();
    let mut bad = Vec::new();
    for v in [
        0.0,
        0.0999,
        -1.0,
        600.001,
        1e9,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ] {
        let mut c = ok.clone();
        c.shared_lease_s = Some(v);
        match c.validate() {
            Err(e) if e.to_string().contains("shared_lease_s") => {}
            other => bad.push(format!("shared_lease_s {v}: {other:?}")),
        }
    }
    for v in [0.1, 600.0] {
        let mut c = ok.clone();
        c.shared_lease_s = Some(v);
        if let Err(e) = c.validate() {
            bad.push(format!("shared_lease_s {v} refused: {e}"));
        }
    }
    let long = "a".repeat(65);
    for id in [
        "",
        ".",
        "..",
        "a/b",
        "a b",
        "ä",
        "a\nb",
        "a:b",
        "*",
        long.as_str(),
        "a%2Fb",
    ] {
        let mut c = ok.clone();
        c.instance_id = Some(id.into());
        match c.validate() {
            Err(e) if e.to_string().contains("instance_id") => {}
            other => bad.push(format!("instance_id {id:?}: {other:?}")),
        }
    }
    for id in ["a", "A-b_c.9", &"z".repeat(64), "...", "-"] {
        let mut c = ok.clone();
        c.instance_id = Some(id.into());
        if let Err(e) = c.validate() {
            bad.push(format!("instance_id {id:?} refused: {e}"));
        }
    }
    // through a spec, as a user writes it
    for (k, v) in [
        ("shared_lease_s", serde_json::json!(0.05)),
        ("shared_lease_s", serde_json::json!("1")),
        ("shared_lease_s", serde_json::json!(-3)),
        ("instance_id", serde_json::json!("a/b")),
        ("instance_id", serde_json::json!(7)),
        ("shared", serde_json::json!("yes")),
    ] {
        let mut opts = serde_json::Map::new();
        opts.insert("bucket".into(), "b".into());
        opts.insert("shared".into(), true.into());
        opts.insert("max_size_gb".into(), 1.into());
        opts.insert(k.into(), v.clone());
        let mut spec = kv_tier_core::TierSpec::new("obj");
        spec.options = opts;
        match ObjTierConfig::from_spec(&spec) {
            Err(e) if e.to_string().contains(k) => {}
            other => bad.push(format!("spec {k}={v}: {other:?}")),
        }
    }
    assert!(
        bad.is_empty(),
        "not refused naming the field (or wrongly refused):\n{}",
        bad.join("\n")
    );
}

/// On a store without conditional writes, a shared bucket is refused at open, naming the
/// option; without `max_size_gb`, at validation.
#[tokio::test]
async fn a_shared_bucket_needs_conditional_writes_and_a_bound() {
    let store = Arc::new(kv_tier_testkit::controlled_store::ControlledStore::new());
    store.refuse_create(true);
    let cfg = shared_obj_config(ObjTierConfig::new("mem"), "a");
    let e = ObjTier::with_store("obj", store, cfg.clone(), ns(), SHARED_BS)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("shared") && e.to_string().contains("conditional"),
        "{e}"
    );
    let mut unbounded = cfg.clone();
    unbounded.max_size_gb = None;
    let e = unbounded.validate().unwrap_err();
    assert!(e.to_string().contains("max_size_gb"), "{e}");
    let mut stray = ObjTierConfig::new("b");
    stray.shared_lease_s = Some(1.0);
    let e = stray.validate().unwrap_err();
    assert!(e.to_string().contains("shared_lease_s"), "{e}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_as_obj_through_the_config_json() {
    let server = S3Server::start().await;
    let json = format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": 4096,
            "layout": {{"model_name": "m", "dtype": "float16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{}",
              "access_key": "{}", "secret_key": "{}", "scheme": "http", "prefix": "p"}}]}}"#,
        server.endpoint,
        crate::support::AK,
        crate::support::SK
    );
    let cfg = kv_tier_core::KvTierConfig::from_json_str(&json).unwrap();
    let mut reg = kv_tier_core::TierRegistry::new();
    ObjTier::register(&mut reg).unwrap();
    let cpu = Arc::new(
        kv_tier_cpu::CpuTier::new(kv_tier_cpu::CpuTierConfig {
            capacity_bytes: 65536,
            block_size: 4096,
            policy: kv_tier_core::EvictionPolicy::Lru,
            prefault: false,
        })
        .unwrap(),
    );
    let m = kv_tier_core::TieringManager::builder(cfg)
        .primary(cpu)
        .registry(reg)
        .build()
        .await
        .unwrap();
    assert_eq!(m.tier_names(), ["obj"]);
    assert_eq!(m.tiers()[0].info().locality, kv_tier_core::Locality::Remote);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_credentials_fail_at_startup_saying_so() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.secret_key = Some("not-the-secret".into());
    let err = ObjTier::connect("obj", cfg, ns(), BS).await.unwrap_err();
    assert!(err.to_string().contains("credentials"), "{err}");
    // and an endpoint nobody listens on
    let mut cfg = server.config();
    cfg.endpoint_override = Some("http://127.0.0.1:1".into());
    cfg.request_timeout_s = 1.0;
    cfg.max_retries = 0;
    let err = ObjTier::connect("obj", cfg, ns(), BS).await.unwrap_err();
    assert!(err.to_string().contains("endpoint"), "{err}");
}

/// With no keys in the config nor the environment, the startup probe says there are no
/// credentials (and where the chain looked), not that the endpoint cannot be reached: the
/// credential chain's last stop, the instance metadata address, refuses or does not answer
/// (on this machine a 403 from the network's filter), and no request reaches the endpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_credentials_fail_at_startup_saying_so() {
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_some() || std::env::var_os("AWS_PROFILE").is_some()
    {
        eprintln!("SKIPPED: AWS credentials in the environment");
        return;
    }
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.access_key = None;
    cfg.secret_key = None;
    cfg.max_retries = 0;
    cfg.request_timeout_s = 10.0;
    let err = ObjTier::connect("obj", cfg, ns(), BS).await.unwrap_err();
    let e = err.to_string();
    assert!(
        e.contains("no credentials")
            && e.contains("access_key")
            && !e.contains("cannot be reached"),
        "{e}"
    );
}

/// Promise (`ObjTier::connect`): with no keys, the credential chain is asked before any
/// request, and a chain that does not answer fails the startup as missing credentials naming
/// the source it asked (here the instance metadata service, moved by
/// `AWS_METADATA_ENDPOINT` to a socket that accepts connections and never answers), not as an
/// endpoint that cannot be reached. In a process of its own: the child's environment holds
/// the metadata address.
#[test]
fn a_credential_chain_that_does_not_answer_is_named_not_taken_for_the_endpoint() {
    use kv_tier_testkit::fixtures::process::{
        OWN_PROCESS_ENV, run_with_deadline, test_binary_child,
    };
    const TEST: &str =
        "config::a_credential_chain_that_does_not_answer_is_named_not_taken_for_the_endpoint";
    if std::env::var_os("AWS_ACCESS_KEY_ID").is_some() || std::env::var_os("AWS_PROFILE").is_some()
    {
        eprintln!("SKIPPED: AWS credentials in the environment");
        return;
    }
    if std::env::var(OWN_PROCESS_ENV).as_deref() == Ok(TEST) {
        let metadata = std::env::var("AWS_METADATA_ENDPOINT").expect("set by the parent");
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let e = rt.block_on(async {
            let server = S3Server::start().await;
            let mut cfg = server.config();
            cfg.access_key = None;
            cfg.secret_key = None;
            cfg.max_retries = 0;
            cfg.request_timeout_s = 0.5;
            ObjTier::connect("obj", cfg, ns(), BS)
                .await
                .unwrap_err()
                .to_string()
        });
        assert!(
            e.contains("no credentials")
                && e.contains("access_key")
                && e.contains(&format!("the instance metadata service at {metadata}"))
                && !e.contains("cannot be reached"),
            "{e}"
        );
        return;
    }
    // accepted by the kernel's backlog, never read: the chain's requests wait for an answer
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let metadata = format!("http://{}", silent.local_addr().unwrap());
    let out = run_with_deadline(
        test_binary_child(TEST)
            .env(OWN_PROCESS_ENV, TEST)
            .env("AWS_METADATA_ENDPOINT", &metadata),
        Duration::from_secs(120),
    );
    assert!(out.success(), "{}", out.all());
    assert!(
        out.stdout.contains("test result: ok. 1 passed"),
        "{}",
        out.all()
    );
    drop(silent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_fails_at_startup_saying_so() {
    use crate::support::S3ServerExt as _;
    let server = crate::support::S3Server::start().await;
    let mut c = server.config();
    c.bucket = "no-such-bucket".into();
    c.request_timeout_s = 60.0; // a loaded machine must not turn this into "unreachable"
    let err = ObjTier::connect("obj", c, ns(), BS).await.unwrap_err();
    assert!(
        err.to_string().contains("the bucket does not exist"),
        "{err}"
    );
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
