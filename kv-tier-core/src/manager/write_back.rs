//! Bounded write-back: how many bytes of store jobs each tier may have queued or in flight,
//! what happens beyond that (its policy), and how much DRAM all write-back may keep pinned.

use rustc_hash::{FxHashMap, FxHashSet};

use crate::buf::BlockSource;
use crate::error::Error;
use crate::key::BlockKey;
use crate::tier_options::{TierSettings, WriteBackPolicy};

/// One tier's store jobs queued or in flight.
#[derive(Debug, Default)]
struct Queue {
    bytes: u64,
    peak: u64,
    keys: FxHashSet<BlockKey>,
}

/// What a cascade to one tier was allowed to do.
#[derive(Debug, Default)]
pub(super) struct Admission {
    /// The blocks to write.
    pub(super) blocks: Vec<(BlockKey, BlockSource)>,
    /// Blocks not written: the tier's write-back (or the pinned DRAM) is at its limit and its
    /// policy is `drop`.
    pub(super) dropped: Vec<BlockKey>,
    /// Blocks already queued for this tier: not queued twice.
    pub(super) duplicates: u64,
}

#[derive(Debug)]
pub(super) struct WriteBack {
    settings: Vec<TierSettings>,
    queues: Vec<Queue>,
    /// Store jobs holding each pinned key.
    pinned: FxHashMap<BlockKey, u32>,
    pinned_bytes: u64,
    pinned_peak: u64,
    max_pinned_bytes: u64,
    /// Keys of stores prepared and not yet completed, while a tier's policy is `wait`: they
    /// will be admitted to it, so they count against its limit (and the pinned limit) now.
    reserved: FxHashSet<BlockKey>,
    reserved_bytes: u64,
    any_wait: bool,
}

impl WriteBack {
    pub(super) fn new(settings: Vec<TierSettings>, max_pinned_bytes: u64) -> Self {
        Self {
            queues: settings.iter().map(|_| Queue::default()).collect(),
            any_wait: settings
                .iter()
                .any(|s| s.write_back_policy == WriteBackPolicy::Wait),
            settings,
            pinned: FxHashMap::default(),
            pinned_bytes: 0,
            pinned_peak: 0,
            max_pinned_bytes,
            reserved: FxHashSet::default(),
            reserved_bytes: 0,
        }
    }

    pub(super) fn settings(&self, tier: usize) -> &TierSettings {
        &self.settings[tier]
    }

    /// Takes what tier `tier` may write of `blocks` now. A key already queued for the tier is
    /// skipped. Past the tier's limit (or the pinned-DRAM limit), a `drop` tier drops the
    /// rest; a `wait` tier takes everything (new stores are refused instead, see
    /// [`WriteBack::refusal`]).
    pub(super) fn admit(&mut self, tier: usize, blocks: Vec<(BlockKey, BlockSource)>) -> Admission {
        let mut a = Admission::default();
        let policy = self.settings[tier].write_back_policy;
        let limit = self.settings[tier].write_back_limit_bytes;
        for (k, src) in blocks {
            let len = src.len() as u64;
            let q = &self.queues[tier];
            if q.keys.contains(&k) {
                a.duplicates += 1;
                continue;
            }
            let new_pin = !self.pinned.contains_key(&k);
            let fits = q.bytes + len <= limit
                && (!new_pin
                    || self.pinned_bytes + self.reserved_bytes + len <= self.max_pinned_bytes);
            if !fits && policy == WriteBackPolicy::Drop {
                a.dropped.push(k);
                continue;
            }
            let q = &mut self.queues[tier];
            q.bytes += len;
            q.peak = q.peak.max(q.bytes);
            q.keys.insert(k);
            let n = self.pinned.entry(k).or_insert(0);
            *n += 1;
            if *n == 1 {
                self.pinned_bytes += len;
                self.pinned_peak = self.pinned_peak.max(self.pinned_bytes);
            }
            a.blocks.push((k, src));
        }
        a
    }

    /// A store job of `keys` (of `per_block` bytes each) to `tier` ended.
    pub(super) fn release(&mut self, tier: usize, keys: &[BlockKey], per_block: u64) {
        let q = &mut self.queues[tier];
        for k in keys {
            if q.keys.remove(k) {
                q.bytes = q.bytes.saturating_sub(per_block);
                if let Some(n) = self.pinned.get_mut(k) {
                    *n -= 1;
                    if *n == 0 {
                        self.pinned.remove(k);
                        self.pinned_bytes = self.pinned_bytes.saturating_sub(per_block);
                    }
                }
            }
        }
    }

    /// Why a store of `incoming` new bytes is refused now, if it is: it would take a `wait`
    /// tier's write-back, or the DRAM pinned by write-back, past its limit (counting the
    /// stores prepared and not completed). A store is never refused when nothing is queued
    /// or reserved: one larger than a limit is taken alone.
    pub(super) fn refusal(&self, names: &[String], incoming: u64) -> Option<Error> {
        if !self.any_wait || incoming == 0 {
            return None;
        }
        let past = |held: u64, limit: u64| held > 0 && held + incoming > limit;
        for (i, (s, q)) in self.settings.iter().zip(&self.queues).enumerate() {
            let held = q.bytes + self.reserved_bytes;
            if s.write_back_policy == WriteBackPolicy::Wait && past(held, s.write_back_limit_bytes)
            {
                return Some(Error::WriteBackFull {
                    tier: names[i].clone(),
                    queued_bytes: held,
                    limit_bytes: s.write_back_limit_bytes,
                });
            }
        }
        let held = self.pinned_bytes + self.reserved_bytes;
        if past(held, self.max_pinned_bytes) {
            return Some(Error::WriteBackFull {
                tier: crate::tier::PRIMARY_TIER_NAME.into(),
                queued_bytes: held,
                limit_bytes: self.max_pinned_bytes,
            });
        }
        None
    }

    /// A store of `keys` was prepared: while a tier waits, they count against the limits
    /// until [`WriteBack::unreserve`].
    pub(super) fn reserve(&mut self, keys: impl IntoIterator<Item = BlockKey>, per_block: u64) {
        if !self.any_wait {
            return;
        }
        for k in keys {
            if self.reserved.insert(k) {
                self.reserved_bytes += per_block;
            }
        }
    }

    /// The store of `keys` was completed (or failed): they no longer count as reserved.
    pub(super) fn unreserve(&mut self, keys: &[BlockKey], per_block: u64) {
        if self.reserved.is_empty() {
            return;
        }
        for k in keys {
            if self.reserved.remove(k) {
                self.reserved_bytes = self.reserved_bytes.saturating_sub(per_block);
            }
        }
    }

    /// (queued bytes, peak) of `tier`.
    pub(super) fn queued(&self, tier: usize) -> (u64, u64) {
        (self.queues[tier].bytes, self.queues[tier].peak)
    }

    /// (pinned bytes, peak) of all write-back.
    pub(super) fn pinned(&self) -> (u64, u64) {
        (self.pinned_bytes, self.pinned_peak)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn src() -> BlockSource {
        BlockSource::from_bytes(vec![0u8; 100])
    }

    fn settings(policy: WriteBackPolicy, limit: u64) -> TierSettings {
        TierSettings {
            probe_budget: Duration::from_millis(50),
            write_back_limit_bytes: limit,
            write_back_policy: policy,
            events: false,
            locality: None,
            admit_after_lookups: 0,
            write_budget_bytes_per_s: None,
            chain_eviction: false,
        }
    }

    #[test]
    fn a_key_queued_for_a_tier_is_not_queued_twice_and_release_frees_it() {
        let k = BlockKey::from_hash32([1; 32], 0);
        let mut wb = WriteBack::new(vec![settings(WriteBackPolicy::Drop, 1000)], 1000);
        assert_eq!(wb.admit(0, vec![(k, src())]).blocks.len(), 1);
        let again = wb.admit(0, vec![(k, src())]);
        assert_eq!((again.blocks.len(), again.duplicates), (0, 1));
        assert_eq!(wb.queued(0), (100, 100));
        assert_eq!(wb.pinned(), (100, 100));
        wb.release(0, &[k], 100);
        assert_eq!(wb.queued(0).0, 0);
        assert_eq!(wb.pinned().0, 0);
        assert_eq!(wb.admit(0, vec![(k, src())]).blocks.len(), 1);
    }

    #[test]
    fn a_wait_tier_refuses_only_past_its_limit() {
        let names = vec!["t".to_string()];
        let mut wb = WriteBack::new(vec![settings(WriteBackPolicy::Wait, 300)], 10_000);
        assert!(
            wb.refusal(&names, 500).is_none(),
            "alone, one past the limit"
        );
        let k = BlockKey::from_hash32([1; 32], 0);
        assert_eq!(wb.admit(0, vec![(k, src())]).blocks.len(), 1);
        assert!(wb.refusal(&names, 0).is_none(), "nothing incoming");
        assert!(
            wb.refusal(&names, 200).is_none(),
            "100 held + 200 is the limit"
        );
        let Some(Error::WriteBackFull {
            tier,
            queued_bytes,
            limit_bytes,
        }) = wb.refusal(&names, 201)
        else {
            panic!("past the limit and not refused");
        };
        assert_eq!((tier.as_str(), queued_bytes, limit_bytes), ("t", 100, 300));
    }

    #[test]
    fn the_dram_limit_counts_pinned_and_reserved_bytes() {
        let names = vec!["t".to_string()];
        let mut wb = WriteBack::new(vec![settings(WriteBackPolicy::Wait, 100_000)], 250);
        assert_eq!(
            wb.admit(0, vec![(BlockKey::from_hash32([1; 32], 0), src())])
                .blocks
                .len(),
            1
        );
        wb.reserve([BlockKey::from_hash32([2; 32], 0)], 100);
        assert!(
            wb.refusal(&names, 50).is_none(),
            "100 pinned + 100 reserved + 50"
        );
        let Some(Error::WriteBackFull {
            tier, queued_bytes, ..
        }) = wb.refusal(&names, 51)
        else {
            panic!("past the DRAM limit and not refused");
        };
        assert_eq!(
            (tier.as_str(), queued_bytes),
            (crate::tier::PRIMARY_TIER_NAME, 200)
        );
    }

    #[test]
    fn a_key_pinned_by_two_tiers_counts_once() {
        let k = BlockKey::from_hash32([1; 32], 0);
        let s = settings(WriteBackPolicy::Drop, 1000);
        let mut wb = WriteBack::new(vec![s, s], 150);
        assert_eq!(wb.admit(0, vec![(k, src())]).blocks.len(), 1);
        assert_eq!(wb.admit(1, vec![(k, src())]).blocks.len(), 1);
        assert_eq!(wb.pinned().0, 100);
        let other = BlockKey::from_hash32([2; 32], 0);
        assert_eq!(
            wb.admit(1, vec![(other, src())]).dropped,
            vec![other],
            "past the pinned limit"
        );
        wb.release(0, &[k], 100);
        assert_eq!(wb.pinned().0, 100, "tier 1 still holds it");
        wb.release(1, &[k], 100);
        assert_eq!(wb.pinned().0, 0);
    }
}
