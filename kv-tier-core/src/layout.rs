//! The on-disk layout shared with vLLM's filesystem tier: namespace digest, directory names
//! and block paths. The `fs` tier uses it under its `root_dir`, the `obj` tier under its prefix.
//! [`Namespace`] reproduces the vectors of `tests/data/layout-vectors.json` byte for byte.
//!
#![doc = include_str!("../docs/vllm-layout.md")]

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};
pub use crate::json::canonical_json;
use crate::json::write_json;
use crate::key::BlockKey;
use crate::ranges::check_range_u64;

/// One KV-cache group of the run fields.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KvCacheGroup {
    /// Tokens per block of this group.
    pub tokens_per_block: u64,
    /// The attention layers of this group, in order.
    pub layer_names: Vec<String>,
}

fn one() -> u64 {
    1
}
fn yes() -> bool {
    true
}
fn vllm() -> String {
    "vllm".into()
}

/// The largest value of each number of the run fields: tokens per hash and per group block
/// 1 to 2^20 (1,048,576), blocks per file 1 to 65,536 (vLLM's `blocks_per_chunk`), each
/// parallel size 1 to 65,536. Beyond them a config (or a `config.json`) is refused, naming the
/// field.
pub const LAYOUT_RANGES: [(&str, u64, u64); 7] = [
    ("tokens_per_hash", 1, 1 << 20),
    ("blocks_per_file", 1, 65_536),
    ("tp_size", 1, 65_536),
    ("pp_size", 1, 65_536),
    ("pcp_size", 1, 65_536),
    ("dcp_size", 1, 65_536),
    ("tokens_per_block", 1, 1 << 20),
];

/// [`LAYOUT_RANGES`]' maximum of `field`.
fn layout_max(field: &str) -> u64 {
    LAYOUT_RANGES
        .iter()
        .find(|r| r.0 == field)
        .map_or(u64::MAX, |r| r.2)
}

/// The run fields: what a block means. Blocks of different run fields are never mixed.
///
/// Deserializes from the `config.json` form, where `parallel_agnostic` is present only when
/// false and `replicated_layout` only when true.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunFields {
    /// Model name, e.g. `meta-llama/Llama-3.1-8B-Instruct`.
    pub model_name: String,
    /// Tokens per block hash.
    pub tokens_per_hash: u64,
    /// Blocks per file (1 by default).
    #[serde(default = "one")]
    pub blocks_per_file: u64,
    /// Tensor-parallel size (forced to 1 when parallelism-agnostic).
    #[serde(default = "one")]
    pub tp_size: u64,
    /// Pipeline-parallel size (forced to 1 when parallelism-agnostic).
    #[serde(default = "one")]
    pub pp_size: u64,
    /// Prefill context-parallel size (forced to 1 when parallelism-agnostic).
    #[serde(default = "one")]
    pub pcp_size: u64,
    /// Decode context-parallel size (forced to 1 when parallelism-agnostic).
    #[serde(default = "one")]
    pub dcp_size: u64,
    /// The dtype as the engine spells it, e.g. `torch.bfloat16`.
    pub dtype: String,
    /// KV-cache groups, order kept.
    #[serde(default)]
    pub kv_cache_groups: Vec<KvCacheGroup>,
    /// The engine, `"vllm"` by default.
    #[serde(default = "vllm")]
    pub inference_engine: String,
    /// Whether the namespace is shared across parallel layouts: tp/pp/pcp/dcp are written as
    /// 1 and the rank is 0, so every parallel layout of the run reads and writes one
    /// directory. `config.json` omits it when true. In a config's `layout`, see
    /// [`RunFields::from_layout`] for how it is decided when not given.
    #[serde(default = "yes")]
    pub parallel_agnostic: bool,
    /// vLLM's replicated layout (MLA models on TP-only single-node runs: every rank holds the
    /// same KV): the namespace is parallelism-agnostic (tp/pp/pcp/dcp 1, rank 0), so TP2 and
    /// TP4 writers share one directory; `config.json` says `"replicated_layout": true`.
    #[serde(default)]
    pub replicated_layout: bool,
    /// A canonical byte format, when one is used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canonical_format: Option<String>,
    /// A storage format, when one is used (vLLM hashes it when set).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_format: Option<String>,
    /// The KV cache's memory layout as vLLM names it (`"NHD"` or `"HND"`: which of the
    /// token and head axes comes first in a block), when the engine states it: hashed when
    /// set, as vLLM does, so blocks of two layouts never share a directory; absent from
    /// `config.json` and the digest otherwise (a cache written before the field keeps its
    /// directory).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_layout: Option<String>,
}

impl RunFields {
    /// Minimal run fields for a model and dtype; parallelism-agnostic, one block per file.
    pub fn new(
        model_name: impl Into<String>,
        dtype: impl Into<String>,
        tokens_per_hash: u64,
    ) -> Self {
        Self {
            model_name: model_name.into(),
            tokens_per_hash,
            blocks_per_file: 1,
            tp_size: 1,
            pp_size: 1,
            pcp_size: 1,
            dcp_size: 1,
            dtype: dtype.into(),
            kv_cache_groups: Vec::new(),
            inference_engine: vllm(),
            parallel_agnostic: true,
            replicated_layout: false,
            canonical_format: None,
            storage_format: None,
            kv_cache_layout: None,
        }
    }

    /// The run fields of a config's `layout` object (`field`: its path, for errors), with
    /// vLLM's defaults for what it omits (`blocks_per_file`, the parallel sizes: 1;
    /// `kv_cache_groups`: none; `inference_engine`: `"vllm"`) and `parallel_agnostic` decided
    /// as vLLM decides it where the fields alone tell:
    ///
    /// - `replicated_layout: true` (only with `tp_size` above 1 and no other parallelism, as
    ///   vLLM sets it) makes the namespace agnostic (stating `parallel_agnostic: false` with
    ///   it is refused);
    /// - with context parallelism (`pcp_size` or `dcp_size` above 1), or several
    ///   `kv_cache_groups` without a `canonical_format`, vLLM never shares the namespace:
    ///   not agnostic;
    /// - with `tp_size` above 1 vLLM's answer depends on the model (its KV heads must shard
    ///   evenly across the TP ranks), which the fields do not say: refused unless
    ///   `parallel_agnostic` is given, rather than guessed into another directory;
    /// - otherwise (one rank of TP, one full-attention group) agnostic, vLLM's answer for a
    ///   standard model. vLLM does not share the namespace of MLA models (unless replicated),
    ///   of its V2 model runner or of per-token-head KV quantisation: such runs must say
    ///   `"parallel_agnostic": false`.
    ///
    /// ```
    /// use kv_tier_core::RunFields;
    /// let m = |v: serde_json::Value| v.as_object().unwrap().clone();
    /// let f = RunFields::from_layout(
    ///     m(serde_json::json!({"model_name": "m", "dtype": "float16", "tokens_per_hash": 16})),
    ///     "layout",
    /// )?;
    /// assert!(f.parallel_agnostic);
    /// let err = RunFields::from_layout(
    ///     m(serde_json::json!({"model_name": "m", "dtype": "float16", "tokens_per_hash": 16, "tp_size": 2})),
    ///     "layout",
    /// )
    /// .unwrap_err();
    /// assert!(err.to_string().contains("layout.parallel_agnostic"), "{err}");
    /// # Ok::<(), kv_tier_core::Error>(())
    /// ```
    pub fn from_layout(mut map: Map<String, Value>, field: &str) -> Result<Self> {
        let given = match map.remove("parallel_agnostic") {
            None => None,
            Some(Value::Bool(b)) => Some(b),
            Some(other) => {
                return Err(Error::config(
                    format!("{field}.parallel_agnostic"),
                    format!("must be true or false, got {other}"),
                ));
            }
        };
        let mut fields: RunFields = crate::json::from_value(Value::Object(map), field)?;
        let groups = fields.kv_cache_groups.len();
        if fields.replicated_layout
            && !(fields.tp_size > 1
                && fields.pp_size == 1
                && fields.pcp_size == 1
                && fields.dcp_size == 1)
        {
            return Err(Error::config(
                format!("{field}.replicated_layout"),
                format!(
                    "vLLM replicates the layout only across tensor-parallel ranks (tp_size > 1, pp_size, pcp_size and dcp_size 1), got tp {} pp {} pcp {} dcp {}",
                    fields.tp_size, fields.pp_size, fields.pcp_size, fields.dcp_size
                ),
            ));
        }
        fields.parallel_agnostic = match given {
            Some(false) if fields.replicated_layout => {
                return Err(Error::config(
                    format!("{field}.parallel_agnostic"),
                    "false contradicts replicated_layout: true (vLLM's replicated layout is always parallelism-agnostic)",
                ));
            }
            Some(b) => b,
            None if fields.replicated_layout => true,
            None if fields.pcp_size > 1 || fields.dcp_size > 1 => false,
            None if groups > 1 && fields.canonical_format.is_none() => false,
            None if fields.tp_size > 1 => {
                return Err(Error::config(
                    format!("{field}.parallel_agnostic"),
                    format!(
                        "is required with tp_size {} > 1: vLLM shares the namespace across parallel layouts only when the model's KV heads shard evenly across the TP ranks (num_kv_heads x tp_size == total KV heads) in one full-attention, non-MLA group; say which (true or false) so the blocks land in the directory vLLM uses",
                        fields.tp_size
                    ),
                ));
            }
            None => true,
        };
        fields.validate_in(field)?;
        Ok(fields)
    }

    /// The fields as written into `config.json` and digested (sorted keys; the optional
    /// fields present only as the spec says).
    pub fn to_json(&self) -> Value {
        let agnostic = self.parallel_agnostic;
        let par = |v: u64| Value::from(if agnostic { 1 } else { v });
        let mut m = Map::new();
        m.insert("model_name".into(), self.model_name.clone().into());
        m.insert("tokens_per_hash".into(), self.tokens_per_hash.into());
        m.insert("blocks_per_file".into(), self.blocks_per_file.into());
        m.insert("tp_size".into(), par(self.tp_size));
        m.insert("pp_size".into(), par(self.pp_size));
        m.insert("pcp_size".into(), par(self.pcp_size));
        m.insert("dcp_size".into(), par(self.dcp_size));
        m.insert("dtype".into(), self.dtype.clone().into());
        m.insert(
            "kv_cache_groups".into(),
            serde_json::to_value(&self.kv_cache_groups).expect("groups serialize"),
        );
        m.insert(
            "inference_engine".into(),
            self.inference_engine.clone().into(),
        );
        if !agnostic {
            m.insert("parallel_agnostic".into(), false.into());
        }
        if self.replicated_layout {
            m.insert("replicated_layout".into(), true.into());
        }
        if let Some(f) = &self.canonical_format {
            m.insert("canonical_format".into(), f.clone().into());
        }
        if let Some(f) = &self.storage_format {
            m.insert("storage_format".into(), f.clone().into());
        }
        if let Some(l) = &self.kv_cache_layout {
            m.insert("kv_cache_layout".into(), l.clone().into());
        }
        Value::Object(m)
    }

    fn validate(&self) -> Result<()> {
        self.validate_in("layout")
    }

    fn validate_in(&self, field: &str) -> Result<()> {
        let at = |k: &str| format!("{field}.{k}");
        if self.model_name.is_empty() {
            return Err(Error::config(at("model_name"), "must not be empty"));
        }
        if self.dtype.is_empty() {
            return Err(Error::config(at("dtype"), "must not be empty"));
        }
        if self.kv_cache_layout.as_deref() == Some("") {
            return Err(Error::config(
                at("kv_cache_layout"),
                "must not be empty when given (vLLM's layouts are \"NHD\" and \"HND\"); leave it out when the engine does not state one",
            ));
        }
        if self.replicated_layout && !self.parallel_agnostic {
            return Err(Error::config(
                at("replicated_layout"),
                "a replicated layout is parallelism-agnostic (as in vLLM): parallel_agnostic must be true",
            ));
        }
        for (name, v) in [
            ("tokens_per_hash", self.tokens_per_hash),
            ("blocks_per_file", self.blocks_per_file),
            ("tp_size", self.tp_size),
            ("pp_size", self.pp_size),
            ("pcp_size", self.pcp_size),
            ("dcp_size", self.dcp_size),
        ] {
            if v == 0 {
                return Err(Error::config(at(name), "must be positive"));
            }
            check_range_u64(&at(name), v, 1, layout_max(name))?;
        }
        for (i, g) in self.kv_cache_groups.iter().enumerate() {
            check_range_u64(
                &at(&format!("kv_cache_groups[{i}].tokens_per_block")),
                g.tokens_per_block,
                1,
                layout_max("tokens_per_block"),
            )?;
        }
        Ok(())
    }
}

/// A resolved namespace: run fields, rank and digest. Maps keys to paths relative to a root.
///
/// ```
/// use kv_tier_core::{BlockKey, Namespace, RunFields};
/// let ns = Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0)?;
/// let key = BlockKey::from_hex("abcdef01", 0)?;
/// let rel = ns.block_rel_path(&key);
/// assert_eq!(rel, format!("org_model_{}_r0/abc/de_g0/abcdef01.bin", ns.digest()));
/// # Ok::<(), kv_tier_core::Error>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    fields: RunFields,
    rank: u32,
    digest: String,
    dir_name: String,
}

impl Namespace {
    /// Resolves run fields and a worker rank (forced to 0 when parallelism-agnostic). The
    /// fields are taken as given (they may come from a `config.json`, where a replicated
    /// layout's sizes are written as 1): vLLM's rules for a config's `layout` are
    /// [`RunFields::from_layout`]'s.
    pub fn new(fields: RunFields, rank: u32) -> Result<Self> {
        fields.validate()?;
        let canonical = canonical_json(&fields.to_json());
        let hash = Sha256::digest(canonical.as_bytes());
        let mut digest = String::with_capacity(12);
        for b in &hash[..6] {
            write!(digest, "{b:02x}").expect("string write");
        }
        let dir_name = format!("{}_{digest}", fields.model_name.replace('/', "_"));
        let rank = if fields.parallel_agnostic { 0 } else { rank };
        Ok(Self {
            fields,
            rank,
            digest,
            dir_name,
        })
    }

    /// Parses the `config.json` form of the run fields (a JSON object) plus a rank.
    pub fn from_json(fields: &Value, rank: u32) -> Result<Self> {
        let fields: RunFields = crate::json::from_value(fields.clone(), "layout")?;
        Self::new(fields, rank)
    }

    /// The run fields.
    pub fn fields(&self) -> &RunFields {
        &self.fields
    }

    /// The effective rank.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// The 12-hex-digit digest of the canonical JSON.
    pub fn digest(&self) -> &str {
        &self.digest
    }

    /// The canonical JSON that the digest is taken over.
    pub fn canonical_json(&self) -> String {
        canonical_json(&self.fields.to_json())
    }

    /// `<root>/<model_name with '/' -> '_'>_<digest>`.
    pub fn namespace_dir(&self, root: &Path) -> PathBuf {
        root.join(&self.dir_name)
    }

    /// `<namespace dir>/config.json`.
    pub fn config_path(&self, root: &Path) -> PathBuf {
        self.namespace_dir(root).join("config.json")
    }

    /// The name of the directory holding this rank's blocks, relative to the root.
    pub fn rank_dir_name(&self) -> String {
        format!("{}_r{}", self.dir_name, self.rank)
    }

    /// The content of `config.json`: pretty-printed, sorted keys, 2-space indent, non-ASCII
    /// escaped (Python's `json.dumps(fields, indent=2, sort_keys=True)`).
    pub fn config_json(&self) -> String {
        let mut out = String::new();
        write_json(&mut out, &self.fields.to_json(), Some(0));
        out
    }

    /// Checks an existing `config.json` against this namespace (compared as JSON values).
    pub fn check_config_json(&self, path: &Path, content: &str) -> Result<()> {
        let found: Value = serde_json::from_str(content).map_err(|e| Error::LayoutMismatch {
            path: path.to_path_buf(),
            reason: format!("not valid JSON: {e}"),
        })?;
        let want = self.fields.to_json();
        if found != want {
            let differing = match (&found, &want) {
                (Value::Object(f), Value::Object(w)) => {
                    let mut names: Vec<String> = w
                        .iter()
                        .filter(|(k, v)| f.get(*k) != Some(*v))
                        .map(|(k, v)| match f.get(k) {
                            Some(got) => format!(
                                "{k} ({} here, {} configured)",
                                canonical_json(got),
                                canonical_json(v)
                            ),
                            None => format!("{k} (missing here, {} configured)", canonical_json(v)),
                        })
                        .collect();
                    names.extend(
                        f.keys()
                            .filter(|k| !w.contains_key(*k))
                            .map(|k| format!("{k} (here only)")),
                    );
                    names.join("; ")
                }
                _ => "not an object".to_string(),
            };
            return Err(Error::LayoutMismatch {
                path: path.to_path_buf(),
                reason: format!(
                    "its run fields differ from this tier's: {differing}. It holds {} but this tier is configured with {}",
                    canonical_json(&found),
                    canonical_json(&want)
                ),
            });
        }
        Ok(())
    }

    /// `<rank dir>/<hex[0..3]>/<hex[3..5]>_g<group>/<hex>.bin`, relative to the root, with `/`
    /// separators. Slices shorter hashes as Python does (a 1-byte hash gives `ab/_g0/ab.bin`).
    pub fn block_rel_path(&self, key: &BlockKey) -> String {
        let hex = key.hash_hex();
        let a = &hex[..hex.len().min(3)];
        let b = &hex[hex.len().min(3)..hex.len().min(5)];
        format!(
            "{}/{a}/{b}_g{}/{hex}.bin",
            self.rank_dir_name(),
            key.group()
        )
    }

    /// The key whose block lives at `rel` (a path relative to the root, `/` separators), if
    /// `rel` is exactly where [`Namespace::block_rel_path`] puts that key in this namespace:
    /// how a tier recognises its own blocks among what it lists (files, objects).
    ///
    /// ```
    /// use kv_tier_core::{BlockKey, Namespace, RunFields};
    /// let ns = Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0)?;
    /// let key = BlockKey::from_hash32([0xab; 32], 3);
    /// assert_eq!(ns.parse_block_rel_path(&ns.block_rel_path(&key)), Some(key));
    /// assert_eq!(ns.parse_block_rel_path("elsewhere/abc/ab_g3/abab.bin"), None);
    /// # Ok::<(), kv_tier_core::Error>(())
    /// ```
    pub fn parse_block_rel_path(&self, rel: &str) -> Option<BlockKey> {
        let mut parts = rel.rsplit('/');
        let hex = parts.next()?.strip_suffix(".bin")?;
        let group: u32 = parts.next()?.rsplit_once("_g")?.1.parse().ok()?;
        let key = BlockKey::from_hex(hex, group).ok()?;
        (self.block_rel_path(&key) == rel).then_some(key)
    }

    /// [`Namespace::block_rel_path`] under `root`.
    ///
    /// (For a path inside a rank directory whose namespace is not known, see
    /// [`parse_rank_rel_path`].)
    pub fn block_path(&self, root: &Path, key: &BlockKey) -> PathBuf {
        root.join(self.block_rel_path(key))
    }
}

/// The key whose block lives at `rel` inside a rank directory
/// (`<hex[0..3]>/<hex[3..5]>_g<group>/<hex>.bin`, `/` separators), if `rel` is exactly where
/// [`Namespace::block_rel_path`] puts that key in any namespace: the name is a hash in lower
/// case hex, and its directories are the ones its hex and group give. For a rank directory
/// whose namespace is not known (no usable `config.json`): what cannot be a block there.
///
/// ```
/// use kv_tier_core::BlockKey;
/// use kv_tier_core::layout::parse_rank_rel_path;
/// let key = BlockKey::from_hash32([0xab; 32], 3);
/// let hex = key.hash_hex();
/// assert_eq!(parse_rank_rel_path(&format!("aba/ba_g3/{hex}.bin")), Some(key));
/// // another program's file, and a block name in the wrong directories
/// assert_eq!(parse_rank_rel_path("a/b/notes.bin"), None);
/// assert_eq!(parse_rank_rel_path(&format!("abc/ba_g3/{hex}.bin")), None);
/// ```
pub fn parse_rank_rel_path(rel: &str) -> Option<BlockKey> {
    let mut parts = rel.split('/');
    let (_, leaf, file) = (parts.next()?, parts.next()?, parts.next()?);
    if parts.next().is_some() {
        return None;
    }
    let hex = file.strip_suffix(".bin")?;
    let group: u32 = leaf.rsplit_once("_g")?.1.parse().ok()?;
    let key = BlockKey::from_hex(hex, group).ok()?;
    let h = key.hash_hex();
    let (a, b) = (&h[..h.len().min(3)], &h[h.len().min(3)..h.len().min(5)]);
    (format!("{a}/{b}_g{group}/{h}.bin") == rel).then_some(key)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rank_paths_are_blocks_only_where_the_layout_puts_them() {
        let ns = Namespace::new(RunFields::new("org/m", "torch.bfloat16", 16), 0).unwrap();
        for key in [
            BlockKey::from_hash32([0x0f; 32], 0),
            BlockKey::from_hash32([0xab; 32], 12),
            BlockKey::new(&[0xab], 1).unwrap(),
            BlockKey::new(&[0xab, 0xcd], 0).unwrap(),
        ] {
            let full = ns.block_rel_path(&key);
            let rel = full.split_once('/').unwrap().1;
            assert_eq!(parse_rank_rel_path(rel), Some(key), "{rel}");
        }
        let hex = BlockKey::from_hash32([0xab; 32], 0).hash_hex();
        for bad in [
            "a/b/notes.bin".to_string(),
            format!("aba/ba_g0/{hex}.txt"),
            format!("aba/ba_g+0/{hex}.bin"),
            format!("aba/ba_g00/{hex}.bin"),
            format!("ABA/BA_g0/{}.bin", hex.to_uppercase()),
            format!("aba/bb_g0/{hex}.bin"),
            format!("abb/ba_g0/{hex}.bin"),
            format!("x/aba/ba_g0/{hex}.bin"),
            format!("aba/ba_g0/{}.bin", &hex[1..]),
            "aba/ba_g0/.bin".to_string(),
        ] {
            assert_eq!(parse_rank_rel_path(&bad), None, "{bad}");
        }
    }

    #[test]
    fn escapes_like_python() {
        let v = serde_json::json!({"b": "é\"\\\n\u{1}\u{7f}😀", "a": [1, {"z": true, "y": null}]});
        assert_eq!(
            canonical_json(&v),
            r#"{"a":[1,{"y":null,"z":true}],"b":"\u00e9\"\\\n\u0001\u007f\ud83d\ude00"}"#
        );
    }

    #[test]
    fn pretty_matches_python_indent_2() {
        let v = serde_json::json!({"b": [], "a": [1, 2], "c": {}});
        let mut out = String::new();
        write_json(&mut out, &v, Some(0));
        assert_eq!(
            out,
            "{\n  \"a\": [\n    1,\n    2\n  ],\n  \"b\": [],\n  \"c\": {}\n}"
        );
    }

    #[test]
    fn agnostic_forces_parallel_sizes_and_rank() {
        let mut f = RunFields::new("m", "float16", 16);
        f.tp_size = 4;
        let ns = Namespace::new(f.clone(), 3).unwrap();
        assert_eq!(ns.rank(), 0);
        assert_eq!(ns.fields().to_json()["tp_size"], 1);
        assert!(ns.fields().to_json().get("parallel_agnostic").is_none());
        f.parallel_agnostic = false;
        let ns2 = Namespace::new(f, 3).unwrap();
        assert_eq!(ns2.rank(), 3);
        assert_eq!(ns2.fields().to_json()["tp_size"], 4);
        assert_ne!(ns.digest(), ns2.digest());
    }

    #[test]
    fn short_hashes_slice_like_python() {
        let ns = Namespace::new(RunFields::new("m", "f", 16), 0).unwrap();
        let key = BlockKey::new(&[0xab], 1).unwrap();
        assert!(ns.block_rel_path(&key).ends_with("_r0/ab/_g1/ab.bin"));
        let key = BlockKey::new(&[0xab, 0xcd], 0).unwrap();
        assert!(ns.block_rel_path(&key).ends_with("_r0/abc/d_g0/abcd.bin"));
    }

    #[test]
    fn config_json_round_trips_and_mismatch_is_refused() {
        let ns = Namespace::new(RunFields::new("a/b", "torch.float16", 16), 0).unwrap();
        let text = ns.config_json();
        let p = Path::new("/x/config.json");
        ns.check_config_json(p, &text).unwrap();
        let other = Namespace::new(RunFields::new("a/b", "torch.bfloat16", 16), 0).unwrap();
        let err = other.check_config_json(p, &text).unwrap_err();
        assert!(matches!(err, Error::LayoutMismatch { .. }), "{err}");
        assert!(err.to_string().contains("/x/config.json"));
    }
}
