//! A slow tier never slows the engine: tiers are probed at once, a probe budget bounds the
//! wait for a slow one, and write-back to a tier is bounded with a visible policy. Tier A is
//! fast, tier B is held at gates; the clock is tokio's paused clock.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{
    BlockKey, Error, KvTierConfig, LookupResult, RequestContext, RequestId, SecondaryTier,
    StoreJob, TierOptions, TieringManager, WriteBackPolicy,
};
use kv_tier_cpu::CpuTier;
use kv_tier_testkit::{FaultyTier, MemoryTier, source_for, test_key};

const BS: usize = 4096;

fn cpu(slots: usize) -> Arc<CpuTier> {
    kv_tier_testkit::util::lru_dram(slots, BS)
}

/// A manager over tiers A and B (in that order), with the manager's options for each.
async fn manager(
    slots: usize,
    a: Arc<dyn SecondaryTier>,
    b: Arc<dyn SecondaryTier>,
    tune: impl FnOnce(&mut KvTierConfig, &mut [TierOptions; 2]),
) -> TieringManager {
    let mut cfg = KvTierConfig::new((slots * BS) as u64, BS as u64);
    let mut opts = [TierOptions::default(); 2];
    tune(&mut cfg, &mut opts);
    TieringManager::builder(cfg)
        .primary(cpu(slots))
        .tier_with_options(a, opts[0])
        .tier_with_options(b, opts[1])
        .build()
        .await
        .unwrap()
}

async fn seed(t: &dyn SecondaryTier, keys: &[BlockKey]) {
    let job = StoreJob {
        requests: Vec::new(),
        blocks: keys.iter().map(|k| (*k, source_for(k, 0, BS))).collect(),
    };
    assert!(t.store(job).await.is_success());
    t.take_events();
}

fn step(m: &TieringManager, keys: &[BlockKey], req: &RequestContext) -> Vec<LookupResult> {
    let r = keys.iter().map(|k| m.lookup(k, req)).collect();
    m.on_schedule_end();
    r
}

fn store(m: &TieringManager, req: RequestId, keys: &[BlockKey]) -> kv_tier_core::Result<()> {
    let mut p = m.prepare_store(keys)?;
    for (k, sink) in p.slots() {
        kv_tier_testkit::fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(req);
    Ok(())
}

fn tiers() -> (Arc<MemoryTier>, Arc<MemoryTier>, Arc<FaultyTier>) {
    let a = Arc::new(MemoryTier::new("a", BS));
    let b_inner = Arc::new(MemoryTier::new("b", BS));
    let b = Arc::new(FaultyTier::new(b_inner.clone()));
    (a, b_inner, b)
}

/// A key tier A has is served as soon as A answers, whatever B is doing.
#[tokio::test(start_paused = true)]
async fn a_key_in_the_fast_tier_does_not_wait_for_the_slow_one() {
    let (a, _b_inner, b) = tiers();
    let k = test_key(1);
    seed(&*a, &[k]).await;
    let b_gate = b.hold_lookups();
    let m = manager(8, a.clone(), b.clone(), |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    tokio::time::sleep(Duration::from_millis(5)).await; // A has answered; B has not
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::HitPending]);
    assert!(!b_gate.is_open());
}

/// A key absent from A and present in B is answered in the step B answers: B is probed in
/// the same step as A, not one step later.
#[tokio::test(start_paused = true)]
async fn a_key_only_the_slow_tier_has_is_answered_when_it_answers() {
    let (a, b_inner, b) = tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    let m = manager(8, a.clone(), b.clone(), |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    m.wait_idle().await; // both probes answered: A absent, B present
    assert_eq!(
        step(&m, &[k], &req),
        vec![LookupResult::HitPending],
        "B was not probed with A"
    );
    assert_eq!(b_inner.lookup_counts().1, 1);
}

/// A probe past its budget stops gating the lookup: the key is a miss there for the asking
/// request; the late answer serves later requests.
#[tokio::test(start_paused = true)]
async fn the_probe_budget_bounds_the_wait_and_a_late_answer_serves_the_next_request() {
    let (a, b_inner, b) = tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    let b_gate = b.hold_lookups();
    let m = manager(8, a.clone(), b.clone(), |_, o| {
        o[1].probe_budget_s = Some(0.02)
    })
    .await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        step(&m, &[k], &req),
        vec![LookupResult::Retry],
        "within budget"
    );
    tokio::time::sleep(Duration::from_millis(15)).await;
    assert_eq!(
        step(&m, &[k], &req),
        vec![LookupResult::Miss],
        "past the budget"
    );
    assert_eq!(m.stats().tiers[1].probes.over_budget, 1);
    b_gate.open(); // the late answer: present
    m.wait_idle().await;
    let s = m.stats();
    assert_eq!(s.tiers[1].probes.late_answers, 1);
    assert!(s.tiers[1].probe_latency.count() >= 1);
    // a second request: A (asked first) is probed; B's late answer is already known
    let probes_of_b = b_inner.lookup_counts().1;
    let r2 = RequestContext::new(2);
    assert_eq!(step(&m, &[k], &r2), vec![LookupResult::Retry]);
    m.wait_idle().await;
    assert_eq!(step(&m, &[k], &r2), vec![LookupResult::HitPending]);
    assert_eq!(b_inner.lookup_counts().1, probes_of_b, "B was probed again");
}

/// A tier with the default policy drops what does not fit in its write-back (counted; the
/// blocks stay in DRAM and in the tiers above); a tier with policy `wait` drops nothing and
/// pushes back on `prepare_store` instead, until its jobs catch up. A store larger than the
/// limit is taken when nothing else is queued.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_back_is_bounded_under_both_policies() {
    let (a_inner, b_inner) = (
        Arc::new(MemoryTier::new("a", BS)),
        Arc::new(MemoryTier::new("b", BS)),
    );
    let (a, b) = (
        Arc::new(FaultyTier::new(a_inner.clone())),
        Arc::new(FaultyTier::new(b_inner.clone())),
    );
    let limit = (2 * BS) as f64 / (1u64 << 20) as f64; // two blocks
    let m = manager(64, a.clone(), b.clone(), |_, o| {
        for t in o.iter_mut() {
            t.write_back_limit_mb = Some(limit);
        }
        o[0].write_back_policy = Some(WriteBackPolicy::Wait);
    })
    .await;
    let (sa, sb) = (m.tier_settings(0), m.tier_settings(1));
    assert_eq!(sa.write_back_policy, WriteBackPolicy::Wait);
    assert_eq!(sb.write_back_policy, WriteBackPolicy::Drop, "the default");
    let (ga, gb) = (a.hold_stores(), b.hold_stores());
    let keys: Vec<_> = (0..5).map(test_key).collect();
    store(&m, RequestId(1), &keys).unwrap();
    let s = m.stats();
    assert_eq!(
        s.tiers[1].writes_dropped, 3,
        "the drop tier took more than its limit"
    );
    assert_eq!(s.tiers[1].write_back_bytes, 2 * BS as u64);
    assert_eq!(s.tiers[0].writes_dropped, 0, "a wait tier dropped");
    assert_eq!(s.tiers[0].write_back_bytes, 5 * BS as u64);
    // the wait tier is over its limit: new stores are refused, naming it
    match store(&m, RequestId(1), &[test_key(9)]).unwrap_err() {
        Error::WriteBackFull { tier, .. } => assert_eq!(tier, "a"),
        e => panic!("{e}"),
    }
    assert_eq!(m.stats().stores_refused_for_write_back, 1);
    ga.open();
    gb.open();
    m.wait_idle().await;
    assert!(keys.iter().all(|k| a_inner.contains(k)));
    assert_eq!(keys.iter().filter(|k| b_inner.contains(k)).count(), 2);
    let s = m.stats();
    assert_eq!(
        (s.tiers[0].write_back_bytes, s.tiers[1].write_back_bytes),
        (0, 0)
    );
    assert_eq!(s.tiers[0].write_back_peak_bytes, 5 * BS as u64);
    assert_eq!(s.write_back_pinned_bytes, 0);
    store(&m, RequestId(1), &[test_key(9)]).unwrap();
}

/// DRAM pinned by write-back stays under `write_back_max_dram_fraction` of the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dram_pinned_by_write_back_stays_under_its_fraction() {
    let (a, b_inner, b) = tiers();
    drop(a);
    let other = Arc::new(MemoryTier::new("a", BS));
    let m = manager(20, other, b.clone(), |c, o| {
        c.write_back_max_dram_fraction = 0.2; // 4 of 20 slots
        o[0].write_back_policy = Some(WriteBackPolicy::Drop);
    })
    .await;
    let g = b.hold_stores();
    let keys: Vec<_> = (0..10).map(test_key).collect();
    for k in &keys {
        store(&m, RequestId(1), &[*k]).unwrap();
        m.on_schedule_end();
    }
    let s = m.stats();
    assert!(s.write_back_pinned_peak_bytes <= 4 * BS as u64, "{s:?}");
    assert!(s.tiers[1].writes_dropped >= 6, "{:?}", s.tiers[1]);
    g.open();
    m.wait_idle().await;
    assert!(b_inner.len() <= 4);
}

/// Under `wait`, stores prepared and not yet completed count against the limits: a second
/// prepared store that would take the tier past its limit is refused before the first one
/// completes, and nothing passes the limit once both land.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_tier_counts_stores_prepared_and_not_completed() {
    let (a_inner, b_inner, b) = tiers();
    let m = manager(64, a_inner.clone(), b.clone(), |_, o| {
        o[1].write_back_limit_mb = Some((4 * BS) as f64 / (1u64 << 20) as f64);
        o[1].write_back_policy = Some(WriteBackPolicy::Wait);
    })
    .await;
    let g = b.hold_stores();
    let first: Vec<_> = (0..3).map(test_key).collect();
    let p1 = m.prepare_store(&first).unwrap();
    match m.prepare_store(&[test_key(10), test_key(11)]) {
        Err(Error::WriteBackFull { tier, .. }) => assert_eq!(tier, "b"),
        other => panic!("a store past the limit was prepared: {other:?}"),
    }
    // a key already in DRAM adds nothing: only the new one counts
    let p2 = m.prepare_store(&[test_key(0), test_key(12)]).unwrap();
    assert_eq!(p2.keys(), vec![test_key(12)]);
    p1.commit(RequestId(1));
    p2.commit(RequestId(1));
    assert_eq!(m.stats().tiers[1].write_back_bytes, 4 * BS as u64);
    g.open();
    m.wait_idle().await;
    let s = m.stats();
    assert_eq!(s.tiers[1].write_back_peak_bytes, 4 * BS as u64);
    assert_eq!(s.tiers[1].writes_dropped, 0);
    assert_eq!(b_inner.len(), 4);
    // a failed store releases what it reserved
    m.prepare_store(&[test_key(20), test_key(21), test_key(22)])
        .unwrap()
        .abort();
    store(
        &m,
        RequestId(1),
        &(30..34).map(test_key).collect::<Vec<_>>(),
    )
    .unwrap();
}

/// Many stores of mixed sizes, some prepared together, while a `wait` tier's jobs are held
/// and released at random: its write-back and the DRAM pinned by write-back never pass
/// their limits, nothing is dropped, and every stored block reaches the tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_wait_the_limits_hold_through_any_interleaving() {
    let (a_inner, b_inner, b) = tiers();
    let m = manager(64, a_inner.clone(), b.clone(), |c, o| {
        c.write_back_max_dram_fraction = 0.125; // 8 of 64 slots
        o[1].write_back_limit_mb = Some((6 * BS) as f64 / (1u64 << 20) as f64);
        o[1].write_back_policy = Some(WriteBackPolicy::Wait);
    })
    .await;
    let mut gate = b.hold_stores();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let (mut key, mut stored, mut refused) = (0u64, Vec::new(), 0);
    for _ in 0..400 {
        // one or two stores prepared before either completes
        let mut open = Vec::new();
        for _ in 0..1 + next(2) {
            let keys: Vec<_> = (0..1 + next(4)).map(|i| test_key(key + i)).collect();
            key += keys.len() as u64;
            match m.prepare_store(&keys) {
                Ok(p) => open.push((p, keys)),
                Err(Error::WriteBackFull { .. }) => refused += 1,
                Err(e) => panic!("{e}"),
            }
        }
        for (mut p, keys) in open {
            for (k, sink) in p.slots() {
                kv_tier_testkit::fill_block(k, 0, sink.as_mut_slice());
            }
            p.commit(RequestId(1));
            stored.extend(keys);
        }
        let s = m.stats();
        assert!(
            s.tiers[1].write_back_bytes <= 6 * BS as u64,
            "{:?}",
            s.tiers[1]
        );
        assert!(s.write_back_pinned_bytes <= 8 * BS as u64, "{s:?}");
        if next(3) == 0 {
            gate.open();
            gate = b.hold_stores();
        }
        m.on_schedule_end();
        tokio::task::yield_now().await;
    }
    gate.open();
    m.wait_idle().await;
    let s = m.stats();
    assert!(refused > 0, "the limits were never reached");
    assert_eq!(s.tiers[1].writes_dropped, 0);
    assert!(
        s.tiers[1].write_back_peak_bytes <= 6 * BS as u64,
        "{:?}",
        s.tiers[1]
    );
    assert!(s.write_back_pinned_peak_bytes <= 8 * BS as u64, "{s:?}");
    assert!(
        stored.iter().all(|k| b_inner.contains(k)),
        "a stored block never reached the wait tier"
    );
}

/// The budget is judged at the step's start, where answers are applied: an answer that came
/// within the budget is not thrown away because the step that applies it runs long, and a
/// verdict never changes in the middle of a step.
#[tokio::test(start_paused = true)]
async fn an_answer_within_the_budget_serves_however_long_the_step_runs() {
    let (a, b_inner, b) = tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    let b_gate = b.hold_lookups();
    let m = manager(8, a.clone(), b.clone(), |_, o| {
        o[1].probe_budget_s = Some(0.005)
    })
    .await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]); // probe sent at t=0
    tokio::time::sleep(Duration::from_millis(2)).await;
    // the next step starts at t=2 (its first call applies what has arrived: nothing)
    assert_eq!(
        m.lookup(&test_key(99), &RequestContext::new(7)),
        LookupResult::Retry
    );
    tokio::time::sleep(Duration::from_millis(2)).await;
    b_gate.open(); // B answers at t=4, within the 5 ms budget
    tokio::time::sleep(Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(5)).await; // a long step: t=10
    assert_eq!(
        m.lookup(&k, &req),
        LookupResult::Retry,
        "the verdict changed in the middle of the step, or an answer within budget was dropped"
    );
    m.on_schedule_end();
    assert_eq!(
        step(&m, &[k], &req),
        vec![LookupResult::HitPending],
        "the answer that came within the budget did not serve"
    );
    let p = m.stats().tiers[1].probes;
    assert_eq!((p.over_budget, p.late_answers), (0, 0));
}

/// A probe that never answers (it times out) is not a late answer: it serves nobody.
#[tokio::test(start_paused = true)]
async fn a_timed_out_probe_is_not_counted_as_a_late_answer() {
    let (a, _b_inner, b) = tiers();
    let _gate = b.hold_lookups();
    let m = manager(8, a.clone(), b.clone(), |c, o| {
        c.probe_timeout_s = 0.05;
        o[1].probe_budget_s = Some(0.01);
    })
    .await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[test_key(1)], &req), vec![LookupResult::Retry]);
    tokio::time::sleep(Duration::from_millis(100)).await;
    m.wait_idle().await;
    let p = m.stats().tiers[1].probes;
    assert_eq!(p.probe_timeouts, 1);
    assert_eq!(p.late_answers, 0, "a timeout was counted as a late answer");
}

/// A key both tiers have is served by A; the lease B took on it (probed at the same time)
/// ends with A's promotion instead of pinning B's copy until the request ends.
#[tokio::test(start_paused = true)]
async fn the_slow_tier_lets_go_of_a_key_the_fast_one_promoted() {
    let (a, b_inner, b) = tiers();
    let k = test_key(1);
    seed(&*a, &[k]).await;
    seed(&*b_inner, &[k]).await;
    let m = manager(8, a.clone(), b.clone(), |_, _| {}).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    m.wait_idle().await;
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::HitPending]);
    m.wait_idle().await;
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Hit]);
    let s = m.stats();
    assert_eq!(s.tiers[0].hits, 1);
    assert_eq!(
        (s.tiers[0].leased_keys, s.tiers[1].leased_keys),
        (0, 0),
        "a tier keeps a lease on a key another tier promoted"
    );
    assert!(!b.is_protected(&k));
}
