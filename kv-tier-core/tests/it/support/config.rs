//! Configs in the tests: a manager config sized in slots, `config check` (parse and effective
//! config), the errors a config gets, a parse-check-build that must not panic, a round trip of
//! blocks through a built manager, and the layouts and namespaces of the namespace tests.

use std::path::{Path, PathBuf};

use kv_tier_core::{BlockKey, Error, KvTierConfig, Namespace, RequestContext, TieringManager};
use serde_json::Value;

use super::*;

/// A DRAM slot's bytes for blocks of `bs` bytes: `bs` rounded up to a page.
pub(crate) fn slot_of(bs: usize) -> usize {
    bs.div_ceil(4096) * 4096
}

/// A manager config of `slots` DRAM blocks of `bs` bytes (the pool sized in page-rounded slots),
/// `extra` added to the top level.
pub(crate) fn dram_cfg(slots: usize, bs: usize, extra: &str) -> KvTierConfig {
    // slots are page-rounded: size the pool in slot units
    let slot = bs.div_ceil(4096) * 4096;
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {bs}{extra}}}"#,
        slots * slot
    ))
    .unwrap()
}

/// [`dram_cfg`] with blocks of [`BS`] bytes.
pub(crate) fn mcfg(slots: usize, extra: &str) -> KvTierConfig {
    dram_cfg(slots, BS, extra)
}

/// Parse + effective config (what `config check` runs).
pub(crate) fn config_check(text: &str) -> Result<Value, Error> {
    let cfg = KvTierConfig::from_json_str(text)?;
    kv_tier::effective_config(&cfg, &kv_tier::registry())
}

/// The error a config gets, from parsing or from the effective config; panics if it is accepted.
pub(crate) fn err_of(json: &str) -> String {
    match KvTierConfig::from_json_str(json) {
        Err(e) => e.to_string(),
        Ok(c) => match kv_tier::effective_config(&c, &kv_tier::registry()) {
            Err(e) => e.to_string(),
            Ok(v) => panic!("accepted: {json}\n-> {v}"),
        },
    }
}

/// The field and reason of the error a config gets (from parsing or the effective config);
/// panics if it is accepted or the error is not `InvalidConfig`.
pub(crate) fn refused(text: &str) -> (String, String) {
    let r = KvTierConfig::from_json_str(text)
        .and_then(|c| kv_tier::effective_config(&c, &kv_tier::registry()).map(|_| ()));
    match r {
        Err(kv_tier::Error::InvalidConfig { field, reason }) => (field, reason),
        other => panic!("{text}: expected a refusal, got {other:?}"),
    }
}

/// Parse, check, and (with a namespace) build: an Err is fine, a panic is not.
pub(crate) fn parse_check_build(text: &str) -> std::result::Result<(), String> {
    let cfg = KvTierConfig::from_json_str(text).map_err(|e| e.to_string())?;
    kv_tier::effective_config(&cfg, &kv_tier::registry()).map_err(|e| e.to_string())?;
    let mut cfg = cfg;
    if cfg.block_size_bytes == 0 {
        cfg.block_size_bytes = BS_64K as u64;
    }
    let mut b = kv_tier::builder(cfg).map_err(|e| e.to_string())?;
    b = b.namespace(model_namespace());
    let m = b.build_blocking().map_err(|e| e.to_string())?;
    m.shutdown_blocking().map_err(|e| e.to_string())?;
    Ok(())
}

/// `n` keys whose hashes are `salt` bytes but for the index (`i + 1`, little-endian) up front.
pub(crate) fn salted_keys(n: u64, salt: u8) -> Vec<BlockKey> {
    (0..n)
        .map(|i| {
            let mut h = [salt; 32];
            h[..8].copy_from_slice(&(i + 1).to_le_bytes());
            BlockKey::from_hash32(h, 0)
        })
        .collect()
}

/// The byte a [`roundtrip`] block of `k` is filled with.
pub(crate) fn fill_byte(k: &BlockKey) -> u8 {
    k.hash_bytes()[0] ^ 0x5a
}

/// Stores `n` blocks, waits for the cascade, empties DRAM, then asks for them until they are
/// back (or `steps` steps pass). Returns how many came back with the right bytes. Panics
/// only on wrong bytes.
pub(crate) fn roundtrip(m: &TieringManager, n: u64, salt: u8, steps: usize) -> usize {
    let ks = salted_keys(n, salt);
    let req = RequestContext::new(1000 + salt as u64);
    match m.prepare_store(&ks) {
        Ok(mut pending) => {
            for (k, s) in pending.slots() {
                s.as_mut_slice().fill(fill_byte(k));
            }
            pending.commit(req.id);
        }
        Err(e) => {
            eprintln!("prepare_store refused: {e}");
            return 0;
        }
    }
    m.on_request_finished(req.id);
    m.runtime().block_on(m.wait_idle());
    m.runtime().block_on(m.reset_cache());
    let r = RequestContext::new(2000 + salt as u64);
    let mut hit = 0;
    for _ in 0..steps {
        let f = m.lookup_prefix(&ks, &r);
        m.on_schedule_end();
        hit = f.hit;
        if f.hit == ks.len() {
            break;
        }
        m.runtime().block_on(m.wait_idle());
        // the scheduler's next step
        std::thread::sleep(Duration::from_millis(2));
    }
    if hit > 0 {
        let views = m.prepare_load(&ks[..hit]).expect("hits load");
        for (k, v) in ks.iter().zip(&views) {
            assert!(
                v.as_slice().iter().all(|&b| b == fill_byte(k)),
                "wrong bytes for a block loaded back"
            );
        }
    }
    m.on_request_finished(r.id);
    hit
}

/// The layout of [`MODEL`] (bf16, 16 tokens per hash), `extra` added.
pub(crate) fn model_layout(extra: &str) -> String {
    format!(
        r#"{{"model_name": "{MODEL}", "dtype": "torch.bfloat16", "tokens_per_hash": 16{extra}}}"#
    )
}

/// A config of 16 blocks of [`BS_64K`] bytes with `layout`, over an fs tier in `root`.
pub(crate) fn layout_config(root: &std::path::Path, layout: &str) -> kv_tier::Result<KvTierConfig> {
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS_64K}, "layout": {layout},
            "secondary_tiers": [{{"type": "fs", "root_dir": {root:?}}}]}}"#,
        16 * BS_64K
    ))
}

/// The namespace of `cfg`'s layout.
pub(crate) fn namespace_of(cfg: &KvTierConfig) -> kv_tier::Namespace {
    cfg.layout.as_ref().unwrap().namespace().unwrap()
}

/// Python's canonical JSON and 12-hex-digit SHA-256 digest of `fields`, as vLLM computes them
/// (`json.dumps(sort_keys=True, separators=(\",\", \":\"))`).
pub(crate) fn python_digest(fields: &serde_json::Value) -> (String, String) {
    let script = r#"
import sys, json, hashlib
f = json.loads(sys.stdin.read())
s = json.dumps(f, sort_keys=True, separators=(",", ":"))
print(s)
print(hashlib.sha256(s.encode()).hexdigest()[:12])
"#;
    use std::io::Write;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(fields.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let mut lines = text.lines();
    (
        lines.next().unwrap().to_string(),
        lines.next().unwrap().to_string(),
    )
}

/// The namespace a config with `layout` computes.
pub(crate) fn layout_ns(layout: serde_json::Value) -> kv_tier::Result<Namespace> {
    let cfg = KvTierConfig::from_value(serde_json::json!({
        "cpu_bytes_to_use": 4194304, "layout": layout
    }))?;
    cfg.layout.unwrap().namespace()
}

/// The layout-vector files: this crate's copy, and the shared spec's when checked out beside
/// the repository.
pub(crate) fn vector_files() -> Vec<PathBuf> {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![here.join("tests/data/layout-vectors.json")];
    // The project's shared spec, when checked out beside the repository, is checked too so a
    // newer vector set cannot silently diverge from the copy kept here.
    let shared = here.join("../../shared/spec/layout-vectors.json");
    if shared.exists() {
        files.push(shared);
    }
    files
}
