//! [`TierSpec`]: one entry of `secondary_tiers`, split into its type, name, vLLM's
//! `module_path`, the manager's options for it and the tier's own options.

use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use crate::error::{Error, Result};
use crate::json::from_value;
use crate::tier_options::TierOptions;

/// One entry of `secondary_tiers`: `{"type": "...", "name": "...", ...options}`.
#[derive(Debug, Clone, PartialEq)]
pub struct TierSpec {
    /// The registered type name (`"fs"`, `"obj"`, `"memory"`, or a user's own).
    pub kind: String,
    /// A unique name for this tier (defaults to the type); used in request tier filters,
    /// statistics and events.
    pub name: String,
    /// vLLM's `module_path` (the Python module an out-of-tree tier type is imported from):
    /// accepted for a registered type (and then unused, as in vLLM, which imports only
    /// unknown types); for an unregistered type building fails naming it, since tiers here
    /// are Rust types registered at compile time.
    pub module_path: Option<String>,
    /// The type-specific options (every key but `type`, `name`, `module_path` and the
    /// manager's own).
    pub options: Map<String, Value>,
    /// What the manager does with this tier: probe budget, write-back limit and policy
    /// (`probe_budget_s`, `write_back_limit_mb`, `write_back_policy`).
    pub tiering: TierOptions,
}

/// The keys every tier entry takes, whatever its type: its own and the manager's options.
fn common_keys() -> String {
    ["type", "name", "module_path"]
        .into_iter()
        .chain(crate::tier_options::keys())
        .map(|k| format!("`{k}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Parses a tier entry's own options (what [`TierSpec::options`] holds) into the tier's
/// config type (use `#[serde(deny_unknown_fields)]`); errors name the field relative to the
/// tier entry. An unknown key's error lists the type's keys and, after them, the keys every
/// tier takes (taken out of the options before they reach the type), so a misspelling of
/// one of those is found too.
///
/// ```
/// #[derive(serde::Deserialize)]
/// #[serde(deny_unknown_fields)]
/// struct Mine { #[allow(dead_code)] depth: u32 }
/// let mut options = serde_json::Map::new();
/// options.insert("probe_budget".into(), 1.into());
/// let e = kv_tier_core::config::parse_tier_options::<Mine>(options).err().unwrap().to_string();
/// assert!(e.contains("`depth`") && e.contains("`probe_budget_s`"), "{e}");
/// ```
pub fn parse_tier_options<T: DeserializeOwned>(options: Map<String, Value>) -> Result<T> {
    from_value(Value::Object(options), "").map_err(|e| match e {
        Error::InvalidConfig { field, reason } if reason.starts_with("unknown key") => {
            Error::InvalidConfig {
                field,
                reason: format!("{reason}; or one every tier takes: {}", common_keys()),
            }
        }
        e => e,
    })
}

impl TierSpec {
    /// A spec of the given type with no options.
    pub fn new(kind: impl Into<String>) -> Self {
        let kind = kind.into();
        Self {
            name: kind.clone(),
            kind,
            module_path: None,
            options: Map::new(),
            tiering: TierOptions::default(),
        }
    }

    /// Adds an option.
    pub fn option(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.options.insert(key.to_string(), value.into());
        self
    }

    /// Parses the options into a tier's own config type (use `#[serde(deny_unknown_fields)]`);
    /// errors name the field relative to the tier entry (see [`parse_tier_options`]).
    pub fn parse_options<T: DeserializeOwned>(&self) -> Result<T> {
        parse_tier_options(self.options.clone())
    }

    pub(super) fn from_value(v: Value, field: &str) -> Result<Self> {
        let Value::Object(mut map) = v else {
            return Err(Error::config(
                field,
                "must be an object with a \"type\" key",
            ));
        };
        let kind = match map.remove("type") {
            Some(Value::String(s)) if !s.is_empty() => s,
            Some(other) => {
                return Err(Error::config(
                    format!("{field}.type"),
                    format!("must be a non-empty string, got {other}"),
                ));
            }
            None => return Err(Error::config(format!("{field}.type"), "is required")),
        };
        let name = match map.remove("name") {
            Some(Value::String(s)) if !s.is_empty() => s,
            Some(other) => {
                return Err(Error::config(
                    format!("{field}.name"),
                    format!("must be a non-empty string, got {other}"),
                ));
            }
            None => kind.clone(),
        };
        let module_path = match map.remove("module_path") {
            Some(Value::String(s)) if !s.is_empty() => Some(s),
            Some(Value::Null) => None,
            Some(other) => {
                return Err(Error::config(
                    format!("{field}.module_path"),
                    format!("must be a non-empty string (a Python module path), got {other}"),
                ));
            }
            None => None,
        };
        let tiering = TierOptions::take_from(&mut map, field)?;
        Ok(Self {
            kind,
            name,
            module_path,
            options: map,
            tiering,
        })
    }
}
