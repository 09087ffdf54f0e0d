//! The serving-workload simulator: plays an inference engine's scheduler driving
//! `TieringManager` over real tiers, with every loaded block verified byte for byte.
//!
//! [`run`] is the data flow, one module a stage:
//!
//! - `config`: [`SimConfig`], its defaults and the tier config made of it;
//! - `setup`: the fs tier's directory, the manager, typed access to its fs tier, the workload;
//! - `step`: the engine, one scheduler step at a time (admit, look up, load and verify,
//!   store, finish; with `sync_steps`, the fs GC at the end of the step), counting as it goes;
//! - `report`: the [`Report`] made of those counts and the manager's stats, [`render`]ed as
//!   text, and the live progress line;
//! - `attribution`: where every prompt token went (the engine's ledger of each block);
//! - `offline`: the run's trace replayed under LRU, Belady's rule and no bound;
//! - `compare`: two reports side by side ([`render_admission_comparison`]);
//! - `instances`: several instances on one shared fs root ([`run_instances`]).

pub mod attribution;
mod compare;
mod config;
mod instances;
pub mod offline;
mod report;
mod setup;
mod step;

pub use compare::render_admission_comparison;
pub use config::{
    DEFAULT_DRAM_BLOCKS, DEFAULT_FS_BLOCKS, DEFAULT_MAX_WAIT_STEPS, DEFAULT_MODEL, ModelPreset,
    PRESETS, SimConfig, WORKLOADS, WorkloadPreset, preset, workload_preset,
};
pub use instances::{InstanceReport, InstancesReport, child_args, render_instances, run_instances};
pub use report::{
    DiskProbe, GcReport, Inputs, ModelReport, OfflineReport, PerRequest, Report, RestartReport,
    ServerProbe, TierReport, ideal_hit_rate, render,
};

use report::Progress;
use setup::Setup;
use step::Engine;

/// Runs the simulation and returns its report. Fails on a bad config, an I/O error, or a
/// block that came back with wrong bytes.
pub fn run(cfg: &SimConfig) -> Result<Report, Box<dyn std::error::Error>> {
    let wall = std::time::Instant::now();
    let mut setup = Setup::new(cfg)?;
    let inputs = report::Inputs {
        version: env!("CARGO_PKG_VERSION").into(),
        argv: Vec::new(),
        sim: cfg.clone(),
        tiers: setup::effective_tiers(&setup.manager),
    };
    if cfg.progress {
        eprintln!("serve_sim: tiers (effective config): {}", inputs.tiers);
    }
    let mut engine = Engine::new(
        cfg,
        setup.manager.clone(),
        setup.fs.clone(),
        setup::workload(cfg),
    );
    let mut progress = Progress::new(cfg.progress, engine.tally().requests_planned);
    // the stats of the managers a restart shut down
    let mut earlier: Option<kv_tier::ManagerStats> = None;
    while !engine.done() {
        let due = earlier.is_none()
            && (cfg.restart_at.is_some_and(|t| engine.elapsed() >= t)
                || cfg
                    .restart_after
                    .is_some_and(|n| engine.tally().requests >= n));
        if due && engine.pause() {
            engine.drain();
            earlier = Some(setup.manager.stats());
            if cfg.progress {
                eprintln!(
                    "serve_sim: restart after {} requests: shutting the manager down and reopening it on the same root",
                    engine.tally().requests
                );
            }
            let took = setup.restart()?;
            // what the old manager and its tiers reported up to and during its shutdown
            engine.take_events();
            engine.restarted(setup.manager.clone(), setup.fs.clone(), took);
            continue;
        }
        engine.step()?;
        progress.tick(&setup.manager, engine.tally(), engine.elapsed());
        if engine.tally().corrupt() {
            break;
        }
    }
    let seconds = engine.elapsed();
    let drain = engine.drain();
    progress.finish(&setup.manager, engine.tally(), engine.elapsed());
    let tally = engine.into_tally();
    let fs_stats = setup.fs.as_ref().map(|t| t.stats());
    let gc = fs_stats.and_then(|s| s.gc);
    let mut stats = setup.manager.stats();
    if let Some(e) = &earlier {
        report::accumulate(&mut stats, e);
    }
    let mut report = report::fill(cfg, &tally, &stats, gc, seconds, drain);
    report.shared = fs_stats.and_then(|s| s.shared);
    report.inputs = inputs;
    report.disk = setup.disk;
    report.server = setup.server.clone();
    report.blocks_found_at_open = setup.found_at_open;
    setup.teardown(cfg.progress)?;
    tally.check_oracle()?;
    if let Some(path) = &cfg.trace {
        report
            .trace
            .write(path)
            .map_err(|e| format!("--trace {}: {e}", path.display()))?;
    }
    report.wall_seconds = wall.elapsed().as_secs_f64();
    Ok(report)
}
