//! A shared bucket's leader: its index of every member's objects (seeded by a LIST, mended
//! by one every eight periods), the members' journals, the sweep and the grants (see the
//! parent module for the protocol).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kv_tier_core::BlockKey;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt as _, PutPayload};
use rustc_hash::FxHashMap;

use super::{Coord, Record, lock};
use crate::block::{ReqError, Shared};

/// Ticks a new leader waits before it grants (writers drop the old leader's credit meanwhile).
const GRANT_DELAY_TICKS: u32 = 2;

/// Grants keep the leader's total under this multiple of the bound.
const CEILING: f64 = 1.05;

/// The leader's view of one instance.
#[derive(Default)]
struct Member {
    /// The next batch to apply (`None`: the first one listed).
    next_seq: Option<u64>,
    granted: u64,
    consumed: u64,
    /// Its stores in flight (announced, not ended).
    pending: FxHashMap<BlockKey, u64>,
    /// Its heartbeat's version and when that was first seen.
    beat: Option<(String, Instant)>,
    alive: bool,
    /// When it was found dead (its journal is not read a retention later; its ledger is
    /// kept, so one that comes back is granted on from what it holds).
    died: Option<Instant>,
    /// Its block size (its first record).
    block: u64,
    /// The grant last written for it, and when.
    written: Option<(u64, Instant)>,
    /// Since when its next batch has been missing (a batch lost: skipped a lease later).
    missing_since: Option<Instant>,
    /// It said it shut down: gone as soon as its heartbeat is.
    exited: bool,
    /// When a batch of its journal was last applied (a sign of life as good as a heartbeat).
    last_batch: Option<Instant>,
    /// When it last said it waited for credit (`W`), and last spent some (`P`).
    wanted_at: Option<Instant>,
    spent_at: Option<Instant>,
}

/// The leader's work state (the lease itself is the lease task's).
pub(super) struct Leading {
    pub(super) epoch: u64,
    members: FxHashMap<String, Member>,
    /// Applied batches, deleted once older than [`retention`].
    applied: Vec<(ObjPath, Instant)>,
    ticks: u32,
    /// Rotates which member a grant smaller than everyone's block goes to first.
    turn: usize,
    /// When its index was last mended by a LIST.
    reconciled: Instant,
    /// Whether its index holds every object (a whole LIST made since it took the lease).
    pub(super) seeded: bool,
}

/// A new leader's state; its index is seeded at its first ticks (see [`seed`]).
pub(super) fn take_over(c: &Coord, epoch: u64) -> Leading {
    lock(&c.read_seen).clear();
    Leading {
        epoch,
        members: FxHashMap::default(),
        applied: Vec::new(),
        ticks: 0,
        turn: 0,
        reconciled: Instant::now(),
        seeded: false,
    }
}

/// Seeds a new leader's index with every object of the rank (a LIST, ordered by age; the
/// journals it reads next add the rest): all or nothing. A leader whose LIST failed part way
/// neither sweeps nor grants (an index short of objects would let the bucket overflow); it
/// lists again at its next tick.
async fn seed(c: &Coord, sh: &Shared) -> bool {
    let clear = || {
        let mut idx = c.index.lock();
        for k in idx.keys_by_recency() {
            idx.remove(&k);
        }
    };
    clear();
    match sh.seed_cap(&c.index).await {
        Ok(()) => true,
        Err(e) => {
            clear();
            c.error(
                "listing the objects (the new leader waits for a whole listing)",
                &e,
            );
            false
        }
    }
}

/// How long applied journal batches are kept (a new leader reads what is left).
fn retention(c: &Coord) -> Duration {
    c.lease * 4
}

/// The leader's work: members, journals, the sweep, grants.
pub(super) async fn lead_tick(c: &Coord, sh: &Shared, l: &mut Leading) {
    if !l.seeded {
        l.seeded = seed(c, sh).await;
        if !l.seeded {
            return;
        }
    }
    l.ticks = l.ticks.saturating_add(1);
    let now = Instant::now();
    scan_members(c, sh, l, now).await;
    tail(c, sh, l).await;
    let keep_for = c.lease;
    lock(&c.read_seen).retain(|_, t| now - *t < keep_for);
    let doubt_for = reconcile_every(c);
    lock(&c.doubtful).retain(|_, t| now - *t < doubt_for);
    publish_outside(c, l);
    publish_demand(c, l, now);
    if now - l.reconciled >= reconcile_every(c) {
        reconcile(c, sh, l).await;
        l.reconciled = Instant::now();
    }
    if c.index.over() {
        let read_seen = lock(&c.read_seen).clone();
        let doubtful = lock(&c.doubtful).clone();
        let keep = |k: &BlockKey| read_seen.contains_key(k) || doubtful.contains_key(k);
        let n = sh.sweep_cap(&c.index, &keep, true).await;
        c.counters.evicted.fetch_add(n as u64, Ordering::Relaxed);
    }
    if c.is_leader() && l.ticks > GRANT_DELAY_TICKS {
        grant(c, sh, l).await;
    }
    // applied batches past their retention
    let old: Vec<ObjPath> = l
        .applied
        .iter()
        .filter(|(_, t)| now - *t >= retention(c))
        .map(|(p, _)| p.clone())
        .collect();
    if !old.is_empty() {
        l.applied.retain(|(_, t)| now - *t < retention(c));
        for p in old {
            let _ = sh.request_unbounded(sh.store.delete(&p)).await;
        }
    }
}

/// How often the leader LISTs the objects to mend its index: every 8 periods.
fn reconcile_every(c: &Coord) -> Duration {
    c.lease * 8
}

/// Mends the index with a LIST: an object it does not count (a PUT that landed after its
/// deadline and after a delete of its key found nothing, a lost journal batch) is counted
/// from now (as the most recently used), and one it counts that the LIST did not find (and
/// was not stored or used since the LIST began, is not being stored, and did not end in
/// doubt) is dropped.
async fn reconcile(c: &Coord, sh: &Shared, l: &Leading) {
    let began = c.index.lock().clock();
    let found = match sh.list_rank().await {
        Ok((found, _)) => found,
        Err(e) => {
            c.error("listing the objects to mend the index", &e);
            return;
        }
    };
    let pending: rustc_hash::FxHashSet<BlockKey> = l
        .members
        .values()
        .flat_map(|m| m.pending.keys().copied())
        .collect();
    let listed: rustc_hash::FxHashSet<BlockKey> = found.iter().map(|(_, k, _)| *k).collect();
    // a key whose store's end is not known may land yet: it stays counted
    let doubtful = lock(&c.doubtful).clone();
    let (mut added, mut dropped) = (0u64, 0u64);
    let mut idx = c.index.lock();
    for (_, k, size) in &found {
        if idx.tick_of(k).is_none() && !idx.is_deleting(k) && !pending.contains(k) {
            idx.insert(*k, *size);
            added += 1;
        }
    }
    for k in idx.keys_by_recency() {
        if !listed.contains(&k)
            && !pending.contains(&k)
            && !doubtful.contains_key(&k)
            && idx.tick_of(&k).is_some_and(|t| t <= began)
        {
            idx.remove(&k);
            dropped += 1;
        }
    }
    drop(idx);
    if added + dropped > 0 {
        tracing::info!(instance = %c.id, added, dropped, "shared bucket: the index mended by a listing");
    }
}

/// The room a member waiting for credit needs and the room left cannot give (its block, the
/// largest such): the sweep frees it (a bound of a few blocks, full, and a member asking).
fn publish_demand(c: &Coord, l: &Leading, now: Instant) {
    let ceiling = (c.index.cap as f64 * CEILING) as u64;
    let room = ceiling.saturating_sub(c.global_bytes.load(Ordering::Relaxed));
    let demand = l
        .members
        .values()
        .filter(|m| {
            m.alive
                && m.wanted_at.is_some_and(|t| now - t < c.lease)
                && m.granted.saturating_sub(m.consumed) < m.block
        })
        .map(|m| m.block)
        .max()
        .filter(|b| *b > room)
        .unwrap_or(0);
    c.index.demand.store(demand, Ordering::Relaxed);
}

/// Stores in flight and credit not spent: counted with the index against the bound.
fn publish_outside(c: &Coord, l: &Leading) {
    let outside: u64 = l
        .members
        .values()
        .map(|m| {
            let pending: u64 = m.pending.values().sum();
            let unspent = if m.alive {
                m.granted.saturating_sub(m.consumed)
            } else {
                0
            };
            pending + unspent
        })
        .sum();
    c.index.outside.store(outside, Ordering::Relaxed);
    c.global_bytes
        .store(c.index.lock().total() + outside, Ordering::Relaxed);
    c.members.store(
        l.members.values().filter(|m| m.alive).count() as u64,
        Ordering::Relaxed,
    );
}

/// Lists the heartbeats: a member whose heartbeat is gone or unchanged for two periods is
/// dead: its credit is void and its stores in flight are counted as written.
async fn scan_members(c: &Coord, sh: &Shared, l: &mut Leading, now: Instant) {
    let prefix = c.path("members");
    let listed = sh
        .request_unbounded(sh.store.list_with_delimiter(Some(&prefix)))
        .await;
    let listed = match listed {
        Ok(v) => v.objects,
        Err(e) => {
            c.error("listing the members", &sh.err("coordination", e));
            return;
        }
    };
    let mut seen = FxHashMap::default();
    for m in listed {
        if let Some(id) = m.location.filename() {
            let tag = m.e_tag.unwrap_or_else(|| m.last_modified.to_rfc3339());
            seen.insert(id.to_string(), tag);
        }
    }
    for (id, tag) in &seen {
        let m = l.members.entry(id.clone()).or_default();
        match &m.beat {
            Some((t, _)) if t == tag => {}
            _ => {
                m.beat = Some((tag.clone(), now));
                m.alive = true;
                m.died = None;
            }
        }
    }
    for (id, m) in l.members.iter_mut() {
        let gone = !seen.contains_key(id);
        let stale = m
            .beat
            .as_ref()
            .is_some_and(|(_, t)| now - *t >= c.lease * 2)
            && m.last_batch.is_none_or(|t| now - t >= c.lease * 2);
        // gone: its heartbeat deleted after its last batch said it shut down, or unchanged
        // (or missing) for two periods: it has not spent credit for a period since (it spends
        // only within a period of its last heartbeat that landed)
        if m.alive && ((gone && m.exited) || stale) {
            m.alive = false;
            m.died = Some(now);
            tracing::info!(instance = %c.id, member = %id, "shared bucket: a member is gone; its credit is void");
            let mut idx = c.index.lock();
            for (k, size) in m.pending.drain() {
                idx.insert(k, size);
            }
        }
    }
}

/// Applies the journals' new batches, in order per member: a GET of each member's next
/// batches, the members at once (no LIST, but once per member to find where its journal
/// starts).
pub(super) async fn tail(c: &Coord, sh: &Shared, l: &mut Leading) {
    let now = Instant::now();
    let retired = retention(c);
    let fetches = l
        .members
        .iter()
        .filter(|(_, m)| m.alive || m.died.is_some_and(|t| now - t < retired))
        .map(|(id, m)| {
            // its next batch missing for a lease while it lives: look past it
            let skip = m.alive && m.missing_since.is_some_and(|t| now - t >= c.lease);
            fetch_batches(c, sh, id, m.next_seq, skip)
        });
    let fetched = futures::future::join_all(fetches).await;
    let now = Instant::now();
    for (id, next, batches) in fetched {
        let Some(m) = l.members.get_mut(&id) else {
            continue;
        };
        if batches.is_empty() {
            m.missing_since.get_or_insert(now);
        } else {
            m.missing_since = None;
            m.last_batch = Some(now);
            if !m.alive && !m.exited {
                // it writes: it lives (its heartbeats were lost); its ledger counts again
                tracing::info!(instance = %c.id, member = %id, "shared bucket: a member thought gone writes again");
                m.alive = true;
                m.died = None;
            }
        }
        for (path, bytes) in batches {
            apply(c, l.epoch, m, &String::from_utf8_lossy(&bytes));
            l.applied.push((path, now));
        }
        if next.is_some() {
            m.next_seq = next;
        }
    }
}

/// Member `id`'s batches from `next` on, in order, as far as they have landed; and the
/// next batch to read. Where its journal starts (`next` `None`), or what follows a batch
/// missing for a lease (`skip`), a LIST of its journal says: the oldest batch left (a leader
/// deletes batches only after applying them, oldest first), none yet: its first.
async fn fetch_batches(
    c: &Coord,
    sh: &Shared,
    id: &str,
    next: Option<u64>,
    skip: bool,
) -> (String, Option<u64>, Vec<(ObjPath, bytes::Bytes)>) {
    let mut out = Vec::new();
    let mut next = match next {
        Some(n) if !skip => n,
        _ => {
            let prefix = c.path(&format!("journal/{id}"));
            match sh
                .request_unbounded(sh.store.list_with_delimiter(Some(&prefix)))
                .await
            {
                Ok(r) => {
                    let from = next.unwrap_or(0);
                    let first = r
                        .objects
                        .iter()
                        .filter_map(|o| o.location.filename()?.parse::<u64>().ok())
                        .filter(|s| *s >= from)
                        .min();
                    match (next, first) {
                        (Some(n), Some(f)) if f > n => {
                            tracing::warn!(instance = %c.id, member = %id, missing = f - n, "shared bucket: journal batches missing; skipped (the credit they spent is in the next batch's total)");
                            f
                        }
                        (Some(n), _) => n,
                        (None, f) => f.unwrap_or(0),
                    }
                }
                Err(e) => {
                    c.error("listing a journal", &sh.err("coordination", e));
                    return (id.to_string(), None, out);
                }
            }
        }
    };
    for _ in 0..64 {
        let path = c.path(&format!("journal/{id}/{next:020}"));
        let got = sh
            .request_unbounded(async { sh.store.get(&path).await?.bytes().await })
            .await;
        match got {
            Ok(b) => out.push((path, b)),
            Err(ReqError::Store(object_store::Error::NotFound { .. })) => break,
            Err(e) => {
                c.error("reading a journal batch", &sh.err("coordination", e));
                break;
            }
        }
        next += 1;
    }
    (id.to_string(), Some(next), out)
}

fn apply(c: &Coord, epoch: u64, m: &mut Member, text: &str) {
    let now = Instant::now();
    for line in text.lines() {
        match Record::parse(line) {
            Some(Record::Store(k, bytes, credit_epoch, leader)) => {
                // credit of another leader is not this one's to account
                if credit_epoch == epoch && leader == c.id {
                    m.consumed += bytes;
                }
                m.spent_at = Some(now);
                m.pending.insert(k, bytes);
            }
            Some(Record::Done(k, outcome)) => {
                if outcome == b'?' {
                    lock(&c.doubtful).insert(k, now);
                }
                let size = m.pending.remove(&k);
                if outcome != b'0'
                    && let Some(size) = size
                {
                    c.index.lock().insert(k, size);
                }
            }
            Some(Record::Read(k)) => {
                c.index.lock().touch(&k);
                lock(&c.read_seen).insert(k, now);
            }
            Some(Record::Block(bytes)) => m.block = bytes,
            Some(Record::Exit) => m.exited = true,
            Some(Record::Want) => m.wanted_at = Some(now),
            Some(Record::Consumed(credit_epoch, leader, total)) => {
                if credit_epoch == epoch && leader == c.id {
                    m.consumed = m.consumed.max(total);
                }
            }
            None if line.is_empty() => {}
            None => {
                tracing::warn!(instance = %c.id, line, "shared bucket: a journal line is not a record; skipped")
            }
        }
    }
}

/// Grants the room under the ceiling in even shares to the live members.
async fn grant(c: &Coord, sh: &Shared, l: &mut Leading) {
    publish_outside(c, l);
    let ceiling = (c.index.cap as f64 * CEILING) as u64;
    let committed = c.global_bytes.load(Ordering::Relaxed);
    let now = Instant::now();
    // credit goes to the members that use it: that stored or asked for credit within a
    // period (an idle member's unspent credit is room the others cannot use)
    let mut wanting: Vec<String> = l
        .members
        .iter()
        .filter(|(_, m)| {
            m.alive
                && [m.wanted_at, m.spent_at]
                    .iter()
                    .any(|t| t.is_some_and(|t| now - t < c.lease))
        })
        .map(|(id, _)| id.clone())
        .collect();
    wanting.sort_unstable();
    let mut room = ceiling.saturating_sub(committed);
    if !wanting.is_empty() && room > 0 {
        // even shares in whole blocks, no member holding more than its part of an eighth of
        // the bound (or two of its blocks) unspent; a share smaller than a block goes a
        // block at a time, to the members in turn from a rotating start
        let n = wanting.len() as u64;
        let share = room / n;
        l.turn = l.turn.wrapping_add(1);
        let start = l.turn % wanting.len();
        wanting.rotate_left(start);
        for id in &wanting {
            let m = l.members.get_mut(id).expect("listed above");
            let block = m.block.max(1);
            let most = (c.index.cap / 8 / n).max(2 * block);
            let unspent = m.granted.saturating_sub(m.consumed);
            let mut more = share.min(most.saturating_sub(unspent));
            more -= more % block;
            if more == 0 && unspent < block && room >= block {
                more = block;
            }
            let more = more.min(room);
            room -= more;
            // counted before the PUT: one that lands unseen is credit the member may spend
            m.granted += more;
        }
    }
    let mut puts = Vec::new();
    for (id, m) in l.members.iter().filter(|(_, m)| m.alive) {
        // written when it grew, when the last write failed, and once a lease anyway (a grant
        // object deleted or garbled is written again)
        let due = match m.written {
            Some((g, at)) => g != m.granted || now - at >= c.lease,
            None => m.granted > 0,
        };
        if !due {
            continue;
        }
        let granted = m.granted;
        let p = c.path(&format!("grants/{id}"));
        let body = format!("{} {} {granted}", l.epoch, c.id);
        let id = id.clone();
        puts.push(async move {
            let r = sh
                .request_unbounded(sh.store.put(&p, PutPayload::from(body)))
                .await;
            let ok = r.is_ok();
            if let Err(e) = r {
                c.error("writing a grant", &sh.err("coordination", e));
            }
            (id, granted, ok)
        });
    }
    for (id, granted, ok) in futures::future::join_all(puts).await {
        if let Some(m) = l.members.get_mut(&id) {
            m.written = ok.then_some((granted, now));
        }
    }
    publish_outside(c, l);
}
