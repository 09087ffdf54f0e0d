//! Helpers of the obj tier's tests: the testkit's S3 server, configured for `ObjTier`.
#![allow(dead_code, unreachable_pub)]

use kv_tier_core::{Namespace, RunFields};
use kv_tier_obj::{ObjTier, ObjTierConfig, Scheme};
pub use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};

pub const BS: usize = 4096;

pub fn ns() -> Namespace {
    Namespace::new(
        RunFields::new("test-org/test-model", "torch.float16", 16),
        0,
    )
    .unwrap()
}

/// `ObjTier` and aws-sdk-s3 clients of a test server.
pub trait S3ServerExt {
    fn config(&self) -> ObjTierConfig;
    async fn tier(&self, cfg: ObjTierConfig) -> ObjTier;
    fn sdk(&self) -> aws_sdk_s3::Client;
}

impl S3ServerExt for S3Server {
    fn config(&self) -> ObjTierConfig {
        let mut c = ObjTierConfig::new(BUCKET);
        c.endpoint_override = Some(self.endpoint.clone());
        c.access_key = Some(AK.into());
        c.secret_key = Some(SK.into());
        c.region = Some("us-east-1".into());
        c.scheme = Scheme::Http;
        c.prefix = "tests/".into();
        c
    }

    async fn tier(&self, cfg: ObjTierConfig) -> ObjTier {
        ObjTier::connect("obj", cfg, ns(), BS).await.unwrap()
    }

    /// An aws-sdk-s3 client for the server.
    fn sdk(&self) -> aws_sdk_s3::Client {
        let creds = aws_sdk_s3::config::Credentials::new(AK, SK, None, None, "test");
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .endpoint_url(&self.endpoint)
            .region(aws_sdk_s3::config::Region::new("us-east-1"))
            .credentials_provider(creds)
            .force_path_style(true)
            .build();
        aws_sdk_s3::Client::from_conf(conf)
    }
}

/// An obj tier named "obj" over a controlled in-memory store.
pub async fn tier_on(
    store: &std::sync::Arc<kv_tier_testkit::controlled_store::ControlledStore>,
    cfg: ObjTierConfig,
) -> std::sync::Arc<ObjTier> {
    std::sync::Arc::new(
        ObjTier::with_store("obj", store.clone(), cfg, ns(), BS)
            .await
            .unwrap(),
    )
}

/// Stores `keys` (salt 0) as one job.
pub async fn store(t: &ObjTier, keys: &[kv_tier_core::BlockKey]) -> kv_tier_core::JobResult {
    kv_tier_testkit::store_keys(t, keys, 0, BS).await
}
