//! Process-wide concerns of one binary running every test: a test that must be alone in its
//! process (it counts the process's threads, or installs a global subscriber) re-runs itself
//! in a child process ([`in_own_process`], [`isolated`]); the threads of this process; a
//! panic hook recording every panic, for tests that promise "never panics"; the span
//! recorder of the spans test.

use std::process::Command;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing_subscriber::Layer;
use tracing_subscriber::layer::Context;

/// Every panic [`watch_panics`] recorded (see there).
pub(crate) static PANICS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Records every panic of this process (background threads included), then runs the default
/// hook. Tests take the list at their end: a panic caught and turned into an error, or one on
/// a tier's own thread, still breaks "never panics". The hook is the process's, and every test
/// of this binary shares the process: the panics `FaultyTier` injects on purpose (other tests'
/// `panic_on_*`, "injected panic in FaultyTier::...") are not recorded, so a watching test
/// sees only panics nobody asked for (a failing test elsewhere is one: it fails too).
pub(crate) fn watch_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let where_ = info
                .location()
                .map(|l| format!("{}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let msg = info
                .payload()
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| info.payload().downcast_ref::<String>().cloned())
                .unwrap_or_default();
            let thread = std::thread::current().name().unwrap_or("?").to_string();
            if !msg.starts_with("injected panic") {
                PANICS
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .push(format!("[{thread}] {where_}: {msg}"));
            }
            default(info);
        }));
    });
    PANICS.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// The panics recorded since [`watch_panics`], taken.
pub(crate) fn take_panics() -> Vec<String> {
    std::mem::take(&mut *PANICS.lock().unwrap_or_else(|e| e.into_inner()))
}

/// Asserts that no panic was recorded since [`watch_panics`] (`ctx` names the check).
pub(crate) fn assert_no_panics(ctx: &str) {
    let p = take_panics();
    assert!(p.is_empty(), "{ctx}: panics recorded: {p:#?}");
}

/// The environment variable that marks a child run of this binary (see [`in_own_process`]):
/// its value is the test the child runs.
const CHILD_TEST: &str = "KV_TIER_TEST_CHILD";

/// Whether this process is the child run of `test` (its full path in this binary,
/// `module::name`): then the caller runs the test's body. Otherwise runs this test binary
/// again on `test` alone (`--exact`, one test thread, `CHILD_TEST` set), asserts that the
/// child passed, and returns false: the caller returns. For a test whose assertions need the
/// process to itself (it counts the process's threads or installs a global subscriber), or
/// that may abort it (huge allocations): in the child no other test runs.
pub(crate) fn in_own_process(test: &str) -> bool {
    if std::env::var(CHILD_TEST).as_deref() == Ok(test) {
        return true;
    }
    let out = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_TEST, test)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    let tail: String = err
        .chars()
        .rev()
        .take(3000)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child {test} failed: {:?}\nstdout: {stdout}\nstderr (tail): {tail}",
        out.status,
    );
    assert!(
        stdout.contains("1 passed"),
        "the child ran no test named {test}:\n{stdout}"
    );
    false
}

/// Runs `body` in a child process: [`in_own_process`] of `name` (this binary's path of the
/// calling test), the body run there.
pub(crate) fn isolated(name: &str, body: impl FnOnce()) {
    if in_own_process(name) {
        body();
    }
}

/// Threads of this process whose name passes `pred`.
pub(crate) fn threads_where(pred: impl Fn(&str) -> bool) -> usize {
    let Ok(rd) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    rd.flatten()
        .filter(|e| {
            std::fs::read_to_string(e.path().join("comm"))
                .map(|c| pred(c.trim_end()))
                .unwrap_or(false)
        })
        .count()
}

/// This process's fs tier threads (`kv-fs*`).
pub(crate) fn fs_threads() -> usize {
    threads_where(|n| n.starts_with("kv-fs"))
}

/// Every span opened: its name and its fields as `name=value` pairs.
#[derive(Clone, Default)]
pub(crate) struct Spans(pub(crate) Arc<Mutex<Vec<(String, String)>>>);

/// The fields of a span, as `name=value ` pairs.
pub(crate) struct Fields(pub(crate) String);

impl Visit for Fields {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.push_str(&format!("{}={:?} ", field.name(), value));
    }
}

impl<S: tracing::Subscriber> Layer<S> for Spans {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _id: &tracing::span::Id,
        _ctx: Context<'_, S>,
    ) {
        let mut f = Fields(String::new());
        attrs.record(&mut f);
        self.0
            .lock()
            .unwrap()
            .push((attrs.metadata().name().to_string(), f.0));
    }
}
