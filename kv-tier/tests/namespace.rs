//! Namespace identity as vLLM computes it: the config's `layout` with vLLM's defaults, the
//! parallel-agnostic decision (refused where the fields do not tell), `replicated_layout`
//! (TP2 and TP4 writers share one directory), `canonical_format`. Expected digests are
//! Python's: `hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")))`.

use kv_tier::{BlockKey, KvTierConfig, LookupResult, RequestContext, RequestId};
use kv_tier_testkit::{fill_block, test_key};

const BS: usize = 65536;
const MODEL: &str = "deepseek-ai/DeepSeek-V2-Lite";

fn layout(extra: &str) -> String {
    format!(
        r#"{{"model_name": "{MODEL}", "dtype": "torch.bfloat16", "tokens_per_hash": 16{extra}}}"#
    )
}

fn config(root: &std::path::Path, layout: &str) -> kv_tier::Result<KvTierConfig> {
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS}, "layout": {layout},
            "secondary_tiers": [{{"type": "fs", "root_dir": {root:?}}}]}}"#,
        16 * BS
    ))
}

fn namespace_of(cfg: &KvTierConfig) -> kv_tier::Namespace {
    cfg.layout.as_ref().unwrap().namespace().unwrap()
}

#[test]
fn a_replicated_layout_is_agnostic_so_tp2_and_tp4_writers_share_one_directory() {
    let dir = tempfile::tempdir().unwrap();
    let tp2 = config(
        dir.path(),
        &layout(r#", "tp_size": 2, "replicated_layout": true, "rank": 1"#),
    )
    .unwrap();
    let tp4 = config(
        dir.path(),
        &layout(r#", "tp_size": 4, "replicated_layout": true, "rank": 3"#),
    )
    .unwrap();
    let (a, b) = (namespace_of(&tp2), namespace_of(&tp4));
    // Python over {"blocks_per_file":1,...,"replicated_layout":true,...,"tp_size":1}
    assert_eq!(a.digest(), "b641998705fd");
    assert_eq!(
        a.canonical_json(),
        r#"{"blocks_per_file":1,"dcp_size":1,"dtype":"torch.bfloat16","inference_engine":"vllm","kv_cache_groups":[],"model_name":"deepseek-ai/DeepSeek-V2-Lite","pcp_size":1,"pp_size":1,"replicated_layout":true,"tokens_per_hash":16,"tp_size":1}"#
    );
    assert_eq!((a.rank(), b.rank()), (0, 0));
    assert_eq!(a.rank_dir_name(), b.rank_dir_name());
    assert_eq!(
        a.rank_dir_name(),
        "deepseek-ai_DeepSeek-V2-Lite_b641998705fd_r0"
    );

    // a TP2 rank writes; a TP4 rank (another manager, same root) reads it back
    let writer = kv_tier::builder(tp2).unwrap().build_blocking().unwrap();
    let keys: Vec<BlockKey> = (0..3).map(test_key).collect();
    let mut p = writer.prepare_store(&keys).unwrap();
    for (k, sink) in p.slots() {
        fill_block(k, 0, sink.as_mut_slice());
    }
    p.commit(RequestId(1));
    writer.runtime().block_on(writer.wait_idle());
    drop(writer);
    let config_json = std::fs::read_to_string(
        dir.path()
            .join("deepseek-ai_DeepSeek-V2-Lite_b641998705fd/config.json"),
    )
    .unwrap();
    assert!(
        config_json.contains("\"replicated_layout\": true"),
        "{config_json}"
    );
    assert!(!config_json.contains("parallel_agnostic"), "{config_json}");

    let reader = kv_tier::builder(tp4).unwrap().build_blocking().unwrap();
    let req = RequestContext::new(7);
    let mut answer = LookupResult::Miss;
    for _ in 0..50 {
        answer = reader.lookup(&keys[0], &req);
        if answer == LookupResult::Hit {
            break;
        }
        reader.on_schedule_end();
        reader.runtime().block_on(reader.wait_idle());
    }
    assert_eq!(
        answer,
        LookupResult::Hit,
        "the TP4 rank finds the TP2 rank's block"
    );
    let rank_dirs: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains("_r"))
        .collect();
    assert_eq!(rank_dirs, ["deepseek-ai_DeepSeek-V2-Lite_b641998705fd_r0"]);
}

#[test]
fn canonical_format_is_hashed_only_when_set() {
    let dir = tempfile::tempdir().unwrap();
    let with =
        namespace_of(&config(dir.path(), &layout(r#", "canonical_format": "fmt-v1""#)).unwrap());
    assert_eq!(with.digest(), "dd2e69e8ba71");
    assert!(
        with.config_json()
            .contains("\"canonical_format\": \"fmt-v1\"")
    );
    let storage =
        namespace_of(&config(dir.path(), &layout(r#", "storage_format": "sf1""#)).unwrap());
    assert_eq!(
        storage.digest(),
        "e2a37cdcc4f7",
        "storage_format is hashed when set"
    );
    let without = namespace_of(&config(dir.path(), &layout("")).unwrap());
    assert!(!without.canonical_json().contains("canonical_format"));
    assert_ne!(with.digest(), without.digest());
}

#[test]
fn the_parallel_agnostic_decision_follows_vllm_or_is_refused_when_the_fields_cannot_tell() {
    let dir = tempfile::tempdir().unwrap();
    let err = |extra: &str| match config(dir.path(), &layout(extra)) {
        Err(kv_tier::Error::InvalidConfig { field, reason }) => (field, reason),
        other => panic!("{extra}: expected a refusal, got {other:?}"),
    };
    // TP > 1: vLLM's answer depends on the model's KV heads, which the fields do not say
    let (field, reason) = err(r#", "tp_size": 2, "rank": 1"#);
    assert_eq!(field, "layout.parallel_agnostic");
    assert!(reason.contains("num_kv_heads"), "{reason}");
    // stated: honoured; not agnostic keeps the sizes and the rank (Python's digest)
    let ns = namespace_of(
        &config(
            dir.path(),
            &layout(r#", "tp_size": 2, "rank": 1, "parallel_agnostic": false"#),
        )
        .unwrap(),
    );
    assert_eq!(ns.digest(), "c5b8ed870cfd");
    assert_eq!(ns.rank(), 1);
    let ns = namespace_of(
        &config(
            dir.path(),
            &layout(r#", "tp_size": 2, "rank": 1, "parallel_agnostic": true"#),
        )
        .unwrap(),
    );
    assert_eq!((ns.fields().parallel_agnostic, ns.rank()), (true, 0));
    // context parallelism, or several KV-cache groups: vLLM never shares the namespace
    for extra in [
        r#", "dcp_size": 2"#,
        r#", "pcp_size": 2"#,
        r#", "kv_cache_groups": [{"tokens_per_block": 16, "layer_names": ["a"]},
                                 {"tokens_per_block": 16, "layer_names": ["b"]}]"#,
    ] {
        let ns = namespace_of(&config(dir.path(), &layout(extra)).unwrap());
        assert!(!ns.fields().parallel_agnostic, "{extra}");
        assert!(
            ns.canonical_json().contains("\"parallel_agnostic\":false"),
            "{extra}"
        );
    }
    // one TP rank, one group: agnostic, vLLM's answer for a standard (non-MLA) model
    let standard = r#"{"model_name": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "torch.bfloat16", "tokens_per_hash": 16}"#;
    assert!(
        namespace_of(&config(dir.path(), standard).unwrap())
            .fields()
            .parallel_agnostic
    );
    // an MLA model (this one) is not shared by vLLM unless replicated: it says so
    let ns = namespace_of(&config(dir.path(), &layout(r#", "parallel_agnostic": false"#)).unwrap());
    assert!(ns.canonical_json().contains("\"parallel_agnostic\":false"));
    // vLLM replicates only across TP ranks
    for extra in [
        r#", "replicated_layout": true"#,
        r#", "replicated_layout": true, "tp_size": 2, "pp_size": 2"#,
        r#", "replicated_layout": true, "tp_size": 2, "dcp_size": 2"#,
    ] {
        let (field, _) = err(extra);
        assert_eq!(field, "layout.replicated_layout", "{extra}");
    }
    // contradictions
    let (field, _) =
        err(r#", "tp_size": 2, "replicated_layout": true, "parallel_agnostic": false"#);
    assert_eq!(field, "layout.parallel_agnostic");
    let (field, _) = err(r#", "parallel_agnostic": "yes""#);
    assert_eq!(field, "layout.parallel_agnostic");
}
