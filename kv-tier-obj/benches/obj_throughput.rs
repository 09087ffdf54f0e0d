//! The obj tier's requests beside the fairest competitor, plain `object_store` (the same S3
//! client, built by the tier) on the same server, interleaved round by round, alternating
//! which goes first:
//! - HEADs/s at 1, 16 and 64 in flight: a lookup of 128 held keys the tier does not know
//!   (its existence cache cleared), against 128 plain HEADs;
//! - PUT and GET GB/s of 128 blocks of 2 MiB at 1 and 16 in flight (the tier's `io_threads`,
//!   one store job and one load job into DRAM slots), and the process's CPU seconds per GB
//!   moved (PUT and GET together); and the PUTs again with plain `object_store` writing as
//!   the tier does, create-only (`If-None-Match: *`), the row `PUT GB/s create-only`; and
//!   the GETs again with plain `object_store` reading each object as 4 ranged GETs at once,
//!   the row `GET GB/s ranged` (plain only: whether a load would gain by splitting a block;
//!   its ratio is to plain's whole-object GETs).
//!
//! Servers: `s3s` (s3s + s3s-fs in this process on 127.0.0.1: its CPU is in the figure),
//! `s3s-20ms` (the same, every request held 20 ms first, standing for a remote region) and
//! `moto` (`moto_server` in its own process, PyPI `moto[server]`: only the client's CPU is
//! counted; skipped, saying how to install it, when it is not on the PATH).
//!
//! `cargo bench -p kv-tier-obj --bench obj_throughput` (rounds: `KV_TIER_BENCH_ROUNDS`,
//! default 3; servers: `KV_TIER_BENCH_SERVERS`, default `s3s,s3s-20ms,moto`)

#[path = "../tests/it/support/mod.rs"]
#[allow(dead_code, unused_imports)]
mod support;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use kv_tier_core::{
    AlignedBuf, BlockKey, BlockSource, EvictionPolicy, LoadJob, PrimaryTier, SecondaryTier,
    StoreJob,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_obj::{ObjTier, ObjTierConfig};
use kv_tier_testkit::bench::{cpu_seconds, env_or, median};
use kv_tier_testkit::{fill_block, test_key};
use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;
use object_store::path::Path as ObjPath;

const BLOCK: usize = 2 << 20;
const N: usize = 128;
/// The ranged GETs a block is read as in the plain `GET GB/s ranged` row.
const RANGES: usize = 4;

/// `moto_server` on a free port of 127.0.0.1, with the tests' bucket; killed on drop.
struct Moto {
    child: std::process::Child,
    endpoint: String,
}

impl Moto {
    async fn start() -> Option<Moto> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let child = std::process::Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .ok()?;
        let moto = Moto {
            child,
            endpoint: format!("http://127.0.0.1:{port}"),
        };
        let t = Instant::now();
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            if t.elapsed() > Duration::from_secs(30) {
                eprintln!("moto_server did not listen on port {port} within 30 s");
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let creds = aws_sdk_s3::config::Credentials::new(support::AK, support::SK, None, None, "b");
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .endpoint_url(&moto.endpoint)
            .region(aws_sdk_s3::config::Region::new("us-east-1"))
            .credentials_provider(creds)
            .force_path_style(true)
            .build();
        aws_sdk_s3::Client::from_conf(conf)
            .create_bucket()
            .bucket(support::BUCKET)
            .send()
            .await
            .map_err(|e| eprintln!("moto: cannot create the bucket: {e:?}"))
            .ok()?;
        Some(moto)
    }
}

impl Drop for Moto {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One server's figures: name -> samples (one per round).
type Figures = BTreeMap<String, Vec<f64>>;

/// Prints, under `heads`, the median of each figure `<base><side>` beside that of
/// `<base><against>` and their ratio, in a row named `<base><label>`.
fn print_ratios(fig: &Figures, side: &str, against: &str, label: &str, heads: [&str; 4]) {
    let [h0, h1, h2, h3] = heads;
    println!("  {h0:>9} {h1:>8} {h2:>10} {h3:>10} {:>7}", "ratio");
    for (name, a) in fig {
        let Some(base) = name.strip_suffix(side) else {
            continue;
        };
        let Some(b) = fig.get(&format!("{base}{against}")) else {
            continue;
        };
        let row = format!("{base}{label}");
        let (threads, what) = row.split_at(2);
        let (a, b) = (median(a.clone()), median(b.clone()));
        println!(
            "  {:>9} {:>8} {a:>10.3} {b:>10.3} {:>6.2}x",
            threads.trim(),
            what.trim(),
            a / b
        );
    }
}

async fn round(endpoint: &str, round: usize, srcs: &[Bytes], cpu: &CpuTier, fig: &mut Figures) {
    for threads in [1usize, 16, 64] {
        let mut cfg: ObjTierConfig = support::s3_config(endpoint);
        cfg.io_threads = threads;
        cfg.request_timeout_s = 120.0;
        cfg.lookup_timeout_s = 600.0;
        // (as a deployment would: a pooled connection the server closed is retried)
        cfg.max_retries = 2;
        let tier = ObjTier::connect("obj", cfg, support::ns(), BLOCK)
            .await
            .unwrap();
        let store: Arc<dyn ObjectStore> = tier.object_store().clone();
        let keys: Vec<BlockKey> = (0..N)
            .map(|i| test_key((round as u64) << 40 | (threads as u64) << 20 | i as u64))
            .collect();
        let tier_paths: Vec<ObjPath> = keys
            .iter()
            .map(|k| ObjPath::from(tier.object_path(k)))
            .collect();
        let plain_paths: Vec<ObjPath> = (0..N)
            .map(|i| ObjPath::from(format!("plain/{round}/{threads}/{i}.bin")))
            .collect();
        let moves = threads <= 16;
        let gb = (N * BLOCK) as f64 / 1e9;
        let run_tier = || {
            let (tier, keys) = (&tier, &keys);
            async move {
                let mut out = Vec::new();
                let cpu0 = cpu_seconds();
                let job = StoreJob {
                    links: Vec::new(),
                    requests: Vec::new(),
                    blocks: keys
                        .iter()
                        .zip(srcs)
                        .map(|(k, s)| (*k, BlockSource::from_bytes(s.clone())))
                        .collect(),
                };
                let t = Instant::now();
                let r = tier.store(job).await;
                assert!(r.is_success(), "{:?}", &r.failed[..r.failed.len().min(3)]);
                if moves {
                    let put = gb / t.elapsed().as_secs_f64();
                    out.push(("PUT GB/s", put));
                    out.push(("PUT GB/s create-only", put));
                    let mut p = cpu.prepare_store(keys).unwrap();
                    let job = LoadJob {
                        blocks: std::mem::take(&mut p.to_store),
                        ..Default::default()
                    };
                    let t = Instant::now();
                    let r = tier.load(job).await;
                    assert!(r.is_success(), "{:?}", &r.failed[..r.failed.len().min(3)]);
                    out.push(("GET GB/s", gb / t.elapsed().as_secs_f64()));
                    cpu.complete_store(keys, false);
                    out.push(("CPU s/GB", (cpu_seconds() - cpu0) / (2.0 * gb)));
                }
                tier.clear_exists_cache();
                let t = Instant::now();
                let found = tier.lookup(keys).await.unwrap();
                assert!(found.iter().all(|b| *b), "a held key was not found");
                out.push(("HEAD/s", N as f64 / t.elapsed().as_secs_f64()));
                out
            }
        };
        let create_paths: Vec<ObjPath> = (0..N)
            .map(|i| ObjPath::from(format!("plain-create/{round}/{threads}/{i}.bin")))
            .collect();
        let run_plain = || {
            let (store, paths, create_paths) = (&store, &plain_paths, &create_paths);
            async move {
                let mut out = Vec::new();
                let cpu0 = cpu_seconds();
                let t = Instant::now();
                let puts: Vec<_> = futures::stream::iter(paths.iter().zip(srcs))
                    .map(|(p, s)| async move { store.put(p, s.clone().into()).await })
                    .buffer_unordered(threads)
                    .collect()
                    .await;
                assert!(puts.iter().all(|r| r.is_ok()), "a plain PUT failed");
                if moves {
                    out.push(("PUT GB/s", gb / t.elapsed().as_secs_f64()));
                    let t = Instant::now();
                    let gets: Vec<usize> =
                        futures::stream::iter(paths.iter())
                            .map(|p| async move {
                                store.get(p).await.unwrap().bytes().await.unwrap().len()
                            })
                            .buffer_unordered(threads)
                            .collect()
                            .await;
                    assert!(gets.iter().all(|&n| n == BLOCK));
                    out.push(("GET GB/s", gb / t.elapsed().as_secs_f64()));
                    out.push(("CPU s/GB", (cpu_seconds() - cpu0) / (2.0 * gb)));
                    // the same objects, each as RANGES ranged GETs at once (`threads` objects
                    // at a time): would the tier's loads gain by splitting a block? (after
                    // the CPU figure, which they would inflate)
                    let t = Instant::now();
                    let gets: Vec<usize> = futures::stream::iter(paths.iter())
                        .map(|p| async move {
                            let part = (BLOCK / RANGES) as u64;
                            let parts = futures::future::try_join_all(
                                (0..RANGES as u64)
                                    .map(|i| store.get_range(p, i * part..(i + 1) * part)),
                            )
                            .await
                            .unwrap();
                            parts.iter().map(|b| b.len()).sum::<usize>()
                        })
                        .buffer_unordered(threads)
                        .collect()
                        .await;
                    assert!(gets.iter().all(|&n| n == BLOCK));
                    out.push(("GET GB/s ranged", gb / t.elapsed().as_secs_f64()));
                    // the tier's kind of PUT (create-only, `If-None-Match: *`), to new paths
                    let t = Instant::now();
                    let puts: Vec<_> = futures::stream::iter(create_paths.iter().zip(srcs))
                        .map(|(p, s)| async move {
                            let opts = object_store::PutOptions {
                                mode: object_store::PutMode::Create,
                                ..Default::default()
                            };
                            store.put_opts(p, s.clone().into(), opts).await
                        })
                        .buffer_unordered(threads)
                        .collect()
                        .await;
                    assert!(puts.iter().all(|r| r.is_ok()), "a create-only PUT failed");
                    out.push(("PUT GB/s create-only", gb / t.elapsed().as_secs_f64()));
                }
                let t = Instant::now();
                let found: Vec<bool> = futures::stream::iter(paths.iter())
                    .map(|p| async move { store.head(p).await.is_ok() })
                    .buffer_unordered(threads)
                    .collect()
                    .await;
                assert!(found.iter().all(|b| *b), "a plain HEAD failed");
                out.push(("HEAD/s", N as f64 / t.elapsed().as_secs_f64()));
                out
            }
        };
        let (t, p) = if (round + threads).is_multiple_of(2) {
            let t = run_tier().await;
            (t, run_plain().await)
        } else {
            let p = run_plain().await;
            (run_tier().await, p)
        };
        for (side, out) in [("tier", t), ("plain", p)] {
            for (name, v) in out {
                fig.entry(format!("{threads:>2} {name} {side}"))
                    .or_default()
                    .push(v);
            }
        }
        // the objects go: every round writes new ones, and moto keeps them in memory
        let _: Vec<_> =
            futures::stream::iter(tier_paths.iter().chain(&plain_paths).chain(if moves {
                &create_paths[..]
            } else {
                &[]
            }))
            .map(|p| {
                let store = &store;
                async move { store.delete(p).await }
            })
            .buffer_unordered(16)
            .collect()
            .await;
        tier.shutdown().await.unwrap();
    }
}

fn main() {
    let rounds: usize = env_or("KV_TIER_BENCH_ROUNDS", 3);
    let servers: String = env_or("KV_TIER_BENCH_SERVERS", "s3s,s3s-20ms,moto".to_string());
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
    println!(
        "ObjTier vs plain object_store: {N} HEADs, {N} PUTs and GETs of 2 MiB ({rounds} rounds, medians; ratio = tier / plain)"
    );
    for server in servers.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let fig = rt.block_on(async {
            let mut fig = Figures::new();
            let (_s3s, _moto, endpoint) = match server {
                "s3s" | "s3s-20ms" => {
                    let s = support::S3Server::start().await;
                    if server == "s3s-20ms" {
                        s.set_latency(Duration::from_millis(20));
                    }
                    let e = s.endpoint.clone();
                    (Some(s), None, e)
                }
                "moto" => match Moto::start().await {
                    Some(m) => {
                        let e = m.endpoint.clone();
                        (None, Some(m), e)
                    }
                    None => {
                        println!(
                            "{server}: skipped: `moto_server` did not start (install it: pip install 'moto[server]')"
                        );
                        return None;
                    }
                },
                other => {
                    println!("{other}: skipped: not a server of this bench (s3s, s3s-20ms, moto)");
                    return None;
                }
            };
            for r in 0..rounds {
                round(&endpoint, r, &srcs, &cpu, &mut fig).await;
            }
            Some(fig)
        });
        let Some(fig) = fig else { continue };
        println!("{server}:");
        print_ratios(
            &fig,
            " tier",
            " plain",
            "",
            ["in flight", "", "tier", "plain"],
        );
        print_ratios(
            &fig,
            " ranged plain",
            " plain",
            " ranged",
            ["", "plain", "ranged", "whole"],
        );
    }
}
