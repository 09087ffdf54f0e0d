//! The index a bounded tier evicts from: every block it holds with its size and its place in
//! recency order, the total of the sizes, and the keys a sweep has taken out to delete.
//!
//! It is the part the fs tier's GC and the obj tier's capacity share. What recency is stays
//! the tier's: an mtime for the fs tier (it survives restarts and other processes see it), a
//! logical tick for the obj tier. A sweep reads victims oldest first in batches
//! ([`LruIndex::oldest`]), re-checks each under its own locks, and takes it out with
//! [`LruIndex::take_for_deletion`]: from then on the key is neither indexed nor free, and a
//! store of it waits until [`LruIndex::end_deletion`].
//!
//! ```
//! use kv_tier_core::BlockKey;
//! use kv_tier_core::lru::{LruIndex, Slot};
//!
//! let k = |i: u8| BlockKey::from_hash32([i; 32], 0);
//! let mut idx = LruIndex::new();
//! idx.insert(k(1), Slot { size: 10, at: 1u64 });
//! idx.insert(k(2), Slot { size: 20, at: 2 });
//! idx.update(&k(1), |e| e.at = 3); // used again: now the most recent
//! assert_eq!(idx.bytes(), 30);
//! let victims = idx.oldest(None, 1);
//! assert_eq!((victims[0].at, victims[0].key), (2, k(2)));
//! let e = idx.take_for_deletion(&k(2)).unwrap();
//! assert_eq!((e.size, idx.bytes(), idx.is_deleting(&k(2))), (20, 10, true));
//! idx.end_deletion(&k(2));
//! assert!(!idx.is_deleting(&k(2)) && !idx.contains(&k(2)));
//! ```
//!
//! # Chains
//!
//! Prefix caching needs a contiguous prefix: a block is of use only while every block before
//! it in its request's chain is there too. [`LruIndex::link`] tells the index which block a
//! block follows (its parent) and at which position of the chain it is (its depth, strictly
//! larger than its parent's). The index then evicts chain tails only: a block that a later
//! block of its chain follows is not a candidate ([`LruIndex::oldest`] never returns it) until
//! that later block is gone. Among tails the order is LRU, where a block that became a tail
//! when its last follower left takes the follower's recency if newer than its own: the most
//! recent use of it or of any later block of its chain. So touching only a trailing window
//! (sliding-window groups) does not age a chain's head, and a cold chain goes tail first.
//! Ties go deepest first. A block nothing is linked to is a chain of one, and an index
//! without links is plain LRU.
//!
//! A block whose parent is not indexed is the start of a broken chain: it and every block
//! after it are dead bytes ([`LruIndex::dead_bytes`]) as far as this index knows.

use std::collections::BTreeSet;
use std::fmt::Debug;
use std::ops::Bound;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::BlockKey;

/// An entry of an [`LruIndex`]: its size and its recency (larger: more recent).
pub trait LruEntry: Copy {
    /// The recency order's key: an mtime, a tick.
    type At: Ord + Copy + Debug;
    /// Bytes the entry counts toward the total.
    fn size(&self) -> u64;
    /// Its place in the recency order.
    fn at(&self) -> Self::At;
}

/// An entry that is nothing but a size and a recency, for an index that needs no more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot<A> {
    /// Bytes it counts toward the total.
    pub size: u64,
    /// Its place in the recency order.
    pub at: A,
}

impl<A: Ord + Copy + Debug> LruEntry for Slot<A> {
    type At = A;
    fn size(&self) -> u64 {
        self.size
    }
    fn at(&self) -> A {
        self.at
    }
}

/// A candidate's place in the eviction order: least recent first, then deepest first (a
/// chain's later block before its earlier one at equal recency), then by key.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rank<A> {
    /// Its recency: its own, or that of the later block of its chain that left last, if
    /// newer.
    pub at: A,
    /// Its position in its chain (0: a chain's first block, or a block with no link).
    pub depth: u32,
    /// The block.
    pub key: BlockKey,
}

impl<A: Ord> Ord for Rank<A> {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.at
            .cmp(&o.at)
            .then(o.depth.cmp(&self.depth))
            .then(self.key.cmp(&o.key))
    }
}

impl<A: Ord> PartialOrd for Rank<A> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// One indexed block: its entry and its place in its chain.
#[derive(Debug, Clone, Copy)]
struct Node<E: LruEntry> {
    e: E,
    /// Recency inherited from the later block of its chain that left last (if newer).
    inherited: Option<E::At>,
    parent: Option<BlockKey>,
    depth: u32,
    /// Indexed blocks that follow this one (0: a tail, an eviction candidate).
    followers: u32,
    /// At most the least depth of a block that follows this one (`u32::MAX`: none yet).
    min_follower: u32,
}

impl<E: LruEntry> Node<E> {
    fn at(&self) -> E::At {
        match self.inherited {
            Some(i) if i > self.e.at() => i,
            _ => self.e.at(),
        }
    }
}

/// Blocks in recency order with their summed sizes, their chains, and the keys being
/// deleted. See the [module docs](self).
#[derive(Debug)]
pub struct LruIndex<E: LruEntry> {
    map: FxHashMap<BlockKey, Node<E>>,
    /// The tails (blocks no indexed block follows), in eviction order.
    order: BTreeSet<Rank<E::At>>,
    bytes: u64,
    deleting: FxHashSet<BlockKey>,
    /// Blocks linked to a parent that is not indexed, per parent: how many, and the least
    /// depth among them (an indexed parent must be shallower than its followers).
    waiting: FxHashMap<BlockKey, (u32, u32)>,
}

impl<E: LruEntry> Default for LruIndex<E> {
    fn default() -> Self {
        Self {
            map: FxHashMap::default(),
            order: BTreeSet::new(),
            bytes: 0,
            deleting: FxHashSet::default(),
            waiting: FxHashMap::default(),
        }
    }
}

impl<E: LruEntry> LruIndex<E> {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    fn rank_of(key: &BlockKey, n: &Node<E>) -> Rank<E::At> {
        Rank {
            at: n.at(),
            depth: n.depth,
            key: *key,
        }
    }

    /// Indexes `key` (replacing its entry, if any: its links stay); returns the entry it
    /// replaced. A new block that blocks linked earlier follow is not a tail.
    pub fn insert(&mut self, key: BlockKey, e: E) -> Option<E> {
        if let Some(n) = self.map.get(&key).copied() {
            if n.followers == 0 {
                self.order.remove(&Self::rank_of(&key, &n));
            }
            let mut m = n;
            m.e = e;
            self.bytes = self.bytes - n.e.size() + e.size();
            self.map.insert(key, m);
            if m.followers == 0 {
                self.order.insert(Self::rank_of(&key, &m));
            }
            return Some(n.e);
        }
        let (followers, min_follower) = self.waiting.remove(&key).unwrap_or((0, u32::MAX));
        let n = Node {
            e,
            inherited: None,
            parent: None,
            depth: 0,
            followers,
            min_follower,
        };
        self.bytes += e.size();
        self.map.insert(key, n);
        if followers == 0 {
            self.order.insert(Self::rank_of(&key, &n));
        }
        None
    }

    /// Links indexed block `key` to the block it follows in its chain, at `depth` (its
    /// position, at least 1; taken as one past an indexed parent's where that is more).
    /// Returns whether the link holds: a block already linked keeps its link, and a link whose
    /// depths contradict what is known (`key` not shallower than a block that follows it) is
    /// refused, so links never form a cycle whatever the caller passes.
    pub fn link(&mut self, key: &BlockKey, parent: BlockKey, depth: u32) -> bool {
        let Some(n) = self.map.get(key).copied() else {
            return false;
        };
        if n.parent.is_some() || parent == *key || depth == 0 {
            return n.parent == Some(parent);
        }
        if n.followers > 0 && n.min_follower <= depth {
            return false;
        }
        // below an indexed parent, one deeper than it at least
        let depth = match self.map.get(&parent) {
            Some(p) => depth.max(p.depth.saturating_add(1)),
            None => depth,
        };
        if n.followers > 0 && n.min_follower <= depth {
            return false;
        }
        match self.map.get(&parent).copied() {
            Some(p) if p.depth >= depth => return false,
            Some(p) => {
                if p.followers == 0 {
                    self.order.remove(&Self::rank_of(&parent, &p));
                }
                let pm = self.map.get_mut(&parent).expect("indexed");
                pm.followers += 1;
                pm.min_follower = pm.min_follower.min(depth);
            }
            None => {
                let w = self.waiting.entry(parent).or_insert((0, u32::MAX));
                w.0 += 1;
                w.1 = w.1.min(depth);
            }
        }
        if n.followers == 0 {
            self.order.remove(&Self::rank_of(key, &n));
        }
        let m = self.map.get_mut(key).expect("indexed");
        m.parent = Some(parent);
        m.depth = depth;
        let m = *m;
        if m.followers == 0 {
            self.order.insert(Self::rank_of(key, &m));
        }
        true
    }

    /// Removes `key`'s entry; returns it. Its parent becomes a tail when `key` was its last
    /// follower, with `key`'s recency if newer than its own.
    pub fn remove(&mut self, key: &BlockKey) -> Option<E> {
        let n = self.map.remove(key)?;
        self.bytes -= n.e.size();
        if n.followers == 0 {
            self.order.remove(&Self::rank_of(key, &n));
        } else {
            // its followers now wait for it again (their chain is broken until it is back)
            let w = self.waiting.entry(*key).or_insert((0, u32::MAX));
            w.0 += n.followers;
            w.1 = w.1.min(n.min_follower);
        }
        if let Some(p) = n.parent {
            let at = n.at();
            if let Some(pn) = self.map.get_mut(&p) {
                pn.followers -= 1;
                if pn.followers == 0 {
                    if pn.inherited.is_none_or(|i| i < at) {
                        pn.inherited = Some(at);
                    }
                    let pn = *pn;
                    self.order.insert(Self::rank_of(&p, &pn));
                }
            } else if let Some(w) = self.waiting.get_mut(&p) {
                w.0 -= 1;
                if w.0 == 0 {
                    self.waiting.remove(&p);
                }
            }
        }
        Some(n.e)
    }

    /// `key`'s entry.
    pub fn get(&self, key: &BlockKey) -> Option<&E> {
        self.map.get(key).map(|n| &n.e)
    }

    /// Whether `key` is indexed.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.map.contains_key(key)
    }

    /// Changes `key`'s entry in place (its size and recency included: the order and the
    /// total follow); returns what `f` returned, or `None` when `key` is not indexed.
    pub fn update<T>(&mut self, key: &BlockKey, f: impl FnOnce(&mut E) -> T) -> Option<T> {
        let n = self.map.get_mut(key)?;
        let before = *n;
        let out = f(&mut n.e);
        let after = *n;
        if before.followers == 0 && before.at() != after.at() {
            self.order.remove(&Self::rank_of(key, &before));
            self.order.insert(Self::rank_of(key, &after));
        }
        self.bytes = self.bytes - before.e.size() + after.e.size();
        Some(out)
    }

    /// Makes room for `n` more entries (before a bulk insert).
    pub fn reserve(&mut self, n: usize) {
        self.map.reserve(n);
    }

    /// Entries indexed.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The sum of the entries' sizes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Every entry, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (&BlockKey, &E)> {
        self.map.iter().map(|(k, n)| (k, &n.e))
    }

    /// Up to `n` eviction candidates (chain tails), first to go first, after `after` (the
    /// last one a previous batch returned) or from the start: a range of the order, no sort.
    pub fn oldest(&self, after: Option<Rank<E::At>>, n: usize) -> Vec<Rank<E::At>> {
        self.oldest_from(after.map_or(Bound::Unbounded, Bound::Excluded), n)
    }

    /// Up to `n` eviction candidates from `from` on.
    pub fn oldest_from(&self, from: Bound<Rank<E::At>>, n: usize) -> Vec<Rank<E::At>> {
        self.order
            .range((from, Bound::Unbounded))
            .take(n)
            .copied()
            .collect()
    }

    /// How many candidates are at `from` or later in the order.
    pub fn count_from(&self, from: Rank<E::At>) -> usize {
        self.order.range(from..).count()
    }

    /// `key`'s place in the eviction order, if it is a candidate (a chain tail).
    pub fn rank(&self, key: &BlockKey) -> Option<Rank<E::At>> {
        self.map
            .get(key)
            .filter(|n| n.followers == 0)
            .map(|n| Self::rank_of(key, n))
    }

    /// The block `key` follows, if linked.
    pub fn parent(&self, key: &BlockKey) -> Option<BlockKey> {
        self.map.get(key).and_then(|n| n.parent)
    }

    /// The block `key` follows and `key`'s depth, if linked: what [`LruIndex::link`] takes to
    /// link it again (in another index, or after a restart).
    pub fn chain_link(&self, key: &BlockKey) -> Option<(BlockKey, u32)> {
        self.map
            .get(key)
            .and_then(|n| n.parent.map(|p| (p, n.depth)))
    }

    /// Every key, least recent first by its own recency (a sort of the whole index: for a
    /// snapshot, not for a sweep).
    pub fn keys_by_recency(&self) -> Vec<BlockKey> {
        if self.order.len() == self.map.len() && self.map.values().all(|n| n.inherited.is_none()) {
            // no links: the candidates are every key, in that order already
            return self.order.iter().map(|r| r.key).collect();
        }
        let mut v: Vec<(E::At, BlockKey)> = self.map.iter().map(|(k, n)| (n.e.at(), *k)).collect();
        v.sort_unstable();
        v.into_iter().map(|(_, k)| k).collect()
    }

    /// Bytes of blocks whose chain is broken before them: linked to a parent that is not
    /// indexed, or following such a block. A prefix lookup cannot reach them through this
    /// index. One pass over the index (memoized per chain).
    pub fn dead_bytes(&self) -> u64 {
        let mut dead: FxHashMap<BlockKey, bool> = FxHashMap::default();
        let mut total = 0;
        let mut path = Vec::new();
        for (k, n) in &self.map {
            // walk up to a known answer, a chain's first block or a missing parent
            path.clear();
            let mut cur = *k;
            let verdict = loop {
                if let Some(d) = dead.get(&cur) {
                    break *d;
                }
                path.push(cur);
                match self.map.get(&cur).and_then(|c| c.parent) {
                    None => break false,
                    Some(p) if !self.map.contains_key(&p) => break true,
                    // links never form a cycle (depths decrease): this ends
                    Some(p) => cur = p,
                }
            };
            for c in &path {
                dead.insert(*c, verdict);
            }
            if verdict {
                total += n.e.size();
            }
        }
        total
    }

    /// Takes `key` out of the index to delete it, and marks it deleting; returns its entry
    /// (`None`, and nothing marked, when it is not indexed).
    pub fn take_for_deletion(&mut self, key: &BlockKey) -> Option<E> {
        let e = self.remove(key)?;
        self.deleting.insert(*key);
        Some(e)
    }

    /// Marks `key` deleting (for an index that removes entries its own way first).
    pub fn mark_deleting(&mut self, key: BlockKey) {
        self.deleting.insert(key);
    }

    /// Ends `key`'s deletion (gone, or put back by the caller); returns whether it was marked.
    pub fn end_deletion(&mut self, key: &BlockKey) -> bool {
        self.deleting.remove(key)
    }

    /// Whether a sweep has taken `key` out and is deleting it.
    pub fn is_deleting(&self, key: &BlockKey) -> bool {
        self.deleting.contains(key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type E = Slot<i64>;

    fn k(i: u8) -> BlockKey {
        BlockKey::from_hash32([i; 32], 0)
    }

    fn order(idx: &LruIndex<E>) -> Vec<BlockKey> {
        idx.keys_by_recency()
    }

    fn ranks(v: Vec<Rank<i64>>) -> Vec<(i64, BlockKey)> {
        v.into_iter().map(|r| (r.at, r.key)).collect()
    }

    #[test]
    fn a_replaced_entry_leaves_the_order_and_the_total() {
        let mut idx = LruIndex::new();
        assert!(idx.is_empty());
        assert_eq!(idx.insert(k(1), Slot { size: 10, at: 5 }), None);
        idx.insert(k(2), Slot { size: 1, at: 7 });
        let old = idx.insert(k(1), Slot { size: 3, at: 9 });
        assert_eq!(old, Some(Slot { size: 10, at: 5 }));
        assert_eq!((idx.bytes(), idx.len()), (4, 2));
        assert_eq!(order(&idx), vec![k(2), k(1)]);
        assert_eq!(idx.remove(&k(2)), Some(Slot { size: 1, at: 7 }));
        assert_eq!(idx.remove(&k(2)), None);
        assert_eq!((idx.bytes(), order(&idx)), (3, vec![k(1)]));
        assert!(idx.contains(&k(1)) && !idx.contains(&k(2)) && !idx.is_empty());
    }

    #[test]
    fn an_update_moves_the_entry_and_its_bytes() {
        let mut idx = LruIndex::new();
        idx.insert(k(1), Slot { size: 10, at: 1 });
        idx.insert(k(2), Slot { size: 20, at: 2 });
        assert_eq!(idx.update(&k(1), |e| e.size), Some(10));
        assert_eq!(
            order(&idx),
            vec![k(1), k(2)],
            "an update that moves nothing"
        );
        assert_eq!(
            idx.update(&k(1), |e| {
                e.at = 3;
                e.size = 15;
            }),
            Some(())
        );
        assert_eq!(order(&idx), vec![k(2), k(1)]);
        assert_eq!(idx.bytes(), 35);
        assert_eq!(idx.get(&k(1)), Some(&Slot { size: 15, at: 3 }));
        assert_eq!(idx.update(&k(9), |e| e.at = 0), None);
        assert_eq!(idx.iter().count(), 2);
    }

    #[test]
    fn oldest_reads_batches_after_a_cursor() {
        let mut idx = LruIndex::new();
        for i in 0..5u8 {
            idx.insert(
                k(i),
                Slot {
                    size: 1,
                    at: 10 - i as i64,
                },
            );
        }
        let first = idx.oldest(None, 2);
        assert_eq!(ranks(first.clone()), vec![(6, k(4)), (7, k(3))]);
        let next = idx.oldest(first.last().copied(), 2);
        assert_eq!(ranks(next.clone()), vec![(8, k(2)), (9, k(1))]);
        assert_eq!(ranks(idx.oldest(next.last().copied(), 2)), vec![(10, k(0))]);
        let at = |at, key| Rank { at, depth: 0, key };
        assert_eq!(idx.count_from(at(8, k(2))), 3);
        assert_eq!(
            idx.count_from(at(8, k(3))),
            2,
            "from between two entries: the later ones"
        );
    }

    #[test]
    fn a_key_taken_for_deletion_is_out_and_marked_until_its_end() {
        let mut idx = LruIndex::new();
        idx.insert(k(1), Slot { size: 10, at: 1 });
        assert_eq!(idx.take_for_deletion(&k(2)), None);
        assert!(!idx.is_deleting(&k(2)), "an absent key is not marked");
        assert_eq!(idx.take_for_deletion(&k(1)), Some(Slot { size: 10, at: 1 }));
        assert!(idx.is_deleting(&k(1)) && !idx.contains(&k(1)));
        assert_eq!(idx.bytes(), 0);
        assert!(idx.end_deletion(&k(1)));
        assert!(!idx.end_deletion(&k(1)));
        assert!(!idx.is_deleting(&k(1)));
        idx.mark_deleting(k(3));
        assert!(idx.is_deleting(&k(3)));
    }

    fn tails(idx: &LruIndex<E>) -> Vec<BlockKey> {
        idx.oldest(None, usize::MAX).iter().map(|r| r.key).collect()
    }

    /// A chain 1 <- 2 <- 3 stored head first (oldest head): plain LRU would take 1 first;
    /// only the tail is a candidate, and the chain goes tail first.
    #[test]
    fn a_chain_goes_tail_first_whatever_its_heads_age() {
        let mut idx = LruIndex::new();
        for i in 1..=3u8 {
            idx.insert(
                k(i),
                Slot {
                    size: 1,
                    at: i as i64,
                },
            );
        }
        idx.insert(k(9), Slot { size: 1, at: 4 });
        assert!(idx.link(&k(2), k(1), 1));
        assert!(idx.link(&k(3), k(2), 2));
        assert_eq!(tails(&idx), vec![k(3), k(9)]);
        assert_eq!(idx.parent(&k(3)), Some(k(2)));
        assert_eq!(
            idx.rank(&k(1)),
            None,
            "a head with followers is no candidate"
        );
        idx.remove(&k(3));
        // 2 inherits 3's recency (3): still before 9 (4)
        assert_eq!(tails(&idx), vec![k(2), k(9)]);
        assert_eq!(idx.rank(&k(2)).unwrap().at, 3);
        idx.remove(&k(2));
        assert_eq!(tails(&idx), vec![k(1), k(9)]);
        assert_eq!(idx.bytes(), 2);
    }

    /// Touching only a chain's trailing window keeps its head: the head inherits the
    /// window's recency when it becomes a tail.
    #[test]
    fn a_touched_tail_keeps_its_head_warm() {
        let mut idx = LruIndex::new();
        idx.insert(k(1), Slot { size: 1, at: 1 });
        idx.insert(k(2), Slot { size: 1, at: 2 });
        idx.insert(k(8), Slot { size: 1, at: 5 });
        idx.link(&k(2), k(1), 1);
        idx.update(&k(2), |e| e.at = 10);
        assert_eq!(tails(&idx), vec![k(8), k(2)]);
        idx.remove(&k(8));
        idx.remove(&k(2));
        assert_eq!(idx.rank(&k(1)).unwrap().at, 10);
        // at equal recency the deeper block goes first
        idx.insert(k(3), Slot { size: 1, at: 10 });
        idx.link(&k(3), k(7), 4);
        assert_eq!(tails(&idx), vec![k(3), k(1)]);
    }

    /// A block stored before its parent (a job's blocks publish in any order) counts as
    /// the parent's follower once the parent is indexed.
    #[test]
    fn a_follower_indexed_first_is_counted_when_its_parent_arrives() {
        let mut idx = LruIndex::new();
        idx.insert(k(2), Slot { size: 5, at: 1 });
        idx.link(&k(2), k(1), 1);
        assert_eq!(idx.dead_bytes(), 5, "its parent is missing");
        idx.insert(k(1), Slot { size: 3, at: 2 });
        idx.link(&k(1), k(0), 0);
        assert_eq!(tails(&idx), vec![k(2)]);
        assert_eq!(idx.dead_bytes(), 0);
        // the parent removed (a damaged file): its follower waits again, and is dead
        idx.remove(&k(1));
        assert_eq!(idx.dead_bytes(), 5);
        idx.insert(k(1), Slot { size: 3, at: 3 });
        assert_eq!(tails(&idx), vec![k(2)]);
        idx.remove(&k(2));
        assert_eq!(tails(&idx), vec![k(1)]);
        assert!(idx.waiting.is_empty());
    }

    /// Links that would close a cycle (or contradict the depths) are refused: every block
    /// stays reachable as a candidate once what follows it is gone.
    #[test]
    fn links_never_form_a_cycle() {
        let mut idx = LruIndex::new();
        idx.insert(k(1), Slot { size: 1, at: 1 });
        idx.insert(k(2), Slot { size: 1, at: 2 });
        assert!(idx.link(&k(2), k(1), 2));
        assert!(
            !idx.link(&k(1), k(2), 1),
            "a parent shallower than its follower"
        );
        assert!(!idx.link(&k(1), k(2), 3), "1 has a follower at depth 2");
        assert!(!idx.link(&k(1), k(1), 1), "itself");
        assert!(!idx.link(&k(9), k(1), 1), "not indexed");
        // one waiting on an absent block, which then arrives and links back
        idx.insert(k(5), Slot { size: 1, at: 5 });
        assert!(idx.link(&k(5), k(6), 3));
        idx.insert(k(6), Slot { size: 1, at: 6 });
        assert!(!idx.link(&k(6), k(5), 4));
        let mut n = 0;
        while let Some(r) = idx.oldest(None, 1).first().copied() {
            idx.remove(&r.key);
            n += 1;
        }
        assert_eq!(
            (n, idx.len()),
            (4, 0),
            "every block was a candidate in turn"
        );
    }

    /// Whatever the order of inserts, links, removals and touches: each block's follower
    /// count is the number of indexed blocks linked to it, each missing parent's waiting
    /// count the number linked to it, the candidates are exactly the blocks nothing follows,
    /// and draining the candidates empties the index.
    #[test]
    fn follower_counts_match_the_links_under_any_order() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = |n: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % n
        };
        for _round in 0..200 {
            let mut idx: LruIndex<E> = LruIndex::new();
            for step in 0..300 {
                let a = k(rnd(24) as u8);
                match rnd(5) {
                    0 | 1 => {
                        idx.insert(a, Slot { size: 1, at: step });
                    }
                    2 => {
                        let p = k(rnd(24) as u8);
                        idx.link(&a, p, 1 + rnd(30) as u32);
                    }
                    3 => {
                        idx.remove(&a);
                    }
                    _ => {
                        idx.update(&a, |e| e.at = step);
                    }
                }
                let mut followers: FxHashMap<BlockKey, u32> = FxHashMap::default();
                for n in idx.map.values() {
                    if let Some(p) = n.parent {
                        *followers.entry(p).or_default() += 1;
                    }
                }
                for (key, n) in &idx.map {
                    assert_eq!(n.followers, followers.get(key).copied().unwrap_or(0));
                    assert_eq!(
                        n.followers == 0,
                        idx.order.contains(&LruIndex::rank_of(key, n))
                    );
                }
                let waiting: FxHashMap<BlockKey, u32> = followers
                    .into_iter()
                    .filter(|(p, _)| !idx.map.contains_key(p))
                    .collect();
                let counted: FxHashMap<BlockKey, u32> =
                    idx.waiting.iter().map(|(p, (c, _))| (*p, *c)).collect();
                assert_eq!(counted, waiting);
                assert_eq!(
                    idx.order.len(),
                    idx.map.values().filter(|n| n.followers == 0).count()
                );
            }
            let mut left = idx.len();
            while let Some(r) = idx.oldest(None, 1).first().copied() {
                idx.remove(&r.key);
                left -= 1;
            }
            assert_eq!(left, 0, "every block became a candidate in turn");
        }
    }
}
