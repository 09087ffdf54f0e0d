//! Options of the `fs` tier entry.

use std::path::PathBuf;

use kv_tier_core::config::{check_range, check_range_u64};
use kv_tier_core::{Error, Result, TierSpec};
use serde::Deserialize;

/// Block integrity checking (`"checksum"`): with `crc32c`, the CRC is kept in the extended
/// attribute `user.kv_tier.crc32c` (or, where the filesystem has no user xattrs, in a sidecar
/// file `<hex>.bin.crc32c`) and verified on every load; the `.bin` bytes are unchanged.
pub use kv_tier_core::Checksum;

/// Options of the `fs` tier (the `secondary_tiers` entry with `"type": "fs"`).
///
/// ```json
/// {"type": "fs", "root_dir": "/mnt/nvme/kv", "n_read_threads": 16, "n_write_threads": 16,
///  "checksum": "crc32c", "fsync": false, "direct_io": true, "tmp_reap_age_s": 600}
/// ```
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(default, deny_unknown_fields)]
pub struct FsTierConfig {
    /// The cache directory (shared with vLLM's fs tier if pointed at the same place).
    /// Created if missing; must be a writable directory.
    pub root_dir: PathBuf,
    /// Threads that take loads (and lookups) first, then stores when idle. Default 16, range 1
    /// to 1,024.
    pub n_read_threads: usize,
    /// Threads that take stores first, then loads when idle. Default 16, range 1 to 1,024.
    pub n_write_threads: usize,
    /// Integrity checking, `"none"` (default) or `"crc32c"`.
    pub checksum: Checksum,
    /// With `checksum` on, serve blocks that carry no checksum at all (counted as unverified
    /// loads) instead of refusing them. Off by default: with checksums on, a block without a
    /// valid checksum is a miss and its file is removed as damaged. Turn it on only to share a
    /// root with writers that keep no checksum (vLLM's own fs tier): their blocks are then
    /// served UNVERIFIED. A malformed or mismatching checksum is refused either way.
    pub accept_unverified: bool,
    /// vLLM's per-block checksum (`vllm_checksum`): also write, on every block stored, the
    /// xattr `user.vllm.kv_crc32c` that vLLM's fs tier writes (the CRC32C of the block's bytes,
    /// four bytes big-endian, set on the temp file before it is published), and check it on
    /// load where a block has one (a block without one still loads, as in vLLM; a mismatch is
    /// damage, removed). kv-tier's own checksum (`checksum: "crc32c"`) also covers the key,
    /// so it also catches a block at another key's path; vLLM's covers the bytes only. A block
    /// vLLM wrote, with only its checksum, counts as verified when it matches. Needs user
    /// xattrs (on a filesystem without them, only kv-tier's sidecar checksum is kept). Off by
    /// default.
    pub vllm_checksum: bool,
    /// `fsync` every block file and its directory before a store reports success. Off by
    /// default: it costs a device flush per block (tens to hundreds of microseconds on NVMe,
    /// milliseconds on network disks) and only matters for power loss, not process crashes.
    pub fsync: bool,
    /// Use `O_DIRECT` where the filesystem supports it (probed once at open; buffered I/O is
    /// the logged fallback). Default true.
    pub direct_io: bool,
    /// Write each block into an unnamed temp file (`O_TMPFILE`) and publish it with one
    /// `linkat`, which never replaces (the first writer wins): one directory insert per block
    /// and no temp name to reap after a crash. Probed once at open; filesystems without
    /// `O_TMPFILE` (or without `/proc/self/fd` to link through) get the named temp file and
    /// `renameat2(RENAME_NOREPLACE)` (with `link` + `unlink` where that is refused). Default
    /// true; false forces the named temp file.
    pub tmpfile_publish: bool,
    /// At open, `.tmp` files of killed writers older than this many seconds are deleted.
    /// Default 600, range 0 to 31,536,000 (0 reaps every temp file at open: only when no other
    /// process writes to the root). A live writer's temp file exists for milliseconds.
    /// Rescans (bounded mode) reap with the same age, but never younger than 60 s: they run
    /// while the tier's own stores are in flight. (Checksum sidecars whose block file is gone
    /// are reaped by the open's walk and by rescans whatever their age.)
    pub tmp_reap_age_s: u64,
    /// Capacity bound in GiB (2^30 bytes) of what the tier holds on disk: the allocated bytes
    /// (`st_blocks`) of its block files and checksum sidecars and of the directories they keep
    /// (see `gc_hard_ceiling` for how hard the bound is). Absent: unbounded, no GC.
    pub gc_max_size_gb: Option<f64>,
    /// How far above the cap the tier may go, as a multiple of it (default 1.05, range 1 to
    /// 1,000). A store that would cross this ceiling first makes room (a sweep on its own
    /// thread that ignores `gc_grace_s`, or a wait of at most a second for one that runs),
    /// failing with `NoSpace` if everything left is protected or being written. Past halfway
    /// from the cap to the ceiling, the GC's own sweeps stop sparing the grace window too
    /// (down to the cap), so stores seldom reach the ceiling.
    pub gc_hard_ceiling: Option<f64>,
    /// A sweep deletes down to `gc_max_size_gb * gc_low_watermark`. In (0, 1]; default 0.9.
    ///
    /// Every `gc_*` number has a range, listed in [`RANGES`]; `gc_max_size_gb` is 1e-9 to 1e9,
    /// and must also hold one block file with its leaf and top directories on the root's
    /// filesystem (with 4 KiB blocks on ext4, 12 KiB): that is checked when the tier opens,
    /// where the filesystem's allocation unit is known (`kv-tier config check`, which touches
    /// no disk, cannot), failing naming `gc_max_size_gb`.
    pub gc_low_watermark: Option<f64>,
    /// Seconds between capacity checks (a sweep runs only when over the cap; a store that
    /// crosses the cap also wakes the GC). Default 60, range 0.01 to 86,400.
    pub gc_interval_s: Option<f64>,
    /// A key's mtime is stamped at most once per this many seconds. Default 60, range 0.000001 to
    /// 86,400.
    pub gc_stamp_interval_s: Option<f64>,
    /// Files used (mtime) within this many seconds are spared by the GC's sweeps over the cap,
    /// while the total is within halfway from the cap to `gc_hard_ceiling`; past that, and in
    /// the sweeps a store runs to stay under the ceiling, they go (oldest first) like any
    /// other. Must exceed `gc_stamp_interval_s`. Default 300, range 0.000001 to 31,536,000.
    pub gc_grace_s: Option<f64>,
    /// At most this many stamps wait to be applied; touches beyond are dropped (counted).
    /// Default 200000, range 1 to 100,000,000.
    pub gc_max_tracked: Option<usize>,
    /// Seconds between full rescans of the tree, which repair drift from external deletes
    /// and adopt files other processes wrote. Default 3600; 0 disables; otherwise 1 to
    /// 31,536,000.
    pub gc_rescan_interval_s: Option<f64>,
    /// Seconds between checkpoints of the index (written only when it changed, and always
    /// when the tier closes), which the next open reads instead of walking the tree; it then
    /// answers at once and reconciles with the disk by a walk in the background. Default
    /// 300; 0: no checkpoints (none written, none read); otherwise 1 to 31,536,000. Not used
    /// on a shared root (its leader walks) nor with `gc_background` false (the open walks).
    pub gc_checkpoint_interval_s: Option<f64>,
    /// Run sweeps, stamps and rescans on a background thread (`gc_background`, default
    /// true). `false`: they run only when the embedder calls `FsTier::gc_*_now` (reached with
    /// `TieringManager::tier::<FsTier>`), for engines that schedule the GC themselves, and for
    /// deterministic tests and benchmarks.
    pub gc_background: bool,
    /// Several instances (processes, possibly on several hosts over a shared filesystem)
    /// share this root's rank directory under one cap: `gc_max_size_gb` is then the bound of
    /// the directory as a whole, not of this process's files. One instance at a time holds
    /// the leader lease and sweeps for all (true LRU across instances); every instance
    /// writes only with credit the leader grants. Requires `gc_max_size_gb`. The protocol
    /// and its failure modes: the fs README, "Shared root". Default false.
    pub shared: bool,
    /// Shared root: the leader lease's period in seconds. The leader renews it four times
    /// per period; an instance that sees it unchanged for a whole period (by its own clock)
    /// takes it over, so a killed leader is replaced within about one to two periods.
    /// Default 2, range 0.05 to 600.
    pub shared_lease_s: Option<f64>,
    /// Shared root: this instance's name in the coordination directory (letters, digits,
    /// `.`, `_`, `-`; 1 to 64). Default `<host>-<pid>-<random>`; unique among the instances
    /// sharing the root.
    pub instance_id: Option<String>,
}

impl Default for FsTierConfig {
    /// The defaults, with an empty `root_dir` (which `validate` refuses: it must be given).
    fn default() -> Self {
        Self {
            root_dir: PathBuf::new(),
            n_read_threads: 16,
            n_write_threads: 16,
            checksum: Checksum::None,
            accept_unverified: false,
            vllm_checksum: false,
            fsync: false,
            direct_io: true,
            tmpfile_publish: true,
            tmp_reap_age_s: 600,
            gc_max_size_gb: None,
            gc_hard_ceiling: None,
            gc_low_watermark: None,
            gc_interval_s: None,
            gc_stamp_interval_s: None,
            gc_grace_s: None,
            gc_max_tracked: None,
            gc_rescan_interval_s: None,
            gc_checkpoint_interval_s: None,
            gc_background: true,
            shared: false,
            shared_lease_s: None,
            instance_id: None,
        }
    }
}

/// The defaults of the options a config may leave out (`None`), each declared once: the GC's
/// (a bounded tier's) and the shared root's.
pub(crate) mod defaults {
    pub(crate) const GC_HARD_CEILING: f64 = 1.05;
    pub(crate) const GC_LOW_WATERMARK: f64 = 0.9;
    pub(crate) const GC_INTERVAL_S: f64 = 60.0;
    pub(crate) const GC_STAMP_INTERVAL_S: f64 = 60.0;
    pub(crate) const GC_GRACE_S: f64 = 300.0;
    pub(crate) const GC_MAX_TRACKED: usize = 200_000;
    pub(crate) const GC_RESCAN_INTERVAL_S: f64 = 3600.0;
    pub(crate) const GC_CHECKPOINT_INTERVAL_S: f64 = 300.0;
    pub(crate) const SHARED_LEASE_S: f64 = 2.0;
}

impl kv_tier_core::registry::EffectiveOptions for FsTierConfig {
    const ALIASES: &'static [(&'static str, &'static str)] =
        &[("max_storage_size_gb", "gc_max_size_gb")];

    fn effective_options(&self) -> (serde_json::Value, Vec<&'static str>) {
        self.effective()
    }
}

impl FsTierConfig {
    /// The options as the tier uses them, as JSON (the keys of the config), with the keys
    /// whose value is a default because the config left them out. An option that does not
    /// apply stays `null`: the GC's on an unbounded tier (no `gc_max_size_gb`), the shared
    /// root's when `shared` is off; `instance_id` left out is made at open
    /// (`<host>-<pid>-<random>`).
    ///
    /// ```
    /// let mut c = kv_tier_fs::FsTierConfig::new("/cache");
    /// c.gc_max_size_gb = Some(4.0);
    /// let (v, defaulted) = c.effective();
    /// assert_eq!(v["gc_low_watermark"], 0.9);
    /// assert!(defaulted.contains(&"gc_low_watermark"));
    /// assert!(v["shared_lease_s"].is_null());
    /// ```
    pub fn effective(&self) -> (serde_json::Value, Vec<&'static str>) {
        use defaults::*;
        let mut v = serde_json::to_value(self).expect("a config serializes");
        let mut defaulted = Vec::new();
        let mut fill = |key: &'static str, value: serde_json::Value| {
            if v[key].is_null() {
                v[key] = value;
                defaulted.push(key);
            }
        };
        if self.gc_max_size_gb.is_some() {
            fill("gc_hard_ceiling", GC_HARD_CEILING.into());
            fill("gc_low_watermark", GC_LOW_WATERMARK.into());
            fill("gc_interval_s", GC_INTERVAL_S.into());
            fill("gc_stamp_interval_s", GC_STAMP_INTERVAL_S.into());
            fill("gc_grace_s", GC_GRACE_S.into());
            fill("gc_max_tracked", GC_MAX_TRACKED.into());
            fill("gc_rescan_interval_s", GC_RESCAN_INTERVAL_S.into());
            fill("gc_checkpoint_interval_s", GC_CHECKPOINT_INTERVAL_S.into());
        }
        if self.shared {
            fill("shared_lease_s", SHARED_LEASE_S.into());
        }
        (v, defaulted)
    }

    /// Options with defaults for `root_dir`.
    pub fn new(root_dir: impl Into<PathBuf>) -> Self {
        Self {
            root_dir: root_dir.into(),
            ..Self::default()
        }
    }

    /// The GC settings with defaults applied, or `None` when unbounded. Call after `validate`.
    pub(crate) fn gc(&self) -> Option<crate::gc::GcConfig> {
        let gb = self.gc_max_size_gb?;
        let cap = (gb * (1u64 << 30) as f64) as u64;
        use defaults::*;
        let low = self.gc_low_watermark.unwrap_or(GC_LOW_WATERMARK);
        let secs = |v: Option<f64>, d: f64| std::time::Duration::from_secs_f64(v.unwrap_or(d));
        let ns = |v: Option<f64>, d: f64| (v.unwrap_or(d) * 1e9) as i64;
        let rescan = self.gc_rescan_interval_s.unwrap_or(GC_RESCAN_INTERVAL_S);
        let checkpoint = self
            .gc_checkpoint_interval_s
            .unwrap_or(GC_CHECKPOINT_INTERVAL_S);
        let hard = self.gc_hard_ceiling.unwrap_or(GC_HARD_CEILING);
        Some(crate::gc::GcConfig {
            cap_bytes: cap,
            low_bytes: (cap as f64 * low) as u64,
            hard_bytes: (cap as f64 * hard).min(u64::MAX as f64) as u64,
            tmp_age: std::time::Duration::from_secs(self.tmp_reap_age_s),
            interval: secs(self.gc_interval_s, GC_INTERVAL_S),
            stamp_interval_ns: ns(self.gc_stamp_interval_s, GC_STAMP_INTERVAL_S),
            grace_ns: ns(self.gc_grace_s, GC_GRACE_S),
            max_tracked: self.gc_max_tracked.unwrap_or(GC_MAX_TRACKED),
            rescan_interval: (rescan > 0.0).then(|| std::time::Duration::from_secs_f64(rescan)),
            checkpoint_interval: (checkpoint > 0.0)
                .then(|| std::time::Duration::from_secs_f64(checkpoint)),
            background: self.gc_background,
        })
    }

    /// Parses and validates a tier spec's options.
    ///
    /// The keys of the bounded-fs evictor in vLLM's tiering branch are taken too:
    /// `max_storage_size_gb` is `gc_max_size_gb`, and `evictor_type` may be `"lru"` (what the
    /// GC does: least recently used block files first, by mtime); its testing-only
    /// `"fail_on_full"` is refused saying so.
    pub fn from_spec(spec: &TierSpec) -> Result<Self> {
        let mut options = spec.options.clone();
        let aliased = options.contains_key("max_storage_size_gb");
        if let Some(v) = options.remove("max_storage_size_gb") {
            if options.contains_key("gc_max_size_gb") {
                return Err(Error::config(
                    "max_storage_size_gb",
                    "given with gc_max_size_gb, its kv-tier name: keep one",
                ));
            }
            options.insert("gc_max_size_gb".into(), v);
        }
        match options.remove("evictor_type") {
            None => {}
            Some(serde_json::Value::String(t))
                if t == "lru" && !options.contains_key("gc_max_size_gb") =>
            {
                return Err(Error::config(
                    "evictor_type",
                    "\"lru\" evicts down from max_storage_size_gb (or gc_max_size_gb), which is not given",
                ));
            }
            Some(serde_json::Value::String(t)) if t == "lru" => {}
            Some(serde_json::Value::String(t)) if t == "fail_on_full" => {
                return Err(Error::config(
                    "evictor_type",
                    "\"fail_on_full\" (vLLM's testing-only evictor) is not implemented: the bounded tier evicts least recently used block files (\"lru\")",
                ));
            }
            Some(other) => {
                return Err(Error::config(
                    "evictor_type",
                    format!("must be \"lru\", got {other}"),
                ));
            }
        }
        let parsed = kv_tier_core::config::parse_tier_options(options)
            .and_then(|cfg: Self| cfg.validate().map(|()| cfg));
        // errors name the key the user wrote
        parsed.map_err(|e| match e {
            Error::InvalidConfig { field, reason } if aliased && field == "gc_max_size_gb" => {
                Error::config("max_storage_size_gb", reason)
            }
            e => e,
        })
    }

    /// Checks every value; errors name the field.
    pub fn validate(&self) -> Result<()> {
        if self.root_dir.as_os_str().is_empty() {
            return Err(Error::config("root_dir", "must not be empty"));
        }
        for (field, v) in [
            ("n_read_threads", self.n_read_threads as u64),
            ("n_write_threads", self.n_write_threads as u64),
            ("tmp_reap_age_s", self.tmp_reap_age_s),
        ] {
            let (min, max) = range(field);
            check_range_u64(field, v, min as u64, max as u64)?;
        }
        if self.accept_unverified && self.checksum != Checksum::Crc32c {
            return Err(Error::config(
                "accept_unverified",
                "is set but checksum is \"none\": without checksums every block is unverified",
            ));
        }
        self.validate_gc()
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
                        "is set but shared is not: it only applies to a shared root",
                    ));
                }
            }
            return Ok(());
        }
        if self.gc_max_size_gb.is_none() {
            return Err(Error::config(
                "shared",
                "needs gc_max_size_gb: a shared root is one bounded directory",
            ));
        }
        if !self.gc_background {
            return Err(Error::config(
                "gc_background",
                "must be true on a shared root: the leader sweeps for every instance on its GC thread",
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

    fn validate_gc(&self) -> Result<()> {
        self.validate_shared()?;
        if self.gc_max_size_gb.is_none() {
            let set = [
                ("gc_low_watermark", self.gc_low_watermark.is_some()),
                ("gc_hard_ceiling", self.gc_hard_ceiling.is_some()),
                ("gc_interval_s", self.gc_interval_s.is_some()),
                ("gc_stamp_interval_s", self.gc_stamp_interval_s.is_some()),
                ("gc_grace_s", self.gc_grace_s.is_some()),
                ("gc_max_tracked", self.gc_max_tracked.is_some()),
                ("gc_rescan_interval_s", self.gc_rescan_interval_s.is_some()),
                (
                    "gc_checkpoint_interval_s",
                    self.gc_checkpoint_interval_s.is_some(),
                ),
            ];
            if let Some((name, _)) = set.iter().find(|(_, s)| *s) {
                return Err(Error::config(
                    *name,
                    "is set but gc_max_size_gb is not: the tier is unbounded and has no GC",
                ));
            }
            return Ok(());
        }
        let reals = [
            ("gc_max_size_gb", self.gc_max_size_gb),
            ("gc_hard_ceiling", self.gc_hard_ceiling),
            ("gc_low_watermark", self.gc_low_watermark),
            ("gc_interval_s", self.gc_interval_s),
            ("gc_stamp_interval_s", self.gc_stamp_interval_s),
            ("gc_grace_s", self.gc_grace_s),
        ];
        for (field, v) in reals {
            if let Some(v) = v {
                let (min, max) = range(field);
                check_range(field, v, min, max)?;
            }
        }
        for (field, v) in [
            ("gc_rescan_interval_s", self.gc_rescan_interval_s),
            ("gc_checkpoint_interval_s", self.gc_checkpoint_interval_s),
        ] {
            if let Some(r) = v
                && r != 0.0
            {
                let (min, max) = range(field);
                check_range(field, r, min, max).map_err(|_| {
                    Error::config(
                        field,
                        format!("must be 0 (never) or between {min} and {max}, got {r}"),
                    )
                })?;
            }
        }
        if let Some(n) = self.gc_max_tracked {
            let (min, max) = range("gc_max_tracked");
            check_range_u64("gc_max_tracked", n as u64, min as u64, max as u64)?;
        }
        let stamp = self
            .gc_stamp_interval_s
            .unwrap_or(defaults::GC_STAMP_INTERVAL_S);
        let grace = self.gc_grace_s.unwrap_or(defaults::GC_GRACE_S);
        if grace <= stamp {
            return Err(Error::config(
                "gc_grace_s",
                format!(
                    "must exceed gc_stamp_interval_s ({stamp}), got {grace}: a key in use could otherwise look idle between two stamps"
                ),
            ));
        }
        Ok(())
    }
}

/// The documented range of every numeric option, checked by [`FsTierConfig::validate`]:
/// `(field, min, max)`, both ends included (`gc_rescan_interval_s` and
/// `gc_checkpoint_interval_s` may also be 0: never).
pub const RANGES: &[(&str, f64, f64)] = &[
    ("n_read_threads", 1.0, 1024.0),
    ("n_write_threads", 1.0, 1024.0),
    ("tmp_reap_age_s", 0.0, 31_536_000.0),
    ("gc_max_size_gb", 1e-9, 1e9),
    ("gc_hard_ceiling", 1.0, 1000.0),
    ("gc_low_watermark", 1e-9, 1.0),
    ("gc_interval_s", 0.01, 86_400.0),
    ("gc_stamp_interval_s", 1e-6, 86_400.0),
    ("gc_grace_s", 1e-6, 31_536_000.0),
    ("gc_max_tracked", 1.0, 100_000_000.0),
    ("gc_rescan_interval_s", 1.0, 31_536_000.0),
    ("gc_checkpoint_interval_s", 1.0, 31_536_000.0),
    ("shared_lease_s", 0.05, 600.0),
];

fn range(field: &str) -> (f64, f64) {
    RANGES
        .iter()
        .find(|r| r.0 == field)
        .map_or((f64::NAN, f64::NAN), |r| (r.1, r.2))
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

    #[test]
    fn shared_root_options_are_validated_by_name() {
        let ok = parse(
            r#"{"root_dir": "/x", "gc_max_size_gb": 1, "shared": true, "shared_lease_s": 0.5,
                "instance_id": "node-1.gpu_0"}"#,
        )
        .unwrap();
        assert!(ok.shared);
        assert!(!parse(r#"{"root_dir": "/x"}"#).unwrap().shared);
        let cases = [
            (r#"{"root_dir": "/x", "shared": true}"#, "shared"),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "shared": true, "gc_background": false}"#,
                "gc_background",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "shared_lease_s": 2}"#,
                "shared_lease_s",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "instance_id": "a"}"#,
                "instance_id",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "shared": true, "shared_lease_s": 0.01}"#,
                "shared_lease_s",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "shared": true, "shared_lease_s": 601}"#,
                "shared_lease_s",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "shared": true, "shared_lease_s": "2"}"#,
                "shared_lease_s",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "shared": "yes"}"#,
                "shared",
            ),
        ];
        for (json, want) in cases {
            assert_eq!(field(json), want, "{json}");
        }
        for bad in ["", ".", "..", "a/b", "a b", "ü", &"x".repeat(65)] {
            let json = format!(
                r#"{{"root_dir": "/x", "gc_max_size_gb": 1, "shared": true, "instance_id": {}}}"#,
                serde_json::to_string(bad).unwrap()
            );
            assert_eq!(field(&json), "instance_id", "{bad:?}");
        }
    }

    #[test]
    fn gc_options_are_validated_by_name() {
        let c = parse(r#"{"root_dir": "/x", "gc_max_size_gb": 2}"#).unwrap();
        let g = c.gc().unwrap();
        assert_eq!(g.cap_bytes, 2 << 30);
        assert_eq!(g.low_bytes, ((2u64 << 30) as f64 * 0.9) as u64);
        assert!(parse(r#"{"root_dir": "/x"}"#).unwrap().gc().is_none());
        let cases = [
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 0}"#,
                "gc_max_size_gb",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": -1}"#,
                "gc_max_size_gb",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": "1G"}"#,
                "gc_max_size_gb",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_low_watermark": 0}"#,
                "gc_low_watermark",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_low_watermark": 1.5}"#,
                "gc_low_watermark",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_interval_s": 0}"#,
                "gc_interval_s",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_stamp_interval_s": -3}"#,
                "gc_stamp_interval_s",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_grace_s": 30}"#,
                "gc_grace_s",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_stamp_interval_s": 400}"#,
                "gc_grace_s",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_max_tracked": 0}"#,
                "gc_max_tracked",
            ),
            (
                r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_rescan_interval_s": -1}"#,
                "gc_rescan_interval_s",
            ),
            (r#"{"root_dir": "/x", "gc_grace_s": 500}"#, "gc_grace_s"),
        ];
        for (json, want) in cases {
            assert_eq!(field(json), want, "{json}");
        }
        assert!(parse(r#"{"root_dir": "/x", "gc_max_size_gb": 1, "gc_low_watermark": 1, "gc_rescan_interval_s": 0}"#).is_ok());
    }
}
