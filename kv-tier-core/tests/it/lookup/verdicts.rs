//! Verdicts (`Retry`, `HitPending`, `Hit`, `Miss`) as an engine's steps see them: a step's end
//! sends its probes, verdicts change only at step boundaries, `lookup_prefix` never counts past a
//! miss and its hits load.

use std::time::{Duration, Instant};

use LookupResult::{Hit, HitPending, Miss, Retry};
use kv_tier::count_prefix;
use kv_tier_core::{BlockKey, LookupResult, RequestContext, RequestId};
use kv_tier_testkit::{store_keys, temp_root, test_key};

use crate::support::*;

/// The end of a step sends the probes its lookups queued, on its own: the tier sees them
/// without the engine calling anything else.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_end_of_a_step_sends_its_probes() {
    let t = mem("fs");
    let keys: Vec<_> = (0..4).map(test_key).collect();
    seed(&*t, &keys).await;
    let fx = evented_manager(8, vec![t.clone()]).await;
    let req = RequestContext::new(1);
    assert_eq!(step(&fx.m, &keys, &req), vec![LookupResult::Retry; 4]);
    wait_until_async("the step's probe sent", SETTLE_LIMIT, || {
        t.lookup_counts() == (4, 1)
    })
    .await;
}

/// Promise (kv-tier-core/src/manager/mod.rs, `lookup_prefix`): "Looks up `keys` in prefix
/// order and counts the contiguous run of hits. Stops at the first `Miss`"; `lookup_many`:
/// "it stops after the first `Miss`, so the result may be shorter than `keys`"; `Hit`: "In
/// DRAM and readable now". Over a prefix whose 5th block exists nowhere: the count never
/// passes it, `lookup_prefix` agrees with the verdicts of `lookup_many` in the same step, and
/// the blocks counted as hits are loadable with their bytes at every step.
#[test]
fn lookup_prefix_never_counts_past_a_miss_and_its_hits_load() {
    let root = temp_root();
    let fs = open_fs(root.path(), BS);
    let m = build_with(mcfg(16, r#", "probe_timeout_s": 30"#), vec![fs.clone()]);
    let prefix: Vec<BlockKey> = (0..8).map(|i| test_key(80 + i)).collect();
    let stored: Vec<BlockKey> = prefix
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 4)
        .map(|(_, k)| *k)
        .collect();
    engine_store(&m, RequestId(1), &stored);
    m.on_request_finished(RequestId(1));
    block_on_jobs(&m);
    assert_eq!(block_on(&m, m.reset_cache()), 0);
    let r = ctx(2);
    let t0 = Instant::now();
    loop {
        let verdicts = m.lookup_many(&prefix, &r);
        if let Some(p) = verdicts.iter().position(|v| *v == Miss) {
            assert_eq!(
                p + 1,
                verdicts.len(),
                "lookup_many went on past a Miss: {verdicts:?}"
            );
            assert_eq!(p, 4, "a stored block missed: {verdicts:?}");
        }
        let c = count_prefix(verdicts.iter().copied());
        let found = m.lookup_prefix(&prefix, &r);
        assert_eq!(
            (found.hit, found.present, found.retry),
            (c.hit, c.present, c.retry),
            "lookup_prefix disagrees with lookup_many in the same step: {verdicts:?}"
        );
        assert!(
            found.hit <= found.present && found.present <= 4,
            "{found:?}"
        );
        if found.hit > 0 {
            load_verify(&m, &prefix[..found.hit]);
        }
        m.on_schedule_end();
        if found.hit == 4 && verdicts.len() == 5 {
            break;
        }
        assert!(
            t0.elapsed() < SETTLE_LIMIT,
            "never reached 4 hits: {found:?} {verdicts:?}"
        );
        // the scheduler's next step (the checks hold at every step)
        std::thread::sleep(Duration::from_millis(3));
    }
    m.on_request_finished(r.id);
    assert_nothing_left(&m, &prefix);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/mod.rs, `TieringManager`): "Completed jobs and probes
/// are applied at the first call of a step and at [`TieringManager::on_schedule_end`], so
/// verdicts change only there." A probe answer that arrives in the middle of a step does not
/// change the verdicts of that step (`lookup`, `lookup_many`, `lookup_prefix`); the next
/// step sees it.
#[test]
fn verdicts_change_only_at_step_boundaries() {
    let (mem, faulty) = faulty_mem();
    let rt = runtime();
    let (k, k2) = (test_key(201), test_key(202));
    assert!(rt.block_on(store_keys(&*mem, &[k], 0, BS)).is_success());
    let m = build_with(mcfg(4, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let gate = faulty.hold_lookups();
    let r = ctx(1);
    assert_eq!(m.lookup_many(&[k, k2], &r), vec![Retry, Retry]);
    m.on_schedule_end();
    block_on(&m, async {
        tokio::time::timeout(SETTLE_LIMIT, gate.wait_arrived(1)).await
    })
    .unwrap();
    // a new step starts with this call; the answer is still held
    assert_eq!(m.lookup(&k, &r), Retry);
    gate.open();
    std::thread::sleep(Duration::from_millis(300)); // the answer arrives mid-step
    assert_eq!(m.lookup(&k, &r), Retry, "an answer was applied mid-step");
    assert_eq!(m.lookup_many(&[k, k2], &r), vec![Retry, Retry], "mid-step");
    let c = m.lookup_prefix(&[k, k2], &r);
    assert_eq!((c.hit, c.present, c.retry), (0, 0, true), "mid-step");
    assert!(m.prepare_load(&[k]).is_err());
    m.on_schedule_end();
    assert_eq!(
        m.lookup_many(&[k, k2], &r),
        vec![HitPending, Miss],
        "the next step"
    );
    m.on_schedule_end();
    let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
    assert_eq!(end, Hit, "{seen:?}");
    load_verify(&m, &[k]);
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_nothing_left(&m, &[k, k2]);
    m.shutdown_blocking().unwrap();
}
