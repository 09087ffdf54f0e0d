//! The promotion hold: a promoted block is held in DRAM for its request until the request reads it,
//! its prefix stops before it, or it finishes; nothing is left held or pinned once requests end,
//! whatever failed or was cancelled; a random model check of who holds what.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use LookupResult::{Hit, HitPending, Miss, Retry};
use kv_tier_core::{BlockKey, Error, LookupResult, PrimaryTier, RequestContext, RequestId};
use kv_tier_testkit::util::try_engine_store;
use kv_tier_testkit::{FaultyTier, MemoryTier, fill_block, store_keys, test_key, verify_block};

use crate::support::*;

// the basic contract
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_block_is_not_evicted_before_its_request_reads_it() {
    let fx = hold_fx(&[test_key(1)]).await;
    let req = RequestContext::new(1);
    promote(&fx, &req).await;
    // another request wants all of DRAM: the held block is not a victim, so the store is
    // refused (three free slots for four blocks)
    let err = try_engine_store(&fx.m, RequestId(2), &fillers(SLOTS)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::CapacityExhausted {
                needed: 4,
                evictable: 3,
                ..
            }
        ),
        "{err}"
    );
    // three fit beside it
    try_engine_store(&fx.m, RequestId(2), &fillers(SLOTS - 1)).unwrap();
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    // the request's next step reads it
    assert_eq!(fx.m.lookup(&test_key(1), &req), LookupResult::Hit);
    // held to the end of that step (the engine's prepare_load comes after its lookup)
    assert_eq!(fx.m.stats().held_blocks, 1);
    assert!(try_engine_store(&fx.m, RequestId(3), &fillers(SLOTS)).is_err());
    let views = fx.m.prepare_load(&[test_key(1)]).unwrap();
    assert!(verify_block(&test_key(1), 0, views[0].as_slice()));
    drop(views);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 0);
    // read and the step over: an ordinary block again, the least recently used one
    try_engine_store(&fx.m, RequestId(3), &fillers(SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&test_key(1)), LookupResult::Miss, "evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_requests_hit_does_not_release_the_hold() {
    let fx = hold_fx(&[test_key(1)]).await;
    let req = RequestContext::new(1);
    promote(&fx, &req).await;
    let other = RequestContext::new(2);
    assert_eq!(fx.m.lookup(&test_key(1), &other), LookupResult::Hit);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 1, "held for request 1, not 2");
    assert!(try_engine_store(&fx.m, RequestId(3), &fillers(SLOTS)).is_err());
    assert_eq!(fx.m.lookup(&test_key(1), &req), LookupResult::Hit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_request_holds_nothing() {
    // finished after the promotion landed
    let fx = hold_fx(&[test_key(1)]).await;
    let req = RequestContext::new(1);
    promote(&fx, &req).await;
    fx.m.on_request_finished(req.id);
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&test_key(1)), LookupResult::Miss, "evicted");

    // finished while the promotion was in flight: it lands for others, held for no one
    let fx = hold_fx(&[test_key(1)]).await;
    assert_eq!(fx.m.lookup(&test_key(1), &req), LookupResult::Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&test_key(1), &req), LookupResult::HitPending);
    fx.m.on_schedule_end(); // the load job is sent
    fx.m.on_request_finished(req.id);
    fx.m.wait_idle().await;
    assert_eq!(fx.cpu.lookup(&test_key(1)), LookupResult::Hit, "landed");
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&test_key(1)), LookupResult::Miss, "evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_cache_and_shutdown_release_holds() {
    let fx = hold_fx(&[test_key(1)]).await;
    let req = RequestContext::new(1);
    promote(&fx, &req).await;
    assert_eq!(fx.m.reset_cache().await, 0, "no block kept by a hold");
    assert_eq!(fx.cpu.lookup(&test_key(1)), LookupResult::Miss);
    assert_eq!(fx.m.stats().held_blocks, 0);

    let fx = hold_fx(&[test_key(1)]).await;
    promote(&fx, &req).await;
    fx.m.shutdown().await.unwrap();
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&test_key(1)), LookupResult::Miss, "evicted");
}

// nothing left behind
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_finish_while_queued() {
    let fx = hold_fx(&[test_key(1), test_key(2)]).await;
    let r = RequestContext::new(1);
    assert_eq!(
        fx.step(&[test_key(1), test_key(2)], &r).await,
        vec![Retry, Retry]
    );
    assert_eq!(
        fx.m.lookup_many(&[test_key(1), test_key(2)], &r),
        vec![HitPending, HitPending]
    );
    fx.m.on_request_finished(r.id); // queued, not sent
    fx.assert_clean("finished while queued").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_finish_while_in_flight_gated() {
    let fx = hold_fx(&[test_key(1), test_key(2)]).await;
    let r = RequestContext::new(1);
    assert_eq!(
        fx.step(&[test_key(1), test_key(2)], &r).await,
        vec![Retry, Retry]
    );
    let gate = fx.ft.hold_loads();
    assert_eq!(
        fx.m.lookup_many(&[test_key(1), test_key(2)], &r),
        vec![HitPending, HitPending]
    );
    fx.m.on_schedule_end();
    gate.wait_arrived(1).await;
    fx.m.on_request_finished(r.id);
    // poll / is_idle while in flight
    fx.m.poll();
    assert!(!fx.m.is_idle());
    gate.open();
    fx.assert_clean("finished while in flight").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_finish_when_result_in_inbox_mid_step() {
    // the job has reported but the step already began (no drain): finish then
    let fx = hold_fx(&[test_key(1)]).await;
    let r = RequestContext::new(1);
    fx.step(&[test_key(1)], &r).await;
    let gate = fx.ft.hold_load_results();
    assert_eq!(fx.m.lookup(&test_key(1), &r), HitPending);
    fx.m.on_schedule_end();
    gate.wait_arrived(1).await;
    // begin a step (drains nothing yet)
    assert_eq!(fx.m.lookup(&test_key(7), &RequestContext::new(5)), Retry);
    gate.open();
    // time for the load result to reach the inbox (no call shows it unapplied)
    tokio::time::sleep(Duration::from_millis(50)).await;
    fx.m.on_request_finished(r.id);
    fx.m.on_request_finished(RequestId(5));
    fx.assert_clean("finished with result in inbox").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_id_reused_after_finish() {
    let fx = hold_fx(&[test_key(1), test_key(2)]).await;
    let r = RequestContext::new(1);
    fx.step(&[test_key(1)], &r).await;
    let gate = fx.ft.hold_loads();
    assert_eq!(fx.m.lookup(&test_key(1), &r), HitPending);
    fx.m.on_schedule_end();
    gate.wait_arrived(1).await;
    fx.m.on_request_finished(r.id);
    // same id, new request
    assert_eq!(fx.m.lookup(&test_key(1), &r), HitPending);
    assert_eq!(fx.m.lookup(&test_key(2), &r), Retry);
    fx.m.on_schedule_end();
    gate.open();
    fx.m.wait_idle().await;
    assert_eq!(
        fx.step(&[test_key(1), test_key(2)], &r).await,
        vec![Hit, HitPending]
    );
    fx.m.on_request_finished(r.id);
    fx.assert_clean("id reused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_two_requests_same_key() {
    let fx = hold_fx(&[test_key(1)]).await;
    let a = RequestContext::new(1);
    let b = RequestContext::new(2);
    assert_eq!(fx.m.lookup(&test_key(1), &a), Retry);
    assert_eq!(fx.m.lookup(&test_key(1), &b), Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&test_key(1), &b), HitPending);
    assert_eq!(fx.m.lookup(&test_key(1), &a), HitPending);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.stats().held_blocks, 1);
    assert_eq!(fx.m.lookup(&test_key(1), &a), Hit);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 1, "held for b");
    fx.m.on_request_finished(a.id);
    fx.m.on_request_finished(b.id);
    fx.assert_clean("two requests").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_partial_and_total_load_failures_and_panic() {
    let fx = hold_fx(&[test_key(1), test_key(2), test_key(3)]).await;
    let r = RequestContext::new(1);
    fx.ft.fail_load(&[test_key(2)]);
    fx.step(&[test_key(1), test_key(2), test_key(3)], &r).await;
    assert_eq!(
        fx.step(&[test_key(1), test_key(2), test_key(3)], &r).await,
        vec![HitPending; 3]
    );
    let after =
        fx.m.lookup_many(&[test_key(1), test_key(2), test_key(3)], &r);
    assert_eq!(after, vec![Hit, Miss]);
    fx.m.on_schedule_end();
    fx.m.on_request_finished(r.id);
    fx.assert_clean("partial failure").await;

    let fx = hold_fx_with(|_| {}, &[test_key(1), test_key(2)]).await;
    fx.ft.panic_on_load(true);
    fx.step(&[test_key(1), test_key(2)], &r).await;
    fx.step(&[test_key(1), test_key(2)], &r).await;
    assert_eq!(fx.m.stats().held_blocks, 0);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("panic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_job_timeout() {
    let fx = hold_fx_with(
        |c| {
            c.job_timeout_s = 0.05;
            c.job_timeout_per_block_s = 0.0;
        },
        &[test_key(1), test_key(2)],
    )
    .await;
    let r = RequestContext::new(1);
    fx.step(&[test_key(1), test_key(2)], &r).await;
    let _gate = fx.ft.hold_loads(); // never opened
    assert_eq!(
        fx.step(&[test_key(1), test_key(2)], &r).await,
        vec![HitPending, HitPending]
    );
    assert_eq!(fx.m.stats().tiers[0].jobs_timed_out, 1);
    assert_eq!(fx.m.stats().held_blocks, 0);
    fx.m.on_request_finished(r.id);
    fx.ft.heal();
    fx.assert_clean("timeout").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_reset_cache_while_in_flight() {
    let fx = Arc::new(hold_fx(&[test_key(1), test_key(2)]).await);
    let r = RequestContext::new(1);
    fx.step(&[test_key(1), test_key(2)], &r).await;
    let gate = fx.ft.hold_loads();
    assert_eq!(
        fx.m.lookup_many(&[test_key(1), test_key(2)], &r),
        vec![HitPending, HitPending]
    );
    fx.m.on_schedule_end();
    gate.wait_arrived(1).await;
    let f2 = fx.clone();
    let h = tokio::spawn(async move { f2.m.reset_cache().await });
    // time for reset_cache to start waiting on the load in flight
    tokio::time::sleep(Duration::from_millis(20)).await;
    gate.open();
    assert_eq!(h.await.unwrap(), 0);
    assert_eq!(fx.m.stats().held_blocks, 0);
    // request still alive: lookups promote again
    assert_eq!(fx.m.lookup(&test_key(1), &r), Retry);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("reset while in flight").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_shutdown_then_calls() {
    let fx = hold_fx(&[test_key(1), test_key(2)]).await;
    let r = RequestContext::new(1);
    fx.step(&[test_key(1), test_key(2)], &r).await;
    assert_eq!(
        fx.m.lookup_many(&[test_key(1), test_key(2)], &r),
        vec![HitPending, HitPending]
    );
    fx.m.on_schedule_end();
    fx.m.shutdown().await.unwrap();
    assert_eq!(fx.m.stats().held_blocks, 0);
    let r2 = RequestContext::new(2);
    assert_eq!(
        fx.m.lookup_many(&[test_key(1), test_key(2)], &r2),
        vec![Hit, Hit]
    );
    assert_eq!(fx.m.lookup(&test_key(3), &r2), Miss);
    fx.m.on_schedule_end();
    fx.m.on_schedule_end();
    fx.m.on_request_finished(r.id);
    fx.m.on_request_finished(r2.id);
    fx.m.on_request_finished(r2.id);
    assert_eq!(fx.m.reset_cache().await, 0);
    fx.m.shutdown().await.unwrap();
    fx.assert_clean("after shutdown").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_tier_filter_and_double_schedule_end() {
    let fx = hold_fx(&[test_key(1), test_key(2)]).await;
    let r = RequestContext::new(1).skip_tiers(["fs"]);
    assert_eq!(fx.step(&[test_key(1)], &r).await, vec![Miss]);
    let r2 = RequestContext::new(2).only_tiers(["fs"]);
    fx.step(&[test_key(1), test_key(2)], &r2).await;
    fx.step(&[test_key(1), test_key(2)], &r2).await;
    // r (not allowed the tier) reads the block r2 promoted: a Hit, but r2 still holds
    assert_eq!(fx.m.lookup(&test_key(1), &r), Hit);
    fx.m.on_schedule_end();
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 2);
    assert_eq!(
        fx.m.lookup_many(&[test_key(1), test_key(2)], &r2),
        vec![Hit, Hit]
    );
    fx.m.on_schedule_end();
    assert_eq!(
        fx.m.stats().held_blocks,
        2,
        "hits not read keep their holds"
    );
    assert_eq!(
        fx.m.lookup_many(&[test_key(1), test_key(2)], &r2),
        vec![Hit, Hit]
    );
    drop(fx.m.prepare_load(&[test_key(1), test_key(2)]).unwrap());
    fx.m.on_schedule_end();
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 0);
    fx.m.on_request_finished(r.id);
    fx.m.on_request_finished(r2.id);
    fx.assert_clean("filters").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_lookups_without_schedule_end() {
    // a Hit read with no step end yet: finishing releases the hold at once
    let fx = hold_fx(&[test_key(1)]).await;
    let r = RequestContext::new(1);
    fx.step(&[test_key(1)], &r).await;
    fx.step(&[test_key(1)], &r).await;
    assert_eq!(fx.m.lookup(&test_key(1), &r), Hit);
    drop(fx.m.prepare_load(&[test_key(1)]).unwrap());
    assert_eq!(fx.m.stats().held_blocks, 1, "released when the step ends");
    fx.m.on_request_finished(r.id);
    fx.m.wait_idle().await;
    fx.m.poll();
    assert!(fx.m.is_idle());
    assert_eq!(fx.m.stats().held_blocks, 0);
    fx.assert_clean("no schedule end").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_correct_after_hold_and_repeated_cycles() {
    let keys: Vec<BlockKey> = (1..=3).map(test_key).collect();
    let fx = hold_fx(&keys).await;
    for round in 0..5u64 {
        let r = RequestContext::new(100 + round);
        fx.step(&keys, &r).await;
        assert_eq!(
            fx.step(&keys, &r).await,
            vec![HitPending; 3],
            "round {round}"
        );
        // pressure: only one slot is free and it is taken
        assert!(try_engine_store(&fx.m, RequestId(50), &fillers(SLOTS)).is_err());
        try_engine_store(&fx.m, RequestId(50), &fillers(1)).unwrap();
        assert_eq!(fx.m.lookup_many(&keys, &r), vec![Hit; 3]);
        let views = fx.m.prepare_load(&keys).unwrap();
        for (kk, v) in keys.iter().zip(&views) {
            assert!(verify_block(kk, 0, v.as_slice()));
        }
        drop(views);
        fx.m.on_schedule_end();
        fx.m.on_request_finished(r.id);
        fx.m.on_request_finished(RequestId(50));
        fx.assert_clean("cycle").await; // evicts all three
    }
    let _ = &fx.mem;
    let _ = fx.cpu.lookup(&test_key(1));
}

// a hold lasts while its request can still read the block, and no longer
/// A load job with one failed key: the keys after it land, but the request's prefix now stops
/// at the failed key (Miss), so its lookups never reach them: not held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partly_failed_promotion_holds_nothing_past_the_miss() {
    let keys: Vec<BlockKey> = (1..=4).map(test_key).collect();
    let fx = hold_fx(&keys).await;
    fx.ft.fail_load(&[test_key(1)]);
    let r = RequestContext::new(1);
    fx.step(&keys, &r).await;
    assert_eq!(fx.step(&keys, &r).await, vec![HitPending; 4]);
    // the engine asks again: the prefix stops at the first key
    assert_eq!(fx.step(&keys, &r).await, vec![Miss]);
    // the request runs (recomputes the prefix, decodes) for many steps; nobody else can use
    // DRAM meanwhile:
    for _ in 0..10 {
        fx.m.on_schedule_end();
    }
    let held = fx.m.stats().held_blocks;
    let store = try_engine_store(&fx.m, RequestId(2), &fillers(2));
    // the request's own offload of its recomputed prefix also cannot take those slots
    assert_eq!(
        held, 0,
        "{held} blocks held that request 1 can never read; store of 2 fresh blocks: {store:?}"
    );
}

/// A key already known present is promoted right away, while an earlier key of the prefix is
/// still Retry; when that earlier key then answers Miss, the later ones are not held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_later_key_is_not_held_once_an_earlier_key_misses() {
    let fx = hold_fx(&[test_key(2), test_key(3), test_key(4)]).await; // k(1) is in no tier
    // another request's probe found k2..k4 (it then went away without reading them... or is
    // still waiting; here it is just another request)
    let other = RequestContext::new(7);
    fx.step(&[test_key(2), test_key(3), test_key(4)], &other)
        .await;
    let r = RequestContext::new(1);
    // k1 unknown -> Retry; k2..k4 known present -> promoted for r
    assert_eq!(
        fx.step(&[test_key(1), test_key(2), test_key(3), test_key(4)], &r)
            .await,
        vec![Retry, HitPending, HitPending, HitPending]
    );
    fx.m.on_request_finished(other.id);
    assert_eq!(
        fx.step(&[test_key(1), test_key(2), test_key(3), test_key(4)], &r)
            .await,
        vec![Miss]
    );
    let held = fx.m.stats().held_blocks;
    let store = try_engine_store(&fx.m, RequestId(2), &fillers(2));
    assert_eq!(
        held, 0,
        "{held} blocks held for r that r's prefix lookups never reach; store: {store:?}"
    );
}

/// An engine that looks a request up but cannot schedule it this step (vLLM: allocate_slots
/// fails, the request stays waiting) does not read its hits: the hold stays, so under DRAM
/// pressure the request does not promote its prefix again and again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hit_the_engine_did_not_read_keeps_the_hold() {
    let keys: Vec<BlockKey> = (1..=3).map(test_key).collect();
    let fx = hold_fx(&keys).await;
    let r = RequestContext::new(1);
    let mut promotions = 0;
    for step in 0..9 {
        let v = fx.m.lookup_many(&keys, &r);
        if v.contains(&HitPending) {
            promotions += 1;
        }
        // Hit for all: the engine tries to schedule, GPU has no room, does not call
        // prepare_load this step
        fx.m.on_schedule_end();
        fx.m.wait_idle().await;
        // other requests' offloads fill DRAM between steps
        let _ = try_engine_store(&fx.m, RequestId(50 + step), &fillers(SLOTS));
        fx.m.on_request_finished(RequestId(50 + step));
        fx.m.wait_idle().await; // their cascades end before the next step
    }
    let ts = fx.m.stats().tiers[0].blocks_loaded;
    assert!(
        promotions <= 1,
        "promoted {promotions} times ({ts} blocks loaded) without ever reading"
    );
}

/// A request told HitPending because another request's promotion is bringing the key in is
/// held for too: the promoting request finishing (abort) before the load lands changes
/// nothing for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_riding_on_anothers_promotion_is_held_for_too() {
    let fx = hold_fx(&[test_key(1)]).await;
    let a = RequestContext::new(1);
    let b = RequestContext::new(2);
    assert_eq!(fx.m.lookup(&test_key(1), &a), Retry);
    assert_eq!(fx.m.lookup(&test_key(1), &b), Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&test_key(1), &a), HitPending); // reserves, holds for a
    assert_eq!(fx.m.lookup(&test_key(1), &b), HitPending); // piggybacks
    fx.m.on_schedule_end();
    fx.m.on_request_finished(a.id); // a aborted while the load is in flight
    fx.m.wait_idle().await;
    let held = fx.m.stats().held_blocks;
    let _ = try_engine_store(&fx.m, RequestId(3), &fillers(SLOTS));
    let v = fx.m.lookup(&test_key(1), &b);
    assert_eq!(
        v, Hit,
        "b was told HitPending, held_blocks={held}; after pressure b gets {v:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzz_model() {
    for seed in 1..300 {
        fuzz_one(seed, false).await;
        fuzz_one(seed, true).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fuzz_timing() {
    for seed in 1..200 {
        fuzz_inner(seed, seed % 2 == 0, false).await;
    }
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
    let b = test_key(2);
    store_evicting(&m, 1, &[b]);
    block_on_idle(&m);
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
        block_on_idle(&m);
    }
    assert!(got_hit, "never promoted");
    m.on_schedule_end();
    // the request has not read it: it is held
    assert_eq!(m.stats().held_blocks, 1, "{:?}", m.stats());
    for i in 0..10u64 {
        let keys = [test_key(100 + 2 * i), test_key(101 + 2 * i)];
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
        block_on_idle(&m);
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
        let keys = [test_key(1), test_key(2)];
        store_evicting(&m, 1, &keys);
        block_on_idle(&m);
        m.runtime().block_on(m.reset_cache());
        let mut replica = HashSet::new();
        replay_dram(&m.take_events(), &mut replica, phase);
        let req = RequestContext::new(4);
        m.lookup_many(&keys, &req);
        m.on_schedule_end();
        wait_until(&format!("{phase}: HitPending"), SETTLE_LIMIT, || {
            m.runtime().block_on(m.wait_jobs());
            m.poll();
            m.lookup_many(&keys, &req)
                .iter()
                .all(|v| *v == LookupResult::HitPending)
        });
        if phase == "in flight" {
            m.on_schedule_end();
        }
        m.on_request_finished(req.id);
        m.on_schedule_end();
        block_on_idle(&m);
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
        let ev = store_evicting(
            &m,
            9,
            &[test_key(10), test_key(11), test_key(12), test_key(13)],
        );
        assert_eq!(ev.len(), st.primary.ready_blocks, "{phase}");
        replay_dram(&m.take_events(), &mut replica, phase);
        let mut want: HashSet<_> = (10..14).map(test_key).collect();
        want.retain(|kk| is_hit(&m, kk));
        assert_eq!(replica, want, "{phase}");
        m.shutdown_blocking().unwrap();
    }
}

/// Promise (kv-tier-core/src/manager/mod.rs, `lookup`): the promoted block "is then held in
/// DRAM for `req` ... until `req` reads it ..., its prefix stops before it ..., or `req`
/// finishes"; ARCHITECTURE.md: "promotions already in flight land for others". The promoting
/// request finishes while its load is in flight; a joiner still gets its `Hit`; when every
/// asker finished mid-promotion, the landed block is held for nobody.
#[test]
fn requests_finishing_mid_promotion_strand_nothing() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let (k, k2) = (test_key(91), test_key(92));
    assert!(rt.block_on(store_keys(&*mem, &[k, k2], 0, BS)).is_success());
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let gate = faulty.hold_loads();
    let (r1, r2) = (ctx(1), ctx(2));
    assert_eq!(m.lookup(&k, &r1), Retry);
    m.on_schedule_end();
    block_on_idle(&m);
    assert_eq!(m.lookup(&k, &r1), HitPending);
    m.on_schedule_end(); // the load goes out, and waits at the gate
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    assert_eq!(m.lookup(&k, &r2), HitPending, "a joiner");
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    gate.open();
    let (end, seen) = settle_lookup(&m, &k, &r2, SETTLE_LIMIT);
    assert_eq!(end, Hit, "the joiner was stranded: {seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    // every asker gone mid-promotion
    let gate = faulty.hold_loads();
    let r3 = ctx(3);
    assert_eq!(m.lookup(&k2, &r3), Retry);
    m.on_schedule_end();
    block_on_idle(&m);
    assert_eq!(m.lookup(&k2, &r3), HitPending);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    m.on_request_finished(r3.id);
    gate.open();
    assert_nothing_left(&m, &[k, k2]);
    m.shutdown_blocking().unwrap();
}

/// A request aborted while its promotion's load is in flight: the block lands, nothing is
/// held for the dead request.
#[test]
fn a_request_aborted_mid_load_holds_nothing() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build_with(dram_cfg(4, BS, ""), vec![f.clone()]);
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    let r = m.runtime().block_on(store_keys(&**f.inner(), &keys, 0, BS));
    assert!(r.is_success());
    let gate = f.hold_loads();
    let req = RequestContext::new(1);
    m.lookup_many(&keys, &req);
    step_and_wait(&m);
    let v = m.lookup_many(&keys, &req);
    assert!(v.iter().all(|x| *x == LookupResult::HitPending), "{v:?}");
    m.on_schedule_end();
    m.runtime().block_on(gate.wait_arrived(1));
    m.on_request_finished(req.id);
    m.on_request_finished(req.id); // twice
    m.on_request_finished(RequestId(12345)); // never started
    gate.open();
    assert_clean(&m);
    // the landed blocks are right
    let r2 = RequestContext::new(2);
    let v = m.lookup_many(&keys, &r2);
    for (k, x) in keys.iter().zip(&v) {
        if *x == LookupResult::Hit {
            assert!(load_and_verify(&m, &[*k]));
        }
    }
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
