#![doc = include_str!("../README.md")]

mod block;
mod capacity;
mod client;
mod config;
mod error;
mod existing;
mod inspect;
mod listing;
mod load;
mod presence;
mod shared;
mod stats;
mod sweep;
mod tier;

pub use block::{CRC_METADATA_KEY, block_crc};
pub use config::{ObjChecksum, ObjTierConfig, RANGES, STORE_CONFIG_KEYS, Scheme, check_bucket};
pub use stats::{ObjStats, SharedStats};
pub use tier::ObjTier;

/// The [`object_store`](https://docs.rs/object_store/0.14) crate this tier is built on,
/// re-exported: an engine that builds its own store (its credentials, its client options, a
/// wrapper of its own) hands it to [`ObjTier::with_store`] through this path, with no need to
/// pin a matching version itself.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// use std::sync::Arc;
/// use kv_tier_core::{Namespace, RunFields};
/// use kv_tier_obj::object_store::{ObjectStore, memory::InMemory};
/// use kv_tier_obj::{ObjTier, ObjTierConfig};
///
/// let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
/// let ns = Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap();
/// let tier = ObjTier::with_store("obj", store, ObjTierConfig::new("kv"), ns, 4096)
///     .await
///     .unwrap();
/// assert_eq!(tier.stats().blocks.blocks_written, 0);
/// # }
/// ```
pub use object_store;
