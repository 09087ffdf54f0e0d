//! The request lifecycle as the tiers see it: a request's start (with the offload policy
//! each tier asks for) and its end, passed on once its store jobs have ended.

use super::{State, TieringManager, lock};
use crate::request::{RequestContext, RequestId};
use crate::tier::OffloadPolicy;

impl TieringManager {
    /// The request is done. Its queued promotions are not sent (their DRAM reservations and
    /// leases are released); promotions in flight land for others to use, and a failure of
    /// one is ignored. The blocks promoted for it and not yet read are no longer held. Its
    /// per-request lookup state is dropped in every tier, but only once its pending store
    /// jobs have finished; tiers hear of it ([`SecondaryTier::on_request_finished`](crate::SecondaryTier::on_request_finished)) then.
    /// Call it after the request's stores are committed: a store committed later is not
    /// waited for (a `PendingStore` belongs to no request until its commit). Call it once.
    pub fn on_request_finished(&self, req: RequestId) {
        let mut st = self.begin();
        st.holds.finish(req);
        st.last_miss.remove(&req);
        let queued: Vec<(usize, Option<RequestId>)> = st
            .promotions
            .keys()
            .filter(|(_, r)| *r == Some(req))
            .copied()
            .collect();
        for at in queued {
            if let Some(blocks) = st.promotions.remove(&at) {
                st.stats.tiers[at.0].promotions_cancelled += blocks.len() as u64;
                self.cancel(&mut st, at.0, blocks);
            }
        }
        if st.pending_stores.contains_key(&req) {
            st.finishing.insert(req);
        } else {
            self.request_done(&mut st, req);
        }
    }

    /// A request the engine starts (vLLM's `on_new_request`): passed to every tier
    /// ([`SecondaryTier::on_new_request`](crate::SecondaryTier::on_new_request)) for request-level policies. Optional: lookups and
    /// jobs work without it.
    ///
    /// A tier answering [`OffloadPolicy::RequestLevel`] gets every block the request stores,
    /// those already in DRAM included (vLLM's `REQUEST_LEVEL`); the answer is
    /// `RequestLevel` if any tier asked for it.
    pub fn on_new_request(&self, req: &RequestContext) -> OffloadPolicy {
        // the hooks run off the manager's lock: a tier's may take locks of its own
        let mut request_level = Vec::new();
        for (i, t) in self.tiers.iter().enumerate() {
            let mut policy = OffloadPolicy::ChunkLevel;
            crate::tier::hook_caught(&**t, "on_new_request", |t| {
                policy = t.on_new_request(req);
            });
            if policy == OffloadPolicy::RequestLevel {
                request_level.push(i);
            }
        }
        if request_level.is_empty() {
            return OffloadPolicy::ChunkLevel;
        }
        lock(&self.state)
            .request_level
            .insert(req.id, request_level);
        OffloadPolicy::RequestLevel
    }

    /// The request's per-request state goes, in the probe caches and in every tier (once its
    /// store jobs have ended).
    pub(super) fn request_done(&self, st: &mut State, req: RequestId) {
        st.request_level.remove(&req);
        st.chains.forget(req);
        for l in &mut st.lookups {
            l.finish_request(req);
        }
        for t in &self.tiers {
            crate::tier::hook_caught(&**t, "on_request_finished", |t| t.on_request_finished(req));
        }
    }
}
