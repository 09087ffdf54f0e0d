//! Extreme sizes: DRAM of one block, pools smaller than a slot, odd block sizes that round-trip
//! through DRAM and fs, huge prefixes and lookups.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_tier::{BlockKey, Error, KvTierConfig, LookupResult, RequestContext, RequestId};
use kv_tier_testkit::{FaultyTier, MemoryTier, test_key, verify_block};

use crate::support::*;

/// Block sizes that are valid but awkward for O_DIRECT (1, 3, 511, 4097 bytes) and DRAM of exactly
/// one slot: stored to fs (direct I/O, checksums) and loaded back byte for byte.
#[test]
fn awkward_block_sizes_round_trip_through_fs() {
    watch_panics();
    let mut bad = Vec::new();
    for (bs, cpu) in [
        (1u64, 1u64 << 20),
        (3, 1 << 20),
        (511, 1 << 20),
        (4097, 1 << 20),
        (4096, 4096),
        (65536, 65536),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let text = serde_json::json!({
            "cpu_bytes_to_use": cpu, "block_size_bytes": bs,
            "layout": {"model_name": "m", "dtype": "f", "tokens_per_hash": 16},
            "secondary_tiers": [{"type": "fs", "root_dir": dir.path(), "checksum": "crc32c", "direct_io": true}]
        })
        .to_string();
        let m = match KvTierConfig::from_json_str(&text).and_then(try_build) {
            Ok(m) => m,
            Err(e) => {
                bad.push(format!("block {bs}, cpu {cpu}: does not build: {e}"));
                continue;
            }
        };
        let want = if cpu / bs.div_ceil(4096).max(1) / 4096 >= 2 {
            2
        } else {
            1
        };
        let n = roundtrip(&m, want, 8, 300);
        if n != want as usize {
            bad.push(format!("block {bs}, cpu {cpu}: {n}/{want} came back"));
        }
        m.shutdown_blocking().unwrap();
    }
    let p = take_panics();
    assert!(bad.is_empty() && p.is_empty(), "{bad:#?}\npanics: {p:#?}");
}

/// Promise (kv-tier-cpu/README.md, kv-tier-core/src/config/mod.rs): the pool holds
/// "`capacity_bytes / slot_size` blocks, where the slot size is the block size rounded up to
/// a page"; "`cpu_bytes_to_use` ... Must hold at least one block". A pool of exactly one
/// block works (each store evicts the previous one, a pinned one blocks the next store), and
/// a block size that is not a multiple of a page round-trips its exact length.
#[test]
fn one_block_pools_and_odd_block_sizes() {
    for bs in [4096usize, 1, 5000, 4097, 12_289] {
        let slot = slot_of(bs);
        let m = build(dram_cfg(1, bs, ""));
        assert_eq!(m.stats().primary.capacity_blocks, 1, "bs {bs}");
        assert_eq!(m.block_size(), bs);
        let (a, b, c) = (test_key(1), test_key(2), test_key(3));
        assert!(store_evicting(&m, 1, &[a]).is_empty());
        assert_eq!(store_evicting(&m, 1, &[b]), vec![a], "bs {bs}");
        assert!(!is_hit(&m, &a) && is_hit(&m, &b));
        assert!(matches!(
            m.prepare_store(&[a, c]),
            Err(Error::CapacityExhausted { .. })
        ));
        let v = m.prepare_load(&[b]).unwrap();
        assert_eq!(v[0].len(), bs);
        assert!(verify_block(&b, 0, v[0].as_slice()), "bs {bs}");
        assert!(
            matches!(m.prepare_store(&[c]), Err(Error::CapacityExhausted { .. })),
            "bs {bs}: the one slot is pinned"
        );
        assert!(verify_block(&b, 0, v[0].as_slice()));
        drop(v);
        assert_eq!(store_evicting(&m, 1, &[c]), vec![b]);
        let st = m.stats().primary;
        assert_eq!(
            (st.evictions, st.ready_blocks, st.refused_stores),
            (2, 1, 2),
            "bs {bs}"
        );
        drop(m);
        // one byte short of a second slot is still one slot; short of one slot is refused
        let cfg2 = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}}}"#,
            2 * slot - 1
        ))
        .unwrap();
        assert_eq!(build(cfg2).stats().primary.capacity_blocks, 1, "bs {bs}");
        let short = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}}}"#,
            slot - 1
        ));
        let err = match short {
            Err(e) => e.to_string(),
            Ok(c) => match kv_tier::builder(c) {
                Err(e) => e.to_string(),
                Ok(b) => b.build_blocking().map(|_| ()).unwrap_err().to_string(),
            },
        };
        assert!(err.contains("cpu_bytes_to_use"), "bs {bs}: {err}");
    }
}

/// DRAM of exactly one block, over the fs tier: blocks cascade, evict each other, and come
/// back from fs with their bytes.
#[test]
fn one_block_of_dram_over_fs() {
    let dir = tempfile::tempdir().unwrap();
    let m = kv_tier::builder(fs_manager_config(
        dir.path(),
        1,
        BS,
        r#", "checksum": "crc32c""#,
    ))
    .unwrap()
    .build_blocking()
    .unwrap();
    assert_eq!(m.stats().primary.capacity_blocks, 1);
    let keys: Vec<BlockKey> = (0..5).map(test_key).collect();
    for (i, k) in keys.iter().enumerate() {
        engine_store(&m, RequestId(i as u64), &[*k]);
        m.on_request_finished(RequestId(i as u64));
        block_on_idle(&m);
    }
    assert_eq!(m.stats().tiers[0].blocks_stored, 5);
    for (i, k) in keys.iter().enumerate() {
        let req = RequestContext::new(100 + i as u64);
        let v = settle_lookup(&m, k, &req, Duration::from_secs(5)).0;
        assert_eq!(v, LookupResult::Hit, "{k}");
        assert!(load_and_verify(&m, &[*k]));
        m.on_schedule_end();
        m.on_request_finished(req.id);
    }
    // a two-block prefix cannot fit: the second is a miss, not a hang or an eviction of the first
    let req = RequestContext::new(200);
    let t0 = Instant::now();
    let c = loop {
        let c = m.lookup_prefix(&keys[..2], &req);
        if !c.retry && c.hit == c.present {
            break c;
        }
        step_and_wait(&m);
        assert!(t0.elapsed() < Duration::from_secs(5), "{c:?}");
    };
    assert!(c.hit <= 1, "{c:?}");
    assert!(load_and_verify(&m, &keys[..c.hit]));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// Block sizes 1 and odd, over fs with checksums: round trips through fs are exact.
#[test]
fn odd_block_sizes_round_trip_through_fs() {
    for bs in [1usize, 7, 4097, 65537] {
        let dir = tempfile::tempdir().unwrap();
        let m = kv_tier::builder(fs_manager_config(
            dir.path(),
            4,
            bs,
            r#", "checksum": "crc32c""#,
        ))
        .unwrap()
        .build_blocking()
        .unwrap();
        let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
        engine_store(&m, RequestId(1), &keys);
        m.on_request_finished(RequestId(1));
        block_on_idle(&m);
        let s = m.stats();
        assert_eq!(
            s.tiers[0].blocks_stored, 3,
            "bs {bs}: {:?}",
            s.tiers[0].store_failure_causes
        );
        m.runtime().block_on(m.reset_cache());
        let req = RequestContext::new(2);
        let t0 = Instant::now();
        loop {
            let c = m.lookup_prefix(&keys, &req);
            if c.hit == keys.len() {
                break;
            }
            assert!(c.present == keys.len() || c.retry, "bs {bs}: {c:?}");
            step_and_wait(&m);
            assert!(t0.elapsed() < Duration::from_secs(5), "bs {bs}: {c:?}");
        }
        assert!(load_and_verify(&m, &keys), "bs {bs}");
        m.on_schedule_end();
        m.on_request_finished(req.id);
        assert_clean(&m);
        m.shutdown_blocking().unwrap();
    }
}

/// A pool smaller than one page-rounded slot: refused at construction naming the field, or
/// it holds at least the one block the config promised (`cpu_bytes_to_use`: "Must hold at
/// least one block").
#[test]
fn a_pool_smaller_than_one_rounded_slot() {
    for (cpu, bs) in [(5000u64, 4097u64), (1, 1), (4095, 7)] {
        let c = KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": {cpu}, "block_size_bytes": {bs}}}"#
        ));
        let c = match c {
            Err(e) => {
                assert!(e.to_string().contains("cpu_bytes_to_use"), "{e}");
                continue;
            }
            Ok(c) => c,
        };
        match kv_tier::builder(c).and_then(|b| b.build_blocking()) {
            Err(e) => assert!(
                e.to_string().contains("cpu_bytes_to_use"),
                "({cpu}, {bs}): {e}"
            ),
            Ok(m) => {
                let cap = m.stats().primary.capacity_blocks;
                let r = m.prepare_store(&[test_key(1)]).map(|p| p.keys().len());
                assert!(
                    cap >= 1 && r.is_ok(),
                    "({cpu}, {bs}): accepted, but the pool holds {cap} blocks and a store of one gives {r:?}"
                );
            }
        }
    }
}

/// Many keys in one lookup, present in a tier, with a small DRAM: non-blocking, bounded by
/// DRAM, every hit right, everything released at the end.
#[test]
fn a_huge_prefix_over_a_small_dram() {
    let t = Script::new("mem", BS);
    let m = build_with(dram_cfg(8, BS, ""), vec![t.clone()]);
    let keys: Vec<BlockKey> = (0..2000).map(test_key).collect();
    put(&m, &t, &keys);
    let req = RequestContext::new(1);
    let t0 = Instant::now();
    let c = loop {
        // (that a lookup does not wait for the tier is shown without a clock by
        // `a_huge_lookup_returns_while_the_tier_has_not_answered`)
        let c = m.lookup_prefix(&keys, &req);
        if !c.retry && c.hit == c.present {
            break c;
        }
        step_and_wait(&m);
        assert!(t0.elapsed() < Duration::from_secs(60), "{c:?}");
    };
    assert!(c.hit >= 1 && c.hit <= 8, "{c:?}");
    assert!(load_and_verify(&m, &keys[..c.hit]));
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// 200k keys, nothing anywhere, over fs: all settle to Miss, and nothing is left behind.
/// (That one lookup call does not wait for the tier is shown without a clock by
/// `a_huge_lookup_returns_while_the_tier_has_not_answered`.)
#[test]
fn a_huge_lookup_of_missing_keys_over_fs() {
    let dir = tempfile::tempdir().unwrap();
    let m = kv_tier::builder(fs_manager_config(dir.path(), 8, BS, ""))
        .unwrap()
        .build_blocking()
        .unwrap();
    let keys: Vec<BlockKey> = (0..200_000).map(test_key).collect();
    let req = RequestContext::new(1);
    let v = m.lookup_many(&keys, &req);
    assert!(v.iter().all(|r| *r == LookupResult::Retry));
    m.on_schedule_end();
    let t0 = Instant::now();
    loop {
        let v = m.lookup_many(&keys, &req);
        if v[0] == LookupResult::Miss {
            break;
        }
        step_and_wait(&m);
        assert!(t0.elapsed() < Duration::from_secs(60), "never settled");
    }
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// 200k keys asked of a tier whose existence checks are held: `lookup_many` and
/// `on_schedule_end` return while no answer can have come (the probe is sent off the
/// caller's thread); once the tier answers, every key settles to Miss.
#[test]
fn a_huge_lookup_returns_while_the_tier_has_not_answered() {
    let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let gate = t.hold_lookups();
    let m = build_with(
        dram_cfg(8, BS, r#", "probe_timeout_s": 600"#),
        vec![t.clone()],
    );
    let keys: Vec<BlockKey> = (0..200_000).map(test_key).collect();
    let req = RequestContext::new(1);
    let v = m.lookup_many(&keys, &req);
    assert!(v.iter().all(|r| *r == LookupResult::Retry));
    m.on_schedule_end();
    wait_until("the probe reached the tier", LIMIT, || gate.arrived() > 0);
    assert!(!gate.is_open(), "returned only once the tier could answer");
    assert!(
        m.lookup_many(&keys, &req)
            .iter()
            .all(|r| *r == LookupResult::Retry),
        "a verdict without an answer"
    );
    gate.open();
    let t0 = Instant::now();
    loop {
        let v = m.lookup_many(&keys, &req);
        if v.iter().all(|r| *r == LookupResult::Miss) {
            break;
        }
        step_and_wait(&m);
        assert!(t0.elapsed() < Duration::from_secs(60), "never settled");
    }
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}
