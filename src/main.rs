//! `tally`: serve the account API. Thin: configuration, tracing, serve, graceful shutdown.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser};
use tally::app::App;
use tally::auth::mint::TokenArgs;
use tally::config::{Config, LogFormat};
use tally::log_writer::{self, LogWriterGuard};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // `tally token ...` mints a development token; every other invocation is the
    // server's flags, parsed as before.
    if std::env::args_os().nth(1).is_some_and(|a| a == "token") {
        return mint_token();
    }
    // `tally trim ACCOUNT...` trims account streams below a checkpoint (retention), with
    // the server's flags for the store, the window and `--retain-history-secs`.
    if std::env::args_os().nth(1).is_some_and(|a| a == "trim") {
        return trim::main();
    }
    let config = parse_flags();
    if let Err(e) = config.validate() {
        eprintln!("tally: {e}");
        return ExitCode::from(2);
    }
    // Held to the end: dropping it writes the lines still queued.
    let _log_writer = init_tracing(config.log_format);
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(workers) = config.http.worker_threads {
        builder.worker_threads(workers);
    }
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tally: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(run(config))
}

/// Parses flags and environment. A value clap refuses (a bad `--faults` spec, say) is an
/// invalid configuration like one [`Config::validate`] refuses: named so on stderr, exit 2.
/// `--help` and `--version` print to stdout and exit 0, as clap does.
fn parse_flags() -> Config {
    server_command()
        .try_get_matches()
        .and_then(|m| Config::from_arg_matches(&m))
        .unwrap_or_else(|e| {
            if e.use_stderr() {
                eprintln!("tally: invalid configuration:");
            }
            // Prints clap's message and exits: 2 for a refusal, 0 for help and version.
            e.exit()
        })
}

/// The server's command line, with the subcommands in its usage and help. `trim` and `token`
/// are dispatched on the first argument, before the server's flags are read (each takes the
/// rest of the line whole), so clap does not know them as its own subcommands: their usage
/// and summary are taken from their own parsers here.
fn server_command() -> clap::Command {
    let subcommands = [trim::TrimArgs::command(), TokenArgs::command()];
    let mut usage = String::from("tally [OPTIONS]");
    let mut listed = String::from("Commands:\n");
    let width = subcommands
        .iter()
        .map(|c| c.get_name().len())
        .max()
        .unwrap_or(0);
    for mut command in subcommands {
        let shown = command.render_usage().to_string();
        let shown = shown.trim_start_matches("Usage:").trim();
        usage.push_str(&format!("\n       {shown}"));
        let about = command
            .get_about()
            .map(|a| a.to_string())
            .unwrap_or_default();
        let name = command.get_name().to_owned();
        listed.push_str(&format!(
            "  {name:width$}  {about}. More: `{name} --help`\n"
        ));
    }
    Config::command()
        .override_usage(usage)
        .help_template(format!(
            "{{before-help}}{{about-with-newline}}\n{{usage-heading}} {{usage}}\n\n{listed}\n{{all-args}}{{after-help}}"
        ))
}

mod trim {
    //! `tally trim`: the operator's retention command. For each account, trims its stream
    //! below its newest checkpoint older than the idempotency window plus
    //! `--retain-history-secs` (0 when unset), once that checkpoint checks against the
    //! stream; prints one JSON line per account. Exit 0 when every account was handled, 1
    //! when any failed, 2 for bad arguments.

    use std::process::ExitCode;
    use std::sync::Arc;
    use std::time::Duration;

    use clap::Parser;
    use tally::account::AccountId;
    use tally::config::Config;
    use tally::metrics::Metrics;
    use tally::projection::{MonotonicClock, Projection};
    use tally::store::SharedLog;
    use tally::store::celeriant::CeleriantLog;
    use tally::store::config::StoreKind;

    /// Trims account streams below a checkpoint (retention)
    // The detail goes after the flags, not in a second paragraph: a long "about" would turn
    // `--help` into clap's long layout, a paragraph for each of the server's flags.
    #[derive(Parser)]
    #[command(
        name = "tally trim",
        after_help = "Each account is trimmed below its newest checkpoint older than the window \
                      and the retention. The server's flags name the store, the window and the \
                      retention."
    )]
    pub(super) struct TrimArgs {
        /// The accounts to trim (UUIDs).
        #[arg(id = "account_ids", required = true, value_name = "ACCOUNT_ID")]
        account_ids: Vec<AccountId>,
        #[command(flatten)]
        config: Config,
    }

    pub fn main() -> ExitCode {
        let argv = std::iter::once("tally trim".into()).chain(std::env::args_os().skip(2));
        let args = TrimArgs::try_parse_from(argv).unwrap_or_else(|e| e.exit());
        if args.config.store.kind != StoreKind::Celeriant {
            eprintln!(
                "tally trim: needs --store celeriant (the embedded store keeps nothing to trim)"
            );
            return ExitCode::from(2);
        }
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            Err(e) => {
                eprintln!("tally trim: cannot start the runtime: {e}");
                return ExitCode::FAILURE;
            }
        };
        runtime.block_on(run(args))
    }

    async fn run(args: TrimArgs) -> ExitCode {
        let config = &args.config;
        if let Err(why) = config.check_trim_keeps_keys() {
            eprintln!("tally trim: {why}");
            return ExitCode::from(2);
        }
        let log: SharedLog = match CeleriantLog::connect(&config.store.celeriant) {
            Ok(log) => Arc::new(log),
            Err(e) => {
                eprintln!("tally trim: {e}");
                return ExitCode::from(2);
            }
        };
        let projection = Projection::new(
            log,
            config.identity(),
            config.projection(),
            Arc::new(MonotonicClock::new()),
            Arc::new(Metrics::new()),
        );
        // Checkpoint ages are server time: anchor it first.
        if let Err(e) = projection.sync_server_clock().await {
            eprintln!("tally trim: the store did not answer: {e}");
            return ExitCode::FAILURE;
        }
        let retain = Duration::from_secs(config.projection.retain_history_secs.unwrap_or(0));
        let mut failed = false;
        for &account in &args.account_ids {
            let line = match projection.trim_account(account, retain).await {
                Ok(r) => serde_json::json!({
                    "accountId": account.to_string(),
                    "trimmedAt": r.trimmed_at,
                    "firstAvailableVersion": r.first_available,
                }),
                Err(e) => {
                    failed = true;
                    serde_json::json!({ "accountId": account.to_string(), "error": e.to_string() })
                }
            };
            println!("{line}");
        }
        if failed {
            ExitCode::FAILURE
        } else {
            ExitCode::SUCCESS
        }
    }
}

/// `tally token`: prints a development token (HS256) signed with a secret file.
fn mint_token() -> ExitCode {
    let argv = std::iter::once("tally token".into()).chain(std::env::args_os().skip(2));
    let args = TokenArgs::try_parse_from(argv).unwrap_or_else(|e| e.exit());
    match args.mint() {
        Ok(token) => {
            println!("{token}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("tally token: {e}");
            ExitCode::from(2)
        }
    }
}

async fn run(config: Config) -> ExitCode {
    // The addresses first: a port already taken is found at once, not after the start-up
    // steps (seeding, the server clock), which a slow store can hold for long.
    let listen = config.http.listen;
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            let hint = listen_hint(&e, "--listen", "TALLY_LISTEN");
            tracing::error!(error = %e, %listen, "cannot listen on {listen}: {hint}");
            return ExitCode::FAILURE;
        }
    };
    // /metrics (and the probes) on an admin address of their own, when asked.
    let admin = match config.admin_listen {
        Some(admin) => match tokio::net::TcpListener::bind(admin).await {
            Ok(l) => Some(l),
            Err(e) => {
                let hint = listen_hint(&e, "--admin-listen", "TALLY_ADMIN_LISTEN");
                tracing::error!(error = %e, %admin, "cannot listen on the admin address {admin}: {hint}");
                return ExitCode::FAILURE;
            }
        },
        None => None,
    };
    let app = match App::builder(config).build().await {
        Ok(app) => app,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    if let Some(l) = admin {
        if let Ok(addr) = l.local_addr() {
            tracing::info!(%addr, "admin listening (/metrics, /healthz, /readyz)");
        }
        tokio::spawn(tally::http::serve_admin(
            app.clone(),
            l,
            std::future::pending(),
        ));
    }
    let addr = listener.local_addr().map_or(listen, |a| a);
    tracing::info!(
        %addr,
        store = %app.config.store_description(),
        projection = %app.config.projection_description(),
        window_secs = app.config.idempotency_window,
        client_id = %app.identity.client_id,
        auth = ?app.config.auth.mode,
        "tally listening"
    );
    tally::http::serve(app, listener, shutdown_signal()).await;
    tracing::info!("stopped");
    ExitCode::SUCCESS
}

/// What to do when an address cannot be bound: the flag and the variable that move it (a
/// first run often finds 8080 taken by something else).
fn listen_hint(e: &std::io::Error, flag: &str, env: &str) -> String {
    let why = match e.kind() {
        std::io::ErrorKind::AddrInUse => "another process is listening there",
        std::io::ErrorKind::PermissionDenied => "this user may not bind that port",
        _ => "the address cannot be bound here",
    };
    format!(
        "{why}; choose another with {flag} HOST:PORT or the {env} variable \
         (with make: make run ARGS='{flag} 127.0.0.1:8090')"
    )
}

/// Resolves on SIGINT or SIGTERM.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Logs to stdout in batches (`tally::log_writer`): a line costs its request a copy into a
/// buffer, not a system call. The guard writes what is left when it is dropped.
fn init_tracing(format: LogFormat) -> Option<LogWriterGuard> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a person at a terminal: escape codes in a log file or a collector's
    // pipe are noise (and cost a little on every access-log line).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
    let Some((sink, guard)) = log_writer::batched_stdout() else {
        match format {
            LogFormat::Human => builder.init(),
            LogFormat::Json => builder.json().init(),
        }
        return None;
    };
    let builder = builder.with_writer(sink);
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    Some(guard)
}

// mimalloc instead of glibc's malloc: under load from many connections on two cores, glibc's
// arena locks and chunk consolidation showed in profiles (`__lll_lock_wait_private`,
// `malloc_consolidate`), frees crossing worker threads; docs/benchmarks-history.md
// ("Overload") has the before and after.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
