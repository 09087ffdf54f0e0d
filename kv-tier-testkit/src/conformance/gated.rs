//! The cases of a capability: they run when the tier declares it, with the fixture's hook.

use std::collections::BTreeSet;

use kv_tier_core::BlockKey;

use super::cases::{keys, load, store, within};
use super::{Bound, Damage, TierFixture};
use crate::util::{removed_keys, verify_block};

/// Stores `ks` in chunks of a quarter of the bound; after each chunk, settles and sweeps, then
/// calls `check` with every key evicted so far.
async fn store_sweeping(
    fx: &TierFixture,
    b: &Bound,
    ks: &[BlockKey],
    gone: &mut BTreeSet<BlockKey>,
    mut check: impl FnMut(&BTreeSet<BlockKey>),
) {
    let chunk = (b.capacity_blocks / 4).max(1);
    for part in ks.chunks(chunk) {
        let res = within("a store", store(fx, part, 0)).await;
        assert!(
            res.is_success(),
            "a store into the bounded tier failed: {:?}",
            res.failed
        );
        b.settle().await;
        within("a sweep", b.sweep()).await;
        gone.extend(removed_keys(fx.tier.take_events()));
        let (used, bound) = b.usage();
        assert!(
            used <= bound,
            "after a sweep the tier uses {used}, over its bound {bound}"
        );
        check(gone);
    }
}

/// `bounded`: storing three times the bound, with a sweep after every quarter of it, keeps the
/// tier within its bound after every sweep; what it evicted is reported removed and is absent,
/// and what it kept loads whole.
pub async fn bounded_tier_stays_within_its_bound(fx: &TierFixture) {
    if !fx.tier.info().capability.bounded {
        return;
    }
    let b = fx
        .require_bound("bounded_tier_stays_within_its_bound")
        .clone();
    let n = b.capacity_blocks.max(4);
    let ks = keys(30, 3 * n);
    let mut gone = BTreeSet::new();
    store_sweeping(fx, &b, &ks, &mut gone, |_| {}).await;
    assert!(
        !gone.is_empty(),
        "storing 3x the bound ({} blocks) evicted nothing",
        3 * n
    );
    let present = within("a lookup", fx.tier.lookup(&ks)).await.unwrap();
    for (k, p) in ks.iter().zip(&present) {
        assert!(
            !(gone.contains(k) && *p),
            "{k} was reported removed and is still found"
        );
    }
    let kept: Vec<BlockKey> = ks
        .iter()
        .zip(&present)
        .filter(|(_, p)| **p)
        .map(|(k, _)| *k)
        .collect();
    let (res, data) = load(fx, &kept).await;
    assert!(
        res.is_success(),
        "kept keys failed to load: {:?}",
        res.failed
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// `bounded`: keys protected while the tier overflows twice over are never evicted (they are
/// the oldest, so an LRU would take them first); once released, they are.
pub async fn bounded_tier_never_evicts_a_protected_key(fx: &TierFixture) {
    if !fx.tier.info().capability.bounded {
        return;
    }
    let b = fx
        .require_bound("bounded_tier_never_evicts_a_protected_key")
        .clone();
    let n = b.capacity_blocks.max(4);
    let prot = keys(31, n / 4);
    assert!(store(fx, &prot, 0).await.is_success());
    let guard = fx.tier.protect(&prot);
    b.settle().await;
    let mut gone = BTreeSet::new();
    store_sweeping(fx, &b, &keys(32, 2 * n), &mut gone, |gone| {
        let lost: Vec<_> = prot.iter().filter(|k| gone.contains(*k)).collect();
        assert!(lost.is_empty(), "protected keys were evicted: {lost:?}");
    })
    .await;
    assert!(!gone.is_empty(), "overflowing the bound evicted nothing");
    let (res, data) = load(fx, &prot).await;
    assert!(
        res.is_success(),
        "protected keys failed to load: {:?}",
        res.failed
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    drop(guard);
    b.settle().await;
    store_sweeping(fx, &b, &keys(33, 2 * n), &mut gone, |_| {}).await;
    assert!(
        prot.iter().any(|k| gone.contains(k)),
        "released, the oldest keys were still never evicted: protection is not what kept them"
    );
}

/// Stores `a` then `b` (settling between), then touches `a`: `b` is now the least recent.
async fn older_and_touched(fx: &TierFixture, bound: &Bound, a: &[BlockKey], b: &[BlockKey]) {
    assert!(store(fx, a, 0).await.is_success());
    bound.settle().await;
    assert!(store(fx, b, 0).await.is_success());
    bound.settle().await;
    fx.tier.touch(a);
    bound.settle().await;
}

/// Fails when a touched key was evicted while an untouched older one survives.
fn assert_lru(gone: &BTreeSet<BlockKey>, touched: &[BlockKey], older: &[BlockKey]) {
    let touched_gone = touched.iter().filter(|k| gone.contains(*k)).count();
    let older_kept = older.iter().filter(|k| !gone.contains(*k)).count();
    assert!(
        touched_gone == 0 || older_kept == 0,
        "{touched_gone} keys touched after the others were stored were evicted while {older_kept} older keys survive: eviction does not follow touch"
    );
}

/// `bounded`: keys touched after others were stored outlive them: while the tier evicts, no
/// touched key goes while an untouched older one stays.
pub async fn bounded_eviction_follows_touch(fx: &TierFixture) {
    if !fx.tier.info().capability.bounded {
        return;
    }
    let bound = fx.require_bound("bounded_eviction_follows_touch").clone();
    let n = bound.capacity_blocks.max(4);
    let (a, b) = (keys(34, n / 4), keys(35, n / 4));
    older_and_touched(fx, &bound, &a, &b).await;
    let mut gone = BTreeSet::new();
    store_sweeping(fx, &bound, &keys(36, 2 * n), &mut gone, |g| {
        assert_lru(g, &a, &b)
    })
    .await;
    assert!(
        b.iter().all(|k| gone.contains(k)),
        "storing twice the bound left older keys"
    );
}

/// `persistent`: blocks stored before a shutdown are found and load whole after a reopen; a
/// bounded tier's recency survives too (keys touched before the reopen outlive older ones).
pub async fn persistent_blocks_and_recency_survive_a_reopen(fx: &TierFixture) {
    let info = fx.tier.info();
    if !info.capability.persistent {
        return;
    }
    const CASE: &str = "persistent_blocks_and_recency_survive_a_reopen";
    let ks = keys(40, 8);
    assert!(store(fx, &ks, 3).await.is_success());
    let lru = if info.capability.bounded {
        let bound = fx.require_bound(CASE).clone();
        let n = bound.capacity_blocks.max(4);
        let (a, b) = (keys(41, n / 4), keys(42, n / 4));
        older_and_touched(fx, &bound, &a, &b).await;
        Some((n, a, b))
    } else {
        None
    };
    let _ = fx.tier.take_events();
    within("shutdown", fx.tier.shutdown())
        .await
        .expect("shutdown failed");
    let fx2 = fx.reopened(CASE).await;
    assert_eq!(
        within("a lookup after reopening", fx2.tier.lookup(&ks))
            .await
            .unwrap(),
        vec![true; ks.len()],
        "blocks stored before the reopen are not found"
    );
    let (res, data) = load(&fx2, &ks).await;
    assert!(
        res.is_success(),
        "blocks stored before the reopen do not load: {:?}",
        res.failed
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 3, d)));
    if let Some((n, a, b)) = lru {
        let bound = fx2.require_bound(CASE).clone();
        let mut gone = BTreeSet::new();
        store_sweeping(&fx2, &bound, &keys(43, 2 * n), &mut gone, |g| {
            assert_lru(g, &a, &b)
        })
        .await;
    }
    let _ = within("shutdown", fx2.tier.shutdown()).await;
}

/// `checksums`: every kind of damage the tier's format has turns the key into a failed load,
/// never bytes; a store then makes the key whole again, and the key whose block was copied
/// over it is unharmed.
pub async fn checksums_turn_every_damage_into_a_miss(fx: &TierFixture) {
    if !fx.tier.info().capability.checksums {
        return;
    }
    const CASE: &str = "checksums_turn_every_damage_into_a_miss";
    let other = keys(50, 1)[0];
    assert!(store(fx, &[other], 9).await.is_success());
    let ks = keys(51, 6);
    assert!(store(fx, &ks, 1).await.is_success());
    let mut applied = Vec::new();
    for (k, d) in ks.iter().zip(Damage::all(other)) {
        if !fx.do_damage(CASE, *k, d).await {
            continue;
        }
        applied.push(d);
        let (res, data) = load(fx, &[*k]).await;
        assert!(
            res.ok.is_empty() && data.is_empty(),
            "{d:?}: the damaged block of {k} was served as bytes"
        );
        let res = within("a store", store(fx, &[*k], 1)).await;
        assert!(res.is_success(), "{d:?}: a store after the damage failed");
        let (res, data) = load(fx, &[*k]).await;
        assert!(
            res.is_success() && verify_block(k, 1, &data[0].1),
            "{d:?}: after a failed load and a store, {k} does not load whole: {:?}",
            res.failed
        );
    }
    assert!(
        applied.contains(&Damage::FlipByte),
        "the damage hook applied no FlipByte (applied: {applied:?})"
    );
    let (res, data) = load(fx, &[other]).await;
    assert!(
        res.is_success() && verify_block(&other, 9, &data[0].1),
        "the key whose block was copied was harmed"
    );
}
