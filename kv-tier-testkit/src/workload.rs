//! A workload generator of multi-turn conversations sharing prefixes, with block keys chained
//! like vLLM's prefix hashes (each block's hash covers its parent's hash and its tokens).

use kv_tier_core::{BlockKey, RequestId};
use sha2::{Digest, Sha256};

/// The shape of a workload. Sizes are in blocks (of `tokens_per_block` tokens each).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkloadConfig {
    /// Seed: the same seed gives the same requests and keys.
    pub seed: u64,
    /// Concurrent conversations.
    pub streams: usize,
    /// Turns per conversation.
    pub turns: usize,
    /// Shared prefixes (system prompts, documents) the conversations draw from.
    pub prefix_pool: usize,
    /// Blocks per shared prefix.
    pub prefix_blocks: usize,
    /// New prompt blocks per turn (the user's message).
    pub prompt_blocks: usize,
    /// Output blocks per turn (appended to the conversation for the next turn).
    pub output_blocks: usize,
    /// KV-cache group of the keys.
    pub group: u32,
}

impl Default for WorkloadConfig {
    fn default() -> Self {
        Self {
            seed: 1,
            streams: 4,
            turns: 3,
            prefix_pool: 8,
            prefix_blocks: 8,
            prompt_blocks: 4,
            output_blocks: 2,
            group: 0,
        }
    }
}

/// One turn: a request whose prompt is `keys`, in prefix order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Turn {
    /// The request (unique per turn).
    pub request: RequestId,
    /// The conversation.
    pub stream: usize,
    /// The turn number within the conversation, from 0.
    pub turn: usize,
    /// Prompt block keys, in prefix order: shared prefix, history, the new message.
    pub keys: Vec<BlockKey>,
    /// Keys of the output blocks this turn produces (part of the next turn's prompt).
    pub output: Vec<BlockKey>,
}

/// The workload: turns in round-robin order over the streams (turn 0 of every stream, then
/// turn 1, ...), as a scheduler interleaves concurrent conversations.
#[derive(Debug, Clone)]
pub struct Workload {
    cfg: WorkloadConfig,
    rng: u64,
    history: Vec<Vec<BlockKey>>,
    next: usize,
    next_request: u64,
}

fn chain(parent: Option<&BlockKey>, chunk: u64, group: u32) -> BlockKey {
    let mut h = Sha256::new();
    if let Some(p) = parent {
        h.update(p.hash_bytes());
    }
    h.update(chunk.to_le_bytes());
    BlockKey::from_hash32(h.finalize().into(), group)
}

impl Workload {
    /// A workload of the given shape.
    pub fn new(cfg: WorkloadConfig) -> Self {
        let mut w = Self {
            rng: cfg.seed ^ 0x2545_f491_4f6c_dd1d,
            history: vec![Vec::new(); cfg.streams],
            next: 0,
            next_request: 0,
            cfg,
        };
        for s in 0..w.cfg.streams {
            let p = (w.rand() % w.cfg.prefix_pool.max(1) as u64) as usize;
            let mut keys = Vec::with_capacity(w.cfg.prefix_blocks);
            for j in 0..w.cfg.prefix_blocks {
                let chunk = (p as u64) << 32 | j as u64;
                keys.push(chain(keys.last(), chunk, w.cfg.group));
            }
            w.history[s] = keys;
        }
        w
    }

    fn rand(&mut self) -> u64 {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.rng
    }

    /// Total turns in the workload.
    pub fn total_turns(&self) -> usize {
        self.cfg.streams * self.cfg.turns
    }

    fn extend(&mut self, s: usize, n: usize) -> Vec<BlockKey> {
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            // Unique token content (high bit set: never collides with a pool chunk).
            let chunk = self.rand() | 1 << 63;
            let k = chain(self.history[s].last(), chunk, self.cfg.group);
            self.history[s].push(k);
            out.push(k);
        }
        out
    }
}

impl Iterator for Workload {
    type Item = Turn;

    fn next(&mut self) -> Option<Turn> {
        if self.next >= self.total_turns() || self.cfg.streams == 0 {
            return None;
        }
        let stream = self.next % self.cfg.streams;
        let turn = self.next / self.cfg.streams;
        self.next += 1;
        self.extend(stream, self.cfg.prompt_blocks);
        let keys = self.history[stream].clone();
        let output = self.extend(stream, self.cfg.output_blocks);
        let request = RequestId(self.next_request);
        self.next_request += 1;
        Some(Turn {
            request,
            stream,
            turn,
            keys,
            output,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_workload_and_prefixes_are_shared() {
        let cfg = WorkloadConfig {
            streams: 6,
            prefix_pool: 2,
            ..WorkloadConfig::default()
        };
        let a: Vec<Turn> = Workload::new(cfg.clone()).collect();
        let b: Vec<Turn> = Workload::new(cfg.clone()).collect();
        assert_eq!(a, b);
        assert_eq!(a.len(), 18);
        // 6 streams over 2 prefixes: some first blocks are shared.
        let firsts: std::collections::HashSet<_> = a.iter().map(|t| t.keys[0]).collect();
        assert!(firsts.len() <= 2);
        // a later turn extends the earlier turn's prompt and output
        let t0 = &a[0];
        let t1 = a
            .iter()
            .find(|t| t.stream == t0.stream && t.turn == 1)
            .unwrap();
        assert_eq!(&t1.keys[..t0.keys.len()], &t0.keys[..]);
        assert_eq!(
            &t1.keys[t0.keys.len()..t0.keys.len() + t0.output.len()],
            &t0.output[..]
        );
        assert_eq!(t1.keys.len(), 8 + 4 + 2 + 4);
    }
}
