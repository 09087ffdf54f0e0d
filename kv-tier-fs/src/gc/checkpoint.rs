//! The index on disk: a checkpoint of every indexed block file (key, allocated bytes, mtime,
//! chain link) and of the measured leaf directories, written by the GC now and then and when
//! the tier closes, read by the next open instead of walking the tree.
//!
//! The file is `<namespace dir>/<rank dir name>.index` (outside the rank directory and the
//! cap, beside `config.json`). It is written whole to a temp file, fsynced and renamed over
//! the previous one, so a crash at any moment leaves the previous checkpoint or the new one,
//! never a mix. It ends with a CRC32C of everything before it, and begins with what it is
//! valid for (the rank directory's name, the directory and sidecar units, how top
//! directories count): a damaged, truncated or foreign checkpoint is refused, with the
//! reason, and the open walks the tree as it would without one.
//!
//! A checkpoint is where the index starts, never what it trusts over the files: every open
//! that reads one reconciles it with the disk by a full walk in the background (a rescan),
//! which adopts the files added since and forgets the ones removed since, whoever changed
//! them. Loads verify what they read whatever the index says.
//!
//! Records are written oldest first (by mtime), so reading them back builds the recency
//! order by appends. Layout (little-endian): `KVTFSIX1`, version `u32`, the identity (rank dir name as `u32`
//! length and bytes, `dir_unit u64`, `sidecar_unit u64`, `base_bytes u64`, `count_tops u8`),
//! written-at ns `i64`, records `u64`, each record (hash length `u8`, hash bytes, group `u32`,
//! size `u64`, mtime `i64`, parent record `u32` (`u32::MAX`: none), depth `u32`), measured
//! leaves `u64`, each (record `u32` of a file in it, bytes `u64`), then the CRC32C `u32`.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::time::Instant;

use kv_tier_core::BlockKey;
use rustc_hash::FxHashMap;

use super::Gc;
use super::index::leaf_of;

const MAGIC: &[u8; 8] = b"KVTFSIX1";
const VERSION: u32 = 1;
const NO_PARENT: u32 = u32::MAX;
/// More than a block file (at most 1 GiB, with its sidecar) or a leaf directory allocates:
/// a record past it is damage, and summing it could overflow the index's total.
const MAX_FILE_BYTES: u64 = 1 << 32;

/// What a checkpoint is valid for: a checkpoint written for anything else is foreign.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Identity {
    pub(crate) rank_dir: String,
    pub(crate) dir_unit: u64,
    pub(crate) sidecar_unit: u64,
    pub(crate) base_bytes: u64,
    pub(crate) count_tops: bool,
}

/// One indexed block file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) key: BlockKey,
    pub(crate) size: u64,
    pub(crate) mtime: i64,
    /// The block it follows (an index into the records) and its depth.
    pub(crate) link: Option<(u32, u32)>,
}

/// The index as a checkpoint holds it.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub(crate) records: Vec<Record>,
    /// Measured leaf directories: a record of a file in each, and its bytes.
    pub(crate) leaves: Vec<(u32, u64)>,
    /// When it was written (ns since the epoch).
    pub(crate) written_ns: i64,
}

/// Where the checkpoint of the rank directory `rank_dir_name` lives.
pub(crate) fn path(ns_dir: &Path, rank_dir_name: &str) -> PathBuf {
    ns_dir.join(format!("{rank_dir_name}.index"))
}

/// Links given as keys, as record numbers (a link to a key that is not a record is dropped:
/// its chain is broken already).
pub(crate) fn resolve_links(records: &mut [Record], links: &FxHashMap<BlockKey, (BlockKey, u32)>) {
    let at: FxHashMap<BlockKey, u32> = records
        .iter()
        .enumerate()
        .map(|(i, r)| (r.key, i as u32))
        .collect();
    for r in records.iter_mut() {
        r.link = links
            .get(&r.key)
            .and_then(|(p, d)| at.get(p).map(|i| (*i, *d)));
    }
}

pub(crate) fn encode(id: &Identity, s: &Snapshot) -> Vec<u8> {
    let mut b = Vec::with_capacity(64 + s.records.len() * 61 + s.leaves.len() * 12);
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.extend_from_slice(&(id.rank_dir.len() as u32).to_le_bytes());
    b.extend_from_slice(id.rank_dir.as_bytes());
    for v in [id.dir_unit, id.sidecar_unit, id.base_bytes] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    b.push(u8::from(id.count_tops));
    b.extend_from_slice(&s.written_ns.to_le_bytes());
    b.extend_from_slice(&(s.records.len() as u64).to_le_bytes());
    for r in &s.records {
        let h = r.key.hash_bytes();
        b.push(h.len() as u8);
        b.extend_from_slice(h);
        b.extend_from_slice(&r.key.group().to_le_bytes());
        b.extend_from_slice(&r.size.to_le_bytes());
        b.extend_from_slice(&r.mtime.to_le_bytes());
        let (p, d) = r.link.unwrap_or((NO_PARENT, 0));
        b.extend_from_slice(&p.to_le_bytes());
        b.extend_from_slice(&d.to_le_bytes());
    }
    b.extend_from_slice(&(s.leaves.len() as u64).to_le_bytes());
    for (r, bytes) in &s.leaves {
        b.extend_from_slice(&r.to_le_bytes());
        b.extend_from_slice(&bytes.to_le_bytes());
    }
    let crc = crc32c::crc32c(&b);
    b.extend_from_slice(&crc.to_le_bytes());
    b
}

/// Reads a checkpoint's bytes: `Err` says why they are not a checkpoint for `id`.
#[cfg(test)]
pub(crate) fn decode(id: &Identity, bytes: &[u8]) -> Result<Snapshot, String> {
    let mut records = Vec::new();
    let (leaves, written_ns) = decode_with(id, bytes, |n, r| {
        records.reserve_exact(n - records.len());
        records.push(r)
    })?;
    Ok(Snapshot {
        records,
        leaves,
        written_ns,
    })
}

/// [`decode`], handing each record to `record` as it is read (with how many records there
/// are) instead of collecting them: returns the measured leaves and when it was written. On
/// `Err` the records handed so far are not a checkpoint.
pub(crate) fn decode_with(
    id: &Identity,
    bytes: &[u8],
    mut record: impl FnMut(usize, Record),
) -> Result<(Vec<(u32, u64)>, i64), String> {
    if bytes.len() < MAGIC.len() + 4 || &bytes[..MAGIC.len()] != MAGIC {
        return Err("not a kv-tier index checkpoint (no magic)".into());
    }
    let (body, crc) = bytes.split_at(bytes.len() - 4);
    let crc = u32::from_le_bytes(crc.try_into().expect("4 bytes"));
    if crc32c::crc32c(body) != crc {
        return Err("its checksum does not match (damaged or cut short)".into());
    }
    let mut r = Reader {
        b: body,
        at: MAGIC.len(),
    };
    let version = r.u32()?;
    if version != VERSION {
        return Err(format!("version {version}, this build reads {VERSION}"));
    }
    let n = r.u32()? as usize;
    let rank_dir = String::from_utf8_lossy(r.take(n)?).into_owned();
    let found = Identity {
        rank_dir,
        dir_unit: r.u64()?,
        sidecar_unit: r.u64()?,
        base_bytes: r.u64()?,
        count_tops: r.u8()? != 0,
    };
    if &found != id {
        return Err(format!(
            "written for another directory or filesystem ({found:?}, this tier is {id:?})"
        ));
    }
    let written_ns = r.u64()? as i64;
    let n = r.u64()?;
    // every record takes at least 29 bytes: a count beyond that is damage, not an allocation
    if n > (body.len() / 29) as u64 {
        return Err(format!("{n} records cannot fit in {} bytes", body.len()));
    }
    for i in 0..n {
        let len = r.u8()? as usize;
        let hash = r.take(len)?;
        let group = r.u32()?;
        let key = BlockKey::new(hash, group).map_err(|e| format!("record {i}: {e}"))?;
        let size = r.u64()?;
        if size > MAX_FILE_BYTES {
            return Err(format!(
                "record {i} holds {size} bytes, more than a block file can"
            ));
        }
        let mtime = r.u64()? as i64;
        let (p, d) = (r.u32()?, r.u32()?);
        if p != NO_PARENT && u64::from(p) >= n {
            return Err(format!("record {i} follows record {p} of {n}"));
        }
        let link = (p != NO_PARENT).then_some((p, d));
        record(
            n as usize,
            Record {
                key,
                size,
                mtime,
                link,
            },
        );
    }
    let n_leaves = r.u64()?;
    if n_leaves > (body.len() / 12) as u64 {
        return Err(format!(
            "{n_leaves} leaves cannot fit in {} bytes",
            body.len()
        ));
    }
    let mut leaves = Vec::with_capacity(n_leaves as usize);
    for _ in 0..n_leaves {
        let (rec, bytes) = (r.u32()?, r.u64()?);
        if u64::from(rec) >= n {
            return Err(format!("a leaf names record {rec} of {n}"));
        }
        if bytes > MAX_FILE_BYTES {
            return Err(format!("a leaf directory of {bytes} bytes"));
        }
        leaves.push((rec, bytes));
    }
    if r.at != body.len() {
        return Err(format!("{} bytes follow its end", body.len() - r.at));
    }
    Ok((leaves, written_ns))
}

/// What the index held when a checkpoint was taken (its change counter, links applied,
/// files and bytes): an index that still matches needs no new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Mark(u64, u64, usize, u64);

impl Mark {
    fn of(idx: &super::index::Index) -> Self {
        Self(idx.seq, idx.links, idx.lru.len(), idx.lru.bytes())
    }
}

impl Gc {
    /// Checkpoints the index at `path` (see the module docs); read at open by
    /// [`Gc::read_checkpoint`].
    pub(crate) fn with_checkpoint(mut self, path: PathBuf) -> Self {
        self.checkpoint = Some(path);
        self
    }

    fn identity(&self) -> Identity {
        let (dir_unit, base_bytes, count_tops) = self.lock().units();
        Identity {
            rank_dir: self.at.ns.rank_dir_name(),
            dir_unit,
            sidecar_unit: self.sidecar_unit.load(Ordering::Relaxed),
            base_bytes,
            count_tops,
        }
    }

    /// The index as a checkpoint holds it, and its mark. The copy is made under the index
    /// lock; links and leaves are resolved after it drops.
    fn snapshot(&self) -> (Snapshot, Mark) {
        let idx = self.lock();
        let mut records = Vec::with_capacity(idx.lru.len());
        let mut links = FxHashMap::default();
        for (k, e, link) in idx.lru.iter_linked() {
            records.push(Record {
                key: k,
                size: e.size,
                mtime: e.mtime,
                link: None,
            });
            if let Some(l) = link {
                links.insert(k, l);
            }
        }
        let mut measured = idx.measured_leaves();
        let mark = Mark::of(&idx);
        drop(idx);
        // oldest first: read back in this order, the recency order is built by appends
        records.sort_unstable_by_key(|r| r.mtime);
        resolve_links(&mut records, &links);
        let mut leaves = Vec::with_capacity(measured.len());
        for (i, r) in records.iter().enumerate() {
            if measured.is_empty() {
                break;
            }
            if let Some(bytes) = measured.remove(&leaf_of(&r.key)) {
                leaves.push((i as u32, bytes));
            }
        }
        let written_ns = self.now_ns();
        let s = Snapshot {
            records,
            leaves,
            written_ns,
        };
        (s, mark)
    }

    /// Writes a checkpoint of the index if it changed since the last one (and checkpoints
    /// are on). Returns whether one was written; a failure is logged and counted, and the
    /// previous checkpoint stays.
    pub(crate) fn write_checkpoint(&self) -> bool {
        let Some(path) = &self.checkpoint else {
            return false;
        };
        let mut written = self.written.lock().unwrap_or_else(|p| p.into_inner());
        // unchanged: known from the mark alone, without a copy of the index under its lock
        if *written == Some(Mark::of(&self.lock())) {
            return false;
        }
        let t = Instant::now();
        let (snap, mark) = self.snapshot();
        let bytes = encode(&self.identity(), &snap);
        match write_atomically(path, &bytes) {
            Ok(()) => {
                *written = Some(mark);
                let c = &self.counters;
                c.checkpoints_written.fetch_add(1, Ordering::Relaxed);
                c.checkpoint_ms
                    .store(t.elapsed().as_millis() as u64, Ordering::Relaxed);
                tracing::debug!(tier = %self.at.name, files = snap.records.len(), bytes = bytes.len(), ms = t.elapsed().as_millis() as u64, "fs tier checkpointed its index");
                true
            }
            Err(e) => {
                self.counters
                    .checkpoint_errors
                    .fetch_add(1, Ordering::Relaxed);
                tracing::warn!(tier = %self.at.name, path = %path.display(), error = %e, "could not write the index checkpoint; the previous one (if any) stays, and the next open reconciles it with the disk");
                false
            }
        }
    }

    /// Reads the checkpoint into the (empty) index, if there is a usable one: returns how
    /// many files it holds. The index is then not reconciled with the disk until a walk
    /// has run (the GC thread's first step). A checkpoint that is damaged or foreign is
    /// refused with a warning naming it and why (counted), and `None` is returned: the open
    /// walks the tree.
    pub(crate) fn read_checkpoint(&self) -> Option<usize> {
        let path = self.checkpoint.as_ref()?;
        let t = Instant::now();
        // non-blocking, regular files only, no symlink followed: a FIFO or a device at the
        // path must not hang the open
        let bytes = match crate::file::read_regular(path) {
            Ok(Some(b)) => b,
            Ok(None) => return self.refuse(path, "not a regular file"),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return None,
            Err(e) => return self.refuse(path, &e.to_string()),
        };
        // the records straight into the index as they are read: no copy of them in between
        let id = self.identity();
        let mut idx = self.lock();
        let (decoded, leaf_of_record) = idx.load_with(|add| {
            decode_with(&id, &bytes, |n, r| add(n, r.key, r.size, r.mtime, r.link))
        });
        let (leaves, written_ns) = match decoded {
            Ok(d) => d,
            Err(why) => {
                // what was read of it is not a checkpoint: the index starts empty again
                let (dir_unit, base_bytes, count_tops) = idx.units();
                *idx = super::index::Index::new(dir_unit, base_bytes, count_tops);
                drop(idx);
                return self.refuse(path, &why);
            }
        };
        for (rec, bytes) in leaves {
            idx.set_bytes_of(leaf_of_record[rec as usize], bytes);
        }
        let n = leaf_of_record.len();
        self.reconciled.store(false, Ordering::SeqCst);
        drop(idx);
        drop(bytes);
        let c = &self.counters;
        c.checkpoint_files.store(n as u64, Ordering::Relaxed);
        c.checkpoint_read_ms
            .store(t.elapsed().as_millis() as u64, Ordering::Relaxed);
        let age_s = (self.now_ns() - written_ns) as f64 / 1e9;
        tracing::info!(tier = %self.at.name, files = n, bytes = self.total_bytes(), ms = t.elapsed().as_millis() as u64, age_s, "fs tier read its index checkpoint; reconciling it with the disk in the background");
        Some(n)
    }

    fn refuse(&self, path: &Path, why: &str) -> Option<usize> {
        self.counters
            .checkpoints_refused
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(tier = %self.at.name, path = %path.display(), reason = why, "ignoring the index checkpoint; walking the tree instead");
        None
    }

    /// A walk has reconciled the index with the disk.
    pub(super) fn mark_reconciled(&self) {
        if !self.reconciled.swap(true, Ordering::SeqCst) {
            tracing::info!(tier = %self.at.name, files = self.files(), "fs tier reconciled its checkpointed index with the disk");
        }
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        let end = self
            .at
            .checked_add(n)
            .filter(|e| *e <= self.b.len())
            .ok_or_else(|| format!("cut short at byte {}", self.at))?;
        let s = &self.b[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
}

/// Writes `bytes` as the checkpoint at `path`: a temp file beside it (reaped as any `.tmp`
/// if this process dies first), fsynced, renamed over the old one, the directory fsynced.
pub(crate) fn write_atomically(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut tmp = path.as_os_str().to_os_string();
    tmp.push(format!("_{:016x}.tmp", crate::block::random_salt()));
    let tmp = PathBuf::from(tmp);
    let done = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent() {
            crate::file::fsync_dir(dir)?;
        }
        Ok(())
    })();
    if done.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> Identity {
        Identity {
            rank_dir: "ns_r0".into(),
            dir_unit: 4096,
            sidecar_unit: 0,
            base_bytes: 0,
            count_tops: true,
        }
    }

    fn snap(n: u32) -> Snapshot {
        let records = (0..n)
            .map(|i| Record {
                key: BlockKey::new(&i.to_le_bytes()[..1 + (i as usize % 4)], i % 3).unwrap(),
                size: 4096 * u64::from(i + 1),
                mtime: -5 + i64::from(i) * 1_000_000_007,
                link: (i > 0).then(|| (i - 1, i)),
            })
            .collect();
        Snapshot {
            records,
            leaves: vec![(0, 8192), (n - 1, 12288)],
            written_ns: 42,
        }
    }

    #[test]
    fn a_checkpoint_reads_back_as_written() {
        let s = snap(100);
        assert_eq!(decode(&id(), &encode(&id(), &s)), Ok(s));
    }

    #[test]
    fn every_damage_and_every_other_identity_is_refused() {
        let bytes = encode(&id(), &snap(20));
        for cut in [0, 4, 8, 40, bytes.len() / 2, bytes.len() - 1] {
            assert!(decode(&id(), &bytes[..cut]).is_err(), "cut at {cut}");
        }
        for i in (0..bytes.len()).step_by(7) {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            assert!(
                decode(&id(), &b).is_err(),
                "a flipped bit at byte {i} was read"
            );
        }
        let mut longer = bytes.clone();
        longer.push(0);
        assert!(decode(&id(), &longer).is_err());
        for other in [
            Identity {
                rank_dir: "ns_r1".into(),
                ..id()
            },
            Identity {
                dir_unit: 0,
                ..id()
            },
            Identity {
                sidecar_unit: 4096,
                ..id()
            },
            Identity {
                count_tops: false,
                ..id()
            },
        ] {
            let e = decode(&other, &bytes).unwrap_err();
            assert!(e.contains("another directory"), "{e}");
        }
    }

    #[test]
    fn a_crafted_count_is_refused_before_it_allocates() {
        // a valid checksum over a header that claims 2^60 records
        let mut b = encode(&id(), &Snapshot::default());
        b.truncate(b.len() - 4 - 8 - 8); // the CRC, the leaf count, the record count
        b.extend_from_slice(&(1u64 << 60).to_le_bytes());
        b.extend_from_slice(&0u64.to_le_bytes());
        let crc = crc32c::crc32c(&b);
        b.extend_from_slice(&crc.to_le_bytes());
        let e = decode(&id(), &b).unwrap_err();
        assert!(e.contains("cannot fit"), "{e}");
    }

    /// Promise (`Gc::indexed`, `Gc::read_checkpoint`): an index read from a checkpoint
    /// answers for what it holds at once, leaves a key it lacks to a probe until a walk has
    /// reconciled it with the disk, and then answers for every key; a checkpoint is written
    /// only when the index changed.
    #[test]
    fn a_checkpointed_index_answers_for_what_it_holds_until_reconciled() {
        let dir = tempfile::tempdir().unwrap();
        let gc = opened(dir.path());
        let k = |i: u8| BlockKey::from_hash32([i; 32], 0);
        let a = gc();
        a.lock().insert(k(1), 4096, 5); // indexed, no file on disk
        assert!(a.write_checkpoint());
        assert!(
            !a.write_checkpoint(),
            "an unchanged index was written again"
        );
        let b = gc();
        assert_eq!(b.read_checkpoint(), Some(1));
        assert!(!b.reconciled());
        assert_eq!((b.indexed(&k(1)), b.indexed(&k(2))), (Some(true), None));
        b.rescan(); // the disk has neither
        assert!(b.reconciled());
        assert_eq!(
            (b.indexed(&k(1)), b.indexed(&k(2))),
            (Some(false), Some(false))
        );
    }

    /// A checkpoint whose checksum holds but whose third record cannot be a block file (as
    /// one written by another build might be) is refused after two records went into the
    /// index: the index is empty again, as it was before the read, and counts nothing.
    #[test]
    fn a_checkpoint_refused_midway_leaves_the_index_empty() {
        let dir = tempfile::tempdir().unwrap();
        let gc = opened(dir.path());
        let a = gc();
        let k = |i: u8| BlockKey::from_hash32([i; 32], 0);
        for i in 1..=3 {
            a.lock().insert(k(i), 4096, i64::from(i));
        }
        let base = a.total_bytes();
        let (mut snap, _) = a.snapshot();
        snap.records[2].size = u64::MAX;
        write_atomically(
            a.checkpoint.as_ref().unwrap(),
            &encode(&a.identity(), &snap),
        )
        .unwrap();
        let b = gc();
        let empty = b.total_bytes();
        assert_eq!(b.read_checkpoint(), None);
        assert_eq!(
            (b.files(), b.total_bytes(), b.reconciled()),
            (0, empty, true)
        );
        assert!(base > empty);
        assert_eq!(b.counters.checkpoints_refused.load(Ordering::Relaxed), 1);
    }

    /// A bounded GC for a root at `dir` with a checkpoint file, made anew by each call.
    fn opened(dir: &Path) -> impl Fn() -> Gc + '_ {
        use kv_tier_core::{EventLog, Locality, Medium, Namespace, ProtectionSet, RunFields};
        let ns = Namespace::new(RunFields::new("m", "torch.bfloat16", 16), 0).unwrap();
        std::fs::create_dir_all(dir.join(ns.rank_dir_name())).unwrap();
        let mut c = crate::FsTierConfig::new(dir);
        c.gc_max_size_gb = Some(1.0);
        let file = path(&ns.namespace_dir(dir), &ns.rank_dir_name());
        std::fs::create_dir_all(file.parent().unwrap()).unwrap();
        move || {
            let at = super::super::Place {
                name: "fs".into(),
                root: dir.to_path_buf(),
                ns: ns.clone(),
                protection: ProtectionSet::new(),
                events: std::sync::Arc::new(EventLog::new("fs", Medium::Storage, Locality::Local)),
            };
            Gc::new(c.gc().unwrap(), at, 4096, 0, true).with_checkpoint(file.clone())
        }
    }

    #[test]
    fn a_record_larger_than_any_block_file_is_refused() {
        let mut s = snap(3);
        s.records[1].size = u64::MAX;
        let e = decode(&id(), &encode(&id(), &s)).unwrap_err();
        assert!(e.contains("record 1 holds"), "{e}");
        let mut s = snap(3);
        s.leaves[0].1 = u64::MAX;
        assert!(decode(&id(), &encode(&id(), &s)).is_err());
    }

    #[test]
    fn links_to_keys_that_are_not_records_are_dropped() {
        let k = |i: u8| BlockKey::from_hash32([i; 32], 0);
        let mut records: Vec<Record> = (0..3)
            .map(|i| Record {
                key: k(i),
                size: 1,
                mtime: 0,
                link: None,
            })
            .collect();
        let links = [(k(1), (k(0), 1)), (k(2), (k(9), 5))].into_iter().collect();
        resolve_links(&mut records, &links);
        let got: Vec<_> = records.iter().map(|r| r.link).collect();
        assert_eq!(got, vec![None, Some((0, 1)), None]);
    }
}
