//! The fs and obj tiers' `SecondaryTier` methods (`store`, `load`, `lookup`, `shutdown`) dropped at
//! every point, as the trait's cancellation rule requires of every tier: sources and sinks let go
//! of, no protection, claim, permit, capacity entry or temp file left, and a later call works.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kv_tier::fs::FsTier;
use kv_tier::obj::ObjTier;
use kv_tier::{BlockKey, BlockSink, Error, LoadJob, SecondaryTier};
use kv_tier_testkit::s3::S3Server;
use kv_tier_testkit::{find_files, load_keys, store_keys, temp_root, test_key, verify_block};

use crate::support::*;

/// Promise (kv-tier-core/src/tier.rs, "Cancellation, deadlines and panics"): "Every async
/// method must be cancellation-safe: its future may be dropped at any await point ..., and
/// the tier must stay consistent: no entry, claim, pin, permit or protection created by the
/// call may outlive the call's own work ... Work the call handed to threads of its own may
/// finish after the drop (its buffers keep their DRAM slots pinned until then, and its keys
/// may stay protected until then), but never longer." The fs tier's `store` dropped at
/// every point: its sources are let go of, its keys unprotected, no temp file stays, and
/// the same keys then store and load with their bytes.
#[test]
fn fs_store_dropped_at_every_point() {
    let rt = runtime();
    let root = temp_root();
    let bs = 64 * 1024;
    let fs = open_fs(root.path(), bs);
    let live = Arc::new(AtomicUsize::new(0));
    for i in 0..16usize {
        let keys: Vec<BlockKey> = (0..6)
            .map(|j| test_key(10_000 + i as u64 * 10 + j))
            .collect();
        let job = store_job(&keys, bs, &live);
        let r = rt.block_on(drop_at(fs.store(job), i));
        assert!(
            poll_until(SETTLE_LIMIT, || live.load(Ordering::SeqCst) == 0),
            "point {i}: {} block sources still held after the store was dropped",
            live.load(Ordering::SeqCst)
        );
        assert!(
            poll_until(SETTLE_LIMIT, || keys.iter().all(|k| !fs.is_protected(k))),
            "point {i}: keys still protected"
        );
        assert!(
            poll_until(SETTLE_LIMIT, || tmp_files_below(root.path()).is_empty()),
            "point {i}: {:?}",
            tmp_files_below(root.path())
        );
        if let Some(r) = r {
            assert!(r.is_success(), "{:?}", r.failed);
        }
        let res = rt.block_on(store_keys(&*fs, &keys, 0, bs));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        let (res, bytes) = rt.block_on(load_keys(&*fs, &keys, bs));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        for (k, b) in &bytes {
            assert!(verify_block(k, 0, b), "point {i}: {k} wrong bytes");
        }
    }
    rt.block_on(fs.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/tier.rs, cancellation, as above; `LoadJob`: "Each sink is
/// exclusive and pins its slot until dropped"). The fs tier's `load` and `lookup` dropped at
/// every point: every sink is let go of, no key stays protected, and the blocks then load
/// with their bytes.
#[test]
fn fs_load_and_lookup_dropped_at_every_point() {
    let rt = runtime();
    let root = temp_root();
    let bs = 64 * 1024;
    let fs = open_fs(root.path(), bs);
    let keys: Vec<BlockKey> = (0..6).map(|j| test_key(20_000 + j)).collect();
    assert!(rt.block_on(store_keys(&*fs, &keys, 0, bs)).is_success());
    for i in 0..16usize {
        let mut job = LoadJob::default();
        let mut readers = Vec::new();
        for k in &keys {
            let (s, r) = BlockSink::pair(bs);
            job.blocks.push((*k, s));
            readers.push(r);
        }
        let _ = rt.block_on(drop_at(fs.load(job), i));
        assert!(
            poll_until(SETTLE_LIMIT, || sinks_released(&mut readers)),
            "point {i}: sinks still held"
        );
        let _ = rt.block_on(drop_at(fs.lookup(&keys), i));
        assert!(
            poll_until(SETTLE_LIMIT, || keys.iter().all(|k| !fs.is_protected(k))),
            "point {i}: keys still protected"
        );
        let (res, bytes) = rt.block_on(load_keys(&*fs, &keys, bs));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        assert!(bytes.iter().all(|(k, b)| verify_block(k, 0, b)));
        assert_eq!(
            rt.block_on(fs.lookup(&keys)).unwrap(),
            vec![true; keys.len()]
        );
    }
    rt.block_on(fs.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/tier.rs: "Every async method must be cancellation-safe"; fs
/// README: "`shutdown` stops it promptly, and joins the tier's threads"; `SecondaryTier::
/// shutdown`: "Stops background work and releases resources"). The fs tier's `shutdown`
/// dropped at its first polls, then called again: the second completes, and once the tier
/// is dropped none of its threads is left.
#[test]
fn fs_shutdown_dropped_then_completed_leaves_no_thread() {
    if !in_own_process("cancellation::tiers::fs_shutdown_dropped_then_completed_leaves_no_thread") {
        return;
    }
    let rt = runtime();
    let root = temp_root();
    let base = fs_threads();
    for i in 0..6usize {
        let mut c = fs_tier_config(root.path());
        c.gc_max_size_gb = Some(1.0);
        let fs = Arc::new(FsTier::open("fs", c, model_namespace(), BS).unwrap());
        let keys: Vec<BlockKey> = (0..4).map(|j| test_key(30_000 + j)).collect();
        assert!(rt.block_on(store_keys(&*fs, &keys, 0, BS)).is_success());
        assert!(fs_threads() > base);
        let first = rt.block_on(drop_at(fs.shutdown(), i));
        if let Some(r) = first {
            r.unwrap();
        }
        rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, fs.shutdown()).await })
            .expect("the second shutdown hung")
            .expect("the second shutdown failed");
        drop(fs);
        assert!(
            poll_until(SETTLE_LIMIT, || fs_threads() <= base),
            "point {i}: fs threads left: {} (base {base})",
            fs_threads()
        );
    }
}

/// Promise (kv-tier-obj README: "Every method is cancellation-safe: a dropped store frees its
/// claim on the key (concurrent stores of one key upload once), its permit and its
/// protection"; tier.rs cancellation). The obj tier (`io_threads` 1, a slow server): `store`
/// dropped at every point; its sources are let go of, no key stays protected, a later store
/// of the same keys completes (claim and permit freed) and they load with their bytes; the
/// bucket holds only whole blocks.
#[test]
fn obj_store_dropped_at_every_point() {
    let rt = runtime();
    let (s3, obj) = s3_and_obj(&rt, "adv", |_| {});
    s3.set_latency(Duration::from_millis(5));
    let live = Arc::new(AtomicUsize::new(0));
    let mut all = Vec::new();
    for i in 0..16usize {
        let keys: Vec<BlockKey> = (0..3)
            .map(|j| test_key(40_000 + i as u64 * 10 + j))
            .collect();
        all.extend(keys.iter().copied());
        let _ = rt.block_on(drop_at(obj.store(store_job(&keys, BS, &live)), i));
        assert!(
            poll_until(SETTLE_LIMIT, || live.load(Ordering::SeqCst) == 0),
            "point {i}: {} sources still held",
            live.load(Ordering::SeqCst)
        );
        assert!(
            poll_until(SETTLE_LIMIT, || keys.iter().all(|k| !obj.is_protected(k))),
            "point {i}: keys still protected"
        );
        let res = rt
            .block_on(async {
                tokio::time::timeout(SETTLE_LIMIT, obj.store(store_job(&keys, BS, &live))).await
            })
            .unwrap_or_else(|_| {
                panic!("point {i}: a store after a dropped one hung (claim or permit kept)")
            });
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        let (res, bytes) = rt.block_on(load_keys(&*obj, &keys, BS));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        assert!(bytes.iter().all(|(k, b)| verify_block(k, 0, b)));
    }
    let paths: std::collections::BTreeSet<String> =
        all.iter().map(|k| obj.object_path(k)).collect();
    let objects = rt.block_on(list_objects(&obj));
    for o in &objects {
        assert!(paths.contains(o), "a stray object: {o}");
    }
    assert_eq!(objects.len(), paths.len());
    rt.block_on(obj.shutdown()).unwrap();
}

/// Promise (kv-tier-obj README: "a dropped store frees its claim on the key (concurrent
/// stores of one key upload once)"; `SecondaryTier::store`: "of concurrent stores of one key
/// exactly one copy survives, whole. A store that reports success leaves a readable block").
/// Two concurrent stores of one key, one dropped at every point: the other completes, with
/// success, and the key loads with its bytes.
#[test]
fn obj_concurrent_stores_of_one_key_with_one_dropped() {
    let rt = runtime();
    let (s3, obj) = s3_and_obj(&rt, "adv2", |c| c.io_threads = 2);
    s3.set_latency(Duration::from_millis(5));
    let live = Arc::new(AtomicUsize::new(0));
    for i in 0..16usize {
        let k = test_key(50_000 + i as u64);
        let (a, b) = (obj.clone(), obj.clone());
        let live2 = live.clone();
        let survivor = rt.spawn(async move { b.store(store_job(&[k], BS, &live2)).await });
        let _ = rt.block_on(drop_at(a.store(store_job(&[k], BS, &live)), i));
        let res = rt
            .block_on(async { tokio::time::timeout(SETTLE_LIMIT, survivor).await })
            .unwrap_or_else(|_| panic!("point {i}: the surviving store hung"))
            .unwrap();
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        let (res, bytes) = rt.block_on(load_keys(&*obj, &[k], BS));
        assert!(
            res.is_success() && verify_block(&k, 0, &bytes[0].1),
            "point {i}: {:?}",
            res.failed
        );
        assert!(poll_until(SETTLE_LIMIT, || live.load(Ordering::SeqCst)
            == 0
            && !obj.is_protected(&k)));
    }
    rt.block_on(obj.shutdown()).unwrap();
}

/// Promise (tier.rs cancellation; kv-tier-obj README "Every method is cancellation-safe").
/// The obj tier's `load` and `lookup` dropped at every point with `io_threads` 1: every sink
/// is let go of, no key stays protected, and a later load (which needs the one permit)
/// completes with the right bytes.
#[test]
fn obj_load_and_lookup_dropped_at_every_point() {
    let rt = runtime();
    let (s3, obj) = s3_and_obj(&rt, "adv3", |_| {});
    let keys: Vec<BlockKey> = (0..3).map(|j| test_key(60_000 + j)).collect();
    assert!(rt.block_on(store_keys(&*obj, &keys, 0, BS)).is_success());
    s3.set_latency(Duration::from_millis(5));
    for i in 0..16usize {
        let mut job = LoadJob::default();
        let mut readers = Vec::new();
        for k in &keys {
            let (s, r) = BlockSink::pair(BS);
            job.blocks.push((*k, s));
            readers.push(r);
        }
        let _ = rt.block_on(drop_at(obj.load(job), i));
        assert!(
            poll_until(SETTLE_LIMIT, || sinks_released(&mut readers)),
            "point {i}: sinks still held"
        );
        obj.clear_exists_cache();
        let _ = rt.block_on(drop_at(obj.lookup(&keys), i));
        assert!(
            poll_until(SETTLE_LIMIT, || keys.iter().all(|k| !obj.is_protected(k))),
            "point {i}: keys still protected"
        );
        let (res, bytes) = rt
            .block_on(async {
                tokio::time::timeout(SETTLE_LIMIT, load_keys(&*obj, &keys, BS)).await
            })
            .unwrap_or_else(|_| panic!("point {i}: a load after dropped calls hung"));
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        assert!(bytes.iter().all(|(k, b)| verify_block(k, 0, b)));
        let found = rt
            .block_on(async { tokio::time::timeout(SETTLE_LIMIT, obj.lookup(&keys)).await })
            .unwrap()
            .unwrap();
        assert_eq!(found, vec![true; keys.len()], "point {i}");
    }
    rt.block_on(obj.shutdown()).unwrap();
}

/// Promise (kv-tier-obj README: "`shutdown` stops and awaits the background sweeps; later
/// calls fail with `Shutdown`"; capacity: "`shutdown` saves the recency order ... in one small
/// object beside the blocks"; tier.rs cancellation). A bounded obj tier's `shutdown` dropped
/// at every point against a slow server, then completed: it succeeds, later stores fail with
/// `Shutdown`, and the bucket holds the blocks and at most that one small object.
#[test]
fn obj_shutdown_dropped_then_completed() {
    let rt = runtime();
    let s3 = rt.block_on(S3Server::start());
    for i in 0..10usize {
        let mut c = obj_config(&s3.endpoint, &format!("sd{i}"));
        c.max_size_gb = Some(1.0);
        let obj = rt
            .block_on(ObjTier::connect("obj", c, model_namespace(), BS))
            .unwrap();
        let keys: Vec<BlockKey> = (0..3)
            .map(|j| test_key(70_000 + i as u64 * 10 + j))
            .collect();
        assert!(rt.block_on(store_keys(&obj, &keys, 0, BS)).is_success());
        obj.touch(&keys);
        s3.set_latency(Duration::from_millis(20));
        if let Some(r) = rt.block_on(drop_at(obj.shutdown(), i)) {
            r.unwrap();
        }
        rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, obj.shutdown()).await })
            .unwrap_or_else(|_| panic!("point {i}: the second shutdown hung"))
            .unwrap_or_else(|e| panic!("point {i}: the second shutdown failed: {e}"));
        s3.set_latency(Duration::ZERO);
        let k = test_key(79_000 + i as u64);
        let res = rt.block_on(store_keys(&obj, &[k], 0, BS));
        assert!(
            res.failed.len() == 1 && matches!(res.failed[0].1, Error::Shutdown { .. }),
            "point {i}: a store after shutdown: {res:?}"
        );
        let paths: std::collections::BTreeSet<String> =
            keys.iter().map(|k| obj.object_path(k)).collect();
        let objects: Vec<String> = rt
            .block_on(list_objects(&obj))
            .into_iter()
            .filter(|o| o.starts_with(&format!("sd{i}/")))
            .collect();
        let others: Vec<&String> = objects.iter().filter(|o| !paths.contains(*o)).collect();
        assert!(others.len() <= 1, "point {i}: stray objects: {others:?}");
        assert_eq!(
            objects.len() - others.len(),
            paths.len(),
            "point {i}: {objects:?}"
        );
    }
}

/// Promise (kv-tier-core/src/tier.rs: "Work the call handed to threads of its own may finish
/// after the drop (its buffers keep their DRAM slots pinned until then ...), but never
/// longer"; config `shutdown_timeout_s`: "A tier's shutdown waits for work its abandoned jobs
/// left running"). fs stores and loads of 1 MiB blocks dropped at many points, then
/// `shutdown`: once it returns, no buffer of a dropped call is still held.
#[test]
fn fs_shutdown_after_dropped_calls_holds_no_buffer() {
    let rt = runtime();
    for i in 0..10usize {
        let root = temp_root();
        let bs = 1 << 20;
        let fs = open_fs(root.path(), bs);
        let live = Arc::new(AtomicUsize::new(0));
        let keys: Vec<BlockKey> = (0..8)
            .map(|j| test_key(80_000 + i as u64 * 10 + j))
            .collect();
        let _ = rt.block_on(drop_at(fs.store(store_job(&keys, bs, &live)), i));
        let mut readers = Vec::new();
        let mut job = LoadJob::default();
        for k in &keys {
            let (s, r) = BlockSink::pair(bs);
            job.blocks.push((*k, s));
            readers.push(r);
        }
        let _ = rt.block_on(drop_at(fs.load(job), i));
        rt.block_on(async { tokio::time::timeout(SETTLE_LIMIT, fs.shutdown()).await })
            .expect("shutdown hung")
            .expect("shutdown failed");
        assert_eq!(
            live.load(Ordering::SeqCst),
            0,
            "point {i}: a store's buffer held past shutdown"
        );
        assert!(
            sinks_released(&mut readers),
            "point {i}: a load's sink held past shutdown"
        );
        assert!(
            keys.iter().all(|k| !fs.is_protected(k)),
            "point {i}: protected past shutdown"
        );
    }
}

/// Promise (kv-tier-core/src/tier.rs, cancellation: "no entry, claim, pin, permit or
/// protection created by the call may outlive the call's own work"; obj README "Capacity":
/// "an index of (key, size, last use)"; `ObjStats::objects`: "Objects in the capacity index").
/// A bounded obj tier (`io_threads` 1, a slow server) whose store of 4 blocks is dropped
/// while its first PUT is out and the others wait for the one permit: the capacity index
/// does not keep entries for blocks whose PUT was never sent (at most the one PUT in doubt).
#[test]
fn obj_dropped_stores_leave_no_phantom_capacity_entries() {
    let rt = runtime();
    let (s3, obj) = s3_and_obj(&rt, "cap", |c| c.max_size_gb = Some(1.0));
    let live = Arc::new(AtomicUsize::new(0));
    let mut phantoms_seen = Vec::new();
    for i in 0..6usize {
        s3.set_latency(Duration::from_millis(150));
        let keys: Vec<BlockKey> = (0..4)
            .map(|j| test_key(90_000 + i as u64 * 10 + j))
            .collect();
        let r = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_millis(60 + 10 * i as u64),
                obj.store(store_job(&keys, BS, &live)),
            )
            .await
        });
        assert!(
            r.is_err(),
            "the store finished before it was dropped: the test is void"
        );
        assert!(poll_until(SETTLE_LIMIT, || live.load(Ordering::SeqCst)
            == 0
            && keys.iter().all(|k| !obj.is_protected(k))));
        s3.set_latency(Duration::ZERO);
        std::thread::sleep(Duration::from_millis(400)); // the server ends the PUT it had
        let actual = rt.block_on(list_objects(&obj)).len() as u64;
        let indexed = obj.stats().objects;
        phantoms_seen.push((indexed, actual));
        assert!(
            indexed <= actual + 1,
            "drop {i}: the capacity index counts {indexed} objects, the bucket holds {actual}: \
             entries of PUTs never sent outlived the dropped store (history {phantoms_seen:?})"
        );
        // the same keys store whole afterwards
        let res = rt.block_on(store_keys(&*obj, &keys, 0, BS));
        assert!(res.is_success(), "{:?}", res.failed);
    }
    rt.block_on(obj.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/tier.rs, cancellation, as above; `GcStats::files`: "Block files
/// in the index"; `GcStats::bytes`: "... plus bytes reserved by stores in flight"). A bounded
/// fs tier's stores dropped at every point: once their work ended, the index counts exactly
/// the block files on disk and no reservation is left.
#[test]
fn fs_dropped_stores_leave_the_gc_index_exact() {
    let rt = runtime();
    let root = temp_root();
    let bs = 64 * 1024;
    let mut c = fs_tier_config(root.path());
    c.gc_max_size_gb = Some(1.0);
    let fs = Arc::new(FsTier::open("fs", c, model_namespace(), bs).unwrap());
    let live = Arc::new(AtomicUsize::new(0));
    for i in 0..16usize {
        let keys: Vec<BlockKey> = (0..6)
            .map(|j| test_key(95_000 + i as u64 * 10 + j))
            .collect();
        let _ = rt.block_on(drop_at(fs.store(store_job(&keys, bs, &live)), i));
        assert!(poll_until(SETTLE_LIMIT, || live.load(Ordering::SeqCst)
            == 0
            && keys.iter().all(|k| !fs.is_protected(k))));
        let ok = poll_until(SETTLE_LIMIT, || {
            let on_disk = find_files(root.path(), ".bin").len() as u64;
            fs.stats().gc.map(|g| g.files) == Some(on_disk)
        });
        assert!(
            ok,
            "point {i}: the index counts {:?} files, the disk holds {}",
            fs.stats().gc.map(|g| g.files),
            find_files(root.path(), ".bin").len()
        );
    }
    // with every file gone from the index's bytes, what is left is directories and files
    let g = fs.stats().gc.unwrap();
    let files_bytes = find_files(root.path(), ".bin").len() as u64 * bs as u64;
    assert!(g.bytes >= files_bytes, "{g:?}");
    assert!(
        g.bytes <= kv_tier_testkit::allocated_bytes(root.path()) + 64 * 4096 * 4096,
        "bytes reserved by dropped stores left in the total: {g:?}"
    );
    rt.block_on(fs.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/tier.rs, `store`: "of concurrent stores of one key exactly one
/// copy survives, whole. A store that reports success leaves a readable block"; and the
/// cancellation rule). Two concurrent fs stores of one key, one dropped at every point:
/// the other succeeds and the key loads with its bytes; nothing stays held or protected.
#[test]
fn fs_concurrent_stores_of_one_key_with_one_dropped() {
    let rt = runtime();
    let root = temp_root();
    let bs = 256 * 1024;
    let fs = open_fs(root.path(), bs);
    let live = Arc::new(AtomicUsize::new(0));
    for i in 0..16usize {
        let k = test_key(97_000 + i as u64);
        let b = fs.clone();
        let live2 = live.clone();
        let survivor = rt.spawn(async move { b.store(store_job(&[k], bs, &live2)).await });
        let _ = rt.block_on(drop_at(fs.store(store_job(&[k], bs, &live)), i));
        let res = rt
            .block_on(async { tokio::time::timeout(SETTLE_LIMIT, survivor).await })
            .unwrap_or_else(|_| panic!("point {i}: the surviving store hung"))
            .unwrap();
        assert!(res.is_success(), "point {i}: {:?}", res.failed);
        let (res, bytes) = rt.block_on(load_keys(&*fs, &[k], bs));
        assert!(
            res.is_success() && verify_block(&k, 0, &bytes[0].1),
            "point {i}: {:?}",
            res.failed
        );
        assert!(poll_until(SETTLE_LIMIT, || live.load(Ordering::SeqCst)
            == 0
            && !fs.is_protected(&k)));
    }
    assert!(poll_until(SETTLE_LIMIT, || tmp_files_below(root.path()).is_empty()));
    rt.block_on(fs.shutdown()).unwrap();
}
