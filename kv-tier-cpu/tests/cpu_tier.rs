//! Behaviour of the DRAM primary tier.

use std::sync::Arc;

use kv_tier_core::{BlockKey, Error, EvictionPolicy, LookupResult, PAGE_SIZE, PrimaryTier};
use kv_tier_cpu::{CpuTier, CpuTierConfig};

fn key(i: u32) -> BlockKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_be_bytes());
    BlockKey::from_hash32(h, 0)
}

fn tier(slots: usize, block: usize, policy: EvictionPolicy) -> CpuTier {
    let slot = block.div_ceil(PAGE_SIZE) * PAGE_SIZE;
    CpuTier::new(CpuTierConfig {
        capacity_bytes: (slots * slot) as u64,
        block_size: block,
        policy,
        prefault: true,
    })
    .unwrap()
}

fn store(t: &CpuTier, keys: &[BlockKey]) -> Vec<BlockKey> {
    let mut p = t.prepare_store(keys).unwrap();
    for (k, sink) in &mut p.to_store {
        let fill = k.hash_bytes()[3];
        sink.as_mut_slice().fill(fill);
    }
    drop(p);
    t.complete_store(keys, true)
}

fn resident(t: &CpuTier, n: u32) -> Vec<u32> {
    (0..n)
        .filter(|&i| t.lookup(&key(i)) == LookupResult::Hit)
        .collect()
}

#[test]
fn slots_are_page_aligned_and_sized_to_the_block() {
    let t = tier(3, 5000, EvictionPolicy::Lru);
    assert_eq!(t.capacity_blocks(), 3);
    let mut p = t.prepare_store(&[key(0), key(1)]).unwrap();
    for (_, sink) in &mut p.to_store {
        assert_eq!(sink.len(), 5000);
        assert!(sink.is_aligned(PAGE_SIZE));
    }
    drop(p);
    t.complete_store(&[key(0), key(1)], true);
    let views = t.prepare_load(&[key(0)]).unwrap();
    assert!(views[0].is_aligned(PAGE_SIZE));
    // Bytes view without a copy: same address as the slot view.
    assert_eq!(views[0].bytes().as_ptr(), views[0].as_slice().as_ptr());
}

#[test]
fn lookup_follows_the_write_state() {
    let t = tier(2, 4096, EvictionPolicy::Lru);
    assert_eq!(t.lookup(&key(1)), LookupResult::Miss);
    let p = t.prepare_store(&[key(1)]).unwrap();
    assert_eq!(t.lookup(&key(1)), LookupResult::HitPending);
    drop(p);
    assert_eq!(t.complete_store(&[key(1)], true), vec![key(1)]);
    assert_eq!(t.lookup(&key(1)), LookupResult::Hit);
    // a second prepare of a present key has nothing to write
    let p = t.prepare_store(&[key(1)]).unwrap();
    assert!(p.to_store.is_empty());
    assert_eq!(p.present, vec![key(1)]);
}

#[test]
fn failed_store_frees_the_slots() {
    let t = tier(1, 4096, EvictionPolicy::Lru);
    drop(t.prepare_store(&[key(1)]).unwrap());
    assert!(t.complete_store(&[key(1)], false).is_empty());
    assert_eq!(t.lookup(&key(1)), LookupResult::Miss);
    assert_eq!(t.stats().writing_blocks, 0);
    store(&t, &[key(2)]);
    assert_eq!(t.lookup(&key(2)), LookupResult::Hit);
    assert!(t.take_events().iter().all(|e| !e.keys.contains(&key(1))));
}

#[test]
fn lru_evicts_least_recent_and_touch_keeps_first_key_most_recent() {
    let t = tier(4, 4096, EvictionPolicy::Lru);
    store(&t, &[key(0), key(1), key(2), key(3)]);
    // touch [3, 0]: 3 is most recent, then 0 -- no, the first key ends most recent.
    t.touch(&[key(3), key(0)]);
    // recency now, oldest first: 1, 2, 0, 3
    let p = t.prepare_store(&[key(10), key(11)]).unwrap();
    assert_eq!(p.evicted, vec![key(1), key(2)]);
    drop(p);
    t.complete_store(&[key(10), key(11)], true);
    let p = t.prepare_store(&[key(12)]).unwrap();
    assert_eq!(
        p.evicted,
        vec![key(0)],
        "key 0 was touched before key 3 became most recent"
    );
}

#[test]
fn never_evicts_a_key_of_the_same_batch() {
    let t = tier(2, 4096, EvictionPolicy::Lru);
    store(&t, &[key(0), key(1)]);
    // key 0 is the LRU block, but it is part of this batch.
    let p = t.prepare_store(&[key(0), key(5)]).unwrap();
    assert_eq!(p.evicted, vec![key(1)]);
    assert_eq!(p.present, vec![key(0)]);
    assert_eq!(p.to_store.len(), 1);
}

#[test]
fn refuses_cleanly_when_everything_is_pinned() {
    let t = tier(3, 4096, EvictionPolicy::Lru);
    store(&t, &[key(0), key(1), key(2)]);
    let pins = t.prepare_load(&[key(0), key(2)]).unwrap();
    t.take_events();
    let err = t.prepare_store(&[key(7), key(8)]).unwrap_err();
    match err {
        Error::CapacityExhausted {
            needed,
            evictable,
            capacity,
        } => assert_eq!((needed, evictable, capacity), (2, 1, 3)),
        other => panic!("unexpected {other}"),
    }
    // no partial state: nothing evicted, nothing reserved, no events
    assert_eq!(resident(&t, 3), vec![0, 1, 2]);
    assert_eq!(t.lookup(&key(7)), LookupResult::Miss);
    assert!(t.take_events().is_empty());
    assert_eq!(t.stats().refused_stores, 1);
    // one new block fits by evicting the only unpinned one
    let p = t.prepare_store(&[key(7)]).unwrap();
    assert_eq!(p.evicted, vec![key(1)]);
    drop(p);
    drop(pins);
    t.complete_store(&[key(7)], true);
    assert_eq!(resident(&t, 8), vec![0, 2, 7]);
}

#[test]
fn a_live_source_pins_its_slot_until_dropped() {
    let t = tier(1, 4096, EvictionPolicy::Lru);
    store(&t, &[key(0)]);
    let src = t.sources(&[key(0)]).pop().unwrap().unwrap();
    let bytes = src.bytes();
    drop(src);
    // the Bytes view alone still pins
    assert!(t.prepare_store(&[key(1)]).is_err());
    drop(bytes);
    assert!(t.prepare_store(&[key(1)]).is_ok());
}

#[test]
fn removal_events_come_before_stored_events() {
    let t = tier(1, 4096, EvictionPolicy::Lru);
    store(&t, &[key(0)]);
    t.take_events();
    store(&t, &[key(1)]);
    let ev = t.take_events();
    assert_eq!(ev.len(), 2);
    assert!(ev[0].removed && ev[0].keys == vec![key(0)]);
    assert!(!ev[1].removed && ev[1].keys == vec![key(1)]);
    assert_eq!(ev[1].medium, kv_tier_core::Medium::Cpu);
}

#[test]
fn arc_keeps_frequently_used_blocks_through_a_scan() {
    for (policy, survives) in [(EvictionPolicy::Arc, true), (EvictionPolicy::Lru, false)] {
        let t = tier(4, 4096, policy);
        store(&t, &[key(0), key(1)]);
        t.touch(&[key(0), key(1)]); // used twice: frequent
        // a scan of one-off blocks
        for i in 100..106 {
            store(&t, &[key(i)]);
        }
        let kept = t.lookup(&key(0)) == LookupResult::Hit && t.lookup(&key(1)) == LookupResult::Hit;
        assert_eq!(kept, survives, "{policy:?}");
    }
}

#[test]
fn reset_drops_unpinned_blocks_and_reports_them() {
    let t = tier(3, 4096, EvictionPolicy::Arc);
    store(&t, &[key(0), key(1), key(2)]);
    t.take_events();
    let pin = t.prepare_load(&[key(1)]).unwrap();
    assert_eq!(t.reset(), 1);
    assert_eq!(resident(&t, 3), vec![1]);
    let ev = t.take_events();
    assert!(ev[0].removed);
    assert_eq!(ev[0].keys.len(), 2);
    drop(pin);
    assert_eq!(t.reset(), 0);
    assert_eq!(t.stats().ready_blocks, 0);
}

#[test]
fn completing_while_the_sink_is_alive_drops_the_block() {
    let t = tier(1, 4096, EvictionPolicy::Lru);
    let p = t.prepare_store(&[key(0)]).unwrap();
    assert!(t.complete_store(&[key(0)], true).is_empty());
    assert_eq!(t.lookup(&key(0)), LookupResult::Miss);
    // the slot is not reused while the stale sink lives
    assert!(t.prepare_store(&[key(1)]).is_err());
    drop(p);
    assert!(t.prepare_store(&[key(1)]).is_ok());
}

/// Readers on other threads hold and drop pins while the scheduler thread stores and evicts:
/// a pinned block is never overwritten.
#[test]
fn pinned_blocks_are_never_overwritten_under_concurrency() {
    let t = Arc::new(tier(16, 8192, EvictionPolicy::Lru));
    let (tx, rx) = std::sync::mpsc::sync_channel::<(u32, kv_tier_core::BlockSource)>(2);
    let checker = std::thread::spawn(move || {
        let mut held = std::collections::VecDeque::new();
        let mut checked = 0u64;
        for (i, src) in rx {
            held.push_back((i, src));
            if held.len() > 6 {
                let (i, src) = held.pop_front().unwrap();
                let want = (i as u8).wrapping_mul(31);
                assert!(
                    src.as_slice().iter().all(|&b| b == want),
                    "block {i} changed while pinned"
                );
                checked += 1;
            }
        }
        checked
    });
    let mut stored = 0;
    for i in 0..4000u32 {
        let k = key(i);
        let mut p = match t.prepare_store(&[k]) {
            Ok(p) => p,
            Err(_) => continue,
        };
        for (_, sink) in &mut p.to_store {
            sink.as_mut_slice().fill((i as u8).wrapping_mul(31));
        }
        drop(p);
        t.complete_store(&[k], true);
        stored += 1;
        if i % 3 == 0
            && let Some(src) = t.sources(&[k]).pop().unwrap()
        {
            tx.send((i, src)).unwrap();
        }
    }
    drop(tx);
    let checked = checker.join().unwrap();
    assert!(stored > 3000, "stored {stored}");
    assert!(checked > 1000, "checked {checked}");
}
