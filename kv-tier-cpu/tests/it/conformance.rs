//! The primary-tier conformance cases of kv-tier-testkit against the DRAM tier, under LRU
//! (here) and under ARC (`arc`).

use kv_tier_core::EvictionPolicy;

use crate::support::primary_fixture;

kv_tier_testkit::primary_conformance_tests!(|| primary_fixture(EvictionPolicy::Lru));

/// The same cases under ARC.
mod arc {
    use super::*;
    kv_tier_testkit::primary_conformance_tests!(|| primary_fixture(EvictionPolicy::Arc));
}
