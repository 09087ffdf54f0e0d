//! The obj tier in the tests: its config against the S3 test server, a tier connected to a
//! fresh server, a listing of the bucket, manager configs over it (a shared bucket's
//! included), a server that never answers, and whether a server has gone quiet.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use kv_tier::obj::{ObjChecksum, ObjTier, ObjTierConfig, Scheme};
use kv_tier_core::KvTierConfig;
use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};

use super::*;

/// An obj tier config against `endpoint` (the test server's bucket and keys, plain HTTP) under
/// `prefix`: CRC32C, one I/O thread, 5 s requests, no retries.
pub(crate) fn obj_config(endpoint: &str, prefix: &str) -> ObjTierConfig {
    let mut c = ObjTierConfig::new(BUCKET);
    c.endpoint_override = Some(endpoint.to_string());
    c.access_key = Some(AK.to_string());
    c.secret_key = Some(SK.to_string());
    c.scheme = Scheme::Http;
    c.prefix = prefix.to_string();
    c.checksum = ObjChecksum::Crc32c;
    c.io_threads = 1;
    c.request_timeout_s = 5.0;
    c.max_retries = 0;
    c
}

/// A fresh S3 test server (on `rt`) and an obj tier named `obj` connected to it ([`obj_config`]
/// under `prefix`, changed by `tune`).
pub(crate) fn s3_and_obj(
    rt: &tokio::runtime::Runtime,
    prefix: &str,
    tune: impl FnOnce(&mut ObjTierConfig),
) -> (S3Server, Arc<ObjTier>) {
    let s3 = rt.block_on(S3Server::start());
    let mut c = obj_config(&s3.endpoint, prefix);
    tune(&mut c);
    let tier = rt
        .block_on(ObjTier::connect("obj", c, model_namespace(), BS))
        .unwrap();
    (s3, Arc::new(tier))
}

/// Every object in the bucket (recursively, by delimiter listing).
pub(crate) async fn list_objects(tier: &ObjTier) -> Vec<String> {
    use kv_tier::obj::object_store::path::Path as OPath;
    let store = tier.object_store();
    let mut out = Vec::new();
    let mut dirs: Vec<Option<OPath>> = vec![None];
    while let Some(d) = dirs.pop() {
        let r = store
            .list_with_delimiter(d.as_ref())
            .await
            .expect("list the bucket");
        out.extend(r.objects.iter().map(|o| o.location.to_string()));
        dirs.extend(r.common_prefixes.into_iter().map(Some));
    }
    out.sort();
    out
}

/// A manager config over one obj tier against `endpoint` with `request_timeout_s`, no retries.
pub(crate) fn obj_manager_cfg(endpoint: &str, request_timeout_s: f64) -> KvTierConfig {
    KvTierConfig::from_json_str(&format!(
        r#"{{"cpu_bytes_to_use": 65536, "block_size_bytes": {BS}, {LAYOUT},
            "secondary_tiers": [{{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{endpoint}",
              "scheme": "http", "access_key": "{AK}", "secret_key": "{SK}",
              "request_timeout_s": {request_timeout_s}, "max_retries": 0}}]}}"#
    ))
    .unwrap()
}

/// The `secondary_tiers` entry of a shared, bounded obj tier against `endpoint` (prefix `shared`,
/// lease 0.5 s).
pub(crate) fn shared_obj_entry(endpoint: &str) -> String {
    format!(
        r#"{{"type": "obj", "bucket": "{BUCKET}", "endpoint_override": "{endpoint}", "scheme": "http",
            "access_key": "{AK}", "secret_key": "{SK}", "prefix": "shared", "max_size_gb": 1,
            "shared": true, "shared_lease_s": 0.5, "request_timeout_s": 2, "max_retries": 0}}"#
    )
}

/// Whether the server saw no request during `window` (sampled twice).
pub(crate) fn server_quiet(s3: &S3Server, window: Duration) -> bool {
    let a = s3.requests.load(Ordering::SeqCst);
    // the window the server must stay quiet in
    std::thread::sleep(window);
    s3.requests.load(Ordering::SeqCst) == a
}

/// Starts a TCP listener that accepts connections and never answers (a black hole); returns
/// its endpoint and a flag that stops it.
pub(crate) fn black_hole() -> (String, Arc<AtomicBool>) {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.set_nonblocking(true).unwrap();
    let addr = l.local_addr().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    std::thread::Builder::new()
        .name("black-hole".into())
        .spawn(move || {
            let mut held = Vec::new();
            while !s.load(Ordering::SeqCst) {
                if let Ok((c, _)) = l.accept() {
                    held.push(c);
                }
                // the listener is non-blocking: look again shortly
                std::thread::sleep(Duration::from_millis(2));
            }
        })
        .unwrap();
    (format!("http://{addr}"), stop)
}
