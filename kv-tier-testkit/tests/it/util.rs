//! The testkit's block helpers (`store_keys`, `load_keys`): what they report loaded.

use std::sync::Arc;

use kv_tier_testkit::{FaultyTier, MemoryTier};

/// `load_keys` with a key given twice whose two loads went two ways (one served, one failed):
/// the result lists the key in both lists without saying which sink was filled, so neither
/// sink's bytes are returned as the key's (one of them holds nothing: returning it was a
/// "wrong block" the tier never served).
#[tokio::test]
async fn load_keys_returns_no_bytes_for_a_key_whose_loads_went_two_ways() {
    let t = Arc::new(FaultyTier::new(Arc::new(MemoryTier::new("memory", 4096))));
    let k = kv_tier_testkit::test_key(7);
    assert!(
        kv_tier_testkit::store_keys(&*t, &[k], 0, 4096)
            .await
            .is_success()
    );
    t.fail_every_nth_load(Some(2));
    let (r, data) = kv_tier_testkit::load_keys(&*t, &[k, k], 4096).await;
    assert_eq!((r.ok.len(), r.failed.len()), (1, 1), "{r:?}");
    assert!(data.is_empty(), "{} sinks returned", data.len());
    // a key given twice and loaded twice is returned twice, verified
    t.fail_every_nth_load(None);
    let (r, data) = kv_tier_testkit::load_keys(&*t, &[k, k], 4096).await;
    assert!(r.is_success(), "{r:?}");
    assert_eq!(data.len(), 2);
    assert!(
        data.iter()
            .all(|(k, d)| kv_tier_testkit::verify_block(k, 0, d))
    );
}
