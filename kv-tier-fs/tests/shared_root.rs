//! Several processes on one shared root (`shared: true`), each a child run of this test
//! binary: the directory's peak allocated bytes against the one global cap, wrong bytes
//! served, keys read by any instance never evicted, and the leader lease taken over after
//! the leader is killed with SIGKILL.
//!
//! `KV_TIER_SHARED_SECS` sets the run's length (default 60 s).

mod common;
use common::ns;

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kv_tier_core::{BlockKey, Error, SecondaryTier};
use kv_tier_fs::{FsTier, FsTierConfig};
use kv_tier_testkit::{allocated_bytes, load_keys, store_keys, test_key, verify_block};

const BS: usize = 64 << 10;
const CAP_BYTES: u64 = 256 << 20;
const LEASE_S: f64 = 1.0;
const STAMP_S: f64 = 0.5;
const INSTANCES: u64 = 4;
const HOT: u64 = 8;
const JOB: u64 = 16;
/// Store jobs in flight per instance.
const WRITERS: usize = 3;

fn cfg(root: &Path, id: &str) -> FsTierConfig {
    common::shared_cfg(root, id, CAP_BYTES, LEASE_S, STAMP_S)
}

fn hot_key(child: u64, i: u64) -> BlockKey {
    test_key(1 << 60 | child << 32 | i)
}

fn new_key(child: u64, seq: u64) -> BlockKey {
    test_key(2 << 60 | child << 32 | seq)
}

/// What a child reports at its end.
#[derive(Debug, Default, Clone, Copy)]
struct Outcome {
    stored: u64,
    no_space: u64,
    loaded: u64,
    wrong: u64,
    hot_loads: u64,
    hot_misses: u64,
    took_lease: u64,
}

impl Outcome {
    fn to_line(self) -> String {
        format!(
            "{} {} {} {} {} {} {}",
            self.stored,
            self.no_space,
            self.loaded,
            self.wrong,
            self.hot_loads,
            self.hot_misses,
            self.took_lease
        )
    }
    fn parse(s: &str) -> Option<Self> {
        let v: Vec<u64> = s
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
        })
    }
}

/// One instance: stores its hot keys, then until the end stores new 16-block jobs, reads its
/// own hot keys and its neighbour's every 30 ms (each such read must hit and verify), and
/// reads keys other instances wrote (each served block must verify).
#[test]
#[ignore = "a child process of the shared_root tests"]
fn shared_child() {
    let Ok(spec) = std::env::var("KV_TIER_SHARED_CHILD") else {
        return;
    };
    let parts: Vec<&str> = spec.split('|').collect();
    let (root, child, secs, out) = (
        PathBuf::from(parts[0]),
        parts[1].parse::<u64>().unwrap(),
        parts[2].parse::<f64>().unwrap(),
        PathBuf::from(parts[3]),
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let o = rt.block_on(async move {
        let tier =
            Arc::new(FsTier::open("fs", cfg(&root, &format!("child-{child}")), ns(), BS).unwrap());
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mine: Vec<BlockKey> = (0..HOT).map(|i| hot_key(child, i)).collect();
        let next = (child + 1) % INSTANCES;
        let theirs: Vec<BlockKey> = (0..HOT).map(|i| hot_key(next, i)).collect();
        // the hot keys first (credit comes once a leader holds the lease)
        loop {
            let r = store_keys(&*tier, &mine, 0, BS).await;
            if r.is_success() {
                break;
            }
            assert!(
                Instant::now() < end,
                "the hot keys were never stored: {:?}",
                r.failed
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let seq = Arc::new(AtomicU64::new(0));
        // writers: new 16-block jobs, WRITERS in flight
        let writers: Vec<_> = (0..WRITERS)
            .map(|_| {
                let (tier, seq) = (tier.clone(), seq.clone());
                tokio::spawn(async move {
                    let mut o = Outcome::default();
                    while Instant::now() < end {
                        let s = seq.fetch_add(JOB, Ordering::Relaxed);
                        let keys: Vec<BlockKey> = (s..s + JOB).map(|s| new_key(child, s)).collect();
                        let r = store_keys(&*tier, &keys, 0, BS).await;
                        o.stored += r.ok.len() as u64;
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
        // a reader of keys any instance wrote lately (instances run at about the same pace)
        let reader = {
            let (tier, seq) = (tier.clone(), seq.clone());
            tokio::spawn(async move {
                let mut o = Outcome::default();
                let mut rng = child.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                while Instant::now() < end {
                    let at = seq.load(Ordering::Relaxed);
                    let mut probe = Vec::new();
                    for _ in 0..JOB {
                        rng ^= rng << 13;
                        rng ^= rng >> 7;
                        rng ^= rng << 17;
                        let c = rng % INSTANCES;
                        let back = (rng >> 8) % (4 * JOB);
                        probe.push(new_key(c, at.saturating_sub(back)));
                    }
                    // one load per key: a key twice in a job can load once and miss once
                    // (evicted in between), and its result does not say which sink it filled
                    probe.sort_unstable();
                    probe.dedup();
                    let present = tier.lookup(&probe).await.unwrap();
                    let found: Vec<BlockKey> = probe
                        .iter()
                        .zip(present)
                        .filter(|(_, p)| *p)
                        .map(|(k, _)| *k)
                        .collect();
                    if found.is_empty() {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                        continue;
                    }
                    let (_, data) = load_keys(&*tier, &found, BS).await;
                    o.loaded += data.len() as u64;
                    o.wrong += wrong(child, "recent", &data);
                }
                o
            })
        };
        // the hot keys, every 30 ms: its own and, once they exist, its neighbour's
        let mut o = Outcome::default();
        let mut theirs_seen = false;
        while Instant::now() < end {
            tokio::time::sleep(Duration::from_millis(30)).await;
            if !theirs_seen {
                theirs_seen = tier.lookup(&theirs).await.unwrap().iter().all(|p| *p);
            }
            let mut hot = mine.clone();
            if theirs_seen {
                hot.extend(&theirs);
            }
            let (r, data) = load_keys(&*tier, &hot, BS).await;
            o.hot_loads += hot.len() as u64;
            o.hot_misses += r.failed.len() as u64;
            for (k, e) in &r.failed {
                eprintln!("child {child}: hot key {k} failed: {e}");
            }
            o.wrong += wrong(child, "hot", &data);
        }
        for w in writers {
            let w = w.await.unwrap();
            o.stored += w.stored;
            o.no_space += w.no_space;
        }
        let r = reader.await.unwrap();
        o.loaded += r.loaded;
        o.wrong += r.wrong;
        let st = tier.stats();
        eprintln!("child {child}: {:?}", st.shared.unwrap());
        o.took_lease = st.shared.unwrap().takeovers;
        tier.shutdown().await.unwrap();
        o
    });
    let mut text = o.to_line();
    for line in WRONG_LINES.lock().unwrap().iter() {
        text.push('\n');
        text.push_str(line);
    }
    std::fs::write(out, text).unwrap();
}

/// What [`wrong`] found, written beside the child's outcome for the parent's report.
static WRONG_LINES: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Counts the blocks of `data` that are not their key's bytes, describing each on stderr and
/// in [`WRONG_LINES`].
fn wrong(child: u64, what: &str, data: &[(BlockKey, bytes::Bytes)]) -> u64 {
    let mut n = 0;
    for (k, d) in data {
        if verify_block(k, 0, d) {
            continue;
        }
        n += 1;
        let want = kv_tier_testkit::block_bytes(k, 0, d.len());
        let first = d.iter().zip(&want).position(|(a, b)| a != b).unwrap_or(0);
        let last = d.iter().zip(&want).rposition(|(a, b)| a != b).unwrap_or(0);
        let zeros = d[first..=last].iter().all(|b| *b == 0);
        let line = format!(
            "child {child}: WRONG {what} block {k}: bytes {first}..={last} differ (all zero: {zeros}) of {}",
            d.len()
        );
        eprintln!("{line}");
        WRONG_LINES.lock().unwrap().push(line);
    }
    n
}

fn spawn_child(root: &Path, child: u64, secs: f64, out: &Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["shared_child", "--ignored", "--exact", "--nocapture"])
        .env(
            "KV_TIER_SHARED_CHILD",
            format!("{}|{child}|{secs}|{}", root.display(), out.display()),
        )
        .spawn()
        .unwrap()
}

/// Bytes in use on the filesystem holding `dir` (`statvfs`).
fn used(dir: &Path) -> u64 {
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: zeroed is a valid statvfs; the call fills it for a valid path.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid NUL-terminated path and a statvfs to fill.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0);
    (st.f_blocks - st.f_bfree) * st.f_frsize
}

/// A fresh ext4 filesystem of its own (a loop-mounted image), so the whole filesystem's
/// use is the tier's: every block, directory, sidecar and unnamed file in flight, with no
/// walk racing the writers. `None` where loop mounts are refused.
struct Ext4 {
    dir: PathBuf,
}

impl Ext4 {
    fn new(at: &Path) -> Option<Ext4> {
        let img = at.join("fs.img");
        std::fs::File::create(&img)
            .unwrap()
            .set_len(2 << 30)
            .unwrap();
        let ok = Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&img)
            .status()
            .is_ok_and(|s| s.success());
        let dir = at.join("mnt");
        std::fs::create_dir(&dir).unwrap();
        let mounted = ok
            && Command::new("mount")
                .args(["-o", "loop"])
                .arg(&img)
                .arg(&dir)
                .status()
                .is_ok_and(|s| s.success());
        mounted.then_some(Ext4 { dir })
    }
}

impl Drop for Ext4 {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

fn read_lease(coord: &Path) -> Option<(u64, String)> {
    let s = std::fs::read_to_string(coord.join("lease")).ok()?;
    let mut it = s.split_whitespace();
    Some((it.next()?.parse().ok()?, it.next()?.to_string()))
}

/// 4 processes on one root for `KV_TIER_SHARED_SECS` (60) seconds of stores and loads as fast
/// as they go: the directory never holds more than 1.10x the global cap, no wrong byte is
/// served, no key read by any instance within a stamp interval is evicted (hot keys, read
/// every 30 ms by their writer and its neighbour, never miss), and when the leader is killed
/// (SIGKILL) another instance holds the lease within two lease periods.
#[test]
fn four_processes_share_one_bound_and_survive_the_leaders_death() {
    let secs: f64 = std::env::var("KV_TIER_SHARED_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60.0);
    let dir = kv_tier_testkit::temp_root();
    let fs = Ext4::new(dir.path());
    let root = match &fs {
        Some(f) => f.dir.join("root"),
        None => {
            eprintln!("no loop mount here: measuring by walks of the rank directory");
            dir.path().join("root")
        }
    };
    let rank_dir = root.join(ns().rank_dir_name());
    let coord = ns().namespace_dir(&root).join("shared-r0");
    let outs: Vec<PathBuf> = (0..INSTANCES)
        .map(|c| dir.path().join(format!("out-{c}")))
        .collect();
    let mut children: Vec<Child> = (0..INSTANCES)
        .map(|c| spawn_child(&root, c, secs, &outs[c as usize]))
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    // on its own filesystem: what is in use beyond the empty filesystem, less the namespace
    // directory (config.json and the coordination files, outside the cap)
    let base = fs.as_ref().map(|f| used(&f.dir));
    let ns_dir = ns().namespace_dir(&root);
    let sampler = {
        let (stop, peak, rank_dir) = (stop.clone(), peak.clone(), rank_dir.clone());
        let mnt = fs.as_ref().map(|f| f.dir.clone());
        std::thread::spawn(move || {
            let mut samples = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let now = match (&mnt, base) {
                    (Some(m), Some(b)) => used(m)
                        .saturating_sub(b)
                        .saturating_sub(allocated_bytes(&ns_dir)),
                    _ => allocated_bytes(&rank_dir),
                };
                peak.fetch_max(now, Ordering::Relaxed);
                samples += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            samples
        })
    };
    // kill the leader a third of the way in, and time the takeover
    std::thread::sleep(Duration::from_secs_f64(secs / 3.0));
    let (epoch, owner) = read_lease(&coord).expect("a leader holds the lease");
    // one leader from the start: a live leader never loses the lease
    assert_eq!(
        epoch, 1,
        "the lease changed hands before the kill ({owner} holds it)"
    );
    let killed: u64 = owner
        .strip_prefix("child-")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("lease owner {owner:?}"));
    children[killed as usize].kill().unwrap();
    let killed_at = Instant::now();
    children[killed as usize].wait().unwrap();
    let takeover = loop {
        if let Some((e, o)) = read_lease(&coord)
            && e > epoch
            && o != owner
            && o != "-"
        {
            break killed_at.elapsed();
        }
        assert!(
            killed_at.elapsed() < Duration::from_secs_f64(10.0 * LEASE_S),
            "no takeover after the leader {owner} was killed"
        );
        std::thread::sleep(Duration::from_millis(2));
    };
    for (c, ch) in children.iter_mut().enumerate() {
        if c as u64 != killed {
            assert!(ch.wait().unwrap().success(), "child {c} failed");
        }
    }
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
    let mut total = Outcome::default();
    let mut wrong_lines = Vec::new();
    for (c, out) in outs.iter().enumerate() {
        if c as u64 == killed {
            continue;
        }
        let text = std::fs::read_to_string(out).unwrap();
        let mut lines = text.lines();
        let o = Outcome::parse(lines.next().unwrap_or_default()).unwrap();
        wrong_lines.extend(lines.map(str::to_string));
        eprintln!("child {c}: {o:?}");
        assert!(
            o.stored > 0 && o.loaded > 0 && o.hot_loads > 0,
            "child {c} did no work: {o:?}"
        );
        total.stored += o.stored;
        total.no_space += o.no_space;
        total.loaded += o.loaded;
        total.wrong += o.wrong;
        total.hot_loads += o.hot_loads;
        total.hot_misses += o.hot_misses;
        total.took_lease += o.took_lease;
    }
    let ratio = peak as f64 / CAP_BYTES as f64;

    eprintln!(
        "{INSTANCES} instances, {secs} s: stored {} blocks ({:.1} GiB), {} refused for lack of credit, loaded {}, wrong {}, hot loads {} (misses {}); peak {:.2} MiB = {ratio:.3}x the cap over {samples} samples; leader child-{killed} killed, lease taken over in {:?} ({} takeovers by the survivors)",
        total.stored,
        (total.stored * BS as u64) as f64 / (1u64 << 30) as f64,
        total.no_space,
        total.loaded,
        total.wrong,
        total.hot_loads,
        total.hot_misses,
        peak as f64 / (1u64 << 20) as f64,
        takeover,
        total.took_lease
    );
    assert_eq!(
        total.wrong,
        0,
        "wrong bytes served:\n{}",
        wrong_lines.join("\n")
    );

    assert_eq!(total.hot_misses, 0, "keys in use were evicted");
    assert!(ratio <= 1.10, "peak {peak} bytes is {ratio:.3}x the cap");
    assert!(
        takeover <= Duration::from_secs_f64(2.0 * LEASE_S),
        "takeover took {takeover:?}, more than two lease periods"
    );
    assert!(
        total.stored * BS as u64 > 4 * CAP_BYTES,
        "the run wrote too little to test the bound"
    );
}

/// Opens an instance on `root` in this process.
fn open_instance(root: &Path, id: &str, lease_s: f64) -> FsTier {
    let mut c = cfg(root, id);
    c.shared_lease_s = Some(lease_s);
    FsTier::open("fs", c, ns(), BS).unwrap()
}

/// Waits (at most 30 s: a condition wait, not a timing check) until `f` holds.
fn wait_until(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "never: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Without a leader that grants credit (the lease held by an instance that renews it and
/// grants nothing), a store is refused as `NoSpace` after its wait, naming the instance; it
/// writes nothing and says so in the stats.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_credit_a_store_is_refused_and_writes_nothing() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let coord = ns().namespace_dir(&root).join("shared-r0");
    std::fs::create_dir_all(&coord).unwrap();
    // a live leader of another host that never grants: renews its lease every 50 ms
    let stop = Arc::new(AtomicBool::new(false));
    let ghost = {
        let (stop, lease) = (stop.clone(), coord.join("lease"));
        std::thread::spawn(move || {
            let mut beat = 0u64;
            while !stop.load(Ordering::Relaxed) {
                beat += 1;
                let tmp = lease.with_extension("ghost");
                std::fs::write(&tmp, format!("7 ghost {beat}\n")).unwrap();
                std::fs::rename(&tmp, &lease).unwrap();
                std::thread::sleep(Duration::from_millis(50));
            }
        })
    };
    let tier = open_instance(&root, "lonely", 1.0);
    let keys: Vec<BlockKey> = (0..4).map(|i| new_key(9, i)).collect();
    let r = store_keys(&tier, &keys, 0, BS).await;
    assert_eq!(r.failed.len(), 4);
    for (_, e) in &r.failed {
        assert!(
            matches!(e, Error::NoSpace { detail, .. } if detail.contains("lonely") && detail.contains("no credit")),
            "{e}"
        );
    }
    let s = tier.stats().shared.unwrap();
    assert!(!s.leader);
    assert_eq!((s.epoch, s.no_credit, s.consumed_bytes), (7, 4, 0));
    assert_eq!(tier.lookup(&keys).await.unwrap(), vec![false; 4]);
    stop.store(true, Ordering::Relaxed);
    ghost.join().unwrap();
    // the ghost's lease now stands still: this instance takes it over and stores
    wait_until("the stalled lease is taken over", || {
        tier.stats().shared.unwrap().leader
    });
    assert!(store_keys(&tier, &keys, 0, BS).await.is_success());
    assert_eq!(tier.stats().shared.unwrap().epoch, 8);
    tier.shutdown().await.unwrap();
}

/// A leader that closes releases the lease: another instance takes it at its next look,
/// long before the lease period (60 s here) would have let it; blocks one instance stored
/// are served by the other.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closing_leader_hands_the_lease_over_at_once() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let a = open_instance(&root, "a", 60.0);
    wait_until("a leads", || a.stats().shared.unwrap().leader);
    let b = open_instance(&root, "b", 60.0);
    let keys: Vec<BlockKey> = (0..8).map(|i| new_key(5, i)).collect();
    assert!(store_keys(&a, &keys, 0, BS).await.is_success());
    let (r, data) = load_keys(&b, &keys, BS).await;
    assert!(r.is_success());
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert!(!b.stats().shared.unwrap().leader);
    a.shutdown().await.unwrap();
    wait_until("b takes the released lease", || {
        b.stats().shared.unwrap().leader
    });
    assert_eq!(b.stats().shared.unwrap().epoch, 2);
    assert!(store_keys(&b, &[new_key(5, 100)], 0, BS).await.is_success());
    b.shutdown().await.unwrap();
}

/// An instance id whose heartbeat is alive is refused (naming it); one whose heartbeat stands
/// still (a previous run of it, killed) is taken over, and the credit that run spent carries
/// on (the leader counts it, so the new run must too).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_instance_id_is_refused_and_a_dead_ones_is_taken_over() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let a = open_instance(&root, "a", 0.4);
    let taken = FsTier::open("fs", cfg(&root, "a"), ns(), BS).err().unwrap();
    assert!(
        matches!(&taken, Error::InvalidConfig { field, reason } if field == "shared" && reason.contains("\"a\" is in use")),
        "{taken}"
    );
    a.shutdown().await.unwrap();
    // a previous run of "z", killed: its heartbeat stands still, its journal spent credit
    let coord = ns().namespace_dir(&root).join("shared-r0");
    std::fs::write(coord.join("members/z"), "41\n").unwrap();
    let rel = ns().block_rel_path(&new_key(3, 0));
    std::fs::write(
        coord.join("journal/z"),
        format!("P {rel} 1000\nD {rel}\nP {rel} 234\n"),
    )
    .unwrap();
    std::fs::write(coord.join("grants/z"), "1 5000\n").unwrap();
    let z = open_instance(&root, "z", 0.4);
    let s = z.stats().shared.unwrap();
    assert_eq!((s.consumed_bytes, s.granted_bytes), (1234, 5000));
    wait_until("z leads", || z.stats().shared.unwrap().leader);
    let r = store_keys(&z, &[new_key(3, 1)], 0, BS).await;
    assert!(
        r.is_success(),
        "{:?} {:?} {:?} {:?}",
        r.failed,
        z.stats().shared,
        std::fs::read_to_string(coord.join("grants/z")),
        std::fs::read_to_string(coord.join("state"))
    );
    z.shutdown().await.unwrap();
}

/// Every instance on a shared root must bound it alike: once a leader has published its
/// settings, an instance with another cap, lease or stamp interval is refused, naming the
/// setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_that_bounds_the_root_differently_is_refused() {
    let dir = kv_tier_testkit::temp_root();
    let root = dir.path().join("root");
    let a = open_instance(&root, "a", 0.4);
    let state = ns().namespace_dir(&root).join("shared-r0/state");
    wait_until("the leader publishes its settings", || state.exists());
    let mut other_cap = cfg(&root, "b");
    other_cap.shared_lease_s = Some(0.4);
    other_cap.gc_max_size_gb = Some(2.0 * CAP_BYTES as f64 / (1u64 << 30) as f64);
    let mut other_lease = cfg(&root, "c");
    other_lease.shared_lease_s = Some(0.8);
    let mut other_stamp = cfg(&root, "d");
    other_stamp.shared_lease_s = Some(0.4);
    other_stamp.gc_stamp_interval_s = Some(0.25);
    for (c, field) in [
        (other_cap, "gc_max_size_gb"),
        (other_lease, "shared_lease_s"),
        (other_stamp, "gc_stamp_interval_s"),
    ] {
        let e = FsTier::open("fs", c, ns(), BS).err().unwrap();
        assert!(
            matches!(&e, Error::InvalidConfig { field: f, reason } if f == field && reason.contains("must set it alike")),
            "{e}"
        );
    }
    let same = open_instance(&root, "e", 0.4);
    same.shutdown().await.unwrap();
    a.shutdown().await.unwrap();
}
