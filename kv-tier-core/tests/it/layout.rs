//! The layout: namespace identity as vLLM computes it (digests equal Python's, the
//! parallel-agnostic decision, replicated layouts shared by TP ranks, `canonical_format`), and the
//! spec's layout vectors byte for byte.

use std::path::Path;

use kv_tier::{BlockKey, LookupResult, Namespace, RequestContext, RequestId, RunFields};
use kv_tier_testkit::{fill_block, test_key};
use serde_json::Value;

use crate::support::*;

#[test]
fn a_replicated_layout_is_agnostic_so_tp2_and_tp4_writers_share_one_directory() {
    let dir = tempfile::tempdir().unwrap();
    let tp2 = layout_config(
        dir.path(),
        &model_layout(r#", "tp_size": 2, "replicated_layout": true, "rank": 1"#),
    )
    .unwrap();
    let tp4 = layout_config(
        dir.path(),
        &model_layout(r#", "tp_size": 4, "replicated_layout": true, "rank": 3"#),
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

/// vLLM's `kv_cache_layout` (PR #55907): hashed and written to `config.json` when set, so
/// the two layouts' blocks never share a directory; absent otherwise (the directory of a
/// cache written without it stays the same); an empty one is refused, naming the field.
#[test]
fn kv_cache_layout_is_hashed_only_when_set() {
    let dir = tempfile::tempdir().unwrap();
    let layout =
        |extra: &str| namespace_of(&layout_config(dir.path(), &model_layout(extra)).unwrap());
    let (hnd, nhd) = (
        layout(r#", "kv_cache_layout": "HND""#),
        layout(r#", "kv_cache_layout": "NHD""#),
    );
    let without = layout("");
    assert_ne!(hnd.digest(), nhd.digest());
    assert_ne!(hnd.digest(), without.digest());
    assert!(hnd.config_json().contains("\"kv_cache_layout\": \"HND\""));
    assert!(!without.canonical_json().contains("kv_cache_layout"));
    let err = layout_config(dir.path(), &model_layout(r#", "kv_cache_layout": """#)).unwrap_err();
    assert!(err.to_string().contains("layout.kv_cache_layout"), "{err}");
}

#[test]
fn canonical_format_is_hashed_only_when_set() {
    let dir = tempfile::tempdir().unwrap();
    let with = namespace_of(
        &layout_config(
            dir.path(),
            &model_layout(r#", "canonical_format": "fmt-v1""#),
        )
        .unwrap(),
    );
    assert_eq!(with.digest(), "dd2e69e8ba71");
    assert!(
        with.config_json()
            .contains("\"canonical_format\": \"fmt-v1\"")
    );
    let storage = namespace_of(
        &layout_config(dir.path(), &model_layout(r#", "storage_format": "sf1""#)).unwrap(),
    );
    assert_eq!(
        storage.digest(),
        "e2a37cdcc4f7",
        "storage_format is hashed when set"
    );
    let without = namespace_of(&layout_config(dir.path(), &model_layout("")).unwrap());
    assert!(!without.canonical_json().contains("canonical_format"));
    assert_ne!(with.digest(), without.digest());
}

#[test]
fn the_parallel_agnostic_decision_follows_vllm_or_is_refused_when_the_fields_cannot_tell() {
    let dir = tempfile::tempdir().unwrap();
    let err = |extra: &str| match layout_config(dir.path(), &model_layout(extra)) {
        Err(kv_tier::Error::InvalidConfig { field, reason }) => (field, reason),
        other => panic!("{extra}: expected a refusal, got {other:?}"),
    };
    // TP > 1: vLLM's answer depends on the model's KV heads, which the fields do not say
    let (field, reason) = err(r#", "tp_size": 2, "rank": 1"#);
    assert_eq!(field, "layout.parallel_agnostic");
    assert!(reason.contains("num_kv_heads"), "{reason}");
    // stated: honoured; not agnostic keeps the sizes and the rank (Python's digest)
    let ns = namespace_of(
        &layout_config(
            dir.path(),
            &model_layout(r#", "tp_size": 2, "rank": 1, "parallel_agnostic": false"#),
        )
        .unwrap(),
    );
    assert_eq!(ns.digest(), "c5b8ed870cfd");
    assert_eq!(ns.rank(), 1);
    let ns = namespace_of(
        &layout_config(
            dir.path(),
            &model_layout(r#", "tp_size": 2, "rank": 1, "parallel_agnostic": true"#),
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
        let ns = namespace_of(&layout_config(dir.path(), &model_layout(extra)).unwrap());
        assert!(!ns.fields().parallel_agnostic, "{extra}");
        assert!(
            ns.canonical_json().contains("\"parallel_agnostic\":false"),
            "{extra}"
        );
    }
    // one TP rank, one group: agnostic, vLLM's answer for a standard (non-MLA) model
    let standard = r#"{"model_name": "meta-llama/Llama-3.1-8B-Instruct", "dtype": "torch.bfloat16", "tokens_per_hash": 16}"#;
    assert!(
        namespace_of(&layout_config(dir.path(), standard).unwrap())
            .fields()
            .parallel_agnostic
    );
    // an MLA model (this one) is not shared by vLLM unless replicated: it says so
    let ns = namespace_of(
        &layout_config(dir.path(), &model_layout(r#", "parallel_agnostic": false"#)).unwrap(),
    );
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

#[test]
fn digests_match_python() {
    use serde_json::json;
    let base = |extra: serde_json::Value| {
        let mut v = json!({"model_name": "org/Modèle-😀\u{7f}\u{2028}\"\\", "tokens_per_hash": 16,
            "blocks_per_file": 1, "tp_size": 1, "pp_size": 1, "pcp_size": 1, "dcp_size": 1,
            "dtype": "torch.bfloat16", "kv_cache_groups": [], "inference_engine": "vllm"});
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        v
    };
    // (layout as given, the fields vLLM digests)
    let cases = vec![
        (json!({}), base(json!({}))),
        (
            json!({"tp_size": 2, "parallel_agnostic": false}),
            base(json!({"tp_size": 2, "parallel_agnostic": false})),
        ),
        (
            json!({"tp_size": 2, "replicated_layout": true}),
            base(json!({"replicated_layout": true})),
        ),
        (
            json!({"dcp_size": 2}),
            base(json!({"dcp_size": 2, "parallel_agnostic": false})),
        ),
        (
            json!({"canonical_format": "nhd-v1", "kv_cache_groups": [
            {"tokens_per_block": 16, "layer_names": ["l.0", "l.1"]},
            {"tokens_per_block": 32, "layer_names": ["s.0"]}]}),
            base(json!({"canonical_format": "nhd-v1", "kv_cache_groups": [
            {"tokens_per_block": 16, "layer_names": ["l.0", "l.1"]},
            {"tokens_per_block": 32, "layer_names": ["s.0"]}]})),
        ),
        (
            json!({"storage_format": "fp8", "blocks_per_file": 4}),
            base(json!({"storage_format": "fp8", "blocks_per_file": 4})),
        ),
        (
            json!({"kv_cache_layout": "HND"}),
            base(json!({"kv_cache_layout": "HND"})),
        ),
    ];
    for (given, want) in cases {
        let mut layout = json!({"model_name": "org/Modèle-😀\u{7f}\u{2028}\"\\", "dtype": "torch.bfloat16", "tokens_per_hash": 16, "rank": 3});
        for (k, x) in given.as_object().unwrap() {
            layout[k] = x.clone();
        }
        let ns = layout_ns(layout).unwrap();
        let (canon, digest) = python_digest(&want);
        assert_eq!(ns.canonical_json(), canon, "{given}");
        assert_eq!(ns.digest(), digest, "{given}");
    }
}

#[test]
fn replicated_tp2_and_tp4_share_one_directory_rank_0() {
    use serde_json::json;
    let l = |tp: u64, rank: u32| {
        layout_ns(
            json!({"model_name": "deepseek/V3", "dtype": "torch.bfloat16",
            "tokens_per_hash": 64, "tp_size": tp, "replicated_layout": true, "rank": rank}),
        )
        .unwrap()
    };
    let (a, b, c) = (l(2, 1), l(4, 3), l(8, 0));
    assert_eq!(a.rank_dir_name(), b.rank_dir_name());
    assert_eq!(a.rank_dir_name(), c.rank_dir_name());
    assert_eq!(a.rank(), 0);
    assert!(a.rank_dir_name().ends_with("_r0"));
    // and through Namespace::new directly
    let mut f = RunFields::new("deepseek/V3", "torch.bfloat16", 64);
    f.tp_size = 4;
    f.replicated_layout = true;
    let d = Namespace::new(f, 2).unwrap();
    assert_eq!(d.rank_dir_name(), a.rank_dir_name());
}

#[test]
fn layout_vectors_reproduce_byte_for_byte() {
    let mut checked = 0;
    for file in vector_files() {
        let text = std::fs::read_to_string(&file).unwrap();
        let vectors: serde_json::Map<String, Value> = serde_json::from_str(&text).unwrap();
        assert!(!vectors.is_empty());
        for (name, v) in vectors {
            let root = Path::new(v["root_dir"].as_str().unwrap());
            let rank = v["rank"].as_u64().unwrap() as u32;
            let ns = Namespace::from_json(&v["config_json_fields"], rank).unwrap();
            let key = BlockKey::from_hex(
                v["block_hash_hex"].as_str().unwrap(),
                v["group"].as_u64().unwrap() as u32,
            )
            .unwrap();
            assert_eq!(
                ns.namespace_dir(root).to_str().unwrap(),
                v["namespace_dir"].as_str().unwrap(),
                "{name}: namespace_dir"
            );
            assert_eq!(
                ns.config_path(root).to_str().unwrap(),
                v["config_path"].as_str().unwrap(),
                "{name}: config_path"
            );
            assert_eq!(
                ns.block_path(root, &key).to_str().unwrap(),
                v["block_path"].as_str().unwrap(),
                "{name}: block_path"
            );
            // config.json holds exactly the run fields given (as JSON values) ...
            let written: Value = serde_json::from_str(&ns.config_json()).unwrap();
            assert_eq!(
                written, v["config_json_fields"],
                "{name}: config.json content"
            );
            // ... and reading it back gives the same namespace.
            ns.check_config_json(&ns.config_path(root), &ns.config_json())
                .unwrap();
            checked += 1;
        }
    }
    assert!(checked >= 2, "checked {checked} vectors");
}

#[test]
fn config_json_is_python_pretty_printed() {
    let v: serde_json::Map<String, Value> =
        serde_json::from_str(&std::fs::read_to_string(&vector_files()[0]).unwrap()).unwrap();
    let ns = Namespace::from_json(&v["test-model-r3-g2"]["config_json_fields"], 3).unwrap();
    // json.dumps(fields, indent=2, sort_keys=True)
    let expected = r#"{
  "blocks_per_file": 1,
  "dcp_size": 1,
  "dtype": "float16",
  "inference_engine": "vllm",
  "kv_cache_groups": [],
  "model_name": "test-model",
  "parallel_agnostic": false,
  "pcp_size": 1,
  "pp_size": 1,
  "tokens_per_hash": 16,
  "tp_size": 1
}"#;
    assert_eq!(ns.config_json(), expected);
    assert_eq!(
        ns.canonical_json(),
        r#"{"blocks_per_file":1,"dcp_size":1,"dtype":"float16","inference_engine":"vllm","kv_cache_groups":[],"model_name":"test-model","parallel_agnostic":false,"pcp_size":1,"pp_size":1,"tokens_per_hash":16,"tp_size":1}"#
    );
}
