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

/// When the GC thread sweeps, rescans and checkpoints: a sweep every `interval` (or at once
/// when kicked), a rescan every `rescan` and a checkpoint every `checkpoint` (if any). A pure
/// function of the times it is given, so its cadence is tested without waiting.
#[derive(Debug, Clone, Copy)]
struct Schedule {
    interval: Duration,
    rescan: Option<Duration>,
    checkpoint: Option<Duration>,
    next_sweep: Instant,
    next_rescan: Option<Instant>,
    next_checkpoint: Option<Instant>,
}

/// What one tick of the GC thread does besides applying stamps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Due {
    /// Sweep, if over the cap.
    sweep: bool,
    rescan: bool,
    /// Checkpoint the index, if it changed.
    checkpoint: bool,
}

impl Schedule {
    fn new(
        interval: Duration,
        rescan: Option<Duration>,
        checkpoint: Option<Duration>,
        now: Instant,
    ) -> Self {
        Self {
            interval,
            rescan,
            checkpoint,
            next_sweep: now + interval,
            next_rescan: rescan.map(|d| now + d),
            next_checkpoint: checkpoint.map(|d| now + d),
        }
    }

    /// What is due at `now` (a kick makes a sweep due at once without moving the next
    /// interval's); what is due is scheduled again from `now`.
    fn tick(&mut self, now: Instant, kicked: bool) -> Due {
        let interval_due = now >= self.next_sweep;
        if interval_due {
            self.next_sweep = now + self.interval;
        }
        let rescan = self.next_rescan.is_some_and(|at| now >= at);
        if rescan {
            self.next_rescan = self.rescan.map(|d| now + d);
        }
        let checkpoint = self.next_checkpoint.is_some_and(|at| now >= at);
        if checkpoint {
            self.next_checkpoint = self.checkpoint.map(|d| now + d);
        }
        Due {
            sweep: interval_due || kicked,
            rescan,
            checkpoint,
        }
    }
}

fn run(gc: &Gc) {
    let tick = gc.cfg.interval.min(Duration::from_secs(1));
    let mut schedule = Schedule::new(
        gc.cfg.interval,
        gc.cfg.rescan_interval,
        gc.cfg.checkpoint_interval,
        Instant::now(),
    );
    if !gc.reconciled() && gc.may_sweep() {
        // an index read from a checkpoint: the walk that checks it against the disk comes
        // first (a panic in it restarts the loop, which tries again)
        gc.rescan();
    }
    loop {
        let (stop, kicked) = gc.wait(tick);
        if stop {
            return;
        }
        gc.hook(SweepPoint::Tick);
        let step = std::panic::catch_unwind(AssertUnwindSafe(|| {
            let due = schedule.tick(Instant::now(), kicked);
            // Capacity first: keys with a stamp still pending are skipped by the sweep anyway.
            // (A sweep toward the cap returns at once when the tier is within it.)
            if due.sweep {
                gc.sweep(Goal::Cap);
            }
            gc.apply_stamps();
            if due.rescan && gc.may_sweep() {
                gc.rescan();
            }
            if due.checkpoint {
                gc.write_checkpoint();
            }
        }));
        if step.is_err() {
            gc.counters.errors.fetch_add(1, Ordering::Relaxed);
            tracing::error!(tier = %gc.at.name, "the fs tier's GC step panicked; the GC goes on");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_sweep_is_due_each_interval_or_when_kicked() {
        let t0 = Instant::now();
        let mut s = Schedule::new(60 * S, None, None, t0);
        let due = |s: &mut Schedule, at: Duration, kicked| s.tick(t0 + at, kicked).sweep;
        assert!(!due(&mut s, 59 * S, false));
        assert!(due(&mut s, 30 * S, true), "a kick sweeps at once");
        assert!(
            due(&mut s, 60 * S, false),
            "the interval is not moved by a kick"
        );
        assert!(
            !due(&mut s, 119 * S, false),
            "the next interval runs from the last"
        );
        assert!(due(&mut s, 120 * S, false));
        assert!(!due(&mut s, 121 * S, false));
    }

    #[test]
    fn a_rescan_is_due_each_rescan_interval_and_never_without_one() {
        let t0 = Instant::now();
        let mut s = Schedule::new(S, Some(100 * S), None, t0);
        let rescan = |s: &mut Schedule, at: Duration| s.tick(t0 + at, false).rescan;
        assert!(!rescan(&mut s, 99 * S));
        assert!(rescan(&mut s, 100 * S));
        assert!(!rescan(&mut s, 150 * S), "the next one runs from the last");
        assert!(!rescan(&mut s, 199 * S));
        assert!(rescan(&mut s, 200 * S));
        let mut never = Schedule::new(S, None, None, t0);
        assert!(!rescan(&mut never, 1_000_000 * S));
    }

    #[test]
    fn a_checkpoint_is_due_each_checkpoint_interval_and_never_without_one() {
        let t0 = Instant::now();
        let mut s = Schedule::new(S, Some(1000 * S), Some(300 * S), t0);
        let due = |s: &mut Schedule, at: Duration| s.tick(t0 + at, false).checkpoint;
        assert!(!due(&mut s, 299 * S));
        assert!(due(&mut s, 300 * S));
        assert!(!due(&mut s, 599 * S));
        assert!(due(&mut s, 600 * S));
        let mut never = Schedule::new(S, None, None, t0);
        assert!(!due(&mut never, 1_000_000 * S));
    }
}
