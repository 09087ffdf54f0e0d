//! The engine's store path: the pending store's typestate, the cascade to the secondary tiers,
//! write-back bounds and admission.

/// `store_threshold`, `max_tracker_size`, `admit_after_lookups`, write budgets.
mod admission;
/// The cascade of a committed store to the secondary tiers.
mod cascade;
/// Chain links sent with the stores (`chain_eviction`).
mod chains;
/// What a commit left out of the cascade, per tier and cause.
mod receipts;
/// `prepare_store`'s pending store: commit, abort, drop, duplicates.
mod typestate;
/// Write-back bounds per tier and the DRAM they pin.
mod write_back;
