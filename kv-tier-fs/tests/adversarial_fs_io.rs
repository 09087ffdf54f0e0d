//! Adversarial tests of the fs tier's store and load paths, written from the README's
//! promises and the public API only: files of the wrong size, byte flips, blocks linked to
//! other keys' paths, directories removed or replaced under a running tier, a rank directory
//! renamed away, special files at block paths, loads racing truncations and renames, stores
//! racing loads and external deletes, many writers of one key through two instances,
//! dropped futures, ENOSPC on a small tmpfs, EMFILE, and errors that name what failed.

mod common;

use std::collections::{HashMap, HashSet};
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{BS, cfg, leaf_key, ns};
use kv_tier_core::{BlockKey, Error, JobResult, SecondaryTier};
use kv_tier_fs::{CRC_XATTR, Checksum, FsOp, FsTier, FsTierConfig};
use kv_tier_testkit::{block_bytes, find_files, temp_root, test_key, verify_block};

// ---------------------------------------------------------------------------------------
// helpers
// ---------------------------------------------------------------------------------------

/// The EMFILE test lowers the whole process's descriptor limit and takes every descriptor
/// left: it runs alone (write), the others side by side (read).
static DESCRIPTORS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// A small deterministic PRNG (xorshift64*).
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

fn checked_cfg(root: &Path) -> FsTierConfig {
    let mut c = cfg(root);
    c.checksum = Checksum::Crc32c;
    c
}

async fn store_bs(t: &FsTier, keys: &[BlockKey], salt: u64, bs: usize) -> JobResult {
    kv_tier_testkit::store_keys(t, keys, salt, bs).await
}

async fn load_bs(
    t: &FsTier,
    keys: &[BlockKey],
    bs: usize,
) -> (JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    kv_tier_testkit::load_keys(t, keys, bs).await
}

async fn store(t: &FsTier, keys: &[BlockKey], salt: u64) -> JobResult {
    store_bs(t, keys, salt, BS).await
}

async fn load(t: &FsTier, keys: &[BlockKey]) -> (JobResult, Vec<(BlockKey, bytes::Bytes)>) {
    load_bs(t, keys, BS).await
}

/// Every key of the job is in exactly one of the result's lists, once per occurrence.
fn assert_accounts(res: &JobResult, keys: &[BlockKey], what: &str) {
    let mut want: HashMap<BlockKey, usize> = HashMap::new();
    for k in keys {
        *want.entry(*k).or_default() += 1;
    }
    let mut got: HashMap<BlockKey, usize> = HashMap::new();
    for k in res.ok.iter().chain(res.failed.iter().map(|(k, _)| k)) {
        *got.entry(*k).or_default() += 1;
    }
    assert_eq!(
        got, want,
        "{what}: the job result does not account for every key exactly once: ok {:?} failed {:?}",
        res.ok, res.failed
    );
}

fn removed(tier: &FsTier) -> Vec<BlockKey> {
    kv_tier_testkit::removed_keys(tier.take_events())
}

fn leaf_dir(tier: &FsTier, k: &BlockKey) -> PathBuf {
    tier.block_path(k).parent().unwrap().to_path_buf()
}

fn top_dir(tier: &FsTier, k: &BlockKey) -> PathBuf {
    tier.block_path(k)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

fn rank_dir(tier: &FsTier, k: &BlockKey) -> PathBuf {
    tier.block_path(k)
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Every non-directory entry below `dir` (not following links), sorted.
fn all_entries(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in rd.flatten() {
            let p = e.path();
            match std::fs::symlink_metadata(&p) {
                Ok(m) if m.is_dir() => stack.push(p),
                Ok(_) => out.push(p),
                Err(_) => {}
            }
        }
    }
    out.sort();
    out
}

fn tmp_files(dir: &Path) -> Vec<PathBuf> {
    all_entries(dir)
        .into_iter()
        .filter(|p| p.to_string_lossy().contains(".tmp"))
        .collect()
}

fn bin_files(dir: &Path) -> Vec<PathBuf> {
    find_files(dir, ".bin")
}

fn is_regular(p: &Path) -> bool {
    std::fs::symlink_metadata(p)
        .map(|m| m.is_file())
        .unwrap_or(false)
}

fn exists_nofollow(p: &Path) -> bool {
    std::fs::symlink_metadata(p).is_ok()
}

fn cpath(p: &Path) -> CString {
    CString::new(p.as_os_str().as_encoded_bytes()).unwrap()
}

fn get_xattr(p: &Path) -> Option<Vec<u8>> {
    let c = cpath(p);
    let name = CString::new(CRC_XATTR).unwrap();
    let mut buf = vec![0u8; 256];
    // SAFETY: valid path, name and buffer.
    let n = unsafe {
        libc::lgetxattr(
            c.as_ptr(),
            name.as_ptr(),
            buf.as_mut_ptr().cast(),
            buf.len(),
        )
    };
    if n < 0 {
        return None;
    }
    buf.truncate(n as usize);
    Some(buf)
}

fn set_xattr(p: &Path, v: &[u8]) -> std::io::Result<()> {
    let c = cpath(p);
    let name = CString::new(CRC_XATTR).unwrap();
    // SAFETY: valid path, name and value.
    let rc = unsafe { libc::lsetxattr(c.as_ptr(), name.as_ptr(), v.as_ptr().cast(), v.len(), 0) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

fn flip_byte(p: &Path, off: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(p)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, off).unwrap();
    b[0] ^= 0x01;
    f.write_all_at(&b, off).unwrap();
}

fn mknod(p: &Path, mode: libc::mode_t, dev: libc::dev_t) {
    let c = cpath(p);
    // SAFETY: a valid path.
    let rc = unsafe { libc::mknod(c.as_ptr(), mode, dev) };
    assert_eq!(
        rc,
        0,
        "mknod {}: {}",
        p.display(),
        std::io::Error::last_os_error()
    );
}

fn mkfifo(p: &Path) {
    let c = cpath(p);
    // SAFETY: a valid path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
}

fn rm_rf(p: &Path) {
    match std::fs::symlink_metadata(p) {
        Ok(m) if m.is_dir() => {
            let _ = std::fs::remove_dir_all(p);
        }
        Ok(_) => {
            let _ = std::fs::remove_file(p);
        }
        Err(_) => {}
    }
}

/// Waits until the tier's write/read counters have not moved for `quiet` and no key of
/// `keys` is protected (I/O of dropped jobs has ended); at most 15 s.
async fn quiesce(tier: &FsTier, keys: &[BlockKey]) {
    let deadline = Instant::now() + Duration::from_secs(15);
    let sig = |t: &FsTier| {
        let b = t.stats().blocks;
        (
            b.blocks_written,
            b.stores_skipped,
            b.store_failures,
            b.blocks_read,
            b.load_misses,
            b.load_failures,
        )
    };
    let mut last = sig(tier);
    let mut since = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = sig(tier);
        if now != last {
            last = now;
            since = Instant::now();
        }
        let protected = keys.iter().any(|k| tier.is_protected(k));
        if !protected && since.elapsed() > Duration::from_millis(300) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the tier never went quiet (protected keys: {protected})"
        );
    }
}

// ---------------------------------------------------------------------------------------
// sizes
// ---------------------------------------------------------------------------------------

/// A file whose size is not exactly the block size (empty, one byte short or long, a
/// logical block long, twice the block, a sparse gigabyte long) is never served, even when
/// its first `block` bytes are exactly the block's: the load is a miss, the file removed and
/// reported. Also for a block size that is not a multiple of 512, and with buffered I/O.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn files_of_any_wrong_size_are_misses_removed_and_reported() {
    let _descriptors = DESCRIPTORS.read().await;
    for (bs, direct) in [
        (4096usize, true),
        (5000, true),
        (4096, false),
        (65536, true),
    ] {
        let root = temp_root();
        let mut c = cfg(root.path());
        c.direct_io = direct;
        let tier = FsTier::open("fs", c, ns(), bs).unwrap();
        let sizes = [
            0,
            1,
            511,
            bs - 1,
            bs + 1,
            bs + 511,
            bs + 512,
            bs + 4095,
            bs + 4096,
            bs + 4097,
            2 * bs,
            3 * bs + 7,
            bs + (1 << 30),
        ];
        for (i, &sz) in sizes.iter().enumerate() {
            let what = format!("block {bs} (direct {direct}), file of {sz} bytes");
            let k = test_key(10_000 + i as u64);
            let p = tier.block_path(&k);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let mut bytes = block_bytes(&k, 0, bs.min(sz));
            if sz > bs && sz < bs + (1 << 20) {
                bytes.extend(block_bytes(&test_key(99), 0, sz - bs));
            }
            std::fs::write(&p, &bytes).unwrap();
            if sz as u64 > bytes.len() as u64 {
                let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
                f.set_len(sz as u64).unwrap(); // sparse tail
            }
            assert_eq!(std::fs::metadata(&p).unwrap().len(), sz as u64);
            tier.take_events();
            let (res, data) = load_bs(&tier, &[k], bs).await;
            assert_accounts(&res, &[k], &what);
            assert!(data.is_empty(), "{what}: served");
            assert!(
                matches!(res.failed[..], [(_, Error::Corrupt { .. })]),
                "{what}: {:?}",
                res.failed
            );
            assert!(!exists_nofollow(&p), "{what}: the file was kept");
            assert_eq!(removed(&tier), vec![k], "{what}: no BlockRemoved");
            // heals
            let r = store_bs(&tier, &[k], 1, bs).await;
            assert!(r.is_success(), "{what}: {:?}", r.failed);
            let (res, data) = load_bs(&tier, &[k], bs).await;
            assert!(
                res.is_success() && verify_block(&k, 1, &data[0].1),
                "{what}: not healed"
            );
        }
        // a right-sized sparse file with a checksum-less tier is bytes like any other
        // (nothing to check); the right size never confuses the short-read detection
        let k = test_key(20_000);
        let p = tier.block_path(&k);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        let f = std::fs::File::create(&p).unwrap();
        f.set_len(bs as u64).unwrap();
        drop(f);
        let (res, data) = load_bs(&tier, &[k], bs).await;
        assert!(
            res.is_success(),
            "block {bs}: a sparse file of exactly the size: {:?}",
            res.failed
        );
        assert!(data[0].1.iter().all(|&b| b == 0));
        tier.shutdown().await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// checksums
// ---------------------------------------------------------------------------------------

/// With checksums, a flipped bit anywhere in the block (first byte, sector edges, middle,
/// last byte), a punched hole, or a flipped bit anywhere in the checksum xattr, is never
/// served: a miss, the file removed and reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn any_flipped_bit_in_block_or_xattr_is_a_miss_never_served() {
    let _descriptors = DESCRIPTORS.read().await;
    let root = temp_root();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    let mut n = 0u64;
    let mut next_key = || {
        n += 1;
        test_key(30_000 + n)
    };
    let offsets = [
        0u64,
        1,
        7,
        511,
        512,
        4095,
        BS as u64 / 2,
        BS as u64 - 2,
        BS as u64 - 1,
    ];
    for off in offsets {
        let k = next_key();
        assert!(store(&tier, &[k], 0).await.is_success());
        let p = tier.block_path(&k);
        flip_byte(&p, off);
        tier.take_events();
        let (res, data) = load(&tier, &[k]).await;
        assert!(data.is_empty(), "a flipped bit at {off} was served");
        assert!(
            matches!(res.failed[..], [(_, Error::Corrupt { .. })]),
            "flip at {off}: {:?}",
            res.failed
        );
        assert!(!exists_nofollow(&p), "flip at {off}: kept");
        assert_eq!(removed(&tier), vec![k], "flip at {off}");
    }
    // a punched hole (zeros where data was, same size)
    let k = next_key();
    assert!(store(&tier, &[k], 0).await.is_success());
    let p = tier.block_path(&k);
    {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        // SAFETY: a valid descriptor.
        let rc = unsafe {
            libc::fallocate(
                f.as_raw_fd(),
                libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                0,
                BS as i64,
            )
        };
        assert_eq!(rc, 0);
    }
    assert_eq!(std::fs::metadata(&p).unwrap().len(), BS as u64);
    let (res, data) = load(&tier, &[k]).await;
    assert!(
        data.is_empty() && !res.is_success(),
        "a punched hole was served"
    );
    // every bit of the xattr
    let k0 = next_key();
    assert!(store(&tier, &[k0], 0).await.is_success());
    let x = get_xattr(&tier.block_path(&k0)).expect("ext4 keeps the checksum in an xattr");
    for i in 0..x.len() {
        for bit in [0x01u8, 0x80] {
            let k = next_key();
            assert!(store(&tier, &[k], 0).await.is_success());
            let p = tier.block_path(&k);
            let mut v = get_xattr(&p).unwrap();
            v[i] ^= bit;
            set_xattr(&p, &v).unwrap();
            let (res, data) = load(&tier, &[k]).await;
            assert!(
                data.is_empty() && !res.is_success(),
                "xattr {:?} with byte {i} ^ {bit:#x} was served",
                String::from_utf8_lossy(&v)
            );
        }
    }
    // with the xattr removed
    let k = next_key();
    assert!(store(&tier, &[k], 0).await.is_success());
    let p = tier.block_path(&k);
    let c = cpath(&p);
    let name = CString::new(CRC_XATTR).unwrap();
    // SAFETY: valid path and name.
    assert_eq!(unsafe { libc::lremovexattr(c.as_ptr(), name.as_ptr()) }, 0);
    let (res, data) = load(&tier, &[k]).await;
    assert!(
        data.is_empty() && !res.is_success(),
        "a block without its xattr was served"
    );
    assert_eq!(
        tier.stats().blocks.blocks_read,
        0,
        "something was read whole"
    );
}

/// The CRC covers the key: the same hash in another group (a different key, a different
/// leaf directory) linked or copied with its xattr is not served there; nor is another
/// hash's block copied with its xattr; nor one whose bytes are another key's with that
/// key's xattr (a consistent pair at the wrong path).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_block_at_another_keys_path_fails_there_also_across_groups() {
    let _descriptors = DESCRIPTORS.read().await;
    let root = temp_root();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    let h = *b"0123456789abcdef0123456789abcdef";
    let g0 = BlockKey::from_hash32(h, 0);
    let g1 = BlockKey::from_hash32(h, 1);
    let g7 = BlockKey::from_hash32(h, 7);
    let other = test_key(40_001);
    assert!(store(&tier, &[g0], 0).await.is_success());
    let src = tier.block_path(&g0);
    let xattr = get_xattr(&src).unwrap();
    // hard link into the group-1 path
    let p1 = tier.block_path(&g1);
    assert_ne!(p1, src);
    std::fs::create_dir_all(p1.parent().unwrap()).unwrap();
    std::fs::hard_link(&src, &p1).unwrap();
    // copy (new inode) with the xattr into the group-7 path and another hash's path
    for k in [g7, other] {
        let p = tier.block_path(&k);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::copy(&src, &p).unwrap();
        set_xattr(&p, &xattr).unwrap();
    }
    for (k, what) in [
        (g1, "hard link into group 1"),
        (g7, "copy into group 7"),
        (other, "copy into another hash"),
    ] {
        let (res, data) = load(&tier, &[k]).await;
        assert!(
            data.is_empty(),
            "{what}: group 0's bytes were served as {k}"
        );
        assert!(!res.is_success(), "{what}");
    }
    // the original stands
    let (res, data) = load(&tier, &[g0]).await;
    assert!(
        res.is_success() && verify_block(&g0, 0, &data[0].1),
        "{:?}",
        res.failed
    );
}

/// In sidecar mode (ramfs: no user xattrs), the same: a block hard-linked to another
/// group's path with its sidecar copied beside it, or a flipped byte in block or sidecar,
/// is never served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sidecar_mode_never_serves_linked_or_flipped_blocks() {
    let _descriptors = DESCRIPTORS.read().await;
    let m = common::Mount::new("ramfs", "");
    let tier = FsTier::open("fs", checked_cfg(&m.dir), ns(), BS).unwrap();
    let h = *b"fedcba9876543210fedcba9876543210";
    let g0 = BlockKey::from_hash32(h, 0);
    let g1 = BlockKey::from_hash32(h, 1);
    assert!(store(&tier, &[g0], 0).await.is_success());
    let src = tier.block_path(&g0);
    let side = PathBuf::from(format!(
        "{}{}",
        src.display(),
        kv_tier_fs::CRC_SIDECAR_SUFFIX
    ));
    assert!(side.exists(), "no sidecar on ramfs: {}", side.display());
    let p1 = tier.block_path(&g1);
    std::fs::create_dir_all(p1.parent().unwrap()).unwrap();
    std::fs::hard_link(&src, &p1).unwrap();
    std::fs::copy(
        &side,
        format!("{}{}", p1.display(), kv_tier_fs::CRC_SIDECAR_SUFFIX),
    )
    .unwrap();
    let (res, data) = load(&tier, &[g1]).await;
    assert!(
        data.is_empty() && !res.is_success(),
        "group 0's block served as group 1 through a copied sidecar"
    );
    // flips
    for (i, off) in [0u64, BS as u64 / 2, BS as u64 - 1].into_iter().enumerate() {
        let k = test_key(41_000 + i as u64);
        assert!(store(&tier, &[k], 0).await.is_success());
        flip_byte(&tier.block_path(&k), off);
        let (res, data) = load(&tier, &[k]).await;
        assert!(
            data.is_empty() && !res.is_success(),
            "sidecar mode: flip at {off} served"
        );
    }
    let k = test_key(41_100);
    assert!(store(&tier, &[k], 0).await.is_success());
    let sp = PathBuf::from(format!(
        "{}{}",
        tier.block_path(&k).display(),
        kv_tier_fs::CRC_SIDECAR_SUFFIX
    ));
    let len = std::fs::metadata(&sp).unwrap().len();
    for off in 0..len {
        flip_byte(&sp, off);
        let (res, data) = load(&tier, &[k]).await;
        assert!(
            data.is_empty() && !res.is_success(),
            "sidecar byte {off} flipped: served"
        );
        if !tier.block_path(&k).exists() {
            assert!(store(&tier, &[k], 0).await.is_success());
        } else {
            flip_byte(&sp, off);
        }
        let sp_now = PathBuf::from(format!(
            "{}{}",
            tier.block_path(&k).display(),
            kv_tier_fs::CRC_SIDECAR_SUFFIX
        ));
        if !sp_now.exists() {
            break;
        }
    }
}

// ---------------------------------------------------------------------------------------
// directories removed or replaced under a running tier
// ---------------------------------------------------------------------------------------

/// Between stores, leaf directories, top directories or the whole rank directory are
/// removed (or removed and recreated empty); every store that reports a key stored has its
/// block at the key's path with the right bytes, and every store succeeds (nothing is in the
/// way: only directories went missing).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_after_directories_vanish_land_on_disk_and_load() {
    let _descriptors = DESCRIPTORS.read().await;
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let mut rng = Rng::new(7);
        let mut stored: Vec<BlockKey> = Vec::new();
        let mut next = 0u64;
        for it in 0..80 {
            let action = rng.below(6);
            if let Some(&victim) = stored.get(rng.below(stored.len() as u64) as usize) {
                match action {
                    0 => rm_rf(&leaf_dir(&tier, &victim)),
                    1 => rm_rf(&top_dir(&tier, &victim)),
                    2 => rm_rf(&rank_dir(&tier, &victim)),
                    3 => {
                        rm_rf(&rank_dir(&tier, &victim));
                        let _ = std::fs::create_dir(rank_dir(&tier, &victim));
                    }
                    4 => {
                        rm_rf(&leaf_dir(&tier, &victim));
                        let _ = std::fs::create_dir_all(leaf_dir(&tier, &victim));
                    }
                    _ => {}
                }
            }
            // half the batch in the one shared leaf, half anywhere
            let batch: Vec<BlockKey> = (0..4)
                .map(|j| {
                    next += 1;
                    if j % 2 == 0 {
                        leaf_key(next)
                    } else {
                        test_key(50_000 + next)
                    }
                })
                .collect();
            let res = store(&tier, &batch, 0).await;
            assert_accounts(&res, &batch, "store");
            assert!(
                res.is_success(),
                "publish {publish}, iteration {it} after action {action}: {:?}",
                res.failed
            );
            for k in &res.ok {
                let p = tier.block_path(k);
                assert!(
                    is_regular(&p),
                    "publish {publish}, iteration {it}, action {action}: {k} reported stored, not at {}",
                    p.display()
                );
            }
            let (res, data) = load(&tier, &batch).await;
            assert!(
                res.is_success(),
                "publish {publish}, iteration {it}: {:?}",
                res.failed
            );
            for (k, d) in &data {
                assert!(verify_block(k, 0, d));
            }
            // earlier keys: present ones load right, gone ones are misses
            let (res, data) = load(&tier, &stored).await;
            assert_accounts(&res, &stored, "load of earlier keys");
            for (k, d) in &data {
                assert!(verify_block(k, 0, d));
            }
            for k in &res.ok {
                assert!(
                    is_regular(&tier.block_path(k)),
                    "{k} loaded but not on disk"
                );
            }
            stored.extend(batch);
        }
        assert!(
            tmp_files(root.path()).is_empty(),
            "{:?}",
            tmp_files(root.path())
        );
        tier.shutdown().await.unwrap();
    }
}

/// A leaf directory, a top directory or the rank directory replaced by a regular file, a
/// FIFO or a symlink to a directory outside the root: a store never reports a key stored
/// that cannot be read back from its path; once the obstacle is gone the tier stores and
/// loads again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn directories_replaced_by_files_or_links_never_make_a_store_lie() {
    let _descriptors = DESCRIPTORS.read().await;
    let mut report = Vec::new();
    let mut broken = Vec::new();
    for publish in [true, false] {
        for (level, kind) in [
            ("leaf", "file"),
            ("leaf", "fifo"),
            ("leaf", "symlink"),
            ("top", "file"),
            ("top", "symlink"),
            ("rank", "file"),
            ("rank", "symlink"),
        ] {
            let what = format!("publish {publish}, {level} replaced by a {kind}");
            let root = temp_root();
            let outside = temp_root();
            let mut c = checked_cfg(root.path());
            c.tmpfile_publish = publish;
            let tier = FsTier::open("fs", c, ns(), BS).unwrap();
            let (a, b) = (leaf_key(1), leaf_key(2));
            assert!(store(&tier, &[a], 0).await.is_success());
            let dir = match level {
                "leaf" => leaf_dir(&tier, &a),
                "top" => top_dir(&tier, &a),
                _ => rank_dir(&tier, &a),
            };
            // the tier makes the top directories in the background: remove until gone
            let deadline = Instant::now() + Duration::from_secs(10);
            while let Err(e) = std::fs::remove_dir_all(&dir) {
                assert!(
                    Instant::now() < deadline,
                    "{what}: cannot remove {}: {e}",
                    dir.display()
                );
            }
            match kind {
                "file" => std::fs::write(&dir, b"not a directory").unwrap(),
                "fifo" => mkfifo(&dir),
                _ => std::os::unix::fs::symlink(outside.path(), &dir).unwrap(),
            }
            let res = tokio::time::timeout(Duration::from_secs(15), store(&tier, &[b], 0))
                .await
                .unwrap_or_else(|_| panic!("{what}: the store hung"));
            let store_ok = res.is_success();
            assert_accounts(&res, &[b], &what);
            let pb = tier.block_path(&b);
            if res.is_success() {
                let bytes = std::fs::read(&pb)
                    .unwrap_or_else(|e| panic!("{what}: reported stored, {}: {e}", pb.display()));
                assert!(verify_block(&b, 0, &bytes), "{what}: wrong bytes on disk");
            } else {
                let msg = res.failed[0].1.to_string();
                assert!(
                    msg.contains(&b.hash_hex())
                        || msg.contains(&*dir.to_string_lossy())
                        || msg.contains(&*root.path().to_string_lossy()),
                    "{what}: the error names neither key nor path: {msg}"
                );
            }
            let (res, data) = tokio::time::timeout(Duration::from_secs(15), load(&tier, &[a, b]))
                .await
                .unwrap_or_else(|_| panic!("{what}: the load hung"));
            assert_accounts(&res, &[a, b], &what);
            for (k, d) in &data {
                assert!(verify_block(k, 0, d), "{what}: wrong bytes for {k}");
            }
            assert!(
                !res.ok.contains(&a) || kind == "symlink",
                "{what}: a was served though its directory is gone"
            );
            report.push(format!(
                "{what}: store of b {}, load a {} b {}, outside dir holds {:?}",
                if store_ok { "ok" } else { "failed" },
                res.ok.contains(&a),
                res.ok.contains(&b),
                all_entries(outside.path())
                    .iter()
                    .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
            ));
            // the obstacle goes: the tier works again
            rm_rf(&dir);
            let res = store(&tier, &[a, b], 3).await;
            assert!(
                res.is_success(),
                "{what}: after the obstacle went: {:?}",
                res.failed
            );
            for k in [a, b] {
                assert!(
                    is_regular(&tier.block_path(&k)),
                    "{what}: {k} not on disk after the obstacle went"
                );
            }
            let (res, data) = load(&tier, &[a, b]).await;
            if !res.is_success() {
                broken.push(format!(
                    "{what}: after the obstacle went, a and b stored (both regular files at their paths) but a load \
                     of them says {:?}; the outside directory (the link's old target) holds {:?}",
                    res.failed.iter().map(|(k, e)| format!("{}: {e}", &k.hash_hex()[..8])).collect::<Vec<_>>(),
                    all_entries(outside.path())
                ));
            }
            for (k, d) in &data {
                if !verify_block(k, 3, d) {
                    broken.push(format!(
                        "{what}: after the obstacle went, {} (salt 3 at its path) was served with other bytes \
                         (salt 0: {}), from the link's old target {:?}",
                        &k.hash_hex()[..8],
                        verify_block(k, 0, d),
                        all_entries(outside.path())
                    ));
                }
            }
            tier.shutdown().await.unwrap();
        }
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        broken.is_empty(),
        "{}\nhistory:\n{}",
        broken.join("\n"),
        report.join("\n")
    );
}

/// The rank directory renamed away under a running tier (an operator clearing the cache
/// with `mv cache cache.old`): the tier's later stores land at the keys' paths, not in the
/// directory that moved; a store reported done is at `block_path`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_rank_directory_is_renamed_away_stores_land_at_its_path() {
    let _descriptors = DESCRIPTORS.read().await;
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let k1 = leaf_key(1);
        assert!(store(&tier, &[k1], 0).await.is_success());
        let rank = rank_dir(&tier, &k1);
        let old = root.path().join("moved-away");
        std::fs::rename(&rank, &old).unwrap();
        let fresh: Vec<BlockKey> = vec![leaf_key(2), test_key(60_001), test_key(60_002)];
        let res = store(&tier, &fresh, 0).await;
        assert_accounts(&res, &fresh, "store");
        for k in &res.ok {
            assert!(
                is_regular(&tier.block_path(k)),
                "publish {publish}: {k} reported stored but is not at its path {} (the moved directory has {:?})",
                tier.block_path(k).display(),
                bin_files(&old)
            );
        }
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
    }
}

/// The rank directory renamed away (`mv`, the directory lives on elsewhere) under a running
/// tier that has loaded from it: blocks the tier stores afterwards (reported stored, at their
/// paths) load from the same tier.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_rank_directory_is_renamed_away_blocks_stored_since_load() {
    let _descriptors = DESCRIPTORS.read().await;
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let k1 = test_key(60_101);
        assert!(store(&tier, &[k1], 0).await.is_success());
        assert!(load(&tier, &[k1]).await.0.is_success());
        let rank = rank_dir(&tier, &k1);
        std::fs::rename(&rank, root.path().join("moved-away")).unwrap();
        let fresh: Vec<BlockKey> = (0..4).map(|i| test_key(60_200 + i)).collect();
        let res = store(&tier, &fresh, 0).await;
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
        assert!(fresh.iter().all(|k| is_regular(&tier.block_path(k))));
        let looked = tier.lookup(&fresh).await.unwrap();
        let (res, data) = load(&tier, &fresh).await;
        assert!(
            res.is_success(),
            "publish {publish}: blocks just stored at their paths (lookup {looked:?}) do not load from the same tier: {:?}",
            res.failed
                .iter()
                .map(|(_, e)| e.to_string())
                .collect::<Vec<_>>()
        );
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    }
}

/// The rank directory renamed away and another one put in its place (another instance
/// opened on the root after the move and stored `k` with other bytes): a load of `k` serves
/// what is at `k`'s path now, and a key only in the moved directory is a miss, as `lookup`
/// says. (A questionable expectation if the tier means to keep reading the directory it
/// opened; the README says the descriptor is "reopened if the directory was removed".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_rank_directory_is_replaced_loads_read_the_new_one() {
    let _descriptors = DESCRIPTORS.read().await;
    let root = temp_root();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    let (k, only_old) = (test_key(61_001), test_key(61_002));
    assert!(store(&tier, &[k, only_old], 0).await.is_success());
    let (res, _) = load(&tier, &[k, only_old]).await; // the descriptor is open and used
    assert!(res.is_success());
    let rank = rank_dir(&tier, &k);
    std::fs::rename(&rank, root.path().join("moved-away")).unwrap();
    let other = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    assert!(store(&other, &[k], 7).await.is_success());
    assert!(!exists_nofollow(&tier.block_path(&only_old)));
    let looked = tier.lookup(&[k, only_old]).await.unwrap();
    let (res, data) = load(&tier, &[k, only_old]).await;
    assert_accounts(&res, &[k, only_old], "load");
    let got: HashMap<BlockKey, bytes::Bytes> = data.into_iter().collect();
    let served_old = got.get(&k).map(|d| verify_block(&k, 0, d));
    let only_old_served = res.ok.contains(&only_old);
    let observed = format!(
        "lookup {looked:?}; key only in the moved-away directory served: {only_old_served}; \
         k (salt 0 in the moved-away directory, salt 7 at its path now): {}",
        match served_old {
            Some(true) => "served the MOVED-AWAY directory's bytes (salt 0)",
            Some(false) => "served the bytes at its path (salt 7)",
            None => "a miss",
        }
    );
    assert_eq!(looked, vec![true, false], "{observed}");
    assert!(!only_old_served, "{observed}");
    assert_eq!(served_old, Some(false), "{observed}");
    assert!(verify_block(&k, 7, &got[&k]));
}

/// A root that is a symlink, and a rank directory that is a symlink to a directory
/// elsewhere, work; the rank symlink retargeted under the running tier: later stores land
/// at the keys' paths (in the new target).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn symlinked_root_and_rank_directory() {
    let _descriptors = DESCRIPTORS.read().await;
    // root_dir a symlink
    let real = temp_root();
    let holder = temp_root();
    let link = holder.path().join("root-link");
    std::os::unix::fs::symlink(real.path(), &link).unwrap();
    let tier = FsTier::open("fs", checked_cfg(&link), ns(), BS).unwrap();
    let ks: Vec<BlockKey> = (0..8).map(|i| test_key(62_000 + i)).collect();
    assert!(store(&tier, &ks, 0).await.is_success());
    assert_eq!(bin_files(real.path()).len(), 8);
    let (res, data) = load(&tier, &ks).await;
    assert!(res.is_success() && data.iter().all(|(k, d)| verify_block(k, 0, d)));
    tier.shutdown().await.unwrap();
    drop(tier);

    // the rank directory a symlink
    let root = temp_root();
    let probe = FsTier::open("fs", cfg(root.path()), ns(), BS).unwrap();
    let rank_name = rank_dir(&probe, &ks[0]).file_name().unwrap().to_owned();
    probe.shutdown().await.unwrap();
    drop(probe);
    let root = temp_root();
    let (x, y) = (temp_root(), temp_root());
    let rank = root.path().join(&rank_name);
    std::os::unix::fs::symlink(x.path(), &rank).unwrap();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    assert!(store(&tier, &ks[..4], 0).await.is_success());
    assert_eq!(
        bin_files(x.path()).len(),
        4,
        "blocks not in the link's target"
    );
    let (res, _) = load(&tier, &ks[..4]).await;
    assert!(res.is_success(), "{:?}", res.failed);
    // retarget the link
    std::fs::remove_file(&rank).unwrap();
    std::os::unix::fs::symlink(y.path(), &rank).unwrap();
    let res = store(&tier, &ks[4..], 0).await;
    for k in &res.ok {
        assert!(
            is_regular(&tier.block_path(k)),
            "{k} reported stored but not at its path after the rank link was retargeted (old target has {} blocks)",
            bin_files(x.path()).len()
        );
    }
    assert!(res.is_success(), "{:?}", res.failed);
}

/// The rank directory is a symlink (to a bigger disk, say) and the operator points it at
/// another directory while the tier runs: a block the tier then stores (reported stored, at
/// its path) loads from the same tier. Loads of a key stored before the retarget, which is
/// not at its path any more, are a miss like `lookup` says.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_the_rank_link_is_retargeted_a_block_just_stored_loads() {
    let _descriptors = DESCRIPTORS.read().await;
    let probe_root = temp_root();
    let probe = FsTier::open("fs", cfg(probe_root.path()), ns(), BS).unwrap();
    let k0 = test_key(62_500);
    let rank_name = rank_dir(&probe, &k0).file_name().unwrap().to_owned();
    probe.shutdown().await.unwrap();
    drop(probe);
    let root = temp_root();
    let (x, y) = (temp_root(), temp_root());
    let rank = root.path().join(&rank_name);
    std::os::unix::fs::symlink(x.path(), &rank).unwrap();
    let tier = FsTier::open("fs", checked_cfg(root.path()), ns(), BS).unwrap();
    let (old, new) = (test_key(62_501), test_key(62_502));
    assert!(store(&tier, &[old], 0).await.is_success());
    let (res, _) = load(&tier, &[old]).await; // a load before the link is retargeted
    assert!(res.is_success());
    std::fs::remove_file(&rank).unwrap();
    std::os::unix::fs::symlink(y.path(), &rank).unwrap();
    let res = store(&tier, &[new], 0).await;
    assert!(res.is_success(), "{:?}", res.failed);
    assert!(
        is_regular(&tier.block_path(&new)),
        "stored, not at its path"
    );
    assert!(
        bin_files(y.path()).len() == 1,
        "not in the link's new target"
    );
    let looked = tier.lookup(&[old, new]).await.unwrap();
    let (res, data) = load(&tier, &[old, new]).await;
    assert_eq!(looked, vec![false, true]);
    assert!(
        res.ok.contains(&new),
        "a block just stored (at {}) is not found by a load of the same tier: {:?} (lookup {looked:?}; \
         the old target still holds {:?})",
        tier.block_path(&new).display(),
        res.failed,
        bin_files(x.path())
    );
    assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
    assert!(
        !res.ok.contains(&old),
        "a key not at its path (only in the link's old target) was served; lookup said {looked:?}"
    );
}

// ---------------------------------------------------------------------------------------
// special files at block paths
// ---------------------------------------------------------------------------------------

/// Character devices (/dev/zero's and /dev/null's numbers), a unix socket, a dangling
/// symlink, a symlink loop and a symlink to /dev/zero at block paths: `lookup` says absent,
/// a load is a miss that never hangs and never serves (zeros from /dev/zero!), and the node
/// goes; a store replaces each with the block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn devices_sockets_and_odd_links_at_block_paths_are_damage() {
    let _descriptors = DESCRIPTORS.read().await;
    for checksum in [Checksum::None, Checksum::Crc32c] {
        for load_first in [true, false] {
            let root = temp_root();
            let mut c = cfg(root.path());
            c.checksum = checksum;
            let tier = FsTier::open("fs", c, ns(), BS).unwrap();
            let kinds = [
                "zero",
                "null",
                "socket",
                "dangling",
                "loop",
                "link-zero",
                "link-dir",
            ];
            let keys: Vec<BlockKey> = (0..kinds.len() as u64)
                .map(|i| test_key(63_000 + i))
                .collect();
            let mut _sockets = Vec::new();
            for (k, kind) in keys.iter().zip(kinds) {
                let p = tier.block_path(k);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                match kind {
                    "zero" => mknod(&p, libc::S_IFCHR | 0o666, libc::makedev(1, 5)),
                    "null" => mknod(&p, libc::S_IFCHR | 0o666, libc::makedev(1, 3)),
                    "socket" => {
                        let short = PathBuf::from(format!(
                            "/tmp/kvs-{}-{}",
                            std::process::id(),
                            k.hash_hex().get(..8).unwrap()
                        ));
                        let _ = std::fs::remove_file(&short);
                        _sockets.push(std::os::unix::net::UnixListener::bind(&short).unwrap());
                        std::fs::rename(&short, &p).unwrap();
                    }
                    "dangling" => std::os::unix::fs::symlink("/nonexistent/x.bin", &p).unwrap(),
                    "loop" => std::os::unix::fs::symlink(&p, &p).unwrap(),
                    "link-zero" => std::os::unix::fs::symlink("/dev/zero", &p).unwrap(),
                    _ => std::os::unix::fs::symlink(root.path(), &p).unwrap(),
                }
            }
            let what = format!("checksum {checksum:?}, load first {load_first}");
            let found = tier.lookup(&keys).await.unwrap();
            assert!(
                found.iter().all(|f| !f),
                "{what}: lookup counted a non-file: {found:?}"
            );
            if load_first {
                tier.take_events();
                let (res, data) = tokio::time::timeout(Duration::from_secs(15), load(&tier, &keys))
                    .await
                    .unwrap_or_else(|_| panic!("{what}: a load hung"));
                assert_accounts(&res, &keys, &what);
                assert!(
                    data.is_empty(),
                    "{what}: served {:?}",
                    data.iter().map(|d| d.0).collect::<Vec<_>>()
                );
                for (k, kind) in keys.iter().zip(kinds) {
                    assert!(
                        !exists_nofollow(&tier.block_path(k)),
                        "{what}: the {kind} at a block path was kept by a load"
                    );
                }
                let mut rm = removed(&tier);
                rm.sort();
                let mut want = keys.clone();
                want.sort();
                assert_eq!(rm, want, "{what}: BlockRemoved events");
            }
            let res = tokio::time::timeout(Duration::from_secs(15), store(&tier, &keys, 2))
                .await
                .unwrap_or_else(|_| panic!("{what}: a store hung"));
            assert!(res.is_success(), "{what}: {:?}", res.failed);
            for (k, kind) in keys.iter().zip(kinds) {
                assert!(
                    is_regular(&tier.block_path(k)),
                    "{what}: the {kind} was not replaced by the block"
                );
            }
            let (res, data) = load(&tier, &keys).await;
            assert!(res.is_success(), "{what}: {:?}", res.failed);
            assert!(data.iter().all(|(k, d)| verify_block(k, 2, d)));
            assert!(std::path::Path::new("/dev/zero").exists() && root.path().is_dir());
        }
    }
}

// ---------------------------------------------------------------------------------------
// loads racing mutation
// ---------------------------------------------------------------------------------------

/// A copy of a stored block (bytes and checksum xattr), to put back over damage.
struct Good {
    bytes: Vec<u8>,
    xattr: Option<Vec<u8>>,
}

/// With checksums, loads and stores run while another thread truncates, extends, rewrites
/// in place, unlinks, and renames good, flipped and foreign-xattr copies over the block
/// files: every load that reports a key loaded returns exactly the stored bytes, every job
/// accounts for its keys, and once the mutation stops every key loads again after a store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loads_racing_truncation_extension_and_rename_over_serve_exact_bytes_or_miss() {
    let _descriptors = DESCRIPTORS.read().await;
    for checksum in [Checksum::Crc32c, Checksum::None] {
        let root = temp_root();
        let mut c = cfg(root.path());
        c.checksum = checksum;
        let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
        let keys: Vec<BlockKey> = (0..8).map(|i| test_key(64_000 + i)).collect();
        assert!(store(&tier, &keys, 0).await.is_success());
        let goods: Vec<Good> = keys
            .iter()
            .map(|k| Good {
                bytes: std::fs::read(tier.block_path(k)).unwrap(),
                xattr: get_xattr(&tier.block_path(k)),
            })
            .collect();
        let paths: Vec<PathBuf> = keys.iter().map(|k| tier.block_path(k)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let ops = Arc::new(AtomicU64::new(0));
        let checked = checksum == Checksum::Crc32c;
        let mutator = {
            let (stop, ops, paths) = (stop.clone(), ops.clone(), paths.clone());
            std::thread::spawn(move || {
                use std::os::unix::fs::FileExt;
                let mut rng = Rng::new(11);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let i = rng.below(paths.len() as u64) as usize;
                    let p = &paths[i];
                    let g = &goods[i];
                    let put = |bytes: &[u8], x: Option<&Vec<u8>>, n: u64| {
                        let t = p.with_file_name(format!("mut-{n}.cpy"));
                        if std::fs::write(&t, bytes).is_err() {
                            return;
                        }
                        if let Some(x) = x {
                            let _ = set_xattr(&t, x);
                        }
                        if std::fs::rename(&t, p).is_err() {
                            let _ = std::fs::remove_file(&t);
                        }
                    };
                    n += 1;
                    // without checksums only mutations a size check can see (the first
                    // BS bytes never change)
                    let op = if checked {
                        rng.below(8)
                    } else {
                        [1, 2, 5, 6][rng.below(4) as usize]
                    };
                    match op {
                        0 => {
                            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(p) {
                                let _ = f.set_len(rng.below(2 * BS as u64));
                            }
                        }
                        1 => {
                            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(p) {
                                let _ = f.set_len(BS as u64 + 1 + rng.below(8192));
                            }
                        }
                        2 => {
                            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(p) {
                                let _ = f.set_len(BS as u64);
                            }
                        }
                        3 => {
                            let mut b = g.bytes.clone();
                            let off = rng.below(BS as u64) as usize;
                            b[off] ^= 0x10;
                            put(&b, g.xattr.as_ref(), n);
                        }
                        4 => {
                            if let Ok(f) = std::fs::OpenOptions::new().write(true).open(p) {
                                let off = rng.below(BS as u64);
                                let _ = f.write_all_at(&[rng.next() as u8], off);
                            }
                        }
                        5 => {
                            let _ = std::fs::remove_file(p);
                        }
                        6 => put(&g.bytes, g.xattr.as_ref(), n),
                        _ => {
                            // good bytes, another key's checksum
                            let j = (i + 1) % goods.len();
                            put(&g.bytes, goods[j].xattr.as_ref(), n);
                        }
                    }
                    ops.fetch_add(1, Ordering::Relaxed);
                    if n.is_multiple_of(4) {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                }
            })
        };
        let wrong = Arc::new(AtomicU64::new(0));
        let served = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        let until = Instant::now() + Duration::from_secs(3);
        for t in 0..3 {
            let (tier, keys, wrong, served) =
                (tier.clone(), keys.clone(), wrong.clone(), served.clone());
            tasks.push(tokio::spawn(async move {
                while Instant::now() < until {
                    let (res, data) = load(&tier, &keys).await;
                    assert_accounts(&res, &keys, "load");
                    for (k, d) in &data {
                        served.fetch_add(1, Ordering::Relaxed);
                        if !verify_block(k, 0, d) {
                            wrong.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    if t == 0 {
                        let res = store(&tier, &keys, 0).await;
                        assert_accounts(&res, &keys, "store");
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        mutator.join().unwrap();
        eprintln!(
            "checksum {checksum:?}: {} mutations, {} blocks served, stats {:?}",
            ops.load(Ordering::Relaxed),
            served.load(Ordering::Relaxed),
            tier.stats().blocks
        );
        assert_eq!(
            wrong.load(Ordering::Relaxed),
            0,
            "checksum {checksum:?}: wrong bytes were served"
        );
        assert!(
            served.load(Ordering::Relaxed) > 0,
            "nothing was ever served: the test tested nothing"
        );
        // damage left behind: a load removes it, a store rewrites, a load serves
        for f in all_entries(root.path()) {
            if f.to_string_lossy().ends_with(".cpy") {
                std::fs::remove_file(f).unwrap();
            }
        }
        let _ = load(&tier, &keys).await;
        // without checksums a file of the right size with the right bytes stands
        let res = store(&tier, &keys, 0).await;
        assert!(res.is_success(), "{:?}", res.failed);
        let (res, data) = load(&tier, &keys).await;
        assert!(
            res.is_success(),
            "checksum {checksum:?}: after the mutation: {:?}",
            res.failed
        );
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        assert!(tmp_files(root.path()).is_empty());
    }
}

// ---------------------------------------------------------------------------------------
// many writers, external deletes
// ---------------------------------------------------------------------------------------

/// Twelve tasks over two instances on one root store the same 48 keys at once, each with
/// its own bytes (salt), in its own order: every job succeeds for every key, exactly 48
/// blocks are written in all (the rest skipped), no damage is found, both instances serve
/// the same bytes for each key, whole (one writer's), and no temp file remains. With
/// unnamed and named temp files, with xattrs (ext4) and sidecars (ramfs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_writers_of_the_same_keys_through_two_instances_write_each_once() {
    let _descriptors = DESCRIPTORS.read().await;
    for (fs, publish) in [
        ("ext4", true),
        ("ext4", false),
        ("ramfs", true),
        ("ramfs", false),
    ] {
        let what = format!("{fs}, tmpfile_publish {publish}");
        let tmp;
        let mnt;
        let root: PathBuf = if fs == "ramfs" {
            mnt = common::Mount::new("ramfs", "");
            mnt.dir.clone()
        } else {
            tmp = temp_root();
            tmp.path().to_path_buf()
        };
        let mk = || {
            let mut c = checked_cfg(&root);
            c.tmpfile_publish = publish;
            Arc::new(FsTier::open("fs", c, ns(), BS).unwrap())
        };
        let (a, b) = (mk(), mk());
        let keys: Vec<BlockKey> = (0..48)
            .map(|i| {
                if i % 3 == 0 {
                    leaf_key(i)
                } else {
                    test_key(65_000 + i)
                }
            })
            .collect();
        let writers = 12u64;
        let mut tasks = Vec::new();
        for w in 0..writers {
            let tier = if w % 2 == 0 { a.clone() } else { b.clone() };
            let mut ks = keys.clone();
            Rng::new(w + 100).shuffle(&mut ks);
            tasks.push(tokio::spawn(async move {
                let mut failed = Vec::new();
                for chunk in ks.chunks(6) {
                    let res = store(&tier, chunk, w + 1).await;
                    assert_accounts(&res, chunk, "store");
                    failed.extend(res.failed.into_iter().map(|(k, e)| format!("{k}: {e}")));
                }
                failed
            }));
        }
        let mut failed = Vec::new();
        for t in tasks {
            failed.extend(t.await.unwrap());
        }
        assert!(failed.is_empty(), "{what}: stores failed: {failed:?}");
        let (sa, sb) = (a.stats().blocks, b.stats().blocks);
        assert_eq!(
            sa.corrupt_deleted + sb.corrupt_deleted,
            0,
            "{what}: damage found among concurrent writers: {sa:?} {sb:?}"
        );
        assert_eq!(
            sa.blocks_written + sb.blocks_written,
            48,
            "{what}: blocks written: {sa:?} {sb:?}"
        );
        assert_eq!(
            sa.stores_skipped + sb.stores_skipped,
            writers * 48 - 48,
            "{what}: skips"
        );
        assert_eq!(bin_files(&root).len(), 48, "{what}");
        assert!(
            tmp_files(&root).is_empty(),
            "{what}: {:?}",
            tmp_files(&root)
        );
        let (ra, da) = load(&a, &keys).await;
        let (rb, db) = load(&b, &keys).await;
        assert!(
            ra.is_success() && rb.is_success(),
            "{what}: {:?} {:?}",
            ra.failed,
            rb.failed
        );
        for ((k, x), (_, y)) in da.iter().zip(db.iter()) {
            assert_eq!(x, y, "{what}: the instances serve different bytes for {k}");
            assert!(
                (1..=writers).any(|s| verify_block(k, s, x)),
                "{what}: {k}'s bytes are no writer's whole block"
            );
        }
        if fs == "ramfs" {
            let sidecars = find_files(&root, kv_tier_fs::CRC_SIDECAR_SUFFIX).len();
            assert_eq!(sidecars, 48, "{what}: sidecars");
        }
        a.shutdown().await.unwrap();
        b.shutdown().await.unwrap();
    }
}

/// Stores, loads and lookups run while another thread deletes block files, leaf and top
/// directories and (rarely) the whole rank directory: loads never serve wrong bytes, no
/// damage is ever found (an external delete is not damage), every job accounts for its
/// keys; once the deletes stop, one store puts every key on disk and every key loads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stores_loads_and_external_deletes_never_serve_wrong_bytes() {
    let _descriptors = DESCRIPTORS.read().await;
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = Arc::new(FsTier::open("fs", c, ns(), BS).unwrap());
        let keys: Vec<BlockKey> = (0..64)
            .map(|i| {
                if i % 2 == 0 {
                    leaf_key(i)
                } else {
                    test_key(66_000 + i)
                }
            })
            .collect();
        let paths: Vec<PathBuf> = keys.iter().map(|k| tier.block_path(k)).collect();
        let stop = Arc::new(AtomicBool::new(false));
        let deleter = {
            let (stop, paths) = (stop.clone(), paths.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(5);
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let p = &paths[rng.below(paths.len() as u64) as usize];
                    match rng.below(100) {
                        0..=69 => {
                            let _ = std::fs::remove_file(p);
                        }
                        70..=89 => rm_rf(p.parent().unwrap()),
                        90..=97 => rm_rf(p.parent().unwrap().parent().unwrap()),
                        _ => rm_rf(p.parent().unwrap().parent().unwrap().parent().unwrap()),
                    }
                    n += 1;
                    std::thread::sleep(Duration::from_micros(300));
                }
                n
            })
        };
        let wrong = Arc::new(AtomicU64::new(0));
        let served = Arc::new(AtomicU64::new(0));
        let until = Instant::now() + Duration::from_secs(3);
        let fails = Arc::new(AtomicU64::new(0));
        let mut tasks = Vec::new();
        for t in 0..6u64 {
            let (tier, keys, wrong, served) =
                (tier.clone(), keys.clone(), wrong.clone(), served.clone());
            let fails = fails.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = Rng::new(t + 1);
                while Instant::now() < until {
                    let mut ks = keys.clone();
                    rng.shuffle(&mut ks);
                    ks.truncate(8);
                    match t % 3 {
                        0 => {
                            let res = store(&tier, &ks, 0).await;
                            assert_accounts(&res, &ks, "store");
                            for (_, e) in &res.failed {
                                if fails.fetch_add(1, Ordering::Relaxed) < 3 {
                                    eprintln!("store failure under external deletes: {e}");
                                }
                            }
                        }
                        1 => {
                            let (res, data) = load(&tier, &ks).await;
                            assert_accounts(&res, &ks, "load");
                            for (k, d) in &data {
                                served.fetch_add(1, Ordering::Relaxed);
                                if !verify_block(k, 0, d) {
                                    wrong.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        }
                        _ => {
                            let r = tier.lookup(&ks).await.unwrap();
                            assert_eq!(r.len(), ks.len());
                        }
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        stop.store(true, Ordering::Relaxed);
        let deletes = deleter.join().unwrap();
        let s = tier.stats().blocks;
        eprintln!(
            "publish {publish}: {deletes} deletes, {} served, {s:?}",
            served.load(Ordering::Relaxed)
        );
        assert_eq!(
            wrong.load(Ordering::Relaxed),
            0,
            "publish {publish}: wrong bytes served"
        );
        assert!(served.load(Ordering::Relaxed) > 0, "nothing served");
        assert_eq!(
            (
                s.corrupt_deleted,
                s.checksum_mismatches,
                s.unverified_refused
            ),
            (0, 0, 0),
            "publish {publish}: external deletes were taken for damage: {s:?}"
        );
        let res = store(&tier, &keys, 0).await;
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
        for k in &keys {
            assert!(
                is_regular(&tier.block_path(k)),
                "publish {publish}: {k} reported stored, not on disk"
            );
        }
        let (res, data) = load(&tier, &keys).await;
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        assert!(
            tmp_files(root.path()).is_empty(),
            "{:?}",
            tmp_files(root.path())
        );
    }
}

// ---------------------------------------------------------------------------------------
// cancellation
// ---------------------------------------------------------------------------------------

/// Store and load futures dropped at random points (timeouts of 0 to 400 us, and a
/// `select!` against a yield): once the I/O has ended, the files on disk are exactly the
/// blocks written (no temp files, no file counted twice or not at all), no key is left
/// protected, every key stores and loads again, and nothing is found damaged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_stores_and_loads_leave_nothing_behind_and_wedge_nothing() {
    let _descriptors = DESCRIPTORS.read().await;
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let keys: Vec<BlockKey> = (0..32)
            .map(|i| {
                if i % 2 == 0 {
                    leaf_key(100 + i)
                } else {
                    test_key(67_000 + i)
                }
            })
            .collect();
        let mut rng = Rng::new(if publish { 3 } else { 4 });
        let mut completed_wrong = 0;
        for it in 0..400 {
            let mut ks = keys.clone();
            rng.shuffle(&mut ks);
            ks.truncate(1 + rng.below(6) as usize);
            let d = Duration::from_micros(rng.below(400));
            match it % 4 {
                0 | 1 => {
                    let _ = tokio::time::timeout(d, store(&tier, &ks, 0)).await;
                }
                2 => {
                    if let Ok((_, data)) = tokio::time::timeout(d, load(&tier, &ks)).await {
                        completed_wrong +=
                            data.iter().filter(|(k, d)| !verify_block(k, 0, d)).count();
                    }
                }
                _ => {
                    tokio::select! {
                        _ = store(&tier, &ks, 0) => {}
                        _ = tokio::task::yield_now() => {}
                    }
                }
            }
        }
        assert_eq!(completed_wrong, 0);
        quiesce(&tier, &keys).await;
        let s = tier.stats().blocks;
        let bins = bin_files(root.path());
        assert!(
            tmp_files(root.path()).is_empty(),
            "publish {publish}: temp files after dropped stores: {:?}",
            tmp_files(root.path())
        );
        assert_eq!(s.corrupt_deleted, 0, "publish {publish}: {s:?}");
        assert_eq!(
            bins.len() as u64,
            s.blocks_written,
            "publish {publish}: files on disk vs blocks_written: {s:?}"
        );
        for k in &keys {
            assert!(
                !tier.is_protected(k),
                "publish {publish}: {k} still protected"
            );
        }
        let res = tokio::time::timeout(Duration::from_secs(15), store(&tier, &keys, 0))
            .await
            .expect("a store after the drops hung: a wedged key");
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
        let (res, data) = tokio::time::timeout(Duration::from_secs(15), load(&tier, &keys))
            .await
            .expect("a load after the drops hung");
        assert!(res.is_success(), "publish {publish}: {:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        let s = tier.stats().blocks;
        assert_eq!(
            bin_files(root.path()).len() as u64,
            s.blocks_written,
            "{s:?}"
        );
        tier.shutdown().await.unwrap();
        assert!(tmp_files(root.path()).is_empty());
        let leftovers: Vec<PathBuf> = all_entries(root.path())
            .into_iter()
            .filter(|p| {
                let s = p.to_string_lossy();
                !s.ends_with(".bin") && !s.ends_with("config.json")
            })
            .collect();
        assert!(leftovers.is_empty(), "publish {publish}: {leftovers:?}");
    }
}

// ---------------------------------------------------------------------------------------
// ENOSPC, EMFILE
// ---------------------------------------------------------------------------------------

fn statvfs_used(p: &Path) -> u64 {
    let c = cpath(p);
    // SAFETY: zeroed statvfs is valid; a valid path.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statvfs to fill.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut s) }, 0);
    (s.f_blocks - s.f_bfree) * s.f_frsize
}

/// On an 8 MiB tmpfs, blocks of 1.5 MiB stored until the disk is full: every key reported
/// stored is whole on disk and loads; every failed key fails with `NoSpace`, has nothing at
/// its path and loads as a plain miss; no temp file remains and no space is held by
/// unnamed files; once space is freed, the failed keys store and load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enospc_fails_cleanly_and_the_tier_works_again_once_space_is_freed() {
    let _descriptors = DESCRIPTORS.read().await;
    const B: usize = 3 << 19; // 1.5 MiB
    for publish in [true, false] {
        let m = common::Mount::new("tmpfs", "size=8m");
        let mut c = checked_cfg(&m.dir);
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), B).unwrap();
        let what = format!("tmpfile_publish {publish}");
        let keys: Vec<BlockKey> = (0..8).map(|i| test_key(68_000 + i)).collect();
        let mut ok = Vec::new();
        let mut failed = Vec::new();
        for chunk in keys.chunks(4) {
            let res = store_bs(&tier, chunk, 0, B).await;
            assert_accounts(&res, chunk, &what);
            ok.extend(res.ok.iter().copied());
            failed.extend(res.failed);
        }
        eprintln!(
            "{what}: {} stored, {} failed: {:?}",
            ok.len(),
            failed.len(),
            failed.iter().map(|f| f.1.to_string()).collect::<Vec<_>>()
        );
        assert!(!failed.is_empty(), "{what}: the disk never filled");
        for (k, e) in &failed {
            assert!(
                matches!(e, Error::NoSpace { .. }),
                "{what}: {k} failed with {e:?}, not NoSpace"
            );
            assert!(
                !exists_nofollow(&tier.block_path(k)),
                "{what}: a failed store left a file at {}",
                tier.block_path(k).display()
            );
        }
        for k in &ok {
            let md = std::fs::metadata(tier.block_path(k)).unwrap();
            assert_eq!(md.len(), B as u64, "{what}");
        }
        assert!(
            tmp_files(&m.dir).is_empty(),
            "{what}: {:?}",
            tmp_files(&m.dir)
        );
        let used = statvfs_used(&m.dir);
        assert!(
            used <= ok.len() as u64 * B as u64 + (256 << 10),
            "{what}: {used} bytes used for {} blocks: space held by something else: {:?}",
            ok.len(),
            all_entries(&m.dir)
        );
        let (res, data) = load_bs(&tier, &keys, B).await;
        assert_accounts(&res, &keys, &what);
        let served: HashSet<BlockKey> = data.iter().map(|d| d.0).collect();
        assert_eq!(
            served,
            ok.iter().copied().collect(),
            "{what}: loads after ENOSPC"
        );
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        for (k, e) in &res.failed {
            assert!(matches!(e, Error::NotFound { .. }), "{what}: {k}: {e:?}");
        }
        assert_eq!(tier.stats().blocks.corrupt_deleted, 0);
        assert!(
            tier.stats().no_space >= failed.len() as u64,
            "{what}: no_space {:?}",
            tier.stats()
        );
        // free the space
        for k in &ok {
            std::fs::remove_file(tier.block_path(k)).unwrap();
        }
        for (k, _) in failed.iter().take(4) {
            let res = store_bs(&tier, &[*k], 0, B).await;
            assert!(
                res.is_success(),
                "{what}: after space was freed: {:?}",
                res.failed
            );
            let (res, data) = load_bs(&tier, &[*k], B).await;
            assert!(res.is_success() && verify_block(k, 0, &data[0].1), "{what}");
        }
        tier.shutdown().await.unwrap();
    }
}

/// A disk that fills up while the checksum xattr is set, or while a directory is made:
/// an 8 MiB tmpfs filled to the last page by a file of ours, then stores of small blocks
/// fail cleanly (nothing at the path, no temp files), and work once the filler goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_full_to_the_last_page_fails_small_stores_cleanly() {
    let _descriptors = DESCRIPTORS.read().await;
    for publish in [true, false] {
        let m = common::Mount::new("tmpfs", "size=8m");
        let mut c = checked_cfg(&m.dir);
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let what = format!("tmpfile_publish {publish}");
        let warm = test_key(69_000);
        assert!(store(&tier, &[warm], 0).await.is_success());
        // fill
        let filler = m.dir.join("filler");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&filler).unwrap();
            let chunk = vec![1u8; 64 << 10];
            while f.write_all(&chunk).is_ok() {}
            let one = [1u8; 4096];
            while f.write_all(&one).is_ok() {}
        }
        let keys: Vec<BlockKey> = (1..9).map(|i| test_key(69_000 + i)).collect();
        let res = store(&tier, &keys, 0).await;
        assert_accounts(&res, &keys, &what);
        for k in &res.ok {
            let bytes = std::fs::read(tier.block_path(k)).unwrap();
            assert!(verify_block(k, 0, &bytes), "{what}");
        }
        for (k, e) in &res.failed {
            assert!(
                !exists_nofollow(&tier.block_path(k)),
                "{what}: {e}: a file is left at the path"
            );
        }
        assert!(
            !res.failed.is_empty(),
            "{what}: the full disk took every block"
        );
        assert!(
            tmp_files(&m.dir).is_empty(),
            "{what}: {:?}",
            tmp_files(&m.dir)
        );
        let (res2, data) = load(&tier, &keys).await;
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)), "{what}");
        assert_eq!(res2.ok.len(), res.ok.len(), "{what}: loads vs stores");
        std::fs::remove_file(&filler).unwrap();
        let res = store(&tier, &keys, 0).await;
        assert!(res.is_success(), "{what}: {:?}", res.failed);
        let (res, data) = load(&tier, &keys).await;
        assert!(
            res.is_success() && data.iter().all(|(k, d)| verify_block(k, 0, d)),
            "{what}: {:?}",
            res.failed
        );
        tier.shutdown().await.unwrap();
    }
}

/// Out of file descriptors (EMFILE, the soft limit lowered and the rest taken): loads fail
/// but keep the files (transient, no BlockRemoved), stores fail leaving nothing at the path
/// and no temp file; nothing hangs or panics; with descriptors back, everything works.
/// Changes the whole process's limit: the test restores it before it asserts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn emfile_is_transient_keeps_files_and_leaves_nothing_behind() {
    let _descriptors = DESCRIPTORS.write().await;
    for publish in [true, false] {
        let what = format!("tmpfile_publish {publish}");
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let old: Vec<BlockKey> = (0..6).map(|i| leaf_key(200 + i)).collect();
        let new: Vec<BlockKey> = (0..6)
            .map(|i| {
                if i % 2 == 0 {
                    leaf_key(300 + i)
                } else {
                    test_key(70_000 + i)
                }
            })
            .collect();
        assert!(store(&tier, &old, 0).await.is_success());
        let (res, _) = load(&tier, &old).await;
        assert!(res.is_success());
        tier.take_events();
        let removed_before = tier.stats().blocks.corrupt_deleted;

        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: valid pointer.
        assert_eq!(unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) }, 0);
        let open_now = std::fs::read_dir("/proc/self/fd").unwrap().count() as u64;
        let low = libc::rlimit {
            rlim_cur: open_now + 32,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: valid pointer.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &low) }, 0);
        let mut hogs = Vec::new();
        while let Ok(f) = std::fs::File::open("/dev/null") {
            hogs.push(f);
            if hogs.len() > 100_000 {
                break;
            }
        }
        let (lres, ldata) = tokio::time::timeout(Duration::from_secs(15), load(&tier, &old))
            .await
            .expect("load hung on EMFILE");
        let sres = tokio::time::timeout(Duration::from_secs(15), store(&tier, &new, 0))
            .await
            .expect("store hung on EMFILE");
        let look = tokio::time::timeout(Duration::from_secs(15), tier.lookup(&old))
            .await
            .expect("lookup hung");
        drop(hogs);
        // SAFETY: valid pointer.
        assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) }, 0);

        eprintln!(
            "{what}: under EMFILE load ok {} failed {:?}; store ok {} failed {:?}; lookup {:?}",
            lres.ok.len(),
            lres.failed.first().map(|f| f.1.to_string()),
            sres.ok.len(),
            sres.failed.first().map(|f| f.1.to_string()),
            look.as_ref().map_err(|e| e.to_string())
        );
        assert_accounts(&lres, &old, &what);
        assert_accounts(&sres, &new, &what);
        assert!(ldata.iter().all(|(k, d)| verify_block(k, 0, d)), "{what}");
        assert!(
            !lres.failed.is_empty(),
            "{what}: every load succeeded without descriptors?"
        );
        for k in &old {
            assert!(
                is_regular(&tier.block_path(k)),
                "{what}: EMFILE removed {k}'s file"
            );
        }
        assert!(
            removed(&tier).is_empty(),
            "{what}: BlockRemoved for a transient error"
        );
        assert_eq!(
            tier.stats().blocks.corrupt_deleted,
            removed_before,
            "{what}"
        );
        for (k, e) in &sres.failed {
            assert!(
                !exists_nofollow(&tier.block_path(k)),
                "{what}: a failed store left {}",
                tier.block_path(k).display()
            );
            assert!(!matches!(e, Error::Corrupt { .. }), "{what}: {e}");
        }
        for k in &sres.ok {
            assert!(
                is_regular(&tier.block_path(k)),
                "{what}: {k} reported stored, not on disk"
            );
        }
        assert!(
            tmp_files(root.path()).is_empty(),
            "{what}: {:?}",
            tmp_files(root.path())
        );
        // descriptors back
        let (res, data) = load(&tier, &old).await;
        assert!(res.is_success(), "{what}: after EMFILE: {:?}", res.failed);
        assert!(data.iter().all(|(k, d)| verify_block(k, 0, d)));
        let res = store(&tier, &new, 0).await;
        assert!(res.is_success(), "{what}: after EMFILE: {:?}", res.failed);
        let (res, _) = load(&tier, &new).await;
        assert!(res.is_success(), "{what}: {:?}", res.failed);
        tier.shutdown().await.unwrap();
    }
}

// ---------------------------------------------------------------------------------------
// errors
// ---------------------------------------------------------------------------------------

/// Every error a store or a load reports names the key or the path it concerns: faults
/// injected at each operation (EIO, EACCES, EMFILE), a short file, a missing block.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_name_the_key_or_the_path() {
    let _descriptors = DESCRIPTORS.read().await;
    for publish in [true, false] {
        let root = temp_root();
        let mut c = checked_cfg(root.path());
        c.tmpfile_publish = publish;
        let tier = FsTier::open("fs", c, ns(), BS).unwrap();
        let stored = test_key(71_000);
        assert!(store(&tier, &[stored], 0).await.is_success());
        let names = |e: &Error, k: &BlockKey| {
            let m = e.to_string();
            let bp = tier.block_path(k);
            m.contains(&k.hash_hex())
                || m.contains(&*bp.to_string_lossy())
                || m.contains(&*bp.parent().unwrap().to_string_lossy())
        };
        let mut n = 1u64;
        for op in [
            FsOp::CreateTmp,
            FsOp::Write,
            FsOp::Publish,
            FsOp::OpenRead,
            FsOp::Read,
        ] {
            for errno in [libc::EIO, libc::EACCES, libc::EMFILE] {
                n += 1;
                let what = format!("publish {publish}, {op:?} fails with errno {errno}");
                tier.set_fault_injector(Some(Arc::new(move |o, _p: &Path| {
                    (o == op).then(|| std::io::Error::from_raw_os_error(errno))
                })));
                let k = test_key(71_000 + n);
                let res = store(&tier, &[k], 0).await;
                let (lres, data) = load(&tier, &[stored]).await;
                tier.set_fault_injector(None);
                for (fk, e) in res.failed.iter().chain(lres.failed.iter()) {
                    assert!(
                        names(e, fk),
                        "{what}: `{e}` names neither {fk} nor its path"
                    );
                }
                let store_op = matches!(op, FsOp::CreateTmp | FsOp::Write | FsOp::Publish);
                assert_eq!(
                    res.failed.len(),
                    usize::from(store_op),
                    "{what}: store {:?}",
                    res.failed
                );
                assert_eq!(
                    lres.failed.len(),
                    usize::from(!store_op),
                    "{what}: load {:?}",
                    lres.failed
                );
                if store_op {
                    assert!(
                        !exists_nofollow(&tier.block_path(&k)),
                        "{what}: the failed store left a file"
                    );
                } else {
                    assert!(data.is_empty());
                    assert!(
                        is_regular(&tier.block_path(&stored)),
                        "{what}: a transient error removed the block"
                    );
                }
                assert!(
                    tmp_files(root.path()).is_empty(),
                    "{what}: {:?}",
                    tmp_files(root.path())
                );
            }
        }
        // a short file, a missing block
        let short = test_key(71_900);
        let p = tier.block_path(&short);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, [0u8; 10]).unwrap();
        let missing = test_key(71_901);
        let (res, _) = load(&tier, &[short, missing]).await;
        assert_eq!(res.failed.len(), 2);
        for (k, e) in &res.failed {
            assert!(names(e, k), "`{e}` names neither {k} nor its path");
        }
        tier.shutdown().await.unwrap();
    }
}
