//! The fs tier under a manager keeps leased keys through sweeps; its threads never block an
//! async worker at shutdown or drop; dropped calls leave their keys protected exactly as long
//! as their I/O runs; no config that deserialises makes `open` panic.

mod common;

use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::{BS, cfg, load, ns, open, store};
use kv_tier_core::{
    BlockKey, EvictionPolicy, KvTierConfig, LookupResult, RequestContext, SecondaryTier, TierSpec,
    TieringManager,
};
use kv_tier_fs::{FsOp, FsTier, FsTierConfig};
use kv_tier_testkit::{temp_root, test_key, verify_block};
use tokio::sync::Notify;

fn bounded_cfg(root: &Path, cap_blocks: u64) -> FsTierConfig {
    let mut c = cfg(root);
    c.gc_max_size_gb = Some((cap_blocks * BS as u64) as f64 / (1u64 << 30) as f64);
    c.gc_low_watermark = Some(0.5);
    c.gc_hard_ceiling = Some(1000.0);
    c.gc_grace_s = Some(300.0);
    c.gc_stamp_interval_s = Some(60.0);
    c.gc_interval_s = Some(3600.0);
    c.gc_background = false;
    c
}

fn step(m: &TieringManager, keys: &[BlockKey], req: &RequestContext) -> Vec<LookupResult> {
    let r = keys.iter().map(|k| m.lookup(k, req)).collect();
    m.on_schedule_end();
    r
}

/// Between the probe that found a key and the promotion that reads it, a sweep runs that would
/// take that key first (it is the oldest). The key is leased: it stays, and the promotion
/// reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_found_by_a_probe_survives_a_sweep_until_its_promotion_ends() {
    let root = temp_root();
    let fs = Arc::new(FsTier::open("fs", bounded_cfg(root.path(), 10), ns(), BS).unwrap());
    let keys: Vec<_> = (0..15).map(test_key).collect();
    assert!(store(&*fs, &keys, 0).await.is_success());
    for (i, k) in keys.iter().enumerate() {
        let f = std::fs::File::options()
            .write(true)
            .open(fs.block_path(k))
            .unwrap();
        f.set_modified(SystemTime::now() - Duration::from_secs((15 - i as u64) * 1000))
            .unwrap(); // key 0 is the oldest, all are past the grace window
    }
    fs.gc_rescan_now().unwrap();
    let cpu = Arc::new(
        kv_tier_cpu::CpuTier::new(kv_tier_cpu::CpuTierConfig {
            capacity_bytes: (16 * BS) as u64,
            block_size: BS,
            policy: EvictionPolicy::Lru,
            prefault: false,
        })
        .unwrap(),
    );
    let m = TieringManager::builder(KvTierConfig::new((16 * BS) as u64, BS as u64))
        .primary(cpu)
        .tier(fs.clone())
        .build()
        .await
        .unwrap();
    let req = RequestContext::new(1);
    let k = keys[0];
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::Retry]);
    m.wait_idle().await; // found, and leased
    let swept = fs.gc_sweep_now().unwrap();
    assert!(swept > 0, "the sweep deleted nothing");
    assert!(fs.block_path(&k).exists(), "the sweep deleted a leased key");
    assert!(!fs.block_path(&keys[1]).exists(), "the next oldest goes");
    assert_eq!(step(&m, &[k], &req), vec![LookupResult::HitPending]);
    m.wait_idle().await;
    assert_eq!(m.lookup(&k, &req), LookupResult::Hit);
    let s = m.stats();
    assert_eq!(s.tiers[0].load_failures, 0);
    assert!(!fs.is_protected(&k), "the lease outlived the promotion");
    m.on_request_finished(req.id);
    assert_eq!(m.stats().tiers[0].tracked_keys, 0);
}

/// A write that blocks until released, by a task or (after a while) by a watchdog; tells which.
struct HeldWrite {
    entered: Arc<Notify>,
    release: mpsc::Sender<&'static str>,
    released_by: Arc<Mutex<Option<&'static str>>>,
}

fn hold_writes(tier: &FsTier, op: FsOp) -> HeldWrite {
    let entered = Arc::new(Notify::new());
    let (tx, rx) = mpsc::channel::<&'static str>();
    let rx = Mutex::new(rx);
    let released_by = Arc::new(Mutex::new(None));
    let (e, r) = (entered.clone(), released_by.clone());
    tier.set_fault_injector(Some(Arc::new(move |o, _path: &Path| {
        if o == op && r.lock().unwrap().is_none() {
            e.notify_one();
            let by = rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or("watchdog");
            *r.lock().unwrap() = Some(by);
        }
        None
    })));
    HeldWrite {
        entered,
        release: tx,
        released_by,
    }
}

fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// `shutdown` on a one-worker runtime while an I/O thread is busy with a block that only a
/// task on that worker can finish: the join must not block the worker.
#[test]
fn shutdown_does_not_block_the_async_worker() {
    current_thread_runtime().block_on(async {
        let root = temp_root();
        let tier = open(root.path());
        let held = hold_writes(&tier, FsOp::Write);
        let k = [test_key(1)];
        let mut job = Box::pin(store(&tier, &k, 0));
        assert!(futures::poll!(&mut job).is_pending());
        held.entered.notified().await; // an I/O thread is inside the write
        let tx = held.release.clone();
        tokio::spawn(async move {
            let _ = tx.send("task");
        });
        tier.shutdown().await.unwrap();
        let _ = job.await;
        assert_eq!(
            *held.released_by.lock().unwrap(),
            Some("task"),
            "shutdown blocked the runtime's only worker while joining"
        );
    });
}

/// The same for dropping the tier.
#[test]
fn dropping_the_tier_does_not_block_the_async_worker() {
    current_thread_runtime().block_on(async {
        let root = temp_root();
        let tier = open(root.path());
        let held = hold_writes(&tier, FsOp::Write);
        let k = [test_key(1)];
        let mut job = Box::pin(store(&tier, &k, 0));
        assert!(futures::poll!(&mut job).is_pending());
        held.entered.notified().await;
        drop(job);
        let tx = held.release.clone();
        let released = tokio::spawn(async move {
            let _ = tx.send("task");
        });
        drop(tier);
        released.await.unwrap();
        // the helper thread joins the I/O thread once the write is released
        while held.released_by.lock().unwrap().is_none() {
            tokio::task::yield_now().await;
        }
        assert_eq!(*held.released_by.lock().unwrap(), Some("task"));
    });
}

/// A store or load future dropped while its block is on an I/O thread: the key stays
/// protected until that I/O ends (a sweep cannot take a block half-handled), then nothing is
/// left, and the key stores and loads normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_call_keeps_its_keys_protected_exactly_while_its_io_runs() {
    let root = temp_root();
    let tier = open(root.path());
    let k = test_key(1);
    for op in [FsOp::Write, FsOp::Read] {
        let held = hold_writes(&tier, op);
        if op == FsOp::Read {
            assert!(store(&tier, &[k], 0).await.is_success());
        }
        let mut call: std::pin::Pin<Box<dyn Future<Output = ()> + Send + '_>> = match op {
            FsOp::Write => Box::pin(async { drop(store(&tier, &[k], 0).await) }),
            _ => Box::pin(async { drop(load(&tier, &[k]).await) }),
        };
        assert!(futures::poll!(&mut call).is_pending());
        held.entered.notified().await;
        drop(call);
        assert!(
            tier.is_protected(&k),
            "{op:?}: protection ended before the I/O"
        );
        held.release.send("task").unwrap();
        tokio::time::timeout(Duration::from_secs(30), async {
            while tier.is_protected(&k) {
                tokio::task::yield_now().await;
            }
        })
        .await
        .expect("the protection outlived the I/O");
        tier.set_fault_injector(None);
    }
    assert!(store(&tier, &[k], 0).await.is_success());
    let (res, data) = load(&tier, &[k]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&k, 0, &data[0].1));
}

/// A store dropped while its block is on an I/O thread: the block the thread then publishes
/// is still reported (`BlockStored`), so the event log matches the disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_store_still_reports_what_its_io_published() {
    let root = temp_root();
    let tier = open(root.path());
    let k = test_key(1);
    let held = hold_writes(&tier, FsOp::Publish);
    let mut call = Box::pin(async { drop(store(&tier, &[k], 0).await) });
    assert!(futures::poll!(&mut call).is_pending());
    held.entered.notified().await;
    drop(call);
    held.release.send("task").unwrap();
    tokio::time::timeout(Duration::from_secs(30), async {
        while tier.is_protected(&k) {
            tokio::task::yield_now().await;
        }
    })
    .await
    .expect("the I/O never ended");
    assert!(tier.block_path(&k).exists());
    let stored: Vec<BlockKey> = tier
        .take_events()
        .into_iter()
        .filter(|e| !e.removed)
        .flat_map(|e| e.keys)
        .collect();
    assert_eq!(
        stored,
        vec![k],
        "the published block's event was lost with the job"
    );
}

/// Every numeric option, at values across and beyond its range (as JSON a user could write):
/// parsing either refuses it naming the field, or the tier opens; nothing panics.
#[test]
fn no_config_that_deserialises_makes_open_panic() {
    let root = temp_root();
    let mut opened = 0;
    for &(field, _, _) in kv_tier_fs::RANGES {
        for &v in kv_tier_testkit::CONFIG_NUMBERS {
            let mut json = format!(r#"{{"root_dir": {:?}, "{field}": {v}"#, root.path());
            if field.starts_with("gc_") && field != "gc_max_size_gb" {
                json.push_str(r#", "gc_max_size_gb": 1"#);
            }
            json.push('}');
            let mut spec = TierSpec::new("fs");
            spec.options = serde_json::from_str::<serde_json::Value>(&json)
                .unwrap()
                .as_object()
                .unwrap()
                .clone();
            let cfg = match FsTierConfig::from_spec(&spec) {
                Ok(c) => c,
                Err(kv_tier_core::Error::InvalidConfig { field: f, reason }) => {
                    let interplay = f == "gc_grace_s" && field == "gc_stamp_interval_s";
                    assert!(
                        f == field || interplay,
                        "{json}: refused naming {f}: {reason}"
                    );
                    continue;
                }
                Err(e) => panic!("{json}: {e}"),
            };
            let opened_ok = std::panic::catch_unwind(|| {
                let mut c = cfg.clone();
                c.gc_background = true; // the GC thread's own timing is part of what must not panic
                FsTier::open("fs", c, ns(), BS).map(drop)
            });
            match opened_ok {
                Ok(Ok(())) => opened += 1,
                // a cap too small for one block is found at open (it depends on the block
                // size and the filesystem)
                Ok(Err(kv_tier_core::Error::InvalidConfig { field: f, .. }))
                    if f == "gc_max_size_gb" => {}
                Ok(Err(e)) => panic!("{json}: a valid config failed to open: {e}"),
                Err(_) => panic!("{json}: open panicked"),
            }
        }
    }
    assert!(opened > 10, "too few configs opened: {opened}");
}
