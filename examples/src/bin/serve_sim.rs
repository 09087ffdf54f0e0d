//! serve_sim: plays an inference engine's scheduler over kv-tier's real tiers (DRAM, fs in a
//! temp dir with a GC cap) on a multi-turn, prefix-sharing workload, with a live progress line
//! and a report. Every block loaded from any tier is verified byte for byte.
//!
//! `cargo run --release -p kv-tier-examples --bin serve_sim -- --help`

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use kv_tier_examples::sim::{SimConfig, render, run};

const HELP: &str = "\
serve_sim: a serving-workload simulator over kv-tier's tiers

USAGE: serve_sim [OPTIONS]

Workload:
  --streams N              concurrent conversations [64]
  --turns N                turns per conversation [5]
  --prefixes N             shared prefixes in the pool [4 x streams]
  --prefix-tokens N        tokens per shared prefix [10000]
  --prompt-tokens N        new prompt tokens per turn [4096]
  --output-tokens N        output tokens per turn [512]
  --tokens-per-block N     tokens per block [16]
  --seed N                 workload seed [1]
  --duration SECONDS       stop admitting turns after this long [70]
Model shape (block bytes = layers x kv-heads x head-dim x dtype-bytes x 2 x tokens-per-block):
  --layers N [1]  --kv-heads N [2]  --head-dim N [64]  --dtype-bytes N [2]
Engine:
  --gpu-cache-blocks N     simulated GPU prefix cache [4096]
  --max-batch N            requests scheduled at once [16]
  --prefill-tokens-per-s X simulated prefill speed of missed tokens [200000]
Tiers:
  --dram-mb N              DRAM for the primary tier [512]
  --root-dir DIR           the fs tier's directory [a fresh temp dir]
  --fs-cap-gb X            the fs tier's GC cap in GiB, 0 for none [0.75]
  --s3-endpoint URL        also an obj tier below fs, on this S3 endpoint [none]
  --s3-bucket NAME         its bucket [kv-tier]
  --s3-access-key KEY      its access key [the AWS credential chain]
  --s3-secret-key KEY      its secret key
  --s3-region REGION       its region [us-east-1]
  --config FILE            a vLLM-shaped tier config JSON instead of the flags above
Output:
  --json FILE              also write the report as JSON
  --sync-steps             wait for every transfer at each step (same seed, same counts)
  --no-progress            no progress line
  -h, --help               this text
";

fn parse(args: &[String]) -> Result<(SimConfig, Option<PathBuf>), String> {
    let mut c = SimConfig::default();
    let mut prefixes_set = false;
    let mut json = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let mut value = |name: &str| -> Result<String, String> {
            it.next()
                .cloned()
                .ok_or_else(|| format!("{name} needs a value (see --help)"))
        };
        fn num<T: std::str::FromStr>(name: &str, v: String) -> Result<T, String> {
            v.parse()
                .map_err(|_| format!("{name}: {v:?} is not a valid number"))
        }
        match flag.as_str() {
            "-h" | "--help" => return Err(String::new()),
            "--streams" => c.streams = num(flag, value(flag)?)?,
            "--turns" => c.turns = num(flag, value(flag)?)?,
            "--prefixes" => {
                c.prefixes = num(flag, value(flag)?)?;
                prefixes_set = true;
            }
            "--prefix-tokens" => c.prefix_tokens = num(flag, value(flag)?)?,
            "--prompt-tokens" => c.prompt_tokens = num(flag, value(flag)?)?,
            "--output-tokens" => c.output_tokens = num(flag, value(flag)?)?,
            "--tokens-per-block" => c.tokens_per_block = num(flag, value(flag)?)?,
            "--seed" => c.seed = num(flag, value(flag)?)?,
            "--duration" => {
                let s: f64 = num(flag, value(flag)?)?;
                if !(s.is_finite() && s > 0.0) {
                    return Err(format!("--duration must be positive, got {s}"));
                }
                c.duration = Duration::from_secs_f64(s);
            }
            "--layers" => c.layers = num(flag, value(flag)?)?,
            "--kv-heads" => c.kv_heads = num(flag, value(flag)?)?,
            "--head-dim" => c.head_dim = num(flag, value(flag)?)?,
            "--dtype-bytes" => c.dtype_bytes = num(flag, value(flag)?)?,
            "--gpu-cache-blocks" => c.gpu_cache_blocks = num(flag, value(flag)?)?,
            "--max-batch" => c.max_batch = num(flag, value(flag)?)?,
            "--prefill-tokens-per-s" => c.prefill_tokens_per_s = num(flag, value(flag)?)?,
            "--dram-mb" => {
                let mb: u64 = num(flag, value(flag)?)?;
                c.dram_bytes = mb << 20;
            }
            "--root-dir" => c.root_dir = Some(PathBuf::from(value(flag)?)),
            "--fs-cap-gb" => {
                let gb: f64 = num(flag, value(flag)?)?;
                if !(gb.is_finite() && gb >= 0.0) {
                    return Err(format!("--fs-cap-gb must be 0 or positive, got {gb}"));
                }
                c.fs_cap_gb = (gb > 0.0).then_some(gb);
            }
            "--config" => {
                let path = value(flag)?;
                c.config_json = Some(
                    std::fs::read_to_string(&path).map_err(|e| format!("--config {path}: {e}"))?,
                );
            }
            "--json" => json = Some(PathBuf::from(value(flag)?)),
            "--s3-endpoint" => c.s3_endpoint = Some(value(flag)?),
            "--s3-bucket" => c.s3_bucket = value(flag)?,
            "--s3-access-key" => c.s3_access_key = value(flag)?,
            "--s3-secret-key" => c.s3_secret_key = value(flag)?,
            "--s3-region" => c.s3_region = value(flag)?,
            "--sync-steps" => c.sync_steps = true,
            "--no-progress" => c.progress = false,
            other => return Err(format!("unknown option {other:?} (see --help)")),
        }
    }
    if !prefixes_set {
        c.prefixes = 4 * c.streams.max(1);
    }
    for (name, v) in [
        ("--streams", c.streams),
        ("--turns", c.turns),
        ("--tokens-per-block", c.tokens_per_block),
        ("--layers", c.layers),
        ("--kv-heads", c.kv_heads),
        ("--head-dim", c.head_dim),
        ("--dtype-bytes", c.dtype_bytes),
        ("--max-batch", c.max_batch),
        ("--prefixes", c.prefixes),
    ] {
        if v == 0 {
            return Err(format!("{name} must be positive"));
        }
    }
    Ok((c, json))
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cfg, json) = match parse(&args) {
        Ok(v) => v,
        Err(msg) if msg.is_empty() => {
            print!("{HELP}");
            return ExitCode::SUCCESS;
        }
        Err(msg) => {
            eprintln!("serve_sim: {msg}");
            return ExitCode::from(2);
        }
    };
    eprintln!(
        "serve_sim: {} streams x {} turns, blocks of {} KiB, DRAM {} MiB, fs cap {}",
        cfg.streams,
        cfg.turns,
        cfg.block_bytes() >> 10,
        cfg.dram_bytes >> 20,
        cfg.fs_cap_gb
            .map_or("none".to_string(), |g| format!("{g} GiB"))
    );
    match run(&cfg) {
        Ok(report) => {
            print!("{}", render(&report));
            if let Some(path) = json {
                let text = serde_json::to_string_pretty(&report).expect("report serializes");
                if let Err(e) = std::fs::write(&path, text + "\n") {
                    eprintln!("serve_sim: --json {}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("serve_sim: {e}");
            ExitCode::FAILURE
        }
    }
}
