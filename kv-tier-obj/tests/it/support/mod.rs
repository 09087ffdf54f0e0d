//! Helpers of the obj tier's tests, once for the binary: the block size and namespace, the
//! testkit's S3 server configured for `ObjTier`, tiers on a `ControlledStore`, configs,
//! objects written, damaged or looked at behind the tier's back, the events seen.
//!
//! - `proxy`: a TCP proxy in front of the S3 server that misbehaves on demand;
//! - `shared`: what the shared-bucket tests share;
//! - `conformance`: the conformance suite's fixtures.

mod conformance;
mod proxy;
mod shared;

pub(crate) use conformance::*;
pub(crate) use proxy::*;
pub(crate) use shared::*;

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{FutureExt as _, StreamExt as _};
use kv_tier_core::{BlockKey, Error, JobResult, SecondaryTier};
use kv_tier_obj::{CRC_METADATA_KEY, ObjChecksum, ObjTier, ObjTierConfig, Scheme};
use kv_tier_testkit::controlled_store::ControlledStore;
pub(crate) use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};
use kv_tier_testkit::wait::{SETTLE_LIMIT, wait_until_async};
use kv_tier_testkit::{load_keys, store_keys};
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    Attribute, Attributes, ObjectMeta, ObjectStore, ObjectStoreExt as _, PutOptions, PutPayload,
};

/// The block size of the tests (but those on [`shared_obj_config`]: [`SHARED_BS`]).
pub(crate) const BS: usize = 4096;

/// What a loaded 2-core machine may add to a request deadline (scheduling): a call with no
/// deadline at all never ends, so the check still tells one from the other.
pub(crate) const DEADLINE_SLACK: Duration = Duration::from_secs(3);

/// The tests' namespace: rank 0 of a test model.
pub(crate) use kv_tier_testkit::test_namespace as ns;

/// The config of an obj tier on the S3 test server at `endpoint` (its bucket and keys, under
/// the prefix `tests/`).
pub(crate) fn s3_config(endpoint: &str) -> ObjTierConfig {
    let mut c = ObjTierConfig::new(BUCKET);
    c.endpoint_override = Some(endpoint.into());
    c.access_key = Some(AK.into());
    c.secret_key = Some(SK.into());
    c.region = Some("us-east-1".into());
    c.scheme = Scheme::Http;
    c.prefix = "tests/".into();
    c
}

/// `ObjTier` and aws-sdk-s3 clients of a test server.
pub(crate) trait S3ServerExt {
    /// [`s3_config`] of this server.
    fn config(&self) -> ObjTierConfig;
    /// An obj tier on this server, with `cfg`.
    async fn tier(&self, cfg: ObjTierConfig) -> ObjTier;
    /// An aws-sdk-s3 client for the server.
    fn sdk(&self) -> aws_sdk_s3::Client;
}

impl S3ServerExt for S3Server {
    fn config(&self) -> ObjTierConfig {
        s3_config(&self.endpoint)
    }

    async fn tier(&self, cfg: ObjTierConfig) -> ObjTier {
        ObjTier::connect("obj", cfg, ns(), BS).await.unwrap()
    }

    fn sdk(&self) -> aws_sdk_s3::Client {
        let creds = aws_sdk_s3::config::Credentials::new(AK, SK, None, None, "test");
        let conf = aws_sdk_s3::config::Builder::new()
            .behavior_version(aws_sdk_s3::config::BehaviorVersion::latest())
            .endpoint_url(&self.endpoint)
            .region(aws_sdk_s3::config::Region::new("us-east-1"))
            .credentials_provider(creds)
            .force_path_style(true)
            .build();
        aws_sdk_s3::Client::from_conf(conf)
    }
}

/// `cfg` without the existence listing (`absent_ttl_s` 0): lookups ask for every key the
/// existence cache does not hold, as tests of HEADs and of another writer's objects need.
pub(crate) fn heads_only(mut cfg: ObjTierConfig) -> ObjTierConfig {
    cfg.absent_ttl_s = 0.0;
    cfg
}

/// An obj tier named "obj" over a controlled in-memory store.
pub(crate) async fn tier_on(store: &Arc<ControlledStore>, cfg: ObjTierConfig) -> Arc<ObjTier> {
    Arc::new(
        ObjTier::with_store("obj", store.clone(), cfg, ns(), BS)
            .await
            .unwrap(),
    )
}

/// What [`store`] takes: a tier, or the `Arc` a test holds it in.
pub(crate) trait AsTier {
    /// The tier.
    fn as_tier(&self) -> &dyn SecondaryTier;
}

impl AsTier for ObjTier {
    fn as_tier(&self) -> &dyn SecondaryTier {
        self
    }
}

impl AsTier for Arc<ObjTier> {
    fn as_tier(&self) -> &dyn SecondaryTier {
        &**self
    }
}

impl AsTier for dyn SecondaryTier {
    fn as_tier(&self) -> &dyn SecondaryTier {
        self
    }
}

/// Stores `keys` (salt 0, blocks of [`BS`]) on `t` as one job.
pub(crate) async fn obj_store(t: &(impl AsTier + ?Sized), keys: &[BlockKey]) -> JobResult {
    store_keys(t.as_tier(), keys, 0, BS).await
}

/// Checksums on (CRC32C), defaults otherwise.
pub(crate) fn checked() -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.checksum = ObjChecksum::Crc32c;
    c
}

/// Checksums on, 0.5 s requests, no retries.
pub(crate) fn checked_half_second() -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.checksum = ObjChecksum::Crc32c;
    c.request_timeout_s = 0.5;
    c.max_retries = 0;
    c
}

/// No checksums, 1 s requests, no retries.
pub(crate) fn one_second() -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    c
}

/// A bound of `blocks` blocks, low watermark 0.5, defaults otherwise.
pub(crate) fn bounded(blocks: usize) -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.max_size_gb = Some((blocks * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = 0.5;
    c
}

/// A bound of `blocks` blocks, low watermark 0.5, checksums on, 1 s requests, no retries.
pub(crate) fn bounded_checked_1s(blocks: usize) -> ObjTierConfig {
    let mut c = ObjTierConfig::new("mem");
    c.max_size_gb = Some((blocks * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = 0.5;
    c.request_timeout_s = 1.0;
    c.max_retries = 0;
    c.checksum = ObjChecksum::Crc32c;
    c
}

/// A bound of `blocks` blocks, low watermark `low`, checksums on, 2 s requests, no retries.
pub(crate) fn bounded_checked_2s(blocks: usize, low: f64) -> ObjTierConfig {
    let mut c = checked_half_second();
    c.max_size_gb = Some((blocks * BS) as f64 / (1u64 << 30) as f64);
    c.low_watermark = low;
    c.request_timeout_s = 2.0;
    c
}

/// Whether `e` is a timeout.
pub(crate) fn is_timeout(e: &Error) -> bool {
    matches!(e, Error::Timeout { .. })
}

/// Whether the error `e` names `k` (its object's path, the key or its hash).
pub(crate) fn names(e: &Error, t: &ObjTier, k: &BlockKey) -> bool {
    let s = e.to_string();
    s.contains(&t.object_path(k)) || s.contains(&k.to_string()) || s.contains(&k.hash_hex())
}

/// Bytes of the block objects (`.bin`) in `s` (an in-memory store lists at once).
pub(crate) fn present_bytes(s: &InMemory) -> u64 {
    let metas: Vec<ObjectMeta> = s
        .list(None)
        .map(|m| m.unwrap())
        .collect()
        .now_or_never()
        .expect("an in-memory store lists at once");
    metas
        .iter()
        .filter(|m| m.location.as_ref().ends_with(".bin"))
        .map(|m| m.size)
        .sum()
}

/// Waits until `t` runs no sweep.
pub(crate) async fn wait_sweeps_done(t: &ObjTier) {
    wait_until_async("the sweeps to end", SETTLE_LIMIT, || {
        t.sweeps_running() == 0
    })
    .await;
}

/// Whether `lookup` finds `k`, its positive-answer cache forgotten first (as its TTL would).
pub(crate) async fn found(t: &ObjTier, k: BlockKey) -> bool {
    t.clear_exists_cache();
    t.lookup(&[k]).await.unwrap()[0]
}

/// Every event ever taken, in order: (key, removed).
#[derive(Default)]
pub(crate) struct History(pub(crate) Vec<(BlockKey, bool)>);

impl History {
    /// Takes `t`'s new events: returns them, and keeps them in the history.
    pub(crate) fn take(&mut self, t: &ObjTier) -> Vec<(BlockKey, bool)> {
        let mut new = Vec::new();
        for e in t.take_events() {
            for k in e.keys {
                new.push((k, e.removed));
            }
        }
        self.0.extend(new.iter().copied());
        new
    }

    /// The last word on `k`: `Some(true)` removed, `Some(false)` stored, `None` nothing.
    pub(crate) fn last(&self, k: &BlockKey) -> Option<bool> {
        self.0.iter().rev().find(|(x, _)| x == k).map(|(_, r)| *r)
    }
}

/// Attributes carrying `v` as the object's checksum metadata.
pub(crate) fn crc_attrs(v: &str) -> Attributes {
    let mut a = Attributes::new();
    a.insert(
        Attribute::Metadata(CRC_METADATA_KEY.into()),
        v.to_string().into(),
    );
    a
}

/// Writes `body` at `path` in `s`, with `crc` as its checksum metadata if given.
pub(crate) async fn put_raw(s: &dyn ObjectStore, path: &str, body: Vec<u8>, crc: Option<&str>) {
    let opts = PutOptions {
        attributes: crc.map(crc_attrs).unwrap_or_default(),
        ..PutOptions::default()
    };
    s.put_opts(&Path::from(path), PutPayload::from(body), opts)
        .await
        .unwrap();
}

/// Writes 100 bytes that are no block at `path`, behind the tier's back.
pub(crate) async fn put_in_the_way(s: &ControlledStore, path: &str) {
    s.inner
        .put(&Path::from(path), PutPayload::from(vec![7u8; 100]))
        .await
        .unwrap();
}

/// Rewrites the object at `path` with one byte flipped, keeping its metadata (bit rot).
pub(crate) async fn rot(s: &ControlledStore, path: &str) {
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

/// Whether an object is at `path` in `s` (a HEAD).
pub(crate) async fn exists(s: &dyn ObjectStore, path: &str) -> bool {
    s.head(&Path::from(path)).await.is_ok()
}

/// The ETag of the object at `path` (asked of the inner store, not counted).
pub(crate) async fn etag(s: &ControlledStore, path: &str) -> Option<String> {
    s.inner.head(&Path::from(path)).await.unwrap().e_tag
}

/// Whether the S3 server holds an object at `path` (asked with aws-sdk-s3).
pub(crate) async fn sdk_exists(server: &S3Server, path: &str) -> bool {
    server
        .sdk()
        .head_object()
        .bucket(BUCKET)
        .key(path)
        .send()
        .await
        .is_ok()
}

/// Stores `keys` until the store succeeds, for at most 30 s (a try with a short timeout may
/// time out on a loaded machine); the last result.
pub(crate) async fn until_stored(tier: &dyn SecondaryTier, keys: &[BlockKey]) -> JobResult {
    let t0 = Instant::now();
    loop {
        let r = obj_store(tier, keys).await;
        if r.is_success() || t0.elapsed() > Duration::from_secs(30) {
            return r;
        }
        // a pause between tries, for a server that is still recovering
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// [`until_stored`] for a load of `keys`.
pub(crate) async fn until_loaded(
    tier: &dyn SecondaryTier,
    keys: &[BlockKey],
) -> (JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    let t0 = Instant::now();
    loop {
        let r = load_keys(tier, keys, BS).await;
        if r.0.is_success() || t0.elapsed() > Duration::from_secs(30) {
            return r;
        }
        // a pause between tries, for a server that is still recovering
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A bound of `blocks` blocks, low watermark 0.5, requests and lookups of 600 s (no retries):
/// nothing times out unless a test holds it that long.
pub(crate) fn bounded_long(blocks: usize) -> ObjTierConfig {
    let mut c = bounded(blocks);
    c.request_timeout_s = 600.0;
    c.max_retries = 0;
    c.lookup_timeout_s = 600.0;
    c
}

/// What the tier under-counts: `None` if its count (`ObjStats::bytes`) is at least the bytes
/// of block objects in `s`, else why not.
pub(crate) fn under_count(tier: &ObjTier, s: &ControlledStore) -> Option<String> {
    let st = tier.stats();
    let present = present_bytes(&s.inner);
    (st.bytes < present).then(|| {
        format!(
            "under-count: stats().bytes {} < {present} bytes present ({st:?})",
            st.bytes
        )
    })
}

/// Deletes `k`'s object from `s` behind `tier`'s back (another writer's delete, a lifecycle
/// rule).
pub(crate) async fn delete_behind_the_back(s: &ControlledStore, tier: &ObjTier, k: &BlockKey) {
    s.inner
        .delete(&Path::from(tier.object_path(k)))
        .await
        .unwrap();
}
