//! Small helpers: deterministic keys and block bytes, temp roots, gates.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use kv_tier_core::{BlockKey, BlockSink, BlockSource, SinkReader};
use tokio::sync::Notify;

/// A deterministic 32-byte key for test index `i` (group 0).
pub fn test_key(i: u64) -> BlockKey {
    test_key_in_group(i, 0)
}

/// A deterministic 32-byte key for test index `i` in `group`.
pub fn test_key_in_group(i: u64, group: u32) -> BlockKey {
    let mut h = [0u8; 32];
    let mut x = i ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in h.chunks_mut(8) {
        x = splitmix(x);
        chunk.copy_from_slice(&x.to_le_bytes());
    }
    BlockKey::from_hash32(h, group)
}

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn key_seed(key: &BlockKey, salt: u64) -> u64 {
    let mut s = salt ^ (key.group() as u64).rotate_left(32);
    for chunk in key.hash_bytes().chunks(8) {
        let mut b = [0u8; 8];
        b[..chunk.len()].copy_from_slice(chunk);
        s = splitmix(s ^ u64::from_le_bytes(b));
    }
    s
}

/// Fills `buf` with bytes derived from `key` (and `salt`, to tell writers apart).
pub fn fill_block(key: &BlockKey, salt: u64, buf: &mut [u8]) {
    let mut x = key_seed(key, salt);
    let mut chunks = buf.chunks_exact_mut(8);
    for c in &mut chunks {
        x = x
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        c.copy_from_slice(&x.to_le_bytes());
    }
    let rest = chunks.into_remainder();
    x = splitmix(x);
    let tail = x.to_le_bytes();
    rest.copy_from_slice(&tail[..rest.len()]);
}

/// The bytes [`fill_block`] produces.
pub fn block_bytes(key: &BlockKey, salt: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    fill_block(key, salt, &mut v);
    v
}

/// Whether `data` is exactly what [`fill_block`] produces for `key` and `salt`.
pub fn verify_block(key: &BlockKey, salt: u64, data: &[u8]) -> bool {
    data == block_bytes(key, salt, data.len())
}

/// A page-aligned source holding [`block_bytes`] of `key`.
pub fn source_for(key: &BlockKey, salt: u64, len: usize) -> BlockSource {
    let mut buf = kv_tier_core::AlignedBuf::zeroed(len);
    fill_block(key, salt, buf.as_mut_slice());
    BlockSource::from_owner(buf)
}

/// A sink of `len` bytes and the reader that gets them back.
pub fn sink(len: usize) -> (BlockSink, SinkReader) {
    BlockSink::pair(len)
}

/// The namespace tier tests write in: model `test-org/test-model`, `torch.float16`, 16 tokens
/// a hash, rank 0.
pub fn test_namespace() -> kv_tier_core::Namespace {
    kv_tier_core::Namespace::new(
        kv_tier_core::RunFields::new("test-org/test-model", "torch.float16", 16),
        0,
    )
    .expect("a valid namespace")
}

/// A temporary directory for a tier's root, removed on drop.
pub fn temp_root() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("kv-tier-test-")
        .tempdir()
        .expect("create a temp dir")
}

/// Calls `f` with every entry below `dir` (recursively, not following links; `dir` itself
/// not visited) and its metadata. Entries that vanish while it walks are skipped.
pub fn walk(dir: &Path, mut f: impl FnMut(std::path::PathBuf, std::fs::Metadata)) {
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let Ok(m) = e.metadata() else { continue };
            if m.is_dir() {
                stack.push(e.path());
            }
            f(e.path(), m);
        }
    }
}

/// Allocated bytes below `dir` (`st_blocks` x 512 of every file and directory in it,
/// recursively; `dir` itself not counted): what `du` shows, and what the fs tier's cap
/// bounds. Entries that vanish while it walks are skipped.
pub fn allocated_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    walk(dir, |_, m| total += m.blocks() * 512);
    total
}

/// Allocated bytes below `dir` that were all there at one instant: what [`allocated_bytes`]
/// counts, less every entry that is gone or replaced (another inode, or other blocks) when the
/// walk has ended. A walk is not a snapshot: under churn it counts a file deleted after it was
/// counted and one created after that, as if they were there together. Every entry counted
/// here existed from its first look until its second, so all of them at the instant the walk
/// ended: a lower bound of the use at that instant (entries created behind the walk are left
/// out; the next walk sees them).
pub fn allocated_bytes_at_once(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = Vec::new();
    walk(dir, |p, m| seen.push((p, m)));
    seen.iter()
        .filter(|(p, m)| {
            std::fs::symlink_metadata(p).is_ok_and(|now| {
                // not the times: a touch (the fs tier's recency) changes them in place
                (now.dev(), now.ino(), now.blocks()) == (m.dev(), m.ino(), m.blocks())
            })
        })
        .map(|(_, m)| m.blocks() * 512)
        .sum()
}

/// The files below `dir` whose names end with `suffix` (recursively), sorted.
pub fn find_files(dir: &Path, suffix: &str) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    walk(dir, |p, m| {
        if !m.is_dir() && p.to_string_lossy().ends_with(suffix) {
            out.push(p);
        }
    });
    out.sort();
    out
}

/// A gate that holds async operations until opened, and counts those that reached it:
/// the tool for driving interleavings deterministically, without sleeps.
#[derive(Clone, Default)]
pub struct Gate {
    inner: Arc<GateInner>,
}

#[derive(Default)]
struct GateInner {
    open: AtomicBool,
    arrived: AtomicUsize,
    notify: Notify,
}

impl std::fmt::Debug for Gate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gate")
            .field("open", &self.inner.open.load(Ordering::SeqCst))
            .field("arrived", &self.inner.arrived.load(Ordering::SeqCst))
            .finish()
    }
}

impl Gate {
    /// A closed gate.
    pub fn new() -> Self {
        Self::default()
    }

    /// Opens the gate: every waiting and future operation passes.
    pub fn open(&self) {
        self.inner.open.store(true, Ordering::SeqCst);
        self.inner.notify.notify_waiters();
    }

    /// Whether the gate is open.
    pub fn is_open(&self) -> bool {
        self.inner.open.load(Ordering::SeqCst)
    }

    /// How many operations have reached the gate.
    pub fn arrived(&self) -> usize {
        self.inner.arrived.load(Ordering::SeqCst)
    }

    /// Called by the held operation: counts itself, then waits until the gate opens.
    pub async fn pass(&self) {
        self.inner.arrived.fetch_add(1, Ordering::SeqCst);
        self.inner.notify.notify_waiters();
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.is_open() {
                return;
            }
            notified.await;
        }
    }

    /// Waits until at least `n` operations have reached the gate.
    pub async fn wait_arrived(&self, n: usize) {
        loop {
            let notified = self.inner.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.arrived() >= n {
                return;
            }
            notified.await;
        }
    }
}

/// Waits (at most 10 s) until one of `lookup`'s probes has reported (`notify` is the one the
/// lookup was made with). A wait without a deadline would turn a failure into a hang.
pub async fn wait_probe_results(lookup: &kv_tier_core::ProbeCache, notify: &Notify) {
    let done = tokio::time::timeout(std::time::Duration::from_secs(10), async {
        while !lookup.has_results() {
            notify.notified().await;
        }
    })
    .await;
    assert!(done.is_ok(), "no probe reported within 10 s");
}

/// A manager builder whose primary is the DRAM tier `cfg` sizes, with an empty registry:
/// what `kv_tier::builder` does, without the built-in tiers (tests add theirs).
pub fn dram_manager_builder(
    cfg: kv_tier_core::KvTierConfig,
) -> kv_tier_core::Result<kv_tier_core::TieringManagerBuilder> {
    let cpu = kv_tier_cpu::CpuTier::from_config(&cfg)?;
    Ok(kv_tier_core::TieringManager::builder(cfg).primary(Arc::new(cpu)))
}

/// An LRU DRAM tier of `slots` blocks of `block_size` bytes, not prefaulted (for tests).
pub fn lru_dram(slots: usize, block_size: usize) -> Arc<kv_tier_cpu::CpuTier> {
    Arc::new(
        kv_tier_cpu::CpuTier::new(kv_tier_cpu::CpuTierConfig {
            capacity_bytes: (slots * block_size) as u64,
            block_size,
            policy: kv_tier_core::EvictionPolicy::Lru,
            prefault: false,
        })
        .expect("a valid DRAM tier"),
    )
}

/// The engine's store path through a manager: prepare `keys`, write each new block's
/// [`block_bytes`] (salt 0) as the GPU -> DRAM copy would, complete the store for `req`.
/// Fails, storing nothing, if the manager refuses the store (no DRAM room, write-back full).
pub fn try_engine_store(
    m: &kv_tier_core::TieringManager,
    req: kv_tier_core::RequestId,
    keys: &[BlockKey],
) -> kv_tier_core::Result<()> {
    let mut p = m.prepare_store(keys)?;
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(req);
    Ok(())
}

/// [`try_engine_store`] that panics if the manager refuses the store.
pub fn engine_store(
    m: &kv_tier_core::TieringManager,
    req: kv_tier_core::RequestId,
    keys: &[BlockKey],
) {
    try_engine_store(m, req, keys).expect("the manager refused a store");
}

/// How long [`store_keys`] and [`load_keys`] wait for a tier's job before the test fails: a
/// tier that hangs fails its test instead of hanging the suite.
pub const JOB_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

async fn within_deadline<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(JOB_DEADLINE, f)
        .await
        .unwrap_or_else(|_| panic!("the tier's {what} job hung past {JOB_DEADLINE:?}"))
}

/// Stores `keys` in `tier` as one job, each block [`block_bytes`] of its key and `salt`.
/// Panics if the job does not end within [`JOB_DEADLINE`].
pub async fn store_keys(
    tier: &dyn kv_tier_core::SecondaryTier,
    keys: &[BlockKey],
    salt: u64,
    block_size: usize,
) -> kv_tier_core::JobResult {
    let blocks = keys
        .iter()
        .map(|k| (*k, source_for(k, salt, block_size)))
        .collect();
    within_deadline(
        "store",
        tier.store(kv_tier_core::StoreJob {
            links: Vec::new(),
            requests: Vec::new(),
            blocks,
        }),
    )
    .await
}

/// Asserts that `tier` reports each block of a load as it lands
/// ([`kv_tier_core::LoadProgress::landed`]): `keys` stored, then loaded with one key it does
/// not have, the blocks reported are exactly the ones loaded, each once, the missing one not.
pub async fn assert_loads_report_what_landed(
    tier: &dyn kv_tier_core::SecondaryTier,
    keys: &[BlockKey],
    missing: BlockKey,
    block_size: usize,
) {
    assert!(store_keys(tier, keys, 0, block_size).await.is_success());
    let mut job = kv_tier_core::LoadJob::default();
    let mut readers = Vec::new();
    for k in keys.iter().chain([&missing]) {
        let (s, r) = sink(block_size);
        job.blocks.push((*k, s));
        readers.push(r);
    }
    let progress = job.progress.clone();
    let res = within_deadline("load", tier.load(job)).await;
    let reported = progress.keys();
    let set = |ks: &[BlockKey]| ks.iter().copied().collect::<std::collections::HashSet<_>>();
    assert_eq!(set(&res.ok), set(keys), "{res:?}");
    assert_eq!(
        set(&reported),
        set(&res.ok),
        "reported landed, against loaded: {res:?}"
    );
    assert_eq!(
        reported.len(),
        res.ok.len(),
        "a block reported twice: {reported:?}"
    );
    assert!(!reported.contains(&missing));
}

/// Loads `keys` from `tier` as one job; returns the result and the bytes of each key that
/// loaded (a key given more than once is returned once per sink, and not at all if any of
/// its loads failed: the result does not say which sink that was). Panics if the job does
/// not end within [`JOB_DEADLINE`].
pub async fn load_keys(
    tier: &dyn kv_tier_core::SecondaryTier,
    keys: &[BlockKey],
    block_size: usize,
) -> (kv_tier_core::JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    let mut job = kv_tier_core::LoadJob::default();
    let mut readers = Vec::new();
    for k in keys {
        let (s, r) = sink(block_size);
        job.blocks.push((*k, s));
        readers.push((*k, r));
    }
    let progress = job.progress.clone();
    let res = within_deadline("load", tier.load(job)).await;
    // what the tier reported landed (`LoadProgress::landed`), it reports loaded
    let landed = progress.keys();
    for k in &landed {
        let reported = landed.iter().filter(|l| *l == k).count();
        let loaded = res.ok.iter().filter(|l| *l == k).count();
        assert!(
            reported <= loaded,
            "{k} reported landed {reported} times, loaded {loaded}: {res:?}"
        );
    }
    let ok: std::collections::HashSet<BlockKey> = res.ok.iter().copied().collect();
    // a key given twice whose loads went two ways is in both lists, and which of its sinks
    // was filled is not said: neither is served
    let failed: std::collections::HashSet<BlockKey> = res.failed.iter().map(|(k, _)| *k).collect();
    let mut out = Vec::new();
    for (k, r) in readers {
        let bytes = r
            .into_bytes()
            .expect("the tier kept a sink after its load returned");
        if ok.contains(&k) && !failed.contains(&k) {
            out.push((k, bytes));
        }
    }
    (res, out)
}

/// Numbers as a user could write them in a config JSON, across and far beyond any sensible
/// range (negative, zero, tiny, fractional, huge, the integer limits, a string): for tests
/// that every numeric option is refused naming its field, or works, and never panics.
pub const CONFIG_NUMBERS: &[&str] = &[
    "-1",
    "0",
    "1e-9",
    "0.5",
    "1",
    "1000",
    "1e9",
    "1e11",
    "1e19",
    "1e20",
    "1e300",
    "4294967295",
    "18446744073709551615",
    "\"7\"",
];

/// The keys of the removal events among `events`, in order.
pub fn removed_keys(events: Vec<kv_tier_core::TierEvent>) -> Vec<BlockKey> {
    events
        .into_iter()
        .filter(|e| e.removed)
        .flat_map(|e| e.keys)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_blocks_are_deterministic() {
        assert_eq!(test_key(5), test_key(5));
        assert_ne!(test_key(5), test_key(6));
        let k = test_key(1);
        let a = block_bytes(&k, 0, 1001);
        assert!(verify_block(&k, 0, &a));
        assert!(!verify_block(&k, 1, &a));
        assert!(!verify_block(&test_key(2), 0, &a));
    }

    #[tokio::test]
    async fn gate_holds_until_opened() {
        let g = Gate::new();
        let g2 = g.clone();
        let t = tokio::spawn(async move {
            g2.pass().await;
            7
        });
        g.wait_arrived(1).await;
        assert!(!t.is_finished());
        g.open();
        assert_eq!(t.await.unwrap(), 7);
    }
}
