//! The crate's lock helper.

use std::sync::{Mutex, MutexGuard};

/// Locks `m`, recovering it if a panic poisoned it: every critical section of this crate's
/// locks leaves its data consistent before anything can panic, so a poisoned lock is still
/// usable, and protection, lookups and stores never turn into a panic of the caller (often
/// the engine's scheduler thread).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
