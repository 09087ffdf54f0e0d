//! Stores then loads N blocks through the fs tier, one 16-block job at a time (1 job in
//! flight), for counting the syscalls per block under strace:
//!
//! ```sh
//! cargo build --release -p kv-tier-fs --example store_syscalls
//! for n in 256 512; do strace -f -c -o /tmp/sc.$n target/release/examples/store_syscalls $n; done
//! ```
//!
//! The difference between the two runs over 256 is the per-block count (setup cancels out).
//! Arguments: `N [BLOCK_BYTES] [DIR] [spread]` (default 262144 bytes, the system temp dir).
//! The keys fall in 16 leaf directories (a warm cache's case: the directory of a new block
//! exists), or with `spread` each in a leaf of its own (a new directory per block);
//! the cache directory is left in place and its path printed (remove it after counting, so
//! the removal is not counted).

use std::sync::Arc;

use kv_tier_core::{BlockKey, BlockSink, BlockSource, LoadJob, Namespace, RunFields};
use kv_tier_core::{SecondaryTier, StoreJob};
use kv_tier_fs::{FsTier, FsTierConfig};

fn main() {
    let mut args = std::env::args().skip(1);
    let n: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(256);
    let block: usize = args
        .next()
        .and_then(|a| a.parse().ok())
        .unwrap_or(256 << 10);
    let base = args
        .next()
        .filter(|a| !a.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let spread = args.next().as_deref() == Some("spread");
    let dir = tempfile::tempdir_in(base).expect("temp dir").keep();
    println!("{}", dir.display());
    let ns = Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap();
    let tier = Arc::new(
        FsTier::open(String::from("fs"), FsTierConfig::new(&dir), ns, block).expect("fs tier"),
    );
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let keys: Vec<BlockKey> = (0..n as u32)
        .map(|i| {
            // the first 20 bits name the leaf directory: 16 of them
            let mut h = [0u8; 32];
            if spread {
                h[..4].copy_from_slice(&i.wrapping_mul(2_654_435_761).to_be_bytes());
            } else {
                h[0] = (i % 16) as u8;
            }
            h[4..8].copy_from_slice(&i.to_be_bytes());
            BlockKey::from_hash32(h, 0)
        })
        .collect();
    let data = vec![7u8; block];
    // the top-level directories are made in the background at open: not part of a block
    while !tier.stats().top_dirs_ready {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    rt.block_on(async {
        for chunk in keys.chunks(16) {
            let job = StoreJob {
                requests: Vec::new(),
                blocks: chunk
                    .iter()
                    .map(|k| (*k, BlockSource::from_bytes(data.clone())))
                    .collect(),
            };
            assert!(tier.store(job).await.is_success());
        }
        for chunk in keys.chunks(16) {
            let (sinks, readers): (Vec<_>, Vec<_>) =
                chunk.iter().map(|_| BlockSink::pair(block)).unzip();
            let job = LoadJob {
                requests: Vec::new(),
                blocks: chunk.iter().copied().zip(sinks).collect(),
            };
            assert!(tier.load(job).await.is_success());
            drop(readers);
        }
        tier.shutdown().await.unwrap();
    });
}
