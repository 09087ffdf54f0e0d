//! The library's tracing spans: a job's span names its tier, direction, blocks and bytes; an fs
//! sweep's and the opening walk's name their tier. Recorded by a global subscriber, so the test
//! runs alone in a child process.

use kv_tier::{BlockKey, KvTierConfig, RequestId};
use kv_tier_testkit::{fill_block, test_key};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{Layer, Registry};

use crate::support::*;

#[test]
fn jobs_sweeps_and_the_opening_walk_have_spans_with_their_fields() {
    if !in_own_process("spans::jobs_sweeps_and_the_opening_walk_have_spans_with_their_fields") {
        return;
    }
    let spans = Spans::default();
    let subscriber = Registry::default().with(
        spans
            .clone()
            .with_filter(tracing_subscriber::filter::LevelFilter::DEBUG),
    );
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let cfg = KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS_64K},
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "fs", "root_dir": {:?}, "name": "disk",
                                  "gc_max_size_gb": 1}}]}}"#,
        8 * BS_64K,
        dir.path()
    ))
    .unwrap();
    let m = kv_tier::builder(cfg).unwrap().build_blocking().unwrap();
    let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
    let mut p = m.prepare_store(&keys).unwrap();
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(RequestId(1));
    m.on_request_finished(RequestId(1));
    m.runtime().block_on(m.wait_idle());
    m.tier::<kv_tier::fs::FsTier>("disk")
        .unwrap()
        .gc_sweep_now()
        .unwrap();
    m.shutdown_blocking().unwrap();
    let seen = spans.0.lock().unwrap().clone();
    let find = |name: &str| {
        seen.iter()
            .find(|(n, _)| n == name)
            .map(|(_, f)| f.clone())
            .unwrap_or_else(|| panic!("no {name} span in {seen:?}"))
    };
    let job = find("kv_tier_job");
    for want in [
        "tier=disk",
        "direction=\"store\"",
        "blocks=3",
        &format!("bytes={}", 3 * BS_64K),
    ] {
        assert!(job.contains(want), "{want} not in the job's span: {job}");
    }
    assert!(find("kv_tier_fs_adopt").contains("tier=disk"));
    assert!(find("kv_tier_fs_sweep").contains("tier=disk"));
}
