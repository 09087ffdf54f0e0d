//! What a commit left out: `PendingStore::commit`'s receipt names, per tier, each block that
//! tier will not be sent and why (its admission rule, its write budget, its write-back bound),
//! and agrees with the tiers' counters and contents.

use std::sync::Arc;

use kv_tier_core::{BlockKey, NotWritten, RequestId, StoreReceipt, TieringManager};
use kv_tier_testkit::{FaultyTier, MemoryTier, fill_block, test_key};

use crate::support::*;

/// The engine's store of `keys` for `req`, returning the commit's receipt.
fn store(m: &TieringManager, req: u64, keys: &[BlockKey]) -> StoreReceipt {
    let mut p = m.prepare_store(keys).unwrap();
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(RequestId(req))
}

/// The keys of `r` left out of `tier` for `why`.
fn left_out(r: &StoreReceipt, tier: &str, why: NotWritten) -> Vec<BlockKey> {
    r.left_out
        .iter()
        .filter(|(t, _, w)| t == tier && *w == why)
        .map(|(_, k, _)| *k)
        .collect()
}

/// "The receipt names the blocks a tier will not get and why": a tier that admits after two
/// lookups gets only the blocks asked for twice, the receipt names the rest as not admitted
/// for that tier alone, and what a tier got plus what the receipt names is every block.
#[test]
fn a_commit_names_the_blocks_a_tier_does_not_admit() {
    let m = memory_manager(
        "",
        r#"{"type": "memory", "name": "ssd", "admit_after_lookups": 2},
           {"type": "memory", "name": "all"}"#,
    );
    let (r1, r2) = (
        kv_tier::RequestContext::new(1),
        kv_tier::RequestContext::new(2),
    );
    let twice: Vec<_> = (0..4).map(test_key).collect();
    let once: Vec<_> = (10..16).map(test_key).collect();
    m.lookup_prefix(&twice, &r1);
    m.lookup_prefix(&twice, &r2);
    m.lookup_prefix(&once, &r1);
    let mut all = twice.clone();
    all.extend(&once);
    let receipt = store(&m, 1, &all);
    assert!(!receipt.is_complete());
    assert_eq!(left_out(&receipt, "ssd", NotWritten::NotAdmitted), once);
    assert!(
        receipt.left_out.iter().all(|(t, _, _)| t == "ssd"),
        "only ssd left anything out: {receipt:?}"
    );
    m.runtime().block_on(m.wait_idle());
    let ssd = m.tier::<MemoryTier>("ssd").unwrap();
    assert_eq!(ssd.len(), twice.len());
    assert_eq!(m.tier::<MemoryTier>("all").unwrap().len(), all.len());
    let s = m.stats();
    assert_eq!(s.tiers[0].not_admitted, once.len() as u64);
    // a block already in DRAM is not stored again: nothing to leave out
    assert!(store(&m, 1, &twice).is_complete());
}

/// A tier whose write-back is full drops the blocks past its limit (policy `drop`): the
/// receipt names exactly those, and they are the ones the tier never got.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_names_the_blocks_a_full_write_back_dropped() {
    let inner = Arc::new(MemoryTier::new("b", BS));
    let b = Arc::new(FaultyTier::new(inner.clone()));
    let a = Arc::new(MemoryTier::new("a", BS));
    let limit = (2 * BS) as f64 / (1u64 << 20) as f64; // two blocks
    let m = two_tier_manager(64, a, b.clone(), |_, o| {
        o[1].write_back_limit_mb = Some(limit)
    })
    .await;
    let gate = b.hold_stores();
    let keys: Vec<_> = (0..5).map(test_key).collect();
    let receipt = store(&m, 1, &keys);
    let dropped = left_out(&receipt, "b", NotWritten::WriteBackFull);
    assert_eq!(dropped.len(), 3, "{receipt:?}");
    assert_eq!(receipt.left_out.len(), 3, "tier a took everything");
    assert_eq!(m.stats().tiers[1].writes_dropped, 3);
    gate.open();
    m.wait_idle().await;
    for k in &keys {
        assert_eq!(
            inner.contains(k),
            !dropped.contains(k),
            "{k}: in tier b exactly when the receipt does not name it"
        );
    }
}
