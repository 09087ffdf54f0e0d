#![doc = include_str!("../README.md")]

pub mod bench;
pub mod conformance;
pub mod controlled_store;
pub mod faulty;
pub mod fixtures;
pub mod instances;
pub mod memory;
#[cfg(feature = "s3-server")]
pub mod s3;
pub mod sim;
pub mod util;
pub mod wait;
pub mod workload;

pub use conformance::{Bound, Damage, TierFixture};
pub use faulty::FaultyTier;
pub use memory::MemoryTier;
pub use util::{
    CONFIG_NUMBERS, Gate, allocated_bytes, allocated_bytes_at_once,
    assert_loads_report_what_landed, block_bytes, dram_manager_builder, fill_block, find_files,
    load_keys, removed_keys, sink, source_for, store_keys, temp_root, test_key, test_namespace,
    verify_block,
};
pub use workload::{Turn, Workload, WorkloadConfig};
