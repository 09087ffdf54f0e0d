//! Options of the `fs` tier entry.

use std::path::PathBuf;

use kv_tier_core::{Error, Result, TierSpec};
use serde::Deserialize;

/// Block integrity checking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Checksum {
    /// No checksum (the default; vLLM's fs tier keeps none).
    #[default]
    None,
    /// CRC32C of the block, kept in the extended attribute `user.kv_tier.crc32c` (or, where
    /// the filesystem has no user xattrs, in a sidecar file `<hex>.bin.crc32c`), verified on
    /// every load. The `.bin` bytes are unchanged.
    Crc32c,
}

fn sixteen() -> usize {
    16
}
fn yes() -> bool {
    true
}
fn reap_age() -> u64 {
    600
}

/// Options of the `fs` tier (the `secondary_tiers` entry with `"type": "fs"`).
///
/// ```json
/// {"type": "fs", "root_dir": "/mnt/nvme/kv", "n_read_threads": 16, "n_write_threads": 16,
///  "checksum": "crc32c", "fsync": false, "direct_io": true, "tmp_reap_age_s": 600}
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FsTierConfig {
    /// The cache directory (shared with vLLM's fs tier if pointed at the same place).
    /// Created if missing; must be a writable directory.
    pub root_dir: PathBuf,
    /// Threads that take loads (and lookups) first, then stores when idle. Default 16.
    #[serde(default = "sixteen")]
    pub n_read_threads: usize,
    /// Threads that take stores first, then loads when idle. Default 16.
    #[serde(default = "sixteen")]
    pub n_write_threads: usize,
    /// Integrity checking, `"none"` (default) or `"crc32c"`.
    #[serde(default)]
    pub checksum: Checksum,
    /// `fsync` every block file and its directory before a store reports success. Off by
    /// default: it costs a device flush per block (tens to hundreds of microseconds on NVMe,
    /// milliseconds on network disks) and only matters for power loss, not process crashes.
    #[serde(default)]
    pub fsync: bool,
    /// Use `O_DIRECT` where the filesystem supports it (probed once at open; buffered I/O is
    /// the logged fallback). Default true.
    #[serde(default = "yes")]
    pub direct_io: bool,
    /// At open, `.tmp` files of killed writers older than this many seconds are deleted.
    /// Default 600. A live writer's temp file exists for milliseconds.
    #[serde(default = "reap_age")]
    pub tmp_reap_age_s: u64,
}

impl FsTierConfig {
    /// Options with defaults for `root_dir`.
    pub fn new(root_dir: impl Into<PathBuf>) -> Self {
        Self {
            root_dir: root_dir.into(),
            n_read_threads: 16,
            n_write_threads: 16,
            checksum: Checksum::None,
            fsync: false,
            direct_io: true,
            tmp_reap_age_s: reap_age(),
        }
    }

    /// Parses and validates a tier spec's options.
    pub fn from_spec(spec: &TierSpec) -> Result<Self> {
        let cfg: Self = spec.parse_options()?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks every value; errors name the field.
    pub fn validate(&self) -> Result<()> {
        if self.root_dir.as_os_str().is_empty() {
            return Err(Error::config("root_dir", "must not be empty"));
        }
        for (name, v) in [
            ("n_read_threads", self.n_read_threads),
            ("n_write_threads", self.n_write_threads),
        ] {
            if v == 0 || v > 1024 {
                return Err(Error::config(
                    name,
                    format!("must be between 1 and 1024, got {v}"),
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> Result<FsTierConfig> {
        let v: serde_json::Value = serde_json::from_str(json).unwrap();
        let mut spec = TierSpec::new("fs");
        spec.options = v.as_object().unwrap().clone();
        FsTierConfig::from_spec(&spec)
    }

    fn field(json: &str) -> String {
        match parse(json).unwrap_err() {
            Error::InvalidConfig { field, .. } => field,
            e => panic!("{e}"),
        }
    }

    #[test]
    fn defaults_and_bad_values() {
        let c = parse(r#"{"root_dir": "/x"}"#).unwrap();
        assert_eq!(
            (c.n_read_threads, c.n_write_threads, c.fsync, c.direct_io),
            (16, 16, false, true)
        );
        assert_eq!(c.checksum, Checksum::None);
        assert_eq!(field(r#"{}"#), "root_dir");
        assert_eq!(field(r#"{"root_dir": ""}"#), "root_dir");
        assert_eq!(
            field(r#"{"root_dir": "/x", "n_read_threads": 0}"#),
            "n_read_threads"
        );
        assert_eq!(
            field(r#"{"root_dir": "/x", "n_write_threads": -2}"#),
            "n_write_threads"
        );
        assert_eq!(
            field(r#"{"root_dir": "/x", "checksum": "md5"}"#),
            "checksum"
        );
        assert_eq!(field(r#"{"root_dir": "/x", "fsync": "yes"}"#), "fsync");
        assert_eq!(field(r#"{"root_dir": "/x", "root": "/y"}"#), "root");
    }
}
