//! The `kv-tier` command driven as an operator would: on cache directories written by the
//! fs tier (with damage, strays and ages planted behind its back), on config files, and
//! its S3 server used by the obj tier and by serve_sim.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, SystemTime};

use kv_tier::fs::{Checksum, FsTier, FsTierConfig};
use kv_tier::{BlockKey, Namespace, RunFields, SecondaryTier};
use kv_tier_testkit::{store_keys, test_key};
use serde_json::Value;

const BS: usize = 16384;

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kv-tier"))
}

fn run(args: &[&str]) -> Output {
    bin().args(args).output().expect("kv-tier runs")
}

fn json_of(out: &Output) -> Value {
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "not JSON ({e}): {}\nstderr: {}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn ns() -> Namespace {
    Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap()
}

/// A root written by the fs tier with checksums: `n` blocks, the tier shut down.
fn written_root(n: u64) -> (tempfile::TempDir, FsTier, Vec<BlockKey>) {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = FsTierConfig::new(dir.path());
    cfg.checksum = Checksum::Crc32c;
    let tier = FsTier::open("fs", cfg, ns(), BS).unwrap();
    let keys: Vec<BlockKey> = (0..n).map(test_key).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        assert!(store_keys(&tier, &keys, 0, BS).await.is_success());
        tier.shutdown().await.unwrap();
    });
    (dir, tier, keys)
}

fn arg(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn inspect_reports_namespaces_blocks_bytes_and_strays() {
    let (dir, tier, keys) = written_root(12);
    let block = tier.block_path(&keys[0]);
    let leaf = block.parent().unwrap();
    std::fs::write(leaf.join("stray.tmp"), b"half").unwrap();
    std::fs::write(leaf.join(format!("{}.crc32c", "ab".repeat(32))), b"orphan").unwrap();
    std::fs::write(leaf.join("notes.txt"), b"mine").unwrap();
    let out = run(&["inspect", arg(dir.path()), "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v = json_of(&out);
    assert_eq!(v["blocks"], 12);
    let ns = &v["namespaces"][0];
    assert_eq!(ns["name"], ns_dir_name());
    assert_eq!(ns["config"]["model_name"], "org/model");
    let r = &ns["ranks"][0];
    assert_eq!(r["rank"], 0);
    assert_eq!(r["blocks"], 12);
    assert_eq!(r["block_sizes"][BS.to_string()], 12);
    assert_eq!(r["temp_files"], 1);
    assert_eq!(r["orphan_sidecars"], 1);
    assert_eq!(r["foreign_files"], 1);
    assert_eq!(r["ages"]["under_1m"], 12);
    let (files, dirs) = (
        r["file_bytes"].as_u64().unwrap(),
        r["dir_bytes"].as_u64().unwrap(),
    );
    assert!(files >= 12 * BS as u64, "{r}");
    assert!(dirs > 0);
    assert_eq!(r["allocated_bytes"].as_u64().unwrap(), files + dirs);
    // for people: the same figures
    let out = run(&["inspect", arg(dir.path())]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("12 blocks (12 of 16384 bytes)")
            && text.contains("temp files 1, orphan sidecars 1, foreign files 1"),
        "{text}"
    );
    // not a directory: an error naming it, exit 1
    let out = run(&["inspect", "/nonexistent/kv"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/kv"));
}

fn ns_dir_name() -> String {
    ns().namespace_dir(Path::new("/"))
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// Writes `bytes` at `at` into `path` in place (keeping its inode, so its sidecar or xattr
/// still belongs to it).
fn overwrite(path: &Path, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

#[test]
fn verify_lists_damage_and_repair_removes_only_it() {
    let (dir, tier, keys) = written_root(10);
    let flipped = tier.block_path(&keys[1]);
    let mut b = std::fs::read(&flipped).unwrap();
    b[100] ^= 0xff;
    overwrite(&flipped, 100, &b[100..101]);
    let short = tier.block_path(&keys[2]);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&short)
        .unwrap()
        .set_len(BS as u64 - 1)
        .unwrap();
    let out = run(&["verify", arg(dir.path()), "--json"]);
    assert_eq!(out.status.code(), Some(1), "damage left: exit 1");
    let v = json_of(&out);
    assert_eq!(v["checked"], 10);
    assert_eq!(v["verified"], 8);
    let damaged = v["damaged"].as_array().unwrap();
    let paths: Vec<PathBuf> = damaged
        .iter()
        .map(|d| PathBuf::from(d["path"].as_str().unwrap()))
        .collect();
    assert_eq!(paths.len(), 2, "{v}");
    assert!(paths.contains(&flipped) && paths.contains(&short), "{v}");
    let reasons: Vec<&str> = damaged
        .iter()
        .map(|d| d["reason"].as_str().unwrap())
        .collect();
    assert!(
        reasons.iter().any(|r| r.contains("checksum"))
            && reasons.iter().any(|r| r.contains("16383 bytes")),
        "{reasons:?}"
    );
    assert!(
        flipped.exists() && short.exists(),
        "verify without --repair removes nothing"
    );
    let out = run(&["verify", arg(dir.path()), "--repair"]);
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("2 damaged (2 removed)"), "{text}");
    assert!(!flipped.exists() && !short.exists());
    for k in [0, 3, 4, 5, 6, 7, 8, 9] {
        assert!(
            tier.block_path(&keys[k]).exists(),
            "a good block was removed"
        );
    }
    let out = run(&["verify", arg(dir.path()), "--json"]);
    assert!(out.status.success());
    assert_eq!(json_of(&out)["verified"], 8);
}

#[test]
fn gc_deletes_the_least_recently_used_down_to_the_watermark_or_only_lists_them() {
    let (dir, tier, keys) = written_root(40);
    // ages: key 0 the least recently used, each next one a minute later
    let now = SystemTime::now();
    for (i, k) in keys.iter().enumerate() {
        let f = std::fs::File::options()
            .write(true)
            .open(tier.block_path(k))
            .unwrap();
        f.set_modified(now - Duration::from_secs(3600 - 60 * i as u64))
            .unwrap();
    }
    let inspect = json_of(&run(&["inspect", arg(dir.path()), "--json"]));
    let total = inspect["allocated_bytes"].as_u64().unwrap();
    let per_block = inspect["namespaces"][0]["ranks"][0]["file_bytes"]
        .as_u64()
        .unwrap()
        / 40;
    // a cap that ten blocks' worth must go for
    let cap = total - 10 * per_block;
    let gb = format!("{}", cap as f64 / (1u64 << 30) as f64);
    let out = run(&[
        "gc",
        arg(dir.path()),
        "--max-size-gb",
        &gb,
        "--low-watermark",
        "1",
        "--dry-run",
        "--json",
    ]);
    assert!(out.status.success(), "{out:?}");
    let v = json_of(&out);
    let victims: Vec<PathBuf> = v["victims"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| PathBuf::from(x["path"].as_str().unwrap()))
        .collect();
    let oldest: Vec<PathBuf> = keys[..victims.len()]
        .iter()
        .map(|k| tier.block_path(k))
        .collect();
    assert_eq!(victims, oldest, "oldest first");
    assert!((10..=11).contains(&victims.len()), "{}", victims.len());
    assert!(
        victims.iter().all(|p| p.exists()),
        "a dry run deletes nothing"
    );
    let out = run(&[
        "gc",
        arg(dir.path()),
        "--max-size-gb",
        &gb,
        "--low-watermark",
        "1",
    ]);
    assert!(out.status.success(), "{out:?}");
    assert!(victims.iter().all(|p| !p.exists()));
    assert!(
        keys[victims.len()..]
            .iter()
            .all(|k| tier.block_path(k).exists())
    );
    let after = json_of(&run(&["inspect", arg(dir.path()), "--json"]));
    assert!(after["allocated_bytes"].as_u64().unwrap() <= cap);
    // within the cap: nothing to do
    let out = run(&["gc", arg(dir.path()), "--max-size-gb", "1"]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("nothing to delete"));
    // a bad cap is a usage error
    assert_eq!(
        run(&["gc", arg(dir.path()), "--max-size-gb", "-1"])
            .status
            .code(),
        Some(2)
    );
}

fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    p
}

#[test]
fn config_check_prints_the_effective_config_or_the_field_in_error() {
    let dir = tempfile::tempdir().unwrap();
    let good = write_config(
        dir.path(),
        "good.json",
        r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536,
            "layout": {"model_name": "org/m", "dtype": "torch.bfloat16", "tokens_per_hash": 16},
            "secondary_tiers": [
              {"type": "fs", "root_dir": "/tmp/kv", "gc_max_size_gb": 10},
              {"type": "obj", "bucket": "b", "endpoint_override": "http://127.0.0.1:9000",
               "access_key": "AK", "secret_key": "SECRET"}]}"#,
    );
    let out = run(&["config", "check", arg(&good), "--json"]);
    assert!(out.status.success(), "{out:?}");
    let v = json_of(&out);
    assert_eq!(v["ok"], true);
    let e = &v["effective"];
    assert_eq!(e["job_timeout_s"], 30.0, "a manager default, filled in");
    assert_eq!(
        e["shutdown_timeout_s"], 30.0,
        "a manager default, filled in"
    );
    assert_eq!(e["layout"]["rank"], 0);
    assert_eq!(e["secondary_tiers"][0]["gc_max_size_gb"], 10.0);
    assert_eq!(e["secondary_tiers"][0]["checksum"], "none");
    assert_eq!(e["secondary_tiers"][1]["name"], "obj");
    assert_eq!(
        e["secondary_tiers"][1]["secret_key"], "***",
        "secrets are masked"
    );
    assert_eq!(
        e["secondary_tiers"][1]["probe_budget_s"], 0.005,
        "a remote tier's budget"
    );
    let text = String::from_utf8_lossy(&run(&["config", "check", arg(&good)]).stdout).into_owned();
    assert!(
        !text.contains("SECRET") && text.contains("\"gc_max_size_gb\": 10.0"),
        "{text}"
    );
    for (body, field) in [
        (
            r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536,
                "secondary_tiers": [{"type": "fs", "root_dir": "/tmp/kv", "gc_low_watermark": 2}]}"#,
            "secondary_tiers[0].gc_low_watermark",
        ),
        (
            r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536, "lease_s": -1}"#,
            "lease_s",
        ),
        (
            r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536,
                "secondary_tiers": [{"type": "tape"}]}"#,
            "secondary_tiers[0].type",
        ),
        (
            r#"{"cpu_bytes_to_use": 1073741824, "block_size_bytes": 65536, "frobnicate": 1}"#,
            "frobnicate",
        ),
    ] {
        let bad = write_config(dir.path(), "bad.json", body);
        let out = run(&["config", "check", arg(&bad)]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(field), "{field} not named: {err}");
        let v = json_of(&run(&["config", "check", arg(&bad), "--json"]));
        assert_eq!(v["ok"], false);
        assert!(v["error"].as_str().unwrap().contains(field));
    }
    let out = run(&["config", "check", "/nonexistent/kv.json"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/kv.json"));
}

/// The S3 server as a process, its endpoint read from its first line of output; killed when
/// dropped.
struct Server(std::process::Child, String);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn s3_server(root: &Path) -> Server {
    let mut child = bin()
        .args(["s3-server", "--root", arg(root), "--port", "0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.starts_with("http://127.0.0.1:"), "{line:?}");
    Server(child, line.trim().to_string())
}

/// The path of serve_sim beside this package's binary, built first if it is not there.
fn serve_sim() -> PathBuf {
    let me = PathBuf::from(env!("CARGO_BIN_EXE_kv-tier"));
    let sim = me.with_file_name("serve_sim");
    if !sim.exists() {
        let profile_release = me.parent().and_then(|d| d.file_name()) == Some("release".as_ref());
        let mut c = Command::new(env!("CARGO"));
        c.args(["build", "-p", "kv-tier-examples", "--bin", "serve_sim"]);
        if profile_release {
            c.arg("--release");
        }
        assert!(c.status().unwrap().success(), "building serve_sim");
    }
    sim
}

#[test]
fn the_s3_server_serves_the_obj_tier_and_serve_sim() {
    let dir = tempfile::tempdir().unwrap();
    let server = s3_server(dir.path());
    // the obj tier, through the facade, stores a block there
    let rt = tokio::runtime::Runtime::new().unwrap();
    let cfg = kv_tier::KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": {}, "block_size_bytes": {BS},
            "layout": {{"model_name": "org/model", "dtype": "torch.bfloat16", "tokens_per_hash": 16}},
            "secondary_tiers": [{{"type": "obj", "bucket": "{}", "endpoint_override": "{}",
                "scheme": "http", "access_key": "{}", "secret_key": "{}", "checksum": "crc32c"}}]}}"#,
        8 * BS,
        kv_tier_testkit::s3::BUCKET,
        server.1,
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
            &server.1,
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
