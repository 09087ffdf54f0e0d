//! The integration tests of the facade: what `kv-tier` adds to kv-tier-core, the builder with the
//! built-in tiers registered and vLLM's config shapes built with them. One binary, a module per
//! subject.

/// `kv_tier::builder` and `kv_tier::registry` with the built-in tiers.
mod builder;
/// Helpers of this binary's tests.
mod support;
/// vLLM's config shapes build unchanged with the built-in tiers.
mod vllm;
