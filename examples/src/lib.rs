//! Runnable programs for kv-tier (see `src/bin` and `benches`) and the serving-workload
//! simulator they share. The project README is compiled here so its examples stay true.
#![doc = include_str!("../../README.md")]

pub mod sim;
