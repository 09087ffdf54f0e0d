//! [`ControlledStore`]: an `ObjectStore` wrapper (over `InMemory`) whose requests can be held
//! at a gate or slowed, per kind of request, to drive deadlines and interleavings
//! deterministically (with tokio's paused clock, a held request lasts exactly until a
//! deadline fires), or to play a backend that stops answering; and that fails on demand the
//! way a network store does: GET bodies that hang, break or run long ([`BodyFault`]), PUTs
//! refused, half written or whose reply is lost ([`PutFault`]), PUTs that land after the
//! client gave up, DELETE answers naming another path.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::Gate;
use futures::StreamExt;
use futures::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, ObjectStoreExt, PutMultipartOptions, PutOptions, PutPayload, PutResult, Result,
};

/// A kind of request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `get_opts` with `head: true` (what `ObjectStoreExt::head` sends).
    Head,
    /// `put_opts`.
    Put,
    /// `get_opts`.
    Get,
    /// One object's delete in `delete_stream` (what `ObjectStoreExt::delete` sends).
    Delete,
}

impl Op {
    /// Every kind.
    pub const ALL: [Op; 4] = [Op::Head, Op::Put, Op::Get, Op::Delete];
}

/// How the body of a GET goes wrong ([`ControlledStore::break_bodies`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyFault {
    /// Half the body arrives, then the stream never ends.
    Hang,
    /// Half the body arrives, then the stream answers an error.
    Break,
    /// The whole body arrives with this many bytes (`0xAB`) more; the metadata gives the
    /// size without them.
    Longer(usize),
}

/// How a PUT goes wrong ([`ControlledStore::fail_puts`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutFault {
    /// It does not run, and answers a server error (a 503 SlowDown).
    Refused,
    /// It writes the first half of its body, without metadata, then answers an error (a
    /// store whose writes are not atomic: the connection reset mid-body).
    HalfWritten,
    /// It lands, then answers an error (its reply lost: the connection reset after the
    /// request was sent). A PUT the store refused on its own answers that instead, and does
    /// not count as one of the failures asked for.
    ReplyLost,
}

/// The PUTs [`ControlledStore::fail_puts`] asked to fail.
struct PutFaults {
    fault: PutFault,
    /// Of paths ending with this ("" for every path).
    suffix: String,
    /// How many more.
    left: usize,
}

#[derive(Default)]
struct Plan {
    gates: HashMap<Op, Gate>,
    path_gates: Vec<(Op, String, Gate)>,
    delays: HashMap<Op, Duration>,
    /// Replies of requests that have run take this long to arrive.
    reply_delays: HashMap<Op, Duration>,
    /// GET bodies arrive in chunks of this many bytes.
    chunk: Option<usize>,
    /// GET bodies lose this many bytes at their end (the metadata still says whole).
    cut: usize,
    /// Create-only PUTs are refused as not implemented.
    no_create: bool,
    /// LISTs of this prefix fail after their first object (a listing that breaks part
    /// way).
    fail_lists: Option<String>,
    /// LISTs answer only once this gate opens (what they answer is taken when they are
    /// sent).
    list_gate: Option<Gate>,
    /// GET bodies of these paths go wrong.
    broken_bodies: HashMap<String, BodyFault>,
    /// PUTs that fail.
    put_faults: Option<PutFaults>,
    /// PUTs of paths ending with this run this long after they were sent, in a task of their
    /// own.
    late_puts: Option<(String, Duration)>,
    /// DELETEs of missing objects answer NotFound naming another path.
    misname_missing: bool,
}

/// An `ObjectStore` over [`InMemory`] whose requests can be held, slowed or failed (see the
/// module docs). Copies and multipart uploads pass straight through; LISTs can be held
/// ([`ControlledStore::hold_lists`]) or broken ([`ControlledStore::fail_lists`]).
///
/// ```
/// # async fn demo() {
/// use kv_tier_testkit::controlled_store::{ControlledStore, Op};
/// use object_store::{ObjectStoreExt, path::Path};
/// let store = ControlledStore::new();
/// let path = Path::from("a");
/// store.hold(Op::Put); // PUTs wait from now on
/// let (put, ()) = futures::join!(store.put(&path, vec![1u8].into()), async {
///     // the PUT is in flight and has not landed
///     assert!(!store.exists("a").await);
///     store.release(Op::Put);
/// });
/// put.unwrap();
/// assert!(store.exists("a").await);
/// # }
/// ```
pub struct ControlledStore {
    /// The store requests reach once they pass.
    pub inner: InMemory,
    ctl: Arc<Control>,
}

/// What the requests of a [`ControlledStore`] pass through (shared with its delete streams,
/// which outlive the call that made them).
#[derive(Default)]
struct Control {
    plan: Mutex<Plan>,
    counts: Mutex<HashMap<Op, usize>>,
    /// Requests that entered (held or not), all kinds.
    started: AtomicUsize,
    /// PUTs failed as [`ControlledStore::fail_puts`] asked.
    failed_puts: AtomicUsize,
    /// Late PUTs sent and not landed yet.
    late_in_flight: AtomicUsize,
    /// Late PUTs that landed (or failed) on the inner store.
    landed_late: AtomicUsize,
}

impl fmt::Debug for ControlledStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ControlledStore")
    }
}

impl fmt::Display for ControlledStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ControlledStore(InMemory)")
    }
}

impl Default for ControlledStore {
    fn default() -> Self {
        Self::new()
    }
}

impl ControlledStore {
    /// An empty store that lets every request through.
    pub fn new() -> Self {
        Self {
            inner: InMemory::new(),
            ctl: Arc::default(),
        }
    }

    /// Requests of `op` from now on wait at the returned gate (until `release`). Holding a
    /// kind already held returns its gate.
    pub fn hold(&self, op: Op) -> Gate {
        self.ctl
            .plan
            .lock()
            .unwrap()
            .gates
            .entry(op)
            .or_default()
            .clone()
    }

    /// Requests of `op` on `path` from now on wait at the returned gate (until `release`).
    pub fn hold_path(&self, op: Op, path: &str) -> Gate {
        let g = Gate::new();
        self.ctl
            .plan
            .lock()
            .unwrap()
            .path_gates
            .push((op, path.to_string(), g.clone()));
        g
    }

    /// Holds every kind of request (a backend that stops answering) until [`Self::release_all`].
    /// Listing, copies and multipart uploads are not held.
    pub fn hold_all(&self) {
        for op in Op::ALL {
            self.hold(op);
        }
    }

    /// Opens every gate, lets every later request through, and ends reply delays (a reply
    /// already waiting still waits).
    pub fn release_all(&self) {
        for op in Op::ALL {
            self.release(op);
        }
        self.ctl.plan.lock().unwrap().reply_delays.clear();
    }

    /// Opens `op`'s gates and lets later requests through.
    pub fn release(&self, op: Op) {
        let mut p = self.ctl.plan.lock().unwrap();
        if let Some(g) = p.gates.remove(&op) {
            g.open();
        }
        p.path_gates.retain(|(o, _, g)| {
            if *o == op {
                g.open();
            }
            *o != op
        });
    }

    /// LISTs from now on see the objects there when they are sent, and answer only once the
    /// returned gate opens (until [`Self::release_lists`]): a LIST whose answer is on its way
    /// while the objects change. Holding them again returns the same gate.
    pub fn hold_lists(&self) -> Gate {
        self.ctl
            .plan
            .lock()
            .unwrap()
            .list_gate
            .get_or_insert_with(Gate::new)
            .clone()
    }

    /// Opens the gate of [`Self::hold_lists`] and lets later LISTs through.
    pub fn release_lists(&self) {
        if let Some(g) = self.ctl.plan.lock().unwrap().list_gate.take() {
            g.open();
        }
    }

    /// Requests of `op` take `d` (on tokio's clock) before they run.
    pub fn delay(&self, op: Op, d: Duration) {
        self.ctl.plan.lock().unwrap().delays.insert(op, d);
    }

    /// Requests of `op` run at once, and their replies take `d` (on tokio's clock) to
    /// arrive: a client whose deadline fires meanwhile cannot tell that the request ran (a
    /// PUT that landed, a DELETE that removed its object).
    pub fn delay_replies(&self, op: Op, d: Duration) {
        self.ctl.plan.lock().unwrap().reply_delays.insert(op, d);
    }

    /// GET bodies arrive in chunks of `n` bytes from now on (`None`: as the inner store
    /// sends them), as a network client's body stream does.
    pub fn chunk_gets(&self, n: Option<usize>) {
        self.ctl.plan.lock().unwrap().chunk = n.map(|n| n.max(1));
    }

    /// GET bodies end `n` bytes early from now on while their metadata still gives the
    /// whole size: a body cut short without the client noticing (0: whole).
    pub fn cut_gets(&self, n: usize) {
        self.ctl.plan.lock().unwrap().cut = n;
    }

    /// Refuses create-only PUTs (`PutMode::Create`) as not implemented from now on, as a
    /// store without conditional writes does.
    pub fn refuse_create(&self, on: bool) {
        self.ctl.plan.lock().unwrap().no_create = on;
    }

    /// From now on, a LIST (`list`) of the prefix `of` yields its first object, then fails
    /// (a listing broken part way: a page that timed out, a connection reset); `None` ends
    /// it.
    pub fn fail_lists(&self, of: Option<&str>) {
        self.ctl.plan.lock().unwrap().fail_lists = of.map(str::to_string);
    }

    /// GETs of `path` from now on have bodies that go wrong as `fault` says (`None`: whole
    /// again). Such a body is sent whole at once, neither chunked nor cut.
    pub fn break_bodies(&self, path: &str, fault: Option<BodyFault>) {
        let mut p = self.ctl.plan.lock().unwrap();
        match fault {
            Some(f) => p.broken_bodies.insert(path.to_string(), f),
            None => p.broken_bodies.remove(path),
        };
    }

    /// From now on, the next `times` PUTs of paths ending with `suffix` ("" for every path;
    /// `times` = `usize::MAX`: until [`Self::stop_failing_puts`]) fail as `fault` says,
    /// replacing what an earlier call asked. They pass the gates and delays first, as any
    /// PUT does.
    pub fn fail_puts(&self, fault: PutFault, suffix: &str, times: usize) {
        self.ctl.plan.lock().unwrap().put_faults = Some(PutFaults {
            fault,
            suffix: suffix.to_string(),
            left: times,
        });
    }

    /// PUTs run normally again (ends [`Self::fail_puts`]).
    pub fn stop_failing_puts(&self) {
        self.ctl.plan.lock().unwrap().put_faults = None;
    }

    /// PUTs failed so far as [`Self::fail_puts`] asked.
    pub fn failed_puts(&self) -> usize {
        self.ctl.failed_puts.load(Ordering::SeqCst)
    }

    /// From now on, PUTs of paths ending with `suffix` run `after` (on tokio's clock) once
    /// sent, in a task of their own: they land whether or not the client still waits (a
    /// request that timed out or was dropped, and lands all the same). `None` ends it for
    /// later PUTs.
    pub fn land_puts_late(&self, suffix: &str, after: Option<Duration>) {
        self.ctl.plan.lock().unwrap().late_puts = after.map(|d| (suffix.to_string(), d));
    }

    /// PUTs sent late ([`Self::land_puts_late`]) that have not reached the inner store yet.
    pub fn late_puts_in_flight(&self) -> usize {
        self.ctl.late_in_flight.load(Ordering::SeqCst)
    }

    /// PUTs sent late ([`Self::land_puts_late`]) that reached the inner store.
    pub fn landed_late(&self) -> usize {
        self.ctl.landed_late.load(Ordering::SeqCst)
    }

    /// From now on (`on`), a DELETE of an object that is not there answers NotFound naming
    /// another path (`/var/lib/objects/<path>`, as a local-filesystem store names its file or
    /// a prefixing wrapper the prefixed path) instead of succeeding.
    pub fn misname_missing_deletes(&self, on: bool) {
        self.ctl.plan.lock().unwrap().misname_missing = on;
    }

    /// Requests that entered so far (held or not), all kinds.
    pub fn started(&self) -> usize {
        self.ctl.started.load(Ordering::SeqCst)
    }

    /// Requests of `op` received so far.
    pub fn count(&self, op: Op) -> usize {
        self.ctl
            .counts
            .lock()
            .unwrap()
            .get(&op)
            .copied()
            .unwrap_or(0)
    }

    /// Whether an object exists (asked of the inner store, not counted).
    pub async fn exists(&self, path: &str) -> bool {
        self.inner.head(&Path::from(path)).await.is_ok()
    }
}

impl Control {
    async fn enter(&self, op: Op, location: &Path) {
        *self.counts.lock().unwrap().entry(op).or_default() += 1;
        self.started.fetch_add(1, Ordering::SeqCst);
        let (gates, delay) = {
            let p = self.plan.lock().unwrap();
            let mut gates: Vec<Gate> = p.gates.get(&op).cloned().into_iter().collect();
            gates.extend(
                p.path_gates
                    .iter()
                    .filter(|(o, path, _)| *o == op && location.as_ref() == path)
                    .map(|(_, _, g)| g.clone()),
            );
            (gates, p.delays.get(&op).copied())
        };
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        for g in gates {
            g.pass().await;
        }
    }

    /// Waits out the reply delay of `op`, if any.
    async fn reply(&self, op: Op) {
        let d = self.plan.lock().unwrap().reply_delays.get(&op).copied();
        if let Some(d) = d {
            tokio::time::sleep(d).await;
        }
    }

    /// The PUT fault this PUT of `location` meets, if any (counted down; a lost reply is
    /// counted down once the PUT landed).
    fn put_fault(&self, location: &Path) -> Option<PutFault> {
        let mut p = self.plan.lock().unwrap();
        let f = p.put_faults.as_mut()?;
        if f.left == 0 || !location.as_ref().ends_with(f.suffix.as_str()) {
            return None;
        }
        if f.fault != PutFault::ReplyLost {
            f.left = f.left.saturating_sub(1);
            self.failed_puts.fetch_add(1, Ordering::SeqCst);
        }
        Some(f.fault)
    }

    /// Whether a PUT that landed loses its reply (and counts it down).
    fn lose_reply(&self) -> bool {
        let mut p = self.plan.lock().unwrap();
        match p.put_faults.as_mut() {
            Some(f) if f.fault == PutFault::ReplyLost && f.left > 0 => {
                f.left = f.left.saturating_sub(1);
                self.failed_puts.fetch_add(1, Ordering::SeqCst);
                true
            }
            _ => false,
        }
    }

    /// A PUT: its gates and delays, the faults asked for, the inner store, its reply delay.
    async fn put(
        &self,
        inner: &InMemory,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.enter(Op::Put, location).await;
        if matches!(opts.mode, object_store::PutMode::Create) && self.plan.lock().unwrap().no_create
        {
            return Err(object_store::Error::NotImplemented {
                operation: "put_opts with PutMode::Create".into(),
                implementer: "ControlledStore".into(),
            });
        }
        let fault = self.put_fault(location);
        let r = match fault {
            Some(PutFault::Refused) => Err(injected("503 SlowDown")),
            Some(PutFault::HalfWritten) => {
                let body: Vec<u8> = payload.iter().flat_map(|b| b.iter().copied()).collect();
                let half = body[..body.len() / 2].to_vec();
                inner.put(location, PutPayload::from(half)).await?;
                Err(injected("connection reset by peer mid-body"))
            }
            Some(PutFault::ReplyLost) => match inner.put_opts(location, payload, opts).await {
                Ok(_) if self.lose_reply() => {
                    Err(injected("connection reset after the request was sent"))
                }
                r => r,
            },
            None => inner.put_opts(location, payload, opts).await,
        };
        self.reply(Op::Put).await;
        r
    }
}

/// An error of the kind a network store answers (object_store's `Generic`: transient).
fn injected(what: &str) -> object_store::Error {
    object_store::Error::Generic {
        store: "controlled",
        source: format!("{what} (injected)").into(),
    }
}

/// `body` as `fault` makes it arrive.
fn broken_body(body: bytes::Bytes, fault: BodyFault) -> BoxStream<'static, Result<bytes::Bytes>> {
    let half = body.slice(..body.len() / 2);
    match fault {
        BodyFault::Hang => futures::stream::iter(vec![Ok(half)])
            .chain(futures::stream::pending())
            .boxed(),
        BodyFault::Break => {
            futures::stream::iter(vec![Ok(half), Err(injected("the body broke"))]).boxed()
        }
        BodyFault::Longer(n) => {
            let mut v = body.to_vec();
            v.extend(std::iter::repeat_n(0xAB, n));
            futures::stream::iter(vec![Ok(bytes::Bytes::from(v))]).boxed()
        }
    }
}

#[async_trait::async_trait]
impl ObjectStore for ControlledStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        let late = self
            .ctl
            .plan
            .lock()
            .unwrap()
            .late_puts
            .clone()
            .filter(|(suffix, _)| location.as_ref().ends_with(suffix.as_str()));
        if let Some((_, d)) = late {
            let (ctl, inner, location) = (self.ctl.clone(), self.inner.clone(), location.clone());
            ctl.late_in_flight.fetch_add(1, Ordering::SeqCst);
            let landing = tokio::spawn(async move {
                tokio::time::sleep(d).await;
                let r = ctl.put(&inner, &location, payload, opts).await;
                ctl.landed_late.fetch_add(1, Ordering::SeqCst);
                ctl.late_in_flight.fetch_sub(1, Ordering::SeqCst);
                r
            });
            return landing.await.expect("a late PUT panicked");
        }
        self.ctl.put(&self.inner, location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> Result<Box<dyn MultipartUpload>> {
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(&self, location: &Path, options: GetOptions) -> Result<GetResult> {
        let op = if options.head { Op::Head } else { Op::Get };
        self.ctl.enter(op, location).await;
        let got = self.inner.get_opts(location, options).await;
        self.ctl.reply(op).await;
        let got = got?;
        let (chunk, cut, broken) = {
            let p = self.ctl.plan.lock().unwrap();
            (
                p.chunk,
                p.cut,
                p.broken_bodies.get(location.as_ref()).copied(),
            )
        };
        if op == Op::Head || (chunk.is_none() && cut == 0 && broken.is_none()) {
            return Ok(got);
        }
        let (meta, range, attributes, extensions) = (
            got.meta.clone(),
            got.range.clone(),
            got.attributes.clone(),
            got.extensions.clone(),
        );
        let body = got.bytes().await?;
        if let Some(fault) = broken {
            return Ok(GetResult {
                payload: GetResultPayload::Stream(broken_body(body, fault)),
                meta,
                range,
                attributes,
                extensions,
            });
        }
        let body = body.slice(..body.len().saturating_sub(cut));
        let n = chunk.unwrap_or(body.len().max(1));
        let chunks: Vec<Result<bytes::Bytes>> = (0..body.len())
            .step_by(n)
            .map(|at| Ok(body.slice(at..(at + n).min(body.len()))))
            .collect();
        Ok(GetResult {
            payload: GetResultPayload::Stream(futures::stream::iter(chunks).boxed()),
            meta,
            range,
            attributes,
            extensions,
        })
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, Result<Path>>,
    ) -> BoxStream<'static, Result<Path>> {
        let (ctl, inner) = (self.ctl.clone(), self.inner.clone());
        locations
            .map(move |location| {
                let (ctl, inner) = (ctl.clone(), inner.clone());
                async move {
                    let location = location?;
                    let misname = ctl.plan.lock().unwrap().misname_missing;
                    if misname && inner.head(&location).await.is_err() {
                        return Err(object_store::Error::NotFound {
                            path: format!("/var/lib/objects/{location}"),
                            source: "No such file or directory".into(),
                        });
                    }
                    ctl.enter(Op::Delete, &location).await;
                    let r = inner.delete(&location).await;
                    ctl.reply(Op::Delete).await;
                    r.map(|()| location)
                }
            })
            .buffered(10)
            .boxed()
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, Result<ObjectMeta>> {
        // (InMemory's listing is what is there now, however late it is read)
        let mut listing = self.inner.list(prefix);
        let (fails, gate) = {
            let p = self.ctl.plan.lock().unwrap();
            let fails = match &p.fail_lists {
                Some(of) => prefix.is_some_and(|p| p.as_ref() == of.as_str()),
                None => false,
            };
            (fails, p.list_gate.clone())
        };
        if let Some(gate) = gate {
            listing = futures::StreamExt::boxed(futures::StreamExt::flatten(
                futures::stream::once(async move {
                    gate.pass().await;
                    listing
                }),
            ));
        }
        if !fails {
            return listing;
        }
        let broken = futures::stream::once(async {
            Err(object_store::Error::Generic {
                store: "controlled",
                source: "the listing broke part way (injected)".into(),
            })
        });
        futures::StreamExt::boxed(futures::StreamExt::chain(
            futures::StreamExt::take(listing, 1),
            broken,
        ))
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(&self, from: &Path, to: &Path, options: CopyOptions) -> Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}
