//! The promotion hold (found by the seeded simulation: under DRAM pressure a request promoted
//! its prefix again and again and never read it), through the public API only: the basic
//! contract; then cases written first by an adversarial review of
//! its first version): nothing is left held or pinned once requests end, whatever failed or
//! was cancelled; a hold lasts exactly while its request can still read the block; a random
//! model check of who holds what.

use std::sync::Arc;
use std::time::Duration;

use LookupResult::*;
use kv_tier_core::{
    BlockKey, Error, EvictionPolicy, KvTierConfig, LookupResult, PrimaryTier, RequestContext,
    RequestId, SecondaryTier, StoreJob, TieringManager,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::util::{test_key_in_group, try_engine_store};
use kv_tier_testkit::{FaultyTier, MemoryTier, source_for, test_key, verify_block};

const BS: usize = 4096;
const SLOTS: usize = 4;

struct Fx {
    m: TieringManager,
    cpu: Arc<CpuTier>,
    ft: Arc<FaultyTier>,
    mem: Arc<MemoryTier>,
}

async fn fx_with(cfg: impl FnOnce(&mut KvTierConfig), seeded: &[BlockKey]) -> Fx {
    let mem = Arc::new(MemoryTier::new("fs", BS));
    if !seeded.is_empty() {
        let job = StoreJob {
            requests: Vec::new(),
            blocks: seeded.iter().map(|k| (*k, source_for(k, 0, BS))).collect(),
        };
        assert!(mem.store(job).await.is_success());
    }
    let ft = Arc::new(FaultyTier::new(mem.clone()));
    let cpu = Arc::new(
        CpuTier::new(CpuTierConfig {
            capacity_bytes: (SLOTS * BS) as u64,
            block_size: BS,
            policy: EvictionPolicy::Lru,
            prefault: true,
        })
        .unwrap(),
    );
    let mut c = KvTierConfig::new((SLOTS * BS) as u64, BS as u64);
    cfg(&mut c);
    let m = TieringManager::builder(c)
        .primary(cpu.clone())
        .tier(ft.clone())
        .build()
        .await
        .unwrap();
    Fx { m, cpu, ft, mem }
}

async fn fx(seeded: &[BlockKey]) -> Fx {
    fx_with(|_| {}, seeded).await
}

fn k(i: u64) -> BlockKey {
    test_key(i)
}

static NEXT_FILLER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
fn fillers(n: usize) -> Vec<BlockKey> {
    let base = NEXT_FILLER.fetch_add(1000, std::sync::atomic::Ordering::Relaxed);
    (0..n as u64)
        .map(|i| test_key_in_group(100_000 + base + i, 0))
        .collect()
}

impl Fx {
    /// One step: lookup_many then schedule end then wait.
    async fn step(&self, keys: &[BlockKey], req: &RequestContext) -> Vec<LookupResult> {
        let r = self.m.lookup_many(keys, req);
        self.m.on_schedule_end();
        self.m.wait_idle().await;
        r
    }

    /// Every request has finished: nothing held, nothing writing, DRAM fully usable.
    async fn assert_clean(&self, what: &str) {
        self.m.wait_idle().await;
        self.m.on_schedule_end();
        let s = self.m.stats();
        assert_eq!(s.held_blocks, 0, "{what}: held_blocks");
        assert_eq!(s.primary.writing_blocks, 0, "{what}: writing_blocks");
        let f = fillers(SLOTS);
        if let Err(e) = try_engine_store(&self.m, RequestId(9_999), &f) {
            panic!("{what}: DRAM not fully usable: {e}");
        }
        self.m.on_request_finished(RequestId(9_999));
        self.m.on_schedule_end();
        self.m.wait_idle().await;
    }
}

/// Probes `k(1)` for `req` and lets the promotion land: Ready in DRAM, not yet read.
async fn promote(fx: &Fx, req: &RequestContext) {
    assert_eq!(fx.m.lookup(&k(1), req), LookupResult::Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k(1), req), LookupResult::HitPending);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.cpu.lookup(&k(1)), LookupResult::Hit, "landed");
    assert_eq!(fx.m.stats().held_blocks, 1);
}

// ---------------------------------------------------------------------------------------------
// the basic contract
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_block_is_not_evicted_before_its_request_reads_it() {
    let fx = fx(&[k(1)]).await;
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
    assert_eq!(fx.m.lookup(&k(1), &req), LookupResult::Hit);
    // held to the end of that step (the engine's prepare_load comes after its lookup)
    assert_eq!(fx.m.stats().held_blocks, 1);
    assert!(try_engine_store(&fx.m, RequestId(3), &fillers(SLOTS)).is_err());
    let views = fx.m.prepare_load(&[k(1)]).unwrap();
    assert!(verify_block(&k(1), 0, views[0].as_slice()));
    drop(views);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 0);
    // read and the step over: an ordinary block again, the least recently used one
    try_engine_store(&fx.m, RequestId(3), &fillers(SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&k(1)), LookupResult::Miss, "evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_requests_hit_does_not_release_the_hold() {
    let fx = fx(&[k(1)]).await;
    let req = RequestContext::new(1);
    promote(&fx, &req).await;
    let other = RequestContext::new(2);
    assert_eq!(fx.m.lookup(&k(1), &other), LookupResult::Hit);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 1, "held for request 1, not 2");
    assert!(try_engine_store(&fx.m, RequestId(3), &fillers(SLOTS)).is_err());
    assert_eq!(fx.m.lookup(&k(1), &req), LookupResult::Hit);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_request_holds_nothing() {
    // finished after the promotion landed
    let fx = fx(&[k(1)]).await;
    let req = RequestContext::new(1);
    promote(&fx, &req).await;
    fx.m.on_request_finished(req.id);
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&k(1)), LookupResult::Miss, "evicted");

    // finished while the promotion was in flight: it lands for others, held for no one
    let fx = self::fx(&[k(1)]).await;
    assert_eq!(fx.m.lookup(&k(1), &req), LookupResult::Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k(1), &req), LookupResult::HitPending);
    fx.m.on_schedule_end(); // the load job is sent
    fx.m.on_request_finished(req.id);
    fx.m.wait_idle().await;
    assert_eq!(fx.cpu.lookup(&k(1)), LookupResult::Hit, "landed");
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&k(1)), LookupResult::Miss, "evicted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_cache_and_shutdown_release_holds() {
    let fx = fx(&[k(1)]).await;
    let req = RequestContext::new(1);
    promote(&fx, &req).await;
    assert_eq!(fx.m.reset_cache().await, 0, "no block kept by a hold");
    assert_eq!(fx.cpu.lookup(&k(1)), LookupResult::Miss);
    assert_eq!(fx.m.stats().held_blocks, 0);

    let fx = self::fx(&[k(1)]).await;
    promote(&fx, &req).await;
    fx.m.shutdown().await.unwrap();
    assert_eq!(fx.m.stats().held_blocks, 0);
    try_engine_store(&fx.m, RequestId(2), &fillers(SLOTS)).unwrap();
    assert_eq!(fx.cpu.lookup(&k(1)), LookupResult::Miss, "evicted");
}

// ---------------------------------------------------------------------------------------------
// nothing left behind
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_finish_while_queued() {
    let fx = fx(&[k(1), k(2)]).await;
    let r = RequestContext::new(1);
    assert_eq!(fx.step(&[k(1), k(2)], &r).await, vec![Retry, Retry]);
    assert_eq!(
        fx.m.lookup_many(&[k(1), k(2)], &r),
        vec![HitPending, HitPending]
    );
    fx.m.on_request_finished(r.id); // queued, not sent
    fx.assert_clean("finished while queued").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_finish_while_in_flight_gated() {
    let fx = fx(&[k(1), k(2)]).await;
    let r = RequestContext::new(1);
    assert_eq!(fx.step(&[k(1), k(2)], &r).await, vec![Retry, Retry]);
    let gate = fx.ft.hold_loads();
    assert_eq!(
        fx.m.lookup_many(&[k(1), k(2)], &r),
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
    let fx = fx(&[k(1)]).await;
    let r = RequestContext::new(1);
    fx.step(&[k(1)], &r).await;
    let gate = fx.ft.hold_load_results();
    assert_eq!(fx.m.lookup(&k(1), &r), HitPending);
    fx.m.on_schedule_end();
    gate.wait_arrived(1).await;
    // begin a step (drains nothing yet)
    assert_eq!(fx.m.lookup(&k(7), &RequestContext::new(5)), Retry);
    gate.open();
    tokio::time::sleep(Duration::from_millis(50)).await;
    fx.m.on_request_finished(r.id);
    fx.m.on_request_finished(RequestId(5));
    fx.assert_clean("finished with result in inbox").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_id_reused_after_finish() {
    let fx = fx(&[k(1), k(2)]).await;
    let r = RequestContext::new(1);
    fx.step(&[k(1)], &r).await;
    let gate = fx.ft.hold_loads();
    assert_eq!(fx.m.lookup(&k(1), &r), HitPending);
    fx.m.on_schedule_end();
    gate.wait_arrived(1).await;
    fx.m.on_request_finished(r.id);
    // same id, new request
    assert_eq!(fx.m.lookup(&k(1), &r), HitPending);
    assert_eq!(fx.m.lookup(&k(2), &r), Retry);
    fx.m.on_schedule_end();
    gate.open();
    fx.m.wait_idle().await;
    assert_eq!(fx.step(&[k(1), k(2)], &r).await, vec![Hit, HitPending]);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("id reused").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_two_requests_same_key() {
    let fx = fx(&[k(1)]).await;
    let a = RequestContext::new(1);
    let b = RequestContext::new(2);
    assert_eq!(fx.m.lookup(&k(1), &a), Retry);
    assert_eq!(fx.m.lookup(&k(1), &b), Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k(1), &b), HitPending);
    assert_eq!(fx.m.lookup(&k(1), &a), HitPending);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.stats().held_blocks, 1);
    assert_eq!(fx.m.lookup(&k(1), &a), Hit);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 1, "held for b");
    fx.m.on_request_finished(a.id);
    fx.m.on_request_finished(b.id);
    fx.assert_clean("two requests").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_partial_and_total_load_failures_and_panic() {
    let fx = fx(&[k(1), k(2), k(3)]).await;
    let r = RequestContext::new(1);
    fx.ft.fail_load(&[k(2)]);
    fx.step(&[k(1), k(2), k(3)], &r).await;
    assert_eq!(fx.step(&[k(1), k(2), k(3)], &r).await, vec![HitPending; 3]);
    let after = fx.m.lookup_many(&[k(1), k(2), k(3)], &r);
    assert_eq!(after, vec![Hit, Miss]);
    fx.m.on_schedule_end();
    fx.m.on_request_finished(r.id);
    fx.assert_clean("partial failure").await;

    let fx = fx_with(|_| {}, &[k(1), k(2)]).await;
    fx.ft.panic_on_load(true);
    fx.step(&[k(1), k(2)], &r).await;
    fx.step(&[k(1), k(2)], &r).await;
    assert_eq!(fx.m.stats().held_blocks, 0);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("panic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_job_timeout() {
    let fx = fx_with(
        |c| {
            c.job_timeout_s = 0.05;
            c.job_timeout_per_block_s = 0.0;
        },
        &[k(1), k(2)],
    )
    .await;
    let r = RequestContext::new(1);
    fx.step(&[k(1), k(2)], &r).await;
    let _gate = fx.ft.hold_loads(); // never opened
    assert_eq!(
        fx.step(&[k(1), k(2)], &r).await,
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
    let fx = Arc::new(fx(&[k(1), k(2)]).await);
    let r = RequestContext::new(1);
    fx.step(&[k(1), k(2)], &r).await;
    let gate = fx.ft.hold_loads();
    assert_eq!(
        fx.m.lookup_many(&[k(1), k(2)], &r),
        vec![HitPending, HitPending]
    );
    fx.m.on_schedule_end();
    gate.wait_arrived(1).await;
    let f2 = fx.clone();
    let h = tokio::spawn(async move { f2.m.reset_cache().await });
    tokio::time::sleep(Duration::from_millis(20)).await;
    gate.open();
    assert_eq!(h.await.unwrap(), 0);
    assert_eq!(fx.m.stats().held_blocks, 0);
    // request still alive: lookups promote again
    assert_eq!(fx.m.lookup(&k(1), &r), Retry);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("reset while in flight").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leak_shutdown_then_calls() {
    let fx = fx(&[k(1), k(2)]).await;
    let r = RequestContext::new(1);
    fx.step(&[k(1), k(2)], &r).await;
    assert_eq!(
        fx.m.lookup_many(&[k(1), k(2)], &r),
        vec![HitPending, HitPending]
    );
    fx.m.on_schedule_end();
    fx.m.shutdown().await.unwrap();
    assert_eq!(fx.m.stats().held_blocks, 0);
    let r2 = RequestContext::new(2);
    assert_eq!(fx.m.lookup_many(&[k(1), k(2)], &r2), vec![Hit, Hit]);
    assert_eq!(fx.m.lookup(&k(3), &r2), Miss);
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
    let fx = fx(&[k(1), k(2)]).await;
    let r = RequestContext::new(1).skip_tiers(["fs"]);
    assert_eq!(fx.step(&[k(1)], &r).await, vec![Miss]);
    let r2 = RequestContext::new(2).only_tiers(["fs"]);
    fx.step(&[k(1), k(2)], &r2).await;
    fx.step(&[k(1), k(2)], &r2).await;
    // r (not allowed the tier) reads the block r2 promoted: a Hit, but r2 still holds
    assert_eq!(fx.m.lookup(&k(1), &r), Hit);
    fx.m.on_schedule_end();
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 2);
    assert_eq!(fx.m.lookup_many(&[k(1), k(2)], &r2), vec![Hit, Hit]);
    fx.m.on_schedule_end();
    assert_eq!(
        fx.m.stats().held_blocks,
        2,
        "hits not read keep their holds"
    );
    assert_eq!(fx.m.lookup_many(&[k(1), k(2)], &r2), vec![Hit, Hit]);
    drop(fx.m.prepare_load(&[k(1), k(2)]).unwrap());
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
    let fx = fx(&[k(1)]).await;
    let r = RequestContext::new(1);
    fx.step(&[k(1)], &r).await;
    fx.step(&[k(1)], &r).await;
    assert_eq!(fx.m.lookup(&k(1), &r), Hit);
    drop(fx.m.prepare_load(&[k(1)]).unwrap());
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
    let keys: Vec<BlockKey> = (1..=3).map(k).collect();
    let fx = fx(&keys).await;
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
    let _ = fx.cpu.lookup(&k(1));
}

// ---------------------------------------------------------------------------------------------
// a hold lasts while its request can still read the block, and no longer
// ---------------------------------------------------------------------------------------------

/// A load job with one failed key: the keys after it land, but the request's prefix now stops
/// at the failed key (Miss), so its lookups never reach them: not held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_partly_failed_promotion_holds_nothing_past_the_miss() {
    let keys: Vec<BlockKey> = (1..=4).map(k).collect();
    let fx = fx(&keys).await;
    fx.ft.fail_load(&[k(1)]);
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
    let fx = fx(&[k(2), k(3), k(4)]).await; // k(1) is in no tier
    // another request's probe found k2..k4 (it then went away without reading them... or is
    // still waiting; here it is just another request)
    let other = RequestContext::new(7);
    fx.step(&[k(2), k(3), k(4)], &other).await;
    let r = RequestContext::new(1);
    // k1 unknown -> Retry; k2..k4 known present -> promoted for r
    assert_eq!(
        fx.step(&[k(1), k(2), k(3), k(4)], &r).await,
        vec![Retry, HitPending, HitPending, HitPending]
    );
    fx.m.on_request_finished(other.id);
    assert_eq!(fx.step(&[k(1), k(2), k(3), k(4)], &r).await, vec![Miss]);
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
    let keys: Vec<BlockKey> = (1..=3).map(k).collect();
    let fx = fx(&keys).await;
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
    let fx = fx(&[k(1)]).await;
    let a = RequestContext::new(1);
    let b = RequestContext::new(2);
    assert_eq!(fx.m.lookup(&k(1), &a), Retry);
    assert_eq!(fx.m.lookup(&k(1), &b), Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&k(1), &a), HitPending); // reserves, holds for a
    assert_eq!(fx.m.lookup(&k(1), &b), HitPending); // piggybacks
    fx.m.on_schedule_end();
    fx.m.on_request_finished(a.id); // a aborted while the load is in flight
    fx.m.wait_idle().await;
    let held = fx.m.stats().held_blocks;
    let _ = try_engine_store(&fx.m, RequestId(3), &fillers(SLOTS));
    let v = fx.m.lookup(&k(1), &b);
    assert_eq!(
        v, Hit,
        "b was told HitPending, held_blocks={held}; after pressure b gets {v:?}"
    );
}

// ---------------------------------------------------------------------------------------------
// randomized model check: held_blocks equals the model's count, a held key answers Hit to its
// request, bytes verify, and once every request finished nothing is held or pinned.
// ---------------------------------------------------------------------------------------------

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

async fn fuzz_one(seed: u64, faults: bool) {
    fuzz_inner(seed, faults, true).await
}

async fn fuzz_inner(seed: u64, faults: bool, exact: bool) {
    use std::collections::BTreeSet;
    let tier_keys: Vec<BlockKey> = (1..=6).map(k).collect();
    let fx = fx(&tier_keys).await;
    if !exact {
        fx.ft.delay(Some(Duration::from_micros(300)));
    }
    let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let all: Vec<BlockKey> = (1..=8).map(k).collect(); // 7, 8 in no tier
    // the model: (request, key) told HitPending (promotion on its way), holding (landed),
    // answered Hit this step, and keys read this step
    let mut pending: BTreeSet<(u64, BlockKey)> = BTreeSet::new();
    let mut held: BTreeSet<(u64, BlockKey)> = BTreeSet::new();
    let mut hit: BTreeSet<(u64, BlockKey)> = BTreeSet::new();
    let mut read: BTreeSet<BlockKey> = BTreeSet::new();
    let mut live: BTreeSet<u64> = BTreeSet::new();
    let mut next_req = 1u64;
    let mut trace = Vec::new();
    for step in 0..60 {
        if faults && rng.below(5) == 0 {
            fx.ft.fail_load(&[all[rng.below(6) as usize]]);
            trace.push("fault".to_string());
        }
        for _ in 0..rng.below(5) {
            match rng.below(10) {
                0..=5 => {
                    if live.is_empty() || rng.below(4) == 0 {
                        live.insert(next_req);
                        next_req += 1;
                    }
                    let ids: Vec<u64> = live.iter().copied().collect();
                    let id = ids[rng.below(ids.len() as u64) as usize];
                    let r = RequestContext::new(id);
                    let start = rng.below(4) as usize;
                    let len = 1 + rng.below(5) as usize;
                    let keys: Vec<BlockKey> = all[start..(start + len).min(all.len())].to_vec();
                    let v = if keys.len() == 1 && rng.below(2) == 0 {
                        vec![fx.m.lookup(&keys[0], &r)]
                    } else {
                        fx.m.lookup_many(&keys, &r)
                    };
                    trace.push(format!(
                        "s{step} r{id} {:?} -> {v:?}",
                        &keys
                            .iter()
                            .map(|k| all.iter().position(|a| a == k).unwrap() + 1)
                            .collect::<Vec<_>>()
                    ));
                    for (i, res) in v.iter().enumerate() {
                        let key = keys[i];
                        if held.contains(&(id, key)) {
                            assert_eq!(
                                *res,
                                Hit,
                                "seed {seed}: held key answered {res:?}\n{}",
                                trace.join("\n")
                            );
                            hit.insert((id, key));
                        }
                        match res {
                            // only promotions write these keys: promised to this request
                            HitPending => {
                                pending.insert((id, key));
                            }
                            Miss => {
                                // the prefix stops here: this key and the rest of the call
                                for k in &keys[i..] {
                                    pending.remove(&(id, *k));
                                    held.remove(&(id, *k));
                                }
                            }
                            _ => {}
                        }
                    }
                    let hits = count_hits(&v);
                    if hits > 0 && rng.below(2) == 0 {
                        let views = fx.m.prepare_load(&keys[..hits]).unwrap();
                        for (kk, vv) in keys.iter().zip(&views) {
                            assert!(verify_block(kk, 0, vv.as_slice()), "seed {seed}: bytes");
                        }
                        if !hit.is_empty() {
                            read.extend(keys[..hits].iter().copied());
                        }
                    }
                }
                6 => {
                    if let Some(&id) = live
                        .iter()
                        .nth(rng.below(live.len().max(1) as u64) as usize)
                    {
                        fx.m.on_request_finished(RequestId(id));
                        live.remove(&id);
                        held.retain(|(r, _)| *r != id);
                        pending.retain(|(r, _)| *r != id);
                        hit.retain(|(r, _)| *r != id);
                        trace.push(format!("s{step} finish r{id}"));
                    }
                }
                7 | 8 => {
                    let n = 1 + rng.below(SLOTS as u64) as usize;
                    let res = try_engine_store(&fx.m, RequestId(500), &fillers(n));
                    trace.push(format!("s{step} store {n}: {}", res.is_ok()));
                }
                _ => {
                    if rng.below(3) == 0 {
                        fx.m.poll();
                        let _ = fx.m.is_idle();
                    } else {
                        fx.m.touch(&all[..3]);
                    }
                }
            }
        }
        fx.m.on_schedule_end();
        for (id, key) in std::mem::take(&mut hit) {
            if read.contains(&key) {
                held.remove(&(id, key));
            }
        }
        read.clear();
        if rng.below(10) == 0 {
            fx.m.reset_cache().await;
            held.clear();
            pending.clear();
            trace.push(format!("s{step} reset"));
        }
        if !exact {
            if rng.below(3) == 0 {
                fx.m.wait_idle().await;
            } else {
                tokio::time::sleep(Duration::from_micros(rng.below(800))).await;
            }
            held.clear();
            pending.clear();
            continue;
        }
        fx.m.wait_idle().await;
        fx.m.poll();
        // a promise whose block landed is a hold; one whose promotion failed is gone
        for (id, key) in std::mem::take(&mut pending) {
            if fx.cpu.lookup(&key) == Hit {
                held.insert((id, key));
            }
        }
        let keys_held: BTreeSet<BlockKey> = held.iter().map(|(_, k)| *k).collect();
        let s = fx.m.stats();
        let requests: BTreeSet<u64> = held.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            (s.held_blocks, s.holding_requests),
            (keys_held.len(), requests.len()),
            "seed {seed} step {step}: held blocks and requests\n{}",
            trace.join("\n")
        );
    }
    for id in std::mem::take(&mut live) {
        fx.m.on_request_finished(RequestId(id));
    }
    fx.m.on_request_finished(RequestId(500));
    fx.ft.heal();
    fx.assert_clean(&format!("fuzz seed {seed}")).await;
}

fn count_hits(v: &[LookupResult]) -> usize {
    v.iter().take_while(|r| **r == Hit).count()
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
