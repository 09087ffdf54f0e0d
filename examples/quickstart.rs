//! Quickstart: a manager from a JSON config (DRAM + an fs tier), store a block, look it up,
//! read it back. `cargo run -p kv-tier-examples --example quickstart`
use kv_tier::{BlockKey, KvTierConfig, LookupResult, RequestContext};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 67108864, "block_size_bytes": 65536,
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": "{}"}}]}}"#,
        dir.path().display()
    ))?;
    let manager = kv_tier::builder(cfg)?.build_blocking()?;
    let (req, key) = (RequestContext::new(1), BlockKey::from_hash32([42; 32], 0));
    let mut pending = manager.prepare_store(&[key])?; // DRAM slots to copy GPU -> DRAM into
    pending.slots()[0].1.as_mut_slice().fill(7);
    pending.commit(req.id); // readable in DRAM; cascades to the fs tier in the background
    assert_eq!(manager.lookup(&key, &req), LookupResult::Hit);
    let views = manager.prepare_load(&[key])?; // pinned until dropped: copy DRAM -> GPU
    assert!(views[0].as_slice().iter().all(|&b| b == 7));
    manager.runtime().block_on(manager.wait_idle());
    let fs = manager
        .tier::<kv_tier::fs::FsTier>("fs")
        .expect("the fs tier");
    println!(
        "stored, found and read back {key}; blocks stored in the fs tier: {}, files written: {}",
        manager.stats().tiers[0].blocks_stored,
        fs.stats().blocks.blocks_written
    );
    Ok(())
}
