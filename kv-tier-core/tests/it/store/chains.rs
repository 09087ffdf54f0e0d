//! Chain links: with `chain_eviction` on (the default), the manager sends a tier each stored
//! block's place in its request's chain, learned from the lookup's and the store's key lists
//! (prefix order) and from where the engine says a lookup starts (`RequestContext::follows`);
//! off, it sends none.

use kv_tier::RequestContext;
use kv_tier_core::{RequestId, TieringManager};
use kv_tier_testkit::util::engine_store;
use kv_tier_testkit::{temp_root, test_key};

use crate::support::*;

/// The fs tier's dead bytes and block files, once the manager's jobs are done.
fn dead_bytes(m: &TieringManager) -> (u64, u64) {
    m.runtime().block_on(m.wait_idle());
    let s = m.tier::<kv_tier::fs::FsTier>("fs").unwrap().stats();
    let g = s.gc.unwrap();
    (g.dead_bytes, g.files)
}

/// A manager over a bounded fs tier in `root` (`extra`: more of its entry's keys).
fn bounded(root: &std::path::Path, extra: &str) -> TieringManager {
    build(fs_manager_config(
        root,
        16,
        BS,
        &format!(r#", "gc_max_size_gb": 1{extra}"#),
    ))
}

/// Ends request 1 and shuts the manager down.
fn end(m: TieringManager) {
    m.on_request_finished(RequestId(1));
    m.runtime().block_on(m.shutdown()).unwrap();
}

/// Promise (`TierOptions::chain_eviction`, `StoreJob::links`): the links are learned from
/// the key lists the engine passes in prefix order. A request looks up blocks 0..4 (0 is
/// in no tier: it is never stored) and stores 1..4: the store's first block is linked across
/// the lookup to block 0, which the tier does not hold, so all three stored blocks are dead
/// bytes there; once 0 is stored none are. Without `chain_eviction` no link reaches the tier.
#[test]
fn a_store_is_linked_to_the_block_its_lookup_put_before_it() {
    for on in [true, false] {
        let root = temp_root();
        let m = bounded(root.path(), &format!(r#", "chain_eviction": {on}"#));
        let ks: Vec<_> = (0..4).map(|i| test_key(7_000 + i)).collect();
        let req = RequestContext::new(1);
        m.lookup_prefix(&ks, &req);
        engine_store(&m, RequestId(1), &ks[1..]);
        let (dead, files) = dead_bytes(&m);
        assert_eq!(files, 3);
        if on {
            assert!(dead > 0, "three blocks follow a missing one");
            engine_store(&m, RequestId(1), &ks[..1]);
            assert_eq!(dead_bytes(&m), (0, 4), "the chain is whole");
        } else {
            assert_eq!(dead, 0, "no links sent");
        }
        end(m);
    }
}

/// Promise (`RequestContext::follows`): an engine that looks up only the blocks past its own
/// prefix cache says which block the lookup's first key follows, and the store of that key
/// is linked to it. Blocks 0 and 1 are the engine's (never stored in the tier); the request
/// looks up 2..4 following 1 and stores them: all three follow a block the tier lacks, so are
/// dead bytes there; once 1 is stored, none is. Without `follows`, block 2 starts a chain of
/// its own and none is dead.
#[test]
fn a_lookup_past_the_engines_prefix_links_its_first_key_to_the_block_before() {
    for follows in [true, false] {
        let root = temp_root();
        let m = bounded(root.path(), "");
        let ks: Vec<_> = (0..5).map(|i| test_key(7_100 + i)).collect();
        let req = match follows {
            true => RequestContext::new(1).follows(ks[1], 2),
            false => RequestContext::new(1),
        };
        m.lookup_prefix(&ks[2..], &req);
        engine_store(&m, RequestId(1), &ks[2..]);
        let (dead, files) = dead_bytes(&m);
        assert_eq!(files, 3);
        if follows {
            assert!(
                dead > 0,
                "the stored blocks follow block 1, which the tier lacks"
            );
            engine_store(&m, RequestId(1), &ks[1..2]);
            // block 1's own parent was never named: as far as the tier knows, it starts
            // the chain, now whole
            assert_eq!(dead_bytes(&m), (0, 4));
        } else {
            assert_eq!(dead, 0, "block 2 starts a chain of its own");
        }
        end(m);
    }
}

/// Promise (`PendingStore::follows`): a store whose first block continues neither the
/// request's lookup nor its last store (here the batch after one DRAM refused: block 2 was
/// never stored) says which block it follows, and is linked to it: blocks 3 and 4 are dead
/// bytes in the tier until 2 is stored. Without `follows`, block 3 starts a chain of its own.
#[test]
fn a_store_says_which_block_its_first_one_follows() {
    for follows in [true, false] {
        let root = temp_root();
        let m = bounded(root.path(), "");
        let ks: Vec<_> = (0..5).map(|i| test_key(7_200 + i)).collect();
        let req = RequestContext::new(1);
        m.lookup_prefix(&ks[..2], &req);
        engine_store(&m, RequestId(1), &ks[..2]);
        let mut p = m.prepare_store(&ks[3..]).unwrap();
        for (k, sink) in p.slots() {
            kv_tier_testkit::fill_block(k, 0, sink.as_mut_slice());
        }
        if follows {
            p = p.follows(ks[2], 3);
        }
        p.commit(RequestId(1));
        let (dead, files) = dead_bytes(&m);
        assert_eq!(files, 4);
        if follows {
            assert!(
                dead > 0,
                "blocks 3 and 4 follow block 2, which the tier lacks"
            );
            engine_store(&m, RequestId(1), &ks[2..3]);
            assert_eq!(dead_bytes(&m), (0, 5), "the chain is whole");
        } else {
            assert_eq!(dead, 0, "block 3 starts a chain of its own");
        }
        end(m);
    }
}
