//! The client: one pooled HTTP/1 connection set to one base URL, and the calls, each run
//! through [`Client::call`], the one retry loop.

use std::marker::PhantomData;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HeaderValue, RETRY_AFTER};
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::Client as Pool;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use uuid::Uuid;

use crate::policy::{Meaning, RetryPolicy, meaning};
use crate::types::{AmountBody, OpenBody, TransferBody};
use crate::{
    AmountCents, ApiError, Balance, Error, Failure, History, IdempotencyKey, Opened, Transferred,
    Written,
};

/// Largest answer body read (a full history page is far below it).
pub const MAX_ANSWER_BYTES: usize = 4 * 1024 * 1024;
/// Idle connections kept per host.
const MAX_IDLE_PER_HOST: usize = 32;
const IDEMPOTENCY_KEY: &str = "idempotency-key";
const IDEMPOTENT_REPLAYED: &str = "idempotent-replayed";
const IDEMPOTENCY_WINDOW: &str = "idempotency-window";

/// A Tally client for one base URL (a replica, or the fleet's balancer). Cheap to clone: the
/// clones share one connection pool.
#[derive(Clone, Debug)]
pub struct Client {
    pool: Pool<HttpConnector, Full<Bytes>>,
    /// `http://authority/prefix`, without a trailing slash.
    base: String,
    policy: RetryPolicy,
    token: Option<HeaderValue>,
}

/// Options for a [`Client`].
#[derive(Debug)]
pub struct ClientBuilder {
    base: String,
    policy: RetryPolicy,
    token: Option<String>,
}

impl ClientBuilder {
    /// The bounds of every call (attempts, total time, per-attempt timeout, backoff).
    pub fn policy(mut self, policy: RetryPolicy) -> Self {
        self.policy = policy;
        self
    }

    /// A bearer token sent with every request (replicas run with `--auth jwt`).
    pub fn bearer_token(mut self, token: impl Into<String>) -> Self {
        self.token = Some(token.into());
        self
    }

    pub fn build(self) -> Result<Client, Error> {
        self.policy.check().map_err(Error::InvalidPolicy)?;
        let invalid = |why| Error::InvalidUrl {
            url: self.base.clone(),
            why,
        };
        let uri: Uri = self.base.parse().map_err(|_| invalid("not a URL"))?;
        if uri.scheme_str() != Some("http") {
            return Err(invalid("the scheme must be http:// (no TLS built in)"));
        }
        let authority = uri.authority().ok_or_else(|| invalid("no host"))?;
        if uri.query().is_some() {
            return Err(invalid("a query string is not accepted"));
        }
        let token = match &self.token {
            Some(t) => Some(
                HeaderValue::from_str(&format!("Bearer {t}"))
                    .map_err(|_| invalid("the token is not a header value"))?,
            ),
            None => None,
        };
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        connector.set_connect_timeout(Some(self.policy.attempt_timeout));
        Ok(Client {
            pool: Pool::builder(TokioExecutor::new())
                .pool_max_idle_per_host(MAX_IDLE_PER_HOST)
                .build(connector),
            base: format!("http://{authority}{}", uri.path().trim_end_matches('/')),
            policy: self.policy,
            token,
        })
    }
}

/// One answer, read whole.
pub(crate) struct Answer {
    pub(crate) status: u16,
    pub(crate) replayed: bool,
    pub(crate) retry_after: Option<Duration>,
    pub(crate) window: Option<Duration>,
    pub(crate) body: Bytes,
}

/// Whether any attempt of a call may have reached the server: only then can a write have
/// landed although the call ends without an answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reach {
    /// Every attempt so far failed to open its connection.
    Nothing,
    /// At least one request may have been sent (and may have landed).
    Maybe,
}

/// A request as every attempt sends it.
pub(crate) struct Call<'a> {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) body: Option<Bytes>,
    pub(crate) key: Option<&'a IdempotencyKey>,
}

impl Client {
    /// A client for `base_url` (`http://host:port`, optionally with a path prefix) with the
    /// default [`RetryPolicy`].
    pub fn new(base_url: &str) -> Result<Client, Error> {
        Client::builder(base_url).build()
    }

    pub fn builder(base_url: &str) -> ClientBuilder {
        ClientBuilder {
            base: base_url.to_string(),
            policy: RetryPolicy::default(),
            token: None,
        }
    }

    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// `POST /api/accounts/{account}/deposit`.
    pub fn deposit(&self, account: Uuid, amount_cents: AmountCents) -> WriteCall<'_, Balance> {
        let path = format!("/api/accounts/{account}/deposit");
        self.write(path, &AmountBody { amount_cents })
    }

    /// `POST /api/accounts/{account}/withdraw`.
    pub fn withdraw(&self, account: Uuid, amount_cents: AmountCents) -> WriteCall<'_, Balance> {
        let path = format!("/api/accounts/{account}/withdraw");
        self.write(path, &AmountBody { amount_cents })
    }

    /// `POST /api/transfers`: both legs in one write.
    pub fn transfer(
        &self,
        from: Uuid,
        to: Uuid,
        amount_cents: AmountCents,
    ) -> WriteCall<'_, Transferred> {
        let body = TransferBody {
            from_account_id: from,
            to_account_id: to,
            amount_cents,
        };
        self.write("/api/transfers".into(), &body)
    }

    /// `POST /api/accounts`: opens `account`, or (`None`) the account the key names.
    pub fn open(&self, account: Option<Uuid>) -> WriteCall<'_, Opened> {
        let body = OpenBody {
            account_id: account,
        };
        self.write("/api/accounts".into(), &body)
    }

    /// `GET /api/accounts/{account}/balance`; with `min_version`, only once this replica
    /// sees the account at that version (read-your-writes on any replica).
    pub async fn balance(&self, account: Uuid, min_version: Option<u64>) -> Result<Balance, Error> {
        let query = min_version.map_or(String::new(), |v| format!("?minVersion={v}"));
        self.read(format!("/api/accounts/{account}/balance{query}"))
            .await
    }

    /// One page of `GET /api/accounts/{account}/history`; follow `next_from_version`.
    pub async fn history(
        &self,
        account: Uuid,
        from_version: Option<u64>,
        limit: Option<u32>,
    ) -> Result<History, Error> {
        let mut query = Vec::new();
        query.extend(from_version.map(|v| format!("fromVersion={v}")));
        query.extend(limit.map(|n| format!("limit={n}")));
        let query = if query.is_empty() {
            String::new()
        } else {
            format!("?{}", query.join("&"))
        };
        self.read(format!("/api/accounts/{account}/history{query}"))
            .await
    }

    fn write<T>(&self, path: String, body: &impl serde::Serialize) -> WriteCall<'_, T> {
        WriteCall {
            client: self,
            path,
            // Serialising these plain structs cannot fail.
            body: Bytes::from(serde_json::to_vec(body).unwrap_or_default()),
            key: None,
            answer: PhantomData,
        }
    }

    async fn read<T: DeserializeOwned>(&self, path_and_query: String) -> Result<T, Error> {
        let call = Call {
            method: Method::GET,
            uri: self.uri(&path_and_query)?,
            body: None,
            key: None,
        };
        let (answer, _) = self.call(&call).await?;
        decode(&answer)
    }

    pub(crate) fn uri(&self, path_and_query: &str) -> Result<Uri, Error> {
        format!("{}{path_and_query}", self.base)
            .parse()
            .map_err(|_| Error::InvalidUrl {
                url: self.base.clone(),
                why: "a request URI did not parse",
            })
    }

    /// The retry loop: sends `call` until an answer is a success or final, or the contract
    /// forbids another attempt. Every attempt of a write carries the same key.
    async fn call(&self, call: &Call<'_>) -> Result<(Answer, u32), Error> {
        let started = Instant::now();
        // The latest time a resend of the key is known safe, from the `Idempotency-Window`
        // of the answers so far (each speaks from its own arrival).
        let mut resend_by: Option<Instant> = None;
        let mut reach = Reach::Nothing;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let budget = self.policy.total.saturating_sub(started.elapsed());
            let failure = match self
                .attempt(call, self.policy.attempt_timeout.min(budget))
                .await
            {
                Ok(answer) => {
                    let error =
                        (!(200..300).contains(&answer.status)).then(|| api_error(&answer.body));
                    match meaning(answer.status, error.as_ref()) {
                        Meaning::Success => return Ok((answer, attempt)),
                        Meaning::Final => {
                            return Err(Error::Refused {
                                status: answer.status,
                                error: error.unwrap_or_else(|| api_error(&answer.body)),
                                key: call.key.cloned(),
                            });
                        }
                        Meaning::Retry => {
                            if let Some(window) = answer.window {
                                let by = Instant::now() + window;
                                resend_by = Some(resend_by.map_or(by, |b| b.min(by)));
                            }
                            Failure::Answer {
                                status: answer.status,
                                error: error.map(Box::new),
                                retry_after: answer.retry_after,
                            }
                        }
                    }
                }
                Err(failure) => failure,
            };
            if !matches!(failure, Failure::Connect(_)) {
                reach = Reach::Maybe;
            }
            let due = Instant::now() + self.wait_after(attempt, &failure);
            self.may_resend(call, attempt, started, due, resend_by, reach, failure)?;
            tokio::time::sleep_until(due).await;
        }
    }

    /// The wait before the next attempt: the backoff, or the server's `Retry-After` when it
    /// asks for longer, plus a random share of the backoff, so that callers the server shed
    /// together (all told the same `Retry-After`) do not all come back at the same instant.
    fn wait_after(&self, attempt: u32, failure: &Failure) -> Duration {
        let asked = match failure {
            Failure::Answer { retry_after, .. } => *retry_after,
            _ => None,
        };
        self.wait_before_retry(attempt, asked)
    }

    /// The wait after attempt `attempt` when the server asked for `asked` (`Retry-After`):
    /// the longer of that and the backoff, plus the jitter.
    pub(crate) fn wait_before_retry(&self, attempt: u32, asked: Option<Duration>) -> Duration {
        let backoff = self.policy.backoff_after(attempt);
        let base = asked.map_or(backoff, |asked| backoff.max(asked));
        // A UUIDv4 is 122 random bits from the OS: enough for a jitter, without a crate.
        let draw = Uuid::new_v4().as_u64_pair().1 % 1024;
        base + backoff.mul_f64(draw as f64 / 1024.0)
    }

    /// Whether an attempt may be sent at `due`: within the key's window, the attempts and
    /// the total time.
    #[allow(clippy::too_many_arguments)]
    fn may_resend(
        &self,
        call: &Call<'_>,
        attempt: u32,
        started: Instant,
        due: Instant,
        resend_by: Option<Instant>,
        reach: Reach,
        last: Failure,
    ) -> Result<(), Error> {
        if let (Some(key), Some(by)) = (call.key, resend_by)
            && due >= by
        {
            return Err(Error::WindowClosed {
                key: key.clone(),
                attempts: attempt,
                last,
            });
        }
        if attempt >= self.policy.max_attempts || due - started >= self.policy.total {
            if reach == Reach::Nothing {
                return Err(Error::Unreachable {
                    key: call.key.cloned(),
                    attempts: attempt,
                    elapsed: started.elapsed(),
                    last,
                });
            }
            return Err(Error::Exhausted {
                key: call.key.cloned(),
                attempts: attempt,
                elapsed: started.elapsed(),
                last,
            });
        }
        Ok(())
    }

    /// One request and its whole answer within `limit`.
    pub(crate) async fn attempt(
        &self,
        call: &Call<'_>,
        limit: Duration,
    ) -> Result<Answer, Failure> {
        let mut request = Request::builder()
            .method(call.method.clone())
            .uri(call.uri.clone());
        if let Some(key) = call.key {
            request = request.header(IDEMPOTENCY_KEY, key.as_str());
        }
        if call.body.is_some() {
            request = request.header(CONTENT_TYPE, HeaderValue::from_static("application/json"));
        }
        if let Some(token) = &self.token {
            request = request.header(AUTHORIZATION, token.clone());
        }
        let request = request
            .body(Full::new(call.body.clone().unwrap_or_default()))
            .map_err(|e| Failure::Connection(format!("request: {e}")))?;
        let exchange = async {
            let response = self.pool.request(request).await.map_err(|e| {
                // A connection that never opened carried no request.
                if e.is_connect() {
                    Failure::Connect(chain(&e))
                } else {
                    Failure::Connection(chain(&e))
                }
            })?;
            read_answer(response).await
        };
        tokio::time::timeout(limit, exchange)
            .await
            .unwrap_or(Err(Failure::Timeout(limit)))
    }
}

/// A write about to be sent: give it a key with [`WriteCall::key`], or one is minted.
#[must_use = "a write is sent by .send().await"]
pub struct WriteCall<'a, T> {
    client: &'a Client,
    path: String,
    body: Bytes,
    key: Option<IdempotencyKey>,
    answer: PhantomData<T>,
}

impl<T: DeserializeOwned> WriteCall<'_, T> {
    /// The key for this intent. Send your own when the call may be repeated after this
    /// process gives up (a crash, a timeout of your own): the same key lands the write once.
    pub fn key(mut self, key: IdempotencyKey) -> Self {
        self.key = Some(key);
        self
    }

    /// Sends the write, retrying under its one key as the contract allows.
    pub async fn send(self) -> Result<Written<T>, Error> {
        let key = self.key.unwrap_or_else(IdempotencyKey::mint);
        let call = Call {
            method: Method::POST,
            uri: self.client.uri(&self.path)?,
            body: Some(self.body),
            key: Some(&key),
        };
        let (answer, attempts) = self.client.call(&call).await?;
        Ok(Written {
            value: decode(&answer)?,
            replayed: answer.replayed,
            attempts,
            key,
        })
    }
}

pub(crate) fn decode<T: DeserializeOwned>(answer: &Answer) -> Result<T, Error> {
    serde_json::from_slice(&answer.body).map_err(|e| Error::Decode {
        status: answer.status,
        detail: e.to_string(),
    })
}

/// Tally's error body, or (from something else on the way, a proxy say) the text as message.
pub(crate) fn api_error(body: &[u8]) -> ApiError {
    serde_json::from_slice(body).unwrap_or_else(|_| ApiError {
        code: String::new(),
        message: String::from_utf8_lossy(&body[..body.len().min(200)]).into_owned(),
        error_id: None,
    })
}

async fn read_answer(response: hyper::Response<hyper::body::Incoming>) -> Result<Answer, Failure> {
    let headers = response.headers();
    let text = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };
    let seconds = |name| {
        text(name)
            .and_then(|v| v.trim().parse::<u64>().ok())
            .map(Duration::from_secs)
    };
    let status = response.status().as_u16();
    let replayed = text(IDEMPOTENT_REPLAYED).is_some_and(|v| v.trim() == "true");
    let (retry_after, window) = (seconds(RETRY_AFTER.as_str()), seconds(IDEMPOTENCY_WINDOW));
    let body = Limited::new(response.into_body(), MAX_ANSWER_BYTES)
        .collect()
        .await
        .map_err(|e| Failure::Connection(format!("answer body: {}", chain(&*e))))?
        .to_bytes();
    Ok(Answer {
        status,
        replayed,
        retry_after,
        window,
        body,
    })
}

/// An error and its sources, joined with `: `.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
