//! The conformance suite: what every [`SecondaryTier`] must do, as documented `pub async fn`
//! cases. Run them all in your crate with [`crate::conformance_tests!`], one `#[tokio::test]`
//! per case, so a failure is named by its case.
//!
//! ```ignore
//! // tests/conformance.rs of a tier crate (needs tokio with "macros" and "rt-multi-thread")
//! kv_tier_testkit::conformance_tests!(|| async {
//!     kv_tier_testkit::TierFixture::new(std::sync::Arc::new(MyTier::new()), 4096)
//! });
//! ```

use std::any::Any;
use std::collections::BTreeSet;
use std::sync::Arc;

use kv_tier_core::{BlockKey, LoadJob, SecondaryTier, StoreJob};

use crate::util::{sink, source_for, test_key, verify_block};

/// A tier under test, its block size, and whatever must live as long as it (a temp dir, a
/// server).
pub struct TierFixture {
    /// The tier.
    pub tier: Arc<dyn SecondaryTier>,
    /// The block size it was built for.
    pub block_size: usize,
    _keep: Vec<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for TierFixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierFixture")
            .field("tier", &self.tier)
            .field("block_size", &self.block_size)
            .finish()
    }
}

impl TierFixture {
    /// A fixture for `tier` built for blocks of `block_size` bytes.
    pub fn new(tier: Arc<dyn SecondaryTier>, block_size: usize) -> Self {
        Self {
            tier,
            block_size,
            _keep: Vec::new(),
        }
    }

    /// Keeps `guard` alive as long as the fixture (dropped after the tier's last use).
    pub fn keep<T: Any + Send + Sync>(mut self, guard: T) -> Self {
        self._keep.push(Box::new(guard));
        self
    }
}

/// Keys reserved for one case so cases never collide, even on a shared backend.
fn keys(case: u64, n: usize) -> Vec<BlockKey> {
    (0..n as u64).map(|i| test_key(case << 32 | i)).collect()
}

async fn store(fx: &TierFixture, keys: &[BlockKey], salt: u64) -> kv_tier_core::JobResult {
    crate::util::store_keys(&*fx.tier, keys, salt, fx.block_size).await
}

async fn load(
    fx: &TierFixture,
    keys: &[BlockKey],
) -> (kv_tier_core::JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    crate::util::load_keys(&*fx.tier, keys, fx.block_size).await
}

fn set(keys: &[BlockKey]) -> BTreeSet<BlockKey> {
    keys.iter().copied().collect()
}

fn assert_partition(res: &kv_tier_core::JobResult, keys: &[BlockKey]) {
    let mut all: Vec<BlockKey> = res.ok.clone();
    all.extend(res.failed_keys());
    all.sort();
    let mut want = keys.to_vec();
    want.sort();
    want.dedup();
    assert_eq!(all, want, "every key of a job is reported exactly once");
}

/// Lookups on an empty tier miss, one answer per key, in order; an empty batch answers empty.
pub async fn lookups_on_empty_tier_miss(fx: &TierFixture) {
    assert_eq!(fx.tier.lookup(&[]).await.unwrap(), Vec::<bool>::new());
    let ks = keys(1, 10);
    assert_eq!(fx.tier.lookup(&ks).await.unwrap(), vec![false; 10]);
    assert_eq!(fx.tier.lookup(&ks[..1]).await.unwrap(), vec![false]);
}

/// A stored key is found; answers follow the order of the keys asked.
pub async fn store_then_lookup_hits(fx: &TierFixture) {
    let ks = keys(2, 4);
    let res = store(fx, &[ks[0], ks[2], ks[3]], 0).await;
    assert!(res.is_success(), "store failed: {:?}", res.failed);
    assert_eq!(set(&res.ok), set(&[ks[0], ks[2], ks[3]]));
    let got = fx.tier.lookup(&[ks[1], ks[0], ks[3], ks[2]]).await.unwrap();
    assert_eq!(got, vec![false, true, true, true]);
}

/// Store then load preserves every byte, for batches of 0, 1, 2, 5 and 64 blocks.
pub async fn round_trip_preserves_bytes(fx: &TierFixture) {
    for (i, n) in [0usize, 1, 2, 5, 64].into_iter().enumerate() {
        let ks = keys(3 << 8 | i as u64, n);
        let res = store(fx, &ks, 7).await;
        assert!(res.is_success(), "store of {n} failed: {:?}", res.failed);
        assert_partition(&res, &ks);
        let (res, data) = load(fx, &ks).await;
        assert!(res.is_success(), "load of {n} failed: {:?}", res.failed);
        assert_partition(&res, &ks);
        assert_eq!(data.len(), n);
        for (k, bytes) in data {
            assert!(
                verify_block(&k, 7, &bytes),
                "bytes of {k} changed in a round trip of {n}"
            );
        }
    }
}

/// Loading a missing key fails that key only; the others load whole.
pub async fn load_missing_key_fails_only_that_key(fx: &TierFixture) {
    let ks = keys(4, 3);
    assert!(store(fx, &[ks[0], ks[2]], 1).await.is_success());
    let (res, data) = load(fx, &ks).await;
    assert_partition(&res, &ks);
    assert_eq!(res.failed_keys(), vec![ks[1]]);
    assert_eq!(set(&res.ok), set(&[ks[0], ks[2]]));
    for (k, bytes) in data {
        assert!(verify_block(&k, 1, &bytes));
    }
}

/// Storing a key that exists succeeds and does not replace the first copy.
pub async fn storing_existing_key_is_noop_success(fx: &TierFixture) {
    let ks = keys(5, 1);
    assert!(store(fx, &ks, 1).await.is_success());
    let again = store(fx, &ks, 2).await;
    assert!(
        again.is_success(),
        "second store failed: {:?}",
        again.failed
    );
    assert_eq!(again.ok, ks);
    let (_, data) = load(fx, &ks).await;
    assert!(
        verify_block(&ks[0], 1, &data[0].1),
        "the first copy was replaced"
    );
}

/// 16 concurrent stores of one key (different bytes each) all succeed and leave exactly one
/// whole copy: one writer's bytes, never a mix.
pub async fn concurrent_stores_of_one_key_leave_one_copy(fx: &TierFixture) {
    let k = keys(6, 1)[0];
    let mut tasks = Vec::new();
    for w in 0..16u64 {
        let tier = fx.tier.clone();
        let src = source_for(&k, 100 + w, fx.block_size);
        tasks.push(tokio::spawn(async move {
            tier.store(StoreJob {
                blocks: vec![(k, src)],
            })
            .await
        }));
    }
    for t in tasks {
        let res = t.await.expect("store task panicked");
        assert!(
            res.is_success(),
            "a concurrent store failed: {:?}",
            res.failed
        );
    }
    let (res, data) = load(fx, &[k]).await;
    assert!(res.is_success());
    let winners = (0..16u64)
        .filter(|w| verify_block(&k, 100 + w, &data[0].1))
        .count();
    assert_eq!(winners, 1, "the block is not exactly one writer's bytes");
}

/// Touching and protecting keys that do not exist is harmless.
pub async fn touch_and_protect_missing_keys_are_harmless(fx: &TierFixture) {
    let ks = keys(7, 3);
    fx.tier.touch(&ks);
    let g = fx.tier.protect(&ks);
    fx.tier.touch(&[]);
    drop(g);
    drop(fx.tier.protect(&[]));
    assert_eq!(fx.tier.lookup(&ks).await.unwrap(), vec![false; 3]);
    assert!(store(fx, &ks[..1], 0).await.is_success());
    fx.tier.touch(&ks);
    assert_eq!(fx.tier.lookup(&ks).await.unwrap(), vec![true, false, false]);
}

/// Protection is refcounted: two guards on a key keep it protected until both drop.
pub async fn protect_refcounts_nest(fx: &TierFixture) {
    let ks = keys(8, 2);
    assert!(!fx.tier.is_protected(&ks[0]));
    let g1 = fx.tier.protect(&ks[..1]);
    let g2 = fx.tier.protect(&ks);
    assert!(fx.tier.is_protected(&ks[0]) && fx.tier.is_protected(&ks[1]));
    drop(g2);
    assert!(
        fx.tier.is_protected(&ks[0]),
        "released while a guard still lives"
    );
    assert!(!fx.tier.is_protected(&ks[1]));
    drop(g1);
    assert!(!fx.tier.is_protected(&ks[0]));
}

/// Stored events name the keys of successful stores only; loads and failed stores emit none.
pub async fn events_for_successful_stores_only(fx: &TierFixture) {
    let ks = keys(9, 3);
    fx.tier.take_events();
    // ks[2] is one byte short: refused.
    let mut job = StoreJob::default();
    job.blocks
        .push((ks[0], source_for(&ks[0], 0, fx.block_size)));
    job.blocks
        .push((ks[1], source_for(&ks[1], 0, fx.block_size)));
    job.blocks
        .push((ks[2], source_for(&ks[2], 0, fx.block_size - 1)));
    let res = fx.tier.store(job).await;
    assert_partition(&res, &ks);
    assert_eq!(res.failed_keys(), vec![ks[2]]);
    let _ = load(fx, &ks).await;
    let events = fx.tier.take_events();
    let stored: BTreeSet<BlockKey> = events
        .iter()
        .filter(|e| !e.removed)
        .flat_map(|e| e.keys.iter().copied())
        .collect();
    assert_eq!(stored, set(&ks[..2]));
    assert!(
        events.iter().all(|e| !e.removed),
        "unexpected removal events: {events:?}"
    );
    assert!(
        events
            .iter()
            .all(|e| e.tier == fx.tier.info().name && e.medium == fx.tier.info().medium)
    );
    assert!(fx.tier.take_events().is_empty(), "events are taken once");
}

/// Blocks of the wrong size are refused per key: a short block is never stored, a load into a
/// sink of the wrong size fails that key only.
pub async fn wrong_sizes_are_refused_per_key(fx: &TierFixture) {
    let ks = keys(10, 2);
    let mut job = StoreJob::default();
    job.blocks
        .push((ks[0], source_for(&ks[0], 0, fx.block_size + 1)));
    job.blocks
        .push((ks[1], source_for(&ks[1], 0, fx.block_size)));
    let res = fx.tier.store(job).await;
    assert_eq!(res.failed_keys(), vec![ks[0]]);
    assert_eq!(fx.tier.lookup(&ks).await.unwrap(), vec![false, true]);
    let (s, _r) = sink(fx.block_size / 2);
    let (s2, r2) = sink(fx.block_size);
    let res = fx
        .tier
        .load(LoadJob {
            blocks: vec![(ks[1], s), (ks[1], s2)],
        })
        .await;
    assert_eq!(res.failed.len(), 1, "{res:?}");
    assert_eq!(res.ok, vec![ks[1]]);
    assert!(verify_block(&ks[1], 0, &r2.into_bytes().unwrap()));
}

/// Polls `fut` `polls` times (yielding to the runtime between polls, so background work
/// moves on), then drops it unless it finished.
async fn drop_after<F: Future>(polls: usize, fut: F) {
    let mut fut = std::pin::pin!(fut);
    for _ in 0..polls {
        if futures::poll!(fut.as_mut()).is_ready() {
            return;
        }
        tokio::task::yield_now().await;
    }
}

/// Waits (bounded) until no key of `keys` is protected: protections a dropped call's I/O
/// still holds end when that I/O ends.
async fn wait_unprotected(fx: &TierFixture, keys: &[BlockKey]) {
    let done = tokio::time::timeout(std::time::Duration::from_secs(60), async {
        while keys.iter().any(|k| fx.tier.is_protected(k)) {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        done.is_ok(),
        "a dropped call left keys protected for good: {:?}",
        keys.iter()
            .filter(|k| fx.tier.is_protected(k))
            .collect::<Vec<_>>()
    );
}

/// Cancellation safety: a `store`, `load` or `lookup` future dropped at any await point (here
/// after 0 to 15 polls, with the runtime running in between) leaves the tier consistent: no
/// protection outlives the call's own work, and the same keys then store, load and look up
/// normally.
pub async fn dropped_calls_leave_no_trace(fx: &TierFixture) {
    let ks = keys(11, 4);
    for polls in 0..16 {
        drop_after(polls, store(fx, &ks, 0)).await;
        drop_after(polls, load(fx, &ks)).await;
        drop_after(polls, fx.tier.lookup(&ks)).await;
    }
    wait_unprotected(fx, &ks).await;
    let res = store(fx, &ks, 0).await;
    assert!(
        res.is_success(),
        "store after dropped calls failed: {:?}",
        res.failed
    );
    let (res, data) = load(fx, &ks).await;
    assert!(
        res.is_success(),
        "load after dropped calls failed: {:?}",
        res.failed
    );
    for (k, bytes) in data {
        assert!(
            verify_block(&k, 0, &bytes),
            "bytes of {k} changed after dropped calls"
        );
    }
    assert_eq!(fx.tier.lookup(&ks).await.unwrap(), vec![true; 4]);
    wait_unprotected(fx, &ks).await;
}

/// Runs every case in order against fixtures from `make` (for tiers that prefer one test).
pub async fn run_all<F, Fut>(make: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = TierFixture>,
{
    lookups_on_empty_tier_miss(&make().await).await;
    store_then_lookup_hits(&make().await).await;
    round_trip_preserves_bytes(&make().await).await;
    load_missing_key_fails_only_that_key(&make().await).await;
    storing_existing_key_is_noop_success(&make().await).await;
    concurrent_stores_of_one_key_leave_one_copy(&make().await).await;
    touch_and_protect_missing_keys_are_harmless(&make().await).await;
    protect_refcounts_nest(&make().await).await;
    events_for_successful_stores_only(&make().await).await;
    wrong_sizes_are_refused_per_key(&make().await).await;
    dropped_calls_leave_no_trace(&make().await).await;
}

/// Expands into one `#[tokio::test]` per conformance case, inside a module `conformance`.
///
/// The argument is an expression callable with no arguments that returns a future of a
/// [`TierFixture`] (a fresh tier per case). The calling crate needs `tokio` (features
/// `macros`, `rt-multi-thread`) as a dev-dependency.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::conformance_tests!(@cases $make;
            lookups_on_empty_tier_miss,
            store_then_lookup_hits,
            round_trip_preserves_bytes,
            load_missing_key_fails_only_that_key,
            storing_existing_key_is_noop_success,
            concurrent_stores_of_one_key_leave_one_copy,
            touch_and_protect_missing_keys_are_harmless,
            protect_refcounts_nest,
            events_for_successful_stores_only,
            wrong_sizes_are_refused_per_key,
            dropped_calls_leave_no_trace
        );
    };
    (@cases $make:expr; $($case:ident),* $(,)?) => {
        mod conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let fixture: $crate::TierFixture = ($make)().await;
                    $crate::conformance::$case(&fixture).await;
                }
            )*
        }
    };
}
