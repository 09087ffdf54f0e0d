//! Options of the `obj` tier entry.

use std::time::Duration;

use kv_tier_core::config::{check_range, check_range_u64};
use kv_tier_core::{Error, Result, TierSpec};
use serde::Deserialize;

/// `http` or `https`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    /// Plain HTTP (test servers, local gateways).
    Http,
    /// HTTPS (the default).
    #[default]
    Https,
}

/// Block integrity checking (`"checksum"`): with `crc32c`, the CRC is kept in the object's
/// user metadata (`x-amz-meta-kv-tier-crc32c`) and verified on every load; a mismatch is a
/// miss, the object is deleted and it is counted. The same type as the fs tier's.
pub use kv_tier_core::Checksum as ObjChecksum;

/// The documented range of every numeric option, checked by [`ObjTierConfig::validate`]:
/// `(field, min, max)`, both ends included.
pub const RANGES: &[(&str, f64, f64)] = &[
    ("io_threads", 1.0, 1024.0),
    ("request_timeout_s", 0.01, 3_600.0),
    ("max_retries", 0.0, 100.0),
    ("exists_ttl_s", 0.001, 604_800.0),
    ("absent_ttl_s", 0.0, 3_600.0),
    ("lookup_timeout_s", 0.001, 3_600.0),
    ("max_size_gb", 1e-9, 1e9),
    ("low_watermark", 1e-9, 1.0),
    ("shared_lease_s", 0.1, 600.0),
];

/// The keys of vLLM's obj `store_config`, taken here beside the tier's other options.
pub const STORE_CONFIG_KEYS: [&str; 8] = [
    "bucket",
    "endpoint_override",
    "access_key",
    "secret_key",
    "session_token",
    "region",
    "scheme",
    "ca_bundle",
];

/// Keys of newer versions of vLLM's `store_config` (options of its NIXL object backend)
/// that kv-tier does not implement, with why.
const NIXL_KEYS: [(&str, &str); 6] = [
    (
        "use_virtual_addressing",
        "the S3 client here addresses buckets by path (what S3-compatible servers expect)",
    ),
    (
        "req_checksum",
        "integrity is the tier's own \"checksum\": \"crc32c\" (kept in the object's metadata)",
    ),
    (
        "resp_checksum",
        "integrity is the tier's own \"checksum\": \"crc32c\" (kept in the object's metadata)",
    ),
    ("accelerated", "S3 Transfer Acceleration is not supported"),
    (
        "type",
        "the store is S3 or S3-compatible (or any object_store through ObjTier::with_store)",
    ),
    (
        "backend_params",
        "NIXL backend parameters have no meaning here",
    ),
];

fn range(field: &str) -> (f64, f64) {
    RANGES
        .iter()
        .find(|r| r.0 == field)
        .map_or((f64::NAN, f64::NAN), |r| (r.1, r.2))
}

/// Options of the `obj` tier (the `secondary_tiers` entry with `"type": "obj"`).
///
/// ```json
/// {"type": "obj", "bucket": "kv-cache", "endpoint_override": "http://127.0.0.1:9000",
///  "access_key": "...", "secret_key": "...", "region": "us-east-1", "scheme": "http",
///  "prefix": "prod", "io_threads": 16, "checksum": "crc32c", "max_size_gb": 500}
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct ObjTierConfig {
    /// The bucket: 1 to 255 of letters, digits, `.`, `_` and `-`, beginning and ending with a
    /// letter or digit, no two dots in a row (see [`check_bucket`]).
    pub bucket: String,
    /// An S3-compatible endpoint (MinIO, Ceph, R2, ...) instead of AWS's.
    pub endpoint_override: Option<String>,
    /// Access key id; empty or absent: the standard AWS credential chain (environment,
    /// profile, instance metadata).
    pub access_key: Option<String>,
    /// Secret access key (with `access_key`).
    pub secret_key: Option<String>,
    /// Session token, for temporary credentials.
    pub session_token: Option<String>,
    /// Region (default `us-east-1`).
    pub region: Option<String>,
    /// `http` or `https` (default). `http` is required for a plain-HTTP endpoint.
    pub scheme: Scheme,
    /// A PEM file of extra root certificates (private CAs).
    pub ca_bundle: Option<String>,
    /// Key prefix inside the bucket (no leading or trailing `/` needed; at most 768 bytes, and
    /// short enough that a block's whole key fits S3's 1,024 bytes with the namespace's
    /// directory, checked when the tier opens).
    pub prefix: String,
    /// Bound on concurrent requests of each kind (default 4, range 1 to 1,024): a lookup's
    /// HEADs, reads (GET, LIST), and writes (PUT, DELETE), of which a quarter (at least one)
    /// start while reads wait or run: see the crate's README, "Reads before write-back".
    pub io_threads: usize,
    /// Integrity checking: `"none"` (default) or `"crc32c"`. The checksum covers the block's
    /// key and its bytes (an object copied to another key's path fails there) and is kept
    /// in the object's metadata.
    pub checksum: ObjChecksum,
    /// With checksums on, also serve objects that carry no checksum (written by another
    /// program, e.g. vLLM's obj tier, or before checksums were turned on): served
    /// UNVERIFIED, and counted. Off by default: such an object is a miss, and is deleted so
    /// the next store rewrites it with a checksum. A malformed or mismatching checksum is
    /// refused either way.
    pub accept_unverified: bool,
    /// Per-attempt timeout in seconds (default 5, range 0.01 to 3,600). Every request (HEAD,
    /// PUT, GET with its body, DELETE, LIST page) ends within its deadline,
    /// [`ObjTierConfig::request_deadline`]: `request_timeout_s x (max_retries + 1)` plus the
    /// backoff between attempts. A job is one request per block (two where the store has no
    /// create-only writes), at most `io_threads` at once, so it ends within about
    /// `ceil(blocks / io_threads)` deadlines: its time scales with its size, and a block whose
    /// request passed its deadline fails alone.
    ///
    /// Keep the tier's deadlines below the manager's (`job_timeout_s`, `probe_timeout_s`), so
    /// the tier ends its own calls and reports exactly what it did, and the manager's
    /// deadline stays the backstop: with the defaults a request ends within 20 s (5 s x 3
    /// attempts + backoff) and a lookup within 0.8 s, below the manager's 30 s and 1 s.
    pub request_timeout_s: f64,
    /// Retries of transient failures (5xx, throttling, connection resets) with backoff
    /// (default 2, range 0 to 100).
    pub max_retries: usize,
    /// Positive existence answers are cached this long, seconds (default 300, range 0.001 to
    /// 604,800). The cache answers lookups only: a store always writes, or has the backend
    /// confirm the object exists, before it reports a key stored.
    pub exists_ttl_s: f64,
    /// An unbounded tier (not `shared`) LISTs the rank's objects in the background, every
    /// half of this many seconds, and answers "absent" without a request for a key its last
    /// LIST did not find, for this long after that LIST began (default 5, range 0 to 3,600;
    /// 0: no LIST, every key the existence cache does not hold is asked for with a HEAD).
    /// A key this tier stores is never answered absent from it. Another writer's new
    /// objects are found within this
    /// long. A LIST that takes longer than a hundredth of this is followed by the next only
    /// fifty times its own time later (meanwhile the listing ages out and lookups ask); a rank
    /// of more than 1,048,576 objects is not listed again. (A bounded tier answers from its
    /// capacity index instead.)
    pub absent_ttl_s: f64,
    /// A lookup answers within this many seconds (default 0.8, range 0.001 to 3,600): keys
    /// whose HEAD has not answered by then count as absent (and are counted in the stats).
    pub lookup_timeout_s: f64,
    /// Capacity bound in GiB of object bytes (range 1e-9 to 1e9); absent: unbounded.
    pub max_size_gb: Option<f64>,
    /// Deletions go down to `max_size_gb x low_watermark` (default 0.9, range (0, 1]).
    pub low_watermark: f64,
    /// Several instances (processes, hosts) on one bucket and prefix under one bound:
    /// `max_size_gb` is the bound of the rank's objects as a whole, and one instance at a
    /// time (the leader, by a lease object written with conditional PUTs) keeps the index of
    /// every instance's objects and deletes the least recently used for all. Needs
    /// `max_size_gb` and a store with conditional writes (`If-None-Match` / `If-Match`: S3
    /// since 2024, MinIO, R2, GCS; the protocol and its failure modes are in the crate's
    /// README, "Shared bucket").
    pub shared: bool,
    /// Shared bucket: the leader lease's period in seconds (default 10, range 0.1 to 600).
    /// The leader renews it four times per period; an instance that sees it unchanged for a
    /// whole period (by its own clock) takes it over.
    pub shared_lease_s: Option<f64>,
    /// Shared bucket: this instance's name in the coordination objects (letters, digits,
    /// `.`, `_`, `-`; 1 to 64). Default `<host>-<pid>-<random>`; unique among the instances
    /// sharing the bucket.
    pub instance_id: Option<String>,
}

impl Default for ObjTierConfig {
    /// The defaults, with an empty `bucket` (which `validate` refuses: it must be given).
    fn default() -> Self {
        Self {
            bucket: String::new(),
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
            accept_unverified: false,
            request_timeout_s: 5.0,
            max_retries: 2,
            exists_ttl_s: 300.0,
            absent_ttl_s: 5.0,
            lookup_timeout_s: 0.8,
            max_size_gb: None,
            low_watermark: 0.9,
            shared: false,
            shared_lease_s: None,
            instance_id: None,
        }
    }
}

/// The shared bucket's lease period when `shared_lease_s` is not given.
const SHARED_LEASE_S: f64 = 10.0;

impl kv_tier_core::registry::EffectiveOptions for ObjTierConfig {
    /// As serialised, with the lease period a shared bucket uses when none is given.
    fn effective_options(&self) -> (serde_json::Value, Vec<&'static str>) {
        let mut v = serde_json::to_value(self).expect("a config serializes");
        if self.shared && self.shared_lease_s.is_none() {
            v["shared_lease_s"] = SHARED_LEASE_S.into();
            return (v, vec!["shared_lease_s"]);
        }
        (v, Vec::new())
    }
}

impl ObjTierConfig {
    /// A config for `bucket` with defaults.
    pub fn new(bucket: impl Into<String>) -> Self {
        Self {
            bucket: bucket.into(),
            ..Self::default()
        }
    }

    /// Parses and validates a tier spec's options. The connection may be given flat or, as
    /// vLLM's obj tier takes it, nested in `store_config` (`bucket`, `endpoint_override`,
    /// `access_key`, `secret_key`, `session_token`, `region`, `scheme`, `ca_bundle`; empty
    /// strings mean unset, and `scheme` defaults to `"http"` there, as in vLLM); a key given
    /// both ways is refused.
    pub fn from_spec(spec: &TierSpec) -> Result<Self> {
        let mut options = spec.options.clone();
        let nested = options.remove("store_config");
        let mut nested_keys: Vec<String> = Vec::new();
        if let Some(nested) = nested {
            let serde_json::Value::Object(nested) = nested else {
                return Err(Error::config(
                    "store_config",
                    format!("must be an object (vLLM's store_config), got {nested}"),
                ));
            };
            for (k, v) in nested {
                if let Some((_, why)) = NIXL_KEYS.iter().find(|(n, _)| *n == k) {
                    return Err(Error::config(
                        format!("store_config.{k}"),
                        format!(
                            "an option of vLLM's NIXL object backend kv-tier does not implement: {why}"
                        ),
                    ));
                }
                if !STORE_CONFIG_KEYS.contains(&k.as_str()) {
                    return Err(Error::config(
                        format!("store_config.{k}"),
                        format!(
                            "unknown key (check the spelling); store_config takes {}",
                            STORE_CONFIG_KEYS.join(", ")
                        ),
                    ));
                }
                if options.contains_key(&k) {
                    return Err(Error::config(
                        format!("store_config.{k}"),
                        "given twice: in store_config and beside it; keep one",
                    ));
                }
                nested_keys.push(k.clone());
                options.insert(k, v);
            }
        }
        let vllm_shape = !nested_keys.is_empty();
        // vLLM writes "" for unset values, and its scheme defaults to http
        if options
            .get("scheme")
            .is_some_and(|v| v.as_str() == Some(""))
        {
            options.remove("scheme");
        }
        if vllm_shape && !options.contains_key("scheme") {
            options.insert("scheme".into(), "http".into());
        }
        // vLLM's endpoint_override is a host[:port], its scheme apart
        if let Some(serde_json::Value::String(e)) = options.get("endpoint_override")
            && !e.is_empty()
            && !e.contains(['/', '@', '?', '#'])
        {
            let scheme = match options.get("scheme").and_then(|v| v.as_str()) {
                Some(s) => s.to_ascii_lowercase(),
                None => "https".into(),
            };
            let url = format!("{scheme}://{e}");
            options.insert("endpoint_override".into(), url.into());
        }
        let rename = |e: Error| match e {
            // an error about a connection key names it in store_config when the config
            // uses that form and did not write the key flat
            Error::InvalidConfig { field, reason }
                if nested_keys.contains(&field)
                    || (vllm_shape
                        && STORE_CONFIG_KEYS.contains(&field.as_str())
                        && !spec.options.contains_key(&field)) =>
            {
                Error::config(format!("store_config.{field}"), reason)
            }
            e => e,
        };
        let mut c: Self = kv_tier_core::config::parse_tier_options(options).map_err(rename)?;
        for v in [
            &mut c.endpoint_override,
            &mut c.access_key,
            &mut c.secret_key,
            &mut c.session_token,
            &mut c.region,
            &mut c.ca_bundle,
        ] {
            if v.as_deref() == Some("") {
                *v = None;
            }
        }
        c.validate().map_err(rename)?;
        Ok(c)
    }

    /// Checks every value; errors name the field.
    pub fn validate(&self) -> Result<()> {
        if self.bucket.is_empty() {
            return Err(Error::config("bucket", "must not be empty"));
        }
        let int = |field: &str, v: usize| {
            let (min, max) = range(field);
            check_range_u64(field, v as u64, min as u64, max as u64)
        };
        int("io_threads", self.io_threads)?;
        int("max_retries", self.max_retries)?;
        let mut reals = vec![
            ("request_timeout_s", self.request_timeout_s),
            ("exists_ttl_s", self.exists_ttl_s),
            ("absent_ttl_s", self.absent_ttl_s),
            ("lookup_timeout_s", self.lookup_timeout_s),
            ("low_watermark", self.low_watermark),
        ];
        if let Some(gb) = self.max_size_gb {
            reals.push(("max_size_gb", gb));
        }
        for (field, v) in reals {
            let (min, max) = range(field);
            check_range(field, v, min, max)?;
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
        check_bucket(&self.bucket)?;
        // they go into request headers and signatures: printable ASCII only
        for (field, v) in [
            ("region", &self.region),
            ("access_key", &self.access_key),
            ("secret_key", &self.secret_key),
            ("session_token", &self.session_token),
        ] {
            if let Some(v) = v
                && let Some(c) = v.chars().find(|c| !(c.is_ascii_graphic()))
            {
                return Err(Error::config(
                    field,
                    format!("must be printable ASCII without spaces, found {c:?}"),
                ));
            }
        }
        if let Some(e) = &self.endpoint_override {
            check_endpoint(e)?;
        }
        if self.prefix.contains("//") {
            return Err(Error::config("prefix", "must not contain \"//\""));
        }
        if self.normalized_prefix().len() > MAX_PREFIX_BYTES {
            return Err(Error::config(
                "prefix",
                format!(
                    "is {} bytes: S3 keys are at most {MAX_KEY_BYTES} bytes and a block's path \
                     under the prefix takes up to a few hundred, so the prefix may take \
                     {MAX_PREFIX_BYTES}",
                    self.normalized_prefix().len()
                ),
            ));
        }
        self.validate_shared()
    }

    fn validate_shared(&self) -> Result<()> {
        if !self.shared {
            for (name, set) in [
                ("shared_lease_s", self.shared_lease_s.is_some()),
                ("instance_id", self.instance_id.is_some()),
            ] {
                if set {
                    return Err(Error::config(
                        name,
                        "is set but shared is not: it only applies to a shared bucket",
                    ));
                }
            }
            return Ok(());
        }
        if self.max_size_gb.is_none() {
            return Err(Error::config(
                "shared",
                "needs max_size_gb: a shared bucket is one bounded set of objects",
            ));
        }
        if let Some(v) = self.shared_lease_s {
            let (min, max) = range("shared_lease_s");
            check_range("shared_lease_s", v, min, max)?;
        }
        if let Some(id) = &self.instance_id {
            kv_tier_core::config::check_instance_id("instance_id", id)?;
        }
        Ok(())
    }

    /// The shared bucket's lease period (`shared_lease_s`, default 10 s).
    pub fn shared_lease(&self) -> Duration {
        Duration::from_secs_f64(self.shared_lease_s.unwrap_or(SHARED_LEASE_S))
    }

    /// How long one request may take, retries and backoff included: `request_timeout_s x
    /// (max_retries + 1)` plus the backoff between attempts (at most 2 s each) plus 1 s.
    /// Call after [`ObjTierConfig::validate`].
    pub fn request_deadline(&self) -> Duration {
        let attempts = self.max_retries as f64 + 1.0;
        let secs = self.request_timeout_s * attempts + 2.0 * self.max_retries as f64 + 1.0;
        Duration::try_from_secs_f64(secs).unwrap_or(Duration::MAX)
    }

    /// The key prefix, normalized: no leading or trailing `/`.
    pub fn normalized_prefix(&self) -> &str {
        self.prefix.trim_matches('/')
    }
}

/// The longest object key S3 takes, in bytes.
pub(crate) const MAX_KEY_BYTES: usize = 1024;

/// The longest `prefix` (normalized), in bytes: room is left for the block paths under it
/// (checked exactly when the tier opens, with the namespace's directory name).
const MAX_PREFIX_BYTES: usize = 768;

/// Checks a bucket name as the obj tier takes it: 1 to 255 of `[A-Za-z0-9._-]`, beginning
/// and ending with a letter or digit, no two dots in a row (S3 itself is stricter; other
/// stores are not). So `.`, `..`, `-`, a path or an empty name, which a client or a server
/// over a directory would resolve to another bucket or directory, are refused, naming
/// `bucket`.
///
/// ```
/// assert!(kv_tier_obj::check_bucket("kv-cache.v2").is_ok());
/// assert!(kv_tier_obj::check_bucket("..").is_err());
/// assert!(kv_tier_obj::check_bucket("a/b").is_err());
/// ```
pub fn check_bucket(b: &str) -> Result<()> {
    if b.is_empty() || b.len() > 255 {
        return Err(Error::config(
            "bucket",
            format!("must be 1 to 255 characters, got {}", b.len()),
        ));
    }
    if let Some(c) = b
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(Error::config(
            "bucket",
            format!("may hold letters, digits, '.', '_' and '-' only, found {c:?} in {b:?}"),
        ));
    }
    let edge = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if !edge(b.chars().next()) || !edge(b.chars().last()) {
        return Err(Error::config(
            "bucket",
            format!("must begin and end with a letter or a digit, got {b:?}"),
        ));
    }
    if b.contains("..") {
        return Err(Error::config(
            "bucket",
            format!("must not hold two dots in a row, got {b:?}"),
        ));
    }
    Ok(())
}

/// `url` with any user information before its host (`user:password@`) masked, for errors:
/// a secret written into the URL by mistake is not repeated where logs keep it.
fn redact_userinfo(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    match rest[..end].rfind('@') {
        Some(at) => {
            let sep = if scheme.is_empty() { "" } else { "://" };
            format!("{scheme}{sep}***@{}", &rest[at + 1..])
        }
        None => url.to_string(),
    }
}

/// An `http(s)://host[:port][/path]` URL with a host, a valid port, no credentials, query or
/// fragment, and nothing a request line cannot carry. Errors quote it with any credentials
/// masked.
fn check_endpoint(raw: &str) -> Result<()> {
    let bad = |why: String| Err(Error::config("endpoint_override", why));
    let shown = redact_userinfo(raw);
    let e: &str = &shown;
    let raw_has_userinfo = shown != raw;
    if !(e.starts_with("http://") || e.starts_with("https://")) {
        return bad(format!("must be an http:// or https:// URL, got {e:?}"));
    }
    if let Some(c) = e.chars().find(|c| !c.is_ascii_graphic()) {
        return bad(format!(
            "must be a URL without spaces or control characters, found {c:?} in {e:?}"
        ));
    }
    if raw_has_userinfo {
        return bad(format!(
            "{e:?} carries credentials: use access_key and secret_key"
        ));
    }
    let u = match url::Url::parse(e) {
        Ok(u) => u,
        Err(err) => return bad(format!("{e:?} is not a valid URL: {err}")),
    };
    if u.host_str().is_none_or(str::is_empty) {
        return bad(format!("{e:?} has no host"));
    }
    let authority = e
        .split_once("://")
        .map_or(e, |(_, rest)| rest.split('/').next().unwrap_or(rest));
    if authority.ends_with(':') {
        return bad(format!("{e:?} has an empty port"));
    }
    if !u.username().is_empty() || u.password().is_some() {
        return bad(format!(
            "{e:?} carries credentials: use access_key and secret_key"
        ));
    }
    if u.query().is_some() || u.fragment().is_some() {
        return bad(format!("{e:?} has a query or fragment"));
    }
    Ok(())
}
