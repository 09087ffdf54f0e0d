//! The coordination records deleted or garbled under live instances (the lease, grants,
//! heartbeats, journal batches): stores go on, the bound holds, at most one leader at a time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_tier_core::SecondaryTier;
use kv_tier_testkit::controlled_store::ControlledStore;
use kv_tier_testkit::wait::wait_until_async;
use object_store::{ObjectStoreExt as _, PutPayload};

use crate::support::*;

/// The lease object deleted at epoch 1 under three live instances: stores go on (credit
/// flows again), the bound holds, at most one leader at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_deleted_at_epoch_one() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(
            tier_on(
                &s,
                shared_mem_cfg(&format!("l{i}"), blocks(CAP as f64), 0.5),
            )
            .await,
        );
    }
    warm(&ts, 4).await;
    // some traffic first, longer than the journal's retention (4 leases = 2 s), so each
    // writer's cumulative grant exceeds what its retained journal accounts for
    let until = Instant::now() + Duration::from_secs(4);
    let hs: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| spawn_flood(t, base(i as u64), 0, until, 8))
        .collect();
    for h in hs {
        h.await.unwrap();
    }
    let smp = sampler(&s, ts.clone());
    let before: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    s.inner.delete(&coord("lease")).await.unwrap();
    let (first, second) = flood_halves(&ts, 1, 8.0).await;
    let (peak, max_leaders, _) = smp.finish().await;
    let after: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    let lease = read(&s, "lease").await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "lease deleted at epoch 1: before {before:?}\nafter {after:?}\nlease now {lease:?}\nfirst 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x, max leaders {max_leaders}"
    );
    shutdown_all_promptly(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
    assert!(max_leaders <= 1, "{max_leaders} leaders at once");
}

/// After a clean handover (epoch 2), the lease object is deleted: stores must go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_deleted_after_a_handover() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(
            tier_on(
                &s,
                shared_mem_cfg(&format!("h{i}"), blocks(CAP as f64), 0.5),
            )
            .await,
        );
    }
    warm(&ts, 5).await;
    let l = leaders(&ts);
    assert_eq!(l.len(), 1);
    let old = ts.remove(l[0]);
    old.shutdown().await.unwrap();
    drop(old);
    wait_until_async("the released lease taken", Duration::from_secs(5), || {
        ts.iter().any(|t| {
            let st = t.stats().shared.unwrap();
            st.leader && st.epoch == 2
        })
    })
    .await;
    warm(&ts, 6).await;
    let epoch_before: Vec<u64> = ts.iter().map(|t| t.stats().shared.unwrap().epoch).collect();
    let smp = sampler(&s, ts.clone());
    s.inner.delete(&coord("lease")).await.unwrap();
    let (first, second) = flood_halves(&ts, 2, 8.0).await;
    let (peak, max_leaders, _) = smp.finish().await;
    let after: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    let lease = read(&s, "lease").await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "lease deleted after a handover (epochs {epoch_before:?}): lease now {lease:?}\nafter {after:?}\nfirst 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x, max leaders {max_leaders}"
    );
    shutdown_all_promptly(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
}

/// The lease object overwritten with garbage under live instances: stores go on, the bound
/// holds, at most one leader at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_garbled() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(
            tier_on(
                &s,
                shared_mem_cfg(&format!("g{i}"), blocks(CAP as f64), 0.5),
            )
            .await,
        );
    }
    warm(&ts, 7).await;
    // some traffic first, longer than the journal's retention (4 leases = 2 s), so each
    // writer's cumulative grant exceeds what its retained journal accounts for
    let until = Instant::now() + Duration::from_secs(4);
    let hs: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| spawn_flood(t, base(i as u64) | 11 << 36, 0, until, 8))
        .collect();
    for h in hs {
        h.await.unwrap();
    }
    let smp = sampler(&s, ts.clone());
    s.inner
        .put(&coord("lease"), PutPayload::from("\u{1}garbage\u{ff}"))
        .await
        .unwrap();
    let (first, second) = flood_halves(&ts, 3, 8.0).await;
    let (peak, max_leaders, _) = smp.finish().await;
    let after: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    let lease = read(&s, "lease").await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "lease garbled: lease now {lease:?}\nafter {after:?}\nfirst 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x, max leaders {max_leaders}"
    );
    shutdown_all_promptly(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
    assert!(max_leaders <= 1, "{max_leaders} leaders at once");
}

/// `grants/<id>` deleted and garbled repeatedly for 1 s under a flooding instance: its stores
/// go on afterwards, the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grants_deleted_and_garbled() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(
            tier_on(
                &s,
                shared_mem_cfg(&format!("gr{i}"), blocks(CAP as f64), 0.5),
            )
            .await,
        );
    }
    warm(&ts, 8).await;
    let smp = sampler(&s, ts.clone());
    let vandal = {
        let s = s.clone();
        tokio::spawn(async move {
            let t0 = Instant::now();
            let mut n = 0u64;
            while t0.elapsed() < Duration::from_secs(1) {
                for id in ["gr0", "gr1", "gr2"] {
                    let p = coord(&format!("grants/{id}"));
                    if n.is_multiple_of(2) {
                        let _ = s.inner.delete(&p).await;
                    } else {
                        let _ = s.inner.put(&p, PutPayload::from("x\u{0} 1e3 -")).await;
                    }
                }
                n += 1;
                // the vandal's pace
                tokio::time::sleep(Duration::from_millis(7)).await;
            }
        })
    };
    let (first, second) = flood_halves(&ts, 4, 8.0).await;
    vandal.await.unwrap();
    let (peak, _, _) = smp.finish().await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!("grants vandalised: first 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x");
    shutdown_all_promptly(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_deleted_repeatedly_4_instances() {
    heartbeats_deleted(4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heartbeats_deleted_repeatedly_8_instances() {
    heartbeats_deleted(8).await;
}

/// One instance's journal batches deleted for 1 s while it stores (a batch the leader had
/// not read yet goes missing): its stores are granted again afterwards and the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_batches_deleted() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(
            tier_on(
                &s,
                shared_mem_cfg(&format!("j{i}"), blocks(CAP as f64), 0.5),
            )
            .await,
        );
    }
    warm(&ts, 10).await;
    let smp = sampler(&s, ts.clone());
    let victim = ts[1].clone();
    let until = Instant::now() + Duration::from_secs(1);
    let h = spawn_flood(&victim, base(1) | 6 << 36, 0, until, 8);
    let mut deleted = 0;
    while Instant::now() < until {
        for p in list(&s, "journal/j1").await {
            if s.inner.delete(&p).await.is_ok() {
                deleted += 1;
            }
        }
        // the vandal's pace
        tokio::time::sleep(Duration::from_millis(3)).await;
    }
    let during = h.await.unwrap();
    let (first, second) = flood_halves(&ts, 7, 6.0).await;
    let (peak, _, _) = smp.finish().await;
    let st = victim.stats().shared.unwrap();
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "journal of j1: {deleted} batches deleted; during {during:?}\nthen first 3 s {first:?}\nlast 3 s {second:?}\nj1 {st:?}\npeak {ratio:.3}x"
    );
    shutdown_all_promptly(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 3 s: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
}
