//! The I/O engine: dedicated read and write threads over three queues. Read threads take
//! probes, then loads, then stores; write threads take probes, then stores, then loads. No lock
//! is held across I/O: a thread pops one task under the queue lock and runs it outside.
//! Jobs are split into one task per block, so a large job spreads over every idle thread and
//! a one-block job is one task.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use tokio::sync::oneshot;

/// A unit of work run on an I/O thread.
pub(crate) type Task = Box<dyn FnOnce() + Send + 'static>;

/// Which queue a task goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Class {
    Probe,
    Load,
    Store,
}

#[derive(Default)]
struct Queues {
    probe: VecDeque<Task>,
    load: VecDeque<Task>,
    store: VecDeque<Task>,
    stop: bool,
}

impl Queues {
    fn pop(&mut self, reader: bool) -> Option<Task> {
        if let Some(t) = self.probe.pop_front() {
            return Some(t);
        }
        if reader {
            self.load.pop_front().or_else(|| self.store.pop_front())
        } else {
            self.store.pop_front().or_else(|| self.load.pop_front())
        }
    }
}

/// The queues and their condition variable, shared by the engine and its threads.
struct Board {
    q: Mutex<Queues>,
    cv: Condvar,
    /// Times a waiting thread woke up (for the test that a job wakes only as many threads
    /// as it has tasks).
    wakes: std::sync::atomic::AtomicU64,
}

/// The thread pools.
pub(crate) struct Engine {
    shared: Arc<Board>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    n_threads: usize,
}

impl Engine {
    pub(crate) fn start(n_read: usize, n_write: usize) -> std::io::Result<Self> {
        let shared = Arc::new(Board {
            q: Mutex::new(Queues::default()),
            cv: Condvar::new(),
            wakes: std::sync::atomic::AtomicU64::new(0),
        });
        let mut threads = Vec::with_capacity(n_read + n_write);
        for i in 0..n_read + n_write {
            let reader = i < n_read;
            let s = shared.clone();
            let name = if reader {
                format!("kv-fs-r{i}")
            } else {
                format!("kv-fs-w{}", i - n_read)
            };
            threads.push(
                std::thread::Builder::new()
                    .name(name)
                    .spawn(move || worker(s, reader))?,
            );
        }
        Ok(Self {
            shared,
            threads: Mutex::new(threads),
            n_threads: n_read + n_write,
        })
    }

    /// Queues tasks; returns false (dropping them) after shutdown.
    pub(crate) fn submit(&self, class: Class, tasks: Vec<Task>) -> bool {
        let n = tasks.len();
        {
            let mut q = self.shared.q.lock().expect("io queues");
            if q.stop {
                return false;
            }
            let dst = match class {
                Class::Probe => &mut q.probe,
                Class::Load => &mut q.load,
                Class::Store => &mut q.store,
            };
            dst.extend(tasks);
        }
        // one wake per task, at most one per thread: a job wakes only the threads it has
        // work for (a thread busy when notified takes more tasks before it waits again)
        for _ in 0..n.min(self.n_threads) {
            self.shared.cv.notify_one();
        }
        true
    }

    /// Stops the threads after their current task; queued tasks are dropped (their jobs report
    /// the shutdown). Returns the threads to join (each only once). Idempotent.
    pub(crate) fn stop(&self) -> Vec<JoinHandle<()>> {
        let dropped = {
            let mut q = self.shared.q.lock().expect("io queues");
            q.stop = true;
            (
                std::mem::take(&mut q.probe),
                std::mem::take(&mut q.load),
                std::mem::take(&mut q.store),
            )
        };
        drop(dropped);
        self.shared.cv.notify_all();
        std::mem::take(&mut *self.threads.lock().expect("io threads"))
    }

    /// [`Engine::stop`], then joins the threads (without blocking an async runtime's worker:
    /// see [`join_threads`]).
    pub(crate) fn shutdown(&self) {
        join_threads(self.stop());
    }

    /// Whether the engine's threads are running.
    #[cfg(test)]
    pub(crate) fn is_running(&self) -> bool {
        !self.shared.q.lock().expect("io queues").stop
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Joins `threads` (but not the calling thread itself). On a tokio multi-thread worker the
/// join runs in `block_in_place`, so the worker's other tasks move elsewhere; on a
/// current-thread runtime it runs on a helper thread of its own (the caller does not wait:
/// blocking the only worker could deadlock a task the threads wait for).
pub(crate) fn join_threads(threads: Vec<JoinHandle<()>>) {
    let me = std::thread::current().id();
    let threads: Vec<_> = threads
        .into_iter()
        .filter(|t| t.thread().id() != me)
        .collect();
    if threads.is_empty() {
        return;
    }
    let join = move || {
        for t in threads {
            let _ = t.join();
        }
    };
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(RuntimeFlavor::MultiThread) if !std::thread::panicking() => {
            tokio::task::block_in_place(join)
        }
        Ok(_) => {
            let spawned = std::thread::Builder::new()
                .name("kv-fs-join".into())
                .spawn(join);
            if let Err(e) = spawned {
                tracing::warn!(error = %e, "no thread to join the fs tier's threads; they end on their own");
            }
        }
        Err(_) => join(),
    }
}

fn worker(s: Arc<Board>, reader: bool) {
    loop {
        let task = {
            let mut q = s.q.lock().expect("io queues");
            loop {
                if q.stop {
                    return;
                }
                if let Some(t) = q.pop(reader) {
                    break t;
                }
                q = s.cv.wait(q).expect("io queues");
                s.wakes.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        };
        if std::panic::catch_unwind(AssertUnwindSafe(task)).is_err() {
            tracing::error!("an fs I/O task panicked; the thread goes on");
        }
    }
}

/// Collects the per-task results of one job and hands them over when the last one arrives.
/// If tasks are dropped unrun (shutdown), the receiver sees the channel closed.
pub(crate) struct Collector<T> {
    inner: Mutex<Pending<T>>,
    total: usize,
}

/// Results so far, and where to send them all.
type Pending<T> = (Vec<T>, Option<oneshot::Sender<Vec<T>>>);

impl<T: Send + 'static> Collector<T> {
    pub(crate) fn new(total: usize) -> (Arc<Self>, oneshot::Receiver<Vec<T>>) {
        let (tx, rx) = oneshot::channel();
        (
            Arc::new(Self {
                inner: Mutex::new((Vec::with_capacity(total), Some(tx))),
                total,
            }),
            rx,
        )
    }

    /// Whether nobody waits for the results any more (the job's future was dropped: cut,
    /// past its deadline, or cancelled).
    pub(crate) fn abandoned(&self) -> bool {
        let g = self.inner.lock().expect("collector");
        g.1.as_ref().is_none_or(|tx| tx.is_closed())
    }

    pub(crate) fn push(&self, item: T) {
        let mut g = self.inner.lock().expect("collector");
        g.0.push(item);
        if g.0.len() == self.total
            && let Some(tx) = g.1.take()
        {
            let all = std::mem::take(&mut g.0);
            drop(g);
            let _ = tx.send(all);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[tokio::test]
    async fn runs_every_task_and_collects_results() {
        let e = Engine::start(2, 2).unwrap();
        let (col, rx) = Collector::new(100);
        let tasks: Vec<Task> = (0..100)
            .map(|i| {
                let col = col.clone();
                Box::new(move || col.push(i)) as Task
            })
            .collect();
        drop(col);
        assert!(e.submit(Class::Load, tasks));
        let mut got = rx.await.unwrap();
        got.sort();
        assert_eq!(got, (0..100).collect::<Vec<_>>());
    }

    #[tokio::test]
    async fn a_job_wakes_only_as_many_threads_as_it_has_tasks() {
        let e = Engine::start(8, 8).unwrap();
        // let every thread reach its wait
        for _ in 0..1000 {
            if Arc::strong_count(&e.shared) == 17 && e.shared.q.try_lock().is_ok() {
                break;
            }
            tokio::task::yield_now().await;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
        let before = e.shared.wakes.load(Ordering::Relaxed);
        for round in 0..20 {
            let (col, rx) = Collector::new(2);
            let tasks: Vec<Task> = (0..2)
                .map(|i| {
                    let col = col.clone();
                    Box::new(move || col.push(round * 2 + i)) as Task
                })
                .collect();
            drop(col);
            assert!(e.submit(Class::Load, tasks));
            assert_eq!(rx.await.unwrap().len(), 2);
        }
        let wakes = e.shared.wakes.load(Ordering::Relaxed) - before;
        eprintln!("{wakes} wake-ups for 40 tasks on 16 threads");
        // 20 two-task jobs on 16 idle threads: about 40 wakes; waking every thread would be
        // 320 (spurious wake-ups are rare; the bound leaves room for them)
        assert!(wakes <= 80, "{wakes} wake-ups for 40 tasks on 16 threads");
    }

    #[tokio::test]
    async fn shutdown_drops_queued_tasks_and_reports_closed() {
        let e = Engine::start(1, 0).unwrap();
        let ran = Arc::new(AtomicUsize::new(0));
        // Block the only thread until shutdown has been requested.
        let (hold_tx, hold_rx) = std::sync::mpsc::channel::<()>();
        let (running_tx, running_rx) = std::sync::mpsc::channel::<()>();
        let r = ran.clone();
        e.submit(
            Class::Probe,
            vec![Box::new(move || {
                running_tx.send(()).unwrap();
                let _ = hold_rx.recv();
                r.fetch_add(1, Ordering::SeqCst);
            })],
        );
        running_rx.recv().unwrap(); // the only thread is now busy with the held task
        let (col, rx) = Collector::<u32>::new(1);
        let c = col.clone();
        e.submit(Class::Store, vec![Box::new(move || c.push(1))]);
        drop(col);
        std::thread::scope(|s| {
            s.spawn(|| e.shutdown());
            while e.is_running() {
                std::thread::yield_now();
            }
            hold_tx.send(()).unwrap();
        });
        assert!(rx.await.is_err(), "a dropped task must close its job");
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        assert!(!e.submit(Class::Load, vec![Box::new(|| {})]));
        assert!(!e.is_running());
    }

    #[tokio::test]
    async fn a_panicking_task_does_not_kill_its_thread() {
        let e = Engine::start(1, 0).unwrap();
        e.submit(Class::Load, vec![Box::new(|| panic!("boom"))]);
        let (col, rx) = Collector::new(1);
        e.submit(Class::Load, vec![Box::new(move || col.push(5))]);
        assert_eq!(rx.await.unwrap(), vec![5]);
    }
}
