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
use kv_tier_testkit::allocated_bytes;
use kv_tier_testkit::instances::{Pace, collect, kill_the_leader, new_key, run_instance};
use kv_tier_testkit::{load_keys, store_keys, verify_block};

const BS: usize = 64 << 10;
const CAP_BYTES: u64 = 256 << 20;
const LEASE_S: f64 = 1.0;
const STAMP_S: f64 = 0.5;
const INSTANCES: u64 = 4;

fn cfg(root: &Path, id: &str) -> FsTierConfig {
    common::shared_cfg(root, id, CAP_BYTES, LEASE_S, STAMP_S)
}

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
        let pace = Pace {
            hot_every: Duration::from_millis(30),
            reader_pause: Duration::ZERO,
        };
        let mut o = run_instance(tier.clone(), child, INSTANCES, end, BS, pace).await;
        let st = tier.stats();
        eprintln!("child {child}: {:?}", st.shared.unwrap());
        o.took_lease = st.shared.unwrap().takeovers;
        tier.shutdown().await.unwrap();
        o
    });
    std::fs::write(out, o.to_text()).unwrap();
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

/// 4 processes on one root for `KV_TIER_SHARED_SECS` (60) seconds of stores and loads as fast
/// as they go: the directory never holds more than 1.10x the global cap, no wrong byte is
/// served, no key read by any instance within a stamp interval is evicted (hot keys, read
/// every 30 ms by their writer and its neighbour, never miss), and when the leader is killed
/// (SIGKILL) another instance holds the lease within two lease periods (and 2 s of slack for
/// a loaded machine).
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
    let (killed, takeover) = kill_the_leader(
        &mut children,
        &coord.join("lease"),
        Duration::from_secs_f64(10.0 * LEASE_S),
    );
    let total = collect(&mut children, &outs, killed);
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.join().unwrap();
    let peak = peak.load(Ordering::Relaxed);
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
        total.notes.join("\n")
    );

    assert_eq!(
        total.hot_misses,
        0,
        "keys in use were evicted:\n{}",
        total.notes.join("\n")
    );
    assert!(ratio <= 1.10, "peak {peak} bytes is {ratio:.3}x the cap");
    assert!(
        // two lease periods, plus what a loaded 2-core machine adds to scheduling
        takeover <= Duration::from_secs_f64(2.0 * LEASE_S + 2.0),
        "takeover took {takeover:?}, more than two lease periods and 2 s"
    );
    assert!(
        total.stored * BS as u64 > 2 * CAP_BYTES,
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
