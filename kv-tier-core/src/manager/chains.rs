//! What the manager knows of its requests' chains: which block follows which, learned from
//! the key lists the engine passes in prefix order, and handed to the tiers with each store
//! job ([`StoreJob::links`](crate::StoreJob::links)).

use rustc_hash::FxHashMap;

use crate::key::BlockKey;
use crate::request::RequestId;
use crate::tier::ChainLink;

/// Per request (until it finishes): each block's link, as its lookups and stores showed it.
#[derive(Default)]
pub(super) struct Chains {
    per_request: FxHashMap<RequestId, FxHashMap<BlockKey, ChainLink>>,
}

impl Chains {
    /// `keys` are consecutive blocks of `req`'s chain (a lookup's list: the prompt's blocks
    /// past what the engine holds itself), the first of them following `first` where the
    /// engine says so ([`RequestContext::follows`](crate::RequestContext::follows)). A block
    /// keeps the first link learned for it.
    pub(super) fn learn(&mut self, req: RequestId, first: Option<ChainLink>, keys: &[BlockKey]) {
        if let (Some(l), Some(k)) = (first, keys.first())
            && l.parent != *k
        {
            self.per_request
                .entry(req)
                .or_default()
                .entry(*k)
                .or_insert(l);
        }
        let [.., before, last] = keys else {
            return;
        };
        let known = self.per_request.entry(req).or_default();
        // the same list asked again (a lookup retried each step): nothing new
        if known.get(last).is_some_and(|l| l.parent == *before)
            && known.get(&keys[1]).is_some_and(|l| l.parent == keys[0])
        {
            return;
        }
        let mut depth = known.get(&keys[0]).map_or(0, |l| l.depth);
        for w in keys.windows(2) {
            depth = depth.saturating_add(1);
            let l = *known.entry(w[1]).or_insert(ChainLink {
                parent: w[0],
                depth,
            });
            depth = l.depth;
        }
    }

    /// The links of a store's blocks (`chain`: the keys of one `prepare_store` call, in prefix
    /// order, the first following `first` where the engine says so), learned with them.
    pub(super) fn links(
        &mut self,
        req: RequestId,
        first: Option<ChainLink>,
        chain: &[BlockKey],
    ) -> Vec<(BlockKey, ChainLink)> {
        // a request nothing was learned of (finished, or never looked up) gets the links of
        // the call's own order and leaves nothing behind
        let mut once = Chains::default();
        let from = if self.per_request.contains_key(&req) {
            self
        } else {
            &mut once
        };
        from.learn(req, first, chain);
        let Some(known) = from.per_request.get(&req) else {
            return Vec::new();
        };
        chain
            .iter()
            .filter_map(|k| known.get(k).map(|l| (*k, *l)))
            .collect()
    }

    /// The links learned so far of those of `keys` that `req`'s lookups and stores showed
    /// (learning nothing new): a promotion's blocks, as their DRAM slots are reserved.
    pub(super) fn known(&self, req: RequestId, keys: &[BlockKey]) -> Vec<(BlockKey, ChainLink)> {
        let Some(known) = self.per_request.get(&req) else {
            return Vec::new();
        };
        keys.iter()
            .filter_map(|k| known.get(k).map(|l| (*k, *l)))
            .collect()
    }

    /// `req` finished: its links are forgotten (the tiers keep those of what they store).
    pub(super) fn forget(&mut self, req: RequestId) {
        self.per_request.remove(&req);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlockKey {
        BlockKey::from_hash32([i; 32], 0)
    }

    /// A lookup whose first key follows a block the engine holds itself (its GPU cache) links
    /// that key to it, at the position given, and the rest one deeper each: a later store of
    /// the first key gets the link.
    #[test]
    fn a_lookup_after_the_engines_own_prefix_links_its_first_key_to_it() {
        let mut c = Chains::default();
        let r = RequestId(1);
        let held = ChainLink {
            parent: k(9),
            depth: 12,
        };
        c.learn(r, Some(held), &[k(1), k(2)]);
        let links = c.links(r, None, &[k(1), k(2)]);
        assert_eq!(
            links,
            vec![
                (k(1), held),
                (
                    k(2),
                    ChainLink {
                        parent: k(1),
                        depth: 13
                    }
                ),
            ]
        );
        // a store whose first key continues neither: linked where the engine says
        let after = ChainLink {
            parent: k(7),
            depth: 30,
        };
        assert_eq!(c.links(r, Some(after), &[k(20), k(21)])[0], (k(20), after));
        // a key said to follow itself is no link
        c.learn(
            RequestId(2),
            Some(ChainLink {
                parent: k(5),
                depth: 1,
            }),
            &[k(5)],
        );
        assert!(c.links(RequestId(2), None, &[k(5)]).is_empty());
    }

    /// A lookup's list links each block to the one before; a later store of the blocks past
    /// the hit prefix gets those links, its first block's across the boundary included.
    #[test]
    fn a_store_after_a_lookup_links_across_the_hit_prefix() {
        let mut c = Chains::default();
        let r = RequestId(1);
        c.learn(r, None, &[k(1), k(2), k(3)]);
        c.learn(r, None, &[k(1), k(2), k(3)]);
        let links = c.links(r, None, &[k(3), k(4)]);
        assert_eq!(
            links,
            vec![
                (
                    k(3),
                    ChainLink {
                        parent: k(2),
                        depth: 2
                    }
                ),
                (
                    k(4),
                    ChainLink {
                        parent: k(3),
                        depth: 3
                    }
                ),
            ]
        );
        assert!(
            c.links(RequestId(2), None, &[k(9)]).is_empty(),
            "nothing known of it"
        );
        assert_eq!(
            c.links(RequestId(3), None, &[k(8), k(9)]).len(),
            1,
            "its own order"
        );
        assert!(
            !c.per_request.contains_key(&RequestId(3)),
            "nothing kept of it"
        );
        // a list that starts earlier than the one learned links its new front
        c.learn(r, None, &[k(0), k(1), k(2), k(3)]);
        assert_eq!(c.links(r, None, &[k(1)])[0].1.parent, k(0));
        c.forget(r);
        assert!(c.per_request.is_empty() || !c.per_request.contains_key(&r));
        // a block keeps its first link
        c.learn(r, None, &[k(5), k(6)]);
        c.learn(r, None, &[k(7), k(6)]);
        assert_eq!(c.links(r, None, &[k(6)])[0].1.parent, k(5));
    }
}
