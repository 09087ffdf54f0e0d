//! Chain-aware eviction: blocks stored with their chain links (`StoreJob::links`) go tail
//! first, so a sweep never takes a chain's earlier block while a later one stays; blocks whose
//! chain is broken before them are counted as dead bytes.

use kv_tier_testkit::temp_root;

use crate::support::*;

/// Promise (kv-tier-core `lru` docs, "Chains"): "a block that a later block of its chain
/// follows is not a candidate until that later block is gone"; "among tails the order is
/// LRU, where a block that became a tail ... takes the follower's recency". A chain whose head
/// is the oldest file and whose tail was used lately stays whole, where plain mtime LRU would
/// take its first four blocks; the seven oldest unlinked blocks go instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chain_used_at_its_tail_keeps_its_head() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = leaf_keys(0..15);
    store_chain(&tier, &ks[..5], None).await;
    assert!(fs_store(&tier, &ks[5..], 0).await.is_success());
    // the chain's head oldest of all, its tail used 400 s ago (outside the 300 s grace)
    age(&tier, &ks, |i| {
        if i == 4 { 400 } else { (15 - i as u64) * 1000 }
    });
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    let p = present(&tier, &ks);
    assert_eq!(
        p,
        (0..15).map(|i| !(5..12).contains(&i)).collect::<Vec<_>>(),
        "the chain stays whole, the seven oldest others go"
    );
    assert_eq!(gc_stats(&tier).dead_bytes, 0);
}

/// An unused chain goes tail first and whole, back to front: its head is the last of it to
/// go, after blocks newer than the head but older than the chain's tail.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cold_chain_goes_tail_first() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = leaf_keys(0..15);
    store_chain(&tier, &ks[..5], None).await;
    assert!(fs_store(&tier, &ks[5..], 0).await.is_success());
    // the chain's tail 10,500 s ago: between ks[5] (10,000) and older blocks
    age(&tier, &ks, |i| match i {
        0..4 => 20_000,
        4 => 10_500,
        _ => (15 - i as u64) * 1000,
    });
    // 7 go: the chain's tail inherits back to its head (4, 3, 2, 1, 0), then ks[5], ks[6]
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| i >= 7).collect::<Vec<_>>()
    );
}

/// A block whose parent is not in the tier is dead (a prefix lookup cannot reach it here)
/// until the parent is stored; its bytes are counted in `dead_bytes`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_after_a_missing_parent_are_dead_bytes() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 100, 0.8);
    let ks = leaf_keys(0..4);
    store_chain(&tier, &ks[1..], Some(ks[0])).await;
    let s = gc_stats(&tier);
    assert_eq!(
        s.dead_bytes,
        s.bytes - s.dir_bytes,
        "all three follow a missing block"
    );
    assert!(s.dead_bytes > 0);
    store_chain(&tier, &ks[..1], None).await;
    assert_eq!(gc_stats(&tier).dead_bytes, 0);
}

/// A victim whose parent was used lately (a shared prefix's block) makes the parent a
/// candidate far down the order: the sweep reads on from the victim, so the older blocks in
/// between go first and the parent stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parent_used_lately_waits_its_turn_after_its_follower_goes() {
    let root = temp_root();
    let tier = open_hand_swept(root.path(), 10, 0.8);
    let ks = leaf_keys(0..15);
    store_chain(&tier, &ks[..2], None).await;
    assert!(fs_store(&tier, &ks[2..], 0).await.is_success());
    // the follower oldest of all, its parent used 400 s ago
    age(&tier, &ks, |i| match i {
        0 => 400,
        1 => 20_000,
        _ => (15 - i as u64) * 1000,
    });
    assert_eq!(tier.gc_sweep_now().unwrap(), 7);
    assert_eq!(
        present(&tier, &ks),
        (0..15).map(|i| i == 0 || i >= 8).collect::<Vec<_>>(),
        "the follower and the six oldest others go, the parent stays"
    );
}
