//! What an [`ObjTier`] shows of itself and lets tests and tools drive: its options, object
//! paths and store, statistics, and sweeps run by hand.

use std::sync::Arc;

use kv_tier_core::BlockKey;
use object_store::ObjectStore;

use crate::block::lock;
use crate::config::ObjTierConfig;
use crate::stats::ObjStats;
use crate::tier::ObjTier;

impl ObjTier {
    /// The options the tier was opened with.
    pub fn config(&self) -> &ObjTierConfig {
        &self.cfg
    }

    /// The object path of `key`.
    pub fn object_path(&self, key: &BlockKey) -> String {
        self.shared.path(key).to_string()
    }

    /// The key vLLM's obj tier hands its client for the same block in the same bucket and
    /// prefix (its `f"{prefix}/"` root joined to the fs layout's path with another `/`):
    /// with a prefix it holds `//`, without one it starts with `/`. It is
    /// [`ObjTier::object_path`] with the empty path segment put back; the AWS C++ SDK under
    /// vLLM collapses it by default, so the object lands at kv-tier's key (see the crate
    /// README, "Sharing a bucket with vLLM").
    pub fn vllm_object_key(&self, key: &BlockKey) -> String {
        let root = if self.shared.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.shared.prefix)
        };
        format!("{root}/{}", self.shared.ns.block_rel_path(key))
    }

    /// The underlying store.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.shared.store
    }

    /// Counters.
    pub fn stats(&self) -> ObjStats {
        let c = &self.shared.counters;
        let index =
            (self.shared.cap.as_ref()).or_else(|| self.shared.coord.as_ref().map(|c| &c.index));
        let (bytes, objects, dead_bytes) = index.map_or((0, 0, 0), |cap| {
            let i = cap.lock();
            (i.total(), i.len() as u64, i.dead_bytes())
        });
        let mut s = ObjStats {
            blocks: c.blocks.snapshot(),
            bytes,
            objects,
            dead_bytes,
            shared: self.shared.coord.as_ref().map(|c| c.stats()),
            ..ObjStats::default()
        };
        c.own.fill(&mut s);
        s
    }

    /// Runs a capacity sweep now (bounded mode), after any sweep in progress; returns the
    /// objects it deleted.
    pub async fn sweep_now(&self) -> usize {
        self.shared.clone().sweep(true).await
    }

    /// Forgets cached existence answers and the existence listing (for tests and benches of
    /// the requests they save; the next relist fills both again). A HEAD, GET or LIST under
    /// way keeps what it found to itself, and a LIST under way installs no listing.
    pub fn clear_exists_cache(&self) {
        self.shared.presence.clear();
        self.shared.forget_listing();
    }

    /// Background sweeps spawned and not yet finished.
    pub fn sweeps_running(&self) -> usize {
        let mut set = lock(&self.sweeps);
        while set.try_join_next().is_some() {}
        set.len()
    }
}
