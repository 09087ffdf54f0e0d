//! Shared helpers of the fs tier's tests.
#![allow(dead_code, unreachable_pub)]

use std::path::{Path, PathBuf};
use std::process::Command;

use kv_tier_core::{BlockKey, Namespace, RunFields, SecondaryTier};
use kv_tier_fs::{Checksum, FsTier, FsTierConfig};

pub const BS: usize = 4096;

/// How long a test waits for a sweep hook to be reached before it fails (a condition wait,
/// not a timing assertion: a broken tier fails the test instead of hanging it).
pub const HOOK_DEADLINE: std::time::Duration = std::time::Duration::from_secs(30);

pub fn ns() -> Namespace {
    Namespace::new(
        RunFields::new("test-org/test-model", "torch.float16", 16),
        0,
    )
    .unwrap()
}

pub fn cfg(root: &Path) -> FsTierConfig {
    let mut c = FsTierConfig::new(root);
    c.n_read_threads = 4;
    c.n_write_threads = 4;
    c
}

/// An instance of a shared root (`shared: true`, id `id`): [`cfg`] with checksums on, a cap
/// of `cap_bytes` for the root as a whole, the GC on a sub-second scale (stamp interval
/// `stamp_s`, grace twice that) and a lease of `lease_s`.
pub fn shared_cfg(
    root: &Path,
    id: &str,
    cap_bytes: u64,
    lease_s: f64,
    stamp_s: f64,
) -> FsTierConfig {
    let mut c = cfg(root);
    c.checksum = Checksum::Crc32c;
    c.gc_max_size_gb = Some(cap_bytes as f64 / (1u64 << 30) as f64);
    c.gc_stamp_interval_s = Some(stamp_s);
    c.gc_grace_s = Some(2.0 * stamp_s);
    c.gc_interval_s = Some(0.05);
    c.shared = true;
    c.shared_lease_s = Some(lease_s);
    c.instance_id = Some(id.into());
    c
}

pub fn open(root: &Path) -> FsTier {
    FsTier::open("fs", cfg(root), ns(), BS).unwrap()
}

pub fn open_checksummed(root: &Path) -> FsTier {
    let mut c = cfg(root);
    c.checksum = Checksum::Crc32c;
    FsTier::open("fs", c, ns(), BS).unwrap()
}

pub async fn store(t: &dyn SecondaryTier, keys: &[BlockKey], salt: u64) -> kv_tier_core::JobResult {
    kv_tier_testkit::store_keys(t, keys, salt, BS).await
}

pub async fn load(
    t: &dyn SecondaryTier,
    keys: &[BlockKey],
) -> (kv_tier_core::JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    kv_tier_testkit::load_keys(t, keys, BS).await
}

/// A filesystem mounted for one test (the tests run as root); unmounted on drop.
pub struct Mount {
    pub dir: PathBuf,
    _tmp: tempfile::TempDir,
}

impl Mount {
    pub fn new(fstype: &str, options: &str) -> Mount {
        let tmp = kv_tier_testkit::temp_root();
        let dir = tmp.path().join("mnt");
        std::fs::create_dir(&dir).unwrap();
        let mut cmd = Command::new("mount");
        cmd.args(["-t", fstype]);
        if !options.is_empty() {
            cmd.args(["-o", options]);
        }
        let out = cmd.arg(fstype).arg(&dir).output().expect("run mount");
        assert!(
            out.status.success(),
            "mount -t {fstype} -o {options} failed (these tests need root): {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Mount { dir, _tmp: tmp }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// Key of a block file, from its path (`.../<hex[0..3]>/<hex[3..5]>_g<group>/<hex>.bin`).
pub fn key_of(path: &Path) -> BlockKey {
    let hex = path.file_stem().unwrap().to_str().unwrap();
    let dir = path
        .parent()
        .unwrap()
        .file_name()
        .unwrap()
        .to_str()
        .unwrap();
    let group: u32 = dir.rsplit("_g").next().unwrap().parse().unwrap();
    BlockKey::from_hex(hex, group).unwrap()
}

/// Sets each key's file mtime to `secs_ago(i)` seconds in the past, then rescans (so the
/// tier's index sees the new ages).
pub fn age(tier: &FsTier, keys: &[BlockKey], secs_ago: impl Fn(usize) -> u64) {
    for (i, k) in keys.iter().enumerate() {
        let f = std::fs::File::options()
            .write(true)
            .open(tier.block_path(k))
            .unwrap();
        f.set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(secs_ago(i)))
            .unwrap();
    }
    tier.gc_rescan_now().unwrap();
}

/// A key in the one leaf directory `abc/de_g0` (`i` picks the rest of the hash): what such
/// keys hold on disk is their files plus one fixed pair of directories.
pub fn leaf_key(i: u64) -> BlockKey {
    let mut h = [0u8; 32];
    h.copy_from_slice(kv_tier_testkit::test_key(i).hash_bytes());
    h[0] = 0xab;
    h[1] = 0xcd;
    h[2] = 0xe0 | (h[2] & 0x0f);
    BlockKey::from_hash32(h, 0)
}

/// Sets the block checksum xattr of the file at `p` to `v` (any bytes: tests damage it).
pub fn set_crc_xattr(p: &Path, v: &[u8]) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let name = std::ffi::CString::new(kv_tier_fs::CRC_XATTR).unwrap();
    // SAFETY: valid path, name and value buffer.
    let rc = unsafe { libc::setxattr(c.as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    assert_eq!(rc, 0, "setxattr {}", p.display());
}

/// Installs a GC hook that stops at `point`: the receiver gets a message when the GC is
/// there, and the GC goes on when the sender sends (or is dropped).
pub fn hook_at(
    tier: &FsTier,
    point: kv_tier_fs::SweepPoint,
) -> (std::sync::mpsc::Receiver<()>, std::sync::mpsc::Sender<()>) {
    let (at_tx, at_rx) = std::sync::mpsc::channel();
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let go_rx = std::sync::Mutex::new(go_rx);
    tier.set_sweep_hook(Some(std::sync::Arc::new(move |p| {
        if p == point {
            let _ = at_tx.send(());
            let _ = go_rx.lock().unwrap().recv();
        }
    })))
    .unwrap();
    (at_rx, go_tx)
}

/// Allocated bytes of the directories the test keys keep: they all share one leaf directory
/// (and so one top directory), each a directory's allocation on this filesystem.
pub fn dirs(root: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    2 * std::fs::metadata(root).unwrap().blocks() * 512
}

/// What `n` test blocks hold on disk: their files and their shared directories.
pub fn held(root: &Path, n: u64) -> u64 {
    n * BS as u64 + dirs(root)
}

/// A bounded tier whose cap holds `cap_blocks` test blocks and whose low watermark holds
/// `watermark x cap_blocks` of them. The hard ceiling is out of the way: these tests drive
/// sweeps by hand (the ceiling has tests of its own).
pub fn hand_swept_cfg(root: &Path, cap_blocks: u64, watermark: f64) -> FsTierConfig {
    let mut c = cfg(root);
    let cap = held(root, cap_blocks);
    let low = watermark * (cap_blocks * BS as u64) as f64 + dirs(root) as f64 + 0.5;
    c.gc_max_size_gb = Some(cap as f64 / (1u64 << 30) as f64);
    c.gc_low_watermark = Some(low / cap as f64);
    c.gc_hard_ceiling = Some(1000.0);
    c.gc_grace_s = Some(300.0);
    c.gc_stamp_interval_s = Some(60.0);
    c.gc_interval_s = Some(3600.0);
    c.gc_background = false;
    c
}

/// Holds the sweep at `point`: returns the sweep's thread once it has reached it, and the
/// sender that lets it go on.
pub fn sweep_held_at(
    tier: &std::sync::Arc<FsTier>,
    point: kv_tier_fs::SweepPoint,
) -> (std::thread::JoinHandle<usize>, std::sync::mpsc::Sender<()>) {
    let (at_rx, go_tx) = hook_at(tier, point);
    let t = tier.clone();
    let sweep = std::thread::spawn(move || t.gc_sweep_now().unwrap());
    at_rx
        .recv_timeout(HOOK_DEADLINE)
        .expect("the sweep hook was never reached");
    (sweep, go_tx)
}
