//! The GC's index: every block file the tier knows, with its allocated bytes and mtime, in
//! mtime order, plus the directories those files keep alive and the bytes reserved by stores
//! in flight. What it sums is what the tier holds on disk.

use kv_tier_core::BlockKey;
use kv_tier_core::lru::{LruEntry, LruIndex};
use rustc_hash::FxHashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Entry {
    /// Allocated bytes of the block file and its checksum sidecar (if any).
    pub(super) size: u64,
    /// mtime, ns since the epoch: also what rate-limits stamps (a file stored or touched
    /// within the stamp interval is not stamped again).
    pub(super) mtime: i64,
    /// When the entry was (re)inserted, from the index's counter (later walks and stamps do
    /// not undo what happened after they started), and in the top bit whether a stamp of it
    /// is queued: 24 bytes an entry.
    seq_pending: u64,
}

const PENDING: u64 = 1 << 63;

impl Entry {
    pub(super) fn new(size: u64, mtime: i64, seq: u64) -> Self {
        Self {
            size,
            mtime,
            seq_pending: seq & !PENDING,
        }
    }

    /// When the entry was (re)inserted or last changed (the index's counter).
    pub(super) fn seq(&self) -> u64 {
        self.seq_pending & !PENDING
    }

    pub(super) fn set_seq(&mut self, seq: u64) {
        self.seq_pending = (seq & !PENDING) | (self.seq_pending & PENDING);
    }

    /// Whether a stamp of it is queued.
    pub(super) fn pending(&self) -> bool {
        self.seq_pending & PENDING != 0
    }

    pub(super) fn set_pending(&mut self, pending: bool) {
        self.seq_pending = self.seq() | if pending { PENDING } else { 0 };
    }
}

impl LruEntry for Entry {
    type At = i64;
    fn size(&self) -> u64 {
        self.size
    }
    fn at(&self) -> i64 {
        self.mtime
    }
}

/// A block's leaf directory (`<hex[0..3]>/<hex[3..5]>_g<group>`) and its top directory
/// (`<hex[0..3]>`, bits 8.. of `leaf`), as numbers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Leaf {
    pub(crate) leaf: u32,
    pub(crate) group: u32,
}

impl Leaf {
    /// Its top directory.
    pub(crate) fn top(&self) -> u32 {
        self.leaf >> 8 & 0xffff
    }
}

/// The directories of `key`'s path, as numbers. Hashes shorter than 3 bytes are sliced as
/// the layout slices them (`hex[0..3]`, `hex[3..5]`, each as far as the hex goes): a 1-byte
/// hash has a 2-digit top directory of its own, while a 2-byte hash shares its top with longer
/// hashes and has a 1-digit leaf of its own. So the top's number carries whether it has 2 or 3
/// digits, and the leaf's how many digits it has.
pub(crate) fn leaf_of(key: &BlockKey) -> Leaf {
    let h = key.hash_bytes();
    let b = |i: usize| h.get(i).copied().unwrap_or(0) as u32;
    let top_digits = if h.len() == 1 { 2 } else { 3 };
    let leaf_digits = (h.len().min(3) - 1) as u32;
    // hex[0..3] = b0 and the high nibble of b1; hex[3..5] = low nibble of b1, high of b2
    let top = top_digits << 12 | b(0) << 4 | b(1) >> 4;
    let leaf = leaf_digits << 24 | top << 8 | (b(1) & 0xf) << 4 | b(2) >> 4;
    Leaf {
        leaf,
        group: key.group(),
    }
}

#[derive(Default)]
pub(super) struct Index {
    /// Every indexed file in mtime order (oldest first), their summed bytes, and the keys a
    /// sweep is deleting.
    pub(super) lru: LruIndex<Entry>,
    /// Indexed files per leaf directory in use (17 bytes a leaf, with the table's control
    /// byte: at a million random keys most blocks have a leaf of their own).
    leaves: FxHashMap<Leaf, LeafUse>,
    /// The allocated bytes of leaf directories in use that were measured at other than one
    /// directory unit (a directory grows with its entries and does not shrink: measured by
    /// walks and, once it holds [`LEAF_GROWS_FROM`] files, by every store into it).
    grown: FxHashMap<Leaf, u64>,
    /// Leaf directories in use per top directory.
    tops: FxHashMap<u32, u32>,
    dir_bytes: u64,
    /// Bytes that exist whatever the index holds (pre-created top directories).
    base_bytes: u64,
    /// Bytes stores in flight have reserved.
    pub(super) reserved: u64,
    /// The reservations in `reserved`, per key: (number, bytes). A file of the key indexed
    /// before its store swaps its reservation for the entry (a load or another store saw it
    /// first) takes one over, so no block counts twice.
    by_key: FxHashMap<BlockKey, Vec<(u64, u64)>>,
    next_reservation: u64,
    /// The `seq` each rescan walk under way started at, and the keys that left the index
    /// since the oldest of them (with the `seq` of their removal): a walk may have seen a file
    /// before a sweep deleted it, and its merge must not put it back.
    walks: Vec<u64>,
    removed_in_walk: FxHashMap<BlockKey, u64>,
    /// Bytes of files (and the directories they empty) a sweep took out of the index and has
    /// not unlinked yet: still on disk, so still counted.
    pub(super) unlinking_bytes: u64,
    /// Allocated bytes of one directory (0 where directories take none, as on tmpfs).
    dir_unit: u64,
    /// Whether top directories count per use (they were not pre-created).
    count_tops: bool,
    pub(super) seq: u64,
    /// Chain links applied (a checkpoint holds them: one taken before a link is stale).
    pub(super) links: u64,
    pub(super) peak: u64,
    pub(super) pending: Vec<BlockKey>,
    /// Stamps queued for keys not in the index (another process wrote them), with the last
    /// stamp time of each for the rate limit.
    pub(super) foreign: FxHashMap<BlockKey, i64>,
    pub(super) foreign_pending: Vec<BlockKey>,
}

/// What [`Index::load_with`] hands each file to: how many files there are, the key, size,
/// mtime, and the position of the file it follows with its depth.
pub(super) type Feed<'a> = dyn FnMut(usize, BlockKey, u64, i64, Option<(u32, u32)>) + 'a;

/// How a leaf directory is used: by indexed files and by reservations of stores that will
/// publish there (so its directories count, and no sweep removes them, until both are gone).
#[derive(Debug, Clone, Copy)]
struct LeafUse {
    files: u32,
    reservations: u32,
}

/// Which reservation a file being indexed replaces ([`Index::insert_claiming`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Claim {
    /// None: no store of this process reserved for it.
    Nothing,
    /// This store's reservation (the file is the one it published).
    Number(u64),
    /// Whichever the key has, if any (the file was found by a walk, a load or another
    /// store: a store in flight may have just published it).
    Any,
}

/// From this many files on, a leaf directory may grow with a store's entries: stores into it
/// reserve two directory units for that and measure it after publishing.
pub(crate) const LEAF_GROWS_FROM: u32 = 16;

/// What removing an entry left behind.
#[derive(Debug, Clone, Copy)]
pub(super) struct Removed {
    /// The leaf directory lost its last indexed file.
    pub(super) leaf_empty: bool,
    /// The top directory lost its last leaf in use (only when tops count per use).
    pub(super) top_empty: bool,
}

impl Index {
    /// An empty index for directories of `dir_unit` bytes, `base_bytes` that always exist,
    /// counting top directories per use when `count_tops`.
    pub(super) fn new(dir_unit: u64, base_bytes: u64, count_tops: bool) -> Self {
        Self {
            dir_unit,
            base_bytes,
            count_tops,
            ..Self::default()
        }
    }

    pub(super) fn total(&self) -> u64 {
        self.lru.bytes() + self.dir_bytes + self.base_bytes + self.reserved + self.unlinking_bytes
    }

    /// The total once the victims being unlinked are gone: what a sweep aims at.
    pub(super) fn settled(&self) -> u64 {
        self.total() - self.unlinking_bytes
    }

    /// What a victim taken out of the index (`size` bytes, leaving `r`) still holds on disk
    /// until its unlink (and its directories' removal) is done.
    pub(super) fn victim_bytes(&self, size: u64, r: &Removed) -> u64 {
        size + (u64::from(r.leaf_empty) + u64::from(r.top_empty)) * self.dir_unit
    }

    /// Whether top directories count per use (they were not pre-created).
    pub(super) fn counts_tops(&self) -> bool {
        self.count_tops
    }

    pub(super) fn dir_bytes(&self) -> u64 {
        self.dir_bytes + self.base_bytes
    }

    pub(super) fn note_peak(&mut self) {
        self.peak = self.peak.max(self.total());
    }

    /// Inserts or replaces `key`'s entry (a replaced entry keeps a queued stamp).
    pub(super) fn insert(&mut self, key: BlockKey, size: u64, mtime: i64) {
        self.insert_claiming(key, size, mtime, Claim::Nothing);
    }

    /// [`Index::insert`] of a file that replaces a reservation made for it: counted once, in
    /// one step, so no total in between holds the block twice, or its directories none.
    pub(super) fn insert_claiming(&mut self, key: BlockKey, size: u64, mtime: i64, claim: Claim) {
        self.seq += 1;
        let e = Entry::new(size, mtime, self.seq);
        match self.lru.insert(key, e) {
            Some(old) => {
                if old.pending() {
                    self.lru.update(&key, |e| e.set_pending(true));
                }
            }
            None => self.hold_leaf(leaf_of(&key), true),
        }
        // (after the file holds its directories: the reservation's hold on them passes on)
        match claim {
            Claim::Nothing => {}
            Claim::Number(n) => self.release(&key, n),
            Claim::Any => self.take_over(&key),
        }
        self.note_peak();
    }

    /// Indexes the files `feed` hands over, least recent first (what a checkpoint holds:
    /// with how many there are, each file's key, size and mtime, and the position of the file
    /// it follows with its depth), into the empty index of an open: as [`Index::insert`] of
    /// each and a link of each, with nothing held per file but a few numbers until the
    /// recency order is built, once, at the end. Returns what `feed` returned, and each
    /// file's leaf directory by position.
    pub(super) fn load_with<T>(&mut self, feed: impl FnOnce(&mut Feed<'_>) -> T) -> (T, Vec<Leaf>) {
        // (the open reads a checkpoint before anything else touches the index; a refused one
        // leaves a new, empty index)
        debug_assert!(
            self.lru.is_empty(),
            "a checkpoint is read into an empty index"
        );
        let mut leaves = Vec::new();
        let mut seq = self.seq;
        let mut new = Vec::new();
        let out = {
            let mut l = self.lru.loader(0);
            feed(&mut |n, key, size, mtime, link| {
                if l.is_empty() {
                    l.reserve(n);
                    leaves.reserve_exact(n);
                }
                if let Some((p, d)) = link {
                    l.link(l.len() as u32, p, d);
                }
                seq += 1;
                let leaf = leaf_of(&key);
                leaves.push(leaf);
                // a key given twice is one file: its leaf is held once
                if l.add(key, Entry::new(size, mtime, seq)) {
                    new.push(leaf);
                }
            })
        };
        self.seq = seq;
        for leaf in new {
            self.hold_leaf(leaf, true);
        }
        self.note_peak();
        (out, leaves)
    }

    pub(super) fn remove(&mut self, key: &BlockKey) -> Option<Removed> {
        self.lru.remove(key)?;
        self.note_removed(key);
        Some(self.drop_leaf(leaf_of(key), true))
    }

    /// One more user of leaf `l` (a file, or a reservation for one): its directories count
    /// from the first.
    fn hold_leaf(&mut self, l: Leaf, file: bool) {
        let n = self.leaves.entry(l).or_insert(LeafUse {
            files: 0,
            reservations: 0,
        });
        if n.files + n.reservations == 0 {
            // (a leaf out of use is measured anew: one unit until then)
            self.dir_bytes += self.dir_unit;
            let t = self.tops.entry(l.top()).or_insert(0);
            *t += 1;
            if *t == 1 && self.count_tops {
                self.dir_bytes += self.dir_unit;
            }
        }
        if file {
            n.files += 1;
        } else {
            n.reservations += 1;
        }
    }

    /// One user less of leaf `l`: when it was the last, its directories no longer count (and
    /// are for the caller to remove).
    fn drop_leaf(&mut self, l: Leaf, file: bool) -> Removed {
        let mut r = Removed {
            leaf_empty: false,
            top_empty: false,
        };
        let Some(n) = self.leaves.get_mut(&l) else {
            return r;
        };
        let users = if file {
            &mut n.files
        } else {
            &mut n.reservations
        };
        *users = users.saturating_sub(1);
        if n.files + n.reservations > 0 {
            return r;
        }
        self.leaves.remove(&l);
        let bytes = self.grown.remove(&l).unwrap_or(self.dir_unit);
        self.dir_bytes -= bytes;
        r.leaf_empty = true;
        if let Some(t) = self.tops.get_mut(&l.top()) {
            *t -= 1;
            if *t == 0 {
                self.tops.remove(&l.top());
                if self.count_tops {
                    self.dir_bytes -= self.dir_unit;
                    r.top_empty = true;
                }
            }
        }
        r
    }

    /// A rescan walk begins: returns the `seq` it starts at.
    pub(super) fn begin_walk(&mut self) -> u64 {
        self.walks.push(self.seq);
        self.seq
    }

    /// The rescan walk that started at `seq0` ended (merged, or dropped): removals no walk
    /// under way started before are forgotten.
    pub(super) fn end_walk(&mut self, seq0: u64) {
        if let Some(i) = self.walks.iter().position(|s| *s == seq0) {
            self.walks.swap_remove(i);
        }
        match self.walks.iter().min() {
            None => self.removed_in_walk.clear(),
            Some(&oldest) => self.removed_in_walk.retain(|_, s| *s > oldest),
        }
    }

    /// `key`'s file left (or its entry the index) now: remembered while rescan walks run.
    pub(super) fn note_removed(&mut self, key: &BlockKey) {
        if !self.walks.is_empty() {
            self.seq += 1;
            self.removed_in_walk.insert(*key, self.seq);
        }
    }

    /// Whether `key` left the index after `seq0` (while a walk that started then ran).
    pub(super) fn removed_since(&self, key: &BlockKey, seq0: u64) -> bool {
        self.removed_in_walk.get(key).is_some_and(|s| *s > seq0)
    }

    /// Leaf directories whose measured size is not one directory unit, with their bytes.
    pub(super) fn measured_leaves(&self) -> FxHashMap<Leaf, u64> {
        self.grown.clone()
    }

    /// What a checkpoint must match to be read into this index (with the rank directory).
    pub(super) fn units(&self) -> (u64, u64, bool) {
        (self.dir_unit, self.base_bytes, self.count_tops)
    }

    /// Files indexed in `key`'s leaf directory.
    pub(super) fn leaf_files(&self, key: &BlockKey) -> u32 {
        self.leaves.get(&leaf_of(key)).map_or(0, |l| l.files)
    }

    /// Sets the measured allocated bytes of `key`'s leaf directory (if it is in use).
    pub(super) fn set_leaf_bytes(&mut self, key: &BlockKey, bytes: u64) {
        self.set_bytes_of(leaf_of(key), bytes);
    }

    /// Sets the measured allocated bytes of leaf directory `l` (if it is in use).
    pub(super) fn set_bytes_of(&mut self, l: Leaf, bytes: u64) {
        if !self.leaves.contains_key(&l) {
            return;
        }
        let was = if bytes == self.dir_unit {
            self.grown.remove(&l)
        } else {
            self.grown.insert(l, bytes)
        };
        self.dir_bytes = self.dir_bytes - was.unwrap_or(self.dir_unit) + bytes;
        self.note_peak();
    }

    /// Moves `key` to a new mtime (a stamp, or a fresher mtime seen on disk).
    pub(super) fn set_mtime(&mut self, key: &BlockKey, mtime: i64) {
        let seq = &mut self.seq;
        self.lru.update(key, |e| {
            if e.mtime != mtime {
                e.mtime = mtime;
                // a change, like an insert: newer than a walk that started before it
                *seq += 1;
                e.set_seq(*seq);
            }
        });
    }

    /// Reserves `bytes` for a new file of `key`, and the directories it would create (held
    /// until the reservation ends: see [`LeafUse`]), if the total stays within `limit`;
    /// returns the reservation's number.
    pub(super) fn reserve_for(&mut self, key: BlockKey, bytes: u64, limit: u64) -> Option<u64> {
        if self.total() + bytes + self.dirs_needed(&key) > limit {
            return None;
        }
        self.reserved += bytes;
        self.hold_leaf(leaf_of(&key), false);
        let n = self.next_reservation;
        self.next_reservation += 1;
        self.by_key.entry(key).or_default().push((n, bytes));
        self.note_peak();
        Some(n)
    }

    /// Ends reservation `n` of `key`, unless a file of the key took it over.
    pub(super) fn release(&mut self, key: &BlockKey, n: u64) {
        let Some(list) = self.by_key.get_mut(key) else {
            return;
        };
        let Some(i) = list.iter().position(|(m, _)| *m == n) else {
            return;
        };
        let (_, bytes) = list.swap_remove(i);
        if list.is_empty() {
            self.by_key.remove(key);
        }
        self.end_reservation(key, bytes);
    }

    /// A file of `key` is indexed: one reservation made for the key (if any) is now that
    /// file's entry.
    fn take_over(&mut self, key: &BlockKey) {
        let Some(list) = self.by_key.get_mut(key) else {
            return;
        };
        let Some((_, bytes)) = list.pop() else {
            return;
        };
        if list.is_empty() {
            self.by_key.remove(key);
        }
        self.end_reservation(key, bytes);
    }

    fn end_reservation(&mut self, key: &BlockKey, bytes: u64) {
        self.reserved = self.reserved.saturating_sub(bytes);
        // (the directories a store created and left empty on failure stay on disk, not
        // counted: a walk reaps them)
        self.drop_leaf(leaf_of(key), false);
    }

    /// What a new file in `key`'s leaf directory may add to the directory itself: two units
    /// once it holds [`LEAF_GROWS_FROM`] files or more, 0 before. A few dozen entries fill a
    /// directory's first unit, and the step past it is the largest: on ext4 the directory
    /// then becomes indexed and goes from one block to three (measured: 4 KiB to 12 KiB at
    /// the 54th block file); later steps are one unit. Stores reserve it, and measure such a
    /// leaf after publishing.
    pub(super) fn growth_slack(&self, key: &BlockKey) -> u64 {
        match self.leaves.get(&leaf_of(key)) {
            Some(l) if l.files + 1 >= LEAF_GROWS_FROM => 2 * self.dir_unit,
            _ => 0,
        }
    }

    /// Whether `key`'s leaf (and top) directory is in use (by a file or a reservation): what a
    /// new file there would add.
    pub(super) fn dirs_needed(&self, key: &BlockKey) -> u64 {
        let l = leaf_of(key);
        if self.leaves.contains_key(&l) {
            0
        } else if self.tops.contains_key(&l.top()) || !self.count_tops {
            self.dir_unit
        } else {
            2 * self.dir_unit
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(b: [u8; 3], group: u32) -> BlockKey {
        let mut h = [0u8; 32];
        h[..3].copy_from_slice(&b);
        BlockKey::from_hash32(h, group)
    }

    /// The numbers pack the directories' hex digits and how many there are: `abc` is
    /// `3 abc` (3 digits), `0a` (a 1-byte hash) `2 0a0`; a leaf carries its top and its own
    /// digits with their count (`de` is 2, `0` of a 2-byte hash 1, none of a 1-byte hash 0).
    #[test]
    fn directory_numbers_pack_digits_and_their_count() {
        let l = leaf_of(&key([0xab, 0xcd, 0xef], 7));
        assert_eq!(
            (l.top(), l.leaf, l.group),
            (0x3abc, 2 << 24 | 0x3abc << 8 | 0xde, 7)
        );
        let l = leaf_of(&BlockKey::new(&[0x0a, 0x00], 0).unwrap());
        assert_eq!((l.top(), l.leaf), (0x30a0, 1 << 24 | 0x30a0 << 8));
        let l = leaf_of(&BlockKey::new(&[0x0a], 0).unwrap());
        assert_eq!((l.top(), l.leaf), (0x20a0, 0x20a0 << 8));
    }

    #[test]
    fn leaves_follow_the_layout() {
        let ns =
            kv_tier_core::Namespace::new(kv_tier_core::RunFields::new("m", "f", 16), 0).unwrap();
        let keys = [
            key([0xab, 0xcd, 0xef], 0),
            key([0xab, 0xcd, 0xe0], 0),
            key([0xab, 0xc0, 0x00], 0),
            // the same top; hex[3..5] differs only in the low bits of byte 1
            key([0xab, 0xc3, 0x00], 0),
            // short hashes: their directories are sliced from fewer digits
            BlockKey::new(&[0x0a], 0).unwrap(),
            BlockKey::new(&[0x0a, 0x00], 0).unwrap(),
            key([0x0a, 0x00, 0x00], 0),
            key([0xab, 0xcd, 0xef], 1),
            key([0xac, 0xcd, 0xef], 0),
        ];
        for a in &keys {
            for b in &keys {
                let dir = |k: &BlockKey| {
                    let p = ns.block_rel_path(k);
                    p[..p.rfind('/').unwrap()].to_string()
                };
                let top = |k: &BlockKey| dir(k)[..dir(k).rfind('/').unwrap()].to_string();
                assert_eq!(leaf_of(a) == leaf_of(b), dir(a) == dir(b), "{a} {b}");
                assert_eq!(
                    leaf_of(a).top() == leaf_of(b).top(),
                    top(a) == top(b),
                    "{a} {b}"
                );
            }
        }
    }

    #[test]
    fn totals_count_files_directories_and_reservations() {
        let mut idx = Index::new(4096, 0, true);
        let (a, b, c) = (key([1, 2, 3], 0), key([1, 2, 4], 0), key([9, 9, 9], 0));
        idx.insert(a, 8192, 10);
        assert_eq!(idx.total(), 8192 + 2 * 4096); // file, leaf, top
        idx.insert(b, 8192, 11); // same leaf
        assert_eq!(idx.total(), 2 * 8192 + 2 * 4096);
        assert_eq!(idx.dirs_needed(&c), 2 * 4096);
        // a reservation in a's leaf: no directory to add
        let d = key([1, 2, 5], 0);
        let rd = idx.reserve_for(d, 100, u64::MAX).unwrap();
        idx.insert(c, 8192, 5);
        assert_eq!(idx.total(), 3 * 8192 + 4 * 4096 + 100);
        assert!(idx.reserve_for(d, 1, idx.total()).is_none());
        idx.release(&d, rd);
        let r = idx.remove(&a).unwrap();
        assert!(!r.leaf_empty);
        let r = idx.remove(&b).unwrap();
        assert!(r.leaf_empty && r.top_empty);
        assert_eq!(idx.total(), 8192 + 2 * 4096);
        assert_eq!(idx.lru.oldest(None, 1)[0].key, c, "oldest first");
        idx.set_mtime(&c, 50);
        assert_eq!(idx.lru.oldest(None, 1)[0].at, 50);
        assert_eq!(idx.peak, 3 * 8192 + 4 * 4096 + 100);
    }

    #[test]
    fn a_new_file_needs_the_directories_it_would_create() {
        let mut idx = Index::new(4096, 0, true);
        idx.insert(key([1, 2, 3], 0), 8192, 10);
        // another leaf (hex[3..5] = "2f") under the same top ("010"): the leaf only
        assert_eq!(idx.dirs_needed(&key([1, 2, 0xf0], 0)), 4096);
        assert_eq!(idx.dirs_needed(&key([1, 2, 0x0f], 0)), 0, "the same leaf");
        // top directories pre-created (not counted per use): a new leaf only
        let idx = Index::new(4096, 4096 * 4096, false);
        assert_eq!(idx.dirs_needed(&key([1, 2, 3], 0)), 4096);
    }

    #[test]
    fn a_reservation_may_reach_the_limit_but_not_pass_it() {
        let mut idx = Index::new(4096, 0, true);
        idx.insert(key([1, 2, 3], 0), 8192, 10);
        let limit = idx.total() + 100;
        let same_leaf = key([1, 2, 4], 0);
        assert!(idx.reserve_for(same_leaf, 101, limit).is_none());
        assert!(idx.reserve_for(same_leaf, 100, limit).is_some());
        assert_eq!(idx.total(), limit);
        // a new leaf needs its directory too
        let mut idx = Index::new(4096, 0, true);
        idx.insert(key([1, 2, 3], 0), 8192, 10);
        let limit = idx.total() + 100 + 4096;
        assert!(idx.reserve_for(key([1, 2, 0xf0], 0), 101, limit).is_none());
        assert!(idx.reserve_for(key([1, 2, 0xf0], 0), 100, limit).is_some());
        assert_eq!(idx.total(), limit);
    }

    /// A file of a key indexed (by a load or a store that found it) before its own store
    /// swapped its reservation for the entry takes the reservation over: the block is never
    /// counted twice, and the store's later release or publish changes nothing more.
    #[test]
    fn a_file_indexed_before_its_store_publishes_takes_its_reservation_over() {
        let mut idx = Index::new(4096, 0, true);
        let (a, b) = (key([1, 2, 3], 0), key([1, 2, 4], 0));
        let dirs = idx.dirs_needed(&a);
        let ra = idx.reserve_for(a, 8192, u64::MAX).unwrap();
        let rb = idx.reserve_for(b, 8192, u64::MAX).unwrap();
        assert_eq!(idx.total(), 2 * 8192 + dirs);
        // a load sees a's file first
        idx.insert_claiming(a, 8192, 10, Claim::Any);
        assert_eq!(idx.total(), 2 * 8192 + dirs, "a counted once");
        // then a's store publishes: its reservation is gone already
        idx.insert_claiming(a, 8192, 11, Claim::Number(ra));
        assert_eq!(idx.total(), 2 * 8192 + dirs);
        assert_eq!(idx.peak, 2 * 8192 + dirs, "never counted twice");
        // b's store skips (dropped room): its reservation ends, once
        idx.release(&b, rb);
        idx.release(&b, rb);
        assert_eq!((idx.total(), idx.reserved), (8192 + dirs, 0));
        // nothing to take over: a file of b indexed with no store in flight
        idx.insert_claiming(b, 8192, 12, Claim::Any);
        assert_eq!((idx.total(), idx.reserved), (2 * 8192 + dirs, 0));
    }

    /// A store reserves room in a leaf directory another file keeps alive; that file is
    /// removed before the store publishes. The reservation holds the directories: the removal
    /// leaves them (no sweep removes a directory a store is about to write into), their room
    /// is not freed for another store to take, and the publish adds nothing unreserved. So a
    /// total filled to the limit meanwhile stays within it.
    #[test]
    fn a_removal_racing_a_publish_leaves_the_reserved_directories_counted() {
        let mut idx = Index::new(4096, 0, true);
        let (old, new, elsewhere) = (key([1, 2, 3], 0), key([1, 2, 4], 0), key([9, 9, 9], 0));
        idx.insert(old, 8192, 10);
        let n = idx.reserve_for(new, 8192, u64::MAX).unwrap();
        assert_eq!(
            idx.total(),
            2 * 8192 + 2 * 4096,
            "no directory reserved twice"
        );
        let r = idx.remove(&old).unwrap();
        assert!(!r.leaf_empty && !r.top_empty, "the reservation keeps them");
        assert_eq!(idx.total(), 8192 + 2 * 4096);
        // another store fills the room the removal freed, up to the limit
        let limit = idx.total() + 8192 + 2 * 4096;
        let m = idx.reserve_for(elsewhere, 8192, limit).unwrap();
        assert_eq!(idx.total(), limit);
        idx.insert_claiming(new, 8192, 20, Claim::Number(n));
        idx.insert_claiming(elsewhere, 8192, 21, Claim::Number(m));
        assert_eq!(idx.total(), limit, "both files and their directories, once");
        assert!(idx.peak <= limit, "peak {} over {limit}", idx.peak);
        // a store that gives up: its directories go with it when nothing else holds them
        let k = idx.reserve_for(key([7, 7, 7], 0), 8192, u64::MAX).unwrap();
        assert_eq!(idx.total(), limit + 8192 + 2 * 4096);
        idx.release(&key([7, 7, 7], 0), k);
        assert_eq!(idx.total(), limit);
        assert_eq!(idx.reserved, 0);
    }
}
