//! How long a lookup waits for a tier: the probe budget (`probe_budget_s`: past it the key is a
//! miss for the asking request, and a late answer serves the next one) and the probe deadline
//! (`probe_timeout_s`: no key stays `Retry` longer).

use std::sync::Arc;
use std::time::{Duration, Instant};

use LookupResult::{Hit, HitPending, Miss, Retry};
use kv_tier::{Presence, ProbeCache};
use kv_tier_core::{KvTierConfig, LookupResult, RequestContext, RequestId, TierOptions};
use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};
use kv_tier_testkit::{FaultyTier, MemoryTier, store_keys, test_key};

use crate::support::*;

/// A probe past its budget stops gating the lookup: the key is a miss there for the asking
/// request; the late answer serves later requests.
#[tokio::test(start_paused = true)]
async fn the_probe_budget_bounds_the_wait_and_a_late_answer_serves_the_next_request() {
    let (a, b_inner, b) = two_tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    let b_gate = b.hold_lookups();
    let m = two_tier_manager(8, a.clone(), b.clone(), |_, o| {
        o[1].probe_budget_s = Some(0.02)
    })
    .await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    // the paused clock passes (within the 20 ms budget)
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert_eq!(
        step(&m, &[k], &req),
        vec![LookupResult::Retry],
        "within budget"
    );
    // the paused clock passes the budget
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

/// The budget is judged at the step's start, where answers are applied: an answer that came
/// within the budget is not thrown away because the step that applies it runs long, and a
/// verdict never changes in the middle of a step.
#[tokio::test(start_paused = true)]
async fn an_answer_within_the_budget_serves_however_long_the_step_runs() {
    let (a, b_inner, b) = two_tiers();
    let k = test_key(1);
    seed(&*b_inner, &[k]).await;
    let b_gate = b.hold_lookups();
    let m = two_tier_manager(8, a.clone(), b.clone(), |_, o| {
        o[1].probe_budget_s = Some(0.005)
    })
    .await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]); // probe sent at t=0
    // the paused clock: t = 2 ms
    tokio::time::sleep(Duration::from_millis(2)).await;
    // the next step starts at t=2 (its first call applies what has arrived: nothing)
    assert_eq!(
        m.lookup(&test_key(99), &RequestContext::new(7)),
        LookupResult::Retry
    );
    // the paused clock: t = 4 ms
    tokio::time::sleep(Duration::from_millis(2)).await;
    b_gate.open(); // B answers at t=4, within the 5 ms budget
    // the paused clock: B has answered
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
    let (a, _b_inner, b) = two_tiers();
    let _gate = b.hold_lookups();
    let m = two_tier_manager(8, a.clone(), b.clone(), |c, o| {
        c.probe_timeout_s = 0.05;
        o[1].probe_budget_s = Some(0.01);
    })
    .await;
    let req = RequestContext::new(1);
    assert_eq!(step(&m, &[test_key(1)], &req), vec![LookupResult::Retry]);
    // the paused clock passes the probe deadline (50 ms)
    tokio::time::sleep(Duration::from_millis(100)).await;
    m.wait_idle().await;
    let p = m.stats().tiers[1].probes;
    assert_eq!(p.probe_timeouts, 1);
    assert_eq!(p.late_answers, 0, "a timeout was counted as a late answer");
}

/// Promise (kv-tier-core/src/config/mod.rs, `probe_timeout_s`): "A probe that has not
/// answered by then ... answers 'absent in this tier' for its keys, so no key waits in
/// `Retry` longer than this." Requests joining a held probe at every step each end at a
/// verdict (bounded), and once the tier answers again the key is served.
#[test]
fn every_request_joining_a_held_probe_leaves_retry_at_the_probe_deadline() {
    let (mem, faulty) = faulty_mem();
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 0.2"#), vec![faulty.clone()]);
    let k = test_key(51);
    let rt = runtime();
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let gate = faulty.hold_lookups();
    let reqs: Vec<RequestContext> = (1..=10).map(ctx).collect();
    let mut done = vec![None; reqs.len()];
    let t0 = Instant::now();
    let mut step = 0;
    while done.iter().any(Option::is_none) {
        for (i, r) in reqs.iter().enumerate().take(step + 1) {
            if done[i].is_none() {
                let v = m.lookup(&k, r);
                if matches!(v, Hit | Miss) {
                    done[i] = Some(v);
                }
            }
        }
        m.on_schedule_end();
        step += 1;
        assert!(
            t0.elapsed() < SETTLE_LIMIT,
            "requests stuck out of Hit/Miss: {done:?}"
        );
        // the next step: another request joins the held probe each step
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(done.iter().all(|v| *v == Some(Miss)), "{done:?}");
    gate.open();
    let r = ctx(100);
    let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    for r in reqs.iter().chain([&r]) {
        m.on_request_finished(r.id);
    }
    assert_nothing_left(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/tier_options.rs, `probe_budget_s`): "how long a lookup waits for
/// this tier's probe before it counts the key as absent here for the asking request ... The
/// probe goes on until `probe_timeout_s`; a late answer still serves later lookups." A
/// request past the budget misses; the late "present" then serves the next request without
/// another probe (its first verdict is `HitPending`), which reads the right bytes.
#[test]
fn a_late_answer_past_the_budget_serves_the_next_request() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let k = test_key(61);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let opts = TierOptions {
        probe_budget_s: Some(0.01),
        ..Default::default()
    };
    let m = kv_tier::builder(mcfg(4, r#", "probe_timeout_s": 30"#))
        .unwrap()
        .tier_with_options(faulty.clone(), opts)
        .build_blocking()
        .unwrap();
    let gate = faulty.hold_lookups();
    let r1 = ctx(1);
    assert_eq!(m.lookup(&k, &r1), Retry);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(50)); // past the 10 ms budget
    assert_eq!(
        m.lookup(&k, &r1),
        Miss,
        "past its budget the request misses"
    );
    m.on_schedule_end();
    gate.open();
    assert!(poll_until(SETTLE_LIMIT, || {
        m.poll();
        m.is_idle()
    }));
    let r2 = ctx(2);
    let first = m.lookup(&k, &r2);
    assert_eq!(
        first, HitPending,
        "the late answer did not serve the next request"
    );
    let (end, seen) = settle_lookup(&m, &k, &r2, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    let p = m.stats().tiers[0].probes;
    assert!(p.over_budget >= 1 && p.late_answers >= 1, "{p:?}");
    assert_eq!(p.probes, 1, "the late answer was probed for again: {p:?}");
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r2.id);
    assert_nothing_left(&m, &[k]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier README: "`Retry` lasts only while a tier that could still answer present
/// is pending and within its probe budget (`probe_budget_s`; default ... 5 ms for a remote
/// one, whose late answers serve the next requests)"). The real obj tier, its default
/// budget, behind a server that holds every request until the first request has missed (a
/// latency would race the scheduler's steps: a step delayed past it finds the answer come
/// back). No existence listing (`absent_ttl_s` 0): a LIST at open that ended before the hold
/// would tell the tier the key without a probe. The next request, asking after the answer
/// came back, is served without a new probe, with the right bytes.
#[test]
fn a_remote_obj_tier_late_answer_serves_the_next_request() {
    let rt = runtime();
    let s3 = rt.block_on(S3Server::start());
    let cfg = || {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT}, "probe_timeout_s": 10,
                "secondary_tiers": [{{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{}",
                  "scheme": "http", "access_key": "{AK}", "secret_key": "{SK}", "checksum": "crc32c",
                  "lookup_timeout_s": 5, "absent_ttl_s": 0}}]}}"#,
            s3.endpoint
        ))
        .unwrap()
    };
    let k = test_key(261);
    {
        let m = rt
            .block_on(kv_tier::builder(cfg()).unwrap().build())
            .unwrap();
        engine_store(&m, RequestId(1), &[k]);
        m.on_request_finished(RequestId(1));
        rt.block_on(m.wait_idle());
        rt.block_on(m.shutdown()).unwrap();
    }
    let m = kv_tier::builder(cfg())
        .unwrap()
        .runtime(rt.handle().clone())
        .build_blocking()
        .unwrap();
    let held = s3.hold();
    let r1 = ctx(2);
    let (end, seen) = settle_lookup(&m, &k, &r1, SETTLE_LIMIT);
    assert_eq!(
        end, Miss,
        "the first request waited for the slow tier: {seen:?}"
    );
    assert_eq!(m.stats().tiers[0].probes.over_budget, 1);
    drop(held);
    assert!(
        poll_until(SETTLE_LIMIT, || {
            m.poll();
            m.stats().tiers[0].probes.late_answers >= 1
        }),
        "{:?}",
        m.stats().tiers[0].probes
    );
    let r2 = ctx(3);
    assert_eq!(
        m.lookup(&k, &r2),
        HitPending,
        "the late answer did not serve the next request"
    );
    let (end, seen) = settle_lookup(&m, &k, &r2, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r2.id);
    assert_nothing_left(&m, &[k]);
    rt.block_on(m.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/probe_cache/mod.rs, `with_budget`: "a key whose probe was sent
/// at least the budget before that moment and had not answered by then is absent for the
/// requests that asked for it then, for as long as they live ... The answer is not discarded
/// when it arrives: it is applied at the next application and serves every other request from
/// then on"; tier_options.rs `probe_budget_s`: "counts the key as absent here for the asking
/// request"). On a `ProbeCache`: the request past the budget is absent, and stays absent; at
/// the next application the late "present" answer serves a new request. (Found: the doc said
/// the absence lasted "until the next application", which neither the code nor the other docs
/// do.)
#[test]
fn probe_cache_budget_absence_lasts_for_the_asking_request() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let k = test_key(351);
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let notify = Arc::new(tokio::sync::Notify::new());
    let mut pc = ProbeCache::new(faulty.clone(), rt.handle().clone(), notify.clone())
        .with_timeouts(Duration::from_secs(30), Duration::from_secs(30))
        .with_budget(Duration::from_millis(10));
    let gate = faulty.hold_lookups();
    assert_eq!(pc.ask(&k, RequestId(1)), Presence::Retry);
    pc.flush();
    rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await })
        .unwrap();
    // past the probe's budget
    std::thread::sleep(Duration::from_millis(30));
    pc.apply_results();
    assert_eq!(
        pc.ask(&k, RequestId(1)),
        Presence::Absent,
        "past the budget"
    );
    gate.open();
    rt.block_on(kv_tier_testkit::util::wait_probe_results(&pc, &notify));
    pc.apply_results(); // the next application, with the late answer
    assert_eq!(
        pc.ask(&k, RequestId(2)),
        Presence::Present,
        "the late answer does not serve"
    );
    assert_eq!(
        pc.ask(&k, RequestId(1)),
        Presence::Absent,
        "a request told the key is absent was told otherwise later"
    );
    assert_eq!(pc.stats().late_answers, 1, "{:?}", pc.stats());
    pc.finish_request(RequestId(1));
    pc.finish_request(RequestId(2));
    assert_eq!((pc.tracked_keys(), pc.leased_keys()), (0, 0));
}

/// A slow probe past the tier's `probe_budget_s`: the asking request is told `Miss` within
/// the budget, and the late answer serves the next request ("a late answer still serves
/// later lookups").
#[test]
fn a_late_probe_answer_serves_the_next_request() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("slow", BS))));
    let opts = kv_tier::TierOptions {
        probe_budget_s: Some(0.01),
        ..Default::default()
    };
    // the probe deadline far past the budget: the probe is held, not timed out
    let m = kv_tier::builder(dram_cfg(8, BS, r#", "probe_timeout_s": 60"#))
        .unwrap()
        .tier_with_options(f.clone(), opts)
        .build_blocking()
        .unwrap();
    let k = test_key(1);
    let r = m.runtime().block_on(store_keys(&**f.inner(), &[k], 0, BS));
    assert!(r.is_success());
    // the probe answers only once the gate opens: `Miss` while it is shut is the budget's
    let gate = f.hold_lookups();
    let r1 = RequestContext::new(1);
    assert_eq!(
        settle_lookup(&m, &k, &r1, Duration::from_secs(30)).0,
        LookupResult::Miss
    );
    assert!(!gate.is_open());
    m.on_schedule_end();
    gate.open();
    block_on_idle(&m); // the late answer lands
    let r2 = RequestContext::new(2);
    let v = m.lookup(&k, &r2);
    assert_eq!(
        v,
        LookupResult::HitPending,
        "the late answer did not serve the next request"
    );
    assert_eq!(
        settle_lookup(&m, &k, &r2, Duration::from_secs(30)).0,
        LookupResult::Hit
    );
    assert!(load_and_verify(&m, &[k]));
    m.on_schedule_end();
    m.on_request_finished(r1.id);
    m.on_request_finished(r2.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
