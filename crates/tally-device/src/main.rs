//! `tally-device`: an offline device's side of Tally. Records deposits and withdrawals into a
//! durable SQLite outbox (each with its own, never reissued, per-account sequence) and syncs
//! them to a Tally server later, however much later, exactly once.
//!
//! Exit status: 0 on success (a sync that drained the outbox), 1 when a sync stopped with
//! events still queued (the reason is printed; the queue is intact), 2 on bad input, a
//! refused operation or an outbox that cannot be used.
//!
//! Crash testing: `TALLY_DEVICE_CRASH_AT=STEP[@N]` aborts the process at a named crash point
//! (see `tally_device::crash::CrashPoint`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::builder::TypedValueParser;
use clap::{Parser, Subcommand};
use tally::account::{AccountId, AmountCents, Operation};
use tally::device::MAX_RUN_EVENTS;
use tally_device::crash::{AbortAt, Hooks};
use tally_device::outbox::{Outbox, OutboxError};
use tally_device::sync::{self, SyncLoop, SyncOptions};
use tally_device::transport::{self, HttpTransport};

const EXIT_STOPPED: u8 = 1;
const EXIT_ERROR: u8 = 2;
/// The outbox used when neither `--outbox` nor the environment names one.
const DEFAULT_OUTBOX: &str = "tally-device.sqlite";
/// The longest `--timeout-ms` accepted.
const MAX_TIMEOUT_MS: u64 = 600_000;
/// The most `--max-attempts` accepted.
const MAX_ATTEMPTS_LIMIT: u32 = 1_000;

#[derive(Parser, Debug)]
#[command(
    name = "tally-device",
    about = "An offline device's outbox and sync loop for Tally"
)]
struct Cli {
    /// The outbox file (SQLite).
    #[arg(long, global = true, env = "TALLY_DEVICE_OUTBOX", default_value = DEFAULT_OUTBOX)]
    outbox: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Creates the outbox and this device's identity (kept if it already exists).
    Init,
    /// Records `deposit|withdraw ACCOUNT AMOUNT_CENTS` in the outbox. No network.
    Record {
        /// `deposit` or `withdraw` (transfers are refused offline).
        kind: String,
        /// The account id (a UUID).
        account: String,
        /// A positive amount in cents.
        // A negative amount reaches the amount rule, not clap's "unexpected argument".
        #[arg(allow_negative_numbers = true)]
        amount_cents: String,
    },
    /// Sends every queued event to the server, in order, exactly once.
    Sync {
        /// The Tally server, e.g. http://127.0.0.1:8080.
        #[arg(long, env = "TALLY_DEVICE_SERVER")]
        server: String,
        /// Events per request (1 to the server's limit).
        #[arg(long, default_value_t = sync::DEFAULT_BATCH_SIZE,
              value_parser = clap::value_parser!(u16).range(1..=MAX_RUN_EVENTS as i64).map(usize::from))]
        batch_size: usize,
        /// Sends of one run before this sync gives up (the queue is kept).
        #[arg(long, default_value_t = sync::DEFAULT_MAX_ATTEMPTS,
              value_parser = clap::value_parser!(u32).range(1..=MAX_ATTEMPTS_LIMIT as i64))]
        max_attempts: u32,
        /// Time allowed for one request, in milliseconds.
        #[arg(long, default_value_t = transport::DEFAULT_TIMEOUT.as_millis() as u64,
              value_parser = clap::value_parser!(u64).range(1..=MAX_TIMEOUT_MS))]
        timeout_ms: u64,
        /// Seed of the backoff jitter (random when absent).
        #[arg(long)]
        jitter_seed: Option<u64>,
        /// A file holding the bearer token to send, for a server running `--auth jwt`: its
        /// `sub` must be this device's id and its scopes include `devices:sync`.
        #[arg(long, env = "TALLY_DEVICE_TOKEN_FILE")]
        token_file: Option<std::path::PathBuf>,
    },
    /// Shows pending, in-flight and synced events per account.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

/// A failure and the exit status it earns.
struct Failure(u8, String);

impl From<OutboxError> for Failure {
    fn from(e: OutboxError) -> Self {
        Failure(EXIT_ERROR, e.to_string())
    }
}

/// Writes one line to stdout. A reader that went away (`tally-device status | head -1`)
/// is no failure: the line is dropped, never a panic, and the exit status stays what the
/// command's outcome makes it (a stopped sync still exits 1).
fn say(line: std::fmt::Arguments<'_>) {
    use std::io::Write;
    if let Err(e) = writeln!(std::io::stdout().lock(), "{line}")
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        eprintln!("tally-device: cannot write to stdout: {e}");
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(Failure(code, message)) => {
            eprintln!("tally-device: {message}");
            ExitCode::from(code)
        }
    }
}

async fn run(cli: Cli) -> Result<(), Failure> {
    let mut hooks = AbortAt::from_env().map_err(|e| Failure(EXIT_ERROR, e))?;
    match cli.command {
        Command::Init => init_outbox(&cli.outbox),
        Command::Record {
            kind,
            account,
            amount_cents,
        } => {
            let operation = operation(&kind, &account, &amount_cents)?;
            record_event(&cli.outbox, operation, &mut hooks)
        }
        Command::Sync {
            server,
            batch_size,
            max_attempts,
            timeout_ms,
            jitter_seed,
            token_file,
        } => {
            let transport = http_transport(&server, timeout_ms, token_file.as_deref())?;
            let mut outbox = Outbox::open(&cli.outbox)?;
            let options = SyncOptions {
                batch_size,
                max_attempts,
                jitter_seed: jitter_seed.unwrap_or_else(rand::random),
                ..SyncOptions::default()
            };
            sync_outbox(&mut outbox, &transport, options, &mut hooks).await
        }
        Command::Status { json } => show_status(&cli.outbox, json),
    }
}

/// `init`: creates the outbox, or keeps the one there.
fn init_outbox(path: &Path) -> Result<(), Failure> {
    let (outbox, created) = Outbox::init(path, tally::store::wall_clock_ms())?;
    let verb = if created {
        "created"
    } else {
        "already initialised; kept"
    };
    say(format_args!(
        "outbox {} {verb}; device id {}",
        path.display(),
        outbox.device_id()
    ));
    Ok(())
}

/// `record`: records one deposit or withdrawal in the outbox.
fn record_event(path: &Path, operation: Operation, hooks: &mut dyn Hooks) -> Result<(), Failure> {
    let mut outbox = Outbox::open(path)?;
    let event = outbox.record(operation, tally::store::wall_clock_ms(), hooks)?;
    say(format_args!(
        "recorded {} of {} cents on {} as sequence {} (event {})",
        event.kind.wire(),
        event.amount_cents,
        event.account,
        event.client_seq,
        event.event_id
    ));
    Ok(())
}

/// The transport to `server`, with the bearer token of `token_file` when one is named.
fn http_transport(
    server: &str,
    timeout_ms: u64,
    token_file: Option<&Path>,
) -> Result<HttpTransport, Failure> {
    let mut transport = HttpTransport::new(server, Duration::from_millis(timeout_ms))
        .map_err(|e| Failure(EXIT_ERROR, e))?;
    if let Some(path) = token_file {
        transport = transport
            .with_token(&read_token(path)?)
            .map_err(|e| Failure(EXIT_ERROR, format!("--token-file: {e}")))?;
    }
    Ok(transport)
}

/// `sync`: drains the outbox; a sync that stopped with events still queued fails with
/// [`EXIT_STOPPED`].
async fn sync_outbox(
    outbox: &mut Outbox,
    transport: &HttpTransport,
    options: SyncOptions,
    hooks: &mut dyn Hooks,
) -> Result<(), Failure> {
    let report = SyncLoop::new(outbox, transport, options)
        .run(hooks)
        .await
        .map_err(|e| Failure(EXIT_ERROR, e.to_string()))?;
    say(format_args!(
        "synced {} events in {} runs ({} found already synced); {} failed sends",
        report.events_synced,
        report.runs_synced + report.runs_already_synced,
        report.runs_already_synced,
        report.failed_sends
    ));
    match report.stopped {
        Some(stop) => Err(Failure(EXIT_STOPPED, stop.to_string())),
        None => Ok(()),
    }
}

/// `status`: pending, in-flight and synced events per account, as a table or JSON.
fn show_status(path: &Path, json: bool) -> Result<(), Failure> {
    let status = Outbox::open(path)?.status()?;
    if json {
        let text = serde_json::to_string_pretty(&status)
            .map_err(|e| Failure(EXIT_ERROR, e.to_string()))?;
        say(format_args!("{text}"));
        return Ok(());
    }
    say(format_args!(
        "device {}: {} pending, {} in flight, {} synced",
        status.device_id, status.pending, status.in_flight, status.synced
    ));
    for a in &status.accounts {
        let run = match (a.run_attempts, &a.last_error) {
            (Some(n), Some(e)) => format!("; {n} failed sends, last: {e}"),
            (Some(n), None) => format!("; {n} failed sends"),
            _ => String::new(),
        };
        say(format_args!(
            "  {}: {} pending, {} in flight, {} synced, last sequence {}{run}",
            a.account, a.pending, a.in_flight, a.synced, a.last_seq
        ));
    }
    Ok(())
}

/// Parses `record`'s arguments into a deposit or a withdrawal.
fn operation(kind: &str, account: &str, amount: &str) -> Result<Operation, Failure> {
    let bad = |m: String| Failure(EXIT_ERROR, m);
    if kind == "transfer" {
        return Err(bad(OutboxError::TransferOffline.to_string()));
    }
    let account: AccountId = account
        .parse()
        .map_err(|_| bad(format!("account {account:?} is not a UUID")))?;
    let cents: i64 = amount
        .parse()
        .map_err(|_| bad(format!("amount {amount:?} is not a whole number of cents")))?;
    let amount = AmountCents::new(cents).map_err(|e| bad(e.to_string()))?;
    match kind {
        "deposit" => Ok(Operation::Deposit { account, amount }),
        "withdraw" => Ok(Operation::Withdraw { account, amount }),
        other => Err(bad(format!(
            "unknown kind {other:?}: record deposit or withdraw"
        ))),
    }
}

/// The token in `path`, read whole up to [`transport::MAX_TOKEN_FILE_BYTES`].
fn read_token(path: &Path) -> Result<String, Failure> {
    use std::io::Read;
    let bad = |why: String| {
        Failure(
            EXIT_ERROR,
            format!("--token-file {}: {why}", path.display()),
        )
    };
    let file = std::fs::File::open(path).map_err(|e| bad(e.to_string()))?;
    let mut token = String::new();
    file.take(transport::MAX_TOKEN_FILE_BYTES + 1)
        .read_to_string(&mut token)
        .map_err(|e| bad(e.to_string()))?;
    if token.len() as u64 > transport::MAX_TOKEN_FILE_BYTES {
        return Err(bad(format!(
            "longer than {} bytes",
            transport::MAX_TOKEN_FILE_BYTES
        )));
    }
    Ok(token)
}
