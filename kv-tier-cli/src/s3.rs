//! `kv-tier s3-server --root DIR --port P`: the S3 server of kv-tier's tests (s3s over a
//! directory), as a local process.

use std::net::SocketAddr;
use std::path::PathBuf;

use kv_tier_testkit::s3::{AK, BUCKET, S3Server, SK};

use crate::Outcome;

#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// The directory served: each subdirectory is a bucket (created if missing)
    #[arg(long, value_name = "DIR")]
    root: PathBuf,
    /// The port (0: one the OS picks; the endpoint is printed)
    #[arg(long, value_name = "P")]
    port: u16,
    /// The address to listen on
    #[arg(long, value_name = "IP", default_value = "127.0.0.1")]
    host: std::net::IpAddr,
    /// The bucket created at start (a subdirectory of DIR: letters, digits, '.', '_' and '-',
    /// beginning and ending with a letter or digit)
    #[arg(long, value_name = "NAME", default_value = BUCKET, value_parser = bucket)]
    bucket: String,
    /// The access key requests must be signed with
    #[arg(long, value_name = "KEY", default_value = AK)]
    access_key: String,
    /// The secret key requests must be signed with
    #[arg(long, value_name = "KEY", default_value = SK)]
    secret_key: String,
}

/// A bucket name the obj tier takes, which is also a plain subdirectory of the root (never
/// `..`, a path or empty).
fn bucket(v: &str) -> Result<String, String> {
    kv_tier::obj::check_bucket(v).map_err(|e| e.to_string())?;
    Ok(v.to_string())
}

pub(crate) fn run(a: Args) -> Outcome {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| format!("starting the runtime: {e}"))?;
    rt.block_on(async {
        let addr = SocketAddr::new(a.host, a.port);
        let server = S3Server::serve(&a.root, addr, &a.bucket, &a.access_key, &a.secret_key)
            .await
            .map_err(|e| e.to_string())?;
        // the first line is the endpoint, for scripts
        println!("{}", server.endpoint);
        eprintln!(
            "kv-tier s3-server: serving {} at {} (bucket {:?}, access key {:?}, secret key {:?}); \
             try it: serve_sim --s3-endpoint {} --s3-bucket {} --s3-access-key {} --s3-secret-key {}",
            a.root.display(),
            server.endpoint,
            a.bucket,
            a.access_key,
            a.secret_key,
            server.endpoint,
            a.bucket,
            a.access_key,
            a.secret_key
        );
        // until the process is stopped
        std::future::pending::<()>().await;
        Ok(true)
    })
}
