//! A short demo of kv-tier: an engine-like loop over the DRAM tier and the in-memory
//! reference tier, playing multi-turn conversations that share prefixes. Every block read
//! back is verified against the bytes derived from its key.
//!
//! `cargo run --release -p kv-tier-examples --bin demo`

use std::io::Write as _;
use std::time::Instant;

use kv_tier_core::{BlockKey, KvTierConfig, RequestContext, TierRegistry};
use kv_tier_testkit::{MemoryTier, Workload, WorkloadConfig, fill_block, verify_block};

const CONFIG: &str = r#"{
    "cpu_bytes_to_use": 67108864,
    "block_size_bytes": 262144,
    "eviction_policy": "lru",
    "secondary_tiers": [{"type": "memory"}]
}"#;

fn main() {
    if let Err(e) = run() {
        eprintln!("demo failed: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let cfg = KvTierConfig::from_json_str(CONFIG)?;
    let mut registry = TierRegistry::new();
    MemoryTier::register(&mut registry);
    let manager = kv_tier_cpu::manager_builder(cfg.clone())?
        .registry(registry)
        .build_blocking()?;
    let rt = manager.runtime().clone();
    println!(
        "kv-tier demo: {} MiB of DRAM in blocks of {} KiB, secondary tiers: {:?}",
        cfg.cpu_bytes_to_use >> 20,
        cfg.block_size_bytes >> 10,
        manager.tier_names()
    );
    let wl = Workload::new(WorkloadConfig {
        seed: 42,
        streams: 16,
        turns: 4,
        prefix_pool: 8,
        prefix_blocks: 16,
        prompt_blocks: 8,
        output_blocks: 4,
        group: 0,
    });
    let total = wl.total_turns();
    let started = Instant::now();
    let (mut hit_blocks, mut computed_blocks, mut verified, mut steps) = (0u64, 0u64, 0u64, 0u64);
    for (i, turn) in wl.enumerate() {
        let req = RequestContext::new(turn.request);
        // The scheduler asks every step until the answer is settled.
        let hit = loop {
            steps += 1;
            let c = manager.lookup_prefix(&turn.keys, &req);
            manager.on_schedule_end();
            if !c.retry && c.present == c.hit {
                break c.hit;
            }
            rt.block_on(manager.wait_idle());
        };
        // Read the hit prefix from DRAM and check every byte.
        let views = manager.prepare_load(&turn.keys[..hit])?;
        for (k, v) in turn.keys[..hit].iter().zip(&views) {
            if !verify_block(k, 0, v.as_slice()) {
                return Err(format!("block {k} came back with wrong bytes").into());
            }
            verified += 1;
        }
        drop(views);
        hit_blocks += hit as u64;
        // "Compute" the rest and the output, and offload them.
        let mut new: Vec<BlockKey> = turn.keys[hit..].to_vec();
        new.extend(&turn.output);
        computed_blocks += new.len() as u64;
        for chunk in new.chunks(16) {
            let mut prepared = manager.prepare_store(chunk)?;
            for (k, sink) in &mut prepared.to_store {
                fill_block(k, 0, sink.as_mut_slice());
            }
            drop(prepared);
            manager.complete_store(req.id, chunk, true);
        }
        manager.touch(&turn.keys);
        manager.on_request_finished(req.id);
        let s = manager.stats();
        print!(
            "\r[{:>3}/{total}] prefix hits {:>5} blocks, computed {:>5}, promoted {:>4}, DRAM evictions {:>5}",
            i + 1,
            hit_blocks,
            computed_blocks,
            s.tiers[0].blocks_loaded,
            s.primary.evictions
        );
        std::io::stdout().flush().ok();
    }
    rt.block_on(manager.wait_idle());
    let elapsed = started.elapsed();
    let s = manager.stats();
    let t = &s.tiers[0];
    println!("\n\nreport");
    println!(
        "  turns                 {total} in {:.2} s ({steps} scheduler steps)",
        elapsed.as_secs_f64()
    );
    println!(
        "  lookups               {} (hit {}, pending {}, retry {}, miss {})",
        s.lookups, s.hits, s.hits_pending, s.retries, s.misses
    );
    println!("  blocks from cache     {hit_blocks} (verified byte for byte: {verified})");
    println!("  blocks computed       {computed_blocks}");
    println!(
        "  tier {:<16} stored {} blocks ({} MiB), promoted {} blocks ({} MiB)",
        t.name,
        t.blocks_stored,
        t.bytes_stored >> 20,
        t.blocks_loaded,
        t.bytes_loaded >> 20
    );
    println!(
        "  load job latency      p50 {:?}  p99 {:?}",
        t.load_latency.quantile(0.5),
        t.load_latency.quantile(0.99)
    );
    println!("  DRAM evictions        {}", s.primary.evictions);
    let events = manager.take_events();
    println!(
        "  events                {} ({} removals)",
        events.len(),
        events.iter().filter(|e| e.removed).count()
    );
    if verified == 0 || t.blocks_loaded == 0 {
        return Err("the demo expected cache hits and promotions but saw none".into());
    }
    rt.block_on(manager.shutdown())?;
    Ok(())
}
