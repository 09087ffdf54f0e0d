//! A slow tier never slows the engine: serve_sim (16 streams, a 25 s admission window) with
//! the fs tier only, and with an obj tier below it on a real S3 server (the testkit's s3s
//! fixture) that answers every request 20 ms late, as a remote store would; the bucket is
//! empty at the start of each run, so the obj tier serves nothing and only costs. Run
//! interleaved; prints steps, run time (the final drain of write-back reported apart),
//! lookups and `Retry` verdicts, hit rate, writes dropped and stores refused.
//!
//! `cargo bench -p kv-tier-examples --bench slow_tier` (`KV_TIER_SLOW_ROUNDS`, default 2;
//! `KV_TIER_SLOW_LATENCY_MS`, default 20; `KV_TIER_SLOW_SECONDS`, the admission window,
//! default 25; `KV_TIER_SLOW_ONLY=fs` or `fs+obj` runs one side, for a profiler;
//! `KV_TIER_SLOW_SERVER_DIR`, where the server keeps its objects, default `/dev/shm` (a
//! remote store's disk work is not the engine's; point it at a disk directory to charge the
//! server's work to the same two cores)).

use std::time::Duration;

use kv_tier_examples::sim::{Report, SimConfig, run};
use kv_tier_testkit::bench::{cpu_seconds, env_or, median};
use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};

fn main() {
    let rounds: usize = env_or("KV_TIER_SLOW_ROUNDS", 2);
    let latency_ms: u64 = env_or("KV_TIER_SLOW_LATENCY_MS", 20);
    let window: u64 = env_or("KV_TIER_SLOW_SECONDS", 25);
    let only: Option<String> = std::env::var("KV_TIER_SLOW_ONLY").ok();
    let server_dir =
        std::path::PathBuf::from(env_or("KV_TIER_SLOW_SERVER_DIR", "/dev/shm".to_string()));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // the toy model and workload this benchmark has always run (serve_sim's defaults until
    // they moved to MiB-sized blocks), so its figures stay comparable across runs
    let base = SimConfig {
        streams: 16,
        turns: 5,
        prefixes: 256,
        prefix_tokens: 10_000,
        prompt_tokens: 4096,
        output_tokens: 512,
        model: "tiny".into(),
        layers: 1,
        kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
        gpu_cache_blocks: 4096,
        prefill_tokens_per_s: 200_000.0,
        dram_bytes: 512 << 20,
        fs_cap_gb: Some(0.75),
        duration: Duration::from_secs(window),
        progress: false,
        ..SimConfig::default()
    };
    println!(
        "serve_sim, {} streams, {} s admission window: fs only vs fs + obj (S3 answering {latency_ms} ms late, bucket empty, objects in {}), {rounds} rounds interleaved",
        base.streams,
        window,
        server_dir.display()
    );
    println!(
        "{:>5} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10} {:>7} {:>9} {:>9} {:>9} {:>7} {:>9}",
        "round",
        "tiers",
        "run s",
        "drain s",
        "steps",
        "lookups",
        "retries",
        "hit %",
        "dropped",
        "refused",
        "wb refus",
        "cpu s",
        "s3 reqs"
    );
    let runs = tempfile::Builder::new()
        .prefix("kv-tier-slow-tier-")
        .tempdir()
        .expect("a temp dir");
    let mut fs = (vec![], vec![]);
    let mut both = (vec![], vec![]);
    for round in 0..rounds {
        for with_obj in if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            if only
                .as_deref()
                .is_some_and(|o| o != if with_obj { "fs+obj" } else { "fs" })
            {
                continue;
            }
            let mut cfg = base.clone();
            // every run in a fresh directory, all removed at the end: a run that follows the
            // removal of 100k files would pay for it (ext4 skips recently freed inodes)
            cfg.root_dir = Some(runs.path().join(format!(
                "{round}-{}",
                if with_obj { "fs+obj" } else { "fs" }
            )));
            let server = with_obj.then(|| {
                // the server stands for a remote store: its objects live in memory where
                // possible, so its disk work does not take the engine's two cores
                let s = if server_dir.is_dir() {
                    rt.block_on(S3Server::start_in(&server_dir))
                } else {
                    rt.block_on(S3Server::start())
                };
                s.set_latency(Duration::from_millis(latency_ms));
                cfg.s3_endpoint = Some(s.endpoint.clone());
                cfg.s3_bucket = BUCKET.into();
                cfg.s3_access_key = AK.into();
                cfg.s3_secret_key = SK.into();
                s
            });
            let cpu0 = cpu_seconds();
            let r: Report = run(&cfg).expect("serve_sim");
            let cpu = cpu_seconds() - cpu0;
            let reqs = server
                .as_ref()
                .map_or(0, |s| s.requests.load(std::sync::atomic::Ordering::Relaxed));
            assert_eq!(r.blocks_corrupt, 0);
            let dropped: u64 = r.tiers.iter().map(|t| t.writes_dropped).sum();
            println!(
                "{:>5} {:>9} {:>8.1} {:>8.1} {:>8} {:>10} {:>10} {:>7.1} {:>9} {:>9} {:>9} {:>7.1} {:>9}",
                round,
                if with_obj { "fs+obj" } else { "fs" },
                r.seconds,
                r.drain_seconds,
                r.steps,
                r.lookups,
                r.lookup_retries,
                100.0 * r.hit_rate,
                dropped,
                r.stores_refused,
                r.stores_refused_write_back,
                cpu,
                reqs
            );
            let into = if with_obj { &mut both } else { &mut fs };
            into.0.push(r.seconds);
            into.1.push(r.steps as f64);
            drop(server);
        }
    }
    if fs.0.is_empty() || both.0.is_empty() {
        return;
    }
    let (t_fs, t_both) = (median(fs.0), median(both.0));
    let (s_fs, s_both) = (median(fs.1), median(both.1));
    println!(
        "median: run time fs {t_fs:.1} s, fs+obj {t_both:.1} s ({:.2}x); steps fs {s_fs:.0}, fs+obj {s_both:.0} ({:.2}x); target <= 1.15x",
        t_both / t_fs,
        s_both / s_fs
    );
}
