//! Block checksums, one definition for every tier: a CRC32C over the block's key and then its
//! bytes, so a block moved or copied to another key's place fails verification there instead
//! of being served as that key; and the verify step that turns what a tier found stored
//! into verified bytes or a refusal.

use serde::{Deserialize, Serialize};

use crate::key::BlockKey;

/// Block integrity checking of a tier (`"checksum"` in its config entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Checksum {
    /// No checksum (the default; vLLM's tiers keep none).
    #[default]
    None,
    /// A CRC32C of the key and the block ([`block_crc`]), kept beside the block by the tier
    /// (the fs tier in an extended attribute or a sidecar file, the obj tier in the object's
    /// metadata) and verified on every load.
    Crc32c,
}

/// The checksum of `key`'s block `data`: CRC32C over the key's hash bytes, then its group
/// (big-endian), then the data.
///
/// ```
/// use kv_tier_core::{BlockKey, checksum::block_crc};
/// let (a, b) = (BlockKey::from_hash32([1; 32], 0), BlockKey::from_hash32([2; 32], 0));
/// assert_ne!(block_crc(&a, b"same bytes"), block_crc(&b, b"same bytes"));
/// ```
pub fn block_crc(key: &BlockKey, data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(key.hash_bytes());
    let crc = crc32c::crc32c_append(crc, &key.group().to_be_bytes());
    crc32c::crc32c_append(crc, data)
}

/// A checksum written as text: exactly 8 hex digits (either case).
///
/// ```
/// use kv_tier_core::checksum::parse_crc_hex;
/// assert_eq!(parse_crc_hex("deadBEEF"), Some(0xdead_beef));
/// assert_eq!(parse_crc_hex("beef"), None);
/// assert_eq!(parse_crc_hex("+eadbeef"), None);
/// ```
pub fn parse_crc_hex(text: &str) -> Option<u32> {
    (text.len() == 8 && text.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| u32::from_str_radix(text, 16).ok())
        .flatten()
}

/// A block's stored checksum, as a tier found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoredCrc {
    /// A well-formed checksum.
    Crc(u32),
    /// None (written by a program that keeps none, or before checksums were on).
    Missing,
    /// Something that is not a checksum, with what is wrong: damage.
    Malformed(String),
}

/// What verifying a block's bytes against its stored checksum says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The checksum matches: serve the bytes.
    Verified,
    /// There is no checksum and the tier accepts unverified blocks: serve them, counted.
    Unverified,
    /// The checksum does not match: a miss, and the block is damaged.
    Mismatch {
        /// The checksum of the bytes read.
        got: u32,
        /// The stored checksum.
        stored: u32,
    },
    /// There is no checksum and checksums are required: a miss, and the block is removed
    /// so the next store rewrites it with one.
    Missing,
    /// The stored checksum is malformed: a miss, and the block is damaged.
    Malformed(String),
}

impl Verdict {
    /// Whether the bytes may be served.
    pub fn serves(&self) -> bool {
        matches!(self, Verdict::Verified | Verdict::Unverified)
    }
}

/// Verifies `data`, the block of `key`, against what was stored beside it. Without a stored
/// checksum the block is served only if `accept_unverified`.
///
/// ```
/// use kv_tier_core::BlockKey;
/// use kv_tier_core::checksum::{StoredCrc, Verdict, block_crc, verify};
/// let key = BlockKey::from_hash32([7; 32], 0);
/// let crc = block_crc(&key, b"block");
/// assert_eq!(verify(&StoredCrc::Crc(crc), &key, b"block", false), Verdict::Verified);
/// assert!(!verify(&StoredCrc::Crc(crc), &key, b"blocK", false).serves());
/// assert_eq!(verify(&StoredCrc::Missing, &key, b"block", true), Verdict::Unverified);
/// assert_eq!(verify(&StoredCrc::Missing, &key, b"block", false), Verdict::Missing);
/// ```
pub fn verify(stored: &StoredCrc, key: &BlockKey, data: &[u8], accept_unverified: bool) -> Verdict {
    match stored {
        StoredCrc::Crc(want) => {
            let got = block_crc(key, data);
            if got == *want {
                Verdict::Verified
            } else {
                Verdict::Mismatch { got, stored: *want }
            }
        }
        StoredCrc::Missing if accept_unverified => Verdict::Unverified,
        StoredCrc::Missing => Verdict::Missing,
        StoredCrc::Malformed(why) => Verdict::Malformed(why.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_crc_hex;

    #[test]
    fn a_stored_checksum_is_exactly_eight_hex_digits() {
        assert_eq!(parse_crc_hex("deadBEEF"), Some(0xdead_beef));
        assert_eq!(parse_crc_hex("0000000a"), Some(10));
        for bad in [
            "",
            "abcdef",
            "0deadbeef",
            "0000000g",
            "+0000001",
            " 0000001",
        ] {
            assert_eq!(parse_crc_hex(bad), None, "{bad:?} was accepted");
        }
    }
}
