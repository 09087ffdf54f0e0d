//! Waits on conditions, with deadlines: what a test does instead of sleeping and hoping.
//!
//! A test that needs something to have happened (a background sweep ran, a probe answered, a
//! thread let go of a buffer) waits for exactly that, polled, and fails naming it when the
//! deadline passes. The deadlines are generous ([`SETTLE_LIMIT`]): they bound a failure so it
//! does not hang the suite; they are not timing assertions, and a loaded 2-core machine that
//! takes ten times longer than usual still passes.
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until};
//!
//! let n = AtomicUsize::new(0);
//! wait_until("three polls", SETTLE_LIMIT, || n.fetch_add(1, Ordering::SeqCst) >= 2);
//! assert_eq!(n.load(Ordering::SeqCst), 3);
//! ```

use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, LookupResult, RequestContext, TieringManager};

/// How long a test waits for something the code must reach by itself (a verdict to settle, a
/// background thread to finish, a lease to be given back) before it fails: 30 s, far above
/// what any of it takes on a loaded machine.
pub const SETTLE_LIMIT: Duration = Duration::from_secs(30);

/// The pause between two looks at a polled condition.
pub const POLL_EVERY: Duration = Duration::from_millis(5);

/// Polls `cond` (every [`POLL_EVERY`]) until it holds; returns whether it did within `limit`.
/// For a test that reports more than `what` when it fails; [`wait_until`] otherwise.
pub fn poll_until(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if t0.elapsed() > limit {
            return false;
        }
        std::thread::sleep(POLL_EVERY);
    }
}

/// Polls `cond` until it holds; panics naming `what` if it has not within `limit`.
pub fn wait_until(what: &str, limit: Duration, cond: impl FnMut() -> bool) {
    assert!(poll_until(limit, cond), "{what}: not within {limit:?}");
}

/// [`poll_until`] for async tests: polls `cond` every [`POLL_EVERY`] without holding a
/// runtime worker between looks.
pub async fn poll_until_async(limit: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let t0 = Instant::now();
    loop {
        if cond() {
            return true;
        }
        if t0.elapsed() > limit {
            return false;
        }
        tokio::time::sleep(POLL_EVERY).await;
    }
}

/// [`wait_until`] for async tests.
pub async fn wait_until_async(what: &str, limit: Duration, cond: impl FnMut() -> bool) {
    assert!(
        poll_until_async(limit, cond).await,
        "{what}: not within {limit:?}"
    );
}

/// Plays scheduler steps (`on_schedule_end`, then a pause of [`POLL_EVERY`]) until `cond`
/// holds, which it is asked before each step; panics naming `what` after `limit`. The loop an
/// engine's scheduler runs while it waits for background work to land.
pub fn step_until(
    m: &TieringManager,
    what: &str,
    limit: Duration,
    mut cond: impl FnMut(&TieringManager) -> bool,
) {
    let t0 = Instant::now();
    while !cond(m) {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        m.on_schedule_end();
        std::thread::sleep(POLL_EVERY);
    }
}

/// Steps `req`'s lookups of `key` (a lookup, then `on_schedule_end`, until the verdict is
/// `Hit` or `Miss`); returns that verdict and every verdict seen on the way. Panics if it has
/// not settled within `limit`, showing the verdicts seen.
pub fn settle_lookup(
    m: &TieringManager,
    key: &BlockKey,
    req: &RequestContext,
    limit: Duration,
) -> (LookupResult, Vec<LookupResult>) {
    let t0 = Instant::now();
    let mut seen = Vec::new();
    loop {
        let v = m.lookup(key, req);
        seen.push(v);
        if matches!(v, LookupResult::Hit | LookupResult::Miss) {
            return (v, seen);
        }
        assert!(
            t0.elapsed() < limit,
            "{key} stuck out of Hit/Miss for {limit:?}: {:?}",
            &seen[seen.len().saturating_sub(8)..]
        );
        m.on_schedule_end();
        std::thread::sleep(POLL_EVERY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poll_until_reports_a_condition_that_never_holds() {
        assert!(!poll_until(Duration::from_millis(20), || false));
        assert!(poll_until(Duration::ZERO, || true));
    }

    #[test]
    #[should_panic(expected = "the thing: not within")]
    fn wait_until_names_what_it_waited_for() {
        wait_until("the thing", Duration::from_millis(10), || false);
    }

    #[tokio::test]
    async fn the_async_wait_sees_a_condition_set_by_another_task() {
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = flag.clone();
        tokio::spawn(async move { f.store(true, std::sync::atomic::Ordering::SeqCst) });
        wait_until_async("the flag", SETTLE_LIMIT, || {
            flag.load(std::sync::atomic::Ordering::SeqCst)
        })
        .await;
    }
}
