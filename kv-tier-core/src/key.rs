//! Block keys: the content address of one KV-cache block.

use std::fmt;
use std::hash::{Hash, Hasher};

/// Why bytes or text are not a block key. Converts into [`crate::Error::InvalidKey`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid block key: {reason}")]
pub struct InvalidKey {
    /// Why the key is refused.
    pub reason: String,
}

type Result<T> = std::result::Result<T, InvalidKey>;

/// The largest block-hash length a [`BlockKey`] holds, in bytes.
pub const MAX_HASH_LEN: usize = 64;

/// Content address of a block: the engine's prefix-hash bytes plus a KV-cache group index.
///
/// The byte form ([`BlockKey::to_offload_bytes`]) is the hash bytes followed by the group as
/// 4 bytes big-endian, exactly vLLM's `OffloadKey`. The key is `Copy`, stored inline (no
/// allocation), and hashes only the bytes in use.
///
/// ```
/// use kv_tier_core::BlockKey;
/// let key = BlockKey::new(&[0xab, 0xcd, 0xef], 2)?;
/// assert_eq!(key.to_string(), "abcdef:g2");
/// assert_eq!(key.hash_hex(), "abcdef");
/// let bytes = key.to_offload_bytes();
/// assert_eq!(bytes, [0xab, 0xcd, 0xef, 0, 0, 0, 2]);
/// assert_eq!(BlockKey::from_offload_bytes(&bytes)?, key);
/// # Ok::<(), kv_tier_core::Error>(())
/// ```
#[derive(Clone, Copy)]
pub struct BlockKey {
    /// A 64-bit digest of (hash bytes, group), computed once: hashing a key into a map then
    /// costs one word, and unequal keys usually differ here first.
    mix: u64,
    group: u32,
    len: u8,
    hash: [u8; MAX_HASH_LEN],
}

/// The digest a [`BlockKey`] of `hash` and `group` carries (what it hashes as).
pub(crate) fn mix_of(hash: &[u8], group: u32) -> u64 {
    const K: u64 = 0x517c_c1b7_2722_0a95;
    let mut h = (hash.len() as u64) ^ ((group as u64) << 32);
    let mut chunks = hash.chunks_exact(8);
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = (h.rotate_left(5) ^ w).wrapping_mul(K);
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut b = [0u8; 8];
        b[..rest.len()].copy_from_slice(rest);
        h = (h.rotate_left(5) ^ u64::from_le_bytes(b)).wrapping_mul(K);
    }
    // final avalanche (murmur3 fmix64) so every input bit reaches the low bits maps use
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^ (h >> 33)
}

impl BlockKey {
    /// A key from block-hash bytes (1 to [`MAX_HASH_LEN`] bytes) and a group index.
    pub fn new(hash: &[u8], group: u32) -> Result<Self> {
        if hash.is_empty() {
            return Err(InvalidKey {
                reason: "the block hash is empty".into(),
            });
        }
        if hash.len() > MAX_HASH_LEN {
            return Err(InvalidKey {
                reason: format!(
                    "the block hash is {} bytes long; at most {MAX_HASH_LEN} are supported",
                    hash.len()
                ),
            });
        }
        let mut buf = [0u8; MAX_HASH_LEN];
        buf[..hash.len()].copy_from_slice(hash);
        Ok(Self {
            mix: mix_of(hash, group),
            len: hash.len() as u8,
            group,
            hash: buf,
        })
    }

    /// A key from a 32-byte hash (the usual size); infallible.
    pub fn from_hash32(hash: [u8; 32], group: u32) -> Self {
        let mut buf = [0u8; MAX_HASH_LEN];
        buf[..32].copy_from_slice(&hash);
        Self {
            mix: mix_of(&hash, group),
            len: 32,
            group,
            hash: buf,
        }
    }

    /// Parses vLLM's `OffloadKey` byte form: hash bytes followed by the group, 4 bytes big-endian.
    pub fn from_offload_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.len() < 5 {
            return Err(InvalidKey {
                reason: format!(
                    "an offload key is hash bytes plus a 4-byte group, so at least 5 bytes; got {}",
                    bytes.len()
                ),
            });
        }
        let (hash, group) = bytes.split_at(bytes.len() - 4);
        let group = u32::from_be_bytes(group.try_into().expect("4 bytes"));
        Self::new(hash, group)
    }

    /// Parses a lower-case or upper-case hex block hash.
    pub fn from_hex(hex: &str, group: u32) -> Result<Self> {
        if !hex.len().is_multiple_of(2) {
            return Err(InvalidKey {
                reason: format!("hex hash {hex:?} has an odd number of digits"),
            });
        }
        let mut out = Vec::with_capacity(hex.len() / 2);
        for pair in hex.as_bytes().chunks(2) {
            let s = std::str::from_utf8(pair).unwrap_or("");
            let b = u8::from_str_radix(s, 16).map_err(|_| InvalidKey {
                reason: format!("hex hash {hex:?} has a non-hex digit"),
            })?;
            out.push(b);
        }
        Self::new(&out, group)
    }

    /// The key's 64-bit digest (what it hashes as in a map).
    pub(crate) fn mix(&self) -> u64 {
        self.mix
    }

    /// The block-hash bytes.
    pub fn hash_bytes(&self) -> &[u8] {
        &self.hash[..self.len as usize]
    }

    /// The KV-cache group index.
    pub fn group(&self) -> u32 {
        self.group
    }

    /// vLLM's `OffloadKey` byte form: hash bytes ++ group (4 bytes, big-endian).
    pub fn to_offload_bytes(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(self.len as usize + 4);
        v.extend_from_slice(self.hash_bytes());
        v.extend_from_slice(&self.group.to_be_bytes());
        v
    }

    /// Lower-case hex of the hash bytes only (not the group), as used in block paths.
    pub fn hash_hex(&self) -> String {
        let mut s = String::with_capacity(self.len as usize * 2);
        for b in self.hash_bytes() {
            s.push(HEX[(b >> 4) as usize] as char);
            s.push(HEX[(b & 15) as usize] as char);
        }
        s
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl PartialEq for BlockKey {
    fn eq(&self, other: &Self) -> bool {
        self.mix == other.mix
            && self.group == other.group
            && self.hash_bytes() == other.hash_bytes()
    }
}

impl Eq for BlockKey {}

impl Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.mix);
    }
}

impl PartialOrd for BlockKey {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for BlockKey {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.hash_bytes()
            .cmp(other.hash_bytes())
            .then(self.group.cmp(&other.group))
    }
}

impl fmt::Display for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:g{}", self.hash_hex(), self.group)
    }
}

impl fmt::Debug for BlockKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockKey({self})")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn offload_bytes_round_trip() {
        let hash: Vec<u8> = (0..32).collect();
        let key = BlockKey::new(&hash, 0x0102_0304).unwrap();
        let bytes = key.to_offload_bytes();
        assert_eq!(&bytes[..32], &hash[..]);
        assert_eq!(&bytes[32..], &[1, 2, 3, 4]);
        assert_eq!(BlockKey::from_offload_bytes(&bytes).unwrap(), key);
    }

    #[test]
    fn bad_input_is_an_error_not_a_panic() {
        assert!(matches!(BlockKey::new(&[], 0), Err(InvalidKey { .. })));
        assert!(BlockKey::new(&[7; 65], 0).is_err());
        assert!(BlockKey::new(&[7; 64], 0).is_ok());
        assert!(BlockKey::from_offload_bytes(&[1, 2, 3, 4]).is_err());
        assert!(BlockKey::from_hex("abc", 0).is_err());
        assert!(BlockKey::from_hex("zz", 0).is_err());
    }

    #[test]
    fn hex_display_is_lower_case() {
        let key = BlockKey::from_hex("D0F3", 1).unwrap();
        assert_eq!(key.hash_hex(), "d0f3");
        assert_eq!(key.to_string(), "d0f3:g1");
    }

    #[test]
    fn equality_and_hash_ignore_unused_bytes_and_respect_group() {
        let a = BlockKey::new(&[1, 2], 0).unwrap();
        let b = BlockKey::from_offload_bytes(&[1, 2, 0, 0, 0, 0]).unwrap();
        let c = BlockKey::new(&[1, 2], 1).unwrap();
        let d = BlockKey::new(&[1, 2, 0], 0).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        let set: HashSet<_> = [a, b, c, d].into_iter().collect();
        assert_eq!(set.len(), 3);
    }
}
