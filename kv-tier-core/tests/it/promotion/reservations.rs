//! The DRAM reservation of a promotion: it never evicts a block the same lookup answered `Hit` for;
//! with no room the promotion is refused as a counted `Miss`; an engine store of a key being
//! promoted never serves unfilled bytes.

use std::sync::Arc;
use std::time::{Duration, Instant};

use LookupResult::{Hit, HitPending, Miss, Retry};
use kv_tier_core::{BlockKey, LookupResult, PrimaryTier, RequestContext, RequestId};
use kv_tier_testkit::{FaultyTier, MemoryTier, fill_block, store_keys, test_key};

use crate::support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secondary_hit_without_dram_room_is_a_miss() {
    let t = mem("fs");
    let k = test_key(1);
    seed(&*t, &[k]).await;
    let fx = evented_manager(1, vec![t.clone()]).await;
    let pinned = test_key(9);
    engine_store(&fx.m, RequestId(1), &[pinned]);
    fx.m.wait_idle().await;
    let _reader = fx.cpu.prepare_load(&[pinned]).unwrap(); // the only slot is pinned
    let req = RequestContext::new(2);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k, &req), LookupResult::Miss);
    assert_eq!(fx.m.stats().promotions_refused, 1);
}

/// A promotion's reservation never evicts a block the same prefix lookup answered Hit for.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_does_not_evict_hits_of_the_same_prefix_lookup() {
    let t = mem("fs");
    let (k0, k1, k2, other) = (test_key(0), test_key(1), test_key(2), test_key(9));
    seed(&*t, &[k2]).await;
    let fx = evented_manager(3, vec![t.clone()]).await;
    engine_store(&fx.m, RequestId(1), &[k0]);
    engine_store(&fx.m, RequestId(1), &[k1]);
    engine_store(&fx.m, RequestId(1), &[other]); // most recent: k0 is the LRU block
    fx.m.wait_idle().await;
    let req = RequestContext::new(2).only_tiers(["fs"]);
    let prefix = [k0, k1, k2];
    let c = fx.m.lookup_prefix(&prefix, &req);
    assert_eq!((c.hit, c.retry), (2, true));
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    let c = fx.m.lookup_prefix(&prefix, &req);
    assert_eq!((c.hit, c.present), (2, 3));
    // the answered hits are still readable; the unrelated block made room
    assert!(
        fx.m.prepare_load(&[k0, k1]).is_ok(),
        "a block answered Hit was evicted"
    );
    assert_eq!(fx.cpu.lookup(&other), LookupResult::Miss);
}

/// A promotion whose load failed, with its result not applied yet, while the engine completes
/// a store of the same key: the slot must not become a readable block of garbage. (Found by
/// serve_sim's byte-for-byte oracle.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_store_never_completes_a_slot_reserved_by_a_promotion() {
    let inner = mem("fs");
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let t = faulty_over(&inner);
    t.fail_load(&[k]);
    let fx = evented_manager(4, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    step(&fx.m, &[k], &req);
    fx.m.wait_idle().await;
    let held = t.hold_load_results();
    assert_eq!(step(&fx.m, &[k], &req), vec![LookupResult::HitPending]);
    held.wait_arrived(1).await; // the load failed and released its slot; no result yet
    // same step, the engine recomputed the block and stores it
    let other = RequestContext::new(2);
    let p = fx.m.prepare_store(&[k]).unwrap();
    assert!(p.keys().is_empty(), "the slot is reserved by the promotion");
    p.commit(other.id);
    assert_ne!(
        fx.cpu.lookup(&k),
        LookupResult::Hit,
        "a slot nobody wrote became readable"
    );
    held.open();
    fx.m.wait_idle().await;
    assert_eq!(fx.cpu.lookup(&k), LookupResult::Miss);
    // and the engine can store it for real now
    engine_store(&fx.m, other.id, &[k]);
    assert_dram_bytes(&fx.cpu, &[k]);
}

/// When DRAM has no other room, a promotion is refused (Miss) rather than evicting a block the
/// same lookup already answered Hit for. (Found by serve_sim's test under CI load.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_dram_refuses_a_promotion_rather_than_evict_a_hit_of_the_same_lookup() {
    let t = mem("fs");
    let (k0, k1, k2, k3) = (test_key(0), test_key(1), test_key(2), test_key(3));
    seed(&*t, &[k2, k3]).await;
    let fx = evented_manager(3, vec![t.clone()]).await;
    engine_store(&fx.m, RequestId(1), &[k0]);
    engine_store(&fx.m, RequestId(1), &[k1]);
    fx.m.wait_idle().await;
    let req = RequestContext::new(2);
    let prefix = [k0, k1, k2, k3];
    assert_eq!(
        fx.m.lookup_many(&prefix, &req),
        vec![
            LookupResult::Hit,
            LookupResult::Hit,
            LookupResult::Retry,
            LookupResult::Retry
        ]
    );
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    // one free slot: k2 gets it; k3 would have to evict k0 or k1
    let r = fx.m.lookup_many(&prefix, &req);
    assert_eq!(
        r,
        vec![
            LookupResult::Hit,
            LookupResult::Hit,
            LookupResult::HitPending,
            LookupResult::Miss
        ]
    );
    assert!(
        fx.m.prepare_load(&[k0, k1]).is_ok(),
        "a block answered Hit was evicted"
    );
    assert_eq!(fx.m.stats().promotions_refused, 1);
}

/// A key a tier has, with no DRAM slot to promote it into: `Miss`, counted as a miss and as a
/// refused promotion.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promotion_without_dram_room_is_a_counted_miss() {
    let inner = Arc::new(MemoryTier::new("m", BS));
    let k = test_key(1);
    seed(&*inner, &[k]).await;
    let (m, _cpu) = manager_and_dram(1, inner.clone()).await;
    let pinned = test_key(2);
    engine_store(&m, RequestId(9), &[pinned]);
    bounded("wait_idle", m.wait_idle()).await;
    let view = m.prepare_load(&[pinned]).unwrap(); // the only slot, pinned by a reader
    let req = RequestContext::new(1);
    assert_eq!(m.lookup(&k, &req), LookupResult::Retry);
    m.on_schedule_end();
    bounded("wait_idle", m.wait_idle()).await;
    assert_eq!(m.lookup(&k, &req), LookupResult::Miss);
    let s = m.stats();
    assert_eq!((s.promotions_refused, s.misses), (1, 1));
    drop(view);
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
    let (a, b) = (test_key(1), test_key(2));
    store_evicting(&m, 1, &[b]);
    block_on_idle(&m);
    store_evicting(&m, 1, &[a]); // evicts b from DRAM; b is in fs
    block_on_idle(&m);
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
        block_on_idle(&m);
    }
    assert_eq!(last, vec![LookupResult::Hit, LookupResult::Miss]);
    assert!(is_hit(&m, &a), "the promotion evicted the prefix's Hit");
    assert!(m.stats().promotions_refused >= 1, "{:?}", m.stats());
    m.on_request_finished(req.id);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/tier.rs, `PreparedStore::present`: "Keys already present (or
/// being written, which may yet fail): nothing to do for them"; README "never returns a wrong
/// or torn block"; `Hit`: "In DRAM and readable now"). The engine stores a key whose
/// promotion is in flight: the key is not `Hit` before the load lands, and when it is, its
/// bytes are the block's; a load that then fails never leaves a readable unfilled slot.
#[test]
fn an_engine_store_of_a_key_being_promoted_never_serves_unfilled_bytes() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let (k, k2) = (test_key(221), test_key(222));
    assert!(rt.block_on(store_keys(&*mem, &[k, k2], 0, BS)).is_success());
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    for (key, fail) in [(k, false), (k2, true)] {
        let loads = faulty.hold_loads();
        if fail {
            faulty.fail_load(&[key]);
        }
        let r = ctx(1 + fail as u64);
        assert_eq!(m.lookup(&key, &r), Retry);
        m.on_schedule_end();
        block_on_idle(&m);
        assert_eq!(m.lookup(&key, &r), HitPending);
        m.on_schedule_end();
        block_on(&m, async {
            tokio::time::timeout(SETTLE_LIMIT, loads.wait_arrived(1)).await
        })
        .unwrap();
        // the engine recomputed the block and offloads it: its slot is the promotion's
        let mut p = m.prepare_store(&[key]).unwrap();
        assert!(
            p.keys().is_empty(),
            "a second slot for a key being promoted"
        );
        for (kk, s) in p.slots() {
            fill_block(kk, 0, s.as_mut_slice());
        }
        p.commit(RequestId(100));
        m.on_schedule_end();
        let v = m.lookup(&key, &ctx(50));
        assert_ne!(v, Hit, "Hit before the promotion's load ran");
        assert!(
            m.prepare_load(&[key]).is_err(),
            "an unfilled slot was readable"
        );
        m.on_schedule_end();
        loads.open();
        block_on_idle(&m);
        let (end, seen) = settle_lookup(&m, &key, &r, SETTLE_LIMIT);
        if fail {
            assert_eq!(end, Miss, "{seen:?}");
            assert!(
                m.prepare_load(&[key]).is_err(),
                "a failed load left a readable slot"
            );
        } else {
            assert_eq!(end, Hit, "{seen:?}");
            load_verify(&m, &[key]);
        }
        m.on_schedule_end();
        m.on_request_finished(r.id);
        m.on_request_finished(RequestId(50));
        m.on_request_finished(RequestId(100));
        faulty.heal();
    }
    assert_nothing_left(&m, &[k, k2]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/mod.rs, `lookup_prefix`: "A promotion's DRAM
/// reservation never evicts a block this call has already answered `Hit` for"; `lookup_many`:
/// "When nothing else can make room, the promotion is refused and that key is a `Miss`").
/// DRAM holds the prefix's first blocks as its least recent ones; the promotions of the rest
/// evict others, never them; with no other room, the promotion is refused as a `Miss` and
/// the hits stay loadable.
#[test]
fn promotion_reservations_never_evict_this_calls_hits() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let prefix: Vec<BlockKey> = (0..4).map(|i| test_key(250 + i)).collect();
    assert!(rt.block_on(store_keys(&*mem, &prefix, 0, BS)).is_success());
    // 4 slots: prefix[0..2] in DRAM, least recent, then two junk blocks
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    engine_store(&m, RequestId(1), &prefix[..2]);
    engine_store(&m, RequestId(1), &[test_key(258), test_key(259)]);
    m.on_request_finished(RequestId(1));
    block_on_jobs(&m);
    let r = ctx(2);
    let t0 = Instant::now();
    loop {
        let found = m.lookup_prefix(&prefix, &r);
        assert!(found.hit >= 2, "this call's hits were evicted: {found:?}");
        load_verify(&m, &prefix[..found.hit]);
        m.on_schedule_end();
        if found.hit == 4 {
            break;
        }
        assert!(t0.elapsed() < SETTLE_LIMIT, "{found:?}");
        // the scheduler's next step (the checks hold at every step)
        std::thread::sleep(Duration::from_millis(3));
    }
    m.on_schedule_end();
    m.on_request_finished(r.id);
    // 2 slots, both the prefix's: the third block has no room
    let m2 = build_with(mcfg(2, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    engine_store(&m2, RequestId(1), &prefix[..2]);
    m2.on_request_finished(RequestId(1));
    block_on_jobs(&m2);
    let r = ctx(3);
    let t0 = Instant::now();
    loop {
        let v = m2.lookup_many(&prefix[..3], &r);
        assert_eq!(&v[..2], &[Hit, Hit], "{v:?}");
        load_verify(&m2, &prefix[..2]);
        m2.on_schedule_end();
        if v[2] == Miss {
            break;
        }
        assert_ne!(v[2], Hit);
        assert!(t0.elapsed() < SETTLE_LIMIT, "{v:?}");
        // the scheduler's next step (the checks hold at every step)
        std::thread::sleep(Duration::from_millis(3));
    }
    assert!(m2.stats().promotions_refused >= 1);
    m2.on_schedule_end();
    m2.on_request_finished(r.id);
    assert_nothing_left(&m2, &prefix);
    assert_nothing_left(&m, &prefix);
    m2.shutdown_blocking().unwrap();
    m.shutdown_blocking().unwrap();
}

/// The engine computes a block that a promotion is bringing in: `prepare_store` calls it
/// `present` ("nothing to do"). If that promotion then fails, the key misses (as
/// `PendingStore::present` says: the block is computed again), never a wrong or torn block,
/// and a new store of it lands.
#[test]
fn a_store_answered_present_because_of_a_promotion_that_then_fails() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build_with(dram_cfg(8, BS, ""), vec![f.clone()]);
    let k = test_key(1);
    let r = m.runtime().block_on(store_keys(&**f.inner(), &[k], 0, BS));
    assert!(r.is_success());
    let gate = f.hold_loads();
    f.fail_load(&[k]);
    let r1 = RequestContext::new(1);
    assert_eq!(m.lookup(&k, &r1), LookupResult::Retry);
    step_and_wait(&m);
    assert_eq!(m.lookup(&k, &r1), LookupResult::HitPending);
    m.on_schedule_end();
    m.runtime().block_on(gate.wait_arrived(1));
    // request 2 recomputed the block and offloads it
    let mut p = m.prepare_store(&[k]).unwrap();
    let written = p.keys().len();
    let present = p.present().to_vec();
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    p.commit(RequestId(2));
    gate.open();
    block_on_idle(&m);
    let r3 = RequestContext::new(3);
    let v = settle_lookup(&m, &k, &r3, Duration::from_secs(30)).0;
    assert_eq!(written, 0, "the key was being promoted: nothing to write");
    assert_eq!(present, vec![k], "answered present while its promotion ran");
    assert_eq!(
        v,
        LookupResult::Miss,
        "the promotion failed: the key must miss, not hang or be served"
    );
    // computed again: the new store lands and is served whole
    let mut p = m.prepare_store(&[k]).unwrap();
    assert_eq!(p.keys(), vec![k]);
    for (key, s) in p.slots() {
        fill_block(key, 0, s.as_mut_slice());
    }
    p.commit(RequestId(3));
    block_on_idle(&m);
    let r4 = RequestContext::new(4);
    assert_eq!(
        settle_lookup(&m, &k, &r4, Duration::from_secs(30)).0,
        LookupResult::Hit
    );
    m.on_schedule_end();
    for r in 1..=4 {
        m.on_request_finished(RequestId(r));
    }
    f.heal();
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// DRAM entirely pinned by the engine's views: a promotion is refused as a `Miss` (counted),
/// never a hang; once the views go, the block is promoted.
#[test]
fn promotions_into_a_fully_pinned_dram_are_refused_then_work() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(2, BS, ""), vec![t.clone()]);
    let k = test_key(1);
    put(&m, &t, &[k]);
    let pinned = [test_key(10), test_key(11)];
    engine_store(&m, RequestId(9), &pinned);
    let views = m.prepare_load(&pinned).unwrap();
    let r1 = RequestContext::new(1);
    assert_eq!(
        settle_lookup(&m, &k, &r1, Duration::from_secs(30)).0,
        LookupResult::Miss
    );
    assert!(m.stats().promotions_refused >= 1);
    drop(views);
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    let r2 = RequestContext::new(2);
    assert_eq!(
        settle_lookup(&m, &k, &r2, Duration::from_secs(30)).0,
        LookupResult::Hit
    );
    assert!(load_and_verify(&m, &[k]));
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    m.on_request_finished(RequestId(9));
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
