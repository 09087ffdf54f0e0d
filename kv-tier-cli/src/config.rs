//! `kv-tier config check FILE`.

use std::io::Read as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::Path;

use serde_json::{Value, json};

use crate::{Outcome, human, print_json};

/// A config file larger than this is refused unread (a config is a few KiB).
const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The text of the config at `file`: a regular file (a device or FIFO is refused, and opened
/// without blocking), of at most [`MAX_CONFIG_BYTES`].
fn read_config(file: &Path) -> Result<String, String> {
    let named = |e: String| format!("{}: {e}", file.display());
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(file)
        .map_err(|e| named(e.to_string()))?;
    let m = f.metadata().map_err(|e| named(e.to_string()))?;
    if !m.is_file() {
        let what = if m.is_dir() {
            "a directory"
        } else {
            "a device, FIFO or socket"
        };
        return Err(named(format!(
            "not a regular file ({what}): a config is a JSON file"
        )));
    }
    let mut bytes = Vec::new();
    (&f).take(MAX_CONFIG_BYTES + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| named(e.to_string()))?;
    if bytes.len() as u64 > MAX_CONFIG_BYTES {
        return Err(named(format!(
            "larger than {}: not a config",
            human(MAX_CONFIG_BYTES)
        )));
    }
    String::from_utf8(bytes).map_err(|e| named(format!("not UTF-8 text ({e})")))
}

/// Free bytes on the filesystem of `path` (or of its nearest existing ancestor: a root that
/// is not made yet), with the path measured.
fn free_bytes(path: &Path) -> Option<(u64, std::path::PathBuf)> {
    let dir = path.ancestors().find(|p| p.exists())?;
    let c = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: statvfs is plain data: all zeroes is a valid value
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a statvfs the call fills
    if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
        return None;
    }
    Some((s.f_bavail as u64 * s.f_frsize as u64, dir.to_path_buf()))
}

/// What a valid config may still get wrong: an fs tier without a cap, or with a cap above the
/// free space of its filesystem.
fn warnings(eff: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for (i, t) in eff["secondary_tiers"]
        .as_array()
        .into_iter()
        .flatten()
        .enumerate()
    {
        if t["type"] != "fs" {
            continue;
        }
        let root = Path::new(t["root_dir"].as_str().unwrap_or(""));
        let at = format!("secondary_tiers[{i}] (fs at {})", root.display());
        match t["gc_max_size_gb"].as_f64() {
            None => out.push(format!(
                "{at} has no cap (gc_max_size_gb): it grows until its filesystem is full"
            )),
            Some(gb) => {
                let cap = (gb * (1u64 << 30) as f64) as u64;
                if let Some((free, dir)) = free_bytes(root)
                    && cap > free
                {
                    out.push(format!(
                        "{at}: its cap of {} is more than the {} free on the filesystem of {} now",
                        human(cap),
                        human(free),
                        dir.display()
                    ));
                }
            }
        }
    }
    out
}

/// The effective config of the JSON text, secrets masked, with what the file left out
/// filled by default; or the error. The defaults listed: the top-level keys the file does not
/// have, then the tiers' (as the tiers say).
fn effective(text: &str) -> Result<(Value, Vec<String>), String> {
    let cfg = kv_tier::KvTierConfig::from_json_str(text).map_err(|e| e.to_string())?;
    let (mut eff, tier_defaults) =
        kv_tier::effective_config_and_defaults(&cfg, &kv_tier::registry())
            .map_err(|e| e.to_string())?;
    kv_tier::redact_secrets(&mut eff);
    let raw: Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let mut defaults: Vec<String> = eff
        .as_object()
        .into_iter()
        .flat_map(|m| m.keys())
        .filter(|k| !matches!(k.as_str(), "secondary_tiers" | "layout") && raw.get(k).is_none())
        .cloned()
        .collect();
    defaults.extend(tier_defaults);
    Ok((eff, defaults))
}

pub(crate) fn check(file: &Path, json: bool) -> Outcome {
    let text = read_config(file)?;
    let result = effective(&text);
    if json {
        print_json(&match &result {
            Ok((eff, defaults)) => json!({
                "file": file.to_string_lossy(),
                "ok": true,
                "effective": eff,
                "defaults": defaults,
                "warnings": warnings(eff),
            }),
            Err(e) => json!({"file": file.to_string_lossy(), "ok": false, "error": e}),
        });
        return Ok(result.is_ok());
    }
    match result {
        Ok((eff, defaults)) => {
            let tiers = eff["secondary_tiers"].as_array().map_or(0, Vec::len);
            eprintln!(
                "{}: valid ({tiers} secondary tier{}); the effective config:",
                file.display(),
                if tiers == 1 { "" } else { "s" }
            );
            print_json(&eff);
            if !defaults.is_empty() {
                eprintln!("defaults (left out of the file): {}", defaults.join(", "));
            }
            eprintln!(
                "null: not set, or does not apply (an fs tier's gc_* without gc_max_size_gb, \
                 shared_* without shared; instance_id is made at open)"
            );
            for w in warnings(&eff) {
                eprintln!("WARN {w}");
            }
            Ok(true)
        }
        Err(e) => Err(format!("{}: {e}", file.display())),
    }
}
