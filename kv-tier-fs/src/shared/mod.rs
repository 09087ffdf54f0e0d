//! A shared root: several instances (processes, possibly on several hosts) on one rank
//! directory under one cap, coordinated through small files next to it, with no server.
//!
//! The coordination directory is `<namespace dir>/shared-r<rank>/`:
//!
//! - `lease`: `<epoch> <owner> <beat>`: the leader. It rewrites the file (temp + rename)
//!   four times per lease period with `beat + 1`; `owner` `-` is a lease released by a
//!   leader that closed.
//! - `claims/<epoch>`: taking the lease at an epoch starts with creating this file with
//!   `O_EXCL`: of several instances that see the lease expire, one wins.
//! - `members/<id>`: each instance's heartbeat (`<beat>`), rewritten four times per period.
//! - `journal/<id>`: each instance's append-only journal, one `write` per job:
//!   `P <path> <credit>` before it writes a block (the credit it spends), `D <path>` when that
//!   store's job has ended (written or not), and `R <path>` before it reads one (at most
//!   once per key per stamp interval).
//! - `grants/<id>`: `<epoch> <granted>`: the credit (cumulative bytes) the leader granted it.
//! - `state`: `<epoch> <bytes> <cap> <members>`: the leader's view, for the others' stats.
//!
//! Expiry is judged by each observer's own monotonic clock (a lease or heartbeat unchanged for
//! a whole period), never by comparing clocks across hosts. The leader indexes what the
//! journals announce, sweeps least-recently-used files for everyone, never takes a key read
//! within two stamp intervals, and grants credit only while the total with all credit granted
//! and not spent stays under the hard ceiling: so the directory never holds more than that.

mod files;
mod leader;

use std::fs::File;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, BlockSource, Error, Namespace};
use rustc_hash::FxHashMap;

use crate::stats::{SharedCounters as Counters, SharedStats};
use files::{Lease, Record, State, ctx, open_journal, read_grant, read_opt, replace};
pub(crate) use leader::spawn;

/// How long a store on a shared root waits for credit before the blocks it lacks are
/// refused (`NoSpace`).
const CREDIT_WAIT: Duration = Duration::from_secs(1);

/// Figures of [`Coord`] that are not counters.
#[derive(Default)]
struct Seen {
    members: AtomicU64,
    global_bytes: AtomicU64,
    epoch: AtomicU64,
}

/// This instance's side as a writer: its journal and credit.
struct Writer {
    /// This incarnation's name in `members/`, `journal/` and `grants/`: the instance id, then
    /// `<id>.r<n>` after its journal was removed under it (a new member to the leader: the
    /// old one's credit and journal are never mixed with the new one's).
    name: String,
    incarnation: u32,
    journal: File,
    /// A write failed part-way: the next one starts with a newline, so the broken line is
    /// one bad record, not the start of the next.
    dirty: bool,
    /// The highest leader epoch whose grant this writer took (an older leader's late grant
    /// is not taken).
    grant_epoch: u64,
    granted: u64,
    consumed: u64,
    /// When each key's read was last journaled (rate limit: one per stamp interval).
    reads: FxHashMap<BlockKey, Instant>,
}

impl Writer {
    /// Appends `lines` to the journal (one `write`); after a failed one, a newline first.
    fn append(&mut self, lines: &str) -> io::Result<()> {
        let r = if self.dirty {
            self.journal.write_all(format!("\n{lines}").as_bytes())
        } else {
            self.journal.write_all(lines.as_bytes())
        };
        self.dirty = r.is_err();
        r
    }
}

/// The coordination of one instance on a shared root.
pub(crate) struct Coord {
    dir: PathBuf,
    id: String,
    lease: Duration,
    stamp_interval: Duration,
    ns: Namespace,
    /// Credit one block needs: its file and two directories (at most).
    block_credit: u64,
    /// Allocated bytes of one block file with its sidecar: what the leader indexes for it.
    file_bytes: u64,
    cap: u64,
    hard: u64,
    low: u64,
    writer: Mutex<Writer>,
    leader: AtomicBool,
    stop: Mutex<bool>,
    cv: Condvar,
    counters: Counters,
    seen: Seen,
}

/// What [`Coord::new`] needs besides the paths.
pub(crate) struct Sizes {
    pub(crate) block_credit: u64,
    pub(crate) file_bytes: u64,
    pub(crate) cap: u64,
    pub(crate) hard: u64,
    pub(crate) low: u64,
    pub(crate) stamp_interval: Duration,
}

impl Coord {
    /// Joins the shared root: makes the coordination directory and this instance's journal
    /// and heartbeat. Fails naming the path when they cannot be made, or when `id` is taken
    /// by a live instance (its heartbeat file exists).
    pub(crate) fn new(
        root: &Path,
        ns: &Namespace,
        id: String,
        lease: Duration,
        sizes: Sizes,
    ) -> io::Result<Self> {
        let dir = ns
            .namespace_dir(root)
            .join(format!("shared-r{}", ns.rank()));
        for sub in ["claims", "members", "journal", "grants"] {
            let d = dir.join(sub);
            std::fs::create_dir_all(&d).map_err(|e| ctx("mkdir", &d, e))?;
        }
        // every instance must bound the same directory the same way: the leader publishes
        // its settings, and an instance that differs is refused, naming the setting
        if let Some(state) = read_opt(&dir.join("state")).and_then(|s| State::parse(&s)) {
            let mine = [
                ("gc_max_size_gb", state.cap, sizes.cap),
                ("shared_lease_s", state.lease_ms, lease.as_millis() as u64),
                (
                    "gc_stamp_interval_s",
                    state.stamp_ms,
                    sizes.stamp_interval.as_millis() as u64,
                ),
            ];
            for (field, theirs, ours) in mine {
                if theirs != ours {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!(
                            "{field}: differs from the shared root's leader's ({theirs} there, {ours} here; cap in bytes, times in ms): every instance on a shared root must set it alike"
                        ),
                    ));
                }
            }
        }
        let member = dir.join("members").join(&id);
        if let Some(before) = read_opt(&member) {
            // a heartbeat with this id: a live instance, or this one's previous run (killed,
            // restarted): it is live if its heartbeat moves within a lease period and a quarter
            let deadline = Instant::now() + lease + lease / 4;
            while Instant::now() < deadline {
                std::thread::sleep((lease / 8).min(Duration::from_millis(100)));
                if read_opt(&member).is_some_and(|now| now != before) {
                    return Err(io::Error::new(
                        io::ErrorKind::AlreadyExists,
                        format!(
                            "instance id {id:?} is in use on this shared root (its heartbeat {} is alive); give each instance its own instance_id",
                            member.display()
                        ),
                    ));
                }
            }
            tracing::info!(instance = %id, "shared root: taking over the stale heartbeat of a previous run with this id");
        }
        replace(&member, "0\n").map_err(|e| ctx("write", &member, e))?;
        let jp = dir.join("journal").join(&id);
        let journal = open_journal(&jp).map_err(|e| ctx("open", &jp, e))?;
        // a previous run's journal (killed and restarted, the leader not done with it): the
        // credit it spent and was granted carry on (read through the descriptor opened: the
        // leader may remove the path meanwhile, and then this is a fresh start)
        let mut text = String::new();
        std::io::Read::read_to_string(&mut &journal, &mut text).map_err(|e| ctx("read", &jp, e))?;
        let consumed: u64 = text
            .lines()
            .filter_map(Record::parse)
            .filter(|(r, _, _)| *r == Record::Store)
            .map(|(_, _, credit)| credit)
            .sum();
        let granted = if consumed == 0 {
            0
        } else {
            read_grant(&dir.join("grants").join(&id)).map_or(0, |(_, g)| g)
        }
        .max(consumed);
        let name0 = id.clone();
        Ok(Self {
            dir,
            id,
            lease,
            stamp_interval: sizes.stamp_interval,
            ns: ns.clone(),
            block_credit: sizes.block_credit,
            file_bytes: sizes.file_bytes,
            cap: sizes.cap,
            hard: sizes.hard,
            low: sizes.low,
            writer: Mutex::new(Writer {
                name: name0,
                incarnation: 0,
                journal,
                dirty: false,
                grant_epoch: 0,
                granted,
                consumed,
                reads: FxHashMap::default(),
            }),
            leader: AtomicBool::new(false),
            stop: Mutex::new(false),
            cv: Condvar::new(),
            counters: Counters::default(),
            seen: Seen::default(),
        })
    }

    pub(crate) fn is_leader(&self) -> bool {
        self.leader.load(Ordering::SeqCst)
    }

    fn writer(&self) -> std::sync::MutexGuard<'_, Writer> {
        self.writer.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn stats(&self) -> SharedStats {
        let w = self.writer();
        let mut s = SharedStats {
            leader: self.is_leader(),
            epoch: self.seen.epoch.load(Ordering::Relaxed),
            members: self.seen.members.load(Ordering::Relaxed),
            global_bytes: self.seen.global_bytes.load(Ordering::Relaxed),
            granted_bytes: w.granted,
            consumed_bytes: w.consumed,
            ..SharedStats::default()
        };
        self.counters.fill(&mut s);
        s
    }

    fn error(&self, what: &str, e: &io::Error) {
        self.counters.coord_errors.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(instance = %self.id, error = %e, "shared root: {what} failed");
    }

    fn grants_path(&self, id: &str) -> PathBuf {
        self.dir.join("grants").join(id)
    }

    /// Spends credit for as many of `keys` (from the first) as it covers, announcing each in
    /// the journal before any is written (one `write`); returns how many. The grant file is
    /// read again when what is left does not cover them all. No await inside: a caller's
    /// future dropped around it never leaves credit spent and unannounced.
    pub(crate) fn take_credit(&self, keys: &[BlockKey]) -> io::Result<usize> {
        let mut w = self.writer();
        let need = keys.len() as u64 * self.block_credit;
        if w.granted.saturating_sub(w.consumed) < need
            && let Some((epoch, g)) = read_grant(&self.grants_path(&w.name))
            // an older leader's late grant is not taken; but if the epochs started over
            // (the coordination directory was wiped), the lease's own epoch is the truth
            && (epoch >= w.grant_epoch || self.read_lease().is_some_and(|l| l.epoch == epoch))
        {
            w.grant_epoch = epoch;
            w.granted = w.granted.max(g);
        }
        let n =
            ((w.granted.saturating_sub(w.consumed) / self.block_credit) as usize).min(keys.len());
        if n == 0 {
            return Ok(0);
        }
        let lines = Record::Store.lines(&self.ns, &keys[..n], self.block_credit);
        if let Err(e) = w.append(&lines) {
            self.error("journal write", &e);
            // whatever part of it landed announces stores that will not happen: closed
            let _ = w.append(&Record::Done.lines(&self.ns, &keys[..n], 0));
            return Err(e);
        }
        w.consumed += n as u64 * self.block_credit;
        Ok(n)
    }

    /// Takes credit for a store job's `blocks` (announcing each in the journal before it is
    /// written), waiting up to [`CREDIT_WAIT`] for the leader to grant more; the blocks it
    /// could not cover are taken out of `blocks` and returned as `NoSpace` (not stored).
    pub(crate) async fn credit_for(
        &self,
        tier: &str,
        closing: &AtomicBool,
        blocks: &mut Vec<(BlockKey, BlockSource)>,
        finish: &mut Finish,
    ) -> Vec<(BlockKey, Error)> {
        let keys: Vec<BlockKey> = blocks.iter().map(|(k, _)| *k).collect();
        let deadline = std::time::Instant::now() + CREDIT_WAIT;
        let mut got = 0;
        let mut failure = None;
        let mut waited = false;
        while got < keys.len() {
            match self.take_credit(&keys[got..]) {
                Ok(n) => {
                    finish.keys.extend_from_slice(&keys[got..got + n]);
                    got += n;
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
            if got == keys.len()
                || std::time::Instant::now() >= deadline
                || closing.load(Ordering::SeqCst)
            {
                break;
            }
            if !waited {
                waited = true;
                self.counters.credit_waits.fetch_add(1, Ordering::Relaxed);
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let rest = blocks.split_off(got);
        if failure.is_none() {
            self.counters
                .no_credit
                .fetch_add(rest.len() as u64, Ordering::Relaxed);
        }
        rest.into_iter()
            .map(|(k, _)| {
                let e = match &failure {
                    Some(e) => Error::Backend {
                        tier: tier.to_string(),
                        message: format!("shared root: could not announce block {k} in this instance's journal: {e}"),
                        transient: true,
                    },
                    None => Error::NoSpace {
                        tier: tier.to_string(),
                        detail: format!(
                            "block {k}: no credit from the shared root's leader within {CREDIT_WAIT:?} (instance {}; the directory is at its bound, or no leader holds the lease right now)",
                            self.id
                        ),
                    },
                };
                (k, e)
            })
            .collect()
    }

    /// Closes the announcements of `keys` (their store job ended, written or not): `D`
    /// lines, one `write`. Until then the leader counts a missing file of theirs as on its
    /// way, not gone.
    pub(crate) fn finish(&self, keys: &[BlockKey]) {
        if keys.is_empty() {
            return;
        }
        let lines = Record::Done.lines(&self.ns, keys, 0);
        if let Err(e) = self.writer().append(&lines) {
            self.error("journal write", &e);
        }
    }

    /// Announces reads of `keys` (each at most once per stamp interval), so the leader keeps
    /// them for at least a stamp interval after this read.
    pub(crate) fn note_reads(&self, keys: &[BlockKey]) {
        let now = Instant::now();
        let mut w = self.writer();
        let due: Vec<BlockKey> = keys
            .iter()
            .filter(|k| {
                w.reads
                    .get(*k)
                    .is_none_or(|t| now.duration_since(*t) >= self.stamp_interval)
            })
            .copied()
            .collect();
        if due.is_empty() {
            return;
        }
        match w.append(&Record::Read.lines(&self.ns, &due, 0)) {
            // noted only once announced (a failed write is tried again at the next read)
            Ok(()) => w.reads.extend(due.into_iter().map(|k| (k, now))),
            Err(e) => self.error("journal write", &e),
        }
        if w.reads.len() > 1 << 20 {
            let iv = self.stamp_interval;
            w.reads.retain(|_, t| now.duration_since(*t) < iv);
            if w.reads.len() > 1 << 20 {
                // more keys read within one interval than that: start over (they are
                // announced again at their next read)
                w.reads.clear();
            }
        }
    }

    /// Stops the coordination thread (which then releases the lease if it holds it).
    pub(crate) fn stop(&self) {
        *self.stop.lock().unwrap_or_else(|p| p.into_inner()) = true;
        self.cv.notify_all();
    }

    /// Waits `d` or until stopped; true when stopped.
    fn wait(&self, d: Duration) -> bool {
        let g = self.stop.lock().unwrap_or_else(|p| p.into_inner());
        let (g, _) = self
            .cv
            .wait_timeout_while(g, d, |s| !*s)
            .unwrap_or_else(|p| p.into_inner());
        *g
    }

    /// The highest epoch claimed so far (0: none).
    fn highest_claim(&self) -> u64 {
        std::fs::read_dir(self.dir.join("claims"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u64>().ok())
            .max()
            .unwrap_or(0)
    }

    fn lease_path(&self) -> PathBuf {
        self.dir.join("lease")
    }

    /// Writes the lease: `owner` holds it at `epoch` (`-`: released), `beat` its renewals.
    fn write_lease(&self, epoch: u64, owner: &str, beat: u64) -> io::Result<()> {
        let lease = Lease {
            epoch,
            owner: owner.to_string(),
            beat,
        };
        replace(&self.lease_path(), &lease.render())
    }

    fn read_lease(&self) -> Option<Lease> {
        read_opt(&self.lease_path()).and_then(|s| Lease::parse(&s))
    }

    /// Tries to take the lease at `epoch`: creates `claims/<epoch>` exclusively (of several
    /// instances trying the same epoch, one wins), then writes the lease. Returns the epoch
    /// taken.
    fn claim(&self, epoch: u64) -> Option<u64> {
        let claim = self.dir.join("claims").join(epoch.to_string());
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&claim)
        {
            Ok(mut f) => {
                let _ = f.write_all(self.id.as_bytes());
            }
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return None,
            Err(e) => {
                self.error("lease claim", &e);
                return None;
            }
        }
        if let Err(e) = self.write_lease(epoch, &self.id, 0) {
            self.error("lease write", &e);
            return None;
        }
        // a claimer delayed between its claim and its write may have put back an older
        // epoch over a newer one: it is the leader only if the lease says so now
        if self
            .read_lease()
            .is_none_or(|l| l.epoch != epoch || l.owner != self.id)
        {
            return None;
        }
        // older claims are history
        for old in epoch.saturating_sub(64)..epoch.saturating_sub(8) {
            let _ = std::fs::remove_file(self.dir.join("claims").join(old.to_string()));
        }
        Some(epoch)
    }
}

/// Closes a store job's announcements when dropped: held by the job's I/O tasks, so the
/// last one to end (or the job's drop, unrun) writes the `D` lines.
pub(crate) struct Finish {
    pub(crate) coord: Arc<Coord>,
    pub(crate) keys: Vec<BlockKey>,
}

impl Drop for Finish {
    fn drop(&mut self) {
        self.coord.finish(&self.keys);
    }
}
