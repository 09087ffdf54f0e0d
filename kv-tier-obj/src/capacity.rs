//! The bounded mode's capacity index: size and last use of every object, kept in
//! least-recently-used order so a sweep finds its victims without sorting the index.

use std::sync::Mutex;

use std::ops::Bound;

use kv_tier_core::lru::{LruEntry, LruIndex, Rank};
use kv_tier_core::{BlockKey, EventLog, ProtectionSet};
use rustc_hash::FxHashMap;
use tokio::sync::Notify;

/// One indexed object: its size, its tick (larger: more recently used), the tick it was
/// last indexed at (stored, confirmed, listed, or counted before a write: what a request
/// that found it missing compares; a touch does not change it), and whether it is in doubt
/// (counted, but not known held).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Entry {
    pub(crate) size: u64,
    pub(crate) at: u64,
    pub(crate) stored: u64,
    pub(crate) doubt: Doubt,
}

/// Whether an indexed object is known to be there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Doubt {
    /// Stored, confirmed or listed, and not found missing since.
    Known,
    /// A write of it under way, or one that timed out or was dropped: it may still land, so
    /// a request that finds it missing does not take it out (a sweep, or a store, does; a
    /// write landing after a sweep's DELETE is then not counted until the next open).
    Unended,
    /// It may be there or not (a DELETE that may have run, a write that failed in a way
    /// that may have followed its landing, a write whose "present" a later 404
    /// contradicts): a request that finds it missing takes it out.
    Unknown,
}

impl LruEntry for Entry {
    type At = u64;
    fn size(&self) -> u64 {
        self.size
    }
    fn at(&self) -> u64 {
        self.at
    }
}

/// A sweep's victim: its key, its entry and its link (parent, depth), to put it back as it
/// was if its DELETE is not confirmed.
pub(crate) type Victim = (BlockKey, Entry, Option<(BlockKey, u32)>);

/// The objects in recency order (a logical clock: each use is the next tick), with the keys
/// a sweep is deleting (stores of them wait, lookups answer absent).
#[derive(Default)]
pub(crate) struct CapIndex {
    lru: LruIndex<Entry>,
    clock: u64,
    /// Victims whose DELETE has been sent (the others a store may take back).
    sending: rustc_hash::FxHashSet<BlockKey>,
}

impl CapIndex {
    /// Indexes `key` as the most recently used object; returns whether it was not indexed
    /// before (so the caller's undo may remove it).
    pub(crate) fn insert(&mut self, key: BlockKey, size: u64) -> bool {
        let tick = self.tick();
        let e = Entry {
            size,
            at: tick,
            stored: tick,
            doubt: Doubt::Known,
        };
        self.lru.insert(key, e).is_none()
    }

    /// The logical clock's next tick.
    fn tick(&mut self) -> u64 {
        self.clock += 1;
        self.clock
    }

    /// [`CapIndex::insert`], [`Doubt::Unended`]: counted before a write. Returns whether it
    /// was not indexed before, and whether an earlier write of it may still land (it was
    /// `Unended` already).
    pub(crate) fn insert_before_write(&mut self, key: BlockKey, size: u64) -> (bool, bool) {
        let earlier = self
            .lru
            .get(&key)
            .is_some_and(|e| e.doubt == Doubt::Unended);
        let added = self.insert(key, size);
        self.doubt(&key, Doubt::Unended);
        (added, earlier)
    }

    /// A write of `key` ended without telling whether it landed: counted, in doubt, as of
    /// now (a request sent before this is older than what it may have written).
    pub(crate) fn ended_in_doubt(&mut self, key: &BlockKey, doubt: Doubt) {
        let tick = self.tick();
        self.lru.update(key, |e| {
            e.stored = tick;
            e.doubt = doubt;
        });
    }

    /// Where indexed `key` sits in its chain: a sweep takes a chain's later objects first.
    pub(crate) fn link(&mut self, key: &BlockKey, l: &kv_tier_core::ChainLink) {
        self.lru.link(key, l.parent, l.depth);
    }

    /// Bytes of objects whose chain is broken before them (see `LruIndex::dead_bytes`).
    pub(crate) fn dead_bytes(&self) -> u64 {
        self.lru.dead_bytes()
    }

    /// Makes `key` the most recently used, if indexed.
    pub(crate) fn touch(&mut self, key: &BlockKey) {
        let tick = self.tick();
        self.lru.update(key, |e| e.at = tick);
    }

    pub(crate) fn remove(&mut self, key: &BlockKey) -> Option<Entry> {
        self.lru.remove(key)
    }

    /// `key`'s tick, if indexed.
    pub(crate) fn tick_of(&self, key: &BlockKey) -> Option<u64> {
        self.lru.get(key).map(|e| e.at)
    }

    /// The tick `key` was last indexed at, if indexed.
    pub(crate) fn stored_at(&self, key: &BlockKey) -> Option<u64> {
        self.lru.get(key).map(|e| e.stored)
    }

    /// Whether `key` is indexed and known held (not in doubt).
    pub(crate) fn knows(&self, key: &BlockKey) -> Option<bool> {
        self.lru.get(key).map(|e| e.doubt == Doubt::Known)
    }

    /// Removes `key` if it was not indexed again since `stored` (see
    /// [`CapIndex::stored_at`]); returns whether it did.
    pub(crate) fn remove_if_stored_at(&mut self, key: &BlockKey, stored: u64) -> bool {
        let found = self.lru.get(key).copied();
        if found.is_some_and(|e| e.stored == stored && e.doubt != Doubt::Unended) {
            self.lru.remove(key);
            true
        } else {
            false
        }
    }

    /// Keeps `key` counted, in doubt: not known held until stored or confirmed again.
    pub(crate) fn doubt(&mut self, key: &BlockKey, doubt: Doubt) {
        self.lru.update(key, |e| e.doubt = doubt);
    }

    pub(crate) fn total(&self) -> u64 {
        self.lru.bytes()
    }

    /// The logical clock: every tick an entry holds is at most this.
    pub(crate) fn clock(&self) -> u64 {
        self.clock
    }

    pub(crate) fn len(&self) -> usize {
        self.lru.len()
    }

    pub(crate) fn is_deleting(&self, key: &BlockKey) -> bool {
        self.lru.is_deleting(key)
    }

    /// A sweep is about to send victim `key`'s DELETE: whether it is still a victim (a store
    /// may have taken it back).
    pub(crate) fn start_delete(&mut self, key: &BlockKey) -> bool {
        let still = self.lru.is_deleting(key);
        if still {
            self.sending.insert(*key);
        }
        still
    }

    /// A store of victim `key` takes it back from its sweep if its DELETE is not sent yet:
    /// the object is still there, so it is counted again (`size` bytes, in doubt, as of now:
    /// however the store ends, it stays counted); whether it was a victim whose DELETE is not
    /// sent.
    pub(crate) fn take_back(&mut self, key: &BlockKey, size: u64) -> bool {
        let back = self.lru.is_deleting(key) && !self.sending.contains(key);
        if back {
            self.lru.end_deletion(key);
            self.insert(*key, size);
            self.doubt(key, Doubt::Unknown);
        }
        back
    }

    /// Takes `key` out, unless a write of it may still land ([`Doubt::Unended`]).
    pub(crate) fn remove_unless_unended(&mut self, key: &BlockKey) {
        if self.lru.get(key).is_some_and(|e| e.doubt != Doubt::Unended) {
            self.lru.remove(key);
        }
    }

    /// The indexed keys, least recently used first.
    pub(crate) fn keys_by_recency(&self) -> Vec<BlockKey> {
        self.lru.keys_by_recency()
    }
}

/// The recency snapshot's format: a header line, then 36 bytes per key (hash, then group
/// little-endian), least recently used first.
const SNAPSHOT_HEADER: &[u8] = b"kv-tier recency v1\n";

/// Encodes `keys` (least recent first) as a recency snapshot.
pub(crate) fn encode_recency(keys: &[BlockKey]) -> Vec<u8> {
    let mut out = Vec::with_capacity(SNAPSHOT_HEADER.len() + keys.len() * 36);
    out.extend_from_slice(SNAPSHOT_HEADER);
    for k in keys {
        out.extend_from_slice(k.hash_bytes());
        out.extend_from_slice(&k.group().to_le_bytes());
    }
    out
}

/// Decodes a recency snapshot into each key's position (0: least recent); `None` when it is
/// not one (damaged or foreign: then recency falls back to the objects' ages).
pub(crate) fn decode_recency(bytes: &[u8]) -> Option<FxHashMap<BlockKey, u64>> {
    let body = bytes.strip_prefix(SNAPSHOT_HEADER)?;
    if body.len() % 36 != 0 {
        return None;
    }
    let mut pos = FxHashMap::default();
    for (i, rec) in body.chunks_exact(36).enumerate() {
        let hash: [u8; 32] = rec[..32].try_into().ok()?;
        let group = u32::from_le_bytes(rec[32..].try_into().ok()?);
        pos.insert(BlockKey::from_hash32(hash, group), i as u64);
    }
    Some(pos)
}

/// Orders objects found by a LIST (`(last_modified, key, size)`) by recency: the keys of the
/// snapshot (taken at `snapshot_time`) in its order; objects it does not name are older
/// than all of them if modified before it, newer if after (written since), by their ages.
/// Returns them with their rank as the time, least recent first.
pub(crate) fn order_by_snapshot(
    found: Vec<(u64, BlockKey, u64)>,
    snapshot: &FxHashMap<BlockKey, u64>,
    snapshot_time: u64,
) -> Vec<(u64, BlockKey, u64)> {
    let mut ranked: Vec<((u8, u64), BlockKey, u64)> = found
        .into_iter()
        .map(|(t, k, size)| {
            let rank = match snapshot.get(&k) {
                Some(p) => (1, *p),
                None if t <= snapshot_time => (0, t),
                None => (2, t),
            };
            (rank, k, size)
        })
        .collect();
    ranked.sort_unstable_by_key(|(rank, k, _)| (*rank, *k));
    ranked
        .into_iter()
        .enumerate()
        .map(|(i, (_, k, size))| (i as u64, k, size))
        .collect()
}

/// The bound, its index, and the sweep's coordination.
pub(crate) struct Cap {
    pub(crate) cap: u64,
    pub(crate) low: u64,
    pub(crate) index: Mutex<CapIndex>,
    /// Woken when keys leave `deleting`.
    pub(crate) deleted: Notify,
    /// One sweep at a time: background sweeps skip when one runs, `sweep_now` waits.
    pub(crate) sweeping: tokio::sync::Mutex<()>,
    /// Bytes committed outside the index, counted with it against the bound (a shared
    /// bucket's leader: stores in flight and credit granted but not spent); 0 otherwise.
    pub(crate) outside: std::sync::atomic::AtomicU64,
    /// Room wanted beyond the bound's (a shared bucket's member waiting for credit that
    /// the room left cannot give): the sweep makes it.
    pub(crate) demand: std::sync::atomic::AtomicU64,
}

/// What one decision step chose.
#[derive(Debug, Default)]
pub(crate) struct Decision {
    /// Victims, out of the index and marked deleting, with their entries (to restore one
    /// whose delete fails).
    pub(crate) victims: Vec<Victim>,
    /// Candidates kept because they were protected.
    pub(crate) protected: u64,
    /// Index entries examined under the locks (at most the batch size, whatever the index's
    /// size).
    pub(crate) examined: usize,
    /// Nothing more to decide: down to the low watermark, or no candidate left.
    pub(crate) done: bool,
    /// The last victim's place in the order: a sweep whose deletes did not all confirm reads
    /// on from here (the candidates after it were examined, not taken).
    pub(crate) last_victim: Option<Rank<u64>>,
}

impl Cap {
    pub(crate) fn new(cap: u64, low_watermark: f64) -> Self {
        Self {
            cap,
            low: (cap as f64 * low_watermark) as u64,
            index: Mutex::new(CapIndex::default()),
            deleted: Notify::new(),
            sweeping: tokio::sync::Mutex::new(()),
            outside: std::sync::atomic::AtomicU64::new(0),
            demand: std::sync::atomic::AtomicU64::new(0),
        }
    }

    fn outside(&self) -> u64 {
        self.outside.load(std::sync::atomic::Ordering::Relaxed)
            + self.demand.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, CapIndex> {
        // Every critical section leaves the index consistent before anything can panic.
        self.index.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn over(&self) -> bool {
        self.lock().total() + self.outside() > self.cap
    }

    /// Chooses up to `n` victims, least recently used first, after the tick `cursor`.
    ///
    /// The candidates are read under the index lock alone (a range of the recency order:
    /// no sort, no copy of the index); each is then re-checked under the protection lock and
    /// the index lock (still indexed, not touched since, not protected) and, if it goes,
    /// leaves the index and is marked deleting before the locks drop. So `protect()` and
    /// `touch()` wait at most for one batch, never for a walk of the whole index. Keys for
    /// which `keep` answers true are kept as protected ones are (a shared bucket's keys read
    /// lately by any instance).
    pub(crate) fn decide(
        &self,
        protection: &ProtectionSet,
        keep: &(dyn Fn(&BlockKey) -> bool + Sync),
        cursor: &mut Bound<Rank<u64>>,
        n: usize,
    ) -> Decision {
        let low = self.low.saturating_sub(self.outside());
        let candidates: Vec<Rank<u64>> = {
            let idx = self.lock();
            if idx.total() <= low {
                return Decision {
                    done: true,
                    ..Decision::default()
                };
            }
            idx.lru.oldest_from(*cursor, n)
        };
        let mut d = Decision {
            done: candidates.len() < n,
            ..Decision::default()
        };
        let Some(&last) = candidates.last() else {
            return d;
        };
        *cursor = Bound::Excluded(last);
        d.examined = candidates.len();
        protection.with_lock(|is_protected| {
            let mut idx = self.lock();
            for rank in candidates {
                let key = rank.key;
                if idx.total() <= low {
                    d.done = true;
                    break;
                }
                if idx.lru.rank(&key) != Some(rank) {
                    continue; // touched, followed or removed since it was read
                }
                if is_protected(&key) || keep(&key) {
                    d.protected += 1;
                    continue;
                }
                let link = idx.lru.parent(&key).map(|p| (p, rank.depth));
                let e = idx.lru.take_for_deletion(&key).expect("checked above");
                d.victims.push((key, e, link));
                d.last_victim = Some(rank);
                // its parent may be a candidate now: not done; and if it comes before the
                // rest of this batch, the batch ends here and the next reads on from here
                if let Some(pr) = link.and_then(|(p, _)| idx.lru.rank(&p)) {
                    d.done = false;
                    // never before this victim: read on from it
                    if pr < last {
                        *cursor = Bound::Excluded(rank);
                        break;
                    }
                }
            }
        });
        d
    }

    /// Ends the deletion of `victims`: those in `failed` (still in the store, or not known
    /// to be gone) go back to the index with their old recency; all leave `deleting`, and
    /// stores waiting for them wake.
    pub(crate) fn finish(&self, victims: &[Victim], failed: &[BlockKey]) {
        {
            let mut idx = self.lock();
            for (k, e, link) in victims {
                idx.sending.remove(k);
                if !idx.lru.is_deleting(k) {
                    continue; // taken back by a store, which counts it
                }
                if failed.contains(k) && !idx.lru.contains(k) {
                    // its old recency and link, in doubt: the DELETE may have run
                    let e = Entry {
                        doubt: Doubt::Unknown,
                        ..*e
                    };
                    idx.lru.insert(*k, e);
                    if let Some((p, d)) = link {
                        idx.lru.link(k, *p, *d);
                    }
                }
                idx.lru.end_deletion(k);
            }
        }
        self.deleted.notify_waiters();
    }

    /// Seeds the index with objects found by a LIST, oldest first.
    pub(crate) fn seed(&self, mut found: Vec<(u64, BlockKey, u64)>) {
        found.sort_unstable();
        let mut idx = self.lock();
        for (_, k, size) in found {
            idx.insert(k, size);
        }
    }
}

/// Owns victims being deleted, and ends their deletion however the sweep ends (done,
/// failed, timed out, dropped at shutdown or cancelled).
///
/// Every victim is reported removed when the batch is taken, before any DELETE: from then on
/// lookups answer absent for it, and one whose DELETE is not confirmed may be gone too (a
/// request that timed out or was dropped may have run on the server; a batch may end part
/// way), while a key reported stored must never go missing without its removal reported.
/// Victims not confirmed gone go back to the index with their old recency (they may still
/// be there: counting them is the safe side of the bound, and a later sweep's delete of one
/// that is gone is a no-op; found again, one is a hit that was reported removed, never a
/// loss); all leave `deleting`, each as its own DELETE ends ([`Deleting::settle`]) or when
/// the batch goes, so no store waits for them forever, nor for the rest of the batch.
pub(crate) struct Deleting<'a> {
    pub(crate) cap: &'a Cap,
    pub(crate) victims: Vec<Victim>,
    /// Per victim: whether its DELETE was confirmed (or the object was already gone).
    pub(crate) gone: Vec<bool>,
    /// Per victim: whether its deletion has ended.
    settled: Vec<bool>,
}

impl<'a> Deleting<'a> {
    /// Takes `victims` (out of the index, marked deleting by [`Cap::decide`]) and reports
    /// them removed.
    pub(crate) fn new(cap: &'a Cap, events: &EventLog, victims: Vec<Victim>) -> Self {
        events.push(victims.iter().map(|(k, _, _)| *k).collect(), true);
        let gone = vec![false; victims.len()];
        let settled = gone.clone();
        Self {
            cap,
            victims,
            gone,
            settled,
        }
    }

    /// Ends victim `i`'s deletion now: `gone`, it stays out of the index; else it goes back
    /// (in doubt). A store waiting for it goes on.
    pub(crate) fn settle(&mut self, i: usize, gone: bool) {
        if std::mem::replace(&mut self.settled[i], true) {
            return;
        }
        self.gone[i] = gone;
        let v = &self.victims[i..=i];
        let failed: &[BlockKey] = if gone {
            &[]
        } else {
            std::slice::from_ref(&v[0].0)
        };
        self.cap.finish(v, failed);
    }

    /// How many victims are confirmed gone.
    pub(crate) fn confirmed(&self) -> usize {
        self.gone.iter().filter(|g| **g).count()
    }
}

impl Drop for Deleting<'_> {
    fn drop(&mut self) {
        for i in 0..self.victims.len() {
            self.settle(i, self.gone[i]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_decision_examines_one_batch_whatever_the_size_of_the_index() {
        let cap = Cap::new(100_000, 0.5);
        for i in 0..200_000u32 {
            let mut h = [0u8; 32];
            h[..4].copy_from_slice(&i.to_le_bytes());
            cap.lock().insert(BlockKey::from_hash32(h, 0), 1);
        }
        let prot = ProtectionSet::new();
        let mut cursor = Bound::Unbounded;
        let d = cap.decide(&prot, &|_| false, &mut cursor, 256);
        assert_eq!(d.victims.len(), 256);
        assert_eq!(d.examined, 256, "a decision walked more than its batch");
        // the oldest went first
        let mut first = [0u8; 32];
        first[..4].copy_from_slice(&0u32.to_le_bytes());
        assert_eq!(d.victims[0].0, BlockKey::from_hash32(first, 0));
    }

    /// The victims of `decide` in batches of `n` until it is done, in order.
    fn decide_all(cap: &Cap, prot: &ProtectionSet, n: usize) -> Vec<BlockKey> {
        let mut cursor = Bound::Unbounded;
        let mut victims = Vec::new();
        loop {
            let d = cap.decide(prot, &|_| false, &mut cursor, n);
            victims.extend(d.victims.iter().map(|(k, _, _)| *k));
            if d.done {
                return victims;
            }
        }
    }

    fn k(i: u8) -> BlockKey {
        BlockKey::from_hash32([i; 32], 0)
    }

    /// A chain (0 <- 1 <- 2, its head the oldest object) whose tail was used last goes tail
    /// first and only after older tails: the sweep takes 3..7 and then the chain from its tail,
    /// each object once it is a tail, never its head before its later objects.
    #[test]
    fn a_chain_goes_tail_first_in_one_sweep() {
        let cap = Cap::new(100, 0.3);
        for i in 0..8 {
            cap.lock().insert(k(i), 10);
        }
        let link = |c: u8, p: u8, depth: u32| {
            let l = kv_tier_core::ChainLink {
                parent: k(p),
                depth,
            };
            cap.lock().link(&k(c), &l);
        };
        link(1, 0, 1);
        link(2, 1, 2);
        cap.lock().touch(&k(2)); // the chain's tail, most recent
        let prot = ProtectionSet::new();
        let victims = decide_all(&cap, &prot, 256);
        // 80 -> 30: five go, the unlinked ones; the chain, used last, stays whole
        assert_eq!(victims, [3, 4, 5, 6, 7].map(k).to_vec());
        let mut more = Vec::new();
        let cap2 = Cap::new(100, 0.0);
        for i in 0..3 {
            cap2.lock().insert(k(i), 10);
        }
        for (c, p, d) in [(1u8, 0u8, 1u32), (2, 1, 2)] {
            let l = kv_tier_core::ChainLink {
                parent: k(p),
                depth: d,
            };
            cap2.lock().link(&k(c), &l);
        }
        more.extend(decide_all(&cap2, &prot, 256));
        assert_eq!(more, [2, 1, 0].map(k).to_vec(), "tail first, head last");
    }

    #[test]
    fn victims_follow_recency_skip_protected_and_stop_at_the_low_watermark() {
        let cap = Cap::new(100, 0.5);
        for i in 0..12 {
            cap.lock().insert(k(i), 10);
        }
        cap.lock().touch(&k(0)); // most recent now
        let prot = ProtectionSet::new();
        let _g = prot.protect(&[k(1)]);
        let victims = decide_all(&cap, &prot, 3);
        // 120 -> 50: seven go, the oldest unprotected ones
        assert_eq!(victims, (2..9).map(k).collect::<Vec<_>>());
        assert_eq!(cap.lock().total(), 50);
        assert!(cap.lock().is_deleting(&k(2)));
        let log = EventLog::new(
            "t",
            kv_tier_core::Medium::Storage,
            kv_tier_core::Locality::Local,
        );
        let d = Deleting::new(
            &cap,
            &log,
            vec![(
                k(2),
                Entry {
                    size: 10,
                    at: 3,
                    stored: 3,
                    doubt: Doubt::Known,
                },
                None,
            )],
        );
        // reported removed as soon as it is taken (lookups answer absent from then on)
        let ev = log.take();
        drop(d); // dropped before it finished: the victim is restored
        assert!(!cap.lock().is_deleting(&k(2)));
        assert_eq!(cap.lock().total(), 60);
        assert_eq!(ev.len(), 1);
        assert!(ev[0].removed && ev[0].keys == vec![k(2)], "{ev:?}");
        // one confirmed gone stays out of the index, one not confirmed goes back
        assert!(cap.lock().is_deleting(&k(3)) && cap.lock().is_deleting(&k(4)));
        let mut d = Deleting::new(
            &cap,
            &log,
            vec![
                (
                    k(3),
                    Entry {
                        size: 10,
                        at: 4,
                        stored: 4,
                        doubt: Doubt::Known,
                    },
                    None,
                ),
                (
                    k(4),
                    Entry {
                        size: 10,
                        at: 5,
                        stored: 5,
                        doubt: Doubt::Known,
                    },
                    None,
                ),
            ],
        );
        d.gone[0] = true;
        assert_eq!(d.confirmed(), 1);
        let ev = log.take();
        drop(d);
        assert!(!cap.lock().is_deleting(&k(3)) && !cap.lock().is_deleting(&k(4)));
        assert_eq!(
            cap.lock().total(),
            70,
            "only the doubtful one is counted again"
        );
        assert!(cap.lock().lru.get(&k(4)).is_some() && cap.lock().lru.get(&k(3)).is_none());
        assert!(log.take().is_empty(), "reported once, when taken");
        assert!(ev[0].removed && ev[0].keys == vec![k(3), k(4)], "{ev:?}");
    }

    #[test]
    fn a_decision_at_the_low_watermark_or_out_of_candidates_is_done() {
        let cap = Cap::new(100, 0.5);
        for i in 0..5 {
            cap.lock().insert(k(i), 10);
        }
        let prot = ProtectionSet::new();
        let d = cap.decide(&prot, &|_| false, &mut Bound::Unbounded, 3);
        assert!(d.done && d.victims.is_empty(), "50 is the low watermark");
        assert!(!cap.over());
        for i in 5..10 {
            cap.lock().insert(k(i), 10);
        }
        assert!(!cap.over(), "at the cap is not over it");
        cap.lock().insert(k(10), 10);
        assert!(cap.over());
        let _g = prot.protect(&(0..11).map(k).collect::<Vec<_>>());
        let mut cursor = Bound::Unbounded;
        let d = cap.decide(&prot, &|_| false, &mut cursor, 8);
        assert_eq!((d.victims.len(), d.protected, d.done), (0, 8, false));
        let d = cap.decide(&prot, &|_| false, &mut cursor, 8);
        assert_eq!(
            (d.victims.len(), d.protected, d.done),
            (0, 3, true),
            "fewer candidates than the batch: nothing more to decide"
        );
    }

    #[test]
    fn a_snapshot_orders_what_it_names_between_older_and_newer_objects() {
        let snap: FxHashMap<BlockKey, u64> = [(k(3), 0), (k(1), 1)].into_iter().collect();
        let found = vec![
            (5, k(1), 10),
            (50, k(2), 10),
            (20, k(3), 10),
            (100, k(4), 10),
            (10, k(5), 10),
            (30, k(6), 10),
        ];
        let order: Vec<(u64, BlockKey)> = order_by_snapshot(found, &snap, 30)
            .into_iter()
            .map(|(rank, key, _)| (rank, key))
            .collect();
        // unnamed and not newer than the snapshot (by age), the snapshot's order, then
        // unnamed and written since (by age)
        assert_eq!(
            order,
            vec![
                (0, k(5)),
                (1, k(6)),
                (2, k(3)),
                (3, k(1)),
                (4, k(2)),
                (5, k(4))
            ]
        );
    }
}
