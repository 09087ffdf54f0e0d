//! Events: DRAM's (one per store and eviction, removals before the stores that caused them,
//! promotions and resets reported), the tiers' (only where enabled, with their locality, in order),
//! bounded buffers and their losses, and `take_events` from many threads.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use kv_tier::{
    BlockKey, KvTierConfig, Locality, LookupResult, Medium, RequestContext, RequestId,
    SecondaryTier, TierEvent,
};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{MemoryTier, fill_block, s3, test_key, verify_block};

use crate::support::*;

/// Promise (kv-tier-core/src/manager/mod.rs `take_events`): "Events since the last call:
/// the primary's first"; kv-tier-cpu/README.md: "Events: removals (evictions) are queued
/// before the stores that caused them". Every committed block gets exactly one DRAM stored
/// event, every eviction exactly one removal, a key's removal comes after its store, and a
/// store's victims are reported before that store.
#[test]
fn dram_events_one_per_store_and_eviction_in_order() {
    let m = build(dram_cfg(4, BS, ""));
    let mut evicted_by = Vec::new();
    for i in 0..12 {
        let ev = store_evicting(&m, 1, &[test_key(i)]);
        evicted_by.push((test_key(i), ev));
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
        let stored: Vec<_> = seq.iter().positions(|(kk, r)| *kk == test_key(i) && !r);
        let removed: Vec<_> = seq.iter().positions(|(kk, r)| *kk == test_key(i) && *r);
        assert_eq!(stored.len(), 1, "k{i} stored events: {seq:?}");
        let was_evicted = evicted_by.iter().any(|(_, e)| e.contains(&test_key(i)));
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
    let m = build(dram_cfg(2, BS, ""));
    store_evicting(&m, 1, &[test_key(1), test_key(2)]);
    let _ = m.take_events();
    let p = m.prepare_store(&[test_key(3)]).unwrap();
    let mut victims = p.evicted().to_vec();
    assert_eq!(victims.len(), 1);
    p.abort();
    // the freed slot and one more eviction
    let p = m.prepare_store(&[test_key(4), test_key(5)]).unwrap();
    victims.extend(p.evicted());
    assert_eq!(victims.len(), 2);
    drop(p);
    let events = m.take_events();
    let seq = flat(&events);
    assert!(
        !seq.iter()
            .any(|(kk, r)| !r && [test_key(3), test_key(4), test_key(5)].contains(kk)),
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
        LAYOUT,
        d1.path(),
        d2.path()
    ))
    .unwrap();
    let m = build(c);
    let keys: Vec<_> = (0..10).map(test_key).collect();
    for ch in keys.chunks(3) {
        store_evicting(&m, 1, ch);
    }
    block_on_idle(&m);
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
        store_evicting(&m, 1, ch);
    }
    block_on_idle(&m);
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
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let mut all = Vec::new();
    for i in 0..80u64 {
        store_evicting(&m, 1, &[test_key(i)]);
        if i % 4 == 3 {
            block_on_idle(&m);
            all.extend(m.take_events());
        }
    }
    block_on_idle(&m);
    // until the GC has removed something (the checks below say what if it never does)
    poll_until(SETTLE_LIMIT, || {
        all.extend(m.take_events());
        flat(&by_tier(&all).remove("fs").unwrap_or_default())
            .iter()
            .any(|(_, r)| *r)
    });
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
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    for i in 0..20 {
        store_evicting(&m, 1, &[test_key(i)]);
        block_on_idle(&m);
    }
    let st = m.stats();
    let events = m.take_events();
    let t = by_tier(&events);
    let cpu = flat(t.get(CPU).map(|v| &v[..]).unwrap_or(&[]));
    let fs = flat(t.get("fs").map(|v| &v[..]).unwrap_or(&[]));
    let newest: Vec<_> = (15..20).map(|i| (test_key(i), false)).collect();
    assert_eq!(cpu, newest, "DRAM held the wrong keys");
    assert_eq!(fs, newest, "the fs tier held the wrong keys");
    assert_eq!(st.tiers[0].events_dropped, 15, "{:?}", st.tiers[0]);
    assert_eq!(st.events_dropped, 30, "DRAM's 15 and the tier's 15");
    // taken: the buffers are empty again and the counts do not move
    for i in 20..23 {
        store_evicting(&m, 1, &[test_key(i)]);
    }
    block_on_idle(&m);
    assert_eq!(m.stats().events_dropped, 30);
    assert_eq!(flat(&m.take_events()).len(), 6);
}

/// Promise (kv-tier-core/src/manager/mod.rs `take_events`): "Events since the last call".
/// Taken from four threads at once while another thread stores (with evictions), every event
/// is returned exactly once: no stored event lost or duplicated, one removal per eviction.
#[test]
fn take_events_from_many_threads_loses_and_duplicates_nothing() {
    let m = build(dram_cfg(32, BS, ""));
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
            evictions += store_evicting(&m, 1, &[test_key(i)]).len();
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
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    for i in 0..10 {
        store_evicting(&m, 1, &[test_key(i)]);
    }
    block_on_idle(&m);
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

/// Promise (kv-tier-core/src/event.rs): "Events that tell consumers (a KV-events publisher, a
/// router) where blocks are"; `TierEvent::removed`: "`true` for removals (evictions,
/// deletions)"; lifecycle.rs `reset_cache`: "empties DRAM ... Returns how many blocks stay in
/// DRAM because readers still pin them". A consumer told a block is in DRAM must be told when
/// reset_cache drops it: one removal per dropped block, none for the pinned ones (until a
/// later reset drops them).
#[test]
fn reset_cache_reports_the_blocks_it_drops_from_dram() {
    let m = build(dram_cfg(8, BS, ""));
    let keys: Vec<_> = (0..6).map(test_key).collect();
    store_evicting(&m, 1, &keys);
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
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let keys: Vec<_> = (0..4).map(test_key).collect();
    store_evicting(&m, 1, &keys);
    block_on_idle(&m);
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
        block_on_idle(&m);
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

/// Promise (kv-tier-core/src/event.rs `BoundedEvents`): "past it the oldest keys go first
/// (whole events, or the oldest keys of the one event left), counted"; config
/// `event_buffer_keys`. One store of 8 blocks with a bound of 5 keeps that event's 5 newest
/// keys, in their order, and counts 3 dropped.
#[test]
fn the_event_bound_trims_inside_a_single_event() {
    let m = build(dram_cfg(16, BS, r#", "event_buffer_keys": 5"#));
    let keys: Vec<_> = (0..8).map(test_key).collect();
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
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let (a, b) = (test_key(1), test_key(2));
    store_evicting(&m, 1, &[a, b]);
    block_on_idle(&m);
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
    let mut r = Vec::new();
    poll_until(SETTLE_LIMIT, || {
        m.runtime().block_on(m.wait_jobs());
        m.poll();
        r = m.lookup_many(&[a, b], &req);
        r.iter().all(|v| *v == LookupResult::HitPending)
    });
    assert_eq!(r, vec![LookupResult::HitPending; 2]);
    // damage a before its promotion's load runs
    let f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    f.set_len(BS as u64 / 2).unwrap();
    drop(f);
    m.on_schedule_end(); // sends the promotion
    let mut last = Vec::new();
    for _ in 0..200 {
        block_on_idle(&m);
        last = m.lookup_many(&[a, b], &req);
        m.on_schedule_end();
        if !last.contains(&LookupResult::HitPending) && !last.contains(&LookupResult::Retry) {
            break;
        }
    }
    assert_eq!(last.first(), Some(&LookupResult::Miss), "{last:?}");
    m.on_request_finished(req.id);
    block_on_idle(&m);
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
        LAYOUT,
        dirs[0].path(),
        dirs[1].path(),
        dirs[2].path()
    ))
    .unwrap();
    let m = build(c);
    store_evicting(&m, 1, &[test_key(1), test_key(2)]);
    block_on_idle(&m);
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
        LAYOUT,
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
            let keys: Vec<_> = (0..16).map(|i| test_key(b * 100 + i)).collect();
            store_evicting(&m, 1, &keys);
            if b % 6 == 5 {
                block_on_idle(&m);
            }
        }
        block_on_idle(&m);
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

/// `event_buffer_keys` bounds every buffer; the excess is counted.
#[test]
fn event_buffers_are_bounded() {
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "event_buffer_keys": 3,
            "secondary_tiers": [{{"type": "memory", "enable_kv_events": true}}]}}"#,
        4 * BS
    ))
    .unwrap();
    let mut reg = kv_tier::registry();
    MemoryTier::register(&mut reg).unwrap();
    let m = kv_tier::builder(c)
        .unwrap()
        .registry(reg)
        .build_blocking()
        .unwrap();
    for i in 0..10u64 {
        engine_store(&m, RequestId(i), &[test_key(i * 2), test_key(i * 2 + 1)]);
        m.on_request_finished(RequestId(i));
        block_on_idle(&m);
    }
    let ev = m.take_events();
    let mut per: std::collections::HashMap<String, usize> = Default::default();
    for e in &ev {
        *per.entry(e.tier.clone()).or_default() += e.keys.len();
    }
    for (tier, n) in &per {
        assert!(
            *n <= 3,
            "{tier}: {n} event keys held with event_buffer_keys = 3"
        );
    }
    assert!(m.stats().events_dropped > 0);
    m.shutdown_blocking().unwrap();
}

#[test]
fn event_buffers_are_bounded_and_their_losses_counted() {
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS_64K}, "event_buffer_keys": 4,
            "secondary_tiers": [{{"type": "memory", "name": "loud", "enable_kv_events": true}},
                                {{"type": "memory", "name": "quiet"}}]}}"#,
        64 * BS_64K
    ))
    .unwrap();
    let mut registry = kv_tier::registry();
    kv_tier_testkit::MemoryTier::register(&mut registry).unwrap();
    let m = kv_tier::builder(cfg)
        .unwrap()
        .registry(registry)
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..10).map(test_key).collect();
    for k in &keys {
        engine_store(&m, RequestId(1), &[*k]); // one event per block
        m.runtime().block_on(m.wait_idle());
    }
    // nobody took the events: each buffer kept the newest 4 keys and counted the rest
    let s = m.stats();
    assert_eq!(s.tiers[0].events_dropped, 6, "loud");
    assert_eq!(s.tiers[1].events_dropped, 0, "quiet records nothing");
    assert_eq!(s.events_dropped, 6 + 6, "DRAM's 6 and loud's 6");
    let ev = m.take_events();
    let loud: Vec<BlockKey> = ev
        .iter()
        .filter(|e| e.tier == "loud")
        .flat_map(|e| e.keys.clone())
        .collect();
    assert_eq!(loud, keys[6..], "the oldest went first");
    let dram: Vec<BlockKey> = ev
        .iter()
        .filter(|e| e.tier == "cpu" && !e.removed)
        .flat_map(|e| e.keys.clone())
        .collect();
    assert_eq!(dram, keys[6..]);
    assert!(ev.iter().all(|e| e.tier != "quiet"));
    let quiet = m.tier::<kv_tier_testkit::MemoryTier>("quiet").unwrap();
    assert_eq!(quiet.len(), 10, "stored all the same");
    assert!(kv_tier::SecondaryTier::take_events(&*quiet).is_empty());
}

/// Locality overrides apply to what take_events returns, both directions.
#[test]
fn locality_override_applies_both_ways_and_off_records_nothing() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(s3::S3Server::start());
    let dir = tempfile::tempdir().unwrap();
    let text = format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS_64K},
            "secondary_tiers": [
              {{"type": "fs", "root_dir": {:?}, "enable_kv_events": true, "locality": "REMOTE"}},
              {{"type": "fs", "name": "fs_quiet", "root_dir": {:?}, "enable_kv_events": false}},
              {{"type": "obj", "bucket": "{}", "endpoint_override": "{}", "scheme": "http",
                "access_key": "{}", "secret_key": "{}", "enable_kv_events": true, "locality": "local"}}
            ]}}"#,
        64 * BS_64K,
        dir.path().join("a"),
        dir.path().join("b"),
        s3::BUCKET,
        server.endpoint,
        s3::AK,
        s3::SK
    );
    let cfg = KvTierConfig::from_json_str(&text).unwrap();
    let m = kv_tier::builder(cfg)
        .unwrap()
        .runtime(rt.handle().clone())
        .namespace(model_namespace())
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..4).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    rt.block_on(m.wait_idle());
    let ev = m.take_events();
    assert!(
        ev.iter()
            .filter(|e| e.tier == "fs")
            .all(|e| e.locality == Locality::Remote)
    );
    assert!(
        ev.iter()
            .filter(|e| e.tier == "obj")
            .all(|e| e.locality == Locality::Local)
    );
    assert_eq!(
        ev.iter()
            .filter(|e| e.tier == "obj")
            .map(|e| e.keys.len())
            .sum::<usize>(),
        4
    );
    assert!(ev.iter().all(|e| e.tier != "fs_quiet"));
    let quiet = m.tier::<kv_tier::fs::FsTier>("fs_quiet").unwrap();
    assert!(
        SecondaryTier::take_events(&*quiet).is_empty(),
        "quiet tier's own buffer grew"
    );
    assert_eq!(m.stats().tiers[1].events_dropped, 0);
    rt.block_on(m.shutdown()).unwrap();
}

/// An fs tier with events off, reopened over a directory its GC must shrink at open: its
/// open-time removals are not "losses" a consumer who turned events off should see.
#[test]
fn events_off_counts_no_losses_from_open_time_gc() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = |extra: &str| {
        let mut c = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "secondary_tiers": [{{"type": "fs", "root_dir": {:?}{extra}}}]}}"#,
            64 * BS_64K,
            dir.path()
        ))
        .unwrap();
        c.block_size_bytes = BS_64K as u64;
        c
    };
    let m = kv_tier::builder(cfg(""))
        .unwrap()
        .namespace(model_namespace())
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..40).map(test_key).collect();
    for c in keys.chunks(8) {
        engine_store(&m, RequestId(1), c);
        m.runtime().block_on(m.wait_idle());
    }
    m.shutdown_blocking().unwrap();
    // ~0.5 MiB bound over 2.5 MiB of blocks
    let m = kv_tier::builder(cfg(r#", "gc_max_size_gb": 0.0005"#))
        .unwrap()
        .namespace(model_namespace())
        .build_blocking()
        .unwrap();
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    // over its cap at open, the tier sweeps at its first GC interval (60 s, past this test):
    // the open-time sweep by hand
    fs.gc_sweep_now().unwrap();
    assert!(
        fs.stats().gc.unwrap().swept_files > 0,
        "the sweep removed nothing"
    );
    m.runtime().block_on(m.wait_idle());
    let s = m.stats();
    assert_eq!(
        s.events_dropped, 0,
        "events off, yet losses counted: {:?}",
        s.tiers[0].events_dropped
    );
    assert!(m.take_events().iter().all(|e| e.tier != "fs"));
    m.shutdown_blocking().unwrap();
}

#[test]
fn fs_event_buffer_bound_within_one_job() {
    let dir = tempfile::tempdir().unwrap();
    let mut c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "event_buffer_keys": 2,
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "enable_kv_events": true}}]}}"#,
        64 * BS_64K,
        dir.path()
    ))
    .unwrap();
    c.block_size_bytes = BS_64K as u64;
    let m = kv_tier::builder(c)
        .unwrap()
        .namespace(model_namespace())
        .build_blocking()
        .unwrap();
    let keys: Vec<_> = (0..5).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    m.runtime().block_on(m.wait_idle());
    let s = m.stats();
    assert_eq!(s.tiers[0].events_dropped, 3);
    assert_eq!(s.events_dropped, 6, "DRAM's 3 + fs's 3");
    let ev = m.take_events();
    assert_eq!(
        ev.iter()
            .filter(|e| e.tier == "fs")
            .map(|e| e.keys.len())
            .sum::<usize>(),
        2
    );
    m.shutdown_blocking().unwrap();
}
