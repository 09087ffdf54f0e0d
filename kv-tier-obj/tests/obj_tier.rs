//! The obj tier against a real S3 server: interop with aws-sdk-s3, faults, credentials,
//! capacity, lookup bounds and integrity.

mod common;

use common::S3ServerExt as _;

use std::sync::Arc;
use std::time::Duration;

use common::{BS, BUCKET, S3Server, ns};
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::{ObjChecksum, ObjTier, ObjTierConfig};
use kv_tier_testkit::{block_bytes, test_key, verify_block};
use object_store::ObjectStore as _;
use object_store::ObjectStoreExt as _;

async fn store(t: &dyn SecondaryTier, keys: &[BlockKey], salt: u64) -> kv_tier_core::JobResult {
    kv_tier_testkit::store_keys(t, keys, salt, BS).await
}

async fn load(
    t: &dyn SecondaryTier,
    keys: &[BlockKey],
) -> (kv_tier_core::JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    kv_tier_testkit::load_keys(t, keys, BS).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_follow_the_fs_layout_under_the_prefix_without_double_slashes() {
    let server = S3Server::start().await;
    for prefix in ["", "a", "/a/b/", "a/b"] {
        let mut cfg = server.config();
        cfg.prefix = prefix.into();
        let tier = server.tier(cfg).await;
        let k = test_key(1);
        let p = tier.object_path(&k);
        let rel = ns().block_rel_path(&k);
        let want = match prefix.trim_matches('/') {
            "" => rel.clone(),
            pre => format!("{pre}/{rel}"),
        };
        assert_eq!(p, want);
        assert!(!p.starts_with('/') && !p.contains("//"), "{p}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_interoperate_with_aws_sdk_s3_both_ways() {
    let server = S3Server::start().await;
    let tier = server.tier(server.config()).await;
    let sdk = server.sdk();
    // written by ObjTier, read by the SDK
    let k = test_key(1);
    assert!(store(&tier, &[k], 0).await.is_success());
    let got = sdk
        .get_object()
        .bucket(BUCKET)
        .key(tier.object_path(&k))
        .send()
        .await
        .unwrap();
    let body = got.body.collect().await.unwrap().into_bytes();
    assert_eq!(
        &body[..],
        &block_bytes(&k, 0, BS)[..],
        "raw bytes, no header"
    );
    // written by the SDK at the right key, loaded by ObjTier
    let k2 = test_key(2);
    sdk.put_object()
        .bucket(BUCKET)
        .key(tier.object_path(&k2))
        .body(block_bytes(&k2, 9, BS).into())
        .send()
        .await
        .unwrap();
    assert_eq!(tier.lookup(&[k2]).await.unwrap(), vec![true]);
    let (res, data) = load(&tier, &[k2]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&k2, 9, &data[0].1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_answering_503_for_a_while_is_retried() {
    let server = S3Server::start().await;
    let tier = server.tier(server.config()).await;
    let keys: Vec<_> = (0..4).map(test_key).collect();
    let sent = |tier: &ObjTier| tier.stats().http_attempts;
    let seen = || server.requests.load(std::sync::atomic::Ordering::SeqCst) as u64;
    // every request the server saw was one the tier's client sent (its startup probe too)
    assert_eq!(sent(&tier), seen());
    assert_eq!(tier.stats().http_retryable_failures, 0);
    server.fail_next(3);
    let res = store(&tier, &keys, 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    // the three 503s were each retried and counted
    assert_eq!(tier.stats().http_retryable_failures, 3);
    assert_eq!(sent(&tier), seen());
    server.fail_next(2);
    let (res, data) = load(&tier, &keys).await;
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
    assert!(store(&tier, &[k], 0).await.is_success());
    tier.clear_exists_cache();
    server.stop().await;
    // A generous outer bound: the job's own deadline is about 3 s.
    let bound = Duration::from_secs(30);
    let res = tokio::time::timeout(bound, store(&tier, &[test_key(2)], 0))
        .await
        .expect("store hung");
    assert_eq!(res.failed.len(), 1);
    assert!(res.failed[0].1.is_transient(), "{}", res.failed[0].1);
    let (res, _) = tokio::time::timeout(bound, load(&tier, &[k]))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lookups_are_bounded_by_io_threads_and_answer_from_the_cache_after_stores() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.io_threads = 4;
    let tier = server.tier(cfg).await;
    let keys: Vec<_> = (0..2000).map(test_key).collect();
    let found = tier.lookup(&keys).await.unwrap();
    assert!(found.iter().all(|b| !b));
    assert!(tier.stats().max_in_flight <= 4, "{:?}", tier.stats());
    let res = store(&tier, &keys, 0).await;
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
    let (res, _) = load(&tier, &keys[..1]).await;
    assert!(matches!(res.failed[0].1, Error::NotFound { .. }));
    assert_eq!(tier.lookup(&keys[..1]).await.unwrap(), vec![false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checksum_mismatch_is_a_miss_and_the_object_goes() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.checksum = ObjChecksum::Crc32c;
    let tier = server.tier(cfg).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    assert!(store(&tier, &keys, 0).await.is_success());
    // replace the third object with other bytes but the first one's checksum metadata
    let sdk = server.sdk();
    let head = sdk
        .head_object()
        .bucket(BUCKET)
        .key(tier.object_path(&keys[0]))
        .send()
        .await
        .unwrap();
    let crc = head
        .metadata()
        .unwrap()
        .get(kv_tier_obj::CRC_METADATA_KEY)
        .unwrap()
        .clone();
    sdk.put_object()
        .bucket(BUCKET)
        .key(tier.object_path(&keys[2]))
        .metadata(kv_tier_obj::CRC_METADATA_KEY, crc)
        .body(block_bytes(&keys[2], 0, BS).into())
        .send()
        .await
        .unwrap();
    let (res, data) = load(&tier, &keys).await;
    assert_eq!(res.failed.len(), 1);
    assert_eq!(res.failed[0].0, keys[2]);
    assert!(matches!(&res.failed[0].1, Error::Corrupt { reason, .. } if reason.contains("crc32c")));
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert_eq!(tier.stats().blocks.checksum_mismatches, 1);
    assert!(
        sdk.head_object()
            .bucket(BUCKET)
            .key(tier.object_path(&keys[2]))
            .send()
            .await
            .is_err()
    );
    assert!(
        tier.take_events()
            .iter()
            .any(|e| e.removed && e.keys == vec![keys[2]])
    );
}

/// With checksums on, an object that carries no checksum (written by another program) is a
/// miss and goes, unless `accept_unverified` asks for it to be served (and counted); an
/// object copied from another key's path, checksum and all, is a miss at its new path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_checksums_unverified_and_moved_objects_are_misses() {
    for accept in [false, true] {
        let store_ = Arc::new(object_store::memory::InMemory::new());
        let mut cfg = ObjTierConfig::new("m");
        cfg.checksum = ObjChecksum::Crc32c;
        cfg.accept_unverified = accept;
        let tier = ObjTier::with_store("obj", store_.clone(), cfg, ns(), BS)
            .await
            .unwrap();
        let (a, b, c) = (test_key(1), test_key(2), test_key(3));
        assert!(store(&tier, &[a], 0).await.is_success());
        // b: bytes without a checksum; c: a's object (bytes and checksum) copied to c's path
        let plain = object_store::path::Path::from(tier.object_path(&b));
        store_
            .put(&plain, block_bytes(&b, 0, BS).into())
            .await
            .unwrap();
        store_
            .copy(
                &object_store::path::Path::from(tier.object_path(&a)),
                &object_store::path::Path::from(tier.object_path(&c)),
            )
            .await
            .unwrap();
        let (res, data) = load(&tier, &[a, b, c]).await;
        let ok: Vec<_> = data.iter().map(|(k, _)| *k).collect();
        if accept {
            assert_eq!(ok, vec![a, b], "{:?}", res.failed);
            assert_eq!(tier.stats().blocks.unverified_loads, 1);
        } else {
            assert_eq!(ok, vec![a], "{:?}", res.failed);
            assert_eq!(tier.stats().blocks.unverified_refused, 1);
            assert!(
                store_.head(&plain).await.is_err(),
                "the unverifiable object stays"
            );
        }
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        assert!(
            res.failed
                .iter()
                .any(|(k, e)| *k == c && matches!(e, Error::Corrupt { .. })),
            "a copied object was served as another key"
        );
        if !accept {
            // a store finds an object without a checksum in its way (a half-written PUT of a
            // store without atomic writes) and replaces it: its success means a readable block
            let d = test_key(4);
            let p = object_store::path::Path::from(tier.object_path(&d));
            store_.put(&p, block_bytes(&d, 0, BS).into()).await.unwrap();
            assert!(store(&tier, &[d], 0).await.is_success());
            let (res, data) = load(&tier, &[d]).await;
            assert!(res.is_success(), "{:?}", res.failed);
            assert!(verify_block(&d, 0, &data[0].1));
            // so does a short object, even one whose checksum metadata looks right
            let e = test_key(5);
            assert!(store(&tier, &[e], 0).await.is_success());
            let p = object_store::path::Path::from(tier.object_path(&e));
            let got = store_.get(&p).await.unwrap();
            let attributes = got.attributes.clone();
            let half = got.bytes().await.unwrap().slice(..BS / 2);
            let opts = object_store::PutOptions {
                attributes,
                ..Default::default()
            };
            store_.put_opts(&p, half.into(), opts).await.unwrap();
            assert!(store(&tier, &[e], 0).await.is_success());
            let (res, data) = load(&tier, &[e]).await;
            assert!(
                res.is_success(),
                "a short object stayed in the way: {:?}",
                res.failed
            );
            assert!(verify_block(&e, 0, &data[0].1));
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_object_is_a_miss_for_that_key_only() {
    let store_ = Arc::new(object_store::memory::InMemory::new());
    let tier = ObjTier::with_store("obj", store_.clone(), ObjTierConfig::new("m"), ns(), BS)
        .await
        .unwrap();
    let keys: Vec<_> = (0..2).map(test_key).collect();
    assert!(store(&tier, &keys, 0).await.is_success());
    let path = object_store::path::Path::from(tier.object_path(&keys[1]));
    store_
        .put(&path, bytes::Bytes::from(vec![1u8; BS / 2]).into())
        .await
        .unwrap();
    let (res, _) = load(&tier, &keys).await;
    assert_eq!(res.ok, vec![keys[0]]);
    assert!(matches!(res.failed[0].1, Error::Corrupt { .. }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_the_bound_the_oldest_go_first_and_protected_keys_stay() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.max_size_gb = Some((10 * BS) as f64 / (1u64 << 30) as f64);
    cfg.low_watermark = 0.8;
    let tier = server.tier(cfg.clone()).await;
    let keys: Vec<_> = (0..10).map(test_key).collect();
    for k in &keys {
        assert!(store(&tier, &[*k], 0).await.is_success()); // one at a time: ascending age
    }
    tier.touch(&keys[..1]); // key 0 becomes the most recent
    let guard = tier.protect(&keys[1..2]);
    tier.take_events();
    let more: Vec<_> = (100..103).map(test_key).collect();
    assert!(store(&tier, &more, 0).await.is_success()); // 13 > 10: over the bound
    tier.sweep_now().await; // after the sweep the store woke, if it still runs
    let s = tier.stats();
    assert!(s.bytes <= 8 * BS as u64, "{s:?}");
    let exists = tier.lookup(&keys).await.unwrap();
    assert!(exists[0], "the touched key went");
    assert!(exists[1], "the protected key went");
    assert_eq!(
        &exists[2..7],
        &[false; 5],
        "the oldest unprotected go first: {exists:?}"
    );
    assert!(exists[7..].iter().all(|&b| b));
    assert!(s.skipped_in_flight >= 1);
    let removed: Vec<BlockKey> = kv_tier_testkit::removed_keys(tier.take_events());
    assert_eq!(removed.len(), 5);
    assert_eq!(s.evicted, 5);
    drop(guard);
    // a restart seeds the index from a LIST
    let again = server.tier(cfg).await;
    assert_eq!(again.stats().objects, 8);
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registered_as_obj_through_the_config_json() {
    let server = S3Server::start().await;
    let json = format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": 4096,
            "layout": {{"model_name": "m", "dtype": "float16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{}",
              "access_key": "{}", "secret_key": "{}", "scheme": "http", "prefix": "p"}}]}}"#,
        server.endpoint,
        common::AK,
        common::SK
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
async fn vllm_keys_differ_from_ours_by_the_empty_segment_that_object_store_cannot_address() {
    let store = Arc::new(object_store::memory::InMemory::new());
    let k = test_key(5);
    for prefix in ["kv", "a/b", ""] {
        let mut cfg = ObjTierConfig::new("m");
        cfg.prefix = prefix.into();
        let tier = ObjTier::with_store("obj", store.clone(), cfg, ns(), BS)
            .await
            .unwrap();
        let (ours, vllm) = (tier.object_path(&k), tier.vllm_object_key(&k));
        let rel = ns().block_rel_path(&k);
        // vLLM's f"{root}/{model}_{digest}..." with root = f"{prefix}/" or ""
        let want = if prefix.is_empty() {
            format!("/{rel}")
        } else {
            format!("{prefix}//{rel}")
        };
        assert_eq!(vllm, want);
        assert_eq!(
            ours,
            vllm.split('/')
                .filter(|s| !s.is_empty())
                .collect::<Vec<_>>()
                .join("/")
        );
        assert!(!ours.starts_with('/') && !ours.contains("//"), "{ours}");
        // object_store cannot name vLLM's key: parsing refuses it, building drops the gap
        if !prefix.is_empty() {
            assert!(object_store::path::Path::parse(&vllm).is_err(), "{vllm}");
        }
        assert_eq!(object_store::path::Path::from(vllm.as_str()).as_ref(), ours);
    }
}
