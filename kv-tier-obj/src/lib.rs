#![doc = include_str!("../README.md")]

mod block;
mod capacity;
mod client;
mod config;
mod error;
mod inspect;
mod load;
mod stats;
mod sweep;
mod tier;

pub use block::{CRC_METADATA_KEY, block_crc};
pub use config::{ObjChecksum, ObjTierConfig, RANGES, Scheme};
pub use stats::ObjStats;
pub use tier::ObjTier;
