//! What the obj tier asks of its store and what it makes of odd answers: a new block is one
//! PUT, a block already there is confirmed and not rewritten, an object in the way is
//! replaced, bodies that arrive in pieces or cut short, keys being deleted, the bound's
//! bookkeeping and where the recency order is saved. On a controlled in-memory store.

mod common;

use std::sync::Arc;

use common::{BS, store, tier_on};
use kv_tier_core::{Namespace, RunFields, SecondaryTier};
use kv_tier_obj::{CRC_METADATA_KEY, ObjChecksum, ObjTier, ObjTierConfig, block_crc};
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::{block_bytes, load_keys, test_key, verify_block};
use object_store::ObjectStoreExt as _;
use object_store::path::Path;
use object_store::{
    Attribute, AttributeValue, Attributes, ObjectStore, PutMode, PutOptions, PutPayload,
};

fn checked() -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.checksum = ObjChecksum::Crc32c;
    c
}

fn bounded(blocks: usize) -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.max_size_gb = Some((blocks * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = 0.5;
    c
}

async fn etag(s: &ControlledStore, path: &str) -> Option<String> {
    s.inner.head(&Path::from(path)).await.unwrap().e_tag
}

#[tokio::test]
async fn a_new_block_is_one_put_and_one_already_there_is_confirmed_not_rewritten() {
    let s = Arc::new(ControlledStore::new());
    let a = tier_on(&s, ObjTierConfig::new("mem")).await;
    let k = test_key(1);
    let (heads, gets) = (s.count(Op::Head), s.count(Op::Get));
    assert!(store(&a, &[k]).await.is_success());
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
    assert!(store(&b, &[k]).await.is_success());
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
    assert!(store(&t, &[k]).await.is_success());
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

#[tokio::test]
async fn bodies_in_small_pieces_load_and_bodies_cut_short_are_refused() {
    let s = Arc::new(ControlledStore::new());
    let t = tier_on(&s, ObjTierConfig::new("mem")).await;
    let keys = [test_key(1), test_key(2)];
    assert!(store(&t, &keys).await.is_success());
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

/// A sweep chose keys and their DELETEs are in flight: those keys are absent for lookups,
/// and a store of one waits for its delete and then writes it. On one thread, so the store
/// runs as far as it can before the delete is let go.
#[tokio::test]
async fn a_key_being_deleted_is_absent_and_its_store_waits_for_the_delete() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(4)).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(store(&tier, &[*k]).await.is_success());
    }
    let deletes = s.hold(Op::Delete);
    assert!(store(&tier, &keys[4..]).await.is_success()); // over: a sweep starts
    deletes.wait_arrived(1).await;
    let k = keys[0];
    assert_eq!(
        tier.lookup(&[k]).await.unwrap(),
        vec![false],
        "a key being deleted was found"
    );
    // absent from now on, so reported removed from now on (not when the sweep ends)
    let removed: Vec<_> = tier
        .take_events()
        .into_iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys)
        .collect();
    assert!(
        removed.contains(&k),
        "a key lookups answer absent for is not reported removed: {removed:?}"
    );
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { store(&t2, &[k]).await });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    s.release(Op::Delete);
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(
        s.exists(&tier.object_path(&k)).await,
        "the store wrote before the delete and the delete removed it"
    );
    // the store's copy is reported after the removal, so the last word on `k` is "stored"
    let last = tier
        .take_events()
        .into_iter()
        .rfind(|e| e.keys.contains(&k))
        .expect("the store reported its copy");
    assert!(!last.removed, "the removal was reported after the new copy");
}

/// A sweep's DELETEs run on the server, and their replies never arrive within the request
/// deadline: the sweep cannot tell the objects are gone. Each is reported removed anyway
/// (a key reported stored never goes missing unreported), and each is still counted
/// toward the bound (it may be there); a later sweep's delete of one is a no-op.
#[tokio::test(start_paused = true)]
async fn a_delete_whose_reply_is_lost_is_reported_removed_and_still_counted() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(4);
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    let tier = tier_on(&s, c).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(store(&tier, &[*k]).await.is_success());
    }
    tier.take_events();
    s.delay_replies(Op::Delete, std::time::Duration::from_secs(3600));
    assert!(store(&tier, &keys[4..]).await.is_success()); // over: a sweep starts
    assert_eq!(tier.sweep_now().await, 0, "no delete was confirmed");
    let mut gone = Vec::new();
    for k in &keys {
        if !s.exists(&tier.object_path(k)).await {
            gone.push(*k);
        }
    }
    assert!(!gone.is_empty(), "the sweep deleted nothing");
    let removed: Vec<_> = tier
        .take_events()
        .into_iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys)
        .collect();
    for k in &gone {
        assert!(
            removed.contains(k),
            "{k} is gone from the store and was never reported removed (removed: {removed:?})"
        );
        assert_eq!(tier.lookup(&[*k]).await.unwrap(), vec![false]);
    }
    assert_eq!(
        tier.stats().bytes,
        5 * BS as u64,
        "objects the sweep could not confirm gone left the count"
    );
    // with replies back, the next sweep confirms them gone, and the count follows
    s.delay_replies(Op::Delete, std::time::Duration::ZERO);
    assert_eq!(tier.sweep_now().await, gone.len());
    assert_eq!(tier.stats().bytes, (5 - gone.len() as u64) * BS as u64);
}

#[tokio::test]
async fn a_block_gone_at_load_leaves_the_bound() {
    let s = Arc::new(ControlledStore::new());
    let t = tier_on(&s, bounded(8)).await;
    let k = test_key(1);
    assert!(store(&t, &[k]).await.is_success());
    assert_eq!(t.stats().bytes, BS as u64);
    s.inner
        .delete(&Path::from(t.object_path(&k)))
        .await
        .unwrap();
    let (res, _) = load_keys(&*t, &[k], BS).await;
    assert_eq!(res.failed_keys(), vec![k]);
    assert_eq!((t.stats().objects, t.stats().bytes), (0, 0));
}

#[tokio::test]
async fn each_rank_saves_its_recency_order_under_its_own_directory() {
    let s = Arc::new(ControlledStore::new());
    for rank in [0, 1] {
        let ns = Namespace::new(
            RunFields::new("test-org/test-model", "torch.float16", 16),
            rank,
        )
        .unwrap();
        let t = ObjTier::with_store("obj", s.clone(), bounded(8), ns.clone(), BS)
            .await
            .unwrap();
        assert!(store(&t, &[test_key(u64::from(rank))]).await.is_success());
        t.shutdown().await.unwrap();
        let saved = format!("{}/kv-tier-recency.v1", ns.rank_dir_name());
        assert!(s.exists(&saved).await, "rank {rank}: nothing at {saved}");
    }
}

async fn put_in_the_way(s: &ControlledStore, path: &str) {
    s.inner
        .put(&Path::from(path), PutPayload::from(vec![7u8; 100]))
        .await
        .unwrap();
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
        store(&t, &[k1]).await.is_success(),
        "no fallback without create-only PUTs"
    );
    assert!(s.exists(&t.object_path(&k1)).await);
    put_in_the_way(&s, &t.object_path(&k2)).await;
    let res = store(&t, &[k2]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = load_keys(&*t, &[k2], BS).await;
    assert!(res.is_success() && verify_block(&k2, 0, &data[0].1));
    put_in_the_way(&s, &t.object_path(&k3)).await;
    let _deletes = s.hold(Op::Delete); // the object in the way cannot be deleted
    let res = tokio::time::timeout(std::time::Duration::from_secs(60), store(&t, &[k3]))
        .await
        .expect("a store looped on an object it cannot replace");
    assert_eq!(res.failed_keys(), vec![k3]);
    let msg = res.failed[0].1.to_string();
    assert!(
        msg.contains("could not be replaced") && msg.contains(&t.object_path(&k3)),
        "{msg}"
    );
}

/// An object another instance wrote is found by one HEAD; the answer is cached, so a second
/// lookup within `exists_ttl_s` sends no request.
#[tokio::test]
async fn an_existence_answer_from_a_head_is_cached() {
    let s = Arc::new(ControlledStore::new());
    let writer = tier_on(&s, ObjTierConfig::new("mem")).await;
    let k = test_key(1);
    assert!(store(&writer, &[k]).await.is_success());
    let reader = tier_on(&s, ObjTierConfig::new("mem")).await;
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

/// A store of a key the tier knows present asks the backend once (one HEAD tells presence,
/// size and checksum), writes nothing, and reports it stored; without create-only writes a
/// new key costs one HEAD and one PUT.
#[tokio::test]
async fn a_store_of_a_present_key_is_one_head() {
    let s = Arc::new(ControlledStore::new());
    let t = tier_on(&s, checked()).await;
    let k = test_key(1);
    assert!(store(&t, &[k]).await.is_success());
    let (heads, puts, gets) = (s.count(Op::Head), s.count(Op::Put), s.count(Op::Get));
    assert!(store(&t, &[k]).await.is_success());
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
    assert!(store(&u, &[test_key(3)]).await.is_success());
    let k2 = test_key(2);
    let (heads, puts) = (s.count(Op::Head), s.count(Op::Put));
    assert!(store(&u, &[k2]).await.is_success());
    assert_eq!(
        (s.count(Op::Head) - heads, s.count(Op::Put) - puts),
        (1, 1),
        "requests of a new key's store without create-only writes (HEAD, PUT)"
    );
    let (res, data) = load_keys(&*u, &[k, k2], BS).await;
    assert!(res.is_success() && data.iter().all(|(k, d)| verify_block(k, 0, d)));
}
