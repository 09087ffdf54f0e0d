//! The bound as stores meet it: room reserved under the hard ceiling before a block file is
//! written, made by a sweep (or waited for) when the total would cross it. A store job
//! reserves the room of all its blocks before any is written, in the job's order, on one
//! thread ([`Shared::reserve_rooms`]). Eviction itself is the GC's (`gc/`).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use kv_tier_core::{BlockKey, Error, Result};

use crate::block::Shared;
use crate::gc::{Gc, Goal};

/// Bytes a store reserved under the hard ceiling for one key; released on drop unless taken
/// over by the published file's entry (by the store, or by whoever indexed the file first).
pub(crate) struct Room {
    gc: Arc<Gc>,
    key: BlockKey,
    reservation: Option<u64>,
    /// It holds room for the growth of the key's leaf directory.
    grows: bool,
}

impl Room {
    /// Whether it holds room for the growth of the key's leaf directory: the leaf is then
    /// measured after the publish and counted as the room is given up.
    pub(crate) fn grows(&self) -> bool {
        self.grows
    }

    /// The reservation's number, for [`Gc::on_published`]; the room no longer releases it.
    pub(crate) fn take(&mut self) -> Option<u64> {
        self.reservation.take()
    }
}

impl Drop for Room {
    fn drop(&mut self) {
        if let Some(n) = self.reservation {
            self.gc.unreserve(&self.key, n);
        }
    }
}

impl Shared {
    /// The room of a store job's blocks, reserved before any of them is written: key by key
    /// in the job's order, each once any unlink of it that a sweep decided before the job
    /// protected its keys has ended (the caller protects `keys` first; see
    /// [`Gc::wait_not_deleting`]). So a job that meets the hard ceiling makes room at one
    /// point of its order, and which files that sweep takes, and how many, does not depend
    /// on how the job's writes interleave on the I/O threads.
    pub(crate) fn reserve_rooms(&self, keys: &[BlockKey]) -> Vec<Result<Option<Room>>> {
        keys.iter()
            .map(|key| {
                if let Some(gc) = &self.gc {
                    gc.wait_not_deleting(key);
                }
                self.reserve_room(key)
            })
            .collect()
    }

    /// Reserves room for a new block file under the hard ceiling (bounded mode): when the
    /// total would cross it, runs a sweep for room here, or, if another sweep runs, waits
    /// for it while it frees room (a second at most since it last freed any). Fails with `NoSpace` when no room can be made (everything
    /// left is protected or being written): the block is then not in this tier.
    fn reserve_room(&self, key: &BlockKey) -> Result<Option<Room>> {
        let Some(gc) = &self.gc else { return Ok(None) };
        if self.coord.is_some() {
            // a shared root: the credit taken for the job stands for the room
            return Ok(None);
        }
        let file_bytes = gc.file_bytes(self.alloc_block);
        let mut deadline = crate::gc::room_deadline();
        let mut waited = false;
        loop {
            if let Some((n, grows)) = gc.try_reserve(key, file_bytes) {
                return Ok(Some(Room {
                    gc: gc.clone(),
                    key: *key,
                    reservation: Some(n),
                    grows,
                }));
            }
            if !waited {
                waited = true;
                gc.counters.store_waits.fetch_add(1, Ordering::Relaxed);
            }
            let hopeless = if gc.sweep_running() {
                // another thread's sweep: its batches free room as they go; each one it
                // frees gives this store another deadline (a loaded disk can make a whole
                // sweep take longer than one, but a sweep that frees nothing is not waited on)
                if gc.wait_for_room(Duration::from_millis(20)) {
                    deadline = crate::gc::room_deadline();
                }
                std::time::Instant::now() >= deadline || gc.stopped()
            } else {
                gc.sweep(Goal::Room(file_bytes + 2 * self.dir_alloc)) == 0
                    && gc
                        .try_reserve(key, file_bytes)
                        .map(|(n, _)| gc.unreserve(key, n))
                        .is_none()
            };
            if hopeless {
                gc.counters.no_room.fetch_add(1, Ordering::Relaxed);
                return Err(Error::NoSpace {
                    tier: self.name.clone(),
                    detail: format!(
                        "block {key} does not fit under the hard ceiling of {} bytes and no sweep could make room (everything left is protected or being written)",
                        gc.cfg.hard_bytes
                    ),
                });
            }
        }
    }
}
