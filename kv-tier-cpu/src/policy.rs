//! Eviction policies over resident (Ready) slots: LRU and ARC. Both keep intrusive
//! doubly-linked lists over slot indices, so touch, insert and remove are O(1).

use std::collections::VecDeque;

use kv_tier_core::BlockKey;
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

    #[test]
    fn lru_order_and_touch() {
        let mut p = Policy::new(4, false);
        for s in 0..4 {
            p.insert(s, &key(s as u8));
        }
        assert_eq!(p.victims(2, |_| true).unwrap(), vec![0, 1]);
        p.touch(0);
        assert_eq!(p.victims(2, |_| true).unwrap(), vec![1, 2]);
        assert_eq!(p.victims(2, |s| s != 1).unwrap(), vec![2, 3]);
        assert!(p.victims(4, |s| s != 1).is_none());
        p.remove(2, &key(2), true);
        assert_eq!(p.victims(3, |_| true).unwrap(), vec![1, 3, 0]);
    }

    #[test]
    fn arc_keeps_frequent_blocks_over_a_scan() {
        let mut p = Policy::new(4, true);
        // slots 0,1 used twice (frequent), 2,3 once.
        for s in 0..4 {
            p.insert(s, &key(s as u8));
        }
        p.touch(0);
        p.touch(1);
        // victims come from the recent list first.
        assert_eq!(p.victims(2, |_| true).unwrap(), vec![2, 3]);
        // when T1 is unevictable, T2 is used.
        assert_eq!(p.victims(2, |s| s < 2).unwrap(), vec![0, 1]);
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
