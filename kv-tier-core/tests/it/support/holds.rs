//! The promotion-hold tests' fixture ([`HoldFx`]: a manager of [`SLOTS`] DRAM blocks over one
//! fault-injecting tier, with its own step and cleanliness check), fresh filler keys, and the
//! random model check of who holds what.

use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::LookupResult::{self, *};
use kv_tier_core::{
    BlockKey, EvictionPolicy, KvTierConfig, PrimaryTier, RequestContext, RequestId, SecondaryTier,
    StoreJob, TieringManager,
};
use kv_tier_cpu::{CpuTier, CpuTierConfig};
use kv_tier_testkit::util::test_key_in_group;
use kv_tier_testkit::util::try_engine_store;
use kv_tier_testkit::{FaultyTier, MemoryTier, source_for, test_key, verify_block};

use super::*;

/// A manager of [`SLOTS`] DRAM blocks over a fault-injecting tier (`ft`) on a memory tier (`mem`).
pub(crate) struct HoldFx {
    pub(crate) m: TieringManager,
    pub(crate) cpu: Arc<CpuTier>,
    pub(crate) ft: Arc<FaultyTier>,
    pub(crate) mem: Arc<MemoryTier>,
}

/// A [`HoldFx`] whose memory tier holds `seeded`, its config changed by `cfg` first.
pub(crate) async fn hold_fx_with(
    cfg: impl FnOnce(&mut KvTierConfig),
    seeded: &[BlockKey],
) -> HoldFx {
    let mem = Arc::new(MemoryTier::new("fs", BS));
    if !seeded.is_empty() {
        let job = StoreJob {
            links: Vec::new(),
            requests: Vec::new(),
            blocks: seeded.iter().map(|k| (*k, source_for(k, 0, BS))).collect(),
        };
        assert!(mem.store(job).await.is_success());
    }
    let ft = Arc::new(FaultyTier::new(mem.clone()));
    let cpu = Arc::new(
        CpuTier::new(CpuTierConfig {
            capacity_bytes: (SLOTS * BS) as u64,
            block_size: BS,
            policy: EvictionPolicy::Lru,
            prefault: true,
        })
        .unwrap(),
    );
    let mut c = KvTierConfig::new((SLOTS * BS) as u64, BS as u64);
    cfg(&mut c);
    let m = TieringManager::builder(c)
        .primary(cpu.clone())
        .tier(ft.clone())
        .build()
        .await
        .unwrap();
    HoldFx { m, cpu, ft, mem }
}

/// [`hold_fx_with`] the default config.
pub(crate) async fn hold_fx(seeded: &[BlockKey]) -> HoldFx {
    hold_fx_with(|_| {}, seeded).await
}

/// The next free range of [`fillers`] keys.
static NEXT_FILLER: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// `n` keys never used before (in this process), to fill DRAM with.
pub(crate) fn fillers(n: usize) -> Vec<BlockKey> {
    let base = NEXT_FILLER.fetch_add(1000, std::sync::atomic::Ordering::Relaxed);
    (0..n as u64)
        .map(|i| test_key_in_group(100_000 + base + i, 0))
        .collect()
}

impl HoldFx {
    /// One step: lookup_many then schedule end then wait.
    pub(crate) async fn step(&self, keys: &[BlockKey], req: &RequestContext) -> Vec<LookupResult> {
        let r = self.m.lookup_many(keys, req);
        self.m.on_schedule_end();
        self.m.wait_idle().await;
        r
    }

    /// Every request has finished: nothing held, nothing writing, DRAM fully usable.
    pub(crate) async fn assert_clean(&self, what: &str) {
        self.m.wait_idle().await;
        self.m.on_schedule_end();
        let s = self.m.stats();
        assert_eq!(s.held_blocks, 0, "{what}: held_blocks");
        assert_eq!(s.primary.writing_blocks, 0, "{what}: writing_blocks");
        let f = fillers(SLOTS);
        if let Err(e) = try_engine_store(&self.m, RequestId(9_999), &f) {
            panic!("{what}: DRAM not fully usable: {e}");
        }
        self.m.on_request_finished(RequestId(9_999));
        self.m.on_schedule_end();
        self.m.wait_idle().await;
    }
}

/// Probes `k(1)` for `req` and lets the promotion land: Ready in DRAM, not yet read.
pub(crate) async fn promote(fx: &HoldFx, req: &RequestContext) {
    assert_eq!(fx.m.lookup(&test_key(1), req), LookupResult::Retry);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.m.lookup(&test_key(1), req), LookupResult::HitPending);
    fx.m.on_schedule_end();
    fx.m.wait_idle().await;
    assert_eq!(fx.cpu.lookup(&test_key(1)), LookupResult::Hit, "landed");
    assert_eq!(fx.m.stats().held_blocks, 1);
}

/// One exact run of the model check ([`fuzz_inner`]) with `seed`, with or without faults.
pub(crate) async fn fuzz_one(seed: u64, faults: bool) {
    fuzz_inner(seed, faults, true).await
}

/// The model check: a random mix of lookups, reads, finishes, stores, polls, touches and resets
/// for 60 steps; with `exact`, after every step, `held_blocks` and `holding_requests` equal the
/// model's, a held key answers `Hit` to its request and bytes verify; at the end nothing is held
/// or pinned. Without `exact` the tier is slowed and steps do not wait (timing, no model).
pub(crate) async fn fuzz_inner(seed: u64, faults: bool, exact: bool) {
    use std::collections::BTreeSet;
    let tier_keys: Vec<BlockKey> = (1..=6).map(test_key).collect();
    let fx = hold_fx(&tier_keys).await;
    if !exact {
        fx.ft.delay(Some(Duration::from_micros(300)));
    }
    let mut rng = Rng::new(seed);
    let all: Vec<BlockKey> = (1..=8).map(test_key).collect(); // 7, 8 in no tier
    // the model: (request, key) told HitPending (promotion on its way), holding (landed),
    // answered Hit this step, and keys read this step
    let mut pending: BTreeSet<(u64, BlockKey)> = BTreeSet::new();
    let mut held: BTreeSet<(u64, BlockKey)> = BTreeSet::new();
    let mut hit: BTreeSet<(u64, BlockKey)> = BTreeSet::new();
    let mut read: BTreeSet<BlockKey> = BTreeSet::new();
    let mut live: BTreeSet<u64> = BTreeSet::new();
    let mut next_req = 1u64;
    let mut trace = Vec::new();
    for step in 0..60 {
        if faults && rng.below(5) == 0 {
            fx.ft.fail_load(&[all[rng.below(6) as usize]]);
            trace.push("fault".to_string());
        }
        for _ in 0..rng.below(5) {
            match rng.below(10) {
                0..=5 => {
                    if live.is_empty() || rng.below(4) == 0 {
                        live.insert(next_req);
                        next_req += 1;
                    }
                    let ids: Vec<u64> = live.iter().copied().collect();
                    let id = ids[rng.below(ids.len() as u64) as usize];
                    let r = RequestContext::new(id);
                    let start = rng.below(4) as usize;
                    let len = 1 + rng.below(5) as usize;
                    let keys: Vec<BlockKey> = all[start..(start + len).min(all.len())].to_vec();
                    let v = if keys.len() == 1 && rng.below(2) == 0 {
                        vec![fx.m.lookup(&keys[0], &r)]
                    } else {
                        fx.m.lookup_many(&keys, &r)
                    };
                    trace.push(format!(
                        "s{step} r{id} {:?} -> {v:?}",
                        &keys
                            .iter()
                            .map(|k| all.iter().position(|a| a == k).unwrap() + 1)
                            .collect::<Vec<_>>()
                    ));
                    for (i, res) in v.iter().enumerate() {
                        let key = keys[i];
                        if held.contains(&(id, key)) {
                            assert_eq!(
                                *res,
                                Hit,
                                "seed {seed}: held key answered {res:?}\n{}",
                                trace.join("\n")
                            );
                            hit.insert((id, key));
                        }
                        match res {
                            // only promotions write these keys: promised to this request
                            HitPending => {
                                pending.insert((id, key));
                            }
                            Miss => {
                                // the prefix stops here: this key and the rest of the call
                                for k in &keys[i..] {
                                    pending.remove(&(id, *k));
                                    held.remove(&(id, *k));
                                }
                            }
                            _ => {}
                        }
                    }
                    let hits = count_hits(&v);
                    if hits > 0 && rng.below(2) == 0 {
                        let views = fx.m.prepare_load(&keys[..hits]).unwrap();
                        for (kk, vv) in keys.iter().zip(&views) {
                            assert!(verify_block(kk, 0, vv.as_slice()), "seed {seed}: bytes");
                        }
                        if !hit.is_empty() {
                            read.extend(keys[..hits].iter().copied());
                        }
                    }
                }
                6 => {
                    if let Some(&id) = live
                        .iter()
                        .nth(rng.below(live.len().max(1) as u64) as usize)
                    {
                        fx.m.on_request_finished(RequestId(id));
                        live.remove(&id);
                        held.retain(|(r, _)| *r != id);
                        pending.retain(|(r, _)| *r != id);
                        hit.retain(|(r, _)| *r != id);
                        trace.push(format!("s{step} finish r{id}"));
                    }
                }
                7 | 8 => {
                    let n = 1 + rng.below(SLOTS as u64) as usize;
                    let res = try_engine_store(&fx.m, RequestId(500), &fillers(n));
                    trace.push(format!("s{step} store {n}: {}", res.is_ok()));
                }
                _ => {
                    if rng.below(3) == 0 {
                        fx.m.poll();
                        let _ = fx.m.is_idle();
                    } else {
                        fx.m.touch(&all[..3]);
                    }
                }
            }
        }
        fx.m.on_schedule_end();
        for (id, key) in std::mem::take(&mut hit) {
            if read.contains(&key) {
                held.remove(&(id, key));
            }
        }
        read.clear();
        if rng.below(10) == 0 {
            fx.m.reset_cache().await;
            held.clear();
            pending.clear();
            trace.push(format!("s{step} reset"));
        }
        if !exact {
            if rng.below(3) == 0 {
                fx.m.wait_idle().await;
            } else {
                // a random pause between steps (the timing run)
                tokio::time::sleep(Duration::from_micros(rng.below(800))).await;
            }
            held.clear();
            pending.clear();
            continue;
        }
        fx.m.wait_idle().await;
        fx.m.poll();
        // a promise whose block landed is a hold; one whose promotion failed is gone
        for (id, key) in std::mem::take(&mut pending) {
            if fx.cpu.lookup(&key) == Hit {
                held.insert((id, key));
            }
        }
        let keys_held: BTreeSet<BlockKey> = held.iter().map(|(_, k)| *k).collect();
        let s = fx.m.stats();
        let requests: BTreeSet<u64> = held.iter().map(|(r, _)| *r).collect();
        assert_eq!(
            (s.held_blocks, s.holding_requests),
            (keys_held.len(), requests.len()),
            "seed {seed} step {step}: held blocks and requests\n{}",
            trace.join("\n")
        );
    }
    for id in std::mem::take(&mut live) {
        fx.m.on_request_finished(RequestId(id));
    }
    fx.m.on_request_finished(RequestId(500));
    fx.ft.heal();
    fx.assert_clean(&format!("fuzz seed {seed}")).await;
}

/// The leading `Hit`s of `v`.
pub(crate) fn count_hits(v: &[LookupResult]) -> usize {
    v.iter().take_while(|r| **r == Hit).count()
}
