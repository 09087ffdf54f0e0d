//! Store then load 512 blocks of 2 MiB through `ObjTier` against the in-process S3 server
//! (s3s + s3s-fs on 127.0.0.1) at `io_threads` 4 and 16; in the same run, interleaved round by
//! round, a plain `object_store` put/get loop with the same concurrency over the same bytes.
//!
//! `cargo bench -p kv-tier-obj --bench obj_throughput` (rounds: `KV_TIER_BENCH_ROUNDS`, default 3)

#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code, unused_imports)]
mod support;

use support::S3ServerExt as _;

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use kv_tier_core::{
    AlignedBuf, BlockKey, BlockSource, EvictionPolicy, LoadJob, PrimaryTier, SecondaryTier,
    StoreJob,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_obj::ObjTier;
use kv_tier_testkit::bench::median;
use kv_tier_testkit::{fill_block, test_key};
use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;
use object_store::path::Path as ObjPath;

const BLOCK: usize = 2 << 20;
const N: usize = 512;

fn main() {
    let rounds: usize = std::env::var("KV_TIER_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let srcs: Vec<Bytes> = (0..N)
        .map(|i| {
            let mut b = AlignedBuf::zeroed(BLOCK);
            fill_block(&test_key(i as u64), 0, b.as_mut_slice());
            Bytes::from_owner(b)
        })
        .collect();
    let cpu = CpuTier::new(CpuTierConfig {
        capacity_bytes: (N * BLOCK) as u64,
        block_size: BLOCK,
        policy: EvictionPolicy::Lru,
        prefault: true,
    })
    .unwrap();
    let gb = (N * BLOCK) as f64 / 1e9;
    println!(
        "ObjTier vs plain object_store, {N} x 2 MiB against s3s on 127.0.0.1 ({rounds} rounds, medians)"
    );
    println!(
        "{:>10} {:>10} {:>10} {:>7} | {:>10} {:>10} {:>7}",
        "io_threads", "tier put", "plain put", "ratio", "tier get", "plain get", "ratio"
    );
    for threads in [4usize, 16] {
        let (mut tp, mut pp, mut tg, mut pg, mut rp, mut rg) =
            (vec![], vec![], vec![], vec![], vec![], vec![]);
        for round in 0..rounds {
            let keys: Vec<BlockKey> = (0..N)
                .map(|i| test_key((round as u64) << 40 | i as u64))
                .collect();
            let (t_put, t_get, p_put, p_get) = rt.block_on(async {
                let server = support::S3Server::start().await;
                let mut cfg = server.config();
                cfg.io_threads = threads;
                cfg.request_timeout_s = 120.0;
                let tier = Arc::new(
                    ObjTier::connect("obj", cfg, support::ns(), BLOCK)
                        .await
                        .unwrap(),
                );
                let store: Arc<dyn ObjectStore> = tier.object_store().clone();
                let run_tier = || async {
                    let job = StoreJob {
                        links: Vec::new(),
                        requests: Vec::new(),
                        blocks: keys
                            .iter()
                            .zip(&srcs)
                            .map(|(k, s)| (*k, BlockSource::from_bytes(s.clone())))
                            .collect(),
                    };
                    let t = Instant::now();
                    assert!(tier.store(job).await.is_success());
                    let put = t.elapsed();
                    let mut p = cpu.prepare_store(&keys).unwrap();
                    let job = LoadJob {
                        requests: Vec::new(),
                        blocks: std::mem::take(&mut p.to_store),
                    };
                    let t = Instant::now();
                    assert!(tier.load(job).await.is_success());
                    let get = t.elapsed();
                    cpu.complete_store(&keys, false);
                    (put, get)
                };
                let run_plain = || async {
                    let paths: Vec<ObjPath> = (0..N)
                        .map(|i| ObjPath::from(format!("plain/{round}/{i}.bin")))
                        .collect();
                    let t = Instant::now();
                    let puts: Vec<_> = futures::stream::iter(paths.iter().zip(&srcs))
                        .map(|(p, s)| {
                            let store = store.clone();
                            async move { store.put(p, s.clone().into()).await }
                        })
                        .buffer_unordered(threads)
                        .collect()
                        .await;
                    assert!(puts.iter().all(|r| r.is_ok()));
                    let put = t.elapsed();
                    let t = Instant::now();
                    let gets: Vec<_> = futures::stream::iter(paths.iter())
                        .map(|p| {
                            let store = store.clone();
                            async move { store.get(p).await.unwrap().bytes().await.unwrap().len() }
                        })
                        .buffer_unordered(threads)
                        .collect()
                        .await;
                    assert!(gets.iter().all(|&n| n == BLOCK));
                    (put, t.elapsed())
                };
                // interleave, alternating which goes first
                if round % 2 == 0 {
                    let (a, b) = run_tier().await;
                    let (c, d) = run_plain().await;
                    (a, b, c, d)
                } else {
                    let (c, d) = run_plain().await;
                    let (a, b) = run_tier().await;
                    (a, b, c, d)
                }
            });
            let g = |d: Duration| gb / d.as_secs_f64();
            tp.push(g(t_put));
            pp.push(g(p_put));
            tg.push(g(t_get));
            pg.push(g(p_get));
            rp.push(p_put.as_secs_f64() / t_put.as_secs_f64());
            rg.push(p_get.as_secs_f64() / t_get.as_secs_f64());
        }
        println!(
            "{:>10} {:>8.2} GB/s {:>6.2} GB/s {:>6.2}x | {:>6.2} GB/s {:>6.2} GB/s {:>6.2}x",
            threads,
            median(tp),
            median(pp),
            median(rp),
            median(tg),
            median(pg),
            median(rg)
        );
    }
}
