//! A slow tier never slows the engine: serve_sim (16 streams, a 25 s admission window) with
//! the fs tier only, and with an obj tier below it on a real S3 server (the testkit's s3s
//! fixture) that answers every request 20 ms late, as a remote store would; the bucket is
//! empty at the start of each run, so the obj tier serves nothing and only costs. Run
//! interleaved; prints steps, run time (the final drain of write-back reported apart),
//! lookups and `Retry` verdicts, hit rate, writes dropped and stores refused.
//!
//! `cargo bench -p kv-tier-examples --bench slow_tier` (`KV_TIER_SLOW_ROUNDS`, default 2;
//! `KV_TIER_SLOW_LATENCY_MS`, default 20; `KV_TIER_SLOW_SECONDS`, the admission window,
//! default 25).

use std::time::Duration;

use kv_tier_examples::sim::{Report, SimConfig, run};
use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};

fn env<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let rounds: usize = env("KV_TIER_SLOW_ROUNDS", 2);
    let latency_ms: u64 = env("KV_TIER_SLOW_LATENCY_MS", 20);
    let window: u64 = env("KV_TIER_SLOW_SECONDS", 25);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let base = SimConfig {
        streams: 16,
        duration: Duration::from_secs(window),
        progress: false,
        ..SimConfig::default()
    };
    println!(
        "serve_sim, {} streams, {} s admission window: fs only vs fs + obj (S3 answering {latency_ms} ms late, bucket empty), {rounds} rounds interleaved",
        base.streams, window
    );
    println!(
        "{:>5} {:>9} {:>8} {:>8} {:>8} {:>10} {:>10} {:>7} {:>9} {:>9} {:>9}",
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
        "wb refus"
    );
    let mut fs = (vec![], vec![]);
    let mut both = (vec![], vec![]);
    for round in 0..rounds {
        for with_obj in if round % 2 == 0 {
            [false, true]
        } else {
            [true, false]
        } {
            let mut cfg = base.clone();
            let server = with_obj.then(|| {
                let s = rt.block_on(S3Server::start());
                s.set_latency(Duration::from_millis(latency_ms));
                cfg.s3_endpoint = Some(s.endpoint.clone());
                cfg.s3_bucket = BUCKET.into();
                cfg.s3_access_key = AK.into();
                cfg.s3_secret_key = SK.into();
                s
            });
            let r: Report = run(&cfg).expect("serve_sim");
            assert_eq!(r.blocks_corrupt, 0);
            let dropped: u64 = r.tiers.iter().map(|t| t.writes_dropped).sum();
            println!(
                "{:>5} {:>9} {:>8.1} {:>8.1} {:>8} {:>10} {:>10} {:>7.1} {:>9} {:>9} {:>9}",
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
                r.stores_refused_write_back
            );
            let into = if with_obj { &mut both } else { &mut fs };
            into.0.push(r.seconds);
            into.1.push(r.steps as f64);
            drop(server);
        }
    }
    let (t_fs, t_both) = (median(fs.0), median(both.0));
    let (s_fs, s_both) = (median(fs.1), median(both.1));
    println!(
        "median: run time fs {t_fs:.1} s, fs+obj {t_both:.1} s ({:.2}x); steps fs {s_fs:.0}, fs+obj {s_both:.0} ({:.2}x); target <= 1.15x",
        t_both / t_fs,
        s_both / s_fs
    );
}
