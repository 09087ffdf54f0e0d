//! Threads, runtimes, I/O held by a fault injector, and child runs of this test binary.

use std::path::Path;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use kv_tier_fs::{FsOp, FsTier};
use kv_tier_testkit::fixtures::process::run_with_deadline;
use tokio::sync::Notify;

use super::*;

/// A write that blocks until released, by a task or (after a while) by a watchdog; tells which.
pub(crate) struct HeldWrite {
    pub(crate) entered: Arc<Notify>,
    pub(crate) release: mpsc::Sender<&'static str>,
    pub(crate) released_by: Arc<Mutex<Option<&'static str>>>,
}

/// Holds `tier`'s next `op` (an fs operation) until released through the [`HeldWrite`]
/// returned, or by its watchdog after 10 s.
pub(crate) fn hold_writes(tier: &FsTier, op: FsOp) -> HeldWrite {
    let entered = Arc::new(Notify::new());
    let (tx, rx) = mpsc::channel::<&'static str>();
    let rx = Mutex::new(rx);
    let released_by = Arc::new(Mutex::new(None));
    let (e, r) = (entered.clone(), released_by.clone());
    tier.set_fault_injector(Some(Arc::new(move |o, _path: &Path| {
        if o == op && r.lock().unwrap().is_none() {
            e.notify_one();
            let by = rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10))
                .unwrap_or("watchdog");
            *r.lock().unwrap() = Some(by);
        }
        None
    })));
    HeldWrite {
        entered,
        release: tx,
        released_by,
    }
}

/// A tokio runtime with one worker (the caller's thread), time and I/O on.
pub(crate) fn current_thread_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// Env var: the root the crash test's child writer stores into.
pub(crate) const CRASH_ROOT_ENV: &str = "KV_TIER_CRASH_ROOT";

/// Env var: the crash test's child writer's seed (its keys).
pub(crate) const CRASH_SEED_ENV: &str = "KV_TIER_CRASH_SEED";

/// Starts child `child` of the soak: this binary's `shared::shared_child`, on `root` for
/// `secs` seconds, its outcome written to `out`.
pub(crate) fn spawn_shared_child(root: &Path, child: u64, secs: f64, out: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "shared::shared_child",
            "--ignored",
            "--exact",
            "--nocapture",
        ])
        .env(
            "KV_TIER_SHARED_CHILD",
            format!("{}|{child}|{secs}|{}", root.display(), out.display()),
        )
        .spawn()
        .unwrap()
}

/// Runs `f` on a thread of its own; the receiver gets its result.
pub(crate) fn on_thread<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> mpsc::Receiver<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx
}

/// The result of a thread [`on_thread`] started, waited for at most [`LIMIT`] (panics naming
/// `what` past that).
pub(crate) fn join<T>(rx: &mpsc::Receiver<T>, what: &str) -> T {
    rx.recv_timeout(LIMIT)
        .unwrap_or_else(|e| panic!("{what} did not end within {LIMIT:?}: {e}"))
}

/// Awaits `f` for at most [`LIMIT`] (panics naming `what` past that).
pub(crate) async fn within_limit<F: std::future::Future>(what: &str, f: F) -> F::Output {
    tokio::time::timeout(LIMIT, f)
        .await
        .unwrap_or_else(|_| panic!("{what} did not end within {LIMIT:?}"))
}

/// Env var set in a child run of this binary made by [`in_a_process_of_its_own`]: the test it
/// runs.
pub(crate) const ALONE_ENV: &str = "KV_TIER_FS_TEST_ALONE";

/// For a test that changes what the whole process shares (a resource limit) and so cannot run
/// beside the other tests of this binary. In a child run of this binary made for `test` (its
/// full path, `module::name`), returns `true`: the caller goes on with its body. Otherwise runs
/// that child (only `test`, at most [`CHILD_LIMIT`]), asserts that it ran the test and passed,
/// and returns `false`: the caller returns.
pub(crate) fn in_a_process_of_its_own(test: &str) -> bool {
    if std::env::var(ALONE_ENV).as_deref() == Ok(test) {
        return true;
    }
    let out = run_with_deadline(
        Command::new(std::env::current_exe().unwrap())
            .args([test, "--exact", "--nocapture", "--test-threads=1"])
            .env(ALONE_ENV, test),
        CHILD_LIMIT,
    );
    eprintln!("{test} in a process of its own:\n{}", out.all());
    assert!(
        out.success(),
        "{test} failed in its own process: {}",
        out.all()
    );
    assert!(
        out.stdout.contains("test result: ok. 1 passed"),
        "the child run did not run {test}: {}",
        out.all()
    );
    false
}

/// How long [`in_a_process_of_its_own`] waits for its child before it kills it and fails.
pub(crate) const CHILD_LIMIT: Duration = Duration::from_secs(600);
