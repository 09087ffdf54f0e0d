//! Setting up a run and taking it down: the fs tier's directory, the manager built with
//! `kv_tier::builder`, typed access to its fs tier, and the workload.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kv_tier::fs::FsTier;
use kv_tier::{Namespace, RunFields, TieringManager};
use kv_tier_testkit::{Workload, WorkloadConfig};
use tempfile::TempDir;

use super::SimConfig;

type BoxError = Box<dyn std::error::Error>;

/// What a run starts from (with [`workload`]). Its fields drop in order: the manager and
/// the fs tier before the directory they write to.
pub(super) struct Setup {
    /// The manager over the configured tiers.
    pub(super) manager: Arc<TieringManager>,
    /// The Prometheus endpoint, if asked for.
    endpoint: Option<kv_tier::prometheus::MetricsEndpoint>,
    /// The first fs tier, typed: for its GC figures and (with `sync_steps`) to drive its GC.
    pub(super) fs: Option<Arc<FsTier>>,
    /// The fs tier's directory when the simulator made it (no `root_dir`): removed at the end.
    scratch: Option<TempDir>,
    /// The disk under the fs tier, measured before the run.
    pub(super) disk: Option<DiskProbe>,
    /// The obj tier's server, measured before the run.
    pub(super) server: Option<ServerProbe>,
    /// The fs tier's directory.
    root: PathBuf,
    /// Block files a bounded fs tier found at open (a reused root).
    pub(super) found_at_open: Option<u64>,
    /// The run's config, with the embedded S3 server's endpoint filled in.
    cfg: SimConfig,
    /// The S3 server of `--s3-embedded` (dropped last: after the manager that uses it).
    _s3: Option<EmbeddedS3>,
}

/// An S3 server in this process, on a runtime of its own, its objects in a temp dir.
struct EmbeddedS3 {
    server: Option<kv_tier_testkit::s3::S3Server>,
    runtime: tokio::runtime::Runtime,
}

impl EmbeddedS3 {
    fn start() -> Result<Self, BoxError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("serve-sim-s3")
            .enable_all()
            .build()?;
        let server = runtime.block_on(kv_tier_testkit::s3::S3Server::start());
        Ok(EmbeddedS3 {
            server: Some(server),
            runtime,
        })
    }
}

impl Drop for EmbeddedS3 {
    fn drop(&mut self) {
        // the server's task is aborted inside its runtime
        let _g = self.runtime.enter();
        drop(self.server.take());
    }
}

impl Setup {
    /// Checks the config, makes the fs tier's directory and builds the manager.
    pub(super) fn new(cfg: &SimConfig) -> Result<Self, BoxError> {
        if cfg.streams == 0 || cfg.turns == 0 || cfg.tokens_per_block == 0 {
            return Err("--streams, --turns and --tokens-per-block must be positive".into());
        }
        if cfg.no_fs && cfg.s3_endpoint.is_none() && !cfg.s3_embedded {
            return Err(
                "--no-fs leaves no tier below DRAM: give --s3-endpoint URL or --s3-embedded".into(),
            );
        }
        let mut cfg = cfg.clone();
        let s3 = if cfg.s3_embedded {
            let s = EmbeddedS3::start()?;
            let server = s.server.as_ref().expect("started");
            cfg.s3_endpoint = Some(server.endpoint.clone());
            cfg.s3_bucket = kv_tier_testkit::s3::BUCKET.into();
            cfg.s3_access_key = kv_tier_testkit::s3::AK.into();
            cfg.s3_secret_key = kv_tier_testkit::s3::SK.into();
            if cfg.progress {
                eprintln!(
                    "serve_sim: an S3 server in this process at {}",
                    server.endpoint
                );
            }
            Some(s)
        } else {
            None
        };
        let (root, scratch) = root_dir(&cfg)?;
        let manager = Arc::new(build_manager(&cfg, &root)?);
        let fs = first_fs_tier(&manager);
        let found_at_open = fs.as_ref().map(|t| blocks_at_open(t));
        let disk = fs.as_ref().and_then(|t| {
            let c = t.config();
            probe_disk(
                &c.root_dir,
                cfg.block_bytes(),
                c.n_write_threads.max(1),
                c.n_read_threads.max(1),
            )
        });
        let server = match first_obj_tier(&manager) {
            Some((name, t)) => {
                let p = manager
                    .runtime()
                    .block_on(probe_server(&name, &t, cfg.block_bytes()));
                if let Err(e) = &p {
                    eprintln!("serve_sim: the object server was not measured: {e}");
                }
                p.ok()
            }
            None => None,
        };
        let endpoint = match cfg.metrics_addr {
            Some(addr) => {
                let e = manager
                    .runtime()
                    .block_on(kv_tier::prometheus::serve(addr, &manager))?;
                eprintln!("serve_sim: metrics at http://{}/metrics", e.addr());
                Some(e)
            }
            None => None,
        };
        Ok(Self {
            manager,
            endpoint,
            fs,
            scratch,
            disk,
            server,
            root,
            found_at_open,
            cfg,
            _s3: s3,
        })
    }

    /// Shuts the manager down and builds a new one over the same root (a restart of the
    /// engine): returns how long that took. The metrics endpoint is not served again.
    pub(super) fn restart(&mut self) -> Result<std::time::Duration, BoxError> {
        let t = std::time::Instant::now();
        self.endpoint = None;
        self.manager.runtime().block_on(self.manager.shutdown())?;
        self.fs = None;
        self.manager = Arc::new(build_manager(&self.cfg, &self.root)?);
        self.fs = first_fs_tier(&self.manager);
        Ok(t.elapsed())
    }

    /// Shuts the manager down, then removes the scratch directory if there is one.
    pub(super) fn teardown(self, progress: bool) -> Result<(), BoxError> {
        let Self {
            manager,
            endpoint,
            fs,
            scratch,
            disk: _,
            server: _,
            root: _,
            found_at_open: _,
            cfg: _,
            _s3,
        } = self;
        drop(endpoint);
        manager.runtime().block_on(manager.shutdown())?;
        drop(fs);
        drop(manager);
        if let Some(t) = scratch {
            // The layout makes a directory per block or two: delete in parallel, it is quicker.
            if progress {
                eprintln!(
                    "removing the temporary cache directory {}",
                    t.path().display()
                );
            }
            remove_tree(t.path(), 4);
        }
        Ok(())
    }
}

/// A short direct-I/O write and read of the disk under the fs tier's directory.
#[derive(Debug, Clone, Copy, serde::Serialize, PartialEq)]
pub struct DiskProbe {
    /// Bytes written, then read.
    pub bytes: u64,
    /// In blocks of this many bytes.
    pub block_bytes: u64,
    /// Write throughput, GB/s (O_DIRECT, `write_threads` at once).
    pub write_gb_per_s: f64,
    /// Read throughput, GB/s (O_DIRECT, `read_threads` at once).
    pub read_gb_per_s: f64,
    /// Threads writing at once: the fs tier's `n_write_threads`.
    pub write_threads: usize,
    /// Threads reading at once: the fs tier's `n_read_threads`.
    pub read_threads: usize,
}

/// Plain `object_store` PUTs, then GETs, of objects of the run's block size to the first obj
/// tier's server, at the tier's `io_threads` in flight: what the server does for a client
/// that does nothing else, the yardstick of the tier's own rates.
#[derive(Debug, Clone, serde::Serialize, PartialEq)]
pub struct ServerProbe {
    /// The obj tier whose server it is.
    pub tier: String,
    /// Bytes written, then read.
    pub bytes: u64,
    /// In objects of this many bytes.
    pub object_bytes: u64,
    /// Requests in flight: the tier's `io_threads`.
    pub in_flight: usize,
    /// PUT throughput, GB/s.
    pub put_gb_per_s: f64,
    /// GET throughput, GB/s.
    pub get_gb_per_s: f64,
}

/// Measures [`ServerProbe`] with 128 MiB in 8 to 64 objects (fewer bytes with small blocks;
/// read twice, the second time timed) under
/// `<prefix>/.kv-tier-server-probe-<pid>/`, outside the tier's namespace directory, and
/// deletes them after (also when a request fails).
async fn probe_server(
    name: &str,
    tier: &kv_tier::obj::ObjTier,
    block_bytes: usize,
) -> Result<ServerProbe, BoxError> {
    use futures::{StreamExt as _, TryStreamExt as _, stream};
    use kv_tier::obj::object_store::ObjectStoreExt as _;
    use kv_tier::obj::object_store::path::Path as ObjPath;
    const TOTAL: usize = 128 << 20;
    let n = (TOTAL / block_bytes.max(1)).clamp(8, 64);
    let in_flight = tier.config().io_threads.max(1);
    let store = tier.object_store().clone();
    let prefix = tier.config().prefix.trim_matches('/');
    let dir = format!(".kv-tier-server-probe-{}", std::process::id());
    let paths: Vec<ObjPath> = (0..n)
        .map(|i| match prefix {
            "" => ObjPath::from(format!("{dir}/{i}")),
            p => ObjPath::from(format!("{p}/{dir}/{i}")),
        })
        .collect();
    let body = kv_tier::obj::object_store::PutPayload::from(vec![0x5a_u8; block_bytes]);
    let get_all = || {
        stream::iter(&paths)
            .map(|p| async {
                let b = store.get(p).await?.bytes().await?;
                Ok::<_, kv_tier::obj::object_store::Error>(b.len())
            })
            .buffer_unordered(in_flight)
            .try_collect::<Vec<usize>>()
    };
    let check = |lens: Vec<usize>| match lens.iter().all(|&l| l == block_bytes) {
        true => Ok(()),
        false => Err(BoxError::from(
            "a GET returned fewer bytes than its PUT wrote",
        )),
    };
    let (mut put, mut get) = (0.0, 0.0);
    let probed: Result<(), BoxError> = async {
        let t = std::time::Instant::now();
        stream::iter(&paths)
            .map(|p| store.put(p, body.clone()))
            .buffer_unordered(in_flight)
            .try_for_each(|_| async { Ok(()) })
            .await?;
        put = t.elapsed().as_secs_f64();
        // the GETs twice, the second timed: the first finds the server cold
        check(get_all().await?)?;
        let t = std::time::Instant::now();
        check(get_all().await?)?;
        get = t.elapsed().as_secs_f64();
        Ok(())
    }
    .await;
    // (whatever failed: the objects go)
    stream::iter(&paths)
        .map(|p| store.delete(p))
        .buffer_unordered(in_flight)
        .for_each(|_| async {})
        .await;
    probed?;
    let bytes = (n * block_bytes) as f64;
    Ok(ServerProbe {
        tier: name.to_string(),
        bytes: bytes as u64,
        object_bytes: block_bytes as u64,
        in_flight,
        put_gb_per_s: bytes / put / 1e9,
        get_gb_per_s: bytes / get / 1e9,
    })
}

/// The effective tier config of the run (secrets masked).
pub(super) fn effective_tiers(manager: &TieringManager) -> serde_json::Value {
    let mut registry = kv_tier::registry();
    kv_tier_testkit::MemoryTier::register(&mut registry).expect("a fresh registry");
    let mut v = kv_tier::effective_config(manager.config(), &registry)
        .unwrap_or_else(|e| serde_json::json!({ "error": e.to_string() }));
    kv_tier::redact_secrets(&mut v);
    v
}

/// Writes then reads 256 MiB with O_DIRECT in `dir`, in blocks of the run's block size (at
/// least 1 MiB), at the fs tier's own concurrency (`writers` threads, then `readers`, each on
/// its share of the blocks): what the disk does under the tier; `None` where the filesystem
/// refuses O_DIRECT.
fn probe_disk(dir: &Path, block_bytes: usize, writers: usize, readers: usize) -> Option<DiskProbe> {
    use std::os::unix::fs::{FileExt, OpenOptionsExt};
    const TOTAL: usize = 256 << 20;
    let block = block_bytes.max(1 << 20).next_multiple_of(4096).min(TOTAL);
    let n = TOTAL / block;
    // a name of this process's own: a file left by a run killed mid-probe (removed below if
    // old) never stands in the way
    let path = dir.join(format!(".kv-tier-disk-probe-{}.tmp", std::process::id()));
    remove_stale_probes(dir);
    // the blocks `i` of thread `t` of `threads`: every `threads`-th from `t`
    let pass = |f: &std::fs::File, threads: usize, write: bool| -> std::io::Result<f64> {
        let t0 = std::time::Instant::now();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads.min(n))
                .map(|t| {
                    s.spawn(move || -> std::io::Result<()> {
                        let mut buf = kv_tier::AlignedBuf::zeroed(block);
                        buf.as_mut_slice()
                            .iter_mut()
                            .enumerate()
                            .for_each(|(i, b)| *b = (i * 31 % 251) as u8);
                        for i in (t..n).step_by(threads) {
                            let at = (i * block) as u64;
                            if write {
                                f.write_all_at(buf.as_slice(), at)?;
                            } else {
                                f.read_exact_at(buf.as_mut_slice(), at)?;
                            }
                        }
                        Ok(())
                    })
                })
                .collect();
            hs.into_iter()
                .try_for_each(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
        })?;
        if write {
            f.sync_all()?;
        }
        Ok(t0.elapsed().as_secs_f64())
    };
    let run = || -> std::io::Result<DiskProbe> {
        let f = std::fs::OpenOptions::new()
            .create_new(true)
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)?;
        let write = pass(&f, writers, true)?;
        let read = pass(&f, readers, false)?;
        let bytes = (n * block) as f64;
        Ok(DiskProbe {
            bytes: (n * block) as u64,
            block_bytes: block as u64,
            write_gb_per_s: bytes / write / 1e9,
            read_gb_per_s: bytes / read / 1e9,
            write_threads: writers.min(n),
            read_threads: readers.min(n),
        })
    };
    let probe = run();
    let _ = std::fs::remove_file(&path);
    probe.ok()
}

/// Removes disk-probe files a killed run left in `dir` (older than a minute: a probe takes
/// seconds, and another run's may be going on).
fn remove_stale_probes(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        let old = e
            .metadata()
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .is_some_and(|age| age > std::time::Duration::from_secs(60));
        if name.starts_with(".kv-tier-disk-probe") && name.ends_with(".tmp") && old {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The block files `fs` holds as it opens: a bounded tier's index counts them; an unbounded
/// one keeps no index, so its rank directory is walked (0 if it cannot be read).
fn blocks_at_open(fs: &FsTier) -> u64 {
    match fs.stats().gc {
        Some(g) => g.files,
        None => {
            let rank = fs.config().root_dir.join(fs.namespace().rank_dir_name());
            kv_tier::fs::offline::scan_rank(&rank, Some(fs.namespace()))
                .map_or(0, |s| s.blocks.len() as u64)
        }
    }
}

/// The fs tier's directory: `root_dir`, or a fresh temp dir (returned too, to be removed);
/// with a config and no `root_dir`, none (the config's tiers have their own directories), and
/// none without an fs tier.
fn root_dir(cfg: &SimConfig) -> std::io::Result<(PathBuf, Option<TempDir>)> {
    Ok(match &cfg.root_dir {
        Some(r) => (r.clone(), None),
        // the config's tiers have their own directories, or there is no fs tier: nothing of
        // ours to make or remove
        None if cfg.config_json.is_some() || cfg.no_fs => (PathBuf::new(), None),
        None => {
            let t = tempfile::Builder::new().prefix("kv-tier-sim-").tempdir()?;
            (t.path().to_path_buf(), Some(t))
        }
    })
}

/// The manager over the config's tiers (the built-in ones and the testkit's memory tier),
/// after checking that the config's block size is the model shape's.
fn build_manager(cfg: &SimConfig, root: &Path) -> Result<TieringManager, BoxError> {
    let tier_cfg = cfg.tier_config(root)?;
    let block = tier_cfg.block_size_bytes as usize;
    if block != cfg.block_bytes() {
        return Err(format!(
            "the config's block_size_bytes ({block}) differs from the model shape's block size ({})",
            cfg.block_bytes()
        )
        .into());
    }
    // one namespace per model shape: a root reused by a run of another model or block size
    // gets a directory of its own (the layout has no block size: the model name stands for it,
    // as in vLLM)
    let ns = Namespace::new(
        RunFields::new(
            format!("kv-tier/serve-sim/{}B", cfg.block_bytes()),
            "torch.bfloat16",
            cfg.tokens_per_block as u64,
        ),
        0,
    )?;
    let mut registry = kv_tier::registry();
    kv_tier_testkit::MemoryTier::register(&mut registry).expect("a fresh registry");
    let mut b = kv_tier::builder(tier_cfg)?.registry(registry).namespace(ns);
    if cfg.load_policy && cfg.prefill_tokens_per_s > 0.0 {
        b = b.recompute_time(kv_tier::RecomputeTime::at_rate(
            cfg.prefill_tokens_per_s,
            cfg.tokens_per_block as u64,
        ));
    }
    Ok(b.build_blocking()?)
}

/// The manager's first fs tier, typed.
/// The first obj tier, with its name.
fn first_obj_tier(manager: &TieringManager) -> Option<(String, Arc<kv_tier::obj::ObjTier>)> {
    let spec = manager
        .config()
        .secondary_tiers
        .iter()
        .find(|t| t.kind == "obj")?;
    Some((
        spec.name.clone(),
        manager.tier::<kv_tier::obj::ObjTier>(&spec.name)?,
    ))
}

fn first_fs_tier(manager: &TieringManager) -> Option<Arc<FsTier>> {
    manager
        .config()
        .secondary_tiers
        .iter()
        .find(|t| t.kind == "fs")
        .and_then(|t| manager.tier::<FsTier>(&t.name))
}

/// The multi-turn, prefix-sharing workload of the config, in blocks.
pub(super) fn workload(cfg: &SimConfig) -> Workload {
    let bpb = cfg.tokens_per_block;
    Workload::new(WorkloadConfig {
        seed: cfg.seed,
        streams: cfg.streams,
        turns: cfg.turns,
        prefix_pool: cfg.prefixes.max(1),
        prefix_blocks: cfg.prefix_tokens / bpb,
        prompt_blocks: cfg.prompt_tokens / bpb,
        output_blocks: cfg.output_tokens / bpb,
        group: 0,
    })
}

/// Removes a directory tree with `threads` threads (one subtree of the second level each).
fn remove_tree(root: &Path, threads: usize) {
    let mut subtrees = Vec::new();
    for top in std::fs::read_dir(root).into_iter().flatten().flatten() {
        for sub in std::fs::read_dir(top.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            subtrees.push(sub.path());
        }
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let Some(p) = subtrees.get(i) else { break };
                    if p.is_dir() {
                        let _ = std::fs::remove_dir_all(p);
                    } else {
                        let _ = std::fs::remove_file(p);
                    }
                }
            });
        }
    });
    let _ = std::fs::remove_dir_all(root);
}
