//! A TCP proxy between a tier and the S3 test server that black-holes, drops replies, resets
//! connections or answers 503 SlowDown on demand.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use kv_tier_obj::{ObjChecksum, ObjTier};

use super::{S3Server, S3ServerExt as _};

/// How a [`Proxy`] treats the traffic.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Mode {
    /// Everything passes.
    Pass,
    /// Requests and replies vanish; connections stay open.
    Blackhole,
    /// Requests reach the server; the connection drops before the reply.
    DropReply,
    /// The connection is reset as soon as a request arrives.
    Reset,
    /// Every request is answered 503 SlowDown.
    SlowDown,
}

/// A TCP proxy in front of an S3 server that misbehaves as its [`Mode`] says.
pub(crate) struct Proxy {
    /// Where clients connect.
    pub(crate) endpoint: String,
    mode: Arc<Mutex<Mode>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// A proxy in front of `upstream` (an `http://` endpoint), passing everything.
    pub(crate) async fn start(upstream: &str) -> Proxy {
        let upstream = upstream.trim_start_matches("http://").to_string();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let endpoint = format!("http://{}", listener.local_addr().unwrap());
        let mode = Arc::new(Mutex::new(Mode::Pass));
        let m = mode.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let (m, up) = (m.clone(), upstream.clone());
                tokio::spawn(async move {
                    let _ = pump(client, &up, m).await;
                });
            }
        });
        Proxy {
            endpoint,
            mode,
            task,
        }
    }
    /// From now on, treats the traffic as `m` says.
    pub(crate) fn set(&self, m: Mode) {
        *self.mode.lock().unwrap() = m;
    }
}

/// Carries one client connection to `up` and back, as the proxy's mode says.
async fn pump(
    mut client: tokio::net::TcpStream,
    up: &str,
    mode: Arc<Mutex<Mode>>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    client.set_nodelay(true)?;
    let mut server = tokio::net::TcpStream::connect(up).await?;
    server.set_nodelay(true)?;
    let (mut cr, mut cw) = client.split();
    let (mut sr, mut sw) = server.split();
    let (mut b1, mut b2) = (vec![0u8; 65536], vec![0u8; 65536]);
    let mut drop_reply = false;
    let mode = || *mode.lock().unwrap();
    loop {
        tokio::select! {
            r = cr.read(&mut b1) => {
                let n = r?;
                if n == 0 { return Ok(()); }
                match mode() {
                    Mode::Pass => sw.write_all(&b1[..n]).await?,
                    Mode::Blackhole => {}
                    Mode::DropReply => { sw.write_all(&b1[..n]).await?; drop_reply = true; }
                    Mode::Reset => return Ok(()),
                    Mode::SlowDown => {
                        let body = "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>";
                        let resp = format!("HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
                        cw.write_all(resp.as_bytes()).await?;
                        return Ok(());
                    }
                }
            }
            r = sr.read(&mut b2) => {
                let n = r?;
                if n == 0 { return Ok(()); }
                if drop_reply { return Ok(()); }
                match mode() {
                    Mode::Blackhole => {}
                    _ => cw.write_all(&b2[..n]).await?,
                }
            }
        }
    }
}

/// An obj tier (checksums on, `timeout` s requests, `retries` retries, 0.5 s lookups) on
/// `server` through `proxy`, and its request deadline.
pub(crate) async fn proxied(
    server: &S3Server,
    proxy: &Proxy,
    timeout: f64,
    retries: usize,
) -> (ObjTier, Duration) {
    let mut cfg = server.config();
    cfg.endpoint_override = Some(proxy.endpoint.clone());
    cfg.checksum = ObjChecksum::Crc32c;
    cfg.request_timeout_s = timeout;
    cfg.max_retries = retries;
    cfg.lookup_timeout_s = 0.5;
    let c = cfg.clone();
    c.validate().unwrap();
    let d = c.request_deadline();
    (server.tier(cfg).await, d)
}
