//! Leases: a key a probe found stays protected in its tier until its promotion ends, its
//! requests end, or the lease expires (a reaper task drops expired ones).

use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustc_hash::FxHashMap;
use tokio::time::Instant;

use crate::sync::lock;
use crate::tier::ProtectGuard;

/// The tier's protections held as leases, by lease id, with their expiry. A reaper task
/// drops expired ones even while nobody calls the lookup (an idle scheduler).
pub(super) type LeaseTable = Arc<LeaseMap>;

/// Lease id -> (expiry, the protection).
pub(super) type LeaseMap = Mutex<FxHashMap<u64, (Instant, ProtectGuard)>>;

/// A key known present, protected in the tier until the lease drops or expires.
pub(super) struct Lease {
    pub(super) id: u64,
    pub(super) expires: Instant,
    pub(super) table: LeaseTable,
    /// Whether an ask has answered `Present` on it (a lease that expires before any ask saw
    /// it is renewed once by the next ask instead of probing again: see
    /// `ProbeCache::ask`).
    pub(super) seen: bool,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let guard = lock(&self.table).remove(&self.id);
        drop(guard); // released outside the table's lock
    }
}

/// Drops expired leases every `tick` until the lookup is gone.
pub(super) async fn reap_leases(table: std::sync::Weak<LeaseMap>, tick: Duration) {
    loop {
        tokio::time::sleep(tick).await;
        let Some(table) = table.upgrade() else { return };
        let now = Instant::now();
        let expired: Vec<(Instant, ProtectGuard)> = {
            let mut t = lock(&table);
            let ids: Vec<u64> = t
                .iter()
                .filter(|(_, (at, _))| *at <= now)
                .map(|(id, _)| *id)
                .collect();
            ids.iter().filter_map(|id| t.remove(id)).collect()
        };
        // a tier whose guard panics as it drops must not stop the reaper
        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| drop(expired)));
    }
}
