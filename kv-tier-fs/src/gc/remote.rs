//! What a shared root's leader learns from the other instances: their stores (announced,
//! then indexed), their reads (recency), and the credit it granted them (counted as
//! reserved).

use kv_tier_core::BlockKey;

use super::Gc;

impl Gc {
    /// Shared root (leader): another instance (or this one) is about to publish `key`
    /// (`size` allocated bytes): indexed now with mtime now, or its recency renewed if known.
    /// A publish that then fails leaves an entry without a file: counted until a sweep or a
    /// rescan finds it gone (the bound errs on the safe side).
    pub(crate) fn on_remote_store(&self, key: BlockKey, size: u64) {
        let now = self.now_ns();
        let over = {
            let mut idx = self.lock();
            if idx.lru.contains(&key) {
                idx.set_mtime(&key, now);
            } else {
                idx.foreign.remove(&key);
                idx.insert(key, size, now);
            }
            self.is_over(&idx)
        };
        if over {
            self.kick();
        }
    }

    /// Shared root (leader): an instance read `key`: its recency is renewed and no sweep
    /// takes it within two stamp intervals.
    pub(crate) fn on_remote_read(&self, key: BlockKey) {
        let now = self.now_ns();
        self.recent_reads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, now);
        let mut idx = self.lock();
        if idx.lru.contains(&key) {
            idx.set_mtime(&key, now);
        }
    }

    /// Whether `key` was read (by any instance, as far as the leader knows) within two stamp
    /// intervals of `now`.
    pub(crate) fn read_recently(&self, key: &BlockKey, now: i64) -> bool {
        let r = self.recent_reads.lock().unwrap_or_else(|p| p.into_inner());
        !r.is_empty()
            && r.get(key)
                .is_some_and(|t| now - t < 2 * self.cfg.stamp_interval_ns)
    }

    /// Shared root (leader): a store of `key` is under way (announced, its job not ended).
    pub(crate) fn announce(&self, key: BlockKey) {
        *self
            .announced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key)
            .or_insert(0) += 1;
    }

    /// Shared root (leader): a store of `key` announced before has ended (or its instance
    /// died).
    pub(crate) fn unannounce(&self, key: &BlockKey) {
        let mut a = self.announced.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = a.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                a.remove(key);
            }
        }
    }

    /// Whether a store of `key` is under way on a shared root (its file may not be there
    /// yet).
    pub(crate) fn announced(&self, key: &BlockKey) -> bool {
        let a = self.announced.lock().unwrap_or_else(|p| p.into_inner());
        !a.is_empty() && a.contains_key(key)
    }

    /// Stores under way on a shared root as the leader knows them (announced, not ended).
    pub(crate) fn announced_stores(&self) -> u64 {
        let a = self.announced.lock().unwrap_or_else(|p| p.into_inner());
        a.values().map(|n| *n as u64).sum()
    }

    /// Forgets every announcement (a leader stepping down or taking over: the journals are
    /// the truth).
    pub(crate) fn clear_announced(&self) {
        self.announced
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Forgets reads older than two stamp intervals.
    pub(crate) fn prune_reads(&self) {
        let now = self.now_ns();
        let keep = 2 * self.cfg.stamp_interval_ns;
        self.recent_reads
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, t| now - *t < keep);
    }

    /// Shared root (leader): the credit granted to instances and not yet spent, counted as
    /// reserved (a shared root's stores reserve nothing locally: credit stands for it).
    pub(crate) fn set_outstanding_credit(&self, bytes: u64) {
        let over = {
            let mut idx = self.lock();
            idx.reserved = bytes;
            idx.note_peak();
            self.is_over(&idx)
        };
        if over {
            self.kick();
        }
    }
}
