//! vLLM's keys with no counterpart in kv-tier's own config: the ones refused with a reason,
//! and the chunking keys (`block_size`, `blocks_per_chunk`) applied to the run fields.

use super::BLOCKS_PER_CHUNK;
use crate::error::{Error, Result};
use crate::layout::RunFields;

/// vLLM keys of `kv_connector_extra_config` that kv-tier knows and does not implement, with
/// why: refused with that reason rather than as unknown.
pub(super) const VLLM_KEYS_NOT_HERE: &[(&str, &str)] = &[
    (
        "offload_prompt_only",
        "which blocks to offload is the engine's choice here: kv-tier stores the blocks the engine passes to prepare_store",
    ),
    (
        "self_describing_kv_events",
        "kv-tier's events carry their keys, medium and locality (TierEvent); publishing them in vLLM's wire format is the engine's publisher's job",
    ),
    (
        "max_recompute_pending_tokens",
        "a scheduler policy of vLLM's connector, not of the tiers: the engine decides when to recompute instead of waiting",
    ),
    (
        "canonical_layout",
        "set the namespace's canonical_format in \"layout\" instead (the byte format the engine's blocks use)",
    ),
];

/// Applies vLLM's chunking keys to run fields: `blocks_per_chunk` is `blocks_per_file`;
/// `block_size` (tokens per offloaded block) is `tokens_per_hash x blocks_per_file`. A
/// `blocks_per_file` the layout states must agree; errors name the vLLM key.
pub(super) fn apply_chunking(
    block_size: Option<u64>,
    blocks_per_chunk: Option<u64>,
    blocks_per_file_given: bool,
    fields: &mut RunFields,
) -> Result<()> {
    let wanted = match (block_size, blocks_per_chunk) {
        (Some(tokens), _) => {
            let per = fields.tokens_per_hash.max(1);
            if tokens % per != 0 || tokens == 0 {
                return Err(Error::config(
                    "block_size",
                    format!(
                        "{tokens} tokens is not a positive multiple of the layout's tokens_per_hash ({per}), the engine's block size"
                    ),
                ));
            }
            let n = tokens / per;
            if !(BLOCKS_PER_CHUNK.0..=BLOCKS_PER_CHUNK.1).contains(&n) {
                return Err(Error::config(
                    "block_size",
                    format!(
                        "{tokens} tokens make {n} engine blocks of {per} tokens per offloaded block, outside 1 to {}",
                        BLOCKS_PER_CHUNK.1
                    ),
                ));
            }
            Some(("block_size", n))
        }
        (None, Some(n)) => Some(("blocks_per_chunk", n)),
        (None, None) => None,
    };
    if let Some((key, n)) = wanted {
        if blocks_per_file_given && fields.blocks_per_file != n {
            return Err(Error::config(
                key,
                format!(
                    "makes {n} engine blocks per offloaded block, but the layout's blocks_per_file is {}",
                    fields.blocks_per_file
                ),
            ));
        }
        fields.blocks_per_file = n;
    }
    Ok(())
}
