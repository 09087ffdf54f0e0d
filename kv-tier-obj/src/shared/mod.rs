//! A shared bucket: several instances (processes, hosts) on one bucket and prefix under one
//! bound, coordinated through small objects next to the blocks, with no server.
//!
//! The coordination prefix is `<prefix>/kv-tier-shared/<rank dir>/`:
//!
//! - `lease`: `<epoch> <owner> <beat>`, the leader. Taken with a conditional PUT only
//!   (`If-None-Match: *` when there is none, else `If-Match` of the version last seen): of
//!   several instances that see it expire, one wins. The leader renews it (`If-Match` of its
//!   own last version) four times per period, and stops leading if it has not managed to for
//!   three quarters of a period; an instance that sees the same version for a whole period
//!   by its own clock (or `owner` `-`: released at a clean close) takes it.
//! - `members/<id>`: each instance's heartbeat, rewritten four times per period (deleted at
//!   a clean close).
//! - `journal/<id>/<seq>`: each instance's journal, one object per batch (written every
//!   tick when there is something to say, retried under the same name until it lands):
//!   `P <key> <bytes> <epoch>` a store spending credit of the leader of `epoch`, `D <key> <1|0|?>` that store's end
//!   (written, not written, not known: a cancelled or timed-out PUT), `R <key>` a load (at
//!   most once per key per quarter period).
//! - `grants/<id>`: `<epoch> <granted>`: the credit (cumulative bytes) the leader of `epoch`
//!   granted it.
//!
//! The leader keeps the index of every instance's objects (a LIST of the rank's objects when
//! it takes the lease, then what the journals say), deletes the least recently used for
//! everyone down to the low watermark, never a key any instance read within a lease period,
//! and grants credit only while its index, the stores in flight and the credit granted and
//! not spent stay under 1.05x the bound: so the bucket never holds more than that. A writer
//! spends only credit of the leader whose lease it last saw; a new leader grants nothing for
//! two ticks, so the old leader's credit is dropped first.

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
    leading: AtomicBool,
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
    grant_epoch: u64,
    granted: u64,
    consumed: u64,
    /// When each key's read was last journaled.
    reads: FxHashMap<BlockKey, Instant>,
}

impl Writer {
    fn available(&self) -> u64 {
        if self.grant_epoch != self.lease_epoch || self.lease_epoch == 0 {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Record {
    /// A store's key, its bytes and the epoch of the leader whose credit it spent.
    Store(BlockKey, u64, u64),
    Done(BlockKey, u8),
    Read(BlockKey),
}

impl Record {
    fn parse(line: &str) -> Option<Record> {
        let mut it = line.split(' ');
        let kind = it.next()?;
        let key = decode_key(it.next()?)?;
        let r = match kind {
            "P" => Record::Store(key, it.next()?.parse().ok()?, it.next()?.parse().ok()?),
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
    /// The coordination of instance `id` under `dir` (the coordination prefix).
    pub(crate) fn new(id: String, dir: String, lease: Duration, cap: u64, low: f64) -> Self {
        let tick = (lease / 10).clamp(Duration::from_millis(10), Duration::from_secs(1));
        Self {
            id,
            dir,
            lease,
            tick,
            w: Mutex::new(Writer::default()),
            credit: Notify::new(),
            index: Cap::new(cap, low),
            read_seen: Mutex::new(FxHashMap::default()),
            leading: AtomicBool::new(false),
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

    /// Spends `bytes` of credit for a store of `key` and journals it, waiting for credit up to
    /// [`CREDIT_WAIT`]; the returned guard journals the store's end. `NoSpace` when no
    /// credit came.
    pub(crate) async fn credit_for(
        self: &Arc<Self>,
        key: BlockKey,
        bytes: u64,
        tier: &str,
    ) -> Result<Finish> {
        let deadline = tokio::time::Instant::now() + CREDIT_WAIT;
        let mut waited = false;
        loop {
            let notified = self.credit.notified();
            {
                let mut w = lock(&self.w);
                if w.available() >= bytes {
                    w.consumed += bytes;
                    let epoch = w.grant_epoch;
                    let _ = writeln!(w.records, "P {} {bytes} {epoch}", encode_key(&key));
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
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                self.counters.no_credit.fetch_add(1, Ordering::Relaxed);
                return Err(Error::NoSpace {
                    tier: tier.to_string(),
                    detail: format!(
                        "block {key}: no credit from the shared bucket's leader within {CREDIT_WAIT:?} (the bucket is at its bound, or no instance holds the lease)"
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
        for r in [
            Record::Store(k, 65536, 3),
            Record::Done(k, b'1'),
            Record::Done(k, b'0'),
            Record::Done(k, b'?'),
            Record::Read(k),
        ] {
            let line = match r {
                Record::Store(k, b, e) => format!("P {} {b} {e}", encode_key(&k)),
                Record::Done(k, o) => format!("D {} {}", encode_key(&k), o as char),
                Record::Read(k) => format!("R {}", encode_key(&k)),
            };
            assert_eq!(Record::parse(&line), Some(r), "{line}");
        }
        for bad in [
            "",
            "P",
            "X 00:1",
            "P 0707:3 1 1",
            "P 0707070707070707070707070707070707070707070707070707070707070707:3 1",
            "D 0707070707070707070707070707070707070707070707070707070707070707:3 2",
            "R 0707070707070707070707070707070707070707070707070707070707070707:3 extra",
            "P 0707070707070707070707070707070707070707070707070707070707070707:x 1 1",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }
}
