//! Credit: the leader grants the room under the bound in even shares (bounds of a few blocks,
//! idle members), a grant PUT that times out or a heartbeat that lapses does not starve a
//! member, stores without credit end in about a second, a leader whose listing broke grants
//! nothing, and dropped futures leak no credit.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::{ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::ControlledStore;
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, store_keys, test_key};

use crate::support::*;

/// Two instances, a bound of 1.5 blocks (it holds a block): each instance should be able
/// to store (the bucket is empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_on_a_bound_of_one_and_a_half_blocks_both_store() {
    let f = Arc::new(ControlledStore::new());
    let a = tier_on(&f, shared_mem_cfg("half-a", blocks(1.5), 0.5)).await;
    let b = tier_on(&f, shared_mem_cfg("half-b", blocks(1.5), 0.5)).await;
    assert!(wait_leader(&[a.clone(), b.clone()], Duration::from_secs(3)).await);
    let ha = tokio::spawn(trickle(a.clone(), base(0), 5.0));
    let hb = tokio::spawn(trickle(b.clone(), base(1), 5.0));
    let (ra, rb) = (ha.await.unwrap(), hb.await.unwrap());
    let bytes = present_bytes(&f.inner);
    eprintln!(
        "bound 1.5 blocks, 2 instances, 5 s: a stored {} (refused {}), b stored {} (refused {}); bucket {bytes} B; a {:?}; b {:?}",
        ra.0,
        ra.1,
        rb.0,
        rb.1,
        a.stats().shared,
        b.stats().shared
    );
    shutdown_all(&[a, b]).await;
    assert!(
        ra.0 > 0 && rb.0 > 0,
        "an instance never stored on an empty bucket: a {ra:?}, b {rb:?}"
    );
}

/// A bound of 7 blocks, one instance alone: a non-shared bounded tier stores up to 7 blocks;
/// the shared one should store something (or refuse the config naming a field).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_bound_still_grants_a_block() {
    let s = Arc::new(ControlledStore::new());
    let c = shared_mem_cfg("small", blocks(7.0), 0.5);
    let t = match ObjTier::with_store("obj", s.clone(), c, ns(), BS).await {
        Ok(t) => Arc::new(t),
        Err(e) => {
            eprintln!("refused: {e}");
            return;
        }
    };
    let got = first_success(&t, 0x5A << 40, Duration::from_secs(5)).await;
    let st = t.stats().shared.unwrap();
    eprintln!("bound of 7 blocks: first store after {got:?}; {st:?}");
    shutdown_all_promptly(&[t]).await;
    assert!(
        got.is_some(),
        "nothing stored within 5 s under a 7-block bound: {st:?}"
    );
}

/// Six instances, a bound of 8 blocks; five are idle (they never store, as replicas that
/// only load), one writes a block at a time for 6 s: it keeps being granted (the bucket has
/// room: the writer's old blocks are evicted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_members_do_not_starve_the_one_writer_on_a_small_bound() {
    let f = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..6 {
        ts.push(tier_on(&f, shared_mem_cfg(&format!("idle{i}"), blocks(8.0), 0.5)).await);
    }
    assert!(wait_leader(&ts, Duration::from_secs(3)).await);
    let w = ts[5].clone();
    let first = trickle(w.clone(), base(0), 3.0).await;
    let second = trickle(w.clone(), base(1), 3.0).await;
    let bytes = present_bytes(&f.inner);
    let l = leaders(&ts);
    eprintln!(
        "bound 8 blocks, 6 instances, 1 writer: first 3 s stored {} refused {}, next 3 s stored {} refused {}; bucket {} blocks; writer {:?}; leader {:?}",
        first.0,
        first.1,
        second.0,
        second.1,
        bytes / BS as u64,
        w.stats().shared,
        l.first().map(|i| ts[*i].stats().shared)
    );
    shutdown_all(&ts).await;
    assert!(
        second.0 > 0,
        "the writer was starved for 3 s while the bucket held {} of 8 blocks",
        bytes / BS as u64
    );
}

/// With no credit to be had (the bound is under a block for the writer's share), a store of
/// 64 blocks is refused with NoSpace in about a second; a shutdown while it waits ends at
/// once, and the store ends too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_waiting_for_credit_end_in_about_a_second_and_shutdown_ends() {
    let s = Arc::new(ControlledStore::new());
    // 16 blocks, 3 instances: each may hold 16*4096/8/3 = 2730 bytes unspent < one block
    let mut ts = Vec::new();
    for i in 0..3 {
        let mut c = shared_mem_cfg(&format!("n{i}"), blocks(16.0), 0.5);
        c.io_threads = 4;
        ts.push(tier_on(&s, c).await);
    }
    wait_until_async(
        "a leader counting the three instances",
        SETTLE_LIMIT,
        || {
            ts.iter().any(|t| {
                let st = t.stats().shared.unwrap();
                st.leader && st.members == 3
            })
        },
    )
    .await;
    let keys: Vec<BlockKey> = (0..64).map(|i| test_key(0xD0 << 40 | i)).collect();
    let t0 = Instant::now();
    let r = store_keys(&*ts[0], &keys, 0, BS).await;
    let took = t0.elapsed();
    let tl = tally(&r);
    // during a wait: shutdown
    let t = ts[1].clone();
    let keys2: Vec<BlockKey> = (0..64).map(|i| test_key(0xD1 << 40 | i)).collect();
    let st = tokio::spawn(async move {
        let t0 = Instant::now();
        let r = store_keys(&*t, &keys2, 0, BS).await;
        (t0.elapsed(), tally(&r))
    });
    // the store waits for credit when the shutdown comes
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t1 = Instant::now();
    ts[1].shutdown().await.unwrap();
    let shut = t1.elapsed();
    let (store_took, tl2) = st.await.unwrap();
    eprintln!(
        "no credit: a 64-block store (io_threads 4) took {took:?}: {tl:?}; with a shutdown 300 ms in: shutdown took {shut:?}, the store {store_took:?}: {tl2:?}"
    );
    shutdown_all_promptly(&[ts[0].clone(), ts[2].clone()]).await;
    assert!(shut < Duration::from_secs(10), "shutdown took {shut:?}");
    assert!(
        took < Duration::from_secs(10),
        "a store without credit took {took:?}"
    );
    assert!(
        store_took < Duration::from_secs(10),
        "a store during shutdown took {store_took:?}"
    );
}

/// The leader's PUT of one member's grant times out once (the request held past its
/// deadline, so it never lands: a transient failure): that member is granted credit again
/// afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_put_that_times_out_once_does_not_starve_the_member() {
    use kv_tier_testkit::controlled_store::Op;
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let c = |id: &str| {
        let mut c = shared_mem_cfg(id, blocks(CAP as f64), 0.5);
        c.request_timeout_s = 0.3;
        c
    };
    let q0 = tier_on(&s, c("q0")).await;
    wait_until_async(
        "the first instance to take the lease",
        Duration::from_secs(5),
        || q0.stats().shared.unwrap().leader,
    )
    .await;
    // the leader's first grant PUT to q1 is held past its deadline (never lands)
    let vid = "q1";
    let path = coord(&format!("grants/{vid}")).to_string();
    let _gate = s.hold_path(Op::Put, &path);
    let q1 = tier_on(&s, c("q1")).await;
    let q2 = tier_on(&s, c("q2")).await;
    let ts = vec![q0, q1, q2];
    let v = 1;
    let before = read(&s, &format!("grants/{vid}")).await;
    let held_until = Instant::now() + Duration::from_secs(2);
    let during = flood_until(ts[v].clone(), base(v as u64) | 12 << 36, 0, held_until, 8).await;
    s.release(Op::Put);
    let mid = read(&s, &format!("grants/{vid}")).await;
    let (first, second) = flood_halves(&ts, 13, 6.0).await;
    let after = read(&s, &format!("grants/{vid}")).await;
    let st = ts[v].stats().shared.unwrap();
    eprintln!(
        "grant PUT held for {vid}: grant before {before:?}, after the hold {mid:?}, at the end {after:?}; during {during:?}\nthen first 3 s {first:?}\nlast 3 s {second:?}\n{vid}: {st:?}"
    );
    shutdown_all_promptly(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 3 s: {t:?}"
        );
    }
}

/// One member's heartbeat PUTs fail (held past their deadline) for 4 s, long enough for
/// the leader to find it dead and forget it, while its journal and grant reads still work;
/// then its heartbeats land again: it is granted credit again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_heartbeat_lapses_is_granted_again() {
    use kv_tier_testkit::controlled_store::Op;
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        let mut c = shared_mem_cfg(&format!("hb{i}"), blocks(CAP as f64), 0.5);
        c.request_timeout_s = 0.2;
        ts.push(tier_on(&s, c).await);
    }
    warm(&ts, 20).await;
    let l = leaders(&ts);
    assert_eq!(l.len(), 1);
    let v = (l[0] + 1) % 3;
    // traffic first: its cumulative grant grows
    let until = Instant::now() + Duration::from_secs(2);
    let hs: Vec<_> = ts
        .iter()
        .enumerate()
        .map(|(i, t)| spawn_flood(t, base(i as u64) | 14 << 36, 0, until, 8))
        .collect();
    for h in hs {
        h.await.unwrap();
    }
    let _gate = s.hold_path(Op::Put, coord(&format!("members/hb{v}")).as_ref());
    let held = Instant::now();
    let leader = ts[l[0]].clone();
    let mut members_min = u64::MAX;
    while held.elapsed() < Duration::from_secs(4) {
        members_min = members_min.min(leader.stats().shared.unwrap().members);
        // the hold lasts 4 s; the leader's count is sampled meanwhile
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.release(Op::Put);
    let (first, second) = flood_halves(&ts, 15, 6.0).await;
    let st = ts[v].stats().shared.unwrap();
    let grant = read(&s, &format!("grants/hb{v}")).await;
    eprintln!(
        "heartbeat of hb{v} held 4 s (leader counted as few as {members_min} members)\nthen first 3 s {first:?}\nlast 3 s {second:?}\nhb{v}: {st:?}; its grant object {grant:?}"
    );
    shutdown_all_promptly(&ts).await;
    for (i, t) in second.iter().enumerate() {
        assert!(
            t.stored > 0,
            "instance {i} stored nothing in the last 3 s: {t:?}"
        );
    }
}

/// A new leader whose LIST of the objects breaks part way neither sweeps nor grants (with an
/// index short of objects it would let the bucket overflow): stores are refused for lack of
/// credit and nothing is deleted; once a LIST goes through, it counts every object, sweeps
/// down to the bound and grants again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_whose_listing_broke_grants_nothing_until_it_lists_every_object() {
    use kv_tier_testkit::controlled_store::{ControlledStore, Op};
    let s = Arc::new(ControlledStore::new());
    const N: u64 = 48;
    // N blocks already in the bucket, more than the shared bound of 32
    let plain = ObjTier::with_store("obj", s.clone(), ObjTierConfig::new("mem"), ns(), SHARED_BS)
        .await
        .unwrap();
    let old: Vec<BlockKey> = (0..N).map(test_key).collect();
    assert!(store_keys(&plain, &old, 0, SHARED_BS).await.is_success());
    plain.shutdown().await.unwrap();
    s.fail_lists(Some(&ns().rank_dir_name()));
    let mut cfg = shared_obj_config(ObjTierConfig::new("mem"), "a");
    cfg.max_size_gb = Some((32 * SHARED_BS) as f64 / (1u64 << 30) as f64);
    cfg.shared_lease_s = Some(0.2);
    let tier = ObjTier::with_store("obj", s.clone(), cfg, ns(), SHARED_BS)
        .await
        .unwrap();
    let new = [test_key(1000)];
    wait_until_async("a lease taken", Duration::from_secs(10), || {
        tier.stats().shared.unwrap().leader
    })
    .await;
    let r = store_keys(&tier, &new, 0, SHARED_BS).await;
    assert!(
        matches!(&r.failed[..], [(_, Error::NoSpace { .. })]),
        "a leader with a broken listing granted credit: {r:?}"
    );
    assert_eq!(
        s.count(Op::Delete),
        0,
        "a leader with a broken listing swept"
    );
    s.fail_lists(None);
    let t0 = Instant::now();
    while !store_keys(&tier, &new, 0, SHARED_BS).await.is_success() {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "no credit after the listing went through"
        );
    }
    // it knew the N objects: it deleted down to the bound, least recently used first
    assert!(
        s.count(Op::Delete) as u64 >= N - 32,
        "{} deleted",
        s.count(Op::Delete)
    );
    let st = tier.stats();
    assert!(st.objects <= 33 && st.objects > 0, "{st:?}");
    tier.shutdown().await.unwrap();
}

/// Store, load and lookup futures dropped at random early points 600 times across three
/// instances: afterwards every instance stores within 3 s, the bound held, and once idle the
/// leader's count agrees with the bucket (no credit or store in flight leaked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_futures_leave_nothing_wedged() {
    const CAP: u64 = 256;
    let s = Arc::new(ControlledStore::new());
    let mut ts = Vec::new();
    for i in 0..3 {
        ts.push(
            tier_on(
                &s,
                shared_mem_cfg(&format!("c{i}"), blocks(CAP as f64), 0.5),
            )
            .await,
        );
    }
    warm(&ts, 14).await;
    let smp = sampler(&s, ts.clone());
    let mut rng = 0x1234_5678_9abc_def1u64;
    let mut dropped = 0;
    for n in 0..600u64 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let t = &ts[(rng % 3) as usize];
        let d = Duration::from_micros(rng >> 54); // 0 to ~1 ms
        let keys: Vec<BlockKey> = (0..8).map(|j| test_key(0xC0 << 40 | n << 8 | j)).collect();
        let r = match n % 3 {
            0 => tokio::time::timeout(d, store_keys(&**t, &keys, 0, BS))
                .await
                .is_err(),
            1 => tokio::time::timeout(d, load_keys(&**t, &keys, BS))
                .await
                .is_err(),
            _ => tokio::time::timeout(d, t.lookup(&keys)).await.is_err(),
        };
        dropped += r as u64;
    }
    let mut late = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        late.push(first_success(t, 0xCF << 40 | (i as u64) << 20, Duration::from_secs(30)).await);
    }
    // 2 s idle before the bucket and the leader's count are read
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (peak, _, _) = smp.finish().await;
    let bucket = present_bytes(&s.inner);
    let l = leaders(&ts);
    let global = l
        .first()
        .map(|&i| ts[i].stats().shared.unwrap().global_bytes);
    let ratio = peak as f64 / (CAP * BS as u64) as f64;
    eprintln!(
        "{dropped} of 600 futures dropped; later first stores {late:?}; peak {ratio:.3}x; idle: bucket {bucket} B, leader's global_bytes {global:?}"
    );
    shutdown_all_promptly(&ts).await;
    assert!(
        late.iter().all(Option::is_some),
        "no credit after drops: {late:?}"
    );
    assert!(ratio <= 1.10);
}
