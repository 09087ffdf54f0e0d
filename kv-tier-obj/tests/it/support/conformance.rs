//! The conformance suite's fixtures of the obj tier: on an in-memory store (reopening on it,
//! built from a config JSON by type name) and on the S3 test server, with the bound and
//! damage hooks.

use std::sync::Arc;

use kv_tier_core::registry::{BuildContext, TierBuilder, TierRegistry};
use kv_tier_core::{BlockKey, SecondaryTier, TierSpec};
use kv_tier_obj::{CRC_METADATA_KEY, ObjChecksum, ObjTier, ObjTierConfig};
use kv_tier_testkit::conformance::BoxFuture;
use kv_tier_testkit::{Bound, Damage, TierFixture};
use object_store::ObjectStoreExt as _;
use object_store::memory::InMemory;
use object_store::path::Path as ObjPath;
use object_store::{
    Attribute, AttributeValue, Attributes, ObjectStore, PutMode, PutOptions, PutPayload,
};

use super::{BS, S3Server, S3ServerExt as _, ns};

/// The bounded fixture's cap, in blocks.
pub(crate) const CAP_BLOCKS: usize = 128;

/// The layout section of the fixtures' config JSON.
fn layout() -> serde_json::Value {
    serde_json::json!({"model_name": "test-org/test-model", "dtype": "torch.float16", "tokens_per_hash": 16})
}

/// Builds `"obj"` tiers on one in-memory store (the config's `bucket` is ignored).
struct OnMemory(Arc<InMemory>);

#[kv_tier_core::async_trait]
impl TierBuilder for OnMemory {
    async fn build(
        &self,
        spec: &TierSpec,
        ctx: &BuildContext,
    ) -> kv_tier_core::Result<Arc<dyn SecondaryTier>> {
        let cfg = ObjTierConfig::from_spec(spec)?;
        let ns = ctx.require_namespace()?.clone();
        Ok(Arc::new(
            ObjTier::with_store(&ctx.name, self.0.clone(), cfg, ns, ctx.block_size).await?,
        ))
    }
}

/// Damages `key`'s object in `store`, keeping or changing its checksum metadata.
async fn damage(store: Arc<dyn ObjectStore>, tier: Arc<ObjTier>, key: BlockKey, d: Damage) -> bool {
    let path = ObjPath::from(tier.object_path(&key));
    let got = store.get(&path).await.unwrap();
    let mut attributes = got.attributes.clone();
    let mut bytes = got.bytes().await.unwrap().to_vec();
    let crc = Attribute::Metadata(CRC_METADATA_KEY.into());
    assert!(
        attributes.get(&crc).is_some(),
        "the object carries its checksum"
    );
    match d {
        Damage::FlipByte => bytes[100] ^= 0x40,
        Damage::Truncate => bytes.truncate(bytes.len() / 2),
        Damage::Empty => bytes.clear(),
        Damage::ReplacedBy(other) => {
            let o = store
                .get(&ObjPath::from(tier.object_path(&other)))
                .await
                .unwrap();
            attributes = o.attributes.clone();
            bytes = o.bytes().await.unwrap().to_vec();
        }
        Damage::WrongChecksum => {
            let v = attributes.get(&crc).unwrap().to_string();
            let wrong = format!("{:08x}", u32::from_str_radix(&v, 16).unwrap() ^ 1);
            attributes.insert(crc, AttributeValue::from(wrong));
        }
        Damage::NoChecksum => {
            let mut kept = Attributes::new();
            for (k, v) in attributes.iter() {
                if *k != crc {
                    kept.insert(k.clone(), v.clone());
                }
            }
            attributes = kept;
        }
    }
    let opts = PutOptions {
        mode: PutMode::Overwrite,
        attributes,
        ..Default::default()
    };
    store
        .put_opts(&path, PutPayload::from(bytes), opts)
        .await
        .unwrap();
    true
}

/// A fixture on the in-memory `store` with `cfg` (boxed: it reopens itself).
pub(crate) fn on_memory(store: Arc<InMemory>, cfg: ObjTierConfig) -> BoxFuture<TierFixture> {
    Box::pin(async move {
        let tier = Arc::new(
            ObjTier::with_store("obj", store.clone(), cfg.clone(), ns(), BS)
                .await
                .unwrap(),
        );
        let mut entry =
            serde_json::json!({"type": "obj", "bucket": "mem", "prefix": "from-config/"});
        if let Some(gb) = cfg.max_size_gb {
            entry["max_size_gb"] = gb.into();
        }
        let s = store.clone();
        let fx = TierFixture::new(tier.clone(), BS).registered(
            move |r: &mut TierRegistry| {
                r.register("obj", OnMemory(s.clone()))?;
                Ok(())
            },
            serde_json::json!({"layout": layout(), "secondary_tiers": [entry]}),
        );
        let fx = with_hooks(fx, tier, store.clone() as Arc<dyn ObjectStore>, &cfg);
        let c = cfg.clone();
        fx.reopen(move || on_memory(store.clone(), c.clone()))
    })
}

/// The bound and damage hooks every obj fixture shares.
fn with_hooks(
    mut fx: TierFixture,
    tier: Arc<ObjTier>,
    store: Arc<dyn ObjectStore>,
    cfg: &ObjTierConfig,
) -> TierFixture {
    if let Some(gb) = cfg.max_size_gb {
        let cap = (gb * (1u64 << 30) as f64) as u64;
        let (t1, t2) = (tier.clone(), tier.clone());
        fx = fx.bounded(Bound::new(
            CAP_BLOCKS,
            move || {
                let t = t1.clone();
                async move {
                    t.sweep_now().await;
                }
            },
            || async {},
            move || (t2.stats().bytes, cap),
        ));
    }
    if cfg.checksum == ObjChecksum::Crc32c {
        fx = fx.damage(move |k, d| damage(store.clone(), tier.clone(), k, d));
    }
    fx
}

/// A fixture on the S3 test `server` (checksums on; it reopens itself).
pub(crate) fn on_server(server: Arc<S3Server>) -> BoxFuture<TierFixture> {
    Box::pin(async move {
        let mut cfg = server.config();
        cfg.checksum = ObjChecksum::Crc32c;
        let tier = Arc::new(server.tier(cfg.clone()).await);
        let entry = serde_json::json!({
            "type": "obj", "bucket": cfg.bucket, "endpoint_override": cfg.endpoint_override,
            "access_key": cfg.access_key, "secret_key": cfg.secret_key, "region": cfg.region,
            "scheme": "http", "prefix": "from-config/", "checksum": "crc32c",
        });
        let fx = TierFixture::new(tier.clone(), BS).registered(
            ObjTier::register,
            serde_json::json!({"layout": layout(), "secondary_tiers": [entry]}),
        );
        let store = tier.object_store().clone();
        let fx = with_hooks(fx, tier, store, &cfg);
        let s = server.clone();
        fx.reopen(move || on_server(s.clone()))
    })
}
