//! Options of the `obj` tier entry.

use kv_tier_core::{Error, Result, TierSpec};
use serde::Deserialize;

/// `http` or `https`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    /// Plain HTTP (test servers, local gateways).
    Http,
    /// HTTPS (the default).
    #[default]
    Https,
}

/// Block integrity checking.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ObjChecksum {
    /// None (the default).
    #[default]
    None,
    /// CRC32C of the block in the object's user metadata (`x-amz-meta-kv-tier-crc32c`),
    /// verified on every load: a mismatch is a miss, the object is deleted and it is counted.
    Crc32c,
}

fn four() -> usize {
    4
}
fn timeout() -> f64 {
    30.0
}
fn retries() -> usize {
    3
}
fn ttl() -> f64 {
    300.0
}
fn watermark() -> f64 {
    0.9
}

/// Options of the `obj` tier (the `secondary_tiers` entry with `"type": "obj"`).
///
/// ```json
/// {"type": "obj", "bucket": "kv-cache", "endpoint_override": "http://127.0.0.1:9000",
///  "access_key": "...", "secret_key": "...", "region": "us-east-1", "scheme": "http",
///  "prefix": "prod", "io_threads": 16, "checksum": "crc32c", "max_size_gb": 500}
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ObjTierConfig {
    /// The bucket.
    pub bucket: String,
    /// An S3-compatible endpoint (MinIO, Ceph, R2, ...) instead of AWS's.
    #[serde(default)]
    pub endpoint_override: Option<String>,
    /// Access key id; empty or absent: the standard AWS credential chain (environment,
    /// profile, instance metadata).
    #[serde(default)]
    pub access_key: Option<String>,
    /// Secret access key (with `access_key`).
    #[serde(default)]
    pub secret_key: Option<String>,
    /// Session token, for temporary credentials.
    #[serde(default)]
    pub session_token: Option<String>,
    /// Region (default `us-east-1`).
    #[serde(default)]
    pub region: Option<String>,
    /// `http` or `https` (default). `http` is required for a plain-HTTP endpoint.
    #[serde(default)]
    pub scheme: Scheme,
    /// A PEM file of extra root certificates (private CAs).
    #[serde(default)]
    pub ca_bundle: Option<String>,
    /// Key prefix inside the bucket (no leading or trailing `/` needed).
    #[serde(default)]
    pub prefix: String,
    /// Bound on concurrent requests (default 4).
    #[serde(default = "four")]
    pub io_threads: usize,
    /// Integrity checking: `"none"` (default) or `"crc32c"`.
    #[serde(default)]
    pub checksum: ObjChecksum,
    /// Per-request timeout in seconds (default 30); a job never runs past
    /// `request_timeout_s x (max_retries + 1)`.
    #[serde(default = "timeout")]
    pub request_timeout_s: f64,
    /// Retries of transient failures (5xx, throttling, connection resets) with backoff
    /// (default 3).
    #[serde(default = "retries")]
    pub max_retries: usize,
    /// Positive existence answers are cached this long, seconds (default 300).
    #[serde(default = "ttl")]
    pub exists_ttl_s: f64,
    /// Capacity bound in GiB of object bytes; absent: unbounded.
    #[serde(default)]
    pub max_size_gb: Option<f64>,
    /// Deletions go down to `max_size_gb x low_watermark` (default 0.9).
    #[serde(default = "watermark")]
    pub low_watermark: f64,
}

impl ObjTierConfig {
    /// A config for `bucket` with defaults.
    pub fn new(bucket: impl Into<String>) -> Self {
        Self {
            bucket: bucket.into(),
            endpoint_override: None,
            access_key: None,
            secret_key: None,
            session_token: None,
            region: None,
            scheme: Scheme::Https,
            ca_bundle: None,
            prefix: String::new(),
            io_threads: 4,
            checksum: ObjChecksum::None,
            request_timeout_s: timeout(),
            max_retries: retries(),
            exists_ttl_s: ttl(),
            max_size_gb: None,
            low_watermark: watermark(),
        }
    }

    /// Parses and validates a tier spec's options.
    pub fn from_spec(spec: &TierSpec) -> Result<Self> {
        let c: Self = spec.parse_options()?;
        c.validate()?;
        Ok(c)
    }

    /// Checks every value; errors name the field.
    pub fn validate(&self) -> Result<()> {
        if self.bucket.is_empty() {
            return Err(Error::config("bucket", "must not be empty"));
        }
        if self.io_threads == 0 || self.io_threads > 1024 {
            return Err(Error::config(
                "io_threads",
                format!("must be between 1 and 1024, got {}", self.io_threads),
            ));
        }
        for (name, v) in [
            ("request_timeout_s", self.request_timeout_s),
            ("exists_ttl_s", self.exists_ttl_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(Error::config(
                    name,
                    format!("must be a positive number, got {v}"),
                ));
            }
        }
        if let Some(gb) = self.max_size_gb
            && !(gb.is_finite() && gb > 0.0)
        {
            return Err(Error::config(
                "max_size_gb",
                format!("must be a positive number, got {gb}"),
            ));
        }
        if !(self.low_watermark > 0.0 && self.low_watermark <= 1.0) {
            return Err(Error::config(
                "low_watermark",
                format!("must be in (0, 1], got {}", self.low_watermark),
            ));
        }
        let has = |v: &Option<String>| v.as_deref().is_some_and(|s| !s.is_empty());
        if has(&self.access_key) != has(&self.secret_key) {
            return Err(Error::config(
                if has(&self.access_key) {
                    "secret_key"
                } else {
                    "access_key"
                },
                "access_key and secret_key go together (leave both empty for the AWS credential chain)",
            ));
        }
        if let Some(e) = &self.endpoint_override
            && !(e.starts_with("http://") || e.starts_with("https://"))
        {
            return Err(Error::config(
                "endpoint_override",
                format!("must be an http:// or https:// URL, got {e:?}"),
            ));
        }
        if self.prefix.contains("//") {
            return Err(Error::config("prefix", "must not contain \"//\""));
        }
        Ok(())
    }

    /// The key prefix, normalized: no leading or trailing `/`.
    pub fn normalized_prefix(&self) -> &str {
        self.prefix.trim_matches('/')
    }
}
