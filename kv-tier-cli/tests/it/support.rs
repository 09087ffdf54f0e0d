//! Helpers of the `kv-tier` command's tests: running it (with a deadline), its S3 server as a
//! child, roots written by the fs tier and the damage planted in them.

use std::ffi::OsStr;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use kv_tier::fs::{Checksum, FsTier, FsTierConfig};
use kv_tier::{BlockKey, Namespace, RunFields, SecondaryTier};
use kv_tier_testkit::fixtures::files::mkfifo;
use kv_tier_testkit::fixtures::process::{
    ChildOutput, S3ServerChild, binary_beside, run_with_deadline,
};
use kv_tier_testkit::{store_keys, test_key};

/// The `kv-tier` binary of this package.
pub(crate) const KV_TIER: &str = env!("CARGO_BIN_EXE_kv-tier");

/// The block size of the roots the tests write.
pub(crate) const BS: usize = 16384;

/// Runs `kv-tier` with `args` for up to `secs` seconds (killed past that), its output
/// captured.
pub(crate) fn run_os<S: AsRef<OsStr>>(args: &[S], secs: u64) -> ChildOutput {
    run_with_deadline(Command::new(KV_TIER).args(args), Duration::from_secs(secs))
}

/// [`run_os`] with string arguments and a deadline of 20 s.
pub(crate) fn run(args: &[&str]) -> ChildOutput {
    run_os(args, 20)
}

/// `kv-tier s3-server ARGS` for up to `secs` seconds (one that starts serving serves until
/// then and is killed): its output.
pub(crate) fn run_s3_server(args: &[&str], secs: u64) -> ChildOutput {
    let mut all = vec!["s3-server"];
    all.extend_from_slice(args);
    run_os(&all, secs)
}

/// `kv-tier s3-server --root ROOT --port 0` as a child process, its endpoint read from its
/// first line of output; killed when dropped.
pub(crate) fn s3_server_on(root: &Path) -> S3ServerChild {
    S3ServerChild::start(Path::new(KV_TIER), root)
}

/// The path of serve_sim beside this package's binary, built first if it is not there.
pub(crate) fn serve_sim() -> PathBuf {
    binary_beside(Path::new(KV_TIER), "serve_sim", "kv-tier-examples")
}

/// The namespace the tests' roots are written in.
pub(crate) fn root_namespace() -> Namespace {
    Namespace::new(RunFields::new("org/model", "torch.bfloat16", 16), 0).unwrap()
}

/// A root at `dir` written by the fs tier with checksums: `n` blocks, the tier shut down.
pub(crate) fn write_root(dir: &Path, n: u64) -> (FsTier, Vec<BlockKey>) {
    let mut cfg = FsTierConfig::new(dir);
    cfg.checksum = Checksum::Crc32c;
    let tier = FsTier::open("fs", cfg, root_namespace(), BS).unwrap();
    let keys: Vec<BlockKey> = (0..n).map(test_key).collect();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        assert!(store_keys(&tier, &keys, 0, BS).await.is_success());
        tier.shutdown().await.unwrap();
    });
    (tier, keys)
}

/// A root in a fresh temporary directory: [`write_root`] of `n` blocks there.
pub(crate) fn written_root(n: u64) -> (tempfile::TempDir, FsTier, Vec<BlockKey>) {
    let dir = tempfile::tempdir().unwrap();
    let (tier, keys) = write_root(dir.path(), n);
    (dir, tier, keys)
}

/// `p` as a command-line argument (the tests' paths are UTF-8 unless a test makes them not).
pub(crate) fn arg(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The directory name of [`ns`] under a root.
pub(crate) fn ns_dir_name() -> String {
    root_namespace()
        .namespace_dir(Path::new("/"))
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

/// Writes `bytes` at `at` into `path` in place (keeping its inode, so its sidecar or xattr
/// still belongs to it).
pub(crate) fn overwrite(path: &Path, at: u64, bytes: &[u8]) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(bytes, at).unwrap();
}

/// Writes `text` to the file `name` in `dir`; returns its path.
pub(crate) fn write_config(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p)
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    p
}

/// The stdout of `out` as JSON; panics showing all of `out` if it is none.
pub(crate) fn json(out: &ChildOutput) -> serde_json::Value {
    serde_json::from_str(&out.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {out:?}"))
}

/// A FIFO at one path of a written root (the fs tier's README: "a FIFO at a block, sidecar or
/// config.json path is damage, never a hang"): inspect, verify and gc --dry-run must end.
pub(crate) fn fifo_case(which: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    let (tier, keys) = write_root(dir.path(), 4);
    let at = match which {
        "config" => root_namespace().config_path(dir.path()),
        "block" => tier.block_path(&keys[0]),
        _ => PathBuf::from(format!("{}.crc32c", tier.block_path(&keys[1]).display())),
    };
    let _ = std::fs::remove_file(&at);
    mkfifo(&at);
    let mut bad = Vec::new();
    for args in [
        vec!["inspect", arg(dir.path()), "--json"],
        vec!["verify", arg(dir.path()), "--json"],
        vec![
            "gc",
            arg(dir.path()),
            "--max-size-gb",
            "1e-9",
            "--dry-run",
            "--json",
        ],
    ] {
        let out = run_os(&args, 5);
        if out.timed_out || out.panicked() {
            bad.push(format!("FIFO at the {which} path: {args:?}: {out:?}"));
        }
    }
    bad
}

/// Copies the directory `from` to `to`, recursively (files and directories only).
pub(crate) fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// `kv-tier gc ROOT` with a cap so small that every block under it is a victim, then `extra`.
pub(crate) fn gc_all<'a>(root: &'a Path, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "gc",
        arg(root),
        "--max-size-gb",
        "1e-12",
        "--low-watermark",
        "1e-9",
    ];
    args.extend_from_slice(extra);
    args
}
