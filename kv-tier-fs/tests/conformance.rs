//! The conformance suite against the fs tier, with and without checksums.

mod common;

use std::sync::Arc;

use kv_tier_testkit::{TierFixture, temp_root};

kv_tier_testkit::conformance_tests!(|| async {
    let root = temp_root();
    let tier = common::open(root.path());
    assert!(
        tier.stats().direct_io,
        "O_DIRECT is expected to work on the test filesystem"
    );
    TierFixture::new(Arc::new(tier), common::BS).keep(root)
});

mod checksummed {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let root = temp_root();
        TierFixture::new(Arc::new(common::open_checksummed(root.path())), common::BS).keep(root)
    });
}
