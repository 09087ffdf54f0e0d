//! Quickstart: a manager from a JSON config (DRAM + an fs tier), store a block, look it up,
//! read it back. `cargo run -p kv-tier-examples --example quickstart`
use kv_tier_core::{BlockKey, KvTierConfig, LookupResult, RequestContext, TierRegistry};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 67108864, "block_size_bytes": 65536,
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": "{}"}}]}}"#,
        dir.path().display()
    ))?;
    let mut registry = TierRegistry::new();
    kv_tier_fs::FsTier::register(&mut registry);
    let manager = kv_tier_cpu::manager_builder(cfg)?
        .registry(registry)
        .build_blocking()?;
    let (req, key) = (RequestContext::new(1), BlockKey::from_hash32([42; 32], 0));
    let mut prepared = manager.prepare_store(&[key])?; // DRAM slots to copy GPU -> DRAM into
    prepared.to_store[0].1.as_mut_slice().fill(7);
    drop(prepared);
    manager.complete_store(req.id, &[key], true); // cascades to the fs tier in the background
    assert_eq!(manager.lookup(&key, &req), LookupResult::Hit);
    let views = manager.prepare_load(&[key])?; // pinned until dropped: copy DRAM -> GPU
    assert!(views[0].as_slice().iter().all(|&b| b == 7));
    manager.runtime().block_on(manager.wait_idle());
    println!(
        "stored, found and read back {key}; stats: {:?}",
        manager.stats().tiers[0].blocks_stored
    );
    Ok(())
}
