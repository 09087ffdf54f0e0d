//! The recency order: saved at shutdown under each rank's directory, touches surviving a
//! restart, and a garbled snapshot not breaking open.

use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt as _;
use kv_tier_core::{Namespace, RunFields, SecondaryTier};
use kv_tier_obj::ObjTier;
use kv_tier_testkit::controlled_store::ControlledStore;
use kv_tier_testkit::{load_keys, test_key, verify_block};
use object_store::{ObjectMeta, ObjectStore, ObjectStoreExt as _, PutPayload};

use crate::support::*;

/// "shutdown saves the recency order (touches included) ... and the next open orders the
/// objects by it": the oldest key, touched before shutdown, outlives younger untouched ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touches_survive_a_restart() {
    let s = Arc::new(ControlledStore::new());
    let keys: Vec<_> = (0..9).map(test_key).collect();
    {
        let tier = tier_on(&s, bounded_checked_2s(8, 0.5)).await;
        for k in &keys[..6] {
            assert!(obj_store(&*tier, &[*k]).await.is_success());
            // time passes between the stores: each key is older than the next
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tier.touch(&[keys[0]]);
        tier.shutdown().await.unwrap();
    }
    let tier = tier_on(&s, bounded_checked_2s(8, 0.5)).await;
    for k in &keys[6..] {
        assert!(obj_store(&*tier, &[*k]).await.is_success());
    }
    tier.sweep_now().await;
    wait_sweeps_done(&tier).await;
    let mut present = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        if s.exists(&tier.object_path(k)).await {
            present.push(i);
        }
    }
    assert!(
        present.contains(&0),
        "the touched key went; present: {present:?}"
    );
    assert!(!present.contains(&1), "present: {present:?}");
}

/// The recency object replaced by garbage (or emptied) between runs: the tier still opens
/// and serves its blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_garbled_recency_object_does_not_break_open() {
    for garbage in [
        vec![],
        b"kv-tier recency 1\n".to_vec(),
        vec![0xffu8; 1 << 16],
        {
            let mut v = b"kv-tier-recency v1 999999999999\n".to_vec();
            v.extend([7u8; 35]);
            v
        },
    ] {
        let s = Arc::new(ControlledStore::new());
        let keys: Vec<_> = (0..4).map(test_key).collect();
        {
            let tier = tier_on(&s, bounded_checked_2s(8, 0.5)).await;
            assert!(obj_store(&*tier, &keys).await.is_success());
            tier.touch(&keys[..1]);
            tier.shutdown().await.unwrap();
        }
        let metas: Vec<ObjectMeta> = s.inner.list(None).map(|m| m.unwrap()).collect().await;
        let others: Vec<_> = metas
            .iter()
            .filter(|m| !m.location.as_ref().ends_with(".bin"))
            .map(|m| m.location.clone())
            .collect();
        assert!(!others.is_empty(), "no recency object saved at shutdown");
        for p in &others {
            s.inner
                .put(p, PutPayload::from(garbage.clone()))
                .await
                .unwrap();
        }
        let tier = tokio::time::timeout(
            Duration::from_secs(10),
            ObjTier::with_store("obj", s.clone(), bounded_checked_2s(8, 0.5), ns(), BS),
        )
        .await
        .expect("open hung")
        .expect("a garbled recency object made open fail");
        let (r, data) = load_keys(&tier, &keys, BS).await;
        assert!(r.is_success(), "{:?}", r.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        assert_eq!(tier.stats().objects, 4, "{:?}", tier.stats());
    }
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
        assert!(
            obj_store(&t, &[test_key(u64::from(rank))])
                .await
                .is_success()
        );
        t.shutdown().await.unwrap();
        let saved = format!("{}/kv-tier-recency.v1", ns.rank_dir_name());
        assert!(s.exists(&saved).await, "rank {rank}: nothing at {saved}");
    }
}
