//! The leader lease: released at shutdown and when the leader is dropped, taken over within
//! two lease periods of the leader's death (dropped, runtime killed, the takeover's reply
//! lost), one lost renewal reply, a forged lease, and the lease at the ends of its range.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, SecondaryTier};
use kv_tier_obj::object_store::path::Path as ObjPath;
use kv_tier_obj::{ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::{ControlledStore, PutFault};
use kv_tier_testkit::wait::{poll_until_async, wait_until_async};
use kv_tier_testkit::{store_keys, test_key};
use object_store::ObjectStoreExt as _;

use crate::support::*;

/// Two instances in one process on the S3 server: both store, the bound holds over three
/// times its size, and when the leader closes the other takes the released lease and grants
/// credit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_store_under_one_bound_and_a_closing_leader_hands_over() {
    let server = S3Server::start().await;
    let open = |id: &str| {
        let cfg = shared_obj_config(server.config(), id);
        async move { Arc::new(ObjTier::connect("obj", cfg, ns(), SHARED_BS).await.unwrap()) }
    };
    let a = open("a").await;
    let b = open("b").await;
    let cap_blocks = SHARED_CAP_BYTES / SHARED_BS as u64;
    let mut stored = 0u64;
    let mut seq = 0u64;
    // three bounds' worth of blocks through the two instances
    while stored < 3 * cap_blocks {
        let keys: Vec<BlockKey> = (seq..seq + SHARED_JOB).map(test_key).collect();
        seq += SHARED_JOB;
        let t = if (seq / SHARED_JOB).is_multiple_of(2) {
            &a
        } else {
            &b
        };
        let r = store_keys(&**t, &keys, 0, SHARED_BS).await;
        stored += r.ok.len() as u64;
        assert!(seq < 100 * cap_blocks, "stores stalled at {stored} blocks");
    }
    let leader = if a.stats().shared.unwrap().leader {
        a.clone()
    } else {
        b.clone()
    };
    let other = if Arc::ptr_eq(&leader, &a) { &b } else { &a };
    // the leader's index and the objects agree with the bound
    let st = leader.stats();
    assert!(
        st.bytes <= (SHARED_CAP_BYTES as f64 * 1.10) as u64,
        "the leader indexes {} bytes",
        st.bytes
    );
    assert!(
        leader.stats().shared.unwrap().leader,
        "no instance leads: {:?} / {:?}",
        a.stats().shared,
        b.stats().shared
    );
    let before = other.stats().shared.unwrap().takeovers;
    leader.shutdown().await.unwrap();
    let taken = poll_until_async(Duration::from_secs_f64(10.0 * SHARED_LEASE_S), || {
        other.stats().shared.unwrap().takeovers != before
    })
    .await;
    assert!(
        taken,
        "the released lease was not taken: {:?}",
        other.stats().shared
    );
    let keys: Vec<BlockKey> = (seq..seq + SHARED_JOB).map(test_key).collect();
    let t0 = Instant::now();
    loop {
        let r = store_keys(&**other, &keys, 0, SHARED_BS).await;
        if r.is_success() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs_f64(10.0 * SHARED_LEASE_S),
            "the new leader grants no credit: {:?}",
            r.failed
        );
    }
    other.shutdown().await.unwrap();
}

/// A leader dropped without `shutdown` releases the lease (the other instance takes it long
/// before a lease period would have expired it) and deletes its heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_dropped_without_shutdown_releases_the_lease() {
    let s = Arc::new(kv_tier_testkit::controlled_store::ControlledStore::new());
    let open = |id: &str| {
        let mut cfg = shared_obj_config(ObjTierConfig::new("mem"), id);
        cfg.shared_lease_s = Some(30.0);
        let s = s.clone();
        async move {
            ObjTier::with_store("obj", s, cfg, ns(), SHARED_BS)
                .await
                .unwrap()
        }
    };
    let a = open("a").await;
    wait_until_async("a lease taken", Duration::from_secs(10), || {
        a.stats().shared.unwrap().leader
    })
    .await;
    let b = open("b").await;
    // the heartbeats of instance `id`'s members (`members/<id>.<suffix>`)
    let heartbeats = |id: &'static str| {
        let s = s.clone();
        async move {
            use object_store::ObjectStore as _;
            let dir = object_store::path::Path::from(format!(
                "kv-tier-shared/{}/members",
                ns().rank_dir_name()
            ));
            let listed = s.inner.list_with_delimiter(Some(&dir)).await.unwrap();
            listed
                .objects
                .iter()
                .filter(|o| {
                    o.location
                        .filename()
                        .is_some_and(|f| f.starts_with(&format!("{id}.")))
                })
                .count()
        }
    };
    assert_eq!(heartbeats("a").await, 1);
    drop(a);
    // a lease of 30 s: taken within 10 only if released
    let released =
        poll_until_async(Duration::from_secs(10), || b.stats().shared.unwrap().leader).await;
    assert!(
        released,
        "the dropped leader's lease was not released: {:?}",
        b.stats().shared
    );
    assert_eq!(heartbeats("a").await, 0, "the heartbeat is left");
    b.shutdown().await.unwrap();
}

/// The leader dropped (its last `Arc`) without shutdown: another instance holds the lease
/// within two lease periods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_dropped_without_shutdown_is_taken_over() {
    const LEASE: f64 = 0.5;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(tier_on(&s, shared_mem_cfg(&format!("d{i}"), blocks(256.0), LEASE)).await);
    }
    warm(&ts, 2).await;
    let l = leaders(&ts);
    assert_eq!(l.len(), 1, "leaders {l:?}");
    let dead = ts.remove(l[0]);
    let dead_id = dead.stats().shared.unwrap();
    let before = read(&s, "lease").await;
    drop(dead);
    let t0 = Instant::now();
    let took = poll_until_async(Duration::from_secs_f64(8.0 * LEASE + 10.0), || {
        !leaders(&ts).is_empty()
    })
    .await
    .then(|| t0.elapsed());
    let after = read(&s, "lease").await;
    eprintln!(
        "leader dropped ({dead_id:?}); lease before {before:?}, {:?} later {after:?}; takeover after {took:?}",
        t0.elapsed()
    );
    shutdown_all_promptly(&ts).await;
    let took = took.unwrap_or_else(|| {
        panic!(
            "no takeover within {:?} of dropping the leader: the lease went from {before:?} to {after:?} (still renewed)",
            t0.elapsed()
        )
    });
    assert!(
        took <= Duration::from_secs_f64(2.0 * LEASE + SCHED_SLACK_S),
        "takeover after {took:?}"
    );
}

/// The leader's runtime killed mid-flood_until (as a SIGKILL does): another instance takes the
/// lease within two lease periods, grants again, and the bound holds throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leader_runtime_killed_mid_flood_is_taken_over_and_the_bound_holds() {
    const LEASE: f64 = 0.5;
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let (rt, a) = open_on_own_runtime(&s, shared_mem_cfg("k-a", blocks(CAP as f64), LEASE));
    // a leads (it opened first)
    wait_until_async(
        "the first instance to take the lease",
        Duration::from_secs(5),
        || a.stats().shared.unwrap().leader,
    )
    .await;
    let b = tier_on(&s, shared_mem_cfg("k-b", blocks(CAP as f64), LEASE)).await;
    let c = tier_on(&s, shared_mem_cfg("k-c", blocks(CAP as f64), LEASE)).await;
    let others = vec![b.clone(), c.clone()];
    warm(&others, 3).await;
    let smp = sampler(&s, others.clone());
    // a floods on its own runtime
    let a_until = Instant::now() + Duration::from_secs(30);
    let _a_flood = rt.spawn(flood_until(a.clone(), base(0), 0, a_until, 8));
    let until = Instant::now() + Duration::from_secs(7);
    let hb = spawn_flood(&b, base(1), 0, until, 8);
    let hc = spawn_flood(&c, base(2), 0, until, 8);
    // the floods run a while before the kill
    tokio::time::sleep(Duration::from_secs(2)).await;
    rt.shutdown_background();
    let killed = Instant::now();
    let took = poll_until_async(Duration::from_secs_f64(8.0 * LEASE + 10.0), || {
        !leaders(&others).is_empty()
    })
    .await
    .then(|| killed.elapsed());
    let tb = hb.await.unwrap();
    let tc = hc.await.unwrap();
    // credit flows after the takeover
    let late_b = first_success(&b, 0xB0 << 40, Duration::from_secs(30)).await;
    let late_c = first_success(&c, 0xC0 << 40, Duration::from_secs(30)).await;
    let (peak, max_leaders, samples) = smp.finish().await;
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "killed leader: takeover after {took:?}; b {tb:?} c {tc:?}; later stores b {late_b:?} c {late_c:?}; peak {ratio:.3}x over {samples} samples; max leaders among survivors {max_leaders}"
    );
    shutdown_all_promptly(&others).await;
    drop(a);
    let took = took.expect("no survivor took the lease");
    assert!(
        took <= Duration::from_secs_f64(2.0 * LEASE + SCHED_SLACK_S),
        "takeover after {took:?}"
    );
    assert!(
        late_b.is_some() && late_c.is_some(),
        "no credit after the takeover"
    );
    assert!(ratio <= 1.10, "peak {ratio:.3}x the bound");
}

/// The leader killed; the first takeover PUT lands but its reply is lost: another instance
/// still holds the lease within two periods of the death.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_whose_reply_is_lost_still_within_two_periods() {
    const LEASE: f64 = 1.0;
    let f = Arc::new(ControlledStore::new());
    let (rt, a) = open_on_own_runtime(&f, shared_mem_cfg("lost-a", blocks(128.0), LEASE));
    wait_until_async(
        "the first instance to take the lease",
        Duration::from_secs(5),
        || a.stats().shared.unwrap().leader,
    )
    .await;
    let b = tier_on(&f, shared_mem_cfg("lost-b", blocks(128.0), LEASE)).await;
    let c = tier_on(&f, shared_mem_cfg("lost-c", blocks(128.0), LEASE)).await;
    let others = vec![b.clone(), c.clone()];
    warm(&others, 2).await;
    rt.shutdown_background();
    let killed = Instant::now();
    f.fail_puts(PutFault::ReplyLost, "/lease", 1);
    let took = poll_until_async(Duration::from_secs_f64(6.0 * LEASE + 10.0), || {
        !leaders(&others).is_empty()
    })
    .await
    .then(|| killed.elapsed());
    let lost = f.failed_puts();
    let lease = f
        .inner
        .get(&ObjPath::from(format!(
            "kv-tier-shared/{}/lease",
            ns().rank_dir_name()
        )))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    eprintln!(
        "leader killed, {lost} lease reply lost: takeover after {took:?} (lease {LEASE} s); lease now {:?}",
        String::from_utf8_lossy(&lease)
    );
    shutdown_all(&others).await;
    assert_eq!(lost, 1, "the fault did not fire");
    let took = took.expect("no takeover within 6 periods and 10 s");
    assert!(
        took <= Duration::from_secs_f64(2.0 * LEASE + SCHED_SLACK_S),
        "takeover {took:?} after the leader died (lease {LEASE} s)"
    );
}

/// The live leader's renewal lands but its reply is lost once: how long the bucket has no
/// leader (no credit); it should lead again (or another) within two periods, and a writer
/// should get credit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_lost_renewal_reply_of_a_live_leader() {
    const LEASE: f64 = 1.0;
    let f = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(
            tier_on(
                &f,
                shared_mem_cfg(&format!("renew{i}"), blocks(128.0), LEASE),
            )
            .await,
        );
    }
    warm(&ts, 3).await;
    let l0 = leaders(&ts);
    assert_eq!(l0.len(), 1);
    // the fault comes at some point of a lease period
    tokio::time::sleep(Duration::from_millis(300)).await;
    f.fail_puts(PutFault::ReplyLost, "/lease", 1);
    let inj = Instant::now();
    // watch: the longest stretch with no leader
    let mut gap_start: Option<Instant> = None;
    let mut longest = Duration::ZERO;
    let mut stepped = false;
    while inj.elapsed() < Duration::from_secs_f64(5.0 * LEASE) {
        let l = leaders(&ts);
        if l.is_empty() {
            stepped = true;
            gap_start.get_or_insert_with(Instant::now);
        } else if let Some(s) = gap_start.take() {
            longest = longest.max(s.elapsed());
        }
        // the leaders are sampled every 2 ms for 5 lease periods
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    if let Some(s) = gap_start {
        longest = longest.max(s.elapsed());
    }
    let w = ts[(l0[0] + 1) % 3].clone();
    let t = Instant::now();
    let mut ok = false;
    while t.elapsed() < Duration::from_secs(30) {
        if store_keys(
            &*w,
            &[test_key(base(5) + t.elapsed().as_micros() as u64)],
            0,
            BS,
        )
        .await
        .is_success()
        {
            ok = true;
            break;
        }
    }
    eprintln!(
        "one lost renewal reply (fired {}): leader stepped down: {stepped}; longest leaderless stretch {longest:?} (lease {LEASE} s); leaders now {:?}; writer stores again: {ok}",
        f.failed_puts(),
        leaders(&ts)
    );
    shutdown_all(&ts).await;
    assert_eq!(f.failed_puts(), 1);
    assert!(ok, "no credit after the lost reply");
    assert!(
        longest <= Duration::from_secs_f64(2.0 * LEASE + SCHED_SLACK_S),
        "no leader for {longest:?}"
    );
}

/// The lease overwritten with a lower epoch and an owner nobody knows (a wiped or restored
/// coordination prefix, an operator's edit) after epochs had climbed: the leader steps down at
/// its next renewal, the forged lease expires a period later, one instance takes it above every
/// epoch it has seen, and the writers take that leader's grants and store again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_lease_expires_and_the_next_leader_goes_above_every_epoch_seen() {
    use object_store::ObjectStoreExt as _;
    let s = Arc::new(kv_tier_testkit::controlled_store::ControlledStore::new());
    let lease =
        object_store::path::Path::from(format!("kv-tier-shared/{}/lease", ns().rank_dir_name()));
    s.inner.put(&lease, "7 - 0".into()).await.unwrap();
    let open = |id: &str| {
        let mut cfg = shared_obj_config(ObjTierConfig::new("mem"), id);
        cfg.shared_lease_s = Some(0.3);
        let s = s.clone();
        async move {
            ObjTier::with_store("obj", s, cfg, ns(), SHARED_BS)
                .await
                .unwrap()
        }
    };
    let (a, b) = (open("a").await, open("b").await);
    async fn stores(t: &ObjTier, from: u64) {
        let keys: Vec<BlockKey> = (from..from + 4).map(test_key).collect();
        let t0 = Instant::now();
        while !store_keys(t, &keys, 0, SHARED_BS).await.is_success() {
            assert!(t0.elapsed() < Duration::from_secs(10), "no credit");
        }
    }
    stores(&a, 0).await;
    stores(&b, 10).await;
    for t in [&a, &b] {
        assert!(
            t.stats().shared.unwrap().epoch >= 8,
            "{:?}",
            t.stats().shared
        );
    }
    s.inner.put(&lease, "1 forged 0".into()).await.unwrap();
    // the forged lease expires and is taken above epoch 8; both see it, one leads
    let settled = poll_until_async(Duration::from_secs(10), || {
        [&a, &b].iter().all(|t| t.stats().shared.unwrap().epoch > 8)
            && [&a, &b]
                .iter()
                .filter(|t| t.stats().shared.unwrap().leader)
                .count()
                == 1
    })
    .await;
    assert!(settled, "{:?} {:?}", a.stats().shared, b.stats().shared);
    // the credit of epoch 8 is void now: these stores need the new leader's grants
    stores(&a, 20).await;
    stores(&b, 30).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// The lease at its range's ends: 0.1 s (two instances flooding 4 s: the bound holds, the
/// lease does not flap much, shutdown ends) and 600 s (stores are granted within a few s,
/// shutdown ends promptly).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_at_the_ends_of_its_range() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let ts = vec![
        tier_on(&s, shared_mem_cfg("e0", blocks(CAP as f64), 0.1)).await,
        tier_on(&s, shared_mem_cfg("e1", blocks(CAP as f64), 0.1)).await,
    ];
    warm(&ts, 17).await;
    let smp = sampler(&s, ts.clone());
    let until = Instant::now() + Duration::from_secs(4);
    let h0 = spawn_flood(&ts[0], base(0), 0, until, 8);
    let h1 = spawn_flood(&ts[1], base(1), 0, until, 8);
    let f = (h0.await.unwrap(), h1.await.unwrap());
    let (peak, max_leaders, _) = smp.finish().await;
    let takeovers: u64 = ts.iter().map(|t| t.stats().shared.unwrap().takeovers).sum();
    let epoch = ts[0].stats().shared.unwrap().epoch;
    let t0 = Instant::now();
    shutdown_all_promptly(&ts).await;
    let shut_fast = t0.elapsed();
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    // 600 s
    let s2 = Arc::new(ControlledStore::new());
    let long = tier_on(&s2, shared_mem_cfg("long", blocks(CAP as f64), 600.0)).await;
    let got = first_success(&long, 0x60 << 40, Duration::from_secs(10)).await;
    let t1 = Instant::now();
    shutdown_all_promptly(std::slice::from_ref(&long)).await;
    let shut_long = t1.elapsed();
    eprintln!(
        "lease 0.1 s: {f:?}, peak {ratio:.3}x, takeovers {takeovers} (epoch {epoch}), max leaders {max_leaders}, shutdown {shut_fast:?}; lease 600 s: first store after {got:?}, shutdown {shut_long:?}"
    );
    assert!(ratio <= 1.10, "peak {ratio:.3}x");
    assert!(got.is_some(), "lease 600 s: no store granted within 10 s");
    assert!(
        shut_long < Duration::from_secs(5),
        "lease 600 s: shutdown took {shut_long:?}"
    );
}
