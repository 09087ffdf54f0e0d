//! The GC thread.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Gc, Goal, SweepPoint};

/// Starts the GC thread of `gc` (marked alive before it runs).
pub(crate) fn spawn(gc: Arc<Gc>) -> std::io::Result<std::thread::JoinHandle<()>> {
    gc.alive.store(true, Ordering::SeqCst);
    let g = gc.clone();
    std::thread::Builder::new()
        .name("kv-fs-gc".into())
        .spawn(move || gc_loop(&g))
        .inspect_err(|_| gc.alive.store(false, Ordering::SeqCst))
}

/// The GC thread: applies stamps every tick, sweeps when over the cap (each interval, or at
/// once when a store crossed the cap), rescans now and then. An error or panic in a step is
/// logged and counted and the loop goes on; a panic outside a step restarts the loop (counted
/// in `thread_restarts`, logged as an error). `thread_alive` turns false only when the tier
/// stops it.
fn gc_loop(gc: &Gc) {
    struct Alive<'a>(&'a Gc);
    impl Drop for Alive<'_> {
        fn drop(&mut self) {
            self.0.alive.store(false, Ordering::SeqCst);
        }
    }
    let _alive = Alive(gc);
    loop {
        match std::panic::catch_unwind(AssertUnwindSafe(|| run(gc))) {
            Ok(()) => return, // stopped
            Err(_) => {
                gc.counters.thread_restarts.fetch_add(1, Ordering::Relaxed);
                gc.counters.errors.fetch_add(1, Ordering::Relaxed);
                tracing::error!(tier = %gc.at.name, "the fs tier's GC loop panicked; restarting it");
                // a moment's pause, so a loop that panics at once does not spin a core
                if gc.wait(Duration::from_secs(1)).0 {
                    return;
                }
            }
        }
    }
}

fn run(gc: &Gc) {
    let tick = gc.cfg.interval.min(Duration::from_secs(1));
    let now = Instant::now();
    let mut next_sweep = now + gc.cfg.interval;
    let mut next_rescan = gc.cfg.rescan_interval.map(|d| now + d);
    loop {
        let (stop, kicked) = gc.wait(tick);
        if stop {
            return;
        }
        gc.hook(SweepPoint::Tick);
        let step = std::panic::catch_unwind(AssertUnwindSafe(|| {
            // Capacity first: keys with a stamp still pending are skipped by the sweep anyway.
            let now = Instant::now();
            let due = now >= next_sweep;
            if due {
                next_sweep = now + gc.cfg.interval;
            }
            if (due || kicked) && gc.over_cap() {
                gc.sweep(Goal::Cap);
            }
            gc.apply_stamps();
            if let Some(at) = next_rescan
                && now >= at
            {
                next_rescan = gc.cfg.rescan_interval.map(|d| now + d);
                gc.rescan();
            }
        }));
        if step.is_err() {
            gc.counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(tier = %gc.at.name, "the fs tier's GC step panicked; the GC goes on");
        }
    }
}
