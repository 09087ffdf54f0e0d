//! The offline model: a run's request trace replayed against a cache of fixed capacity under
//! a chosen eviction policy, with prefix semantics (a block serves only if every block before
//! it in the prompt does), so the online run can be read beside the same trace under LRU,
//! under Belady's rule and with no bound at all.
//!
//! What the model assumes, and the report repeats:
//!
//! - **Two levels, written through.** Every block the engine stores goes to DRAM and to the fs
//!   tier (kv-tier cascades every store), and a hit in either serves. Both levels see the
//!   same stream, so under LRU the larger one holds everything the smaller one does; the
//!   model is one level of `max(DRAM, fs)` blocks (with a bounded obj tier below fs, the
//!   largest of the three bounds; with an unbounded one, no bound). A restart empties DRAM
//!   only: with an fs level the model keeps its blocks, without one it starts empty.
//! - **In front, the GPU prefix cache**, LRU of its own blocks, as the engine's: the same for
//!   every policy.
//! - **Whole requests.** A request reads its prompt's hit prefix, then stores the rest of
//!   its prompt and its output; evictions happen as it stores. No timing: a block stored is
//!   there for the next request (no write-back delay, no probe budget, no give-up).
//! - **Pooled** (`pooled`): Belady's rule on one level of DRAM + `fs_blocks` blocks, as if the two
//!   levels were one cache: what any placement of blocks across them could hold at most (the
//!   real hierarchy keeps many blocks in both, so its content is at most this many blocks). A
//!   bound on what a better placement, not only a better eviction order, could win.
//! - **Belady's rule per block** (`opt`): evict the block whose next use in a prompt is
//!   farthest, and do not keep a new block whose next use is farther than every kept one.
//!   With prefix semantics this is the usual stand-in for the optimum (it is optimal for
//!   single blocks, and keeps what the trace reads soonest), not a proven optimum of chains.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

/// An eviction policy of the offline model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Policy {
    /// Least recently used first (what kv-tier's DRAM and fs tiers run).
    Lru,
    /// Belady's rule: the block used again farthest in the future first.
    Opt,
    /// Belady's rule on DRAM and the fs level pooled (their blocks summed).
    Pooled,
    /// No bound: every block kept.
    Unbounded,
}

impl Policy {
    /// Its name on the command line.
    pub fn name(&self) -> &'static str {
        match self {
            Policy::Lru => "lru",
            Policy::Opt => "opt",
            Policy::Pooled => "pooled",
            Policy::Unbounded => "unbounded",
        }
    }

    /// The policy named `name`.
    pub fn parse(name: &str) -> Option<Policy> {
        [Policy::Lru, Policy::Opt, Policy::Pooled, Policy::Unbounded]
            .into_iter()
            .find(|p| p.name() == name)
    }
}

/// The capacities a trace was recorded at: the first line of a trace file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceHeader {
    /// DRAM, in blocks.
    pub dram_blocks: u64,
    /// The largest bounded tier below DRAM (the fs tier, or a bounded obj tier below it), in
    /// blocks (`None`: none, or one unbounded with `unbounded_below`).
    pub fs_blocks: Option<u64>,
    /// The fs tier (or a tier below it) has no bound: the model keeps everything.
    pub unbounded_below: bool,
    /// The engine's GPU prefix cache, in blocks.
    pub gpu_blocks: u64,
    /// Tokens per block.
    pub tokens_per_block: u64,
}

impl TraceHeader {
    /// The model's one level (see the module): `max(DRAM, fs_blocks)` blocks, `None` for no
    /// bound.
    pub fn model_blocks(&self) -> Option<u64> {
        if self.unbounded_below {
            None
        } else {
            Some(self.dram_blocks.max(self.fs_blocks.unwrap_or(0)))
        }
    }

    /// The pooled level (see the module): `DRAM + fs_blocks` blocks, `None` for no bound.
    pub fn pooled_blocks(&self) -> Option<u64> {
        if self.unbounded_below {
            None
        } else {
            Some(self.dram_blocks.saturating_add(self.fs_blocks.unwrap_or(0)))
        }
    }
}

/// One line of a trace after the header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceRecord {
    /// A request: its prompt's blocks in order, then the output blocks it stored (block ids:
    /// the same id is the same block).
    Request {
        /// The prompt's blocks.
        prompt: Vec<u64>,
        /// The output's blocks.
        output: Vec<u64>,
    },
    /// The manager was shut down and reopened on the same root (DRAM and the GPU cache lost).
    Restart,
}

/// A run's trace: its capacities and its requests in the order they were served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    /// The capacities.
    pub header: TraceHeader,
    /// The requests (and restarts).
    pub records: Vec<TraceRecord>,
}

impl Trace {
    /// Writes the trace as JSON lines: the header, then a record per line.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
        serde_json::to_writer(&mut f, &self.header)?;
        f.write_all(b"\n")?;
        for r in &self.records {
            serde_json::to_writer(&mut f, r)?;
            f.write_all(b"\n")?;
        }
        f.flush()
    }

    /// Reads a trace [`Trace::write`] wrote; the error names the line that is wrong.
    pub fn read(path: &Path) -> Result<Trace, String> {
        let f = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let mut lines = std::io::BufReader::new(f).lines();
        let at = |n: usize, e: &dyn std::fmt::Display| format!("{}:{n}: {e}", path.display());
        let first = lines
            .next()
            .ok_or_else(|| at(1, &"empty: no header line"))?
            .map_err(|e| at(1, &e))?;
        let header: TraceHeader = serde_json::from_str(&first).map_err(|e| at(1, &e))?;
        if header.tokens_per_block == 0 {
            return Err(at(1, &"tokens_per_block must be at least 1"));
        }
        let mut records = Vec::new();
        for (i, line) in lines.enumerate() {
            let line = line.map_err(|e| at(i + 2, &e))?;
            if line.trim().is_empty() {
                continue;
            }
            records.push(serde_json::from_str(&line).map_err(|e| at(i + 2, &e))?);
        }
        Ok(Trace { header, records })
    }
}

/// Records requests as a trace's block ids (the same block, the same id).
#[derive(Debug, Default)]
pub(super) struct Recorder {
    ids: HashMap<kv_tier::BlockKey, u64>,
    /// The records so far.
    pub(super) records: Vec<TraceRecord>,
}

impl Recorder {
    fn id(&mut self, k: &kv_tier::BlockKey) -> u64 {
        let n = self.ids.len() as u64;
        *self.ids.entry(*k).or_insert(n)
    }

    /// A request's prompt and output blocks.
    pub(super) fn request(&mut self, prompt: &[kv_tier::BlockKey], output: &[kv_tier::BlockKey]) {
        let prompt = prompt.iter().map(|k| self.id(k)).collect();
        let output = output.iter().map(|k| self.id(k)).collect();
        self.records.push(TraceRecord::Request { prompt, output });
    }

    /// Distinct blocks recorded: the working set.
    pub(super) fn blocks(&self) -> u64 {
        self.ids.len() as u64
    }
}

/// What the model served of a trace, in blocks of prompt.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Served {
    /// Prompt blocks in all.
    pub prompt_blocks: u64,
    /// Served from the GPU cache.
    pub from_gpu: u64,
    /// Served from the cache below it.
    pub from_cache: u64,
}

impl Served {
    /// The fraction of prompt blocks not recomputed.
    pub fn hit_rate(&self) -> f64 {
        if self.prompt_blocks == 0 {
            0.0
        } else {
            (self.from_gpu + self.from_cache) as f64 / self.prompt_blocks as f64
        }
    }
}

/// Replays `trace` under `policy` (see the module for what is modelled).
pub fn replay(trace: &Trace, policy: Policy) -> Served {
    let cap = match policy {
        Policy::Unbounded => None,
        Policy::Pooled => trace.header.pooled_blocks(),
        Policy::Lru | Policy::Opt => trace.header.model_blocks(),
    };
    let mut gpu: Lru = Lru::new(trace.header.gpu_blocks as usize);
    let mut cache = Cache::new(policy, cap, &trace.records);
    let mut served = Served::default();
    for (i, r) in trace.records.iter().enumerate() {
        let (prompt, output) = match r {
            TraceRecord::Request { prompt, output } => (prompt, output),
            TraceRecord::Restart => {
                gpu = Lru::new(trace.header.gpu_blocks as usize);
                match trace.header.fs_blocks {
                    // DRAM's part goes; the fs level keeps at most its own blocks
                    _ if trace.header.unbounded_below => {}
                    Some(fs) => cache.trim(fs as usize),
                    None => cache.clear(),
                }
                continue;
            }
        };
        served.prompt_blocks += prompt.len() as u64;
        let g = prompt.iter().take_while(|k| gpu.contains(k)).count();
        let h = prompt[g..].iter().take_while(|k| cache.contains(k)).count();
        served.from_gpu += g as u64;
        served.from_cache += h as u64;
        // the hits are used now (made recent); the rest is computed and stored, with the output
        for k in prompt.iter().chain(output) {
            cache.put(*k, i);
            gpu.put(*k);
        }
    }
    served
}

/// An LRU set of keys of at most `cap` (the offline model's, and the engine's GPU cache).
#[derive(Debug)]
pub(super) struct Lru<K: std::hash::Hash + Eq + Copy = u64> {
    cap: usize,
    order: VecDeque<(K, u64)>,
    seq: HashMap<K, u64>,
    next: u64,
}

impl<K: std::hash::Hash + Eq + Copy> Lru<K> {
    pub(super) fn new(cap: usize) -> Self {
        Lru {
            cap,
            order: VecDeque::new(),
            seq: HashMap::new(),
            next: 0,
        }
    }

    pub(super) fn contains(&self, k: &K) -> bool {
        self.seq.contains_key(k)
    }

    /// Makes `k` the most recent, evicting the least recent past the cap.
    pub(super) fn put(&mut self, k: K) {
        if self.cap == 0 {
            return;
        }
        self.next += 1;
        self.seq.insert(k, self.next);
        self.order.push_back((k, self.next));
        self.trim(self.cap);
        if self.order.len() > self.cap.saturating_mul(4).saturating_add(64) {
            let seq = &self.seq;
            self.order.retain(|(k, s)| seq.get(k) == Some(s));
        }
    }

    /// Evicts the least recent until at most `n` are left.
    fn trim(&mut self, n: usize) {
        while self.seq.len() > n {
            let Some((old, s)) = self.order.pop_front() else {
                break;
            };
            if self.seq.get(&old) == Some(&s) {
                self.seq.remove(&old);
            }
        }
    }
}

/// The model's level under one policy.
enum Cache {
    Lru(Lru),
    Unbounded(std::collections::HashSet<u64>),
    Opt(Opt),
}

impl Cache {
    fn new(policy: Policy, cap: Option<u64>, records: &[TraceRecord]) -> Cache {
        match (policy, cap) {
            (Policy::Unbounded, _) | (_, None) => Cache::Unbounded(Default::default()),
            (Policy::Lru, Some(c)) => Cache::Lru(Lru::new(c as usize)),
            (Policy::Opt | Policy::Pooled, Some(c)) => Cache::Opt(Opt::new(c as usize, records)),
        }
    }

    fn contains(&self, k: &u64) -> bool {
        match self {
            Cache::Lru(l) => l.contains(k),
            Cache::Unbounded(s) => s.contains(k),
            Cache::Opt(o) => o.next_of.contains_key(k),
        }
    }

    /// `k` is used (or stored) by record `i`.
    fn put(&mut self, k: u64, i: usize) {
        match self {
            Cache::Lru(l) => l.put(k),
            Cache::Unbounded(s) => {
                s.insert(k);
            }
            Cache::Opt(o) => o.put(k, i),
        }
    }

    /// Keeps at most `n` blocks, evicting by the policy's own order.
    fn trim(&mut self, n: usize) {
        match self {
            Cache::Lru(l) => l.trim(n),
            Cache::Unbounded(_) => {}
            Cache::Opt(o) => {
                while o.next_of.len() > n {
                    let Some(&(far, victim)) = o.by_next.iter().next_back() else {
                        break;
                    };
                    o.by_next.remove(&(far, victim));
                    o.next_of.remove(&victim);
                }
            }
        }
    }

    fn clear(&mut self) {
        match self {
            Cache::Lru(l) => *l = Lru::new(l.cap),
            Cache::Unbounded(s) => s.clear(),
            Cache::Opt(o) => {
                o.next_of.clear();
                o.by_next.clear();
            }
        }
    }
}

/// Belady's rule over block ids, with the trace's future known.
struct Opt {
    cap: usize,
    /// Per block, the records whose prompt reads it, in order.
    uses: HashMap<u64, Vec<usize>>,
    /// Kept blocks and their next use (`usize::MAX`: never again).
    next_of: HashMap<u64, usize>,
    /// Kept blocks by next use.
    by_next: BTreeSet<(usize, u64)>,
}

impl Opt {
    fn new(cap: usize, records: &[TraceRecord]) -> Opt {
        let mut uses: HashMap<u64, Vec<usize>> = HashMap::new();
        for (i, r) in records.iter().enumerate() {
            if let TraceRecord::Request { prompt, .. } = r {
                for k in prompt {
                    let u = uses.entry(*k).or_default();
                    if u.last() != Some(&i) {
                        u.push(i);
                    }
                }
            }
        }
        Opt {
            cap,
            uses,
            next_of: HashMap::new(),
            by_next: BTreeSet::new(),
        }
    }

    /// The first record after `i` that reads `k`.
    fn next_use(&self, k: u64, i: usize) -> usize {
        let Some(u) = self.uses.get(&k) else {
            return usize::MAX;
        };
        let at = u.partition_point(|&j| j <= i);
        u.get(at).copied().unwrap_or(usize::MAX)
    }

    fn put(&mut self, k: u64, i: usize) {
        if self.cap == 0 {
            return;
        }
        let next = self.next_use(k, i);
        if let Some(old) = self.next_of.insert(k, next) {
            self.by_next.remove(&(old, k));
            self.by_next.insert((next, k));
            return;
        }
        self.by_next.insert((next, k));
        if self.next_of.len() > self.cap {
            // the farthest next use goes: the new block itself if it is the farthest
            let &(far, victim) = self.by_next.iter().next_back().expect("over the cap");
            self.by_next.remove(&(far, victim));
            self.next_of.remove(&victim);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn header(cap: u64) -> TraceHeader {
        TraceHeader {
            dram_blocks: cap,
            fs_blocks: None,
            unbounded_below: false,
            gpu_blocks: 0,
            tokens_per_block: 16,
        }
    }

    fn req(prompt: &[u64], output: &[u64]) -> TraceRecord {
        TraceRecord::Request {
            prompt: prompt.to_vec(),
            output: output.to_vec(),
        }
    }

    fn rates(t: &Trace) -> (Served, Served, Served) {
        (
            replay(t, Policy::Lru),
            replay(t, Policy::Opt),
            replay(t, Policy::Unbounded),
        )
    }

    /// The case: a chain A-B-C is read again after other traffic. LRU, which makes
    /// A-B-C recent in prompt order, evicts the chain's head A first (the oldest), and with
    /// it every block of the chain (prefix semantics); Belady keeps what is read soonest.
    #[test]
    fn lru_evicts_the_head_of_a_chain_that_the_optimum_keeps() {
        // capacity 3: [1,2,3] stored; then [4] is stored (LRU evicts 1, the chain's head);
        // then the chain is read again
        let t = Trace {
            header: header(3),
            records: vec![req(&[1, 2, 3], &[]), req(&[4], &[]), req(&[1, 2, 3], &[])],
        };
        let (lru, opt, unb) = rates(&t);
        assert_eq!(lru.prompt_blocks, 7);
        assert_eq!(lru.from_cache, 0, "LRU lost the head, so the whole chain");
        // Belady does not keep 4 (never read again): the chain stays
        assert_eq!(opt.from_cache, 3);
        assert_eq!(unb.from_cache, 3);
    }

    /// Two blocks read in turn, with one block of DRAM and one of fs: each level alone holds
    /// one, so the one-level model misses every time; pooled, the two hold both and serve
    /// every read after the first two.
    #[test]
    fn pooled_levels_hold_what_either_alone_cannot() {
        let mut records = Vec::new();
        for _ in 0..4 {
            records.extend([req(&[1], &[]), req(&[2], &[])]);
        }
        let t = Trace {
            header: TraceHeader {
                fs_blocks: Some(1),
                ..header(1)
            },
            records,
        };
        assert_eq!(t.header.model_blocks(), Some(1));
        assert_eq!(t.header.pooled_blocks(), Some(2));
        assert_eq!(replay(&t, Policy::Lru).from_cache, 0);
        assert_eq!(replay(&t, Policy::Pooled).from_cache, 6);
        assert!(replay(&t, Policy::Opt).from_cache < 6);
    }

    /// A cyclic scan over four blocks with room for three: LRU misses every time, Belady
    /// keeps two of the three it can (the standard case), the unbounded cache all four.
    #[test]
    fn a_cyclic_scan_defeats_lru_but_not_the_optimum() {
        let mut records = Vec::new();
        for _ in 0..5 {
            for k in 1..=4 {
                records.push(req(&[k], &[]));
            }
        }
        let t = Trace {
            header: header(3),
            records,
        };
        let (lru, opt, unb) = rates(&t);
        assert_eq!(lru.prompt_blocks, 20);
        assert_eq!(lru.from_cache, 0);
        // after the first round, Belady misses one block in three (every third request)
        assert!(opt.from_cache >= 10, "{opt:?}");
        assert_eq!(unb.from_cache, 16, "all but the first round");
    }

    /// Prefix semantics: a block present after a missing one serves nothing.
    #[test]
    fn a_block_after_a_missing_one_serves_nothing() {
        let t = Trace {
            header: header(100),
            records: vec![req(&[2, 3], &[]), req(&[1, 2, 3], &[])],
        };
        let (lru, opt, unb) = rates(&t);
        for s in [lru, opt, unb] {
            assert_eq!(s.from_cache, 0, "2 and 3 are behind the new 1: {s:?}");
        }
        // output blocks are stored for the next turn
        let t = Trace {
            header: header(100),
            records: vec![req(&[1], &[2]), req(&[1, 2, 3], &[])],
        };
        assert_eq!(replay(&t, Policy::Lru).from_cache, 2);
    }

    /// The GPU cache serves first; a restart empties it and, without an fs level, the model;
    /// with an fs level smaller than DRAM, the model keeps the fs level's blocks only.
    #[test]
    fn a_restart_keeps_the_fs_level_only() {
        let mut small_fs = header(4);
        small_fs.fs_blocks = Some(2);
        let t = Trace {
            header: small_fs,
            records: vec![
                req(&[1, 2, 3, 4], &[]),
                TraceRecord::Restart,
                req(&[3, 4], &[]),
            ],
        };
        // LRU keeps the two most recent (3, 4); Belady the two read soonest (3, 4)
        assert_eq!(replay(&t, Policy::Lru).from_cache, 2);
        assert_eq!(replay(&t, Policy::Opt).from_cache, 2);
        let t = Trace {
            header: small_fs,
            records: vec![
                req(&[1, 2, 3, 4], &[]),
                TraceRecord::Restart,
                req(&[1, 2], &[]),
            ],
        };
        assert_eq!(
            replay(&t, Policy::Lru).from_cache,
            0,
            "1 and 2 were DRAM's part"
        );
        assert_eq!(
            replay(&t, Policy::Opt).from_cache,
            2,
            "Belady kept what is read next"
        );
        let mut h = header(10);
        h.gpu_blocks = 2;
        let records = vec![req(&[1, 2], &[]), TraceRecord::Restart, req(&[1, 2], &[])];
        let dram_only = Trace {
            header: h,
            records: records.clone(),
        };
        let s = replay(&dram_only, Policy::Lru);
        assert_eq!((s.from_gpu, s.from_cache), (0, 0), "DRAM lost at restart");
        h.fs_blocks = Some(10);
        let with_fs = Trace { header: h, records };
        let s = replay(&with_fs, Policy::Opt);
        assert_eq!((s.from_gpu, s.from_cache), (0, 2), "the fs level kept them");
        let no_restart = Trace {
            header: h,
            records: vec![req(&[1, 2], &[]), req(&[1, 2], &[])],
        };
        let s = replay(&no_restart, Policy::Lru);
        assert_eq!((s.from_gpu, s.from_cache), (2, 0), "the GPU cache first");
    }

    /// A trace written and read back is the same trace; a bad line is named.
    #[test]
    fn a_trace_file_round_trips_and_a_bad_line_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.jsonl");
        let t = Trace {
            header: header(5),
            records: vec![req(&[1, 2], &[3]), TraceRecord::Restart, req(&[1], &[])],
        };
        t.write(&p).unwrap();
        assert_eq!(Trace::read(&p).unwrap(), t);
        let mut text = std::fs::read_to_string(&p).unwrap();
        text.push_str("{\"nonsense\": 1}\n");
        std::fs::write(&p, text).unwrap();
        let e = Trace::read(&p).unwrap_err();
        assert!(e.contains("t.jsonl:5"), "{e}");
    }
}
