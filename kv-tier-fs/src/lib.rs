#![doc = include_str!("../README.md")]

mod block;
mod capacity;
mod config;
mod error;
mod file;
mod gc;
mod inspect;
mod io;
mod live;
mod load;
pub mod offline;
mod root;
mod shared;
mod stats;
mod store;
mod tier;

pub use block::{FaultInjector, FsOp};
pub use config::{Checksum, FsTierConfig, RANGES};
pub use file::{CRC_SIDECAR_SUFFIX, CRC_XATTR, VLLM_CRC_XATTR};
pub use gc::{SweepHook, SweepPoint};
pub use stats::{FsStats, GcStats, SharedStats};
pub use tier::FsTier;
