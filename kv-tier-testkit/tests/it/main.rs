//! The testkit's own tests: its reference tiers pass the conformance suite, the suite and the
//! seeded fault simulation catch tiers that break their promises, and the block helpers
//! report what they loaded.
//!
//! - `reference_tiers`: `MemoryTier` and `FaultyTier` (no faults planned) pass the suite;
//! - `suite_catches_broken_tiers`: the suite fails a tier that fails, tears or keeps buffers;
//! - `simulation`: the fault simulation over the real tiers, and that it has teeth;
//! - `util`: `load_keys` on a key loaded two ways;
//! - `support`: this binary's helpers;
//! - `world`: the simulation's real tiers, shared with the `simulate` example.

mod reference_tiers;
mod simulation;
mod suite_catches_broken_tiers;
mod support;
mod util;
#[path = "../../examples/simulate/world.rs"]
mod world;
