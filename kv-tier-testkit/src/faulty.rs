//! [`FaultyTier`]: wraps any tier and fails, delays, holds or tears operations per key or on
//! a schedule, so failure paths are tested on purpose instead of by luck.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_tier_core::{
    BlockKey, Error, JobResult, LoadJob, ProtectGuard, Result, SecondaryTier, StoreJob, TierEvent,
    TierInfo, async_trait,
};
use rustc_hash::FxHashSet;

use crate::util::Gate;

#[derive(Debug, Default)]
struct Plan {
    fail_store: FxHashSet<BlockKey>,
    fail_load: FxHashSet<BlockKey>,
    tear_load: FxHashSet<BlockKey>,
    short_store: FxHashSet<BlockKey>,
    fail_every_nth_load: Option<u64>,
    fail_every_nth_store: Option<u64>,
    fail_lookups: bool,
    panic_on_lookup: bool,
    panic_on_load: bool,
    panic_on_protect: bool,
    panic_on_shutdown: bool,
    hang_shutdown: bool,
    shutdown_delay: Option<Duration>,
    delay: Option<Duration>,
    answer_delay: Option<Duration>,
    lookup_gate: Option<Gate>,
    store_gate: Option<Gate>,
    load_gate: Option<Gate>,
    load_result_gate: Option<Gate>,
    stall_loads: Option<(usize, Gate)>,
    retain_sources: bool,
}

/// A wrapper tier that injects faults. All knobs can change while jobs run.
///
/// - `fail_store` / `fail_load`: those keys fail (transient I/O error); the rest of the job runs.
/// - `fail_every_nth_load` / `fail_every_nth_store`: a schedule over blocks.
/// - `tear_load`: the block is loaded with its second half zeroed and reported as loaded (a
///   tier returning torn data), to test end-to-end verification.
/// - `short_store`: the block is handed to the inner tier truncated by one byte.
/// - `panic_on_lookup` / `panic_on_load` / `panic_on_protect` / `panic_on_shutdown`: those
///   calls panic; `hang_shutdown`: `shutdown()` never returns; `delay_shutdown`: it sleeps
///   first (a tier waiting for work its abandoned jobs left running).
/// - `delay`: every job and probe sleeps first.
/// - `delay_answers`: probes look, then sleep before answering (an answer that may arrive
///   after a store of its keys completed: a stale one).
/// - `hold_lookups`: probes run, then wait at a [`Gate`] before answering (a late probe).
/// - `hold_stores` / `hold_loads`: jobs wait at a gate before running.
/// - `stall_loads_after`: a load job loads its first blocks (each reported landed), then waits
///   at a gate before the rest (a transfer that falls behind mid-way).
/// - `retain_sources`: stores keep their jobs' buffers after returning (a zero-copy cache
///   holding DRAM slots), until `heal`.
#[derive(Debug)]
pub struct FaultyTier {
    inner: Arc<dyn SecondaryTier>,
    plan: Mutex<Plan>,
    loads_seen: AtomicU64,
    stores_seen: AtomicU64,
    injected: AtomicU64,
    shutdowns: AtomicU64,
    retained: Mutex<Vec<kv_tier_core::BlockSource>>,
    abandoned: Mutex<Vec<BlockKey>>,
}

/// Records a store job's keys if the job is dropped while the inner tier works on them.
struct Abandoned<'a> {
    keys: Vec<BlockKey>,
    into: &'a Mutex<Vec<BlockKey>>,
}

impl Drop for Abandoned<'_> {
    fn drop(&mut self) {
        if !self.keys.is_empty() {
            let mut a = self.into.lock().unwrap_or_else(|p| p.into_inner());
            a.append(&mut self.keys);
        }
    }
}

fn injected(key: &BlockKey, what: &str) -> Error {
    Error::io(
        "injected fault",
        format!("{what} of {key}"),
        std::io::Error::from_raw_os_error(5),
    )
}

impl FaultyTier {
    /// Wraps `inner` with no faults planned.
    pub fn new(inner: Arc<dyn SecondaryTier>) -> Self {
        Self {
            inner,
            plan: Mutex::new(Plan::default()),
            loads_seen: AtomicU64::new(0),
            stores_seen: AtomicU64::new(0),
            injected: AtomicU64::new(0),
            shutdowns: AtomicU64::new(0),
            retained: Mutex::new(Vec::new()),
            abandoned: Mutex::new(Vec::new()),
        }
    }

    fn plan(&self) -> std::sync::MutexGuard<'_, Plan> {
        self.plan.lock().expect("fault plan")
    }

    /// The wrapped tier.
    pub fn inner(&self) -> &Arc<dyn SecondaryTier> {
        &self.inner
    }

    /// Stores of these keys fail.
    pub fn fail_store(&self, keys: &[BlockKey]) {
        self.plan().fail_store.extend(keys.iter().copied());
    }

    /// Loads of these keys fail.
    pub fn fail_load(&self, keys: &[BlockKey]) {
        self.plan().fail_load.extend(keys.iter().copied());
    }

    /// Loads of these keys return torn data reported as loaded.
    pub fn tear_load(&self, keys: &[BlockKey]) {
        self.plan().tear_load.extend(keys.iter().copied());
    }

    /// Stores of these keys hand the inner tier a block one byte short.
    pub fn short_store(&self, keys: &[BlockKey]) {
        self.plan().short_store.extend(keys.iter().copied());
    }

    /// Every `n`-th block loaded fails (`None` stops).
    pub fn fail_every_nth_load(&self, n: Option<u64>) {
        self.plan().fail_every_nth_load = n.filter(|&n| n > 0);
    }

    /// Every `n`-th block stored fails (`None` stops).
    pub fn fail_every_nth_store(&self, n: Option<u64>) {
        self.plan().fail_every_nth_store = n.filter(|&n| n > 0);
    }

    /// Probes return an error.
    pub fn fail_lookups(&self, on: bool) {
        self.plan().fail_lookups = on;
    }

    /// Probes panic (the manager must survive a panicking tier).
    pub fn panic_on_lookup(&self, on: bool) {
        self.plan().panic_on_lookup = on;
    }

    /// Loads panic (the manager must survive a panicking tier).
    pub fn panic_on_load(&self, on: bool) {
        self.plan().panic_on_load = on;
    }

    /// `protect()` panics.
    pub fn panic_on_protect(&self, on: bool) {
        self.plan().panic_on_protect = on;
    }

    /// `shutdown()` panics (before shutting the inner tier down).
    pub fn panic_on_shutdown(&self, on: bool) {
        self.plan().panic_on_shutdown = on;
    }

    /// `shutdown()` never returns.
    pub fn hang_shutdown(&self, on: bool) {
        self.plan().hang_shutdown = on;
    }

    /// `shutdown()` sleeps `d` before shutting the inner tier down (`None` stops).
    pub fn delay_shutdown(&self, d: Option<Duration>) {
        self.plan().shutdown_delay = d;
    }

    /// How many times `shutdown()` was called.
    pub fn shutdowns(&self) -> u64 {
        self.shutdowns.load(Ordering::Relaxed)
    }

    /// Every job and probe sleeps `d` first (`None` stops).
    pub fn delay(&self, d: Option<Duration>) {
        self.plan().delay = d;
    }

    /// Probes answer only after the returned gate opens (they observe the inner tier first).
    pub fn hold_lookups(&self) -> Gate {
        let g = Gate::new();
        self.plan().lookup_gate = Some(g.clone());
        g
    }

    /// Store jobs start only after the returned gate opens.
    pub fn hold_stores(&self) -> Gate {
        let g = Gate::new();
        self.plan().store_gate = Some(g.clone());
        g
    }

    /// Load jobs start only after the returned gate opens.
    pub fn hold_loads(&self) -> Gate {
        let g = Gate::new();
        self.plan().load_gate = Some(g.clone());
        g
    }

    /// Each load job loads its first `n` blocks (their sinks dropped and reported landed, see
    /// `LoadProgress`), then waits at the returned gate before it loads the rest.
    pub fn stall_loads_after(&self, n: usize) -> Gate {
        let g = Gate::new();
        self.plan().stall_loads = Some((n, g.clone()));
        g
    }

    /// Load jobs run (and release their buffers), then wait at the returned gate before
    /// reporting: a finished transfer whose result has not arrived yet.
    pub fn hold_load_results(&self) -> Gate {
        let g = Gate::new();
        self.plan().load_result_gate = Some(g.clone());
        g
    }

    /// Stores keep a view of their jobs' buffers after returning (`false` and `heal` let them
    /// go): the DRAM slots stay pinned.
    pub fn retain_sources(&self, on: bool) {
        self.plan().retain_sources = on;
        if !on {
            self.retained.lock().expect("retained").clear();
        }
    }

    /// Probes look, then sleep `d` before answering (`None`: answer at once).
    pub fn delay_answers(&self, d: Option<Duration>) {
        self.plan().answer_delay = d;
    }

    /// Takes the keys of store jobs dropped (cancelled, or abandoned at a deadline) while the
    /// inner tier was storing them: each may or may not have landed, unknown to the caller.
    pub fn take_abandoned_stores(&self) -> Vec<BlockKey> {
        std::mem::take(&mut *self.abandoned.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Removes every planned fault and opens every gate.
    pub fn heal(&self) {
        self.retained.lock().expect("retained").clear();
        let mut p = self.plan();
        for g in [&p.lookup_gate, &p.store_gate, &p.load_gate]
            .into_iter()
            .flatten()
        {
            g.open();
        }
        *p = Plan::default();
    }

    /// Faults injected so far (failed or torn blocks, failed probes).
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    async fn pause(&self, gate: Option<Gate>) {
        let delay = self.plan().delay;
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        if let Some(g) = gate {
            g.pass().await;
        }
    }
}

#[async_trait]
impl SecondaryTier for FaultyTier {
    fn info(&self) -> TierInfo {
        self.inner.info()
    }

    async fn lookup(&self, keys: &[BlockKey]) -> Result<Vec<bool>> {
        let delay = self.plan().delay;
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        if self.plan().panic_on_lookup {
            panic!("injected panic in FaultyTier::lookup");
        }
        let answer = self.inner.lookup(keys).await;
        let (gate, fail, answer_delay) = {
            let p = self.plan();
            (p.lookup_gate.clone(), p.fail_lookups, p.answer_delay)
        };
        if let Some(d) = answer_delay {
            tokio::time::sleep(d).await;
        }
        if let Some(g) = gate {
            g.pass().await;
        }
        if fail {
            self.injected.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Backend {
                tier: self.inner.info().name,
                message: "injected probe failure".into(),
                transient: true,
            });
        }
        answer
    }

    async fn store(&self, job: StoreJob) -> JobResult {
        let gate = self.plan().store_gate.clone();
        self.pause(gate).await;
        let mut res = JobResult::default();
        let mut pass = StoreJob::default();
        {
            let p = self.plan();
            if p.retain_sources {
                let mut kept = self.retained.lock().expect("retained");
                kept.extend(job.blocks.iter().map(|(_, s)| s.clone()));
            }
            for (key, src) in job.blocks {
                let n = self.stores_seen.fetch_add(1, Ordering::Relaxed) + 1;
                let nth = p.fail_every_nth_store.is_some_and(|m| n.is_multiple_of(m));
                if p.fail_store.contains(&key) || nth {
                    self.injected.fetch_add(1, Ordering::Relaxed);
                    res.failed.push((key, injected(&key, "store")));
                } else if p.short_store.contains(&key) && !src.is_empty() {
                    let short = src.bytes().slice(..src.len() - 1);
                    pass.blocks
                        .push((key, kv_tier_core::BlockSource::from_bytes(short)));
                } else {
                    pass.blocks.push((key, src));
                }
            }
        }
        // a job dropped while the inner tier works (its deadline passed) may still land in
        // the tier: the caller never learns of it
        let mut watch = Abandoned {
            keys: pass.blocks.iter().map(|(k, _)| *k).collect(),
            into: &self.abandoned,
        };
        let inner = self.inner.store(pass).await;
        watch.keys.clear();
        res.ok.extend(inner.ok);
        res.failed.extend(inner.failed);
        res
    }

    async fn load(&self, job: LoadJob) -> JobResult {
        let res = self.load_inner(job).await;
        let gate = self.plan().load_result_gate.clone();
        if let Some(g) = gate {
            g.pass().await;
        }
        res
    }

    fn touch(&self, keys: &[BlockKey]) {
        self.inner.touch(keys)
    }

    fn protect(&self, keys: &[BlockKey]) -> ProtectGuard {
        if self.plan().panic_on_protect {
            panic!("injected panic in FaultyTier::protect");
        }
        self.inner.protect(keys)
    }

    fn is_protected(&self, key: &BlockKey) -> bool {
        self.inner.is_protected(key)
    }

    fn take_events(&self) -> Vec<TierEvent> {
        self.inner.take_events()
    }

    fn configure_events(&self, settings: kv_tier_core::EventSettings) {
        self.inner.configure_events(settings);
    }

    fn events_dropped(&self) -> u64 {
        self.inner.events_dropped()
    }

    fn stats(&self) -> kv_tier_core::TierSnapshot {
        self.inner.stats()
    }

    async fn shutdown(&self) -> Result<()> {
        self.shutdowns.fetch_add(1, Ordering::Relaxed);
        let (panics, hangs, delay) = {
            let p = self.plan();
            (p.panic_on_shutdown, p.hang_shutdown, p.shutdown_delay)
        };
        if panics {
            panic!("injected panic in FaultyTier::shutdown");
        }
        if hangs {
            std::future::pending::<()>().await;
        }
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        self.heal();
        self.inner.shutdown().await
    }
}

impl FaultyTier {
    async fn load_inner(&self, job: LoadJob) -> JobResult {
        let gate = self.plan().load_gate.clone();
        self.pause(gate).await;
        if self.plan().panic_on_load {
            panic!("injected panic in FaultyTier::load");
        }
        let mut res = JobResult::default();
        let mut pass = LoadJob {
            progress: job.progress.clone(),
            ..LoadJob::default()
        };
        let tear: FxHashSet<BlockKey>;
        {
            let p = self.plan();
            tear = p.tear_load.clone();
            for (key, sink) in job.blocks {
                let n = self.loads_seen.fetch_add(1, Ordering::Relaxed) + 1;
                let nth = p.fail_every_nth_load.is_some_and(|m| n.is_multiple_of(m));
                if p.fail_load.contains(&key) || nth {
                    self.injected.fetch_add(1, Ordering::Relaxed);
                    res.failed.push((key, injected(&key, "load")));
                } else {
                    pass.blocks.push((key, sink));
                }
            }
        }
        let stall = self.plan().stall_loads.clone();
        if let Some((n, gate)) = stall
            && tear.is_empty()
        {
            let rest = LoadJob {
                blocks: pass.blocks.split_off(n.min(pass.blocks.len())),
                requests: pass.requests.clone(),
                progress: pass.progress.clone(),
            };
            if !pass.blocks.is_empty() {
                let first = self.inner.load(pass).await;
                res.ok.extend(first.ok);
                res.failed.extend(first.failed);
            }
            if !rest.blocks.is_empty() {
                gate.pass().await;
                let rest = self.inner.load(rest).await;
                res.ok.extend(rest.ok);
                res.failed.extend(rest.failed);
            }
            return res;
        }
        if tear.is_empty() {
            let inner = self.inner.load(pass).await;
            res.ok.extend(inner.ok);
            res.failed.extend(inner.failed);
            return res;
        }
        // Torn keys: load into a private buffer, then copy half into the real sink.
        let mut real = Vec::new();
        let mut proxied = LoadJob::default();
        for (key, sink) in pass.blocks {
            if tear.contains(&key) {
                let (s, reader) = kv_tier_core::BlockSink::pair(sink.len());
                proxied.blocks.push((key, s));
                real.push((key, Some(sink), Some(reader)));
            } else {
                proxied.blocks.push((key, sink));
                real.push((key, None, None));
            }
        }
        let inner = self.inner.load(proxied).await;
        res.failed.extend(inner.failed);
        for key in inner.ok {
            let Some(pos) = real.iter().position(|(k, _, _)| *k == key) else {
                continue;
            };
            let (_, sink, reader) = &mut real[pos];
            if let (Some(mut sink), Some(reader)) = (sink.take(), reader.take()) {
                let bytes = reader
                    .into_bytes()
                    .expect("proxy sink dropped by the inner load");
                let half = bytes.len() / 2;
                sink.as_mut_slice()[..half].copy_from_slice(&bytes[..half]);
                sink.as_mut_slice()[half..].fill(0);
                self.injected.fetch_add(1, Ordering::Relaxed);
            }
            // (its sink, torn or not, is dropped by now)
            pass.progress.landed(key);
            res.ok.push(key);
        }
        res
    }
}
