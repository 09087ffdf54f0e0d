//! A repeated event said once per interval, with how many there were: so a log line and the
//! counter beside it tell the same story without a line per event.

use std::sync::Mutex;
use std::time::Duration;

// tokio's clock: the wall clock, or a test's paused one
use tokio::time::Instant;

/// How often a repeated WARN is said at most (with the count since the last one), in the
/// manager and the tiers.
pub const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// Lets one in every `interval` of a repeated event through, with the count since the last
/// one it let through (itself included). The first event always passes.
///
/// ```
/// use std::time::Duration;
/// use kv_tier_core::stats::Throttle;
///
/// let t = Throttle::new(Duration::from_secs(3600));
/// assert_eq!(t.note(), Some(1)); // the first: say it
/// assert_eq!(t.note(), None); // within the hour: counted, not said
/// assert_eq!(t.note(), None);
/// ```
#[derive(Debug)]
pub struct Throttle {
    interval: Duration,
    /// When it last let one through, and the events since.
    state: Mutex<(Option<Instant>, u64)>,
}

impl Throttle {
    /// A throttle letting one event through per `interval`.
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            state: Mutex::new((None, 0)),
        }
    }

    /// An event now: `Some(n)` when it is to be said, `n` the events since the last one said
    /// (this one included); `None` when it is only counted.
    pub fn note(&self) -> Option<u64> {
        self.note_at(Instant::now())
    }

    fn note_at(&self, now: Instant) -> Option<u64> {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.1 += 1;
        match s.0 {
            Some(last) if now.saturating_duration_since(last) < self.interval => None,
            _ => {
                s.0 = Some(now);
                Some(std::mem::take(&mut s.1))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_event_per_interval_is_said_with_the_count_since_the_last() {
        let t = Throttle::new(Duration::from_secs(10));
        let t0 = Instant::now();
        assert_eq!(t.note_at(t0), Some(1));
        assert_eq!(t.note_at(t0 + Duration::from_secs(3)), None);
        assert_eq!(t.note_at(t0 + Duration::from_secs(9)), None);
        // the third since the last said, and the interval has passed
        assert_eq!(t.note_at(t0 + Duration::from_secs(10)), Some(3));
        assert_eq!(t.note_at(t0 + Duration::from_secs(11)), None);
        assert_eq!(t.note_at(t0 + Duration::from_secs(25)), Some(2));
        // a clock read out of order (two threads) is within the interval, not a panic
        assert_eq!(t.note_at(t0), None);
    }
}
