//! No wrong bytes are served: checksum mismatches, malformed checksum metadata, unverified
//! objects, objects of the wrong size and bodies that break, run long or arrive cut short are
//! misses (a transfer that failed is not damage); damaged objects go, and a store over one
//! leaves a readable block.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::{ObjChecksum, ObjTier, ObjTierConfig, block_crc};
use kv_tier_testkit::controlled_store::{BodyFault, ControlledStore, Op};
use kv_tier_testkit::wait::poll_until_async;
use kv_tier_testkit::{block_bytes, load_keys, test_key, verify_block};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{ObjectStore, ObjectStoreExt as _, PutPayload};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checksum_mismatch_is_a_miss_and_the_object_goes() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.checksum = ObjChecksum::Crc32c;
    let tier = server.tier(cfg).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    assert!(obj_store(&tier, &keys).await.is_success());
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
    let (res, data) = load_keys(&tier, &keys, BS).await;
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
        assert!(obj_store(&tier, &[a]).await.is_success());
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
        let (res, data) = load_keys(&tier, &[a, b, c], BS).await;
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
            assert!(obj_store(&tier, &[d]).await.is_success());
            let (res, data) = load_keys(&tier, &[d], BS).await;
            assert!(res.is_success(), "{:?}", res.failed);
            assert!(verify_block(&d, 0, &data[0].1));
            // so does a short object, even one whose checksum metadata looks right
            let e = test_key(5);
            assert!(obj_store(&tier, &[e]).await.is_success());
            let p = object_store::path::Path::from(tier.object_path(&e));
            let got = store_.get(&p).await.unwrap();
            let attributes = got.attributes.clone();
            let half = got.bytes().await.unwrap().slice(..BS / 2);
            let opts = object_store::PutOptions {
                attributes,
                ..Default::default()
            };
            store_.put_opts(&p, half.into(), opts).await.unwrap();
            assert!(obj_store(&tier, &[e]).await.is_success());
            let (res, data) = load_keys(&tier, &[e], BS).await;
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
    assert!(obj_store(&tier, &keys).await.is_success());
    let path = object_store::path::Path::from(tier.object_path(&keys[1]));
    store_
        .put(&path, bytes::Bytes::from(vec![1u8; BS / 2]).into())
        .await
        .unwrap();
    let (res, _) = load_keys(&tier, &keys, BS).await;
    assert_eq!(res.ok, vec![keys[0]]);
    assert!(matches!(res.failed[0].1, Error::Corrupt { .. }));
}

/// A GET body that errors half way is a failed key, never served.
#[tokio::test(start_paused = true)]
async fn a_get_body_that_breaks_is_a_failure_and_never_served() {
    let e = Arc::new(ControlledStore::new());
    let tier = tier_on(&e, checked_half_second()).await;
    let a = test_key(1);
    assert!(obj_store(&*tier, &[a]).await.is_success());
    e.break_bodies(&tier.object_path(&a), Some(BodyFault::Break));
    let (res, data) = load_keys(&*tier, &[a], BS).await;
    assert!(data.is_empty() && res.failed_keys() == vec![a], "{res:?}");
    e.break_bodies(&tier.object_path(&a), None);
    let (res, data) = load_keys(&*tier, &[a], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&a, 0, &data[0].1));
}

/// A GET body longer than the block (the metadata says whole): never served.
#[tokio::test(start_paused = true)]
async fn a_body_longer_than_its_metadata_is_never_served() {
    for checksum in [ObjChecksum::None, ObjChecksum::Crc32c] {
        let e = Arc::new(ControlledStore::new());
        let mut cfg = checked_half_second();
        cfg.checksum = checksum;
        let tier = tier_on(&e, cfg).await;
        let a = test_key(1);
        assert!(obj_store(&*tier, &[a]).await.is_success());
        e.break_bodies(&tier.object_path(&a), Some(BodyFault::Longer(7)));
        let (res, data) = load_keys(&*tier, &[a], BS).await;
        assert!(
            data.is_empty() && res.failed_keys() == vec![a],
            "checksum {checksum:?}: a body with 7 extra bytes was served: {res:?}"
        );
    }
}

/// Objects of the wrong size at a key's path: misses, with or without checksums, and with a
/// checksum computed over the whole (wrong-sized) body too.
#[tokio::test(start_paused = true)]
async fn objects_of_the_wrong_size_are_misses() {
    for checksum in [ObjChecksum::None, ObjChecksum::Crc32c] {
        let s = Arc::new(InMemory::new());
        let mut cfg = checked_half_second();
        cfg.checksum = checksum;
        let tier = ObjTier::with_store("obj", s.clone(), cfg, ns(), BS)
            .await
            .unwrap();
        let cases: Vec<(BlockKey, usize)> = vec![
            (test_key(1), BS + 1),
            (test_key(2), BS - 1),
            (test_key(3), 0),
            (test_key(4), 2 * BS),
        ];
        for (k, len) in &cases {
            let mut body = block_bytes(k, 0, BS);
            body.resize(*len, 0x5a);
            let crc = format!("{:08x}", block_crc(k, &body));
            put_raw(&*s, &tier.object_path(k), body, Some(&crc)).await;
        }
        let keys: Vec<_> = cases.iter().map(|(k, _)| *k).collect();
        let (res, data) = load_keys(&tier, &keys, BS).await;
        assert!(
            data.is_empty(),
            "checksum {checksum:?}: wrong-sized objects served: {:?}",
            data.iter().map(|(k, _)| *k).collect::<Vec<_>>()
        );
        assert_eq!(res.failed.len(), keys.len());
    }
}

/// Malformed checksum metadata whose value does not match: refused, even with
/// `accept_unverified` ("A malformed or mismatching checksum is refused either way"), and
/// the object deleted.
#[tokio::test(start_paused = true)]
async fn malformed_checksums_are_refused_and_deleted_even_accepting_unverified() {
    for accept in [false, true] {
        let s = Arc::new(InMemory::new());
        let mut cfg = checked_half_second();
        cfg.accept_unverified = accept;
        let tier = ObjTier::with_store("obj", s.clone(), cfg, ns(), BS)
            .await
            .unwrap();
        let bad = [
            "zzzzzzzz",
            "1234567",
            "123456789",
            "-1",
            "0x",
            "ffffffffff",
            " ",
            "g0000000",
            "\u{e9}\u{e9}\u{e9}\u{e9}",
        ];
        let mut keys = Vec::new();
        for (i, v) in bad.iter().enumerate() {
            let k = test_key(100 + i as u64);
            put_raw(&*s, &tier.object_path(&k), block_bytes(&k, 0, BS), Some(v)).await;
            keys.push(k);
        }
        let (res, data) = load_keys(&tier, &keys, BS).await;
        assert!(
            data.is_empty(),
            "accept_unverified={accept}: served with malformed checksums: {:?}",
            data.iter()
                .map(|(k, _)| bad[keys.iter().position(|x| x == k).unwrap()])
                .collect::<Vec<_>>()
        );
        assert_eq!(res.failed.len(), keys.len());
        for (k, v) in keys.iter().zip(bad) {
            assert!(
                !exists(&*s, &tier.object_path(k)).await,
                "accept_unverified={accept}: object with malformed checksum {v:?} not deleted"
            );
        }
    }
}

/// Checksum text that is not "exactly 8 hex digits" but parses to the right value (a sign,
/// spaces, a `0x`, a ninth leading zero): the docs call any such text malformed: a miss.
#[tokio::test(start_paused = true)]
async fn malformed_checksum_text_with_the_right_value_is_refused() {
    let s = Arc::new(InMemory::new());
    let tier = ObjTier::with_store("obj", s.clone(), checked_half_second(), ns(), BS)
        .await
        .unwrap();
    // sanity: the well-formed text (either case) loads
    let k = test_key(1);
    let body = block_bytes(&k, 0, BS);
    let crc = block_crc(&k, &body);
    put_raw(
        &*s,
        &tier.object_path(&k),
        body,
        Some(&format!("{crc:08X}")),
    )
    .await;
    let (res, _) = load_keys(&tier, &[k], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let mut served = Vec::new();
    for i in 0..10u64 {
        for j in 0..5u64 {
            let kk = test_key(10_000 + i * 10 + j);
            let body = block_bytes(&kk, 0, BS);
            let crc = block_crc(&kk, &body);
            let hex = format!("{crc:08x}");
            let text = match j {
                0 => format!("0{hex}"),
                1 => format!(" {hex}"),
                2 => format!("{hex} "),
                3 => format!("0x{crc:x}"),
                _ => format!("+{crc:x}"),
            };
            put_raw(&*s, &tier.object_path(&kk), body, Some(&text)).await;
            let (_, data) = load_keys(&tier, &[kk], BS).await;
            if !data.is_empty() {
                served.push(text);
            }
        }
    }
    assert!(
        served.is_empty(),
        "checksum texts that are not 8 hex digits were accepted: {served:?}"
    );
}

/// vLLM objects (no checksum) with `accept_unverified`: served and counted when whole; a
/// short or long one is still a miss, and a store over it leaves a readable block.
#[tokio::test(start_paused = true)]
async fn accept_unverified_still_checks_size_and_a_store_replaces_a_bad_one() {
    let s = Arc::new(InMemory::new());
    let mut cfg = checked_half_second();
    cfg.accept_unverified = true;
    let tier = ObjTier::with_store("obj", s.clone(), cfg, ns(), BS)
        .await
        .unwrap();
    let (good, short, long) = (test_key(1), test_key(2), test_key(3));
    put_raw(
        &*s,
        &tier.object_path(&good),
        block_bytes(&good, 0, BS),
        None,
    )
    .await;
    put_raw(
        &*s,
        &tier.object_path(&short),
        block_bytes(&short, 0, BS)[..BS - 16].to_vec(),
        None,
    )
    .await;
    let mut l = block_bytes(&long, 0, BS);
    l.extend([1u8; 16]);
    put_raw(&*s, &tier.object_path(&long), l, None).await;
    let (res, data) = load_keys(&tier, &[good, short, long], BS).await;
    assert_eq!(
        data.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
        vec![good],
        "{:?}",
        res.failed
    );
    assert!(verify_block(&good, 0, &data[0].1));
    assert_eq!(tier.stats().blocks.unverified_loads, 1);
    // the wrong-sized ones may or may not have been deleted by the load; put them back
    put_raw(
        &*s,
        &tier.object_path(&short),
        block_bytes(&short, 0, BS)[..BS - 16].to_vec(),
        None,
    )
    .await;
    let mut l = block_bytes(&long, 0, BS);
    l.extend([1u8; 16]);
    put_raw(&*s, &tier.object_path(&long), l, None).await;
    let res = obj_store(&tier, &[short, long]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = load_keys(&tier, &[short, long], BS).await;
    assert!(
        res.is_success(),
        "a store reported over a wrong-sized unverified object left an unreadable block: {:?}",
        res.failed
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// Checksums off (the default): a short object in a key's way. The trait: "A store that
/// reports success leaves a readable block".
#[tokio::test(start_paused = true)]
async fn without_checksums_a_reported_store_over_a_short_object_is_readable() {
    let s = Arc::new(InMemory::new());
    let tier = ObjTier::with_store("obj", s.clone(), ObjTierConfig::new("mem"), ns(), BS)
        .await
        .unwrap();
    let k = test_key(1);
    put_raw(&*s, &tier.object_path(&k), vec![9u8; BS / 2], None).await;
    let res = obj_store(&tier, &[k]).await;
    if res.is_success() {
        let (res, data) = load_keys(&tier, &[k], BS).await;
        assert!(
            res.is_success() && verify_block(&k, 0, &data[0].1),
            "store reported k stored, but the load fails: {:?}",
            res.failed
        );
    }
}

#[tokio::test]
async fn bodies_in_small_pieces_load_and_bodies_cut_short_are_refused() {
    let s = Arc::new(ControlledStore::new());
    let t = tier_on(&s, ObjTierConfig::new("mem")).await;
    let keys = [test_key(1), test_key(2)];
    assert!(obj_store(&t, &keys).await.is_success());
    s.chunk_gets(Some(1000));
    let (res, data) = load_keys(&*t, &keys[..1], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&keys[0], 0, &data[0].1));
    s.cut_gets(100);
    let (res, _) = load_keys(&*t, &keys[1..], BS).await;
    assert_eq!(
        res.failed_keys(),
        vec![keys[1]],
        "a body cut short was served"
    );
}

/// A GET whose body arrives cut short, from an object of the block's size: the transfer
/// failed, not the object. The load fails (transient), and the object stays, found and
/// loadable once the transfer works.
#[tokio::test]
async fn a_body_cut_short_is_a_failed_transfer_not_damage() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded_checked_1s(64)).await;
    let mut h = History::default();
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    h.take(&tier);
    s.cut_gets(1);
    let (res, _) = load_keys(&*tier, &[k], BS).await;
    s.cut_gets(0);
    match &res.failed[..] {
        [
            (
                key,
                Error::Backend {
                    transient: true,
                    message,
                    ..
                },
            ),
        ] => {
            assert_eq!(*key, k);
            assert!(message.contains("ended after"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        s.exists(&tier.object_path(&k)).await,
        "an intact object was deleted"
    );
    assert!(h.take(&tier).is_empty(), "nothing was removed");
    let (res, data) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success() && kv_tier_testkit::verify_block(&k, 0, &data[0].1));
}

/// A load finds an object damaged (no checksum: in the way) while a store of the key is
/// replacing it; the load's delete, which waits for the store's claim, must not delete the
/// new object (it checks the object is still the one it read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_objects_delete_spares_the_object_a_store_put_in_its_place() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded_checked_1s(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    let path = tier.object_path(&k);
    // an object without a checksum at k's path: a load refuses it, a store replaces it
    s.inner
        .put(&Path::from(path.clone()), PutPayload::from(vec![7u8; BS]))
        .await
        .unwrap();
    let deletes = s.hold_path(Op::Delete, &path);
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { obj_store(&t2, &[k]).await });
    deletes.wait_arrived(1).await; // the store, holding k's claim, deletes the old object
    let t3 = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t3, &[k], BS).await.0 });
    // the load read the old object, refused it, and waits for the claim (polled, bounded)
    poll_until_async(Duration::from_secs(60), || {
        tier.stats().blocks.unverified_refused == 1
    })
    .await;
    assert_eq!(tier.stats().blocks.unverified_refused, 1);
    s.release(Op::Delete);
    assert!(storing.await.unwrap().is_success());
    let lres = loading.await.unwrap();
    assert!(
        matches!(lres.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        lres.failed
    );
    assert!(
        s.exists(&path).await,
        "the load deleted the store's new object"
    );
    let (res, data) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success() && kv_tier_testkit::verify_block(&k, 0, &data[0].1));
}
