//! Waiting for the manager's background work, resetting DRAM, and shutting down.

use super::{State, TieringManager, lock};
use crate::error::{Error, Result};

impl TieringManager {
    /// Applies whatever has completed, without waiting (for callers outside a step loop).
    pub fn poll(&self) {
        let mut st = lock(&self.state);
        self.drain(&mut st);
    }

    /// Whether no job or probe is queued or in flight.
    pub fn is_idle(&self) -> bool {
        let mut st = lock(&self.state);
        self.drain(&mut st);
        Self::idle(&st)
    }

    fn idle(st: &State) -> bool {
        st.jobs.is_empty()
            && st.promotions.is_empty()
            && st
                .lookups
                .iter()
                .all(|l| l.in_flight() == 0 && l.queued() == 0)
    }

    /// Sends everything queued, waits until every job and probe in flight at that moment has
    /// completed, and applies what has completed. For tests and shutdown. Work that other
    /// callers send meanwhile is not waited for (it may still be in flight when this
    /// returns), so the wait ends however much traffic they bring.
    pub async fn wait_idle(&self) {
        self.wait_until(true, true).await;
    }

    /// Waits until every store and load job in flight when it is called has reported, sending
    /// nothing new (queued promotions and probes stay queued) and applying what completes. For
    /// tests, and for callers that need a store's cascade to have landed before anything else
    /// is asked of the tiers. Jobs other callers send meanwhile are not waited for.
    pub async fn wait_jobs(&self) {
        self.wait_until(false, false).await
    }

    /// Waits until every job in flight when the wait began (and, with `probes`, every probe
    /// batch) has reported, then applies all that has arrived in one drain, in submission
    /// order: the result does not depend on which finished first.
    ///
    /// Only what was sent when the wait began counts: waiting for a moment when nothing at all
    /// is in flight could last as long as other threads keep sending. Any number of callers
    /// may wait at once: every arrival wakes them all. Each job and probe has a deadline, so
    /// this returns within the longest of them.
    async fn wait_until(&self, flush: bool, probes: bool) {
        let (jobs_mark, probe_marks) = {
            let mut st = lock(&self.state);
            if flush {
                self.flush(&mut st);
            }
            let probes: Vec<u64> = st.lookups.iter().map(|l| l.batches_sent()).collect();
            (st.next_job, probes)
        };
        loop {
            // Registered before looking, so an arrival between the look and the await is seen.
            let notified = self.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let mut st = lock(&self.state);
                // Each job reports exactly once, and a drain removes its report and its entry
                // together (under the state lock): the jobs before the mark have all reported
                // when their reports waiting in the inbox are as many as their entries.
                let jobs_done = {
                    let inbox = lock(&self.inbox);
                    let reported = inbox.iter().filter(|c| c.job < jobs_mark).count();
                    st.jobs.keys().filter(|id| **id < jobs_mark).count() == reported
                };
                let probes_done = !probes
                    || st
                        .lookups
                        .iter()
                        .zip(&probe_marks)
                        .all(|(l, m)| l.arrived_before(*m));
                if jobs_done && probes_done {
                    self.drain(&mut st);
                    return;
                }
            }
            notified.await;
        }
    }

    /// Cancels queued promotions, waits for the jobs in flight, then empties DRAM.
    /// Secondary tiers keep their data. Returns how many blocks stay in DRAM because readers
    /// still pin them (views from [`TieringManager::prepare_load`] not yet dropped).
    pub async fn reset_cache(&self) -> usize {
        self.cancel_promotions();
        self.wait_idle().await;
        self.release_held();
        self.primary.reset()
    }
    /// Cancels queued promotions, waits for jobs in flight, and shuts every tier down. From
    /// its start the manager serves DRAM only: lookups past DRAM answer `Miss` and stores
    /// cascade nowhere, so the wait ends however much traffic other threads bring meanwhile.
    pub async fn shutdown(&self) -> Result<()> {
        // First: nothing new is sent from here (a wait for idleness while other threads keep
        // sending could run as long as they do)
        lock(&self.state).shut_down = true;
        self.cancel_promotions();
        self.wait_idle().await;
        self.release_held();
        // jobs other callers sent before the flag: they end, or reach their deadline, before
        // their tiers go
        self.wait_jobs().await;
        // Each tier's shutdown runs on the manager's runtime, within `shutdown_timeout_s` (not
        // a job's deadline: it waits for work abandoned jobs left running); one that hangs or
        // panics is reported and the others are still shut down.
        let deadline = self.config.shutdown_timeout();
        let mut first_err = None;
        for (t, name) in self.tiers.iter().zip(&self.names) {
            let tier = t.clone();
            let task = self
                .runtime
                .spawn(async move { tokio::time::timeout(deadline, tier.shutdown()).await });
            let res = match task.await {
                Ok(Ok(r)) => r,
                Ok(Err(_)) => Err(Error::Timeout {
                    op: format!("shutdown of tier `{name}`"),
                    after: deadline,
                }),
                Err(_) => Err(Error::Panicked {
                    tier: name.clone(),
                    op: "shutdown".into(),
                }),
            };
            if let Err(e) = res {
                tracing::warn!(tier = %name, error = %e, "tier shutdown failed");
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// [`TieringManager::shutdown`] for synchronous code (engines that used
    /// [`TieringManagerBuilder::build_blocking`](super::TieringManagerBuilder::build_blocking)): blocks until it is done. Refused inside
    /// a tokio runtime (use `shutdown().await` there).
    pub fn shutdown_blocking(&self) -> Result<()> {
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::config(
                "runtime",
                "shutdown_blocking() called inside a tokio runtime; use shutdown().await",
            ));
        }
        self.runtime.block_on(self.shutdown())
    }

    /// Lets go of every promoted block held for a request (they stay in DRAM as ordinary,
    /// evictable blocks).
    fn release_held(&self) {
        lock(&self.state).holds.clear();
    }
}
