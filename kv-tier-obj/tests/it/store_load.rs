//! Stores and loads at the edges of the API: empty jobs and lookups, one key twice in a job,
//! a store after the object was deleted behind the tier's back.

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
