//! `prepare_store` and its `PendingStore`: slots readable only once committed, `abort` and drop
//! free them, duplicate, present and concurrently prepared keys, an aborted store a lookup waited
//! for.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use LookupResult::{HitPending, Miss};
use kv_tier::{LookupResult, RequestContext, RequestId};
use kv_tier_testkit::{fill_block, test_key, verify_block};

use crate::support::*;

/// Promise (kv-tier/src/lib.rs, "The step loop"): "copy GPU -> DRAM into its slots, then
/// commit it. The blocks are readable in DRAM at once"; kv-tier-core/src/manager/mod.rs
/// `prepare_load`: "Fails, pinning nothing, if a key is not readable (`Hit`)". A block is
/// never `Hit` nor loadable before its store is committed, even when another thread asks
/// while the slot is being written, and a view never shows a half-written block.
#[test]
fn a_block_is_never_readable_before_its_commit_even_from_another_thread() {
    let m = build(dram_cfg(8, BS, ""));
    for round in 0..40u64 {
        let key = test_key(1000 + round);
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
    let m = build(dram_cfg(4, BS, ""));
    let keys: Vec<_> = (0..4).map(test_key).collect();
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
    let ev = store_evicting(&m, 1, &keys);
    assert!(ev.is_empty(), "{ev:?}");
    let st = m.stats();
    assert_eq!((st.primary.ready_blocks, st.primary.evictions), (4, 0));
    assert_eq!(st.cascades, 0, "no secondary tier: nothing to cascade");
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/pending.rs): `slots` are "The keys that need writing,
/// each with its exclusive writable DRAM slot"; `present`: "Keys already present in DRAM, or
/// being written there (by another store ...): nothing to do". A store of zero keys, of the
/// same key twice, of keys present, and of a key another open store is writing: no key gets
/// two slots, counts stay consistent, and the bytes read back are the committed ones.
#[test]
fn empty_duplicate_present_and_concurrently_prepared_keys() {
    let m = build(dram_cfg(8, BS, ""));
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
    let (a, b) = (test_key(1), test_key(2));
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
    let c = test_key(3);
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

/// Promise (kv-tier-core/src/request.rs, `HitPending`: "Present, but a write or a promotion
/// into DRAM is still in flight: ask again next step"; `PendingStore` docs: dropping or
/// aborting it "frees its slots"). A key `HitPending` because the engine is writing it, whose
/// store is then aborted, does not stay `HitPending` and is never `Hit`.
#[test]
fn an_aborted_engine_store_ends_hit_pending() {
    let (_mem, faulty) = faulty_mem();
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let k = test_key(231);
    let r = ctx(2);
    for abort in [true, false] {
        let mut p = m.prepare_store(&[k]).unwrap();
        for (kk, s) in p.slots() {
            fill_block(kk, 0, s.as_mut_slice());
        }
        assert_eq!(m.lookup(&k, &r), HitPending);
        m.on_schedule_end();
        if abort {
            p.abort();
        } else {
            drop(p);
        }
        let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
        assert_eq!(end, Miss, "{seen:?}");
        m.on_schedule_end();
    }
    m.on_request_finished(r.id);
    assert_nothing_left(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Duplicate keys in one store: one slot per key, the bytes right, the pool fully reusable.
#[test]
fn duplicate_keys_in_one_store() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(4, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    let mut p = m.prepare_store(&[k, k, k]).unwrap();
    let n = p.slots().len();
    for (i, (key, s)) in p.slots().iter_mut().enumerate() {
        // if two slots were given, the second write differs: a torn or wrong block shows it
        if i == 0 {
            fill_block(key, 0, s.as_mut_slice());
        } else {
            s.as_mut_slice().fill(0xEE);
        }
    }
    p.commit(RequestId(1));
    assert_eq!(n, 1, "one key was given {n} slots");
    assert_eq!(m.stats().primary.ready_blocks, 1);
    let req = RequestContext::new(1);
    assert_eq!(m.lookup(&k, &req), LookupResult::Hit);
    assert!(load_and_verify(&m, &[k]));
    block_on_idle(&m);
    assert_eq!(m.stats().tiers[0].blocks_stored, 1);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

#[test]
fn a_pending_store_commits_aborts_or_frees_its_slots_when_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let m = kv_tier::builder(disk_tier_config(dir.path(), 4, BS_64K))
        .unwrap()
        .build_blocking()
        .unwrap();
    let req = RequestContext::new(1);
    let (a, b, c) = (test_key(1), test_key(2), test_key(3));
    let writing = |m: &kv_tier::TieringManager| m.primary().stats().writing_blocks;

    let p = m.prepare_store(&[a]).unwrap();
    assert_eq!(p.keys(), [a]);
    assert_eq!(writing(&m), 1);
    assert_eq!(m.lookup(&a, &req), LookupResult::HitPending);
    drop(p);
    assert_eq!(writing(&m), 0, "a dropped store keeps its slot");
    m.on_schedule_end();
    m.runtime().block_on(m.wait_idle());

    let p = m.prepare_store(&[b]).unwrap();
    p.abort();
    assert_eq!(writing(&m), 0, "an aborted store keeps its slot");

    let mut p = m.prepare_store(&[a, c]).unwrap();
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(req.id);
    assert_eq!(writing(&m), 0);
    assert_eq!(m.lookup(&c, &req), LookupResult::Hit);
    let views = m.prepare_load(&[a, c]).unwrap();
    assert!(
        views
            .iter()
            .zip([a, c])
            .all(|(v, k)| verify_block(&k, 0, v.as_slice()))
    );
    drop(views);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    m.runtime().block_on(m.wait_idle());
    let fs = m.tier::<kv_tier::fs::FsTier>("disk").unwrap();
    assert_eq!(
        fs.stats().blocks.blocks_written,
        2,
        "only the committed blocks cascaded"
    );
    // the dropped and the aborted keys were never stored anywhere
    let r2 = RequestContext::new(2);
    for k in [b] {
        let mut verdict = m.lookup(&k, &r2);
        for _ in 0..100 {
            if verdict != LookupResult::Retry {
                break;
            }
            m.on_schedule_end();
            m.runtime().block_on(m.wait_idle());
            verdict = m.lookup(&k, &r2);
        }
        assert_eq!(verdict, LookupResult::Miss, "{k}");
    }
    m.shutdown_blocking().unwrap();
}
