//! The DRAM tier's eviction: LRU order (with `touch`), ARC keeping a frequent set through a scan,
//! never a key of the same batch, a clean refusal when everything is pinned.

use kv_tier_core::{Error, EvictionPolicy, LookupResult, PrimaryTier};

use crate::support::*;

#[test]
fn lru_evicts_least_recent_and_touch_keeps_first_key_most_recent() {
    let t = dram_tier(4, 4096, EvictionPolicy::Lru);
    store_in(&t, &[dram_key(0), dram_key(1), dram_key(2), dram_key(3)]);
    // touch [3, 0]: 3 is most recent, then 0 -- no, the first key ends most recent.
    t.touch(&[dram_key(3), dram_key(0)]);
    // recency now, oldest first: 1, 2, 0, 3
    let p = t.prepare_store(&[dram_key(10), dram_key(11)]).unwrap();
    assert_eq!(p.evicted, vec![dram_key(1), dram_key(2)]);
    drop(p);
    t.complete_store(&[dram_key(10), dram_key(11)], true);
    let p = t.prepare_store(&[dram_key(12)]).unwrap();
    assert_eq!(
        p.evicted,
        vec![dram_key(0)],
        "key 0 was touched before key 3 became most recent"
    );
}

#[test]
fn never_evicts_a_key_of_the_same_batch() {
    let t = dram_tier(2, 4096, EvictionPolicy::Lru);
    store_in(&t, &[dram_key(0), dram_key(1)]);
    // key 0 is the LRU block, but it is part of this batch.
    let p = t.prepare_store(&[dram_key(0), dram_key(5)]).unwrap();
    assert_eq!(p.evicted, vec![dram_key(1)]);
    assert_eq!(p.present, vec![dram_key(0)]);
    assert_eq!(p.to_store.len(), 1);
}

#[test]
fn refuses_cleanly_when_everything_is_pinned() {
    let t = dram_tier(3, 4096, EvictionPolicy::Lru);
    store_in(&t, &[dram_key(0), dram_key(1), dram_key(2)]);
    let pins = t.prepare_load(&[dram_key(0), dram_key(2)]).unwrap();
    t.take_events();
    let err = t.prepare_store(&[dram_key(7), dram_key(8)]).unwrap_err();
    match err {
        Error::CapacityExhausted {
            needed,
            evictable,
            capacity,
        } => assert_eq!((needed, evictable, capacity), (2, 1, 3)),
        other => panic!("unexpected {other}"),
    }
    // no partial state: nothing evicted, nothing reserved, no events
    assert_eq!(resident_keys(&t, 3), vec![0, 1, 2]);
    assert_eq!(t.lookup(&dram_key(7)), LookupResult::Miss);
    assert!(t.take_events().is_empty());
    assert_eq!(t.stats().refused_stores, 1);
    // one new block fits by evicting the only unpinned one
    let p = t.prepare_store(&[dram_key(7)]).unwrap();
    assert_eq!(p.evicted, vec![dram_key(1)]);
    drop(p);
    drop(pins);
    t.complete_store(&[dram_key(7)], true);
    assert_eq!(resident_keys(&t, 8), vec![0, 2, 7]);
}

#[test]
fn arc_keeps_frequently_used_blocks_through_a_scan() {
    for (policy, survives) in [(EvictionPolicy::Arc, true), (EvictionPolicy::Lru, false)] {
        let t = dram_tier(4, 4096, policy);
        store_in(&t, &[dram_key(0), dram_key(1)]);
        t.touch(&[dram_key(0), dram_key(1)]); // used twice: frequent
        // a scan of one-off blocks
        for i in 100..106 {
            store_in(&t, &[dram_key(i)]);
        }
        let kept = t.lookup(&dram_key(0)) == LookupResult::Hit
            && t.lookup(&dram_key(1)) == LookupResult::Hit;
        assert_eq!(kept, survives, "{policy:?}");
    }
}
