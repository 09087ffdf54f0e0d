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

use hashbrown::HashTable;
use rustc_hash::{FxHashMap, FxHashSet};

use crate::BlockKey;
use crate::key::mix_of;

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
/// chain's later block before its earlier one at equal recency), then by the key's 64-bit
/// digest (so ties go the same way whatever order the blocks were indexed in), then where
/// the index keeps the block (`pos`). A rank is a position: one kept after its block left
/// the index still says where a batch read on from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Rank<A> {
    /// Its recency: its own, or that of the later block of its chain that left last, if
    /// newer.
    pub at: A,
    /// Its position in its chain (0: a chain's first block, or a block with no link).
    pub depth: u32,
    /// The block.
    pub key: BlockKey,
    /// Where the index keeps the block: the last tie-break.
    pos: u32,
}

impl<A: Ord> Ord for Rank<A> {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.at
            .cmp(&o.at)
            .then(o.depth.cmp(&self.depth))
            .then(self.key.mix().cmp(&o.key.mix()))
            .then(self.pos.cmp(&o.pos))
            .then(self.key.cmp(&o.key))
    }
}

impl<A: Ord> PartialOrd for Rank<A> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

/// A tail's place in the order as the index keeps it (24 bytes for an `i64` recency, where
/// a [`Rank`] carries the whole key): ordered as [`Rank`] is. The digest is what keeps ties
/// independent of the order blocks were indexed in (a simulation with a frozen clock has
/// many, and its runs must repeat).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pos<A> {
    at: A,
    mix: u64,
    depth: u32,
    slot: u32,
}

impl<A: Ord> Ord for Pos<A> {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        self.at
            .cmp(&o.at)
            .then(o.depth.cmp(&self.depth))
            .then(self.mix.cmp(&o.mix))
            .then(self.slot.cmp(&o.slot))
    }
}

impl<A: Ord> PartialOrd for Pos<A> {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}

impl<A: Copy> Pos<A> {
    fn of(r: &Rank<A>) -> Self {
        Pos {
            at: r.at,
            mix: r.key.mix(),
            depth: r.depth,
            slot: r.pos,
        }
    }
}

/// No slot (a block with no parent).
const NONE: u32 = u32::MAX;
/// Hash bytes a node holds inline; longer hashes keep the rest in [`LruIndex::long`].
const INLINE: usize = 32;
/// The node is an indexed block (not a placeholder for a missing parent).
const PRESENT: u8 = 1;

/// One slot of the index: an indexed block, or a placeholder for a block that indexed
/// blocks are linked to and that is not indexed (it counts their waiting, and goes with the
/// last of them). A placeholder's `e` is a copy of its first follower's and is never read.
/// What a lookup compares comes first, then the entry, so most lookups read one or two
/// cache lines of it.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
struct Node<E: LruEntry> {
    hash: [u8; INLINE],
    group: u32,
    len: u8,
    flags: u8,
    e: E,
    /// The slot of the block it follows ([`NONE`]: none).
    parent: u32,
    depth: u32,
    /// Blocks linked to this one that are indexed (0: a tail, an eviction candidate).
    followers: u32,
    /// At most the least depth of a block that follows this one (`u32::MAX`: none yet).
    min_follower: u32,
}

impl<E: LruEntry> Node<E> {
    fn present(&self) -> bool {
        self.flags & PRESENT != 0
    }
}

/// Nodes by number, in chunks of [`CHUNK`]: growing never copies the nodes or holds twice
/// their room, as a doubling vector does (at most one chunk is not full).
#[derive(Debug)]
struct Nodes<T> {
    chunks: Vec<Vec<T>>,
    len: u32,
}

/// Nodes a chunk holds.
const CHUNK: u32 = 1 << 12;

impl<T> Default for Nodes<T> {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Nodes<T> {
    fn len(&self) -> u32 {
        self.len
    }

    fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn get(&self, s: u32) -> &T {
        &self.chunks[(s / CHUNK) as usize][(s % CHUNK) as usize]
    }

    fn get_mut(&mut self, s: u32) -> &mut T {
        &mut self.chunks[(s / CHUNK) as usize][(s % CHUNK) as usize]
    }

    /// Adds `n` as the next node; returns its number.
    fn push(&mut self, n: T) -> u32 {
        if self.len.is_multiple_of(CHUNK) {
            self.chunks.push(Vec::with_capacity(CHUNK as usize));
        }
        self.chunks.last_mut().expect("a chunk").push(n);
        self.len += 1;
        self.len - 1
    }

    /// Room for the list of chunks that `n` more nodes fill (the chunks come as they fill).
    fn reserve(&mut self, n: u32) {
        let want = (u64::from(self.len) + u64::from(n)).div_ceil(u64::from(CHUNK));
        self.chunks
            .reserve((want as usize).saturating_sub(self.chunks.len()));
    }
}

/// Blocks in recency order with their summed sizes, their chains, and the keys being
/// deleted. See the [module docs](self).
///
/// Its blocks live in chunks of nodes of 56 bytes plus the entry (the key's first 32
/// hash bytes inline, chain links as node numbers), found through a table of 4-byte node
/// numbers, with the eviction order a set of 24-byte positions (for an `i64` recency).
#[derive(Debug)]
pub struct LruIndex<E: LruEntry> {
    nodes: Nodes<Node<E>>,
    /// Free node numbers, reused first.
    free: Vec<u32>,
    /// Node numbers of the indexed blocks and placeholders, by key.
    table: HashTable<u32>,
    /// Bytes 32.. of hashes longer than [`INLINE`], per node.
    long: FxHashMap<u32, [u8; INLINE]>,
    /// Recency a tail inherited from the later block of its chain that left last, where
    /// newer than its own, per node: only nodes that were a chain's
    /// tail when its later block left hold one (a node linked again since keeps it), so this
    /// stays small beside the nodes.
    inherited: FxHashMap<u32, E::At>,
    /// The tails (blocks no indexed block follows), in eviction order.
    order: BTreeSet<Pos<E::At>>,
    len: usize,
    bytes: u64,
    deleting: FxHashSet<BlockKey>,
}

impl<E: LruEntry> Default for LruIndex<E> {
    fn default() -> Self {
        Self {
            nodes: Nodes::default(),
            free: Vec::new(),
            table: HashTable::new(),
            long: FxHashMap::default(),
            inherited: FxHashMap::default(),
            order: BTreeSet::new(),
            len: 0,
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

    fn node(&self, s: u32) -> &Node<E> {
        self.nodes.get(s)
    }

    fn node_mut(&mut self, s: u32) -> &mut Node<E> {
        self.nodes.get_mut(s)
    }

    /// Node `s`'s place in recency: its entry's, or what it inherited where newer.
    fn at_of(&self, s: u32) -> E::At {
        let own = self.node(s).e.at();
        if self.inherited.is_empty() {
            return own;
        }
        match self.inherited.get(&s) {
            Some(&i) if i > own => i,
            _ => own,
        }
    }

    /// Node `s` inherits no recency (any more).
    fn clear_inherited(&mut self, s: u32) {
        self.inherited.remove(&s);
    }

    /// What `f` makes of node `s`'s whole hash bytes and group (the part past [`INLINE`]
    /// joined back from [`LruIndex::long`]).
    fn with_hash<T>(
        nodes: &Nodes<Node<E>>,
        long: &FxHashMap<u32, [u8; INLINE]>,
        s: u32,
        f: impl FnOnce(&[u8], u32) -> T,
    ) -> T {
        let n = nodes.get(s);
        let len = n.len as usize;
        if len <= INLINE {
            return f(&n.hash[..len], n.group);
        }
        let mut b = [0u8; 2 * INLINE];
        b[..INLINE].copy_from_slice(&n.hash);
        b[INLINE..len].copy_from_slice(&long[&s][..len - INLINE]);
        f(&b[..len], n.group)
    }

    /// The key of node `s`.
    fn key_of(&self, s: u32) -> BlockKey {
        Self::with_hash(&self.nodes, &self.long, s, |h, g| {
            BlockKey::new(h, g).expect("a key the index was given")
        })
    }

    /// The hash the table files node `s` under: the key's own digest.
    fn mix_of_node(nodes: &Nodes<Node<E>>, long: &FxHashMap<u32, [u8; INLINE]>, s: u32) -> u64 {
        Self::with_hash(nodes, long, s, mix_of)
    }

    /// The nodes of indexed blocks (not placeholders, not free), in node order.
    fn present_slots(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.nodes.len()).filter(|&s| self.node(s).present())
    }

    fn is_key_in(
        nodes: &Nodes<Node<E>>,
        long: &FxHashMap<u32, [u8; INLINE]>,
        s: u32,
        key: &BlockKey,
    ) -> bool {
        let n = nodes.get(s);
        let h = key.hash_bytes();
        if n.group != key.group() || n.len as usize != h.len() {
            return false;
        }
        if h.len() <= INLINE {
            return n.hash[..h.len()] == *h;
        }
        n.hash[..] == h[..INLINE] && long[&s][..h.len() - INLINE] == h[INLINE..]
    }

    /// The node of `key` (an indexed block or a placeholder).
    fn find(&self, key: &BlockKey) -> Option<u32> {
        self.table
            .find(key.mix(), |&s| {
                Self::is_key_in(&self.nodes, &self.long, s, key)
            })
            .copied()
    }

    /// The node of indexed block `key`.
    fn find_present(&self, key: &BlockKey) -> Option<u32> {
        self.find(key).filter(|&s| self.node(s).present())
    }

    /// A new node for `key` (in the table, not in the order yet).
    fn alloc(&mut self, key: &BlockKey, e: E, flags: u8) -> u32 {
        let s = self.new_node(key, e, flags);
        let (nodes, long) = (&self.nodes, &self.long);
        self.table
            .insert_unique(key.mix(), s, |&t| Self::mix_of_node(nodes, long, t));
        s
    }

    /// A new node for `key`, in no table or order yet.
    fn new_node(&mut self, key: &BlockKey, e: E, flags: u8) -> u32 {
        let h = key.hash_bytes();
        let mut hash = [0u8; INLINE];
        let inline = h.len().min(INLINE);
        hash[..inline].copy_from_slice(&h[..inline]);
        let n = Node {
            e,
            hash,
            group: key.group(),
            parent: NONE,
            depth: 0,
            followers: 0,
            min_follower: u32::MAX,
            len: h.len() as u8,
            flags,
        };
        let s = match self.free.pop() {
            Some(s) => {
                *self.nodes.get_mut(s) = n;
                s
            }
            None => {
                assert!(self.nodes.len() < NONE, "an index of 2^32 - 1 blocks");
                self.nodes.push(n)
            }
        };
        if h.len() > INLINE {
            let mut rest = [0u8; INLINE];
            rest[..h.len() - INLINE].copy_from_slice(&h[INLINE..]);
            self.long.insert(s, rest);
        }
        s
    }

    /// Frees node `s` (indexed no more, and nothing waits on it).
    fn release(&mut self, s: u32) {
        let mix = Self::mix_of_node(&self.nodes, &self.long, s);
        if let Ok(entry) = self.table.find_entry(mix, |&t| t == s) {
            entry.remove();
        }
        self.long.remove(&s);
        self.clear_inherited(s);
        self.node_mut(s).flags = 0;
        self.free.push(s);
    }

    fn pos_of(&self, s: u32) -> Pos<E::At> {
        let n = self.node(s);
        Pos {
            at: self.at_of(s),
            mix: Self::mix_of_node(&self.nodes, &self.long, s),
            depth: n.depth,
            slot: s,
        }
    }

    fn rank_at(&self, p: Pos<E::At>) -> Rank<E::At> {
        Rank {
            at: p.at,
            depth: p.depth,
            key: self.key_of(p.slot),
            pos: p.slot,
        }
    }

    /// Indexes `key` (replacing its entry, if any: its links stay); returns the entry it
    /// replaced. A new block that blocks linked earlier follow is not a tail.
    pub fn insert(&mut self, key: BlockKey, e: E) -> Option<E> {
        match self.find(&key) {
            Some(s) if self.node(s).present() => {
                let n = *self.node(s);
                if n.followers == 0 {
                    self.order.remove(&self.pos_of(s));
                }
                self.node_mut(s).e = e;
                self.bytes = self.bytes - n.e.size() + e.size();
                if n.followers == 0 {
                    self.order.insert(self.pos_of(s));
                }
                Some(n.e)
            }
            Some(s) => {
                // a placeholder: the blocks waiting on it follow it now
                self.clear_inherited(s);
                let n = self.node_mut(s);
                n.e = e;
                n.flags = PRESENT;
                n.parent = NONE;
                n.depth = 0;
                self.len += 1;
                self.bytes += e.size();
                None
            }
            None => {
                let s = self.alloc(&key, e, PRESENT);
                self.len += 1;
                self.bytes += e.size();
                self.order.insert(self.pos_of(s));
                None
            }
        }
    }

    /// Indexes many blocks into an empty index, least recent first, with links given as
    /// positions in `entries` (follower, parent, depth; applied as [`LruIndex::link`] applies
    /// them, in the order given): the order is built once at the end, in full nodes.
    /// Into an index that is not empty, it inserts and links one by one.
    pub fn load(&mut self, entries: &[(BlockKey, E)], links: &[(u32, u32, u32)]) {
        let mut l = self.loader(entries.len());
        for (k, e) in entries {
            l.add(*k, *e);
        }
        for &(c, p, d) in links {
            l.link(c, p, d);
        }
    }

    /// A [`Loader`] of blocks into this index, for `n` of them (a hint: room is made for
    /// that many).
    pub fn loader(&mut self, n: usize) -> Loader<'_, E> {
        let bulk = self.is_empty() && self.order.is_empty() && self.nodes.is_empty();
        if bulk {
            self.reserve(n);
        }
        Loader {
            idx: self,
            bulk,
            slots: Vec::with_capacity(n),
            links: Vec::new(),
        }
    }

    /// [`Loader::add`] into an empty index: one probe of the table, no order yet.
    fn bulk_add(&mut self, k: BlockKey, e: E) -> (u32, bool) {
        let (nodes, long) = (&self.nodes, &self.long);
        let next = nodes.len();
        let found = match self.table.entry(
            k.mix(),
            |&s| Self::is_key_in(nodes, long, s, &k),
            |&t| Self::mix_of_node(nodes, long, t),
        ) {
            hashbrown::hash_table::Entry::Occupied(o) => Some(*o.get()),
            hashbrown::hash_table::Entry::Vacant(v) => {
                v.insert(next);
                None
            }
        };
        match found {
            Some(s) => {
                let old = self.node(s).e.size();
                self.node_mut(s).e = e;
                self.bytes = self.bytes - old + e.size();
                (s, false)
            }
            None => {
                self.len += 1;
                self.bytes += e.size();
                let s = self.new_node(&k, e, PRESENT);
                debug_assert_eq!(s, next, "an empty index has no free node");
                (s, true)
            }
        }
    }

    /// Links indexed block `key` to the block it follows in its chain, at `depth` (its
    /// position, at least 1; taken as one past an indexed parent's where that is more).
    /// Returns whether the link holds: a block already linked keeps its link, and a link whose
    /// depths contradict what is known (`key` not shallower than a block that follows it) is
    /// refused, so links never form a cycle whatever the caller passes.
    pub fn link(&mut self, key: &BlockKey, parent: BlockKey, depth: u32) -> bool {
        let Some(s) = self.find_present(key) else {
            return false;
        };
        let n = *self.node(s);
        if n.parent != NONE || parent == *key || depth == 0 {
            return n.parent != NONE && self.find(&parent) == Some(n.parent);
        }
        let p = match self.find(&parent) {
            Some(p) => p,
            None => {
                // a placeholder counts the blocks waiting on a block not indexed
                let p = self.alloc(&parent, n.e, 0);
                if !self.link_slots(s, p, depth, true) {
                    self.release(p);
                    return false;
                }
                return true;
            }
        };
        self.link_slots(s, p, depth, true)
    }

    /// [`LruIndex::link`] of node `s` to node `p` (an indexed block or a placeholder), the
    /// order kept up to date when `ordered`.
    fn link_slots(&mut self, s: u32, p: u32, depth: u32, ordered: bool) -> bool {
        let n = *self.node(s);
        if n.parent != NONE || s == p || depth == 0 {
            return n.parent == p;
        }
        if n.followers > 0 && n.min_follower <= depth {
            return false;
        }
        let pn = *self.node(p);
        // below an indexed parent, one deeper than it at least
        let depth = if pn.present() {
            depth.max(pn.depth.saturating_add(1))
        } else {
            depth
        };
        if n.followers > 0 && n.min_follower <= depth {
            return false;
        }
        if pn.present() && pn.depth >= depth {
            return false;
        }
        if pn.present() && pn.followers == 0 && ordered {
            self.order.remove(&self.pos_of(p));
        }
        let pm = self.node_mut(p);
        pm.followers += 1;
        pm.min_follower = pm.min_follower.min(depth);
        if n.followers == 0 && ordered {
            self.order.remove(&self.pos_of(s));
        }
        let m = self.node_mut(s);
        m.parent = p;
        m.depth = depth;
        if n.followers == 0 && ordered {
            self.order.insert(self.pos_of(s));
        }
        true
    }

    /// Removes `key`'s entry; returns it. Its parent becomes a tail when `key` was its last
    /// follower, with `key`'s recency if newer than its own.
    pub fn remove(&mut self, key: &BlockKey) -> Option<E> {
        let s = self.find_present(key)?;
        let n = *self.node(s);
        let at = self.at_of(s);
        self.bytes -= n.e.size();
        self.len -= 1;
        if n.followers == 0 {
            self.order.remove(&self.pos_of(s));
            self.release(s);
        } else {
            // a placeholder now: its followers wait for it again (their chain is broken
            // until it is back)
            self.clear_inherited(s);
            let m = self.node_mut(s);
            m.flags = 0;
            m.parent = NONE;
        }
        if n.parent != NONE {
            let p = n.parent;
            let pn = self.node_mut(p);
            pn.followers -= 1;
            if pn.followers == 0 {
                if pn.present() {
                    if at > self.at_of(p) {
                        self.inherited.insert(p, at);
                    }
                    self.order.insert(self.pos_of(p));
                } else {
                    self.release(p);
                }
            }
        }
        Some(n.e)
    }

    /// `key`'s entry.
    pub fn get(&self, key: &BlockKey) -> Option<&E> {
        self.find_present(key).map(|s| &self.node(s).e)
    }

    /// Whether `key` is indexed.
    pub fn contains(&self, key: &BlockKey) -> bool {
        self.find_present(key).is_some()
    }

    /// Changes `key`'s entry in place (its size and recency included: the order and the
    /// total follow); returns what `f` returned, or `None` when `key` is not indexed.
    pub fn update<T>(&mut self, key: &BlockKey, f: impl FnOnce(&mut E) -> T) -> Option<T> {
        let s = self.find_present(key)?;
        let at0 = self.at_of(s);
        let n = self.node_mut(s);
        let (tail, size0) = (n.followers == 0, n.e.size());
        let out = f(&mut n.e);
        let (depth, size1) = (n.depth, n.e.size());
        let at1 = self.at_of(s);
        if tail && at0 != at1 {
            let was = Pos {
                at: at0,
                mix: key.mix(),
                depth,
                slot: s,
            };
            self.order.remove(&was);
            self.order.insert(Pos { at: at1, ..was });
        }
        self.bytes = self.bytes - size0 + size1;
        Some(out)
    }

    /// Makes room for `n` more entries (before a bulk insert).
    pub fn reserve(&mut self, n: usize) {
        self.nodes
            .reserve(n.saturating_sub(self.free.len()).min(u32::MAX as usize) as u32);
        let (nodes, long) = (&self.nodes, &self.long);
        self.table
            .reserve(n, |&t| Self::mix_of_node(nodes, long, t));
    }

    /// Entries indexed.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is indexed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The sum of the entries' sizes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Every entry, in no order.
    pub fn iter(&self) -> impl Iterator<Item = (BlockKey, &E)> {
        self.present_slots()
            .map(|s| (self.key_of(s), &self.node(s).e))
    }

    /// Every entry with its chain link (the block it follows and its depth, as
    /// [`LruIndex::chain_link`] gives it), in no order: one pass, no lookup per entry.
    pub fn iter_linked(&self) -> impl Iterator<Item = (BlockKey, &E, Option<(BlockKey, u32)>)> {
        self.present_slots().map(|s| {
            let n = self.node(s);
            let link = (n.parent != NONE).then(|| (self.key_of(n.parent), n.depth));
            (self.key_of(s), &n.e, link)
        })
    }

    /// Up to `n` eviction candidates (chain tails), first to go first, after `after` (the
    /// last one a previous batch returned) or from the start: a range of the order, no sort.
    pub fn oldest(&self, after: Option<Rank<E::At>>, n: usize) -> Vec<Rank<E::At>> {
        self.oldest_from(after.map_or(Bound::Unbounded, Bound::Excluded), n)
    }

    /// Up to `n` eviction candidates from `from` on.
    pub fn oldest_from(&self, from: Bound<Rank<E::At>>, n: usize) -> Vec<Rank<E::At>> {
        self.order
            .range((from.map(|r| Pos::of(&r)), Bound::Unbounded))
            .take(n)
            .map(|p| self.rank_at(*p))
            .collect()
    }

    /// How many candidates are at `from` or later in the order.
    pub fn count_from(&self, from: Rank<E::At>) -> usize {
        self.order.range(Pos::of(&from)..).count()
    }

    /// `key`'s place in the eviction order, if it is a candidate (a chain tail).
    pub fn rank(&self, key: &BlockKey) -> Option<Rank<E::At>> {
        let s = self.find_present(key)?;
        (self.node(s).followers == 0).then(|| Rank {
            at: self.at_of(s),
            depth: self.node(s).depth,
            key: *key,
            pos: s,
        })
    }

    /// `key`'s recency, if indexed: its entry's, or what it inherited from a later block of
    /// its chain where that is newer (what it ranks by while it is a tail).
    pub fn recency(&self, key: &BlockKey) -> Option<E::At> {
        self.find_present(key).map(|s| self.at_of(s))
    }

    /// The block `key` follows, if linked.
    pub fn parent(&self, key: &BlockKey) -> Option<BlockKey> {
        self.chain_link(key).map(|(p, _)| p)
    }

    /// The block `key` follows and `key`'s depth, if linked: what [`LruIndex::link`] takes to
    /// link it again (in another index, or after a restart).
    pub fn chain_link(&self, key: &BlockKey) -> Option<(BlockKey, u32)> {
        let n = self.node(self.find_present(key)?);
        (n.parent != NONE).then(|| (self.key_of(n.parent), n.depth))
    }

    /// Every key, least recent first by its own recency (a sort of the whole index: for a
    /// snapshot, not for a sweep).
    pub fn keys_by_recency(&self) -> Vec<BlockKey> {
        let mut v: Vec<(E::At, u32)> = self
            .present_slots()
            .map(|s| (self.node(s).e.at(), s))
            .collect();
        v.sort_unstable();
        v.into_iter().map(|(_, s)| self.key_of(s)).collect()
    }

    /// Bytes of blocks whose chain is broken before them: linked to a parent that is not
    /// indexed, or following such a block. A prefix lookup cannot reach them through this
    /// index. One pass over the index (memoized per chain).
    pub fn dead_bytes(&self) -> u64 {
        // per node: 0 not known yet, 1 its chain is whole, 2 broken
        let mut verdict = vec![0u8; self.nodes.len() as usize];
        let mut total = 0;
        let mut path = Vec::new();
        for s in self.present_slots() {
            let n = self.node(s);
            // walk up to a known answer, a chain's first block or a missing parent
            path.clear();
            let mut cur = s;
            let v = loop {
                if verdict[cur as usize] != 0 {
                    break verdict[cur as usize];
                }
                path.push(cur);
                let c = self.node(cur);
                match c.parent {
                    NONE => break 1,
                    p if !self.node(p).present() => break 2,
                    // links never form a cycle (depths decrease): this ends
                    p => cur = p,
                }
            };
            for c in &path {
                verdict[*c as usize] = v;
            }
            if v == 2 {
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

/// Blocks given one by one to an index, least recent first (as a checkpoint holds them),
/// with their chain links by position: into an empty index the order is built once, when the
/// loader drops, in full nodes, and links to blocks given later are fine; into an index that
/// holds blocks each is an insert, and the links are applied at the drop too. Nothing is held
/// per block but its node number (and a link's three numbers) until then.
#[derive(Debug)]
pub struct Loader<'a, E: LruEntry> {
    idx: &'a mut LruIndex<E>,
    bulk: bool,
    /// The node of each block given, by position.
    slots: Vec<u32>,
    links: Vec<(u32, u32, u32)>,
}

impl<E: LruEntry> Loader<'_, E> {
    /// Indexes `key` (the same key again replaces its entry, as [`LruIndex::insert`] does);
    /// returns whether it was not indexed before.
    pub fn add(&mut self, key: BlockKey, e: E) -> bool {
        let (s, new) = if self.bulk {
            self.idx.bulk_add(key, e)
        } else {
            let new = self.idx.insert(key, e).is_none();
            (self.idx.find_present(&key).expect("inserted"), new)
        };
        self.slots.push(s);
        new
    }

    /// The block given at position `follower` follows the one at `parent`, at `depth` (as
    /// [`LruIndex::link`]); either may be given later. Positions never given are ignored.
    pub fn link(&mut self, follower: u32, parent: u32, depth: u32) {
        self.links.push((follower, parent, depth));
    }

    /// Makes room for `n` more blocks (when the count was not known at
    /// [`LruIndex::loader`]).
    pub fn reserve(&mut self, n: usize) {
        if self.bulk {
            self.idx.reserve(n);
        }
        self.slots.reserve(n);
    }

    /// How many blocks were given.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether none was given.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

impl<E: LruEntry> Drop for Loader<'_, E> {
    fn drop(&mut self) {
        let idx = &mut *self.idx;
        for &(c, p, d) in &self.links {
            if let (Some(&c), Some(&p)) = (self.slots.get(c as usize), self.slots.get(p as usize)) {
                idx.link_slots(c, p, d, !self.bulk);
            }
        }
        if self.bulk {
            let tails: Vec<Pos<E::At>> = idx
                .present_slots()
                .filter(|&s| idx.node(s).followers == 0)
                .map(|s| idx.pos_of(s))
                .collect();
            idx.order = tails.into_iter().collect();
        }
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
        let r2 = idx.rank(&k(2)).unwrap();
        assert_eq!(idx.count_from(r2), 3);
        // a rank is a position: kept after its block left, it still counts what follows
        idx.remove(&k(2));
        assert_eq!(
            idx.count_from(r2),
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

    /// `iter_linked` gives every entry once with the link `chain_link` gives it.
    #[test]
    fn iter_linked_is_iter_with_chain_link() {
        let mut idx = LruIndex::new();
        for i in 0..6u8 {
            idx.insert(
                mixed(i),
                Slot {
                    size: 1,
                    at: i as i64,
                },
            );
        }
        idx.link(&mixed(1), mixed(0), 1);
        idx.link(&mixed(2), mixed(1), 2);
        idx.link(&mixed(4), mixed(9), 3); // a parent not indexed
        let mut got: Vec<_> = idx.iter_linked().map(|(k, e, l)| (k, *e, l)).collect();
        let mut want: Vec<_> = idx
            .iter()
            .map(|(k, e)| (k, *e, idx.chain_link(&k)))
            .collect();
        got.sort_by_key(|x| x.0);
        want.sort_by_key(|x| x.0);
        assert_eq!(got, want);
        assert_eq!(got.iter().filter(|x| x.2.is_some()).count(), 3);
    }

    /// A node is 56 bytes plus its entry, and a place in the order 24 bytes (the type's
    /// doc says so).
    #[test]
    fn a_node_is_56_bytes_plus_its_entry() {
        assert_eq!(
            std::mem::size_of::<Node<E>>(),
            56 + std::mem::size_of::<E>()
        );
        assert_eq!(std::mem::size_of::<Pos<i64>>(), 24);
    }

    /// A tail that inherited a newer recency from its chain keeps it (its place in the order)
    /// while it stays, and the index forgets it with the node: once the chain is gone, nothing
    /// of it is held.
    #[test]
    fn inherited_recency_lives_as_long_as_its_node() {
        let mut idx = LruIndex::new();
        for (i, at) in [(1u8, 1i64), (2, 5), (3, 9)] {
            idx.insert(k(i), Slot { size: 1, at });
        }
        idx.insert(k(4), Slot { size: 1, at: 3 });
        assert!(idx.link(&k(2), k(1), 1) && idx.link(&k(3), k(2), 2));
        idx.remove(&k(3)); // k(2) is the tail now, as recent as k(3) was
        assert_eq!(idx.rank(&k(2)).map(|r| r.at), Some(9));
        assert_eq!(ranks(idx.oldest(None, 9)), vec![(3, k(4)), (9, k(2))]);
        assert_eq!(idx.inherited.len(), 1);
        // a stamp older than what it inherited does not age it
        idx.update(&k(2), |e| e.at = 7);
        assert_eq!(idx.rank(&k(2)).map(|r| r.at), Some(9));
        idx.remove(&k(2));
        assert_eq!(idx.rank(&k(1)).map(|r| r.at), Some(9));
        idx.remove(&k(1));
        assert!(idx.inherited.is_empty(), "{:?}", idx.inherited);
        // a block with followers that leaves is a placeholder: it holds no inherited time
        for (i, at) in [(1u8, 1i64), (2, 5), (3, 9)] {
            idx.insert(k(i), Slot { size: 1, at });
        }
        assert!(idx.link(&k(2), k(1), 1) && idx.link(&k(3), k(2), 2));
        idx.remove(&k(3)); // k(2) inherits
        idx.insert(k(5), Slot { size: 1, at: 10 });
        assert!(idx.link(&k(5), k(2), 2));
        idx.remove(&k(2)); // a placeholder k(5) waits on; k(1) a tail that inherits
        assert_eq!(idx.rank(&k(1)).map(|r| r.at), Some(9));
        assert_eq!(idx.inherited.len(), 1, "{:?}", idx.inherited);
        idx.remove(&k(5));
        idx.remove(&k(1));
        assert!(idx.inherited.is_empty());
        assert_eq!(idx.len(), 1); // k(4)
    }

    /// Keys of three hash lengths: inline (32 bytes), shorter, and longer than a node holds
    /// inline (the rest kept aside); two keys differing only past byte 32 or by group.
    fn mixed(i: u8) -> BlockKey {
        match i % 4 {
            0 => k(i),
            1 => BlockKey::new(&[i; 5], 1).unwrap(),
            2 => BlockKey::new(&[i % 8; 48], 0).unwrap(),
            _ => {
                let mut h = [i % 8; 48];
                h[47] = i;
                BlockKey::new(&h, 0).unwrap()
            }
        }
    }

    /// Nodes that stand for a missing parent.
    fn placeholders(idx: &LruIndex<E>) -> usize {
        let free: FxHashSet<u32> = idx.free.iter().copied().collect();
        (0..idx.nodes.len())
            .filter(|s| !free.contains(s) && !idx.node(*s).present())
            .count()
    }

    /// Each node's follower count is the number of indexed blocks linked to it, a missing
    /// parent has a placeholder exactly while blocks are linked to it, the candidates are
    /// exactly the blocks nothing follows, and the table, the totals and the free list
    /// agree with the nodes.
    fn check_counts(idx: &LruIndex<E>) {
        let free: FxHashSet<u32> = idx.free.iter().copied().collect();
        assert_eq!(free.len(), idx.free.len(), "a node freed twice");
        let live: Vec<u32> = (0..idx.nodes.len()).filter(|s| !free.contains(s)).collect();
        let mut followers: FxHashMap<u32, u32> = FxHashMap::default();
        for &s in &live {
            let n = idx.node(s);
            if n.present() && n.parent != NONE {
                assert!(!free.contains(&n.parent), "a link to a freed node");
                *followers.entry(n.parent).or_default() += 1;
            }
        }
        let (mut len, mut bytes) = (0, 0);
        for &s in &live {
            let n = idx.node(s);
            assert_eq!(n.followers, followers.get(&s).copied().unwrap_or(0));
            let key = idx.key_of(s);
            assert_eq!(idx.find(&key), Some(s), "the table finds every node");
            if n.present() {
                len += 1;
                bytes += n.e.size();
                assert_eq!(n.followers == 0, idx.order.contains(&idx.pos_of(s)));
            } else {
                assert!(n.followers > 0, "a placeholder nothing waits on");
                assert_eq!(n.parent, NONE);
            }
        }
        assert_eq!(idx.table.len(), live.len());
        assert_eq!((idx.len(), idx.bytes()), (len, bytes));
        assert_eq!(
            idx.order.len(),
            live.iter()
                .filter(|s| idx.node(**s).present() && idx.node(**s).followers == 0)
                .count()
        );
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
        assert_eq!(placeholders(&idx), 0, "nothing waits on a missing block");
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

    /// A bulk load is the inserts and links it stands for, one by one: the same candidates
    /// in the same order, totals, links and dead bytes, also for a key given twice, links
    /// the rules refuse, and a parent that is not loaded.
    #[test]
    fn a_load_is_its_inserts_and_links_one_by_one() {
        let entries: Vec<(BlockKey, E)> = (0..40u8)
            .map(|i| {
                (
                    mixed(i % 37),
                    Slot {
                        size: 1 + i as u64,
                        at: (i / 3) as i64,
                    },
                )
            })
            .collect();
        let links: Vec<(u32, u32, u32)> = vec![
            (1, 0, 1),
            (2, 1, 2),
            (3, 2, 1), // below its parent's depth: taken one deeper
            (0, 3, 9), // would close a cycle: refused
            (5, 4, 1),
            (6, 4, 1),  // a second follower of 4
            (7, 99, 3), // no such entry: ignored
            (8, 8, 1),  // itself
            (9, 38, 4), // 38 is the same key as 1 (37 + 1 wraps)
        ];
        let mut bulk = LruIndex::new();
        bulk.load(&entries, &links);
        let mut one = LruIndex::new();
        for (k, e) in &entries {
            one.insert(*k, *e);
        }
        for &(c, p, d) in &links {
            if let (Some(c), Some(p)) = (entries.get(c as usize), entries.get(p as usize)) {
                one.link(&c.0, p.0, d);
            }
        }
        check_counts(&bulk);
        let ranks = |i: &LruIndex<E>| -> Vec<(i64, u32, BlockKey)> {
            i.oldest(None, usize::MAX)
                .into_iter()
                .map(|r| (r.at, r.depth, r.key))
                .collect()
        };
        assert_eq!(ranks(&bulk), ranks(&one));
        assert_eq!((bulk.len(), bulk.bytes()), (one.len(), one.bytes()));
        assert_eq!(bulk.dead_bytes(), one.dead_bytes());
        for (k, _) in &entries {
            assert_eq!(bulk.chain_link(k), one.chain_link(k), "{k}");
        }
        // into an index that holds something, the same again
        let mut more = LruIndex::new();
        more.insert(k(200), Slot { size: 1, at: 0 });
        more.load(&entries, &links);
        check_counts(&more);
        assert_eq!(more.len(), one.len() + 1);
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
                let a = mixed(rnd(24) as u8);
                match rnd(5) {
                    0 | 1 => {
                        idx.insert(a, Slot { size: 1, at: step });
                    }
                    2 => {
                        let p = mixed(rnd(24) as u8);
                        idx.link(&a, p, 1 + rnd(30) as u32);
                    }
                    3 => {
                        idx.remove(&a);
                    }
                    _ => {
                        idx.update(&a, |e| e.at = step);
                    }
                }
                check_counts(&idx);
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
