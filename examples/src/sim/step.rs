//! The engine: a scheduler over a simulated GPU prefix cache, one step at a time, counting
//! what it does in a [`Tally`].

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kv_tier::fs::FsTier;
use kv_tier::{BlockKey, LookupResult, MissCause, RequestContext, TieringManager, count_prefix};
use kv_tier_testkit::{Turn, Workload, fill_block, verify_block};

use super::SimConfig;
use super::attribution::{Attribution, ChainsHeld, Ledger, Lost};
use super::offline::{Lru, Recorder, TraceRecord};

type BoxError = Box<dyn std::error::Error>;

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
    /// Every prompt token in its bucket (see `attribution`).
    pub(super) attribution: Attribution,
    /// Per secondary tier at the end: its blocks and the dead ones among them, by the
    /// workload's chains.
    pub(super) chains_held: Vec<ChainsHeld>,
    /// Per request that waited at least one step: from its first lookup to its blocks.
    pub(super) waits: Vec<Duration>,
    /// Per request: the modelled time to first token (its wait plus the recompute of its
    /// missed tokens at the prefill rate).
    pub(super) ttft: Vec<Duration>,
    /// Requests that waited longer than recomputing the tokens they waited for would take.
    pub(super) waited_longer: u64,
    /// The tier tokens of those requests.
    pub(super) waited_longer_tokens: u64,
    /// Those of them that got no tier token.
    pub(super) waited_for_nothing: u64,
    /// Per request that waited: its wait less the time to recompute the tier tokens it got,
    /// ms (positive: the wait did not pay).
    pub(super) wait_over_recompute_ms: Vec<f64>,
    /// Blocks a promotion brought into DRAM that no request has used since (served from
    /// DRAM or the tier) yet.
    pub(super) promoted_unused: std::collections::HashSet<BlockKey>,
    /// The requests in the order they were served (and the restart), as block ids.
    pub(super) trace: Recorder,
    /// Prompt and hit tokens up to the restart.
    pub(super) before_restart: Option<(u64, u64)>,
    /// From the reopen to the first token served from a tier, once there was one.
    pub(super) first_tier_hit_after_restart: Option<Duration>,
    /// How long the shutdown and reopen took.
    pub(super) reopen: Option<Duration>,
}

impl Tally {
    /// A block came back with wrong bytes.
    pub(super) fn corrupt(&self) -> bool {
        !self.corrupt_keys.is_empty()
    }

    /// Prompt tokens not recomputed.
    pub(super) fn hit_tokens(&self) -> u64 {
        self.prompt_tokens - self.tokens_recomputed
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
type GpuCache = Lru<BlockKey>;

enum Phase {
    Lookup { waited: u32 },
    Finish,
}

struct Active {
    turn: Turn,
    ctx: RequestContext,
    phase: Phase,
    /// Keys answered `HitPending` for this request while a promotion brought them up from a
    /// secondary tier, with that tier. The other hits were already in DRAM.
    promoted: HashMap<BlockKey, String>,
    /// Its first lookup.
    first_ask: Instant,
}

/// With `sync_steps`, how far ahead of the wall clock the fs GC clock is frozen at the first
/// step: more than a run lasts, so the files' own mtimes stay behind it.
const GC_CLOCK_LEAD: Duration = Duration::from_secs(3600);

/// With `sync_steps`, how far the fs GC clock moves per step: past the step-scale grace
/// window (2 us) and stamp interval (1 us), so the step's own files are not spared by the
/// sweep that settles it, and small enough that a restart's clock, frozen later, is ahead of
/// every time the run before it set.
const GC_CLOCK_STEP: Duration = Duration::from_micros(4);

/// With `sync_steps`, before the first step (and after a restart, on the new tier): the fs
/// tier's GC clock is frozen [`GC_CLOCK_LEAD`] ahead of the wall clock, so no file's own
/// mtime is newer than what the index holds (none is taken from the disk), and a restart's
/// clock is ahead of every time the run before it set. An unbounded fs tier has no GC.
fn lead_gc_clock(fs: Option<&FsTier>) {
    if let Some(fs) = fs
        && fs.stats().gc.is_some()
        && fs.freeze_gc_clock().is_ok()
    {
        let _ = fs.advance_gc_clock(GC_CLOCK_LEAD);
    }
}

/// The engine: admits turns up to the batch size and takes each through lookup (waiting for
/// its promotions), load and verify, store, and finish, a step at a time.
pub(super) struct Engine<'a> {
    cfg: &'a SimConfig,
    manager: Arc<TieringManager>,
    /// The fs tier whose GC runs at the end of each step with `sync_steps`.
    fs: Option<Arc<FsTier>>,
    /// Every block's history, for the attribution.
    ledger: Ledger,
    /// No new turns for now (a restart is due once the running ones end).
    paused: bool,
    /// When the manager was reopened.
    reopened_at: Option<Instant>,
    workload: Workload,
    gpu: GpuCache,
    active: Vec<Active>,
    /// No more turns to admit: the workload is played or the admission window is over.
    exhausted: bool,
    /// The workload has handed out its last turn.
    workload_done: bool,
    /// Turns whose conversation's previous turn still runs: a conversation's next turn
    /// arrives only once its last answer is out (it holds that answer).
    waiting: VecDeque<Turn>,
    started: Instant,
    tally: Tally,
}

impl<'a> Engine<'a> {
    pub(super) fn new(
        cfg: &'a SimConfig,
        manager: Arc<TieringManager>,
        fs: Option<Arc<FsTier>>,
        workload: Workload,
    ) -> Self {
        let tally = Tally {
            requests_planned: workload.total_turns() as u64,
            ..Tally::default()
        };
        let ledger = Ledger::new(manager.tier_names().to_vec());
        if cfg.sync_steps {
            lead_gc_clock(fs.as_deref());
        }
        Self {
            cfg,
            manager,
            fs,
            ledger,
            paused: false,
            reopened_at: None,
            workload,
            gpu: GpuCache::new(cfg.gpu_cache_blocks),
            active: Vec::new(),
            exhausted: false,
            workload_done: false,
            waiting: VecDeque::new(),
            started: Instant::now(),
            tally,
        }
    }

    /// Nothing left to admit and nothing running.
    pub(super) fn done(&self) -> bool {
        self.active.is_empty() && self.exhausted
    }

    /// Admits no new turn until [`Engine::restarted`]; true once nothing runs.
    pub(super) fn pause(&mut self) -> bool {
        self.paused = true;
        self.active.is_empty()
    }

    /// The manager was shut down (its last events taken) and reopened on the same root:
    /// DRAM and the GPU cache are empty, the tiers keep what they hold.
    pub(super) fn restarted(
        &mut self,
        manager: Arc<TieringManager>,
        fs: Option<Arc<FsTier>>,
        took: Duration,
    ) {
        let t = &mut self.tally;
        t.before_restart = Some((t.prompt_tokens, t.hit_tokens()));
        t.reopen = Some(took);
        t.trace.records.push(TraceRecord::Restart);
        self.ledger.restarted();
        self.manager = manager;
        if self.cfg.sync_steps {
            lead_gc_clock(fs.as_deref());
        }
        self.fs = fs;
        self.gpu = GpuCache::new(self.cfg.gpu_cache_blocks);
        self.paused = false;
        self.reopened_at = Some(Instant::now());
    }

    /// Time since the engine started.
    pub(super) fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    pub(super) fn tally(&self) -> &Tally {
        &self.tally
    }

    /// The tally, with what each tier holds at the end against the workload's chains.
    pub(super) fn into_tally(mut self) -> Tally {
        self.take_events();
        self.tally.chains_held = self.ledger.chains_held();
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
        while self.active.len() < self.cfg.max_batch && !self.exhausted && !self.paused {
            if self.started.elapsed() >= self.cfg.duration {
                self.exhausted = true;
                break;
            }
            let busy =
                |active: &[Active], stream: usize| active.iter().any(|a| a.turn.stream == stream);
            // the earliest waiting turn of a conversation that runs nothing now
            if let Some(i) = self
                .waiting
                .iter()
                .position(|t| !busy(&self.active, t.stream))
            {
                let turn = self.waiting.remove(i).expect("found above");
                self.start(turn);
                continue;
            }
            if self.workload_done || self.waiting.len() >= self.cfg.streams {
                // nothing to admit until a running turn ends
                self.exhausted = self.workload_done && self.waiting.is_empty();
                break;
            }
            match self.workload.next() {
                Some(turn) if busy(&self.active, turn.stream) => self.waiting.push_back(turn),
                Some(turn) => self.start(turn),
                None => {
                    self.workload_done = true;
                    self.exhausted = self.waiting.is_empty();
                }
            }
        }
    }

    /// Admits `turn`.
    fn start(&mut self, turn: Turn) {
        self.active.push(Active {
            ctx: RequestContext::new(turn.request),
            turn,
            phase: Phase::Lookup { waited: 0 },
            promoted: HashMap::new(),
            first_ask: Instant::now(),
        });
    }

    /// The lookup phase of one request: looks its blocks up past the GPU cache; once the
    /// verdicts are settled (or it waited long enough) loads and verifies the hits, counts its
    /// tokens and stores what prefill computes. Returns the tokens the GPU computes for it.
    fn serve(&mut self, a: &mut Active, waited: u32) -> Result<u64, kv_tier::Error> {
        let keys = &a.turn.keys;
        let g = keys.iter().take_while(|k| self.gpu.contains(k)).count();
        // the lookup starts past the GPU cache's prefix: its first key follows that prefix
        let ctx = match g.checked_sub(1) {
            Some(last) => a.ctx.clone().follows(keys[last], g as u32),
            None => a.ctx.clone(),
        };
        let verdicts = self.manager.lookup_many(&keys[g..], &ctx);
        for (k, v) in keys[g..].iter().zip(&verdicts) {
            if *v == LookupResult::HitPending
                && let Some(tier) = self.manager.promotion_tier(k)
            {
                a.promoted.insert(*k, tier.to_string());
                // unused until a request is served it (this one or another: several may
                // wait for one promotion; a key pending again later is a new promotion)
                self.tally.promoted_unused.insert(*k);
            }
        }
        let c = count_prefix(verdicts.iter().copied());
        let settled = !c.retry && c.present == c.hit;
        if !settled && waited < self.cfg.max_wait_steps {
            a.phase = Phase::Lookup { waited: waited + 1 };
            return Ok(0);
        }
        let h = c.hit;
        // why the first block past the hits is not one: the manager's miss, or the give-up
        let first = match verdicts.get(h) {
            None => None,
            Some(LookupResult::Miss) => Some(Lost::Manager(
                self.manager
                    .last_miss(a.ctx.id)
                    .unwrap_or(MissCause::NotFound),
            )),
            Some(_) => Some(Lost::GaveUp),
        };
        // the engine copies the hit blocks DRAM -> GPU: verify every byte
        self.load_and_verify(&keys[g..g + h])?;
        self.manager.touch(&keys[..g + h]);
        for k in &keys[..g + h] {
            self.gpu.put(*k);
        }
        let recomputed = self.account(a, g, h, first, waited);
        let chain: Vec<BlockKey> = keys.iter().chain(&a.turn.output).copied().collect();
        self.ledger.chain(&chain);
        // prefill computes the rest; offload it with the output
        self.store(&chain, g + h, &a.ctx);
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

    /// Counts a served request's prompt tokens by where they came from (`g` blocks from the
    /// GPU cache, then `h` hit blocks from DRAM, promoted or not) and puts each in its bucket
    /// (`first`: why the first block past the served ones is not served); counts its wait,
    /// its modelled time to first token, its unused promotions and its trace record. Returns
    /// the tokens recomputed.
    fn account(&mut self, a: &Active, g: usize, h: usize, first: Option<Lost>, waited: u32) -> u64 {
        // the ledger as of now: this step's DRAM evictions and the tiers' removals included
        self.take_events();
        let bpb = self.cfg.tokens_per_block as u64;
        let keys = &a.turn.keys;
        let gave_up = matches!(first, Some(Lost::GaveUp));
        let lost = self.ledger.classify(&keys[g + h..], first, gave_up);
        let t = &mut self.tally;
        let mut add = |label: String, n: u64| {
            if n > 0 {
                *t.attribution.entry(label).or_insert(0) += n;
            }
        };
        add("served/gpu".into(), g as u64 * bpb);
        let mut tier_tokens = 0;
        for k in &keys[g..g + h] {
            match a.promoted.get(k) {
                Some(tier) => {
                    add(format!("served/{tier}"), bpb);
                    tier_tokens += bpb;
                }
                None => add("served/dram".into(), bpb),
            }
        }
        for l in lost {
            add(l.label(), bpb);
        }
        let total = keys.len() as u64 * bpb;
        let recomputed = total - (g + h) as u64 * bpb;
        t.prompt_tokens += total;
        t.tokens_from_gpu_cache += g as u64 * bpb;
        t.tokens_from_secondary += tier_tokens;
        t.tokens_from_dram += h as u64 * bpb - tier_tokens;
        t.tokens_recomputed += recomputed;
        // the request's wait, against the recompute of the tokens it waited for
        let wait = if waited > 0 {
            a.first_ask.elapsed()
        } else {
            Duration::ZERO
        };
        let rate = self.cfg.prefill_tokens_per_s;
        if waited > 0 {
            t.waits.push(wait);
        }
        if rate > 0.0 {
            t.ttft
                .push(wait + Duration::from_secs_f64(recomputed as f64 / rate));
            if waited > 0 {
                t.wait_over_recompute_ms
                    .push((wait.as_secs_f64() - tier_tokens as f64 / rate) * 1e3);
            }
            if waited > 0 && wait.as_secs_f64() > tier_tokens as f64 / rate {
                t.waited_longer += 1;
                t.waited_longer_tokens += tier_tokens;
                if tier_tokens == 0 {
                    t.waited_for_nothing += 1;
                }
            }
        }
        // a promoted block counts as used once any request is served it
        for k in &keys[g..g + h] {
            t.promoted_unused.remove(k);
        }
        if tier_tokens > 0
            && t.first_tier_hit_after_restart.is_none()
            && let Some(at) = self.reopened_at
        {
            t.first_tier_hit_after_restart = Some(at.elapsed());
        }
        t.trace.request(keys, &a.turn.output);
        recomputed
    }

    /// Offloads the computed blocks of a request's `chain` (its blocks from `from` on) to
    /// kv-tier and puts them in the GPU cache. Each batch says which block it follows: the
    /// one before it in the chain, whether or not that one was stored.
    fn store(&mut self, chain: &[BlockKey], from: usize, ctx: &RequestContext) {
        for (i, chunk) in chain[from..].chunks(STORE_CHUNK).enumerate() {
            let at = from + i * STORE_CHUNK;
            match self.manager.prepare_store(chunk) {
                Ok(mut p) => {
                    for (k, sink) in p.slots() {
                        fill_block(k, 0, sink.as_mut_slice());
                    }
                    if let Some(parent) = at.checked_sub(1).map(|p| chain[p]) {
                        p = p.follows(parent, at as u32);
                    }
                    let receipt = p.commit(ctx.id);
                    self.ledger.offered(chunk);
                    self.ledger.receipt(&receipt);
                    if self.cfg.sync_steps {
                        // the cascade lands before any probe of this step is sent
                        self.manager.runtime().block_on(self.manager.wait_jobs());
                    }
                }
                // DRAM full of pinned blocks, or write-back at its limit: these are not
                // offloaded (recomputed next time), as an engine would do.
                Err(kv_tier::Error::WriteBackFull { .. }) => {
                    self.tally.stores_refused_write_back += 1;
                    self.ledger.refused(chunk, "write_back_full");
                }
                Err(_) => {
                    self.tally.stores_refused += 1;
                    self.ledger.refused(chunk, "pinned");
                }
            }
            for k in chunk {
                self.gpu.put(*k);
            }
        }
    }

    /// With `sync_steps`, the end of a step: waits for every job, then runs the fs GC here
    /// (stamps, then a sweep) on its logical clock and notes the size it left.
    ///
    /// The GC's recency is its clock's time at each store and stamp; on wall time, which of
    /// a step's files count older than which (and what a grace window spares) would depend
    /// on how fast the step ran. So the clock is frozen before the first step (see
    /// [`lead_gc_clock`]) and moves [`GC_CLOCK_STEP`] at the end of each step, before its
    /// sweep: a step's files share one time, ties go by key, every use is stamped and none
    /// is spared for its age (the config's step-scale windows, see `SimConfig::tier_config`;
    /// nothing is in flight when the sweep runs).
    fn settle(&mut self) -> Result<(), BoxError> {
        self.manager.runtime().block_on(self.manager.wait_idle());
        if let Some(fs) = &self.fs
            && let Some(before) = fs.stats().gc
        {
            fs.advance_gc_clock(GC_CLOCK_STEP)?;
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

    /// Takes the events emitted since the last call into the ledger, counting them.
    pub(super) fn take_events(&mut self) {
        for e in self.manager.take_events() {
            self.ledger.event(&e);
            self.tally.events += 1;
            if e.removed {
                self.tally.removal_events += 1;
            }
        }
    }
}
