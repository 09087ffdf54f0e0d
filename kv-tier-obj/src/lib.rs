#![doc = include_str!("../README.md")]

mod config;
mod tier;

pub use config::{ObjChecksum, ObjTierConfig, Scheme};
pub use tier::{CRC_METADATA_KEY, ObjStats, ObjTier};
