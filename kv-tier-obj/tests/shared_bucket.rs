//! Several processes on one bucket (`shared: true`) of the S3 test server, each a child run
//! of this test binary: the bucket's peak block bytes against the one global bound, wrong
//! bytes served, keys read by any instance never deleted, and the leader lease taken over
//! after the leader is killed with SIGKILL. Plus the shared mode's refusals.
//!
//! `KV_TIER_SHARED_SECS` sets the four-process run's length (default 60 s, as the fs test).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{AK, BUCKET, S3Server, S3ServerExt as _, SK, ns};
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::{ObjChecksum, ObjTier, ObjTierConfig, Scheme};
use kv_tier_testkit::instances::{Pace, collect, kill_the_leader, run_instance};
use kv_tier_testkit::{store_keys, test_key};

const BS: usize = 16 << 10;
const CAP_BYTES: u64 = 16 << 20;
const LEASE_S: f64 = 2.0;
const INSTANCES: u64 = 4;
const JOB: u64 = 16;

fn shared_cfg(mut c: ObjTierConfig, id: &str) -> ObjTierConfig {
    c.checksum = ObjChecksum::Crc32c;
    c.max_size_gb = Some(CAP_BYTES as f64 / (1u64 << 30) as f64);
    c.shared = true;
    c.shared_lease_s = Some(LEASE_S);
    c.instance_id = Some(id.into());
    c.io_threads = 8;
    c.request_timeout_s = 5.0;
    c.max_retries = 1;
    c
}

fn child_cfg(endpoint: &str, id: &str) -> ObjTierConfig {
    let mut c = ObjTierConfig::new(BUCKET);
    c.endpoint_override = Some(endpoint.into());
    c.access_key = Some(AK.into());
    c.secret_key = Some(SK.into());
    c.region = Some("us-east-1".into());
    c.scheme = Scheme::Http;
    c.prefix = "tests/".into();
    shared_cfg(c, id)
}

#[test]
#[ignore = "a child process of the shared_bucket tests"]
fn shared_bucket_child() {
    let Ok(spec) = std::env::var("KV_TIER_SHARED_CHILD") else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let (endpoint, child, secs, out) = (
        parts[0].to_string(),
        parts[1].parse::<u64>().unwrap(),
        parts[2].parse::<f64>().unwrap(),
        PathBuf::from(parts[3]),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let o = rt.block_on(async move {
        let cfg = child_cfg(&endpoint, &format!("child-{child}"));
        let tier = Arc::new(ObjTier::connect("obj", cfg, ns(), BS).await.unwrap());
        let end = Instant::now() + Duration::from_secs_f64(secs);
        // a pace the one test server serves for four instances; the hot keys well within the
        // quarter lease (500 ms) reads are journaled at
        let pace = Pace {
            hot_every: Duration::from_millis(100),
            reader_pause: Duration::from_millis(20),
        };
        let mut o = run_instance(tier.clone(), child, INSTANCES, end, BS, pace).await;
        let st = tier.stats().shared.unwrap();
        eprintln!("child {child}: {st:?}");
        o.took_lease = st.takeovers;
        tier.shutdown().await.unwrap();
        o
    });
    std::fs::write(out, o.to_text()).unwrap();
}

fn spawn_child(endpoint: &str, child: u64, secs: f64, out: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["shared_bucket_child", "--ignored", "--exact", "--nocapture"])
        .env(
            "KV_TIER_SHARED_CHILD",
            format!("{endpoint}|{child}|{secs}|{}", out.display()),
        )
        .spawn()
        .unwrap()
}

/// Bytes of the block objects under `dir` (the server's files of the rank's `.bin` objects).
fn block_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let Ok(rd) = std::fs::read_dir(dir) else {
        return 0;
    };
    for e in rd.flatten() {
        let Ok(t) = e.file_type() else { continue };
        if t.is_dir() {
            total += block_bytes(&e.path());
        } else if e.file_name().to_string_lossy().ends_with(".bin")
            && let Ok(m) = e.metadata()
        {
            total += m.len();
        }
    }
    total
}

/// 4 processes on one bucket for `KV_TIER_SHARED_SECS` (60) seconds of stores and loads as
/// fast as the server takes them: the rank's block objects never exceed 1.10x the global
/// bound, no wrong byte is served, no key read by any instance within a lease period is
/// deleted (hot keys, read every 30 ms by their writer and its neighbour, never miss), and
/// when the leader is killed (SIGKILL) another instance holds the lease within two lease
/// periods.
#[test]
fn four_processes_share_one_bucket_bound_and_survive_the_leaders_death() {
    let secs: f64 = std::env::var("KV_TIER_SHARED_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60.0);
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("s3");
    // the server runs on its own runtime, beside the children
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let server = rt
        .block_on(S3Server::serve(
            &root,
            std::net::SocketAddr::from(([127, 0, 0, 1], 0)),
            BUCKET,
            AK,
            SK,
        ))
        .unwrap();
    let rank = ns().rank_dir_name();
    let rank_dir = root.join(BUCKET).join("tests").join(&rank);
    let coord = root
        .join(BUCKET)
        .join("tests")
        .join("kv-tier-shared")
        .join(&rank);
    let outs: Vec<PathBuf> = (0..INSTANCES)
        .map(|c| dir.path().join(format!("out-{c}")))
        .collect();
    let mut children: Vec<Child> = (0..INSTANCES)
        .map(|c| spawn_child(&server.endpoint, c, secs, &outs[c as usize]))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak, rank_dir) = (stop.clone(), peak.clone(), rank_dir.clone());
        let start = Instant::now();
        std::thread::spawn(move || {
            let mut samples = 0u64;
            let mut at = Duration::ZERO;
            while !stop.load(Ordering::Relaxed) {
                let now = block_bytes(&rank_dir);
                if now > peak.fetch_max(now, Ordering::Relaxed) {
                    at = start.elapsed();
                }
                samples += 1;
                std::thread::sleep(Duration::from_millis(20));
            }
            (samples, at)
        })
    };
    let started = Instant::now();
    std::thread::sleep(Duration::from_secs_f64(secs / 3.0));
    let kill_time = started.elapsed();
    let (killed, takeover) = kill_the_leader(
        &mut children,
        &coord.join("lease"),
        Duration::from_secs_f64(10.0 * LEASE_S),
    );
    let total = collect(&mut children, &outs, killed);
    stop.store(true, Ordering::Relaxed);
    let (samples, peak_at) = sampler.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
    let ratio = peak as f64 / CAP_BYTES as f64;
    eprintln!(
        "{INSTANCES} instances, {secs} s: stored {} blocks ({:.2} GiB), {} refused for lack of credit, loaded {}, wrong {}, hot loads {} (misses {}); peak {:.2} MiB of block objects = {ratio:.3}x the bound over {samples} samples (at {peak_at:.1?}); leader child-{killed} killed at {kill_time:.1?}, lease taken over in {takeover:?} ({} takeovers by the survivors); {} requests served",
        total.stored,
        (total.stored * BS as u64) as f64 / (1u64 << 30) as f64,
        total.no_space,
        total.loaded,
        total.wrong,
        total.hot_loads,
        total.hot_misses,
        peak as f64 / (1u64 << 20) as f64,
        total.took_lease,
        server.requests.load(Ordering::Relaxed),
    );
    assert_eq!(
        total.wrong,
        0,
        "wrong bytes served:\n{}",
        total.notes.join("\n")
    );
    assert_eq!(
        total.hot_misses,
        0,
        "keys in use were deleted:\n{}",
        total.notes.join("\n")
    );
    assert!(ratio <= 1.10, "peak {peak} bytes is {ratio:.3}x the bound");
    assert!(
        // two lease periods, plus what a loaded 2-core machine adds to scheduling
        takeover <= Duration::from_secs_f64(2.0 * LEASE_S + 2.0),
        "the lease was taken over {takeover:?} after the kill (lease {LEASE_S} s)"
    );
    assert!(total.took_lease >= 1, "no survivor took the lease");
    // not vacuous: the bucket reached its bound, and more than the bound went through it
    assert!(
        peak as f64 >= 0.9 * CAP_BYTES as f64,
        "the bucket never reached its bound (peak {ratio:.3}x)"
    );
    assert!(
        total.stored * BS as u64 > CAP_BYTES,
        "only {} blocks stored",
        total.stored
    );
    drop(server);
}

/// On a store without conditional writes, a shared bucket is refused at open, naming the
/// option; without `max_size_gb`, at validation.
#[tokio::test]
async fn a_shared_bucket_needs_conditional_writes_and_a_bound() {
    let store = Arc::new(kv_tier_testkit::controlled_store::ControlledStore::new());
    store.refuse_create(true);
    let cfg = shared_cfg(ObjTierConfig::new("mem"), "a");
    let e = ObjTier::with_store("obj", store, cfg.clone(), ns(), BS)
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("shared") && e.to_string().contains("conditional"),
        "{e}"
    );
    let mut unbounded = cfg.clone();
    unbounded.max_size_gb = None;
    let e = unbounded.validate().unwrap_err();
    assert!(e.to_string().contains("max_size_gb"), "{e}");
    let mut stray = ObjTierConfig::new("b");
    stray.shared_lease_s = Some(1.0);
    let e = stray.validate().unwrap_err();
    assert!(e.to_string().contains("shared_lease_s"), "{e}");
}

/// Two instances in one process on the S3 server: both store, the bound holds over three
/// times its size, and when the leader closes the other takes the released lease and grants
/// credit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_store_under_one_bound_and_a_closing_leader_hands_over() {
    let server = S3Server::start().await;
    let open = |id: &str| {
        let cfg = shared_cfg(server.config(), id);
        async move { Arc::new(ObjTier::connect("obj", cfg, ns(), BS).await.unwrap()) }
    };
    let a = open("a").await;
    let b = open("b").await;
    let cap_blocks = CAP_BYTES / BS as u64;
    let mut stored = 0u64;
    let mut seq = 0u64;
    // three bounds' worth of blocks through the two instances
    while stored < 3 * cap_blocks {
        let keys: Vec<BlockKey> = (seq..seq + JOB).map(test_key).collect();
        seq += JOB;
        let t = if (seq / JOB).is_multiple_of(2) {
            &a
        } else {
            &b
        };
        let r = store_keys(&**t, &keys, 0, BS).await;
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
        st.bytes <= (CAP_BYTES as f64 * 1.10) as u64,
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
    let t0 = Instant::now();
    while other.stats().shared.unwrap().takeovers == before {
        assert!(
            t0.elapsed() < Duration::from_secs_f64(10.0 * LEASE_S),
            "the released lease was not taken: {:?}",
            other.stats().shared
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let keys: Vec<BlockKey> = (seq..seq + JOB).map(test_key).collect();
    let t0 = Instant::now();
    loop {
        let r = store_keys(&**other, &keys, 0, BS).await;
        if r.is_success() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs_f64(10.0 * LEASE_S),
            "the new leader grants no credit: {:?}",
            r.failed
        );
    }
    other.shutdown().await.unwrap();
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
    let plain = ObjTier::with_store("obj", s.clone(), ObjTierConfig::new("mem"), ns(), BS)
        .await
        .unwrap();
    let old: Vec<BlockKey> = (0..N).map(test_key).collect();
    assert!(store_keys(&plain, &old, 0, BS).await.is_success());
    plain.shutdown().await.unwrap();
    s.fail_lists(Some(&ns().rank_dir_name()));
    let mut cfg = shared_cfg(ObjTierConfig::new("mem"), "a");
    cfg.max_size_gb = Some((32 * BS) as f64 / (1u64 << 30) as f64);
    cfg.shared_lease_s = Some(0.2);
    let tier = ObjTier::with_store("obj", s.clone(), cfg, ns(), BS)
        .await
        .unwrap();
    let new = [test_key(1000)];
    let t0 = Instant::now();
    while !tier.stats().shared.unwrap().leader {
        assert!(t0.elapsed() < Duration::from_secs(10), "no lease taken");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let r = store_keys(&tier, &new, 0, BS).await;
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
    while !store_keys(&tier, &new, 0, BS).await.is_success() {
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

/// A leader dropped without `shutdown` releases the lease (the other instance takes it long
/// before a lease period would have expired it) and deletes its heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_dropped_without_shutdown_releases_the_lease() {
    let s = Arc::new(kv_tier_testkit::controlled_store::ControlledStore::new());
    let open = |id: &str| {
        let mut cfg = shared_cfg(ObjTierConfig::new("mem"), id);
        cfg.shared_lease_s = Some(30.0);
        let s = s.clone();
        async move { ObjTier::with_store("obj", s, cfg, ns(), BS).await.unwrap() }
    };
    let a = open("a").await;
    let t0 = Instant::now();
    while !a.stats().shared.unwrap().leader {
        assert!(t0.elapsed() < Duration::from_secs(10), "no lease taken");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
    let t0 = Instant::now();
    while !b.stats().shared.unwrap().leader {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the dropped leader's lease was not released: {:?}",
            b.stats().shared
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(heartbeats("a").await, 0, "the heartbeat is left");
    b.shutdown().await.unwrap();
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
        let mut cfg = shared_cfg(ObjTierConfig::new("mem"), id);
        cfg.shared_lease_s = Some(0.3);
        let s = s.clone();
        async move { ObjTier::with_store("obj", s, cfg, ns(), BS).await.unwrap() }
    };
    let (a, b) = (open("a").await, open("b").await);
    async fn stores(t: &ObjTier, from: u64) {
        let keys: Vec<BlockKey> = (from..from + 4).map(test_key).collect();
        let t0 = Instant::now();
        while !store_keys(t, &keys, 0, BS).await.is_success() {
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
    let t0 = Instant::now();
    while [&a, &b]
        .iter()
        .any(|t| t.stats().shared.unwrap().epoch <= 8)
        || [&a, &b]
            .iter()
            .filter(|t| t.stats().shared.unwrap().leader)
            .count()
            != 1
    {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{:?} {:?}",
            a.stats().shared,
            b.stats().shared
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // the credit of epoch 8 is void now: these stores need the new leader's grants
    stores(&a, 20).await;
    stores(&b, 30).await;
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
