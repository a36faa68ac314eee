//! One worker's own HTTP/1 connection to one target, for the measured phase: opened on first
//! use, kept while the server keeps it alive, opened again after the server closes it (a
//! refusal with `Connection: close`) or after a transport error. So `--connections N` is
//! exactly N connections per target whatever the server answers (a shared pool opens extra
//! ones when a request races its own connection's return), and a refusal that closes the
//! connection costs the client a reconnect, as it costs a real client.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::header::{CONNECTION, CONTENT_TYPE, HOST, HeaderValue};
use hyper::{Method, Request};
use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio::time::Instant;

use crate::http::{CONNECT, IDEMPOTENCY_KEY, Outcome, Target, TransportError, chain, read_answer};

/// How long a worker leaves a target alone after it refused a connection (a replica that
/// is down or restarting), rather than spinning on refusals.
pub const TARGET_DOWN_PAUSE: Duration = Duration::from_millis(250);

/// A worker's connection to one target (none open until the first request).
pub struct WorkerConn {
    target: Target,
    sender: Option<SendRequest<Full<Bytes>>>,
    /// Connections opened so far.
    pub connects: u64,
    /// Set when a connection was refused: the target is left alone until then.
    down_until: Option<Instant>,
}

impl WorkerConn {
    pub fn new(target: Target) -> Self {
        WorkerConn {
            target,
            sender: None,
            connects: 0,
            down_until: None,
        }
    }

    /// When the target refused a connection within the last [`TARGET_DOWN_PAUSE`]: until
    /// when it is left alone.
    pub fn down_until(&self, now: Instant) -> Option<Instant> {
        self.down_until.filter(|&until| until > now)
    }

    /// Sends one request and reads the whole answer, connecting first if needed, all within
    /// `timeout`. After a transport error or a `Connection: close` answer the connection is
    /// dropped, and the next request opens a new one.
    pub async fn exchange(
        &mut self,
        method: Method,
        path_and_query: &str,
        idempotency_key: Option<&str>,
        body: Option<Bytes>,
        timeout: Duration,
    ) -> Outcome {
        let outcome = tokio::time::timeout(
            timeout,
            self.exchange_now(method, path_and_query, idempotency_key, body),
        )
        .await
        .unwrap_or_else(|_| {
            Err(TransportError {
                kind: "timeout",
                detail: format!("no complete answer within {} ms", timeout.as_millis()),
            })
        });
        match &outcome {
            Err(e) => {
                self.sender = None;
                if e.kind == CONNECT {
                    self.down_until = Some(Instant::now() + TARGET_DOWN_PAUSE);
                }
            }
            Ok(_) => self.down_until = None,
        }
        outcome
    }

    async fn exchange_now(
        &mut self,
        method: Method,
        path_and_query: &str,
        idempotency_key: Option<&str>,
        body: Option<Bytes>,
    ) -> Outcome {
        let request_error = |detail: String| TransportError {
            kind: "request",
            detail,
        };
        let mut builder = Request::builder()
            .method(method)
            .uri(self.target.origin_form(path_and_query))
            .header(HOST, self.target.authority());
        if let Some(key) = idempotency_key {
            builder = builder.header(IDEMPOTENCY_KEY, key);
        }
        if body.is_some() {
            builder = builder.header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        let request = builder
            .body(Full::new(body.unwrap_or_default()))
            .map_err(|e| request_error(e.to_string()))?;
        let sender = self.ready().await?;
        let response = sender
            .send_request(request)
            .await
            .map_err(|e| request_error(chain(&e)))?;
        let closing = response
            .headers()
            .get(CONNECTION)
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case("close")));
        let answer = read_answer(response).await;
        if closing {
            self.sender = None;
        }
        answer
    }

    /// The open connection, ready for a request; opens one if there is none or it closed.
    async fn ready(&mut self) -> Result<&mut SendRequest<Full<Bytes>>, TransportError> {
        if let Some(sender) = &mut self.sender
            && (sender.is_closed() || sender.ready().await.is_err())
        {
            self.sender = None;
        }
        if self.sender.is_none() {
            let connect_error = |detail: String| TransportError {
                kind: CONNECT,
                detail,
            };
            let stream = TcpStream::connect(self.target.address())
                .await
                .map_err(|e| connect_error(format!("{}: {e}", self.target.address())))?;
            let _ = stream.set_nodelay(true);
            let (sender, connection) = http1::handshake(TokioIo::new(stream))
                .await
                .map_err(|e| connect_error(chain(&e)))?;
            // Drives the connection until either side closes it.
            tokio::spawn(async move {
                let _ = connection.await;
            });
            self.connects += 1;
            self.sender = Some(sender);
        }
        self.sender.as_mut().ok_or_else(|| TransportError {
            kind: CONNECT,
            detail: "no connection".into(),
        })
    }
}
