//! The existence cache: which keys lookups may answer "present" without a request, and the
//! one rule for what may fill it.
//!
//! Every answer that tells presence comes through [`Presence`], in order:
//! - [`Presence::present`]: a request found the object or wrote it (a lookup's HEAD, a
//!   store's HEAD or PUT, a load's GET, a LIST). Cached only if the key was not seen gone
//!   since the request was sent (its [`Stamp`]): a request that a removal or a 404
//!   overlapped may have seen (or written) the object before it went, and its "present"
//!   would hide the removal. Its answer says whether it was cached: a store whose
//!   confirmation is refused writes the block instead.
//! - [`Presence::gone`]: this tier deletes the key (when the delete starts and when it ends),
//!   or a request found it missing. Forgets the cached answer, and refuses the "present" of
//!   every read of the key sent before.
//!
//! The keys seen gone are remembered with the order of the requests, at most
//! [`MAX_GONE`] of them: past that the memory is cleared and every read sent before is
//! refused, which costs a HEAD later, never a wrong answer.

use kv_tier_core::BlockKey;
use rustc_hash::FxHashMap;

/// The removals' lock: every critical section leaves them consistent before anything can
/// panic, so a poisoned lock is still usable.
fn lock(m: &std::sync::Mutex<Seen>) -> std::sync::MutexGuard<'_, Seen> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The most keys seen gone that are remembered one by one (about 3 MB of them).
pub(crate) const MAX_GONE: usize = 1 << 16;

/// When a read was sent, in the order of the removals [`Presence`] has seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) struct Stamp(u64);

/// The existence cache and the removals it has seen (see the module docs).
pub(crate) struct Presence {
    cache: moka::sync::Cache<BlockKey, ()>,
    seen: std::sync::Mutex<Seen>,
}

/// The removals seen: the count of them so far, the one each remembered key went at, and
/// the count below which every read is refused (the memory was cleared then).
#[derive(Default)]
struct Seen {
    removals: u64,
    floor: u64,
    gone_at: FxHashMap<BlockKey, u64>,
}

impl Seen {
    fn allows(&self, key: &BlockKey, sent: Stamp) -> bool {
        sent.0 >= self.floor && self.gone_at.get(key).is_none_or(|&at| at <= sent.0)
    }
}

impl Presence {
    /// A cache of at most `capacity` keys, each answered for `ttl` after it was cached.
    pub(crate) fn new(capacity: u64, ttl: std::time::Duration) -> Self {
        Self {
            cache: moka::sync::Cache::builder()
                .max_capacity(capacity)
                .time_to_live(ttl)
                .build(),
            seen: Default::default(),
        }
    }

    /// Whether a lookup may answer "present" without a request.
    pub(crate) fn holds(&self, key: &BlockKey) -> bool {
        self.cache.contains_key(key)
    }

    /// Taken before a read is sent: see [`Presence::present`].
    pub(crate) fn stamp(&self) -> Stamp {
        Stamp(lock(&self.seen).removals)
    }

    /// A request sent at `sent` found `key` (or wrote it): cached unless the key was seen
    /// gone since; whether it was.
    pub(crate) fn present(&self, key: &BlockKey, sent: Stamp) -> bool {
        self.admit(&lock(&self.seen), key, sent)
    }

    /// [`Presence::present`] for many keys found by one read (a LIST), under one lock.
    pub(crate) fn present_all<'a>(
        &self,
        keys: impl IntoIterator<Item = &'a BlockKey>,
        sent: Stamp,
    ) {
        let seen = lock(&self.seen);
        for k in keys {
            self.admit(&seen, k, sent);
        }
    }

    /// Caches `key` unless `seen` refuses a request sent at `sent`; whether it did.
    fn admit(&self, seen: &Seen, key: &BlockKey, sent: Stamp) -> bool {
        let allowed = seen.allows(key, sent);
        if allowed {
            self.cache.insert(*key, ());
        }
        allowed
    }

    /// `keys` are gone, or going (see the module docs).
    pub(crate) fn gone<'a>(&self, keys: impl IntoIterator<Item = &'a BlockKey>) {
        let mut seen = lock(&self.seen);
        seen.removals += 1;
        let at = seen.removals;
        for k in keys {
            self.cache.invalidate(k);
            seen.gone_at.insert(*k, at);
        }
        if seen.gone_at.len() > MAX_GONE {
            seen.gone_at.clear();
            seen.floor = at;
        }
    }

    /// Forgets every answer, and refuses the "present" of every read sent before.
    pub(crate) fn clear(&self) {
        let mut seen = lock(&self.seen);
        seen.removals += 1;
        seen.floor = seen.removals;
        seen.gone_at.clear();
        self.cache.invalidate_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn key(i: u32) -> BlockKey {
        let mut h = [0u8; 32];
        h[..4].copy_from_slice(&i.to_le_bytes());
        BlockKey::from_hash32(h, 0)
    }

    fn presence() -> Presence {
        Presence::new(1 << 10, Duration::from_secs(600))
    }

    #[test]
    fn a_read_sent_before_its_key_went_is_not_cached_one_sent_after_is() {
        let p = presence();
        let (a, b) = (key(1), key(2));
        let before = p.stamp();
        p.gone([&a]);
        p.present(&a, before);
        assert!(!p.holds(&a), "a read older than the removal was cached");
        p.present(&b, before);
        assert!(p.holds(&b), "another key's removal refused this one");
        let after = p.stamp();
        p.present(&a, after);
        assert!(p.holds(&a));
    }

    #[test]
    fn a_request_sent_after_a_removal_is_cached_and_a_later_removal_forgets_it() {
        let p = presence();
        let a = key(1);
        p.gone([&a]);
        assert!(p.present(&a, p.stamp()));
        assert!(p.holds(&a));
        p.gone([&a]);
        assert!(!p.holds(&a));
    }

    #[test]
    fn past_the_memory_of_removals_every_older_read_is_refused() {
        let p = presence();
        let before = p.stamp();
        let keys: Vec<_> = (0..=MAX_GONE as u32).map(key).collect();
        for k in &keys {
            p.gone([k]);
        }
        let other = key(u32::MAX);
        p.present(&other, before);
        assert!(
            !p.holds(&other),
            "a read older than a forgotten removal was cached"
        );
        p.present(&other, p.stamp());
        assert!(p.holds(&other));
        assert!(lock(&p.seen).gone_at.len() <= MAX_GONE);
    }

    #[test]
    fn a_clear_refuses_every_read_sent_before_it() {
        let p = presence();
        let a = key(1);
        p.present(&a, p.stamp());
        let before = p.stamp();
        p.clear();
        assert!(!p.holds(&a));
        p.present_all([&a], before);
        assert!(!p.holds(&a));
        p.present_all([&a], p.stamp());
        assert!(p.holds(&a));
    }
}
