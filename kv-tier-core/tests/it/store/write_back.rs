//! Write-back bounds per tier (`write_back_limit_mb`, policies `drop` and `wait`) and the DRAM they
//! pin (`write_back_max_dram_fraction`): limits hold under any interleaving, a refusal changes
//! nothing, an aborted store gives its reservation back.

use std::sync::Arc;

use kv_tier_core::{Error, KvTierConfig, RequestId, WriteBackPolicy};
use kv_tier_testkit::{FaultyTier, MemoryTier, fill_block, test_key};

use crate::support::*;

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
    let m = two_tier_manager(64, a.clone(), b.clone(), |_, o| {
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
    try_engine_store(&m, RequestId(1), &keys).unwrap();
    let s = m.stats();
    assert_eq!(
        s.tiers[1].writes_dropped, 3,
        "the drop tier took more than its limit"
    );
    assert_eq!(s.tiers[1].write_back_bytes, 2 * BS as u64);
    assert_eq!(s.tiers[0].writes_dropped, 0, "a wait tier dropped");
    assert_eq!(s.tiers[0].write_back_bytes, 5 * BS as u64);
    // the wait tier is over its limit: new stores are refused, naming it
    match try_engine_store(&m, RequestId(1), &[test_key(9)]).unwrap_err() {
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
    try_engine_store(&m, RequestId(1), &[test_key(9)]).unwrap();
}

/// DRAM pinned by write-back stays under `write_back_max_dram_fraction` of the pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dram_pinned_by_write_back_stays_under_its_fraction() {
    let (a, b_inner, b) = two_tiers();
    drop(a);
    let other = Arc::new(MemoryTier::new("a", BS));
    let m = two_tier_manager(20, other, b.clone(), |c, o| {
        c.write_back_max_dram_fraction = 0.2; // 4 of 20 slots
        o[0].write_back_policy = Some(WriteBackPolicy::Drop);
    })
    .await;
    let g = b.hold_stores();
    let keys: Vec<_> = (0..10).map(test_key).collect();
    for k in &keys {
        try_engine_store(&m, RequestId(1), &[*k]).unwrap();
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
    let (a_inner, b_inner, b) = two_tiers();
    let m = two_tier_manager(64, a_inner.clone(), b.clone(), |_, o| {
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
    try_engine_store(
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
    let (a_inner, b_inner, b) = two_tiers();
    let m = two_tier_manager(64, a_inner.clone(), b.clone(), |c, o| {
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

/// Promise (kv-tier-core/src/manager/mod.rs `prepare_store`): "Where a tier's write-back
/// policy is `wait`, refused with [`Error::WriteBackFull`] (changing nothing) when the new
/// blocks would take its write-back past its limit, ... counting the stores prepared and not
/// yet completed"; stats: `stores_refused_for_write_back`, and `refused_stores` is "for lack
/// of room" only. The refusal evicts nothing from DRAM.
#[test]
fn a_write_back_refusal_changes_nothing_in_dram() {
    let dir = tempfile::tempdir().unwrap();
    let limit_mb = (2 * BS) as f64 / (1u64 << 20) as f64;
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, {},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "write_back_policy": "wait",
              "write_back_limit_mb": {limit_mb}}}]}}"#,
        4 * BS,
        LAYOUT,
        dir.path()
    ))
    .unwrap();
    let m = build(c);
    for i in 0..4 {
        store_evicting(&m, 1, &[test_key(i)]);
        block_on_idle(&m);
    }
    let mut p1 = m.prepare_store(&[test_key(10), test_key(11)]).unwrap();
    assert_eq!(p1.evicted().len(), 2);
    let before = m.stats();
    let resident: Vec<_> = (0..4).map(test_key).filter(|kk| is_hit(&m, kk)).collect();
    assert_eq!(resident.len(), 2);
    match m.prepare_store(&[test_key(12)]) {
        Err(Error::WriteBackFull { .. }) => {}
        Err(e) => panic!("wrong refusal: {e}"),
        Ok(p) => panic!("accepted past the write-back limit: {:?}", p.keys()),
    }
    let after = m.stats();
    assert_eq!(
        after.primary.evictions, before.primary.evictions,
        "the refusal evicted"
    );
    assert_eq!(after.primary.refused_stores, before.primary.refused_stores);
    assert_eq!(
        after.stores_refused_for_write_back,
        before.stores_refused_for_write_back + 1
    );
    assert_eq!(after.primary.writing_blocks, 2);
    for kk in &resident {
        assert!(is_hit(&m, kk), "{kk} lost to a refused store");
    }
    for (key, sk) in p1.slots() {
        fill_block(key, 0, sk.as_mut_slice());
    }
    p1.commit(RequestId(1));
    block_on_idle(&m);
    store_evicting(&m, 1, &[test_key(12)]);
    block_on_idle(&m);
    m.shutdown_blocking().unwrap();
}

/// A `wait` tier's reservation by a prepared store is given back when the store is dropped
/// uncommitted: the next store is not refused forever.
#[test]
fn an_aborted_store_gives_back_its_write_back_reservation() {
    let c = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS},
            "secondary_tiers": [{{"type": "memory", "write_back_policy": "wait", "write_back_limit_mb": 0.0078125}}]}}"#,
        64 * BS
    ))
    .unwrap();
    let mut reg = kv_tier::registry();
    MemoryTier::register(&mut reg).unwrap();
    let m = kv_tier::builder(c)
        .unwrap()
        .registry(reg)
        .build_blocking()
        .unwrap();
    // the limit: 2 blocks
    for round in 0..10u64 {
        let keys = [test_key(round * 2), test_key(round * 2 + 1)];
        let p = m
            .prepare_store(&keys)
            .unwrap_or_else(|e| panic!("round {round}: {e}"));
        drop(p);
    }
    // and a prepared store that is refused does not reserve anything either
    let p = m.prepare_store(&[test_key(500), test_key(501)]).unwrap();
    let refused = m.prepare_store(&[test_key(502), test_key(503)]);
    assert!(
        matches!(refused, Err(Error::WriteBackFull { .. })),
        "{refused:?}"
    );
    drop(p);
    engine_store(&m, RequestId(1), &[test_key(600), test_key(601)]);
    m.on_request_finished(RequestId(1));
    block_on_idle(&m);
    assert_eq!(m.stats().tiers[0].blocks_stored, 2);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
