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
//! - `compare`: two reports side by side ([`render_admission_comparison`]);
//! - `instances`: several instances on one shared fs root ([`run_instances`]).

mod compare;
mod config;
mod instances;
mod report;
mod setup;
mod step;

pub use compare::render_admission_comparison;
pub use config::{DEFAULT_MODEL, ModelPreset, PRESETS, SimConfig, preset};
pub use instances::{InstanceReport, InstancesReport, child_args, render_instances, run_instances};
pub use report::{DiskProbe, GcReport, Inputs, Report, TierReport, ideal_hit_rate, render};

use report::Progress;
use setup::Setup;
use step::Engine;

/// Runs the simulation and returns its report. Fails on a bad config, an I/O error, or a
/// block that came back with wrong bytes.
pub fn run(cfg: &SimConfig) -> Result<Report, Box<dyn std::error::Error>> {
    let wall = std::time::Instant::now();
    let setup = Setup::new(cfg)?;
    let manager = &setup.manager;
    let inputs = report::Inputs {
        version: env!("CARGO_PKG_VERSION").into(),
        argv: Vec::new(),
        sim: cfg.clone(),
        tiers: setup::effective_tiers(manager),
    };
    if cfg.progress {
        eprintln!("serve_sim: tiers (effective config): {}", inputs.tiers);
    }
    let mut engine = Engine::new(cfg, manager, setup.fs.as_deref(), setup::workload(cfg));
    let mut progress = Progress::new(cfg.progress, engine.tally().requests_planned);
    while !engine.done() {
        engine.step()?;
        progress.tick(manager, engine.tally(), engine.elapsed());
        if engine.tally().corrupt() {
            break;
        }
    }
    let seconds = engine.elapsed();
    let drain = engine.drain();
    progress.finish(manager, engine.tally(), engine.elapsed());
    let tally = engine.into_tally();
    let fs_stats = setup.fs.as_ref().map(|t| t.stats());
    let gc = fs_stats.and_then(|s| s.gc);
    let mut report = report::fill(cfg, &tally, &manager.stats(), gc, seconds, drain);
    report.shared = fs_stats.and_then(|s| s.shared);
    report.inputs = inputs;
    report.disk = setup.disk;
    setup.teardown(cfg.progress)?;
    tally.check_oracle()?;
    report.wall_seconds = wall.elapsed().as_secs_f64();
    Ok(report)
}
