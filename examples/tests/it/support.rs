//! Helpers of serve_sim's tests: small scenarios and their checks, serve_sim and `kv-tier` run
//! as children with deadlines, workloads on an fs root, the S3 server, reading the text report,
//! `--help` and a metrics scrape.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kv_tier_examples::sim::{Report, SimConfig};
use kv_tier_testkit::fixtures::process::{ChildOutput, S3ServerChild, binary_beside, finish};
use kv_tier_testkit::wait::wait_until;

/// The serve_sim binary of this package.
pub(crate) const SERVE_SIM: &str = env!("CARGO_BIN_EXE_serve_sim");

/// The `kv-tier` CLI binary of kv-tier-cli, beside serve_sim in the target dir (built first if
/// it is not there).
pub(crate) fn kv_tier_bin() -> PathBuf {
    binary_beside(Path::new(SERVE_SIM), "kv-tier", "kv-tier-cli")
}

/// serve_sim as a command, to give arguments to.
pub(crate) fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_serve_sim"))
}

/// A short in-process scenario (tiny model, 1 MiB of DRAM, deterministic steps) with `seed`.
pub(crate) fn small(seed: u64) -> SimConfig {
    SimConfig {
        streams: 4,
        turns: 3,
        prefixes: 4,
        prefix_tokens: 512,
        prompt_tokens: 256,
        output_tokens: 64,
        tokens_per_block: 16,
        model: "tiny".into(),
        layers: 1,
        kv_heads: 2,
        head_dim: 64,
        dtype_bytes: 2,
        gpu_cache_blocks: 16,
        max_batch: 4,
        prefill_tokens_per_s: 0.0,
        load_policy: false,
        duration: std::time::Duration::from_secs(60),
        seed,
        dram_bytes: 1 << 20, // 128 blocks of 8 KiB: the fs tier gets the rest
        root_dir: None,
        fs_cap_gb: None,
        fs_admit_after_lookups: 0,
        fs_write_budget_mb_per_s: None,
        chain_eviction: false,
        dram_eviction: "lru".into(),
        config_json: None,
        s3_endpoint: None,
        s3_bucket: String::new(),
        s3_access_key: String::new(),
        s3_secret_key: String::new(),
        s3_region: String::new(),
        obj_cap_gb: None,
        fs_gc_interval_s: 0.01,
        fs_gc_stamp_s: 0.000_001,
        fs_gc_grace_s: 0.000_002,
        sync_steps: true,
        progress: false,
        metrics_addr: None,
        fs_instance_id: None,
        workload: "custom".into(),
        max_wait_steps: kv_tier_examples::sim::DEFAULT_MAX_WAIT_STEPS,
        restart_at: None,
        restart_after: None,
        trace: None,
        s3_embedded: false,
        no_fs: false,
    }
}

/// Asserts that the figures of `r` agree with each other: requests, lookups, tokens, bytes,
/// retry waits, promotions, the hit rate.
pub(crate) fn check_consistent(r: &Report) {
    assert_eq!(r.requests, r.requests_planned);
    assert_eq!(r.blocks_corrupt, 0);
    assert!(r.blocks_verified > 0, "nothing was read back: {r:?}");
    assert_eq!(
        r.lookups,
        r.lookup_hits + r.lookup_hits_pending + r.lookup_retries + r.lookup_misses,
        "hits + misses = lookups"
    );
    assert_eq!(
        r.prompt_tokens,
        r.tokens_from_gpu_cache
            + r.tokens_from_dram
            + r.tokens_from_secondary
            + r.tokens_recomputed
    );
    for t in &r.tiers {
        assert_eq!(
            t.bytes_read,
            t.blocks_loaded * r.block_bytes,
            "bytes loaded = blocks loaded x block size"
        );
        assert_eq!(t.bytes_written, t.blocks_stored * r.block_bytes);
        // a bounded tier may refuse a store it has no room for (`NoSpace`: everything left is
        // protected or being written, or the sweep making room took longer than the store
        // waits, as on a loaded machine); any other failed store is a fault
        assert_eq!(
            t.store_failures - t.store_failure_causes.no_space,
            0,
            "tier {}: failed stores ({})",
            t.name,
            t.store_failure_causes.summary()
        );
    }
    // every Retry waited for at least one tier's probe, and each tier counts its waits
    let waits: u64 = r.tiers.iter().map(|t| t.retry_waits).sum();
    assert!(waits >= r.lookup_retries, "{waits} < {}", r.lookup_retries);
    assert_eq!(waits > 0, r.lookup_retries > 0);
    let promoted: u64 = r.tiers.iter().map(|t| t.blocks_loaded).sum();
    // tokens served from a tier were promoted; with real-time steps a promotion may land only
    // after every request that asked for it gave up (a slow tier on a loaded machine)
    assert!(
        r.tokens_from_secondary == 0 || promoted > 0,
        "tokens served from a tier that promoted nothing"
    );
    if r.inputs.sim.sync_steps {
        assert_eq!(
            r.tokens_from_secondary > 0,
            promoted > 0,
            "promotions and tokens served from them disagree"
        );
    }
    let hit_tokens = r.tokens_from_gpu_cache + r.tokens_from_dram + r.tokens_from_secondary;
    assert!((r.hit_rate - hit_tokens as f64 / r.prompt_tokens as f64).abs() < 1e-9);
    check_attribution(r);
}

/// Asserts that every prompt token is in exactly one bucket of the attribution: the buckets
/// sum to the prompt tokens, and the served ones are the report's GPU, DRAM and tier tokens.
pub(crate) fn check_attribution(r: &Report) {
    let a = &r.attribution;
    let sum: u64 = a.values().sum();
    assert_eq!(
        sum, r.prompt_tokens,
        "the buckets sum to the prompt tokens: {a:?}"
    );
    let get = |k: &str| a.get(k).copied().unwrap_or(0);
    assert_eq!(get("served/gpu"), r.tokens_from_gpu_cache, "{a:?}");
    assert_eq!(get("served/dram"), r.tokens_from_dram, "{a:?}");
    let from_tiers: u64 = r
        .tiers
        .iter()
        .map(|t| get(&format!("served/{}", t.name)))
        .sum();
    assert_eq!(from_tiers, r.tokens_from_secondary, "{a:?}");
    let lost: u64 = a
        .iter()
        .filter(|(k, _)| k.starts_with("lost/"))
        .map(|(_, n)| n)
        .sum();
    assert_eq!(lost, r.tokens_recomputed, "{a:?}");
    assert!(
        a.keys()
            .all(|k| k.starts_with("served/") || k.starts_with("lost/")),
        "{a:?}"
    );
    let eps = 1e-9;
    assert!(
        r.offline.lru <= r.offline.unbounded + eps,
        "{:?}",
        r.offline
    );
    assert!(
        r.offline.opt <= r.offline.unbounded + eps,
        "{:?}",
        r.offline
    );
    assert!(
        r.offline.pooled <= r.offline.unbounded + eps,
        "{:?}",
        r.offline
    );
    assert!(
        r.hit_rate <= r.offline.unbounded + eps,
        "{} > unbounded {:?}",
        r.hit_rate,
        r.offline
    );
}

/// The lines of `help` that describe `flag`: its line and the lines after it up to the next
/// flag or heading.
pub(crate) fn help_entry(help: &str, flag: &str) -> String {
    let mut lines = help
        .lines()
        .skip_while(|l| !l.trim_start().split([' ', ',']).any(|w| w == flag));
    let mut entry = lines
        .next()
        .unwrap_or_else(|| panic!("{flag} not in\n{help}"))
        .to_string();
    for l in lines {
        let t = l.trim_start();
        if t.is_empty() || t.starts_with('-') || !l.starts_with(' ') {
            break;
        }
        entry += " ";
        entry += t;
    }
    entry
}

/// One HTTP GET of `path` on `addr`: the status line and the body.
pub(crate) fn http_get(addr: &str, path: &str) -> std::io::Result<(String, String)> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr)?;
    s.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    Ok((
        head.lines().next().unwrap_or("").to_string(),
        body.to_string(),
    ))
}

/// The value of the sample `series` (name with its labels, as rendered) in a scrape.
pub(crate) fn sample(body: &str, series: &str) -> Option<f64> {
    body.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// Spawns serve_sim with `args`, stdin from /dev/null and its output piped, SIGINT at its
/// default action.
pub(crate) fn spawn<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Child {
    use std::os::unix::process::CommandExt;
    let mut cmd = bin();
    cmd.args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // SIGINT as a terminal delivers it: a test run started in the background (`cmd &` in a
    // script, as CI may) passes SIGINT ignored on to its children
    // SAFETY: signal(2) is async-signal-safe, as pre_exec requires.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGINT, libc::SIG_DFL);
            Ok(())
        });
    }
    cmd.spawn().unwrap()
}

/// Runs serve_sim with `args` for at most `timeout_s` seconds (killed past that).
pub(crate) fn sim<S: AsRef<std::ffi::OsStr>>(args: &[S], timeout_s: u64) -> ChildOutput {
    finish(spawn(args), Duration::from_secs(timeout_s))
}

/// A small, quick workload (tiny model, 1 MiB of DRAM so the fs tier gets used) without
/// the flags a test may want to give itself.
pub(crate) fn small_args() -> Vec<String> {
    [
        "--model",
        "tiny",
        "--streams",
        "2",
        "--turns",
        "2",
        "--output-tokens",
        "32",
        "--no-progress",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// [`small_args`] followed by `extra`.
pub(crate) fn with(extra: &[&str]) -> Vec<String> {
    let mut v = small_args();
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// A usage error done right: non-zero, not a panic (101), not killed, no hang, the
/// argument named.
pub(crate) fn assert_clean_refusal(out: &ChildOutput, names: &[&str]) {
    assert!(!out.timed_out, "hung: {}", out.all());
    assert!(out.signal.is_none(), "killed by a signal: {}", out.all());
    assert_ne!(out.code, Some(0), "accepted: {}", out.all());
    assert_ne!(out.code, Some(101), "panicked: {}", out.all());
    assert!(!out.stderr.contains("panicked"), "panicked: {}", out.all());
    assert!(
        names.iter().any(|n| out.stderr.contains(n)),
        "the message names none of {names:?}: {}",
        out.all()
    );
}

/// Asserts that the run exited 0 within its deadline with no corrupt block.
pub(crate) fn assert_ok(out: &ChildOutput) {
    assert!(
        out.code == Some(0) && !out.timed_out,
        "run failed: {}",
        out.all()
    );
    assert!(
        out.stdout.contains(" 0 corrupt"),
        "corrupt blocks: {}",
        out.all()
    );
}

/// A workload that writes to, and reads back from, the fs tier.
pub(crate) fn fs_workload(root: &Path, seed: &str) -> Vec<String> {
    let mut v: Vec<String> = [
        "--model",
        "tiny",
        "--streams",
        "4",
        "--turns",
        "6",
        "--prefix-tokens",
        "512",
        "--prompt-tokens",
        "128",
        "--output-tokens",
        "32",
        "--dram-mb",
        "1",
        "--prefill-tokens-per-s",
        "0",
        "--no-progress",
        "--seed",
        seed,
        "--root-dir",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    v.push(root.to_str().unwrap().to_string());
    v
}

/// `kv-tier verify ROOT`, within 60 s.
pub(crate) fn verify(root: &Path) -> ChildOutput {
    let child = Command::new(kv_tier_bin())
        .arg("verify")
        .arg(root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    finish(child, Duration::from_secs(60))
}

/// Asserts that `kv-tier verify ROOT` accepts `root` with no damaged block.
pub(crate) fn assert_verifies(root: &Path) {
    let v = verify(root);
    assert_eq!(
        v.code,
        Some(0),
        "kv-tier verify {} refused the root: {}",
        root.display(),
        v.all()
    );
    assert!(v.stdout.contains(" 0 damaged"), "{}", v.all());
}

/// Sends `sig` to `child`.
pub(crate) fn kill(child: &Child, sig: i32) {
    // SAFETY: a plain kill(2) of our own child's pid.
    let r = unsafe { libc::kill(child.id() as i32, sig) };
    assert_eq!(r, 0);
}

/// A run long enough to interrupt: many turns, stopping after `--duration 20`.
pub(crate) fn long_workload(root: &Path) -> Vec<String> {
    let mut v = fs_workload(root, "9");
    let i = v.iter().position(|a| a == "--turns").unwrap();
    v[i + 1] = "100000".into();
    v.extend(["--duration".to_string(), "90".to_string()]);
    v
}

/// Bytes of the .bin files under `root`.
pub(crate) fn blocks_under(root: &Path) -> usize {
    fn walk(p: &Path, n: &mut usize) {
        if let Ok(rd) = std::fs::read_dir(p) {
            for e in rd.flatten() {
                let path = e.path();
                if path.is_dir() {
                    walk(&path, n);
                } else if path.extension().is_some_and(|x| x == "bin") {
                    *n += 1;
                }
            }
        }
    }
    let mut n = 0;
    walk(root, &mut n);
    n
}

/// Runs a long fs workload, sends it `sig` once 50 blocks are written, and checks that it
/// stops within 30 s without a panic and leaves a root that `kv-tier verify` and a second run
/// accept.
pub(crate) fn interrupt_mid_run(sig: i32) {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().join("root");
    let child = spawn(&long_workload(&root));
    wait_until(
        "50 blocks written to interrupt",
        Duration::from_secs(60),
        || blocks_under(&root) >= 50,
    );
    // the run goes on past them a while, so that the signal lands mid-run, stores in flight
    std::thread::sleep(Duration::from_millis(500));
    kill(&child, sig);
    let t = Instant::now();
    let out = finish(child, Duration::from_secs(30));
    assert!(
        !out.timed_out,
        "did not stop within 30 s of the signal: {}",
        out.all()
    );
    assert_ne!(out.code, Some(101), "panicked on the signal: {}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
    eprintln!(
        "stopped {:.1} s after the signal: {:?}/{:?}",
        t.elapsed().as_secs_f64(),
        out.code,
        out.signal
    );
    assert_verifies(&root);
    // a second run on the root accepts it, with no corrupt blocks
    let out = sim(&fs_workload(&root, "9"), 60);
    assert_ok(&out);
    assert_verifies(&root);
}

/// The first number after `label` in `text`'s line that starts with it.
pub(crate) fn figure(text: &str, label: &str) -> f64 {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(label))
        .unwrap_or_else(|| panic!("{label} not in\n{text}"));
    let rest = &line.trim_start()[label.len()..];
    rest.split(|c: char| !(c.is_ascii_digit() || c == '.'))
        .find(|w| !w.is_empty())
        .unwrap()
        .parse()
        .unwrap()
}

/// A loopback port free a moment ago (nothing listens on it now).
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `kv-tier s3-server --root DIR --port P` as the README gives it (on a port the OS picks
/// rather than 9000, which another run on this machine may hold), serving a temp dir.
pub(crate) fn s3_server() -> S3ServerChild {
    S3ServerChild::start_in_temp_dir(&kv_tier_bin())
}
