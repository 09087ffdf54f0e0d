//! Probe latency while write-back saturates the server: `ObjTier::lookup` of 32 keys (half
//! held, among 10,000 objects) again and again while a store job of 256 blocks of 2 MiB
//! runs, against the in-process S3 server (s3s + s3s-fs on 127.0.0.1), `io_threads` 16. The
//! tier is probed two ways, by two tiers on the same bucket: one asking the server for every
//! key (`absent_ttl_s` 0, so no listing, and its existence cache cleared before each lookup:
//! the HEAD path), and one as deployed (an unbounded tier answering from its existence
//! listing and cache; nothing clears them, and the bench waits for its first LIST). In the
//! same run, interleaved round by round, the fairest competitor: plain `object_store`, 32
//! HEADs at 16 in flight while 256 PUTs run at 16 in flight, on the same server. Each side
//! also alone (no writes), and each side's write GB/s under the probes; for the tiers, how
//! many answers came from the existence cache and the listing (the rest were HEADs).
//!
//! `cargo bench -p kv-tier-obj --bench obj_probes` (rounds: `KV_TIER_BENCH_ROUNDS`, default
//! 3; objects held: `KV_TIER_BENCH_HELD`, default 10,000)

#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code, unused_imports)]
mod support;

use support::S3ServerExt as _;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use bytes::Bytes;
use futures::StreamExt;
use kv_tier_core::{AlignedBuf, BlockKey, BlockSource, SecondaryTier, StoreJob};
use kv_tier_obj::ObjTier;
use kv_tier_testkit::bench::median;
use kv_tier_testkit::{fill_block, test_key};
use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;
use object_store::path::Path as ObjPath;

const BLOCK: usize = 2 << 20;
const SIDES: [&str; 3] = ["tier, every key asked", "tier, as deployed", "plain"];
const WRITES: usize = 256;
const THREADS: usize = 16;

fn quantile(mut v: Vec<f64>, q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn block(i: u64) -> Bytes {
    let mut b = AlignedBuf::zeroed(BLOCK);
    fill_block(&test_key(i), 0, b.as_mut_slice());
    Bytes::from_owner(b)
}

/// Probes (each a batch of 32 keys, timed) until `done`; at least `min` of them.
async fn probe_until<F, Fut>(done: &AtomicBool, min: usize, probe: F) -> Vec<f64>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let mut ms = Vec::new();
    while !done.load(Ordering::SeqCst) || ms.len() < min {
        let t = Instant::now();
        probe().await;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    ms
}

fn main() {
    let rounds: usize = std::env::var("KV_TIER_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let held_n: usize = std::env::var("KV_TIER_BENCH_HELD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let srcs: Vec<Bytes> = (0..WRITES as u64).map(block).collect();
    println!(
        "probe latency (32 keys, half held among {held_n}) while {WRITES} x 2 MiB are written, io_threads {THREADS}, s3s on 127.0.0.1 ({rounds} rounds, medians of per-round p50/p99)"
    );
    let mut fig: std::collections::BTreeMap<String, Vec<f64>> = Default::default();
    rt.block_on(async {
        // one server and one tier for every round (a server per round ran out of something
        // in its second: its PUTs failed to send)
        let server = support::S3Server::start().await;
        let mut cfg = server.config();
        cfg.io_threads = THREADS;
        cfg.request_timeout_s = 120.0;
        cfg.lookup_timeout_s = 60.0;
        // (as a deployment would: a pooled connection the server closed is retried)
        cfg.max_retries = 2;
        // two tiers on one bucket: one asking the server for every key (no listing, its
        // existence cache cleared before each lookup), one as deployed (its listing and
        // existence cache, which nothing clears)
        let connect = |cfg: kv_tier_obj::ObjTierConfig| async move {
            Arc::new(
                ObjTier::connect("obj", cfg, support::ns(), BLOCK)
                    .await
                    .unwrap(),
            )
        };
        let mut asking_cfg = cfg.clone();
        asking_cfg.absent_ttl_s = 0.0;
        let asking = connect(asking_cfg).await;
        let store: Arc<dyn ObjectStore> = asking.object_store().clone();
        // the objects probed for: held by both sides' keys
        // (small objects at the blocks' paths: a lookup HEADs them and reads nothing, and
        // 10,000 of 2 MiB would not fit this machine's disk)
        let held: Vec<BlockKey> = (0..held_n as u64).map(|i| test_key(1 << 50 | i)).collect();
        let puts: Vec<_> = futures::stream::iter(held.iter())
            .map(|k| {
                let store = store.clone();
                let p = ObjPath::from(asking.object_path(k));
                async move { store.put(&p, Bytes::from_static(&[7; 512]).into()).await }
            })
            .buffer_unordered(THREADS)
            .collect()
            .await;
        assert!(puts.iter().all(|r| r.is_ok()));
        // connected once the objects are there: its first LIST finds them
        let t = Instant::now();
        let deployed = connect(cfg).await;
        while deployed.stats().listings == 0 {
            assert!(
                t.elapsed().as_secs() < 300,
                "the deployed tier's first LIST of {held_n} objects did not end in 300 s"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        println!(
            "  the deployed tier's first listing ({held_n} objects) came {:.2} s after it connected",
            t.elapsed().as_secs_f64()
        );

        for round in 0..rounds {
            let probe_keys = |n: usize| -> Vec<BlockKey> {
                (0..16)
                    .map(|j| held[(n * 16 + j) % held_n])
                    .chain((0..16).map(|j| test_key(1 << 51 | (n * 16 + j) as u64)))
                    .collect()
            };
            let n = std::sync::atomic::AtomicUsize::new(0);
            let tier_probe = |ask_all: bool| {
                let keys = probe_keys(n.fetch_add(1, Ordering::Relaxed));
                let tier = if ask_all { &asking } else { &deployed };
                async move {
                    if ask_all {
                        tier.clear_exists_cache();
                    }
                    let found = tier.lookup(&keys).await.unwrap();
                    assert_eq!(found.iter().filter(|b| **b).count(), 16);
                }
            };
            let plain_probe = || async {
                let keys = probe_keys(n.fetch_add(1, Ordering::Relaxed));
                let found: Vec<bool> = futures::stream::iter(keys.iter())
                    .map(|k| {
                        let store = store.clone();
                        let path = ObjPath::from(asking.object_path(k));
                        async move { store.head(&path).await.is_ok() }
                    })
                    .buffer_unordered(THREADS)
                    .collect()
                    .await;
                assert_eq!(found.iter().filter(|b| **b).count(), 16);
            };
            let tier_write = |side: &str| {
                let tier = if side == "tier, as deployed" {
                    &deployed
                } else {
                    &asking
                };
                let srcs = &srcs;
                let salt = if side == "tier, as deployed" {
                    1 << 39
                } else {
                    0
                };
                async move {
                    let job = StoreJob {
                        links: Vec::new(),
                        requests: Vec::new(),
                        blocks: srcs
                            .iter()
                            .enumerate()
                            .map(|(i, s)| {
                                let k = test_key(salt | (round as u64 + 1) << 40 | i as u64);
                                (k, BlockSource::from_bytes(s.clone()))
                            })
                            .collect(),
                    };
                    let t = Instant::now();
                    let r = tier.store(job).await;
                    assert!(r.is_success(), "{:?}", &r.failed[..r.failed.len().min(3)]);
                    t.elapsed()
                }
            };
            let plain_write = || async {
                let t = Instant::now();
                let puts: Vec<_> = futures::stream::iter(srcs.iter().enumerate())
                    .map(|(i, s)| {
                        let store = store.clone();
                        let p = ObjPath::from(format!("plain/{round}/{i}.bin"));
                        async move { store.put(&p, s.clone().into()).await }
                    })
                    .buffer_unordered(THREADS)
                    .collect()
                    .await;
                assert!(puts.iter().all(|r| r.is_ok()));
                t.elapsed()
            };
            let gb = (WRITES * BLOCK) as f64 / 1e9;
            // each side first in turn: tier asking the server for every key (its existence
            // cache and listing cleared before each lookup), tier answering from what it
            // knows (its listing and existence cache, as deployed), plain object_store
            for k in 0..3 {
                let side = SIDES[(round + k) % 3];
                let probe = || async {
                    match side {
                        "tier, every key asked" => tier_probe(true).await,
                        "tier, as deployed" => tier_probe(false).await,
                        _ => plain_probe().await,
                    }
                };
                let write = || async {
                    if side == "plain" {
                        plain_write().await
                    } else {
                        tier_write(side).await
                    }
                };
                let before = match side {
                    "tier, every key asked" => Some(asking.stats()),
                    "tier, as deployed" => Some(deployed.stats()),
                    _ => None,
                };
                // alone
                let done = AtomicBool::new(true);
                let idle = probe_until(&done, 50, probe).await;
                let idle_n = idle.len();
                // under writes
                let done = AtomicBool::new(false);
                let w = async {
                    let d = write().await;
                    done.store(true, Ordering::SeqCst);
                    d
                };
                let (busy, took) = futures::join!(probe_until(&done, 1, probe), w);
                let busy_n = busy.len();
                let mut put =
                    |stat: &str, v: f64| fig.entry(format!("{side}: {stat}")).or_default().push(v);
                put("idle p50 ms", quantile(idle.clone(), 0.5));
                put("idle p99 ms", quantile(idle, 0.99));
                put("busy probes", busy.len() as f64);
                put("busy p50 ms", quantile(busy.clone(), 0.5));
                put("busy p99 ms", quantile(busy, 0.99));
                put("write GB/s", gb / took.as_secs_f64());
                if let Some(b) = before {
                    let tier = if side == "tier, as deployed" {
                        &deployed
                    } else {
                        &asking
                    };
                    let s = tier.stats();
                    let keys = (idle_n + busy_n) as u64 * 16;
                    println!(
                        "  round {round}, {side}: of {keys} held and {keys} absent keys probed, {} answered by the cache, {} absent by the listing ({} LISTs installed); writes held back for reads {}, most requests in flight {}",
                        s.exists_cache_hits - b.exists_cache_hits,
                        s.listed_absent - b.listed_absent,
                        s.listings - b.listings,
                        s.writes_deferred - b.writes_deferred,
                        s.max_in_flight
                    );
                }
            }
        }
        drop(server);
    });
    for (name, v) in fig {
        let (lo, hi) = v
            .iter()
            .fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(*x), b.max(*x)));
        println!(
            "  {name:<36} {:>9.2} (min {lo:.2}, max {hi:.2})",
            median(v.clone())
        );
    }
}
