//! The layout vectors of the spec, reproduced byte for byte.

use std::path::{Path, PathBuf};

use kv_tier_core::{BlockKey, Namespace};
use serde_json::Value;

fn vector_files() -> Vec<PathBuf> {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![here.join("tests/data/layout-vectors.json")];
    // The project's shared spec, when checked out beside the repository, is checked too so a
    // newer vector set cannot silently diverge from the copy kept here.
    let shared = here.join("../../shared/spec/layout-vectors.json");
    if shared.exists() {
        files.push(shared);
    }
    files
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
