#![doc = include_str!("../README.md")]

mod config;
mod file;
mod gc;
mod io;
mod tier;

pub use config::{Checksum, FsTierConfig, RANGES};
pub use file::{CRC_SIDECAR_SUFFIX, CRC_XATTR};
pub use gc::{SweepHook, SweepPoint};
pub use tier::{FaultInjector, FsOp, FsStats, FsTier, GcStats};
