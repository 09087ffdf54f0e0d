//! The DRAM tier's slots: page-aligned and sized to the block, their write states, pins held by
//! sources and views, resets, event order, and pinned blocks never overwritten under concurrency.

use std::sync::Arc;

use kv_tier_core::{EvictionPolicy, LookupResult, PAGE_SIZE, PrimaryTier};

use crate::support::*;

#[test]
fn slots_are_page_aligned_and_sized_to_the_block() {
    let t = dram_tier(3, 5000, EvictionPolicy::Lru);
    assert_eq!(t.capacity_blocks(), 3);
    let mut p = t.prepare_store(&[dram_key(0), dram_key(1)]).unwrap();
    for (_, sink) in &mut p.to_store {
        assert_eq!(sink.len(), 5000);
        assert!(sink.is_aligned(PAGE_SIZE));
    }
    drop(p);
    t.complete_store(&[dram_key(0), dram_key(1)], true);
    let views = t.prepare_load(&[dram_key(0)]).unwrap();
    assert!(views[0].is_aligned(PAGE_SIZE));
    // Bytes view without a copy: same address as the slot view.
    assert_eq!(views[0].bytes().as_ptr(), views[0].as_slice().as_ptr());
}

#[test]
fn lookup_follows_the_write_state() {
    let t = dram_tier(2, 4096, EvictionPolicy::Lru);
    assert_eq!(t.lookup(&dram_key(1)), LookupResult::Miss);
    let p = t.prepare_store(&[dram_key(1)]).unwrap();
    assert_eq!(t.lookup(&dram_key(1)), LookupResult::HitPending);
    drop(p);
    assert_eq!(t.complete_store(&[dram_key(1)], true), vec![dram_key(1)]);
    assert_eq!(t.lookup(&dram_key(1)), LookupResult::Hit);
    // a second prepare of a present key has nothing to write
    let p = t.prepare_store(&[dram_key(1)]).unwrap();
    assert!(p.to_store.is_empty());
    assert_eq!(p.present, vec![dram_key(1)]);
}

#[test]
fn failed_store_frees_the_slots() {
    let t = dram_tier(1, 4096, EvictionPolicy::Lru);
    drop(t.prepare_store(&[dram_key(1)]).unwrap());
    assert!(t.complete_store(&[dram_key(1)], false).is_empty());
    assert_eq!(t.lookup(&dram_key(1)), LookupResult::Miss);
    assert_eq!(t.stats().writing_blocks, 0);
    store_in(&t, &[dram_key(2)]);
    assert_eq!(t.lookup(&dram_key(2)), LookupResult::Hit);
    assert!(
        t.take_events()
            .iter()
            .all(|e| !e.keys.contains(&dram_key(1)))
    );
}

#[test]
fn a_live_source_pins_its_slot_until_dropped() {
    let t = dram_tier(1, 4096, EvictionPolicy::Lru);
    store_in(&t, &[dram_key(0)]);
    let src = t.sources(&[dram_key(0)]).pop().unwrap().unwrap();
    let bytes = src.bytes();
    drop(src);
    // the Bytes view alone still pins
    assert!(t.prepare_store(&[dram_key(1)]).is_err());
    drop(bytes);
    assert!(t.prepare_store(&[dram_key(1)]).is_ok());
}

#[test]
fn removal_events_come_before_stored_events() {
    let t = dram_tier(1, 4096, EvictionPolicy::Lru);
    store_in(&t, &[dram_key(0)]);
    t.take_events();
    store_in(&t, &[dram_key(1)]);
    let ev = t.take_events();
    assert_eq!(ev.len(), 2);
    assert!(ev[0].removed && ev[0].keys == vec![dram_key(0)]);
    assert!(!ev[1].removed && ev[1].keys == vec![dram_key(1)]);
    assert_eq!(ev[1].medium, kv_tier_core::Medium::Cpu);
}

#[test]
fn reset_drops_unpinned_blocks_and_reports_them() {
    let t = dram_tier(3, 4096, EvictionPolicy::Arc);
    store_in(&t, &[dram_key(0), dram_key(1), dram_key(2)]);
    t.take_events();
    let pin = t.prepare_load(&[dram_key(1)]).unwrap();
    assert_eq!(t.reset(), 1);
    assert_eq!(resident_keys(&t, 3), vec![1]);
    let ev = t.take_events();
    assert!(ev[0].removed);
    assert_eq!(ev[0].keys.len(), 2);
    drop(pin);
    assert_eq!(t.reset(), 0);
    assert_eq!(t.stats().ready_blocks, 0);
}

#[test]
fn completing_while_the_sink_is_alive_drops_the_block() {
    let t = dram_tier(1, 4096, EvictionPolicy::Lru);
    let p = t.prepare_store(&[dram_key(0)]).unwrap();
    assert!(t.complete_store(&[dram_key(0)], true).is_empty());
    assert_eq!(t.lookup(&dram_key(0)), LookupResult::Miss);
    // the slot is not reused while the stale sink lives
    assert!(t.prepare_store(&[dram_key(1)]).is_err());
    drop(p);
    assert!(t.prepare_store(&[dram_key(1)]).is_ok());
}

/// Readers on other threads hold and drop pins while the scheduler thread stores and evicts:
/// a pinned block is never overwritten.
#[test]
fn pinned_blocks_are_never_overwritten_under_concurrency() {
    let t = Arc::new(dram_tier(16, 8192, EvictionPolicy::Lru));
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
        let k = dram_key(i);
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
