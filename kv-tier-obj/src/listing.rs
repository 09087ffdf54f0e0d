//! The existence listing of an unbounded tier (not shared): the keys a LIST of the rank's
//! objects found, relisted in the background, so a lookup answers "absent" for a key it
//! does not list without a HEAD (a bounded tier's capacity index does this for it).
//!
//! Its rules are the existence cache's:
//! - It answers "absent" only. "Present" comes from the existence cache, which each LIST
//!   fills as a HEAD does (see the `presence` module: not for a key seen gone since the LIST
//!   began), so a removal is never hidden by it; stores never ask it.
//! - It answers while its LIST began at most `absent_ttl_s` ago, and the rank is relisted
//!   every half of that: another writer's new object is found within that long.
//! - A key this tier stores is added to the listing, and to the one a LIST under way will
//!   install (which may not have found it): the listing never answers "absent" for a key
//!   this tier stored since its LIST began, whatever the existence cache still holds.
//! - A LIST that takes longer than a hundredth of `absent_ttl_s` is followed by the next
//!   only fifty times its own time later (see [`relist_interval`]): the listing answers less
//!   of the time, and LISTs never take more than a fiftieth of one request stream.
//! - It holds at most [`MAX_LISTED_KEYS`] keys. A rank with more is not listed again, and its
//!   lookups HEAD what the cache does not hold; so do those of a tier with `absent_ttl_s` 0.

use std::ops::ControlFlow;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use kv_tier_core::BlockKey;
use rustc_hash::FxHashSet;
use tokio::time::Instant;

use crate::block::{Listing, Shared, bump, lock};

/// The most keys a listing holds (about 40 MB of them).
pub(crate) const MAX_LISTED_KEYS: usize = 1 << 20;

/// Ends the recording of the keys stored while a LIST is under way, however the LIST ends
/// (dropped mid-request too).
struct StopRecording<'a>(&'a Shared);

impl Drop for StopRecording<'_> {
    fn drop(&mut self) {
        lock(&self.0.listing).stored_while_listing = None;
    }
}

/// Why a LIST gave no listing.
pub(crate) enum Unlisted {
    /// More than [`MAX_LISTED_KEYS`] keys.
    TooMany,
    /// The LIST failed.
    Failed(kv_tier_core::Error),
}

impl Shared {
    /// The listing says `key` is absent: a listing whose LIST began at most `absent_ttl_s`
    /// ago does not hold it.
    pub(crate) fn listed_absent(&self, key: &BlockKey) -> bool {
        lock(&self.listing)
            .current
            .as_ref()
            .is_some_and(|l| l.began.elapsed() <= self.absent_ttl && !l.keys.contains(key))
    }

    /// This tier stored `key`: the listing (and the one a LIST under way installs) holds it.
    /// One that would hold more than [`MAX_LISTED_KEYS`] keys is dropped.
    pub(crate) fn listing_stored(&self, key: BlockKey) {
        let mut l = lock(&self.listing);
        if let Some(during) = &mut l.stored_while_listing {
            during.insert(key);
            if during.len() > MAX_LISTED_KEYS {
                l.stored_while_listing = None;
            }
        }
        if let Some(cur) = &mut l.current {
            cur.keys.insert(key);
            if cur.keys.len() > MAX_LISTED_KEYS {
                l.current = None;
            }
        }
    }

    /// Lists the rank's objects, fills the existence cache with them and replaces the
    /// listing (unless it was forgotten meanwhile).
    pub(crate) async fn relist(&self) -> std::result::Result<(), Unlisted> {
        let began = Instant::now();
        let sent = self.presence.stamp();
        lock(&self.listing).stored_while_listing = Some(FxHashSet::default());
        let _stop = StopRecording(self);
        let mut keys = FxHashSet::default();
        let complete = self
            .list_rank_each(crate::block::Kind::Listing, |meta| {
                if let Some(k) = self.key_of(&meta.location) {
                    keys.insert(k);
                    if keys.len() > MAX_LISTED_KEYS {
                        return ControlFlow::Break(());
                    }
                }
                ControlFlow::Continue(())
            })
            .await
            .map_err(Unlisted::Failed)?;
        if !complete {
            lock(&self.listing).current = None;
            return Err(Unlisted::TooMany);
        }
        let mut listed = keys.iter();
        while listed.len() > 0 {
            self.presence.present_all(listed.by_ref().take(4096), sent);
            tokio::task::yield_now().await;
        }
        let mut l = lock(&self.listing);
        // forgotten since the LIST began (or the keys stored meanwhile were too many): the
        // next LIST answers
        let Some(during) = l.stored_while_listing.take() else {
            return Ok(());
        };
        keys.extend(during);
        if keys.len() > MAX_LISTED_KEYS {
            l.current = None;
            return Err(Unlisted::TooMany);
        }
        bump(&self.counters.own.listings, 1);
        l.current = Some(Listing { keys, began });
        Ok(())
    }

    /// Forgets the listing, and the one a LIST under way would install.
    pub(crate) fn forget_listing(&self) {
        let mut l = lock(&self.listing);
        l.current = None;
        l.stored_while_listing = None;
    }
}

/// How long after a LIST that took `took` the next one begins, for a listing that answers
/// for `absent_ttl`: every half of it, or fifty times the LIST's own time if that is longer
/// (the LISTs take at most a fiftieth of one request stream; meanwhile the listing ages out
/// and lookups ask). Measured (`benches/obj_throughput.rs`, moto, 16 PUTs at once): LISTs
/// taking a tenth of the time cost the tier's PUTs 13% of their GB/s (0.221 against 0.252
/// GB/s with no listing), on a server that serves a LIST at the others' expense.
pub(crate) fn relist_interval(absent_ttl: Duration, took: Duration) -> Duration {
    (absent_ttl / 2).max(took.saturating_mul(50))
}

/// Relists `shared`'s rank (see [`relist_interval`]) until the tier closes or goes, or until
/// the rank holds more than [`MAX_LISTED_KEYS`]. A failed LIST is tried again at the next
/// interval; the listing it would have replaced ages out meanwhile.
pub(crate) async fn run(shared: Weak<Shared>) {
    let mut slow = false;
    loop {
        let Some(sh) = shared.upgrade() else { return };
        if sh.closed.load(Ordering::SeqCst) {
            return;
        }
        let began = Instant::now();
        match sh.relist().await {
            Ok(()) => {}
            Err(Unlisted::TooMany) => {
                tracing::info!(tier = %sh.name, max = MAX_LISTED_KEYS, "the rank holds more keys than a listing keeps: lookups ask for the keys the existence cache does not hold");
                return;
            }
            Err(Unlisted::Failed(e)) => {
                tracing::warn!(tier = %sh.name, error = %e, "the existence LIST failed; it is tried again at the next interval");
            }
        }
        let took = began.elapsed();
        let every = relist_interval(sh.absent_ttl, took);
        if every > sh.absent_ttl / 2 && !slow {
            tracing::info!(tier = %sh.name, took_ms = took.as_millis() as u64, relist_s = every.as_secs_f64(), absent_ttl_s = sh.absent_ttl.as_secs_f64(), "a LIST of the rank takes over a hundredth of absent_ttl_s: relisted less often, lookups ask for what the listing cannot answer meanwhile");
        }
        slow = every > sh.absent_ttl / 2;
        drop(sh);
        tokio::time::sleep_until(began + every).await;
    }
}

/// Starts [`run`] for a tier that keeps a listing: unbounded, not on a shared bucket
/// (`shared`: where other instances write all the time and the TTL is a quarter lease),
/// and with an `absent_ttl_s` above 0.
pub(crate) fn spawn(
    shared: &Arc<Shared>,
    on_shared_bucket: bool,
) -> Option<tokio::task::JoinHandle<()>> {
    (shared.cap.is_none() && !on_shared_bucket && !shared.absent_ttl.is_zero())
        .then(|| tokio::spawn(run(Arc::downgrade(shared))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_slower_than_a_hundredth_of_absent_ttl_spaces_the_next_by_fifty_times_its_time() {
        let ttl = Duration::from_secs(5);
        assert_eq!(relist_interval(ttl, Duration::ZERO), ttl / 2);
        assert_eq!(relist_interval(ttl, Duration::from_millis(50)), ttl / 2);
        assert_eq!(
            relist_interval(ttl, Duration::from_millis(51)),
            Duration::from_millis(2550)
        );
        assert_eq!(
            relist_interval(ttl, Duration::from_secs(3)),
            Duration::from_secs(150)
        );
        assert_eq!(relist_interval(ttl, Duration::MAX), Duration::MAX);
    }
}
