//! The per-scenario mix of operations, and the setup phase (account choice and pre-funding).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use hyper::Method;
use serde::Deserialize;
use tokio::task::JoinSet;
use uuid::Uuid;

use crate::LoadError;
use crate::cli::{Config, Scenario};
use crate::http::{Client, Target, exchange};
use crate::ledger::KeyRecord;
use crate::op::{Op, OpKind};
use crate::rng::Rng;

/// Accounts the hot scenario writes to.
pub const HOT_ACCOUNTS: usize = 3;
/// Mixed scenario: share of deposits, in percent.
pub const MIXED_DEPOSIT_PERCENT: u64 = 50;
/// Mixed scenario: share of withdrawals, in percent (the rest are transfers).
pub const MIXED_WITHDRAW_PERCENT: u64 = 25;
/// Mixed scenario: each account is pre-funded with this many times `--amount-cents`.
pub const MIXED_PREFUND_MULTIPLIER: i64 = 1000;
/// Attempts per pre-funding deposit and target (same key each time).
pub const SETUP_MAX_ATTEMPTS: u32 = 8;
/// Pause before the first re-send of a setup deposit, doubled for each after it.
pub const SETUP_BACKOFF: Duration = Duration::from_millis(50);
/// Longest pause between setup attempts that the doubling reaches.
pub const SETUP_MAX_BACKOFF: Duration = Duration::from_secs(2);
/// Time for one pre-funding deposit on one target, waits included.
pub const SETUP_MAX_TIME: Duration = Duration::from_secs(30);
/// Most characters of a response body quoted in an error message.
pub const MAX_QUOTED_BODY: usize = 200;
/// RNG stream for account ids (ticket streams use the ticket number, far below this).
const ACCOUNT_STREAM: u64 = u64::MAX;

/// The accounts and mix of the measured phase.
#[derive(Debug, Clone)]
pub struct Workload {
    pub scenario: Scenario,
    pub accounts: Vec<Uuid>,
    pub amount_cents: i64,
    /// Share of operations that go to a brand-new account (first-touch only).
    pub fresh_ratio: f64,
}

/// One drawn operation and whether it is the first write to its account.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Draw {
    pub op: Op,
    pub first_touch: bool,
}

impl Workload {
    /// Draws the next operation from `rng`, noting whether it creates its account. A fresh
    /// account id comes from the ticket's own stream, so it is new unless the seed repeats.
    pub fn next_draw(&self, rng: &mut Rng) -> Draw {
        if self.scenario == Scenario::FirstTouch
            && (self.accounts.is_empty() || rng.unit() < self.fresh_ratio)
        {
            return Draw {
                op: Op::deposit(rng.uuid_v4(), self.amount_cents),
                first_touch: true,
            };
        }
        Draw {
            op: self.next_existing(rng),
            first_touch: false,
        }
    }

    fn next_existing(&self, rng: &mut Rng) -> Op {
        let n = self.accounts.len() as u64;
        let from = rng.below(n) as usize;
        let account = self.accounts[from];
        let amount_cents = self.amount_cents;
        let kind = match self.scenario {
            Scenario::Spread | Scenario::Hot | Scenario::FirstTouch => OpKind::Deposit,
            Scenario::Balance => OpKind::Balance,
            Scenario::Mixed => match rng.below(100) {
                r if r < MIXED_DEPOSIT_PERCENT => OpKind::Deposit,
                r if r < MIXED_DEPOSIT_PERCENT + MIXED_WITHDRAW_PERCENT => OpKind::Withdraw,
                _ if n >= 2 => OpKind::Transfer,
                _ => OpKind::Withdraw,
            },
        };
        let to = (kind == OpKind::Transfer).then(|| {
            let offset = 1 + rng.below(n - 1) as usize;
            self.accounts[(from + offset) % self.accounts.len()]
        });
        Op {
            kind,
            account,
            to,
            amount_cents,
        }
    }
}

/// The outcome of the setup phase.
#[derive(Debug)]
pub struct Setup {
    pub workload: Workload,
    /// Keys of the pre-funding deposits, verified like the rest.
    pub records: Vec<KeyRecord>,
    pub requests: u64,
    pub elapsed: Duration,
}

#[derive(Deserialize)]
struct AccountList {
    accounts: Vec<AccountEntry>,
}

#[derive(Deserialize)]
struct AccountEntry {
    id: Uuid,
}

/// Shortens a body for quoting in an error.
pub fn quote(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    text.chars().take(MAX_QUOTED_BODY).collect()
}

/// Chooses the accounts and pre-funds them, retrying each deposit with its own key.
pub async fn prepare(config: &Config, client: &Client) -> Result<Setup, LoadError> {
    let started = Instant::now();
    let mut seeded = Rng::derive(config.seed, ACCOUNT_STREAM);
    let mut requests = 0;
    let (accounts, prefund) = match config.scenario {
        Scenario::Hot => {
            requests += 1;
            let mut accounts = list_accounts(config, client).await?;
            accounts.truncate(HOT_ACCOUNTS);
            while accounts.len() < HOT_ACCOUNTS {
                accounts.push(seeded.uuid_v4());
            }
            (accounts, None)
        }
        // Every operation creates its account: nothing to pre-fund.
        Scenario::FirstTouch if config.fresh_ratio >= 1.0 => (Vec::new(), None),
        Scenario::FirstTouch | Scenario::Spread | Scenario::Balance | Scenario::Mixed => {
            let accounts: Vec<Uuid> = (0..config.accounts).map(|_| seeded.uuid_v4()).collect();
            let amount = if config.scenario == Scenario::Mixed {
                config.amount_cents.saturating_mul(MIXED_PREFUND_MULTIPLIER)
            } else {
                config.amount_cents
            };
            (accounts, Some(amount))
        }
    };
    let mut records = Vec::new();
    if let Some(amount) = prefund {
        let (funded, sent) = prefund_all(config, &accounts, amount).await?;
        records = funded;
        requests += sent;
    }
    Ok(Setup {
        workload: Workload {
            scenario: config.scenario,
            accounts,
            amount_cents: config.amount_cents,
            fresh_ratio: config.fresh_ratio,
        },
        records,
        requests,
        elapsed: started.elapsed(),
    })
}

/// The listed (demo) accounts, from the first target that answers.
async fn list_accounts(config: &Config, client: &Client) -> Result<Vec<Uuid>, LoadError> {
    let mut last = None;
    for target in &config.targets {
        match list_accounts_on(config, client, target).await {
            Ok(accounts) => return Ok(accounts),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| LoadError::Setup("no target to list accounts from".into())))
}

async fn list_accounts_on(
    config: &Config,
    client: &Client,
    target: &Target,
) -> Result<Vec<Uuid>, LoadError> {
    let fail =
        |why: String| LoadError::Setup(format!("GET {}/api/accounts: {why}", target.as_str()));
    let uri = target.uri("/api/accounts").map_err(fail)?;
    let answer = exchange(client, Method::GET, uri, None, None, config.timeout)
        .await
        .map_err(|e| fail(format!("{}: {}", e.kind, e.detail)))?;
    if !(200..300).contains(&answer.status) {
        return Err(fail(format!(
            "status {}: {}",
            answer.status,
            quote(&answer.body)
        )));
    }
    let list: AccountList = serde_json::from_slice(&answer.body)
        .map_err(|e| fail(format!("unexpected body ({e}): {}", quote(&answer.body))))?;
    Ok(list.accounts.into_iter().map(|a| a.id).collect())
}

async fn prefund_all(
    config: &Config,
    accounts: &[Uuid],
    amount: i64,
) -> Result<(Vec<KeyRecord>, u64), LoadError> {
    let amount = u32::try_from(amount).map_err(|_| {
        LoadError::Config(format!(
            "a pre-funding deposit of {amount} cents is out of range"
        ))
    })?;
    let clients = Arc::new(setup_clients(config)?);
    let accounts: Arc<Vec<Uuid>> = Arc::new(accounts.to_vec());
    let next = Arc::new(AtomicUsize::new(0));
    let workers = config.connections.min(accounts.len()).max(1);
    let mut tasks = JoinSet::new();
    for _ in 0..workers {
        let (accounts, next, clients) = (accounts.clone(), next.clone(), clients.clone());
        tasks.spawn(async move {
            let mut records = Vec::new();
            let mut sent = 0u64;
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(&account) = accounts.get(i) else {
                    break;
                };
                let (record, attempts) = fund_one(&clients, i, account, amount).await?;
                sent += attempts;
                records.push(record);
            }
            Ok::<_, String>((records, sent))
        });
    }
    let mut all = Vec::with_capacity(accounts.len());
    let mut sent = 0;
    while let Some(joined) = tasks.join_next().await {
        let (records, n) = joined
            .map_err(|e| LoadError::Setup(format!("pre-funding task failed: {e}")))?
            .map_err(LoadError::Setup)?;
        all.extend(records);
        sent += n;
    }
    Ok((all, sent))
}

/// One `tally-client` per target for the pre-funding deposits: setup is a caller like any
/// other, which needs each deposit landed once, so it takes the client's retry contract
/// (same key, `Retry-After`, the window, final answers not retried) rather than a loop of
/// its own. Its bounds are setup's: [`SETUP_MAX_ATTEMPTS`] per target, `--timeout` each.
fn setup_clients(config: &Config) -> Result<Vec<tally_client::Client>, LoadError> {
    let policy = tally_client::RetryPolicy {
        max_attempts: SETUP_MAX_ATTEMPTS,
        total: SETUP_MAX_TIME,
        attempt_timeout: config.timeout,
        backoff: SETUP_BACKOFF,
        max_backoff: SETUP_MAX_BACKOFF,
    };
    config
        .targets
        .iter()
        .map(|t| {
            tally_client::Client::builder(t.as_str())
                .policy(policy)
                .build()
                .map_err(|e| LoadError::Config(e.to_string()))
        })
        .collect()
}

/// Lands one pre-funding deposit under one key, moving to the next target (same key) when a
/// target's attempts run out without an answer that is final.
async fn fund_one(
    clients: &[tally_client::Client],
    index: usize,
    account: Uuid,
    amount: u32,
) -> Result<(KeyRecord, u64), String> {
    let key = Uuid::new_v4();
    let mut record = KeyRecord::new(key, Op::deposit(account, i64::from(amount)));
    let mut sent = 0u64;
    let mut last = String::new();
    let amount = tally_client::AmountCents::try_from(amount)
        .map_err(|e| format!("pre-funding deposit into {account}: {e}"))?;
    for round in 0..clients.len() {
        let client = &clients[(index + round) % clients.len()];
        match client.deposit(account, amount).key(key.into()).send().await {
            Ok(written) => {
                record.landed(written.attempts);
                return Ok((record, sent + u64::from(written.attempts)));
            }
            Err(tally_client::Error::Exhausted {
                attempts,
                last: why,
                ..
            }) => {
                sent += u64::from(attempts);
                record.unanswered(attempts);
                last = why.to_string();
            }
            // No connection opened: nothing was sent, so the ledger has nothing to note.
            Err(tally_client::Error::Unreachable { last: why, .. }) => last = why.to_string(),
            Err(e) => return Err(format!("pre-funding deposit into {account}: {e}")),
        }
    }
    Err(format!(
        "pre-funding deposit into {account} did not succeed on any target (last: {last})"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mixed_transfers_never_target_self() {
        let mut r = Rng::derive(3, 0);
        let w = Workload {
            scenario: Scenario::Mixed,
            accounts: (0..4).map(|_| r.uuid_v4()).collect(),
            amount_cents: 5,
            fresh_ratio: 0.0,
        };
        let mut kinds = std::collections::HashSet::new();
        for ticket in 0..2000 {
            let op = w.next_draw(&mut Rng::derive(3, ticket)).op;
            kinds.insert(op.kind as u8);
            if let Some(to) = op.to {
                assert_ne!(to, op.account);
                assert!(w.accounts.contains(&to));
            }
        }
        assert_eq!(kinds.len(), 3);
    }

    #[test]
    fn first_touch_draws_new_accounts_at_the_fresh_ratio() {
        let mut r = Rng::derive(5, 0);
        let existing: Vec<Uuid> = (0..10).map(|_| r.uuid_v4()).collect();
        let w = Workload {
            scenario: Scenario::FirstTouch,
            accounts: existing.clone(),
            amount_cents: 5,
            fresh_ratio: 0.3,
        };
        let mut fresh = std::collections::HashSet::new();
        let draws = 10_000;
        for ticket in 0..draws {
            let d = w.next_draw(&mut Rng::derive(5, ticket));
            assert_eq!(d.op.kind, OpKind::Deposit);
            assert_eq!(d.first_touch, !existing.contains(&d.op.account));
            if d.first_touch {
                assert!(
                    fresh.insert(d.op.account),
                    "a fresh account is never reused"
                );
            }
        }
        let share = fresh.len() as f64 / draws as f64;
        assert!((0.27..0.33).contains(&share), "seed 5: fresh share {share}");
        let all_fresh = Workload {
            accounts: Vec::new(),
            fresh_ratio: 1.0,
            ..w
        };
        assert!(all_fresh.next_draw(&mut Rng::derive(5, 1)).first_touch);
    }
}
