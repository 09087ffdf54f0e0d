//! `kv-tier s3-server`: the obj tier and serve_sim served by it; start failures and bucket
//! names that would leave --root refused cleanly.

use std::path::PathBuf;
use std::process::Command;

use kv_tier::SecondaryTier;
use kv_tier_testkit::{store_keys, test_key};
use serde_json::Value;

use crate::support::*;

#[test]
fn the_s3_server_serves_the_obj_tier_and_serve_sim() {
    let dir = tempfile::tempdir().unwrap();
    let server = s3_server_on(dir.path());
    // the obj tier, through the facade, stores a block there
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cfg = kv_tier::KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS},
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "obj", "bucket": "{}", "endpoint_override": "{}",
                "scheme": "http", "access_key": "{}", "secret_key": "{}", "checksum": "crc32c"}}]}}"#,
        8 * BS,
        kv_tier_testkit::s3::BUCKET,
        server.endpoint,
        kv_tier_testkit::s3::AK,
        kv_tier_testkit::s3::SK
    ))
    .unwrap();
    rt.block_on(async {
        let m = kv_tier::builder(cfg).unwrap().build().await.unwrap();
        let obj = m.tier::<kv_tier::obj::ObjTier>("obj").unwrap();
        let k = test_key(5);
        assert!(store_keys(&*obj, &[k], 0, BS).await.is_success());
        assert_eq!(obj.lookup(&[k]).await.unwrap(), vec![true]);
        let path = dir
            .path()
            .join(kv_tier_testkit::s3::BUCKET)
            .join(obj.object_path(&k));
        assert!(
            path.exists(),
            "the object is a file under --root: {}",
            path.display()
        );
        m.shutdown().await.unwrap();
    });
    // serve_sim with an obj tier on it
    let out = Command::new(serve_sim())
        .args([
            "--streams",
            "2",
            "--turns",
            "3",
            "--prefix-tokens",
            "256",
            "--prompt-tokens",
            "128",
            "--output-tokens",
            "32",
            "--model",
            "tiny",
            "--dram-mb",
            "1",
            "--no-progress",
            "--prefill-tokens-per-s",
            "0",
            "--sync-steps",
            "--s3-endpoint",
            &server.endpoint,
            "--s3-bucket",
            kv_tier_testkit::s3::BUCKET,
            "--s3-access-key",
            kv_tier_testkit::s3::AK,
            "--s3-secret-key",
            kv_tier_testkit::s3::SK,
            "--json",
        ])
        .arg(dir.path().join("report.json"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap())
            .unwrap();
    let obj = report["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "obj")
        .expect("an obj tier in the report");
    assert!(obj["blocks_stored"].as_u64().unwrap() > 0, "{obj}");
    assert_eq!(report["blocks_corrupt"], 0);
}

/// s3-server with a root that is a file, /proc, a port already taken, an address not on this
/// host: exit 1 with a message, no panic.
#[test]
fn s3_server_start_failures_are_clean() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("f");
    std::fs::write(&file, b"x").unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = taken.local_addr().unwrap().port().to_string();
    let mut bad = Vec::new();
    for args in [
        vec!["--root", arg(&file), "--port", "0"],
        vec!["--root", "/proc/self", "--port", "0"],
        vec!["--root", arg(dir.path()), "--port", &port],
        vec![
            "--root",
            arg(dir.path()),
            "--port",
            "0",
            "--host",
            "203.0.113.7",
        ],
    ] {
        let out = run_s3_server(&args, 5);
        if out.panicked() || out.timed_out || out.code != Some(1) || out.stderr.trim().is_empty() {
            bad.push(format!("{args:?}: {out:?}"));
        }
    }
    drop(taken);
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}

/// The bucket name becomes a directory under --root ("each subdirectory a bucket"): one with
/// `..` or `/` must be refused, never create or serve a directory outside --root.
#[test]
fn s3_server_bucket_names_cannot_escape_the_root() {
    let parent = tempfile::tempdir().unwrap();
    let root = parent.path().join("root");
    std::fs::create_dir(&root).unwrap();
    let mut bad = Vec::new();
    for (bucket, outside) in [
        ("../escape", parent.path().join("escape")),
        ("..", parent.path().to_path_buf()),
        ("a/b", root.join("a").join("b")),
        ("", root.clone()),
        ("/abs-escape", PathBuf::from("/abs-escape")),
    ] {
        let existed = outside.exists();
        let out = run_s3_server(
            &["--root", arg(&root), "--port", "0", "--bucket", bucket],
            3,
        );
        let created = !existed && outside.exists();
        if out.panicked() && !out.timed_out {
            bad.push(format!("bucket {bucket:?}: {out:?}"));
        } else if out.timed_out || created {
            bad.push(format!(
                "bucket {bucket:?}: accepted and served as {} (created by it: {created}); stderr: {}",
                outside.display(),
                out.stderr.lines().next().unwrap_or("")
            ));
        }
        let _ = std::fs::remove_dir_all("/abs-escape");
        let _ = std::fs::remove_dir_all(parent.path().join("escape"));
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}
