//! The seeded fault simulation over real tiers (fs in a temp dir, obj on an in-memory store).
//!
//! `cargo run --release -p kv-tier-testkit --example simulate -- --seeds 100`
//!
//! Options: `--seeds N` (default 100), `--seed S` (the first seed, default 1; with `--seeds 1`
//! it replays one seed), `--ops M` (operations per seed, default 10,000), `--faults a,b,...`
//! (kinds of fault: probe-errors, job-errors, delays, hangs, panics, tamper, sweeps, crashes,
//! aborts; default all), `--no-shrink`. The last line is `<N> seeds, <total> operations,
//! <V> violations`; a violation prints its seed, the trace before it, the command that
//! replays it and the fewest kinds of fault that still produce it.

mod world;

use std::time::Instant;

use kv_tier_testkit::sim::{SimOptions, SimReport, fault, run};

struct Args {
    seeds: u64,
    first: u64,
    ops: u64,
    faults: u32,
    shrink: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        seeds: 100,
        first: 1,
        ops: 10_000,
        faults: fault::ALL,
        shrink: true,
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
            "--no-shrink" => a.shrink = false,
            "-h" | "--help" => {
                println!(
                    "simulate [--seeds N] [--seed S] [--ops M] [--faults a,b,...] [--no-shrink]\nfault kinds: {}",
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

async fn one(seed: u64, ops: u64, faults: u32) -> SimReport {
    let mut o = SimOptions::new(seed, ops);
    o.faults = faults;
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
        if one(seed, ops, without).await.violation.is_some() {
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
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let started = Instant::now();
    let (mut total, mut violations) = (0u64, 0u64);
    for seed in args.first..args.first + args.seeds {
        let t = Instant::now();
        let r = rt.block_on(one(seed, args.ops, args.faults));
        total += r.ops;
        println!(
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
        if let Some(v) = r.violation {
            violations += 1;
            println!(
                "  violation at operation {} of seed {seed}: {}",
                v.op, v.what
            );
            for line in &v.trace {
                println!("    {line}");
            }
            let replay_ops = v.op + 1;
            if args.shrink {
                let kept = rt.block_on(shrink(seed, replay_ops, args.faults));
                println!("  fewest fault kinds that still fail: {}", names(kept));
                println!(
                    "  replay: cargo run --release -p kv-tier-testkit --example simulate -- --seeds 1 --seed {seed} --ops {replay_ops} --faults {}",
                    names(kept)
                );
            } else {
                println!(
                    "  replay: cargo run --release -p kv-tier-testkit --example simulate -- --seeds 1 --seed {seed} --ops {replay_ops} --faults {}",
                    names(args.faults)
                );
            }
        }
    }
    eprintln!("took {:.1} s", started.elapsed().as_secs_f64());
    println!(
        "{} seeds, {total} operations, {violations} violations",
        args.seeds
    );
    if violations > 0 {
        std::process::exit(1);
    }
}
