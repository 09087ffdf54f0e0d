//! Promised blocks: a promotion lands a step or more after the lookup that asked for it, and
//! DRAM pressure in between would evict it unread (a request under sustained pressure would
//! promote its prefix again and again and never read it). So a promoted block is held (pinned)
//! for every request that was told `HitPending` for it, the one whose lookup reserved the slot
//! and any that asked while the promotion was on its way, until each of them has read it or
//! no longer can:
//! - it answered `Hit` for the key and `prepare_load` took the key in that same step (a `Hit`
//!   the engine did not act on, e.g. when GPU allocation failed, keeps the hold);
//! - its lookup answered `Miss` for the key, or for a key before it in the same
//!   `lookup_many`/`lookup_prefix` call (its prefix stops there);
//! - it finished; or `reset_cache`/`shutdown` released every hold.
//!
//! Holds are bounded by the requests alive: each holds at most what it was told is coming.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::buf::BlockSource;
use crate::key::BlockKey;
use crate::request::RequestId;

#[derive(Default)]
pub(super) struct Holds {
    /// Keys being promoted: the requests told `HitPending` for them.
    waiting: FxHashMap<BlockKey, FxHashSet<RequestId>>,
    /// Landed keys: their pin and the requests that have not read them yet.
    held: FxHashMap<BlockKey, (BlockSource, FxHashSet<RequestId>)>,
    /// Per request, the keys it waits for or holds.
    by_req: FxHashMap<RequestId, FxHashSet<BlockKey>>,
    /// Held keys their request was answered `Hit` for this step.
    hit: Vec<(RequestId, BlockKey)>,
    /// Keys `prepare_load` pinned this step (kept only while `hit` is not empty).
    read: FxHashSet<BlockKey>,
}

impl Holds {
    /// `req` was told `HitPending` for `key`, which a promotion is bringing in.
    pub(super) fn wait(&mut self, req: RequestId, key: BlockKey) {
        self.waiting.entry(key).or_default().insert(req);
        self.by_req.entry(req).or_default().insert(key);
    }

    /// The promotion of `key` landed: held for the requests waiting for it (with `pin`, the
    /// block's readable view), if any are.
    pub(super) fn landed(&mut self, key: BlockKey, pin: Option<BlockSource>) {
        let Some(reqs) = self.waiting.remove(&key) else {
            return;
        };
        match pin {
            Some(pin) if !reqs.is_empty() => {
                self.held.insert(key, (pin, reqs));
            }
            _ => self.forget(key, &reqs),
        }
    }

    /// The promotion of `key` failed or was cancelled: nothing comes to hold.
    pub(super) fn failed(&mut self, key: BlockKey) {
        if let Some(reqs) = self.waiting.remove(&key) {
            self.forget(key, &reqs);
        }
    }

    fn forget(&mut self, key: BlockKey, reqs: &FxHashSet<RequestId>) {
        for r in reqs {
            self.unindex(*r, key);
        }
    }

    /// Removes `key` from `req`'s keys; whether it was there.
    fn unindex(&mut self, req: RequestId, key: BlockKey) -> bool {
        let Some(keys) = self.by_req.get_mut(&req) else {
            return false;
        };
        let had = keys.remove(&key);
        if keys.is_empty() {
            self.by_req.remove(&req);
        }
        had
    }

    /// `req` was answered `Hit` for `key`: its hold ends with the step if `key` is read in it.
    pub(super) fn hit(&mut self, req: RequestId, key: BlockKey) {
        if self.held.get(&key).is_some_and(|(_, r)| r.contains(&req)) {
            self.hit.push((req, key));
        }
    }

    /// `prepare_load` pinned `keys` for reading.
    pub(super) fn read(&mut self, keys: &[BlockKey]) {
        if !self.hit.is_empty() {
            self.read.extend(keys.iter().copied());
        }
    }

    /// The step ended: holds whose request was answered `Hit` and read the key end.
    pub(super) fn end_step(&mut self) {
        for (req, key) in std::mem::take(&mut self.hit) {
            if self.read.contains(&key) {
                self.release(req, key);
            }
        }
        self.read.clear();
    }

    /// `req` no longer waits for or holds `key` (its prefix stopped before it).
    pub(super) fn release(&mut self, req: RequestId, key: BlockKey) {
        if self.unindex(req, key) {
            self.drop_interest(req, key);
        }
    }

    fn drop_interest(&mut self, req: RequestId, key: BlockKey) {
        if let Some(reqs) = self.waiting.get_mut(&key) {
            reqs.remove(&req);
        }
        if let Some((_, reqs)) = self.held.get_mut(&key) {
            reqs.remove(&req);
            if reqs.is_empty() {
                self.held.remove(&key);
            }
        }
    }

    /// `req` finished: it holds nothing and waits for nothing.
    pub(super) fn finish(&mut self, req: RequestId) {
        for key in self.by_req.remove(&req).unwrap_or_default() {
            self.drop_interest(req, key);
        }
    }

    /// Every hold ends (the promotions are all over: `reset_cache`, `shutdown`).
    pub(super) fn clear(&mut self) {
        *self = Self::default();
    }

    /// Blocks held now.
    pub(super) fn held_blocks(&self) -> usize {
        self.held.len()
    }

    /// Requests that wait for or hold a block.
    pub(super) fn requests(&self) -> usize {
        self.by_req.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockKey {
        BlockKey::from_hash32([i; 32], 0)
    }

    fn pin() -> BlockSource {
        BlockSource::from_bytes(vec![0u8; 16])
    }

    #[test]
    fn a_hold_ends_only_when_the_hit_is_read_in_its_step() {
        let mut h = Holds::default();
        let (a, b) = (RequestId(1), RequestId(2));
        h.wait(a, key(1));
        h.wait(b, key(1)); // rides on a's promotion
        h.landed(key(1), Some(pin()));
        assert_eq!((h.held_blocks(), h.requests()), (1, 2));
        // a hit nobody read keeps the hold
        h.hit(a, key(1));
        h.end_step();
        assert_eq!(h.held_blocks(), 1);
        // read by a: a's hold ends, b's stays
        h.hit(a, key(1));
        h.read(&[key(1)]);
        h.end_step();
        assert_eq!((h.held_blocks(), h.requests()), (1, 1));
        // a read without b's hit does not end b's hold
        h.read(&[key(1)]);
        h.end_step();
        assert_eq!(h.held_blocks(), 1);
        h.finish(b);
        assert_eq!((h.held_blocks(), h.requests()), (0, 0));
    }

    #[test]
    fn release_finish_and_failure_leave_nothing() {
        let mut h = Holds::default();
        let a = RequestId(1);
        h.wait(a, key(1));
        h.wait(a, key(2));
        h.wait(a, key(3));
        h.failed(key(3));
        h.landed(key(1), Some(pin()));
        h.landed(key(2), None); // landed but not readable: nothing to hold
        assert_eq!((h.held_blocks(), h.requests()), (1, 1));
        h.release(a, key(1));
        assert_eq!((h.held_blocks(), h.requests()), (0, 0));
        // finished before landing: the landing holds nothing
        h.wait(a, key(4));
        h.finish(a);
        h.landed(key(4), Some(pin()));
        assert_eq!((h.held_blocks(), h.requests()), (0, 0));
        // a landing nobody waits for
        h.landed(key(5), Some(pin()));
        h.hit(a, key(5));
        assert_eq!(h.held_blocks(), 0);
        h.wait(a, key(6));
        h.landed(key(6), Some(pin()));
        h.clear();
        assert_eq!((h.held_blocks(), h.requests()), (0, 0));
    }
}
