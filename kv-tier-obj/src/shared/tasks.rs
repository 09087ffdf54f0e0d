//! A shared bucket's coordination task, the member's side: the journal's flush, the
//! heartbeat, the grant it reads; it runs the lease task (`lease`) and, while this member
//! leads, the leader's work (`leader`). See the parent module for the protocol.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use kv_tier_core::{Error, Result};
use object_store::{ObjectStoreExt as _, PutMode, PutOptions, PutPayload};

use super::leader::{Leading, lead_tick, tail, take_over};
use super::lease::lease_task;
use super::{Coord, lock};
use crate::block::{ReqError, Shared};

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
                Err(e) => c.error("heartbeat", &sh.err("coordination", e)),
            }
        }
        let epoch = c.lead_epoch.load(Ordering::SeqCst);
        if !c.is_leader() || leading.as_ref().is_some_and(|l| l.epoch != epoch) {
            leading = None;
        }
        if c.is_leader() && leading.is_none() {
            leading = Some(take_over(&c, epoch));
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
        Err(e) => c.error("writing the journal", &sh.err("coordination", e)),
    }
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
            c.error("reading the grant", &sh.err("coordination", e));
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
