//! The workload of one instance among several sharing a tier (a shared fs root, a shared
//! bucket), as the scale-out tests run it in child processes: writers storing new keys as
//! fast as the tier takes them, a reader of keys any instance wrote lately, and hot keys read
//! again and again by their writer and its neighbour (which must never miss); the line a
//! child reports its outcome in; and when the children stop ([`Until`], [`stop_when`]): once
//! the run did what its test needs (the bound reached, enough stored through it), however
//! fast the machine runs them, not after a fixed time.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, SecondaryTier};

use crate::util::{block_bytes, load_keys, store_keys, test_key, verify_block};

/// Blocks per job.
const JOB: u64 = 16;
/// Hot keys per instance.
const HOT: u64 = 8;
/// Store jobs in flight per instance.
const WRITERS: usize = 3;

/// How an instance paces its reads.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    /// The hot keys are read this often.
    pub hot_every: Duration,
    /// The reader waits this long between its lookups (at least 1 ms when it found none).
    pub reader_pause: Duration,
}

/// When an instance's run ends: when its parent creates the file `stop` ([`stop_when`]), or
/// at `deadline` at the latest. The instance writes the blocks it stored so far to
/// `progress` as it goes (a decimal number, replaced whole), for the parent to read.
#[derive(Debug, Clone)]
pub struct Until {
    /// The file whose existence ends the run.
    pub stop: PathBuf,
    /// The file the instance's progress is written to.
    pub progress: PathBuf,
    /// The run ends here however far it got.
    pub deadline: Instant,
}

impl Until {
    /// The run of the child whose outcome goes to `out`: it stops when [`stop_file`] of
    /// `out` exists, or `give_up` from now; its progress goes beside `out`
    /// ([`Until::progress_of`]).
    pub fn child(out: &Path, give_up: Duration) -> Self {
        Until {
            stop: stop_file(out),
            progress: Self::progress_of(out),
            deadline: Instant::now() + give_up,
        }
    }

    /// Where the child whose outcome goes to `out` writes its progress.
    pub fn progress_of(out: &Path) -> PathBuf {
        out.with_extension("stored")
    }

    /// Whether the run is over.
    pub fn reached(&self) -> bool {
        Instant::now() >= self.deadline || self.stop.exists()
    }

    /// Records that `stored` blocks are stored so far (written whole: a reader sees the old
    /// number or the new, never part of one).
    fn record(&self, stored: u64) {
        let tmp = self.progress.with_extension("stored-tmp");
        if std::fs::write(&tmp, stored.to_string()).is_ok() {
            let _ = std::fs::rename(&tmp, &self.progress);
        }
    }
}

/// How long a run of at least `secs` may go on for its condition to hold ([`stop_when`]'s
/// `give_up`): four times that, and 100 s at least (with the rest of a test binary beside it
/// on 2 cores, the instances store several times slower than alone).
pub fn give_up(secs: f64) -> Duration {
    Duration::from_secs_f64((4.0 * secs).max(100.0))
}

/// The file whose existence ends a run ([`Until::stop`]), beside the children's outcomes
/// (`out`, one of them).
pub fn stop_file(out: &Path) -> PathBuf {
    out.with_file_name("stop")
}

/// The blocks stored so far by the children whose outcomes go to `outs` (what each last wrote
/// to its progress file; a killed child's last count stays).
pub fn stored_so_far(outs: &[PathBuf]) -> u64 {
    outs.iter()
        .filter_map(|o| std::fs::read_to_string(Until::progress_of(o)).ok())
        .filter_map(|s| s.trim().parse::<u64>().ok())
        .sum()
}

/// Ends the run of the children whose outcomes go to `outs` (creates their [`stop_file`])
/// once at least `min` has passed and `done` holds (asked every 50 ms with the blocks stored
/// so far, [`stored_so_far`] of `outs`), or once `give_up` has passed since `started`; returns
/// whether `done` held, and when the run was ended (since `started`).
pub fn stop_when(
    started: Instant,
    outs: &[PathBuf],
    min: Duration,
    give_up: Duration,
    mut done: impl FnMut(u64) -> bool,
) -> (bool, Duration) {
    let ok = loop {
        let at = started.elapsed();
        if at >= min && done(stored_so_far(outs)) {
            break true;
        }
        if at >= give_up {
            break false;
        }
        // the parent's polling pace
        std::thread::sleep(Duration::from_millis(50));
    };
    std::fs::write(stop_file(&outs[0]), b"stop").expect("writing the stop file");
    (ok, started.elapsed())
}

/// What an instance did, and what it found wrong.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// Blocks stored.
    pub stored: u64,
    /// Blocks refused for lack of room (`NoSpace`).
    pub no_space: u64,
    /// Blocks loaded by the reader.
    pub loaded: u64,
    /// Blocks loaded that were not their key's bytes.
    pub wrong: u64,
    /// Hot-key loads.
    pub hot_loads: u64,
    /// Hot-key loads that failed.
    pub hot_misses: u64,
    /// Times the instance took the leader lease (the caller fills it in).
    pub took_lease: u64,
    /// What was wrong or missed, one line each.
    pub notes: Vec<String>,
}

impl Outcome {
    /// The figures on one line, then the notes, one per line.
    pub fn to_text(&self) -> String {
        let mut s = format!(
            "{} {} {} {} {} {} {}",
            self.stored,
            self.no_space,
            self.loaded,
            self.wrong,
            self.hot_loads,
            self.hot_misses,
            self.took_lease
        );
        for n in &self.notes {
            s.push('\n');
            s.push_str(n);
        }
        s
    }

    /// Parses [`Outcome::to_text`].
    pub fn parse(text: &str) -> Option<Self> {
        let mut lines = text.lines();
        let v: Vec<u64> = lines
            .next()?
            .split_whitespace()
            .map(|x| x.parse().ok())
            .collect::<Option<_>>()?;
        let [
            stored,
            no_space,
            loaded,
            wrong,
            hot_loads,
            hot_misses,
            took_lease,
        ] = v[..]
        else {
            return None;
        };
        Some(Self {
            stored,
            no_space,
            loaded,
            wrong,
            hot_loads,
            hot_misses,
            took_lease,
            notes: lines.map(str::to_string).collect(),
        })
    }

    /// Adds `other`'s figures and notes to these.
    pub fn add(&mut self, other: &Outcome) {
        self.stored += other.stored;
        self.no_space += other.no_space;
        self.loaded += other.loaded;
        self.wrong += other.wrong;
        self.hot_loads += other.hot_loads;
        self.hot_misses += other.hot_misses;
        self.took_lease += other.took_lease;
        self.notes.extend(other.notes.iter().cloned());
    }
}

/// Instance `child`'s hot key `i`.
pub fn hot_key(child: u64, i: u64) -> BlockKey {
    test_key(1 << 60 | child << 32 | i)
}

/// Instance `child`'s `seq`-th new key.
pub fn new_key(child: u64, seq: u64) -> BlockKey {
    test_key(2 << 60 | child << 32 | seq)
}

/// Runs instance `child` of `instances` on `tier` until `until` says stop: stores its hot
/// keys (retrying until it has credit), then three writers of new 16-block jobs, a reader of
/// keys any instance wrote lately (each key once per job) and the hot keys, its own and its
/// neighbour's, read every `pace.hot_every` (when the blocks stored so far are recorded too).
pub async fn run_instance(
    tier: Arc<dyn SecondaryTier>,
    child: u64,
    instances: u64,
    until: Until,
    bs: usize,
    pace: Pace,
) -> Outcome {
    let mine: Vec<BlockKey> = (0..HOT).map(|i| hot_key(child, i)).collect();
    let theirs: Vec<BlockKey> = (0..HOT)
        .map(|i| hot_key((child + 1) % instances, i))
        .collect();
    loop {
        let r = store_keys(&*tier, &mine, 0, bs).await;
        if r.is_success() {
            break;
        }
        assert!(
            !until.reached(),
            "the hot keys were never stored: {:?}",
            r.failed
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let seq = Arc::new(AtomicU64::new(0));
    let stored = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..WRITERS)
        .map(|_| {
            let (tier, seq, stored, until) =
                (tier.clone(), seq.clone(), stored.clone(), until.clone());
            tokio::spawn(async move {
                let mut o = Outcome::default();
                while !until.reached() {
                    let s = seq.fetch_add(JOB, Ordering::Relaxed);
                    let keys: Vec<BlockKey> = (s..s + JOB).map(|s| new_key(child, s)).collect();
                    let r = store_keys(&*tier, &keys, 0, bs).await;
                    o.stored += r.ok.len() as u64;
                    stored.fetch_add(r.ok.len() as u64, Ordering::Relaxed);
                    o.no_space += r
                        .failed
                        .iter()
                        .filter(|(_, e)| matches!(e, Error::NoSpace { .. }))
                        .count() as u64;
                }
                o
            })
        })
        .collect();
    // instances run at about the same pace: the reader picks keys just behind its own
    let reader = {
        let (tier, seq, until) = (tier.clone(), seq.clone(), until.clone());
        tokio::spawn(async move {
            let mut o = Outcome::default();
            let mut rng = child.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            while !until.reached() {
                let at = seq.load(Ordering::Relaxed);
                let mut probe = Vec::new();
                for _ in 0..JOB {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    let c = rng % instances;
                    let back = (rng >> 8) % (4 * JOB);
                    probe.push(new_key(c, at.saturating_sub(back)));
                }
                // one load per key: a key twice in a job can load once and miss once
                // (deleted in between), and its result does not say which sink it filled
                probe.sort_unstable();
                probe.dedup();
                let present = tier.lookup(&probe).await.unwrap_or_default();
                let found: Vec<BlockKey> = probe
                    .iter()
                    .zip(present)
                    .filter(|(_, p)| *p)
                    .map(|(k, _)| *k)
                    .collect();
                tokio::time::sleep(if found.is_empty() {
                    pace.reader_pause.max(Duration::from_millis(1))
                } else {
                    pace.reader_pause
                })
                .await;
                if found.is_empty() {
                    continue;
                }
                let (_, data) = load_keys(&*tier, &found, bs).await;
                o.loaded += data.len() as u64;
                check(child, "recent", &data, &mut o);
            }
            o
        })
    };
    let mut o = Outcome::default();
    let mut theirs_seen = false;
    while !until.reached() {
        tokio::time::sleep(pace.hot_every).await;
        until.record(stored.load(Ordering::Relaxed));
        if !theirs_seen {
            theirs_seen = tier
                .lookup(&theirs)
                .await
                .is_ok_and(|p| p.iter().all(|p| *p));
        }
        let mut hot = mine.clone();
        if theirs_seen {
            hot.extend(&theirs);
        }
        let (r, data) = load_keys(&*tier, &hot, bs).await;
        o.hot_loads += hot.len() as u64;
        o.hot_misses += r.failed.len() as u64;
        for (k, e) in &r.failed {
            o.notes
                .push(format!("child {child}: hot key {k} failed: {e}"));
        }
        check(child, "hot", &data, &mut o);
    }
    for w in writers {
        o.add(&w.await.expect("a writer panicked"));
    }
    o.add(&reader.await.expect("the reader panicked"));
    for n in &o.notes {
        eprintln!("{n}");
    }
    o
}

/// Reads a lease file (`<epoch> <owner> ...`, what both shared tiers write) at `path`.
pub fn read_lease(path: &std::path::Path) -> Option<(u64, String)> {
    let s = std::fs::read_to_string(path).ok()?;
    let mut it = s.split_whitespace();
    Some((it.next()?.parse().ok()?, it.next()?.to_string()))
}

/// Kills (SIGKILL) the child whose instance (`child-<n>`) holds the lease read from
/// `lease`, and waits for another instance to hold it; returns the child killed and how long
/// the takeover took. Panics if none takes it within `give_up`. A lease that changed hands
/// before the kill (a live leader starved of CPU past its lease on a loaded machine loses it,
/// as it should) is reported, not a failure: the current holder is killed.
pub fn kill_the_leader(
    children: &mut [std::process::Child],
    lease: &std::path::Path,
    give_up: Duration,
) -> (u64, Duration) {
    let (epoch, owner) = read_lease(lease).expect("a leader holds the lease");
    if epoch != 1 {
        eprintln!("the lease changed hands before the kill: epoch {epoch}, {owner} holds it");
    }
    let killed: u64 = owner
        .strip_prefix("child-")
        // `child-<n>`, or a member of instance `child-<n>`: `child-<n>.<suffix>`
        .and_then(|n| n.split('.').next()?.parse().ok())
        .unwrap_or_else(|| panic!("lease owner {owner:?}"));
    children[killed as usize].kill().unwrap();
    let killed_at = Instant::now();
    children[killed as usize].wait().unwrap();
    loop {
        if let Some((e, o)) = read_lease(lease)
            && e > epoch
            && o != owner
            && o != "-"
        {
            return (killed, killed_at.elapsed());
        }
        assert!(
            killed_at.elapsed() < give_up,
            "no takeover after the leader {owner} was killed"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Waits for every child but `killed` to succeed and sums their outcomes (each written to
/// its file in `outs` with [`Outcome::to_text`]); each must have done some of every kind of
/// work.
pub fn collect(
    children: &mut [std::process::Child],
    outs: &[std::path::PathBuf],
    killed: u64,
) -> Outcome {
    let mut total = Outcome::default();
    for (c, (ch, out)) in children.iter_mut().zip(outs).enumerate() {
        if c as u64 == killed {
            continue;
        }
        assert!(ch.wait().unwrap().success(), "child {c} failed");
        let o = Outcome::parse(&std::fs::read_to_string(out).unwrap()).unwrap();
        eprintln!("child {c}: {o:?}");
        assert!(
            o.stored > 0 && o.loaded > 0 && o.hot_loads > 0,
            "child {c} did no work: {o:?}"
        );
        total.add(&o);
    }
    total
}

/// Counts the blocks of `data` that are not their key's bytes into `o`, with a note each.
fn check(child: u64, what: &str, data: &[(BlockKey, bytes::Bytes)], o: &mut Outcome) {
    for (k, d) in data {
        if verify_block(k, 0, d) {
            continue;
        }
        o.wrong += 1;
        let want = block_bytes(k, 0, d.len());
        let first = d.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        let last = d.iter().zip(&want).rposition(|(a, b)| a != b).unwrap_or(0);
        let zeros = d[first..=last].iter().all(|b| *b == 0);
        o.notes.push(format!(
            "child {child}: WRONG {what} block {k}: bytes {first}..={last} differ (all zero: {zeros}) of {}",
            d.len()
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_outcome_round_trips_with_its_notes() {
        let o = Outcome {
            stored: 1,
            no_space: 2,
            loaded: 3,
            wrong: 4,
            hot_loads: 5,
            hot_misses: 6,
            took_lease: 7,
            notes: vec!["a b".into(), "c".into()],
        };
        assert_eq!(Outcome::parse(&o.to_text()), Some(o));
        assert_eq!(Outcome::parse("1 2 3"), None);
    }
}
