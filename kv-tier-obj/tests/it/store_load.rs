//! Stores and loads at the edges of the API: empty jobs and lookups, one key twice in a job,
//! a store after the object was deleted behind the tier's back, how long a PUT holds its
//! block's source.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{LoadJob, SecondaryTier, StoreJob};
use kv_tier_obj::ObjTierConfig;
use kv_tier_testkit::controlled_store::ControlledStore;
use kv_tier_testkit::{load_keys, source_for, test_key, verify_block};
use object_store::ObjectStoreExt as _;

use crate::support::*;

#[tokio::test(start_paused = true)]
async fn empty_lookups_and_jobs() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, checked_half_second()).await;
    assert_eq!(
        tier.lookup(&[]).await.expect("lookup of no keys failed"),
        Vec::<bool>::new()
    );
    assert!(tier.store(StoreJob::default()).await.is_success());
    assert!(tier.load(LoadJob::default()).await.is_success());
    // and while the backend hangs
    s.hold_all();
    let r = tokio::time::timeout(Duration::from_secs(5), tier.lookup(&[])).await;
    assert_eq!(
        r.expect("lookup of no keys hung").unwrap(),
        Vec::<bool>::new()
    );
    s.release_all();
}

/// One key twice in one store job, with different bytes and one permit: ends, every entry
/// reported, exactly one whole copy survives.
#[tokio::test(start_paused = true)]
async fn one_key_twice_in_a_store_job_with_one_io_thread() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = checked_half_second();
    cfg.io_threads = 1;
    let tier = tier_on(&s, cfg).await;
    let k = test_key(1);
    let other = test_key(2);
    let job = StoreJob {
        links: Vec::new(),
        requests: Vec::new(),
        blocks: vec![
            (k, source_for(&k, 0, BS)),
            (other, source_for(&other, 0, BS)),
            (k, source_for(&k, 1, BS)),
        ],
    };
    let res = tokio::time::timeout(Duration::from_secs(30), tier.store(job))
        .await
        .expect("a job with a key twice wedged");
    assert_eq!(res.ok.len() + res.failed.len(), 3, "{res:?}");
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = load_keys(&*tier, &[k, k, other], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert_eq!(data.len(), 3);
    for (kk, d) in &data {
        assert!(
            verify_block(kk, 0, d) || verify_block(kk, 1, d),
            "a torn block"
        );
    }
    assert_eq!(data[0].1, data[1].1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_after_an_outside_delete_writes_the_object() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, ObjTierConfig::new("mem")).await;
    let k = test_key(1);
    assert!(obj_store(&tier, &[k]).await.is_success());
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![true]); // cached
    // a lifecycle rule or another instance's GC deletes it
    let path = tier.object_path(&k);
    s.inner
        .delete(&object_store::path::Path::from(path.clone()))
        .await
        .unwrap();
    let res = obj_store(&tier, &[k]).await;
    assert!(res.is_success());
    assert!(
        s.exists(&path).await,
        "the store reported success without the object existing"
    );
    let (res, data) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success() && verify_block(&k, 0, &data[0].1));
}

/// A block source that says when it is released.
struct Tracked(Vec<u8>, Arc<std::sync::atomic::AtomicBool>);

impl AsRef<[u8]> for Tracked {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.1.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

fn tracked(
    key: &kv_tier_core::BlockKey,
) -> (
    kv_tier_core::BlockSource,
    Arc<std::sync::atomic::AtomicBool>,
) {
    let mut bytes = vec![0; BS];
    kv_tier_testkit::fill_block(key, 0, &mut bytes);
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    (
        kv_tier_core::BlockSource::from_owner(Tracked(bytes, released.clone())),
        released,
    )
}

/// `ObjTier::connect`'s S3 client sends a view of the block's source: the source (a DRAM
/// slot, pinned) is held while the PUT is in flight and released once it ends.
#[tokio::test]
async fn a_put_over_s3_sends_a_view_of_its_source_and_releases_it_after() {
    let server = S3Server::start().await;
    let tier = Arc::new(server.tier(server.config()).await);
    let k = test_key(7);
    let (src, released) = tracked(&k);
    let before = server.requests.load(std::sync::atomic::Ordering::SeqCst);
    let held = server.hold();
    let job = StoreJob {
        links: Vec::new(),
        requests: Vec::new(),
        blocks: vec![(k, src)],
    };
    let store = tokio::spawn({
        let tier = tier.clone();
        async move { tier.store(job).await }
    });
    kv_tier_testkit::wait::wait_until_async(
        "the PUT reached the server",
        Duration::from_secs(10),
        || server.requests.load(std::sync::atomic::Ordering::SeqCst) > before,
    )
    .await;
    assert!(
        !released.load(std::sync::atomic::Ordering::SeqCst),
        "the source was released before its PUT ended: the tier copied it"
    );
    drop(held);
    let res = store.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    kv_tier_testkit::wait::wait_until_async(
        "the source released after its PUT",
        Duration::from_secs(10),
        || released.load(std::sync::atomic::Ordering::SeqCst),
    )
    .await;
    let (res, data) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&k, 0, &data[0].1));
}

/// A store given to `with_store` may keep a PUT's body for good (an in-memory store does):
/// the tier sends it a copy, and the source is released when the store job ends, while the
/// store still holds the block.
#[tokio::test]
async fn a_put_to_a_given_store_sends_a_copy_and_releases_its_source() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, ObjTierConfig::new("b")).await;
    let k = test_key(8);
    let (src, released) = tracked(&k);
    let res = tier
        .store(StoreJob {
            links: Vec::new(),
            requests: Vec::new(),
            blocks: vec![(k, src)],
        })
        .await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(
        released.load(std::sync::atomic::Ordering::SeqCst),
        "the source is still held after its store ended: the store keeps a view of it"
    );
    let (res, data) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&k, 0, &data[0].1));
}

/// Each block of a load over S3 is reported as it lands (`LoadProgress`: the manager keeps
/// those of a load job it cuts), the missing one not.
#[tokio::test]
async fn a_load_reports_each_block_as_it_lands() {
    let server = S3Server::start().await;
    let tier = server.tier(server.config()).await;
    let keys: Vec<_> = (1..=5).map(test_key).collect();
    kv_tier_testkit::assert_loads_report_what_landed(&tier, &keys, test_key(99), BS).await;
}
