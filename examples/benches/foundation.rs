//! Foundation benchmarks. Prints a table; compares the DRAM copy path with a plain memcpy of
//! the same bytes measured in the same run, interleaved round by round.
//!
//! `cargo bench -p kv-tier-examples --bench foundation`

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_tier_core::{
    AlignedBuf, BlockKey, EvictionPolicy, KvTierConfig, LookupResult, PrimaryTier, RequestContext,
    RequestId, TieringManager,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::bench::median;
use kv_tier_testkit::{MemoryTier, fill_block, test_key};

fn cpu(slots: usize, block: usize) -> Arc<CpuTier> {
    cpu_with(slots, block, EvictionPolicy::Lru)
}

fn cpu_with(slots: usize, block: usize, policy: EvictionPolicy) -> Arc<CpuTier> {
    Arc::new(
        CpuTier::new(CpuTierConfig {
            capacity_bytes: (slots * block.div_ceil(4096) * 4096) as u64,
            block_size: block,
            policy,
            prefault: true,
        })
        .unwrap(),
    )
}

async fn manager(cpu: Arc<CpuTier>, tiers: usize) -> TieringManager {
    let bs = cpu.block_size();
    let mut b = TieringManager::builder(KvTierConfig::new(
        (cpu.capacity_blocks() * bs.div_ceil(4096) * 4096) as u64,
        bs as u64,
    ))
    .primary(cpu);
    for i in 0..tiers {
        b = b.tier(Arc::new(MemoryTier::new(format!("mem{i}"), bs)));
    }
    b.build().await.unwrap()
}

fn store(m: &TieringManager, keys: &[BlockKey]) {
    let mut p = m.prepare_store(keys).unwrap();
    for (k, s) in p.slots() {
        fill_block(k, 0, s.as_mut_slice());
    }
    p.commit(RequestId(0));
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    println!("{:<58} {:>14} {:>14}", "benchmark", "median", "target");
    rt.block_on(async {
        touch_bench().await;
        lookup_bench().await;
    });
    cpu_store_bench();
    rt.block_on(copy_path_bench());
}

async fn touch_bench() {
    let c = cpu(4096, 4096);
    let m = manager(c, 3).await;
    let keys: Vec<_> = (0..2000).map(test_key).collect();
    for chunk in keys.chunks(200) {
        store(&m, chunk);
    }
    m.wait_idle().await;
    let mut samples = Vec::new();
    for _ in 0..500 {
        let t = Instant::now();
        m.touch(black_box(&keys));
        samples.push(t.elapsed());
    }
    let med = median(samples);
    println!(
        "{:<58} {:>11.1} us {:>14}",
        "TieringManager::touch(2,000 keys), 3 secondary tiers",
        med.as_secs_f64() * 1e6,
        "<= 50 us"
    );
}

async fn lookup_bench() {
    let c = cpu(4096, 4096);
    let m = manager(c, 1).await;
    let keys: Vec<_> = (0..2000).map(test_key).collect();
    for chunk in keys.chunks(200) {
        store(&m, chunk);
    }
    m.wait_idle().await;
    let req = RequestContext::new(1);
    let mut per_key = Vec::new();
    let mut prefix = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        for k in &keys {
            assert_eq!(black_box(m.lookup(k, &req)), LookupResult::Hit);
        }
        per_key.push(t.elapsed());
        let t = Instant::now();
        let c = m.lookup_prefix(black_box(&keys), &req);
        prefix.push(t.elapsed());
        assert_eq!(c.hit, 2000);
    }
    let rate = |d: Duration| 2000.0 / d.as_secs_f64() / 1e6;
    println!(
        "{:<58} {:>9.1} M/s {:>14}",
        "lookup of 2,000 keys in DRAM, one call per key",
        rate(median(per_key)),
        ">= 5 M keys/s"
    );
    println!(
        "{:<58} {:>9.1} M/s {:>14}",
        "lookup_prefix of 2,000 keys in DRAM",
        rate(median(prefix)),
        ""
    );
}

/// Stores of 1,000 blocks into a full pool (each evicts the last 1,000): under LRU, and under
/// chain eviction with each store's blocks linked as one chain.
fn cpu_store_bench() {
    for policy in [EvictionPolicy::Lru, EvictionPolicy::Chain] {
        let c = cpu_with(1000, 4096, policy);
        let mut samples = Vec::new();
        for round in 0..50u64 {
            let keys: Vec<_> = (0..1000).map(|i| test_key(round << 32 | i)).collect();
            let t = Instant::now();
            let p = c.prepare_store(&keys).unwrap();
            drop(p);
            c.complete_store(&keys, true);
            if policy == EvictionPolicy::Chain {
                let links: Vec<_> = keys
                    .windows(2)
                    .zip(1..)
                    .map(|(w, depth)| {
                        (
                            w[1],
                            kv_tier_core::ChainLink {
                                parent: w[0],
                                depth,
                            },
                        )
                    })
                    .collect();
                c.link(&links);
            }
            samples.push(t.elapsed());
            c.take_events();
        }
        let med = median(samples);
        let what = match policy {
            EvictionPolicy::Chain => "chain, linked",
            _ => "lru",
        };
        println!(
            "{:<58} {:>11.1} us {:>14}",
            format!("CpuTier prepare_store + complete_store, 1,000 ({what})"),
            med.as_secs_f64() * 1e6,
            format!("{:.0} ns/block", med.as_nanos() as f64 / 1000.0)
        );
    }
}

/// Store and load of 2 MiB blocks through the manager into the in-memory tier, against a
/// plain memcpy of the same bytes, interleaved round by round.
async fn copy_path_bench() {
    const BS: usize = 2 << 20;
    const N: usize = 64;
    let c = cpu(N, BS);
    let keys: Vec<_> = (0..N as u64).map(test_key).collect();
    let src: Vec<AlignedBuf> = keys
        .iter()
        .map(|k| {
            let mut b = AlignedBuf::zeroed(BS);
            fill_block(k, 0, b.as_mut_slice());
            b
        })
        .collect();
    let mut dst: Vec<AlignedBuf> = (0..N)
        .map(|_| {
            let mut b = AlignedBuf::zeroed(BS);
            b.as_mut_slice().fill(1); // fault the pages in
            b
        })
        .collect();
    let gb = (N * BS) as f64 / 1e9;
    // The tier's memory is allocated up front, as a device's capacity is.
    let tier = Arc::new(MemoryTier::new("mem", BS));
    tier.reserve(N);
    let (mut base, mut st, mut ld) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..7 {
        // baseline: memcpy of the same bytes into pre-faulted buffers
        let t = Instant::now();
        for (s, d) in src.iter().zip(dst.iter_mut()) {
            d.as_mut_slice().copy_from_slice(black_box(s.as_slice()));
        }
        let memcpy = t.elapsed();

        tier.clear();
        // every block may wait in write-back at once: the cascade writes all N
        let mut cfg = KvTierConfig::new((N * BS) as u64, BS as u64);
        cfg.write_back_max_dram_fraction = 1.0;
        let m = TieringManager::builder(cfg)
            .primary(c.clone())
            .tier(tier.clone())
            .build()
            .await
            .unwrap();
        m.reset_cache().await;
        // fill DRAM (the engine's GPU -> DRAM copy; not timed)
        let mut p = m.prepare_store(&keys).unwrap();
        for ((_, sink), s) in p.slots().iter_mut().zip(&src) {
            sink.as_mut_slice().copy_from_slice(s.as_slice());
        }
        // store: DRAM -> tier, through a cascade job
        let t = Instant::now();
        p.commit(RequestId(1));
        m.wait_idle().await;
        let store = t.elapsed();
        assert_eq!(tier.len(), N);
        // load: tier -> DRAM, through probe + promotion
        m.reset_cache().await;
        let req = RequestContext::new(2);
        let t = Instant::now();
        loop {
            let c = m.lookup_prefix(&keys, &req);
            m.on_schedule_end();
            if c.hit == N {
                break;
            }
            m.wait_idle().await;
        }
        let load = t.elapsed();
        if round > 0 {
            base.push(memcpy);
            st.push(store);
            ld.push(load);
        }
        m.reset_cache().await;
    }
    let (b, s, l) = (median(base), median(st), median(ld));
    let gbps = |d: Duration| gb / d.as_secs_f64();
    println!(
        "{:<58} {:>9.2} GB/s {:>14}",
        "memcpy of 64 x 2 MiB (baseline, same run)",
        gbps(b),
        ""
    );
    println!(
        "{:<58} {:>9.2} GB/s {:>14}",
        format!(
            "store DRAM -> memory tier via manager ({:.2}x memcpy)",
            b.as_secs_f64() / s.as_secs_f64()
        ),
        gbps(s),
        ">= 0.8x"
    );
    println!(
        "{:<58} {:>9.2} GB/s {:>14}",
        format!(
            "load memory tier -> DRAM via manager ({:.2}x memcpy)",
            b.as_secs_f64() / l.as_secs_f64()
        ),
        gbps(l),
        ">= 0.8x"
    );
}
