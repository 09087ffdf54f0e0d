//! The conformance suite against object_store's InMemory and against a real S3 server.

mod common;

use common::S3ServerExt as _;

use std::sync::Arc;

use kv_tier_obj::{ObjChecksum, ObjTier, ObjTierConfig};
use kv_tier_testkit::TierFixture;

kv_tier_testkit::conformance_tests!(|| async {
    let store = Arc::new(object_store::memory::InMemory::new());
    let tier = ObjTier::with_store(
        "obj",
        store,
        ObjTierConfig::new("mem"),
        common::ns(),
        common::BS,
    )
    .await
    .unwrap();
    TierFixture::new(Arc::new(tier), common::BS)
});

mod s3 {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let server = common::S3Server::start().await;
        let mut cfg = server.config();
        cfg.checksum = ObjChecksum::Crc32c;
        let tier = server.tier(cfg).await;
        TierFixture::new(Arc::new(tier), common::BS).keep(server)
    });
}
