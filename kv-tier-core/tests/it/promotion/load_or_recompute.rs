//! Load or recompute, on tokio's paused clock: the per-tier estimate of a load's time follows
//! the jobs measured and counts what is queued ahead; with the engine's recompute time, a
//! slow tier's hit is declined (and leaves nothing held), a fast tier's is taken, and a
//! prefix is served as far as it pays; a promotion that falls behind its estimate, at a pace
//! slower than recomputing what it has not landed, is cut and keeps what landed.

use std::time::Duration;

use kv_tier_core::LookupResult::*;
use kv_tier_core::{
    BlockKey, KvTierConfig, MissCause, PrimaryTier, RequestContext, RequestId, SecondaryTier,
};
use kv_tier_testkit::test_key;
use kv_tier_testkit::util::try_engine_store;

use crate::support::*;

/// Keys `from..from + n` of the seeded range.
fn keys(from: u64, n: u64) -> Vec<BlockKey> {
    (from..from + n).map(test_key).collect()
}

/// Takes `keys` through a promotion for `req` (probe, load, read) and finishes `req`.
async fn promote_all(fx: &HoldFx, keys: &[BlockKey], req: u64) {
    let r = RequestContext::new(req);
    assert_eq!(fx.step(keys, &r).await, vec![Retry; keys.len()]);
    assert_eq!(fx.step(keys, &r).await, vec![HitPending; keys.len()]);
    assert_eq!(fx.step(keys, &r).await, vec![Hit; keys.len()]);
    fx.m.on_request_finished(r.id);
}

/// A DRAM tier of [`SLOTS`] blocks.
fn dram() -> std::sync::Arc<kv_tier_cpu::CpuTier> {
    std::sync::Arc::new(
        kv_tier_cpu::CpuTier::new(kv_tier_cpu::CpuTierConfig {
            capacity_bytes: (SLOTS * BS) as u64,
            block_size: BS,
            policy: kv_tier_core::EvictionPolicy::Lru,
            prefault: false,
        })
        .unwrap(),
    )
}

/// The last miss of `r` says recomputing was faster than the fs tier's load.
fn assert_recomputed(fx: &HoldFx, r: &RequestContext) {
    assert_eq!(
        fx.m.last_miss(r.id),
        Some(MissCause::RecomputeFaster { tier: "fs".into() })
    );
}

/// The answers counted agree with the lookups counted, the misses with their causes, once the
/// policy took some back.
fn assert_counts_agree(s: &kv_tier_core::ManagerStats) {
    assert_eq!(
        s.lookups,
        s.hits + s.hits_pending + s.retries + s.misses,
        "{s:?}"
    );
    assert_eq!(s.misses, s.misses_by_cause.total(), "{s:?}");
}

/// A manager whose engine recomputes a block (16 tokens) in `per_block`.
async fn with_recompute(per_block: Duration, seeded: &[BlockKey]) -> HoldFx {
    let rate = 16.0 / per_block.as_secs_f64();
    hold_fx_with(
        |c: &mut KvTierConfig| {
            c.block_size_tokens = Some(16);
            c.prefill_tokens_per_s = Some(rate);
        },
        seeded,
    )
    .await
}

/// The engine's scheduler runs 16 steps of `each` (on the paused clock): the manager's step
/// interval is `each` from then on (the median of its last 15 steps).
async fn steps_of(fx: &HoldFx, each: Duration) {
    for _ in 0..16 {
        tokio::time::sleep(each).await;
        fx.m.on_schedule_end();
    }
}

/// The fs tier measured as the policy measures a tier it does not know: after steps of
/// 100 us (short: a wait costs about itself), request `req`'s promotion of `keys` is sent but
/// not waited for (a `Miss` for it, counted declined), lands in DRAM, and its time is the
/// tier's first measured load.
async fn measure(fx: &HoldFx, keys: &[BlockKey], req: u64) {
    steps_of(fx, Duration::from_micros(100)).await;
    assert!(fx.m.load_estimate("fs").is_none(), "not measured yet");
    let r = RequestContext::new(req);
    assert_eq!(fx.step(keys, &r).await, vec![Retry; keys.len()]);
    assert_eq!(fx.step(keys, &r).await, vec![Miss]);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.load_estimate("fs").map(|e| e.jobs), Some(1));
    for k in keys {
        assert_eq!(fx.cpu.lookup(k), Hit, "{k} landed");
    }
    assert_eq!(fx.m.stats().held_blocks, 0, "held for no request");
    fx.m.on_request_finished(r.id);
}

/// An engine that recomputes a block in 1 ms over a tier whose loads take 100 ms, measured
/// by a promotion of the first `n` seeded keys (request 1).
async fn measured_slow_tier(n: u64) -> HoldFx {
    let fx = with_recompute(Duration::from_millis(1), &keys(1, 8)).await;
    fx.ft.delay(Some(Duration::from_millis(100)));
    measure(&fx, &keys(1, n), 1).await;
    fx
}

/// No estimate before a load job ended, nor for a tier not configured; then the time of the
/// jobs measured (100 ms each), what is in flight counted ahead of a new job, and, once the
/// tier slows to 1 s a job, an estimate between the two (it follows the jobs it is fitted to).
#[tokio::test(start_paused = true)]
async fn estimates_follow_the_jobs_measured() {
    let fx = hold_fx(&keys(1, 16)).await;
    fx.ft.delay(Some(Duration::from_millis(100)));
    assert_eq!(fx.m.load_estimate("fs"), None);
    assert_eq!(fx.m.load_estimate("no such tier"), None);
    promote_all(&fx, &keys(1, 4), 1).await;
    promote_all(&fx, &keys(5, 4), 2).await;
    let e = fx.m.load_estimate("fs").unwrap();
    assert_eq!((e.jobs, e.bytes_ahead), (2, 0));
    let four = 4 * BS as u64;
    let t = e.ready_in(four);
    assert!(
        t >= Duration::from_millis(100) && t <= Duration::from_millis(101),
        "{e:?}: {t:?}"
    );
    // a promotion in flight is ahead of a new job
    let r = RequestContext::new(3);
    assert_eq!(fx.step(&keys(9, 4), &r).await, vec![Retry; 4]);
    assert_eq!(fx.m.lookup_many(&keys(9, 4), &r), vec![HitPending; 4]);
    fx.m.on_schedule_end();
    let e = fx.m.load_estimate("fs").unwrap();
    assert_eq!(e.bytes_ahead, four);
    assert!(e.ready_in(four) >= Duration::from_millis(200), "{e:?}");
    fx.m.wait_idle().await;
    fx.m.on_request_finished(r.id);
    // the tier slows down: the estimate follows, over the jobs it is fitted to
    fx.ft.delay(Some(Duration::from_secs(1)));
    promote_all(&fx, &keys(13, 4), 4).await;
    let e = fx.m.load_estimate("fs").unwrap();
    assert_eq!(e.jobs, 4);
    let t = e.ready_in(four);
    // three jobs of 100 ms and one of 1 s, of one size: 325 ms each on average
    assert!(
        t >= Duration::from_millis(320) && t <= Duration::from_millis(330),
        "{e:?}: {t:?}"
    );
}

/// A load job is measured to its end, not to the step that applies its result: with steps
/// of 1 s and loads of 100 ms, the estimate, the load latency and the time the tier was busy
/// loading all say 100 ms (measured to the drain, they said 1 s: the engine's step, and a
/// policy would decline loads that pay).
#[tokio::test(start_paused = true)]
async fn a_load_is_measured_to_its_end_not_to_the_step_that_applies_it() {
    let fx = hold_fx(&keys(1, 8)).await;
    fx.ft.delay(Some(Duration::from_millis(100)));
    let r = RequestContext::new(1);
    let ks = keys(1, 4);
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 4]);
    assert_eq!(fx.m.lookup_many(&ks, &r), vec![HitPending; 4]);
    fx.m.on_schedule_end();
    // the engine's step runs on for a second; the job ends 100 ms into it
    tokio::time::sleep(Duration::from_secs(1)).await;
    fx.m.on_schedule_end();
    assert_eq!(fx.m.lookup_many(&ks, &r), vec![Hit; 4]);
    let e = fx.m.load_estimate("fs").unwrap();
    let t = e.ready_in(4 * BS as u64);
    assert!(
        t >= Duration::from_millis(100) && t <= Duration::from_millis(101),
        "{e:?}: {t:?}"
    );
    let s = fx.m.stats();
    let busy = s.tiers[0].load_busy;
    assert!(
        busy >= Duration::from_millis(100) && busy <= Duration::from_millis(101),
        "{busy:?}"
    );
    assert!(
        s.tiers[0].load_latency.max() <= Duration::from_millis(101),
        "{s:?}"
    );
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after a load applied a step after it ended")
        .await;
}

/// `lookup_prefix` says when its present run is in DRAM: `None` while the tier it waits for
/// has no estimate, the tier's estimate once it has one, zero when the run is all in DRAM.
#[tokio::test(start_paused = true)]
async fn the_prefix_count_says_when_its_run_is_ready() {
    let fx = hold_fx(&keys(1, 8)).await;
    fx.ft.delay(Some(Duration::from_millis(100)));
    let r = RequestContext::new(1);
    assert_eq!(fx.step(&keys(1, 4), &r).await, vec![Retry; 4]);
    let c = fx.m.lookup_prefix(&keys(1, 4), &r);
    assert_eq!((c.hit, c.present, c.ready_in), (0, 4, None));
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    let c = fx.m.lookup_prefix(&keys(1, 4), &r);
    assert_eq!((c.hit, c.present, c.ready_in), (4, 4, Some(Duration::ZERO)));
    fx.m.on_schedule_end();
    fx.m.on_request_finished(r.id);
    let r = RequestContext::new(2);
    assert_eq!(fx.step(&keys(5, 4), &r).await, vec![Retry; 4]);
    let c = fx.m.lookup_prefix(&keys(5, 4), &r);
    let ready = c.ready_in.expect("the tier has an estimate");
    assert_eq!(c.present, 4);
    assert!(ready >= Duration::from_millis(100), "{ready:?}");
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
}

/// A tier whose loads take 100 ms, an engine that recomputes a block in 1 ms: once the tier
/// is measured, a hit of 4 blocks is declined (a `Miss` naming the cause, again at the next
/// lookup, with no load job), counted, and leaves no DRAM slot, hold or lease behind.
#[tokio::test(start_paused = true)]
async fn a_slow_tiers_hit_is_declined_when_recomputing_is_faster() {
    let fx = measured_slow_tier(4).await;
    let r = RequestContext::new(2);
    let ks = keys(5, 4);
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 4]);
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    assert_recomputed(&fx, &r);
    for k in &ks {
        assert!(!fx.mem.is_protected(k), "{k} still leased");
    }
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    let s = fx.m.stats();
    assert_eq!(
        (
            s.tiers[0].hits,
            s.tiers[0].promotions_declined,
            s.tiers[0].load_jobs
        ),
        // request 2's 4 hits taken back, and the 4 of the measurement
        (0, 8, 1)
    );
    assert_eq!(s.misses_by_cause.recompute_faster, 3);
    assert_counts_agree(&s);
    assert_eq!(s.held_blocks, 0);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after the decline").await;
    // another request is judged afresh (the tier asked again), by the same estimate
    let r = RequestContext::new(3);
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 4]);
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    fx.m.on_request_finished(r.id);
}

/// A tier whose loads take 1 ms, an engine that recomputes a block in 10 ms: once the tier
/// is measured, the hit is taken.
#[tokio::test(start_paused = true)]
async fn a_fast_tiers_hit_is_taken() {
    let fx = with_recompute(Duration::from_millis(10), &keys(1, 8)).await;
    fx.ft.delay(Some(Duration::from_millis(1)));
    measure(&fx, &keys(1, 4), 1).await;
    promote_all(&fx, &keys(5, 4), 2).await;
    let s = fx.m.stats();
    // the 4 declined are the measurement's
    assert_eq!(
        (s.tiers[0].promotions_declined, s.tiers[0].load_jobs),
        (4, 2)
    );
    assert_eq!(s.misses_by_cause.recompute_faster, 1);
}

/// Blocks in DRAM then blocks of a slow tier: the prefix is served as far as it pays (the
/// blocks in DRAM), the rest declined.
#[tokio::test(start_paused = true)]
async fn a_prefix_is_served_as_far_as_it_pays() {
    let fx = measured_slow_tier(2).await;
    let dram = [test_key(50), test_key(51)];
    try_engine_store(&fx.m, RequestId(2), &dram).unwrap();
    fx.m.on_request_finished(RequestId(2));
    fx.m.on_schedule_end();
    let r = RequestContext::new(3);
    let ks = [dram[0], dram[1], test_key(5), test_key(6)];
    assert_eq!(fx.step(&ks, &r).await, vec![Hit, Hit, Retry, Retry]);
    assert_eq!(fx.step(&ks, &r).await, vec![Hit, Hit, Miss]);
    let c = fx.m.lookup_prefix(&ks, &r);
    assert_eq!((c.hit, c.present, c.ready_in), (2, 2, Some(Duration::ZERO)));
    fx.m.on_schedule_end();
    let s = fx.m.stats();
    // 2 of request 3, 2 of the measurement
    assert_eq!(s.tiers[0].promotions_declined, 4);
    assert_counts_agree(&s);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after a prefix cut").await;
}

/// `prefill_tokens_per_s` needs the tokens per block, and its range is checked, each refusal
/// naming the field.
#[tokio::test]
async fn the_prefill_rate_is_checked_at_construction() {
    let mut c = KvTierConfig::new((SLOTS * BS) as u64, BS as u64);
    c.prefill_tokens_per_s = Some(0.5);
    let e = c.validate().unwrap_err().to_string();
    assert!(e.contains("prefill_tokens_per_s"), "{e}");
    let e = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "prefill_tokens_per_s": 1e10}}"#,
        SLOTS * BS
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("prefill_tokens_per_s"), "{e}");
    let mut c = KvTierConfig::new((SLOTS * BS) as u64, BS as u64);
    c.prefill_tokens_per_s = Some(10_000.0);
    let e = kv_tier_core::TieringManager::builder(c)
        .primary(dram())
        .build()
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("prefill_tokens_per_s") && e.contains("tokens per block"),
        "{e}"
    );
}

/// A key twice in a declined prefix was reserved once: declined, and counted, once.
#[tokio::test(start_paused = true)]
async fn a_key_twice_in_a_declined_prefix_is_declined_once() {
    let fx = measured_slow_tier(2).await;
    let r = RequestContext::new(2);
    let ks = [test_key(5), test_key(5), test_key(6)];
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 3]);
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    let s = fx.m.stats();
    // request 2's 2 and the measurement's 2
    assert_eq!((s.tiers[0].hits, s.tiers[0].promotions_declined), (0, 4));
    assert_counts_agree(&s);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after a declined duplicate").await;
}

/// A tier measured at 10 ms a job of 4 blocks, an engine that recomputes a block in
/// `per_block` (and, with `policy` off, no recompute time): request 3's promotion of 4 blocks
/// is sent; its job lands its first `landed` blocks and stalls until the returned gate opens.
async fn stalled_promotion(
    per_block: Option<Duration>,
    landed: usize,
) -> (HoldFx, kv_tier_testkit::Gate, RequestContext, Vec<BlockKey>) {
    let fx = match per_block {
        Some(d) => with_recompute(d, &keys(1, 16)).await,
        None => hold_fx(&keys(1, 16)).await,
    };
    fx.ft.delay(Some(Duration::from_millis(10)));
    if per_block.is_some() {
        measure(&fx, &keys(1, 4), 1).await;
    } else {
        promote_all(&fx, &keys(1, 4), 1).await;
    }
    promote_all(&fx, &keys(5, 4), 2).await;
    let gate = fx.ft.stall_loads_after(landed);
    let r = RequestContext::new(3);
    let ks = keys(9, 4);
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 4]);
    assert_eq!(fx.m.lookup_many(&ks, &r), vec![HitPending; 4]);
    fx.m.on_schedule_end();
    (fx, gate, r, ks)
}

/// One scheduling step `after` the last (its start applies what completed, and cuts what fell
/// behind): the promotion of `ks` is still pending.
async fn assert_pending_after(fx: &HoldFx, after: Duration, ks: &[BlockKey], r: &RequestContext) {
    tokio::time::sleep(after).await;
    assert_eq!(
        fx.m.lookup_many(ks, r),
        vec![HitPending; 4],
        "{after:?} later"
    );
    fx.m.on_schedule_end();
}

/// A promotion past twice its estimate (10 ms) whose two blocks left would take longer at its
/// pace than recomputing them (10 ms a block) is cut at the next step: the two that landed
/// are served with their bytes, the rest are a miss for the request (recomputing was faster,
/// and stays so for it: no new load), counted as cut and not as failed, and nothing is left
/// held, leased or reserved.
#[tokio::test(start_paused = true)]
async fn a_cut_promotion_keeps_what_landed_and_leaves_nothing_held() {
    let (fx, gate, r, ks) = stalled_promotion(Some(Duration::from_millis(10)), 2).await;
    // within twice its estimate: not cut
    assert_pending_after(&fx, Duration::from_millis(15), &ks, &r).await;
    // 25 ms in: past the margin, and the 2 blocks left would take 25 ms, recomputing them 20
    assert_pending_after(&fx, Duration::from_millis(10), &ks, &r).await;
    fx.m.wait_jobs().await;
    assert_eq!(fx.m.lookup_many(&ks, &r), vec![Hit, Hit, Miss]);
    assert_recomputed(&fx, &r);
    load_verify(&fx.m, &ks[..2]);
    fx.m.on_schedule_end();
    assert_eq!(fx.step(&ks, &r).await, vec![Hit, Hit, Miss]);
    let s = fx.m.stats();
    let t = &s.tiers[0];
    assert_eq!(
        (t.load_jobs, t.load_jobs_cut, t.promotions_cut),
        (3, 1, 2),
        "{t:?}"
    );
    assert_eq!((t.load_failures, t.blocks_loaded), (0, 10), "{t:?}");
    assert_counts_agree(&s);
    for k in &ks[2..] {
        assert!(!fx.mem.is_protected(k), "{k} still leased");
    }
    fx.m.on_request_finished(r.id);
    gate.open();
    fx.assert_clean("after a cut").await;
}

/// Behind its estimate but at a pace that still beats recomputing (1 s a block), a promotion
/// runs on and serves every block; without the engine's recompute time, none is ever cut.
#[tokio::test(start_paused = true)]
async fn a_promotion_behind_its_estimate_that_still_pays_runs_on() {
    for per_block in [Some(Duration::from_secs(1)), None] {
        let (fx, gate, r, ks) = stalled_promotion(per_block, 2).await;
        assert_pending_after(&fx, Duration::from_millis(500), &ks, &r).await;
        assert_pending_after(&fx, Duration::from_millis(500), &ks, &r).await;
        gate.open();
        fx.m.wait_jobs().await;
        assert_eq!(fx.step(&ks, &r).await, vec![Hit; 4], "{per_block:?}");
        let t = &fx.m.stats().tiers[0];
        assert_eq!((t.load_jobs_cut, t.promotions_cut), (0, 0), "{per_block:?}");
        fx.m.on_request_finished(r.id);
        fx.assert_clean("after a slow promotion").await;
    }
}

/// A promotion that landed nothing is cut once it has run longer than recomputing its blocks
/// (4 blocks at 10 ms: 40 ms), not at the margin alone.
#[tokio::test(start_paused = true)]
async fn a_promotion_that_landed_nothing_is_cut_once_recomputing_would_have_ended() {
    let (fx, gate, r, ks) = stalled_promotion(Some(Duration::from_millis(10)), 0).await;
    assert_pending_after(&fx, Duration::from_millis(30), &ks, &r).await;
    assert_pending_after(&fx, Duration::from_millis(15), &ks, &r).await;
    fx.m.wait_jobs().await;
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    let t = &fx.m.stats().tiers[0];
    assert_eq!(
        (t.load_jobs_cut, t.promotions_cut, t.load_failures),
        (1, 4, 0),
        "{t:?}"
    );
    fx.m.on_request_finished(r.id);
    gate.open();
    fx.assert_clean("after a cut of nothing landed").await;
}

/// A request that waits resumes at a step. A tier measured at 60 ms for 4 blocks (15 ms a
/// block), an engine that recomputes a block in 20 ms: with steps of 1 ms the 4 blocks are
/// taken (60 ms against 80); with steps of 50 ms their load spans two steps (100 ms against
/// 80), and the 3 blocks that load within one step (45 ms: 50 against 60) are served, the
/// fourth declined.
#[tokio::test(start_paused = true)]
async fn a_load_costs_the_whole_steps_it_spans() {
    for (step, served) in [
        (Duration::from_millis(1), 4),
        (Duration::from_millis(50), 3),
    ] {
        let fx = with_recompute(Duration::from_millis(20), &keys(1, 8)).await;
        fx.ft.delay(Some(Duration::from_millis(60)));
        measure(&fx, &keys(1, 4), 1).await;
        steps_of(&fx, step).await;
        let r = RequestContext::new(2);
        let ks = keys(5, 4);
        // the probe pays for a step (80 ms of recompute against 50)
        assert_eq!(fx.step(&ks, &r).await, vec![Retry; 4], "{step:?}");
        let mut want = vec![HitPending; served];
        if served < 4 {
            want.push(Miss);
            assert_eq!(fx.m.lookup_many(&ks, &r), want, "{step:?}");
            assert_recomputed(&fx, &r);
        } else {
            assert_eq!(fx.m.lookup_many(&ks, &r), want, "{step:?}");
        }
        fx.m.on_schedule_end();
        fx.m.wait_idle().await;
        let t = &fx.m.stats().tiers[0];
        // and the 4 of the measurement
        assert_eq!(t.promotions_declined, 8 - served as u64, "{step:?}");
        assert_counts_agree(&fx.m.stats());
        fx.m.on_request_finished(r.id);
        fx.assert_clean("after a load weighed in steps").await;
    }
}

/// Steps of 50 ms and 4 blocks that recompute in 4 ms: the request does not wait a step for
/// their probe (a `Miss` at once, naming the tier it would have waited for, the tier's wait
/// not counted), and the probe goes on: once it answered the blocks are leased in the tier
/// (found), while the request still has them as a miss; nothing stays leased once it ends.
#[tokio::test(start_paused = true)]
async fn a_probe_that_cannot_pay_within_a_step_is_not_waited_for() {
    let fx = with_recompute(Duration::from_millis(1), &keys(1, 8)).await;
    steps_of(&fx, Duration::from_millis(50)).await;
    let r = RequestContext::new(1);
    let ks = keys(1, 4);
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    assert_recomputed(&fx, &r);
    let s = fx.m.stats();
    assert_eq!(
        (
            s.retries,
            s.tiers[0].retry_waits,
            s.tiers[0].probes_not_waited
        ),
        (0, 0, 4),
        "{s:?}"
    );
    assert_counts_agree(&s);
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    assert_eq!(fx.m.stats().tiers[0].probes.keys_found, 4);
    for k in &ks {
        assert!(fx.mem.is_protected(k), "{k} found and leased");
    }
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after a probe not waited for").await;
    for k in &ks {
        assert!(!fx.mem.is_protected(k), "{k} still leased");
    }
}

/// Before two steps have ended (no step measured), no probe is waited for: the first lookup
/// of a prefix whose blocks a tier may have is a `Miss` with the policy on (a `Retry` without
/// it), and its probe goes on. Steps measured that take no time are steps measured.
#[tokio::test(start_paused = true)]
async fn no_probe_is_waited_for_before_the_steps_are_measured() {
    let fx = with_recompute(Duration::from_secs(1), &keys(1, 8)).await;
    let r = RequestContext::new(1);
    assert_eq!(fx.step(&keys(1, 4), &r).await, vec![Miss]);
    assert_eq!(fx.m.stats().tiers[0].probes.keys_found, 4);
    fx.m.on_request_finished(r.id);
    let off = hold_fx(&keys(1, 8)).await;
    assert_eq!(off.step(&keys(1, 4), &r).await, vec![Retry; 4]);
    off.m.on_request_finished(r.id);
    fx.assert_clean("after a probe before the steps").await;
    // steps measured at no time at all (the clock did not move): a wait costs itself, and
    // 4 blocks of 1 s of recompute pay for waiting for their probe
    steps_of(&fx, Duration::ZERO).await;
    let r = RequestContext::new(2);
    assert_eq!(fx.step(&keys(5, 4), &r).await, vec![Retry; 4]);
    fx.m.on_request_finished(r.id);
}

/// A memory tier named `name` holding `keys`.
async fn seeded(name: &str, keys: &[BlockKey]) -> std::sync::Arc<kv_tier_testkit::MemoryTier> {
    let mem = std::sync::Arc::new(kv_tier_testkit::MemoryTier::new(name, BS));
    let job = kv_tier_core::StoreJob {
        links: Vec::new(),
        requests: Vec::new(),
        blocks: keys
            .iter()
            .map(|k| (*k, kv_tier_testkit::source_for(k, 0, BS)))
            .collect(),
    };
    assert!(mem.store(job).await.is_success());
    mem
}

/// A manager whose engine recomputes a block in 1 ms over two tiers: "fs", holding keys
/// `1..=8` behind 100 ms loads, then "obj" (a memory tier) holding `obj_keys`.
async fn fs_then_obj(obj_keys: &[BlockKey]) -> HoldFx {
    let mem = seeded("fs", &keys(1, 8)).await;
    let ft = std::sync::Arc::new(kv_tier_testkit::FaultyTier::new(mem.clone()));
    ft.delay(Some(Duration::from_millis(100)));
    let cpu = dram();
    let mut c = KvTierConfig::new((SLOTS * BS) as u64, BS as u64);
    c.block_size_tokens = Some(16);
    c.prefill_tokens_per_s = Some(16_000.0);
    let m = kv_tier_core::TieringManager::builder(c)
        .primary(cpu.clone())
        .tier(ft.clone())
        .tier(seeded("obj", obj_keys).await)
        .build()
        .await
        .unwrap();
    HoldFx { m, cpu, ft, mem }
}

/// Two tiers hold the blocks: those the slow first one's load is declined for are a miss for
/// the request in the second tier too (it recomputes them), and nothing is left held.
#[tokio::test(start_paused = true)]
async fn a_declined_block_is_not_served_by_another_tier() {
    let fx = fs_then_obj(&keys(1, 8)).await;
    measure(&fx, &keys(1, 2), 1).await;
    let r = RequestContext::new(2);
    let ks = keys(5, 4);
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 4]);
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    assert_recomputed(&fx, &r);
    let s = fx.m.stats();
    assert_eq!(
        // request 2's 4 and the measurement's 2
        (s.tiers[0].promotions_declined, s.tiers[1].load_jobs),
        (6, 0),
        "{s:?}"
    );
    assert_counts_agree(&s);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after a decline over two tiers").await;
}

/// The promotion that measures a tier is the manager's, not the request's: the request whose
/// lookup found the blocks finishing before the step ends does not cancel it (else a tier
/// whose requests all end within their step would never be measured, and never served).
#[tokio::test(start_paused = true)]
async fn a_measurement_outlives_the_request_that_found_its_blocks() {
    let fx = with_recompute(Duration::from_millis(1), &keys(1, 8)).await;
    fx.ft.delay(Some(Duration::from_millis(100)));
    steps_of(&fx, Duration::from_micros(100)).await;
    let r = RequestContext::new(1);
    let ks = keys(1, 4);
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 4]);
    assert_eq!(fx.m.lookup_many(&ks, &r), vec![Miss]);
    fx.m.on_request_finished(r.id);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    fx.m.on_schedule_end();
    assert_eq!(fx.m.load_estimate("fs").map(|e| e.jobs), Some(1));
    for k in &ks {
        assert_eq!(fx.cpu.lookup(k), Hit, "{k} landed");
    }
    let s = fx.m.stats();
    let t = &s.tiers[0];
    assert_eq!(
        (t.promotions_declined, t.promotions_cancelled, t.load_jobs),
        (4, 0, 1),
        "{s:?}"
    );
    assert_counts_agree(&s);
    fx.assert_clean("after a measurement its request did not wait for")
        .await;
}

/// A key twice in a prefix, once in the part served and once past the cut: its promotion,
/// hold and answer stay with the part served. Steps of 50 ms, 20 ms of recompute a block,
/// loads at 15 ms a block: of `[k5, k6, k7, k8, k5]` the first three pay most (10 ms saved),
/// and only `k8` is declined.
#[tokio::test(start_paused = true)]
async fn a_key_repeated_past_the_cut_keeps_its_promotion_in_the_part_served() {
    let fx = with_recompute(Duration::from_millis(20), &keys(1, 8)).await;
    fx.ft.delay(Some(Duration::from_millis(60)));
    measure(&fx, &keys(1, 4), 1).await;
    steps_of(&fx, Duration::from_millis(50)).await;
    let r = RequestContext::new(2);
    let mut ks = keys(5, 4);
    ks.push(ks[0]);
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 5]);
    assert_eq!(
        fx.m.lookup_many(&ks, &r),
        vec![HitPending, HitPending, HitPending, Miss]
    );
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    fx.m.on_schedule_end();
    assert_eq!(fx.m.stats().held_blocks, 3);
    assert_eq!(fx.m.lookup_many(&ks, &r), vec![Hit, Hit, Hit, Miss]);
    assert_recomputed(&fx, &r);
    let s = fx.m.stats();
    // the measurement's 4 and k8
    assert_eq!(s.tiers[0].promotions_declined, 5, "{s:?}");
    assert_counts_agree(&s);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after a repeated key past the cut").await;
}

/// The tier measured is the one the judged run stops at, not the first a declined block
/// loads from: with fs measured (slow) and obj not, a prefix `[fs block, obj block]` declines
/// both for the request, and obj's promotion is still sent, and measures obj.
#[tokio::test(start_paused = true)]
async fn the_tier_measured_is_the_first_unmeasured_one_past_a_cut_before_it() {
    let k20 = test_key(20);
    let fx = fs_then_obj(&[k20]).await;
    measure(&fx, &keys(1, 2), 1).await;
    assert!(fx.m.load_estimate("obj").is_none());
    let r = RequestContext::new(2);
    let ks = vec![test_key(5), k20];
    assert_eq!(fx.step(&ks, &r).await, vec![Retry; 2]);
    assert_eq!(fx.step(&ks, &r).await, vec![Miss]);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.load_estimate("obj").map(|e| e.jobs), Some(1));
    assert_eq!(fx.cpu.lookup(&k20), Hit, "obj's block landed");
    assert_eq!(fx.cpu.lookup(&test_key(5)), Miss, "fs's block was declined");
    let s = fx.m.stats();
    assert_eq!(
        (s.tiers[0].load_jobs, s.tiers[1].load_jobs),
        (1, 1),
        "{s:?}"
    );
    assert_counts_agree(&s);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after a measurement past a cut").await;
}

/// A job that ended is not ahead of a new one, though no drain has applied its result yet:
/// half a second after a 100 ms load ended, the estimate counts nothing ahead.
#[tokio::test(start_paused = true)]
async fn a_job_that_ended_is_not_counted_ahead_before_it_is_applied() {
    let fx = hold_fx(&keys(1, 8)).await;
    fx.ft.delay(Some(Duration::from_millis(100)));
    promote_all(&fx, &keys(1, 2), 1).await;
    let r = RequestContext::new(2);
    assert_eq!(fx.step(&keys(3, 2), &r).await, vec![Retry; 2]);
    assert_eq!(fx.m.lookup_many(&keys(3, 2), &r), vec![HitPending; 2]);
    fx.m.on_schedule_end();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(fx.m.load_estimate("fs").unwrap().bytes_ahead, 0);
    fx.m.on_request_finished(r.id);
    fx.assert_clean("after an ended job").await;
}

/// Within a step, a load that pays is taken although another request's job ended during the
/// step, unapplied: the tier is idle (100 ms a 2-block load against 150 ms of recompute).
#[tokio::test(start_paused = true)]
async fn a_job_that_ended_within_the_step_does_not_make_a_paying_load_wait_longer() {
    let fx = with_recompute(Duration::from_millis(75), &keys(1, 16)).await;
    fx.ft.delay(Some(Duration::from_millis(100)));
    measure(&fx, &keys(1, 2), 1).await;
    steps_of(&fx, Duration::from_millis(1)).await;
    let (r2, r3) = (RequestContext::new(2), RequestContext::new(3));
    assert_eq!(fx.m.lookup_many(&keys(5, 2), &r2), vec![Retry; 2]);
    assert_eq!(fx.m.lookup_many(&keys(9, 2), &r3), vec![Retry; 2]);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup_many(&keys(5, 2), &r2), vec![HitPending; 2]);
    fx.m.on_schedule_end();
    // the next step begins, and runs 300 ms; request 2's job ends 100 ms into it
    fx.m.touch(&[]);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(fx.m.lookup_many(&keys(9, 2), &r3), vec![HitPending; 2]);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    fx.m.on_request_finished(r2.id);
    fx.m.on_request_finished(r3.id);
    fx.assert_clean("after a paying load within a step").await;
}

/// `load_busy` counts each job to its end: two 100 ms jobs 400 ms apart are 200 ms busy,
/// also when `wait_idle` sends the second (it applies what ended first, as a step does).
#[tokio::test(start_paused = true)]
async fn load_busy_does_not_count_the_gap_before_a_wait_sends_the_next_job() {
    let fx = hold_fx(&keys(1, 8)).await;
    fx.ft.delay(Some(Duration::from_millis(100)));
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    assert_eq!(fx.m.lookup_many(&keys(1, 2), &r1), vec![Retry; 2]);
    assert_eq!(fx.m.lookup_many(&keys(3, 2), &r2), vec![Retry; 2]);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup_many(&keys(1, 2), &r1), vec![HitPending; 2]);
    fx.m.on_schedule_end();
    assert_eq!(fx.m.lookup_many(&keys(3, 2), &r2), vec![HitPending; 2]);
    tokio::time::sleep(Duration::from_millis(500)).await;
    fx.m.wait_idle().await;
    let t = &fx.m.stats().tiers[0];
    assert_eq!(t.load_jobs, 2);
    assert!(
        t.load_busy >= Duration::from_millis(200) && t.load_busy <= Duration::from_millis(201),
        "{:?}",
        t.load_busy
    );
    fx.m.on_request_finished(r1.id);
    fx.m.on_request_finished(r2.id);
    fx.assert_clean("after two loads apart").await;
}
