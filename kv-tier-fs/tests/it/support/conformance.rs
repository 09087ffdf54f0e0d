//! The conformance suite's fixtures of the fs tier: plain, checksummed, bounded and renamed,
//! each reopening on its root, built from a config JSON by type name, and (with checksums)
//! damaging blocks on disk.

use std::ffi::CString;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::BlockKey;
use kv_tier_fs::{CRC_XATTR, Checksum, FsTier, FsTierConfig};
use kv_tier_testkit::{Bound, Damage, TierFixture};

use super::*;

/// The cap of the bounded fixture, in blocks. Directories count against the cap: a few hundred
/// random keys rarely share a directory, so each block holds its file and two directories.
pub(crate) const CAP_BLOCKS: usize = 128;

/// What one block of the bounded conformance fixture holds on disk: its file and two
/// directories.
pub(crate) const HELD_PER_BLOCK: usize = BS + 2 * 4096;

/// The bounded conformance fixture's config: a cap of [`CAP_BLOCKS`] blocks, grace 30 s,
/// stamps every 10 s.
pub(crate) fn conformance_bounded_cfg(root: &Path) -> FsTierConfig {
    let mut c = cfg(root);
    c.gc_max_size_gb = Some((CAP_BLOCKS * HELD_PER_BLOCK) as f64 / (1u64 << 30) as f64);
    c.gc_grace_s = Some(30.0);
    c.gc_stamp_interval_s = Some(10.0);
    c
}

/// The test namespace's layout, as a config's `layout` JSON.
pub(crate) fn layout_json() -> serde_json::Value {
    serde_json::json!({"model_name": "test-org/test-model", "dtype": "torch.float16", "tokens_per_hash": 16})
}

/// A fixture on `root` with `cfg`: reopens with the same config, registers as `"fs"`.
pub(crate) fn fs_fixture(root: PathBuf, cfg: FsTierConfig) -> TierFixture {
    let tier = Arc::new(FsTier::open("fs", cfg.clone(), ns(), BS).unwrap());
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
    let mut fx = TierFixture::new(tier.clone(), BS).registered(
        FsTier::register,
        serde_json::json!({"layout": layout_json(), "secondary_tiers": [entry]}),
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
            async move { damage_on_disk(&t, &k, d) }
        });
    }
    let (r, c) = (root.clone(), cfg.clone());
    fx.reopen(move || {
        let (r, c) = (r.clone(), c.clone());
        async move { fs_fixture(r, c) }
    })
}

/// Damage on disk. The checksum lives in an xattr on this filesystem (the suite asserts so).
pub(crate) fn damage_on_disk(tier: &FsTier, k: &BlockKey, d: Damage) -> bool {
    let p = tier.block_path(k);
    let crc = crc_xattr(&p).expect("checksums live in an xattr on the test filesystem");
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
        Damage::Truncate => f.set_len(BS as u64 / 2).unwrap(),
        Damage::Empty => f.set_len(0).unwrap(),
        Damage::ReplacedBy(other) => {
            let src = tier.block_path(&other);
            let tmp = p.with_extension("replacing");
            std::fs::copy(&src, &tmp).unwrap();
            set_crc_xattr(&tmp, &crc_xattr(&src).expect("the other block's checksum"));
            std::fs::rename(&tmp, &p).unwrap();
        }
        Damage::WrongChecksum => {
            let mut v = crc;
            v[0] ^= 1;
            set_crc_xattr(&p, &v);
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
