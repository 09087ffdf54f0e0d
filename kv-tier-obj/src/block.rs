//! One block's requests: existence (HEAD), store (PUT), delete (the load's GET is in
//! `load`). Every request holds a permit of the `io_threads` bound and ends within the
//! request deadline; every future here can be dropped at any await point without leaving an
//! entry, permit or protection behind.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use kv_tier_core::{
    BlockKey, BlockSource, Error, EventBatch, EventLog, Namespace, ProtectionSet, Result,
};
use object_store::ObjectStoreExt as _;
use object_store::path::Path as ObjPath;
use object_store::{
    Attribute, AttributeValue, Attributes, ObjectStore, PutMode, PutOptions, PutPayload,
};
use rustc_hash::FxHashMap;
use tokio::sync::{Notify, Semaphore};

use crate::capacity::Cap;
use crate::config::ObjChecksum;
use crate::error::{classify, closed, timed_out};
use crate::stats::Counters;

pub use kv_tier_core::checksum::block_crc;

/// What a store finds at a block's path before it writes.
pub(crate) enum Existing {
    /// No object.
    Absent,
    /// An object a load accepts (a whole block; with checksums, a valid one, or none where
    /// unverified objects are accepted), found by a HEAD sent at this stamp.
    Usable(crate::presence::Stamp),
    /// An object a load would refuse: deleted, then written over.
    InTheWay,
}

/// The user-metadata key of a block's CRC32C (8 hex digits; see [`block_crc`]).
pub const CRC_METADATA_KEY: &str = "kv-tier-crc32c";

pub(crate) use kv_tier_core::stats::bump;

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // Every critical section of these locks leaves its data consistent before anything can
    // panic, so a poisoned lock is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// `d` after `now`, or a century on where that is past what an instant holds.
fn after(now: tokio::time::Instant, d: Duration) -> tokio::time::Instant {
    now.checked_add(d)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// The most keys [`Shared::damaged`] remembers.
pub(crate) const MAX_DAMAGED: usize = 4096;

/// How many times a store writes the block after a confirmation that a 404 contradicted,
/// before it fails (the object keeps going as it is stored).
const MAX_CONTRADICTED: usize = 3;

/// Why a request did not succeed.
pub(crate) enum ReqError {
    Store(object_store::Error),
    TimedOut,
}

/// Everything the tier's requests share.
pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) ns: Namespace,
    pub(crate) prefix: String,
    pub(crate) block_size: usize,
    pub(crate) checksum: ObjChecksum,
    pub(crate) accept_unverified: bool,
    pub(crate) put_body: PutBody,
    /// The `io_threads` bound on reads (GET, LIST, a store's HEAD) in flight.
    pub(crate) sem: Semaphore,
    /// The `io_threads` bound on a lookup's HEADs: no probe queues behind a load's GETs.
    pub(crate) probe_sem: Semaphore,
    /// The `io_threads` bound on writes.
    pub(crate) write_sem: Semaphore,
    pub(crate) io_threads: usize,
    pub(crate) in_flight: AtomicUsize,
    /// Reads and probes waiting for a permit or in flight, and writes past their gate: while
    /// any read is active, writes are limited to `writes_while_reading`.
    pub(crate) reads_active: AtomicUsize,
    pub(crate) writes_active: AtomicUsize,
    /// Woken when a read or a write ends: writes held back at their gate look again.
    pub(crate) budget_changed: Notify,
    /// Lookups past their deadline, and with failed HEADs: said in the log once per interval.
    pub(crate) log_deadlines: kv_tier_core::stats::Throttle,
    pub(crate) log_probe_errors: kv_tier_core::stats::Throttle,
    /// Positive existence answers, for lookups only (never to skip a PUT), and the one rule
    /// for what fills them (see the `presence` module).
    pub(crate) presence: crate::presence::Presence,
    /// How long the listing answers "absent" after its LIST began (`absent_ttl_s`).
    pub(crate) absent_ttl: Duration,
    /// What the last LIST found (unbounded tier, not shared): see the `listing` module.
    pub(crate) listing: Mutex<Listings>,
    pub(crate) create_only: AtomicBool,
    pub(crate) protection: ProtectionSet,
    pub(crate) events: Arc<EventLog>,
    pub(crate) counters: Arc<Counters>,
    pub(crate) cap: Option<Cap>,
    /// A shared bucket's coordination (then `cap` is `None`: the leader's index is the
    /// coordination's).
    pub(crate) coord: Option<Arc<crate::shared::Coord>>,
    pub(crate) request_deadline: Duration,
    pub(crate) lookup_deadline: Duration,
    /// Keys with a PUT in flight from this tier: a second store of the same key waits for it
    /// instead of uploading the same bytes again (and racing it on stores whose writes are
    /// not atomic). Entries are owned by [`PutClaim`] guards.
    pub(crate) puts: Mutex<FxHashMap<BlockKey, Arc<Notify>>>,
    /// Keys whose object a load found damaged and whose DELETE did not confirm (at most
    /// [`MAX_DAMAGED`]): a store replaces such an object instead of confirming it, since
    /// its metadata may well look whole.
    pub(crate) damaged: Mutex<rustc_hash::FxHashSet<BlockKey>>,
    pub(crate) closed: AtomicBool,
}

/// How a PUT's body is made from the block's source ([`Shared::put_body`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PutBody {
    /// A view of the source: no copy, and the source (a DRAM slot, pinned) is held until the
    /// store drops the body. For a store that drops a request's body when the request ends.
    View,
    /// A copy: the source is released before the upload. For a store that may keep what it
    /// is given (an in-memory store keeps it for good).
    Copy,
}

/// Which budget a request counts in ([`Shared::request_as`]): each kind has permits of its
/// own, so none queues behind another's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A lookup's HEAD: at most `io_threads`.
    Probe,
    /// GET, LIST, a store's HEAD, a load's DELETE of the damaged object it read: loads wait
    /// for these. At most `io_threads`.
    Read,
    /// The existence listing's LIST pages: a permit of the reads' bound, but not a read
    /// anything waits for, so writes are not held back for it.
    Listing,
    /// PUT, DELETE: write-back, a store's replacement of a damaged object, sweeps. At most
    /// `io_threads`, and while any probe or read is waiting or in flight, one starts only
    /// while fewer than a quarter of it (at least one) are under way, or after waiting a
    /// quarter of its request deadline.
    Write,
}

/// The keys one LIST of the rank found (with the keys this tier stored since it began), and
/// when it began.
pub(crate) struct Listing {
    pub(crate) keys: rustc_hash::FxHashSet<BlockKey>,
    pub(crate) began: tokio::time::Instant,
}

/// The existence listing's state (the `listing` module keeps it): the listing lookups ask,
/// and the keys stored while a LIST is under way.
#[derive(Default)]
pub(crate) struct Listings {
    pub(crate) current: Option<Listing>,
    /// `Some` while a LIST is under way (and not forgotten since): the keys this tier stored
    /// meanwhile, which the listing it installs holds whether or not the LIST found them.
    pub(crate) stored_while_listing: Option<rustc_hash::FxHashSet<BlockKey>>,
}

/// One read or write counted active until dropped (however the request ends).
struct Active<'a> {
    inner: &'a Shared,
    kind: Kind,
}

impl Drop for Active<'_> {
    fn drop(&mut self) {
        let n = match self.kind {
            Kind::Probe | Kind::Read => &self.inner.reads_active,
            Kind::Write => &self.inner.writes_active,
            // (not counted: `slot` makes none for it)
            Kind::Listing => return,
        };
        n.fetch_sub(1, Ordering::SeqCst);
        self.inner.budget_changed.notify_waiters();
    }
}

/// Tracks one request in flight, holding a permit of its kind's bound.
struct InFlight<'a> {
    inner: &'a Shared,
    _permit: tokio::sync::SemaphorePermit<'a>,
    _active: Option<Active<'a>>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.inner.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// This tier's claim to upload a key; dropping it (done, failed or cancelled) frees the key
/// and wakes the stores waiting for it.
struct PutClaim<'a> {
    inner: &'a Shared,
    key: BlockKey,
    notify: Arc<Notify>,
}

impl Drop for PutClaim<'_> {
    fn drop(&mut self) {
        let mut puts = lock(&self.inner.puts);
        if puts
            .get(&self.key)
            .is_some_and(|n| Arc::ptr_eq(n, &self.notify))
        {
            puts.remove(&self.key);
        }
        self.notify.notify_waiters();
    }
}

/// A damaged object's delete under way: dropped unconfirmed (failed, timed out, cancelled),
/// it leaves the key damaged ([`Shared::left_damaged`]).
struct Damaged<'a> {
    inner: &'a Shared,
    key: BlockKey,
}

impl Drop for Damaged<'_> {
    fn drop(&mut self) {
        self.inner.left_damaged(&self.key);
    }
}

/// Keys this tier is deleting: seen gone when made and again when dropped (the deletion
/// ended, failed, or was cancelled mid-request), so no read that overlapped the deletion
/// caches "present" (see the `presence` module).
pub(crate) struct Forget<'a> {
    inner: &'a Shared,
    keys: Vec<BlockKey>,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        self.inner.presence.gone(&self.keys);
    }
}

impl Shared {
    /// See [`Forget`].
    pub(crate) fn forget_after(&self, keys: Vec<BlockKey>) -> Forget<'_> {
        self.presence.gone(&keys);
        Forget { inner: self, keys }
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(closed(&self.name));
        }
        Ok(())
    }

    /// Holds a permit of `kind`'s bound (and, for a write, passes its gate) for one request,
    /// and the instant that request's deadline ends: a request deadline after it got its
    /// permit (a write's hold at the gate is part of it).
    async fn slot(&self, kind: Kind) -> (InFlight<'_>, tokio::time::Instant) {
        let (permit, active) = match kind {
            Kind::Probe | Kind::Read => {
                // counted from before the wait for a permit: a read that queues holds
                // writes back as one in flight does
                // (the guard before the wait: a read dropped while it waits counts off)
                self.reads_active.fetch_add(1, Ordering::SeqCst);
                let active = Active { inner: self, kind };
                let sem = if kind == Kind::Probe {
                    &self.probe_sem
                } else {
                    &self.sem
                };
                let permit = sem.acquire().await.expect("semaphore never closes");
                (permit, Some(active))
            }
            Kind::Listing => (
                self.sem.acquire().await.expect("semaphore never closes"),
                None,
            ),
            Kind::Write => {
                // the permit first: the gate counts writes that hold one
                let permit = self
                    .write_sem
                    .acquire()
                    .await
                    .expect("semaphore never closes");
                let now = tokio::time::Instant::now();
                let active = self.write_gate(after(now, self.request_deadline / 4)).await;
                return (
                    self.start(permit, Some(active)),
                    after(now, self.request_deadline),
                );
            }
        };
        let until = after(tokio::time::Instant::now(), self.request_deadline);
        (self.start(permit, active), until)
    }

    /// Counts a request that holds `permit` as started.
    fn start<'a>(
        &'a self,
        permit: tokio::sync::SemaphorePermit<'a>,
        active: Option<Active<'a>>,
    ) -> InFlight<'a> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.counters
            .own
            .max_in_flight
            .fetch_max(now as u64, Ordering::Relaxed);
        bump(&self.counters.own.requests, 1);
        InFlight {
            inner: self,
            _permit: permit,
            _active: active,
        }
    }

    /// How many writes may run while probes or reads wait or run: a quarter of `io_threads`,
    /// at least one. Measured (`benches/obj_probes.rs`, s3s, `io_threads` 16, 2 MiB PUTs
    /// beside back-to-back lookups of 32 keys): 1 gave probes p99 10 ms and writes 0.41x
    /// plain `object_store`'s, 2 39 ms and 0.6x, 4 44 ms and 0.82x, none 149 ms and 1x.
    fn writes_while_reading(&self) -> usize {
        (self.io_threads / 4).max(1)
    }

    /// Waits until a write may start: no probe or read active, or fewer writes past this gate
    /// than [`Shared::writes_while_reading`] (the write permits bound the rest); or `until`
    /// (a quarter of the write's request deadline): then it starts anyway, since write-back
    /// backs off, it does not stop.
    async fn write_gate(&self, until: tokio::time::Instant) -> Active<'_> {
        let mut deferred = false;
        loop {
            let changed = self.budget_changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let w = self.writes_active.load(Ordering::SeqCst);
            let reading = self.reads_active.load(Ordering::SeqCst) > 0;
            let late = tokio::time::Instant::now() >= until;
            if !reading || w < self.writes_while_reading() || late {
                if self
                    .writes_active
                    .compare_exchange(w, w + 1, Ordering::SeqCst, Ordering::SeqCst)
                    .is_ok()
                {
                    return Active {
                        inner: self,
                        kind: Kind::Write,
                    };
                }
                continue;
            }
            if !std::mem::replace(&mut deferred, true) {
                bump(&self.counters.own.writes_deferred, 1);
            }
            let _ = tokio::time::timeout_at(until, changed).await;
        }
    }

    /// Runs one read (HEAD, GET, LIST page) with a permit, within the request deadline:
    /// [`Shared::request_as`] with [`Kind::Read`].
    pub(crate) async fn request<T>(
        &self,
        fut: impl Future<Output = std::result::Result<T, object_store::Error>>,
    ) -> std::result::Result<T, ReqError> {
        self.request_as(Kind::Read, fut).await
    }

    /// Runs one request (which may stream its body) with a permit of its kind's budget,
    /// within the request deadline.
    pub(crate) async fn request_as<T>(
        &self,
        kind: Kind,
        fut: impl Future<Output = std::result::Result<T, object_store::Error>>,
    ) -> std::result::Result<T, ReqError> {
        let (_s, until) = self.slot(kind).await;
        match tokio::time::timeout_at(until, fut).await {
            Ok(r) => r.map_err(ReqError::Store),
            Err(_) => {
                bump(&self.counters.own.request_timeouts, 1);
                Err(ReqError::TimedOut)
            }
        }
    }

    /// Runs one request within the request deadline without a permit of the `io_threads`
    /// bound: a shared bucket's coordination (its lease must not queue behind block I/O).
    pub(crate) async fn request_unbounded<T>(
        &self,
        fut: impl Future<Output = std::result::Result<T, object_store::Error>>,
    ) -> std::result::Result<T, ReqError> {
        bump(&self.counters.own.requests, 1);
        match tokio::time::timeout(self.request_deadline, fut).await {
            Ok(r) => r.map_err(ReqError::Store),
            Err(_) => {
                bump(&self.counters.own.request_timeouts, 1);
                Err(ReqError::TimedOut)
            }
        }
    }

    pub(crate) fn err(&self, what: &str, e: ReqError) -> Error {
        match e {
            ReqError::Store(e) => classify(&self.name, what, &e),
            ReqError::TimedOut => timed_out(&self.name, what, self.request_deadline),
        }
    }

    pub(crate) fn path(&self, key: &BlockKey) -> ObjPath {
        let rel = self.ns.block_rel_path(key);
        if self.prefix.is_empty() {
            ObjPath::from(rel)
        } else {
            ObjPath::from(format!("{}/{rel}", self.prefix))
        }
    }

    pub(crate) fn rank_prefix(&self) -> ObjPath {
        let rank = self.ns.rank_dir_name();
        if self.prefix.is_empty() {
            ObjPath::from(rank)
        } else {
            ObjPath::from(format!("{}/{rank}", self.prefix))
        }
    }

    /// Where a bounded tier saves its recency order at shutdown (not a block path).
    pub(crate) fn recency_path(&self) -> ObjPath {
        ObjPath::from(format!("{}/kv-tier-recency.v1", self.rank_prefix()))
    }

    /// The key of an object path under the rank prefix, if it is a block of this layout.
    pub(crate) fn key_of(&self, path: &ObjPath) -> Option<BlockKey> {
        let s = path.as_ref();
        let rel = if self.prefix.is_empty() {
            s
        } else {
            s.strip_prefix(&self.prefix)?.strip_prefix('/')?
        };
        self.ns.parse_block_rel_path(rel)
    }

    pub(crate) fn is_deleting(&self, key: &BlockKey) -> bool {
        self.cap.as_ref().is_some_and(|c| c.lock().is_deleting(key))
    }

    /// See `ObjTier::holds`. Under the claims' lock, then the index's (the order
    /// [`Shared::found_missing`] takes them in): no store of the key starts or ends
    /// meanwhile, so an indexed key with no store in flight, not in doubt, was stored,
    /// confirmed or listed, and not found missing or removed since.
    pub(crate) fn holds(&self, key: &BlockKey) -> Option<bool> {
        if self.closed.load(Ordering::SeqCst) {
            return None;
        }
        let puts = lock(&self.puts);
        if puts.contains_key(key) {
            return None;
        }
        match &self.cap {
            Some(cap) => {
                let idx = cap.lock();
                if idx.is_deleting(key) {
                    return None;
                }
                match idx.knows(key) {
                    Some(false) if !self.presence.holds(key) => None,
                    Some(_) => Some(true),
                    None => Some(self.presence.holds(key)),
                }
            }
            None if self.presence.holds(key) => Some(true),
            None if self.listed_absent(key) => {
                bump(&self.counters.own.listed_absent, 1);
                Some(false)
            }
            None => None,
        }
    }

    /// Whether the object exists. With `cached`, a cached positive answer is trusted (for
    /// lookups); without, the backend is asked (for stores). A key a sweep is deleting is
    /// absent.
    pub(crate) async fn head(&self, key: &BlockKey, cached: bool) -> Result<bool> {
        if self.is_deleting(key) {
            return Ok(false);
        }
        if cached && self.presence.holds(key) {
            bump(&self.counters.own.exists_cache_hits, 1);
            return Ok(true);
        }
        if cached && self.listed_absent(key) {
            bump(&self.counters.own.listed_absent, 1);
            return Ok(false);
        }
        let path = self.path(key);
        let (indexed, sent) = (self.indexed_at(key), self.presence.stamp());
        match self.request_as(Kind::Probe, self.store.head(&path)).await {
            Ok(_) => {
                self.found_present(key, sent);
                Ok(true)
            }
            Err(ReqError::Store(object_store::Error::NotFound { .. })) => {
                self.found_missing(key, indexed);
                Ok(false)
            }
            Err(e) => Err(self.err(&format!("HEAD {path}"), e)),
        }
    }

    /// When `key` was last stored, confirmed or listed in the capacity index, if it is
    /// indexed: taken before a request whose "missing" may take it out
    /// ([`Shared::found_missing`]).
    pub(crate) fn indexed_at(&self, key: &BlockKey) -> Option<u64> {
        self.cap.as_ref().and_then(|c| c.lock().stored_at(key))
    }

    /// A request sent when `key` was indexed as `indexed` found no object: no read sent
    /// before it caches "present" (see the `presence` module), and the key leaves the
    /// capacity index, unless a store of it is in flight (whose count this is; under the
    /// claims' lock, so none starts meanwhile) or one stored it again since the request was
    /// sent (it may be there now).
    pub(crate) fn found_missing(&self, key: &BlockKey, indexed: Option<u64>) {
        self.presence.gone([key]);
        if let (Some(cap), Some(stored)) = (&self.cap, indexed) {
            let puts = lock(&self.puts);
            if !puts.contains_key(key) {
                cap.lock().remove_if_stored_at(key, stored);
            }
        }
    }

    /// A read sent at `sent` found `key`: cached present (see the `presence` module) unless
    /// a request found it missing since, and then known held in the capacity index if it is
    /// counted in doubt there.
    pub(crate) fn found_present(&self, key: &BlockKey, sent: crate::presence::Stamp) {
        if self.presence.present(key, sent)
            && let Some(cap) = &self.cap
        {
            cap.lock().doubt(key, crate::capacity::Doubt::Known);
        }
    }

    /// This tier wrote `key`, or the backend confirmed it to a store, with a request sent at
    /// `sent`: the listing holds it, and the existence cache too unless a request found it
    /// missing since (see the `presence` module): whether it does. A bounded tier counts it
    /// either way, in doubt if not cached.
    fn note_stored(&self, key: BlockKey, sent: crate::presence::Stamp) -> bool {
        self.listing_stored(key);
        let known = self.presence.present(&key, sent);
        if let Some(cap) = &self.cap {
            let mut idx = cap.lock();
            idx.insert(key, self.block_size as u64);
            if !known {
                idx.doubt(&key, crate::capacity::Doubt::Unknown);
            }
        }
        known
    }

    /// Waits until a sweep is not deleting `key`: at once if its DELETE is not sent yet (the
    /// store takes the victim back, see `CapIndex::take_back`), else until that DELETE ends.
    async fn wait_not_deleting(&self, key: &BlockKey) {
        let Some(cap) = &self.cap else { return };
        loop {
            let notified = cap.deleted.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut idx = cap.lock();
                if !idx.is_deleting(key) || idx.take_back(key, self.block_size as u64) {
                    return;
                }
            }
            notified.await;
        }
    }

    /// Waits until no other store of this tier uploads `key`, then claims it.
    async fn claim_put(&self, key: BlockKey) -> PutClaim<'_> {
        loop {
            let waiting = {
                let mut puts = lock(&self.puts);
                match puts.get(&key) {
                    // created under the lock: it sees the uploader's notify_waiters
                    Some(n) => n.clone().notified_owned(),
                    None => {
                        let notify = Arc::new(Notify::new());
                        puts.insert(key, notify.clone());
                        return PutClaim {
                            inner: self,
                            key,
                            notify,
                        };
                    }
                }
            };
            waiting.await;
        }
    }

    /// Stores one block: `Ok(true)` when this call created the object, `Ok(false)` when the
    /// backend confirmed it exists. Concurrent stores of one key in this tier upload once:
    /// the others wait for that upload, then have the backend confirm the object (or upload
    /// themselves if it failed). Each request within its deadline; cancellation-safe.
    pub(crate) async fn store_block(
        &self,
        key: BlockKey,
        src: BlockSource,
        published: &EventBatch,
        credit_deadline: tokio::time::Instant,
    ) -> Result<bool> {
        if src.len() != self.block_size {
            return Err(Error::WrongSize {
                key,
                got: src.len(),
                expected: self.block_size,
            });
        }
        let _claim = self.claim_put(key).await;
        let stored = match &self.coord {
            None => self.store_claimed(key, src).await,
            Some(coord) => {
                // credit first (journaled with the key); the guard journals the store's end,
                // however it ends (a cancelled or timed-out PUT: not known)
                let mut finish = coord
                    .credit_for(key, self.block_size as u64, &self.name, credit_deadline)
                    .await?;
                let stored = self.store_claimed(key, src).await;
                match &stored {
                    Ok(_) => finish.written(),
                    Err(Error::Timeout { .. }) => {}
                    Err(_) => finish.not_written(),
                }
                stored
            }
        };
        // written, or confirmed present: either way the tier holds it now (after a removal
        // of the key, this is what says it is back); logged before the claim goes, so a
        // damaged-object delete waiting for the claim logs its removal after
        if stored.is_ok() {
            published.add(key);
        }
        stored
    }

    /// [`Shared::store_block`] under the key's claim.
    async fn store_claimed(&self, key: BlockKey, src: BlockSource) -> Result<bool> {
        // the key is protected by this job: a sweep that chose it before may still be
        // deleting it; write only after that
        self.wait_not_deleting(&key).await;
        self.check_open()?;
        let path = self.path(&key);
        if self.presence.holds(&key) {
            // The cache may save the upload, never the confirmation: ask the backend.
            bump(&self.counters.own.exists_cache_hits, 1);
            match self.existing(&key, &path).await? {
                Existing::Usable(sent) => {
                    if let Some(skipped) = self.confirmed(key, sent) {
                        return Ok(skipped);
                    }
                }
                Existing::InTheWay => self.delete_corrupt(&key, &path, Kind::Write).await,
                Existing::Absent => {}
            }
        }
        let bytes = self.put_body(src);
        let mut attributes = Attributes::new();
        if self.checksum == ObjChecksum::Crc32c {
            let crc = block_crc(&key, &bytes);
            attributes.insert(
                Attribute::Metadata(CRC_METADATA_KEY.into()),
                AttributeValue::from(format!("{crc:08x}")),
            );
        }
        let mut replaced = false;
        let in_the_way = |path: &ObjPath| Error::Backend {
            tier: self.name.clone(),
            message: format!("an object without a valid checksum at {path} could not be replaced"),
            transient: true,
        };
        // (a confirmation a later 404 contradicts writes the block instead, a few times)
        let mut confirmations = 0;
        let mut contradicted = |path: &ObjPath| {
            confirmations += 1;
            (confirmations > MAX_CONTRADICTED).then(|| Error::Backend {
                tier: self.name.clone(),
                message: format!(
                    "{path} was found missing again and again while this store confirmed it"
                ),
                transient: true,
            })
        };
        loop {
            let create = self.create_only.load(Ordering::Relaxed);
            if !create {
                // No conditional writes here: look first (a race may still replace a block
                // with an identical one: blocks are content-addressed).
                match self.existing(&key, &path).await? {
                    Existing::Usable(sent) => match self.confirmed(key, sent) {
                        Some(skipped) => return Ok(skipped),
                        None => {
                            if let Some(e) = contradicted(&path) {
                                return Err(e);
                            }
                        }
                    },
                    Existing::InTheWay if std::mem::replace(&mut replaced, true) => {
                        return Err(in_the_way(&path));
                    }
                    Existing::InTheWay => {
                        self.delete_corrupt(&key, &path, Kind::Write).await;
                        continue;
                    }
                    Existing::Absent => {}
                }
            }
            let opts = PutOptions {
                mode: if create {
                    PutMode::Create
                } else {
                    PutMode::Overwrite
                },
                attributes: attributes.clone(),
                ..PutOptions::default()
            };
            // Counted toward the bound before the PUT, in doubt until it ends: if it is
            // cancelled or times out, the object may exist (and may still land), and
            // over-counting is the safe side of a bound (not known held, though: a lookup
            // asks). A PUT refused for good takes back only a count it added (an object
            // indexed before may well be there); one that failed in a way that may have
            // followed its landing (a transport error, a 5xx) stays counted, in doubt.
            let (added, earlier_unended) = self.cap.as_ref().map_or((false, false), |cap| {
                cap.lock().insert_before_write(key, self.block_size as u64)
            });
            let uncount = |key: &BlockKey| {
                if added {
                    self.uncount(key);
                }
            };
            let put = self
                .store
                .put_opts(&path, PutPayload::from(bytes.clone()), opts);
            let sent = self.presence.stamp();
            match self.request_as(Kind::Write, put).await {
                Ok(_) => {
                    self.note_stored(key, sent);
                    bump(&self.counters.blocks.blocks_written, 1);
                    bump(&self.counters.blocks.bytes_written, self.block_size as u64);
                    return Ok(true);
                }
                Err(ReqError::Store(
                    object_store::Error::AlreadyExists { .. }
                    | object_store::Error::Precondition { .. },
                )) => {
                    if self.existing_is_unverifiable(&key, &path).await? {
                        if std::mem::replace(&mut replaced, true) {
                            uncount(&key);
                            return Err(in_the_way(&path));
                        }
                        self.warn_in_the_way(&key);
                        self.delete_corrupt(&key, &path, Kind::Write).await;
                        continue;
                    }
                    match self.confirmed(key, sent) {
                        Some(skipped) => return Ok(skipped),
                        None => {
                            uncount(&key);
                            if let Some(e) = contradicted(&path) {
                                return Err(e);
                            }
                        }
                    }
                }
                Err(ReqError::Store(object_store::Error::NotImplemented { .. })) if create => {
                    uncount(&key);
                    tracing::warn!(tier = %self.name, "the store has no create-only writes; checking before writing instead");
                    self.create_only.store(false, Ordering::Relaxed);
                }
                Err(ReqError::Store(e @ object_store::Error::Generic { .. })) => {
                    if let Some(cap) = &self.cap {
                        // (an earlier write that timed out may still land: it stays so)
                        let doubt = if earlier_unended {
                            crate::capacity::Doubt::Unended
                        } else {
                            crate::capacity::Doubt::Unknown
                        };
                        cap.lock().ended_in_doubt(&key, doubt);
                    }
                    return Err(self.err(&format!("PUT {path}"), ReqError::Store(e)));
                }
                Err(e @ ReqError::Store(_)) => {
                    uncount(&key);
                    return Err(self.err(&format!("PUT {path}"), e));
                }
                Err(e @ ReqError::TimedOut) => return Err(self.err(&format!("PUT {path}"), e)),
            }
        }
    }

    /// The body of a PUT of `src`: a view of it or a copy, as the store needs
    /// ([`PutBody`]); a copy releases the source now.
    pub(crate) fn put_body(&self, src: BlockSource) -> Bytes {
        match self.put_body {
            PutBody::View => src.bytes(),
            PutBody::Copy => Bytes::copy_from_slice(src.as_slice()),
        }
    }

    /// The backend said the object exists, answering a request sent at `sent`: a skipped
    /// store (`Some(false)`), or `None` if a request found the key missing since (the
    /// answer may be stale: the store writes the block).
    fn confirmed(&self, key: BlockKey, sent: crate::presence::Stamp) -> Option<bool> {
        if !self.note_stored(key, sent) {
            return None;
        }
        bump(&self.counters.blocks.stores_skipped, 1);
        Some(false)
    }

    fn uncount(&self, key: &BlockKey) {
        if let Some(cap) = &self.cap {
            cap.lock().remove(key);
        }
    }

    /// Deletes a damaged object, reported removed first: the block is lost whether or not
    /// the DELETE ends (one that times out or is dropped may still have run). The caller
    /// holds the key's put claim (a store of this tier cannot write it meanwhile, so the
    /// DELETE cannot remove a copy a store just reported). The object leaves the bound's
    /// count only once the store confirms it gone; a read that overlapped the DELETE does not
    /// cache "present". The DELETE counts as `kind`: a store's as a write, a load's as a
    /// read (the load waits for it, and must not wait behind write-back).
    async fn delete_corrupt(&self, key: &BlockKey, path: &ObjPath, kind: Kind) {
        self.events.push(vec![*key], true);
        let _forget = self.forget_after(vec![*key]);
        // (however the DELETE ends short of confirmed, dropped included: the key is left
        // damaged, counted in doubt)
        let unsure = Damaged {
            inner: self,
            key: *key,
        };
        match self.request_as(kind, self.store.delete(path)).await {
            Ok(()) | Err(ReqError::Store(object_store::Error::NotFound { .. })) => {
                std::mem::forget(unsure);
                bump(&self.counters.blocks.corrupt_deleted, 1);
                self.uncount(key);
                lock(&self.damaged).remove(key);
            }
            Err(e) => {
                drop(unsure);
                let err = self.err(&format!("DELETE {path}"), e);
                tracing::warn!(tier = %self.name, %key, error = %err, "a damaged object could not be deleted; it stays counted, and the next load or sweep tries again");
            }
        }
    }

    /// A damaged object at `key` may still be there: the next store replaces it (at most
    /// [`MAX_DAMAGED`] keys are remembered), and a bounded tier counts it in doubt.
    pub(crate) fn left_damaged(&self, key: &BlockKey) {
        let mut damaged = lock(&self.damaged);
        if damaged.len() < MAX_DAMAGED {
            damaged.insert(*key);
        }
        drop(damaged);
        if let Some(cap) = &self.cap {
            cap.lock().doubt(key, crate::capacity::Doubt::Unknown);
        }
    }

    /// [`Shared::delete_corrupt`] from a load that found the object damaged: under the key's
    /// put claim, and only if the object is still the one the load read (its ETag, where the
    /// store gives one): a store may have replaced it meanwhile. When that cannot be told
    /// (the HEAD fails), it is left for the next load.
    pub(crate) async fn delete_damaged_loaded(
        &self,
        key: &BlockKey,
        path: &ObjPath,
        read: Option<&str>,
    ) {
        // (dropped before it knows, waiting for the claim or in the HEAD: left damaged)
        let unsure = Damaged {
            inner: self,
            key: *key,
        };
        let _claim = self.claim_put(*key).await;
        match self.request(self.store.head(path)).await {
            Ok(meta) if read.is_some() && meta.e_tag.as_deref() != read => {
                std::mem::forget(unsure);
                tracing::info!(tier = %self.name, %key, "a damaged object was replaced before its delete; the new one stays");
            }
            Ok(_) => {
                std::mem::forget(unsure); // (its delete has a guard of its own)
                self.delete_corrupt(key, path, Kind::Read).await;
            }
            Err(ReqError::Store(object_store::Error::NotFound { .. })) => {
                std::mem::forget(unsure);
                // gone meanwhile (a sweep, another process): it was reported if ours; under
                // the key's claim, no store of this tier counts it meanwhile
                self.presence.gone([key]);
                self.uncount(key);
            }
            Err(e) => {
                drop(unsure);
                let err = self.err(&format!("HEAD {path}"), e);
                tracing::warn!(tier = %self.name, %key, error = %err, "a damaged object is left for the next load: its HEAD failed");
            }
        }
    }
}
