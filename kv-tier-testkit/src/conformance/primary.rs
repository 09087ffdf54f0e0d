//! What every [`PrimaryTier`] (the DRAM pool) must do: the synchronous contract the manager
//! relies on. Run with [`crate::primary_conformance_tests!`].
//!
//! ```ignore
//! kv_tier_testkit::primary_conformance_tests!(|| kv_tier_testkit::conformance::PrimaryFixture {
//!     tier: std::sync::Arc::new(MyPool::new(16, 4096)),
//!     capacity_blocks: 16,
//!     lru: true,
//! });
//! ```

use std::sync::Arc;

use kv_tier_core::{BlockKey, Error, LookupResult, PrimaryTier};

use crate::util::{fill_block, test_key_in_group, verify_block};

/// A primary tier under test.
#[derive(Debug, Clone)]
pub struct PrimaryFixture {
    /// The tier, empty.
    pub tier: Arc<dyn PrimaryTier>,
    /// How many blocks it holds.
    pub capacity_blocks: usize,
    /// Whether it evicts least recently used first (then the `touch` order case runs).
    pub lru: bool,
}

fn keys(case: u32, n: usize) -> Vec<BlockKey> {
    (0..n as u64).map(|i| test_key_in_group(i, case)).collect()
}

/// Prepares, fills and completes `keys` (salt 0); returns the keys evicted to make room.
fn store(t: &dyn PrimaryTier, keys: &[BlockKey]) -> kv_tier_core::Result<Vec<BlockKey>> {
    let mut p = t.prepare_store(keys)?;
    for (k, sink) in &mut p.to_store {
        fill_block(k, 0, sink.as_mut_slice());
    }
    let evicted = std::mem::take(&mut p.evicted);
    drop(p);
    t.complete_store(keys, true);
    Ok(evicted)
}

/// Stored blocks are `Hit` and read back whole; a key being written is `HitPending`; unknown
/// keys `Miss`; storing present keys writes nothing.
pub fn primary_round_trip_and_write_states(fx: &PrimaryFixture) {
    let t = &*fx.tier;
    let ks = keys(1, 3);
    assert_eq!(t.lookup(&ks[0]), LookupResult::Miss);
    let mut p = t.prepare_store(&ks).expect("room for 3 blocks");
    assert_eq!(p.to_store.len(), 3);
    assert_eq!(t.lookup(&ks[0]), LookupResult::HitPending);
    for (k, sink) in &mut p.to_store {
        assert_eq!(sink.len(), t.block_size());
        fill_block(k, 0, sink.as_mut_slice());
    }
    drop(p);
    let changed = t.complete_store(&ks, true);
    assert_eq!(changed.len(), 3, "every written key became readable");
    for (k, s) in ks.iter().zip(t.sources(&ks)) {
        assert_eq!(t.lookup(k), LookupResult::Hit);
        let s = s.expect("a Hit has a source");
        assert!(verify_block(k, 0, s.as_slice()), "{k} read back changed");
    }
    let again = t.prepare_store(&ks).expect("present keys need no room");
    assert!(again.to_store.is_empty(), "present keys were written again");
    assert_eq!(again.present.len(), 3);
}

/// A failed write frees its slots: the keys are a `Miss` and the room is there again.
pub fn primary_failed_write_frees_its_slots(fx: &PrimaryFixture) {
    let t = &*fx.tier;
    let ks = keys(2, fx.capacity_blocks);
    let p = t.prepare_store(&ks).expect("room for a full pool");
    drop(p);
    t.complete_store(&ks, false);
    assert!(ks.iter().all(|k| t.lookup(k) == LookupResult::Miss));
    assert_eq!(t.stats().writing_blocks, 0);
    assert!(
        store(t, &keys(3, fx.capacity_blocks)).is_ok(),
        "the slots were not freed"
    );
}

/// With every slot pinned by a live source, a store is refused with `CapacityExhausted`
/// and changes nothing; once the sources drop, it succeeds.
pub fn primary_refuses_cleanly_when_everything_is_pinned(fx: &PrimaryFixture) {
    let t = &*fx.tier;
    let ks = keys(4, fx.capacity_blocks);
    store(t, &ks).expect("a full pool");
    let pins = t.sources(&ks);
    let before = t.stats();
    let err = t
        .prepare_store(&keys(5, 1))
        .expect_err("no room while all is pinned");
    assert!(matches!(err, Error::CapacityExhausted { .. }), "{err}");
    let after = t.stats();
    assert_eq!(
        (after.ready_blocks, after.writing_blocks, after.evictions),
        (before.ready_blocks, before.writing_blocks, before.evictions),
        "a refused store changed the pool"
    );
    assert!(ks.iter().all(|k| t.lookup(k) == LookupResult::Hit));
    drop(pins);
    assert!(store(t, &keys(5, 1)).is_ok());
}

/// Eviction never takes a pinned block, a block being written, or a key of the same batch,
/// and never goes past the capacity.
pub fn primary_evicts_only_what_nobody_holds(fx: &PrimaryFixture) {
    let t = &*fx.tier;
    let n = fx.capacity_blocks;
    let held = keys(6, n / 4);
    store(t, &held).expect("room");
    let pins = t.sources(&held);
    let writing = keys(7, n / 4);
    let open = t.prepare_store(&writing).expect("room");
    for round in 0..4u32 {
        let batch = keys(8 + round, n / 2);
        let evicted = store(t, &batch).expect("room among unpinned blocks");
        for k in &evicted {
            assert!(!held.contains(k), "a pinned block was evicted");
            assert!(!writing.contains(k), "a block being written was evicted");
            assert!(!batch.contains(k), "a key of the same batch was evicted");
        }
        let s = t.stats();
        assert!(s.ready_blocks + s.writing_blocks <= s.capacity_blocks);
        assert!(batch.iter().all(|k| t.lookup(k) == LookupResult::Hit));
    }
    assert!(held.iter().all(|k| t.lookup(k) == LookupResult::Hit));
    assert!(
        writing
            .iter()
            .all(|k| t.lookup(k) == LookupResult::HitPending)
    );
    drop(open);
    t.complete_store(&writing, true);
    drop(pins);
}

/// Least-recently-used tiers: keys touched after others were stored outlive them.
pub fn primary_eviction_follows_touch(fx: &PrimaryFixture) {
    if !fx.lru {
        return;
    }
    let t = &*fx.tier;
    let n = fx.capacity_blocks;
    let (a, b) = (keys(20, n / 2), keys(21, n / 2));
    store(t, &a).expect("room");
    store(t, &b).expect("room");
    t.touch(&a);
    let evicted = store(t, &keys(22, n / 2)).expect("room");
    assert!(!evicted.is_empty());
    assert!(
        evicted.iter().all(|k| b.contains(k)),
        "a touched key was evicted before the untouched older ones"
    );
}

/// Events: removals come before the stores that caused them; `reset` drops every block not
/// pinned and says how many stay.
pub fn primary_events_and_reset(fx: &PrimaryFixture) {
    let t = &*fx.tier;
    let n = fx.capacity_blocks;
    let _ = t.take_events();
    let first = keys(30, n);
    store(t, &first).expect("room");
    let second = keys(31, 1);
    store(t, &second).expect("room");
    let events = t.take_events();
    let removed_at = events.iter().position(|e| e.removed);
    let stored_second = events
        .iter()
        .position(|e| !e.removed && e.keys.contains(&second[0]));
    assert!(
        removed_at.is_some() && stored_second.is_some() && removed_at < stored_second,
        "the eviction is not reported before the store that caused it: {events:?}"
    );
    let pin = t.sources(&second);
    assert_eq!(t.reset(), 1, "reset reports the pinned block that stays");
    assert_eq!(t.lookup(&second[0]), LookupResult::Hit);
    drop(pin);
    assert_eq!(t.reset(), 0);
    assert_eq!(t.lookup(&second[0]), LookupResult::Miss);
}

/// Calls `$callback!($($args)*; case, ...)` with every primary-tier case.
#[doc(hidden)]
#[macro_export]
macro_rules! __primary_conformance_cases {
    ($callback:path; $($args:tt)*) => {
        $callback!($($args)*;
            primary_round_trip_and_write_states,
            primary_failed_write_frees_its_slots,
            primary_refuses_cleanly_when_everything_is_pinned,
            primary_evicts_only_what_nobody_holds,
            primary_eviction_follows_touch,
            primary_events_and_reset
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __primary_conformance_test_fns {
    ($make:expr; $($case:ident),* $(,)?) => {
        mod primary_conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[test]
                fn $case() {
                    let _rule = $crate::conformance::RuleOnFailure(stringify!($case));
                    let fixture: $crate::conformance::PrimaryFixture = ($make)();
                    $crate::conformance::$case(&fixture);
                }
            )*
        }
    };
}

/// Expands into one `#[test]` per primary-tier case, inside a module `primary_conformance`.
/// The argument is callable with no arguments and returns a fresh, empty
/// [`PrimaryFixture`] (at least 8 blocks).
#[macro_export]
macro_rules! primary_conformance_tests {
    ($make:expr) => {
        $crate::__primary_conformance_cases!($crate::__primary_conformance_test_fns; $make);
    };
}
