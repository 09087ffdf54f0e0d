//! A shared bucket's coordination tasks: the journal's flush, the heartbeat, the lease, the
//! grants, and the leader's work (see the parent module for the protocol).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, Result};
use object_store::path::Path as ObjPath;
use object_store::{ObjectStoreExt as _, PutMode, PutOptions, PutPayload, UpdateVersion};
use rustc_hash::FxHashMap;

use super::{Coord, Record, lock};
use crate::block::{ReqError, Shared};

/// Ticks a new leader waits before it grants (writers drop the old leader's credit meanwhile).
const GRANT_DELAY_TICKS: u32 = 2;

/// Grants keep the leader's total under this multiple of the bound.
const CEILING: f64 = 1.05;

/// The lease object's content and version.
#[derive(Debug, Clone)]
struct Lease {
    epoch: u64,
    owner: String,
    beat: u64,
    version: UpdateVersion,
}

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
struct Leading {
    epoch: u64,
    members: FxHashMap<String, Member>,
    /// Applied batches, deleted once older than [`retention`].
    applied: Vec<(ObjPath, Instant)>,
    ticks: u32,
    /// Rotates which member a grant smaller than everyone's block goes to first.
    turn: usize,
    /// When its index was last mended by a LIST.
    reconciled: Instant,
    /// Whether its index holds every object (a whole LIST made since it took the lease).
    seeded: bool,
}

/// The lease as its holder keeps it.
struct Held {
    epoch: u64,
    version: UpdateVersion,
    beat: u64,
    renewed: Instant,
}

/// [`Watch::version`] of a lease found missing.
const MISSING: &str = "\0missing";

/// What the follower side last saw of the lease.
struct Watch {
    version: Option<String>,
    since: Instant,
}

/// The coordination task of one instance: journal, heartbeat, grants, and the leader's work
/// while it leads (the lease runs in a task of its own, so no sweep or slow listing delays
/// a renewal). Ends when the tier closes (releasing the lease and its heartbeat).
pub(crate) async fn run(c: Arc<Coord>, sh: Arc<Shared>) {
    let lease = tokio::spawn(lease_task(c.clone(), sh.clone()));
    let mut leading: Option<Leading> = None;
    let mut beat_at = Instant::now() - c.lease;
    let mut beat = 0u64;
    let mut full_at = Instant::now() - c.tick;
    loop {
        if sh.closed.load(Ordering::SeqCst) {
            break;
        }
        let now = Instant::now();
        if now - full_at < c.tick {
            // between ticks, a quarter tick apart: reads reach the leader sooner (the
            // members send batches holding reads, the leader reads the journals)
            if lock(&c.w).reads_unsent {
                flush(&c, &sh).await;
            }
            if let Some(l) = leading.as_mut().filter(|l| l.seeded && c.is_leader()) {
                tail(&c, &sh, l).await;
            }
            tokio::time::sleep(c.tick / 4).await;
            continue;
        }
        full_at = now;
        flush(&c, &sh).await;
        if now - beat_at >= c.lease / 4 {
            beat += 1;
            let p = c.path(&format!("members/{}", c.id));
            match sh
                .request_unbounded(sh.store.put(&p, PutPayload::from(beat.to_string())))
                .await
            {
                Ok(_) => {
                    beat_at = now;
                    lock(&c.w).spend_until = Some(now + c.lease);
                }
                Err(e) => c.error("heartbeat", &err(&sh, e)),
            }
        }
        let epoch = c.lead_epoch.load(Ordering::SeqCst);
        if !c.is_leader() || leading.as_ref().is_some_and(|l| l.epoch != epoch) {
            leading = None;
        }
        if c.is_leader() && leading.is_none() {
            leading = Some(take_over(&c, &sh, epoch).await);
        }
        if let Some(l) = &mut leading {
            lead_tick(&c, &sh, l).await;
        }
        read_grant(&c, &sh).await;
        tokio::time::sleep(c.tick / 4).await;
    }
    lock(&c.w).records.push_str("X\n");
    flush(&c, &sh).await;
    let _ = lease.await;
    let _ = sh
        .request_unbounded(sh.store.delete(&c.path(&format!("members/{}", c.id))))
        .await;
}

/// Holds the lease (renewing it four times per period) or watches it (taking it when it
/// expires); releases it when the tier closes.
async fn lease_task(c: Arc<Coord>, sh: Arc<Shared>) {
    let mut held: Option<Held> = None;
    let mut watch = Watch {
        version: None,
        since: Instant::now(),
    };
    let every = c.tick.min(c.lease / 4);
    while !sh.closed.load(Ordering::SeqCst) {
        held = lease_step(&c, &sh, held, &mut watch).await;
        tokio::time::sleep(every).await;
    }
    if let Some(h) = held {
        c.leading.store(false, Ordering::SeqCst);
        let body = format!("{} - {}", h.epoch, h.beat + 1);
        let opts = PutOptions::from(PutMode::Update(h.version));
        if let Err(e) = sh
            .request_unbounded(sh.store.put_opts(&c.path("lease"), body.into(), opts))
            .await
        {
            c.error("releasing the lease", &err(&sh, e));
        }
    }
}

/// Writes this instance's heartbeat create-only, so a store without conditional writes is
/// refused at open (the lease needs them), naming the option.
pub(crate) async fn check_conditional_writes(c: &Coord, sh: &Shared) -> Result<()> {
    let p = c.path(&format!("members/{}", c.id));
    let put = sh
        .request_unbounded(sh.store.put_opts(
            &p,
            PutPayload::from("0"),
            PutOptions::from(PutMode::Create),
        ))
        .await;
    match put {
        Ok(_) | Err(ReqError::Store(object_store::Error::AlreadyExists { .. })) => Ok(()),
        Err(ReqError::Store(object_store::Error::NotImplemented { .. })) => Err(Error::config(
            "shared",
            format!(
                "the store {} has no conditional writes (If-None-Match / If-Match), which a shared bucket's lease needs",
                sh.store
            ),
        )),
        Err(e) => Err(sh.err(&format!("PUT {p}"), e)),
    }
}

fn err(sh: &Shared, e: ReqError) -> Error {
    sh.err("coordination", e)
}

/// Sends the journal's records as one batch (or the last one again, if it did not land).
async fn flush(c: &Coord, sh: &Shared) {
    let batch = {
        let mut w = lock(&c.w);
        let every = c.lease / 4;
        let now = Instant::now();
        w.reads.retain(|_, t| now - *t < every);
        if w.unsent.is_none() && !w.records.is_empty() {
            let seq = w.next_seq;
            w.next_seq += 1;
            w.reads_unsent = false;
            let mut text = std::mem::take(&mut w.records);
            // what it spent of its grant in all, last (its stores above included): a leader
            // that missed a batch still knows what was spent
            if !w.grant_owner.is_empty() {
                text.push_str(&format!(
                    "C {} {} {}\n",
                    w.grant_epoch, w.grant_owner, w.consumed
                ));
            }
            w.unsent = Some((seq, text));
        }
        w.unsent.clone()
    };
    let Some((seq, text)) = batch else { return };
    let p = c.path(&format!("journal/{}/{seq:020}", c.id));
    match sh
        .request_unbounded(sh.store.put(&p, PutPayload::from(text)))
        .await
    {
        Ok(_) => {
            c.counters.batches.fetch_add(1, Ordering::Relaxed);
            lock(&c.w).unsent = None;
        }
        Err(e) => c.error("writing the journal", &err(sh, e)),
    }
}

async fn read_lease(c: &Coord, sh: &Shared) -> std::result::Result<Option<Lease>, ReqError> {
    let p = c.path("lease");
    let got = sh
        .request_unbounded(async {
            let r = sh.store.get(&p).await?;
            let version = UpdateVersion {
                e_tag: r.meta.e_tag.clone(),
                version: r.meta.version.clone(),
            };
            Ok((r.bytes().await?, version))
        })
        .await;
    match got {
        Ok((bytes, version)) => {
            let text = String::from_utf8_lossy(&bytes);
            let mut it = text.split_whitespace();
            // a lease that does not parse is held by someone unknown (`?`), not released
            let (epoch, owner) = match (it.next().map(str::parse::<u64>), it.next()) {
                (Some(Ok(e)), Some(o)) => (e, o.to_string()),
                _ => (0, "?".to_string()),
            };
            let beat = it.next().and_then(|b| b.parse().ok()).unwrap_or(0);
            Ok(Some(Lease {
                epoch,
                owner,
                beat,
                version,
            }))
        }
        Err(ReqError::Store(object_store::Error::NotFound { .. })) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Renews the lease (its holder) or reads it and takes it when expired (the others).
/// Returns the lease held, `None` when not holding it.
async fn lease_step(c: &Coord, sh: &Shared, held: Option<Held>, watch: &mut Watch) -> Option<Held> {
    let now = Instant::now();
    if let Some(mut h) = held {
        // a renewal whose reply was lost may have landed: the lease then still names this
        // member at its epoch, under a version it does not know; it adopts it and renews again
        let mut adopted = false;
        while now - h.renewed >= c.lease / 4 {
            let body = format!("{} {} {}", h.epoch, c.id, h.beat + 1);
            let opts = PutOptions::from(PutMode::Update(h.version.clone()));
            match sh
                .request_unbounded(sh.store.put_opts(&c.path("lease"), body.into(), opts))
                .await
            {
                Ok(r) => {
                    h.beat += 1;
                    h.renewed = now;
                    h.version = UpdateVersion {
                        e_tag: r.e_tag,
                        version: r.version,
                    };
                }
                Err(ReqError::Store(object_store::Error::Precondition { .. })) => {
                    match read_lease(c, sh).await {
                        Ok(Some(l)) if !adopted && l.owner == c.id && l.epoch == h.epoch => {
                            adopted = true;
                            h.version = l.version;
                            h.beat = l.beat;
                            continue;
                        }
                        _ => {
                            tracing::warn!(instance = %c.id, epoch = h.epoch, "shared bucket: the lease was taken; stepping down");
                            c.leading.store(false, Ordering::SeqCst);
                            return None;
                        }
                    }
                }
                Err(e) => c.error("renewing the lease", &err(sh, e)),
            }
            break;
        }
        // the others take it after a whole period unchanged: stop well before
        if Instant::now() - h.renewed >= c.lease * 3 / 4 {
            tracing::warn!(instance = %c.id, epoch = h.epoch, "shared bucket: the lease could not be renewed; stepping down");
            c.leading.store(false, Ordering::SeqCst);
            return None;
        }
        let mut w = lock(&c.w);
        w.lease_epoch = h.epoch;
        w.lease_owner.clone_from(&c.id);
        drop(w);
        return Some(h);
    }
    let seen = match read_lease(c, sh).await {
        Ok(s) => s,
        Err(e) => {
            c.error("reading the lease", &err(sh, e));
            return None;
        }
    };
    // a claim goes above every epoch this instance has seen (a lease deleted or garbled
    // after epochs climbed never brings an old epoch back)
    let above = c.epoch_seen.load(Ordering::Relaxed);
    let (epoch, mode) = match &seen {
        // none: a fresh bucket (claimed at once by an instance that never saw a lease), or a
        // lease deleted under a leader that may live (claimed once it stayed missing for a
        // whole period: that leader stops at its next renewal)
        None => {
            if watch.version.as_deref() != Some(MISSING) {
                watch.version = Some(MISSING.to_string());
                watch.since = now;
            }
            if above > 0 && now - watch.since < c.lease {
                return None;
            }
            (above + 1, PutMode::Create)
        }
        // this member's own (a take or renewal that landed, its reply lost): renewed at once
        Some(l) if l.owner == c.id => {
            c.epoch_seen.fetch_max(l.epoch, Ordering::Relaxed);
            (l.epoch, PutMode::Update(l.version.clone()))
        }
        Some(l) => {
            c.epoch_seen.fetch_max(l.epoch, Ordering::Relaxed);
            let mut w = lock(&c.w);
            w.lease_epoch = l.epoch;
            w.lease_owner.clone_from(&l.owner);
            drop(w);
            let tag = l.version.e_tag.clone();
            if watch.version != tag {
                watch.version = tag;
                watch.since = now;
            }
            let expired = l.owner == "-" || now - watch.since >= c.lease;
            if !expired {
                return None;
            }
            (above.max(l.epoch) + 1, PutMode::Update(l.version.clone()))
        }
    };
    let body = format!("{epoch} {} 0", c.id);
    let taken = sh
        .request_unbounded(
            sh.store
                .put_opts(&c.path("lease"), body.into(), PutOptions::from(mode)),
        )
        .await;
    match taken {
        Ok(r) => {
            tracing::info!(instance = %c.id, epoch, "shared bucket: took the lease");
            c.counters.takeovers.fetch_add(1, Ordering::Relaxed);
            c.epoch_seen.fetch_max(epoch, Ordering::Relaxed);
            let mut w = lock(&c.w);
            w.lease_epoch = epoch;
            w.lease_owner.clone_from(&c.id);
            drop(w);
            c.lead_epoch.store(epoch, Ordering::SeqCst);
            c.leading.store(true, Ordering::SeqCst);
            Some(Held {
                epoch,
                version: UpdateVersion {
                    e_tag: r.e_tag,
                    version: r.version,
                },
                beat: 0,
                renewed: now,
            })
        }
        Err(ReqError::Store(
            object_store::Error::Precondition { .. } | object_store::Error::AlreadyExists { .. },
        )) => None, // another instance won
        Err(e) => {
            c.error("taking the lease", &err(sh, e));
            None
        }
    }
}

/// A new leader's state; its index is seeded at its first ticks (see [`seed`]).
async fn take_over(c: &Coord, _sh: &Shared, epoch: u64) -> Leading {
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
async fn lead_tick(c: &Coord, sh: &Shared, l: &mut Leading) {
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
            c.error("listing the members", &err(sh, e));
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
async fn tail(c: &Coord, sh: &Shared, l: &mut Leading) {
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
                    c.error("listing a journal", &err(sh, e));
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
                c.error("reading a journal batch", &err(sh, e));
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
                c.error("writing a grant", &err(sh, e));
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

/// Takes this instance's grant: the current leader's cumulative credit.
async fn read_grant(c: &Coord, sh: &Shared) {
    let p = c.path(&format!("grants/{}", c.id));
    let got = sh
        .request_unbounded(async { sh.store.get(&p).await?.bytes().await })
        .await;
    let bytes = match got {
        Ok(b) => b,
        Err(ReqError::Store(object_store::Error::NotFound { .. })) => return,
        Err(e) => {
            c.error("reading the grant", &err(sh, e));
            return;
        }
    };
    let text = String::from_utf8_lossy(&bytes);
    let mut it = text.split_whitespace();
    let (Some(Ok(epoch)), Some(owner), Some(Ok(granted))) = (
        it.next().map(str::parse::<u64>),
        it.next(),
        it.next().map(str::parse::<u64>),
    ) else {
        return;
    };
    let more = {
        let mut w = lock(&c.w);
        if epoch == w.grant_epoch && owner == w.grant_owner {
            w.granted = w.granted.max(granted);
        } else if epoch == w.lease_epoch && owner == w.lease_owner {
            // the grant of the leader whose lease it last read: its credit from zero
            w.grant_epoch = epoch;
            w.grant_owner = owner.to_string();
            w.granted = granted;
            w.consumed = 0;
        }
        w.available() > 0
    };
    if more {
        c.credit.notify_waiters();
    }
}
