//! The seeded fault simulation over real tiers (fs in a temp dir, obj on an in-memory store).
//!
//! `cargo run --release -p kv-tier-testkit --example simulate -- --seeds 100`
//!
//! Options: `--seeds N` (default 100), `--seed S` (the first seed, default 1; with `--seeds 1`
//! it replays one seed), `--ops M` (operations per seed, default 10,000), `--faults a,b,...`
//! (kinds of fault: probe-errors, job-errors, delays, hangs, panics, tamper, sweeps, crashes,
//! aborts, races; default all), `--trace N` (operations shown before a violation, default
//! 40), `--jobs J` (seeds run at once, each on its own runtime, default 4: a seed mostly
//! waits for deadlines), `--no-shrink`. The last line is `<N> seeds, <total> operations,
//! <V> violations`; a violation prints its seed, the trace before it, the command that
//! replays it and the fewest kinds of fault that still produce it.

mod world;

use std::io::Write;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kv_tier_testkit::sim::{SimOptions, SimReport, fault, run};

struct Args {
    seeds: u64,
    first: u64,
    ops: u64,
    faults: u32,
    shrink: bool,
    trace: usize,
    jobs: u64,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seeds: 100,
        first: 1,
        ops: 10_000,
        faults: fault::ALL,
        shrink: true,
        trace: 40,
        jobs: 4,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        let num = |name: &str, v: String| {
            v.parse::<u64>()
                .map_err(|_| format!("{name}: {v:?} is not a whole number"))
        };
        match flag.as_str() {
            "--seeds" => a.seeds = num("--seeds", value("--seeds")?)?,
            "--seed" => a.first = num("--seed", value("--seed")?)?,
            "--ops" => a.ops = num("--ops", value("--ops")?)?,
            "--faults" => {
                a.faults = 0;
                for name in value("--faults")?.split(',').filter(|s| !s.is_empty()) {
                    let i = fault::NAMES
                        .iter()
                        .position(|n| *n == name)
                        .ok_or_else(|| {
                            format!(
                                "--faults: unknown kind {name:?}; kinds: {}",
                                fault::NAMES.join(", ")
                            )
                        })?;
                    a.faults |= 1 << i;
                }
            }
            "--trace" => a.trace = num("--trace", value("--trace")?)? as usize,
            "--jobs" => a.jobs = num("--jobs", value("--jobs")?)?.max(1),
            "--no-shrink" => a.shrink = false,
            "-h" | "--help" => {
                println!(
                    "simulate [--seeds N] [--seed S] [--ops M] [--faults a,b,...] [--trace N] [--jobs J] [--no-shrink]\nfault kinds: {}",
                    fault::NAMES.join(", ")
                );
                std::process::exit(0);
            }
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    Ok(a)
}

fn names(faults: u32) -> String {
    let v: Vec<&str> = fault::NAMES
        .iter()
        .enumerate()
        .filter(|(i, _)| faults & (1 << i) != 0)
        .map(|(_, n)| *n)
        .collect();
    if v.is_empty() {
        "none".into()
    } else {
        v.join(",")
    }
}

async fn one(seed: u64, ops: u64, faults: u32, trace: usize) -> SimReport {
    let mut o = SimOptions::new(seed, ops);
    o.faults = faults;
    o.trace_len = trace;
    run(Box::new(world::RealWorld::new()), o).await
}

/// The fewest kinds of fault with which the seed still fails within `ops` operations.
async fn shrink(seed: u64, ops: u64, faults: u32) -> u32 {
    let mut kept = faults;
    for bit in 0..fault::NAMES.len() {
        let without = kept & !(1 << bit);
        if without == kept {
            continue;
        }
        if one(seed, ops, without, 1).await.violation.is_some() {
            kept = without;
        }
    }
    kept
}

/// Panics the fault injectors cause on purpose are not printed (the manager catches them);
/// any other panic is, with the default hook.
pub(crate) fn quiet_injected_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let msg = info
            .payload()
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| info.payload().downcast_ref::<String>().cloned())
            .unwrap_or_default();
        if !msg.starts_with("injected panic") {
            default(info);
        }
    }));
}

fn main() {
    let args = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("simulate: {e}");
            std::process::exit(2);
        }
    };
    quiet_injected_panics();
    let started = Instant::now();
    // Seeds run `--jobs` at a time, each on its own thread and runtime: a seed's time is
    // mostly deadlines running out, not CPU. Each seed's report is printed whole, as it ends.
    let next = AtomicU64::new(args.first);
    let total = AtomicU64::new(0);
    let violations = AtomicU64::new(0);
    let out = Mutex::new(std::io::stdout());
    std::thread::scope(|s| {
        for _ in 0..args.jobs {
            s.spawn(|| {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .enable_all()
                    .build()
                    .expect("runtime");
                loop {
                    let seed = next.fetch_add(1, Ordering::Relaxed);
                    if seed >= args.first + args.seeds {
                        break;
                    }
                    let report = run_seed(&rt, &args, seed);
                    total.fetch_add(report.ops, Ordering::Relaxed);
                    if report.violation {
                        violations.fetch_add(1, Ordering::Relaxed);
                    }
                    let mut out = out.lock().unwrap_or_else(|p| p.into_inner());
                    let _ = out.write_all(report.text.as_bytes());
                    let _ = out.flush();
                }
            });
        }
    });
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
    let violations = violations.into_inner();
    println!(
        "{} seeds, {} operations, {violations} violations",
        args.seeds,
        total.into_inner()
    );
    if violations > 0 {
        std::process::exit(1);
    }
}

struct SeedReport {
    ops: u64,
    violation: bool,
    text: String,
}

/// Runs one seed (and, on a violation, shrinks its fault kinds) and renders its report.
fn run_seed(rt: &tokio::runtime::Runtime, args: &Args, seed: u64) -> SeedReport {
    use std::fmt::Write;
    let t = Instant::now();
    let r = rt.block_on(one(seed, args.ops, args.faults, args.trace));
    let mut text = String::new();
    let _ = writeln!(
        text,
        "seed {seed}: {} ops, {} blocks verified, {} keys audited, {} faults, {} crashes, {:.1} s{}",
        r.ops,
        r.verified_blocks,
        r.audited_keys,
        r.faults_injected,
        r.crashes,
        t.elapsed().as_secs_f64(),
        if r.violation.is_some() {
            ", VIOLATION"
        } else {
            ""
        }
    );
    let violation = r.violation.is_some();
    if let Some(v) = r.violation {
        let _ = writeln!(
            text,
            "  violation at operation {} of seed {seed}: {}",
            v.op, v.what
        );
        for line in &v.trace {
            let _ = writeln!(text, "    {line}");
        }
        let replay_ops = v.op + 1;
        let kinds = if args.shrink {
            let kept = rt.block_on(shrink(seed, replay_ops, args.faults));
            let _ = writeln!(
                text,
                "  fewest fault kinds that still fail: {}",
                names(kept)
            );
            kept
        } else {
            args.faults
        };
        let _ = writeln!(
            text,
            "  replay: cargo run --release -p kv-tier-testkit --example simulate -- --seeds 1 --seed {seed} --ops {replay_ops} --faults {}",
            names(kinds)
        );
    }
    SeedReport {
        ops: r.ops,
        violation,
        text,
    }
}
