#![doc = include_str!("../README.md")]

mod policy;
mod region;
mod tier;

pub use tier::{CPU_TIER_NAME, CpuTier, CpuTierConfig};
