//! serve_sim, the serving-workload simulator: short scenarios run in process with their reports
//! checked for consistency, and the binary run as a user runs it (through its documented
//! interfaces only), given what a user might give it by mistake, interrupted, scraped. Tests
//! that check the root a run left use the `kv-tier` command of kv-tier-cli, built beside
//! serve_sim if it is not there.
//!
//! - `report`: the report's figures agree with each other, a seed's run is deterministic, the
//!   ideal hit rate, progress on stderr, the README's default run;
//! - `attribution`: every prompt token in one bucket (fs, obj, tiny caps, admission, a
//!   restart), the same for a seed, the trace replayed offline;
//! - `fs_tier`: the fs tier within its cap after each sweep, admission after lookups;
//! - `load_or_recompute`: `--load-policy`: promotions slower than recomputing declined and
//!   attributed;
//! - `json_output`: `--json`: what it records, that it agrees with the text, paths refused;
//! - `flags`: presets, `--help`'s defaults, bad and conflicting flags, `--config` files;
//! - `numbers`: numeric arguments that overflow, are huge, NaN, negative or zero;
//! - `roots`: `--root-dir` given a file, a root of another block size or model, two runs on one;
//! - `interrupts`: SIGINT and SIGTERM mid-run and at startup leave a valid root;
//! - `obj_tier`: an obj tier on an S3 server below fs, slow, unreachable, or misnamed;
//! - `metrics`: the Prometheus endpoint during a run, and its address in use;
//! - `instances`: `--instances`: several processes on one shared root under one cap;
//! - `support`: this binary's helpers.

mod attribution;
mod flags;
mod fs_tier;
mod instances;
mod interrupts;
mod json_output;
mod load_or_recompute;
mod metrics;
mod numbers;
mod obj_tier;
mod report;
mod roots;
mod support;
