//! The conformance suite: what every [`SecondaryTier`] must do, as documented `pub async fn`
//! cases, gated by the tier's declared [`Capability`](kv_tier_core::Capability). Run them all
//! in your crate with [`crate::conformance_tests!`], one `#[tokio::test]` per case, so a
//! failure is named by its case; or run them in one test with [`run_all`].
//!
//! The cases every tier runs ([`cases`]) cover lookups (and answers from memory), round
//! trips, publish-if-absent, concurrent and duplicate stores, protection, events, wrong
//! sizes, cancellation at every await point, shutdown with work in flight, and that a store
//! gives its DRAM buffers back.
//! Cases for a capability ([`gated`]) run when the tier declares it, and need a hook from the
//! fixture (a tier that declares a capability without its hook fails the case, naming it):
//!
//! | capability | hook | cases |
//! |---|---|---|
//! | `bounded` | [`TierFixture::bounded`] | stays within its bound; protected keys survive; eviction follows `touch` |
//! | `persistent` | [`TierFixture::reopen`] | blocks and their recency survive a reopen |
//! | `checksums` | [`TierFixture::damage`] | each kind of [`Damage`] is a miss, never bytes |
//!
//! [`manager`] drives the tier under a [`kv_tier_core::TieringManager`], built from a JSON
//! config by type name when the fixture says how ([`TierFixture::registered`]).
//!
//! [`primary`] holds the cases of the DRAM pool's synchronous contract
//! ([`kv_tier_core::PrimaryTier`]), run with [`crate::primary_conformance_tests!`].
//!
//! ```ignore
//! // tests/conformance.rs of a tier crate (needs tokio with "macros" and "rt-multi-thread")
//! kv_tier_testkit::conformance_tests!(|| async {
//!     kv_tier_testkit::TierFixture::new(std::sync::Arc::new(MyTier::new()), 4096)
//! });
//! ```

use std::any::Any;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use kv_tier_core::registry::TierRegistry;
use kv_tier_core::{BlockKey, SecondaryTier};

pub mod cases;
pub mod gated;
pub mod manager;
pub mod primary;

pub use cases::*;
pub use gated::*;
pub use manager::*;
pub use primary::*;

/// A boxed, sendable future (what fixture hooks return).
pub type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send + 'static>>;

type Hook<T> = Arc<dyn Fn() -> BoxFuture<T> + Send + Sync>;
type DamageHook = Arc<dyn Fn(BlockKey, Damage) -> BoxFuture<bool> + Send + Sync>;

/// How a bounded tier is driven and measured by the `bounded` cases.
#[derive(Clone)]
pub struct Bound {
    /// About how many blocks fit within the bound (what the tier's own overhead per block
    /// allows): the cases store up to three times as many and expect evictions, and protect
    /// or touch up to a quarter of it at a time.
    pub capacity_blocks: usize,
    sweep: Hook<()>,
    settle: Hook<()>,
    usage: Arc<dyn Fn() -> (u64, u64) + Send + Sync>,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound")
            .field("capacity_blocks", &self.capacity_blocks)
            .finish_non_exhaustive()
    }
}

impl Bound {
    /// `capacity_blocks`: about how many blocks fit. `sweep`: evicts now, as the tier's own
    /// background work would, and returns when done. `settle`: applies recency the tier
    /// queued (`touch`) and ends grace windows, so the next sweep may evict any unprotected
    /// key and orders keys by their last store or touch. `usage`: what the tier counts against
    /// its bound, and the bound, in the same unit.
    pub fn new<S, SF, T, TF, U>(capacity_blocks: usize, sweep: S, settle: T, usage: U) -> Self
    where
        S: Fn() -> SF + Send + Sync + 'static,
        SF: Future<Output = ()> + Send + 'static,
        T: Fn() -> TF + Send + Sync + 'static,
        TF: Future<Output = ()> + Send + 'static,
        U: Fn() -> (u64, u64) + Send + Sync + 'static,
    {
        Self {
            capacity_blocks,
            sweep: Arc::new(move || Box::pin(sweep())),
            settle: Arc::new(move || Box::pin(settle())),
            usage: Arc::new(usage),
        }
    }

    /// Runs an eviction pass now.
    pub async fn sweep(&self) {
        (self.sweep)().await
    }

    /// Applies queued recency and ends grace windows.
    pub async fn settle(&self) {
        (self.settle)().await
    }

    /// `(used, bound)`.
    pub fn usage(&self) -> (u64, u64) {
        (self.usage)()
    }
}

/// A kind of damage done to a stored block behind the tier's back, for the `checksums` cases.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Damage {
    /// One byte of the block's data flipped (size unchanged).
    FlipByte,
    /// The block's data cut short.
    Truncate,
    /// The block's data emptied.
    Empty,
    /// The block replaced by another key's stored block, checksum and all.
    ReplacedBy(BlockKey),
    /// The stored checksum changed to a wrong value.
    WrongChecksum,
    /// The stored checksum removed.
    NoChecksum,
}

impl Damage {
    /// Every kind, `ReplacedBy` naming `other`.
    pub fn all(other: BlockKey) -> [Damage; 6] {
        [
            Damage::FlipByte,
            Damage::Truncate,
            Damage::Empty,
            Damage::ReplacedBy(other),
            Damage::WrongChecksum,
            Damage::NoChecksum,
        ]
    }
}

/// Adds a tier's type to a registry.
type RegisterFn = dyn Fn(&mut TierRegistry) -> kv_tier_core::Result<()> + Send + Sync;

/// How to build the tier by type name from a config JSON, for the [`manager`] section.
#[derive(Clone)]
struct Registration {
    register: Arc<RegisterFn>,
    config: serde_json::Value,
}

/// A tier under test, its block size, the hooks its capabilities need, and whatever must live
/// as long as it (a temp dir, a server).
pub struct TierFixture {
    /// The tier.
    pub tier: Arc<dyn SecondaryTier>,
    /// The block size it was built for.
    pub block_size: usize,
    bound: Option<Bound>,
    reopen: Option<Hook<TierFixture>>,
    damage: Option<DamageHook>,
    registration: Option<Registration>,
    keep: Vec<Box<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for TierFixture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierFixture")
            .field("tier", &self.tier)
            .field("block_size", &self.block_size)
            .field("bounded", &self.bound.as_ref().map(|b| b.capacity_blocks))
            .field("reopen", &self.reopen.is_some())
            .field("damage", &self.damage.is_some())
            .field(
                "registration",
                &self.registration.as_ref().map(|r| &r.config),
            )
            .finish()
    }
}

impl TierFixture {
    /// A fixture for `tier` built for blocks of `block_size` bytes.
    pub fn new(tier: Arc<dyn SecondaryTier>, block_size: usize) -> Self {
        Self {
            tier,
            block_size,
            bound: None,
            reopen: None,
            damage: None,
            registration: None,
            keep: Vec::new(),
        }
    }

    /// Keeps `guard` alive as long as the fixture (dropped after the tier's last use).
    pub fn keep<T: Any + Send + Sync>(mut self, guard: T) -> Self {
        self.keep.push(Box::new(guard));
        self
    }

    /// For a tier that declares `bounded`: how the suite drives and measures its bound.
    pub fn bounded(mut self, bound: Bound) -> Self {
        self.bound = Some(bound);
        self
    }

    /// For a tier that declares `persistent`: opens a new instance of the tier on the same
    /// storage (the suite shuts the old one down first; the old fixture outlives the new one,
    /// so what it keeps alive stays).
    pub fn reopen<F, Fut>(mut self, reopen: F) -> Self
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = TierFixture> + Send + 'static,
    {
        self.reopen = Some(Arc::new(move || Box::pin(reopen())));
        self
    }

    /// For a tier that declares `checksums`: does `Damage` to a stored key's block behind the
    /// tier's back; answers `false` when that kind does not apply to the tier's format.
    pub fn damage<F, Fut>(mut self, damage: F) -> Self
    where
        F: Fn(BlockKey, Damage) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = bool> + Send + 'static,
    {
        self.damage = Some(Arc::new(move |k, d| Box::pin(damage(k, d))));
        self
    }

    /// How the tier is built from a config: `register` adds its type to a registry, and
    /// `config` is a whole `KvTierConfig` JSON with the tier as its only `secondary_tiers`
    /// entry (the suite sets `cpu_bytes_to_use` and `block_size_bytes`). The tier built
    /// must use the same storage as [`TierFixture::tier`].
    pub fn registered<R>(mut self, register: R, config: serde_json::Value) -> Self
    where
        R: Fn(&mut TierRegistry) -> kv_tier_core::Result<()> + Send + Sync + 'static,
    {
        self.registration = Some(Registration {
            register: Arc::new(register),
            config,
        });
        self
    }

    /// The bound hooks; panics, naming the case, when a bounded tier's fixture has none.
    fn require_bound(&self, case: &str) -> &Bound {
        self.bound.as_ref().unwrap_or_else(|| {
            panic!(
                "{case}: the tier declares `bounded` but its fixture has no bound hooks (TierFixture::bounded)"
            )
        })
    }

    async fn reopened(&self, case: &str) -> TierFixture {
        let reopen = self.reopen.as_ref().unwrap_or_else(|| {
            panic!(
                "{case}: the tier declares `persistent` but its fixture has no reopen hook (TierFixture::reopen)"
            )
        });
        reopen().await
    }

    async fn do_damage(&self, case: &str, key: BlockKey, d: Damage) -> bool {
        let damage = self.damage.as_ref().unwrap_or_else(|| {
            panic!(
                "{case}: the tier declares `checksums` but its fixture has no damage hook (TierFixture::damage)"
            )
        });
        damage(key, d).await
    }
}

/// Calls `$callback!($($args)*; case, case, ...)` with every case of the suite: the one list
/// [`run_all`] and [`crate::conformance_tests!`] both expand.
/// Every case's rule, in words (the secondary tiers' cases, then the primary tiers'): what a
/// tier that fails the case does wrong. A failing case prints its rule (see [`rule`]) on
/// stderr after the message of the assertion that broke.
const RULES: &[(&str, &str)] = &[
    (
        "lookups_on_empty_tier_miss",
        "a lookup on an empty tier answers false for every key, one answer per key in order, and an empty batch answers empty",
    ),
    (
        "store_then_lookup_hits",
        "a key the tier reported stored is found by lookup, answers in the order of the keys asked",
    ),
    (
        "held_answers_agree_with_lookups",
        "holds() never answers Some(false) for a key reported stored nor Some(true) for one never stored, and agrees with lookup where it answers",
    ),
    (
        "round_trip_preserves_bytes",
        "a store then a load gives back every byte, for batches of 0, 1, 2, 5 and 64 blocks",
    ),
    (
        "load_missing_key_fails_only_that_key",
        "loading a missing key fails that key only; the other keys of the job load whole",
    ),
    (
        "storing_existing_key_is_noop_success",
        "storing a key the tier has succeeds and does not replace the first copy",
    ),
    (
        "concurrent_stores_of_one_key_leave_one_copy",
        "concurrent stores of one key all succeed and leave exactly one whole copy, never a mix of writers",
    ),
    (
        "a_job_holding_a_key_twice_stores_one_whole_copy",
        "a job naming a key twice stores one whole copy and reports the key once; a load naming it twice fills every sink it reports",
    ),
    (
        "touch_and_protect_missing_keys_are_harmless",
        "touch and protect of keys the tier does not have neither fail nor create them",
    ),
    (
        "protect_refcounts_nest",
        "protection is counted: a key stays protected until every guard on it is dropped",
    ),
    (
        "events_for_successful_stores_only",
        "stored events name the keys of successful stores only; loads and failed stores emit none",
    ),
    (
        "wrong_sizes_are_refused_per_key",
        "a block of the wrong size is refused for its key only: never stored, and a load into a wrong-sized sink fails that key only",
    ),
    (
        "stores_and_loads_give_their_buffers_back",
        "a store gives back every DRAM buffer and a load every sink by the time it returns (none is kept alive)",
    ),
    (
        "dropped_calls_leave_no_trace",
        "a store, load or lookup dropped at any await point leaves no protection or buffer behind, and the keys then work normally",
    ),
    (
        "shutdown_ends_work_in_flight_and_later_calls_fail_cleanly",
        "shutdown ends the work in flight (each key reported once) and returns; later calls return, failing cleanly, and nothing hangs",
    ),
    (
        "bounded_tier_stays_within_its_bound",
        "a bounded tier is within its bound after every sweep, reports what it evicted, and what it kept loads whole",
    ),
    (
        "bounded_tier_never_evicts_a_protected_key",
        "a bounded tier never evicts a protected key, however far over its bound; once released it may",
    ),
    (
        "bounded_eviction_follows_touch",
        "a bounded tier evicts by recency: no touched key goes while an untouched older one stays",
    ),
    (
        "persistent_blocks_and_recency_survive_a_reopen",
        "a persistent tier finds and loads whole after a reopen what it stored before, and keeps its recency",
    ),
    (
        "checksums_turn_every_damage_into_a_miss",
        "with checksums, every kind of damage to a block is a failed load of its key, never its bytes; a store heals it",
    ),
    (
        "manager_drives_the_tier_from_its_config",
        "under a manager the tier takes the cascade, is probed and promoted from, serves the same bytes, and holds no state once requests end",
    ),
    (
        "primary_round_trip_and_write_states",
        "a stored block is Hit and reads back whole, a key being written is HitPending, an unknown key Miss, and storing a present key writes nothing",
    ),
    (
        "primary_failed_write_frees_its_slots",
        "a failed write frees its slots: its keys are a Miss and the room is there again",
    ),
    (
        "primary_refuses_cleanly_when_everything_is_pinned",
        "with every slot pinned by a live source, a store is refused with CapacityExhausted and changes nothing; once the sources drop it succeeds",
    ),
    (
        "primary_evicts_only_what_nobody_holds",
        "eviction never takes a pinned block, a block being written or a key of the same batch, and never goes past the capacity",
    ),
    (
        "primary_eviction_follows_touch",
        "a least-recently-used tier keeps the keys touched after others were stored longer than those others",
    ),
    (
        "primary_events_and_reset",
        "removal events come before the stores that caused them, and reset drops every block not pinned and says how many stay",
    ),
];

/// The rule conformance case `case` checks, in words (`None` for no such case).
///
/// ```
/// let r = kv_tier_testkit::conformance::rule("protect_refcounts_nest").unwrap();
/// assert!(r.contains("every guard"));
/// ```
pub fn rule(case: &str) -> Option<&'static str> {
    RULES.iter().find(|(c, _)| *c == case).map(|(_, r)| *r)
}

/// Prints the rule of its case if the case panics, after the panic's message (held for the
/// case's run by the generated tests and [`run_all`]).
#[doc(hidden)]
#[derive(Debug)]
pub struct RuleOnFailure(pub &'static str);

impl Drop for RuleOnFailure {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "conformance case `{}` failed: the rule it checks: {}",
                self.0,
                rule(self.0).unwrap_or("(no rule listed)")
            );
        }
    }
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ($callback:path; $($args:tt)*) => {
        $callback!($($args)*;
            lookups_on_empty_tier_miss,
            store_then_lookup_hits,
            held_answers_agree_with_lookups,
            round_trip_preserves_bytes,
            load_missing_key_fails_only_that_key,
            storing_existing_key_is_noop_success,
            concurrent_stores_of_one_key_leave_one_copy,
            a_job_holding_a_key_twice_stores_one_whole_copy,
            touch_and_protect_missing_keys_are_harmless,
            protect_refcounts_nest,
            events_for_successful_stores_only,
            wrong_sizes_are_refused_per_key,
            stores_and_loads_give_their_buffers_back,
            dropped_calls_leave_no_trace,
            shutdown_ends_work_in_flight_and_later_calls_fail_cleanly,
            bounded_tier_stays_within_its_bound,
            bounded_tier_never_evicts_a_protected_key,
            bounded_eviction_follows_touch,
            persistent_blocks_and_recency_survive_a_reopen,
            checksums_turn_every_damage_into_a_miss,
            manager_drives_the_tier_from_its_config
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_run_each {
    ($make:expr; $($case:ident),* $(,)?) => {
        $({
            let _rule = $crate::conformance::RuleOnFailure(stringify!($case));
            $crate::conformance::$case(&($make)().await).await;
        })*
    };
}

/// Runs every case in order against fixtures from `make` (for tiers that prefer one test).
pub async fn run_all<F, Fut>(make: F)
where
    F: Fn() -> Fut,
    Fut: Future<Output = TierFixture>,
{
    crate::__conformance_cases!(crate::__conformance_run_each; make);
}

/// Expands into one `#[tokio::test]` per conformance case, inside a module `conformance`.
///
/// The argument is an expression callable with no arguments that returns a future of a
/// [`TierFixture`] (a fresh tier per case). The calling crate needs, as dev-dependencies,
/// `kv-tier-testkit` and `tokio` (features `macros`, `rt-multi-thread`); nothing else (the
/// cases reach everything else through this crate). A failing case prints the rule it checks
/// in words ([`rule`]) before its assertion.
#[macro_export]
macro_rules! conformance_tests {
    ($make:expr) => {
        $crate::__conformance_cases!($crate::__conformance_test_fns; $make);
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_test_fns {
    ($make:expr; $($case:ident),* $(,)?) => {
        mod conformance {
            #[allow(unused_imports)]
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let _rule = $crate::conformance::RuleOnFailure(stringify!($case));
                    let fixture: $crate::TierFixture = ($make)().await;
                    $crate::conformance::$case(&fixture).await;
                }
            )*
        }
    };
}

#[cfg(test)]
mod rules {
    macro_rules! case_names {
        (; $($case:ident),* $(,)?) => {
            const CASES: &[&str] = &[$(stringify!($case)),*];
        };
    }
    crate::__conformance_cases!(case_names;);
    mod primary {
        crate::__primary_conformance_cases!(case_names;);
        pub(super) const PRIMARY_CASES: &[&str] = CASES;
    }

    /// Every case run by `conformance_tests!` and `primary_conformance_tests!` has its rule
    /// in words, and every rule a case.
    #[test]
    fn every_case_has_its_rule_in_words() {
        for c in CASES.iter().chain(primary::PRIMARY_CASES) {
            let r = super::rule(c).unwrap_or_else(|| panic!("case {c} has no rule"));
            assert!(r.len() > 20, "{c}: {r:?}");
        }
        assert_eq!(
            super::RULES.len(),
            CASES.len() + primary::PRIMARY_CASES.len(),
            "a rule for no case"
        );
    }

    /// A failing case says its rule in words on stderr, after the message of the assertion
    /// that broke (run in a child of this test binary, where the case fails on purpose).
    #[test]
    fn a_failing_case_prints_its_rule() {
        const CHILD: &str = "KV_TIER_TESTKIT_FAILING_CASE";
        if std::env::var_os(CHILD).is_some() {
            let _rule = super::RuleOnFailure("primary_eviction_follows_touch");
            panic!("the case's assertion broke");
        }
        let out = crate::fixtures::process::run_with_deadline(
            std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "conformance::rules::a_failing_case_prints_its_rule",
                    "--exact",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(CHILD, "1"),
            std::time::Duration::from_secs(60),
        );
        assert!(!out.success(), "the failing case passed: {}", out.all());
        let said = format!(
            "conformance case `primary_eviction_follows_touch` failed: the rule it checks: {}",
            super::rule("primary_eviction_follows_touch").unwrap()
        );
        let (Some(assertion), Some(rule)) = (
            out.stderr.find("the case's assertion broke"),
            out.stderr.find(&said),
        ) else {
            panic!("want the assertion, then {said:?}: {}", out.all());
        };
        assert!(assertion < rule, "{}", out.all());
    }
}
