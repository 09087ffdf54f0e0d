//! Promotion of a block from a secondary tier into DRAM: the load jobs, the DRAM reservation, and
//! the hold that keeps a promoted block for its request.

/// The hold of a promoted block for its request, and nothing left held.
mod holds;
/// Load or recompute: the estimate of a load's time, and the policy that declines a load
/// slower than recomputing.
mod load_or_recompute;
/// Promotion loads: one per tier and request, partial failures, duplicates.
mod loads;
/// The DRAM reservation: never evicts a hit of the same lookup.
mod reservations;
