//! `kv-tier`: the operator's command for kv-tier caches, with no engine running.
//!
//! - `kv-tier inspect ROOT`: namespaces with their `config.json`, block counts, allocated
//!   bytes, ages, temp files and orphan sidecars;
//! - `kv-tier verify ROOT [--repair]`: sizes and checksums of every block;
//! - `kv-tier gc ROOT --max-size-gb X [--dry-run] [--list]`: what a sweep would delete,
//!   oldest first (a file deleted by someone else since the walk is reported "already gone",
//!   not an error);
//!
//! The commands that delete (`verify --repair`, `gc`) delete only block files at the
//! layout's paths (`<ns>_r<rank>/<hex3>/<hex2>_g<group>/<hex>.bin`, the name's hex agreeing
//! with its directories), and refuse without `--force` on a root a running tier has open
//! (naming it) and under a namespace without a usable `config.json` (its blocks are
//! reported, not deleted).
//! - `kv-tier config check FILE`: the effective config, or the error naming the field;
//! - `kv-tier s3-server --root DIR --port P`: a local S3 server to try the obj tier.
//!
//! `--json` on the first four prints one JSON document for scripts. Exit status: 0 when
//! all is well, 1 when something is wrong (damaged blocks left, a config refused, an I/O
//! error), 2 for a usage error.

mod config;
mod gc;
mod inspect;
mod live;
mod s3;
mod verify;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// kv-tier: inspect, verify and garbage-collect KV-cache directories; check configs; serve S3
#[derive(Debug, Parser)]
#[command(name = "kv-tier", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Namespaces under ROOT: their config.json, blocks, allocated bytes, ages, temp files,
    /// orphan sidecars
    Inspect {
        /// The fs tier's root_dir
        root: PathBuf,
        /// One JSON document on stdout
        #[arg(long)]
        json: bool,
    },
    /// Checks every block's size and checksum; lists the damaged ones (exit 1 if any is left)
    Verify {
        /// The fs tier's root_dir
        root: PathBuf,
        /// Removes the damaged blocks (a load would refuse them; the next store rewrites them);
        /// refused on a root a running tier has open
        #[arg(long)]
        repair: bool,
        /// With --repair: also on a root in use, and under a namespace without a usable
        /// config.json
        #[arg(long, requires = "repair")]
        force: bool,
        /// The block size, 1 byte to 1 GiB [default: per rank directory, the size most of its
        /// blocks have]
        #[arg(long, value_name = "BYTES", value_parser = block_bytes)]
        block_size: Option<u64>,
        /// One JSON document on stdout
        #[arg(long)]
        json: bool,
    },
    /// Deletes least-recently-used blocks (oldest mtime first) until ROOT is under
    /// --max-size-gb x --low-watermark, as the fs tier's sweep does. Refused on a root a
    /// running tier has open (it names it), unless --force.
    Gc {
        /// The fs tier's root_dir
        root: PathBuf,
        /// The cap for everything under ROOT, in GiB
        #[arg(long, value_name = "X", value_parser = gib)]
        max_size_gb: f64,
        /// Down to this fraction of the cap, in (0, 1]
        #[arg(long, value_name = "F", value_parser = fraction, default_value_t = 0.9)]
        low_watermark: f64,
        /// Says what would be deleted, deletes nothing
        #[arg(long)]
        dry_run: bool,
        /// Lists every block deleted (or, with --dry-run, that would be), oldest first
        #[arg(long)]
        list: bool,
        /// Also on a root in use, and under a namespace without a usable config.json
        #[arg(long)]
        force: bool,
        /// One JSON document on stdout
        #[arg(long)]
        json: bool,
    },
    /// Configs
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// A local S3 server over a directory (each subdirectory a bucket), to try the obj tier
    #[command(name = "s3-server")]
    S3Server(s3::Args),
}

#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Validates a kv-tier config (vLLM's kv_connector_extra_config shape) and prints it as
    /// a manager would use it, defaults filled in (secrets masked); or the error, naming the
    /// field
    Check {
        /// The JSON file
        file: PathBuf,
        /// One JSON document on stdout
        #[arg(long)]
        json: bool,
    },
}

/// A positive, finite number of GiB.
fn gib(v: &str) -> Result<f64, String> {
    let x: f64 = v.parse().map_err(|e| format!("not a number ({e})"))?;
    if !(x.is_finite() && x > 0.0) {
        return Err(format!("must be positive, got {x}"));
    }
    Ok(x)
}

/// A block size: 1 byte to the largest a manager takes (1 GiB).
fn block_bytes(v: &str) -> Result<u64, String> {
    let x: u64 = v
        .parse()
        .map_err(|e| format!("not a number of bytes ({e})"))?;
    let max = kv_tier::core::config::MAX_BLOCK_SIZE;
    if !(1..=max).contains(&x) {
        return Err(format!("must be between 1 and {max} bytes, got {x}"));
    }
    Ok(x)
}

/// A fraction in (0, 1].
fn fraction(v: &str) -> Result<f64, String> {
    let x: f64 = v.parse().map_err(|e| format!("not a number ({e})"))?;
    if !(x > 0.0 && x <= 1.0) {
        return Err(format!("must be in (0, 1], got {x}"));
    }
    Ok(x)
}

/// What a command ends with: all well, something wrong (reported already), or an error to
/// print.
pub(crate) type Outcome = Result<bool, String>;

/// Prints `v` as pretty JSON on stdout.
pub(crate) fn print_json(v: &serde_json::Value) {
    println!(
        "{}",
        serde_json::to_string_pretty(v).expect("a JSON value prints")
    );
}

/// Bytes as MiB or GiB, for people.
pub(crate) fn human(bytes: u64) -> String {
    const MIB: f64 = (1u64 << 20) as f64;
    if bytes >= 1 << 30 {
        format!("{:.2} GiB", bytes as f64 / (MIB * 1024.0))
    } else if bytes >= 1 << 20 {
        format!("{:.1} MiB", bytes as f64 / MIB)
    } else {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let outcome = match cli.command {
        Command::Inspect { root, json } => inspect::run(&root, json),
        Command::Verify {
            root,
            repair,
            force,
            block_size,
            json,
        } => verify::run(&root, repair.then_some(force), block_size, json),
        Command::Gc {
            root,
            max_size_gb,
            low_watermark,
            dry_run,
            list,
            force,
            json,
        } => gc::run(
            &root,
            gc::Sweep {
                max_size_gb,
                low_watermark,
                dry_run,
                force,
            },
            list,
            json,
        ),
        Command::Config {
            command: ConfigCommand::Check { file, json },
        } => config::check(&file, json),
        Command::S3Server(args) => s3::run(args),
    };
    match outcome {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("kv-tier: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn numbers_are_checked() {
        assert!(gib("0").is_err() && gib("-1").is_err() && gib("nan").is_err());
        assert_eq!(gib("1.5"), Ok(1.5));
        assert!(fraction("0").is_err() && fraction("1.01").is_err());
        assert_eq!(fraction("1"), Ok(1.0));
        assert_eq!(human(3 << 20), "3.0 MiB");
        assert_eq!(human(3 << 30), "3.00 GiB");
        assert_eq!(human(16384), "16.0 KiB");
    }
}
