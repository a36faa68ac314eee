//! The production backend: [`EventLog`] over a Celeriant cluster, through the
//! `celeriant_client_tokio` 0.2 connection pool.
//!
//! Every client-library type stays inside this module; the rest of Tally sees only the port.
//!
//! How the port maps onto the server (each point checked against a real server):
//! - outcomes: `map_error` sorts every client error into the port's classes. A write that
//!   was sent and got no readable answer is `OutcomeUnknown`; anything refused before it was
//!   sent is `NotApplied`. Reads are safe to repeat, so a read that lost its reply is retried
//!   a bounded number of times before it fails as `NotApplied`;
//! - client-sequence filters: the server drops the *events* of a batch that fall outside
//!   `min_client_seq`/`max_client_seq`, where the port keeps or drops whole batches. Those two
//!   filters are therefore applied here, not sent;
//! - `min_server_timestamp_ms` is inclusive on the server (the client crate's doc comment says
//!   exclusive; the server code and a live test say inclusive), so it is passed through as is;
//! - pagination: a page covers at most [`READ_PAGE_MAX_VERSIONS`] versions, and the server's
//!   own byte-bounded cursor is honoured inside that window;
//! - multi-aggregate rejections: the server runs all checks on one aggregate before the next,
//!   in hash order, so a write failing on two legs for different reasons gets either error.
//!   The adapter restates such a rejection in the port's order (see `in_port_order`);
//! - an empty write is refused here with code 2000 (a sharded server would answer 9002);
//! - server timestamps are taken as epoch milliseconds, which is the server's default
//!   (`--timestamp-precision milliseconds`, epoch offset 0). Other settings are unsupported.
//!
//! Where the server still differs from the port's documented semantics (passed through):
//! - `trim_start` past the tip is refused even by one (`keep_from > max_version` is 3004,
//!   `Other`): the newest batch can never be trimmed;
//! - `client_seq` 0 is the server's "no sequence" sentinel: an enforced write whose lowest
//!   sequence is 0 is accepted while the durable high-water mark is 0;
//! - when several legs of one write violate idempotency, which leg's sequences the 2002
//!   reports is arbitrary;
//! - a multi-aggregate write must stay on one shard (9001 `CrossShard`); with the default
//!   `--routing-rule aggregate_id` two accounts usually sit on different shards.
//!
//! The module's files: this one (the adapter: the [`EventLog`] impl and its outcome
//! handling), `config` (how to reach the cluster), `watch` (the commit feed), `wire`
//! (translation and pagination),
//! `classify` (the error-code tables) and `check_order` (the port's order for multi-aggregate
//! rejections).

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::time::Duration;

use async_trait::async_trait;
use celeriant_client_tokio::{CeleriantPool, ClientError};
use celeriant_msg::error_codes as codes;
use celeriant_msg::request::requests::{
    AggregateDetailsRequest, ReadRequest, SingleAggregateWrite, TrimStartRequest, WriteRequest,
};
use tokio::time::Instant;

use super::{
    AggregateDetails, AggregateKey, AggregateWrite, ClientId, EventLog, ReadFilter, ReadPage,
    StoreError, StoreResult, WatchFeed, WatchFilter,
};

mod check_order;
mod classify;
mod config;
mod watch;
mod wire;

use check_order::{AggregateGuard, Observed, order_sensitive, port_order};
pub use classify::LOCAL_ERROR_CODE;
use classify::read_worth_retrying;
pub(crate) use classify::{Op, map_error};
pub use config::{
    ApiKey, CeleriantConfig, CeleriantConfigError, MAX_POOL_SIZE, MAX_REQUEST_BYTES, MAX_SEEDS,
    MAX_TIMEOUT_MS,
};
pub use wire::READ_PAGE_MAX_VERSIONS;
use wire::{
    estimated_request_bytes, next_after, port_batch, server_filters, window, wire_event, wire_key,
};

/// Most attempts for one read whose reply was lost (the first try included).
pub const READ_MAX_ATTEMPTS: u32 = 3;

/// Pause before retry `n` of a read is `n` times this.
const READ_RETRY_BACKOFF: Duration = Duration::from_millis(25);

/// A read's retries must start within this many request timeouts of its first attempt.
const READ_RETRY_DEADLINE_FACTOR: u32 = 2;

/// Client id stamped on trim requests; the port's `trim_start` names no writer, and the
/// server records it only as metadata.
const TRIM_CLIENT_ID: u128 = 0;

/// The key `ping` asks about. It never has to exist: "not found" proves the server answered.
const PING_KEY: AggregateKey = AggregateKey {
    org_id: 0,
    aggregate_type_id: 0,
    aggregate_id: 0,
};

/// [`EventLog`] over a Celeriant cluster. Cheap to share behind an `Arc`.
pub struct CeleriantLog {
    pool: CeleriantPool,
    read_retry_window: Duration,
}

impl fmt::Debug for CeleriantLog {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The pool's options hold the API key: never print them.
        f.debug_struct("CeleriantLog")
            .field("address", &self.pool.options().address)
            .field("seeds", &self.pool.options().seed_addresses)
            .finish_non_exhaustive()
    }
}

impl CeleriantLog {
    /// Validates `cfg`, loads the TLS files and builds the connection pool. Nodes are dialled
    /// lazily on first use, so this does not fail when the cluster is down; use
    /// [`EventLog::ping`] to check that it answers.
    pub fn connect(cfg: &CeleriantConfig) -> Result<Self, CeleriantConfigError> {
        cfg.validate()?;
        let options = cfg.pool_options()?;
        Ok(Self {
            pool: CeleriantPool::new(options),
            read_retry_window: cfg.request_timeout() * READ_RETRY_DEADLINE_FACTOR,
        })
    }

    /// Runs a call that is safe to repeat, retrying a lost reply a bounded number of times.
    async fn repeatable<T, F, Fut>(&self, op: Op, mut call: F) -> StoreResult<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, ClientError>>,
    {
        let deadline = Instant::now() + self.read_retry_window;
        let mut attempt = 1;
        loop {
            match call().await {
                Ok(value) => return Ok(value),
                Err(e) => {
                    let backoff = READ_RETRY_BACKOFF * attempt;
                    let retry = read_worth_retrying(&e)
                        && attempt < READ_MAX_ATTEMPTS
                        && Instant::now() + backoff < deadline;
                    if !retry {
                        return Err(map_error(op, e));
                    }
                    tracing::debug!(attempt, error = %e, "retrying a Celeriant read");
                    tokio::time::sleep(backoff).await;
                    attempt += 1;
                }
            }
        }
    }

    async fn details_as(&self, op: Op, key: AggregateKey) -> StoreResult<AggregateDetails> {
        let request = AggregateDetailsRequest {
            correlation_id: None,
            aggregate_key: wire_key(key),
        };
        let response = self
            .repeatable(op, || self.pool.aggregate_details(request.clone()))
            .await?;
        if response.is_deleted {
            return Err(StoreError::AggregateNotFound);
        }
        Ok(AggregateDetails {
            min_available_version: response.min_aggregate_version.max(1),
            max_version: response.max_aggregate_version,
            last_server_timestamp_ms: response.last_server_timestamp,
        })
    }

    /// The versions a committed multi-aggregate write produced, in input order. With an
    /// expected version the new version is `expected + 1`; without one it is read back from
    /// the aggregate's details, which can name a later version if another write landed in
    /// between. A failed look-up is `OutcomeUnknown`, since the write itself did commit.
    async fn committed_versions(&self, legs: &[AggregateGuard]) -> StoreResult<Vec<u64>> {
        let mut versions = Vec::with_capacity(legs.len());
        for leg in legs {
            let version = match leg.expected {
                Some(v) => v.saturating_add(1),
                None => match self.details_as(Op::Details, leg.key).await {
                    Ok(d) => d.max_version,
                    Err(e) => {
                        return Err(StoreError::OutcomeUnknown {
                            reason: format!(
                                "write committed but its version could not be read: {e}"
                            ),
                        });
                    }
                },
            };
            versions.push(version);
        }
        Ok(versions)
    }

    /// Restates a multi-aggregate rejection in the port's check order.
    ///
    /// The server runs every check on one aggregate before it moves to the next, visiting
    /// them in hash order, so a write with a missing leg and a stale leg can come back as
    /// either error, and one with a stale leg and a duplicate sequence as either 2003 or 2002.
    /// The port checks existence on every leg, then every version guard, then idempotency.
    /// Nothing was appended, so this reads each leg's current version and answers as the port
    /// would. Versions only grow and aggregates are never deleted here, so a leg found missing
    /// or stale now was so when the server checked, or is stale for any retry. A failed
    /// look-up keeps the server's answer.
    async fn in_port_order(&self, legs: &[AggregateGuard], server: StoreError) -> StoreError {
        let mut observed = Vec::with_capacity(legs.len());
        for leg in legs {
            let current = if leg.allow_create && leg.expected.is_none() {
                // Neither check can fail on this leg.
                Observed::Skipped
            } else {
                match self.details_as(Op::Details, leg.key).await {
                    Ok(d) => Observed::At(d.max_version),
                    Err(StoreError::AggregateNotFound) => Observed::Missing,
                    Err(_) => return server,
                }
            };
            observed.push(current);
        }
        port_order(legs, &observed, server)
    }
}

/// Whether a refused multi-aggregate write is restated in the port's check order.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Restate {
    InPortOrder,
    AsTheServerSaid,
}

impl CeleriantLog {
    /// One `WriteRequest` carrying one `SingleAggregateWrite` per aggregate. An aggregate may
    /// appear once per write.
    async fn send_write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
        restate: Restate,
    ) -> StoreResult<Vec<u64>> {
        let estimate = estimated_request_bytes(&writes);
        if estimate as u64 > MAX_REQUEST_BYTES {
            return Err(StoreError::Other {
                code: LOCAL_ERROR_CODE,
                message: format!(
                    "write of about {estimate} bytes exceeds the {MAX_REQUEST_BYTES}-byte request limit"
                ),
            });
        }
        if writes.is_empty() {
            // A sharded server calls this a routing error (9002), a single shard 2000.
            return Err(StoreError::Other {
                code: codes::WRITE_EMPTY_EVENTS_LIST,
                message: "a write must name at least one aggregate".into(),
            });
        }
        let mut legs = Vec::with_capacity(writes.len());
        let mut request = HashMap::with_capacity(writes.len());
        for w in writes {
            legs.push(AggregateGuard {
                key: w.key,
                expected: w.expected_version,
                allow_create: w.allow_create,
            });
            let single = SingleAggregateWrite {
                events: w.events.into_iter().map(wire_event).collect(),
                allow_create: w.allow_create,
                expected_version: w.expected_version,
                enforce_client_idempotency: w.enforce_client_idempotency,
            };
            if request.insert(wire_key(w.key), single).is_some() {
                return Err(StoreError::Other {
                    code: LOCAL_ERROR_CODE,
                    message: format!("aggregate {:?} appears twice in one write", w.key),
                });
            }
        }
        let sent = self
            .pool
            .write(WriteRequest {
                correlation_id: None,
                client_id,
                user_id: None,
                writes: request,
            })
            .await;
        let response = match sent {
            Ok(response) => response,
            Err(e) => {
                let e = map_error(Op::Write, e);
                if restate == Restate::InPortOrder && legs.len() > 1 && order_sensitive(&e) {
                    return Err(self.in_port_order(&legs, e).await);
                }
                return Err(e);
            }
        };
        match (legs.as_slice(), response.max_aggregate_version) {
            ([_], Some(version)) => Ok(vec![version]),
            _ => self.committed_versions(&legs).await,
        }
    }
}

#[async_trait]
impl EventLog for CeleriantLog {
    async fn write(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        self.send_write(client_id, writes, Restate::InPortOrder)
            .await
    }

    /// A combined write's caller sends each member again alone on a refusal: restating the
    /// refusal would cost a read per member for an answer nobody uses.
    async fn write_combined(
        &self,
        client_id: ClientId,
        writes: Vec<AggregateWrite>,
    ) -> StoreResult<Vec<u64>> {
        self.send_write(client_id, writes, Restate::AsTheServerSaid)
            .await
    }

    async fn read(&self, key: AggregateKey, filter: &ReadFilter) -> StoreResult<ReadPage> {
        let w = window(filter);
        let request = ReadRequest {
            correlation_id: None,
            aggregate_key: wire_key(key),
            filters: server_filters(w),
        };
        let response = self
            .repeatable(Op::Read, || self.pool.read(request.clone()))
            .await?;
        let last_returned = response.event_batches.last().map(|b| b.aggregate_version);
        let next = next_after(w, response.next_aggregate_version, last_returned);
        let batches = response
            .event_batches
            .into_iter()
            .map(port_batch)
            .filter(|b| filter.admits(b))
            .collect();
        Ok(ReadPage {
            batches,
            next_version: next,
        })
    }

    async fn details(&self, key: AggregateKey) -> StoreResult<AggregateDetails> {
        self.details_as(Op::Details, key).await
    }

    async fn trim_start(&self, key: AggregateKey, keep_from_version: u64) -> StoreResult<()> {
        self.pool
            .trim_start(TrimStartRequest {
                correlation_id: None,
                aggregate_key: wire_key(key),
                keep_from_aggregate_version: keep_from_version,
                client_id: TRIM_CLIENT_ID,
                user_id: None,
            })
            .await
            .map(|_| ())
            .map_err(|e| map_error(Op::Trim, e))
    }

    /// Asks for the details of a key that need not exist: any answer from the server,
    /// "not found" included, proves it is up.
    async fn ping(&self) -> StoreResult<()> {
        match self.details_as(Op::Ping, PING_KEY).await {
            Ok(_) | Err(StoreError::AggregateNotFound) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn watch(&self, filter: WatchFilter) -> StoreResult<Box<dyn WatchFeed>> {
        self.open_watch(filter).await
    }
}

#[cfg(test)]
mod tests;
