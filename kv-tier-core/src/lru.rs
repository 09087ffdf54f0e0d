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
//! assert_eq!(victims, vec![(2, k(2))]);
//! let e = idx.take_for_deletion(&k(2)).unwrap();
//! assert_eq!((e.size, idx.bytes(), idx.is_deleting(&k(2))), (20, 10, true));
//! idx.end_deletion(&k(2));
//! assert!(!idx.is_deleting(&k(2)) && !idx.contains(&k(2)));
//! ```

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

/// Blocks in recency order with their summed sizes, and the keys being deleted. See the
/// [module docs](self).
#[derive(Debug)]
pub struct LruIndex<E: LruEntry> {
    map: FxHashMap<BlockKey, E>,
    order: BTreeSet<(E::At, BlockKey)>,
    bytes: u64,
    deleting: FxHashSet<BlockKey>,
}

impl<E: LruEntry> Default for LruIndex<E> {
    fn default() -> Self {
        Self {
            map: FxHashMap::default(),
            order: BTreeSet::new(),
            bytes: 0,
            deleting: FxHashSet::default(),
        }
    }
}

impl<E: LruEntry> LruIndex<E> {
    /// An empty index.
    pub fn new() -> Self {
        Self::default()
    }

    /// Indexes `key` (replacing its entry, if any); returns the entry it replaced.
    pub fn insert(&mut self, key: BlockKey, e: E) -> Option<E> {
        let old = self.map.insert(key, e);
        if let Some(o) = &old {
            self.unlink(&key, o);
        }
        self.bytes += e.size();
        self.order.insert((e.at(), key));
        old
    }

    fn unlink(&mut self, key: &BlockKey, e: &E) {
        self.bytes -= e.size();
        self.order.remove(&(e.at(), *key));
    }

    /// Removes `key`'s entry; returns it.
    pub fn remove(&mut self, key: &BlockKey) -> Option<E> {
        let e = self.map.remove(key)?;
        self.unlink(key, &e);
        Some(e)
    }

    /// `key`'s entry.
    pub fn get(&self, key: &BlockKey) -> Option<&E> {
        self.map.get(key)
    }

    /// Whether `key` is indexed.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.map.contains_key(key)
    }

    /// Changes `key`'s entry in place (its size and recency included: the order and the
    /// total follow); returns what `f` returned, or `None` when `key` is not indexed.
    pub fn update<T>(&mut self, key: &BlockKey, f: impl FnOnce(&mut E) -> T) -> Option<T> {
        let e = self.map.get_mut(key)?;
        let before = *e;
        let out = f(e);
        let after = *e;
        if before.at() != after.at() {
            self.order.remove(&(before.at(), *key));
            self.order.insert((after.at(), *key));
        }
        self.bytes = self.bytes - before.size() + after.size();
        Some(out)
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
        self.map.iter()
    }

    /// Up to `n` entries, least recent first, after `after` (the last one a previous batch
    /// returned) or from the start: a range of the order, no sort.
    pub fn oldest(&self, after: Option<(E::At, BlockKey)>, n: usize) -> Vec<(E::At, BlockKey)> {
        let from = after.map_or(Bound::Unbounded, Bound::Excluded);
        self.order
            .range((from, Bound::Unbounded))
            .take(n)
            .copied()
            .collect()
    }

    /// How many entries are at `from` or more recent.
    pub fn count_from(&self, from: (E::At, BlockKey)) -> usize {
        self.order.range(from..).count()
    }

    /// The keys, least recent first.
    pub fn keys_by_recency(&self) -> impl Iterator<Item = BlockKey> + '_ {
        self.order.iter().map(|(_, k)| *k)
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
        idx.keys_by_recency().collect()
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
        assert_eq!(first, vec![(6, k(4)), (7, k(3))]);
        let next = idx.oldest(first.last().copied(), 2);
        assert_eq!(next, vec![(8, k(2)), (9, k(1))]);
        assert_eq!(idx.oldest(next.last().copied(), 2), vec![(10, k(0))]);
        assert_eq!(idx.count_from((8, k(2))), 3);
        assert_eq!(
            idx.count_from((8, k(3))),
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
}
