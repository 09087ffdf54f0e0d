//! The bounded mode's I/O: the sweep, which deletes least-recently-used objects down to the
//! low watermark; the index seeded from a LIST at open; its recency order saved at shutdown.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures::{StreamExt, TryStreamExt};
use kv_tier_core::{BlockKey, Result};
use object_store::ObjectStoreExt as _;

use crate::block::{Kind, ReqError, Shared, bump};
use crate::capacity::Deleting;

/// Victims decided (and deleted, their DELETEs at once within the bound of writes) per
/// batch.
const BATCH: usize = 256;

impl Shared {
    /// Deletes least-recently-used objects down to the low watermark, skipping protected
    /// keys; returns how many it deleted (confirmed by the store). Every victim is reported
    /// removed, batch by batch (see [`Deleting`]). With `wait`, runs after
    /// a sweep in progress; without, returns 0 if one runs.
    ///
    /// Each batch is decided atomically with `protect()` (see [`crate::capacity::Cap::decide`]);
    /// a store of a key being deleted waits for the delete, a lookup answers absent. The
    /// sweep stops between batches once the tier is shut down, and can be dropped at any
    /// await point: undeleted victims go back to the index.
    pub(crate) async fn sweep(self: Arc<Self>, wait: bool) -> usize {
        let span = tracing::info_span!("kv_tier_obj_sweep", tier = %self.name);
        tracing::Instrument::instrument(self.sweep_in_span(wait), span).await
    }

    async fn sweep_in_span(self: Arc<Self>, wait: bool) -> usize {
        let Some(cap) = &self.cap else { return 0 };
        self.sweep_cap(cap, &|_| false, wait).await
    }

    /// Sweeps `cap`'s index (this tier's own, or a shared bucket's leader's index of every
    /// instance's objects) down to its low watermark, keeping the keys `keep` names.
    pub(crate) async fn sweep_cap(
        &self,
        cap: &crate::capacity::Cap,
        keep: &(dyn Fn(&kv_tier_core::BlockKey) -> bool + Sync),
        wait: bool,
    ) -> usize {
        let _one = if wait {
            cap.sweeping.lock().await
        } else {
            match cap.sweeping.try_lock() {
                Ok(g) => g,
                Err(_) => return 0,
            }
        };
        if !cap.over() {
            return 0;
        }
        let mut cursor = std::ops::Bound::Unbounded;
        let mut deleted = 0;
        let mut examined = 0;
        // batches in a row whose deletes confirmed none (a backend that does not delete)
        let mut barren = 0;
        loop {
            if self.closed.load(Ordering::SeqCst) {
                break;
            }
            let d = cap.decide(&self.protection, keep, &mut cursor, BATCH);
            bump(&self.counters.own.skipped_in_flight, d.protected);
            examined += d.examined;
            let mut short = false;
            if !d.victims.is_empty() {
                let mut batch = Deleting::new(cap, &self.events, d.victims);
                self.delete_batch(&mut batch).await;
                deleted += batch.confirmed();
                short = batch.confirmed() < batch.victims.len();
                barren = if batch.confirmed() == 0 {
                    barren + 1
                } else {
                    0
                };
            }
            // A batch whose deletes did not all confirm (they go back, counted) leaves the
            // count over: the sweep reads on after its last victim, so objects that can go
            // are not kept behind ones that cannot; but not past two batches in a row that
            // confirmed nothing (the backend is not deleting: the next sweep tries again).
            // The cursor only moves on: it ends.
            if short && cap.over() && barren < 2 {
                if let Some(r) = d.last_victim {
                    cursor = std::ops::Bound::Excluded(r);
                }
                continue;
            }
            if d.done {
                break;
            }
        }
        bump(&self.counters.own.evicted, deleted as u64);
        bump(&self.counters.own.sweeps, 1);
        tracing::debug!(tier = %self.name, deleted, examined, "obj tier sweep");
        deleted
    }

    /// The DELETEs of the batch's victims, oldest first, each a write request of its own
    /// (the batch within one request deadline), at most half of `io_threads` (at least one)
    /// at once: write-back keeps the other half, and a PUT waits behind at most that many
    /// DELETEs. Each victim is seen gone and marked gone as the store confirms it, and its
    /// deletion ends as its DELETE does; a store of a victim whose DELETE is not sent yet
    /// takes it back (it is left, not deleted), so a store waits for one DELETE at most (see
    /// [`Deleting`] for the rest). One request per object, as the PUTs were: S3's bulk
    /// delete would be one request for the batch, but as many DELETEs in flight at once on a
    /// store without it (object_store's default runs ten), outside the bound.
    pub(crate) async fn delete_batch(&self, batch: &mut Deleting<'_>) {
        let _forget = self.forget_after(batch.victims.iter().map(|(k, _, _)| *k).collect());
        let requests: Vec<_> = batch
            .victims
            .iter()
            .enumerate()
            .map(|(i, (k, _, _))| {
                let (k, path) = (*k, self.path(k));
                let cap = batch.cap;
                async move {
                    // taken back by a store meanwhile (see `CapIndex::take_back`): left
                    if !cap.lock().start_delete(&k) {
                        return (i, k, path, None);
                    }
                    let r = self.request_as(Kind::Write, self.store.delete(&path)).await;
                    (i, k, path, Some(r))
                }
            })
            .collect();
        let mut deletes =
            futures::stream::iter(requests).buffer_unordered((self.io_threads / 2).max(1));
        let mut failed = 0;
        let mut first = None;
        // the batch within one request deadline: the DELETEs not ended by then end their
        // victims' deletion as not confirmed (see `Deleting`), and the sweep goes on
        let until = tokio::time::Instant::now() + self.request_deadline;
        while let Ok(Some((i, k, path, r))) = tokio::time::timeout_at(until, deletes.next()).await {
            let Some(r) = r else {
                batch.settle(i, false);
                continue;
            };
            // before its deletion ends: no read that overlapped the DELETE caches "present"
            self.presence.gone([&k]);
            match r {
                // deleted, or already gone
                Ok(()) | Err(ReqError::Store(object_store::Error::NotFound { .. })) => {
                    batch.settle(i, true);
                }
                Err(e) => {
                    batch.settle(i, false);
                    failed += 1;
                    first.get_or_insert_with(|| self.err(&format!("DELETE {path}"), e));
                }
            }
        }
        if let Some(err) = first {
            tracing::warn!(tier = %self.name, objects = failed, error = %err, "capacity deletes failed or did not end; the objects not confirmed gone are reported removed and stay counted");
        }
    }
}

impl Shared {
    /// Seeds the capacity index (bounded mode) from a LIST of the rank's objects, in the
    /// recency order the last shutdown saved where there is one, else by age.
    pub(crate) async fn seed_index(&self) -> Result<()> {
        match &self.cap {
            Some(cap) => self.seed_cap(cap).await,
            None => Ok(()),
        }
    }

    /// Seeds `cap` (see [`Shared::seed_index`]).
    pub(crate) async fn seed_cap(&self, cap: &crate::capacity::Cap) -> Result<()> {
        let inner = self;
        let snapshot = inner.recency_path();
        let (mut found, snapshot_time) = self.list_rank().await?;
        // the recency the last shutdown saved, if any (touches are not in the objects' ages)
        let order = match snapshot_time {
            Some(at) => match inner
                .request(async { inner.store.get(&snapshot).await?.bytes().await })
                .await
            {
                Ok(bytes) => crate::capacity::decode_recency(&bytes).map(|pos| (pos, at)),
                Err(e) => {
                    tracing::warn!(tier = %inner.name, error = %inner.err("GET recency", e), "the recency snapshot is unreadable; objects are ordered by age");
                    None
                }
            },
            None => None,
        };
        if let Some((pos, at)) = order {
            found = crate::capacity::order_by_snapshot(found, &pos, at);
        }
        cap.seed(found);
        Ok(())
    }

    /// Every block object of the rank (`(last modified, key, size)`), and when the recency
    /// snapshot was saved if there is one: a whole LIST, or an error.
    pub(crate) async fn list_rank(&self) -> Result<(Vec<(u64, BlockKey, u64)>, Option<u64>)> {
        let snapshot = self.recency_path();
        let mut found = Vec::new();
        let mut snapshot_time = None;
        self.list_rank_each(crate::block::Kind::Read, |meta| {
            let t = meta.last_modified.timestamp_micros().max(0) as u64;
            if let Some(k) = self.key_of(&meta.location) {
                found.push((t, k, meta.size));
            } else if meta.location == snapshot {
                snapshot_time = Some(t);
            }
            std::ops::ControlFlow::Continue(())
        })
        .await?;
        Ok((found, snapshot_time))
    }

    /// Calls `f` with every object under the rank prefix, a LIST page per request (each
    /// within a request deadline), until `f` breaks: whether the LIST went to its end.
    pub(crate) async fn list_rank_each(
        &self,
        kind: crate::block::Kind,
        mut f: impl FnMut(object_store::ObjectMeta) -> std::ops::ControlFlow<()>,
    ) -> Result<bool> {
        let prefix = self.rank_prefix();
        let mut listing = self.store.list(Some(&prefix));
        loop {
            match self.request_as(kind, listing.try_next()).await {
                Ok(Some(meta)) => {
                    if f(meta).is_break() {
                        return Ok(false);
                    }
                }
                Ok(None) => return Ok(true),
                Err(e) => return Err(self.err("LIST", e)),
            }
        }
    }

    /// Saves the bounded index's recency order (touches included) for the next open.
    pub(crate) async fn save_recency(&self) {
        let inner = self;
        let Some(cap) = &inner.cap else {
            return;
        };
        let bytes = crate::capacity::encode_recency(&cap.lock().keys_by_recency());
        let path = inner.recency_path();
        let put = inner
            .request_as(crate::block::Kind::Write, async {
                inner
                    .store
                    .put(&path, object_store::PutPayload::from(bytes))
                    .await
            })
            .await;
        if let Err(e) = put {
            tracing::warn!(tier = %inner.name, error = %inner.err("PUT recency", e), "the recency order is not saved; the next open orders objects by age");
        }
    }
}
