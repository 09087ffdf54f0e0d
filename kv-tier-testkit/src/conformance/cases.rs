//! The cases every tier runs, whatever it declares.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use kv_tier_core::{BlockKey, BlockSource, JobResult, LoadJob, StoreJob};

use super::TierFixture;
use crate::util::{fill_block, sink, source_for, test_key, verify_block};

/// Keys reserved for one case so cases never collide, even on a shared backend.
pub(crate) fn keys(case: u64, n: usize) -> Vec<BlockKey> {
    (0..n as u64).map(|i| test_key(case << 32 | i)).collect()
}

pub(crate) async fn store(fx: &TierFixture, keys: &[BlockKey], salt: u64) -> JobResult {
    crate::util::store_keys(&*fx.tier, keys, salt, fx.block_size).await
}

pub(crate) async fn load(
    fx: &TierFixture,
    keys: &[BlockKey],
) -> (JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    crate::util::load_keys(&*fx.tier, keys, fx.block_size).await
}

pub(crate) fn set(keys: &[BlockKey]) -> BTreeSet<BlockKey> {
    keys.iter().copied().collect()
}

pub(crate) fn assert_partition(res: &JobResult, keys: &[BlockKey]) {
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

/// What a tier answers from memory ([`SecondaryTier::holds`](kv_tier_core::SecondaryTier::holds))
/// agrees with its probes: never `Some(false)` for a key it reported stored, never
/// `Some(true)` for one it never had, and where it answers, [`lookup`] answers the same. A
/// tier that answers `None` for every key passes.
///
/// [`lookup`]: kv_tier_core::SecondaryTier::lookup
pub async fn held_answers_agree_with_lookups(fx: &TierFixture) {
    let ks = keys(3, 6);
    let res = store(fx, &ks[..3], 0).await;
    assert!(res.is_success(), "store failed: {:?}", res.failed);
    let _guard = fx.tier.protect(&ks);
    let probed = fx.tier.lookup(&ks).await.unwrap();
    assert_eq!(probed, vec![true, true, true, false, false, false]);
    for (i, k) in ks.iter().enumerate() {
        if let Some(held) = fx.tier.holds(k) {
            assert_eq!(
                held, probed[i],
                "holds() answers {held} for key {i}, its probe {}",
                probed[i]
            );
        }
    }
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
                links: Vec::new(),
                requests: Vec::new(),
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
    let job = LoadJob {
        blocks: vec![(ks[1], s), (ks[1], s2)],
        ..LoadJob::default()
    };
    let progress = job.progress.clone();
    let res = fx.tier.load(job).await;
    assert_eq!(res.failed.len(), 1, "{res:?}");
    assert_eq!(res.ok, vec![ks[1]]);
    // a block reported landed is one the job loads, never the one of the wrong size
    assert!(progress.keys().len() <= 1, "{:?}", progress.keys());
    assert!(verify_block(&ks[1], 0, &r2.into_bytes().unwrap()));
}

/// Polls `fut` `polls` times (yielding to the runtime between polls, so background work
/// moves on), then drops it unless it finished.
pub(crate) async fn drop_after<F: Future>(polls: usize, fut: F) {
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
pub(crate) async fn wait_unprotected(fx: &TierFixture, keys: &[BlockKey]) {
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

/// A source of [`crate::block_bytes`] whose buffer counts itself in `live` until dropped: the
/// suite's view of a DRAM slot a tier keeps pinned.
pub(crate) fn tracked_source(
    key: &BlockKey,
    salt: u64,
    len: usize,
    live: &Arc<AtomicUsize>,
) -> BlockSource {
    struct Tracked {
        buf: kv_tier_core::AlignedBuf,
        live: Arc<AtomicUsize>,
    }
    impl AsRef<[u8]> for Tracked {
        fn as_ref(&self) -> &[u8] {
            self.buf.as_slice()
        }
    }
    impl Drop for Tracked {
        fn drop(&mut self) {
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let mut buf = kv_tier_core::AlignedBuf::zeroed(len);
    fill_block(key, salt, buf.as_mut_slice());
    live.fetch_add(1, Ordering::SeqCst);
    BlockSource::from_owner(Tracked {
        buf,
        live: live.clone(),
    })
}

pub(crate) async fn store_tracked(
    fx: &TierFixture,
    keys: &[BlockKey],
    salt: u64,
    live: &Arc<AtomicUsize>,
) -> JobResult {
    let blocks = keys
        .iter()
        .map(|k| (*k, tracked_source(k, salt, fx.block_size, live)))
        .collect();
    fx.tier
        .store(StoreJob {
            links: Vec::new(),
            requests: Vec::new(),
            blocks,
        })
        .await
}

/// How long the suite waits for something that must happen before it calls a tier hung.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

/// `fut`, or a panic saying `what` hung.
pub(crate) async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    match tokio::time::timeout(PATIENCE, fut).await {
        Ok(v) => v,
        Err(_) => panic!("{what} did not end within {PATIENCE:?}"),
    }
}

/// Waits (bounded) until every tracked source is dropped: buffers a dropped call's I/O still
/// holds are given back when that I/O ends.
pub(crate) async fn wait_released(live: &Arc<AtomicUsize>, what: &str) {
    let done = tokio::time::timeout(PATIENCE, async {
        while live.load(Ordering::SeqCst) > 0 {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    assert!(
        done.is_ok(),
        "{what}: the tier kept {} DRAM buffers for good",
        live.load(Ordering::SeqCst)
    );
}

/// Cancellation safety: a `store`, `load` or `lookup` future dropped at any await point (here
/// after 0 to 15 polls, with the runtime running in between) leaves the tier consistent: no
/// protection and no buffer outlives the call's own work, and the same keys then store, load
/// and look up normally.
pub async fn dropped_calls_leave_no_trace(fx: &TierFixture) {
    let ks = keys(11, 4);
    let live = Arc::new(AtomicUsize::new(0));
    for polls in 0..16 {
        drop_after(polls, store_tracked(fx, &ks, 0, &live)).await;
        drop_after(polls, load(fx, &ks)).await;
        drop_after(polls, fx.tier.lookup(&ks)).await;
    }
    wait_unprotected(fx, &ks).await;
    wait_released(&live, "after dropped stores").await;
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

/// A job naming one key twice (with different bytes) stores it once, whole: one of the two
/// copies, never a mix; the key is not reported both stored and failed. A load job naming a
/// key twice fills every sink it reports loaded.
pub async fn a_job_holding_a_key_twice_stores_one_whole_copy(fx: &TierFixture) {
    let ks = keys(12, 2);
    let bs = fx.block_size;
    let job = StoreJob {
        links: Vec::new(),
        requests: Vec::new(),
        blocks: vec![
            (ks[0], source_for(&ks[0], 1, bs)),
            (ks[1], source_for(&ks[1], 0, bs)),
            (ks[0], source_for(&ks[0], 2, bs)),
        ],
    };
    let res = within("a store with a key twice", fx.tier.store(job)).await;
    assert!(
        res.is_success(),
        "a store naming a key twice failed: {:?}",
        res.failed
    );
    assert_eq!(set(&res.ok), set(&ks), "every key of the job is reported");
    let (res, data) = load(fx, &ks[..1]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let copies = [1u64, 2]
        .iter()
        .filter(|s| verify_block(&ks[0], **s, &data[0].1))
        .count();
    assert_eq!(
        copies, 1,
        "the key's block is not one whole copy of a writer's bytes"
    );
    let salt = if verify_block(&ks[0], 1, &data[0].1) {
        1
    } else {
        2
    };
    let (s1, r1) = sink(bs);
    let (s2, r2) = sink(bs);
    let res = within(
        "a load with a key twice",
        fx.tier.load(LoadJob {
            blocks: vec![(ks[0], s1), (ks[0], s2)],
            ..LoadJob::default()
        }),
    )
    .await;
    assert!(
        !res.ok.is_empty(),
        "a load naming a stored key twice loaded nothing: {:?}",
        res.failed
    );
    let filled = [r1, r2]
        .into_iter()
        .map(|r| {
            r.into_bytes()
                .expect("the tier kept a sink after its load returned")
        })
        .filter(|b| verify_block(&ks[0], salt, b))
        .count();
    assert!(
        filled >= res.ok.len().min(2),
        "{} sinks reported loaded, {filled} hold the block",
        res.ok.len()
    );
}

/// A store gives every DRAM buffer of its job back by the time it returns, and a load every
/// sink: a tier that kept them (a zero-copy `Bytes` held by a cache or a client) would pin
/// DRAM slots under a manager until the pool refuses stores.
pub async fn stores_and_loads_give_their_buffers_back(fx: &TierFixture) {
    let ks = keys(13, 8);
    let live = Arc::new(AtomicUsize::new(0));
    let res = within("a store", store_tracked(fx, &ks, 4, &live)).await;
    assert!(res.is_success(), "store failed: {:?}", res.failed);
    assert_eq!(
        live.load(Ordering::SeqCst),
        0,
        "the store returned and the tier still holds its job's buffers (zero-copy retention)"
    );
    // stores of keys that are present, too
    let res = within("a store", store_tracked(fx, &ks, 4, &live)).await;
    assert!(res.is_success(), "store failed: {:?}", res.failed);
    assert_eq!(
        live.load(Ordering::SeqCst),
        0,
        "a store of present keys kept its job's buffers"
    );
    // load_keys panics if a sink is kept after the load returns
    let (res, data) = load(fx, &ks).await;
    assert!(res.is_success(), "load failed: {:?}", res.failed);
    assert!(data.iter().all(|(k, b)| verify_block(k, 4, b)));
}

/// Shutdown with work in flight: the store, load and lookup running end (each key reported
/// once, loaded bytes whole), shutdown returns, and later calls return too, failing cleanly
/// (per key, or with an error) or succeeding; a second shutdown, `touch`, `protect` and
/// `take_events` never hang or panic, and every buffer comes back.
pub async fn shutdown_ends_work_in_flight_and_later_calls_fail_cleanly(fx: &TierFixture) {
    let stored = keys(14, 16);
    let fresh = keys(14 << 8 | 1, 32);
    let later = keys(14 << 8 | 2, 4);
    assert!(store(fx, &stored, 0).await.is_success());
    let live = Arc::new(AtomicUsize::new(0));
    let blocks: Vec<_> = fresh
        .iter()
        .map(|k| (*k, tracked_source(k, 1, fx.block_size, &live)))
        .collect();
    let t = fx.tier.clone();
    let storing = tokio::spawn(async move {
        t.store(StoreJob {
            links: Vec::new(),
            requests: Vec::new(),
            blocks,
        })
        .await
    });
    let t = fx.tier.clone();
    let bs = fx.block_size;
    let ks = stored.clone();
    let loading = tokio::spawn(async move { crate::util::load_keys(&*t, &ks, bs).await });
    let t = fx.tier.clone();
    let ks = stored.clone();
    let probing = tokio::spawn(async move { t.lookup(&ks).await });
    tokio::task::yield_now().await;
    let _ = within("shutdown with work in flight", fx.tier.shutdown()).await;

    let res = within("a store in flight at shutdown", storing)
        .await
        .expect("the store panicked");
    assert_partition(&res, &fresh);
    let (res, data) = within("a load in flight at shutdown", loading)
        .await
        .expect("the load panicked");
    assert_partition(&res, &stored);
    assert!(
        data.iter().all(|(k, b)| verify_block(k, 0, b)),
        "a load in flight at shutdown returned wrong bytes"
    );
    if let Ok(v) = within("a lookup in flight at shutdown", probing)
        .await
        .expect("the lookup panicked")
    {
        assert_eq!(v.len(), stored.len());
    }

    let res = within("a store after shutdown", store(fx, &later, 0)).await;
    assert_partition(&res, &later);
    let (res, data) = within("a load after shutdown", load(fx, &stored)).await;
    assert_partition(&res, &stored);
    assert!(data.iter().all(|(k, b)| verify_block(k, 0, b)));
    if let Ok(v) = within("a lookup after shutdown", fx.tier.lookup(&stored)).await {
        assert_eq!(v.len(), stored.len());
    }
    fx.tier.touch(&stored);
    drop(fx.tier.protect(&stored));
    let _ = fx.tier.take_events();
    let _ = within("a second shutdown", fx.tier.shutdown()).await;
    wait_released(&live, "after shutdown").await;
}
