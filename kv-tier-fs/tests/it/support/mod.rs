//! Helpers of the fs tier's tests, each defined once: the constants, the test namespace, the
//! tier configs and how to open them, and stores and loads of test blocks. By topic:
//!
//! - [`disk`]: paths, files, xattrs and allocated bytes on disk;
//! - [`gc`]: driving the GC (aged keys, sweep hooks held at a point, settling);
//! - [`audit`]: checks of a tier against the disk and its events;
//! - [`workload`]: load generators, samplers, and scenarios two tests share;
//! - [`process`]: threads, runtimes, held I/O and child runs of this binary;
//! - [`conformance`]: the conformance suite's fixtures.
//!
//! Generic file and filesystem helpers (mounts, `statvfs`, FIFOs) are
//! `kv_tier_testkit::fixtures::files`.

mod audit;
mod conformance;
mod disk;
mod gc;
mod process;
mod workload;

pub(crate) use audit::*;
pub(crate) use conformance::*;
pub(crate) use disk::*;
pub(crate) use gc::*;
pub(crate) use process::*;
pub(crate) use workload::*;

use std::borrow::Borrow;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, Error, JobResult};
use kv_tier_fs::{Checksum, FsTier, FsTierConfig, GcStats};
use kv_tier_testkit::store_keys;

/// The block size of most tests: 4 KiB.
pub(crate) const BS: usize = 4096;

/// How long a test waits for a sweep hook to be reached before it fails (a condition wait,
/// not a timing assertion: a broken tier fails the test instead of hanging it).
pub(crate) const HOOK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

/// The test namespace: model `test-org/test-model`, `torch.float16`, 16 tokens a hash, rank 0.
pub(crate) use kv_tier_testkit::test_namespace as ns;

/// The tier's config on `root` with 4 read and 4 write threads, everything else default
/// (unbounded, no checksums).
pub(crate) fn cfg(root: &Path) -> FsTierConfig {
    let mut c = FsTierConfig::new(root);
    c.n_read_threads = 4;
    c.n_write_threads = 4;
    c
}

/// An instance of a shared root (`shared: true`, id `id`): [`cfg`] with checksums on, a cap
/// of `cap_bytes` for the root as a whole, the GC on a sub-second scale (stamp interval
/// `stamp_s`, grace twice that) and a lease of `lease_s`.
pub(crate) fn shared_fs_config(
    root: &Path,
    id: &str,
    cap_bytes: u64,
    lease_s: f64,
    stamp_s: f64,
) -> FsTierConfig {
    let mut c = cfg(root);
    c.checksum = Checksum::Crc32c;
    c.gc_max_size_gb = Some(cap_bytes as f64 / (1u64 << 30) as f64);
    c.gc_stamp_interval_s = Some(stamp_s);
    c.gc_grace_s = Some(2.0 * stamp_s);
    c.gc_interval_s = Some(0.05);
    c.shared = true;
    c.shared_lease_s = Some(lease_s);
    c.instance_id = Some(id.into());
    c
}

/// An unbounded tier on `root` ([`cfg`], blocks of [`BS`]).
pub(crate) fn open(root: &Path) -> FsTier {
    FsTier::open("fs", cfg(root), ns(), BS).unwrap()
}

/// [`open`] with CRC32C checksums on.
pub(crate) fn open_checksummed(root: &Path) -> FsTier {
    let mut c = cfg(root);
    c.checksum = Checksum::Crc32c;
    FsTier::open("fs", c, ns(), BS).unwrap()
}

/// Stores `keys` in the tier `t` (an `FsTier` or an `Arc` of one) as one job, blocks of
/// [`BS`] bytes of `salt`: [`store_keys`].
pub(crate) async fn fs_store(
    t: &impl Borrow<FsTier>,
    keys: &[BlockKey],
    salt: u64,
) -> kv_tier_core::JobResult {
    kv_tier_testkit::store_keys(t.borrow(), keys, salt, BS).await
}

/// Loads `keys` from the tier `t` (an `FsTier` or an `Arc` of one) as one job, blocks of
/// [`BS`]: [`load_keys`].
pub(crate) async fn load(
    t: &impl Borrow<FsTier>,
    keys: &[BlockKey],
) -> (kv_tier_core::JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    kv_tier_testkit::load_keys(t.borrow(), keys, BS).await
}

/// A bounded tier whose cap holds `cap_blocks` test blocks and whose low watermark holds
/// `watermark x cap_blocks` of them. The hard ceiling is out of the way: these tests drive
/// sweeps by hand (the ceiling has tests of its own).
pub(crate) fn hand_swept_cfg(root: &Path, cap_blocks: u64, watermark: f64) -> FsTierConfig {
    let mut c = cfg(root);
    let cap = held(root, cap_blocks);
    let low = watermark * (cap_blocks * BS as u64) as f64 + dirs(root) as f64 + 0.5;
    c.gc_max_size_gb = Some(cap as f64 / (1u64 << 30) as f64);
    c.gc_low_watermark = Some(low / cap as f64);
    c.gc_hard_ceiling = Some(1000.0);
    c.gc_grace_s = Some(300.0);
    c.gc_stamp_interval_s = Some(60.0);
    c.gc_interval_s = Some(3600.0);
    c.gc_background = false;
    c
}

/// A tier on `root` with [`hand_swept_cfg`] (a cap of `cap_blocks` test blocks, low
/// watermark `watermark`): sweeps by hand only.
pub(crate) fn open_hand_swept(root: &Path, cap_blocks: u64, watermark: f64) -> FsTier {
    FsTier::open("fs", hand_swept_cfg(root, cap_blocks, watermark), ns(), BS).unwrap()
}

/// [`cfg`] capped at `cap_bytes` with no background GC thread (sweeps by hand; the hard
/// ceiling at its default).
pub(crate) fn capped_no_thread_cfg(root: &Path, cap_bytes: u64) -> FsTierConfig {
    let mut c = cfg(root);
    c.gc_max_size_gb = Some(cap_bytes as f64 / (1u64 << 30) as f64);
    c.gc_background = false;
    c
}

/// A bounded tier whose cap holds `cap_blocks` blocks of one leaf and whose low watermark
/// holds `low_blocks` of them (the hard ceiling out of the way); GC driven by hand.
pub(crate) fn hand_swept_low_blocks_cfg(
    root: &Path,
    cap_blocks: u64,
    low_blocks: u64,
) -> FsTierConfig {
    let mut c = cfg(root);
    let cap = cap_blocks * BS as u64 + dirs(root);
    let low = low_blocks as f64 * BS as f64 + dirs(root) as f64 + 0.5;
    c.gc_max_size_gb = Some(cap as f64 / (1u64 << 30) as f64);
    c.gc_low_watermark = Some(low / cap as f64);
    c.gc_hard_ceiling = Some(1000.0);
    c.gc_interval_s = Some(3600.0);
    c.gc_background = false;
    c
}

/// [`cfg`] capped at `cap_blocks` x [`BS`] (directories not allowed for), low watermark 0.5,
/// the hard ceiling out of the way, grace 300 s, stamps every 60 s, no background GC.
pub(crate) fn block_cap_cfg(root: &Path, cap_blocks: u64) -> FsTierConfig {
    let mut c = cfg(root);
    c.gc_max_size_gb = Some((cap_blocks * BS as u64) as f64 / (1u64 << 30) as f64);
    c.gc_low_watermark = Some(0.5);
    c.gc_hard_ceiling = Some(1000.0);
    c.gc_grace_s = Some(300.0);
    c.gc_stamp_interval_s = Some(60.0);
    c.gc_interval_s = Some(3600.0);
    c.gc_background = false;
    c
}

/// The cap of the roomy shared root (the multi-process soak, the lease tests): 256 MiB.
pub(crate) const ROOMY_CAP_BYTES: u64 = 256 << 20;

/// The roomy shared root's lease period: 1 s.
pub(crate) const ROOMY_LEASE_S: f64 = 1.0;

/// Processes in the multi-process soak.
pub(crate) const SOAK_INSTANCES: u64 = 4;

/// Instance `id` of the roomy shared root: [`shared_fs_config`] with [`ROOMY_CAP_BYTES`],
/// [`ROOMY_LEASE_S`] and [`SHARED_STAMP_S`].
pub(crate) fn roomy_shared_cfg(root: &Path, id: &str) -> FsTierConfig {
    shared_fs_config(root, id, ROOMY_CAP_BYTES, ROOMY_LEASE_S, SHARED_STAMP_S)
}

/// Opens instance `id` of the roomy shared root on `root` in this process, with a lease of
/// `lease_s`.
pub(crate) fn open_instance(root: &Path, id: &str, lease_s: f64) -> FsTier {
    let mut c = roomy_shared_cfg(root, id);
    c.shared_lease_s = Some(lease_s);
    FsTier::open("fs", c, ns(), SHARED_BS).unwrap()
}

/// A GiB, the unit of `gc_max_size_gb`.
pub(crate) const GIB: f64 = (1u64 << 30) as f64;

/// `bytes` in GiB (for `gc_max_size_gb`).
pub(crate) fn gb(bytes: u64) -> f64 {
    bytes as f64 / GIB
}

/// The GC stats of a bounded tier (panics if it is unbounded).
pub(crate) fn gc_stats(t: &FsTier) -> GcStats {
    t.stats().gc.expect("bounded tier has GC stats")
}

/// Stores `keys` (salt 0) in `t` as one job of blocks of `bs` bytes.
pub(crate) async fn store_sized(t: &FsTier, keys: &[BlockKey], bs: usize) -> JobResult {
    store_keys(t, keys, 0, bs).await
}

/// Whether `e` is `Error::NoSpace`.
pub(crate) fn is_no_space(e: &Error) -> bool {
    matches!(e, Error::NoSpace { .. })
}

/// [`cfg`] capped at `cap` bytes, everything else default (the background GC on).
pub(crate) fn capped_cfg(root: &Path, cap: u64) -> FsTierConfig {
    let mut c = cfg(root);
    c.gc_max_size_gb = Some(gb(cap));
    c
}

/// A tier opened with `c` for blocks of `bs` bytes, in an `Arc`.
pub(crate) fn open_cfg(c: FsTierConfig, bs: usize) -> Arc<FsTier> {
    Arc::new(FsTier::open("fs", c, ns(), bs).unwrap())
}

/// [`capped_cfg`] for sweeps driven by hand: no background GC, the hard ceiling out of the way.
pub(crate) fn capped_hand_swept_cfg(root: &Path, cap: u64) -> FsTierConfig {
    let mut c = capped_cfg(root, cap);
    c.gc_background = false;
    c.gc_hard_ceiling = Some(1000.0);
    c
}

/// [`cfg`] with CRC32C checksums on.
pub(crate) fn checked_cfg(root: &Path) -> FsTierConfig {
    let mut c = cfg(root);
    c.checksum = Checksum::Crc32c;
    c
}

/// Bounds every wait: a wait that never ends fails its test instead of hanging it.
pub(crate) const LIMIT: Duration = Duration::from_secs(60);

/// A bounded tier config whose cap holds `cap_blocks` blocks of the one leaf directory of
/// [`leaf_key`] and whose low watermark holds 80% of them; GC by hand unless `background`.
pub(crate) fn leaf_cap_cfg(
    root: &Path,
    cap_blocks: u64,
    ceiling: f64,
    background: bool,
) -> FsTierConfig {
    use std::os::unix::fs::MetadataExt;
    let dirs = 2 * std::fs::metadata(root).unwrap().blocks() * 512;
    let cap = cap_blocks * BS as u64 + dirs;
    let low = 0.8 * (cap_blocks * BS as u64) as f64 + dirs as f64 + 0.5;
    let mut c = cfg(root);
    c.gc_max_size_gb = Some(cap as f64 / GIB);
    c.gc_low_watermark = Some(low / cap as f64);
    c.gc_hard_ceiling = Some(ceiling);
    c.gc_grace_s = Some(300.0);
    c.gc_stamp_interval_s = Some(60.0);
    c.gc_interval_s = Some(if background { 0.05 } else { 3600.0 });
    c.gc_background = background;
    c
}

/// The block size of the shared-root tests: 64 KiB.
pub(crate) const SHARED_BS: usize = 64 << 10;

/// The cap of the tight shared root (the tests that tamper with it): 8 MiB, 128 blocks.
pub(crate) const TIGHT_CAP: u64 = 8 << 20;

/// The tight shared root's lease period: 0.4 s.
pub(crate) const TIGHT_LEASE_S: f64 = 0.4;

/// The shared roots' stamp interval: 0.5 s.
pub(crate) const SHARED_STAMP_S: f64 = 0.5;

/// Instance `id` of the tight shared root: [`shared_fs_config`] with [`TIGHT_CAP`],
/// [`TIGHT_LEASE_S`], [`SHARED_STAMP_S`] and 2 read and 2 write threads.
pub(crate) fn tight_shared_cfg(root: &Path, id: &str) -> FsTierConfig {
    let mut c = shared_fs_config(root, id, TIGHT_CAP, TIGHT_LEASE_S, SHARED_STAMP_S);
    c.n_read_threads = 2;
    c.n_write_threads = 2;
    c
}

/// Opens instance `id` of the tight shared root on `root` (blocks of [`SHARED_BS`]).
pub(crate) fn open_tight(root: &Path, id: &str) -> FsTier {
    FsTier::open("fs", tight_shared_cfg(root, id), ns(), SHARED_BS).unwrap()
}

/// What the tight shared root's rank directory may hold at most: 1.10x [`TIGHT_CAP`].
pub(crate) fn tight_limit() -> u64 {
    (TIGHT_CAP as f64 * 1.10) as u64
}
