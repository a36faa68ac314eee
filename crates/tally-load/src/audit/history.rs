//! Reading the accounts' histories back: every page of every touched account, from any
//! target that answers, keeping only the events written under this run's keys.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use hyper::Method;
use serde::Deserialize;
use tokio::task::JoinSet;
use tokio::time::Instant;
use uuid::Uuid;

use crate::cli::Config;
use crate::http::{Answer, Client, Target, exchange};
use crate::workload::quote;

/// Events asked for per history page.
pub const HISTORY_PAGE_LIMIT: u32 = 500;
/// Most pages read per account before the read is declared runaway.
pub const MAX_HISTORY_PAGES: u32 = 10_000;
/// Attempts per history page on a retryable answer (409, 503, 5xx, no answer); each retry
/// goes to the next target, so a replica that is down does not leave the run unverified.
/// Enough that a replica answering 503 to a third of its reads (`--faults read-lag=0.3`)
/// leaves no page of thousands of accounts unread (5 did not).
pub const HISTORY_MAX_ATTEMPTS: u32 = 20;
/// Pause between history attempts, multiplied by the attempt number up to
/// [`HISTORY_BACKOFF_STEPS`]: at most about 20 s on one page.
pub const HISTORY_BACKOFF: Duration = Duration::from_millis(100);
pub const HISTORY_BACKOFF_STEPS: u32 = 20;
/// Most accounts read at once.
pub const READ_CONCURRENCY: usize = 32;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct HistoryPage {
    events: Vec<HistoryEvent>,
    next_from_version: Option<u64>,
}

/// One history event as the API returns it (fields the audit needs; lenient so that an
/// unfamiliar event type does not stop the read).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HistoryEvent {
    pub aggregate_version: u64,
    #[serde(rename = "type", default)]
    pub kind: String,
    #[serde(default)]
    pub amount_cents: i64,
    #[serde(default)]
    pub to_account_id: Option<String>,
    #[serde(default)]
    pub from_account_id: Option<String>,
    #[serde(default)]
    pub event_id: Option<String>,
}

impl HistoryEvent {
    /// The idempotency key this event was written under, when it names one as a UUID.
    pub(super) fn key(&self) -> Option<Uuid> {
        self.event_id
            .as_deref()
            .and_then(|id| Uuid::parse_str(id).ok())
    }

    /// The other account of a transfer leg, when given.
    pub(super) fn counterparty(&self) -> Option<Uuid> {
        self.to_account_id
            .as_deref()
            .or(self.from_account_id.as_deref())
            .and_then(|id| Uuid::parse_str(id).ok())
    }
}

/// One account's history as read: only the events written under this run's keys are kept,
/// so long-lived accounts do not fill memory.
#[derive(Debug, Clone, Default)]
pub struct StreamRead {
    pub ours: Vec<HistoryEvent>,
    /// Every event in the stream, ours or not.
    pub total: u64,
}

/// Account streams read so far.
pub type Streams = HashMap<Uuid, StreamRead>;

/// Reads `accounts` concurrently, rotating targets by `round`; returns what was read and the
/// first error.
pub(super) async fn read_streams(
    config: &Config,
    client: &Client,
    keys: &Arc<HashSet<Uuid>>,
    accounts: Vec<Uuid>,
    round: usize,
    deadline: Instant,
) -> (Streams, Option<String>) {
    let accounts = Arc::new(accounts);
    let next = Arc::new(AtomicUsize::new(0));
    let workers = READ_CONCURRENCY
        .min(config.connections)
        .min(accounts.len())
        .max(1);
    let mut tasks = JoinSet::new();
    for _ in 0..workers {
        let (accounts, next, keys) = (accounts.clone(), next.clone(), keys.clone());
        let (targets, client, timeout) = (config.targets.clone(), client.clone(), config.timeout);
        tasks.spawn(async move {
            let mut read = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&account) = accounts.get(i) else {
                    return (read, None);
                };
                let first = (i + round) % targets.len();
                let result = tokio::time::timeout_at(
                    deadline,
                    read_stream(&client, (&targets, first), account, &keys, timeout),
                )
                .await
                .unwrap_or_else(|_| Err("verification deadline reached".to_string()));
                match result {
                    Ok(events) => read.push((account, events)),
                    Err(e) => return (read, Some(e)),
                }
            }
        });
    }
    let mut streams = Streams::new();
    let mut first_error = None;
    while let Some(joined) = tasks.join_next().await {
        let (read, error) = joined.unwrap_or_else(|e| (Vec::new(), Some(e.to_string())));
        streams.extend(read);
        first_error = first_error.or(error);
    }
    (streams, first_error)
}

/// One account's whole history, following `nextFromVersion` until it is absent; read from
/// `targets` starting at the given index, each page from the target that answered the last.
async fn read_stream(
    client: &Client,
    (targets, mut first): (&[Target], usize),
    account: Uuid,
    keys: &HashSet<Uuid>,
    timeout: Duration,
) -> Result<StreamRead, String> {
    let mut from = 0u64;
    let mut read = StreamRead::default();
    for _ in 0..MAX_HISTORY_PAGES {
        let path = format!(
            "/api/accounts/{account}/history?fromVersion={from}&limit={HISTORY_PAGE_LIMIT}"
        );
        let (answer, answered) = get_with_retries(client, (targets, first), &path, timeout).await?;
        first = answered;
        let page: HistoryPage = serde_json::from_slice(&answer.body).map_err(|e| {
            format!(
                "history of {account}: unexpected body ({e}): {}",
                quote(&answer.body)
            )
        })?;
        for event in page.events {
            // Pages start at `from`; anything below it was on an earlier page.
            if event.aggregate_version < from {
                continue;
            }
            read.total += 1;
            if event.key().is_some_and(|k| keys.contains(&k)) {
                read.ours.push(event);
            }
        }
        match page.next_from_version {
            None => return Ok(read),
            Some(next) if next > from => from = next,
            Some(next) => {
                return Err(format!(
                    "history of {account}: cursor did not advance ({from} -> {next})"
                ));
            }
        }
    }
    Err(format!(
        "history of {account}: more than {MAX_HISTORY_PAGES} pages"
    ))
}

/// GETs `path`, from `targets` starting at the given index and moving on to the next
/// target after each retryable answer; returns the answer and the index of the target that
/// gave it.
async fn get_with_retries(
    client: &Client,
    (targets, first): (&[Target], usize),
    path: &str,
    timeout: Duration,
) -> Result<(Answer, usize), String> {
    let mut last = String::new();
    for attempt in 1..=HISTORY_MAX_ATTEMPTS {
        let index = (first + attempt as usize - 1) % targets.len();
        let uri = targets[index].uri(path)?;
        match exchange(client, Method::GET, uri, None, None, timeout).await {
            Ok(a) if (200..300).contains(&a.status) => return Ok((a, index)),
            Ok(a) if a.status == 409 || a.status >= 500 => {
                last = format!("status {}: {}", a.status, quote(&a.body));
            }
            Ok(a) => {
                return Err(format!(
                    "GET {path}: status {}: {}",
                    a.status,
                    quote(&a.body)
                ));
            }
            Err(e) => last = format!("{}: {}", e.kind, e.detail),
        }
        tokio::time::sleep(HISTORY_BACKOFF * attempt.min(HISTORY_BACKOFF_STEPS)).await;
    }
    Err(format!(
        "GET {path}: gave up after {HISTORY_MAX_ATTEMPTS} attempts ({last})"
    ))
}
