//! The coordination thread: heartbeats, the lease, and the leader's work (takeover,
//! journals tailed into the index, members' liveness, credit granted).

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::BlockKey;
use rustc_hash::FxHashMap;

use super::Coord;
use super::files::{
    Lease, Record, State, not_an_instance, open_journal, read_grant, read_opt, replace,
};
use crate::gc::Gc;

/// The leader's tick: journals are tailed and credit granted this often.
const LEADER_TICK: Duration = Duration::from_millis(5);
/// Journal records re-checked against the disk at a takeover, per instance (publishes that
/// may have landed after the takeover's walk passed their directory).
const TAKEOVER_TAIL: usize = 4096;

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
                && let Some(state) = read_opt(&c.dir.join("state")).and_then(|s| State::parse(&s))
            {
                c.seen.global_bytes.store(state.bytes, Ordering::Relaxed);
                c.seen.members.store(state.members, Ordering::Relaxed);
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
        if c.read_lease().is_some_and(|x| x.owner == c.id) {
            let _ = c.write_lease(l.epoch, "-", l.beat + 1);
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
    let opened = std::fs::create_dir_all(&jdir).and_then(|()| open_journal(&jdir.join(&name)));
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
                let b = beat.fetch_add(1, Ordering::SeqCst) + 1;
                if let Err(e) = c.write_lease(epoch, &c.id, b) {
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
    tracing::info!(instance = %c.id, epoch, members = members.len(), bytes = gc.total_bytes(), ms = t.elapsed().as_millis() as u64, "shared root: leading");
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
        for (kind, k, credit) in records(c, &text) {
            match kind {
                Record::Store => {
                    m.consumed += credit;
                    *m.pending.entry(k).or_insert(0) += 1;
                }
                Record::Done => {
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
                Record::Read => {
                    if reads.len() == TAKEOVER_TAIL {
                        reads.pop_front();
                    }
                    reads.push_back(k);
                }
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
                gc.index_seen(k, &meta, None);
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
        if let Err(e) = c.write_lease(l.epoch, &c.id, l.beat) {
            c.error("lease renewal", &e);
        }
    }
    if now.duration_since(l.last_scan) >= quarter {
        l.last_scan = now;
        scan_members(c, l, now);
        gc.prune_reads();
        let state = State {
            epoch: l.epoch,
            bytes: gc.total_bytes(),
            cap: c.cap,
            members: l.members.values().filter(|m| !m.dead).count() as u64,
            lease_ms: c.lease.as_millis() as u64,
            stamp_ms: c.stamp_interval.as_millis() as u64,
        };
        c.seen.members.store(state.members, Ordering::Relaxed);
        c.seen.global_bytes.store(state.bytes, Ordering::Relaxed);
        if let Err(e) = replace(&c.dir.join("state"), &state.render()) {
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
    for (kind, k, credit) in records(c, &String::from_utf8_lossy(&whole)) {
        match kind {
            Record::Store => {
                m.consumed += credit;
                m.announce(gc, k);
                gc.on_remote_store(k, c.file_bytes);
            }
            Record::Done => m.finish(gc, &k),
            Record::Read => gc.on_remote_read(k),
        }
    }
}

/// The records of `text` whose path is one of this namespace's blocks (others are skipped,
/// their credit too), with their key.
fn records<'a>(c: &'a Coord, text: &'a str) -> impl Iterator<Item = (Record, BlockKey, u64)> + 'a {
    text.lines().filter_map(|line| {
        let (kind, rel, credit) = Record::parse(line)?;
        Some((kind, c.ns.parse_block_rel_path(rel)?, credit))
    })
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
    let mut room = c.hard.saturating_sub(gc.total_bytes());
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
