//! Admission: which blocks are written where. vLLM's `store_threshold` for DRAM (a block is
//! stored only once lookups asked for it that many times), and per tier
//! `admit_after_lookups` (the same rule for one tier, to spare an SSD the writes of blocks
//! nobody asks for again) and `write_budget_mb_per_s` (a token bucket of bytes per second;
//! what it cannot take is dropped, counted).

use std::collections::VecDeque;
use std::time::Instant;

use rustc_hash::FxHashMap;

use crate::key::BlockKey;
use crate::request::RequestId;
use crate::tier_options::TierSettings;

/// How many distinct requests asked for each of the last `max` keys asked for (least
/// recently asked forgotten first), vLLM's `max_tracker_size`. A request asking again (polling
/// while it waits, however the asks of others interleave) does not count again. Counts stop
/// at `cap`, the highest threshold any rule uses: past it the answer no longer changes.
#[derive(Debug)]
pub(super) struct LookupCounts {
    /// key -> (the distinct requests that asked, up to `cap`; sequence of the last ask)
    map: FxHashMap<BlockKey, (Vec<RequestId>, u64)>,
    cap: usize,
    order: VecDeque<(BlockKey, u64)>,
    next: u64,
    max: usize,
}

impl LookupCounts {
    pub(super) fn new(max: u64, cap: u64) -> Self {
        Self {
            map: FxHashMap::default(),
            cap: usize::try_from(cap).unwrap_or(usize::MAX).max(1),
            order: VecDeque::new(),
            next: 0,
            max: usize::try_from(max).unwrap_or(usize::MAX).max(1),
        }
    }

    pub(super) fn bump(&mut self, key: BlockKey, req: RequestId) {
        let seq = self.next;
        self.next += 1;
        let e = self.map.entry(key).or_insert((Vec::new(), seq));
        if e.0.len() < self.cap && !e.0.contains(&req) {
            e.0.push(req);
        }
        e.1 = seq;
        self.order.push_back((key, seq));
        while self.map.len() > self.max {
            let Some((k, s)) = self.order.pop_front() else {
                break;
            };
            if self.map.get(&k).is_some_and(|e| e.1 == s) {
                self.map.remove(&k);
            }
        }
        // stale entries (keys asked for again later) are skipped above; keep them bounded
        if self.order.len() > 2 * self.max + 64 {
            let map = &self.map;
            self.order
                .retain(|(k, s)| map.get(k).is_some_and(|e| e.1 == *s));
        }
    }

    pub(super) fn count(&self, key: &BlockKey) -> u64 {
        self.map.get(key).map_or(0, |e| e.0.len() as u64)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.map.len()
    }
}

/// A token bucket of bytes: `rate` per second, holding at most `cap`.
#[derive(Debug)]
struct Bucket {
    rate: f64,
    cap: f64,
    level: f64,
    at: Instant,
}

impl Bucket {
    fn new(rate: u64, block_bytes: u64) -> Self {
        let cap = rate.max(block_bytes) as f64;
        Self {
            rate: rate as f64,
            cap,
            level: cap,
            at: Instant::now(),
        }
    }

    fn take(&mut self, bytes: u64, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.level = (self.level + dt * self.rate).min(self.cap);
        if self.level >= bytes as f64 {
            self.level -= bytes as f64;
            true
        } else {
            false
        }
    }
}

/// The admission state of a manager.
#[derive(Debug)]
pub(super) struct Admission {
    counts: Option<LookupCounts>,
    store_threshold: u64,
    tiers: Vec<(u64, Option<Bucket>)>,
}

/// What admission let through to one tier, and what it kept out.
#[derive(Debug)]
pub(super) struct Admitted<T> {
    pub(super) blocks: Vec<(BlockKey, T)>,
    /// Keys not looked up `admit_after_lookups` times.
    pub(super) not_admitted: Vec<BlockKey>,
    /// Keys past the tier's write budget.
    pub(super) over_budget: Vec<BlockKey>,
}

impl Admission {
    pub(super) fn new(
        store_threshold: u64,
        max_tracker_size: u64,
        tiers: &[TierSettings],
        block_bytes: u64,
    ) -> Self {
        let counting = store_threshold >= 2 || tiers.iter().any(|t| t.admit_after_lookups > 0);
        let cap = tiers
            .iter()
            .map(|t| t.admit_after_lookups)
            .fold(store_threshold, u64::max);
        Self {
            counts: counting.then(|| LookupCounts::new(max_tracker_size, cap)),
            store_threshold,
            tiers: tiers
                .iter()
                .map(|t| {
                    (
                        t.admit_after_lookups,
                        t.write_budget_bytes_per_s
                            .map(|r| Bucket::new(r, block_bytes)),
                    )
                })
                .collect(),
        }
    }

    /// Request `req` asked for `key`.
    pub(super) fn asked(&mut self, key: &BlockKey, req: RequestId) {
        if let Some(c) = &mut self.counts {
            c.bump(*key, req);
        }
    }

    /// Gives tier `i`'s write budget back the bytes of `n` blocks it was charged for and did
    /// not write (dropped or already queued past the budget).
    pub(super) fn refund(&mut self, i: usize, n: u64, block_bytes: u64) {
        if let Some(b) = &mut self.tiers[i].1 {
            b.level = (b.level + (n * block_bytes) as f64).min(b.cap);
        }
    }

    fn count(&self, key: &BlockKey) -> u64 {
        self.counts.as_ref().map_or(0, |c| c.count(key))
    }

    /// Whether DRAM takes `key` (vLLM's `store_threshold`: below 2, every key).
    pub(super) fn dram_admits(&self, key: &BlockKey) -> bool {
        self.store_threshold < 2 || self.count(key) >= self.store_threshold
    }

    /// The blocks tier `i` takes of `blocks` (each `block_bytes`), in order.
    pub(super) fn for_tier<T>(
        &mut self,
        i: usize,
        blocks: Vec<(BlockKey, T)>,
        block_bytes: u64,
    ) -> Admitted<T> {
        let (after, _) = self.tiers[i];
        let mut out = Admitted {
            blocks: Vec::with_capacity(blocks.len()),
            not_admitted: Vec::new(),
            over_budget: Vec::new(),
        };
        let now = Instant::now();
        for (k, b) in blocks {
            if after > 0 && self.count(&k) < after {
                out.not_admitted.push(k);
                continue;
            }
            if let Some(bucket) = &mut self.tiers[i].1
                && !bucket.take(block_bytes, now)
            {
                out.over_budget.push(k);
                continue;
            }
            out.blocks.push((k, b));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn k(i: u8) -> BlockKey {
        BlockKey::from_hash32([i; 32], 0)
    }

    #[test]
    fn counts_remember_the_most_recently_asked_keys_only() {
        let r = RequestId;
        let mut c = LookupCounts::new(2, 100);
        c.bump(k(1), r(1));
        c.bump(k(1), r(1)); // the same request polling: counted once
        c.bump(k(1), r(2));
        c.bump(k(2), r(1));
        assert_eq!((c.count(&k(1)), c.count(&k(2))), (2, 1));
        c.bump(k(1), r(3)); // k(2) is now the least recently asked
        c.bump(k(3), r(1));
        assert_eq!((c.count(&k(1)), c.count(&k(2)), c.count(&k(3))), (3, 0, 1));
        assert_eq!(c.len(), 2);
        // two requests taking turns, polling: still two (with the earlier three: 5)
        for i in 0..10_000 {
            c.bump(k(1), r(10 + i % 2));
        }
        assert!(c.order.len() <= 2 * 2 + 64, "stale entries stay bounded");
        assert_eq!(c.count(&k(1)), 5);
        // counts stop at the cap
        let mut capped = LookupCounts::new(10, 3);
        for i in 0..10 {
            capped.bump(k(9), r(i));
        }
        assert_eq!(capped.count(&k(9)), 3);
    }

    #[test]
    fn a_bucket_refills_at_its_rate_and_holds_at_most_a_second_of_it() {
        let mut b = Bucket::new(1000, 100);
        let t0 = b.at;
        assert!(b.take(1000, t0));
        assert!(!b.take(1, t0));
        assert!(b.take(500, t0 + Duration::from_millis(500)));
        assert!(!b.take(100, t0 + Duration::from_millis(500)));
        // an idle hour refills one second's worth, no more
        let later = t0 + Duration::from_secs(3600);
        assert!(b.take(1000, later));
        assert!(!b.take(1, later));
        // a rate below one block still lets a block through, at that rate
        let mut slow = Bucket::new(10, 100);
        let t0 = slow.at;
        assert!(slow.take(100, t0));
        assert!(!slow.take(100, t0 + Duration::from_secs(5)));
        assert!(slow.take(100, t0 + Duration::from_secs(10)));
    }
}
