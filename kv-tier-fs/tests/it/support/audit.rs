//! Checks of a tier against the disk and its events: each job accounts for its keys, a key's
//! last event says whether its file is there, the index sums what `du` shows.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, JobResult, SecondaryTier, TierEvent};
use kv_tier_fs::FsTier;
use kv_tier_testkit::wait::poll_until_async;
use kv_tier_testkit::{allocated_bytes, verify_block};

use super::*;

/// Whether `key`'s last event is a removal (`None`: no event of it).
pub(crate) fn last_removed(ev: &[TierEvent], key: &BlockKey) -> Option<bool> {
    ev.iter()
        .rev()
        .find(|e| e.keys.contains(key))
        .map(|e| e.removed)
}

/// Loads `k` expecting a miss that removed the file and reported it; then a store rewrites
/// it and it loads verified.
pub(crate) async fn assert_miss_then_heals(tier: &FsTier, k: BlockKey, what: &str) {
    tier.take_events();
    let (res, data) = load(tier, &[k]).await;
    assert!(data.is_empty(), "{what}: unverified bytes were served");
    assert!(
        matches!(res.failed[0].1, Error::Corrupt { .. }),
        "{what}: {:?}",
        res.failed
    );
    let p = tier.block_path(&k);
    assert!(
        std::fs::symlink_metadata(&p).is_err(),
        "{what}: the damage was kept"
    );
    assert_eq!(removed(tier), vec![k], "{what}: no BlockRemoved");
    assert_eq!(tier.lookup(&[k]).await.unwrap(), vec![false], "{what}");
    assert!(fs_store(tier, &[k], 4).await.is_success());
    let (res, data) = load(tier, &[k]).await;
    assert!(res.is_success(), "{what}: {:?}", res.failed);
    assert!(verify_block(&k, 4, &data[0].1), "{what}");
}

/// Events taken so far, in order, as (key, removed).
pub(crate) fn drain_events(t: &FsTier, into: &mut Vec<(BlockKey, bool)>) {
    for e in t.take_events() {
        for k in e.keys {
            into.push((k, e.removed));
        }
    }
}

/// Every key of the job is in exactly one of the result's lists, once per occurrence.
pub(crate) fn assert_accounts(res: &JobResult, keys: &[BlockKey], what: &str) {
    let mut want: HashMap<BlockKey, usize> = HashMap::new();
    for k in keys {
        *want.entry(*k).or_default() += 1;
    }
    let mut got: HashMap<BlockKey, usize> = HashMap::new();
    for k in res.ok.iter().chain(res.failed.iter().map(|(k, _)| k)) {
        *got.entry(*k).or_default() += 1;
    }
    assert_eq!(
        got, want,
        "{what}: the job result does not account for every key exactly once: ok {:?} failed {:?}",
        res.ok, res.failed
    );
}

/// The keys of the removal events taken from `tier` now.
pub(crate) fn removed(tier: &FsTier) -> Vec<BlockKey> {
    kv_tier_testkit::removed_keys(tier.take_events())
}

/// Waits until the tier's write/read counters have not moved for 300 ms and no key of
/// `keys` is protected (I/O of dropped jobs has ended); at most 15 s.
pub(crate) async fn quiesce(tier: &FsTier, keys: &[BlockKey]) {
    let sig = |t: &FsTier| {
        let b = t.stats().blocks;
        (
            b.blocks_written,
            b.stores_skipped,
            b.store_failures,
            b.blocks_read,
            b.load_misses,
            b.load_failures,
        )
    };
    let mut last = sig(tier);
    let mut since = Instant::now();
    let mut protected = true;
    let quiet = poll_until_async(Duration::from_secs(15), || {
        let now = sig(tier);
        if now != last {
            last = now;
            since = Instant::now();
        }
        protected = keys.iter().any(|k| tier.is_protected(k));
        !protected && since.elapsed() > Duration::from_millis(300)
    })
    .await;
    assert!(
        quiet,
        "the tier never went quiet (protected keys: {protected})"
    );
}

/// The event audit (README, "Events"), against the disk, of a quiet tier whose events since
/// open are `log`: for every key of `keys`, its last event is a removal exactly when no file is
/// there, it is never reported removed twice in a row, and its first event is a removal only
/// if its file predates the tier's open (`predating`); a file with no event at all predates
/// the open too. Nothing was dropped.
pub(crate) fn check_events(
    tier: &FsTier,
    log: &[TierEvent],
    keys: &[BlockKey],
    predating: &HashSet<BlockKey>,
    what: &str,
) {
    assert_eq!(tier.events_dropped(), 0, "{what}: events dropped");
    let mut seqs: HashMap<BlockKey, Vec<bool>> = HashMap::new();
    for e in log {
        for k in &e.keys {
            seqs.entry(*k).or_default().push(e.removed);
        }
    }
    let mut problems = Vec::new();
    for (i, k) in keys.iter().enumerate() {
        let on_disk = is_regular(&tier.block_path(k));
        let seq = seqs.get(k).cloned().unwrap_or_default();
        match seq.last() {
            Some(&last) if last == on_disk => problems.push(format!(
                "key {i}: last event removed={last} but file on disk={on_disk} (events {seq:?})"
            )),
            None if on_disk && !predating.contains(k) => {
                problems.push(format!("key {i}: a file on disk and no event of it"))
            }
            _ => {}
        }
        if seq.windows(2).any(|w| w[0] && w[1]) {
            problems.push(format!("key {i}: removed twice in a row (events {seq:?})"));
        }
        if seq.first() == Some(&true) && !predating.contains(k) {
            problems.push(format!(
                "key {i}: first event a removal, file not from before the open (events {seq:?})"
            ));
        }
    }
    assert!(problems.is_empty(), "{what}:\n{}", problems.join("\n"));
}

/// The accounting audit (README, "Accounting"; `GcStats`) of a quiet tier: `bytes` is `du`
/// of the rank directory, `files` the number of `.bin` files, the peak within the ceiling.
pub(crate) fn check_stats(tier: &FsTier, root: &Path, what: &str) {
    let s = gc_stats(tier);
    let du = allocated_bytes(&rank_dir(root));
    let bins = regular_files(&rank_dir(root), ".bin").len() as u64;
    assert_eq!(
        (s.bytes, s.files),
        (du, bins),
        "{what}: (bytes, files) accounted vs (du, .bin files) on disk: {s:?}"
    );
    assert!(
        s.peak_bytes <= s.hard_ceiling_bytes,
        "{what}: peak {} above the hard ceiling {}: {s:?}",
        s.peak_bytes,
        s.hard_ceiling_bytes
    );
}

/// Appends the events taken from `tier` now to `log`.
pub(crate) fn drain_log(tier: &FsTier, log: &mut Vec<TierEvent>) {
    log.extend(tier.take_events());
}

/// How many times `log` reports `k` removed.
pub(crate) fn removals_of(log: &[TierEvent], k: &BlockKey) -> usize {
    log.iter()
        .filter(|e| e.removed && e.keys.contains(k))
        .map(|e| e.keys.iter().filter(|x| *x == k).count())
        .sum()
}

/// Loads `keys` and checks every block served is the one stored (salt 0).
pub(crate) async fn load_verified(tier: &FsTier, keys: &[BlockKey], what: &str) -> usize {
    let (_, got) = load(tier, keys).await;
    for (k, b) in &got {
        assert!(verify_block(k, 0, b), "{what}: wrong bytes served for {k}");
    }
    got.len()
}
