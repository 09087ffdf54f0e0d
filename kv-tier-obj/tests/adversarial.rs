//! Adversarial tests of the bounded obj tier's promises (public API only), written by a
//! review that tried to break them; each failing case was a bug, fixed since:
//! 1. a key reported stored and not reported removed after that is found by `lookup`;
//! 2. after a removal, a later successful store is reported after it;
//! 3. nothing wedged, `stats().bytes` never below the bytes present under the prefix;
//! 4. futures droppable anywhere without leaving keys "being deleted".

mod common;

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{BS, ns, store, tier_on};
use futures::StreamExt;
use futures::stream::BoxStream;
use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_obj::{ObjChecksum, ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::{load_keys, test_key};
use object_store::ObjectStoreExt as _;
use object_store::path::Path;
use object_store::{
    GetOptions, GetResult, ListResult, MultipartUpload, ObjectMeta, ObjectStore,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

fn bounded(blocks: usize) -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.max_size_gb = Some((blocks * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = 0.5;
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    c.checksum = ObjChecksum::Crc32c;
    c
}

/// Bytes of block objects actually in the store.
async fn present_bytes(s: &dyn ObjectStore) -> u64 {
    let metas: Vec<ObjectMeta> = s.list(None).map(|m| m.unwrap()).collect().await;
    metas
        .iter()
        .filter(|m| m.location.as_ref().ends_with(".bin"))
        .map(|m| m.size)
        .sum()
}

/// Every event ever taken, in order: (key, removed).
#[derive(Default)]
struct History(Vec<(BlockKey, bool)>);

impl History {
    fn take(&mut self, t: &ObjTier) -> Vec<(BlockKey, bool)> {
        let mut new = Vec::new();
        for e in t.take_events() {
            for k in e.keys {
                new.push((k, e.removed));
            }
        }
        self.0.extend(new.iter().copied());
        new
    }
    fn last(&self, k: &BlockKey) -> Option<bool> {
        self.0.iter().rev().find(|(x, _)| x == k).map(|(_, r)| *r)
    }
}

/// Rewrites the object at `path` with one byte flipped, keeping its metadata (bit rot).
async fn rot(s: &ControlledStore, path: &str) {
    let p = Path::from(path);
    let got = s.inner.get(&p).await.unwrap();
    let attributes = got.attributes.clone();
    let mut body = got.bytes().await.unwrap().to_vec();
    body[7] ^= 0xff;
    let opts = PutOptions {
        attributes,
        ..PutOptions::default()
    };
    s.inner
        .put_opts(&p, PutPayload::from(body), opts)
        .await
        .unwrap();
}

/// Whether `lookup` finds `k`, its positive-answer cache forgotten first (as its TTL would).
async fn found(t: &ObjTier, k: BlockKey) -> bool {
    t.clear_exists_cache();
    t.lookup(&[k]).await.unwrap()[0]
}

async fn wait_sweeps_done(t: &ObjTier) {
    for _ in 0..1_000 {
        if t.sweeps_running() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("sweeps never ended");
}

// ---------------------------------------------------------------------------------------
// A store wrapper with faults ControlledStore has no knob for.

struct Faulty {
    inner: Arc<ControlledStore>,
    /// PUTs fail with a transient server error (a 503).
    fail_puts: AtomicBool,
    /// A DELETE of a missing object answers NotFound naming another path (as a local
    /// filesystem store names the file, or a prefixing wrapper the prefixed path).
    not_found_elsewhere: Arc<AtomicBool>,
}

impl Faulty {
    fn new(inner: Arc<ControlledStore>) -> Self {
        Self {
            inner,
            fail_puts: AtomicBool::new(false),
            not_found_elsewhere: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl fmt::Debug for Faulty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Faulty")
    }
}
impl fmt::Display for Faulty {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Faulty")
    }
}

#[async_trait::async_trait]
impl ObjectStore for Faulty {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        if self.fail_puts.load(Ordering::SeqCst) {
            return Err(object_store::Error::Generic {
                store: "Faulty",
                source: "503 SlowDown".into(),
            });
        }
        self.inner.put_opts(location, payload, opts).await
    }
    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }
    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        self.inner.get_opts(location, options).await
    }
    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        let (inner, elsewhere) = (self.inner.clone(), self.not_found_elsewhere.clone());
        locations
            .map(move |location| {
                let (inner, elsewhere) = (inner.clone(), elsewhere.clone());
                async move {
                    let location = location?;
                    if elsewhere.load(Ordering::SeqCst)
                        && inner.inner.head(&location).await.is_err()
                    {
                        return Err(object_store::Error::NotFound {
                            path: format!("/var/lib/objects/{location}"),
                            source: "No such file or directory".into(),
                        });
                    }
                    inner.delete(&location).await.map(|()| location)
                }
            })
            .buffered(10)
            .boxed()
    }
    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }
    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }
    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: object_store::CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

async fn faulty_tier(f: &Arc<Faulty>, cfg: ObjTierConfig) -> Arc<ObjTier> {
    Arc::new(
        ObjTier::with_store("obj", f.clone(), cfg, ns(), BS)
            .await
            .unwrap(),
    )
}

// ---------------------------------------------------------------------------------------
// A: a load of a damaged object deletes it; a store of the same key meanwhile.

/// A load finds `k` damaged (bit rot: checksum mismatch) and deletes it; its DELETE is in
/// flight when a store of `k` arrives. The store reports `k` ok (after the removal was
/// taken), then the load's DELETE lands: the key is reported stored, never removed after,
/// and gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a1_store_during_a_damaged_loads_delete_is_not_lost() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let mut h = History::default();
    let k = test_key(1);
    assert!(store(&tier, &[k]).await.is_success());
    h.take(&tier);
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let deletes = s.hold_path(Op::Delete, &path);
    let t2 = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t2, &[k], BS).await.0 });
    deletes.wait_arrived(1).await;
    let ev = h.take(&tier);
    assert_eq!(
        ev,
        vec![(k, true)],
        "the damaged object is reported removed first"
    );
    // a store of k now: it waits for the delete (the load holds k's claim), then writes k,
    // reported after the removal
    let t3 = tier.clone();
    let storing = tokio::spawn(async move { store(&t3, &[k]).await });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert!(
        !storing.is_finished(),
        "the store did not wait for the delete"
    );
    s.release(Op::Delete);
    let lres = loading.await.unwrap();
    assert!(matches!(lres.failed[0].1, Error::Corrupt { .. }));
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    let after = h.take(&tier);
    assert_eq!(after, vec![(k, false)], "stored again, after the removal");
    let cached = tier.lookup(&[k]).await.unwrap()[0];
    assert!(
        found(&tier, k).await,
        "stored (job ok after the removal event), never reported removed after, and gone (lookup from the cache: {cached}); events {:?}; object exists: {}",
        h.0,
        s.exists(&path).await
    );
}

/// A store job of [k, slow] wrote k (reported stored as it landed, not at the job's end); a
/// load of k meanwhile finds it damaged (bit rot) and deletes it (removal event now). The
/// job then ends: the last word for k is the removal, and k is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a2_stored_event_of_a_job_after_a_damaged_load_removed_the_key() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let mut h = History::default();
    let (k, slow) = (test_key(1), test_key(2));
    let puts = s.hold_path(Op::Put, &tier.object_path(&slow));
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { store(&t2, &[k, slow]).await });
    puts.wait_arrived(1).await;
    for _ in 0..1000 {
        if s.exists(&tier.object_path(&k)).await {
            break;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert!(s.exists(&tier.object_path(&k)).await);
    rot(&s, &tier.object_path(&k)).await;
    let (lres, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(lres.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        lres.failed
    );
    assert_eq!(
        h.take(&tier),
        vec![(k, false), (k, true)],
        "in the order they happened"
    );
    s.release(Op::Put);
    let res = storing.await.unwrap();
    assert!(res.is_success(), "{:?}", res.failed);
    h.take(&tier);
    let last = h.last(&k);
    let found = found(&tier, k).await;
    assert!(
        last != Some(false) || found,
        "last event for k is 'stored' but lookup says absent; events {:?}; object exists: {}",
        h.0,
        s.exists(&tier.object_path(&k)).await
    );
}

// ---------------------------------------------------------------------------------------
// B: sweep DELETEs that never run (held past the deadline), then the keys stored again.

/// A sweep's DELETEs time out without running: the victims were reported removed and are
/// still there. A store of one succeeds (confirmed, not rewritten): the last word of the
/// event stream must not stay "removed".
#[tokio::test(start_paused = true)]
async fn b1_store_after_a_timed_out_sweep_delete_is_reported_after_the_removal() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(4)).await;
    let mut h = History::default();
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(store(&tier, &[*k]).await.is_success());
    }
    s.hold(Op::Delete);
    assert!(store(&tier, &keys[4..]).await.is_success()); // over: a sweep starts
    wait_sweeps_done(&tier).await; // its DELETEs time out
    s.release(Op::Delete);
    let ev = h.take(&tier);
    let k = keys[0];
    assert!(ev.contains(&(k, true)), "{ev:?}");
    let res = store(&tier, &[k]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    let found = found(&tier, k).await;
    assert_eq!(
        h.last(&k),
        Some(false),
        "the store of k succeeded after its removal, yet the last event for k is a removal (lookup: {found}); events {:?}",
        h.0
    );
}

/// Same, with the replies of the DELETEs lost (they ran): the victims are gone, counted,
/// and a store writes them again.
#[tokio::test(start_paused = true)]
async fn b2_lost_delete_replies_then_restore() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(4)).await;
    let mut h = History::default();
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(store(&tier, &[*k]).await.is_success());
    }
    s.delay_replies(Op::Delete, Duration::from_secs(100));
    assert!(store(&tier, &keys[4..]).await.is_success());
    wait_sweeps_done(&tier).await;
    s.release_all();
    h.take(&tier);
    assert!(tier.stats().bytes >= present_bytes(&s.inner).await);
    for k in &keys {
        let res = store(&tier, &[*k]).await;
        assert!(res.is_success(), "{:?}", res.failed);
        h.take(&tier);
        assert!(tier.stats().bytes >= present_bytes(&s.inner).await);
    }
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    for k in &keys {
        if h.last(k) == Some(false) {
            assert!(found(&tier, *k).await, "{k}");
        }
    }
    assert!(tier.stats().bytes >= present_bytes(&s.inner).await);
}

// ---------------------------------------------------------------------------------------
// C: the bound's count under faults.

/// A load deletes a damaged object, the DELETE times out without running: the object is
/// still there, and must stay counted.
#[tokio::test(start_paused = true)]
async fn c1_damaged_objects_whose_delete_failed_stay_counted() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(64)).await;
    let keys: Vec<_> = (0..8).map(test_key).collect();
    assert!(store(&tier, &keys).await.is_success());
    for k in &keys {
        rot(&s, &tier.object_path(k)).await;
    }
    s.hold(Op::Delete);
    let (res, _) = load_keys(&*tier, &keys, BS).await;
    assert_eq!(res.failed.len(), 8);
    s.release(Op::Delete);
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner).await);
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present"
    );
}

/// A store of a key already there (and counted) whose PUT fails with a server error (a
/// 503) uncounts the key, whose object is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_a_failed_put_of_a_present_key_keeps_it_counted() {
    let s = Arc::new(ControlledStore::new());
    let f = Arc::new(Faulty::new(s.clone()));
    let tier = faulty_tier(&f, bounded(64)).await;
    let keys: Vec<_> = (0..8).map(test_key).collect();
    assert!(store(&tier, &keys).await.is_success());
    tier.clear_exists_cache(); // or its TTL passed
    f.fail_puts.store(true, Ordering::SeqCst);
    let res = store(&tier, &keys).await;
    f.fail_puts.store(false, Ordering::SeqCst);
    eprintln!(
        "second store: ok {} failed {}",
        res.ok.len(),
        res.failed.len()
    );
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner).await);
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present"
    );
}

/// A load of `k` while its store's PUT is in flight: the GET finds nothing and the load
/// uncounts `k`; then the PUT lands. The object is there, uncounted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_a_load_missing_a_key_being_stored_does_not_uncount_it() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    let puts = s.hold(Op::Put);
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { store(&t2, &[k]).await });
    puts.wait_arrived(1).await;
    let (lres, _) = load_keys(&*tier, &[k], BS).await;
    assert!(matches!(lres.failed[0].1, Error::NotFound { .. }));
    s.release(Op::Put);
    assert!(storing.await.unwrap().is_success());
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner).await);
    assert!(
        counted >= present,
        "under-count: stats().bytes {counted} < {present} bytes present"
    );
}

// ---------------------------------------------------------------------------------------
// E: cancellation.

/// `sweep_now` dropped while its DELETEs are held; then stores of the victims must not hang,
/// keys never reported removed stay found, and the count stays on the safe side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e1_dropped_sweep_now_leaves_nothing_wedged() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(16);
    c.request_timeout_s = 10.0;
    let tier = tier_on(&s, c).await;
    let mut h = History::default();
    let keys: Vec<_> = (0..16).map(test_key).collect();
    for k in &keys {
        assert!(store(&tier, &[*k]).await.is_success());
    }
    let deletes = s.hold(Op::Delete);
    // over the cap: the store spawns a sweep; sweep_now waits for it
    let extra = test_key(100);
    assert!(store(&tier, &[extra]).await.is_success());
    deletes.wait_arrived(1).await;
    let r = tokio::time::timeout(Duration::from_millis(50), tier.sweep_now()).await;
    assert!(r.is_err());
    // the background sweep is stuck on its DELETEs; stores of its victims wait for it; drop
    // some of those stores midway as well
    let victims: Vec<BlockKey> = h
        .take(&tier)
        .into_iter()
        .filter(|(_, r)| *r)
        .map(|(k, _)| k)
        .collect();
    assert!(!victims.is_empty());
    let r = tokio::time::timeout(Duration::from_millis(50), store(&tier, &victims[..1])).await;
    assert!(
        r.is_err(),
        "the store of a victim did not wait for its delete"
    );
    // shut the background sweep down? no: release the deletes instead
    s.release(Op::Delete);
    wait_sweeps_done(&tier).await;
    for k in keys.iter().chain([&extra]) {
        let r = tokio::time::timeout(Duration::from_secs(5), store(&tier, &[*k])).await;
        let r = r.unwrap_or_else(|_| panic!("store of {k} wedged"));
        assert!(r.is_success(), "{:?}", r.failed);
    }
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    for k in keys.iter().chain([&extra]) {
        if h.last(k) != Some(true) {
            assert!(found(&tier, *k).await, "{k} lost");
        }
    }
    assert!(tier.stats().bytes >= present_bytes(&s.inner).await);
}

/// Shutdown while a sweep's DELETEs are held (short deadline, paused clock).
#[tokio::test(start_paused = true)]
async fn e2_shutdown_mid_sweep() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(4)).await;
    let mut h = History::default();
    let keys: Vec<_> = (0..6).map(test_key).collect();
    for k in &keys {
        assert!(store(&tier, &[*k]).await.is_success());
    }
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    s.hold(Op::Delete);
    for i in 6..9 {
        assert!(store(&tier, &[test_key(i)]).await.is_success());
    }
    tier.shutdown().await.unwrap();
    s.release(Op::Delete);
    h.take(&tier);
    assert!(tier.stats().bytes >= present_bytes(&s.inner).await);
    // reopen over the same store: keys not reported removed are there
    let t2 = tier_on(&s, bounded(4)).await;
    for i in 0..9 {
        let k = test_key(i);
        if h.last(&k) != Some(true) {
            assert!(found(&t2, k).await, "{i} lost");
        }
    }
    assert!(t2.stats().bytes >= present_bytes(&s.inner).await);
}

// ---------------------------------------------------------------------------------------
// F: real concurrency: stores, loads, lookups and sweeps with slow deletes.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_concurrent_stores_during_sweeps() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(16);
    c.request_timeout_s = 0.05; // deadline 1.05 s: lost DELETE replies time out
    c.io_threads = 8;
    let tier = tier_on(&s, c).await;
    s.delay(Op::Delete, Duration::from_millis(20));
    let mut h = History::default();
    let results = Arc::new(std::sync::Mutex::new(Vec::new()));
    for round in 0..6u64 {
        if round % 2 == 1 {
            s.delay_replies(Op::Delete, Duration::from_millis(1200));
        } else {
            s.release_all();
            s.delay(Op::Delete, Duration::from_millis(20));
        }
        let mut tasks = Vec::new();
        for w in 0..4u64 {
            let t = tier.clone();
            let results = results.clone();
            tasks.push(tokio::spawn(async move {
                for j in 0..12u64 {
                    let k = test_key((w * 7 + j * 3 + round) % 40);
                    let r = store(&t, &[k]).await;
                    results.lock().unwrap().push((k, r.is_success()));
                    if j % 4 == 0 {
                        let _ = tokio::time::timeout(Duration::from_millis(5), t.sweep_now()).await;
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    }
    s.release_all();
    wait_sweeps_done(&tier).await;
    h.take(&tier);
    let mut bad = Vec::new();
    let mut last: HashMap<BlockKey, bool> = HashMap::new();
    for (k, r) in &h.0 {
        last.insert(*k, *r);
    }
    for (k, removed) in &last {
        if !removed && !found(&tier, *k).await {
            bad.push(*k);
        }
    }
    let mut removed_but_present = 0;
    for (k, removed) in &last {
        if *removed && s.exists(&tier.object_path(k)).await {
            removed_but_present += 1;
        }
    }
    eprintln!(
        "f1: {} keys whose last event is 'removed' are present",
        removed_but_present
    );
    let st = tier.stats();
    eprintln!(
        "f1: sweeps {} evicted {} request_timeouts {} removal events {}",
        st.sweeps,
        st.evicted,
        st.request_timeouts,
        h.0.iter().filter(|e| e.1).count()
    );
    assert!(bad.is_empty(), "last event 'stored' but absent: {bad:?}");
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner).await);
    assert!(counted >= present, "{counted} < {present}");
    // nothing wedged
    for i in 0..40 {
        let r = tokio::time::timeout(Duration::from_secs(5), store(&tier, &[test_key(i)]))
            .await
            .expect("wedged");
        assert!(r.is_success(), "{:?}", r.failed);
    }
}

// ---------------------------------------------------------------------------------------
// G: the exists cache around a damaged load's delete.

/// A lookup while a damaged load's DELETE is in flight caches "present"; once the DELETE
/// lands the key (reported removed, not stored since) is still answered present. (The sweep
/// guards against this with a second epoch bump after its delete; the damaged-load delete
/// bumps only before.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn g1_lookup_after_a_damaged_loads_delete_answers_absent() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let mut h = History::default();
    let k = test_key(1);
    assert!(store(&tier, &[k]).await.is_success());
    let path = tier.object_path(&k);
    rot(&s, &path).await;
    let deletes = s.hold_path(Op::Delete, &path);
    let t2 = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t2, &[k], BS).await.0 });
    deletes.wait_arrived(1).await;
    let during = tier.lookup(&[k]).await.unwrap()[0]; // HEAD: still there
    s.release(Op::Delete);
    loading.await.unwrap();
    h.take(&tier);
    assert_eq!(h.last(&k), Some(true));
    assert!(!s.exists(&path).await);
    let after = tier.lookup(&[k]).await.unwrap()[0];
    assert!(
        !after,
        "removed, gone, and still answered present (during the delete: {during})"
    );
}

/// A GET whose body arrives cut short, from an object of the block's size: the transfer
/// failed, not the object. The load fails (transient), and the object stays, found and
/// loadable once the transfer works.
#[tokio::test]
async fn a_body_cut_short_is_a_failed_transfer_not_damage() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(64)).await;
    let mut h = History::default();
    let k = test_key(1);
    assert!(store(&tier, &[k]).await.is_success());
    h.take(&tier);
    s.cut_gets(1);
    let (res, _) = load_keys(&*tier, &[k], BS).await;
    s.cut_gets(0);
    match &res.failed[..] {
        [
            (
                key,
                Error::Backend {
                    transient: true,
                    message,
                    ..
                },
            ),
        ] => {
            assert_eq!(*key, k);
            assert!(message.contains("ended after"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(
        s.exists(&tier.object_path(&k)).await,
        "an intact object was deleted"
    );
    assert!(h.take(&tier).is_empty(), "nothing was removed");
    let (res, data) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success() && kv_tier_testkit::verify_block(&k, 0, &data[0].1));
}

/// A sweep's victim already gone answers NotFound naming another path (a local store names
/// the file): it is confirmed gone all the same (answers match victims by position), and
/// leaves the count; before, it went back to the index for good and every later sweep
/// deleted a live object in its place.
#[tokio::test]
async fn a_victim_gone_before_its_delete_leaves_the_count_whatever_path_its_answer_names() {
    let s = Arc::new(ControlledStore::new());
    let f = Arc::new(Faulty::new(s.clone()));
    let tier = faulty_tier(&f, bounded(4)).await;
    let keys: Vec<_> = (0..5).map(test_key).collect();
    for k in &keys[..4] {
        assert!(store(&tier, &[*k]).await.is_success());
    }
    // the two oldest vanish behind the tier's back
    for k in &keys[..2] {
        s.inner
            .delete(&Path::from(tier.object_path(k)))
            .await
            .unwrap();
    }
    f.not_found_elsewhere.store(true, Ordering::SeqCst);
    assert!(store(&tier, &keys[4..]).await.is_success()); // over: a sweep
    wait_sweeps_done(&tier).await;
    assert_eq!(tier.sweep_now().await, 0, "within the bound now");
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner).await);
    assert_eq!(
        counted, present,
        "the vanished objects are still counted ({counted} counted, {present} present)"
    );
    // down to the low watermark (2 of the 5 counted): the 2 vanished ones and the oldest live
    // one went; the newer live ones stay
    for k in &keys[3..] {
        assert!(
            found(&tier, *k).await,
            "a live object was swept for phantom bytes"
        );
    }
}

/// A load's GET answers NotFound late; meanwhile a store of the key counted and wrote it.
/// The late NotFound must not take back the store's count (the object is there).
#[tokio::test(start_paused = true)]
async fn a_late_not_found_does_not_uncount_a_key_stored_meanwhile() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(64)).await;
    let k = test_key(1);
    assert!(store(&tier, &[k]).await.is_success());
    s.inner
        .delete(&Path::from(tier.object_path(&k)))
        .await
        .unwrap();
    s.delay_replies(Op::Get, Duration::from_millis(500));
    let t2 = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t2, &[k], BS).await.0 });
    tokio::time::sleep(Duration::from_millis(100)).await; // the GET ran: NotFound, late
    s.delay_replies(Op::Get, Duration::ZERO);
    assert!(store(&tier, &[k]).await.is_success()); // writes it again
    let lres = loading.await.unwrap();
    assert!(
        matches!(lres.failed[0].1, Error::NotFound { .. }),
        "{:?}",
        lres.failed
    );
    let (counted, present) = (tier.stats().bytes, present_bytes(&s.inner).await);
    assert!(
        counted >= present,
        "under-count: {counted} counted, {present} present"
    );
}

/// A load finds an object damaged (no checksum: in the way) while a store of the key is
/// replacing it; the load's delete, which waits for the store's claim, must not delete the
/// new object (it checks the object is still the one it read).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_objects_delete_spares_the_object_a_store_put_in_its_place() {
    let s = Arc::new(ControlledStore::new());
    let mut c = bounded(64);
    c.request_timeout_s = 5.0;
    let tier = tier_on(&s, c).await;
    let k = test_key(1);
    let path = tier.object_path(&k);
    // an object without a checksum at k's path: a load refuses it, a store replaces it
    s.inner
        .put(&Path::from(path.clone()), PutPayload::from(vec![7u8; BS]))
        .await
        .unwrap();
    let deletes = s.hold_path(Op::Delete, &path);
    let t2 = tier.clone();
    let storing = tokio::spawn(async move { store(&t2, &[k]).await });
    deletes.wait_arrived(1).await; // the store, holding k's claim, deletes the old object
    let t3 = tier.clone();
    let loading = tokio::spawn(async move { load_keys(&*t3, &[k], BS).await.0 });
    // the load read the old object, refused it, and waits for the claim (polled, bounded)
    let patience = Instant::now() + Duration::from_secs(60);
    while tier.stats().blocks.unverified_refused != 1 && Instant::now() < patience {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert_eq!(tier.stats().blocks.unverified_refused, 1);
    s.release(Op::Delete);
    assert!(storing.await.unwrap().is_success());
    let lres = loading.await.unwrap();
    assert!(
        matches!(lres.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        lres.failed
    );
    assert!(
        s.exists(&path).await,
        "the load deleted the store's new object"
    );
    let (res, data) = load_keys(&*tier, &[k], BS).await;
    assert!(res.is_success() && kv_tier_testkit::verify_block(&k, 0, &data[0].1));
}

/// The count follows what is there exactly where the tier knows: a damaged object it
/// deleted leaves it, and so does a new key whose PUT failed (nothing was written).
#[tokio::test]
async fn a_deleted_damaged_object_and_a_failed_new_put_leave_the_count() {
    let s = Arc::new(ControlledStore::new());
    let f = Arc::new(Faulty::new(s.clone()));
    let tier = faulty_tier(&f, bounded(64)).await;
    let (k, fresh) = (test_key(1), test_key(2));
    assert!(store(&tier, &[k]).await.is_success());
    assert_eq!((tier.stats().objects, tier.stats().bytes), (1, BS as u64));
    rot(&s, &tier.object_path(&k)).await;
    let (res, _) = load_keys(&*tier, &[k], BS).await;
    assert!(
        matches!(res.failed[0].1, Error::Corrupt { .. }),
        "{:?}",
        res.failed
    );
    assert!(!s.exists(&tier.object_path(&k)).await);
    assert_eq!(
        (tier.stats().objects, tier.stats().bytes),
        (0, 0),
        "a deleted object is still counted"
    );
    f.fail_puts.store(true, Ordering::SeqCst);
    assert!(!store(&tier, &[fresh]).await.is_success());
    f.fail_puts.store(false, Ordering::SeqCst);
    assert_eq!(
        (tier.stats().objects, tier.stats().bytes),
        (0, 0),
        "a PUT that failed left a count"
    );
}
