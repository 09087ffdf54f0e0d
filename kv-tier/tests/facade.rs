//! The facade's promises: the built-in tiers from one config, typed tier access, the store
//! typestate (commit, abort, drop), and dropping a manager without shutdown.

use kv_tier::{BlockKey, KvTierConfig, LookupResult, RequestContext, RequestId};
use kv_tier_testkit::{fill_block, test_key, verify_block};

const BS: usize = 65536;

fn fs_config(root: &std::path::Path, slots: usize) -> KvTierConfig {
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS},
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": {root:?}, "name": "disk"}}]}}"#,
        slots * BS
    ))
    .expect("config")
}

fn store(m: &kv_tier::TieringManager, req: RequestId, keys: &[BlockKey]) {
    let mut p = m.prepare_store(keys).expect("DRAM room");
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(req);
}

#[test]
fn typed_access_finds_the_tier_by_name_and_type_only() {
    let dir = tempfile::tempdir().unwrap();
    let m = kv_tier::builder(fs_config(dir.path(), 8))
        .unwrap()
        .build_blocking()
        .unwrap();
    let fs = m
        .tier::<kv_tier::fs::FsTier>("disk")
        .expect("the fs tier by its name");
    assert!(
        m.tier::<kv_tier::fs::FsTier>("fs").is_none(),
        "not its name"
    );
    assert!(
        m.tier::<kv_tier::obj::ObjTier>("disk").is_none(),
        "not its type"
    );
    store(&m, RequestId(1), &[test_key(1)]);
    m.runtime().block_on(m.wait_idle());
    assert_eq!(
        fs.stats().blocks.blocks_written,
        1,
        "the handle is the manager's own tier"
    );
    assert!(fs.block_path(&test_key(1)).starts_with(dir.path()));
    m.shutdown_blocking().unwrap();
}

#[test]
fn a_pending_store_commits_aborts_or_frees_its_slots_when_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let m = kv_tier::builder(fs_config(dir.path(), 4))
        .unwrap()
        .build_blocking()
        .unwrap();
    let req = RequestContext::new(1);
    let (a, b, c) = (test_key(1), test_key(2), test_key(3));
    let writing = |m: &kv_tier::TieringManager| m.primary().stats().writing_blocks;

    let p = m.prepare_store(&[a]).unwrap();
    assert_eq!(p.keys(), [a]);
    assert_eq!(writing(&m), 1);
    assert_eq!(m.lookup(&a, &req), LookupResult::HitPending);
    drop(p);
    assert_eq!(writing(&m), 0, "a dropped store keeps its slot");
    m.on_schedule_end();
    m.runtime().block_on(m.wait_idle());

    let p = m.prepare_store(&[b]).unwrap();
    p.abort();
    assert_eq!(writing(&m), 0, "an aborted store keeps its slot");

    let mut p = m.prepare_store(&[a, c]).unwrap();
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(req.id);
    assert_eq!(writing(&m), 0);
    assert_eq!(m.lookup(&c, &req), LookupResult::Hit);
    let views = m.prepare_load(&[a, c]).unwrap();
    assert!(
        views
            .iter()
            .zip([a, c])
            .all(|(v, k)| verify_block(&k, 0, v.as_slice()))
    );
    drop(views);
    m.on_schedule_end();
    m.on_request_finished(req.id);
    m.runtime().block_on(m.wait_idle());
    let fs = m.tier::<kv_tier::fs::FsTier>("disk").unwrap();
    assert_eq!(
        fs.stats().blocks.blocks_written,
        2,
        "only the committed blocks cascaded"
    );
    // the dropped and the aborted keys were never stored anywhere
    let r2 = RequestContext::new(2);
    for k in [b] {
        let mut verdict = m.lookup(&k, &r2);
        for _ in 0..100 {
            if verdict != LookupResult::Retry {
                break;
            }
            m.on_schedule_end();
            m.runtime().block_on(m.wait_idle());
            verdict = m.lookup(&k, &r2);
        }
        assert_eq!(verdict, LookupResult::Miss, "{k}");
    }
    m.shutdown_blocking().unwrap();
}

/// Dropped without `shutdown` while its cascades run: a manager over the same root later
/// finds only whole blocks, each with the bytes stored.
#[test]
fn dropping_a_manager_without_shutdown_leaves_no_torn_block() {
    let dir = tempfile::tempdir().unwrap();
    let keys: Vec<BlockKey> = (0..48).map(test_key).collect();
    {
        let m = kv_tier::builder(fs_config(dir.path(), 64))
            .unwrap()
            .build_blocking()
            .unwrap();
        for chunk in keys.chunks(8) {
            store(&m, RequestId(1), chunk);
        }
        // no shutdown, no wait: the cascade jobs are in flight
    }
    let m = kv_tier::builder(fs_config(dir.path(), 64))
        .unwrap()
        .build_blocking()
        .unwrap();
    let fs = m.tier::<kv_tier::fs::FsTier>("disk").unwrap();
    let req = RequestContext::new(2);
    let (mut found, mut missed, mut steps) = (0, 0, 0);
    let mut pending: Vec<BlockKey> = keys.clone();
    while !pending.is_empty() {
        steps += 1;
        assert!(steps < 1000, "keys never settled: {pending:?}");
        // one key at a time: not a prefix, a miss must not end the pass
        let verdicts: Vec<LookupResult> = pending.iter().map(|k| m.lookup(k, &req)).collect();
        m.on_schedule_end();
        let mut next = Vec::new();
        for (k, v) in pending.iter().zip(verdicts) {
            match v {
                LookupResult::Hit => {
                    let view = m.prepare_load(&[*k]).unwrap();
                    assert!(verify_block(k, 0, view[0].as_slice()), "{k}: wrong bytes");
                    found += 1;
                }
                LookupResult::Miss => missed += 1,
                LookupResult::HitPending | LookupResult::Retry => next.push(*k),
            }
        }
        pending = next;
        m.runtime().block_on(m.wait_idle());
    }
    let s = fs.stats();
    assert_eq!(
        s.blocks.load_failures, 0,
        "a torn or damaged block was found"
    );
    assert_eq!(
        s.blocks.corrupt_deleted, 0,
        "a torn or damaged block was found"
    );
    assert_eq!(found + missed, keys.len(), "every key answered");
    println!("{found} of {} blocks survived the drop", keys.len());
    m.on_request_finished(req.id);
    m.shutdown_blocking().unwrap();
}

/// The manager's statistics carry each tier's own (through `SecondaryTier::stats`) and
/// serialise whole: what a report or an endpoint hands out.
#[test]
fn the_manager_reports_each_tiers_own_statistics_serialisable() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS},
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "name": "disk",
                                  "gc_max_size_gb": 1}}]}}"#,
        8 * BS,
        dir.path()
    ))
    .unwrap();
    let m = kv_tier::builder(cfg).unwrap().build_blocking().unwrap();
    let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
    store(&m, RequestId(1), &keys);
    m.on_request_finished(RequestId(1));
    m.runtime().block_on(m.wait_idle());
    let s = m.stats();
    let own = &s.tiers[0].own;
    assert_eq!(own.kind, "fs");
    assert_eq!(own.blocks.blocks_written, 3);
    assert_eq!(own.capacity_bytes, Some(1 << 30));
    assert!(own.used_bytes.unwrap() >= 3 * BS as u64, "{own:?}");
    let swept = own
        .figures
        .iter()
        .find(|f| f.name == "gc_swept_files")
        .expect("the GC's figures are listed");
    assert_eq!(swept.kind, kv_tier::core::stats::FigureKind::Counter);
    assert_eq!(swept.help, "Files deleted by sweeps.");
    assert!(
        !own.figures.iter().any(|f| f.name.starts_with("blocks_")),
        "the block counters are not listed twice"
    );
    let v = serde_json::to_value(&s).unwrap();
    assert_eq!(v["tiers"][0]["name"], "disk");
    assert_eq!(v["tiers"][0]["blocks_stored"], 3);
    assert_eq!(
        v["tiers"][0]["own"]["detail"]["blocks"]["blocks_written"],
        3
    );
    assert_eq!(
        v["tiers"][0]["own"]["detail"]["gc"]["cap_bytes"],
        1u64 << 30
    );
    assert_eq!(v["tiers"][0]["store_latency"]["count"], 1);
    assert!(v["tiers"][0]["store_latency"]["p50_s"].as_f64().unwrap() > 0.0);
    m.shutdown_blocking().unwrap();
}
