//! What the I/O threads share ([`Shared`]): the tier's root, layout, options, counters and
//! GC handle, and the operations around single blocks (faults, temp paths, stamps of an
//! unbounded tier, existence). Storing and loading a block are in `store.rs` and `load.rs`.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use kv_tier_core::{BlockKey, Error, EventLog, Namespace, ProtectionSet};

use crate::config::Checksum;
use crate::gc::Gc;
pub(crate) use crate::stats::Counters;

/// The operations a fault injector can fail (for tests of error paths).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FsOp {
    /// Opening a block file for a load.
    OpenRead,
    /// Reading a block file.
    Read,
    /// Creating a temp file for a store (each attempt: a missing leaf directory is made and
    /// the create tried again, at most three times). The path is the temp file's, or the
    /// leaf directory's for an unnamed (`O_TMPFILE`) one.
    CreateTmp,
    /// Writing a temp file.
    Write,
    /// Publishing a temp file as the block file.
    Publish,
    /// An existence probe of a batch of keys (the path is the rank directory); runs on an
    /// I/O thread.
    Probe,
}

/// Decides, per operation and path, whether to fail it with an error.
pub type FaultInjector = Arc<dyn Fn(FsOp, &Path) -> Option<io::Error> + Send + Sync>;

pub(crate) use kv_tier_core::stats::bump;

/// Everything the I/O threads need, shared by reference count.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) root: PathBuf,
    pub(crate) ns: Namespace,
    pub(crate) block_size: usize,
    /// Allocated bytes of one block file.
    pub(crate) alloc_block: u64,
    /// Allocated bytes of one directory.
    pub(crate) dir_alloc: u64,
    pub(crate) direct: bool,
    pub(crate) align: usize,
    pub(crate) checksum: Checksum,
    pub(crate) accept_unverified: bool,
    /// vLLM's checksum xattr is written and checked (`vllm_checksum`, with xattrs).
    pub(crate) vllm_crc: bool,
    pub(crate) xattrs: bool,
    /// Blocks are written unnamed (`O_TMPFILE`) and linked into place.
    pub(crate) tmpfile: bool,
    /// See [`SIDECAR_GRACE`].
    pub(crate) sidecar_grace_ns: AtomicU64,
    pub(crate) fsync: bool,
    pub(crate) faults: RwLock<Option<FaultInjector>>,
    pub(crate) counters: Counters,
    pub(crate) tmp_seq: AtomicU64,
    pub(crate) tmp_salt: u64,
    /// The leaf directories this process made or found (a hint: a sweep may remove an
    /// emptied one, and a create that finds it gone makes it again).
    pub(crate) leaves: LeafDirs,
    pub(crate) top_dirs_ready: AtomicBool,
    /// Tells the thread pre-creating the top directories to stop (the tier is closing).
    pub(crate) stop_top_dirs: AtomicBool,
    pub(crate) protection: ProtectionSet,
    /// Unbounded mode: when each key was last stamped (rate limit of `touch`; bounded).
    pub(crate) stamped: std::sync::Mutex<StampMemo>,
    pub(crate) events: Arc<EventLog>,
    pub(crate) gc: Option<Arc<Gc>>,
    /// A shared root's coordination (`shared: true`).
    pub(crate) coord: Option<Arc<crate::shared::Coord>>,
}

/// Which leaf directories (`<hex[0..3]>/<hex[3..5]>_g<group>`) are known to exist, one bit
/// each for KV-cache groups 0 to 3 (2^20 leaves per group, 512 KiB in all); other groups
/// are never known. Lock-free: a store asks before its first create, so a new leaf costs
/// a `mkdir` before the create instead of a failed create first, and a known one nothing.
pub(crate) struct LeafDirs {
    bits: Vec<std::sync::atomic::AtomicU64>,
}

const LEAF_GROUPS: u32 = 4;
const LEAVES_PER_GROUP: usize = 1 << 20;

impl LeafDirs {
    pub(crate) fn new() -> Self {
        let words = LEAF_GROUPS as usize * LEAVES_PER_GROUP / 64;
        Self {
            bits: (0..words).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// The bit of `key`'s leaf: its group and the first 20 bits of its hash (the directory
    /// names' five hex digits).
    fn slot(key: &BlockKey) -> Option<(usize, u64)> {
        let h = key.hash_bytes();
        if key.group() >= LEAF_GROUPS || h.len() < 3 {
            return None;
        }
        let leaf = (u32::from(h[0]) << 12) | (u32::from(h[1]) << 4) | (u32::from(h[2]) >> 4);
        let i = key.group() as usize * LEAVES_PER_GROUP + leaf as usize;
        Some((i / 64, 1u64 << (i % 64)))
    }

    pub(crate) fn known(&self, key: &BlockKey) -> bool {
        Self::slot(key).is_some_and(|(w, b)| self.bits[w].load(Ordering::Relaxed) & b != 0)
    }

    pub(crate) fn set(&self, key: &BlockKey, exists: bool) {
        if let Some((w, b)) = Self::slot(key) {
            if exists {
                self.bits[w].fetch_or(b, Ordering::Relaxed);
            } else {
                self.bits[w].fetch_and(!b, Ordering::Relaxed);
            }
        }
    }
}

pub(crate) fn random_salt() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u128(
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}
/// The temp-file suffix of the `n`-th write of a tier whose salt is `salt`: a different one for
/// every write of a tier (for a given salt, `n` times an odd constant, xor the salt, is a
/// bijection of `u64`), and unrelated between tiers (processes) with different salts.
fn tmp_suffix(salt: u64, n: u64) -> u64 {
    salt ^ n.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// How long after its publication a block may lack its checksum sidecar by default (the
/// publisher writes it right after publishing): a load then fails without removing the block.
pub(crate) const SIDECAR_GRACE: Duration = Duration::from_secs(2);

/// Unbounded mode: a key's mtime is stamped at most once per this interval, and at most
/// this many keys are remembered for it.
const UNBOUNDED_STAMP_NS: i64 = 60_000_000_000;
const UNBOUNDED_STAMP_KEYS: usize = 200_000;

/// Unbounded mode: when each key was last stamped, for at most `limit` keys; a key is due
/// for a stamp at most once per `interval_ns`.
#[derive(Debug)]
pub(crate) struct StampMemo {
    at: rustc_hash::FxHashMap<BlockKey, i64>,
    limit: usize,
    interval_ns: i64,
}

impl Default for StampMemo {
    fn default() -> Self {
        Self::new(UNBOUNDED_STAMP_KEYS, UNBOUNDED_STAMP_NS)
    }
}

impl StampMemo {
    pub(crate) fn new(limit: usize, interval_ns: i64) -> Self {
        Self {
            at: Default::default(),
            limit,
            interval_ns,
        }
    }

    /// The keys of `keys` due for a stamp at `now` (never stamped, or not within the
    /// interval), marked as stamped. When the memo is full of keys stamped within the
    /// interval, a key it does not know is not stamped (nor remembered).
    pub(crate) fn due(&mut self, now: i64, keys: &[BlockKey]) -> Vec<BlockKey> {
        if self.at.len() + keys.len() > self.limit {
            let interval = self.interval_ns;
            self.at.retain(|_, at| now - *at < interval);
        }
        let mut due = Vec::new();
        for k in keys {
            let room = self.at.len() < self.limit;
            match self.at.get_mut(k) {
                Some(last) if now - *last >= self.interval_ns => *last = now,
                Some(_) => continue,
                None if room => {
                    self.at.insert(*k, now);
                }
                None => continue,
            }
            due.push(*k);
        }
        due
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.at.len()
    }
}

impl Shared {
    /// Unbounded mode: the keys of `keys` due for an mtime stamp (at most one per key per
    /// minute), marked as stamped now. An unbounded tier keeps no index, but its reads are
    /// recency for the bounded tiers of other processes on the same root.
    pub(crate) fn due_for_stamp(&self, keys: &[BlockKey]) -> Vec<BlockKey> {
        let now = crate::gc::to_ns(SystemTime::now());
        let mut m = self.stamped.lock().unwrap_or_else(|p| p.into_inner());
        m.due(now, keys)
    }

    pub(crate) fn fault(&self, op: FsOp, path: &Path) -> io::Result<()> {
        match &*self.faults.read().expect("fault injector") {
            Some(f) => f(op, path).map_or(Ok(()), Err),
            None => Ok(()),
        }
    }

    pub(crate) fn io_err(&self, op: &'static str, path: &Path, e: io::Error) -> Error {
        crate::error::io_error(&self.name, op, path, e)
    }

    pub(crate) fn tmp_path(&self, dest: &Path) -> PathBuf {
        let n = self.tmp_seq.fetch_add(1, Ordering::Relaxed);
        let mut s = dest.as_os_str().to_os_string();
        s.push(format!("_{:016x}.tmp", tmp_suffix(self.tmp_salt, n)));
        s.into()
    }

    /// Whether `key`'s file exists. A key a sweep has chosen is looked at only after its
    /// unlink: the probe's caller protects its keys first, so the answer holds until the
    /// protection ends.
    pub(crate) fn exists(&self, key: &BlockKey) -> bool {
        if let Some(gc) = &self.gc {
            gc.wait_not_deleting(key);
        }
        std::fs::symlink_metadata(self.ns.block_path(&self.root, key)).is_ok_and(|m| m.is_file())
    }
}

#[cfg(test)]
mod tests {
    use super::{StampMemo, random_salt, tmp_suffix};
    use kv_tier_core::BlockKey;
    use rustc_hash::FxHashSet;

    #[test]
    fn temp_names_differ_between_writes_and_between_processes() {
        let (a, b) = (random_salt(), random_salt());
        assert_ne!(a, b, "two tiers drew the same salt");
        let mine: FxHashSet<u64> = (0..100_000).map(|n| tmp_suffix(a, n)).collect();
        assert_eq!(
            mine.len(),
            100_000,
            "two writes of one tier share a temp name"
        );
        let theirs: FxHashSet<u64> = (0..100_000).map(|n| tmp_suffix(b, n)).collect();
        assert!(
            mine.is_disjoint(&theirs),
            "two processes writing one block would share a temp file"
        );
    }

    #[test]
    fn a_memo_full_of_stamps_one_interval_old_makes_room() {
        let mut m = StampMemo::new(2, 100);
        assert_eq!(m.due(0, &[k(1), k(2)]).len(), 2);
        // exactly one interval later both are due again, so no longer "within the interval":
        // they give way to a key the memo does not know
        assert_eq!(m.due(100, &[k(3)]), vec![k(3)]);
        assert_eq!(m.due(100, &[k(1)]), vec![k(1)]);
    }

    fn k(i: u8) -> BlockKey {
        BlockKey::from_hash32([i; 32], 0)
    }

    #[test]
    fn a_key_is_due_once_per_interval() {
        let mut m = StampMemo::new(10, 100);
        assert_eq!(m.due(1_000, &[k(1), k(2)]), vec![k(1), k(2)]);
        assert_eq!(
            m.due(1_099, &[k(1)]),
            vec![],
            "stamped again within the interval"
        );
        assert_eq!(m.due(1_100, &[k(1), k(2)]), vec![k(1), k(2)]);
        assert_eq!(m.due(1_150, &[k(1), k(3)]), vec![k(3)]);
    }

    #[test]
    fn the_memo_never_holds_more_than_its_limit() {
        let mut m = StampMemo::new(3, 100);
        assert_eq!(m.due(0, &[k(1), k(2)]).len(), 2);
        assert_eq!(
            m.due(50, &[k(3), k(4)]),
            vec![k(3)],
            "full of recent stamps"
        );
        assert_eq!(m.len(), 3);
        // k(1) and k(2) are past the interval at 120: forgotten to make room
        assert_eq!(m.due(120, &[k(4), k(5)]), vec![k(4), k(5)]);
        assert_eq!(m.len(), 3);
        assert_eq!(m.due(120, &[k(3)]), vec![], "k(3) was kept");
    }
}

#[cfg(test)]
mod leaf_tests {
    use super::*;

    #[test]
    fn a_leaf_is_its_group_and_the_first_twenty_bits_of_the_hash() {
        let leaves = LeafDirs::new();
        let key = |b0: u8, b1: u8, b2: u8, group: u32| {
            let mut h = [0xeeu8; 32];
            (h[0], h[1], h[2]) = (b0, b1, b2);
            BlockKey::from_hash32(h, group)
        };
        let a = key(0xab, 0xcd, 0xe1, 0);
        leaves.set(&a, true);
        // same five hex digits (abcde), same group: the same directory
        assert!(leaves.known(&key(0xab, 0xcd, 0xef, 0)));
        // the sixth digit is not part of it; the fifth is
        assert!(!leaves.known(&key(0xab, 0xcd, 0xd1, 0)));
        // another group is another directory
        assert!(!leaves.known(&key(0xab, 0xcd, 0xe1, 1)));
        // groups past 3 are never known (the create finds out)
        let far = key(0xab, 0xcd, 0xe1, 9);
        leaves.set(&far, true);
        assert!(!leaves.known(&far));
        leaves.set(&a, false);
        assert!(!leaves.known(&a));
        // the layout agrees: both keys are in one directory
        let ns =
            Namespace::new(kv_tier_core::RunFields::new("m", "torch.bfloat16", 16), 0).unwrap();
        let dir = |k: &BlockKey| {
            let p = ns.block_rel_path(k);
            p[..p.rfind('/').unwrap()].to_string()
        };
        assert_eq!(dir(&a), dir(&key(0xab, 0xcd, 0xef, 0)));
        assert_ne!(dir(&a), dir(&key(0xab, 0xcd, 0xd1, 0)));
    }
}
