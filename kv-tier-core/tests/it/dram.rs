//! The DRAM tier as the manager exposes it: views pin their slots through eviction churn and
//! resets, eviction in exact LRU order, ARC keeps a frequently used set through a scan, stores
//! refused exactly when there is no room.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};

use kv_tier::{Error, TierEvent};
use kv_tier_core::{BlockKey, RequestId};
use kv_tier_testkit::{fill_block, test_key, verify_block};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn touch_refreshes_dram_recency_through_the_manager() {
    let fx = evented_manager(2, vec![]).await;
    let (a, b, c) = (test_key(1), test_key(2), test_key(3));
    engine_store(&fx.m, RequestId(1), &[a]);
    engine_store(&fx.m, RequestId(1), &[b]);
    fx.m.touch(&[a]);
    let p = fx.m.prepare_store(&[c]).unwrap();
    assert_eq!(p.evicted(), [b]);
}

/// Promise (`EvictionPolicy::Chain`; `PrimaryTier::link`): the manager tells
/// DRAM where its blocks sit in their chains, and DRAM evicts a chain's later blocks before
/// its earlier ones. A 4-block pool holds a request's chain 0 <- 1 <- 2 and a block 3 stored
/// after it; two new blocks evict 2, then 1, and the chain's head stays. Under `"lru"` they
/// evict 0 and 1, the oldest, and block 2 is left behind a hole; so is it when the manager
/// sends no links.
#[test]
fn dram_evicts_a_chain_from_its_tail() {
    for (policy, evicted) in [("chain", [2, 1]), ("lru", [0, 1])] {
        let m = build(dram_cfg(
            4,
            BS,
            &format!(r#", "eviction_policy": "{policy}""#),
        ));
        let ks: Vec<_> = (0..6).map(|i| test_key(8_000 + i)).collect();
        engine_store(&m, RequestId(1), &ks[..3]);
        engine_store(&m, RequestId(2), &ks[3..4]);
        let p = m.prepare_store(&ks[4..]).unwrap();
        assert_eq!(
            p.evicted(),
            evicted.map(|i| ks[i]),
            "{policy}: evicted in this order"
        );
    }
}

/// Promise (`PrimaryTier::link`: "the blocks a store or a promotion has just made readable
/// whose links it knows"): blocks promoted from a tier are linked as the request's lookup
/// listed them, also when the request finished while its promotion was on its way (the
/// blocks land for the requests after it). A tier holds a chain 0 <- 1 <- 2 that a request
/// promotes into a 4-block pool; blocks 1 and 2 are used again; a store of three new blocks
/// takes the free slot and evicts 2, then 1 (LRU would take 0, then 1).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_promoted_into_dram_are_evicted_from_their_chains_tail() {
    for finish_first in [false, true] {
        let inner = mem("fs");
        let ks: Vec<_> = (0..3).map(|i| test_key(8_100 + i)).collect();
        seed(&*inner, &ks).await;
        let t = std::sync::Arc::new(kv_tier_testkit::FaultyTier::new(inner));
        // the DRAM policy "chain", for the manager and the DRAM tier
        let mut cfg = kv_tier_core::KvTierConfig::new((4 * BS) as u64, BS as u64);
        cfg.eviction_policy = kv_tier_core::EvictionPolicy::Chain;
        let cpu = std::sync::Arc::new(kv_tier_cpu::CpuTier::from_config(&cfg).unwrap());
        let m = kv_tier_core::TieringManager::builder(cfg)
            .primary(cpu)
            .tier(t.clone())
            .build()
            .await
            .unwrap();
        let req = kv_tier_core::RequestContext::new(1);
        // a probe, then the promotion
        m.lookup_many(&ks, &req);
        m.on_schedule_end();
        m.wait_idle().await;
        let loads = t.hold_loads();
        m.lookup_many(&ks, &req);
        m.on_schedule_end();
        if finish_first {
            loads.wait_arrived(1).await; // the promotion is in flight
            m.on_request_finished(req.id);
        }
        loads.open();
        m.wait_idle().await;
        let after = kv_tier_core::RequestContext::new(2);
        m.on_schedule_end();
        assert_eq!(
            m.lookup_prefix(&ks, &after).hit,
            3,
            "promoted ({finish_first})"
        );
        m.on_request_finished(req.id);
        m.on_request_finished(after.id);
        // the trailing window used again (a sliding-window group's): by its own use the
        // chain's head is now the least recent
        m.touch(&ks[1..]);
        let fresh: Vec<_> = (0..3).map(|i| test_key(8_200 + i)).collect();
        let p = m.prepare_store(&fresh).unwrap();
        assert_eq!(
            p.evicted(),
            [ks[2], ks[1]],
            "finished first: {finish_first}"
        );
        drop(p);
        m.shutdown().await.unwrap();
    }
}

/// Promise (kv-tier-cpu/README.md): "`prepare_store` never evicts a key of its own batch and
/// refuses cleanly, changing nothing, when it cannot make room"; kv-tier-core/src/tier.rs:
/// "Refuses with [`Error::CapacityExhausted`] and changes nothing when it cannot make room";
/// PrimaryStats::refused_stores: "`prepare_store` calls refused for lack of room".
#[test]
fn a_store_larger_than_the_pool_is_refused_changing_nothing() {
    let m = build(dram_cfg(4, BS, ""));
    let old: Vec<_> = (0..4).map(test_key).collect();
    store_evicting(&m, 1, &old);
    let before = m.stats().primary;
    let new: Vec<_> = (100..105).map(test_key).collect();
    match m.prepare_store(&new) {
        Err(Error::CapacityExhausted { .. }) => {}
        Err(e) => panic!("refused with the wrong error: {e}"),
        Ok(p) => panic!("5 new keys in a 4-block pool: slots {}", p.keys().len()),
    }
    let after = m.stats().primary;
    assert_eq!(after.ready_blocks, before.ready_blocks);
    assert_eq!(after.writing_blocks, 0);
    assert_eq!(after.evictions, before.evictions, "a refused store evicted");
    assert_eq!(after.refused_stores, before.refused_stores + 1);
    for key in &old {
        assert!(is_hit(&m, key), "{key} lost to a refused store");
        let v = m.prepare_load(&[*key]).unwrap();
        assert!(verify_block(key, 0, v[0].as_slice()));
    }
    // all pinned: even one new key cannot be placed, and nothing changes
    let views = m.prepare_load(&old).unwrap();
    assert!(matches!(
        m.prepare_store(&[test_key(200)]),
        Err(Error::CapacityExhausted { .. })
    ));
    assert_eq!(m.stats().primary.evictions, before.evictions);
    drop(views);
    // a batch of three present keys and one new one evicts the fourth, never its own
    let mixed = vec![old[0], old[1], old[2], test_key(300)];
    let mut p = m.prepare_store(&mixed).unwrap();
    assert_eq!(p.keys(), vec![test_key(300)]);
    assert_eq!(p.present().len(), 3);
    assert_eq!(p.evicted(), &[old[3]], "evicted a key of its own batch");
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    p.commit(RequestId(2));
}

/// Promise (kv-tier/src/lib.rs "The step loop"): "`prepare_load` pins the `Hit` blocks";
/// kv-tier-cpu/src/tier.rs: "a pinned slot is never evicted or reused";
/// kv-tier-core/src/manager/lifecycle.rs `reset_cache`: "Returns how many blocks stay in DRAM
/// because readers still pin them". A view's bytes never change while it is held, whatever
/// stores, evictions and resets happen meanwhile on other threads.
#[test]
fn views_hold_their_bytes_under_eviction_churn_and_reset_cache() {
    let m = build(dram_cfg(6, BS, ""));
    let pinned: Vec<_> = (0..2).map(test_key).collect();
    store_evicting(&m, 1, &pinned);
    let views = m.prepare_load(&pinned).unwrap();
    let copies: Vec<Vec<u8>> = views.iter().map(|v| v.as_slice().to_vec()).collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (m, stop, pinned) = (&m, &stop, &pinned);
            s.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let key = test_key(10_000 * (t + 1) + i % 50);
                    if let Ok(mut p) = m.prepare_store(&[key]) {
                        for (key, sk) in p.slots() {
                            fill_block(key, 0, sk.as_mut_slice());
                        }
                        assert!(!p.evicted().iter().any(|e| pinned.contains(e)));
                        p.commit(RequestId(t + 10));
                    }
                    if let Ok(v) = m.prepare_load(&[key]) {
                        assert!(
                            verify_block(&key, 0, v[0].as_slice()),
                            "wrong bytes for {key}"
                        );
                    }
                    i += 1;
                }
            });
        }
        for _ in 0..20 {
            let left = m.runtime().block_on(m.reset_cache());
            assert!(
                left >= 2,
                "reset_cache reported {left} pinned, 2 views are held"
            );
            for (v, c) in views.iter().zip(&copies) {
                assert_eq!(v.as_slice(), &c[..], "a held view changed");
            }
        }
        stop.store(true, Ordering::SeqCst);
    });
    for (key, v) in pinned.iter().zip(&views) {
        assert!(verify_block(key, 0, v.as_slice()));
        assert!(is_hit(&m, key), "a pinned block left DRAM");
    }
    drop(views);
    assert_eq!(m.runtime().block_on(m.reset_cache()), 0);
    let st = m.stats().primary;
    assert_eq!((st.ready_blocks, st.writing_blocks), (0, 0), "{st:?}");
    assert!(!is_hit(&m, &pinned[0]));
}

/// Promise (kv-tier-core/src/manager/mod.rs): `prepare_store` "Reserves DRAM slots for
/// `keys` (evicting least-recently-used unpinned blocks)"; `touch`: "Refreshes recency of
/// `keys` in DRAM (the first key ends most recent)". Under LRU the victims come in exactly
/// least-recently-used order.
#[test]
fn lru_evicts_in_exact_recency_order() {
    let m = build(dram_cfg(4, BS, r#", "eviction_policy": "lru""#));
    for i in 0..4 {
        assert!(store_evicting(&m, 1, &[test_key(i)]).is_empty());
    }
    // recency now, newest first: 3 2 1 0. touch([1, 0]) -> 1 0 3 2
    m.touch(&[test_key(1), test_key(0)]);
    assert_eq!(store_evicting(&m, 1, &[test_key(4)]), vec![test_key(2)]);
    assert_eq!(store_evicting(&m, 1, &[test_key(5)]), vec![test_key(3)]);
    // newest first: 5 4 1 0; touch([0]) -> 0 5 4 1
    m.touch(&[test_key(0)]);
    assert_eq!(store_evicting(&m, 1, &[test_key(6)]), vec![test_key(1)]);
    // 6 0 5 4: two at once evict the two oldest
    let mut ev = store_evicting(&m, 1, &[test_key(7), test_key(8)]);
    ev.sort();
    let mut want = vec![test_key(4), test_key(5)];
    want.sort();
    assert_eq!(ev, want);
    assert_eq!(m.stats().primary.evictions, 5);
}

/// Promise (kv-tier-core/src/config/mod.rs): `EvictionPolicy::Arc` is "Adaptive replacement
/// cache (recency + frequency)"; kv-tier-cpu/README.md: "LRU or ARC (`eviction_policy`)".
/// ARC's defining property: a working set used more than once survives a scan of keys used
/// once, which under LRU flushes it (checked too, so the test is meaningful).
#[test]
fn arc_keeps_a_frequently_used_set_through_a_one_time_scan() {
    let mut survivors = HashMap::new();
    for policy in ["lru", "arc"] {
        let m = build(dram_cfg(
            8,
            BS,
            &format!(r#", "eviction_policy": "{policy}""#),
        ));
        let hot: Vec<_> = (0..4).map(test_key).collect();
        store_evicting(&m, 1, &hot);
        for _ in 0..3 {
            for h in &hot {
                m.touch(&[*h]);
                drop(m.prepare_load(&[*h]).unwrap());
            }
        }
        for i in 0..64 {
            store_evicting(&m, 2, &[test_key(1000 + i)]);
        }
        let alive = hot.iter().filter(|h| is_hit(&m, h)).count();
        survivors.insert(policy, alive);
    }
    assert_eq!(
        survivors["lru"], 0,
        "LRU keeps old keys through a scan: {survivors:?}"
    );
    assert_eq!(
        survivors["arc"], 4,
        "ARC lost frequently used blocks to a one-time scan: {survivors:?}"
    );
}

/// Promise (kv-tier-core/src/manager/mod.rs `prepare_load`): "Pins readable DRAM blocks ...;
/// each view pins its slot until dropped. Fails, pinning nothing, if a key is not readable".
/// A failed load pins nothing (reset_cache then reports 0 pinned), and a load naming a key
/// twice pins and unpins consistently.
#[test]
fn a_failed_load_pins_nothing_and_duplicate_loads_unpin() {
    let m = build(dram_cfg(4, BS, ""));
    let (a, b) = (test_key(1), test_key(2));
    store_evicting(&m, 1, &[a, b]);
    assert!(m.prepare_load(&[a, test_key(99), b]).is_err());
    assert_eq!(
        m.runtime().block_on(m.reset_cache()),
        0,
        "a failed load pinned something"
    );
    store_evicting(&m, 1, &[a, b]);
    match m.prepare_load(&[a, a, b]) {
        Ok(v) => {
            assert_eq!(v.len(), 3);
            for (key, view) in [a, a, b].iter().zip(&v) {
                assert!(verify_block(key, 0, view.as_slice()));
            }
            assert_eq!(m.runtime().block_on(m.reset_cache()), 2);
            drop(v);
        }
        Err(e) => panic!("a duplicated readable key refused: {e}"),
    }
    assert_eq!(
        m.runtime().block_on(m.reset_cache()),
        0,
        "a view's pin outlived it"
    );
    let st = m.stats().primary;
    assert_eq!((st.ready_blocks, st.writing_blocks), (0, 0));
}

/// Promise (kv-tier-cpu/README.md): "LRU or ARC (`eviction_policy`) over unpinned, readable
/// blocks. `prepare_store` never evicts a key of its own batch and refuses cleanly, changing
/// nothing, when it cannot make room"; kv-tier-cpu/src/tier.rs: "a pinned slot is never
/// evicted or reused". Under both policies, with views held across steps: a store is refused
/// exactly when free slots plus unpinned readable blocks outside the batch are fewer than its
/// new keys; an accepted store never evicts a pinned or batch key; a refusal changes nothing.
#[test]
fn refusals_are_exactly_when_there_is_no_room_under_lru_and_arc() {
    for policy in ["lru", "arc"] {
        let cap = 6usize;
        let m = build(dram_cfg(
            cap,
            BS,
            &format!(r#", "eviction_policy": "{policy}""#),
        ));
        let pool: Vec<_> = (0..14).map(test_key).collect();
        let mut seed = 0x1234_5678_9abc_def1u64 ^ policy.len() as u64;
        let mut rnd = move |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        let mut held: Vec<(BlockKey, kv_tier::BlockSource)> = Vec::new();
        let mut refused_seen = 0u64;
        // DRAM's events replayed: the set of keys they say DRAM holds
        let mut replica: HashSet<BlockKey> = HashSet::new();
        let mut replay = |events: Vec<TierEvent>, step: u64| {
            for (key, removed) in flat(&events) {
                if removed {
                    assert!(
                        replica.remove(&key),
                        "{policy} step {step}: {key} removed, not held"
                    );
                } else {
                    assert!(
                        replica.insert(key),
                        "{policy} step {step}: {key} stored twice"
                    );
                }
            }
            replica.clone()
        };
        for step in 0..1500u64 {
            // what is readable now (loads pin only for the duration of this probe)
            let readable: HashSet<BlockKey> = pool
                .iter()
                .copied()
                .filter(|key| m.prepare_load(&[*key]).is_ok())
                .collect();
            let st = m.stats().primary;
            assert_eq!(
                st.ready_blocks,
                readable.len(),
                "{policy} step {step}: {st:?}"
            );
            if step % 7 == 0 || step == 1499 {
                let r = replay(m.take_events(), step);
                assert_eq!(
                    r, readable,
                    "{policy} step {step}: events disagree with DRAM"
                );
            }
            let pinned: HashSet<BlockKey> = held.iter().map(|(kk, _)| *kk).collect();
            match rnd(6) {
                0 | 1 => {
                    let n = 1 + rnd(4) as usize;
                    let mut keys: Vec<_> = (0..n).map(|_| pool[rnd(14) as usize]).collect();
                    keys.dedup();
                    let batch: HashSet<_> = keys.iter().copied().collect();
                    let new = batch.iter().filter(|kk| !readable.contains(kk)).count();
                    let free = cap - st.ready_blocks - st.writing_blocks;
                    let evictable = readable
                        .iter()
                        .filter(|kk| !pinned.contains(kk) && !batch.contains(kk))
                        .count();
                    match m.prepare_store(&keys) {
                        Ok(mut p) => {
                            assert!(
                                new <= free + evictable,
                                "{policy} step {step}: accepted {new} new with {free} free, {evictable} evictable"
                            );
                            for e in p.evicted() {
                                assert!(
                                    !pinned.contains(e),
                                    "{policy} step {step}: evicted pinned {e}"
                                );
                                assert!(
                                    !batch.contains(e),
                                    "{policy} step {step}: evicted own {e}"
                                );
                            }
                            let needed_evictions = new.saturating_sub(free);
                            assert_eq!(
                                p.evicted().len(),
                                needed_evictions,
                                "{policy} step {step}: evicted more than needed"
                            );
                            for (key, sk) in p.slots() {
                                fill_block(key, 0, sk.as_mut_slice());
                            }
                            if rnd(4) == 0 {
                                p.abort();
                            } else {
                                p.commit(RequestId(step));
                            }
                        }
                        Err(Error::CapacityExhausted { .. }) => {
                            refused_seen += 1;
                            assert!(
                                new > free + evictable,
                                "{policy} step {step}: refused {new} new with {free} free, {evictable} evictable, pinned {}",
                                pinned.len()
                            );
                            let after = m.stats().primary;
                            assert_eq!(after.ready_blocks, st.ready_blocks);
                            assert_eq!(after.evictions, st.evictions);
                        }
                        Err(e) => panic!("{policy} step {step}: {e}"),
                    }
                }
                2 | 3 => {
                    let key = pool[rnd(14) as usize];
                    if let Ok(mut v) = m.prepare_load(&[key]) {
                        held.push((key, v.pop().unwrap()));
                    }
                }
                4 => {
                    if !held.is_empty() {
                        let i = rnd(held.len() as u64) as usize;
                        let (key, v) = held.swap_remove(i);
                        assert!(
                            verify_block(&key, 0, v.as_slice()),
                            "{policy}: held view changed"
                        );
                    }
                }
                _ => {
                    let key = pool[rnd(14) as usize];
                    m.touch(&[key]);
                }
            }
            for (key, v) in &held {
                assert!(verify_block(key, 0, v.as_slice()), "{policy} step {step}");
                assert!(
                    is_hit(&m, key),
                    "{policy} step {step}: pinned {key} left DRAM"
                );
            }
        }
        assert!(
            refused_seen > 0,
            "{policy}: the mix never filled the pool with pins"
        );
    }
}

/// Promise (kv-tier-cpu/README.md): ARC evicts "over unpinned, readable blocks" and refuses
/// only "when it cannot make room". With every block of one ARC list pinned, a store evicts
/// from the other list rather than refusing; both ways round.
#[test]
fn arc_evicts_from_the_other_list_when_one_is_all_pinned() {
    for pin_frequent in [false, true] {
        let m = build(dram_cfg(4, BS, r#", "eviction_policy": "arc""#));
        let (f1, f2, r1, r2) = (test_key(1), test_key(2), test_key(3), test_key(4));
        store_evicting(&m, 1, &[f1, f2]);
        for _ in 0..3 {
            m.touch(&[f1]);
            m.touch(&[f2]);
            drop(m.prepare_load(&[f1, f2]).unwrap());
        }
        store_evicting(&m, 1, &[r1]);
        store_evicting(&m, 1, &[r2]);
        let pinned = if pin_frequent { [f1, f2] } else { [r1, r2] };
        let views = m.prepare_load(&pinned).unwrap();
        let mut p = match m.prepare_store(&[test_key(10)]) {
            Ok(p) => p,
            Err(e) => panic!("pin_frequent={pin_frequent}: refused with 2 unpinned blocks: {e}"),
        };
        assert_eq!(p.evicted().len(), 1);
        assert!(!pinned.contains(&p.evicted()[0]));
        for (key, sk) in p.slots() {
            fill_block(key, 0, sk.as_mut_slice());
        }
        p.commit(RequestId(1));
        let mut p = m
            .prepare_store(&[test_key(11)])
            .unwrap_or_else(|e| panic!("pin_frequent={pin_frequent}: second store refused: {e}"));
        assert!(!pinned.contains(&p.evicted()[0]));
        for (key, sk) in p.slots() {
            fill_block(key, 0, sk.as_mut_slice());
        }
        p.commit(RequestId(1));
        for (key, v) in pinned.iter().zip(&views) {
            assert!(verify_block(key, 0, v.as_slice()));
        }
    }
}

/// A view from `prepare_load` held across `reset_cache` and DRAM pressure keeps its bytes:
/// its slot is never reused under it.
#[test]
fn a_held_view_survives_reset_and_pressure_with_its_bytes() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(4, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    engine_store(&m, RequestId(1), &[k]);
    let view = m.prepare_load(&[k]).unwrap();
    let left = m.runtime().block_on(m.reset_cache());
    assert_eq!(left, 1);
    for round in 0..10u64 {
        let keys: Vec<BlockKey> = (0..4).map(|i| test_key(100 + round * 4 + i)).collect();
        if let Ok(mut p) = m.prepare_store(&keys) {
            for (_, s) in p.slots() {
                s.as_mut_slice().fill(0x5A);
            }
            p.commit(RequestId(2));
        }
        let _ = m.prepare_store(&keys[..3]).map(|mut p| {
            for (_, s) in p.slots() {
                s.as_mut_slice().fill(0xA5);
            }
            p.commit(RequestId(2))
        });
        assert!(
            verify_block(&k, 0, view[0].as_slice()),
            "round {round}: a pinned slot was reused"
        );
    }
    drop(view);
    m.on_request_finished(RequestId(1));
    m.on_request_finished(RequestId(2));
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
