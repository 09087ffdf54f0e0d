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

use std::fs::File;
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Namespace};
use rustc_hash::FxHashMap;

use crate::gc::Gc;
use crate::stats::{SharedCounters as Counters, SharedStats};

/// The leader's tick: journals are tailed and credit granted this often.
const LEADER_TICK: Duration = Duration::from_millis(5);
/// Journal records re-checked against the disk at a takeover, per instance (publishes that
/// may have landed after the takeover's walk passed their directory).
const TAKEOVER_TAIL: usize = 4096;

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

/// Why a path of the coordination directory could not be used.
fn ctx(what: &str, p: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{what} {}: {e}", p.display()))
}

/// Writes `path` whole through a temp file and a rename (readers see the old or the new).
fn replace(path: &Path, content: &str) -> io::Result<()> {
    // the whole name, this process and random bits: ids may hold dots, and containers on
    // several hosts may all run as pid 1
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(format!(
        ".new-{}-{:08x}",
        std::process::id(),
        random_bits() as u32
    ));
    let tmp = path.with_file_name(name);
    std::fs::write(&tmp, content)
        .and_then(|()| std::fs::rename(&tmp, path))
        .inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
}

/// A few random bits (the std hasher's random keys: no dependency).
fn random_bits() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    );
    h.finish()
}

/// Whether a name in the coordination directory is a temp file (`.new-`) or another
/// process's leftover (dotfiles, such as NFS's `.nfsXXXX` of a removed open file), not an
/// instance.
fn not_an_instance(name: &str) -> bool {
    name.starts_with('.') || name.contains(".new-")
}

fn read_opt(path: &Path) -> Option<String> {
    std::fs::read_to_string(path).ok()
}

/// `D` lines for `keys`.
fn done_lines(ns: &Namespace, keys: &[BlockKey]) -> String {
    let mut lines = String::with_capacity(keys.len() * 110);
    for k in keys {
        lines.push_str("D ");
        lines.push_str(&ns.block_rel_path(k));
        lines.push('\n');
    }
    lines
}

/// A grant file's `(epoch, granted)`.
fn read_grant(path: &Path) -> Option<(u64, u64)> {
    let s = read_opt(path)?;
    let mut it = s.split_whitespace();
    Some((it.next()?.parse().ok()?, it.next()?.parse().ok()?))
}

/// The lease file's fields.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Lease {
    epoch: u64,
    owner: String,
    beat: u64,
}

impl Lease {
    fn parse(s: &str) -> Option<Self> {
        let mut it = s.split_whitespace();
        Some(Self {
            epoch: it.next()?.parse().ok()?,
            owner: it.next()?.to_string(),
            beat: it.next()?.parse().ok()?,
        })
    }
    fn render(&self) -> String {
        format!("{} {} {}\n", self.epoch, self.owner, self.beat)
    }
}

/// The default instance id: `<host>-<pid>-<random>`.
pub(crate) fn default_id() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
        .take(32)
        .collect::<String>();
    let host = if host.is_empty() { "host".into() } else { host };
    format!(
        "{host}-{}-{:04x}",
        std::process::id(),
        random_bits() & 0xffff
    )
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
        if let Some(state) = read_opt(&dir.join("state")) {
            let f: Vec<u64> = state
                .split_whitespace()
                .filter_map(|x| x.parse().ok())
                .collect();
            if let [_, _, cap, _, lease_ms, stamp_ms] = f[..] {
                let mine = [
                    ("gc_max_size_gb", cap, sizes.cap),
                    ("shared_lease_s", lease_ms, lease.as_millis() as u64),
                    (
                        "gc_stamp_interval_s",
                        stamp_ms,
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
        let journal = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .read(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(&jp)
            .map_err(|e| ctx("open", &jp, e))?;
        // a previous run's journal (killed and restarted, the leader not done with it): the
        // credit it spent and was granted carry on (read through the descriptor opened: the
        // leader may remove the path meanwhile, and then this is a fresh start)
        let mut text = String::new();
        std::io::Read::read_to_string(&mut &journal, &mut text).map_err(|e| ctx("read", &jp, e))?;
        let consumed: u64 = text
            .lines()
            .filter_map(|l| {
                let mut it = l.split_whitespace();
                (it.next() == Some("P"))
                    .then(|| it.nth(1)?.parse::<u64>().ok())
                    .flatten()
            })
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

    pub(crate) fn id(&self) -> &str {
        &self.id
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
        let mut lines = String::with_capacity(n * 120);
        for k in &keys[..n] {
            lines.push_str("P ");
            lines.push_str(&self.ns.block_rel_path(k));
            lines.push(' ');
            lines.push_str(&self.block_credit.to_string());
            lines.push('\n');
        }
        if let Err(e) = w.append(&lines) {
            self.error("journal write", &e);
            // whatever part of it landed announces stores that will not happen: closed
            let _ = w.append(&done_lines(&self.ns, &keys[..n]));
            return Err(e);
        }
        w.consumed += n as u64 * self.block_credit;
        Ok(n)
    }

    /// Closes the announcements of `keys` (their store job ended, written or not): `D`
    /// lines, one `write`. Until then the leader counts a missing file of theirs as on its
    /// way, not gone.
    pub(crate) fn finish(&self, keys: &[BlockKey]) {
        if keys.is_empty() {
            return;
        }
        let lines = done_lines(&self.ns, keys);
        if let Err(e) = self.writer().append(&lines) {
            self.error("journal write", &e);
        }
    }

    pub(crate) fn note_credit_wait(&self) {
        self.counters.credit_waits.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn note_no_credit(&self, blocks: u64) {
        self.counters.no_credit.fetch_add(blocks, Ordering::Relaxed);
    }

    /// Announces reads of `keys` (each at most once per stamp interval), so the leader keeps
    /// them for at least a stamp interval after this read.
    pub(crate) fn note_reads(&self, keys: &[BlockKey]) {
        let now = Instant::now();
        let mut w = self.writer();
        let mut lines = String::new();
        let mut due = Vec::new();
        for k in keys {
            if w.reads
                .get(k)
                .is_none_or(|t| now.duration_since(*t) >= self.stamp_interval)
            {
                due.push(*k);
                lines.push_str("R ");
                lines.push_str(&self.ns.block_rel_path(k));
                lines.push('\n');
            }
        }
        if lines.is_empty() {
            return;
        }
        match w.append(&lines) {
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
        let lease = Lease {
            epoch,
            owner: self.id.clone(),
            beat: 0,
        };
        if let Err(e) = replace(&self.lease_path(), &lease.render()) {
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

/// One instance as the leader knows it.
struct Member {
    journal: Option<File>,
    offset: u64,
    partial: Vec<u8>,
    consumed: u64,
    granted: u64,
    beat: Option<String>,
    beat_seen: Instant,
    /// Its heartbeat file is gone (it closed) or stood still for a lease period (killed).
    dead: bool,
    /// Its announced stores whose job has not ended (`P` without `D`), with their count.
    pending: FxHashMap<BlockKey, u32>,
}

impl Member {
    fn announce(&mut self, gc: &Gc, k: BlockKey) {
        *self.pending.entry(k).or_insert(0) += 1;
        gc.announce(k);
    }

    fn finish(&mut self, gc: &Gc, k: &BlockKey) {
        if let Some(n) = self.pending.get_mut(k) {
            *n -= 1;
            if *n == 0 {
                self.pending.remove(k);
            }
            gc.unannounce(k);
        }
    }

    /// Its stores under way die with it.
    fn forget_pending(&mut self, gc: &Gc) {
        for (k, n) in self.pending.drain() {
            for _ in 0..n {
                gc.unannounce(&k);
            }
        }
    }
}

impl Member {
    fn new(now: Instant) -> Self {
        Self {
            journal: None,
            offset: 0,
            partial: Vec::new(),
            consumed: 0,
            granted: 0,
            beat: None,
            beat_seen: now,
            dead: false,
            pending: FxHashMap::default(),
        }
    }
}

/// The leader's state, on the coordination thread.
struct Leading {
    epoch: u64,
    beat: u64,
    members: FxHashMap<String, Member>,
    last_renew: Instant,
    last_scan: Instant,
    /// Rotates the order in which members are granted credit.
    turn: usize,
}

/// Runs the coordination thread until [`Coord::stop`].
pub(crate) fn spawn(coord: Arc<Coord>, gc: Arc<Gc>) -> io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kv-fs-shared".into())
        .spawn(move || run(&coord, &gc))
}

fn run(c: &Coord, gc: &Gc) {
    gc.set_may_sweep(false);
    let quarter = c.lease / 4;
    let mut beat = 0u64;
    let mut last_beat = Instant::now() - quarter;
    // the lease as last read, and when it last changed (by this instance's clock)
    let mut seen: Option<Lease> = None;
    let mut seen_since = Instant::now();
    let mut first_look = true;
    let mut leading: Option<Leading> = None;
    loop {
        let tick = if leading.is_some() {
            LEADER_TICK
        } else {
            // a follower looks at the lease 8 times a period (at least 4 times a second: a
            // released lease is taken at once)
            (c.lease / 8).clamp(Duration::from_millis(5), Duration::from_millis(250))
        };
        if c.wait(tick) {
            break;
        }
        let now = Instant::now();
        if now.duration_since(last_beat) >= quarter {
            last_beat = now;
            beat += 1;
            heartbeat(c, beat);
            if leading.is_none()
                && let Some(s) = read_opt(&c.dir.join("state"))
            {
                let f: Vec<u64> = s
                    .split_whitespace()
                    .filter_map(|x| x.parse().ok())
                    .collect();
                if let [_, bytes, _, members, ..] = f[..] {
                    c.seen.global_bytes.store(bytes, Ordering::Relaxed);
                    c.seen.members.store(members, Ordering::Relaxed);
                }
            }
        }
        let lease = c.read_lease();
        if let Some(l) = &mut leading {
            if lease
                .as_ref()
                .is_none_or(|x| x.epoch != l.epoch || x.owner != c.id)
            {
                tracing::warn!(instance = %c.id, epoch = l.epoch, now = ?lease, "shared root: lost the leader lease; stepping down");
                step_down(c, gc);
                leading = None;
                seen = lease;
                seen_since = now;
                continue;
            }
            lead_tick(c, gc, l, now);
            continue;
        }
        c.seen
            .epoch
            .store(lease.as_ref().map_or(0, |l| l.epoch), Ordering::Relaxed);
        if lease != seen {
            seen = lease.clone();
            seen_since = now;
        }
        let released = lease.as_ref().is_some_and(|l| l.owner == "-");
        let fresh_root = first_look && lease.is_none();
        first_look = false;
        // the lease unchanged for this many whole periods
        let periods = (now.duration_since(seen_since).as_secs_f64() / c.lease.as_secs_f64()) as u64;
        // the epoch after the one seen; each further period the lease stays unchanged, one
        // more (a claimer that died between its claim and its lease write blocks its epoch)
        let seen_epoch = match &lease {
            Some(l) => l.epoch,
            // no readable lease (deleted, garbled, never written): the epochs go on above
            // every claim made, never back (writers ignore grants of older epochs)
            None => c.highest_claim(),
        };
        let next = seen_epoch + 1 + periods.saturating_sub(1);
        if (released || fresh_root || periods >= 1)
            && let Some(epoch) = c.claim(next)
        {
            leading = Some(take_over(c, gc, epoch));
        }
    }
    if let Some(l) = leading {
        // a clean close releases the lease: another instance takes it at its next look
        let released = Lease {
            epoch: l.epoch,
            owner: "-".into(),
            beat: l.beat + 1,
        };
        if c.read_lease().is_some_and(|x| x.owner == c.id) {
            let _ = replace(&c.lease_path(), &released.render());
        }
        gc.set_may_sweep(false);
        c.leader.store(false, Ordering::SeqCst);
    }
    let name = c.writer().name.clone();
    let _ = std::fs::remove_file(c.dir.join("members").join(name));
}

fn heartbeat(c: &Coord, beat: u64) {
    let mut w = c.writer();
    let p = c.dir.join("members").join(&w.name);
    if let Err(e) = replace(&p, &format!("{beat}\n")) {
        c.error("heartbeat", &e);
    }
    let jp = c.dir.join("journal").join(&w.name);
    // the file at the journal's path is not the one open here (removed: the leader took this
    // instance for dead, or someone deleted it; an NFS stale handle; a silly-renamed `.nfs`
    // file): this instance joins again as a new member, `<id>.r<n>`, with a journal and
    // credit of its own (the cumulative grant of the old name is never taken as its own)
    let gone = {
        use std::os::unix::fs::MetadataExt;
        match (w.journal.metadata(), std::fs::metadata(&jp)) {
            (Ok(a), Ok(b)) => a.nlink() == 0 || (a.dev(), a.ino()) != (b.dev(), b.ino()),
            _ => true,
        }
    };
    if !gone {
        return;
    }
    let name = format!("{}.r{}", c.id, w.incarnation + 1);
    let jdir = c.dir.join("journal");
    let opened = std::fs::create_dir_all(&jdir).and_then(|()| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .custom_flags(libc::O_CLOEXEC)
            .open(jdir.join(&name))
    });
    match opened {
        Ok(f) => {
            tracing::warn!(instance = %c.id, name = %name, "shared root: this instance's journal is gone (taken for dead, or removed); rejoining as a new member");
            let old = std::mem::replace(&mut w.name, name);
            w.incarnation += 1;
            w.journal = f;
            w.dirty = false;
            w.granted = 0;
            w.consumed = 0;
            w.reads.clear();
            // the old name's heartbeat goes: the leader voids its credit at once
            let _ = std::fs::remove_file(c.dir.join("members").join(old));
            let _ = std::fs::create_dir_all(c.dir.join("members"));
            if let Err(e) = replace(&c.dir.join("members").join(&w.name), &format!("{beat}\n")) {
                c.error("heartbeat", &e);
            }
        }
        Err(e) => c.error("journal reopen", &e),
    }
}

fn step_down(c: &Coord, gc: &Gc) {
    gc.set_may_sweep(false);
    gc.clear_announced();
    gc.set_outstanding_credit(0);
    c.leader.store(false, Ordering::SeqCst);
}

/// Becomes the leader at `epoch`: rebuilds the index from a walk, reads every journal for
/// the credit spent (and re-checks its latest announcements against the disk), takes the
/// grants as they stand, then starts sweeping.
fn take_over(c: &Coord, gc: &Gc, epoch: u64) -> Leading {
    let t = Instant::now();
    tracing::info!(instance = %c.id, epoch, "shared root: took the leader lease");
    c.counters.takeovers.fetch_add(1, Ordering::Relaxed);
    c.seen.epoch.store(epoch, Ordering::Relaxed);
    // The walk and the journals may take longer than a lease period: the lease is renewed
    // meanwhile, or another instance would take it over before this one ever leads.
    let building = AtomicBool::new(true);
    let beat = AtomicU64::new(0);
    let members = std::thread::scope(|scope| {
        scope.spawn(|| {
            let every = (c.lease / 8).max(Duration::from_millis(1));
            let mut last = Instant::now();
            while building.load(Ordering::SeqCst) {
                // short naps: the takeover does not wait for a long one to end
                std::thread::sleep(every.min(Duration::from_millis(5)));
                if last.elapsed() < every {
                    continue;
                }
                last = Instant::now();
                let lease = Lease {
                    epoch,
                    owner: c.id.clone(),
                    beat: beat.fetch_add(1, Ordering::SeqCst) + 1,
                };
                if let Err(e) = replace(&c.lease_path(), &lease.render()) {
                    c.error("lease renewal", &e);
                }
            }
        });
        let members = rebuild(c, gc);
        building.store(false, Ordering::SeqCst);
        members
    });
    c.leader.store(true, Ordering::SeqCst);
    gc.set_may_sweep(true);
    tracing::info!(instance = %c.id, epoch, members = members.len(), bytes = gc.total_now(), ms = t.elapsed().as_millis() as u64, "shared root: leading");
    let now = Instant::now();
    Leading {
        epoch,
        beat: beat.load(Ordering::SeqCst),
        members,
        last_renew: now - c.lease,
        last_scan: now - c.lease,
        turn: 0,
    }
}

/// A new leader's index and members: the journals' sizes first (what is announced after is
/// tailed), a walk, then every journal read whole up to there: the credit each spent, its
/// stores announced and not ended (counted as on their way, kept while missing), the ones
/// that ended (indexed if their file is there: they may have landed after the walk passed
/// their directory), and its latest reads (kept as any read is, as of now: records carry no
/// time, and a takeover errs on the safe side).
fn rebuild(c: &Coord, gc: &Gc) -> FxHashMap<String, Member> {
    let now = Instant::now();
    let mut members: FxHashMap<String, Member> = FxHashMap::default();
    gc.clear_announced();
    for e in std::fs::read_dir(c.dir.join("journal"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let Some(id) = e.file_name().to_str().map(str::to_string) else {
            continue;
        };
        if not_an_instance(&id) {
            continue;
        }
        let mut m = Member::new(now);
        if let Ok(f) = File::open(e.path()) {
            m.offset = f.metadata().map_or(0, |m| m.len());
            m.journal = Some(f);
        }
        members.insert(id, m);
    }
    gc.rescan();
    for (id, m) in &mut members {
        let Some(f) = &m.journal else { continue };
        let mut buf = vec![0u8; m.offset as usize];
        let n = f.read_at(&mut buf, 0).unwrap_or(0);
        // up to the last whole line: the tail goes on from there
        let whole = buf[..n]
            .iter()
            .rposition(|b| *b == b'\n')
            .map_or(0, |i| i + 1);
        buf.truncate(whole);
        m.offset = whole as u64;
        let text = String::from_utf8_lossy(&buf);
        // the latest ended stores (older ones landed before the walk, or never)
        let mut ended: std::collections::VecDeque<BlockKey> = Default::default();
        let mut reads: std::collections::VecDeque<BlockKey> = Default::default();
        for line in text.lines() {
            let mut it = line.split_whitespace();
            let kind = it.next();
            let Some(k) = it.next().and_then(|r| c.ns.parse_block_rel_path(r)) else {
                continue;
            };
            match kind {
                Some("P") => {
                    m.consumed += it.next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
                    *m.pending.entry(k).or_insert(0) += 1;
                }
                Some("D") => {
                    if let Some(n) = m.pending.get_mut(&k) {
                        *n -= 1;
                        if *n == 0 {
                            m.pending.remove(&k);
                        }
                        if ended.len() == TAKEOVER_TAIL {
                            ended.pop_front();
                        }
                        ended.push_back(k);
                    }
                }
                Some("R") => {
                    if reads.len() == TAKEOVER_TAIL {
                        reads.pop_front();
                    }
                    reads.push_back(k);
                }
                _ => {}
            }
        }
        for (k, n) in &m.pending {
            for _ in 0..*n {
                gc.announce(*k);
            }
            gc.on_remote_store(*k, c.file_bytes);
        }
        for k in ended {
            if let Ok(meta) = std::fs::symlink_metadata(c.ns.block_path(&gc.at.root, &k))
                && meta.is_file()
            {
                gc.index_seen(k, &meta);
            }
        }
        for k in reads {
            gc.on_remote_read(k);
        }
        m.granted = read_grant(&c.grants_path(id))
            .map_or(0, |(_, g)| g)
            .max(m.consumed);
    }
    members
}

/// One tick of the leader: renew the lease, look at the members, tail the journals, account
/// the credit outstanding, grant more where there is room.
fn lead_tick(c: &Coord, gc: &Gc, l: &mut Leading, now: Instant) {
    let quarter = c.lease / 4;
    if now.duration_since(l.last_renew) >= quarter {
        l.last_renew = now;
        l.beat += 1;
        let lease = Lease {
            epoch: l.epoch,
            owner: c.id.clone(),
            beat: l.beat,
        };
        if let Err(e) = replace(&c.lease_path(), &lease.render()) {
            c.error("lease renewal", &e);
        }
    }
    if now.duration_since(l.last_scan) >= quarter {
        l.last_scan = now;
        scan_members(c, l, now);
        gc.prune_reads();
        let alive = l.members.values().filter(|m| !m.dead).count() as u64;
        c.seen.members.store(alive, Ordering::Relaxed);
        c.seen.global_bytes.store(gc.total_now(), Ordering::Relaxed);
        let state = format!(
            "{} {} {} {alive} {} {}\n",
            l.epoch,
            gc.total_now(),
            c.cap,
            c.lease.as_millis(),
            c.stamp_interval.as_millis()
        );
        if let Err(e) = replace(&c.dir.join("state"), &state) {
            c.error("state write", &e);
        }
    }
    for (id, m) in &mut l.members {
        tail(c, gc, id, m);
    }
    // the dead are read to the end above: their files go
    let dead: Vec<String> = l
        .members
        .iter()
        .filter(|(_, m)| m.dead)
        .map(|(id, _)| id.clone())
        .collect();
    for id in dead {
        if let Some(mut m) = l.members.remove(&id) {
            m.forget_pending(gc);
        }
        for sub in ["journal", "grants"] {
            let _ = std::fs::remove_file(c.dir.join(sub).join(&id));
        }
        tracing::info!(instance = %c.id, member = %id, "shared root: a member left or died; its credit is void");
    }
    grant(c, gc, l);
}

/// Refreshes the members from `members/` and `journal/`: new ones join, heartbeats that
/// stood still for a lease period (or whose file is gone) mark the dead.
fn scan_members(c: &Coord, l: &mut Leading, now: Instant) {
    let mut present: FxHashMap<String, String> = FxHashMap::default();
    for e in std::fs::read_dir(c.dir.join("members"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Some(id) = e.file_name().to_str()
            && !not_an_instance(id)
        {
            present.insert(id.to_string(), read_opt(&e.path()).unwrap_or_default());
        }
    }
    for e in std::fs::read_dir(c.dir.join("journal"))
        .into_iter()
        .flatten()
        .flatten()
    {
        if let Some(id) = e.file_name().to_str()
            && !not_an_instance(id)
        {
            l.members
                .entry(id.to_string())
                .or_insert_with(|| Member::new(now));
        }
    }
    for (id, m) in &mut l.members {
        match present.get(id) {
            None => m.dead = true,
            Some(b) => {
                if m.beat.as_deref() != Some(b.as_str()) {
                    m.beat = Some(b.clone());
                    m.beat_seen = now;
                }
                if now.duration_since(m.beat_seen) > c.lease {
                    m.dead = true;
                    let _ = std::fs::remove_file(c.dir.join("members").join(id));
                }
            }
        }
    }
}

/// Reads what `m`'s journal gained since the last tick and applies it to the index.
fn tail(c: &Coord, gc: &Gc, id: &str, m: &mut Member) {
    if m.journal.is_none() {
        m.journal = File::open(c.dir.join("journal").join(id)).ok();
    }
    let Some(f) = &m.journal else { return };
    let mut buf = [0u8; 64 << 10];
    loop {
        let n = match f.read_at(&mut buf, m.offset) {
            Ok(n) => n,
            Err(e) => {
                c.error("journal read", &e);
                0
            }
        };
        if n == 0 {
            break;
        }
        m.offset += n as u64;
        m.partial.extend_from_slice(&buf[..n]);
        if n < buf.len() {
            break;
        }
    }
    let Some(end) = m.partial.iter().rposition(|b| *b == b'\n') else {
        return;
    };
    let whole: Vec<u8> = m.partial.drain(..=end).collect();
    for line in String::from_utf8_lossy(&whole).lines() {
        let mut it = line.split_whitespace();
        let (kind, rel) = (it.next(), it.next());
        let Some(k) = rel.and_then(|r| c.ns.parse_block_rel_path(r)) else {
            continue;
        };
        match kind {
            Some("P") => {
                m.consumed += it.next().and_then(|x| x.parse::<u64>().ok()).unwrap_or(0);
                m.announce(gc, k);
                gc.on_remote_store(k, c.file_bytes);
            }
            Some("D") => m.finish(gc, &k),
            Some("R") => gc.on_remote_read(k),
            _ => {}
        }
    }
}

/// Grants credit: every live member is topped up to a chunk while the total (files,
/// directories and all credit outstanding) stays under the hard ceiling.
fn grant(c: &Coord, gc: &Gc, l: &mut Leading) {
    let alive = l.members.values().filter(|m| !m.dead).count().max(1) as u64;
    let chunk = ((c.hard - c.low) / (2 * alive)).max(4 * c.block_credit);
    let outstanding = |l: &Leading| {
        l.members
            .values()
            .filter(|m| !m.dead)
            .map(|m| m.granted.saturating_sub(m.consumed))
            .sum::<u64>()
    };
    gc.set_outstanding_credit(outstanding(l));
    let mut room = c.hard.saturating_sub(gc.total_now());
    // the members short of half a chunk share the room evenly, in an order that rotates
    // tick by tick (so a scarce room is not always the same member's)
    let mut needy: Vec<&String> = l
        .members
        .iter()
        .filter(|(_, m)| !m.dead && m.granted.saturating_sub(m.consumed) < chunk / 2)
        .map(|(id, _)| id)
        .collect();
    needy.sort();
    if needy.is_empty() {
        return;
    }
    l.turn = l.turn.wrapping_add(1);
    let start = l.turn % needy.len();
    needy.rotate_left(start);
    let needy: Vec<String> = needy.into_iter().cloned().collect();
    let share = (room / needy.len() as u64).max(c.block_credit);
    for id in needy {
        let m = l.members.get_mut(&id).expect("listed above");
        let out = m.granted.saturating_sub(m.consumed);
        let add = (chunk - out).min(share).min(room);
        if add < c.block_credit {
            break;
        }
        m.granted = m.granted.max(m.consumed) + add;
        room -= add;
        let line = format!("{} {}\n", l.epoch, m.granted);
        if let Err(e) = replace(&c.grants_path(&id), &line) {
            c.error("grant write", &e);
        }
    }
    gc.set_outstanding_credit(outstanding(l));
}
