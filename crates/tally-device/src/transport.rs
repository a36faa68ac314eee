//! How the sync loop reaches a server: over HTTP ([`HttpTransport`], hyper-util's pooled
//! client) or in process ([`InProcessTransport`], the service-side core called directly, for
//! tests and simulations).

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue};
use hyper::{Method, Request, StatusCode, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use tally::device::DeviceId;
use tally::device::error::{DeviceSyncError, RetryReason};
use tally::device::ingest::DeviceSync;
use tally::device::protocol::{ErrorBody, SyncRequest, SyncResponse, codes};

use crate::sync::{SyncTransport, TransportError};

/// How long one HTTP exchange may take unless `--timeout-ms` says otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);
/// The largest answer read; anything larger is treated as a lost answer.
pub const MAX_RESPONSE_BYTES: usize = 64 * 1024;
/// The longest server URL accepted.
pub const MAX_SERVER_URL_LEN: usize = 2048;

/// The sync endpoint's path for `device`.
pub fn sync_path(device: DeviceId) -> String {
    format!("/api/devices/{device}/sync")
}

/// Sends runs to `POST {server}/api/devices/{deviceId}/sync`.
pub struct HttpTransport {
    client: Client<HttpConnector, Full<Bytes>>,
    base: String,
    timeout: Duration,
    /// `Bearer <token>` when the server runs with `--auth jwt`: a token whose `sub` is this
    /// device's id and whose scopes include `devices:sync`.
    authorization: Option<HeaderValue>,
}

/// The most bytes of a token file read (a JWT is well under 2 KiB).
pub const MAX_TOKEN_FILE_BYTES: u64 = 16 * 1024;

impl HttpTransport {
    /// A transport to `server` (`http://host:port[/prefix]`). TLS is not built in.
    pub fn new(server: &str, timeout: Duration) -> Result<Self, String> {
        let bad = |why: &str| format!("--server {server:?}: {why}");
        if server.len() > MAX_SERVER_URL_LEN {
            return Err(bad("URL too long"));
        }
        let uri: Uri = server.parse().map_err(|_| bad("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(bad("scheme must be http:// (no TLS built in)"));
        }
        let authority = uri.authority().ok_or_else(|| bad("missing host"))?;
        if authority.as_str().contains('@') {
            return Err(bad("credentials in the URL are not accepted"));
        }
        if uri.query().is_some() {
            return Err(bad("a query string is not accepted"));
        }
        let mut connector = HttpConnector::new();
        connector.set_connect_timeout(Some(timeout));
        Ok(Self {
            client: Client::builder(TokioExecutor::new()).build(connector),
            base: format!(
                "http://{}{}",
                authority.as_str(),
                uri.path().trim_end_matches('/')
            ),
            timeout,
            authorization: None,
        })
    }

    /// Sends `token` (the contents of `--token-file`, surrounding whitespace ignored) as a
    /// bearer token on every request. The token never appears in an error or a log line.
    pub fn with_token(mut self, token: &str) -> Result<Self, String> {
        let token = token.trim();
        if token.is_empty() {
            return Err("the token file is empty".into());
        }
        let mut value = HeaderValue::from_str(&format!("Bearer {token}"))
            .map_err(|_| "the token file holds characters a header cannot carry".to_string())?;
        value.set_sensitive(true);
        self.authorization = Some(value);
        Ok(self)
    }

    async fn exchange(&self, uri: Uri, body: Bytes) -> Result<(StatusCode, Bytes), String> {
        // Every failure names where it was sent: "connection refused" alone does not say
        // which --server was wrong.
        let target = uri.to_string();
        let request = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        let request = match &self.authorization {
            Some(value) => request.header(AUTHORIZATION, value.clone()),
            None => request,
        }
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
        let work = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| format!("POST {target} failed: {}", with_causes(&e)))?;
            let status = response.status();
            let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| format!("POST {target}: answer lost: {}", with_causes(&*e)))?
                .to_bytes();
            Ok((status, body))
        };
        tokio::time::timeout(self.timeout, work)
            .await
            .unwrap_or_else(|_| {
                Err(format!(
                    "POST {target}: no answer within {} ms",
                    self.timeout.as_millis()
                ))
            })
    }
}

/// An error and its causes, outermost first: hyper's client says only `client error
/// (Connect)`, and the cause says what happened (`Connection refused`).
fn with_causes(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        out.push_str(": ");
        out.push_str(&c.to_string());
        cause = c.source();
    }
    out
}

#[async_trait]
impl SyncTransport for HttpTransport {
    async fn send(
        &self,
        device: DeviceId,
        request: &SyncRequest,
    ) -> Result<SyncResponse, TransportError> {
        let uri: Uri = format!("{}{}", self.base, sync_path(device))
            .parse()
            .map_err(|e| TransportError::Refused {
                code: "BAD_URL".into(),
                detail: format!("{e}"),
            })?;
        let body = serde_json::to_vec(request).map_err(|e| TransportError::Refused {
            code: "UNENCODABLE".into(),
            detail: e.to_string(),
        })?;
        let (status, body) = self
            .exchange(uri, Bytes::from(body))
            .await
            .map_err(|detail| TransportError::Retry {
                in_flight: false,
                detail,
            })?;
        classify_http(status, &body)
    }
}

/// What an HTTP answer means for the run. Only a well-formed 200 syncs it; a refusal of the
/// request itself stops; anything else (409, 429, 5xx, an unreadable 200) resends the same
/// run, which is always safe.
pub fn classify_http(status: StatusCode, body: &[u8]) -> Result<SyncResponse, TransportError> {
    if status == StatusCode::OK {
        return serde_json::from_slice(body).map_err(|e| TransportError::Retry {
            in_flight: false,
            detail: format!("unreadable success answer: {e}"),
        });
    }
    let error: Option<ErrorBody> = serde_json::from_slice(body).ok();
    let (code, message) = match error {
        Some(e) => (e.error, e.message),
        None => (
            String::new(),
            String::from_utf8_lossy(body).chars().take(200).collect(),
        ),
    };
    let detail = format!("HTTP {}: {message}", status.as_u16());
    let refused = code == codes::RUN_STRADDLES_MARK
        || code == codes::RUN_CONFLICTS_WITH_STORE
        || code == codes::RUN_TRIMMED
        || matches!(
            status,
            StatusCode::BAD_REQUEST
                // A missing, expired or refused token, or one for another device: resending
                // cannot fix it; a new token can (the queue is kept).
                | StatusCode::UNAUTHORIZED
                | StatusCode::FORBIDDEN
                | StatusCode::NOT_FOUND
                | StatusCode::METHOD_NOT_ALLOWED
                | StatusCode::PAYLOAD_TOO_LARGE
                | StatusCode::UNSUPPORTED_MEDIA_TYPE
                | StatusCode::UNPROCESSABLE_ENTITY
        );
    if refused {
        let code = if code.is_empty() {
            format!("HTTP_{}", status.as_u16())
        } else {
            code
        };
        return Err(TransportError::Refused { code, detail });
    }
    Err(TransportError::Retry {
        in_flight: code == codes::SYNC_IN_FLIGHT,
        detail,
    })
}

/// Calls the service-side core directly. The call runs as its own task, as a server request
/// does: when `timeout` expires the caller sees a lost answer while the write goes on, so a
/// resend can meet it in flight.
pub struct InProcessTransport {
    core: DeviceSync,
    timeout: Option<Duration>,
    offline: AtomicBool,
}

impl InProcessTransport {
    pub fn new(core: DeviceSync, timeout: Option<Duration>) -> Self {
        Self {
            core,
            timeout,
            offline: AtomicBool::new(false),
        }
    }

    /// While offline, every send fails before reaching the server.
    pub fn set_offline(&self, offline: bool) {
        self.offline.store(offline, Ordering::SeqCst);
    }

    pub fn core(&self) -> &DeviceSync {
        &self.core
    }
}

/// Maps the core's answer as the HTTP route would, so both transports agree.
pub fn classify_core(
    result: Result<SyncResponse, DeviceSyncError>,
) -> Result<SyncResponse, TransportError> {
    match result {
        Ok(answer) => Ok(answer),
        Err(e) if !e.resend_may_help() => Err(TransportError::Refused {
            code: e.code().as_str().into(),
            detail: e.to_string(),
        }),
        Err(e) => Err(TransportError::Retry {
            in_flight: matches!(
                e,
                DeviceSyncError::Retry {
                    reason: RetryReason::InFlight,
                    ..
                }
            ),
            detail: e.to_string(),
        }),
    }
}

#[async_trait]
impl SyncTransport for InProcessTransport {
    async fn send(
        &self,
        device: DeviceId,
        request: &SyncRequest,
    ) -> Result<SyncResponse, TransportError> {
        if self.offline.load(Ordering::SeqCst) {
            return Err(TransportError::Retry {
                in_flight: false,
                detail: "offline: the server is unreachable".into(),
            });
        }
        let core = self.core.clone();
        let device = device.to_string();
        let request = request.clone();
        let call = tokio::spawn(async move { core.handle(&device, &request).await });
        let joined = match self.timeout {
            Some(t) => match tokio::time::timeout(t, call).await {
                Ok(joined) => joined,
                Err(_) => {
                    return Err(TransportError::Retry {
                        in_flight: false,
                        detail: format!("no answer within {} ms", t.as_millis()),
                    });
                }
            },
            None => call.await,
        };
        match joined {
            Ok(result) => classify_core(result),
            Err(e) => Err(TransportError::Retry {
                in_flight: false,
                detail: format!("the server task failed: {e}"),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_http_answers_refuse_only_what_a_resend_cannot_fix() {
        let ok = br#"{"status":"synced","aggregateVersion":3,"lastSeq":2}"#;
        assert!(classify_http(StatusCode::OK, ok).is_ok());
        let refused = |status, body: &[u8]| {
            matches!(
                classify_http(status, body),
                Err(TransportError::Refused { .. })
            )
        };
        assert!(refused(
            StatusCode::UNPROCESSABLE_ENTITY,
            br#"{"error":"BAD_SEQUENCE","message":"x"}"#
        ));
        assert!(refused(StatusCode::NOT_FOUND, b"no route"));
        assert!(refused(
            StatusCode::UNAUTHORIZED,
            br#"{"error":"INVALID_TOKEN","message":"x"}"#
        ));
        assert!(refused(
            StatusCode::FORBIDDEN,
            br#"{"error":"FORBIDDEN","message":"x"}"#
        ));
        assert!(refused(
            StatusCode::INTERNAL_SERVER_ERROR,
            br#"{"error":"DEVICE_RUN_STRADDLES_MARK","message":"x"}"#
        ));
        for status in [
            StatusCode::CONFLICT,
            StatusCode::TOO_MANY_REQUESTS,
            StatusCode::INTERNAL_SERVER_ERROR,
            StatusCode::SERVICE_UNAVAILABLE,
        ] {
            assert!(!refused(status, b"{}"), "{status}");
        }
        // A success answer that cannot be read may still have landed: resend, never mark.
        assert!(matches!(
            classify_http(StatusCode::OK, b"{\"status\":"),
            Err(TransportError::Retry { .. })
        ));
        assert!(matches!(
            classify_http(
                StatusCode::CONFLICT,
                br#"{"error":"SYNC_IN_FLIGHT","message":"x"}"#
            ),
            Err(TransportError::Retry {
                in_flight: true,
                ..
            })
        ));
    }

    #[test]
    fn device_http_transport_accepts_only_plain_http_urls() {
        assert!(HttpTransport::new("http://127.0.0.1:8080/", DEFAULT_TIMEOUT).is_ok());
        assert!(HttpTransport::new("https://example.test", DEFAULT_TIMEOUT).is_err());
        assert!(HttpTransport::new("http://u:p@host", DEFAULT_TIMEOUT).is_err());
        assert!(HttpTransport::new("http://host/?q=1", DEFAULT_TIMEOUT).is_err());
        assert!(HttpTransport::new("not a url", DEFAULT_TIMEOUT).is_err());
    }
}
