//! The engine's side of the manager in the tests: seeding a tier, stores that report their
//! evictions, loads that verify their bytes, a step that waits, the checks that nothing is
//! left once requests end, events sorted by tier, a `ProbeCache` driven directly, and futures
//! dropped at chosen points.

use std::collections::{BTreeMap, HashSet};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use kv_tier_core::LookupResult::{HitPending, Retry};
use kv_tier_core::{
    BlockKey, LookupResult, ProbeCache, RequestContext, RequestId, SecondaryTier, TierEvent,
    TieringManager,
};
use kv_tier_cpu::CpuTier;
use kv_tier_testkit::fixtures::manager::block_on_idle;
use kv_tier_testkit::wait::{SETTLE_LIMIT, poll_until};
use kv_tier_testkit::{fill_block, store_keys, test_key, verify_block};
use tokio::sync::Notify;

use super::*;

/// Puts blocks straight into a secondary tier (as if stored by an earlier process): one
/// store job of `keys` (salt 0), which must succeed; the tier's events are drained.
pub(crate) async fn seed(t: &dyn SecondaryTier, keys: &[BlockKey]) {
    assert!(store_keys(t, keys, 0, BS).await.is_success());
    t.take_events();
}

/// Seeds `keys` into the scripted tier `t`'s memory tier, on `m`'s runtime.
pub(crate) fn put(m: &TieringManager, t: &Script, keys: &[BlockKey]) {
    let r = m
        .runtime()
        .block_on(store_keys(&*t.inner, keys, 0, m.block_size()));
    assert!(r.is_success());
}

/// Asserts that DRAM holds every key of `keys` with its bytes (salt 0).
pub(crate) fn assert_dram_bytes(cpu: &CpuTier, keys: &[BlockKey]) {
    let views = cpu.prepare_load(keys).unwrap();
    for (k, v) in keys.iter().zip(views) {
        assert!(
            verify_block(k, 0, v.as_slice()),
            "DRAM bytes of {k} are wrong"
        );
    }
}

/// prepare_store + fill + commit; returns the keys evicted to make room.
pub(crate) fn store_evicting(m: &TieringManager, req: u64, keys: &[BlockKey]) -> Vec<BlockKey> {
    let mut p = m.prepare_store(keys).expect("store refused");
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    let ev = p.evicted().to_vec();
    p.commit(RequestId(req));
    ev
}

/// Whether `key` is a `Hit` for a request that asks nothing else.
pub(crate) fn is_hit(m: &TieringManager, key: &BlockKey) -> bool {
    m.lookup(key, &RequestContext::new(999_999)) == LookupResult::Hit
}

/// Per tier, the events in the order returned.
pub(crate) fn by_tier(events: &[TierEvent]) -> BTreeMap<String, Vec<TierEvent>> {
    let mut m: BTreeMap<String, Vec<TierEvent>> = BTreeMap::new();
    for e in events {
        m.entry(e.tier.clone()).or_default().push(e.clone());
    }
    m
}

/// (key, removed) in order for one tier's events.
pub(crate) fn flat(events: &[TierEvent]) -> Vec<(BlockKey, bool)> {
    events
        .iter()
        .flat_map(|e| e.keys.iter().map(move |k| (*k, e.removed)))
        .collect()
}

/// Replays DRAM's events into `replica` (the keys they say DRAM holds), asserting each is
/// possible: a store of a key not held, a removal of a key held.
pub(crate) fn replay_dram(events: &[TierEvent], replica: &mut HashSet<BlockKey>, ctx: &str) {
    for e in events.iter().filter(|e| e.tier == CPU) {
        for key in &e.keys {
            if e.removed {
                assert!(
                    replica.remove(key),
                    "{ctx}: {key} removed from DRAM, not held"
                );
            } else {
                assert!(replica.insert(*key), "{ctx}: {key} stored in DRAM twice");
            }
        }
    }
}

/// Iterator helper: positions of matching items.
pub(crate) trait Positions: Iterator + Sized {
    fn positions<F: FnMut(Self::Item) -> bool>(self, mut f: F) -> Vec<usize> {
        self.enumerate()
            .filter_map(|(i, x)| f(x).then_some(i))
            .collect()
    }
}

impl<I: Iterator> Positions for I {}

/// `prepare_load` of `keys` succeeds and every view holds the stored bytes.
pub(crate) fn load_verify(m: &TieringManager, keys: &[BlockKey]) {
    let views = m
        .prepare_load(keys)
        .expect("prepare_load of Hit keys failed");
    assert_eq!(views.len(), keys.len());
    for (k, v) in keys.iter().zip(&views) {
        assert!(verify_block(k, 0, v.as_slice()), "{k}: wrong bytes served");
    }
}

/// Asserts that every view of a successful `prepare_load` holds the stored bytes.
pub(crate) fn load_and_verify(m: &TieringManager, keys: &[BlockKey]) -> bool {
    match m.prepare_load(keys) {
        Ok(views) => {
            assert_eq!(views.len(), keys.len());
            for (k, v) in keys.iter().zip(&views) {
                assert!(
                    verify_block(k, 0, v.as_slice()),
                    "{k}: wrong or torn bytes served"
                );
            }
            true
        }
        Err(_) => false,
    }
}

/// Ends a scheduler step and waits until the manager is idle.
pub(crate) fn step_and_wait(m: &TieringManager) {
    m.on_schedule_end();
    block_on_idle(m);
}

/// After all requests ended and the manager is idle: nothing tracked, pinned, held, leased.
pub(crate) fn assert_clean(m: &TieringManager) {
    block_on_idle(m);
    let s = m.stats();
    assert_eq!(s.held_blocks, 0, "held blocks left: {s:#?}");
    assert_eq!(s.holding_requests, 0, "holding requests left");
    assert_eq!(s.write_back_pinned_bytes, 0, "write-back pins left");
    assert_eq!(s.primary.writing_blocks, 0, "DRAM slots left Writing");
    for t in &s.tiers {
        assert_eq!(t.write_back_bytes, 0, "{}: write-back bytes left", t.name);
        assert_eq!(t.leased_keys, 0, "{}: leases left", t.name);
        assert_eq!(t.tracked_keys, 0, "{}: tracked keys left", t.name);
        assert_eq!(t.tracked_requests, 0, "{}: tracked requests left", t.name);
    }
    // every DRAM slot is reusable at once: one store of `capacity` fresh keys
    let cap = s.primary.capacity_blocks;
    let fresh: Vec<BlockKey> = (0..cap as u64).map(|i| test_key(9_000_000 + i)).collect();
    let p = m.prepare_store(&fresh);
    assert!(p.is_ok(), "DRAM not fully reusable: {:?}", p.err());
    let p = p.unwrap();
    assert_eq!(p.keys().len() + p.present().len(), cap);
    p.abort();
}

/// After every request finished: the manager idle, nothing tracked, leased, held or pinned,
/// no key of `keys` protected in any tier (bounded: a tier's own threads may still let go),
/// and the whole DRAM pool reusable at once.
pub(crate) fn assert_nothing_left(m: &TieringManager, keys: &[BlockKey]) {
    block_on_idle(m);
    let s = m.stats();
    assert_eq!(s.held_blocks, 0, "held blocks left: {s:#?}");
    assert_eq!(s.holding_requests, 0, "holding requests left");
    assert_eq!(s.write_back_pinned_bytes, 0, "write-back pins left");
    assert_eq!(s.primary.writing_blocks, 0, "DRAM slots left Writing");
    for t in &s.tiers {
        assert_eq!(t.write_back_bytes, 0, "{}: write-back bytes left", t.name);
        assert_eq!(t.tracked_keys, 0, "{}: tracked keys left", t.name);
        assert_eq!(t.tracked_requests, 0, "{}: tracked requests left", t.name);
    }
    assert!(
        poll_until(SETTLE_LIMIT, || m
            .stats()
            .tiers
            .iter()
            .all(|t| t.leased_keys == 0)),
        "leases left: {:?}",
        m.stats()
            .tiers
            .iter()
            .map(|t| t.leased_keys)
            .collect::<Vec<_>>()
    );
    for t in m.tiers() {
        assert!(
            poll_until(SETTLE_LIMIT, || keys.iter().all(|k| !t.is_protected(k))),
            "{}: keys still protected: {:?}",
            t.info().name,
            keys.iter()
                .filter(|k| t.is_protected(k))
                .collect::<Vec<_>>()
        );
    }
    let cap = s.primary.capacity_blocks;
    let fresh: Vec<BlockKey> = (0..cap as u64).map(|i| test_key(90_000_000 + i)).collect();
    let p = m.prepare_store(&fresh);
    assert!(p.is_ok(), "DRAM not fully reusable: {:?}", p.err());
    let p = p.unwrap();
    assert_eq!(p.keys().len() + p.present().len(), cap);
    p.abort();
}

/// Asserts that no tier of `fx`'s manager tracks a key or request or holds a lease.
pub(crate) fn assert_no_lookup_state(fx: &Fx) {
    for t in fx.m.stats().tiers {
        assert_eq!(
            (t.tracked_keys, t.tracked_requests, t.leased_keys),
            (0, 0, 0),
            "lookup state left in tier {}",
            t.name
        );
    }
}

/// Stores `n` fresh junk keys (request `req`, finished) so every older DRAM block is evicted,
/// and lets their cascades land.
pub(crate) fn flush_dram(m: &TieringManager, req: u64) {
    let n = m.stats().primary.capacity_blocks;
    let junk: Vec<BlockKey> = (0..n as u64)
        .map(|i| test_key(50_000_000 + req * 1000 + i))
        .collect();
    engine_store(m, RequestId(req), &junk);
    m.on_request_finished(RequestId(req));
    block_on_jobs(m);
}

/// `k`'s hash in group `round`: a new key per round with the same layout path.
pub(crate) fn test_key_round(k: &BlockKey, round: u32) -> BlockKey {
    BlockKey::from_hash32(k.hash_bytes().try_into().unwrap(), round)
}

/// Sets up, over a `FaultyTier` on a `MemoryTier`, one of each kind of background work held
/// at a gate: a store cascade, a promotion (load) and a probe. Returns the gates
/// (stores, loads, lookups) and the keys (stored, promoted, probed).
pub(crate) fn park_everything(
    m: &TieringManager,
    mem: &MemoryTier,
    faulty: &FaultyTier,
    rt: &tokio::runtime::Runtime,
) -> ([Gate; 3], [BlockKey; 3]) {
    let (ks, kp, kq) = (test_key(151), test_key(152), test_key(153));
    assert!(rt.block_on(store_keys(mem, &[kp, kq], 0, BS)).is_success());
    let r1 = ctx(1);
    assert_eq!(m.lookup(&kp, &r1), Retry);
    m.on_schedule_end();
    block_on_idle(m);
    assert_eq!(m.lookup(&kp, &r1), HitPending);
    let loads = faulty.hold_loads();
    let lookups = faulty.hold_lookups();
    assert_eq!(m.lookup(&kq, &r1), Retry);
    m.on_schedule_end(); // sends the load of kp and the probe of kq
    let stores = faulty.hold_stores();
    engine_store(m, RequestId(2), &[ks]);
    m.on_schedule_end();
    block_on(m, async {
        tokio::time::timeout(SETTLE_LIMIT, async {
            loads.wait_arrived(1).await;
            lookups.wait_arrived(1).await;
            stores.wait_arrived(1).await;
        })
        .await
    })
    .expect("the parked work never reached its gates");
    ([stores, loads, lookups], [ks, kp, kq])
}

/// A `ProbeCache` over `t` on the current runtime, and the notify its probes report to.
pub(crate) fn probe_cache(t: Arc<dyn SecondaryTier>) -> (ProbeCache, Arc<Notify>) {
    let notify = Arc::new(Notify::new());
    let al = ProbeCache::new(t, tokio::runtime::Handle::current(), notify.clone());
    (al, notify)
}

/// Waits (at most 10 s of the runtime's clock) until every probe sent has reported, then
/// applies the answers.
pub(crate) async fn settle_probes(al: &mut ProbeCache, notify: &Notify) {
    let done = tokio::time::timeout(Duration::from_secs(10), async {
        while !al.all_arrived() {
            notify.notified().await;
        }
    })
    .await;
    assert!(done.is_ok(), "probes never reported");
    al.apply_results();
}

/// Polls `fut` up to `n` times (yielding between polls), then drops it unless it finished.
pub(crate) async fn poll_n<F: Future>(fut: F, n: usize) -> Option<F::Output> {
    let mut fut = pin!(fut);
    for i in 0..n {
        if let Poll::Ready(v) = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await
        {
            return Some(v);
        }
        if i + 1 < n {
            tokio::task::yield_now().await;
        }
    }
    None
}

/// Drops `fut` at the `i`-th of a spread of points: after 0..8 polls, or after a timeout of
/// a few hundred microseconds to tens of milliseconds.
pub(crate) async fn drop_at<F: Future>(fut: F, i: usize) -> Option<F::Output> {
    if i < 8 {
        poll_n(fut, i).await
    } else {
        let us = [50u64, 200, 500, 1_000, 3_000, 10_000, 30_000, 80_000][(i - 8) % 8];
        tokio::time::timeout(Duration::from_micros(us), fut)
            .await
            .ok()
    }
}
