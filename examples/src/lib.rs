//! Runnable programs for kv-tier (see `src/bin` and `benches`) and the serving-workload
//! simulator they share. The project README is compiled here so its examples stay true.
#![doc = include_str!("../../README.md")]

pub mod sim;

/// Logs to stderr, filtered by `RUST_LOG` (e.g. `RUST_LOG=kv_tier_fs=debug`; spans of jobs,
/// sweeps and rescans show with their fields at `debug` and `info`); warnings and errors
/// when it is unset.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    use std::io::IsTerminal;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr)
        .try_init();
}
