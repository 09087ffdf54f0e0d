//! The object-store client: building the S3 client from the config, and the startup probe
//! that turns bad credentials, a missing bucket or an unreachable endpoint into a clear error.

use std::sync::Arc;
use std::time::Duration;

use futures::TryStreamExt;
use kv_tier_core::{BlockKey, Error, Result};
use object_store::ObjectStore;
use object_store::ObjectStoreExt as _;

use crate::block::{ReqError, Shared};
use crate::config::{ObjTierConfig, Scheme};
use crate::stats::Counters;
use kv_tier_core::stats::bump;

const CREDENTIALS: &str =
    "the credentials were refused: check access_key, secret_key and session_token";
const UNREACHABLE: &str =
    "the endpoint cannot be reached: check endpoint_override, scheme and region";
const NO_CREDENTIALS: &str = "no credentials: the store's credential provider found none";

/// The S3 client's HTTP layer with its attempts counted: reqwest, as object_store sets it
/// up, under a wrapper that counts every request sent (retries included) and every failure
/// object_store retries.
#[derive(Debug)]
struct CountingConnector(Arc<Counters>);

impl object_store::client::HttpConnector for CountingConnector {
    fn connect(
        &self,
        options: &object_store::ClientOptions,
    ) -> object_store::Result<object_store::client::HttpClient> {
        use object_store::client::{HttpClient, ReqwestConnector};
        let inner = ReqwestConnector::default().connect(options)?;
        Ok(HttpClient::new(Counted {
            inner,
            counters: self.0.clone(),
        }))
    }
}

#[derive(Debug)]
struct Counted {
    inner: object_store::client::HttpClient,
    counters: Arc<Counters>,
}

#[async_trait::async_trait]
impl object_store::client::HttpService for Counted {
    async fn call(
        &self,
        req: object_store::client::HttpRequest,
    ) -> std::result::Result<object_store::client::HttpResponse, object_store::client::HttpError>
    {
        bump(&self.counters.own.http_attempts, 1);
        let r = self.inner.execute(req).await;
        let retryable = match &r {
            Err(_) => true,
            Ok(resp) => retryable_status(resp.status().as_u16()),
        };
        if retryable {
            bump(&self.counters.own.http_retryable_failures, 1);
        }
        r
    }
}

/// The statuses object_store's S3 client retries: server errors, 429 and 408.
fn retryable_status(status: u16) -> bool {
    status >= 500 || status == 429 || status == 408
}

/// Where the S3 client takes its credentials from when neither the config nor the
/// environment gives keys: the provider object_store chose (it picks one, as the AWS SDKs'
/// chain would: a web identity, the ECS task endpoint, EKS pod identity, else the instance
/// metadata service), and what it asks, to name in an error.
pub(crate) struct CredentialSource {
    provider: object_store::aws::AwsCredentialProvider,
    source: String,
}

/// The credential source the builder's settings make object_store use, if it is not keys
/// (given in the config or the environment) and signing is not skipped. The same order as
/// `AmazonS3Builder::build`'s.
fn credential_source(b: &object_store::aws::AmazonS3Builder) -> Option<String> {
    use object_store::aws::AmazonS3ConfigKey as K;
    let get = |k: K| b.get_config_value(&k).filter(|v| !v.is_empty());
    if get(K::AccessKeyId).is_some()
        || get(K::SecretAccessKey).is_some()
        || get(K::SkipSignature).is_some_and(|v| v.eq_ignore_ascii_case("true"))
    {
        return None;
    }
    Some(
        match (
            get(K::WebIdentityTokenFile),
            get(K::RoleArn),
            get(K::ContainerCredentialsRelativeUri),
            get(K::ContainerCredentialsFullUri),
            get(K::ContainerAuthorizationTokenFile),
        ) {
            (Some(file), Some(role), ..) => format!(
                "a web identity (AWS_WEB_IDENTITY_TOKEN_FILE {file}, AWS_ROLE_ARN {role}) at STS"
            ),
            (_, _, Some(uri), ..) => {
                format!("the ECS task credentials endpoint http://169.254.170.2{uri}")
            }
            (_, _, None, Some(uri), Some(_)) => {
                format!("EKS pod identity at {uri} (AWS_CONTAINER_CREDENTIALS_FULL_URI)")
            }
            _ => format!(
                "the instance metadata service at {}",
                get(K::MetadataEndpoint).unwrap_or_else(|| "http://169.254.169.254".into())
            ),
        },
    )
}

/// Asks the credential chain for credentials within `deadline`, before any request is sent:
/// a chain that finds none, or does not answer, fails the startup saying so and naming where
/// it looked, rather than passing for an endpoint that cannot be reached.
pub(crate) async fn check_credentials(
    name: &str,
    from: &CredentialSource,
    deadline: Duration,
) -> Result<()> {
    let what = match tokio::time::timeout(deadline, from.provider.get_credential()).await {
        Ok(Ok(_)) => return Ok(()),
        Ok(Err(e)) => format!("{} gave none ({e})", from.source),
        Err(_) => format!("{} did not answer within {deadline:?}", from.source),
    };
    Err(Error::Backend {
        tier: name.to_string(),
        message: format!(
            "no credentials: access_key and secret_key are not set (neither in the config nor \
             as AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), and {what}"
        ),
        transient: false,
    })
}

/// The S3 client from the config, its HTTP attempts counted in `counters`, and where its
/// credentials come from when the config and the environment give no keys.
pub(crate) fn build_s3(
    cfg: &ObjTierConfig,
    counters: Arc<Counters>,
) -> Result<(Arc<dyn ObjectStore>, Option<CredentialSource>)> {
    use object_store::aws::AmazonS3Builder;
    use object_store::{BackoffConfig, ClientOptions, RetryConfig};
    let mut b = AmazonS3Builder::from_env()
        .with_bucket_name(&cfg.bucket)
        .with_region(cfg.region.clone().unwrap_or_else(|| "us-east-1".into()))
        .with_allow_http(cfg.scheme == Scheme::Http);
    if let Some(e) = &cfg.endpoint_override {
        b = b.with_endpoint(e.trim_end_matches('/'));
    }
    let nonempty = |v: &Option<String>| v.clone().filter(|s| !s.is_empty());
    if let (Some(ak), Some(sk)) = (nonempty(&cfg.access_key), nonempty(&cfg.secret_key)) {
        b = b.with_access_key_id(ak).with_secret_access_key(sk);
        if let Some(t) = nonempty(&cfg.session_token) {
            b = b.with_token(t);
        }
    }
    let attempt = Duration::from_secs_f64(cfg.request_timeout_s);
    let mut opts = ClientOptions::new()
        .with_timeout(attempt)
        .with_connect_timeout(attempt.min(Duration::from_secs(5)))
        .with_allow_http(cfg.scheme == Scheme::Http);
    if let Some(path) = &cfg.ca_bundle {
        let pem = std::fs::read(path)
            .map_err(|e| Error::config("ca_bundle", format!("cannot read {path}: {e}")))?;
        let certs = object_store::Certificate::from_pem_bundle(&pem)
            .map_err(|e| Error::config("ca_bundle", format!("{path}: {e}")))?;
        for c in certs {
            opts = opts.with_root_certificate(c);
        }
    }
    b = b
        .with_http_connector(CountingConnector(counters))
        .with_client_options(opts)
        .with_retry(RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(50),
                max_backoff: Duration::from_secs(2),
                base: 2.0,
            },
            max_retries: cfg.max_retries,
            retry_timeout: cfg.request_deadline(),
        });
    let source = credential_source(&b);
    let store = b
        .build()
        .map_err(|e| Error::config("bucket", format!("cannot build the S3 client: {e}")))?;
    let credentials = source.map(|source| CredentialSource {
        provider: store.credentials().clone(),
        source,
    });
    Ok((Arc::new(store), credentials))
}

/// The startup probe: a HEAD (reachability, credentials), and where it finds nothing a
/// LIST, which tells a missing bucket (404) from a missing object.
pub(crate) async fn probe(inner: &Shared, bucket: &str) -> Result<()> {
    let key = BlockKey::from_hash32([0; 32], u32::MAX);
    let path = inner.path(&key);
    // Classified by the error's kind, and by S3's error codes where only a message is
    // left (a LIST's error): never by digits, which a URL's port may hold.
    let refused = |e: &object_store::Error| {
        matches!(
            e,
            object_store::Error::PermissionDenied { .. }
                | object_store::Error::Unauthenticated { .. }
        ) || [
            "AccessDenied",
            "SignatureDoesNotMatch",
            "InvalidAccessKeyId",
        ]
        .iter()
        .any(|c| e.to_string().contains(c))
    };
    // no request reached the endpoint: the credential chain (ending at the instance
    // metadata service) found nothing to sign with
    let no_credentials = |e: &object_store::Error| {
        let m = e.to_string();
        m.contains("169.254.169.254") || m.to_ascii_lowercase().contains("credential")
    };
    let hint = |e: &object_store::Error| {
        if refused(e) {
            CREDENTIALS
        } else if no_credentials(e) {
            NO_CREDENTIALS
        } else {
            UNREACHABLE
        }
    };
    let (hint, detail) = match inner.request(inner.store.head(&path)).await {
        Ok(_) => return Ok(()),
        Err(ReqError::Store(object_store::Error::NotFound { .. })) => {
            let prefix = inner.rank_prefix().join(".kv-tier-probe");
            let list =
                inner.request(async { inner.store.list(Some(&prefix)).try_next().await.map(drop) });
            match list.await {
                Ok(()) => return Ok(()),
                Err(ReqError::Store(object_store::Error::PermissionDenied { .. })) => {
                    tracing::info!(tier = %inner.name, "no LIST permission: the bucket's existence is not checked at startup");
                    return Ok(());
                }
                Err(ReqError::Store(e)) if e.to_string().contains("NoSuchBucket") => {
                    ("the bucket does not exist", e.to_string())
                }
                Err(ReqError::Store(e)) => (hint(&e), e.to_string()),
                Err(ReqError::TimedOut) => (
                    UNREACHABLE,
                    format!("no answer within {:?}", inner.request_deadline),
                ),
            }
        }
        Err(ReqError::Store(e)) => (hint(&e), e.to_string()),
        Err(ReqError::TimedOut) => (
            UNREACHABLE,
            format!("no answer within {:?}", inner.request_deadline),
        ),
    };
    Err(Error::Backend {
        tier: inner.name.clone(),
        message: format!(
            "startup probe of bucket {:?} failed: {hint} ({detail})",
            bucket
        ),
        transient: false,
    })
}
