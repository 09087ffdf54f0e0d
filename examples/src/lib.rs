//! Runnable programs for kv-tier (see `src/bin` and `benches`). The project README is
//! compiled here so its examples stay true.
#![doc = include_str!("../../README.md")]
