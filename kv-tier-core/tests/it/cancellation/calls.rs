//! `wait_idle`, `wait_jobs`, `reset_cache` and `shutdown` dropped at any point: the work they
//! waited for still lands, a later call completes, nothing is left behind.

use std::sync::Arc;
use std::time::Duration;

use LookupResult::{Hit, HitPending, Retry};
use kv_tier::fs::FsTier;
use kv_tier::obj::ObjTier;
use kv_tier::{
    BlockKey, Error, KvTierConfig, LookupResult, RequestContext, RequestId, SecondaryTier,
};
use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};
use kv_tier_testkit::{
    FaultyTier, MemoryTier, fill_block, load_keys, store_keys, temp_root, test_key, verify_block,
};

use crate::support::*;

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `wait_idle` / `wait_jobs`) together with
/// the cancellation rule of kv-tier-core/src/tier.rs ("its future may be dropped at any await
/// point ... and the [state] must stay consistent"). `wait_idle` and `wait_jobs` dropped at
/// many points while a store, a load and a probe are parked: afterwards everything lands,
/// the blocks are served with their bytes, and nothing is left behind.
#[test]
fn wait_idle_and_wait_jobs_dropped_at_every_point_leave_nothing_behind() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let m = build_with(mcfg(6, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let (gates, [ks, kp, kq]) = park_everything(&m, &mem, &faulty, &rt);
    for i in 0..16 {
        assert!(
            block_on(&m, drop_at(m.wait_idle(), i)).is_none(),
            "wait_idle returned with work parked"
        );
        assert!(
            block_on(&m, drop_at(m.wait_jobs(), i)).is_none(),
            "wait_jobs returned with jobs parked"
        );
        assert!(m.lookup(&kp, &ctx(1)).is_present());
        m.on_schedule_end();
    }
    for g in &gates {
        g.open();
    }
    block_on_idle(&m);
    let r1 = ctx(1);
    for k in [kp, kq] {
        let (end, seen) = settle_lookup(&m, &k, &r1, SETTLE_LIMIT);
        assert_eq!(end, Hit, "{k}: {seen:?}");
        load_verify(&m, &[k]);
    }
    assert!(mem.contains(&ks), "the parked store did not land");
    m.on_schedule_end();
    m.on_request_finished(RequestId(1));
    m.on_request_finished(RequestId(2));
    assert_nothing_left(&m, &[ks, kp, kq]);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `reset_cache`): "Cancels queued
/// promotions, waits for the jobs in flight, then empties DRAM ... Returns how many blocks
/// stay in DRAM because readers still pin them"; cancellation rule of tier.rs. `reset_cache`
/// dropped at many points while work is parked; then a complete `reset_cache` returns 0 and
/// empties DRAM, and the blocks are served again from the tier with their bytes.
#[test]
fn a_reset_cache_dropped_at_every_point_then_completed() {
    let rt = runtime();
    let (mem, faulty) = faulty_mem();
    let m = build_with(mcfg(6, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
    let (gates, keys) = park_everything(&m, &mem, &faulty, &rt);
    for i in 0..16 {
        assert!(
            block_on(&m, drop_at(m.reset_cache(), i)).is_none(),
            "reset_cache returned with jobs parked"
        );
        m.on_schedule_end();
    }
    for g in &gates {
        g.open();
    }
    assert_eq!(
        block_on(&m, m.reset_cache()),
        0,
        "blocks pinned after the reset"
    );
    assert_eq!(m.stats().primary.ready_blocks, 0, "DRAM not emptied");
    m.on_request_finished(RequestId(1));
    m.on_request_finished(RequestId(2));
    assert_nothing_left(&m, &keys);
    let r = ctx(3);
    for k in keys {
        let (end, seen) = settle_lookup(&m, &k, &r, SETTLE_LIMIT);
        assert_eq!(end, Hit, "{k}: {seen:?}");
        load_verify(&m, &[k]);
    }
    m.on_schedule_end();
    m.on_request_finished(r.id);
    assert_nothing_left(&m, &keys);
    m.shutdown_blocking().unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs, `shutdown`: "Cancels queued promotions,
/// waits for jobs in flight, and shuts every tier down"; kv-tier crate docs §5: "the fs tier
/// publishes a block only whole ...; the obj tier's PUTs are whole objects"; tier.rs
/// cancellation). A manager over real fs and obj tiers with cascades in flight to a slow S3
/// server: `shutdown` dropped at several points, then completed. It succeeds; the fs root
/// has no temp file, the bucket only whole blocks; reopened, every block is absent or its
/// exact bytes.
#[test]
fn a_shutdown_dropped_midway_then_completed_over_real_fs_and_obj() {
    let rt = runtime();
    let s3 = rt.block_on(S3Server::start());
    let root = temp_root();
    let cfg = || {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 1048576, "block_size_bytes": 65536, {LAYOUT},
                "secondary_tiers": [
                  {{"type": "fs", "root_dir": {:?}, "checksum": "crc32c", "n_read_threads": 2, "n_write_threads": 2}},
                  {{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{}", "scheme": "http",
                    "access_key": "{AK}", "secret_key": "{SK}", "checksum": "crc32c", "io_threads": 2,
                    "request_timeout_s": 5, "max_retries": 0}}]}}"#,
            root.path(),
            s3.endpoint
        ))
        .unwrap()
    };
    let m = rt
        .block_on(kv_tier::builder(cfg()).unwrap().build())
        .unwrap();
    let keys: Vec<BlockKey> = (0..12).map(|i| test_key(160 + i)).collect();
    s3.set_latency(Duration::from_millis(40));
    let mut p = m.prepare_store(&keys).unwrap();
    for (k, s) in p.slots() {
        fill_block(k, 0, s.as_mut_slice());
    }
    p.commit(RequestId(1));
    m.on_request_finished(RequestId(1));
    m.on_schedule_end();
    for i in [1usize, 2, 4, 9, 11, 13, 14] {
        if let Some(r) = rt.block_on(drop_at(m.shutdown(), i)) {
            r.expect("a shutdown that ran to its end failed");
        }
    }
    rt.block_on(async { tokio::time::timeout(Duration::from_secs(60), m.shutdown()).await })
        .expect("the second shutdown hung")
        .expect("the second shutdown failed");
    let obj = m.tier::<ObjTier>("obj").unwrap();
    drop(obj);
    drop(m);
    s3.set_latency(Duration::ZERO);
    assert!(
        tmp_files_below(root.path()).is_empty(),
        "{:?}",
        tmp_files_below(root.path())
    );
    // reopened: every block absent or whole
    let m = rt
        .block_on(kv_tier::builder(cfg()).unwrap().build())
        .unwrap();
    let obj = m.tier::<ObjTier>("obj").unwrap();
    let fs = m.tier::<FsTier>("fs").unwrap();
    let paths: std::collections::BTreeSet<String> =
        keys.iter().map(|k| obj.object_path(k)).collect();
    for o in rt.block_on(list_objects(&obj)) {
        assert!(paths.contains(&o), "a stray object in the bucket: {o}");
    }
    for t in [fs.clone() as Arc<dyn SecondaryTier>, obj.clone()] {
        let (res, bytes) = rt.block_on(load_keys(&*t, &keys, 65536));
        for (k, b) in &bytes {
            assert!(verify_block(k, 0, b), "{}: {k} torn", t.info().name);
        }
        for (k, e) in &res.failed {
            assert!(
                matches!(e, Error::NotFound { .. }),
                "{}: {k}: {e}",
                t.info().name
            );
        }
    }
    assert!(tmp_files_below(root.path()).is_empty());
    rt.block_on(m.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/manager/lifecycle.rs and tier.rs cancellation). A manager
/// `shutdown` dropped at its first points with a promotion queued and a store in flight,
/// and the manager then used on: `wait_idle` returns, every request ends at `Hit` or `Miss`
/// (a `Hit` with the right bytes), nothing is left once they finish, and a later `shutdown`
/// completes.
#[test]
fn a_manager_used_on_after_a_dropped_shutdown() {
    let rt = runtime();
    for i in 1..8usize {
        let (mem, faulty) = faulty_mem();
        let m = build_with(mcfg(6, r#", "probe_timeout_s": 30"#), vec![faulty.clone()]);
        let (kp, ks) = (test_key(371), test_key(372));
        assert!(rt.block_on(store_keys(&*mem, &[kp], 0, BS)).is_success());
        let r = ctx(1);
        assert_eq!(m.lookup(&kp, &r), Retry);
        m.on_schedule_end();
        block_on_idle(&m);
        assert_eq!(m.lookup(&kp, &r), HitPending); // a promotion queued
        let stores = faulty.hold_stores();
        engine_store(&m, RequestId(2), &[ks]);
        m.on_request_finished(RequestId(2));
        let _ = block_on(&m, drop_at(m.shutdown(), i));
        stores.open();
        block_on_idle(&m);
        let (end, seen) = settle_lookup(&m, &kp, &r, SETTLE_LIMIT);
        if end == Hit {
            load_verify(&m, &[kp]);
        }
        let _ = seen;
        assert_eq!(
            m.lookup(&ks, &r),
            Hit,
            "point {i}: the engine's own store is gone from DRAM"
        );
        load_verify(&m, &[ks]);
        m.on_schedule_end();
        m.on_request_finished(r.id);
        assert_nothing_left(&m, &[kp, ks]);
        block_on(&m, async {
            tokio::time::timeout(SETTLE_LIMIT, m.shutdown()).await
        })
        .expect("the later shutdown hung")
        .expect("the later shutdown failed");
    }
}

/// `reset_cache` dropped while it waits for a promotion in flight leaves nothing behind.
#[test]
fn a_dropped_reset_cache_leaves_nothing_behind() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build_with(dram_cfg(4, BS, ""), vec![f.clone()]);
    let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
    let r = m.runtime().block_on(store_keys(&**f.inner(), &keys, 0, BS));
    assert!(r.is_success());
    let gate = f.hold_loads();
    let req = RequestContext::new(1);
    m.lookup_many(&keys, &req);
    step_and_wait(&m); // probes
    let v = m.lookup_many(&keys, &req);
    assert!(v.iter().all(|x| *x == LookupResult::HitPending), "{v:?}");
    m.on_schedule_end(); // the load is sent, held at the gate
    m.runtime().block_on(gate.wait_arrived(1));
    let r = m.runtime().block_on(async {
        tokio::time::timeout(Duration::from_millis(100), m.reset_cache()).await
    });
    assert!(
        r.is_err(),
        "reset_cache did not wait for the load in flight"
    );
    gate.open();
    block_on_idle(&m);
    let v = m.lookup_many(&keys, &req);
    for (k, x) in keys.iter().zip(&v) {
        if *x == LookupResult::Hit {
            assert!(load_and_verify(&m, &[*k]));
        }
    }
    m.on_schedule_end();
    m.on_request_finished(req.id);
    assert_clean(&m);
    // reset works afterwards, and empties DRAM
    let left = m.runtime().block_on(m.reset_cache());
    assert_eq!(left, 0);
    assert_eq!(m.stats().primary.ready_blocks, 0);
    m.shutdown_blocking().unwrap();
}

/// `wait_idle`/`wait_jobs` dropped mid-way: later waits still see the jobs land.
#[test]
fn dropped_waits_leave_nothing_behind() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build_with(dram_cfg(8, BS, ""), vec![f.clone()]);
    let gate = f.hold_stores();
    let keys: Vec<BlockKey> = (0..4).map(test_key).collect();
    engine_store(&m, RequestId(1), &keys);
    m.on_request_finished(RequestId(1));
    for _ in 0..3 {
        let r = m.runtime().block_on(async {
            tokio::time::timeout(Duration::from_millis(30), m.wait_idle()).await
        });
        assert!(r.is_err());
        let r = m.runtime().block_on(async {
            tokio::time::timeout(Duration::from_millis(30), m.wait_jobs()).await
        });
        assert!(r.is_err());
    }
    assert!(!m.is_idle());
    gate.open();
    block_on_idle(&m);
    assert!(m.is_idle());
    let s = m.stats();
    assert_eq!(s.tiers[0].blocks_stored, 4);
    assert_clean(&m);
    m.shutdown_blocking().unwrap();
}

/// `shutdown` dropped while it waits for a store in flight: a second `shutdown` still shuts
/// every tier down, and the acknowledged store is either in the tier or counted failed.
#[test]
fn a_dropped_shutdown_can_be_completed_by_a_second_one() {
    let f = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("mem", BS))));
    let m = build_with(dram_cfg(8, BS, ""), vec![f.clone()]);
    let gate = f.hold_stores();
    let k = test_key(1);
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    let r = m
        .runtime()
        .block_on(async { tokio::time::timeout(Duration::from_millis(100), m.shutdown()).await });
    assert!(r.is_err(), "shutdown did not wait for the store in flight");
    gate.open();
    let r = m
        .runtime()
        .block_on(async { tokio::time::timeout(Duration::from_secs(10), m.shutdown()).await });
    assert!(r.is_ok(), "the second shutdown hung");
    assert!(
        f.shutdowns() >= 1,
        "after a cancelled shutdown, a second shutdown never shut the tier down"
    );
    let mem = f.inner().clone();
    let present = m.runtime().block_on(mem.lookup(&[k])).unwrap()[0];
    let s = m.stats();
    assert!(
        present || s.tiers[0].store_failures > 0,
        "an acknowledged store neither landed nor was counted failed"
    );
}
