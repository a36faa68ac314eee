//! `tally`: serve the account API. Thin: configuration, tracing, serve, graceful shutdown.

use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use tally::app::App;
use tally::auth::mint::TokenArgs;
use tally::config::{Config, LogFormat};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // `tally token ...` mints a development token; every other invocation is the
    // server's flags, parsed as before.
    if std::env::args_os().nth(1).is_some_and(|a| a == "token") {
        return mint_token();
    }
    let config = parse_flags();
    if let Err(e) = config.validate() {
        eprintln!("tally: {e}");
        return ExitCode::from(2);
    }
    init_tracing(config.log_format);
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
    Config::try_parse().unwrap_or_else(|e| {
        if e.use_stderr() {
            eprintln!("tally: invalid configuration:");
        }
        // Prints clap's message and exits: 2 for a refusal, 0 for help and version.
        e.exit()
    })
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
    let listen = config.http.listen;
    let app = match App::builder(config).build().await {
        Ok(app) => app,
        Err(e) => {
            tracing::error!(error = %e, "cannot start");
            return ExitCode::FAILURE;
        }
    };
    let listener = match tokio::net::TcpListener::bind(listen).await {
        Ok(l) => l,
        Err(e) => {
            let hint = listen_hint(&e, "--listen", "TALLY_LISTEN");
            tracing::error!(error = %e, %listen, "cannot listen on {listen}: {hint}");
            return ExitCode::FAILURE;
        }
    };
    // /metrics (and the probes) on an admin address of their own, when asked.
    if let Some(admin) = app.config.admin_listen {
        match tokio::net::TcpListener::bind(admin).await {
            Ok(l) => {
                let addr = l.local_addr().map_or(admin, |a| a);
                tracing::info!(%addr, "admin listening (/metrics, /healthz, /readyz)");
                tokio::spawn(tally::http::serve_admin(
                    app.clone(),
                    l,
                    std::future::pending(),
                ));
            }
            Err(e) => {
                let hint = listen_hint(&e, "--admin-listen", "TALLY_ADMIN_LISTEN");
                tracing::error!(error = %e, %admin, "cannot listen on the admin address {admin}: {hint}");
                return ExitCode::FAILURE;
            }
        }
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

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colours only for a person at a terminal: escape codes in a log file or a collector's
    // pipe are noise (and cost a little on every access-log line).
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stdout().is_terminal());
    match format {
        LogFormat::Human => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

// mimalloc instead of glibc's malloc: under load from many connections on two cores, glibc's
// arena locks and chunk consolidation showed in profiles (`__lll_lock_wait_private`,
// `malloc_consolidate`), frees crossing worker threads; docs/benchmarks-history.md
// ("Overload") has the before and after.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
