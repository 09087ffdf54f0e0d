//! Adversarial tests of the DRAM primary tier as the manager exposes it, of events, of stats
//! and the Prometheus rendering, and of vLLM config compatibility. Public API and documented
//! promises only: each test quotes the promise it checks.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kv_tier::{
    BlockKey, Error, KvTierConfig, Locality, LookupResult, Medium, RequestContext, RequestId,
    TierEvent, TieringManager,
};
use kv_tier_testkit::{fill_block, test_key, verify_block};

// ------------------------------------------------------------------------------ helpers

const BS: usize = 4096;
const CPU: &str = kv_tier::cpu::CPU_TIER_NAME;

fn slot_of(bs: usize) -> usize {
    bs.div_ceil(4096) * 4096
}

fn cfg(slots: usize, bs: usize, extra: &str) -> KvTierConfig {
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}{extra}}}"#,
        slots * slot_of(bs)
    ))
    .unwrap()
}

fn build(c: KvTierConfig) -> TieringManager {
    kv_tier::builder(c).unwrap().build_blocking().unwrap()
}

fn k(i: u64) -> BlockKey {
    test_key(i)
}

/// prepare_store + fill + commit; returns the keys evicted to make room.
fn store(m: &TieringManager, req: u64, keys: &[BlockKey]) -> Vec<BlockKey> {
    let mut p = m.prepare_store(keys).expect("store refused");
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    let ev = p.evicted().to_vec();
    p.commit(RequestId(req));
    ev
}

fn idle(m: &TieringManager) {
    m.runtime().block_on(m.wait_idle());
}

fn is_hit(m: &TieringManager, key: &BlockKey) -> bool {
    m.lookup(key, &RequestContext::new(999_999)) == LookupResult::Hit
}

/// Per tier, the events in the order returned.
fn by_tier(events: &[TierEvent]) -> BTreeMap<String, Vec<TierEvent>> {
    let mut m: BTreeMap<String, Vec<TierEvent>> = BTreeMap::new();
    for e in events {
        m.entry(e.tier.clone()).or_default().push(e.clone());
    }
    m
}

/// (key, removed) in order for one tier's events.
fn flat(events: &[TierEvent]) -> Vec<(BlockKey, bool)> {
    events
        .iter()
        .flat_map(|e| e.keys.iter().map(move |k| (*k, e.removed)))
        .collect()
}

fn fs_layout() -> &'static str {
    r#""layout": {"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}"#
}

// ===================================================================== DRAM primary tier

/// Promise (kv-tier/src/lib.rs, "The step loop"): "copy GPU -> DRAM into its slots, then
/// commit it. The blocks are readable in DRAM at once"; kv-tier-core/src/manager/mod.rs
/// `prepare_load`: "Fails, pinning nothing, if a key is not readable (`Hit`)". A block is
/// never `Hit` nor loadable before its store is committed, even when another thread asks
/// while the slot is being written, and a view never shows a half-written block.
#[test]
fn a_block_is_never_readable_before_its_commit_even_from_another_thread() {
    let m = build(cfg(8, BS, ""));
    for round in 0..40u64 {
        let key = k(1000 + round);
        let about_to_commit = AtomicBool::new(false);
        let done = AtomicBool::new(false);
        let early = AtomicUsize::new(0);
        let torn = AtomicUsize::new(0);
        let seen_hit = AtomicBool::new(false);
        std::thread::scope(|s| {
            s.spawn(|| {
                let req = RequestContext::new(round + 1);
                while !done.load(Ordering::SeqCst) || !seen_hit.load(Ordering::SeqCst) {
                    let r = m.lookup(&key, &req);
                    let load = m.prepare_load(&[key]);
                    let committing = about_to_commit.load(Ordering::SeqCst);
                    if r == LookupResult::Hit {
                        seen_hit.store(true, Ordering::SeqCst);
                        if !committing {
                            early.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    if let Ok(views) = load {
                        if !committing {
                            early.fetch_add(1, Ordering::SeqCst);
                        }
                        if !verify_block(&key, 0, views[0].as_slice()) {
                            torn.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    if done.load(Ordering::SeqCst) && !seen_hit.load(Ordering::SeqCst) {
                        // committed: the next look must see it
                        assert_eq!(m.lookup(&key, &req), LookupResult::Hit);
                        seen_hit.store(true, Ordering::SeqCst);
                    }
                }
            });
            let mut p = m.prepare_store(&[key]).unwrap();
            // write the slot in pieces, letting the reader look in between
            for (_, sink) in p.slots() {
                let mut full = vec![0u8; BS];
                fill_block(&key, 0, &mut full);
                for chunk in 0..8 {
                    let r = chunk * BS / 8..(chunk + 1) * BS / 8;
                    sink.as_mut_slice()[r.clone()].copy_from_slice(&full[r]);
                    std::thread::yield_now();
                }
            }
            assert_ne!(m.lookup(&key, &RequestContext::new(7)), LookupResult::Hit);
            assert!(m.prepare_load(&[key]).is_err(), "loadable before commit");
            about_to_commit.store(true, Ordering::SeqCst);
            p.commit(RequestId(round + 1));
            done.store(true, Ordering::SeqCst);
        });
        assert_eq!(
            early.load(Ordering::SeqCst),
            0,
            "round {round}: readable before commit"
        );
        assert_eq!(torn.load(Ordering::SeqCst), 0, "round {round}: torn view");
    }
}

/// Promise (kv-tier-core/src/manager/pending.rs): "Dropping it without either aborts: the
/// slots are freed and nothing is stored or cascaded"; `abort`: "Frees the slots; nothing is
/// stored or cascaded. The same as dropping it." After an abort or a drop the pool's full
/// capacity is available again without evicting anything, the keys never become readable,
/// and `writing_blocks` returns to 0.
#[test]
fn abort_and_drop_return_every_slot_and_store_nothing() {
    let m = build(cfg(4, BS, ""));
    let keys: Vec<_> = (0..4).map(k).collect();
    for how in ["abort", "drop", "abort-unfilled", "drop-unfilled"] {
        let mut p = m.prepare_store(&keys).unwrap();
        assert_eq!(p.slots().len(), 4, "{how}");
        assert_eq!(m.stats().primary.writing_blocks, 4, "{how}");
        // lib.rs: `HitPending` "(being promoted from a secondary tier into DRAM, or being
        // stored)"
        assert_eq!(
            m.lookup(&keys[0], &RequestContext::new(77)),
            LookupResult::HitPending,
            "{how}: a key being stored"
        );
        if !how.ends_with("unfilled") {
            for (key, s) in p.slots() {
                fill_block(key, 0, s.as_mut_slice());
            }
        }
        if how.starts_with("abort") {
            p.abort();
        } else {
            drop(p);
        }
        let st = m.stats().primary;
        assert_eq!(
            (st.writing_blocks, st.ready_blocks, st.evictions),
            (0, 0, 0),
            "{how}: {st:?}"
        );
        for key in &keys {
            assert_eq!(
                m.lookup(key, &RequestContext::new(1)),
                LookupResult::Miss,
                "{how}"
            );
            assert!(m.prepare_load(&[*key]).is_err(), "{how}");
        }
    }
    // the whole pool is still usable, with no eviction
    let ev = store(&m, 1, &keys);
    assert!(ev.is_empty(), "{ev:?}");
    let st = m.stats();
    assert_eq!((st.primary.ready_blocks, st.primary.evictions), (4, 0));
    assert_eq!(st.cascades, 0, "no secondary tier: nothing to cascade");
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-cpu/README.md): "`prepare_store` never evicts a key of its own batch and
/// refuses cleanly, changing nothing, when it cannot make room"; kv-tier-core/src/tier.rs:
/// "Refuses with [`Error::CapacityExhausted`] and changes nothing when it cannot make room";
/// PrimaryStats::refused_stores: "`prepare_store` calls refused for lack of room".
#[test]
fn a_store_larger_than_the_pool_is_refused_changing_nothing() {
    let m = build(cfg(4, BS, ""));
    let old: Vec<_> = (0..4).map(k).collect();
    store(&m, 1, &old);
    let before = m.stats().primary;
    let new: Vec<_> = (100..105).map(k).collect();
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
        m.prepare_store(&[k(200)]),
        Err(Error::CapacityExhausted { .. })
    ));
    assert_eq!(m.stats().primary.evictions, before.evictions);
    drop(views);
    // a batch of three present keys and one new one evicts the fourth, never its own
    let mixed = vec![old[0], old[1], old[2], k(300)];
    let mut p = m.prepare_store(&mixed).unwrap();
    assert_eq!(p.keys(), vec![k(300)]);
    assert_eq!(p.present().len(), 3);
    assert_eq!(p.evicted(), &[old[3]], "evicted a key of its own batch");
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    p.commit(RequestId(2));
}

/// Promise (kv-tier-core/src/manager/pending.rs): `slots` are "The keys that need writing,
/// each with its exclusive writable DRAM slot"; `present`: "Keys already present in DRAM, or
/// being written there (by another store ...): nothing to do". A store of zero keys, of the
/// same key twice, of keys present, and of a key another open store is writing: no key gets
/// two slots, counts stay consistent, and the bytes read back are the committed ones.
#[test]
fn empty_duplicate_present_and_concurrently_prepared_keys() {
    let m = build(cfg(8, BS, ""));
    // zero keys
    let mut p = m.prepare_store(&[]).unwrap();
    assert!(p.slots().is_empty() && p.present().is_empty() && p.evicted().is_empty());
    p.commit(RequestId(1));
    let st = m.stats();
    assert_eq!(
        (
            st.primary.ready_blocks,
            st.primary.writing_blocks,
            st.cascades
        ),
        (0, 0, 0)
    );
    // the same key three times in one batch
    let (a, b) = (k(1), k(2));
    let mut p = m.prepare_store(&[a, a, b, a]).unwrap();
    let slot_keys: Vec<_> = p.slots().iter().map(|(k, _)| *k).collect();
    let distinct: HashSet<_> = slot_keys.iter().collect();
    assert_eq!(
        distinct.len(),
        slot_keys.len(),
        "one key, two exclusive slots: {slot_keys:?}"
    );
    assert_eq!(m.stats().primary.writing_blocks, 2);
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    p.commit(RequestId(1));
    assert_eq!(m.stats().primary.ready_blocks, 2);
    // present keys: no slot, no eviction
    let mut p = m.prepare_store(&[a, b]).unwrap();
    assert!(p.slots().is_empty());
    let present: HashSet<_> = p.present().iter().copied().collect();
    assert_eq!(present, HashSet::from([a, b]));
    p.commit(RequestId(1));
    // a key another open store is writing: present for the second, written by the first
    let c = k(3);
    let mut first = m.prepare_store(&[c]).unwrap();
    let mut second = m.prepare_store(&[c]).unwrap();
    assert!(second.slots().is_empty(), "two exclusive slots for one key");
    assert_eq!(second.present(), &[c]);
    second.commit(RequestId(2)); // commits nothing of c
    assert_ne!(m.lookup(&c, &RequestContext::new(3)), LookupResult::Hit);
    for (key, s) in first.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    first.commit(RequestId(1));
    let v = m.prepare_load(&[a, b, c]).unwrap();
    for (key, view) in [a, b, c].iter().zip(&v) {
        assert!(verify_block(key, 0, view.as_slice()));
    }
    assert_eq!(m.stats().primary.ready_blocks, 3);
}

/// Promise (kv-tier/src/lib.rs "The step loop"): "`prepare_load` pins the `Hit` blocks";
/// kv-tier-cpu/src/tier.rs: "a pinned slot is never evicted or reused";
/// kv-tier-core/src/manager/lifecycle.rs `reset_cache`: "Returns how many blocks stay in DRAM
/// because readers still pin them". A view's bytes never change while it is held, whatever
/// stores, evictions and resets happen meanwhile on other threads.
#[test]
fn views_hold_their_bytes_under_eviction_churn_and_reset_cache() {
    let m = build(cfg(6, BS, ""));
    let pinned: Vec<_> = (0..2).map(k).collect();
    store(&m, 1, &pinned);
    let views = m.prepare_load(&pinned).unwrap();
    let copies: Vec<Vec<u8>> = views.iter().map(|v| v.as_slice().to_vec()).collect();
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (m, stop, pinned) = (&m, &stop, &pinned);
            s.spawn(move || {
                let mut i = 0u64;
                while !stop.load(Ordering::SeqCst) {
                    let key = k(10_000 * (t + 1) + i % 50);
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

/// Promise (kv-tier-cpu/README.md, kv-tier-core/src/config/mod.rs): the pool holds
/// "`capacity_bytes / slot_size` blocks, where the slot size is the block size rounded up to
/// a page"; "`cpu_bytes_to_use` ... Must hold at least one block". A pool of exactly one
/// block works (each store evicts the previous one, a pinned one blocks the next store), and
/// a block size that is not a multiple of a page round-trips its exact length.
#[test]
fn one_block_pools_and_odd_block_sizes() {
    for bs in [4096usize, 1, 5000, 4097, 12_289] {
        let slot = slot_of(bs);
        let m = build(cfg(1, bs, ""));
        assert_eq!(m.stats().primary.capacity_blocks, 1, "bs {bs}");
        assert_eq!(m.block_size(), bs);
        let (a, b, c) = (k(1), k(2), k(3));
        assert!(store(&m, 1, &[a]).is_empty());
        assert_eq!(store(&m, 1, &[b]), vec![a], "bs {bs}");
        assert!(!is_hit(&m, &a) && is_hit(&m, &b));
        assert!(matches!(
            m.prepare_store(&[a, c]),
            Err(Error::CapacityExhausted { .. })
        ));
        let v = m.prepare_load(&[b]).unwrap();
        assert_eq!(v[0].len(), bs);
        assert!(verify_block(&b, 0, v[0].as_slice()), "bs {bs}");
        assert!(
            matches!(m.prepare_store(&[c]), Err(Error::CapacityExhausted { .. })),
            "bs {bs}: the one slot is pinned"
        );
        assert!(verify_block(&b, 0, v[0].as_slice()));
        drop(v);
        assert_eq!(store(&m, 1, &[c]), vec![b]);
        let st = m.stats().primary;
        assert_eq!(
            (st.evictions, st.ready_blocks, st.refused_stores),
            (2, 1, 2),
            "bs {bs}"
        );
        drop(m);
        // one byte short of a second slot is still one slot; short of one slot is refused
        let cfg2 = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}}}"#,
            2 * slot - 1
        ))
        .unwrap();
        assert_eq!(build(cfg2).stats().primary.capacity_blocks, 1, "bs {bs}");
        let short = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}}}"#,
            slot - 1
        ));
        let err = match short {
            Err(e) => e.to_string(),
            Ok(c) => match kv_tier::builder(c) {
                Err(e) => e.to_string(),
                Ok(b) => b.build_blocking().map(|_| ()).unwrap_err().to_string(),
            },
        };
        assert!(err.contains("cpu_bytes_to_use"), "bs {bs}: {err}");
    }
}

/// Promise (kv-tier-core/src/manager/mod.rs): `prepare_store` "Reserves DRAM slots for
/// `keys` (evicting least-recently-used unpinned blocks)"; `touch`: "Refreshes recency of
/// `keys` in DRAM (the first key ends most recent)". Under LRU the victims come in exactly
/// least-recently-used order.
#[test]
fn lru_evicts_in_exact_recency_order() {
    let m = build(cfg(4, BS, r#", "eviction_policy": "lru""#));
    for i in 0..4 {
        assert!(store(&m, 1, &[k(i)]).is_empty());
    }
    // recency now, newest first: 3 2 1 0. touch([1, 0]) -> 1 0 3 2
    m.touch(&[k(1), k(0)]);
    assert_eq!(store(&m, 1, &[k(4)]), vec![k(2)]);
    assert_eq!(store(&m, 1, &[k(5)]), vec![k(3)]);
    // newest first: 5 4 1 0; touch([0]) -> 0 5 4 1
    m.touch(&[k(0)]);
    assert_eq!(store(&m, 1, &[k(6)]), vec![k(1)]);
    // 6 0 5 4: two at once evict the two oldest
    let mut ev = store(&m, 1, &[k(7), k(8)]);
    ev.sort();
    let mut want = vec![k(4), k(5)];
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
        let m = build(cfg(8, BS, &format!(r#", "eviction_policy": "{policy}""#)));
        let hot: Vec<_> = (0..4).map(k).collect();
        store(&m, 1, &hot);
        for _ in 0..3 {
            for h in &hot {
                m.touch(&[*h]);
                drop(m.prepare_load(&[*h]).unwrap());
            }
        }
        for i in 0..64 {
            store(&m, 2, &[k(1000 + i)]);
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

/// Promise (kv-tier-core/src/stats/mod.rs `PrimaryStats`): "capacity_blocks: Total slots",
/// "ready_blocks: Slots holding a readable block", "writing_blocks: Slots being written",
/// "evictions: Blocks evicted since start"; `ManagerStats`: "lookups: `lookup` calls" and
/// one counter per verdict. Under a seeded random mix of stores, aborts, drops, loads,
/// touches and lookups, the counters always match what the API shows.
#[test]
fn primary_stats_always_match_what_is_observable() {
    let cap = 6usize;
    let m = build(cfg(cap, BS, ""));
    let pool: Vec<_> = (0..15).map(k).collect();
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut rnd = |n: u64| {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed % n
    };
    let mut evicted_seen = 0u64;
    let mut my_lookups = 0u64;
    let mut verdicts = [0u64; 4];
    for step in 0..600 {
        let n = 1 + rnd(3) as usize;
        let keys: Vec<_> = (0..n).map(|_| pool[rnd(15) as usize]).collect();
        match rnd(6) {
            0 | 1 => {
                if let Ok(mut p) = m.prepare_store(&keys) {
                    evicted_seen += p.evicted().len() as u64;
                    let writing = p.keys().len();
                    assert!(m.stats().primary.writing_blocks >= writing);
                    for (key, s) in p.slots() {
                        fill_block(key, 0, s.as_mut_slice());
                    }
                    match rnd(3) {
                        0 => p.abort(),
                        1 => drop(p),
                        _ => p.commit(RequestId(step)),
                    }
                }
            }
            2 => {
                if let Ok(v) = m.prepare_load(&keys) {
                    for (key, view) in keys.iter().zip(&v) {
                        assert!(verify_block(key, 0, view.as_slice()));
                    }
                }
            }
            3 => m.touch(&keys),
            _ => {
                let r = m.lookup(&keys[0], &RequestContext::new(step));
                my_lookups += 1;
                verdicts[match r {
                    LookupResult::Hit => 0,
                    LookupResult::HitPending => 1,
                    LookupResult::Retry => 2,
                    LookupResult::Miss => 3,
                }] += 1;
            }
        }
        let st = m.stats();
        let p = &st.primary;
        assert_eq!(p.capacity_blocks, cap);
        assert_eq!(p.writing_blocks, 0, "step {step}: {p:?}");
        assert!(p.ready_blocks <= cap);
        assert_eq!(p.evictions, evicted_seen, "step {step}: {p:?}");
        assert_eq!(st.lookups, my_lookups, "step {step}");
        assert_eq!(
            [st.hits, st.hits_pending, st.retries, st.misses],
            verdicts,
            "step {step}"
        );
        if step % 50 == 0 {
            // count readable keys without counting the lookups above
            let readable = pool
                .iter()
                .filter(|key| m.prepare_load(&[**key]).is_ok())
                .count();
            assert_eq!(p.ready_blocks, readable, "step {step}: {p:?}");
        }
    }
}

/// Promise (kv-tier-core/src/manager/mod.rs): the manager's methods are called from the
/// scheduler and jobs run concurrently; kv-tier/src/lib.rs: kv-tier "never returns a wrong or
/// torn block". Threads storing overlapping keys and loading them at once never see a wrong
/// byte, never exceed the pool, and leave no slot in the writing state.
#[test]
fn concurrent_stores_and_loads_of_overlapping_keys() {
    let cap = 16usize;
    let m = build(cfg(cap, BS, ""));
    let bad = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (m, bad) = (&m, &bad);
            s.spawn(move || {
                for i in 0..400u64 {
                    let keys: Vec<_> = (0..3).map(|j| k((i * 7 + j * 3 + t) % 40)).collect();
                    if let Ok(mut p) = m.prepare_store(&keys) {
                        for (key, sk) in p.slots() {
                            fill_block(key, 0, sk.as_mut_slice());
                        }
                        if i % 5 == 0 {
                            p.abort();
                        } else {
                            p.commit(RequestId(t));
                        }
                    }
                    if let Ok(v) = m.prepare_load(&keys[..1])
                        && !verify_block(&keys[0], 0, v[0].as_slice())
                    {
                        bad.fetch_add(1, Ordering::SeqCst);
                    }
                    let st = m.stats().primary;
                    assert!(st.ready_blocks + st.writing_blocks <= cap, "{st:?}");
                }
            });
        }
    });
    assert_eq!(bad.load(Ordering::SeqCst), 0);
    let st = m.stats().primary;
    assert_eq!(st.writing_blocks, 0, "{st:?}");
}

// =============================================================================== events

/// Promise (kv-tier-core/src/manager/mod.rs `take_events`): "Events since the last call:
/// the primary's first"; kv-tier-cpu/README.md: "Events: removals (evictions) are queued
/// before the stores that caused them". Every committed block gets exactly one DRAM stored
/// event, every eviction exactly one removal, a key's removal comes after its store, and a
/// store's victims are reported before that store.
#[test]
fn dram_events_one_per_store_and_eviction_in_order() {
    let m = build(cfg(4, BS, ""));
    let mut evicted_by = Vec::new();
    for i in 0..12 {
        let ev = store(&m, 1, &[k(i)]);
        evicted_by.push((k(i), ev));
    }
    let events = m.take_events();
    assert!(events.iter().all(|e| e.tier == CPU), "{events:?}");
    assert!(
        events
            .iter()
            .all(|e| e.medium == Medium::Cpu && e.locality == Locality::Local),
        "{events:?}"
    );
    let seq = flat(&events);
    let total_evicted: usize = evicted_by.iter().map(|(_, e)| e.len()).sum();
    assert_eq!(total_evicted, 8);
    for i in 0..12 {
        let stored: Vec<_> = seq.iter().positions(|(kk, r)| *kk == k(i) && !r);
        let removed: Vec<_> = seq.iter().positions(|(kk, r)| *kk == k(i) && *r);
        assert_eq!(stored.len(), 1, "k{i} stored events: {seq:?}");
        let was_evicted = evicted_by.iter().any(|(_, e)| e.contains(&k(i)));
        assert_eq!(removed.len(), usize::from(was_evicted), "k{i}: {seq:?}");
        if let Some(r) = removed.first() {
            assert!(*r > stored[0], "k{i} removed before stored: {seq:?}");
        }
    }
    for (cause, victims) in &evicted_by {
        let s = seq.iter().position(|(kk, r)| kk == cause && !r).unwrap();
        for v in victims {
            let r = seq.iter().position(|(kk, r)| kk == v && *r).unwrap();
            assert!(
                r < s,
                "removal of {v} after the store of {cause} that caused it"
            );
        }
    }
    assert!(m.take_events().is_empty(), "events reported twice");
}

/// Promise (kv-tier-core/src/manager/pending.rs): an aborted or dropped store: "nothing is
/// stored or cascaded". No stored event may report a block that never entered DRAM; the
/// evictions it made are real and are reported once.
#[test]
fn aborted_and_dropped_stores_report_no_stored_event() {
    let m = build(cfg(2, BS, ""));
    store(&m, 1, &[k(1), k(2)]);
    let _ = m.take_events();
    let p = m.prepare_store(&[k(3)]).unwrap();
    let mut victims = p.evicted().to_vec();
    assert_eq!(victims.len(), 1);
    p.abort();
    // the freed slot and one more eviction
    let p = m.prepare_store(&[k(4), k(5)]).unwrap();
    victims.extend(p.evicted());
    assert_eq!(victims.len(), 2);
    drop(p);
    let events = m.take_events();
    let seq = flat(&events);
    assert!(
        !seq.iter()
            .any(|(kk, r)| !r && [k(3), k(4), k(5)].contains(kk)),
        "a stored event for a block never committed: {seq:?}"
    );
    assert_eq!(
        seq.iter().filter(|(_, r)| *r).count(),
        2,
        "one removal per eviction: {seq:?}"
    );
    let removed: HashSet<_> = seq.iter().filter(|(_, r)| *r).map(|(kk, _)| *kk).collect();
    assert_eq!(removed, victims.into_iter().collect::<HashSet<_>>());
}

/// Promise (kv-tier-core/src/tier_options.rs): "vLLM's `enable_kv_events`: whether the
/// manager reports this tier's events. Off by default, as in vLLM"; "`locality` (`"LOCAL"` or
/// `"REMOTE"`, any casing): the locality this tier's events carry"; manager `take_events`:
/// "the primary's first, then each secondary tier's in order". Two fs tiers: only the enabled
/// one reports, one stored event per block, with the configured locality.
#[test]
fn tier_events_only_where_enabled_with_their_locality_in_order() {
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [
              {{"type": "fs", "name": "quiet", "root_dir": {:?}}},
              {{"type": "fs", "name": "loud", "root_dir": {:?}, "enable_kv_events": true,
                "locality": "remote"}}]}}"#,
        64 * BS,
        fs_layout(),
        d1.path(),
        d2.path()
    ))
    .unwrap();
    let m = build(c);
    let keys: Vec<_> = (0..10).map(k).collect();
    for ch in keys.chunks(3) {
        store(&m, 1, ch);
    }
    idle(&m);
    let loud = m.tier::<kv_tier::fs::FsTier>("loud").unwrap();
    let quiet = m.tier::<kv_tier::fs::FsTier>("quiet").unwrap();
    assert_eq!(loud.stats().blocks.blocks_written, 10);
    assert_eq!(quiet.stats().blocks.blocks_written, 10);
    let events = m.take_events();
    assert!(
        !events.iter().any(|e| e.tier == "quiet"),
        "disabled tier reported"
    );
    // order: the primary's, then the tiers'
    let first_tier = events
        .iter()
        .position(|e| e.tier != CPU)
        .unwrap_or(events.len());
    assert!(
        events[first_tier..].iter().all(|e| e.tier != CPU),
        "{events:?}"
    );
    let t = by_tier(&events);
    let loud_ev = t.get("loud").cloned().unwrap_or_default();
    assert!(
        loud_ev
            .iter()
            .all(|e| e.medium == Medium::Storage && e.locality == Locality::Remote),
        "{loud_ev:?}"
    );
    let seq = flat(&loud_ev);
    for key in &keys {
        assert_eq!(
            seq.iter().filter(|(kk, r)| kk == key && !r).count(),
            1,
            "{key}: {seq:?}"
        );
    }
    assert!(seq.iter().all(|(_, r)| !r));
    let cpu_seq = flat(t.get(CPU).map(|v| &v[..]).unwrap_or(&[]));
    assert_eq!(
        cpu_seq.len(),
        10,
        "DRAM: one stored event per block: {cpu_seq:?}"
    );
    assert!(m.take_events().is_empty());
    // storing the same keys again (present in DRAM): no new stored event anywhere
    for ch in keys.chunks(3) {
        store(&m, 1, ch);
    }
    idle(&m);
    let again = m.take_events();
    assert!(
        again.iter().all(|e| e.removed),
        "present blocks reported stored again: {again:?}"
    );
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/event.rs `EventBatch`): "the log keeps the order things
/// happened in"; kv-tier-fs/README.md (GC): "emits `BlockRemoved` for what it deleted";
/// tier_options.rs `enable_kv_events`. With a tiny fs cap, GC deletes blocks: each block gets
/// one stored event, a removal never precedes the store of the same key, and no key is
/// removed twice without being stored again in between.
#[test]
fn fs_gc_removals_follow_the_stores_they_remove() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "enable_kv_events": true,
              "gc_max_size_gb": 0.0002, "gc_interval_s": 0.05, "gc_grace_s": 0.002,
              "gc_stamp_interval_s": 0.001}}]}}"#,
        16 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let mut all = Vec::new();
    for i in 0..80u64 {
        store(&m, 1, &[k(i)]);
        if i % 4 == 3 {
            idle(&m);
            all.extend(m.take_events());
        }
    }
    idle(&m);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        all.extend(m.take_events());
        if flat(&by_tier(&all).remove("fs").unwrap_or_default())
            .iter()
            .any(|(_, r)| *r)
            || Instant::now() > deadline
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    let written = fs.stats().blocks.blocks_written;
    let seq = flat(&by_tier(&all).remove("fs").unwrap_or_default());
    assert!(
        seq.iter().any(|(_, r)| *r),
        "no GC removal reported in 30 s"
    );
    let mut state: HashMap<BlockKey, bool> = HashMap::new(); // present?
    let mut stored = 0u64;
    for (i, (key, removed)) in seq.iter().enumerate() {
        let present = state.get(key).copied().unwrap_or(false);
        if *removed {
            assert!(
                present,
                "event {i}: {key} removed while not stored: {seq:?}"
            );
        } else {
            assert!(!present, "event {i}: {key} stored twice: {seq:?}");
            stored += 1;
        }
        state.insert(*key, !removed);
    }
    assert_eq!(stored, written, "stored events vs blocks written");
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/config/mod.rs `event_buffer_keys`): "The most keys a tier's (and
/// DRAM's) event buffer holds until the engine takes them ... past it the oldest events are
/// dropped and counted (`ManagerStats::events_dropped`)". With a bound of 5 and 20 blocks
/// stored, 5 keys are held (the newest) and 15 counted dropped, for DRAM and for a tier.
#[test]
fn event_buffer_bound_keeps_the_newest_and_counts_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "event_buffer_keys": 5, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "enable_kv_events": true}}]}}"#,
        64 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    for i in 0..20 {
        store(&m, 1, &[k(i)]);
        idle(&m);
    }
    let st = m.stats();
    let events = m.take_events();
    let t = by_tier(&events);
    let cpu = flat(t.get(CPU).map(|v| &v[..]).unwrap_or(&[]));
    let fs = flat(t.get("fs").map(|v| &v[..]).unwrap_or(&[]));
    let newest: Vec<_> = (15..20).map(|i| (k(i), false)).collect();
    assert_eq!(cpu, newest, "DRAM held the wrong keys");
    assert_eq!(fs, newest, "the fs tier held the wrong keys");
    assert_eq!(st.tiers[0].events_dropped, 15, "{:?}", st.tiers[0]);
    assert_eq!(st.events_dropped, 30, "DRAM's 15 and the tier's 15");
    // taken: the buffers are empty again and the counts do not move
    for i in 20..23 {
        store(&m, 1, &[k(i)]);
    }
    idle(&m);
    assert_eq!(m.stats().events_dropped, 30);
    assert_eq!(flat(&m.take_events()).len(), 6);
}

/// Promise (kv-tier-core/src/manager/mod.rs `take_events`): "Events since the last call".
/// Taken from four threads at once while another thread stores (with evictions), every event
/// is returned exactly once: no stored event lost or duplicated, one removal per eviction.
#[test]
fn take_events_from_many_threads_loses_and_duplicates_nothing() {
    let m = build(cfg(32, BS, ""));
    let done = AtomicBool::new(false);
    let collected = Mutex::new(Vec::new());
    let mut evictions = 0usize;
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let mut mine = Vec::new();
                loop {
                    let finished = done.load(Ordering::SeqCst);
                    mine.extend(m.take_events());
                    if finished {
                        break;
                    }
                }
                collected.lock().unwrap().extend(mine);
            });
        }
        for i in 0..2000u64 {
            evictions += store(&m, 1, &[k(i)]).len();
        }
        done.store(true, Ordering::SeqCst);
    });
    let mut all = collected.into_inner().unwrap();
    all.extend(m.take_events());
    let seq = flat(&all);
    let mut stored: HashMap<BlockKey, usize> = HashMap::new();
    let mut removed = 0usize;
    for (key, r) in &seq {
        if *r {
            removed += 1;
        } else {
            *stored.entry(*key).or_default() += 1;
        }
    }
    assert_eq!(stored.len(), 2000, "stored events lost");
    assert!(stored.values().all(|&n| n == 1), "stored events duplicated");
    assert_eq!(removed, evictions, "removals lost or duplicated");
    assert_eq!(m.stats().events_dropped, 0);
}

// ==================================================================== stats and Prometheus

/// Promise (kv-tier-core/src/stats/mod.rs): `ManagerStats::events_dropped`: "Event keys
/// dropped, DRAM's and every tier's"; `TierStats::events_dropped`: "Event keys this tier
/// dropped because its buffer was full"; event.rs `EventLog::configure`: "off records nothing
/// from now on". A tier with events off never records, so it never drops (nothing grows).
#[test]
fn a_tier_with_events_off_records_and_drops_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "event_buffer_keys": 1, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
        64 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    for i in 0..10 {
        store(&m, 1, &[k(i)]);
    }
    idle(&m);
    let st = m.stats();
    assert_eq!(
        st.tiers[0].events_dropped, 0,
        "events off, yet dropped: {:?}",
        st.tiers[0]
    );
    assert_eq!(st.events_dropped, 9, "DRAM's 9 only");
    let events = m.take_events();
    assert!(events.iter().all(|e| e.tier == CPU), "{events:?}");
}

#[cfg(feature = "prometheus")]
mod prom {
    use super::*;

    /// The Prometheus recorder is the process's: tests that read it take turns.
    pub(super) static RECORDER: Mutex<()> = Mutex::new(());

    #[derive(Debug, Default)]
    pub(super) struct Exposition {
        /// (name, sorted labels) -> value
        pub(super) series: BTreeMap<(String, Vec<(String, String)>), f64>,
        /// family -> type
        pub(super) types: BTreeMap<String, String>,
    }

    fn valid_name(n: &str, colon: bool) -> bool {
        let mut cs = n.chars();
        let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
        let ok_rest = |c: char| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':');
        cs.next().is_some_and(ok_first) && cs.all(ok_rest)
    }

    /// Parses the text format strictly; panics (with the line) on anything invalid: a
    /// second HELP or TYPE of one family, a sample of no declared family, a bad name or label,
    /// an unknown escape, a duplicate series.
    pub(super) fn parse(text: &str) -> Exposition {
        let mut ex = Exposition::default();
        let mut helps = HashSet::new();
        for line in text.lines() {
            if line.is_empty() {
                continue;
            }
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let name = rest.split(' ').next().unwrap();
                assert!(valid_name(name, true), "bad HELP name: {line:?}");
                assert!(helps.insert(name.to_string()), "HELP twice: {line:?}");
                continue;
            }
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut p = rest.split(' ');
                let (name, ty) = (p.next().unwrap(), p.next().unwrap_or(""));
                assert!(
                    ["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty),
                    "bad TYPE: {line:?}"
                );
                assert!(
                    ex.types.insert(name.to_string(), ty.to_string()).is_none(),
                    "TYPE twice: {line:?}"
                );
                continue;
            }
            assert!(!line.starts_with('#') || line.starts_with("# "), "{line:?}");
            if line.starts_with('#') {
                continue;
            }
            // name{labels} value
            let (name, rest) = match line.find(['{', ' ']) {
                Some(i) => line.split_at(i),
                None => panic!("no value: {line:?}"),
            };
            assert!(valid_name(name, true), "bad metric name: {line:?}");
            let mut labels = Vec::new();
            let mut rest = rest;
            if let Some(r) = rest.strip_prefix('{') {
                let mut chars = r.char_indices().peekable();
                let end;
                loop {
                    let mut lname = String::new();
                    loop {
                        let (_, c) = chars.next().unwrap_or_else(|| panic!("{line:?}"));
                        if c == '=' {
                            break;
                        }
                        if c == '}' && lname.is_empty() {
                            panic!("empty label in {line:?}");
                        }
                        lname.push(c);
                    }
                    assert!(
                        valid_name(&lname, false),
                        "bad label name {lname:?}: {line:?}"
                    );
                    assert_eq!(chars.next().map(|c| c.1), Some('"'), "{line:?}");
                    let mut value = String::new();
                    loop {
                        let (_, c) = chars.next().unwrap_or_else(|| panic!("{line:?}"));
                        match c {
                            '"' => break,
                            '\\' => match chars.next().map(|c| c.1) {
                                Some('\\') => value.push('\\'),
                                Some('"') => value.push('"'),
                                Some('n') => value.push('\n'),
                                other => panic!("bad escape {other:?} in {line:?}"),
                            },
                            '\n' => panic!("raw newline in {line:?}"),
                            c => value.push(c),
                        }
                    }
                    labels.push((lname, value));
                    match chars.next() {
                        Some((_, ',')) => {
                            if chars.peek().map(|c| c.1) == Some('}') {
                                end = chars.next().unwrap().0;
                                break;
                            }
                        }
                        Some((i, '}')) => {
                            end = i;
                            break;
                        }
                        other => panic!("bad label separator {other:?}: {line:?}"),
                    }
                }
                rest = &r[end + 1..];
            }
            let value = rest.trim_start_matches(' ');
            let value: &str = value.split(' ').next().unwrap();
            let v: f64 = match value {
                "+Inf" => f64::INFINITY,
                "-Inf" => f64::NEG_INFINITY,
                "NaN" => f64::NAN,
                v => v
                    .parse()
                    .unwrap_or_else(|_| panic!("bad value in {line:?}")),
            };
            let family = [name, name.strip_suffix("_bucket").unwrap_or(name)]
                .into_iter()
                .chain(name.strip_suffix("_sum"))
                .chain(name.strip_suffix("_count"))
                .find(|f| ex.types.contains_key(*f));
            assert!(family.is_some(), "sample of no declared family: {line:?}");
            let mut sorted = labels.clone();
            sorted.sort();
            let n = sorted.len();
            sorted.dedup_by(|a, b| a.0 == b.0);
            assert_eq!(sorted.len(), n, "a label twice: {line:?}");
            assert!(
                ex.series.insert((name.to_string(), sorted), v).is_none(),
                "duplicate series: {line:?}"
            );
        }
        ex
    }

    pub(super) fn value(ex: &Exposition, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut l: Vec<(String, String)> = labels
            .iter()
            .map(|(a, b)| (a.to_string(), b.to_string()))
            .collect();
        l.sort();
        ex.series.get(&(name.to_string(), l)).copied()
    }

    pub(super) fn scrape(m: &TieringManager) -> (String, Exposition) {
        let handle = kv_tier::prometheus::install_recorder().unwrap();
        let text = kv_tier::prometheus::render(&handle, m);
        let ex = parse(&text);
        (text, ex)
    }
}

/// Promise (kv-tier/src/prometheus.rs `render`): "the manager's statistics published now,
/// then every metric of the recorder in the Prometheus text format"; kv-tier-core/src/metrics.rs:
/// "all named `kv_tier_...` with the tier's name as the label `tier`", "Counters end in
/// `_total`". The text is valid exposition format (one HELP and TYPE per family, no duplicate
/// series, valid names) even with a tier name holding a quote, a backslash and a newline, and
/// that name comes back exactly from the label; or the name is refused naming the field.
#[cfg(feature = "prometheus")]
#[test]
fn prometheus_text_is_valid_and_escapes_tier_names() {
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let weird = "we\"ird\\tier\nx";
    let (d1, d2) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let json = format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "name": {}, "root_dir": {:?}, "enable_kv_events": true}},
                                {{"type": "fs", "name": "plain", "root_dir": {:?}}}]}}"#,
        32 * BS,
        fs_layout(),
        serde_json::to_string(weird).unwrap(),
        d1.path(),
        d2.path()
    );
    let m = match KvTierConfig::from_json_str(&json)
        .and_then(kv_tier::builder)
        .and_then(|b| b.build_blocking())
    {
        Ok(m) => m,
        Err(e) => {
            assert!(
                e.to_string().contains("name"),
                "refused without naming the field: {e}"
            );
            return;
        }
    };
    for i in 0..40 {
        store(&m, 1, &[k(i)]);
    }
    idle(&m);
    m.runtime().block_on(m.reset_cache());
    let req = RequestContext::new(5);
    for _ in 0..200 {
        let found = m.lookup_prefix(&[k(0), k(1)], &req);
        m.on_schedule_end();
        if found.hit == 2 {
            break;
        }
        idle(&m);
    }
    let (text, ex) = prom::scrape(&m);
    for (name, ty) in &ex.types {
        assert!(name.starts_with("kv_tier_"), "{name}");
        if ty == "counter" {
            assert!(
                name.ends_with("_total"),
                "counter not ending in _total: {name}"
            );
        }
    }
    let st = m.stats();
    let stored = prom::value(&ex, "kv_tier_blocks_stored_total", &[("tier", weird)]);
    assert_eq!(
        stored,
        Some(st.tiers[0].blocks_stored as f64),
        "the weird tier's series:\n{text}"
    );
    assert!(st.tiers[0].blocks_stored > 0);
    assert_eq!(
        prom::value(&ex, "kv_tier_blocks_stored_total", &[("tier", "plain")]),
        Some(st.tiers[1].blocks_stored as f64)
    );
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/metrics.rs): "Counters and gauges, published from the
/// statistics ... as they are now", "Counters end in `_total`"; Prometheus counters are
/// monotonic. Across scrapes with stores, evictions, lookups, promotions, reset_cache and
/// dropped events in between, no counter series goes down, and the DRAM figures equal the
/// stats at the scrape.
#[cfg(feature = "prometheus")]
#[test]
fn prometheus_counters_never_decrease_and_match_stats() {
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "event_buffer_keys": 3, {},
            "secondary_tiers": [{{"type": "fs", "name": "mono", "root_dir": {:?},
              "enable_kv_events": true}}]}}"#,
        8 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let mut prev: Option<prom::Exposition> = None;
    for round in 0..6u64 {
        for i in 0..12 {
            store(&m, round, &[k(round * 100 + i)]);
        }
        idle(&m);
        let req = RequestContext::new(round + 1000);
        let keys: Vec<_> = (0..4).map(|i| k(round * 100 + i)).collect();
        for _ in 0..50 {
            let f = m.lookup_prefix(&keys, &req);
            m.on_schedule_end();
            if f.hit == keys.len() {
                break;
            }
            idle(&m);
        }
        m.on_request_finished(req.id);
        if round % 2 == 1 {
            m.runtime().block_on(m.reset_cache());
        }
        let (_, ex) = prom::scrape(&m);
        let st = m.stats();
        // the tier-labelled series are this manager's alone (other tests' managers publish
        // the unlabelled DRAM ones too)
        let t = &st.tiers[0];
        assert_eq!(
            prom::value(&ex, "kv_tier_blocks_stored_total", &[("tier", "mono")]),
            Some(t.blocks_stored as f64)
        );
        assert_eq!(
            prom::value(&ex, "kv_tier_events_dropped_total", &[("tier", "mono")]),
            Some(t.events_dropped as f64)
        );
        assert_eq!(
            prom::value(&ex, "kv_tier_blocks_loaded_total", &[("tier", "mono")]),
            Some(t.blocks_loaded as f64)
        );
        if let Some(p) = &prev {
            for ((name, labels), v) in &p.series {
                let fam = name.strip_suffix("_bucket").unwrap_or(name);
                let fam = fam.strip_suffix("_count").unwrap_or(fam);
                let is_counter = p.types.get(name).map(|t| t == "counter").unwrap_or(false)
                    || p.types.get(fam).map(|t| t == "histogram").unwrap_or(false)
                        && !name.ends_with("_sum");
                if !is_counter {
                    continue;
                }
                let now = ex.series.get(&(name.clone(), labels.clone()));
                assert!(
                    now.is_some_and(|n| n >= v),
                    "round {round}: {name}{labels:?} went from {v} to {now:?}"
                );
            }
        }
        prev = Some(ex);
    }
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier/src/prometheus.rs `serve`): "each scrape publishes `manager`'s
/// statistics first, so every value is as of the scrape"; kv-tier-core/src/metrics.rs: "each
/// manager adds what it counted since it last published, so a counter is the sum over every
/// manager the process had, and never goes back (a manager replaced by a new one ... do not
/// hide each other's counts). Gauges are levels". An engine that replaces its manager (a
/// restart of the cache in the same process) and scrapes the new one sees the new manager's
/// counts added at once and its gauges. (Found: counters were published as absolute values,
/// kept as the larger of old and new: the new manager's 1 miss rendered as the old one's 500.)
#[cfg(feature = "prometheus")]
#[test]
fn prometheus_figures_are_the_scraped_managers_after_a_replacement() {
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let misses =
        |ex: &prom::Exposition| prom::value(ex, "kv_tier_lookups_total", &[("verdict", "miss")]);
    let old = build(cfg(64, BS, ""));
    // other tests of this process published before: counts are compared as increments
    let (_, ex) = prom::scrape(&old);
    let m0 = misses(&ex).unwrap_or(0.0);
    for i in 0..64 {
        store(&old, 1, &[k(i)]);
    }
    for i in 0..500 {
        old.lookup(&k(10_000 + i), &RequestContext::new(1));
    }
    let (_, ex) = prom::scrape(&old);
    let m1 = misses(&ex).unwrap();
    assert_eq!(m1 - m0, old.stats().misses as f64);
    drop(old);
    let new = build(cfg(8, BS, ""));
    store(&new, 1, &[k(1)]);
    new.lookup(&k(99_999), &RequestContext::new(1));
    let (text, ex) = prom::scrape(&new);
    let st = new.stats();
    assert_eq!(st.misses, 1);
    let got = |n: &str, l: &[(&str, &str)]| prom::value(&ex, n, l);
    let mut wrong = Vec::new();
    for (name, labels, want) in [
        (
            "kv_tier_lookups_total",
            vec![("verdict", "miss")],
            m1 + st.misses as f64,
        ),
        (
            "kv_tier_dram_capacity_bytes",
            vec![],
            (st.primary.capacity_blocks * BS) as f64,
        ),
        (
            "kv_tier_dram_used_bytes",
            vec![],
            ((st.primary.ready_blocks + st.primary.writing_blocks) * BS) as f64,
        ),
    ] {
        let v = got(name, &labels);
        if v != Some(want) {
            wrong.push(format!("{name}{labels:?}: rendered {v:?}, want {want}"));
        }
    }
    assert!(wrong.is_empty(), "{wrong:#?}\n{text}");
    // a second scrape of the new manager with nothing new counted adds nothing
    let (_, ex) = prom::scrape(&new);
    assert_eq!(misses(&ex), Some(m1 + 1.0));
}

/// Promise (kv-tier/src/prometheus.rs `serve`): "serves `GET /metrics` ... Other paths answer
/// 404. The endpoint does not keep the manager alive: once it is dropped, scrapes render what
/// was recorded last."
#[cfg(feature = "prometheus")]
#[test]
fn prometheus_endpoint_serves_metrics_404s_the_rest_and_outlives_the_manager() {
    use std::io::{Read, Write};
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let get = |addr: std::net::SocketAddr, path: &str| -> String {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        out
    };
    rt.block_on(async {
        let m = std::sync::Arc::new(
            kv_tier::builder(cfg(8, BS, ""))
                .unwrap()
                .build()
                .await
                .unwrap(),
        );
        store(&m, 1, &[k(1)]);
        let ep = kv_tier::prometheus::serve("127.0.0.1:0".parse().unwrap(), &m)
            .await
            .unwrap();
        let addr = ep.addr();
        let r = tokio::task::spawn_blocking(move || get(addr, "/metrics"))
            .await
            .unwrap();
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        let body = r.split("\r\n\r\n").nth(1).unwrap();
        prom::parse(body);
        assert!(body.contains("kv_tier_dram_capacity_bytes"), "{body}");
        let r = tokio::task::spawn_blocking(move || get(addr, "/other"))
            .await
            .unwrap();
        assert!(r.starts_with("HTTP/1.1 404"), "{r}");
        m.shutdown().await.unwrap();
        drop(m);
        let r = tokio::task::spawn_blocking(move || get(addr, "/metrics"))
            .await
            .unwrap();
        assert!(
            r.starts_with("HTTP/1.1 200"),
            "after the manager is gone: {r}"
        );
        drop(ep);
    });
}

// =================================================================== vLLM config, unchanged

fn err_of(json: &str) -> String {
    match KvTierConfig::from_json_str(json) {
        Err(e) => e.to_string(),
        Ok(c) => match kv_tier::effective_config(&c, &kv_tier::registry()) {
            Err(e) => e.to_string(),
            Ok(v) => panic!("accepted: {json}\n-> {v}"),
        },
    }
}

/// Promise (kv-tier/src/lib.rs "vLLM's config, unchanged"): "A `kv_connector_extra_config`
/// written for vLLM's tiering spec parses as is. vLLM's keys keep their meaning" (the list of
/// keys there). A config using every listed key parses, and each key has its meaning in the
/// effective config.
#[test]
fn every_listed_vllm_key_is_accepted_with_its_meaning() {
    let json = r#"{
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8388608,
        "block_size": 64,
        "eviction_policy": "arc",
        "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.arc",
        "store_threshold": 3,
        "max_tracker_size": 1234,
        "layout": {"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16},
        "secondary_tiers": [
            {"type": "fs", "module_path": "vllm.v1.kv_offload.tiering.fs",
             "enable_kv_events": true, "locality": "LOCAL", "root_dir": "/tmp/kv-vllm",
             "n_read_threads": 7, "n_write_threads": 5},
            {"type": "obj", "module_path": "vllm.v1.kv_offload.tiering.obj",
             "enable_kv_events": false, "locality": "REMOTE",
             "store_config": {"bucket": "kv-cache", "endpoint_override": "http://127.0.0.1:9",
                              "access_key": "ak", "secret_key": "sk", "region": "us-east-1"},
             "prefix": "prod", "io_threads": 9}
        ]
    }"#;
    let c = KvTierConfig::from_json_str(json).unwrap();
    assert_eq!(c.eviction_policy, kv_tier::EvictionPolicy::Arc);
    assert_eq!((c.store_threshold, c.max_tracker_size), (3, 1234));
    assert_eq!(c.block_size_bytes, 0, "left to the engine");
    let eff = kv_tier::effective_config(&c, &kv_tier::registry()).unwrap();
    assert_eq!(eff["block_size"], 64);
    assert_eq!(eff["eviction_policy"], "arc");
    assert_eq!(eff["store_threshold"], 3);
    assert_eq!(eff["max_tracker_size"], 1234);
    assert_eq!(
        eff["layout"]["blocks_per_file"], 4,
        "block_size 64 / tokens_per_hash 16"
    );
    let fs = &eff["secondary_tiers"][0];
    assert_eq!(fs["n_read_threads"], 7);
    assert_eq!(fs["n_write_threads"], 5);
    assert_eq!(fs["enable_kv_events"], true);
    assert_eq!(fs["locality"], "LOCAL");
    assert_eq!(fs["module_path"], "vllm.v1.kv_offload.tiering.fs");
    let obj = &eff["secondary_tiers"][1];
    assert_eq!(obj["bucket"], "kv-cache");
    assert_eq!(obj["prefix"], "prod");
    assert_eq!(obj["io_threads"], 9);
    assert_eq!(obj["enable_kv_events"], false);
    assert_eq!(obj["locality"], "REMOTE");
}

/// Promise (kv-tier/src/lib.rs): "vLLM keys kv-tier does not implement
/// (`offload_prompt_only`, `self_describing_kv_events`, `max_recompute_pending_tokens`,
/// `canonical_layout`) are refused saying why"; "Unknown keys and out-of-range numbers are
/// refused at construction, with an error naming the field" — nested ones too, named by their
/// path.
#[test]
fn unimplemented_and_unknown_keys_are_refused_by_name_at_any_depth() {
    let base = |extra: &str, tier: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096{extra},
                "secondary_tiers": [{tier}]}}"#
        )
    };
    let fs = r#"{"type": "fs", "root_dir": "/tmp/kv""#;
    for key in [
        "offload_prompt_only",
        "self_describing_kv_events",
        "max_recompute_pending_tokens",
        "canonical_layout",
    ] {
        let e = err_of(&base(&format!(r#", "{key}": true"#), ""));
        assert!(e.contains(key), "{key}: {e}");
        assert!(e.len() > key.len() + 30, "refused without saying why: {e}");
    }
    let cases: Vec<(String, &str)> = vec![
        (base(r#", "bogus_top": 1"#, ""), "bogus_top"),
        (
            base("", &format!(r#"{fs}, "bogus_fs": 1}}"#)),
            "secondary_tiers[0].bogus_fs",
        ),
        (
            base(
                "",
                &format!(
                    r#"{fs}}}, {{"type": "fs", "name": "b", "root_dir": "/tmp/b", "bogus2": 1}}"#
                ),
            ),
            "secondary_tiers[1].bogus2",
        ),
        (
            base(
                "",
                r#"{"type": "obj", "store_config": {"bucket": "b", "bogus_nested": 1}}"#,
            ),
            "secondary_tiers[0].store_config.bogus_nested",
        ),
        (
            base(
                r#", "layout": {"model_name": "m", "dtype": "d", "tokens_per_hash": 16, "bogus_l": 1}"#,
                "",
            ),
            "layout.bogus_l",
        ),
    ];
    for (json, path) in cases {
        let e = err_of(&json);
        assert!(e.contains(path), "want {path:?} named: {e}");
    }
}

/// Promise (kv-tier-core/src/config/mod.rs module docs): "Every invalid value is rejected
/// with an error naming the field"; kv-tier/src/lib.rs: "an error naming the field". Values
/// of the wrong JSON type (a string for a number, a fraction for an integer, a number for a
/// bool or a string), top-level and nested, are refused naming their full path.
#[test]
fn wrongly_typed_values_are_refused_naming_their_path() {
    let tier = |t: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, "secondary_tiers": [{t}]}}"#
        )
    };
    let top =
        |kv: &str| format!(r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, {kv}}}"#);
    let cases: Vec<(String, &str)> = vec![
        (
            r#"{"cpu_bytes_to_use": "1048576", "block_size_bytes": 4096}"#.into(),
            "cpu_bytes_to_use",
        ),
        (
            r#"{"cpu_bytes_to_use": 1048576.5, "block_size_bytes": 4096}"#.into(),
            "cpu_bytes_to_use",
        ),
        (top(r#""store_threshold": "2""#), "store_threshold"),
        (top(r#""store_threshold": 1.5"#), "store_threshold"),
        (top(r#""max_tracker_size": -1"#), "max_tracker_size"),
        (top(r#""event_buffer_keys": "10""#), "event_buffer_keys"),
        (top(r#""blocks_per_chunk": 2.5"#), "blocks_per_chunk"),
        (top(r#""eviction_policy": 1"#), "eviction_policy"),
        (top(r#""probe_timeout_s": "1""#), "probe_timeout_s"),
        (
            tier(r#"{"type": "fs", "root_dir": "/tmp/kv", "n_read_threads": "16"}"#),
            "secondary_tiers[0].n_read_threads",
        ),
        (
            tier(r#"{"type": "fs", "root_dir": "/tmp/kv", "n_write_threads": 2.5}"#),
            "secondary_tiers[0].n_write_threads",
        ),
        (
            tier(r#"{"type": "fs", "root_dir": "/tmp/kv", "enable_kv_events": "yes"}"#),
            "secondary_tiers[0].enable_kv_events",
        ),
        (
            tier(r#"{"type": "fs", "root_dir": "/tmp/kv", "locality": 1}"#),
            "secondary_tiers[0].locality",
        ),
        (
            tier(r#"{"type": "fs", "root_dir": 5}"#),
            "secondary_tiers[0].root_dir",
        ),
        (
            tier(r#"{"type": "obj", "store_config": {"bucket": 5}}"#),
            "secondary_tiers[0].store_config.bucket",
        ),
        (
            tier(r#"{"type": "obj", "bucket": "b", "io_threads": "4"}"#),
            "secondary_tiers[0].io_threads",
        ),
        (tier(r#"{"type": 3}"#), "secondary_tiers[0].type"),
        (tier(r#""fs""#), "secondary_tiers[0]"),
    ];
    let mut bad = Vec::new();
    for (json, path) in &cases {
        let e = err_of(json);
        if !e.contains(path) {
            bad.push(format!("{path}: {e}"));
        }
    }
    assert!(bad.is_empty(), "not named by path:\n{}", bad.join("\n"));
}

/// Promise (kv-tier-core/src/config/mod.rs): `block_size`: "tokens per offloaded block (a
/// multiple of the layout's `tokens_per_hash` ...; it sets the layout's `blocks_per_file`,
/// as vLLM sets `blocks_per_chunk`). Not with `blocks_per_chunk`"; `blocks_per_chunk`:
/// "(default 1, range 1 to 65,536); the layout's `blocks_per_file`. Not with `block_size`".
/// The fs tier then writes into the namespace folder of that `blocks_per_file`.
#[test]
fn block_size_and_blocks_per_chunk_meaning_and_exclusivity() {
    let with = |kv: &str| {
        format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, {kv}, {}}}"#,
            fs_layout()
        )
    };
    let e = err_of(&with(r#""block_size": 32, "blocks_per_chunk": 2"#));
    assert!(e.contains("block_size"), "{e}");
    for bad in [
        r#""block_size": 40"#,
        r#""block_size": 8"#,
        r#""block_size": 0"#,
    ] {
        let e = err_of(&with(bad));
        assert!(e.contains("block_size"), "{bad}: {e}");
    }
    for bad in [r#""blocks_per_chunk": 0"#, r#""blocks_per_chunk": 65537"#] {
        let e = err_of(&with(bad));
        assert!(e.contains("blocks_per_chunk"), "{bad}: {e}");
    }
    // meaning: the same folder from block_size 48 and from blocks_per_chunk 3
    let mut dirs = Vec::new();
    for kv in [
        r#""block_size": 48"#,
        r#""blocks_per_chunk": 3"#,
        r#""blocks_per_chunk": 65536"#,
    ] {
        let dir = tempfile::tempdir().unwrap();
        let c = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096, {kv}, {},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
            fs_layout(),
            dir.path()
        ))
        .unwrap();
        let m = build(c);
        store(&m, 1, &[k(1)]);
        idle(&m);
        m.shutdown_blocking().unwrap();
        let names: Vec<String> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.ends_with("_r0"))
            .collect();
        assert_eq!(names.len(), 1, "{kv}: {names:?}");
        let cfg_json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.path().join(&names[0]).join("config.json")).unwrap(),
        )
        .unwrap();
        dirs.push((names[0].clone(), cfg_json["blocks_per_file"].clone()));
    }
    assert_eq!(
        dirs[0], dirs[1],
        "block_size 48 and blocks_per_chunk 3 differ"
    );
    assert_eq!(dirs[0].1, 3);
    assert_eq!(dirs[2].1, 65536);
}

/// Promise (kv-tier-core/src/config/mod.rs `store_threshold`): "a block enters DRAM
/// (`prepare_store` admits it) only once this many distinct requests have looked it up
/// (default 0; 0 and 1: every block, as in vLLM ...). ... a request asking again while it
/// waits counts once"; stats: `stores_not_admitted`: "Keys `prepare_store` left out because
/// lookups had not asked for them `store_threshold` times".
#[test]
fn store_threshold_admits_after_n_distinct_requests() {
    // 1: every block, even one no lookup asked for
    let m = build(cfg(8, BS, r#", "store_threshold": 1"#));
    let p = m.prepare_store(&[k(1)]).unwrap();
    assert_eq!(
        p.keys(),
        vec![k(1)],
        "store_threshold 1 must admit every block"
    );
    drop(p);
    let m = build(cfg(8, BS, r#", "store_threshold": 3"#));
    let key = k(7);
    let admitted = |m: &TieringManager| -> bool {
        let mut p = m.prepare_store(&[key]).unwrap();
        let ok = !p.slots().is_empty();
        for (kk, s) in p.slots() {
            fill_block(kk, 0, s.as_mut_slice());
        }
        p.commit(RequestId(42));
        ok
    };
    assert!(!admitted(&m), "admitted with no lookup");
    assert_eq!(m.stats().stores_not_admitted, 1);
    // request 1 asks three times: counts once
    let r1 = RequestContext::new(1);
    for _ in 0..3 {
        assert_eq!(m.lookup(&key, &r1), LookupResult::Miss);
        m.on_schedule_end();
    }
    assert!(
        !admitted(&m),
        "one request asking thrice counted more than once"
    );
    m.on_request_finished(r1.id);
    let r2 = RequestContext::new(2);
    assert_eq!(m.lookup(&key, &r2), LookupResult::Miss);
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    assert!(!admitted(&m), "two distinct requests, threshold 3");
    assert_eq!(m.stats().stores_not_admitted, 3);
    // a lookup_prefix is a lookup too
    let r3 = RequestContext::new(3);
    m.lookup_prefix(&[key], &r3);
    m.on_schedule_end();
    assert!(admitted(&m), "three distinct requests looked it up");
    assert_eq!(m.lookup(&key, &RequestContext::new(4)), LookupResult::Hit);
    assert_eq!(m.stats().stores_not_admitted, 3);
}

/// Promise (kv-tier-core/src/config/mod.rs `max_tracker_size`): "how many keys the lookup
/// counts of `store_threshold` ... remember, least recently asked forgotten first".
#[test]
fn max_tracker_size_forgets_the_least_recently_asked_key() {
    let m = build(cfg(
        8,
        BS,
        r#", "store_threshold": 2, "max_tracker_size": 2"#,
    ));
    let (a, b, c) = (k(1), k(2), k(3));
    let admitted = |key: BlockKey| -> bool {
        let mut p = m.prepare_store(&[key]).unwrap();
        let ok = !p.slots().is_empty();
        for (kk, s) in p.slots() {
            fill_block(kk, 0, s.as_mut_slice());
        }
        p.commit(RequestId(42));
        ok
    };
    let r1 = RequestContext::new(1);
    for key in [a, b, c] {
        m.lookup(&key, &r1);
    }
    m.on_schedule_end();
    // a was asked least recently: forgotten; c is remembered
    let r2 = RequestContext::new(2);
    m.lookup(&a, &r2);
    m.lookup(&c, &r2);
    m.on_schedule_end();
    assert!(admitted(c), "c asked by two requests, still tracked");
    assert!(!admitted(a), "a was forgotten: one count, not two");
    let r3 = RequestContext::new(3);
    m.lookup(&a, &r3);
    m.on_schedule_end();
    assert!(admitted(a));
}

/// Promise (kv-tier/src/lib.rs): `eviction_policy` with `cache_policy_module_path` ("a
/// built-in policy only"); config/mod.rs: "accepted when `eviction_policy` names a built-in
/// policy (then unused, as in vLLM); a policy from a Python module is refused naming this
/// field"; `spec_name` (`"TieringOffloadingSpec"`) is vLLM's; per tier `module_path` "a
/// registered type only".
#[test]
fn spec_name_policy_module_and_module_path_keep_vllms_meaning() {
    let base = r#""cpu_bytes_to_use": 1048576, "block_size_bytes": 4096"#;
    let ok = |extra: &str| {
        KvTierConfig::from_json_str(&format!("{{{base}{extra}}}"))
            .unwrap_or_else(|e| panic!("{extra}: {e}"))
    };
    ok(r#", "spec_name": "TieringOffloadingSpec""#);
    let c = ok(r#", "eviction_policy": "lru", "cache_policy_module_path": "my.policies""#);
    assert_eq!(c.eviction_policy, kv_tier::EvictionPolicy::Lru);
    let e = err_of(&format!(
        r#"{{{base}, "eviction_policy": "lfu_custom", "cache_policy_module_path": "my.policies"}}"#
    ));
    assert!(e.contains("cache_policy_module_path"), "{e}");
    let e = err_of(&format!(r#"{{{base}, "eviction_policy": "fifo"}}"#));
    assert!(e.contains("eviction_policy"), "{e}");
    let e = err_of(&format!(r#"{{{base}, "spec_name": "CPUOffloadingSpec"}}"#));
    assert!(e.contains("spec_name"), "{e}");
    // module_path of an unregistered type: building fails naming it
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{{base}, "secondary_tiers": [{{"type": "redis", "module_path": "my.tiers.redis"}}]}}"#
    ))
    .unwrap();
    let e = kv_tier::builder(c)
        .unwrap()
        .build_blocking()
        .map(|_| ())
        .unwrap_err()
        .to_string();
    assert!(e.contains("redis") || e.contains("module_path"), "{e}");
}

// ====================================================================== more DRAM and events

/// Promise (kv-tier-core/src/event.rs): "Events that tell consumers (a KV-events publisher, a
/// router) where blocks are"; `TierEvent::removed`: "`true` for removals (evictions,
/// deletions)"; lifecycle.rs `reset_cache`: "empties DRAM ... Returns how many blocks stay in
/// DRAM because readers still pin them". A consumer told a block is in DRAM must be told when
/// reset_cache drops it: one removal per dropped block, none for the pinned ones (until a
/// later reset drops them).
#[test]
fn reset_cache_reports_the_blocks_it_drops_from_dram() {
    let m = build(cfg(8, BS, ""));
    let keys: Vec<_> = (0..6).map(k).collect();
    store(&m, 1, &keys);
    assert_eq!(flat(&m.take_events()).len(), 6);
    let views = m.prepare_load(&keys[..2]).unwrap();
    assert_eq!(m.runtime().block_on(m.reset_cache()), 2);
    let removed = |ev: Vec<TierEvent>| -> Vec<BlockKey> {
        let mut r: Vec<_> = flat(&ev)
            .into_iter()
            .filter(|(_, r)| *r)
            .map(|(kk, _)| kk)
            .collect();
        r.sort();
        r
    };
    let mut want = keys[2..].to_vec();
    want.sort();
    let got = removed(m.take_events());
    drop(views);
    assert_eq!(m.runtime().block_on(m.reset_cache()), 0);
    let mut want2 = keys[..2].to_vec();
    want2.sort();
    let got2 = removed(m.take_events());
    assert_eq!(
        (got, got2),
        (want, want2),
        "blocks reset_cache dropped from DRAM, as removals (first reset, second reset)"
    );
}

/// Promise (kv-tier/src/lib.rs, "Promotion"): "a key found only in a secondary tier is
/// promoted by a load job"; manager `take_events`: "the primary's first". A block promoted
/// into DRAM is a block stored in DRAM: one DRAM stored event per promoted block, and no
/// new stored event for the tier it came from.
#[test]
fn a_promotion_is_reported_as_one_dram_store() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "enable_kv_events": true}}]}}"#,
        16 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let keys: Vec<_> = (0..4).map(k).collect();
    store(&m, 1, &keys);
    idle(&m);
    m.runtime().block_on(m.reset_cache());
    let _ = m.take_events();
    let req = RequestContext::new(2);
    let mut promoted = false;
    for _ in 0..200 {
        let f = m.lookup_prefix(&keys, &req);
        m.on_schedule_end();
        if f.hit == keys.len() {
            promoted = true;
            break;
        }
        idle(&m);
    }
    assert!(promoted, "the promotion never landed");
    let v = m.prepare_load(&keys).unwrap();
    for (key, view) in keys.iter().zip(&v) {
        assert!(verify_block(key, 0, view.as_slice()));
    }
    drop(v);
    m.on_request_finished(req.id);
    let events = m.take_events();
    let t = by_tier(&events);
    let cpu = flat(t.get(CPU).map(|v| &v[..]).unwrap_or(&[]));
    for key in &keys {
        assert_eq!(
            cpu.iter().filter(|(kk, r)| kk == key && !r).count(),
            1,
            "{key}: DRAM events after promotion: {cpu:?}"
        );
    }
    let fs = flat(t.get("fs").map(|v| &v[..]).unwrap_or(&[]));
    assert!(
        fs.iter().all(|(_, r)| *r),
        "a promotion re-reported as an fs store: {fs:?}"
    );
    let st = m.stats();
    assert_eq!((st.held_blocks, st.holding_requests), (0, 0), "{st:?}");
    assert_eq!(st.tiers[0].blocks_loaded, 4);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs `reset_cache`): "Cancels queued
/// promotions, waits for the jobs in flight, then empties DRAM ... Returns how many blocks
/// stay in DRAM because readers still pin them"; pending.rs: the store's slots are its own
/// until commit or abort. A reset while a store is being filled neither hangs nor leaks the
/// slot nor serves a block whose bytes it freed: after the commit the key is either a Hit
/// with the committed bytes or a Miss, and the pool's every slot is usable again.
#[test]
fn reset_cache_while_a_store_is_being_filled() {
    for end in ["commit", "abort"] {
        let m = build(cfg(4, BS, ""));
        store(&m, 1, &[k(50)]);
        let a = k(1);
        let mut p = m.prepare_store(&[a]).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let hung = std::thread::scope(|s| {
            s.spawn(|| {
                let left = m.runtime().block_on(m.reset_cache());
                let _ = tx.send(left);
            });
            let got = rx.recv_timeout(Duration::from_secs(30));
            for (key, sk) in p.slots() {
                // overwrite after the reset: a freed slot reused elsewhere would show it
                fill_block(key, 0, sk.as_mut_slice());
            }
            if end == "commit" {
                p.commit(RequestId(1));
            } else {
                p.abort();
            }
            got.is_err()
        });
        assert!(
            !hung,
            "{end}: reset_cache waited on a store the caller's thread holds"
        );
        let hit = is_hit(&m, &a);
        if hit {
            assert_eq!(end, "commit");
            let v = m.prepare_load(&[a]).unwrap();
            assert!(verify_block(&a, 0, v[0].as_slice()), "{end}: wrong bytes");
        }
        let st = m.stats().primary;
        assert_eq!(st.writing_blocks, 0, "{end}: {st:?}");
        assert_eq!(st.ready_blocks, usize::from(hit), "{end}: {st:?}");
        // the whole pool is usable: 4 new keys, evicting at most the one block there
        let ev = store(&m, 2, &[k(10), k(11), k(12), k(13)]);
        assert_eq!(ev.len(), usize::from(hit), "{end}");
        for i in 10..14 {
            let v = m.prepare_load(&[k(i)]).unwrap();
            assert!(verify_block(&k(i), 0, v[0].as_slice()));
        }
    }
}

/// Promise (kv-tier-core/src/manager/mod.rs `prepare_load`): "Pins readable DRAM blocks ...;
/// each view pins its slot until dropped. Fails, pinning nothing, if a key is not readable".
/// A failed load pins nothing (reset_cache then reports 0 pinned), and a load naming a key
/// twice pins and unpins consistently.
#[test]
fn a_failed_load_pins_nothing_and_duplicate_loads_unpin() {
    let m = build(cfg(4, BS, ""));
    let (a, b) = (k(1), k(2));
    store(&m, 1, &[a, b]);
    assert!(m.prepare_load(&[a, k(99), b]).is_err());
    assert_eq!(
        m.runtime().block_on(m.reset_cache()),
        0,
        "a failed load pinned something"
    );
    store(&m, 1, &[a, b]);
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

/// Promise (kv-tier-core/src/event.rs `BoundedEvents`): "past it the oldest keys go first
/// (whole events, or the oldest keys of the one event left), counted"; config
/// `event_buffer_keys`. One store of 8 blocks with a bound of 5 keeps that event's 5 newest
/// keys, in their order, and counts 3 dropped.
#[test]
fn the_event_bound_trims_inside_a_single_event() {
    let m = build(cfg(16, BS, r#", "event_buffer_keys": 5"#));
    let keys: Vec<_> = (0..8).map(k).collect();
    let mut p = m.prepare_store(&keys).unwrap();
    let order = p.keys();
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    p.commit(RequestId(1));
    let seq: Vec<_> = flat(&m.take_events())
        .into_iter()
        .map(|(kk, _)| kk)
        .collect();
    assert_eq!(seq, order[3..].to_vec());
    assert_eq!(m.stats().events_dropped, 3);
}

/// Promise (kv-tier-core/src/config/mod.rs `store_threshold`): "vLLM refuses it for its
/// tiering spec; here it applies with secondary tiers too". A block DRAM does not admit is
/// not cascaded either (nothing stored, no cascade counted), and is once admitted.
#[test]
fn store_threshold_gates_the_cascade_too() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "store_threshold": 2, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
        16 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let key = k(3);
    store(&m, 1, &[key]);
    idle(&m);
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    assert_eq!(fs.stats().blocks.blocks_written, 0);
    assert_eq!(m.stats().cascades, 0);
    for r in [10u64, 11] {
        let req = RequestContext::new(r);
        for _ in 0..3 {
            let v = m.lookup(&key, &req);
            assert!(
                matches!(v, LookupResult::Retry | LookupResult::Miss),
                "{v:?}"
            );
            m.on_schedule_end();
            idle(&m);
        }
        m.on_request_finished(req.id);
    }
    store(&m, 1, &[key]);
    idle(&m);
    assert!(is_hit(&m, &key));
    assert_eq!(fs.stats().blocks.blocks_written, 1);
    assert_eq!(m.stats().cascades, 1);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/stats/mod.rs): `cascades`: "Store cascades started (one per
/// successful `complete_store` with new blocks)"; `store_jobs`: "Store jobs finished";
/// `blocks_stored`; `write_back_pinned_bytes`: "DRAM bytes pinned by store jobs now";
/// `write_back_bytes`: "Bytes of store jobs queued or in flight to this tier now";
/// pending.rs `commit`: "one store job per secondary tier". Once idle, the counters agree
/// with each other and with the tier's own.
#[test]
fn cascade_counters_agree_once_idle() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
        16 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    for b in 0..3u64 {
        let keys: Vec<_> = (0..4).map(|i| k(b * 10 + i)).collect();
        store(&m, 1, &keys);
        idle(&m);
    }
    // present only: nothing new, no cascade
    store(&m, 1, &[k(0), k(1)]);
    idle(&m);
    let st = m.stats();
    let t = &st.tiers[0];
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    assert_eq!(st.cascades, 3, "{st:?}");
    assert_eq!(t.store_jobs, 3, "{t:?}");
    assert_eq!(t.blocks_stored, 12, "{t:?}");
    assert_eq!(t.bytes_stored, 12 * BS as u64, "{t:?}");
    assert_eq!(fs.stats().blocks.blocks_written, 12);
    assert_eq!(
        (st.write_back_pinned_bytes, t.write_back_bytes),
        (0, 0),
        "{st:?}"
    );
    assert!(st.write_back_pinned_peak_bytes >= 4 * BS as u64, "{st:?}");
    assert!(t.write_back_peak_bytes >= 4 * BS as u64, "{t:?}");
    assert_eq!((t.writes_dropped, t.store_failures), (0, 0));
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier/src/prometheus.rs `render` and kv-tier-core/src/metrics.rs): every tier's
/// own figures are published as `kv_tier_<type>_<figure>` "with the tier's name as the label
/// `tier`", in the Prometheus text format. With an fs tier and an obj tier (a real S3 server)
/// that have stored and served blocks, the text is valid exposition format and each tier's
/// own families carry its label.
#[cfg(feature = "prometheus")]
#[test]
fn prometheus_text_with_fs_and_obj_tiers_is_valid() {
    let _g = prom::RECORDER.lock().unwrap_or_else(|e| e.into_inner());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let s3 = rt.block_on(kv_tier_testkit::s3::S3Server::start());
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [
              {{"type": "fs", "name": "fsx", "root_dir": {:?}, "gc_max_size_gb": 1}},
              {{"type": "obj", "name": "objx", "bucket": "{}", "endpoint_override": "{}",
                "scheme": "http", "access_key": "{}", "secret_key": "{}", "probe_budget_s": 1,
                "checksum": "crc32c", "enable_kv_events": true}}]}}"#,
        16 * BS,
        fs_layout(),
        dir.path(),
        kv_tier_testkit::s3::BUCKET,
        s3.endpoint,
        kv_tier_testkit::s3::AK,
        kv_tier_testkit::s3::SK
    ))
    .unwrap();
    let m = build(c);
    let keys: Vec<_> = (0..6).map(k).collect();
    store(&m, 1, &keys);
    idle(&m);
    m.runtime().block_on(m.reset_cache());
    // promote from obj only
    let req = RequestContext::new(3).only_tiers(["objx"]);
    for _ in 0..200 {
        let f = m.lookup_prefix(&keys[..2], &req);
        m.on_schedule_end();
        if f.hit == 2 {
            break;
        }
        idle(&m);
    }
    m.on_request_finished(req.id);
    let (text, ex) = prom::scrape(&m);
    let st = m.stats();
    assert_eq!(st.tiers[1].blocks_loaded, 2, "{:?}", st.tiers[1]);
    for (tier, ty) in [("fsx", "fs"), ("objx", "obj")] {
        let own: Vec<_> = ex
            .series
            .keys()
            .filter(|(n, l)| {
                n.starts_with(&format!("kv_tier_{ty}_"))
                    && l.iter().any(|(a, b)| a == "tier" && b == tier)
            })
            .collect();
        assert!(
            !own.is_empty(),
            "no kv_tier_{ty}_* series for {tier}:\n{text}"
        );
    }
    assert_eq!(
        prom::value(&ex, "kv_tier_blocks_loaded_total", &[("tier", "objx")]),
        Some(2.0)
    );
    let obj_events = by_tier(&m.take_events()).remove("objx").unwrap_or_default();
    assert!(
        obj_events.iter().all(|e| e.locality == Locality::Remote),
        "{obj_events:?}"
    );
    m.shutdown_blocking().unwrap();
    drop(s3);
    drop(rt);
}

// ============================================================ eviction with pins, both policies

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
        let m = build(cfg(cap, BS, &format!(r#", "eviction_policy": "{policy}""#)));
        let pool: Vec<_> = (0..14).map(k).collect();
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
        let m = build(cfg(4, BS, r#", "eviction_policy": "arc""#));
        let (f1, f2, r1, r2) = (k(1), k(2), k(3), k(4));
        store(&m, 1, &[f1, f2]);
        for _ in 0..3 {
            m.touch(&[f1]);
            m.touch(&[f2]);
            drop(m.prepare_load(&[f1, f2]).unwrap());
        }
        store(&m, 1, &[r1]);
        store(&m, 1, &[r2]);
        let pinned = if pin_frequent { [f1, f2] } else { [r1, r2] };
        let views = m.prepare_load(&pinned).unwrap();
        let mut p = match m.prepare_store(&[k(10)]) {
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
            .prepare_store(&[k(11)])
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

fn fs_manager(dir: &std::path::Path, slots: usize, extra: &str) -> TieringManager {
    build(
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}{extra}, {},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
            slots * BS,
            fs_layout(),
            dir
        ))
        .unwrap(),
    )
}

/// Promise (kv-tier-core/src/manager/mod.rs `lookup_many`): "A promotion's DRAM reservation
/// never evicts a block this call answered `Hit` for ... When nothing else can make room, the
/// promotion is refused and that key is a `Miss`"; stats `promotions_refused`: "Lookups that
/// found a block in a secondary tier but no DRAM slot to promote it into". A one-block DRAM
/// holding the prefix's first block cannot take the second's promotion: the first stays a
/// Hit, the second ends a Miss, and the refusal is counted.
#[test]
fn a_promotion_never_evicts_a_hit_of_the_same_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let m = fs_manager(dir.path(), 1, "");
    let (a, b) = (k(1), k(2));
    store(&m, 1, &[b]);
    idle(&m);
    store(&m, 1, &[a]); // evicts b from DRAM; b is in fs
    idle(&m);
    assert!(is_hit(&m, &a) && !is_hit(&m, &b));
    let req = RequestContext::new(5);
    let mut last = Vec::new();
    for _ in 0..100 {
        last = m.lookup_many(&[a, b], &req);
        m.on_schedule_end();
        assert_eq!(last[0], LookupResult::Hit, "{last:?}");
        if last.get(1) == Some(&LookupResult::Miss) {
            break;
        }
        if last.get(1) == Some(&LookupResult::Hit) {
            break;
        }
        idle(&m);
    }
    assert_eq!(last, vec![LookupResult::Hit, LookupResult::Miss]);
    assert!(is_hit(&m, &a), "the promotion evicted the prefix's Hit");
    assert!(m.stats().promotions_refused >= 1, "{:?}", m.stats());
    m.on_request_finished(req.id);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/mod.rs `lookup`): "The promoted block is then held in
/// DRAM for `req` (not evicted) until `req` reads it (a `Hit` and `prepare_load` of it in one
/// step), its prefix stops before it ..., or `req` finishes"; stats `held_blocks`. Stores
/// that would need the held block's slot evict others or are refused, never the held block;
/// once read, it is released.
#[test]
fn a_promoted_block_is_held_for_its_request_until_read() {
    let dir = tempfile::tempdir().unwrap();
    let m = fs_manager(dir.path(), 3, "");
    let b = k(2);
    store(&m, 1, &[b]);
    idle(&m);
    m.runtime().block_on(m.reset_cache());
    let req = RequestContext::new(9);
    let mut got_hit = false;
    for _ in 0..200 {
        let r = m.lookup(&b, &req);
        m.on_schedule_end();
        if r == LookupResult::Hit {
            got_hit = true;
            break;
        }
        assert!(
            matches!(r, LookupResult::Retry | LookupResult::HitPending),
            "{r:?}"
        );
        idle(&m);
    }
    assert!(got_hit, "never promoted");
    m.on_schedule_end();
    // the request has not read it: it is held
    assert_eq!(m.stats().held_blocks, 1, "{:?}", m.stats());
    for i in 0..10u64 {
        let keys = [k(100 + 2 * i), k(101 + 2 * i)];
        match m.prepare_store(&keys) {
            Ok(mut p) => {
                assert!(!p.evicted().contains(&b), "the held block was evicted");
                for (key, sk) in p.slots() {
                    fill_block(key, 0, sk.as_mut_slice());
                }
                p.commit(RequestId(1));
            }
            Err(Error::CapacityExhausted { .. }) => {}
            Err(e) => panic!("{e}"),
        }
        idle(&m);
        m.on_schedule_end();
    }
    // a Hit and a prepare_load in one step: read
    assert_eq!(m.lookup(&b, &req), LookupResult::Hit);
    let v = m.prepare_load(&[b]).unwrap();
    assert!(verify_block(&b, 0, v[0].as_slice()));
    drop(v);
    m.on_schedule_end();
    assert_eq!(
        m.stats().held_blocks,
        0,
        "read, still held: {:?}",
        m.stats()
    );
    m.on_request_finished(req.id);
    let st = m.stats();
    assert_eq!((st.held_blocks, st.holding_requests), (0, 0));
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-fs/README.md, Load): "Anything that cannot be served for a reason that
/// will not go away (a short or long file, ...) is removed, that key is a miss, and a
/// `BlockRemoved` event says so"; stats `load_failure_causes`: "corrupt: The block was damaged
/// (short, wrong size, checksum mismatch)"; pending.rs `present`: a promotion "can still fail
/// to arrive ...: then it is not in DRAM, the next lookup misses it". A promotion whose file
/// is truncated after the probe found it: no DRAM stored event, one fs removal, a Miss, the
/// failure counted as corrupt, and no slot left behind.
#[test]
fn a_failed_promotion_reports_no_dram_store_and_one_fs_removal() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "enable_kv_events": true}}]}}"#,
        8 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let (a, b) = (k(1), k(2));
    store(&m, 1, &[a, b]);
    idle(&m);
    m.runtime().block_on(m.reset_cache());
    let _ = m.take_events();
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    let path = fs.block_path(&a);
    assert!(path.exists());
    let req = RequestContext::new(3);
    // first step: probes go out
    let r = m.lookup_many(&[a, b], &req);
    assert!(r.iter().all(|v| *v == LookupResult::Retry), "{r:?}");
    m.on_schedule_end();
    // probes answered; wait without sending the promotion
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut r;
    loop {
        m.runtime().block_on(m.wait_jobs());
        m.poll();
        r = m.lookup_many(&[a, b], &req);
        if r.iter().all(|v| *v == LookupResult::HitPending) || Instant::now() > deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(r, vec![LookupResult::HitPending; 2]);
    // damage a before its promotion's load runs
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(BS as u64 / 2).unwrap();
    drop(f);
    m.on_schedule_end(); // sends the promotion
    let mut last = Vec::new();
    for _ in 0..200 {
        idle(&m);
        last = m.lookup_many(&[a, b], &req);
        m.on_schedule_end();
        if !last.contains(&LookupResult::HitPending) && !last.contains(&LookupResult::Retry) {
            break;
        }
    }
    assert_eq!(last.first(), Some(&LookupResult::Miss), "{last:?}");
    m.on_request_finished(req.id);
    idle(&m);
    let events = m.take_events();
    let t = by_tier(&events);
    let cpu = flat(t.get(CPU).map(|v| &v[..]).unwrap_or(&[]));
    assert!(
        !cpu.iter().any(|(kk, r)| *kk == a && !r),
        "a failed promotion reported stored in DRAM: {cpu:?}"
    );
    let fs_ev = flat(t.get("fs").map(|v| &v[..]).unwrap_or(&[]));
    assert_eq!(
        fs_ev.iter().filter(|(kk, r)| *kk == a && *r).count(),
        1,
        "damaged block's removal: {fs_ev:?}"
    );
    assert!(!is_hit(&m, &a));
    let st = m.stats();
    let t0 = &st.tiers[0];
    assert_eq!(t0.load_failures, 1, "{t0:?}");
    assert_eq!(
        t0.load_failure_causes.corrupt, 1,
        "{:?}",
        t0.load_failure_causes
    );
    assert_eq!(st.primary.writing_blocks, 0, "{:?}", st.primary);
    let readable = [a, b]
        .iter()
        .filter(|kk| m.prepare_load(&[**kk]).is_ok())
        .count();
    assert_eq!(st.primary.ready_blocks, readable);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/mod.rs `prepare_store`): "Where a tier's write-back
/// policy is `wait`, refused with [`Error::WriteBackFull`] (changing nothing) when the new
/// blocks would take its write-back past its limit, ... counting the stores prepared and not
/// yet completed"; stats: `stores_refused_for_write_back`, and `refused_stores` is "for lack
/// of room" only. The refusal evicts nothing from DRAM.
#[test]
fn a_write_back_refusal_changes_nothing_in_dram() {
    let dir = tempfile::tempdir().unwrap();
    let limit_mb = (2 * BS) as f64 / (1u64 << 20) as f64;
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "write_back_policy": "wait",
              "write_back_limit_mb": {limit_mb}}}]}}"#,
        4 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    for i in 0..4 {
        store(&m, 1, &[k(i)]);
        idle(&m);
    }
    let mut p1 = m.prepare_store(&[k(10), k(11)]).unwrap();
    assert_eq!(p1.evicted().len(), 2);
    let before = m.stats();
    let resident: Vec<_> = (0..4).map(k).filter(|kk| is_hit(&m, kk)).collect();
    assert_eq!(resident.len(), 2);
    match m.prepare_store(&[k(12)]) {
        Err(Error::WriteBackFull { .. }) => {}
        Err(e) => panic!("wrong refusal: {e}"),
        Ok(p) => panic!("accepted past the write-back limit: {:?}", p.keys()),
    }
    let after = m.stats();
    assert_eq!(
        after.primary.evictions, before.primary.evictions,
        "the refusal evicted"
    );
    assert_eq!(after.primary.refused_stores, before.primary.refused_stores);
    assert_eq!(
        after.stores_refused_for_write_back,
        before.stores_refused_for_write_back + 1
    );
    assert_eq!(after.primary.writing_blocks, 2);
    for kk in &resident {
        assert!(is_hit(&m, kk), "{kk} lost to a refused store");
    }
    for (key, sk) in p1.slots() {
        fill_block(key, 0, sk.as_mut_slice());
    }
    p1.commit(RequestId(1));
    idle(&m);
    store(&m, 1, &[k(12)]);
    idle(&m);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier/src/lib.rs "vLLM's config, unchanged"): "`block_size` or
/// `blocks_per_chunk` (engine blocks per offloaded block: the layout's `blocks_per_file`)";
/// "What vLLM's connector reads off the engine, the engine gives: ... the namespace
/// ([`TieringManagerBuilder::namespace`] ...)"; config.rs `check_namespace`: "The namespace
/// `ns` (the engine's, or the config's layout) checked against vLLM's chunking keys". A vLLM
/// config with `block_size` and an engine namespace must not silently drop `block_size`:
/// either the blocks go to the folder of `blocks_per_file` = block_size / tokens_per_hash, or
/// building fails naming the key.
#[test]
fn block_size_with_an_engine_namespace_is_applied_or_refused_never_ignored() {
    for (key, v, bpf) in [("block_size", 32u64, 2u64), ("blocks_per_chunk", 4, 4)] {
        let dir = tempfile::tempdir().unwrap();
        let mut c = KvTierConfig::from_json_str(&format!(
            r#"{{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 1048576, "{key}": {v},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
            dir.path()
        ))
        .unwrap();
        c.block_size_bytes = BS as u64;
        let ns = kv_tier::Namespace::new(
            kv_tier::RunFields::new("org/model", "torch.bfloat16", 16),
            0,
        )
        .unwrap();
        match kv_tier::builder(c).unwrap().namespace(ns).build_blocking() {
            Err(e) => assert!(
                e.to_string().contains(key),
                "{key}: refused without naming it: {e}"
            ),
            Ok(m) => {
                store(&m, 1, &[k(1)]);
                idle(&m);
                m.shutdown_blocking().unwrap();
                let cfgs: Vec<serde_json::Value> = std::fs::read_dir(dir.path())
                    .unwrap()
                    .filter_map(|e| {
                        let p = e.unwrap().path().join("config.json");
                        std::fs::read_to_string(p).ok()
                    })
                    .map(|t| serde_json::from_str(&t).unwrap())
                    .collect();
                assert_eq!(cfgs.len(), 1);
                assert_eq!(
                    cfgs[0]["blocks_per_file"], bpf,
                    "{key} {v} ignored: blocks written under {}",
                    cfgs[0]
                );
            }
        }
    }
}

/// Promise (kv-tier-core/src/tier_options.rs): "vLLM's `locality` (`"LOCAL"` or `"REMOTE"`,
/// any casing)"; "vLLM's `enable_kv_events` ... Off by default". Mixed casings are accepted
/// and carried; an explicit `false` reports nothing; other words are refused naming the path.
#[test]
fn locality_any_casing_and_explicit_event_switches() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [
              {{"type": "fs", "name": "a", "root_dir": {:?}, "enable_kv_events": true, "locality": "Remote"}},
              {{"type": "fs", "name": "b", "root_dir": {:?}, "enable_kv_events": true, "locality": "lOcAl"}},
              {{"type": "fs", "name": "c", "root_dir": {:?}, "enable_kv_events": false, "locality": "REMOTE"}}]}}"#,
        16 * BS,
        fs_layout(),
        dirs[0].path(),
        dirs[1].path(),
        dirs[2].path()
    ))
    .unwrap();
    let m = build(c);
    store(&m, 1, &[k(1), k(2)]);
    idle(&m);
    let t = by_tier(&m.take_events());
    assert!(t["a"].iter().all(|e| e.locality == Locality::Remote));
    assert!(t["b"].iter().all(|e| e.locality == Locality::Local));
    assert!(!t.contains_key("c"), "enable_kv_events false reported");
    assert_eq!(flat(&t["a"]).len(), 2);
    m.shutdown_blocking().unwrap();
    let e = err_of(
        r#"{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/x", "locality": "GLOBAL"}]}"#,
    );
    assert!(e.contains("secondary_tiers[0].locality"), "{e}");
}

/// Replays DRAM's events into `replica` (the keys they say DRAM holds), asserting each is
/// possible: a store of a key not held, a removal of a key held.
fn replay_dram(events: &[TierEvent], replica: &mut HashSet<BlockKey>, ctx: &str) {
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

/// Promise (kv-tier-core/src/manager/lifecycle.rs `reset_cache`): "Cancels queued
/// promotions, waits for the jobs in flight, then empties DRAM"; lib.rs: a probe has a
/// deadline, "so no key stays out of `Hit`/`Miss` for long"; `lease_s`: "The lease ends when
/// the promotion ends or every request that asked for the key has finished". A reset while a
/// request's promotion is queued, and while it is in flight: the request's keys still settle
/// to `Hit` (with the right bytes) or `Miss`, nothing stays held, leased or being written,
/// and DRAM's events still describe DRAM.
#[test]
fn reset_cache_during_a_queued_and_an_in_flight_promotion() {
    for phase in ["queued", "in flight"] {
        let dir = tempfile::tempdir().unwrap();
        let m = fs_manager(dir.path(), 8, "");
        let keys = [k(1), k(2), k(3)];
        store(&m, 1, &keys);
        idle(&m);
        m.runtime().block_on(m.reset_cache());
        let mut replica = HashSet::new();
        replay_dram(&m.take_events(), &mut replica, phase);
        assert!(replica.is_empty(), "{phase}: {replica:?}");
        let req = RequestContext::new(4);
        let r = m.lookup_many(&keys, &req);
        assert!(r.iter().all(|v| *v == LookupResult::Retry), "{r:?}");
        m.on_schedule_end();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            m.runtime().block_on(m.wait_jobs());
            m.poll();
            let r = m.lookup_many(&keys, &req);
            if r.iter().all(|v| *v == LookupResult::HitPending) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{phase}: never HitPending: {r:?}"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        if phase == "in flight" {
            m.on_schedule_end(); // sends the promotion
        }
        m.runtime().block_on(m.reset_cache());
        let mut last = Vec::new();
        for _ in 0..300 {
            last = m.lookup_many(&keys, &req);
            if last.iter().all(|v| *v == LookupResult::Hit) {
                let v = m.prepare_load(&keys).unwrap();
                for (key, view) in keys.iter().zip(&v) {
                    assert!(
                        verify_block(key, 0, view.as_slice()),
                        "{phase}: wrong bytes"
                    );
                }
                m.on_schedule_end();
                break;
            }
            m.on_schedule_end();
            if last.first() == Some(&LookupResult::Miss) {
                break;
            }
            idle(&m);
        }
        assert!(
            last.iter().all(|v| *v == LookupResult::Hit)
                || last.first() == Some(&LookupResult::Miss),
            "{phase}: never settled: {last:?}"
        );
        m.on_request_finished(req.id);
        idle(&m);
        m.on_schedule_end();
        let st = m.stats();
        assert_eq!(
            (st.held_blocks, st.holding_requests),
            (0, 0),
            "{phase}: {st:?}"
        );
        assert_eq!(st.primary.writing_blocks, 0, "{phase}");
        assert_eq!(st.tiers[0].leased_keys, 0, "{phase}: {:?}", st.tiers[0]);
        replay_dram(&m.take_events(), &mut replica, phase);
        let readable: HashSet<_> = keys
            .iter()
            .copied()
            .filter(|kk| m.prepare_load(&[*kk]).is_ok())
            .collect();
        assert_eq!(replica, readable, "{phase}: DRAM events disagree with DRAM");
        assert_eq!(st.primary.ready_blocks, readable.len(), "{phase}");
        m.shutdown_blocking().unwrap();
    }
}

/// Promise (kv-tier-core/src/manager/mod.rs `lookup`): the promoted block is held "until
/// `req` reads it ..., or `req` finishes"; lifecycle.rs: held blocks are let go "(they stay in
/// DRAM as ordinary, evictable blocks)"; stats `promotions_cancelled`: "Queued promotions not
/// sent because their request finished first". A request that finishes with its promotion
/// queued cancels it (counted, no slot left); one that finishes with it in flight leaves an
/// ordinary, evictable block.
#[test]
fn a_request_finishing_mid_promotion_leaves_nothing_held() {
    for phase in ["queued", "in flight"] {
        let dir = tempfile::tempdir().unwrap();
        let m = fs_manager(dir.path(), 4, "");
        let keys = [k(1), k(2)];
        store(&m, 1, &keys);
        idle(&m);
        m.runtime().block_on(m.reset_cache());
        let mut replica = HashSet::new();
        replay_dram(&m.take_events(), &mut replica, phase);
        let req = RequestContext::new(4);
        m.lookup_many(&keys, &req);
        m.on_schedule_end();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            m.runtime().block_on(m.wait_jobs());
            m.poll();
            if m.lookup_many(&keys, &req)
                .iter()
                .all(|v| *v == LookupResult::HitPending)
            {
                break;
            }
            assert!(Instant::now() < deadline, "{phase}: never HitPending");
            std::thread::sleep(Duration::from_millis(5));
        }
        if phase == "in flight" {
            m.on_schedule_end();
        }
        m.on_request_finished(req.id);
        m.on_schedule_end();
        idle(&m);
        m.on_schedule_end();
        let st = m.stats();
        assert_eq!(
            (st.held_blocks, st.holding_requests),
            (0, 0),
            "{phase}: {st:?}"
        );
        assert_eq!(st.primary.writing_blocks, 0, "{phase}: {:?}", st.primary);
        if phase == "queued" {
            // counted per block (one promotion per key; one job per tier and request)
            assert_eq!(
                st.tiers[0].promotions_cancelled, 2,
                "{phase}: {:?}",
                st.tiers[0]
            );
            assert_eq!(st.primary.ready_blocks, 0, "{phase}");
        }
        // whatever landed is ordinary: four new blocks fit, evicting it
        let ev = store(&m, 9, &[k(10), k(11), k(12), k(13)]);
        assert_eq!(ev.len(), st.primary.ready_blocks, "{phase}");
        replay_dram(&m.take_events(), &mut replica, phase);
        let mut want: HashSet<_> = (10..14).map(k).collect();
        want.retain(|kk| is_hit(&m, kk));
        assert_eq!(replica, want, "{phase}");
        m.shutdown_blocking().unwrap();
    }
}

/// Promise (kv-tier-core/src/event.rs `EventBatch`): "each key is in the log as soon as it is
/// added ..., in one event with the batch's other keys as long as nothing else was logged
/// between them"; manager `take_events`: "Events since the last call". Takes racing a tier's
/// multi-key store batches (from four threads, continuously) lose and duplicate no key: every
/// block written to the fs tier is reported stored exactly once.
#[test]
fn take_events_racing_multi_key_tier_batches_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "enable_kv_events": true,
              "n_write_threads": 4}}]}}"#,
        256 * BS,
        fs_layout(),
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let done = AtomicBool::new(false);
    let collected = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                let mut mine = Vec::new();
                loop {
                    let finished = done.load(Ordering::SeqCst);
                    mine.extend(m.take_events());
                    if finished {
                        break;
                    }
                    std::thread::yield_now();
                }
                collected.lock().unwrap().extend(mine);
            });
        }
        for b in 0..60u64 {
            let keys: Vec<_> = (0..16).map(|i| k(b * 100 + i)).collect();
            store(&m, 1, &keys);
            if b % 6 == 5 {
                idle(&m);
            }
        }
        idle(&m);
        done.store(true, Ordering::SeqCst);
    });
    let mut all = collected.into_inner().unwrap();
    all.extend(m.take_events());
    let written = m
        .tier::<kv_tier::fs::FsTier>("fs")
        .unwrap()
        .stats()
        .blocks
        .blocks_written;
    let fs = flat(&by_tier(&all).remove("fs").unwrap_or_default());
    let mut per_key: HashMap<BlockKey, usize> = HashMap::new();
    for (key, r) in &fs {
        assert!(!r, "an fs removal with no GC: {key}");
        *per_key.entry(*key).or_default() += 1;
    }
    let dup: Vec<_> = per_key.iter().filter(|(_, n)| **n > 1).collect();
    assert!(dup.is_empty(), "duplicated: {dup:?}");
    assert_eq!(per_key.len() as u64, written, "fs stored events lost");
    assert_eq!(written, 960);
    assert_eq!(m.stats().events_dropped, 0);
    m.shutdown_blocking().unwrap();
}

// Iterator helper: positions of matching items.
trait Positions: Iterator + Sized {
    fn positions<F: FnMut(Self::Item) -> bool>(self, mut f: F) -> Vec<usize> {
        self.enumerate()
            .filter_map(|(i, x)| f(x).then_some(i))
            .collect()
    }
}
impl<I: Iterator> Positions for I {}
