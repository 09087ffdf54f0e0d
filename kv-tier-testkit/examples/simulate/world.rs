//! The simulation's real tiers: a bounded, checksummed fs tier in a temp dir (GC on) and a
//! bounded, checksummed obj tier on object_store's in-memory store. Shared by the `simulate`
//! example and the CI test.

use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Duration;

use kv_tier_core::{BlockKey, Namespace, RunFields, SecondaryTier, TierOptions};
use kv_tier_fs::{Checksum, FsTier, FsTierConfig};
use kv_tier_obj::{ObjChecksum, ObjTier, ObjTierConfig};
use kv_tier_testkit::controlled_store::{ControlledStore, Op};
use kv_tier_testkit::sim::{BLOCK_SIZE, BoxFuture, Tamper, World};
use object_store::ObjectStoreExt as _;
use object_store::path::Path as ObjPath;
use object_store::{ObjectStore, PutMode, PutOptions, PutPayload};

/// fs cap in blocks (a block holds its file and, with random keys, two directories): about
/// half of the simulation's key universe fits.
const FS_CAP_BLOCKS: usize = 120;
/// obj cap in blocks.
const OBJ_CAP_BLOCKS: usize = 100;

fn ns() -> Namespace {
    Namespace::new(RunFields::new("sim/model", "torch.float16", 16), 0).unwrap()
}

/// A fresh world: an empty temp dir and an empty in-memory store (behind a wrapper that can
/// stop answering, as a backend does when it hangs).
pub(crate) struct RealWorld {
    root: tempfile::TempDir,
    store: Arc<ControlledStore>,
    fs: Option<Arc<FsTier>>,
    obj: Option<Arc<ObjTier>>,
}

impl RealWorld {
    /// An empty world. The fs tier's root is a temp dir under `$KV_TIER_SIM_DIR`, by default
    /// `/dev/shm` where it exists: the simulation checks logic, not the disk, and on an ext4
    /// without a journal, creating files right after mass deletes spends most of a run in the
    /// kernel's search for reusable inodes.
    pub(crate) fn new() -> Self {
        let parent = std::env::var_os("KV_TIER_SIM_DIR")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                let shm = std::path::Path::new("/dev/shm");
                shm.is_dir().then(|| shm.to_path_buf())
            })
            .unwrap_or_else(std::env::temp_dir);
        Self {
            root: tempfile::Builder::new()
                .prefix("kv-tier-sim-")
                .tempdir_in(&parent)
                .unwrap_or_else(|e| panic!("a temp dir under {}: {e}", parent.display())),
            store: Arc::new(ControlledStore::new()),
            fs: None,
            obj: None,
        }
    }

    fn fs_cfg(&self) -> FsTierConfig {
        let mut c = FsTierConfig::new(self.root.path());
        c.n_read_threads = 2;
        c.n_write_threads = 2;
        c.checksum = Checksum::Crc32c;
        c.gc_max_size_gb = Some((FS_CAP_BLOCKS * (BLOCK_SIZE + 8192)) as f64 / (1u64 << 30) as f64);
        c.gc_grace_s = Some(2.0);
        // a sweep takes half of what the tier holds: evictions are frequent and large
        c.gc_low_watermark = Some(0.5);
        c.gc_stamp_interval_s = Some(1.0);
        c.gc_interval_s = Some(0.5);
        c
    }

    fn obj_cfg() -> ObjTierConfig {
        let mut c = ObjTierConfig::new("sim");
        c.checksum = ObjChecksum::Crc32c;
        c.max_size_gb = Some((OBJ_CAP_BLOCKS * BLOCK_SIZE) as f64 / (1u64 << 30) as f64);
        c.low_watermark = 0.5;
        c.request_timeout_s = 0.02;
        c.max_retries = 0;
        c.lookup_timeout_s = 0.015;
        c
    }
}

impl RealWorld {
    /// One eviction pass; `deep`: the fs tier sweeps as on a full disk (the obj tier has one
    /// kind of pass).
    fn sweep_with(&mut self, tier: usize, deep: bool) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if tier == 0 {
                let fs = self.fs.as_ref().expect("open");
                let _ = if deep {
                    fs.gc_sweep_for_space_now()
                } else {
                    fs.gc_sweep_now()
                };
            } else {
                self.obj.as_ref().expect("open").sweep_now().await;
            }
        })
    }
}

impl Default for RealWorld {
    fn default() -> Self {
        Self::new()
    }
}

impl World for RealWorld {
    fn open(&mut self) -> BoxFuture<'_, Vec<(Arc<dyn SecondaryTier>, TierOptions)>> {
        Box::pin(async move {
            self.fs = None;
            self.obj = None;
            let fs = Arc::new(FsTier::open("fs", self.fs_cfg(), ns(), BLOCK_SIZE).unwrap());
            let obj = Arc::new(
                ObjTier::with_store("obj", self.store.clone(), Self::obj_cfg(), ns(), BLOCK_SIZE)
                    .await
                    .unwrap(),
            );
            self.fs = Some(fs.clone());
            self.obj = Some(obj.clone());
            vec![
                (fs as Arc<dyn SecondaryTier>, TierOptions::default()),
                (obj as Arc<dyn SecondaryTier>, TierOptions::default()),
            ]
        })
    }

    fn crash(&mut self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            let fs = self.fs.take().map(|t| Arc::downgrade(&t));
            let obj = self.obj.take().map(|t| Arc::downgrade(&t));
            let gone = async {
                while fs.as_ref().is_some_and(|w| w.strong_count() > 0)
                    || obj.as_ref().is_some_and(|w| w.strong_count() > 0)
                {
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            };
            tokio::time::timeout(Duration::from_secs(30), gone)
                .await
                .expect("the crashed tiers were never dropped: something keeps them alive");
        })
    }

    fn tamper(&mut self, tier: usize, key: BlockKey, how: Tamper) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            if tier == 0 {
                let p = self.fs.as_ref().expect("open").block_path(&key);
                let Ok(f) = std::fs::File::options().read(true).write(true).open(&p) else {
                    return false;
                };
                match how {
                    Tamper::Delete => std::fs::remove_file(&p).is_ok(),
                    Tamper::Truncate => f.set_len(BLOCK_SIZE as u64 / 2).is_ok(),
                    Tamper::FlipByte => {
                        let mut b = [0u8; 1];
                        f.read_exact_at(&mut b, 100).is_ok()
                            && f.write_all_at(&[b[0] ^ 0x10], 100).is_ok()
                    }
                    Tamper::Replace => {
                        let tmp = p.with_extension("tampered");
                        let other = kv_tier_testkit::block_bytes(&key, 99, BLOCK_SIZE);
                        std::fs::write(&tmp, other).is_ok() && std::fs::rename(&tmp, &p).is_ok()
                    }
                    Tamper::CopyOf(other) => {
                        // a hard link moves the other key's file here, checksum and all
                        let src = self.fs.as_ref().expect("open").block_path(&other);
                        let tmp = p.with_extension("tampered");
                        std::fs::hard_link(&src, &tmp).is_ok() && std::fs::rename(&tmp, &p).is_ok()
                    }
                }
            } else {
                let path = ObjPath::from(self.obj.as_ref().expect("open").object_path(&key));
                if how == Tamper::Delete {
                    return self.store.inner.delete(&path).await.is_ok();
                }
                let source = match how {
                    Tamper::CopyOf(other) => {
                        ObjPath::from(self.obj.as_ref().expect("open").object_path(&other))
                    }
                    _ => path.clone(),
                };
                let Ok(got) = self.store.inner.get(&source).await else {
                    return false;
                };
                let mut attributes = got.attributes.clone();
                let Ok(bytes) = got.bytes().await else {
                    return false;
                };
                let mut bytes = bytes.to_vec();
                match how {
                    Tamper::Truncate => bytes.truncate(bytes.len() / 2),
                    Tamper::FlipByte => bytes[100] ^= 0x10,
                    Tamper::Replace => {
                        bytes = kv_tier_testkit::block_bytes(&key, 99, BLOCK_SIZE);
                        attributes = Default::default();
                    }
                    Tamper::Delete | Tamper::CopyOf(_) => {}
                }
                let opts = PutOptions {
                    mode: PutMode::Overwrite,
                    attributes,
                    ..Default::default()
                };
                self.store
                    .inner
                    .put_opts(&path, PutPayload::from(bytes), opts)
                    .await
                    .is_ok()
            }
        })
    }

    fn sweep(&mut self, tier: usize) -> BoxFuture<'_, ()> {
        self.sweep_with(tier, false)
    }

    fn sweep_deep(&mut self, tier: usize) -> BoxFuture<'_, ()> {
        self.sweep_with(tier, true)
    }

    fn hang_backend(&mut self, tier: usize) -> bool {
        if tier == 1 {
            self.store.hold_all();
        }
        tier == 1
    }

    fn lose_replies(&mut self, tier: usize) -> bool {
        if tier == 1 {
            for op in Op::ALL {
                self.store.delay_replies(op, Duration::from_secs(5));
            }
        }
        tier == 1
    }

    fn heal_backend(&mut self, tier: usize) {
        if tier == 1 {
            self.store.release_all();
        }
    }

    fn quiet_absences(&self, tier: usize) -> u64 {
        // the obj tier answers the keys its lookup deadline cut off, or whose request failed,
        // as absent
        match (tier, &self.obj) {
            (1, Some(o)) => {
                let s = o.stats();
                s.lookup_timeouts + s.request_timeouts
            }
            _ => 0,
        }
    }

    fn clock_jump(&mut self, tier: usize, by: Duration) {
        if tier == 0 {
            let _ = self.fs.as_ref().expect("open").advance_gc_clock(by);
        }
    }

    fn describe(&self, tier: usize, key: BlockKey) -> BoxFuture<'_, String> {
        Box::pin(async move {
            if tier == 0 {
                let p = self.fs.as_ref().expect("open").block_path(&key);
                match std::fs::symlink_metadata(&p) {
                    Ok(m) => format!("{} is a file of {} bytes", p.display(), m.len()),
                    Err(e) => format!("{}: {e}", p.display()),
                }
            } else {
                let path = ObjPath::from(self.obj.as_ref().expect("open").object_path(&key));
                match self.store.inner.head(&path).await {
                    Ok(m) => format!("{path} is an object of {} bytes", m.size),
                    Err(e) => format!("{path}: {e}"),
                }
            }
        })
    }

    fn measured_usage(&self, tier: usize) -> Option<u64> {
        fn du(p: &std::path::Path) -> u64 {
            use std::os::unix::fs::MetadataExt;
            let Ok(m) = std::fs::symlink_metadata(p) else {
                return 0;
            };
            let mut n = m.blocks() * 512;
            if m.is_dir()
                && let Ok(rd) = std::fs::read_dir(p)
            {
                for e in rd.flatten() {
                    n += du(&e.path());
                }
            }
            n
        }
        (tier == 0).then(|| du(self.root.path()))
    }

    fn usage(&self, tier: usize) -> Option<(u64, u64)> {
        if tier == 0 {
            let g = self.fs.as_ref()?.stats().gc?;
            Some((g.bytes, g.hard_ceiling_bytes))
        } else {
            None
        }
    }
}
