//! Adversarial tests of one `ObjTier` (not the shared-bucket mode), public API only: integrity,
//! deadlines, cancellation, capacity, lookups behind the tier's back, shutdown, errors, and
//! the S3 client against a real S3-protocol server behind a misbehaving TCP proxy.

mod common;

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{BS, S3Server, S3ServerExt as _, ns, tier_on};
use futures::StreamExt;
use futures::stream::BoxStream;
use kv_tier_core::{BlockKey, Error, JobResult, LoadJob, SecondaryTier, StoreJob};
use kv_tier_obj::{CRC_METADATA_KEY, ObjChecksum, ObjTier, ObjTierConfig, block_crc};
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::{block_bytes, load_keys, source_for, store_keys, test_key, verify_block};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    Attribute, Attributes, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload,
    ObjectMeta, ObjectStore, ObjectStoreExt as _, PutMultipartOptions, PutOptions, PutPayload,
    PutResult,
};

async fn store(t: &dyn SecondaryTier, keys: &[BlockKey]) -> JobResult {
    store_keys(t, keys, 0, BS).await
}

fn crc_attrs(v: &str) -> Attributes {
    let mut a = Attributes::new();
    a.insert(
        Attribute::Metadata(CRC_METADATA_KEY.into()),
        v.to_string().into(),
    );
    a
}

async fn put_raw(s: &dyn ObjectStore, path: &str, body: Vec<u8>, crc: Option<&str>) {
    let opts = PutOptions {
        attributes: crc.map(crc_attrs).unwrap_or_default(),
        ..PutOptions::default()
    };
    s.put_opts(&Path::from(path), PutPayload::from(body), opts)
        .await
        .unwrap();
}

async fn exists(s: &dyn ObjectStore, path: &str) -> bool {
    s.head(&Path::from(path)).await.is_ok()
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

fn checked() -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.checksum = ObjChecksum::Crc32c;
    c.request_timeout_s = 0.5;
    c.max_retries = 0;
    c
}

fn bounded(blocks: usize, low: f64) -> ObjTierConfig {
    let mut c = checked();
    c.max_size_gb = Some((blocks * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = low;
    c.request_timeout_s = 2.0;
    c
}

async fn wait_sweeps_done(t: &ObjTier) {
    for _ in 0..2_000 {
        if t.sweeps_running() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("sweeps never ended");
}

fn names(e: &Error, t: &ObjTier, k: &BlockKey) -> bool {
    let s = e.to_string();
    s.contains(&t.object_path(k)) || s.contains(&k.to_string()) || s.contains(&k.hash_hex())
}

// ---------------------------------------------------------------------------------------
// A store wrapper with faults the testkit has no knob for.

#[derive(Default)]
struct Knobs {
    /// GETs of this path yield half the body, then never end.
    hang_body: Option<String>,
    /// GETs of this path yield half the body, then an error.
    err_body: Option<String>,
    /// GETs of this path yield the body plus this many extra bytes (metadata unchanged).
    extra_body: Option<(String, usize)>,
    /// PUTs land, then answer a transient error (the reply lost).
    put_lands_then_fails: bool,
    /// PUTs leave the first half of their body without metadata, then fail (a store whose
    /// writes are not atomic).
    put_half_then_fails: bool,
}

struct Evil {
    inner: InMemory,
    knobs: Mutex<Knobs>,
    puts: AtomicUsize,
}

impl Evil {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            inner: InMemory::new(),
            knobs: Mutex::default(),
            puts: AtomicUsize::new(0),
        })
    }
    fn set(&self, f: impl FnOnce(&mut Knobs)) {
        f(&mut self.knobs.lock().unwrap());
    }
}

impl fmt::Debug for Evil {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Evil")
    }
}
impl fmt::Display for Evil {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Evil")
    }
}

fn transient(what: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "Evil",
        source: what.to_string().into(),
    }
}

#[async_trait::async_trait]
impl ObjectStore for Evil {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.puts.fetch_add(1, Ordering::SeqCst);
        let (lands, half) = {
            let k = self.knobs.lock().unwrap();
            (k.put_lands_then_fails, k.put_half_then_fails)
        };
        if half {
            let body: Vec<u8> = payload.iter().flat_map(|b| b.iter().copied()).collect();
            let half = body[..body.len() / 2].to_vec();
            self.inner.put(location, PutPayload::from(half)).await?;
            return Err(transient("connection reset by peer mid-body"));
        }
        let r = self.inner.put_opts(location, payload, opts).await;
        if lands && r.is_ok() {
            return Err(transient("connection reset by peer (reply lost)"));
        }
        r
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
        let head = options.head;
        let got = self.inner.get_opts(location, options).await?;
        if head {
            return Ok(got);
        }
        let (hang, err, extra) = {
            let k = self.knobs.lock().unwrap();
            let p = location.as_ref();
            (
                k.hang_body.as_deref() == Some(p),
                k.err_body.as_deref() == Some(p),
                k.extra_body
                    .as_ref()
                    .filter(|(q, _)| q == p)
                    .map(|(_, n)| *n),
            )
        };
        if !hang && !err && extra.is_none() {
            return Ok(got);
        }
        let (meta, range, attributes, extensions) = (
            got.meta.clone(),
            got.range.clone(),
            got.attributes.clone(),
            got.extensions.clone(),
        );
        let body = got.bytes().await?;
        let stream: BoxStream<'static, object_store::Result<bytes::Bytes>> = if hang {
            futures::stream::iter(vec![Ok(body.slice(..body.len() / 2))])
                .chain(futures::stream::pending())
                .boxed()
        } else if err {
            futures::stream::iter(vec![
                Ok(body.slice(..body.len() / 2)),
                Err(transient("body broke")),
            ])
            .boxed()
        } else {
            let mut v = body.to_vec();
            v.extend(std::iter::repeat_n(0xAB, extra.unwrap()));
            futures::stream::iter(vec![Ok(bytes::Bytes::from(v))]).boxed()
        };
        Ok(GetResult {
            payload: GetResultPayload::Stream(stream),
            meta,
            range,
            attributes,
            extensions,
        })
    }
    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        self.inner.delete_stream(locations)
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

async fn evil_tier(e: &Arc<Evil>, cfg: ObjTierConfig) -> Arc<ObjTier> {
    Arc::new(
        ObjTier::with_store("obj", e.clone(), cfg, ns(), BS)
            .await
            .unwrap(),
    )
}

// ---------------------------------------------------------------------------------------
// Integrity

/// A GET whose body stops half way and never ends: that key fails within the request
/// deadline, the other key of the job loads, and the key loads once the body flows again.
#[tokio::test(start_paused = true)]
async fn t01_a_get_body_that_hangs_half_way_fails_alone_within_the_deadline() {
    let e = Evil::new();
    let cfg = checked();
    let deadline = {
        let c = cfg.clone();
        c.validate().unwrap();
        c.request_deadline()
    };
    let tier = evil_tier(&e, cfg).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(store(&*tier, &[a, b]).await.is_success());
    e.set(|k| k.hang_body = Some(tier.object_path(&b)));
    let t0 = tokio::time::Instant::now();
    let (res, data) = load_keys(&*tier, &[a, b], BS).await;
    let took = t0.elapsed();
    assert!(
        took <= deadline + Duration::from_millis(100),
        "load took {took:?}, deadline {deadline:?}"
    );
    assert_eq!(res.ok, vec![a], "failed: {:?}", res.failed);
    assert_eq!(res.failed_keys(), vec![b]);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    let err = &res.failed[0].1;
    assert!(names(err, &tier, &b), "error does not name the key: {err}");
    e.set(|k| k.hang_body = None);
    let (res, data) = load_keys(&*tier, &[b], BS).await;
    assert!(
        res.is_success(),
        "nothing should be wedged: {:?}",
        res.failed
    );
    assert!(verify_block(&b, 0, &data[0].1));
}

/// A GET body that errors half way is a failed key, never served.
#[tokio::test(start_paused = true)]
async fn t02_a_get_body_that_breaks_is_a_failure_and_never_served() {
    let e = Evil::new();
    let tier = evil_tier(&e, checked()).await;
    let a = test_key(1);
    assert!(store(&*tier, &[a]).await.is_success());
    e.set(|k| k.err_body = Some(tier.object_path(&a)));
    let (res, data) = load_keys(&*tier, &[a], BS).await;
    assert!(data.is_empty() && res.failed_keys() == vec![a], "{res:?}");
    e.set(|k| k.err_body = None);
    let (res, data) = load_keys(&*tier, &[a], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(verify_block(&a, 0, &data[0].1));
}

/// A GET body longer than the block (the metadata says whole): never served.
#[tokio::test(start_paused = true)]
async fn t03_a_body_longer_than_its_metadata_is_never_served() {
    for checksum in [ObjChecksum::None, ObjChecksum::Crc32c] {
        let e = Evil::new();
        let mut cfg = checked();
        cfg.checksum = checksum;
        let tier = evil_tier(&e, cfg).await;
        let a = test_key(1);
        assert!(store(&*tier, &[a]).await.is_success());
        e.set(|k| k.extra_body = Some((tier.object_path(&a), 7)));
        let (res, data) = load_keys(&*tier, &[a], BS).await;
        assert!(
            data.is_empty() && res.failed_keys() == vec![a],
            "checksum {checksum:?}: a body with 7 extra bytes was served: {res:?}"
        );
    }
}

/// Objects of the wrong size at a key's path: misses, with or without checksums, and with a
/// checksum computed over the whole (wrong-sized) body too.
#[tokio::test(start_paused = true)]
async fn t04_objects_of_the_wrong_size_are_misses() {
    for checksum in [ObjChecksum::None, ObjChecksum::Crc32c] {
        let s = Arc::new(InMemory::new());
        let mut cfg = checked();
        cfg.checksum = checksum;
        let tier = ObjTier::with_store("obj", s.clone(), cfg, ns(), BS)
            .await
            .unwrap();
        let cases: Vec<(BlockKey, usize)> = vec![
            (test_key(1), BS + 1),
            (test_key(2), BS - 1),
            (test_key(3), 0),
            (test_key(4), 2 * BS),
        ];
        for (k, len) in &cases {
            let mut body = block_bytes(k, 0, BS);
            body.resize(*len, 0x5a);
            let crc = format!("{:08x}", block_crc(k, &body));
            put_raw(&*s, &tier.object_path(k), body, Some(&crc)).await;
        }
        let keys: Vec<_> = cases.iter().map(|(k, _)| *k).collect();
        let (res, data) = load_keys(&tier, &keys, BS).await;
        assert!(
            data.is_empty(),
            "checksum {checksum:?}: wrong-sized objects served: {:?}",
            data.iter().map(|(k, _)| *k).collect::<Vec<_>>()
        );
        assert_eq!(res.failed.len(), keys.len());
    }
}

/// Malformed checksum metadata whose value does not match: refused, even with
/// `accept_unverified` ("A malformed or mismatching checksum is refused either way"), and
/// the object deleted.
#[tokio::test(start_paused = true)]
async fn t05_malformed_checksums_are_refused_and_deleted_even_accepting_unverified() {
    for accept in [false, true] {
        let s = Arc::new(InMemory::new());
        let mut cfg = checked();
        cfg.accept_unverified = accept;
        let tier = ObjTier::with_store("obj", s.clone(), cfg, ns(), BS)
            .await
            .unwrap();
        let bad = [
            "zzzzzzzz",
            "1234567",
            "123456789",
            "-1",
            "0x",
            "ffffffffff",
            " ",
            "g0000000",
            "\u{e9}\u{e9}\u{e9}\u{e9}",
        ];
        let mut keys = Vec::new();
        for (i, v) in bad.iter().enumerate() {
            let k = test_key(100 + i as u64);
            put_raw(&*s, &tier.object_path(&k), block_bytes(&k, 0, BS), Some(v)).await;
            keys.push(k);
        }
        let (res, data) = load_keys(&tier, &keys, BS).await;
        assert!(
            data.is_empty(),
            "accept_unverified={accept}: served with malformed checksums: {:?}",
            data.iter()
                .map(|(k, _)| bad[keys.iter().position(|x| x == k).unwrap()])
                .collect::<Vec<_>>()
        );
        assert_eq!(res.failed.len(), keys.len());
        for (k, v) in keys.iter().zip(bad) {
            assert!(
                !exists(&*s, &tier.object_path(k)).await,
                "accept_unverified={accept}: object with malformed checksum {v:?} not deleted"
            );
        }
    }
}

/// Checksum text that is not "exactly 8 hex digits" but parses to the right value (a sign,
/// spaces, a `0x`, a ninth leading zero): the docs call any such text malformed: a miss.
#[tokio::test(start_paused = true)]
async fn t06_malformed_checksum_text_with_the_right_value_is_refused() {
    let s = Arc::new(InMemory::new());
    let tier = ObjTier::with_store("obj", s.clone(), checked(), ns(), BS)
        .await
        .unwrap();
    // sanity: the well-formed text (either case) loads
    let k = test_key(1);
    let body = block_bytes(&k, 0, BS);
    let crc = block_crc(&k, &body);
    put_raw(
        &*s,
        &tier.object_path(&k),
        body,
        Some(&format!("{crc:08X}")),
    )
    .await;
    let (res, _) = load_keys(&tier, &[k], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let mut served = Vec::new();
    for i in 0..10u64 {
        for j in 0..5u64 {
            let kk = test_key(10_000 + i * 10 + j);
            let body = block_bytes(&kk, 0, BS);
            let crc = block_crc(&kk, &body);
            let hex = format!("{crc:08x}");
            let text = match j {
                0 => format!("0{hex}"),
                1 => format!(" {hex}"),
                2 => format!("{hex} "),
                3 => format!("0x{crc:x}"),
                _ => format!("+{crc:x}"),
            };
            put_raw(&*s, &tier.object_path(&kk), body, Some(&text)).await;
            let (_, data) = load_keys(&tier, &[kk], BS).await;
            if !data.is_empty() {
                served.push(text);
            }
        }
    }
    assert!(
        served.is_empty(),
        "checksum texts that are not 8 hex digits were accepted: {served:?}"
    );
}

/// vLLM objects (no checksum) with `accept_unverified`: served and counted when whole; a
/// short or long one is still a miss, and a store over it leaves a readable block.
#[tokio::test(start_paused = true)]
async fn t07_accept_unverified_still_checks_size_and_a_store_replaces_a_bad_one() {
    let s = Arc::new(InMemory::new());
    let mut cfg = checked();
    cfg.accept_unverified = true;
    let tier = ObjTier::with_store("obj", s.clone(), cfg, ns(), BS)
        .await
        .unwrap();
    let (good, short, long) = (test_key(1), test_key(2), test_key(3));
    put_raw(
        &*s,
        &tier.object_path(&good),
        block_bytes(&good, 0, BS),
        None,
    )
    .await;
    put_raw(
        &*s,
        &tier.object_path(&short),
        block_bytes(&short, 0, BS)[..BS - 16].to_vec(),
        None,
    )
    .await;
    let mut l = block_bytes(&long, 0, BS);
    l.extend([1u8; 16]);
    put_raw(&*s, &tier.object_path(&long), l, None).await;
    let (res, data) = load_keys(&tier, &[good, short, long], BS).await;
    assert_eq!(
        data.iter().map(|(k, _)| *k).collect::<Vec<_>>(),
        vec![good],
        "{:?}",
        res.failed
    );
    assert!(verify_block(&good, 0, &data[0].1));
    assert_eq!(tier.stats().blocks.unverified_loads, 1);
    // the wrong-sized ones may or may not have been deleted by the load; put them back
    put_raw(
        &*s,
        &tier.object_path(&short),
        block_bytes(&short, 0, BS)[..BS - 16].to_vec(),
        None,
    )
    .await;
    let mut l = block_bytes(&long, 0, BS);
    l.extend([1u8; 16]);
    put_raw(&*s, &tier.object_path(&long), l, None).await;
    let res = store(&tier, &[short, long]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = load_keys(&tier, &[short, long], BS).await;
    assert!(
        res.is_success(),
        "a store reported over a wrong-sized unverified object left an unreadable block: {:?}",
        res.failed
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// Checksums off (the default): a short object in a key's way. The trait: "A store that
/// reports success leaves a readable block".
#[tokio::test(start_paused = true)]
async fn t08_without_checksums_a_reported_store_over_a_short_object_is_readable() {
    let s = Arc::new(InMemory::new());
    let tier = ObjTier::with_store("obj", s.clone(), ObjTierConfig::new("mem"), ns(), BS)
        .await
        .unwrap();
    let k = test_key(1);
    put_raw(&*s, &tier.object_path(&k), vec![9u8; BS / 2], None).await;
    let res = store(&tier, &[k]).await;
    if res.is_success() {
        let (res, data) = load_keys(&tier, &[k], BS).await;
        assert!(
            res.is_success() && verify_block(&k, 0, &data[0].1),
            "store reported k stored, but the load fails: {:?}",
            res.failed
        );
    }
}

/// A PUT that lands and then answers an error (its reply lost), and one that leaves half a
/// body without metadata and fails: never a false success; the key stores later and loads.
#[tokio::test(start_paused = true)]
async fn t09_puts_that_fail_after_landing_or_half_way_then_the_key_recovers() {
    let e = Evil::new();
    let tier = evil_tier(&e, checked()).await;
    let (a, b) = (test_key(1), test_key(2));
    e.set(|k| k.put_lands_then_fails = true);
    let res = store(&*tier, &[a]).await;
    if res.is_success() {
        assert!(exists(&e.inner, &tier.object_path(&a)).await);
    }
    e.set(|k| {
        k.put_lands_then_fails = false;
        k.put_half_then_fails = true;
    });
    let res = store(&*tier, &[b]).await;
    assert!(
        !res.is_success(),
        "a PUT that failed half way was reported stored"
    );
    assert!(names(&res.failed[0].1, &tier, &b), "{}", res.failed[0].1);
    e.set(|k| k.put_half_then_fails = false);
    let res = store(&*tier, &[a, b]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = load_keys(&*tier, &[a, b], BS).await;
    assert!(
        res.is_success(),
        "a later store of the key did not leave a readable block: {:?}",
        res.failed
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

// ---------------------------------------------------------------------------------------
// Edges of the API

#[tokio::test(start_paused = true)]
async fn t10_empty_lookups_and_jobs() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, checked()).await;
    assert_eq!(
        tier.lookup(&[]).await.expect("lookup of no keys failed"),
        Vec::<bool>::new()
    );
    assert!(tier.store(StoreJob::default()).await.is_success());
    assert!(tier.load(LoadJob::default()).await.is_success());
    // and while the backend hangs
    s.hold_all();
    let r = tokio::time::timeout(Duration::from_secs(5), tier.lookup(&[])).await;
    assert_eq!(
        r.expect("lookup of no keys hung").unwrap(),
        Vec::<bool>::new()
    );
    s.release_all();
}

/// One key twice in one store job, with different bytes and one permit: ends, every entry
/// reported, exactly one whole copy survives.
#[tokio::test(start_paused = true)]
async fn t11_one_key_twice_in_a_store_job_with_one_io_thread() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = checked();
    cfg.io_threads = 1;
    let tier = tier_on(&s, cfg).await;
    let k = test_key(1);
    let other = test_key(2);
    let job = StoreJob {
        requests: Vec::new(),
        blocks: vec![
            (k, source_for(&k, 0, BS)),
            (other, source_for(&other, 0, BS)),
            (k, source_for(&k, 1, BS)),
        ],
    };
    let res = tokio::time::timeout(Duration::from_secs(30), tier.store(job))
        .await
        .expect("a job with a key twice wedged");
    assert_eq!(res.ok.len() + res.failed.len(), 3, "{res:?}");
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = load_keys(&*tier, &[k, k, other], BS).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert_eq!(data.len(), 3);
    for (kk, d) in &data {
        assert!(
            verify_block(kk, 0, d) || verify_block(kk, 1, d),
            "a torn block"
        );
    }
    assert_eq!(data[0].1, data[1].1);
}

// ---------------------------------------------------------------------------------------
// Deadlines and errors

#[tokio::test(start_paused = true)]
async fn t12_held_requests_fail_within_the_deadline_naming_op_and_key() {
    let s = Arc::new(ControlledStore::new());
    let cfg = checked();
    let deadline = {
        let c = cfg.clone();
        c.validate().unwrap();
        c.request_deadline()
    };
    let tier = tier_on(&s, cfg).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(store(&*tier, &[a]).await.is_success());
    let _p = s.hold(Op::Put);
    let _h = s.hold(Op::Head);
    let t0 = tokio::time::Instant::now();
    let res = store(&*tier, &[b]).await;
    assert!(
        t0.elapsed() <= deadline * 2 + Duration::from_millis(100),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(res.failed_keys(), vec![b]);
    let msg = res.failed[0].1.to_string();
    assert!(
        msg.contains("PUT") || msg.contains("HEAD"),
        "no op named: {msg}"
    );
    assert!(names(&res.failed[0].1, &tier, &b), "no key named: {msg}");
    let _g = s.hold(Op::Get);
    let t0 = tokio::time::Instant::now();
    let (res, _) = load_keys(&*tier, &[a], BS).await;
    assert!(t0.elapsed() <= deadline + Duration::from_millis(100));
    let msg = res.failed[0].1.to_string();
    assert!(msg.contains("GET"), "no op named: {msg}");
    assert!(names(&res.failed[0].1, &tier, &a), "no key named: {msg}");
    s.release_all();
    // nothing wedged
    assert!(store(&*tier, &[b]).await.is_success());
    assert!(load_keys(&*tier, &[a, b], BS).await.0.is_success());
    assert!(!tier.is_protected(&a) && !tier.is_protected(&b));
}

// ---------------------------------------------------------------------------------------
// Cancellation

/// Store, load and lookup futures dropped at many points in time (every request slowed, one
/// permit, a damaged object on the load's path): no protection left, and afterwards every
/// key stores, loads and looks up within its deadline.
#[tokio::test(start_paused = true)]
async fn t13_futures_dropped_at_every_moment_leave_nothing_behind() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = checked();
    cfg.io_threads = 1;
    cfg.request_timeout_s = 5.0;
    let tier = tier_on(&s, cfg).await;
    for op in Op::ALL {
        s.delay(op, Duration::from_millis(7));
    }
    let keys: Vec<_> = (0..4).map(test_key).collect();
    for step in 0..40u64 {
        let at = Duration::from_millis(step * 2 + 1);
        // damage one key's object so a load takes its delete path
        if step % 3 == 0 {
            let p = tier.object_path(&keys[(step % 4) as usize]);
            if s.exists(&p).await {
                put_raw(&s.inner, &p, vec![1u8; BS], Some("00000000")).await;
            }
        }
        let t1 = tier.clone();
        let ks = keys.clone();
        let _ = tokio::time::timeout(at, async move { store(&*t1, &ks).await }).await;
        let t2 = tier.clone();
        let ks = keys.clone();
        let _ = tokio::time::timeout(at, async move { load_keys(&*t2, &ks, BS).await }).await;
        let _ = tokio::time::timeout(at, tier.lookup(&keys)).await;
        // two overlapping stores of the same keys, one dropped
        let t3 = tier.clone();
        let ks = keys.clone();
        let h = tokio::spawn(async move { store(&*t3, &ks).await });
        let _ = tokio::time::timeout(at, store(&*tier, &keys)).await;
        let r = tokio::time::timeout(Duration::from_secs(60), h)
            .await
            .expect("a store wedged after another store of its keys was dropped")
            .unwrap();
        assert!(r.is_success(), "step {step}: {:?}", r.failed);
        for k in &keys {
            assert!(!tier.is_protected(k), "step {step}: {k} still protected");
        }
    }
    s.release_all();
    for op in Op::ALL {
        s.delay(op, Duration::ZERO);
    }
    let r = tokio::time::timeout(Duration::from_secs(30), store(&*tier, &keys))
        .await
        .expect("store wedged");
    assert!(r.is_success(), "{:?}", r.failed);
    let (r, data) = load_keys(&*tier, &keys, BS).await;
    assert!(r.is_success(), "{:?}", r.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    tier.clear_exists_cache();
    assert_eq!(tier.lookup(&keys).await.unwrap(), vec![true; 4]);
    assert!(tier.stats().max_in_flight <= 1, "{:?}", tier.stats());
}

// ---------------------------------------------------------------------------------------
// Capacity

/// Concurrent stores while every DELETE is slow (sweeps overlap stores): once the stores
/// and sweeps are over, the objects are within the bound, and the index counts them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t14_concurrent_stores_during_slow_sweeps_end_within_the_bound() {
    let s = Arc::new(ControlledStore::new());
    let blocks = 16;
    let tier = tier_on(&s, bounded(blocks, 0.75)).await;
    s.delay(Op::Delete, Duration::from_millis(40));
    let mut hs = Vec::new();
    for w in 0..4u64 {
        let t = tier.clone();
        hs.push(tokio::spawn(async move {
            for i in 0..15u64 {
                let k = test_key(w * 1000 + i);
                let r = store(&*t, &[k]).await;
                assert!(r.is_success(), "{:?}", r.failed);
                tokio::time::sleep(Duration::from_millis(3)).await;
            }
        }));
    }
    for h in hs {
        h.await.unwrap();
    }
    wait_sweeps_done(&tier).await;
    let present = present_bytes(&s.inner).await;
    let bound = (blocks * BS) as u64;
    assert!(
        present <= bound,
        "after all stores and sweeps ended: {} blocks present, bound {blocks} (index says {})",
        present / BS as u64,
        tier.stats().bytes / BS as u64
    );
    assert!(tier.stats().bytes >= present, "{:?}", tier.stats());
}

/// Keys protected before they exist, then stored, survive a flood far past the bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t15_protected_keys_survive_a_flood() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(8, 0.5)).await;
    let keep: Vec<_> = (0..3).map(|i| test_key(500 + i)).collect();
    let guard = tier.protect(&keep);
    assert!(store(&*tier, &keep).await.is_success());
    for i in 0..60 {
        assert!(store(&*tier, &[test_key(i)]).await.is_success());
        if i % 10 == 0 {
            tier.sweep_now().await;
        }
    }
    tier.sweep_now().await;
    wait_sweeps_done(&tier).await;
    for k in &keep {
        assert!(
            s.exists(&tier.object_path(k)).await,
            "protected {k} evicted"
        );
    }
    let (r, _) = load_keys(&*tier, &keep, BS).await;
    assert!(r.is_success(), "{:?}", r.failed);
    drop(guard);
    assert!(keep.iter().all(|k| !tier.is_protected(k)));
    assert!(present_bytes(&s.inner).await <= (8 * BS) as u64);
}

/// "shutdown saves the recency order (touches included) ... and the next open orders the
/// objects by it": the oldest key, touched before shutdown, outlives younger untouched ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t16_touches_survive_a_restart() {
    let s = Arc::new(ControlledStore::new());
    let keys: Vec<_> = (0..9).map(test_key).collect();
    {
        let tier = tier_on(&s, bounded(8, 0.5)).await;
        for k in &keys[..6] {
            assert!(store(&*tier, &[*k]).await.is_success());
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        tier.touch(&[keys[0]]);
        tier.shutdown().await.unwrap();
    }
    let tier = tier_on(&s, bounded(8, 0.5)).await;
    for k in &keys[6..] {
        assert!(store(&*tier, &[*k]).await.is_success());
    }
    tier.sweep_now().await;
    wait_sweeps_done(&tier).await;
    let mut present = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        if s.exists(&tier.object_path(k)).await {
            present.push(i);
        }
    }
    assert!(
        present.contains(&0),
        "the touched key went; present: {present:?}"
    );
    assert!(!present.contains(&1), "present: {present:?}");
}

/// The recency object replaced by garbage (or emptied) between runs: the tier still opens
/// and serves its blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t17_a_garbled_recency_object_does_not_break_open() {
    for garbage in [
        vec![],
        b"kv-tier recency 1\n".to_vec(),
        vec![0xffu8; 1 << 16],
        {
            let mut v = b"kv-tier-recency v1 999999999999\n".to_vec();
            v.extend([7u8; 35]);
            v
        },
    ] {
        let s = Arc::new(ControlledStore::new());
        let keys: Vec<_> = (0..4).map(test_key).collect();
        {
            let tier = tier_on(&s, bounded(8, 0.5)).await;
            assert!(store(&*tier, &keys).await.is_success());
            tier.touch(&keys[..1]);
            tier.shutdown().await.unwrap();
        }
        let metas: Vec<ObjectMeta> = s.inner.list(None).map(|m| m.unwrap()).collect().await;
        let others: Vec<_> = metas
            .iter()
            .filter(|m| !m.location.as_ref().ends_with(".bin"))
            .map(|m| m.location.clone())
            .collect();
        assert!(!others.is_empty(), "no recency object saved at shutdown");
        for p in &others {
            s.inner
                .put(p, PutPayload::from(garbage.clone()))
                .await
                .unwrap();
        }
        let tier = tokio::time::timeout(
            Duration::from_secs(10),
            ObjTier::with_store("obj", s.clone(), bounded(8, 0.5), ns(), BS),
        )
        .await
        .expect("open hung")
        .expect("a garbled recency object made open fail");
        let (r, data) = load_keys(&tier, &keys, BS).await;
        assert!(r.is_success(), "{:?}", r.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        assert_eq!(tier.stats().objects, 4, "{:?}", tier.stats());
    }
}

// ---------------------------------------------------------------------------------------
// Lookups behind the tier's back

#[tokio::test(start_paused = true)]
async fn t18_lookups_after_objects_change_behind_the_tiers_back() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, checked()).await;
    let other = tier_on(&s, checked()).await;
    let (gone, replaced, fresh) = (test_key(1), test_key(2), test_key(3));
    assert!(store(&*tier, &[gone, replaced]).await.is_success());
    assert_eq!(
        tier.lookup(&[gone, replaced, fresh]).await.unwrap(),
        vec![true, true, false]
    );
    s.inner
        .delete(&Path::from(tier.object_path(&gone)))
        .await
        .unwrap();
    put_raw(&s.inner, &tier.object_path(&replaced), vec![3u8; BS], None).await;
    assert!(store(&*other, &[fresh]).await.is_success());
    // fresh: written by another writer, never answered absent from a cache
    assert_eq!(tier.lookup(&[fresh]).await.unwrap(), vec![true]);
    // gone and replaced may be answered present from the cache; a load is a miss, and
    // from then on the lookup answers absent
    let (r, data) = load_keys(&*tier, &[gone, replaced], BS).await;
    assert!(data.is_empty(), "{r:?}");
    assert_eq!(
        tier.lookup(&[gone, replaced]).await.unwrap(),
        vec![false, false],
        "lookup still answers present after loads found the objects missing/damaged"
    );
    // a store rewrites both
    assert!(store(&*tier, &[gone, replaced]).await.is_success());
    let (r, data) = load_keys(&*tier, &[gone, replaced, fresh], BS).await;
    assert!(r.is_success(), "{:?}", r.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// A lookup whose HEADs hang for one key answers the others within `lookup_timeout_s`.
#[tokio::test(start_paused = true)]
async fn t19_a_lookup_with_one_hanging_head_answers_the_others() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = checked();
    cfg.lookup_timeout_s = 0.3;
    let tier = tier_on(&s, cfg).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(store(&*tier, &[a, b]).await.is_success());
    tier.clear_exists_cache();
    let _g = s.hold_path(Op::Head, &tier.object_path(&b));
    let t0 = tokio::time::Instant::now();
    let r = tier.lookup(&[a, b]).await;
    assert!(
        t0.elapsed() <= Duration::from_millis(400),
        "{:?}",
        t0.elapsed()
    );
    assert_eq!(
        r.expect("lookup failed though one key answered"),
        vec![true, false]
    );
    s.release(Op::Head);
}

// ---------------------------------------------------------------------------------------
// Shutdown

#[tokio::test(start_paused = true)]
async fn t20_shutdown_with_requests_hung_forever() {
    let s = Arc::new(ControlledStore::new());
    let mut cfg = bounded(64, 0.5);
    cfg.request_timeout_s = 30.0;
    let tier = tier_on(&s, cfg).await;
    let a = test_key(1);
    assert!(store(&*tier, &[a]).await.is_success());
    s.hold_all();
    let t1 = tier.clone();
    let st = tokio::spawn(async move { store(&*t1, &[test_key(2)]).await });
    let t2 = tier.clone();
    let ld = tokio::spawn(async move { load_keys(&*t2, &[a], BS).await });
    tokio::time::sleep(Duration::from_millis(10)).await;
    let r = tokio::time::timeout(Duration::from_secs(120), tier.shutdown()).await;
    assert!(r.is_ok(), "shutdown hung with requests in flight");
    // a bounded tier saves its recency order at shutdown: bounded by one request deadline
    let r2 = tokio::time::timeout(Duration::from_secs(40), tier.shutdown()).await;
    assert!(r2.is_ok(), "a second shutdown hung");
    let r = store(&*tier, &[test_key(3)]).await;
    assert!(
        matches!(r.failed.first(), Some((_, Error::Shutdown { .. }))),
        "{r:?}"
    );
    assert!(matches!(
        tier.lookup(&[a]).await,
        Err(Error::Shutdown { .. })
    ));
    s.release_all();
    let st = tokio::time::timeout(Duration::from_secs(300), st).await;
    let ld = tokio::time::timeout(Duration::from_secs(300), ld).await;
    assert!(st.is_ok() && ld.is_ok(), "in-flight calls never ended");
}

// ---------------------------------------------------------------------------------------
// A real S3 server behind a misbehaving proxy

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Pass,
    /// Requests and replies vanish; connections stay open.
    Blackhole,
    /// Requests reach the server; the connection drops before the reply.
    DropReply,
    /// The connection is reset as soon as a request arrives.
    Reset,
    /// Every request is answered 503 SlowDown.
    SlowDown,
}

struct Proxy {
    endpoint: String,
    mode: Arc<Mutex<Mode>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    async fn start(upstream: &str) -> Proxy {
        let upstream = upstream.trim_start_matches("http://").to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let mode = Arc::new(Mutex::new(Mode::Pass));
        let m = mode.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let (m, up) = (m.clone(), upstream.clone());
                tokio::spawn(async move {
                    let _ = pump(client, &up, m).await;
                });
            }
        });
        Proxy {
            endpoint,
            mode,
            task,
        }
    }
    fn set(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }
}

async fn pump(
    mut client: tokio::net::TcpStream,
    up: &str,
    mode: Arc<Mutex<Mode>>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    client.set_nodelay(true)?;
    let mut server = tokio::net::TcpStream::connect(up).await?;
    server.set_nodelay(true)?;
    let (mut cr, mut cw) = client.split();
    let (mut sr, mut sw) = server.split();
    let (mut b1, mut b2) = (vec![0u8; 65536], vec![0u8; 65536]);
    let mut drop_reply = false;
    let mode = || *mode.lock().unwrap();
    loop {
        tokio::select! {
            r = cr.read(&mut b1) => {
                let n = r?;
                if n == 0 { return Ok(()); }
                match mode() {
                    Mode::Pass => sw.write_all(&b1[..n]).await?,
                    Mode::Blackhole => {}
                    Mode::DropReply => { sw.write_all(&b1[..n]).await?; drop_reply = true; }
                    Mode::Reset => return Ok(()),
                    Mode::SlowDown => {
                        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
                        let resp = format!("HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                        cw.write_all(resp.as_bytes()).await?;
                        return Ok(());
                    }
                }
            }
            r = sr.read(&mut b2) => {
                let n = r?;
                if n == 0 { return Ok(()); }
                if drop_reply { return Ok(()); }
                match mode() {
                    Mode::Blackhole => {}
                    _ => cw.write_all(&b2[..n]).await?,
                }
            }
        }
    }
}

async fn proxied(
    server: &S3Server,
    proxy: &Proxy,
    timeout: f64,
    retries: usize,
) -> (ObjTier, Duration) {
    let mut cfg = server.config();
    cfg.endpoint_override = Some(proxy.endpoint.clone());
    cfg.checksum = ObjChecksum::Crc32c;
    cfg.request_timeout_s = timeout;
    cfg.max_retries = retries;
    cfg.lookup_timeout_s = 0.5;
    let c = cfg.clone();
    c.validate().unwrap();
    let d = c.request_deadline();
    (server.tier(cfg).await, d)
}

/// What a loaded 2-core machine may add to a request deadline (scheduling): a call with no
/// deadline at all never ends, so the check still tells one from the other.
const DEADLINE_SLACK: Duration = Duration::from_secs(3);

/// Stores `keys` until the store succeeds, for at most 30 s (a try with a short timeout may
/// time out on a loaded machine); the last result.
async fn until_stored(tier: &dyn SecondaryTier, keys: &[BlockKey]) -> JobResult {
    let t0 = Instant::now();
    loop {
        let r = store(tier, keys).await;
        if r.is_success() || t0.elapsed() > Duration::from_secs(30) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`until_stored`] for a load of `keys`.
async fn until_loaded(
    tier: &dyn SecondaryTier,
    keys: &[BlockKey],
) -> (JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    let t0 = Instant::now();
    loop {
        let r = load_keys(tier, keys, BS).await;
        if r.0.is_success() || t0.elapsed() > Duration::from_secs(30) {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn sdk_exists(server: &S3Server, path: &str) -> bool {
    server
        .sdk()
        .head_object()
        .bucket(common::BUCKET)
        .key(path)
        .send()
        .await
        .is_ok()
}

/// A server that stops answering (connections open, nothing comes back): store, load and
/// lookup end within their deadlines with errors naming the key; once it answers again,
/// the same keys store and load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t21_s3_black_hole_then_recovery() {
    let server = S3Server::start().await;
    let proxy = Proxy::start(&server.endpoint).await;
    let (tier, deadline) = proxied(&server, &proxy, 0.5, 1).await;
    let (a, b) = (test_key(1), test_key(2));
    assert!(store(&tier, &[a]).await.is_success());
    proxy.set(Mode::Blackhole);
    let t0 = Instant::now();
    let res = store(&tier, &[b]).await;
    let took = t0.elapsed();
    assert!(
        took <= deadline + DEADLINE_SLACK,
        "store took {took:?} (deadline {deadline:?})"
    );
    assert_eq!(res.failed_keys(), vec![b]);
    assert!(names(&res.failed[0].1, &tier, &b), "{}", res.failed[0].1);
    let t0 = Instant::now();
    let (res, _) = load_keys(&tier, &[a], BS).await;
    assert!(
        t0.elapsed() <= deadline + DEADLINE_SLACK,
        "load took {:?}",
        t0.elapsed()
    );
    assert_eq!(res.failed_keys(), vec![a]);
    assert!(names(&res.failed[0].1, &tier, &a), "{}", res.failed[0].1);
    tier.clear_exists_cache();
    let t0 = Instant::now();
    let l = tier.lookup(&[a, b]).await;
    assert!(
        t0.elapsed() <= Duration::from_millis(400) + DEADLINE_SLACK,
        "lookup took {:?}",
        t0.elapsed()
    );
    assert!(l.is_err() || l.unwrap() == vec![false, false]);
    proxy.set(Mode::Pass);
    // 0.5 s tries: on a loaded machine one may still time out; the store and load succeed
    // again within a few (bounded)
    let res = until_stored(&tier, &[b]).await;
    assert!(res.is_success(), "after recovery: {:?}", res.failed);
    let (res, data) = until_loaded(&tier, &[a, b]).await;
    assert!(res.is_success(), "after recovery: {:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    tokio::time::timeout(Duration::from_secs(10), tier.shutdown())
        .await
        .unwrap()
        .unwrap();
}

/// PUTs whose replies are lost (the connection drops after the request reached the server),
/// and PUTs whose connection is reset before anything lands: a reported store always has its
/// object; the key stores and loads later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t22_s3_connections_dropping_around_puts() {
    let server = S3Server::start().await;
    let proxy = Proxy::start(&server.endpoint).await;
    let (tier, deadline) = proxied(&server, &proxy, 1.0, 2).await;
    for (i, mode) in [Mode::DropReply, Mode::Reset].into_iter().enumerate() {
        let keys: Vec<_> = (0..3).map(|j| test_key(10 * i as u64 + j)).collect();
        proxy.set(mode);
        let t0 = Instant::now();
        let res = store(&tier, &keys).await;
        assert!(
            t0.elapsed() <= deadline + Duration::from_secs(1),
            "{mode:?}: {:?}",
            t0.elapsed()
        );
        proxy.set(Mode::Pass);
        for k in &res.ok {
            assert!(
                sdk_exists(&server, &tier.object_path(k)).await,
                "{mode:?}: {k} reported stored, no object"
            );
        }
        if mode == Mode::Reset {
            assert!(
                res.ok.is_empty(),
                "{mode:?}: nothing could land, yet {:?} stored",
                res.ok
            );
        }
        for (k, e) in &res.failed {
            assert!(names(e, &tier, k), "{mode:?}: {e}");
        }
        let res = store(&tier, &keys).await;
        assert!(res.is_success(), "{mode:?}: later store: {:?}", res.failed);
        let (res, data) = load_keys(&tier, &keys, BS).await;
        assert!(res.is_success(), "{mode:?}: {:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    }
}

/// Every request answered 503 SlowDown: the job fails within the deadline (retries
/// included), naming the key; a few SlowDowns are retried through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t23_s3_slowdown_forever_then_a_few() {
    let server = S3Server::start().await;
    let proxy = Proxy::start(&server.endpoint).await;
    let (tier, deadline) = proxied(&server, &proxy, 0.5, 2).await;
    let (a, b) = (test_key(1), test_key(2));
    proxy.set(Mode::SlowDown);
    let t0 = Instant::now();
    let res = store(&tier, &[a]).await;
    let took = t0.elapsed();
    assert!(took <= deadline + DEADLINE_SLACK, "{took:?} > {deadline:?}");
    assert_eq!(res.failed_keys(), vec![a]);
    assert!(res.failed[0].1.is_transient(), "{}", res.failed[0].1);
    assert!(names(&res.failed[0].1, &tier, &a), "{}", res.failed[0].1);
    assert!(!sdk_exists(&server, &tier.object_path(&a)).await);
    proxy.set(Mode::Pass);
    server.fail_next(2);
    // two SlowDowns, two retries: retried through (a loaded machine's slow try may cost one
    // more round, bounded)
    let res = until_stored(&tier, &[a, b]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = until_loaded(&tier, &[a, b]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// A server slower than every attempt's timeout: jobs end within the deadline; the PUTs
/// that land late do no harm; at normal speed the same keys store and load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t24_s3_slow_server() {
    let server = S3Server::start().await;
    let mut cfg = server.config();
    cfg.checksum = ObjChecksum::Crc32c;
    cfg.request_timeout_s = 0.3;
    cfg.max_retries = 1;
    let c = cfg.clone();
    c.validate().unwrap();
    let deadline = c.request_deadline();
    let tier = server.tier(cfg).await;
    let keys: Vec<_> = (0..3).map(test_key).collect();
    server.set_latency(Duration::from_secs(2));
    let t0 = Instant::now();
    let res = store(&tier, &keys).await;
    assert!(
        t0.elapsed() <= deadline + DEADLINE_SLACK,
        "{:?} > {deadline:?}",
        t0.elapsed()
    );
    assert!(res.ok.is_empty(), "{:?}", res.ok);
    server.set_latency(Duration::ZERO);
    tokio::time::sleep(Duration::from_millis(2500)).await; // late PUTs land
    let res = until_stored(&tier, &keys).await;
    assert!(res.is_success(), "{:?}", res.failed);
    let (res, data) = until_loaded(&tier, &keys).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
}

/// Shutdown is done once: a second call ("later calls fail with `Shutdown`") does no more
/// I/O. Observed: every shutdown of a bounded tier PUTs its recency snapshot again, so a
/// repeated shutdown against a backend that stopped answering waits a whole request deadline
/// each time, and a late repeat rewrites the snapshot.
#[tokio::test(start_paused = true)]
async fn t25_a_second_shutdown_writes_nothing() {
    let s = Arc::new(ControlledStore::new());
    let tier = tier_on(&s, bounded(64, 0.5)).await;
    assert!(store(&*tier, &[test_key(1)]).await.is_success());
    tier.shutdown().await.unwrap();
    let puts = s.count(Op::Put);
    let _ = tier.shutdown().await;
    assert_eq!(
        s.count(Op::Put) - puts,
        0,
        "a second shutdown PUT the recency snapshot again"
    );
}
