#![doc = include_str!("../README.md")]

pub mod buf;
pub mod checksum;
pub mod config;
pub mod error;
pub mod event;
pub mod instance;
pub mod json;
pub mod key;
pub mod layout;
pub mod lru;
pub mod manager;
pub mod metrics;
pub mod probe_cache;
pub mod ranges;
pub mod registry;
pub mod request;
pub mod stats;
mod sync;
pub mod tier;
pub mod tier_options;

pub use buf::{AlignedBuf, BlockSink, BlockSource, PAGE_SIZE, SinkReader};
pub use checksum::Checksum;
pub use config::{EvictionPolicy, KvTierConfig, TierSpec};
pub use error::{Error, Result};
pub use event::{BoundedEvents, EventBatch, EventLog, EventSettings, Locality, Medium, TierEvent};
pub use key::{BlockKey, InvalidKey};
pub use layout::{LAYOUT_RANGES, Namespace, RunFields};
pub use manager::{
    LoadEstimate, NotWritten, PendingStore, RecomputeTime, StoreReceipt, TieringManager,
    TieringManagerBuilder,
};
pub use probe_cache::{Absence, Presence, ProbeCache};
pub use registry::{BuildContext, TierBuilder, TierRegistry};
pub use request::{
    LookupResult, MissCause, PrefixCount, RequestContext, RequestId, TierFilter, count_prefix,
};
pub use stats::{
    BlockCounters, BlockStats, FailureCauses, LatencyHistogram, ManagerStats, MissCounts,
    TierSnapshot, TierStats,
};
pub use tier::{
    Capability, ChainLink, JobResult, LoadJob, LoadProgress, OffloadPolicy, PreparedStore,
    PrimaryStats, PrimaryTier, ProtectGuard, ProtectionSet, SecondaryTier, StoreJob, TierInfo,
};
pub use tier_options::{TierOptions, TierSettings, WriteBackPolicy};

/// Re-exported so tier crates and the conformance macro use the same version.
pub use async_trait::async_trait;

/// What a tier implementation names: `use kv_tier_core::prelude::*;` at the top of a tier's
/// `tier.rs` brings the trait, its jobs and results, its registration and its events.
pub mod prelude {
    pub use crate::{
        BlockKey, BuildContext, Capability, Error, EventBatch, EventLog, JobResult, LoadJob,
        Locality, Medium, Namespace, ProtectGuard, ProtectionSet, Result, SecondaryTier, StoreJob,
        TierEvent, TierInfo, TierRegistry, TierSpec, async_trait,
    };
}
