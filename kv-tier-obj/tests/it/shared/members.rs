//! Members: two instances with the same id, an instance restarted with its id while the
//! leader lives (in memory and on the S3 server), the whole fleet restarted, and members
//! joining and leaving while one floods.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::SecondaryTier;
use kv_tier_obj::ObjTier;
use kv_tier_testkit::controlled_store::ControlledStore;
use kv_tier_testkit::wait::{poll_until_async, wait_until_async};
use kv_tier_testkit::{store_keys, test_key};

use crate::support::*;

/// Two instances opened with the SAME instance_id (plus a third): either the second open is
/// refused, or the bound holds under their flood_until.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_with_the_same_id() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let x = tier_on(&s, shared_mem_cfg("x", blocks(CAP as f64), 0.5)).await;
    let d1 = tier_on(&s, shared_mem_cfg("dup", blocks(CAP as f64), 0.5)).await;
    let second = ObjTier::with_store(
        "obj",
        s.clone(),
        shared_mem_cfg("dup", blocks(CAP as f64), 0.5),
        ns(),
        BS,
    )
    .await;
    let d2 = match second {
        Err(e) => {
            eprintln!("the second open with the same id was refused: {e}");
            shutdown_all_promptly(&[x, d1]).await;
            return;
        }
        Ok(t) => Arc::new(t),
    };
    let ts = vec![x, d1, d2];
    warm(&ts, 11).await;
    let smp = sampler(&s, ts.clone());
    let (first, second) = flood_halves(&ts, 8, 8.0).await;
    // 2 s idle: what the bucket holds then is reported
    tokio::time::sleep(Duration::from_secs(2)).await;
    let resid = present_bytes(&s.inner);
    let (peak, _, _) = smp.finish().await;
    let cap = CAP * BS as u64;
    let ratio = peak as f64 / cap as f64;
    eprintln!(
        "same id twice (second open accepted): first 4 s {first:?}\nlast 4 s {second:?}\npeak {ratio:.3}x; 2 s after the flood_until the bucket holds {:.3}x",
        resid as f64 / cap as f64
    );
    shutdown_all_promptly(&ts).await;
    assert!(ratio <= 1.10, "peak {peak} B = {ratio:.3}x the bound");
}

/// An instance shut down cleanly and reopened at once with the same instance_id (a restart)
/// while the leader lives: the bound holds while it floods, and once the flood_until stops the
/// leader brings the bucket back under the bound (it knows the restarted instance's objects).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_with_the_same_id_while_the_leader_lives() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let lead = tier_on(&s, shared_mem_cfg("lead", blocks(CAP as f64), 0.5)).await;
    wait_until_async(
        "the first instance to take the lease",
        Duration::from_secs(5),
        || lead.stats().shared.unwrap().leader,
    )
    .await;
    let b = tier_on(&s, shared_mem_cfg("b", blocks(CAP as f64), 0.5)).await;
    warm(&[lead.clone(), b.clone()], 12).await;
    // b's first life: 3 s of flood_until (several bounds' worth)
    let first = flood_until(
        b.clone(),
        base(1),
        0,
        Instant::now() + Duration::from_secs(3),
        8,
    )
    .await;
    let st1 = b.stats().shared.unwrap();
    b.shutdown().await.unwrap();
    drop(b);
    let smp = sampler(&s, vec![lead.clone()]);
    let b = tier_on(&s, shared_mem_cfg("b", blocks(CAP as f64), 0.5)).await;
    // the restarted engine stores a little after it opens
    tokio::time::sleep(Duration::from_millis(300)).await;
    let second = flood_until(
        b.clone(),
        base(1),
        1 << 30,
        Instant::now() + Duration::from_secs(4),
        8,
    )
    .await;
    let st2 = b.stats().shared.unwrap();
    // idle: the leader's sweeps bring the bucket back under its bound (polled, bounded: a
    // loaded machine's leader may sweep late)
    let cap = CAP * BS as u64;
    let idle_since = Instant::now();
    let mut resid = present_bytes(&s.inner);
    poll_until_async(Duration::from_secs(30), || {
        resid = present_bytes(&s.inner);
        resid <= cap
    })
    .await;
    let (peak, _, _) = smp.finish().await;
    let lst = lead.stats();
    let ratio = peak as f64 / cap as f64;
    let resid_ratio = resid as f64 / cap as f64;
    eprintln!(
        "restart with the same id: first life {first:?} {st1:?}\nsecond life {second:?} {st2:?}\nleader indexes {} B / {} objects, {:?}\npeak {ratio:.3}x; {:?} after the flood_until the bucket holds {resid_ratio:.3}x",
        lst.bytes,
        lst.objects,
        lst.shared,
        idle_since.elapsed()
    );
    shutdown_all_promptly(&[lead, b]).await;
    assert!(ratio <= 1.10, "peak {peak} B = {ratio:.3}x the bound");
    assert!(
        resid_ratio <= 1.0,
        "the bucket stays at {resid_ratio:.3}x its bound once idle"
    );
}

/// On the S3 server: an instance restarted with the same instance_id while the leader
/// lives floods; the bucket's block bytes stay within 1.10x the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn s3_restart_with_the_same_id_while_the_leader_lives() {
    use crate::support::{AK, BUCKET, S3Server, S3ServerExt as _, SK};
    const CAP: u64 = 256;
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("s3");
    let server = S3Server::serve(
        &root,
        std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
        BUCKET,
        AK,
        SK,
    )
    .await
    .unwrap();
    let rank_dir = root.join(BUCKET).join("tests").join(ns().rank_dir_name());
    let s3cfg = |id: &str| {
        let mut c = server.config();
        let base = shared_mem_cfg(id, blocks(CAP as f64), 1.0);
        c.max_size_gb = base.max_size_gb;
        c.shared = true;
        c.shared_lease_s = base.shared_lease_s;
        c.instance_id = base.instance_id;
        c.io_threads = 8;
        c
    };
    let lead = Arc::new(server.tier(s3cfg("lead")).await);
    wait_until_async(
        "the first instance to take the lease",
        Duration::from_secs(5),
        || lead.stats().shared.unwrap().leader,
    )
    .await;
    let b = Arc::new(server.tier(s3cfg("b")).await);
    warm(&[lead.clone(), b.clone()], 18).await;
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let smp = {
        let (stop, peak, rank_dir) = (stop.clone(), peak.clone(), rank_dir.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(block_file_bytes(&rank_dir), Ordering::Relaxed);
                // the sampler's pace
                std::thread::sleep(Duration::from_millis(10));
            }
        })
    };
    let first = flood_until(
        b.clone(),
        base(1),
        0,
        Instant::now() + Duration::from_secs(6),
        8,
    )
    .await;
    let st1 = b.stats().shared.unwrap();
    let peak_first = peak.load(Ordering::Relaxed);
    b.shutdown().await.unwrap();
    drop(b);
    let b = Arc::new(server.tier(s3cfg("b")).await);
    // the restarted engine stores a little after it opens
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = flood_until(
        b.clone(),
        base(1),
        1 << 30,
        Instant::now() + Duration::from_secs(6),
        8,
    )
    .await;
    let st2 = b.stats().shared.unwrap();
    // 4 s idle (sampled): what the bucket holds then is reported
    tokio::time::sleep(Duration::from_secs(4)).await;
    let resid = block_file_bytes(&rank_dir);
    stop.store(true, Ordering::Relaxed);
    smp.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
    let cap = CAP * BS as u64;
    let ratio = peak as f64 / cap as f64;
    eprintln!(
        "S3, restart with the same id: first life {first:?} {st1:?} (peak then {:.3}x)\nsecond life {second:?} {st2:?}\npeak {ratio:.3}x; 4 s after the flood_until the bucket holds {:.3}x; leader {:?}",
        peak_first as f64 / cap as f64,
        resid as f64 / cap as f64,
        lead.stats().shared
    );
    shutdown_all_promptly(&[lead, b]).await;
    assert!(ratio <= 1.10, "peak {peak} B = {ratio:.3}x the bound");
    drop(server);
}

/// Every instance shut down cleanly, then all reopened with the same ids (a fleet restart):
/// each instance stores again (credit keeps flowing) and the bound holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_shut_down_then_reopened_with_the_same_ids() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let ids = ["r0", "r1", "r2"];
    let mut ts = Vec::new();
    for id in ids {
        ts.push(tier_on(&s, shared_mem_cfg(id, blocks(CAP as f64), 0.5)).await);
    }
    warm(&ts, 13).await;
    let (f1, s1) = flood_halves(&ts, 9, 3.0).await;
    shutdown_all_promptly(&ts).await;
    drop(ts);
    let mut ts = Vec::new();
    for id in ids {
        ts.push(tier_on(&s, shared_mem_cfg(id, blocks(CAP as f64), 0.5)).await);
    }
    // an engine opens, then stores a little later
    tokio::time::sleep(Duration::from_millis(500)).await;
    let smp = sampler(&s, ts.clone());
    let (f2, s2) = flood_halves(&ts, 10, 8.0).await;
    let (peak, _, _) = smp.finish().await;
    let sts: Vec<_> = ts.iter().map(|t| t.stats().shared.unwrap()).collect();
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "fleet restart: before {f1:?} {s1:?}\nafter, first 4 s {f2:?}\nafter, last 4 s {s2:?}\n{sts:#?}\npeak {ratio:.3}x"
    );
    shutdown_all_promptly(&ts).await;
    for (i, t) in s2.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 4 s after reopening: {t:?}"
        );
    }
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
}

// Members joining and leaving while one floods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn member_churn_while_one_floods() {
    const CAP: f64 = 64.0;
    let f = Arc::new(ControlledStore::new());
    let a = tier_on(&f, shared_mem_cfg("churn-a", blocks(CAP), 0.5)).await;
    let w = tier_on(&f, shared_mem_cfg("churn-w", blocks(CAP), 0.5)).await;
    warm(&[a.clone(), w.clone()], 6).await;
    let smp = sampler(&f, vec![a.clone(), w.clone()]);
    let until = Instant::now() + Duration::from_secs(10);
    let hw = tokio::spawn(flood_until(w.clone(), base(1), 0, until, 4));
    let mut cycles = 0;
    let mut churn_stored = 0;
    while Instant::now() + Duration::from_secs(3) < until {
        let mut c = shared_mem_cfg(&format!("churn-{cycles}"), blocks(CAP), 0.5);
        c.instance_id = Some(format!("churn-{}", cycles % 3));
        let t = tier_on(&f, c).await;
        let r = store_keys(&*t, &[test_key(base(7) + cycles)], 0, BS).await;
        churn_stored += r.ok.len();
        if cycles % 2 == 0 {
            tokio::time::timeout(Duration::from_secs(10), t.shutdown())
                .await
                .expect("shutdown hung")
                .unwrap();
        } else {
            drop(t); // dropped without shutdown
        }
        cycles += 1;
    }
    // the last 3 s: no churn; the flooder must be granted
    let before = w.stats().shared.unwrap();
    let tw = hw.await.unwrap();
    let after = w.stats().shared.unwrap();
    let (peak, max_leaders, _) = smp.finish().await;
    // the leader forgets the members that left (polled, bounded: it may tick late)
    let members_of = || {
        leaders(&[a.clone(), w.clone()])
            .first()
            .map(|i| [&a, &w][*i].stats().shared.unwrap().members)
    };
    poll_until_async(Duration::from_secs(30), || members_of() == Some(2)).await;
    let members = members_of();
    eprintln!(
        "churn: {cycles} joins/leaves, churners stored {churn_stored}; flooder {tw:?}; granted in the quiet 3 s: {} B; peak {:.3}x, max leaders {max_leaders}; members now {members:?}",
        after.granted_bytes.saturating_sub(before.granted_bytes),
        peak as f64 / blocks(CAP)
    );
    shutdown_all(&[a, w]).await;
    assert!(peak as f64 <= 1.10 * blocks(CAP));
    assert!(max_leaders <= 1);
    assert_eq!(members, Some(2), "dead members still counted alive");
}
