//! `--compare-admission`'s report: two runs of one workload, without and with the fs tier's
//! admission rule, side by side.

use super::config::SimConfig;
use super::report::{Report, size};

/// Two runs of one workload side by side, without and with the fs tier's admission rule:
/// what each tier wrote and what the hit rate paid for it.
pub fn render_admission_comparison(without: &Report, with: &Report) -> String {
    let mut o = String::new();
    o += &format!(
        "admission comparison (same workload, seed {}): without | with ({})\n",
        with.inputs.sim.seed,
        admission_rule(&with.inputs.sim)
    );
    let pct = |r: &Report| format!("{:.1}%", r.hit_rate * 100.0);
    o += &format!(
        "  {:<34} {:>14} | {:>14}\n",
        "hit rate",
        pct(without),
        pct(with)
    );
    o += &format!(
        "  {:<34} {:>14} | {:>14}\n",
        "prefill time saved",
        format!("{:.1} s", without.prefill_seconds_saved),
        format!("{:.1} s", with.prefill_seconds_saved)
    );
    for (a, b) in without.tiers.iter().zip(&with.tiers) {
        let block = |r: &Report| r.inputs.sim.block_bytes() as u64;
        o += &format!(
            "  {:<34} {:>14} | {:>14}\n",
            format!("tier {} written (device)", a.name),
            size(a.blocks_written_new * block(without), 2),
            size(b.blocks_written_new * block(with), 2)
        );
        o += &format!(
            "  {:<34} {:>14} | {:>14}\n",
            format!("tier {} blocks written", a.name),
            a.blocks_written_new,
            b.blocks_written_new
        );
        o += &format!(
            "  {:<34} {:>14} | {:>14}\n",
            format!("tier {} not admitted / over budget", a.name),
            format!("{} / {}", a.not_admitted, a.over_write_budget),
            format!("{} / {}", b.not_admitted, b.over_write_budget)
        );
        o += &format!(
            "  {:<34} {:>14} | {:>14}\n",
            format!("tier {} blocks promoted", a.name),
            a.blocks_loaded,
            b.blocks_loaded
        );
    }
    let written = |r: &Report| r.tiers.iter().map(|t| t.blocks_written_new).sum::<u64>();
    let (wa, wb) = (written(without), written(with));
    if wa > 0 {
        o += &format!(
            "  blocks written to the tiers {:.2}x, hit rate {:+.1} points\n",
            wb as f64 / wa as f64,
            (with.hit_rate - without.hit_rate) * 100.0
        );
    }
    o
}

fn admission_rule(c: &SimConfig) -> String {
    let mut parts = Vec::new();
    if c.fs_admit_after_lookups > 0 {
        parts.push(format!(
            "fs admit_after_lookups {}",
            c.fs_admit_after_lookups
        ));
    }
    if let Some(mb) = c.fs_write_budget_mb_per_s {
        parts.push(format!("fs write_budget_mb_per_s {mb}"));
    }
    if parts.is_empty() {
        "no rule".into()
    } else {
        parts.join(", ")
    }
}
