/// Probes fail.
pub const PROBE_ERRORS: u32 = 1;
/// Every n-th block stored or loaded fails.
pub const JOB_ERRORS: u32 = 1 << 1;
/// Probes and jobs sleep first.
pub const DELAYS: u32 = 1 << 2;
/// Probes or jobs hang (past the manager's deadlines).
pub const HANGS: u32 = 1 << 3;
/// Probes or loads panic.
pub const PANICS: u32 = 1 << 4;
/// Blocks deleted, cut short or flipped behind the tier's back.
pub const TAMPER: u32 = 1 << 5;
/// Eviction passes forced and clocks moved.
pub const SWEEPS: u32 = 1 << 6;
/// The process "crashes": the manager and tiers are dropped without shutdown and the
/// tiers reopened on the same storage.
pub const CRASHES: u32 = 1 << 7;
/// Requests aborted mid-flight, DRAM reset while work runs.
pub const ABORTS: u32 = 1 << 8;
/// Directed interleavings (a stale probe answer raced against a store, with stores that
/// fill DRAM in between).
pub const RACES: u32 = 1 << 9;
/// Every kind.
pub const ALL: u32 = (1 << 10) - 1;
/// Names, in bit order.
pub const NAMES: [&str; 10] = [
    "probe-errors",
    "job-errors",
    "delays",
    "hangs",
    "panics",
    "tamper",
    "sweeps",
    "crashes",
    "aborts",
    "races",
];
