//! `kv-tier config check FILE`.

use std::path::Path;

use serde_json::{Value, json};

use crate::{Outcome, print_json};

/// Keys whose values are secrets: printed masked.
const SECRETS: [&str; 3] = ["access_key", "secret_key", "session_token"];

fn mask(v: &mut Value) {
    match v {
        Value::Object(m) => {
            for (k, v) in m.iter_mut() {
                if SECRETS.contains(&k.as_str()) {
                    if v.as_str().is_some_and(|s| !s.is_empty()) {
                        *v = Value::from("***");
                    }
                } else {
                    mask(v);
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(mask),
        _ => {}
    }
}

/// The effective config of the JSON text, secrets masked, or the error.
fn effective(text: &str) -> Result<Value, String> {
    let cfg = kv_tier::KvTierConfig::from_json_str(text).map_err(|e| e.to_string())?;
    let mut eff =
        kv_tier::effective_config(&cfg, &kv_tier::registry()).map_err(|e| e.to_string())?;
    mask(&mut eff);
    Ok(eff)
}

pub(crate) fn check(file: &Path, json: bool) -> Outcome {
    let text = std::fs::read_to_string(file).map_err(|e| format!("{}: {e}", file.display()))?;
    let result = effective(&text);
    if json {
        print_json(&match &result {
            Ok(eff) => json!({"file": file, "ok": true, "effective": eff}),
            Err(e) => json!({"file": file, "ok": false, "error": e}),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secrets_are_masked_wherever_they_are() {
        let mut v =
            json!({"a": {"secret_key": "s", "access_key": "", "x": [{"session_token": "t"}]}});
        mask(&mut v);
        assert_eq!(
            v,
            json!({"a": {"secret_key": "***", "access_key": "", "x": [{"session_token": "***"}]}})
        );
    }
}
