//! Helpers of the DRAM tier's tests: keys whose index is in their hash, a tier of a given
//! size, a store that fills each slot with its key's index byte, and the conformance fixture.

use std::sync::Arc;

use kv_tier_core::{BlockKey, EvictionPolicy, LookupResult, PAGE_SIZE, PrimaryTier};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::conformance::PrimaryFixture;

/// The key of index `i`: `i` big-endian in the first four bytes of its hash (so its fourth
/// byte, what [`store_in`] fills its slot with, is `i`'s low byte), group 0.
pub(crate) fn dram_key(i: u32) -> BlockKey {
    let mut h = [0u8; 32];
    h[..4].copy_from_slice(&i.to_be_bytes());
    BlockKey::from_hash32(h, 0)
}

/// A prefaulted DRAM tier of `slots` slots for blocks of `block` bytes (each slot a whole
/// number of pages) under `policy`.
pub(crate) fn dram_tier(slots: usize, block: usize, policy: EvictionPolicy) -> CpuTier {
    let slot = block.div_ceil(PAGE_SIZE) * PAGE_SIZE;
    CpuTier::new(CpuTierConfig {
        capacity_bytes: (slots * slot) as u64,
        block_size: block,
        policy,
        prefault: true,
    })
    .unwrap()
}

/// Stores `keys` in `t` (each slot filled with the fourth byte of its key's hash) and
/// completes the store; returns the keys that became readable.
pub(crate) fn store_in(t: &CpuTier, keys: &[BlockKey]) -> Vec<BlockKey> {
    let mut p = t.prepare_store(keys).unwrap();
    for (k, sink) in &mut p.to_store {
        let fill = k.hash_bytes()[3];
        sink.as_mut_slice().fill(fill);
    }
    drop(p);
    t.complete_store(keys, true)
}

/// The indexes below `n` whose [`dram_key`] is readable (`Hit`) in `t`.
pub(crate) fn resident_keys(t: &CpuTier, n: u32) -> Vec<u32> {
    (0..n)
        .filter(|&i| t.lookup(&dram_key(i)) == LookupResult::Hit)
        .collect()
}

/// The primary-tier conformance fixture: a DRAM tier of 16 blocks of 4 KiB under `policy`.
pub(crate) fn primary_fixture(policy: EvictionPolicy) -> PrimaryFixture {
    let tier = CpuTier::new(CpuTierConfig {
        capacity_bytes: 16 * 4096,
        block_size: 4096,
        policy,
        prefault: false,
    })
    .unwrap();
    PrimaryFixture {
        tier: Arc::new(tier),
        capacity_blocks: 16,
        lru: policy == EvictionPolicy::Lru,
    }
}
