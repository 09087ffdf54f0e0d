//! Events that tell consumers (a KV-events publisher, a router) where blocks are.

use std::fmt;

use crate::key::BlockKey;

/// Where a tier keeps its bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Medium {
    /// Host DRAM (the primary tier).
    Cpu,
    /// Persistent storage: local files or object storage.
    Storage,
}

impl Medium {
    /// The name used in event streams (`"CPU"`, `"STORAGE"`).
    pub fn as_str(&self) -> &'static str {
        match self {
            Medium::Cpu => "CPU",
            Medium::Storage => "STORAGE",
        }
    }
}

impl fmt::Display for Medium {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Whether a tier is private to this host or shared over a network.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Locality {
    /// On this host (DRAM, local NVMe).
    Local,
    /// Reached over the network, possibly shared by many hosts (object storage).
    Remote,
}

/// Blocks were stored in (`removed == false`) or removed from (`removed == true`) a tier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierEvent {
    /// The tier's name.
    pub tier: String,
    /// The blocks concerned, in the order they were handled.
    pub keys: Vec<BlockKey>,
    /// The tier's medium.
    pub medium: Medium,
    /// The tier's locality.
    pub locality: Locality,
    /// `true` for removals (evictions, deletions), `false` for stores.
    pub removed: bool,
}

impl TierEvent {
    /// A `BlockStored` event.
    pub fn stored(tier: &str, keys: Vec<BlockKey>, medium: Medium, locality: Locality) -> Self {
        Self {
            tier: tier.to_string(),
            keys,
            medium,
            locality,
            removed: false,
        }
    }

    /// A `BlockRemoved` event.
    pub fn removed(tier: &str, keys: Vec<BlockKey>, medium: Medium, locality: Locality) -> Self {
        Self {
            tier: tier.to_string(),
            keys,
            medium,
            locality,
            removed: true,
        }
    }
}
