//! The eviction order over resident (Ready) blocks. LRU and ARC keep intrusive
//! doubly-linked lists over slot indices, so touch, insert and remove are O(1); chain
//! eviction keeps core's [`LruIndex`] (the order the fs and obj tiers evict in), whose
//! operations are O(log n).

use std::collections::VecDeque;

use kv_tier_core::lru::{LruIndex, Slot};
use kv_tier_core::{BlockKey, EvictionPolicy};
use rustc_hash::FxHashMap;

const NIL: u32 = u32::MAX;

/// prev/next links shared by the lists of a policy (a slot is in at most one list).
struct Links {
    prev: Vec<u32>,
    next: Vec<u32>,
}

#[derive(Default, Clone, Copy)]
struct List {
    head: u32, // least recent
    tail: u32, // most recent
    len: usize,
}

impl List {
    fn new() -> Self {
        Self {
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    fn push_back(&mut self, l: &mut Links, s: u32) {
        l.prev[s as usize] = self.tail;
        l.next[s as usize] = NIL;
        if self.tail != NIL {
            l.next[self.tail as usize] = s;
        } else {
            self.head = s;
        }
        self.tail = s;
        self.len += 1;
    }

    fn unlink(&mut self, l: &mut Links, s: u32) {
        let (p, n) = (l.prev[s as usize], l.next[s as usize]);
        if p != NIL {
            l.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            l.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.len -= 1;
    }

    fn iter<'a>(&self, l: &'a Links) -> impl Iterator<Item = u32> + 'a {
        let mut cur = self.head;
        std::iter::from_fn(move || {
            if cur == NIL {
                None
            } else {
                let s = cur;
                cur = l.next[s as usize];
                Some(s)
            }
        })
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Where {
    None,
    T1,
    T2,
}

/// Ghost keys (recently evicted, not resident), FIFO-bounded.
#[derive(Default)]
struct Ghost {
    order: VecDeque<(BlockKey, u64)>,
    member: FxHashMap<BlockKey, u64>,
    seq: u64,
}

impl Ghost {
    fn len(&self) -> usize {
        self.member.len()
    }
    fn remove(&mut self, k: &BlockKey) -> bool {
        self.member.remove(k).is_some()
    }
    fn push(&mut self, k: BlockKey, cap: usize) {
        self.seq += 1;
        self.member.insert(k, self.seq);
        self.order.push_back((k, self.seq));
        while self.member.len() > cap {
            self.pop_oldest();
        }
        if self.order.len() > 2 * cap + 64 {
            let member = &self.member;
            self.order.retain(|(k, s)| member.get(k) == Some(s));
        }
    }
    fn pop_oldest(&mut self) {
        while let Some((k, s)) = self.order.pop_front() {
            if self.member.get(&k) == Some(&s) {
                self.member.remove(&k);
                return;
            }
        }
    }
    fn clear(&mut self) {
        self.order.clear();
        self.member.clear();
    }
}

/// A block taken out of a [`LruIndex`] with its entry and its link, to put back as it was.
type Taken = (BlockKey, Slot<u64>, Option<(BlockKey, u32)>);

/// Candidates read from the chain order at a time.
const BATCH: usize = 32;

/// The eviction order of a DRAM tier's readable blocks.
pub(crate) enum Order {
    /// LRU or ARC over slot numbers.
    Lists(Policy),
    /// Least recent chain tail first: a block goes once no later block of its chain is
    /// readable here. Recency is a tick of this tier's, one per insert and per touch, so no
    /// two blocks tie.
    Chain { idx: LruIndex<Slot<u64>>, tick: u64 },
}

impl Order {
    pub(crate) fn new(n_slots: usize, policy: EvictionPolicy) -> Self {
        match policy {
            EvictionPolicy::Lru => Order::Lists(Policy::new(n_slots, false)),
            EvictionPolicy::Arc => Order::Lists(Policy::new(n_slots, true)),
            EvictionPolicy::Chain => Order::Chain {
                idx: LruIndex::new(),
                tick: 0,
            },
        }
    }

    /// `key` became readable in `slot`: the most recent.
    pub(crate) fn insert(&mut self, slot: usize, key: &BlockKey) {
        match self {
            Order::Lists(p) => p.insert(slot, key),
            Order::Chain { idx, tick } => {
                *tick += 1;
                idx.insert(*key, Slot { size: 1, at: *tick });
            }
        }
    }

    /// `key` (in `slot`) was used: the most recent (ARC: promoted to the frequent list).
    pub(crate) fn touch(&mut self, slot: usize, key: &BlockKey) {
        match self {
            Order::Lists(p) => p.touch(slot),
            Order::Chain { idx, tick } => {
                *tick += 1;
                let t = *tick;
                idx.update(key, |e| e.at = t);
            }
        }
    }

    /// Readable `key` follows `parent` in its chain, at `depth`: it goes before `parent`.
    /// Ignored by LRU and ARC (see [`LruIndex::link`] for the links refused).
    pub(crate) fn link(&mut self, key: &BlockKey, parent: BlockKey, depth: u32) {
        if let Order::Chain { idx, .. } = self {
            idx.link(key, parent, depth);
        }
    }

    /// `key` (in `slot`) leaves without being evicted (a reset).
    pub(crate) fn remove(&mut self, slot: usize, key: &BlockKey) {
        match self {
            Order::Lists(p) => p.remove(slot, key, false),
            Order::Chain { idx, .. } => {
                idx.remove(key);
            }
        }
    }

    /// Takes `n` victims out of the order, first to go first, among the blocks that may go
    /// (`evictable(slot)`: the key in the slot, if it may; `slot_of` says where a key is), and
    /// returns their slots; with fewer than `n` evictable, takes none and returns `None`.
    ///
    /// Over chains, a block goes once the later blocks of its chain have gone (taking a tail
    /// makes its parent a tail, which may go next). Only when no evictable tail is left does
    /// an earlier block go before a later one that cannot (pinned, or of the store making
    /// the room), least recent by its own use first.
    pub(crate) fn take_victims(
        &mut self,
        n: usize,
        slot_of: impl Fn(&BlockKey) -> usize,
        evictable: impl Fn(usize) -> Option<BlockKey>,
    ) -> Option<Vec<usize>> {
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return Some(out);
        }
        let idx = match self {
            Order::Lists(p) => {
                let v = p.victims(n, |s| evictable(s).is_some())?;
                for &s in &v {
                    if let Some(k) = evictable(s) {
                        p.remove(s, &k, true);
                    }
                }
                return Some(v);
            }
            Order::Chain { idx, .. } => idx,
        };
        // what went, to put back as it was if the room cannot be made
        let mut taken: Vec<Taken> = Vec::new();
        let mut take = |idx: &mut LruIndex<Slot<u64>>, key: BlockKey, out: &mut Vec<usize>| {
            let (link, at) = (idx.chain_link(&key), idx.recency(&key));
            if let Some(mut e) = idx.remove(&key) {
                // put back with what it inherited too (the removal forgets that)
                e.at = at.unwrap_or(e.at);
                taken.push((key, e, link));
                out.push(slot_of(&key));
            }
        };
        // tails, a batch at a time from where the last one ended: a parent made a tail by its
        // last follower's going ranks after that follower (as recent at least, shallower),
        // so what was passed over stays passed over, and the batch is read again from there
        let mut after = None;
        'tails: while out.len() < n {
            let batch = idx.oldest(after, BATCH);
            let Some(last) = batch.last().copied() else {
                break;
            };
            for r in batch {
                if evictable(slot_of(&r.key)).is_none() {
                    continue;
                }
                let parent = idx.parent(&r.key);
                take(idx, r.key, &mut out);
                if out.len() == n {
                    break 'tails;
                }
                if parent.is_some_and(|p| idx.rank(&p).is_some()) {
                    after = Some(r);
                    continue 'tails;
                }
            }
            after = Some(last);
        }
        if out.len() < n {
            for key in idx.keys_by_recency() {
                if evictable(slot_of(&key)).is_some() {
                    take(idx, key, &mut out);
                    if out.len() == n {
                        break;
                    }
                }
            }
        }
        if out.len() < n {
            for (key, e, link) in taken.into_iter().rev() {
                idx.insert(key, e);
                if let Some((parent, depth)) = link {
                    idx.link(&key, parent, depth);
                }
            }
            return None;
        }
        Some(out)
    }

    /// Forgets everything (ARC's ghosts included).
    pub(crate) fn clear(&mut self) {
        match self {
            Order::Lists(p) => p.clear(),
            Order::Chain { idx, .. } => *idx = LruIndex::new(),
        }
    }
}

/// An eviction policy over slot indices.
pub(crate) struct Policy {
    links: Links,
    place: Vec<Where>,
    t1: List,
    t2: List,
    arc: Option<ArcState>,
}

struct ArcState {
    p: usize,
    cap: usize,
    b1: Ghost,
    b2: Ghost,
}

impl Policy {
    pub(crate) fn new(n_slots: usize, arc: bool) -> Self {
        Self {
            links: Links {
                prev: vec![NIL; n_slots],
                next: vec![NIL; n_slots],
            },
            place: vec![Where::None; n_slots],
            t1: List::new(),
            t2: List::new(),
            arc: arc.then(|| ArcState {
                p: 0,
                cap: n_slots,
                b1: Ghost::default(),
                b2: Ghost::default(),
            }),
        }
    }

    /// A block became resident in `slot`.
    pub(crate) fn insert(&mut self, slot: usize, key: &BlockKey) {
        let s = slot as u32;
        let to_t2 = match &mut self.arc {
            None => false,
            Some(a) => {
                let (b1, b2) = (a.b1.len().max(1), a.b2.len().max(1));
                if a.b1.remove(key) {
                    a.p = (a.p + (b2 / b1).max(1)).min(a.cap);
                    true
                } else if a.b2.remove(key) {
                    a.p = a.p.saturating_sub((b1 / b2).max(1));
                    true
                } else {
                    false
                }
            }
        };
        if to_t2 {
            self.t2.push_back(&mut self.links, s);
            self.place[slot] = Where::T2;
        } else {
            self.t1.push_back(&mut self.links, s);
            self.place[slot] = Where::T1;
        }
    }

    /// The block in `slot` was used: make it most recent (ARC: promote to the frequent list).
    pub(crate) fn touch(&mut self, slot: usize) {
        let s = slot as u32;
        match self.place[slot] {
            Where::None => {}
            Where::T1 => {
                self.t1.unlink(&mut self.links, s);
                if self.arc.is_some() {
                    self.t2.push_back(&mut self.links, s);
                    self.place[slot] = Where::T2;
                } else {
                    self.t1.push_back(&mut self.links, s);
                }
            }
            Where::T2 => {
                self.t2.unlink(&mut self.links, s);
                self.t2.push_back(&mut self.links, s);
            }
        }
    }

    /// The block in `slot` leaves (evicted when `evicted`, otherwise dropped by reset).
    pub(crate) fn remove(&mut self, slot: usize, key: &BlockKey, evicted: bool) {
        let s = slot as u32;
        let was = self.place[slot];
        match was {
            Where::None => return,
            Where::T1 => self.t1.unlink(&mut self.links, s),
            Where::T2 => self.t2.unlink(&mut self.links, s),
        }
        self.place[slot] = Where::None;
        if let (true, Some(a)) = (evicted, &mut self.arc) {
            let cap = a.cap;
            if was == Where::T1 {
                a.b1.push(*key, cap);
            } else {
                a.b2.push(*key, cap);
            }
        }
    }

    /// Picks `n` victims in eviction order among slots where `evictable` holds, or `None`
    /// when fewer than `n` qualify. Changes nothing.
    pub(crate) fn victims(
        &self,
        n: usize,
        evictable: impl Fn(usize) -> bool,
    ) -> Option<Vec<usize>> {
        let mut out = Vec::with_capacity(n);
        if n == 0 {
            return Some(out);
        }
        match &self.arc {
            None => {
                for s in self.t1.iter(&self.links) {
                    if evictable(s as usize) {
                        out.push(s as usize);
                        if out.len() == n {
                            return Some(out);
                        }
                    }
                }
                None
            }
            Some(a) => {
                // REPLACE: take from T1 while it is larger than the target p, else from T2;
                // fall back to the other list when one runs out of evictable blocks.
                let mut t1 = self.t1.iter(&self.links).filter(|&s| evictable(s as usize));
                let mut t2 = self.t2.iter(&self.links).filter(|&s| evictable(s as usize));
                let mut t1_len = self.t1.len;
                let (mut t1_done, mut t2_done) = (false, false);
                while out.len() < n {
                    let prefer_t1 = t1_len > 0 && t1_len > a.p;
                    let pick = if (prefer_t1 || t2_done) && !t1_done {
                        match t1.next() {
                            Some(s) => {
                                t1_len -= 1;
                                Some(s)
                            }
                            None => {
                                t1_done = true;
                                None
                            }
                        }
                    } else if !t2_done {
                        match t2.next() {
                            Some(s) => Some(s),
                            None => {
                                t2_done = true;
                                None
                            }
                        }
                    } else {
                        return None;
                    };
                    if let Some(s) = pick {
                        out.push(s as usize);
                    }
                }
                Some(out)
            }
        }
    }

    /// Forgets everything (ghosts included).
    pub(crate) fn clear(&mut self) {
        self.links.prev.fill(NIL);
        self.links.next.fill(NIL);
        self.place.fill(Where::None);
        self.t1 = List::new();
        self.t2 = List::new();
        if let Some(a) = &mut self.arc {
            a.p = 0;
            a.b1.clear();
            a.b2.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> BlockKey {
        BlockKey::new(&[i], 0).unwrap()
    }

    /// Slots 0..n hold keys 0..n, inserted in order; `taken` says which slots left.
    struct Pool {
        order: Order,
        gone: Vec<bool>,
    }

    impl Pool {
        fn new(n: usize, policy: EvictionPolicy) -> Self {
            let mut order = Order::new(n, policy);
            for s in 0..n {
                order.insert(s, &key(s as u8));
            }
            Self {
                order,
                gone: vec![false; n],
            }
        }

        /// Takes `n` victims among the slots `may` allows.
        fn take(&mut self, n: usize, may: impl Fn(usize) -> bool) -> Option<Vec<usize>> {
            let gone = &self.gone;
            let v = self.order.take_victims(
                n,
                |k| k.hash_bytes()[0] as usize,
                |s| (!gone[s] && may(s)).then(|| key(s as u8)),
            )?;
            for &s in &v {
                self.gone[s] = true;
            }
            Some(v)
        }

        fn link(&mut self, s: usize, parent: usize, depth: u32) {
            self.order.link(&key(s as u8), key(parent as u8), depth);
        }

        /// Links blocks 0..len as one chain, 0 its head.
        fn chain(&mut self, len: usize) {
            for s in 1..len {
                self.link(s, s - 1, s as u32);
            }
        }
    }

    #[test]
    fn lru_takes_the_least_recent_that_may_go() {
        let mut p = Pool::new(5, EvictionPolicy::Lru);
        p.order.touch(0, &key(0));
        assert_eq!(p.take(2, |s| s != 1), Some(vec![2, 3]));
        assert_eq!(p.take(4, |_| true), None, "three are left: none taken");
        assert_eq!(
            p.take(2, |_| true),
            Some(vec![1, 4]),
            "nothing was taken above"
        );
        assert_eq!(p.take(1, |_| true), Some(vec![0]));
    }

    /// Plain LRU takes no links: a chain's head goes first when it is the least recent.
    #[test]
    fn lru_ignores_links() {
        let mut p = Pool::new(3, EvictionPolicy::Lru);
        p.chain(3);
        assert_eq!(p.take(1, |_| true), Some(vec![0]));
    }

    /// A chain 0 <- 1 <- 2 and a block 3 used after it: the chain goes tail first, and the
    /// head is as recent as its tail was (touching only the tail keeps the head).
    #[test]
    fn chain_takes_tails_first_with_the_chains_recency() {
        let mut p = Pool::new(4, EvictionPolicy::Chain);
        p.chain(3);
        // only the trailing window is used again: the head stays older by its own use
        p.order.touch(2, &key(2));
        // 3 is now the least recent tail; then the chain, from its tail
        assert_eq!(p.take(1, |_| true), Some(vec![3]));
        assert_eq!(p.take(3, |_| true), Some(vec![2, 1, 0]));
    }

    /// The parent a taken tail leaves behind may go in the same call, before a tail used
    /// later than the chain.
    #[test]
    fn chain_takes_a_parent_made_a_tail_in_the_same_call() {
        let mut p = Pool::new(3, EvictionPolicy::Chain);
        p.chain(2);
        assert_eq!(p.take(2, |_| true), Some(vec![1, 0]));
        assert_eq!(p.take(1, |_| true), Some(vec![2]));
    }

    /// A tail that may not go (pinned) keeps its chain while another tail can go; with none
    /// left, an earlier block goes before it, and a call that cannot be met takes nothing.
    #[test]
    fn chain_takes_an_earlier_block_only_when_no_tail_may_go() {
        let mut p = Pool::new(4, EvictionPolicy::Chain);
        p.chain(3);
        assert_eq!(p.take(1, |s| s != 2), Some(vec![3]));
        assert_eq!(p.take(3, |s| s != 2), None);
        assert_eq!(
            p.take(1, |s| s != 2),
            Some(vec![0]),
            "the least recent by its own use; the failed call put back what it took"
        );
        assert_eq!(p.take(2, |_| true), Some(vec![2, 1]));
    }

    /// ARC's ghosts: the newest `cap` keys evicted, a key pushed again counted once and as
    /// the newest, and the FIFO behind them compacted, so it stays within a bound.
    #[test]
    fn ghosts_keep_the_newest_keys_within_their_cap() {
        let mut g = Ghost::default();
        for i in 0..5 {
            g.push(key(i), 3);
        }
        assert_eq!(g.len(), 3);
        assert!(!g.remove(&key(0)) && !g.remove(&key(1)), "the oldest went");
        assert!(g.remove(&key(2)));
        assert_eq!(g.len(), 2);
        g.push(key(3), 3); // again: the newest now
        assert_eq!(g.len(), 2);
        g.push(key(7), 3);
        g.push(key(8), 3);
        assert_eq!(g.len(), 3);
        assert!(!g.remove(&key(4)), "4 was the oldest");
        assert!(g.remove(&key(3)));
        for i in 0..1_000u32 {
            g.push(BlockKey::new(&i.to_le_bytes(), 0).unwrap(), 3);
        }
        // the same three again and again: each push leaves a stale entry behind
        for i in 0..1_000u32 {
            g.push(key((i % 3) as u8), 3);
        }
        assert_eq!(g.len(), 3);
        // and the oldest of them still goes first (the compaction kept the live entries)
        g.push(key(9), 3);
        assert_eq!(g.len(), 3);
        assert!(
            !g.remove(&key(1)),
            "1 was the oldest of the three (pushed at 997)"
        );
        assert!(g.order.len() <= 2 * 3 + 64 + 1, "{} queued", g.order.len());
        g.clear();
        assert_eq!((g.len(), g.order.len()), (0, 0));
    }

    /// A reset's `clear` forgets ARC's ghosts and its target: a key evicted before it is new
    /// afterwards, and the recent list's target is 0 again.
    #[test]
    fn clear_forgets_arcs_ghosts() {
        let mut p = Pool::new(2, EvictionPolicy::Arc);
        assert_eq!(p.take(1, |_| true), Some(vec![0]));
        p.order.insert(0, &key(0)); // a ghost hit: the target grows
        p.order.clear();
        let Order::Lists(pol) = &p.order else {
            unreachable!("ARC keeps lists")
        };
        let a = pol.arc.as_ref().unwrap();
        assert_eq!((a.b1.len(), a.b2.len(), a.p), (0, 0, 0));
        assert!(pol.place.iter().all(|w| *w == Where::None));
    }

    /// A block that leaves without being evicted (a reset) is no victim afterwards, in every
    /// order.
    #[test]
    fn a_removed_block_is_no_victim() {
        for policy in [
            EvictionPolicy::Lru,
            EvictionPolicy::Chain,
            EvictionPolicy::Arc,
        ] {
            let mut p = Pool::new(3, policy);
            p.chain(3);
            p.order.remove(2, &key(2));
            assert_eq!(p.take(3, |_| true), None, "{policy:?}: two are left");
            let mut v = p.take(2, |_| true).unwrap();
            v.sort();
            assert_eq!(v, vec![0, 1], "{policy:?}");
        }
    }

    /// A call that cannot be met puts back the recency a block inherited from its chain's
    /// tail: 0 <- 1, with 1 used after 2; once 1 has gone, 0 is as recent as 1 was and still
    /// goes after 2 when a call that took it (and 2) failed.
    #[test]
    fn a_failed_call_keeps_the_recency_a_block_inherited() {
        let mut p = Pool::new(3, EvictionPolicy::Chain);
        p.chain(2);
        p.order.touch(1, &key(1));
        assert_eq!(p.take(1, |s| s == 1), Some(vec![1]));
        assert_eq!(p.take(3, |_| true), None);
        assert_eq!(p.take(1, |_| true), Some(vec![2]));
    }

    #[test]
    fn arc_keeps_frequent_blocks_over_a_scan() {
        let mut p = Pool::new(4, EvictionPolicy::Arc);
        // slots 0,1 used twice (frequent), 2,3 once.
        p.order.touch(0, &key(0));
        p.order.touch(1, &key(1));
        // when T1 is unevictable, T2 is used; victims come from the recent list first
        assert_eq!(p.take(2, |s| s < 2), Some(vec![0, 1]));
        assert_eq!(p.take(2, |_| true), Some(vec![2, 3]));
    }

    #[test]
    fn arc_ghost_hit_goes_to_frequent_list_and_adapts() {
        let mut p = Policy::new(2, true);
        p.insert(0, &key(1));
        p.insert(1, &key(2));
        p.remove(0, &key(1), true); // key 1 -> B1
        p.insert(0, &key(1)); // ghost hit: p grows, key goes to T2
        assert_eq!(p.arc.as_ref().unwrap().p, 1);
        assert!(p.place[0] == Where::T2);
        // T1 = {slot1} (len 1 == p): REPLACE takes from T2 first.
        assert_eq!(p.victims(1, |_| true).unwrap(), vec![0]);
    }
}
