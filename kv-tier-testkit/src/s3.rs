//! A real S3-protocol server for tests (feature `s3-server`): s3s + s3s-fs in process, on an
//! ephemeral 127.0.0.1 port, with SigV4 authentication, TCP_NODELAY and fault injection
//! (answer the next requests 503, hold every request until released, delay every request, or
//! stop the server).
//!
//! ```no_run
//! # async fn demo() {
//! let server = kv_tier_testkit::s3::S3Server::start().await;
//! println!("S3 at {} bucket {}", server.endpoint, kv_tier_testkit::s3::BUCKET);
//! server.fail_next(2); // the next two requests get 503 Service Unavailable
//! # }
//! ```

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use hyper_util::rt::{TokioExecutor, TokioIo};

/// The access key the server accepts.
pub const AK: &str = "kv-tier-test-access";
/// The secret key the server accepts.
pub const SK: &str = "kv-tier-test-secret-0123456789";
/// The bucket the server starts with.
pub const BUCKET: &str = "kv-cache";

/// An S3 server on an ephemeral loopback port; stopped when dropped.
#[derive(Debug)]
pub struct S3Server {
    /// `http://127.0.0.1:<port>`.
    pub endpoint: String,
    fail_next: Arc<AtomicUsize>,
    latency_us: Arc<std::sync::atomic::AtomicU64>,
    held: Arc<tokio::sync::watch::Sender<usize>>,
    /// Requests received so far.
    pub requests: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
    _dir: Option<tempfile::TempDir>,
}

impl S3Server {
    /// Starts a server with the bucket [`BUCKET`] and the credentials [`AK`] / [`SK`].
    pub async fn start() -> S3Server {
        Self::start_with(crate::util::temp_root()).await
    }

    /// As [`S3Server::start`], keeping the objects in a fresh directory under `parent` (say
    /// a tmpfs, so that a benchmark's server, which stands for a remote store, does not
    /// spend the local disk and CPU a remote one would not).
    pub async fn start_in(parent: &std::path::Path) -> S3Server {
        let dir = tempfile::Builder::new()
            .prefix("kv-tier-s3-")
            .tempdir_in(parent)
            .expect("create the server's directory");
        Self::start_with(dir).await
    }

    async fn start_with(dir: tempfile::TempDir) -> S3Server {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], 0));
        let mut server = Self::serve(dir.path(), addr, BUCKET, AK, SK)
            .await
            .expect("start the S3 server");
        server._dir = Some(dir);
        server
    }

    /// Serves the directory `root` over S3 on `addr` (port 0: one the OS picks; see
    /// [`S3Server::endpoint`]): each subdirectory is a bucket, and `bucket` is created if
    /// missing. Requests are signed with `access_key` / `secret_key` (SigV4). What
    /// `kv-tier s3-server` runs.
    pub async fn serve(
        root: &std::path::Path,
        addr: std::net::SocketAddr,
        bucket: &str,
        access_key: &str,
        secret_key: &str,
    ) -> std::io::Result<S3Server> {
        let ctx = |what: String| {
            move |e: std::io::Error| std::io::Error::new(e.kind(), format!("{what}: {e}"))
        };
        std::fs::create_dir_all(root.join(bucket)).map_err(ctx(format!(
            "creating the bucket directory {}",
            root.join(bucket).display()
        )))?;
        let fs = s3s_fs::FileSystem::new(root)
            .map_err(|e| std::io::Error::other(format!("serving {}: {e:?}", root.display())))?;
        let mut b = s3s::service::S3ServiceBuilder::new(fs);
        b.set_auth(s3s::auth::SimpleAuth::from_single(access_key, secret_key));
        let service = b.build();
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(ctx(format!("binding {addr}")))?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let fail_next = Arc::new(AtomicUsize::new(0));
        let requests = Arc::new(AtomicUsize::new(0));
        let latency_us = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let held = Arc::new(tokio::sync::watch::Sender::new(0usize));
        let (f, r, lat) = (fail_next.clone(), requests.clone(), latency_us.clone());
        let hold = held.clone();
        // s3s-fs checks a PUT's If-Match / If-None-Match, then writes: two conditional PUTs
        // of one key could both pass. S3 decides them atomically; so does this server, by
        // running conditional PUTs of one key one at a time.
        let conditional: Arc<Vec<tokio::sync::Mutex<()>>> =
            Arc::new((0..64).map(|_| tokio::sync::Mutex::new(())).collect());
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((socket, _)) = listener.accept().await else {
                    continue;
                };
                // Without TCP_NODELAY every small request waits ~40 ms for a delayed ACK.
                socket.set_nodelay(true).unwrap();
                let (svc, f, r, lat) = (service.clone(), f.clone(), r.clone(), lat.clone());
                let (cond, hold) = (conditional.clone(), hold.clone());
                let handler = hyper::service::service_fn(
                    move |req: http::Request<hyper::body::Incoming>| {
                        let (svc, f, r, lat) = (svc.clone(), f.clone(), r.clone(), lat.clone());
                        let (cond, mut held) = (cond.clone(), hold.subscribe());
                        async move {
                            r.fetch_add(1, Ordering::SeqCst);
                            // the sender lives as long as the server: this ends when released
                            let _ = held.wait_for(|holds| *holds == 0).await;
                            let us = lat.load(Ordering::Relaxed);
                            if us > 0 {
                                tokio::time::sleep(std::time::Duration::from_micros(us)).await;
                            }
                            let fail = f
                                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                                    n.checked_sub(1)
                                })
                                .is_ok();
                            if fail {
                                let body = "<Error><Code>ServiceUnavailable</Code><Message>injected</Message></Error>";
                                return Ok(http::Response::builder()
                                    .status(503)
                                    .body(s3s::Body::from(body.to_string()))
                                    .unwrap());
                            }
                            let _one = if req.method() == http::Method::PUT
                                && (req.headers().contains_key(http::header::IF_MATCH)
                                    || req.headers().contains_key(http::header::IF_NONE_MATCH))
                            {
                                let h = std::hash::BuildHasher::hash_one(
                                    &std::hash::BuildHasherDefault::<
                                        std::collections::hash_map::DefaultHasher,
                                    >::default(),
                                    req.uri().path(),
                                );
                                Some(cond[(h % cond.len() as u64) as usize].lock().await)
                            } else {
                                None
                            };
                            hyper::service::Service::call(&svc, req).await
                        }
                    },
                );
                conns.spawn(async move {
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(socket), handler)
                        .await;
                });
            }
        });
        Ok(S3Server {
            endpoint,
            fail_next,
            latency_us,
            held,
            requests,
            task,
            _dir: None,
        })
    }

    /// Every request waits `d` before it is served, as over a network to a remote store.
    pub fn set_latency(&self, d: std::time::Duration) {
        self.latency_us.store(
            d.as_micros().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    /// Every request, from now until the returned guard drops, waits before it is served; the
    /// waiting ones are then served. Unlike a latency, a test can tell for certain that no
    /// answer came back while held.
    #[must_use = "the server holds requests only until the guard drops"]
    pub fn hold(&self) -> HeldRequests {
        self.held.send_modify(|n| *n += 1);
        HeldRequests {
            held: self.held.clone(),
        }
    }

    /// The next `n` requests are answered 503 Service Unavailable.
    pub fn fail_next(&self, n: usize) {
        self.fail_next.store(n, Ordering::SeqCst);
    }

    /// Stops accepting and drops every connection; returns once the port refuses connections.
    pub async fn stop(&self) {
        self.task.abort();
        let addr = self.endpoint.trim_start_matches("http://").to_string();
        for _ in 0..1000 {
            if tokio::net::TcpStream::connect(&addr).await.is_err() {
                return;
            }
            tokio::task::yield_now().await;
        }
        panic!("the S3 server at {addr} still accepts connections");
    }
}

/// Requests to an [`S3Server`] wait while this lives (see [`S3Server::hold`]).
#[derive(Debug)]
pub struct HeldRequests {
    held: Arc<tokio::sync::watch::Sender<usize>>,
}

impl Drop for HeldRequests {
    fn drop(&mut self) {
        self.held.send_modify(|n| *n -= 1);
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}
