//! JSON helpers shared by the config and the layout: deserialising with errors that name the
//! offending field's path.

use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::{Error, Result};

/// Deserializes `value` into `T`, turning serde's error into [`Error::InvalidConfig`] whose
/// field is the JSON path of the offending value (under `prefix`).
pub fn from_value<T: DeserializeOwned>(value: Value, prefix: &str) -> Result<T> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        let mut field = join_path(prefix, if path == "." { "" } else { &path });
        let mut reason = inner.clone();
        for marker in ["unknown field `", "missing field `"] {
            if let Some(rest) = inner.strip_prefix(marker)
                && let Some(end) = rest.find('`')
            {
                let name = &rest[..end];
                if !(field == name || field.ends_with(&format!(".{name}"))) {
                    field = join_path(&field, name);
                }
                reason = if marker.starts_with("unknown") {
                    format!("unknown key (check the spelling): {inner}")
                } else {
                    "is required".to_string()
                };
            }
        }
        Error::config(field, reason)
    })
}

fn join_path(a: &str, b: &str) -> String {
    match (a.is_empty(), b.is_empty()) {
        (true, _) => b.to_string(),
        (false, true) => a.to_string(),
        (false, false) if b.starts_with('[') => format!("{a}{b}"),
        _ => format!("{a}.{b}"),
    }
}
