//! Where every prompt token went: served (GPU cache, DRAM, a tier) or lost, and why. The
//! engine keeps a ledger of each block's history (what it stored, what each tier's
//! events and the commits' receipts said, what DRAM refused), and asks it, for every block a
//! request did not get, the reason; the manager says why the first missing block of a prefix
//! missed ([`kv_tier::MissCause`]).

use std::collections::{BTreeMap, HashMap};

use kv_tier::{BlockKey, Medium, MissCause, NotWritten, StoreReceipt, TierEvent};

/// Tokens per bucket. Keys are stable labels (`served/dram`, `lost/evicted/fs`, ...), the
/// same in the text report and in `--json`; [`describe`] says what each means.
pub type Attribution = BTreeMap<String, u64>;

/// What a block's history says about it.
#[derive(Debug, Default, Clone)]
struct KeyLog {
    /// The engine computed it and offered it to kv-tier.
    stored: bool,
    /// In DRAM, by DRAM's events.
    in_dram: bool,
    /// Bit per secondary tier: holds it, by that tier's events.
    held: u64,
    /// The latest thing that took it from a place or kept it out of one (a tier's removal,
    /// a commit leaving it out, DRAM refusing it, a restart): why it is not there when no
    /// place holds it. One cause, the latest, so no two marks can disagree.
    last: Option<Lost>,
}

/// Every block's history over a run, kept from what the engine did and saw.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    /// Secondary tiers, in order.
    tiers: Vec<String>,
    keys: HashMap<BlockKey, KeyLog>,
    /// Each block's parent: the block before it in a request's chain (a key is a hash of
    /// its parent's, so a block has one parent whatever request showed it).
    parents: HashMap<BlockKey, BlockKey>,
}

/// What a secondary tier holds at the end of a run, by its events, against the workload's
/// chains: the blocks, and those of them behind a block of their chain the tier does not hold
/// (dead there: a prefix lookup in that tier stops before them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct ChainsHeld {
    pub(super) tier: String,
    pub(super) blocks: u64,
    pub(super) dead: u64,
}

/// Why a block a request did not get was not there, or could not be used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Lost {
    /// Never stored before this ask.
    FirstUse,
    /// Stored, then removed for capacity by this tier (`dram` with no tier below).
    Evicted(String),
    /// The commit did not send it to this tier (admission, write budget, write-back bound).
    NotWritten(String, NotWritten),
    /// DRAM refused its store (pinned, or write-back full).
    DramRefused(&'static str),
    /// Its write to this tier was in flight, or failed.
    WriteInFlightOrFailed(String),
    /// It was only in DRAM, and a restart took it.
    AtRestart,
    /// Present, but an earlier block of the prefix is not.
    ChainBroken,
    /// The request stopped waiting for it (`--max-wait-steps`).
    GaveUp,
    /// The manager's cause (a probe past its budget, a failed probe or load, no DRAM room).
    Manager(MissCause),
    /// The ledger says a tier holds it, and the manager found it nowhere.
    Unexplained,
}

impl Lost {
    /// Its bucket's label.
    pub(super) fn label(&self) -> String {
        match self {
            Lost::FirstUse => "lost/first_use".into(),
            Lost::Evicted(t) => format!("lost/evicted/{t}"),
            Lost::NotWritten(t, w) => format!("lost/not_written/{t}/{}", not_written(*w)),
            Lost::DramRefused(why) => format!("lost/dram_refused/{why}"),
            Lost::WriteInFlightOrFailed(t) => format!("lost/write_in_flight_or_failed/{t}"),
            Lost::AtRestart => "lost/lost_at_restart".into(),
            Lost::ChainBroken => "lost/chain_broken".into(),
            Lost::GaveUp => "lost/gave_up_waiting".into(),
            Lost::Manager(c) => match c {
                MissCause::ProbeOverBudget { tier } => format!("lost/probe_over_budget/{tier}"),
                MissCause::ProbeFailed { tier } => format!("lost/probe_failed/{tier}"),
                MissCause::LoadFailed { tier } => format!("lost/load_failed/{tier}"),
                MissCause::NoDramRoom { tier } => format!("lost/no_dram_slot/{tier}"),
                MissCause::RecomputeFaster { tier } => format!("lost/recompute_faster/{tier}"),
                MissCause::ShutDown => "lost/shut_down".into(),
                _ => "lost/unexplained".into(),
            },
            Lost::Unexplained => "lost/unexplained".into(),
        }
    }
}

fn not_written(w: NotWritten) -> &'static str {
    match w {
        NotWritten::NotAdmitted => "not_admitted",
        NotWritten::OverWriteBudget => "over_write_budget",
        NotWritten::WriteBackFull => "write_back_full",
        _ => "other",
    }
}

impl Ledger {
    /// A ledger over the secondary tiers `tiers` (in lookup order).
    pub(super) fn new(tiers: Vec<String>) -> Self {
        Ledger {
            tiers,
            keys: HashMap::new(),
            parents: HashMap::new(),
        }
    }

    /// `chain` is a request's blocks in prefix order: each follows the one before it.
    pub(super) fn chain(&mut self, chain: &[BlockKey]) {
        for w in chain.windows(2) {
            self.parents.entry(w[1]).or_insert(w[0]);
        }
    }

    /// Per secondary tier: what it holds and how much of it is dead (see [`ChainsHeld`]).
    pub(super) fn chains_held(&self) -> Vec<ChainsHeld> {
        (0..self.tiers.len())
            .map(|t| {
                let bit = 1u64 << t.min(63);
                let held = |k: &BlockKey| self.keys.get(k).is_some_and(|e| e.held & bit != 0);
                // per held block: whether a block before it in its chain is not held
                let mut broken: HashMap<BlockKey, bool> = HashMap::new();
                let (mut blocks, mut dead) = (0, 0);
                for k in self.keys.keys().filter(|k| held(k)) {
                    blocks += 1;
                    let mut path = Vec::new();
                    let mut cur = *k;
                    let b = loop {
                        if let Some(&b) = broken.get(&cur) {
                            break b;
                        }
                        path.push(cur);
                        match self.parents.get(&cur) {
                            None => break false,
                            Some(p) if !held(p) => break true,
                            Some(p) => cur = *p,
                        }
                    };
                    for x in path {
                        broken.insert(x, b);
                    }
                    dead += u64::from(b);
                }
                ChainsHeld {
                    tier: self.tiers[t].clone(),
                    blocks,
                    dead,
                }
            })
            .collect()
    }

    fn tier(&self, name: &str) -> Option<usize> {
        self.tiers.iter().position(|t| t == name)
    }

    /// The engine offered `keys` to kv-tier (a commit).
    pub(super) fn offered(&mut self, keys: &[BlockKey]) {
        for k in keys {
            self.keys.entry(*k).or_default().stored = true;
        }
    }

    /// DRAM refused to store `keys`, for `why`; a key held somewhere lost nothing by it.
    pub(super) fn refused(&mut self, keys: &[BlockKey], why: &'static str) {
        for k in keys {
            let present = self.present(k);
            let e = self.keys.entry(*k).or_default();
            e.stored = true;
            if !present {
                e.last = Some(Lost::DramRefused(why));
            }
        }
    }

    /// A commit's receipt: the blocks it left out, per tier.
    pub(super) fn receipt(&mut self, r: &StoreReceipt) {
        for (tier, k, why) in &r.left_out {
            if self.tier(tier).is_some() {
                self.keys.entry(*k).or_default().last = Some(Lost::NotWritten(tier.clone(), *why));
            }
        }
    }

    /// A tier's (or DRAM's) event.
    pub(super) fn event(&mut self, ev: &TierEvent) {
        let no_tiers = self.tiers.is_empty();
        let Some(t) = self.tier(&ev.tier) else {
            if ev.medium == Medium::Cpu {
                for k in &ev.keys {
                    let e = self.keys.entry(*k).or_default();
                    e.in_dram = !ev.removed;
                    if ev.removed && no_tiers {
                        e.last = Some(Lost::Evicted("dram".into()));
                    }
                }
            }
            return;
        };
        let bit = 1u64 << t.min(63);
        for k in &ev.keys {
            let e = self.keys.entry(*k).or_default();
            if ev.removed {
                e.held &= !bit;
                e.last = Some(Lost::Evicted(self.tiers[t].clone()));
            } else {
                e.held |= bit;
            }
        }
    }

    /// The manager was shut down: DRAM's blocks are gone (the tiers keep theirs).
    pub(super) fn restarted(&mut self) {
        for e in self.keys.values_mut() {
            if e.in_dram {
                e.in_dram = false;
                if e.held == 0 {
                    e.last = Some(Lost::AtRestart);
                }
            }
        }
    }

    /// Whether DRAM or a tier holds `key`, by the ledger.
    pub(super) fn present(&self, key: &BlockKey) -> bool {
        self.keys.get(key).is_some_and(|e| e.in_dram || e.held != 0)
    }

    /// Why `key`, which no place holds by the ledger, is not there: never stored, or the
    /// latest thing that took it or kept it out.
    pub(super) fn absent_cause(&self, key: &BlockKey) -> Lost {
        let Some(e) = self.keys.get(key).filter(|e| e.stored || e.last.is_some()) else {
            return Lost::FirstUse;
        };
        if let Some(l) = &e.last {
            return l.clone();
        }
        match self.tiers.last() {
            Some(t) => Lost::WriteInFlightOrFailed(t.clone()),
            None => Lost::Evicted("dram".into()),
        }
    }

    /// The buckets of the blocks a request did not get, `missed` (its prompt after the served
    /// prefix, in order): the first is lost for `first` (the manager's cause, or the give-up)
    /// if it is there to be had, else for its own absence; each later one for its own
    /// absence, or for the broken chain (or the give-up) if it is there.
    pub(super) fn classify(
        &self,
        missed: &[BlockKey],
        first: Option<Lost>,
        gave_up: bool,
    ) -> Vec<Lost> {
        let mut out = Vec::with_capacity(missed.len());
        // the load-or-recompute policy declines the rest of a prefix with its first block
        let declined = matches!(
            first,
            Some(Lost::Manager(MissCause::RecomputeFaster { .. }))
        );
        for (i, k) in missed.iter().enumerate() {
            let present = self.present(k);
            let why = match (&first, i) {
                (Some(Lost::Manager(MissCause::NotFound)), 0) | (None, 0) if present => {
                    Lost::Unexplained
                }
                // a slow probe or a give-up cost nothing if the block was gone anyway
                (Some(f), 0) if present => f.clone(),
                (Some(f), _) if present && declined => f.clone(),
                _ if present && gave_up => Lost::GaveUp,
                _ if present => Lost::ChainBroken,
                _ => self.absent_cause(k),
            };
            out.push(why);
        }
        out
    }
}

/// What a bucket's label means, for the report.
pub fn describe(label: &str) -> String {
    let parts: Vec<&str> = label.split('/').collect();
    match parts.as_slice() {
        ["served", "gpu"] => "served from the GPU prefix cache".into(),
        ["served", "dram"] => "served from DRAM".into(),
        ["served", t] => format!("served from tier {t} (promoted while the request waited)"),
        ["lost", "first_use"] => "first use: never stored before".into(),
        ["lost", "evicted", t] => format!("evicted for capacity by {t} before this ask"),
        ["lost", "not_written", t, why] => {
            format!("write to {t} dropped: {}", why.replace('_', " "))
        }
        ["lost", "dram_refused", why] => {
            format!("DRAM refused the store ({})", why.replace('_', " "))
        }
        ["lost", "write_in_flight_or_failed", t] => {
            format!("its write to {t} was in flight or failed")
        }
        ["lost", "lost_at_restart"] => "only in DRAM, lost at the restart".into(),
        ["lost", "chain_broken"] => "chain broken: present, an earlier block is not".into(),
        ["lost", "gave_up_waiting"] => "the request gave up waiting (--max-wait-steps)".into(),
        ["lost", "probe_over_budget", t] => format!("{t}'s probe past its budget or deadline"),
        ["lost", "probe_failed", t] => format!("{t}'s probe failed"),
        ["lost", "load_failed", t] => format!("the load from {t} failed"),
        ["lost", "no_dram_slot", t] => format!("in {t}, but no DRAM slot to promote into"),
        ["lost", "recompute_faster", t] => {
            format!("in {t}, but recomputing was faster than its load (declined)")
        }
        ["lost", "shut_down"] => "the manager was shut down".into(),
        ["lost", "unexplained"] => {
            "unexplained: held by a tier's events, found nowhere by the manager".into()
        }
        _ => label.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kv_tier::Locality;
    use kv_tier_testkit::test_key;

    fn ev(tier: &str, medium: Medium, k: BlockKey, removed: bool) -> TierEvent {
        let mut e = TierEvent::stored(tier, vec![k], medium, Locality::Local);
        e.removed = removed;
        e
    }

    /// Each history ends in its bucket, the latest cause winning: never stored, evicted by
    /// the tier that removed it last, left out by a receipt, refused by DRAM (unless it is
    /// held elsewhere), lost at a restart, a chain broken after a missing block, a present
    /// block the manager missed, a slow probe of a block that was gone anyway.
    #[test]
    fn a_blocks_history_names_its_bucket() {
        let mut l = Ledger::new(vec!["fs".into(), "obj".into()]);
        let [a, b, c, d, e] = [1, 2, 3, 4, 5].map(test_key);
        assert_eq!(l.absent_cause(&a), Lost::FirstUse);
        l.offered(&[a, b, c]);
        l.event(&ev("cpu", Medium::Cpu, a, false));
        l.event(&ev("fs", Medium::Storage, a, false));
        l.event(&ev("obj", Medium::Storage, a, false));
        l.event(&ev("cpu", Medium::Cpu, a, true));
        l.event(&ev("obj", Medium::Storage, a, true));
        assert!(l.present(&a), "fs still has it");
        l.event(&ev("fs", Medium::Storage, a, true));
        assert_eq!(
            l.absent_cause(&a),
            Lost::Evicted("fs".into()),
            "the last removal"
        );
        l.event(&ev("fs", Medium::Storage, b, false));
        l.event(&ev("fs", Medium::Storage, b, true));
        l.receipt(&StoreReceipt {
            left_out: vec![("obj".into(), b, NotWritten::WriteBackFull)],
        });
        assert_eq!(
            l.absent_cause(&b),
            Lost::NotWritten("obj".into(), NotWritten::WriteBackFull),
            "the receipt came after the removal"
        );
        assert_eq!(
            l.absent_cause(&c),
            Lost::WriteInFlightOrFailed("obj".into())
        );
        l.refused(&[d], "pinned");
        assert_eq!(l.absent_cause(&d), Lost::DramRefused("pinned"));
        // a refusal of a block fs holds costs nothing; its later eviction is the cause
        let g = test_key(7);
        l.offered(&[g]);
        l.event(&ev("fs", Medium::Storage, g, false));
        l.refused(&[g], "pinned");
        l.event(&ev("fs", Medium::Storage, g, true));
        assert_eq!(l.absent_cause(&g), Lost::Evicted("fs".into()));
        l.offered(&[e]);
        l.event(&ev("cpu", Medium::Cpu, e, false));
        l.restarted();
        assert_eq!(l.absent_cause(&e), Lost::AtRestart);
        let mut only_dram = Ledger::new(Vec::new());
        only_dram.offered(&[e]);
        only_dram.event(&ev("cpu", Medium::Cpu, e, false));
        only_dram.event(&ev("cpu", Medium::Cpu, e, true));
        assert_eq!(only_dram.absent_cause(&e), Lost::Evicted("dram".into()));
        // a prefix [c (missing), f (in fs)]: the second is a broken chain
        let f = test_key(6);
        l.offered(&[f]);
        l.event(&ev("fs", Medium::Storage, f, false));
        let not_found = Some(Lost::Manager(MissCause::NotFound));
        let got = l.classify(&[c, f], not_found.clone(), false);
        assert_eq!(
            got,
            vec![Lost::WriteInFlightOrFailed("obj".into()), Lost::ChainBroken]
        );
        assert_eq!(l.classify(&[f], not_found, false), vec![Lost::Unexplained]);
        assert_eq!(
            l.classify(&[f, f], Some(Lost::GaveUp), true),
            vec![Lost::GaveUp, Lost::GaveUp]
        );
        // a probe past its budget for a block gone anyway: the block's own cause
        let slow = Lost::Manager(MissCause::ProbeOverBudget { tier: "obj".into() });
        assert_eq!(
            l.classify(&[a], Some(slow.clone()), false),
            vec![Lost::Evicted("fs".into())]
        );
        assert_eq!(l.classify(&[f], Some(slow.clone()), false), vec![slow]);
        for lost in [Lost::FirstUse, Lost::ChainBroken, Lost::GaveUp] {
            assert_ne!(describe(&lost.label()), lost.label(), "described");
        }
    }

    /// A tier's dead blocks are the ones it holds behind a block of their chain it does not
    /// hold, wherever else that block is: chain 1-2-3-4-5 with fs holding 1, 3, 4 and 5 (2
    /// only in obj) has 3 dead blocks in fs; chain 6-7 held whole is not dead; a block with
    /// no known parent starts a chain. Obj holds 2 alone, behind 1, which it lacks.
    #[test]
    fn dead_blocks_are_held_behind_a_block_the_tier_lacks() {
        let mut l = Ledger::new(vec!["fs".into(), "obj".into()]);
        let k = test_key;
        l.chain(&[k(1), k(2), k(3), k(4), k(5)]);
        l.chain(&[k(6), k(7)]);
        l.chain(&[k(1), k(2)]); // asked again: nothing changes
        for i in [1, 3, 4, 5, 6, 7, 8] {
            l.event(&ev("fs", Medium::Storage, k(i), false));
        }
        l.event(&ev("obj", Medium::Storage, k(2), false));
        l.event(&ev("cpu", Medium::Cpu, k(2), false));
        let fs = |l: &Ledger| l.chains_held()[0].clone();
        assert_eq!(
            l.chains_held(),
            vec![
                ChainsHeld {
                    tier: "fs".into(),
                    blocks: 7,
                    dead: 3
                },
                ChainsHeld {
                    tier: "obj".into(),
                    blocks: 1,
                    dead: 1
                }
            ]
        );
        l.event(&ev("fs", Medium::Storage, k(2), false));
        assert_eq!(fs(&l).dead, 0, "the chain is whole again");
        l.event(&ev("fs", Medium::Storage, k(4), true));
        assert_eq!((fs(&l).blocks, fs(&l).dead), (7, 1), "5 is behind 4");
    }
}
