//! Names of the instances sharing one tier (a shared fs root, a shared bucket): the check of a
//! configured `instance_id` and the default one.

use crate::error::{Error, Result};

/// Checks an instance id: 1 to 64 letters, digits, `.`, `_` or `-`, and not `.` or `..` (it
/// names files and objects of the coordination); the error names `field`.
pub fn check_instance_id(field: &str, id: &str) -> Result<()> {
    let ok = (1..=64).contains(&id.len())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        && id != "."
        && id != "..";
    if ok {
        return Ok(());
    }
    Err(Error::config(
        field,
        format!(
            "must be 1 to 64 letters, digits, '.', '_' or '-' (not \".\" or \"..\"), got {id:?}"
        ),
    ))
}

/// A default instance id, unique among processes: `<host>-<pid>-<16 random bits>` (the host
/// name cut to 32 of the allowed characters; `host` if there is none).
///
/// ```
/// let id = kv_tier_core::config::default_instance_id();
/// kv_tier_core::config::check_instance_id("instance_id", &id).unwrap();
/// ```
pub fn default_instance_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-' || *c == '.')
        .take(32)
        .collect::<String>();
    let host = if host.is_empty() { "host".into() } else { host };
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    format!("{host}-{}-{:04x}", std::process::id(), h.finish() & 0xffff)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_checked_and_the_default_passes() {
        for ok in ["a", "node-1.gpu_0", &"x".repeat(64)] {
            check_instance_id("instance_id", ok).unwrap();
        }
        for bad in ["", ".", "..", "a/b", "a b", "é", &"x".repeat(65)] {
            let e = check_instance_id("instance_id", bad).unwrap_err();
            assert!(e.to_string().contains("instance_id"), "{e}");
        }
        let a = default_instance_id();
        check_instance_id("instance_id", &a).unwrap();
        assert!(a.contains(&format!("-{}-", std::process::id())), "{a}");
    }
}
