//! [`ControlledStore`]: an `ObjectStore` wrapper (over `InMemory`) whose requests can be held
//! at a gate or slowed, per kind of request, to drive deadlines and interleavings
//! deterministically (with tokio's paused clock, a held request lasts exactly until a
//! deadline fires), or to play a backend that stops answering.

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
}

/// An `ObjectStore` over [`InMemory`] whose requests can be held or slowed per kind (see the
/// module docs). Listing, copies and multipart uploads pass straight through.
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
}

#[async_trait::async_trait]
impl ObjectStore for ControlledStore {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> Result<PutResult> {
        self.ctl.enter(Op::Put, location).await;
        if matches!(opts.mode, object_store::PutMode::Create)
            && self.ctl.plan.lock().unwrap().no_create
        {
            return Err(object_store::Error::NotImplemented {
                operation: "put_opts with PutMode::Create".into(),
                implementer: "ControlledStore".into(),
            });
        }
        let r = self.inner.put_opts(location, payload, opts).await;
        self.ctl.reply(Op::Put).await;
        r
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
        let (chunk, cut) = {
            let p = self.ctl.plan.lock().unwrap();
            (p.chunk, p.cut)
        };
        if op == Op::Head || (chunk.is_none() && cut == 0) {
            return Ok(got);
        }
        let (meta, range, attributes, extensions) = (
            got.meta.clone(),
            got.range.clone(),
            got.attributes.clone(),
            got.extensions.clone(),
        );
        let body = got.bytes().await?;
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
        let listing = self.inner.list(prefix);
        let fails = match &self.ctl.plan.lock().unwrap().fail_lists {
            Some(of) => prefix.is_some_and(|p| p.as_ref() == of.as_str()),
            None => false,
        };
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
