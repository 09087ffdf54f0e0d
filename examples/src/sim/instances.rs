//! `serve_sim --instances K`: K serve_sim processes on one shared fs root (`shared: true`),
//! each an engine with its own conversations (seed + i) over the same shared prefixes, as
//! replicas behind one load balancer; the global figures: the shared directory's peak
//! allocated bytes against its one cap, wrong blocks, hit rates, the leader lease.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;

type BoxError = Box<dyn std::error::Error>;

/// One instance's outcome.
#[derive(Debug, Clone, Serialize)]
pub struct InstanceReport {
    /// Its `instance_id`.
    pub id: String,
    /// Its workload seed.
    pub seed: u64,
    /// Its own report (serve_sim's `--json`).
    pub report: serde_json::Value,
}

/// The run of several instances.
#[derive(Debug, Clone, Serialize)]
pub struct InstancesReport {
    /// The shared fs root.
    pub root: PathBuf,
    /// The one cap of the shared directory, bytes.
    pub cap_bytes: u64,
    /// The most the shared rank directory held (allocated bytes of its files and
    /// directories, sampled by walks every 100 ms), bytes.
    pub peak_bytes: u64,
    /// Walks sampled.
    pub samples: u64,
    /// Blocks any instance got back with wrong bytes.
    pub blocks_corrupt: u64,
    /// Blocks verified, all instances.
    pub blocks_verified: u64,
    /// Times an instance took the leader lease.
    pub takeovers: u64,
    /// Blocks not stored for lack of credit, all instances.
    pub no_credit: u64,
    /// Seconds of wall time.
    pub wall_seconds: f64,
    /// Each instance.
    pub instances: Vec<InstanceReport>,
}

/// Flags the parent sets for each instance itself (dropped from what it was given).
const OWN_FLAGS: [&str; 7] = [
    "--instances",
    "--instance-id",
    "--seed",
    "--root-dir",
    "--json",
    "--no-progress",
    "--metrics-addr",
];

/// `args` without the flags the parent sets for each instance itself (`--instances`,
/// `--instance-id`, `--seed`, `--root-dir`, `--json`, `--no-progress`, `--metrics-addr`; as
/// `--flag value` or `--flag=value`).
pub fn child_args(args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let name = a.split('=').next().unwrap_or(a);
        if OWN_FLAGS.contains(&name) {
            if !a.contains('=') && name != "--no-progress" {
                it.next();
            }
            continue;
        }
        out.push(a.clone());
    }
    out
}

/// Allocated bytes in the rank directories under `root` (`<namespace>_r<rank>`: what the
/// cap bounds).
fn allocated(root: &Path) -> u64 {
    let is_rank_dir = |name: &str| {
        name.rsplit_once("_r")
            .is_some_and(|(_, r)| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
    };
    std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| is_rank_dir(&e.file_name().to_string_lossy()))
        .map(|e| kv_tier_testkit::allocated_bytes(&e.path()))
        .sum()
}

/// Runs `k` instances of this binary (`exe`) with `args` (see [`child_args`]) on `root`
/// (made if missing), seeds `seed..seed + k`, sampling the directory's size meanwhile.
pub fn run_instances(
    exe: &Path,
    args: &[String],
    root: &Path,
    k: usize,
    seed: u64,
    cap_bytes: u64,
) -> Result<InstancesReport, BoxError> {
    let wall = Instant::now();
    std::fs::create_dir_all(root)?;
    let scratch = tempfile::Builder::new()
        .prefix("kv-tier-sim-instances-")
        .tempdir()?;
    let mut children = Vec::new();
    for i in 0..k {
        let id = format!("sim-{i}");
        let json = scratch.path().join(format!("{id}.json"));
        let log = std::fs::File::create(scratch.path().join(format!("{id}.log")))?;
        let child = Command::new(exe)
            .args(args)
            .arg("--root-dir")
            .arg(root)
            .args(["--instance-id", &id])
            .args(["--seed", &seed.wrapping_add(i as u64).to_string()])
            .arg("--json")
            .arg(&json)
            .arg("--no-progress")
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()?;
        children.push((id, seed.wrapping_add(i as u64), json, child));
    }
    eprintln!(
        "serve_sim: {k} instances on {} (one cap of {:.2} GiB), logs in {}",
        root.display(),
        cap_bytes as f64 / (1u64 << 30) as f64,
        scratch.path().display()
    );
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (stop, peak, root) = (stop.clone(), peak.clone(), root.to_path_buf());
        std::thread::spawn(move || {
            let mut samples = 0u64;
            while !stop.load(Ordering::Relaxed) {
                peak.fetch_max(allocated(&root), Ordering::Relaxed);
                samples += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            samples
        })
    };
    let mut instances = Vec::new();
    let mut failed = Vec::new();
    for (id, seed, json, mut child) in children {
        let status = child.wait()?;
        if !status.success() {
            let log = std::fs::read_to_string(scratch.path().join(format!("{id}.log")))
                .unwrap_or_default();
            failed.push(format!("{id} ({status}): {}", log.trim_end()));
            continue;
        }
        let report: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
        instances.push(InstanceReport { id, seed, report });
    }
    stop.store(true, Ordering::Relaxed);
    let samples = sampler.join().map_err(|_| "the sampler panicked")?;
    if !failed.is_empty() {
        return Err(format!("instances failed:\n{}", failed.join("\n")).into());
    }
    let sum = |f: &dyn Fn(&serde_json::Value) -> Option<u64>| {
        instances.iter().filter_map(|i| f(&i.report)).sum::<u64>()
    };
    Ok(InstancesReport {
        root: root.to_path_buf(),
        cap_bytes,
        peak_bytes: peak.load(Ordering::Relaxed),
        samples,
        blocks_corrupt: sum(&|r| r["blocks_corrupt"].as_u64()),
        blocks_verified: sum(&|r| r["blocks_verified"].as_u64()),
        takeovers: sum(&|r| r["shared"]["takeovers"].as_u64()),
        no_credit: sum(&|r| r["shared"]["no_credit"].as_u64()),
        wall_seconds: wall.elapsed().as_secs_f64(),
        instances,
    })
}

/// The report as text: a line per instance, then the global figures.
pub fn render_instances(r: &InstancesReport) -> String {
    let mut out = String::new();
    out.push_str(&format!(
        "{:<8} {:>9} {:>9} {:>10} {:>8} {:>12} {:>7} {:>10}\n",
        "instance",
        "requests",
        "hit rate",
        "verified",
        "corrupt",
        "fs written",
        "leader",
        "no credit"
    ));
    for i in &r.instances {
        let rep = &i.report;
        let fs_written = rep["tiers"]
            .as_array()
            .and_then(|t| t.iter().find(|t| t["name"] == "fs"))
            .and_then(|t| t["blocks_written_new"].as_u64())
            .unwrap_or(0);
        out.push_str(&format!(
            "{:<8} {:>9} {:>8.1}% {:>10} {:>8} {:>12} {:>7} {:>10}\n",
            i.id,
            rep["requests"].as_u64().unwrap_or(0),
            100.0 * rep["hit_rate"].as_f64().unwrap_or(0.0),
            rep["blocks_verified"].as_u64().unwrap_or(0),
            rep["blocks_corrupt"].as_u64().unwrap_or(0),
            fs_written,
            if rep["shared"]["leader"].as_bool().unwrap_or(false) {
                "yes"
            } else {
                "no"
            },
            rep["shared"]["no_credit"].as_u64().unwrap_or(0),
        ));
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    out.push_str(&format!(
        "global: peak {:.3} GiB of the shared directory = {:.3}x its cap of {:.3} GiB ({} walks); {} blocks verified, {} wrong; leader lease taken {} times; {} blocks refused for lack of credit; {:.1} s\n",
        gib(r.peak_bytes),
        r.peak_bytes as f64 / r.cap_bytes.max(1) as f64,
        gib(r.cap_bytes),
        r.samples,
        r.blocks_verified,
        r.blocks_corrupt,
        r.takeovers,
        r.no_credit,
        r.wall_seconds
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_parents_own_flags_are_dropped_in_both_forms() {
        let args: Vec<String> = [
            "--streams",
            "4",
            "--instances",
            "3",
            "--seed=9",
            "--json",
            "out.json",
            "--no-progress",
            "--fs-cap-gb",
            "1",
            "--root-dir=/x",
            "--metrics-addr",
            "127.0.0.1:0",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(child_args(&args), ["--streams", "4", "--fs-cap-gb", "1"]);
    }
}
