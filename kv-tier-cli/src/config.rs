//! `kv-tier config check FILE`.

use std::path::Path;

use serde_json::{Value, json};

use crate::{Outcome, print_json};

/// The effective config of the JSON text, secrets masked, or the error.
fn effective(text: &str) -> Result<Value, String> {
    let cfg = kv_tier::KvTierConfig::from_json_str(text).map_err(|e| e.to_string())?;
    let mut eff =
        kv_tier::effective_config(&cfg, &kv_tier::registry()).map_err(|e| e.to_string())?;
    kv_tier::redact_secrets(&mut eff);
    Ok(eff)
}

pub(crate) fn check(file: &Path, json: bool) -> Outcome {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let result = effective(&text);
    if json {
        print_json(&match &result {
            Ok(eff) => json!({"file": file.to_string_lossy(), "ok": true, "effective": eff}),
            Err(e) => json!({"file": file.to_string_lossy(), "ok": false, "error": e}),
        });
        return Ok(result.is_ok());
    }
    match result {
        Ok(eff) => {
            let tiers = eff["secondary_tiers"].as_array().map_or(0, Vec::len);
            eprintln!(
                "{}: valid ({tiers} secondary tier{}); the effective config:",
                file.display(),
                if tiers == 1 { "" } else { "s" }
            );
            print_json(&eff);
            Ok(true)
        }
        Err(e) => Err(format!("{}: {e}", file.display())),
    }
}
