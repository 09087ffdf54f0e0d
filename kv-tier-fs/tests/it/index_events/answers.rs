//! What a bounded tier answers from its index (`SecondaryTier::holds`): what it stored or
//! adopted is held, what it never had or swept is not, with no probe; a key a sweep has on
//! its way out is left to a probe; files other processes add or remove are seen by a rescan
//! or a load; an unbounded tier and a shared root's follower leave every answer to a probe.

use std::sync::Arc;

use kv_tier_core::{
    KvTierConfig, LookupResult, MissCause, RequestContext, SecondaryTier, TieringManager,
};
use kv_tier_fs::SweepPoint;
use kv_tier_testkit::instances::new_key;
use kv_tier_testkit::util::lru_dram;
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until};
use kv_tier_testkit::{store_keys, temp_root, test_key};

use crate::support::*;

fn holds(tier: &dyn SecondaryTier, keys: &[kv_tier_core::BlockKey]) -> Vec<Option<bool>> {
    keys.iter().map(|k| tier.holds(k)).collect()
}

/// Stored keys are held and others are not, from the index alone (no key is probed); a swept
/// key is not held once its file is gone; the index of a reopened tier (its opening walk)
/// answers the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bounded_tier_answers_from_its_index() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = stored_aged(&tier, 15, &[]).await;
    let probed = tier.stats().keys_probed;
    assert_eq!(holds(&tier, &ks), vec![Some(true); 15]);
    assert_eq!(holds(&tier, &[leaf_key(99)]), vec![Some(false)]);
    assert_eq!(tier.stats().keys_probed, probed, "holds() probed the disk");
    let swept = tier.gc_sweep_now().unwrap() as usize;
    assert!(swept > 0);
    let on_disk = present(&tier, &ks);
    assert_eq!(
        holds(&tier, &ks),
        on_disk.iter().map(|p| Some(*p)).collect::<Vec<_>>(),
        "the index answers other than the disk after a sweep"
    );
    drop(tier);
    let tier = open_hand_swept(root.path(), 10, 0.8);
    assert_eq!(
        holds(&tier, &ks),
        on_disk.iter().map(|p| Some(*p)).collect::<Vec<_>>(),
        "a reopened tier's index answers other than the disk"
    );
}

/// A key a sweep has decided on and not yet unlinked is left to a probe (`None`); protected
/// meanwhile, it stays, and is held again once the sweep's batch is over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_on_its_way_out_is_left_to_a_probe() {
    let root = temp_root();
    let tier = Arc::new(open_hand_swept(root.path(), 10, 0.3));
    let ks = stored_aged(&tier, 15, &[]).await; // down to 3 of 10: keys 0..12 are decided
    let (sweep, go_tx) = sweep_held_at(&tier, SweepPoint::Unlinking);
    assert_eq!(holds(&*tier, &ks[..12]), vec![None; 12]);
    assert_eq!(holds(&*tier, &ks[12..]), vec![Some(true); 3]);
    let guard = tier.protect(&ks[..2]);
    go_tx.send(()).unwrap();
    sweep.join().unwrap();
    assert_eq!(
        holds(&*tier, &ks[..2]),
        vec![Some(true); 2],
        "kept, not held"
    );
    assert_eq!(holds(&*tier, &ks[2..12]), vec![Some(false); 10]);
    drop(guard);
}

/// A file another process wrote is not held until a rescan adopts it; one removed by hand
/// is held until a load finds it gone (a miss for that load, never wrong bytes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_changed_by_others_are_seen_by_a_rescan_or_a_load() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = leaf_keys(0..3);
    assert!(fs_store(&tier, &ks[..2], 0).await.is_success());
    // ks[2]: written by another process
    let p = ns().block_path(root.path(), &ks[2]);
    let mut bytes = vec![0u8; BS];
    kv_tier_testkit::fill_block(&ks[2], 0, &mut bytes);
    std::fs::write(&p, bytes).unwrap();
    assert_eq!(tier.holds(&ks[2]), Some(false));
    tier.gc_rescan_now().unwrap();
    assert_eq!(tier.holds(&ks[2]), Some(true), "a rescan did not adopt it");
    std::fs::remove_file(tier.block_path(&ks[0])).unwrap();
    assert_eq!(tier.holds(&ks[0]), Some(true), "the index walked by itself");
    let (r, _) = load(&tier, &ks[..1]).await;
    assert_eq!(r.failed.len(), 1);
    assert_eq!(
        tier.holds(&ks[0]),
        Some(false),
        "a failed load left it held"
    );
}

/// An unbounded tier keeps no index, and a shared root's follower none of its own: every
/// key is probed. The shared root's leader answers for what its index holds and leaves the
/// rest (other members' stores reach it late) to a probe.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_index_of_its_own_every_key_is_probed() {
    let root = temp_root();
    let unbounded = open(root.path());
    let k = test_key(1);
    assert!(fs_store(&unbounded, &[k], 0).await.is_success());
    assert_eq!(holds(&unbounded, &[k, test_key(2)]), vec![None, None]);
    drop(unbounded);

    let dir = temp_root();
    let shared_root = dir.path().join("root");
    let a = open_instance(&shared_root, "a", 60.0);
    wait_until("a leads", SETTLE_LIMIT, || a.stats().shared.unwrap().leader);
    let b = open_instance(&shared_root, "b", 60.0);
    let ka = new_key(5, 1);
    assert!(store_keys(&a, &[ka], 0, SHARED_BS).await.is_success());
    // (the leader's index learns stores, its own too, from the journals it reads)
    wait_until("the leader holds its own store", SETTLE_LIMIT, || {
        a.holds(&ka) == Some(true)
    });
    assert_eq!(
        a.holds(&new_key(5, 3)),
        None,
        "the leader answered for others"
    );
    assert_eq!(holds(&b, &[ka, new_key(5, 3)]), vec![None; 2]);
    b.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}

/// Under a manager: blocks in the fs tier are promoted from the first lookup and the first
/// block it does not hold ends the prefix at once, with no probe and no `Retry`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_manager_finds_the_tiers_blocks_without_a_probe() {
    let root = temp_root();
    let fs = Arc::new(open_hand_swept(root.path(), 10, 0.8));
    let ks = leaf_keys(0..5);
    assert!(fs_store(&*fs, &ks[..4], 0).await.is_success());
    let m = TieringManager::builder(KvTierConfig::new((8 * BS) as u64, BS as u64))
        .primary(lru_dram(8, BS))
        .tier(fs.clone())
        .build()
        .await
        .unwrap();
    let req = RequestContext::new(1);
    use LookupResult::{Hit, HitPending, Miss};
    assert_eq!(
        m.lookup_many(&ks, &req),
        vec![HitPending, HitPending, HitPending, HitPending, Miss]
    );
    assert_eq!(m.last_miss(req.id), Some(MissCause::NotFound));
    m.on_schedule_end();
    m.wait_idle().await;
    assert_eq!(m.lookup_many(&ks[..4], &req), vec![Hit; 4]);
    let s = m.stats();
    assert_eq!(s.retries, 0);
    assert_eq!(fs.stats().keys_probed, 0, "the fs tier was probed");
    assert_eq!(
        (
            s.tiers[0].probes.known_present,
            s.tiers[0].probes.known_absent
        ),
        (4, 1)
    );
}
