//! A tier written outside kv-tier's tier crates, only against the public `SecondaryTier`
//! trait: it keeps blocks in a map behind a lock and can hold at most `capacity` of them
//! (refusing more with `NoSpace`). It is registered under the type name `"capped-map"`, used
//! from the same config JSON as the built-in tiers, and passes the conformance suite
//! (`cargo test -p kv-tier-examples --example custom_tier`).
//!
//! `cargo run -p kv-tier-examples --example custom_tier`

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use kv_tier::{
    BlockKey, BuildContext, Capability, Error, JobResult, KvTierConfig, LoadJob, Locality,
    LookupResult, Medium, ProtectGuard, ProtectionSet, RequestContext, Result, SecondaryTier,
    StoreJob, TierEvent, TierInfo, TierRegistry, TierSpec, async_trait,
};

/// Options of the `"capped-map"` type.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CappedMapOptions {
    capacity: usize,
}

/// The tier.
#[derive(Debug)]
pub struct CappedMap {
    name: String,
    block_size: usize,
    capacity: usize,
    blocks: Mutex<HashMap<BlockKey, Vec<u8>>>,
    protection: ProtectionSet,
    events: Mutex<Vec<TierEvent>>,
}

impl CappedMap {
    /// An empty tier.
    pub fn new(name: &str, block_size: usize, capacity: usize) -> Self {
        Self {
            name: name.into(),
            block_size,
            capacity,
            blocks: Mutex::default(),
            protection: ProtectionSet::new(),
            events: Mutex::default(),
        }
    }

    /// Registers the type `"capped-map"` (an error if it is there already).
    pub fn register(registry: &mut TierRegistry) -> Result<()> {
        registry.register(
            "capped-map",
            |spec: &TierSpec, ctx: &BuildContext| -> Result<Arc<dyn SecondaryTier>> {
                let o: CappedMapOptions = spec.parse_options()?;
                if o.capacity == 0 {
                    return Err(Error::config("capacity", "must be positive"));
                }
                Ok(Arc::new(CappedMap::new(
                    &ctx.name,
                    ctx.block_size,
                    o.capacity,
                )))
            },
        )?;
        Ok(())
    }
}

#[async_trait]
impl SecondaryTier for CappedMap {
    fn info(&self) -> TierInfo {
        TierInfo::new(
            &self.name,
            Medium::Storage,
            Locality::Local,
            Capability::new(),
        )
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let m = self.blocks.lock().expect("map");
        Ok(keys.iter().map(|k| m.contains_key(k)).collect())
    }

    async fn store(&self, job: StoreJob) -> JobResult {
        let mut res = JobResult::default();
        let mut stored = Vec::new();
        let mut m = self.blocks.lock().expect("map");
        for (key, src) in job.blocks {
            if src.len() != self.block_size {
                let err = Error::WrongSize {
                    key,
                    got: src.len(),
                    expected: self.block_size,
                };
                res.failed.push((key, err));
            } else if m.contains_key(&key) {
                res.ok.push(key); // publish-if-absent: the first copy stays
            } else if m.len() >= self.capacity {
                let detail = format!("{} blocks held", m.len());
                res.failed.push((
                    key,
                    Error::NoSpace {
                        tier: self.name.clone(),
                        detail,
                    },
                ));
            } else {
                m.insert(key, src.as_slice().to_vec());
                stored.push(key);
                res.ok.push(key);
            }
        }
        if !stored.is_empty() {
            let ev = TierEvent::stored(&self.name, stored, Medium::Storage, Locality::Local);
            self.events.lock().expect("events").push(ev);
        }
        res
    }

    async fn load(&self, job: LoadJob) -> JobResult {
        let mut res = JobResult::default();
        let m = self.blocks.lock().expect("map");
        for (key, mut sink) in job.blocks {
            match m.get(&key) {
                Some(data) if data.len() == sink.len() => {
                    sink.as_mut_slice().copy_from_slice(data);
                    res.ok.push(key);
                }
                Some(data) => {
                    let err = Error::WrongSize {
                        key,
                        got: sink.len(),
                        expected: data.len(),
                    };
                    res.failed.push((key, err));
                }
                None => res.failed.push((
                    key,
                    Error::NotFound {
                        key,
                        tier: self.name.clone(),
                    },
                )),
            }
        }
        res
    }

    fn touch(&self, _keys: &[BlockKey]) {}

    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        self.protection.protect(keys)
    }

    fn is_protected(&self, key: &BlockKey) -> bool {
        self.protection.contains(key)
    }

    fn take_events(&self) -> Vec<TierEvent> {
        std::mem::take(&mut *self.events.lock().expect("events"))
    }

    async fn shutdown(&self) -> Result<()> {
        Ok(())
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let cfg = KvTierConfig::from_json_str(
        r#"{"cpu_bytes_to_use": 1048576, "block_size_bytes": 4096,
            "secondary_tiers": [{"type": "capped-map", "name": "mine", "capacity": 1000}]}"#,
    )?;
    let mut registry = kv_tier::registry(); // the built-in tiers, and this one
    CappedMap::register(&mut registry)?;
    let manager = kv_tier::builder(cfg)?.registry(registry).build_blocking()?;
    let (req, key) = (RequestContext::new(1), BlockKey::from_hash32([1; 32], 0));
    let mut p = manager.prepare_store(&[key])?;
    p.slots()[0].1.as_mut_slice().fill(9);
    p.commit(req.id);
    manager.runtime().block_on(manager.reset_cache()); // DRAM emptied; "mine" keeps the block
    let mut answers = Vec::new();
    for _ in 0..3 {
        answers.push(manager.lookup(&key, &req)); // Retry, HitPending, then Hit
        manager.on_schedule_end();
        manager.runtime().block_on(manager.wait_idle());
    }
    assert_eq!(answers.last(), Some(&LookupResult::Hit), "{answers:?}");
    println!("block promoted back from tier `mine`: {answers:?}");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        kv_tier_testkit::TierFixture::new(Arc::new(CappedMap::new("mine", 4096, 10_000)), 4096)
            .registered(
                CappedMap::register,
                serde_json::json!({"secondary_tiers": [
                    {"type": "capped-map", "name": "mine", "capacity": 1000}
                ]}),
            )
    });
}
