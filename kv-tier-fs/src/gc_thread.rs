//! The GC thread.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::block::Files;
use crate::gc::Gc;

/// The GC thread: applies stamps every tick, sweeps when over the cap (each interval, or at
/// once when a store crossed the cap), rescans now and then. An error or panic is logged and
/// counted and the loop goes on; if the thread ends anyway, the stats say so.
pub(crate) fn gc_loop(files: Arc<Files>) {
    struct Alive<'a>(&'a Gc);
    impl Drop for Alive<'_> {
        fn drop(&mut self) {
            self.0.alive.store(false, Ordering::SeqCst);
        }
    }
    let gc = files.gc.as_ref().expect("gc thread without gc");
    let _alive = Alive(gc);
    let tick = gc.cfg.interval.min(Duration::from_secs(1));
    let now = std::time::Instant::now();
    let mut next_sweep = now + gc.cfg.interval;
    let mut next_rescan = gc.cfg.rescan_interval.map(|d| now + d);
    let tmp_age = Some(Duration::from_secs(600));
    loop {
        let (stop, kicked) = gc.wait(tick);
        if stop {
            return;
        }
        let step = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            // Capacity first: keys with a stamp still pending are skipped by the sweep anyway.
            let now = std::time::Instant::now();
            let due = now >= next_sweep;
            if due {
                next_sweep = now + gc.cfg.interval;
            }
            if (due || kicked) && gc.over_cap() {
                files.sweep();
            }
            gc.apply_stamps(&files.ns, &files.root);
            if let Some(at) = next_rescan
                && now >= at
            {
                next_rescan = gc.cfg.rescan_interval.map(|d| now + d);
                files.rescan(tmp_age);
            }
        }));
        if step.is_err() {
            gc.counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(tier = %files.name, "the fs tier's GC step panicked; the GC goes on");
        }
    }
}
