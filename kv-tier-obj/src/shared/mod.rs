//! A shared bucket: several instances (processes, hosts) on one bucket and prefix under one
//! bound, coordinated through small objects next to the blocks, with no server.
//!
//! Each instance joins as a member named `<instance_id>.<8 random hex digits>` (a restart,
//! or two instances given one id, are different members). The coordination prefix is
//! `<prefix>/kv-tier-shared/<rank dir>/`:
//!
//! - `lease`: `<epoch> <owner> <beat>`, the leader. Taken with a conditional PUT only
//!   (`If-None-Match: *` when there is none, else `If-Match` of the version last read): of
//!   several instances that see it expire, one wins, at an epoch above every one it has
//!   seen. The leader renews it (`If-Match` of its own last version) four times per period,
//!   and stops leading if it has not managed to for three quarters of a period; another
//!   instance takes it once it has read the same version (or none, or one it cannot parse)
//!   for a whole period by its own clock, or at once when it says `-` (released at a clean
//!   close) or when it has never seen a lease at all (a fresh bucket).
//! - `members/<member>`: each member's heartbeat, rewritten four times per period (deleted at
//!   a clean close). A member spends credit only within a period of its last heartbeat that
//!   landed.
//! - `journal/<member>/<seq>`: each member's journal, one object per batch (written every
//!   tick when there is something to say, retried under the same name until it lands):
//!   `B <bytes>` its block size (first), `P <key> <bytes> <epoch> <leader>` a store spending
//!   credit of that leader, `D <key> <1|0|?>` that store's end (written, not written, not
//!   known: a cancelled or timed-out PUT), `R <key>` a load (at most once per key per
//!   quarter period; a batch holding one is sent within a quarter tick), `W` a store waiting
//!   for credit (sent as soon), `X` its shutdown (last), and at the end of every batch
//!   `C <epoch> <leader> <bytes>`, the credit of that leader it has spent in all.
//! - `grants/<member>`: `<epoch> <leader> <granted>`: the credit (cumulative bytes) that
//!   leader granted it, rewritten when it grows, when a write failed, and once a period.
//!
//! The leader keeps the index of every member's objects (a whole LIST of the rank's objects
//! when it takes the lease, then what the journals say), deletes the least recently used for
//! everyone down to the low watermark, never a key whose read it has seen within a lease
//! period, and grants credit only while its index, the stores in flight and the credit
//! granted and not spent stay under 1.05x the bound: so the bucket never holds more than
//! that. A member spends only the credit of the leader whose lease it last read; a new
//! leader grants nothing for two ticks, so the old leader's credit is dropped first. A
//! member whose heartbeat stayed unchanged for two periods (or is gone after its `X`) is
//! gone: its stores in flight count as written, its unspent credit no more.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, Result};
use object_store::path::Path as ObjPath;
use rustc_hash::FxHashMap;
use tokio::sync::Notify;

use crate::capacity::Cap;
use crate::stats::{SharedCounters, SharedStats};

mod leader;
mod lease;
pub(crate) mod tasks;

/// Locks `m`, whatever a panicking holder left (every critical section here leaves its state
/// consistent before anything can panic).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// How long a store waits for credit before the blocks it lacks are refused (`NoSpace`).
const CREDIT_WAIT: Duration = Duration::from_secs(1);

/// Journal records kept while they cannot be sent, past which reads are not journaled
/// (stores are: their credit bounds them).
const MAX_UNSENT: usize = 4 << 20;

/// The coordination of one instance on a shared bucket.
pub(crate) struct Coord {
    /// This member's name (the instance id and this incarnation's random suffix).
    pub(crate) id: String,
    dir: String,
    lease: Duration,
    tick: Duration,
    w: Mutex<Writer>,
    credit: Notify,
    /// The leader's index of every instance's objects (empty unless leading).
    pub(crate) index: Cap,
    /// Keys any instance read lately, by when the leader saw the read.
    read_seen: Mutex<FxHashMap<BlockKey, Instant>>,
    /// Keys whose store's end is not known (`D ... ?`: a PUT that timed out may land later
    /// still), by when the leader saw it: not deleted for a while (a delete that found
    /// nothing before the PUT landed would leave the object uncounted).
    doubtful: Mutex<FxHashMap<BlockKey, Instant>>,
    leading: AtomicBool,
    /// The tier closed (see [`Coord::close`]).
    closed: AtomicBool,
    /// The epoch of the lease this instance holds (while `leading`).
    lead_epoch: AtomicU64,
    epoch_seen: AtomicU64,
    members: AtomicU64,
    global_bytes: AtomicU64,
    pub(crate) counters: SharedCounters,
}

/// This instance as a writer: its journal and credit.
#[derive(Default)]
struct Writer {
    /// Records not yet sent.
    records: String,
    /// A batch sent and not known to have landed: sent again under the same name.
    unsent: Option<(u64, String)>,
    next_seq: u64,
    /// The lease's epoch as last seen: only that leader's credit is spent.
    lease_epoch: u64,
    /// The lease's holder as last seen.
    lease_owner: String,
    grant_epoch: u64,
    /// The leader whose grant this is.
    grant_owner: String,
    /// Credit is spent only until a lease after its last heartbeat that landed: an instance
    /// the leader may count as gone (its heartbeat unchanged for two periods) spends none.
    spend_until: Option<Instant>,
    granted: u64,
    consumed: u64,
    /// When each key's read was last journaled.
    reads: FxHashMap<BlockKey, Instant>,
    /// `records` holds a read or a request for credit: sent within a quarter tick.
    reads_unsent: bool,
}

impl Writer {
    fn available(&self) -> u64 {
        if self.grant_epoch != self.lease_epoch
            || self.grant_owner != self.lease_owner
            || self.lease_epoch == 0
            || self.spend_until.is_none_or(|t| Instant::now() > t)
        {
            return 0;
        }
        self.granted.saturating_sub(self.consumed)
    }
}

/// A store's record of its end: `D <key> <outcome>` is journaled when this drops (the store
/// done, failed, timed out or cancelled), with `?` unless the store said how it ended.
pub(crate) struct Finish {
    coord: Arc<Coord>,
    key: BlockKey,
    outcome: u8,
}

impl Finish {
    /// The object was written, or found there.
    pub(crate) fn written(&mut self) {
        self.outcome = b'1';
    }
    /// The object was not written (the PUT was refused).
    pub(crate) fn not_written(&mut self) {
        self.outcome = b'0';
    }
}

impl Drop for Finish {
    fn drop(&mut self) {
        let mut w = lock(&self.coord.w);
        let _ = writeln!(
            w.records,
            "D {} {}",
            encode_key(&self.key),
            self.outcome as char
        );
    }
}

fn encode_key(k: &BlockKey) -> String {
    let mut s = String::with_capacity(76);
    for b in k.hash_bytes() {
        let _ = write!(s, "{b:02x}");
    }
    let _ = write!(s, ":{}", k.group());
    s
}

fn decode_key(s: &str) -> Option<BlockKey> {
    let (hex, group) = s.split_once(':')?;
    if hex.len() != 64 {
        return None;
    }
    let mut hash = [0u8; 32];
    for (i, b) in hash.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(BlockKey::from_hash32(hash, group.parse().ok()?))
}

/// One journal record.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Record {
    /// A store's key, its bytes, and the epoch and name of the leader whose credit it spent.
    Store(BlockKey, u64, u64, String),
    Done(BlockKey, u8),
    Read(BlockKey),
    /// The writer's block size (its first record).
    Block(u64),
    /// The credit the writer has spent of the grant of `(epoch, leader)`, in all (each batch
    /// ends with it: a leader that missed a batch still knows what was spent).
    Consumed(u64, String, u64),
    /// The writer shut down (its last batch).
    Exit,
    /// The writer has a store waiting for credit.
    Want,
}

impl Record {
    fn parse(line: &str) -> Option<Record> {
        let mut it = line.split(' ');
        let kind = it.next()?;
        match kind {
            "X" => return it.next().is_none().then_some(Record::Exit),
            "W" => return it.next().is_none().then_some(Record::Want),
            "B" => {
                let r = Record::Block(it.next()?.parse().ok()?);
                return it.next().is_none().then_some(r);
            }
            "C" => {
                let epoch = it.next()?.parse().ok()?;
                let leader = it.next()?.to_string();
                let r = Record::Consumed(epoch, leader, it.next()?.parse().ok()?);
                return it.next().is_none().then_some(r);
            }
            _ => {}
        }
        let key = decode_key(it.next()?)?;
        let r = match kind {
            "P" => Record::Store(
                key,
                it.next()?.parse().ok()?,
                it.next()?.parse().ok()?,
                it.next()?.to_string(),
            ),
            "D" => match it.next()?.as_bytes() {
                [o @ (b'0' | b'1' | b'?')] => Record::Done(key, *o),
                _ => return None,
            },
            "R" => Record::Read(key),
            _ => return None,
        };
        it.next().is_none().then_some(r)
    }
}

impl Coord {
    /// The coordination of instance `instance_id` under `dir` (the coordination prefix),
    /// as a new member: `<instance_id>.<8 random hex digits>` names its heartbeat, journal
    /// and grant, so an instance restarted with its id (or, by mistake, two instances with
    /// one id) never takes over another incarnation's journal or credit.
    pub(crate) fn new(
        instance_id: &str,
        dir: String,
        lease: Duration,
        cap: u64,
        low: f64,
        block_size: usize,
    ) -> Self {
        use std::hash::{BuildHasher, Hasher};
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u128(
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos()),
        );
        h.write_u32(std::process::id());
        let tick = (lease / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        Self {
            id: format!("{instance_id}.{:08x}", h.finish() as u32),
            dir,
            lease,
            tick,
            w: Mutex::new(Writer {
                records: format!("B {block_size}\n"),
                ..Writer::default()
            }),
            credit: Notify::new(),
            index: Cap::new(cap, low),
            read_seen: Mutex::new(FxHashMap::default()),
            doubtful: Mutex::new(FxHashMap::default()),
            leading: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            lead_epoch: AtomicU64::new(0),
            epoch_seen: AtomicU64::new(0),
            members: AtomicU64::new(0),
            global_bytes: AtomicU64::new(0),
            counters: SharedCounters::default(),
        }
    }

    fn path(&self, rel: &str) -> ObjPath {
        ObjPath::from(format!("{}/{rel}", self.dir))
    }

    pub(crate) fn is_leader(&self) -> bool {
        self.leading.load(Ordering::SeqCst)
    }

    pub(crate) fn stats(&self) -> SharedStats {
        let w = lock(&self.w);
        let mut s = SharedStats {
            leader: self.is_leader(),
            epoch: self.epoch_seen.load(Ordering::Relaxed),
            members: self.members.load(Ordering::Relaxed),
            global_bytes: self.global_bytes.load(Ordering::Relaxed),
            granted_bytes: w.granted,
            consumed_bytes: w.consumed,
            ..SharedStats::default()
        };
        drop(w);
        self.counters.fill(&mut s);
        s
    }

    /// When a store job that starts now stops waiting for credit: [`CREDIT_WAIT`] for the
    /// whole job, however many blocks it has.
    pub(crate) fn credit_deadline() -> tokio::time::Instant {
        tokio::time::Instant::now() + CREDIT_WAIT
    }

    /// The tier closes: stores waiting for credit stop waiting.
    pub(crate) fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.credit.notify_waiters();
    }

    /// Spends `bytes` of credit for a store of `key` and journals it, waiting for credit up to
    /// `deadline` (the job's, [`Coord::credit_deadline`]); the returned guard journals the
    /// store's end. `NoSpace` when no credit came, `Shutdown` when the tier closed.
    pub(crate) async fn credit_for(
        self: &Arc<Self>,
        key: BlockKey,
        bytes: u64,
        tier: &str,
        deadline: tokio::time::Instant,
    ) -> Result<Finish> {
        let mut waited = false;
        loop {
            let notified = self.credit.notified();
            if self.closed.load(Ordering::SeqCst) {
                return Err(crate::error::closed(tier));
            }
            {
                let mut w = lock(&self.w);
                if w.available() >= bytes {
                    w.consumed += bytes;
                    let (epoch, leader) = (w.grant_epoch, w.grant_owner.clone());
                    let _ = writeln!(w.records, "P {} {bytes} {epoch} {leader}", encode_key(&key));
                    return Ok(Finish {
                        coord: self.clone(),
                        key,
                        outcome: b'?',
                    });
                }
            }
            if !waited {
                waited = true;
                self.counters.credit_waits.fetch_add(1, Ordering::Relaxed);
                // the leader grants to members that ask (sent within a quarter tick)
                let mut w = lock(&self.w);
                if w.records.len() < MAX_UNSENT {
                    w.records.push_str("W\n");
                    w.reads_unsent = true;
                }
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                self.counters.no_credit.fetch_add(1, Ordering::Relaxed);
                return Err(Error::NoSpace {
                    tier: tier.to_string(),
                    detail: format!(
                        "block {key}: no credit from the shared bucket's leader within {CREDIT_WAIT:?} of the job's start (the bucket is at its bound, or no instance holds the lease)"
                    ),
                });
            }
        }
    }

    /// Journals a load of `key` (at most once per key per quarter lease period).
    pub(crate) fn note_read(&self, key: BlockKey) {
        let now = Instant::now();
        let mut w = lock(&self.w);
        if w.records.len() >= MAX_UNSENT {
            return; // the journal cannot be written: reads are the records it can spare
        }
        let every = self.lease / 4;
        if w.reads.get(&key).is_some_and(|t| now - *t < every) {
            return;
        }
        w.reads.insert(key, now);
        w.reads_unsent = true;
        let _ = writeln!(w.records, "R {}", encode_key(&key));
    }

    fn error(&self, what: &str, e: &dyn std::fmt::Display) {
        self.counters.coord_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(instance = %self.id, error = %e, "shared bucket: {what} failed");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_garbage_is_refused() {
        let k = kv_tier_core::BlockKey::from_hash32([7; 32], 3);
        for (line, r) in [
            ("X", Record::Exit),
            ("W", Record::Want),
            ("B 4096", Record::Block(4096)),
            ("C 3 a.0f 8192", Record::Consumed(3, "a.0f".into(), 8192)),
        ] {
            assert_eq!(Record::parse(line), Some(r), "{line}");
        }
        for r in [
            Record::Store(k, 65536, 3, "a.0f".into()),
            Record::Done(k, b'1'),
            Record::Done(k, b'0'),
            Record::Done(k, b'?'),
            Record::Read(k),
        ] {
            let line = match r.clone() {
                Record::Store(k, b, e, l) => format!("P {} {b} {e} {l}", encode_key(&k)),
                Record::Done(k, o) => format!("D {} {}", encode_key(&k), o as char),
                Record::Read(k) => format!("R {}", encode_key(&k)),
                _ => unreachable!(),
            };
            assert_eq!(Record::parse(&line), Some(r), "{line}");
        }
        for bad in [
            "X 1",
            "B",
            "B x",
            "B 1 2",
            "C 1 a",
            "C x a 1",
            "",
            "P",
            "X 00:1",
            "P 0707:3 1 1 a",
            "P 0707070707070707070707070707070707070707070707070707070707070707:3 1",
            "P 0707070707070707070707070707070707070707070707070707070707070707:3 1 1",
            "D 0707070707070707070707070707070707070707070707070707070707070707:3 2",
            "R 0707070707070707070707070707070707070707070707070707070707070707:3 extra",
            "P 0707070707070707070707070707070707070707070707070707070707070707:x 1 1 a",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }
}
