//! JSON helpers shared by the config and the layout: deserialising with errors that name the
//! offending field's path.

use std::fmt::Write as _;

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

/// Canonical JSON as Python's `json.dumps(v, sort_keys=True, separators=(",", ":"))`:
/// sorted keys, no spaces, every character outside printable ASCII escaped as `\uXXXX`.
pub fn canonical_json(v: &Value) -> String {
    let mut out = String::new();
    write_json(&mut out, v, None);
    out
}

/// Writes `v` as [`canonical_json`] does, or (with `indent`, the depth to start at) pretty-
/// printed with 2-space indents, as Python's `json.dumps(v, indent=2, sort_keys=True)`.
pub(crate) fn write_json(out: &mut String, v: &Value, indent: Option<usize>) {
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_str(out, s),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, indent.map(|d| d + 1));
                write_json(out, item, indent.map(|d| d + 1));
            }
            newline(out, indent);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                newline(out, indent.map(|d| d + 1));
                write_str(out, k);
                out.push_str(if indent.is_some() { ": " } else { ":" });
                write_json(out, &map[k], indent.map(|d| d + 1));
            }
            newline(out, indent);
            out.push('}');
        }
    }
}

fn newline(out: &mut String, indent: Option<usize>) {
    if let Some(d) = indent {
        out.push('\n');
        for _ in 0..d {
            out.push_str("  ");
        }
    }
}

fn write_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            ' '..='~' => out.push(c),
            _ => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    write!(out, "\\u{unit:04x}").expect("string write");
                }
            }
        }
    }
    out.push('"');
}

/// Marks a parse error with the JSON path where it happened (see [`parse_strict`]).
const AT: &str = "kv-tier-json-path `";

/// Parses `text` as one JSON value whose objects hold each key once (serde_json keeps the
/// last of a repeated key, silently: `{"a": -1, "a": 1}` would pass a check of the second).
/// Errors name the path of the value: a repeated key, a number out of range (`1e309`), a
/// syntax error inside a value.
pub fn parse_strict(text: &str) -> Result<Value> {
    use serde::de::DeserializeSeed;
    let mut de = serde_json::Deserializer::from_str(text);
    let parsed = Strict("")
        .deserialize(&mut de)
        .and_then(|v| de.end().map(|()| v));
    parsed.map_err(|e| {
        let msg = e.to_string();
        match msg.strip_prefix(AT).and_then(|r| r.split_once("`: ")) {
            Some((path, reason)) => Error::config(path, format!("not valid JSON: {reason}")),
            None => Error::config("", format!("not valid JSON: {msg}")),
        }
    })
}

/// A [`Value`] deserialised with its path, refusing repeated keys.
struct Strict<'a>(&'a str);

impl<'de> serde::de::DeserializeSeed<'de> for Strict<'_> {
    type Value = Value;
    fn deserialize<D: serde::Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<Value, D::Error> {
        d.deserialize_any(self)
    }
}

/// `e` marked with `path`, unless a value inside it marked it already.
fn at_path<E: serde::de::Error>(e: E, path: &str) -> E {
    let msg = e.to_string();
    if msg.starts_with(AT) {
        e
    } else {
        E::custom(format!("{AT}{path}`: {msg}"))
    }
}

impl<'de> serde::de::Visitor<'de> for Strict<'_> {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }
    fn visit_bool<E>(self, v: bool) -> std::result::Result<Value, E> {
        Ok(Value::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_u64<E>(self, v: u64) -> std::result::Result<Value, E> {
        Ok(Value::from(v))
    }
    fn visit_f64<E>(self, v: f64) -> std::result::Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, v: &str) -> std::result::Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }
    fn visit_string<E>(self, v: String) -> std::result::Result<Value, E> {
        Ok(Value::String(v))
    }
    fn visit_unit<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> std::result::Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_seq<A: serde::de::SeqAccess<'de>>(
        self,
        mut seq: A,
    ) -> std::result::Result<Value, A::Error> {
        let mut out = Vec::new();
        loop {
            let path = format!("{}[{}]", self.0, out.len());
            match seq.next_element_seed(Strict(&path)) {
                Ok(Some(v)) => out.push(v),
                Ok(None) => return Ok(Value::Array(out)),
                Err(e) => return Err(at_path(e, &path)),
            }
        }
    }
    fn visit_map<A: serde::de::MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Value, A::Error> {
        use serde::de::Error as _;
        let mut out = serde_json::Map::new();
        while let Some(key) = map.next_key::<String>().map_err(|e| at_path(e, self.0))? {
            let path = join_path(self.0, &key);
            if out.contains_key(&key) {
                return Err(A::Error::custom(format!(
                    "{AT}{path}`: the key is given twice (each key of an object once)"
                )));
            }
            let v = map
                .next_value_seed(Strict(&path))
                .map_err(|e| at_path(e, &path))?;
            out.insert(key, v);
        }
        Ok(Value::Object(out))
    }
}

#[cfg(test)]
mod strict_tests {
    use super::*;

    fn field(text: &str) -> (String, String) {
        match parse_strict(text) {
            Err(Error::InvalidConfig { field, reason }) => (field, reason),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn repeated_keys_and_bad_numbers_name_their_path() {
        assert_eq!(
            parse_strict(r#"{"a": [1, {"b": 2.5}], "c": null}"#).unwrap(),
            serde_json::json!({"a": [1, {"b": 2.5}], "c": null})
        );
        let (f, r) = field(r#"{"a": 1, "a": 2}"#);
        assert_eq!(f, "a");
        assert!(r.contains("twice"), "{r}");
        assert_eq!(field(r#"{"t": [{"x": 0}, {"x": 1, "x": 1}]}"#).0, "t[1].x");
        let (f, r) = field(r#"{"t": [{"n": 1e309}]}"#);
        assert_eq!(f, "t[0].n");
        assert!(r.contains("out of range"), "{r}");
        assert_eq!(field(r#"{"a": 1} x"#).0, "");
        assert_eq!(field(r#"{"a": tru}"#).0, "a");
    }
}
