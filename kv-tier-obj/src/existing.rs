//! What a store finds at a block's path before it writes: nothing, a block a load will
//! accept, or an object in the way (one HEAD tells presence, size and checksum).

use kv_tier_core::checksum::parse_crc_hex;
use kv_tier_core::{BlockKey, Result};
use object_store::path::Path as ObjPath;
use object_store::{Attribute, ObjectStore};

use crate::block::{CRC_METADATA_KEY, Existing, ReqError, Shared};
use crate::config::ObjChecksum;

impl Shared {
    /// What is at `key`'s path: nothing, a block a load will accept, or an object in the way
    /// (see [`Shared::unverifiable`]), which is reported here. One HEAD; the caller holds
    /// the key's put claim. A missing object leaves the capacity index (the caller's store
    /// counts it again); a usable one is what the caller confirms (with the HEAD's stamp).
    pub(crate) async fn existing(&self, key: &BlockKey, path: &ObjPath) -> Result<Existing> {
        if self.is_deleting(key) {
            return Ok(Existing::Absent);
        }
        let sent = self.presence.stamp();
        match self.head_meta(path).await? {
            None => {
                // (the caller holds the key's claim: its count is the caller's to make)
                self.presence.gone([key]);
                if let Some(cap) = &self.cap {
                    // (an earlier write that timed out may still land: it stays counted)
                    cap.lock().remove_unless_unended(key);
                }
                Ok(Existing::Absent)
            }
            Some(got) if self.unverifiable(&got) || self.known_damaged(key) => {
                self.warn_in_the_way(key);
                Ok(Existing::InTheWay)
            }
            Some(_) => Ok(Existing::Usable(sent)),
        }
    }

    /// A foreign or half-written object (a store whose PUT is not atomic can keep the body of
    /// a cancelled PUT without its metadata) would fail every load: it goes, and the store
    /// writes the block.
    pub(crate) fn warn_in_the_way(&self, key: &BlockKey) {
        tracing::warn!(tier = %self.name, %key, "an object that is not a whole block with a valid checksum is in the way; replacing it");
    }

    /// Whether the object at `path` is one a load would refuse; one gone meanwhile counts as
    /// in the way, so the caller's delete (harmless on a missing object) runs and the PUT
    /// writes the block.
    pub(crate) async fn existing_is_unverifiable(
        &self,
        key: &BlockKey,
        path: &ObjPath,
    ) -> Result<bool> {
        Ok(self
            .head_meta(path)
            .await?
            .is_none_or(|got| self.unverifiable(&got) || self.known_damaged(key)))
    }

    /// Whether a load of this tier found `key`'s object damaged and could not delete it: a
    /// store replaces it, whatever its metadata says.
    fn known_damaged(&self, key: &BlockKey) -> bool {
        crate::block::lock(&self.damaged).contains(key)
    }

    /// The object at `path`'s metadata and attributes (a HEAD), `None` if there is none.
    async fn head_meta(&self, path: &ObjPath) -> Result<Option<object_store::GetResult>> {
        let opts = object_store::GetOptions {
            head: true,
            ..Default::default()
        };
        match self.request(self.store.get_opts(path, opts)).await {
            Ok(got) => Ok(Some(got)),
            Err(ReqError::Store(object_store::Error::NotFound { .. })) => Ok(None),
            Err(e) => Err(self.err(&format!("HEAD {path}"), e)),
        }
    }

    /// Whether an object (its metadata only) is one a load would refuse: not the size of a
    /// block; or, with checksums on, a malformed checksum, or none where unverified objects
    /// are not accepted. So a store that finds it replaces it, and a reported store is a
    /// readable block (also without checksums, and with `accept_unverified`).
    fn unverifiable(&self, got: &object_store::GetResult) -> bool {
        if got.meta.size != self.block_size as u64 {
            return true;
        }
        if self.checksum != ObjChecksum::Crc32c {
            return false;
        }
        match got
            .attributes
            .get(&Attribute::Metadata(CRC_METADATA_KEY.into()))
        {
            Some(v) => parse_crc_hex(v.as_ref()).is_none(),
            None => !self.accept_unverified,
        }
    }
}
