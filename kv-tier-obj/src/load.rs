//! Loading one block: a GET streamed into its sink, served only whole and (with checksums)
//! verified; a missing object leaves the count, a damaged one is deleted (see
//! [`Shared::delete_damaged_loaded`]).

use futures::StreamExt;
use kv_tier_core::checksum::{self, StoredCrc, Verdict, parse_crc_hex};
use kv_tier_core::{BlockKey, BlockSink, Error, Result};
use object_store::Attribute;
use object_store::ObjectStoreExt as _;
use object_store::path::Path as ObjPath;

use crate::block::{CRC_METADATA_KEY, ReqError, Shared, bump};
use crate::config::ObjChecksum;
use crate::error::not_found;

/// What a GET brought.
struct Fetched {
    size: u64,
    /// The object's version, where the store gives one.
    e_tag: Option<String>,
    /// The checksum metadata, as stored (absent, or text that may not parse).
    crc: Option<String>,
    filled: usize,
    overflow: bool,
}

impl Shared {
    /// GET `path` and stream its body into `buf`, one request within its deadline.
    async fn fetch_into(
        &self,
        path: &ObjPath,
        buf: &mut [u8],
    ) -> std::result::Result<Fetched, ReqError> {
        self.request(async {
            let got = self.store.get(path).await?;
            let crc = got
                .attributes
                .get(&Attribute::Metadata(CRC_METADATA_KEY.into()))
                .map(|v| v.to_string());
            let size = got.meta.size;
            let mut f = Fetched {
                size,
                e_tag: got.meta.e_tag.clone(),
                crc,
                filled: 0,
                overflow: size != buf.len() as u64,
            };
            let mut stream = got.into_stream();
            while !f.overflow
                && let Some(chunk) = stream.next().await
            {
                let chunk = chunk?;
                if f.filled + chunk.len() > buf.len() {
                    f.overflow = true;
                    break;
                }
                buf[f.filled..f.filled + chunk.len()].copy_from_slice(&chunk);
                f.filled += chunk.len();
            }
            Ok(f)
        })
        .await
    }

    /// Loads one block into its sink: a missing object is `NotFound` (and leaves the cache
    /// and the index), a short, long or checksum-failing one is `Corrupt` (and is deleted).
    pub(crate) async fn load_block(&self, key: BlockKey, sink: &mut BlockSink) -> Result<()> {
        if sink.len() != self.block_size {
            return Err(Error::WrongSize {
                key,
                got: sink.len(),
                expected: self.block_size,
            });
        }
        self.check_open()?;
        if let Some(c) = &self.coord {
            c.note_read(key); // before the GET: the leader keeps it from then on
        }
        let path = self.path(&key);
        let buf = sink.as_mut_slice();
        let (indexed, sent) = (self.indexed_at(&key), self.presence.stamp());
        let f = match self.fetch_into(&path, buf).await {
            Ok(f) => f,
            Err(ReqError::Store(object_store::Error::NotFound { .. })) => {
                self.found_missing(&key, indexed);
                bump(&self.counters.blocks.load_misses, 1);
                return Err(not_found(&self.name, key));
            }
            Err(e) => return Err(self.err(&format!("GET {path}"), e)),
        };
        if !f.overflow && f.filled < self.block_size {
            // the object has the block's size and its body arrived short: the transfer
            // failed, not the object
            return Err(Error::Backend {
                tier: self.name.clone(),
                message: format!(
                    "GET {path}: the body ended after {} of {} bytes",
                    f.filled, self.block_size
                ),
                transient: true,
            });
        }
        if f.overflow || f.filled != self.block_size {
            let reason = format!(
                "object is {} bytes, the block size is {} ({path})",
                f.size, self.block_size
            );
            return Err(self
                .refuse_damaged(key, &path, f.e_tag.as_deref(), reason)
                .await);
        }
        if self.checksum == ObjChecksum::Crc32c {
            let stored = match f.crc.as_deref() {
                Some(text) => parse_crc_hex(text).map_or_else(
                    || StoredCrc::Malformed(format!("malformed checksum metadata {text:?}")),
                    StoredCrc::Crc,
                ),
                None => StoredCrc::Missing,
            };
            let refused = match checksum::verify(&stored, &key, buf, self.accept_unverified) {
                Verdict::Verified => None,
                Verdict::Unverified => {
                    bump(&self.counters.blocks.unverified_loads, 1);
                    None
                }
                Verdict::Mismatch { got, stored } => {
                    bump(&self.counters.blocks.checksum_mismatches, 1);
                    Some(format!("crc32c is {got:08x}, stored {stored:08x} ({path})"))
                }
                Verdict::Malformed(why) => {
                    bump(&self.counters.blocks.checksum_mismatches, 1);
                    Some(format!("{why} ({path})"))
                }
                Verdict::Missing => {
                    bump(&self.counters.blocks.unverified_refused, 1);
                    Some(format!(
                        "no checksum (written without one; accept_unverified serves such objects) ({path})"
                    ))
                }
            };
            if let Some(reason) = refused {
                tracing::warn!(tier = %self.name, %key, %reason, "unverifiable block; the object is deleted");
                return Err(self
                    .refuse_damaged(key, &path, f.e_tag.as_deref(), reason)
                    .await);
            }
        }
        self.found_present(&key, sent);
        self.touch_index(&[key]);
        bump(&self.counters.blocks.blocks_read, 1);
        bump(&self.counters.blocks.bytes_read, self.block_size as u64);
        Ok(())
    }

    pub(crate) fn touch_index(&self, keys: &[BlockKey]) {
        if let Some(c) = &self.coord {
            for k in keys {
                c.note_read(*k);
            }
        }
        if let Some(cap) = &self.cap {
            let mut idx = cap.lock();
            for k in keys {
                idx.touch(k);
            }
        }
    }
}

impl Shared {
    /// A loaded object that cannot be served for good: deleted (if it is still the one read,
    /// see [`Shared::delete_damaged_loaded`]), and the load's error.
    async fn refuse_damaged(
        &self,
        key: BlockKey,
        path: &ObjPath,
        e_tag: Option<&str>,
        reason: String,
    ) -> Error {
        self.delete_damaged_loaded(&key, path, e_tag).await;
        Error::Corrupt {
            key,
            tier: self.name.clone(),
            reason,
        }
    }
}
