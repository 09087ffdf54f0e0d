//! The integration tests of kv-tier-cpu: the DRAM tier itself, on its own (the manager's use of it
//! is tested in kv-tier-core). One binary, a module per subject.

/// The primary-tier conformance cases, under LRU and ARC.
mod conformance;
/// The DRAM tier's eviction: LRU, ARC, batches, refusals.
mod eviction;
/// The DRAM tier's slots: alignment, write states, pins, resets, events.
mod slots;
/// Helpers of this binary's tests, each defined once.
mod support;
