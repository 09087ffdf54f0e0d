//! A shared bucket's lease: held by one member at a time, renewed with `If-Match`, taken
//! when it expires (see the parent module for the protocol).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use object_store::{ObjectStoreExt as _, PutMode, PutOptions, UpdateVersion};

use super::{Coord, lock};
use crate::block::{ReqError, Shared};

/// The lease object's content and version.
#[derive(Debug, Clone)]
struct Lease {
    epoch: u64,
    owner: String,
    beat: u64,
    version: UpdateVersion,
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

/// Holds the lease (renewing it four times per period) or watches it (taking it when it
/// expires); releases it when the tier closes.
pub(super) async fn lease_task(c: Arc<Coord>, sh: Arc<Shared>) {
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
            c.error("releasing the lease", &sh.err("coordination", e));
        }
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
                Err(e) => c.error("renewing the lease", &sh.err("coordination", e)),
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
            c.error("reading the lease", &sh.err("coordination", e));
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
            c.error("taking the lease", &sh.err("coordination", e));
            None
        }
    }
}
