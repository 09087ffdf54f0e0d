//! Admission: `store_threshold` (DRAM admits a block once that many distinct requests looked it up;
//! nothing not admitted cascades), `max_tracker_size`, and per tier `admit_after_lookups` and
//! `write_budget_mb_per_s`.

use kv_tier::{BlockKey, KvTierConfig, LookupResult, RequestContext, RequestId, TieringManager};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{MemoryTier, fill_block, test_key};

use crate::support::*;

/// Promise (kv-tier-core/src/config/mod.rs `store_threshold`): "a block enters DRAM
/// (`prepare_store` admits it) only once this many distinct requests have looked it up
/// (default 0; 0 and 1: every block, as in vLLM ...). ... a request asking again while it
/// waits counts once"; stats: `stores_not_admitted`: "Keys `prepare_store` left out because
/// lookups had not asked for them `store_threshold` times".
#[test]
fn store_threshold_admits_after_n_distinct_requests() {
    // 1: every block, even one no lookup asked for
    let m = build(dram_cfg(8, BS, r#", "store_threshold": 1"#));
    let p = m.prepare_store(&[test_key(1)]).unwrap();
    assert_eq!(
        p.keys(),
        vec![test_key(1)],
        "store_threshold 1 must admit every block"
    );
    drop(p);
    let m = build(dram_cfg(8, BS, r#", "store_threshold": 3"#));
    let key = test_key(7);
    let admitted = |m: &TieringManager| -> bool {
        let mut p = m.prepare_store(&[key]).unwrap();
        let ok = !p.slots().is_empty();
        for (kk, s) in p.slots() {
            fill_block(kk, 0, s.as_mut_slice());
        }
        p.commit(RequestId(42));
        ok
    };
    assert!(!admitted(&m), "admitted with no lookup");
    assert_eq!(m.stats().stores_not_admitted, 1);
    // request 1 asks three times: counts once
    let r1 = RequestContext::new(1);
    for _ in 0..3 {
        assert_eq!(m.lookup(&key, &r1), LookupResult::Miss);
        m.on_schedule_end();
    }
    assert!(
        !admitted(&m),
        "one request asking thrice counted more than once"
    );
    m.on_request_finished(r1.id);
    let r2 = RequestContext::new(2);
    assert_eq!(m.lookup(&key, &r2), LookupResult::Miss);
    m.on_schedule_end();
    m.on_request_finished(r2.id);
    assert!(!admitted(&m), "two distinct requests, threshold 3");
    assert_eq!(m.stats().stores_not_admitted, 3);
    // a lookup_prefix is a lookup too
    let r3 = RequestContext::new(3);
    m.lookup_prefix(&[key], &r3);
    m.on_schedule_end();
    assert!(admitted(&m), "three distinct requests looked it up");
    assert_eq!(m.lookup(&key, &RequestContext::new(4)), LookupResult::Hit);
    assert_eq!(m.stats().stores_not_admitted, 3);
}

/// Promise (kv-tier-core/src/config/mod.rs `max_tracker_size`): "how many keys the lookup
/// counts of `store_threshold` ... remember, least recently asked forgotten first".
#[test]
fn max_tracker_size_forgets_the_least_recently_asked_key() {
    let m = build(dram_cfg(
        8,
        BS,
        r#", "store_threshold": 2, "max_tracker_size": 2"#,
    ));
    let (a, b, c) = (test_key(1), test_key(2), test_key(3));
    let admitted = |key: BlockKey| -> bool {
        let mut p = m.prepare_store(&[key]).unwrap();
        let ok = !p.slots().is_empty();
        for (kk, s) in p.slots() {
            fill_block(kk, 0, s.as_mut_slice());
        }
        p.commit(RequestId(42));
        ok
    };
    let r1 = RequestContext::new(1);
    for key in [a, b, c] {
        m.lookup(&key, &r1);
    }
    m.on_schedule_end();
    // a was asked least recently: forgotten; c is remembered
    let r2 = RequestContext::new(2);
    m.lookup(&a, &r2);
    m.lookup(&c, &r2);
    m.on_schedule_end();
    assert!(admitted(c), "c asked by two requests, still tracked");
    assert!(!admitted(a), "a was forgotten: one count, not two");
    let r3 = RequestContext::new(3);
    m.lookup(&a, &r3);
    m.on_schedule_end();
    assert!(admitted(a));
}

/// Promise (kv-tier-core/src/config/mod.rs `store_threshold`): "vLLM refuses it for its
/// tiering spec; here it applies with secondary tiers too". A block DRAM does not admit is
/// not cascaded either (nothing stored, no cascade counted), and is once admitted.
#[test]
fn store_threshold_gates_the_cascade_too() {
    let dir = tempfile::tempdir().unwrap();
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "store_threshold": 2, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}}}]}}"#,
        16 * BS,
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    let key = test_key(3);
    store_evicting(&m, 1, &[key]);
    block_on_idle(&m);
    let fs = m.tier::<kv_tier::fs::FsTier>("fs").unwrap();
    assert_eq!(fs.stats().blocks.blocks_written, 0);
    assert_eq!(m.stats().cascades, 0);
    for r in [10u64, 11] {
        let req = RequestContext::new(r);
        for _ in 0..3 {
            let v = m.lookup(&key, &req);
            assert!(
                matches!(v, LookupResult::Retry | LookupResult::Miss),
                "{v:?}"
            );
            m.on_schedule_end();
            block_on_idle(&m);
        }
        m.on_request_finished(req.id);
    }
    store_evicting(&m, 1, &[key]);
    block_on_idle(&m);
    assert!(is_hit(&m, &key));
    assert_eq!(fs.stats().blocks.blocks_written, 1);
    assert_eq!(m.stats().cascades, 1);
    m.shutdown_blocking().unwrap();
}

#[test]
fn store_threshold_admits_to_dram_only_blocks_looked_up_that_often() {
    let m = memory_manager(r#", "store_threshold": 2"#, "");
    let req = kv_tier::RequestContext::new(1);
    let (a, b) = (test_key(1), test_key(2));
    // one lookup each: neither is admitted yet
    m.lookup_prefix(&[a, b], &req);
    let mut p = m.prepare_store(&[a, b]).unwrap();
    assert!(p.slots().is_empty(), "no slot before the second lookup");
    drop(p);
    assert_eq!(m.stats().stores_not_admitted, 2);
    // the same request asking again (polling while it waits) does not count twice
    m.lookup(&a, &req);
    let mut p = m.prepare_store(&[a]).unwrap();
    assert!(p.slots().is_empty(), "one request asked, twice");
    drop(p);
    // another request's lookup of a: two requests asked for it (b, past the miss at a,
    // was asked for by one)
    m.lookup(&a, &kv_tier::RequestContext::new(2));
    let mut p = m.prepare_store(&[a, b]).unwrap();
    let slots: Vec<BlockKey> = p.slots().iter().map(|(k, _)| *k).collect();
    assert_eq!(slots, [a], "a asked twice, b once");
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(RequestId(1));
    assert_eq!(m.lookup(&a, &req), kv_tier::LookupResult::Hit);
    assert_eq!(m.stats().stores_not_admitted, 4);
}

#[test]
fn a_tier_admits_after_n_lookups_and_within_its_write_budget() {
    // 1 MiB/s of 64 KiB blocks: a bucket of 16 blocks, then 16 a second
    let m = memory_manager(
        "",
        r#"{"type": "memory", "name": "ssd", "admit_after_lookups": 2},
           {"type": "memory", "name": "budget", "write_budget_mb_per_s": 1},
           {"type": "memory", "name": "all"}"#,
    );
    let (r1, r2) = (
        kv_tier::RequestContext::new(1),
        kv_tier::RequestContext::new(2),
    );
    let twice: Vec<_> = (0..4).map(test_key).collect();
    let once: Vec<_> = (10..30).map(test_key).collect();
    m.lookup_prefix(&twice, &r1);
    m.lookup_prefix(&twice, &r2);
    // one request polling: counts once
    m.lookup_prefix(&once, &r1);
    m.lookup_prefix(&once, &r1);
    let mut all = twice.clone();
    all.extend(&once);
    engine_store(&m, RequestId(1), &all);
    m.runtime().block_on(m.wait_idle());
    let tier = |n: &str| m.tier::<kv_tier_testkit::MemoryTier>(n).unwrap();
    assert_eq!(tier("all").len(), 24);
    let ssd = tier("ssd");
    assert_eq!(ssd.len(), 4, "only the blocks asked for twice");
    assert!(twice.iter().all(|k| ssd.get(k).is_some()));
    assert!(
        (16..=17).contains(&tier("budget").len()),
        "one second of budget (16 blocks, one more if the clock ticked): {}",
        tier("budget").len()
    );
    let s = m.stats();
    let by = |n: &str| s.tiers.iter().find(|t| t.name == n).unwrap();
    assert_eq!(by("ssd").not_admitted, 20);
    assert_eq!(by("ssd").over_write_budget, 0);
    assert_eq!(
        by("budget").over_write_budget + tier("budget").len() as u64,
        24,
        "every block written or counted"
    );
    assert_eq!(
        (by("all").not_admitted, by("all").over_write_budget),
        (0, 0)
    );
}

/// "a request asking again while it waits counts once": two requests polling alternately
/// are still two requests.
#[test]
fn store_threshold_counts_requests_not_interleaved_polls() {
    let m = memory_manager(r#", "store_threshold": 3"#, "");
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    let a = test_key(1);
    m.lookup(&a, &r1);
    m.lookup(&a, &r2);
    m.lookup(&a, &r1); // r1 polling again
    m.lookup(&a, &r2); // r2 polling again
    let mut p = m.prepare_store(&[a]).unwrap();
    assert!(
        p.slots().is_empty(),
        "only 2 requests asked, store_threshold 3"
    );
}

#[test]
fn admit_after_lookups_counts_requests_not_interleaved_polls() {
    let m = memory_manager(
        "",
        r#"{"type": "memory", "name": "ssd", "admit_after_lookups": 3}"#,
    );
    let (r1, r2) = (RequestContext::new(1), RequestContext::new(2));
    let a = test_key(1);
    for _ in 0..3 {
        m.lookup_prefix(&[a], &r1);
        m.lookup_prefix(&[a], &r2);
    }
    engine_store(&m, RequestId(1), &[a]);
    m.runtime().block_on(m.wait_idle());
    let ssd = m.tier::<MemoryTier>("ssd").unwrap();
    assert_eq!(ssd.len(), 0, "2 requests asked; 3 required");
    assert_eq!(m.stats().tiers[0].not_admitted, 1);
}

#[test]
fn exact_write_budget_and_admission_do_not_charge_each_other() {
    // 0.125 MiB/s of 64 KiB blocks: a bucket of 2 blocks
    let m = memory_manager(
        "",
        r#"{"type": "memory", "name": "b", "write_budget_mb_per_s": 0.125},
           {"type": "memory", "name": "ab", "admit_after_lookups": 1, "write_budget_mb_per_s": 0.0625}"#,
    );
    let r = RequestContext::new(1);
    let keys: Vec<_> = (0..5).map(test_key).collect();
    // only keys[3] and keys[4] asked for
    m.lookup(&keys[3], &r);
    m.lookup(&keys[4], &r);
    engine_store(&m, RequestId(1), &keys);
    m.runtime().block_on(m.wait_idle());
    let s = m.stats();
    let t = |n: &str| m.tier::<MemoryTier>(n).unwrap().len();
    assert_eq!(t("b"), 2);
    assert_eq!(
        (s.tiers[0].over_write_budget, s.tiers[0].not_admitted),
        (3, 0)
    );
    assert_eq!(t("ab"), 1, "1 block of budget, spent on an admitted key");
    assert_eq!(
        (s.tiers[1].not_admitted, s.tiers[1].over_write_budget),
        (3, 1)
    );
    let ab = m.tier::<MemoryTier>("ab").unwrap();
    assert!(ab.contains(&keys[3]));
}

#[test]
fn store_threshold_blocks_never_cascade_and_are_counted_once() {
    let m = memory_manager(r#", "store_threshold": 2"#, r#"{"type": "memory"}"#);
    let keys: Vec<_> = (0..3).map(test_key).collect();
    m.lookup_prefix(&keys, &RequestContext::new(1));
    m.lookup_prefix(&keys[..1], &RequestContext::new(2));
    engine_store(&m, RequestId(1), &keys);
    m.runtime().block_on(m.wait_idle());
    assert_eq!(m.tier::<MemoryTier>("memory").unwrap().len(), 1);
    assert_eq!(m.stats().stores_not_admitted, 2);
    assert_eq!(m.stats().tiers[0].not_admitted, 0);
}
