//! A manager's `build()` dropped at any point, or failing at a later tier: no fs thread, no task,
//! no coordination of a shared tier and nothing in a bucket is left behind.

use std::pin::pin;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kv_tier::obj::ObjTier;
use kv_tier::{KvTierConfig, RequestId};
use kv_tier_testkit::s3::S3Server;
use kv_tier_testkit::{Gate, temp_root, test_key};

use crate::support::*;

/// Promise (kv-tier-core/src/tier.rs): "Every async method must be cancellation-safe";
/// kv-tier crate docs §5 and `TieringManager` docs: the fs tier "stops its threads when the
/// last handle to it goes". A `build()` dropped while a later tier is still being built
/// (the fs tier already open, its threads running) leaves no fs thread behind, and the same
/// root builds again.
#[test]
fn a_build_dropped_after_the_fs_tier_opened_leaves_no_fs_thread() {
    if !in_own_process(
        "cancellation::build::a_build_dropped_after_the_fs_tier_opened_leaves_no_fs_thread",
    ) {
        return;
    }
    let rt = runtime();
    let root = temp_root();
    let base = fs_threads();
    let gate = Gate::new();
    let mut reg = kv_tier::registry();
    reg.register("gated", GatedBuilder { gate: gate.clone() })
        .unwrap();
    let during = rt.block_on(async {
        let b = kv_tier::builder(gated_cfg(root.path()))
            .unwrap()
            .registry(reg)
            .build();
        let mut b = pin!(b);
        // the build runs while polled: until it reaches the gate
        tokio::time::timeout(SETTLE_LIMIT, async {
            tokio::select! {
                r = b.as_mut() => panic!("build finished past a closed gate: {:?}", r.err()),
                _ = gate.wait_arrived(1) => {}
            }
        })
        .await
        .expect("the gated builder was never reached");
        // a spawned thread names itself once it first runs: until then it has its parent's name
        wait_until_async("the fs tier's threads", SETTLE_LIMIT, || {
            fs_threads() > base
        })
        .await;
        fs_threads()
    });
    assert!(
        during > base,
        "the fs tier had no threads running ({during} vs {base})"
    );
    assert!(
        poll_until(SETTLE_LIMIT, || fs_threads() <= base),
        "fs threads left after the build was dropped: {} (base {base})",
        fs_threads()
    );
    gate.open();
    let mut reg = kv_tier::registry();
    reg.register("gated", GatedBuilder { gate: gate.clone() })
        .unwrap();
    let m = rt
        .block_on(
            kv_tier::builder(gated_cfg(root.path()))
                .unwrap()
                .registry(reg)
                .build(),
        )
        .expect("the root builds again");
    rt.block_on(m.shutdown()).unwrap();
    drop(m);
    assert!(poll_until(SETTLE_LIMIT, || fs_threads() <= base));
}

/// Promise (kv-tier-core/src/tier.rs, cancellation): "its future may be dropped at any await
/// point ... no entry, claim, pin, permit or protection created by the call may outlive the
/// call's own work"; registry.rs: the fs open runs "on the runtime's blocking pool". A
/// `build()` of an fs manager dropped after 1, 2, ... polls (the open possibly still running
/// on the blocking pool) leaves no fs thread once that work ended, and no temp file.
#[test]
fn a_build_dropped_at_every_early_poll_leaves_no_fs_thread() {
    if !in_own_process(
        "cancellation::build::a_build_dropped_at_every_early_poll_leaves_no_fs_thread",
    ) {
        return;
    }
    let rt = runtime();
    let root = temp_root();
    let cfg = || {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "n_read_threads": 2,
                                      "n_write_threads": 2, "gc_max_size_gb": 1}}]}}"#,
            root.path()
        ))
        .unwrap()
    };
    let base = fs_threads();
    for i in 0..12 {
        let done = rt.block_on(drop_at(kv_tier::builder(cfg()).unwrap().build(), i));
        if let Some(m) = done {
            rt.block_on(m.unwrap().shutdown()).unwrap();
        }
        assert!(
            poll_until(SETTLE_LIMIT, || fs_threads() <= base),
            "drop point {i}: fs threads left: {} (base {base})",
            fs_threads()
        );
    }
    // an abandoned open may still be running on the blocking pool (its capability probe file
    // exists while it runs): once it ended, no thread and no file of it is left
    let settled = || {
        poll_until(SETTLE_LIMIT, || {
            fs_threads() <= base && tmp_files_below(root.path()).is_empty()
        })
    };
    assert!(
        settled(),
        "threads {} (base {base}), temp files {:?}",
        fs_threads(),
        tmp_files_below(root.path())
    );
    // an abandoned open finishing late must not bring anything back
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        settled(),
        "threads {} (base {base}), temp files {:?}",
        fs_threads(),
        tmp_files_below(root.path())
    );
    let m = rt
        .block_on(kv_tier::builder(cfg()).unwrap().build())
        .unwrap();
    rt.block_on(m.shutdown()).unwrap();
}

/// Promise (kv-tier-core/src/tier.rs, cancellation: "no entry, claim, pin, permit or
/// protection created by the call may outlive the call's own work"; obj README: "every
/// request ... has a deadline"). A `build()` of an obj manager dropped during the obj tier's
/// startup probe against a server that never answers leaves no thread and no task running
/// past the probe's deadline.
#[test]
fn a_build_dropped_during_the_obj_startup_probe_leaks_no_thread_or_task() {
    if !in_own_process(
        "cancellation::build::a_build_dropped_during_the_obj_startup_probe_leaks_no_thread_or_task",
    ) {
        return;
    }
    let (endpoint, stop) = black_hole();
    let rt = runtime();
    let others = || threads_where(|n| n != "adv-rt");
    // warm up the runtime's own machinery, then measure
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
    let base_threads = others();
    let base_tasks = rt.metrics().num_alive_tasks();
    for i in [1usize, 3, 8, 12, 14] {
        let r = rt.block_on(drop_at(
            kv_tier::builder(obj_manager_cfg(&endpoint, 0.5))
                .unwrap()
                .build(),
            i,
        ));
        assert!(
            r.is_none() || r.unwrap().is_err(),
            "built against a black hole"
        );
    }
    let r = rt.block_on(async {
        tokio::time::timeout(
            Duration::from_millis(200),
            kv_tier::builder(obj_manager_cfg(&endpoint, 0.5))
                .unwrap()
                .build(),
        )
        .await
    });
    assert!(r.is_err() || r.unwrap().is_err());
    let ok = poll_until(SETTLE_LIMIT, || {
        rt.metrics().num_alive_tasks() <= base_tasks
    });
    assert!(
        ok,
        "tasks left: {} (base {base_tasks})",
        rt.metrics().num_alive_tasks()
    );
    let ok = poll_until(SETTLE_LIMIT, || others() <= base_threads);
    assert!(ok, "threads left: {} (base {base_threads})", others());
    stop.store(true, Ordering::SeqCst);
}

/// Promise (kv-tier-core/src/tier.rs, cancellation; obj README "A startup probe turns bad
/// credentials, a missing bucket or an unreachable endpoint into a clear error"). `build()`
/// of an obj manager dropped at many points of its startup against a slow real S3 server
/// leaves nothing in the bucket, and the next build on the same bucket works and stores.
#[test]
fn a_build_dropped_during_the_obj_startup_leaves_the_bucket_empty() {
    let rt = runtime();
    let s3 = rt.block_on(S3Server::start());
    s3.set_latency(Duration::from_millis(30));
    for i in 0..16 {
        let r = rt.block_on(drop_at(
            kv_tier::builder(obj_manager_cfg(&s3.endpoint, 5.0))
                .unwrap()
                .build(),
            i,
        ));
        if let Some(m) = r {
            rt.block_on(m.unwrap().shutdown()).unwrap();
        }
    }
    s3.set_latency(Duration::ZERO);
    let m = rt
        .block_on(
            kv_tier::builder(obj_manager_cfg(&s3.endpoint, 5.0))
                .unwrap()
                .build(),
        )
        .unwrap();
    // let anything the dropped builds left running finish (each request has a deadline)
    std::thread::sleep(Duration::from_millis(600));
    let obj = m.tier::<ObjTier>("obj").unwrap();
    let objects = rt.block_on(list_objects(&obj));
    assert!(
        objects.is_empty(),
        "objects left by dropped builds: {objects:?}"
    );
    let k = test_key(141);
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    rt.block_on(m.wait_idle());
    assert_eq!(rt.block_on(list_objects(&obj)), vec![obj.object_path(&k)]);
    rt.block_on(m.shutdown()).unwrap();
}

/// Promise (kv-tier crate docs §5: the fs tier "stops its threads when the last handle to it
/// goes"; tier.rs cancellation: no state "created by the call may outlive the call's own
/// work"). A `build()` that fails at a later tier, after the fs tier opened, leaves no fs
/// thread, and the root opens again.
#[test]
fn a_build_failing_after_the_fs_tier_opened_leaves_no_fs_thread() {
    if !in_own_process(
        "cancellation::build::a_build_failing_after_the_fs_tier_opened_leaves_no_fs_thread",
    ) {
        return;
    }
    let rt = runtime();
    let root = temp_root();
    let base = fs_threads();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "n_read_threads": 2,
                                  "n_write_threads": 2, "gc_max_size_gb": 1}},
                                {{"type": "failing"}}]}}"#,
        root.path()
    ))
    .unwrap();
    for _ in 0..3 {
        let mut reg = kv_tier::registry();
        reg.register("failing", FailingBuilder).unwrap();
        let r = rt.block_on(kv_tier::builder(cfg.clone()).unwrap().registry(reg).build());
        assert!(r.is_err());
        assert!(
            poll_until(SETTLE_LIMIT, || fs_threads() <= base),
            "fs threads left after a failed build: {} (base {base})",
            fs_threads()
        );
    }
    let fs = open_fs(root.path(), BS);
    drop(fs);
}

/// Promise (tier.rs cancellation: "no entry, claim, pin, permit or protection created by the
/// call may outlive the call's own work"; kv-tier crate docs §5). A `build()` dropped after a
/// shared obj tier connected (a later tier still building): the tier's coordination stops,
/// no task is left on the runtime, the server goes quiet.
#[test]
fn a_build_dropped_after_a_shared_obj_tier_connected_stops_its_coordination() {
    if !in_own_process(
        "cancellation::build::a_build_dropped_after_a_shared_obj_tier_connected_stops_its_coordination",
    ) {
        return;
    }
    let s3_rt = runtime();
    let s3 = s3_rt.block_on(S3Server::start());
    let rt = runtime();
    // the runtime's own machinery starts before its tasks are counted
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
    let base_tasks = rt.metrics().num_alive_tasks();
    let gate = Gate::new();
    let mut reg = kv_tier::registry();
    reg.register("gated", GatedBuilder { gate: gate.clone() })
        .unwrap();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{}, {{"type": "gated"}}]}}"#,
        shared_obj_entry(&s3.endpoint)
    ))
    .unwrap();
    rt.block_on(async {
        let b = kv_tier::builder(cfg).unwrap().registry(reg).build();
        let mut b = pin!(b);
        // the build runs while polled: until it reaches the gate
        tokio::time::timeout(SETTLE_LIMIT, async {
            tokio::select! {
                r = b.as_mut() => panic!("build finished past a closed gate: {:?}", r.err()),
                _ = gate.wait_arrived(1) => {}
            }
        })
        .await
        .expect("the gated builder was never reached");
        tokio::time::sleep(Duration::from_millis(300)).await; // the coordination runs
    });
    let ok = poll_until(SETTLE_LIMIT, || {
        rt.metrics().num_alive_tasks() <= base_tasks
    });
    assert!(
        ok,
        "tasks left after the build was dropped: {} (base {base_tasks})",
        rt.metrics().num_alive_tasks()
    );
    assert!(
        poll_until(SETTLE_LIMIT, || server_quiet(
            &s3,
            Duration::from_millis(1_500)
        )),
        "the dropped build's tier still talks to the bucket"
    );
}

/// Promise (kv-tier crate docs §5: the fs tier "stops its threads when the last handle to it
/// goes"; fs README "Shared root": each instance runs a coordination thread). A `build()`
/// dropped after a shared fs tier opened, and a manager over a shared root dropped without
/// `shutdown`: no fs thread (coordination included) is left.
#[test]
fn dropping_a_build_or_a_manager_over_a_shared_fs_root_leaves_no_thread() {
    if !in_own_process(
        "cancellation::build::dropping_a_build_or_a_manager_over_a_shared_fs_root_leaves_no_thread",
    ) {
        return;
    }
    let rt = runtime();
    let root = temp_root();
    let base = fs_threads();
    let cfg = |gated: bool| {
        KvTierConfig::from_json_str(&format!(
            r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
                "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "n_read_threads": 1,
                    "n_write_threads": 1, "gc_max_size_gb": 1, "shared": true, "shared_lease_s": 0.5}}{}]}}"#,
            root.path(),
            if gated { r#", {"type": "gated"}"# } else { "" }
        ))
        .unwrap()
    };
    let gate = Gate::new();
    let mut reg = kv_tier::registry();
    reg.register("gated", GatedBuilder { gate: gate.clone() })
        .unwrap();
    let during = rt.block_on(async {
        let b = kv_tier::builder(cfg(true)).unwrap().registry(reg).build();
        let mut b = pin!(b);
        // the build runs while polled: until it reaches the gate
        tokio::time::timeout(SETTLE_LIMIT, async {
            tokio::select! {
                r = b.as_mut() => panic!("build finished past a closed gate: {:?}", r.err()),
                _ = gate.wait_arrived(1) => {}
            }
        })
        .await
        .expect("the gated builder was never reached");
        wait_until_async(
            "the shared root's coordination thread",
            SETTLE_LIMIT,
            || threads_where(|n| n == "kv-fs-shared") > 0,
        )
        .await;
        fs_threads()
    });
    assert!(during > base);
    assert!(
        poll_until(SETTLE_LIMIT, || fs_threads() <= base),
        "fs threads left after the build was dropped: {} (base {base})",
        fs_threads()
    );
    let m = rt
        .block_on(kv_tier::builder(cfg(false)).unwrap().build())
        .unwrap();
    let k = test_key(331);
    engine_store(&m, RequestId(1), &[k]);
    m.on_request_finished(RequestId(1));
    rt.block_on(m.wait_idle());
    drop(m);
    assert!(
        poll_until(SETTLE_LIMIT, || fs_threads() <= base),
        "fs threads left after the manager was dropped: {} (base {base})",
        fs_threads()
    );
}

/// Promise (tier.rs cancellation; kv-tier crate docs §5). A `build()` that fails at an fs
/// tier (its root is a regular file) after a shared obj tier connected: the obj tier's
/// coordination stops, no task is left, the server goes quiet.
#[test]
fn a_build_failing_after_a_shared_obj_tier_connected_stops_its_coordination() {
    if !in_own_process(
        "cancellation::build::a_build_failing_after_a_shared_obj_tier_connected_stops_its_coordination",
    ) {
        return;
    }
    let s3_rt = runtime();
    let s3 = s3_rt.block_on(S3Server::start());
    let rt = runtime();
    // the runtime's own machinery starts before its tasks are counted
    rt.block_on(async { tokio::time::sleep(Duration::from_millis(10)).await });
    let base_tasks = rt.metrics().num_alive_tasks();
    let dir = temp_root();
    let not_a_dir = dir.path().join("file");
    std::fs::write(&not_a_dir, b"x").unwrap();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{}, {{"type": "fs", "root_dir": {not_a_dir:?}}}]}}"#,
        shared_obj_entry(&s3.endpoint)
    ))
    .unwrap();
    let r = rt.block_on(kv_tier::builder(cfg).unwrap().build());
    assert!(r.is_err(), "built an fs tier on a regular file");
    let ok = poll_until(SETTLE_LIMIT, || {
        rt.metrics().num_alive_tasks() <= base_tasks
    });
    assert!(
        ok,
        "tasks left after the failed build: {} (base {base_tasks})",
        rt.metrics().num_alive_tasks()
    );
    assert!(
        poll_until(SETTLE_LIMIT, || server_quiet(
            &s3,
            Duration::from_millis(1_500)
        )),
        "the failed build's obj tier still talks to the bucket"
    );
}
