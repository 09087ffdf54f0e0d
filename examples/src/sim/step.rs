//! The engine: a scheduler over a simulated GPU prefix cache, one step at a time, counting
//! what it does in a [`Tally`].

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::{Duration, Instant};

use kv_tier::fs::FsTier;
use kv_tier::{BlockKey, LookupResult, RequestContext, TieringManager, count_prefix};
use kv_tier_testkit::{Turn, Workload, fill_block, verify_block};

use super::SimConfig;

type BoxError = Box<dyn std::error::Error>;

/// Steps a request waits for its promotions at most before it takes what is there.
const MAX_WAIT_STEPS: u32 = 200;

/// Blocks per `prepare_store` call.
const STORE_CHUNK: usize = 64;

/// What the engine counted over its steps; the report is made of it.
#[derive(Debug, Default)]
pub(super) struct Tally {
    pub(super) steps: u64,
    pub(super) requests: u64,
    pub(super) requests_planned: u64,
    pub(super) prompt_tokens: u64,
    pub(super) tokens_from_gpu_cache: u64,
    pub(super) tokens_from_dram: u64,
    pub(super) tokens_from_secondary: u64,
    pub(super) tokens_recomputed: u64,
    pub(super) blocks_verified: u64,
    /// Keys of the blocks that came back with wrong bytes.
    pub(super) corrupt_keys: Vec<BlockKey>,
    pub(super) stores_refused: u64,
    pub(super) stores_refused_write_back: u64,
    pub(super) events: u64,
    pub(super) removal_events: u64,
    /// With `sync_steps`: the largest fs size right after a step's sweep.
    pub(super) max_bytes_after_step_sweep: Option<u64>,
}

impl Tally {
    /// A block came back with wrong bytes.
    pub(super) fn corrupt(&self) -> bool {
        !self.corrupt_keys.is_empty()
    }

    /// The fraction of prompt tokens not recomputed.
    pub(super) fn hit_rate(&self) -> f64 {
        if self.prompt_tokens == 0 {
            0.0
        } else {
            1.0 - self.tokens_recomputed as f64 / self.prompt_tokens as f64
        }
    }

    /// The correctness oracle's verdict: an error naming the first corrupt block, if any.
    pub(super) fn check_oracle(&self) -> Result<(), BoxError> {
        match self.corrupt_keys.first() {
            None => Ok(()),
            Some(k) => Err(format!(
                "correctness oracle: {} block(s) came back with wrong bytes (first: {k})",
                self.corrupt_keys.len()
            )
            .into()),
        }
    }
}

/// A simulated GPU prefix cache: LRU over block keys.
struct GpuCache {
    cap: usize,
    order: VecDeque<(BlockKey, u64)>,
    seq: HashMap<BlockKey, u64>,
    next: u64,
}

impl GpuCache {
    fn new(cap: usize) -> Self {
        Self {
            cap,
            order: VecDeque::new(),
            seq: HashMap::new(),
            next: 0,
        }
    }
    fn contains(&self, k: &BlockKey) -> bool {
        self.seq.contains_key(k)
    }
    fn insert(&mut self, k: BlockKey) {
        self.next += 1;
        self.seq.insert(k, self.next);
        self.order.push_back((k, self.next));
        while self.seq.len() > self.cap {
            let Some((old, s)) = self.order.pop_front() else {
                break;
            };
            if self.seq.get(&old) == Some(&s) {
                self.seq.remove(&old);
            }
        }
        if self.order.len() > 4 * self.cap + 64 {
            let seq = &self.seq;
            self.order.retain(|(k, s)| seq.get(k) == Some(s));
        }
    }
}

enum Phase {
    Lookup { waited: u32 },
    Finish,
}

struct Active {
    turn: Turn,
    ctx: RequestContext,
    phase: Phase,
    /// Keys answered `HitPending` for this request: a promotion brought them up from a
    /// secondary tier. The other hits were already in DRAM.
    promoted: HashSet<BlockKey>,
}

/// The engine: admits turns up to the batch size and takes each through lookup (waiting for
/// its promotions), load and verify, store, and finish, a step at a time.
pub(super) struct Engine<'a> {
    cfg: &'a SimConfig,
    manager: &'a TieringManager,
    /// The fs tier whose GC runs at the end of each step with `sync_steps`.
    fs: Option<&'a FsTier>,
    workload: Workload,
    gpu: GpuCache,
    active: Vec<Active>,
    /// No more turns to admit: the workload is played or the admission window is over.
    exhausted: bool,
    started: Instant,
    tally: Tally,
}

impl<'a> Engine<'a> {
    pub(super) fn new(
        cfg: &'a SimConfig,
        manager: &'a TieringManager,
        fs: Option<&'a FsTier>,
        workload: Workload,
    ) -> Self {
        let tally = Tally {
            requests_planned: workload.total_turns() as u64,
            ..Tally::default()
        };
        Self {
            cfg,
            manager,
            fs,
            workload,
            gpu: GpuCache::new(cfg.gpu_cache_blocks),
            active: Vec::new(),
            exhausted: false,
            started: Instant::now(),
            tally,
        }
    }

    /// Nothing left to admit and nothing running.
    pub(super) fn done(&self) -> bool {
        self.active.is_empty() && self.exhausted
    }

    /// Time since the engine started.
    pub(super) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub(super) fn tally(&self) -> &Tally {
        &self.tally
    }

    pub(super) fn into_tally(self) -> Tally {
        self.tally
    }

    /// One scheduler step: admit, serve every running request one phase further, end the
    /// schedule, spend the GPU time of what was computed, and (with `sync_steps`) wait for
    /// every job and run the fs GC.
    pub(super) fn step(&mut self) -> Result<(), BoxError> {
        self.tally.steps += 1;
        self.admit();
        let mut computed = 0u64;
        let mut active = std::mem::take(&mut self.active);
        let mut i = 0;
        while i < active.len() {
            match active[i].phase {
                Phase::Lookup { waited } => {
                    computed += self.serve(&mut active[i], waited)?;
                    i += 1;
                }
                Phase::Finish => {
                    self.manager.on_request_finished(active[i].ctx.id);
                    self.tally.requests += 1;
                    active.swap_remove(i);
                }
            }
        }
        self.active = active;
        self.manager.on_schedule_end();
        // the GPU is busy prefilling (and decoding) while the tiers move data
        if computed > 0 && self.cfg.prefill_tokens_per_s > 0.0 {
            let secs = computed as f64 / self.cfg.prefill_tokens_per_s;
            std::thread::sleep(Duration::from_secs_f64(secs.min(1.0)));
        }
        if self.cfg.sync_steps {
            self.settle()?;
        }
        self.take_events();
        Ok(())
    }

    /// Waits for the jobs still queued or in flight (write-back, mostly) and returns how long
    /// that took.
    pub(super) fn drain(&mut self) -> Duration {
        let started = Instant::now();
        self.manager.runtime().block_on(self.manager.wait_idle());
        let took = started.elapsed();
        self.take_events();
        took
    }

    /// Admits new turns up to the batch size, until the workload or the admission window
    /// ends.
    fn admit(&mut self) {
        while self.active.len() < self.cfg.max_batch && !self.exhausted {
            if self.started.elapsed() >= self.cfg.duration {
                self.exhausted = true;
                break;
            }
            match self.workload.next() {
                Some(turn) => self.active.push(Active {
                    ctx: RequestContext::new(turn.request),
                    turn,
                    phase: Phase::Lookup { waited: 0 },
                    promoted: HashSet::new(),
                }),
                None => self.exhausted = true,
            }
        }
    }

    /// The lookup phase of one request: looks its blocks up past the GPU cache; once the
    /// verdicts are settled (or it waited long enough) loads and verifies the hits, counts its
    /// tokens and stores what prefill computes. Returns the tokens the GPU computes for it.
    fn serve(&mut self, a: &mut Active, waited: u32) -> Result<u64, kv_tier::Error> {
        let keys = &a.turn.keys;
        let g = keys.iter().take_while(|k| self.gpu.contains(k)).count();
        let verdicts = self.manager.lookup_many(&keys[g..], &a.ctx);
        for (k, v) in keys[g..].iter().zip(&verdicts) {
            if *v == LookupResult::HitPending {
                a.promoted.insert(*k);
            }
        }
        let c = count_prefix(verdicts);
        let settled = !c.retry && c.present == c.hit;
        if !settled && waited < MAX_WAIT_STEPS {
            a.phase = Phase::Lookup { waited: waited + 1 };
            return Ok(0);
        }
        let h = c.hit;
        // the engine copies the hit blocks DRAM -> GPU: verify every byte
        self.load_and_verify(&keys[g..g + h])?;
        self.manager.touch(&keys[..g + h]);
        for k in &keys[..g + h] {
            self.gpu.insert(*k);
        }
        let recomputed = self.count_tokens(a, g, h);
        // prefill computes the rest; offload it with the output
        let mut new: Vec<BlockKey> = keys[g + h..].to_vec();
        new.extend(&a.turn.output);
        self.store(&new, &a.ctx);
        a.phase = Phase::Finish;
        Ok(recomputed + (a.turn.output.len() * self.cfg.tokens_per_block) as u64)
    }

    /// Reads the hit blocks from DRAM and checks their bytes.
    fn load_and_verify(&mut self, hits: &[BlockKey]) -> Result<(), kv_tier::Error> {
        let views = self.manager.prepare_load(hits)?;
        for (k, v) in hits.iter().zip(&views) {
            if verify_block(k, 0, v.as_slice()) {
                self.tally.blocks_verified += 1;
            } else {
                self.tally.corrupt_keys.push(*k);
            }
        }
        Ok(())
    }

    /// Counts a served request's prompt tokens by where they came from: `g` blocks from the
    /// GPU cache, then `h` hit blocks from DRAM (promoted or not). Returns the tokens
    /// recomputed.
    fn count_tokens(&mut self, a: &Active, g: usize, h: usize) -> u64 {
        let bpb = self.cfg.tokens_per_block as u64;
        let total = a.turn.keys.len() as u64 * bpb;
        let promoted = a.turn.keys[g..g + h]
            .iter()
            .filter(|k| a.promoted.contains(k))
            .count() as u64;
        let recomputed = total - (g + h) as u64 * bpb;
        let t = &mut self.tally;
        t.prompt_tokens += total;
        t.tokens_from_gpu_cache += g as u64 * bpb;
        t.tokens_from_secondary += promoted * bpb;
        t.tokens_from_dram += (h as u64 - promoted) * bpb;
        t.tokens_recomputed += recomputed;
        recomputed
    }

    /// Offloads computed blocks to kv-tier and puts them in the GPU cache.
    fn store(&mut self, new: &[BlockKey], ctx: &RequestContext) {
        for chunk in new.chunks(STORE_CHUNK) {
            match self.manager.prepare_store(chunk) {
                Ok(mut p) => {
                    for (k, sink) in p.slots() {
                        fill_block(k, 0, sink.as_mut_slice());
                    }
                    p.commit(ctx.id);
                    if self.cfg.sync_steps {
                        // the cascade lands before any probe of this step is sent
                        self.manager.runtime().block_on(self.manager.wait_jobs());
                    }
                }
                // DRAM full of pinned blocks, or write-back at its limit: these are not
                // offloaded (recomputed next time), as an engine would do.
                Err(kv_tier::Error::WriteBackFull { .. }) => {
                    self.tally.stores_refused_write_back += 1
                }
                Err(_) => self.tally.stores_refused += 1,
            }
            for k in chunk {
                self.gpu.insert(*k);
            }
        }
    }

    /// With `sync_steps`, the end of a step: waits for every job, then runs the fs GC here
    /// (stamps, then a sweep) and notes the size it left.
    fn settle(&mut self) -> Result<(), BoxError> {
        self.manager.runtime().block_on(self.manager.wait_idle());
        if let Some(fs) = self.fs
            && let Some(before) = fs.stats().gc
        {
            fs.gc_apply_stamps_now()?;
            fs.gc_sweep_now()?;
            let after = fs.stats().gc.expect("bounded");
            if after.sweeps > before.sweeps {
                let max = &mut self.tally.max_bytes_after_step_sweep;
                *max = Some(max.unwrap_or(0).max(after.bytes));
            }
        }
        Ok(())
    }

    /// Counts the events emitted since the last call.
    fn take_events(&mut self) {
        for e in self.manager.take_events() {
            self.tally.events += 1;
            if e.removed {
                self.tally.removal_events += 1;
            }
        }
    }
}
