//! The conformance suite against the fs tier: plain, with checksums, and bounded (GC on). Each
//! fixture reopens on its root, builds from a config JSON by type name, and (with checksums)
//! damages blocks on disk.

mod common;

use std::ffi::CString;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::BlockKey;
use kv_tier_fs::{CRC_XATTR, Checksum, FsTier, FsTierConfig};
use kv_tier_testkit::{Bound, Damage, TierFixture, temp_root};

/// The cap of the bounded fixture, in blocks. Directories count against the cap: a few hundred
/// random keys rarely share a directory, so each block holds its file and two directories.
const CAP_BLOCKS: usize = 128;
const HELD_PER_BLOCK: usize = common::BS + 2 * 4096;

fn bounded_cfg(root: &Path) -> FsTierConfig {
    let mut c = common::cfg(root);
    c.gc_max_size_gb = Some((CAP_BLOCKS * HELD_PER_BLOCK) as f64 / (1u64 << 30) as f64);
    c.gc_grace_s = Some(30.0);
    c.gc_stamp_interval_s = Some(10.0);
    c
}

fn layout() -> serde_json::Value {
    serde_json::json!({"model_name": "test-org/test-model", "dtype": "torch.float16", "tokens_per_hash": 16})
}

/// A fixture on `root` with `cfg`: reopens with the same config, registers as `"fs"`.
fn fixture(root: PathBuf, cfg: FsTierConfig) -> TierFixture {
    let tier = Arc::new(FsTier::open("fs", cfg.clone(), common::ns(), common::BS).unwrap());
    assert!(
        tier.stats().direct_io,
        "O_DIRECT is expected to work on the test filesystem"
    );
    assert_eq!(
        tier.stats().tmpfile_publish,
        cfg.tmpfile_publish,
        "O_TMPFILE publishing is expected to work on the test filesystem"
    );
    let mut entry = serde_json::json!({"type": "fs", "root_dir": root.join("from-config")});
    if !cfg.tmpfile_publish {
        entry["tmpfile_publish"] = false.into();
    }
    if cfg.checksum == Checksum::Crc32c {
        entry["checksum"] = "crc32c".into();
    }
    if let Some(gb) = cfg.gc_max_size_gb {
        entry["gc_max_size_gb"] = gb.into();
    }
    let mut fx = TierFixture::new(tier.clone(), common::BS).registered(
        FsTier::register,
        serde_json::json!({"layout": layout(), "secondary_tiers": [entry]}),
    );
    if cfg.gc_max_size_gb.is_some() {
        let (t1, t2, t3) = (tier.clone(), tier.clone(), tier.clone());
        let grace = Duration::from_secs_f64(
            cfg.gc_grace_s.unwrap() + cfg.gc_stamp_interval_s.unwrap() + 1.0,
        );
        fx = fx.bounded(Bound::new(
            CAP_BLOCKS,
            move || {
                let t = t1.clone();
                async move {
                    t.gc_sweep_now().unwrap();
                }
            },
            move || {
                let t = t2.clone();
                async move {
                    t.gc_apply_stamps_now().unwrap();
                    t.advance_gc_clock(grace).unwrap();
                }
            },
            move || {
                let g = t3.stats().gc.expect("bounded");
                (g.bytes, g.cap_bytes)
            },
        ));
    }
    if cfg.checksum == Checksum::Crc32c {
        let t = tier.clone();
        fx = fx.damage(move |k, d| {
            let t = t.clone();
            async move { damage(&t, &k, d) }
        });
    }
    let (r, c) = (root.clone(), cfg.clone());
    fx.reopen(move || {
        let (r, c) = (r.clone(), c.clone());
        async move { fixture(r, c) }
    })
}

fn xattr(p: &Path) -> Option<Vec<u8>> {
    let c = CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    let name = CString::new(CRC_XATTR).unwrap();
    let mut v = [0u8; 64];
    // SAFETY: valid path and name; the buffer is 64 writable bytes.
    let n = unsafe { libc::getxattr(c.as_ptr(), name.as_ptr(), v.as_mut_ptr().cast(), v.len()) };
    (n >= 0).then(|| v[..n as usize].to_vec())
}

/// Damage on disk. The checksum lives in an xattr on this filesystem (the suite asserts so).
fn damage(tier: &FsTier, k: &BlockKey, d: Damage) -> bool {
    let p = tier.block_path(k);
    let crc = xattr(&p).expect("checksums live in an xattr on the test filesystem");
    let f = std::fs::File::options()
        .read(true)
        .write(true)
        .open(&p)
        .unwrap();
    match d {
        Damage::FlipByte => {
            let mut b = [0u8; 1];
            f.read_exact_at(&mut b, 100).unwrap();
            f.write_all_at(&[b[0] ^ 0x40], 100).unwrap();
        }
        Damage::Truncate => f.set_len(common::BS as u64 / 2).unwrap(),
        Damage::Empty => f.set_len(0).unwrap(),
        Damage::ReplacedBy(other) => {
            let src = tier.block_path(&other);
            let tmp = p.with_extension("replacing");
            std::fs::copy(&src, &tmp).unwrap();
            common::set_crc_xattr(&tmp, &xattr(&src).expect("the other block's checksum"));
            std::fs::rename(&tmp, &p).unwrap();
        }
        Damage::WrongChecksum => {
            let mut v = crc;
            v[0] ^= 1;
            common::set_crc_xattr(&p, &v);
        }
        Damage::NoChecksum => {
            let c = CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
            let name = CString::new(CRC_XATTR).unwrap();
            // SAFETY: valid path and name.
            assert_eq!(unsafe { libc::removexattr(c.as_ptr(), name.as_ptr()) }, 0);
        }
    }
    true
}

kv_tier_testkit::conformance_tests!(|| async {
    let root = temp_root();
    fixture(root.path().to_path_buf(), common::cfg(root.path())).keep(root)
});

mod checksummed {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let root = temp_root();
        let mut c = common::cfg(root.path());
        c.checksum = Checksum::Crc32c;
        fixture(root.path().to_path_buf(), c).keep(root)
    });
}

mod bounded {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let root = temp_root();
        fixture(root.path().to_path_buf(), bounded_cfg(root.path())).keep(root)
    });
}

/// Checksums on, published through a named temp file and a rename (the fallback where
/// `O_TMPFILE` is missing).
mod renamed {
    use super::*;
    kv_tier_testkit::conformance_tests!(|| async {
        let root = temp_root();
        let mut c = common::cfg(root.path());
        c.checksum = Checksum::Crc32c;
        c.tmpfile_publish = false;
        fixture(root.path().to_path_buf(), c).keep(root)
    });
}
