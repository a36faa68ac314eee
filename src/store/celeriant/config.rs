//! How Tally reaches Celeriant: [`CeleriantConfig`] (flags and environment), its validation,
//! the API key that never prints, and the TLS and pool options built from it.
//!
//! Kept apart from the adapter because none of it touches the network: everything here can be
//! checked at start, before the first request.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use celeriant_client_tokio::{ClientIdentityConfig, ClientTlsConfig, PoolOptions, sni_host};

/// Largest request the client will send, in bytes (the client library's default, below the
/// server's 16 MiB default).
pub const MAX_REQUEST_BYTES: u64 = 10_000_000;

const DEFAULT_ADDRESS: &str = "127.0.0.1:10000";
const DEFAULT_REQUEST_TIMEOUT_MS: u64 = 5_000;
const DEFAULT_CONNECT_TIMEOUT_MS: u64 = 1_000;
/// Connections per node. Each store request holds one connection until it is answered, and
/// under load Celeriant answers a write only after its amortised fsync (about 4 ms by
/// default), so the pool caps store requests in flight: 16 connections held 1,000-account
/// deposits to 2,833/s where 64 reach about 8,500/s (BENCHMARKS.md). Connections are opened
/// on demand, so an idle replica holds few.
const DEFAULT_POOL_SIZE: usize = 64;
/// Upper bound for either timeout.
pub const MAX_TIMEOUT_MS: u64 = 600_000;
/// Upper bound for connections per node.
pub const MAX_POOL_SIZE: usize = 1_024;
/// Upper bound for seed addresses.
pub const MAX_SEEDS: usize = 64;

/// A Celeriant API key. Its `Debug` never shows the key.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(pub(super) String);

impl ApiKey {
    fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl FromStr for ApiKey {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let key = s.trim();
        if key.is_empty() {
            return Err("the API key is empty".into());
        }
        Ok(ApiKey(key.to_owned()))
    }
}

/// How Tally reaches Celeriant. Flatten into the main config with `#[command(flatten)]`.
///
/// Authentication: client 0.2 supports Celeriant API keys (sent in the connection's
/// `Identify` handshake, base64 of 32 bytes, as `celeriant keys generate` prints them). It also
/// supports RSA key-pair identity, which Tally does not use. The server refuses API keys over
/// plaintext unless it runs with `--insecure-allow-plaintext-auth`, so pair a key with TLS.
#[derive(Clone, Debug, clap::Args)]
#[command(next_help_heading = "Store")]
pub struct CeleriantConfig {
    /// Primary Celeriant node, HOST:PORT.
    #[arg(long = "celeriant-address", env = "CELERIANT_ADDRESS", default_value = DEFAULT_ADDRESS)]
    pub address: String,

    /// Further nodes (comma-separated HOST:PORT), for leader discovery and failover.
    #[arg(
        long = "celeriant-seeds",
        env = "CELERIANT_SEEDS",
        value_delimiter = ',',
        num_args = 0..
    )]
    pub seeds: Vec<String>,

    /// Deadline for one request's answer, in milliseconds.
    #[arg(
        long = "celeriant-request-timeout-ms",
        env = "TALLY_CELERIANT_REQUEST_TIMEOUT_MS",
        default_value_t = DEFAULT_REQUEST_TIMEOUT_MS
    )]
    pub request_timeout_ms: u64,

    /// Deadline for dialling a node, handshakes included, in milliseconds.
    #[arg(
        long = "celeriant-connect-timeout-ms",
        env = "TALLY_CELERIANT_CONNECT_TIMEOUT_MS",
        default_value_t = DEFAULT_CONNECT_TIMEOUT_MS
    )]
    pub connect_timeout_ms: u64,

    /// Most open connections per node.
    #[arg(
        long = "celeriant-pool-size",
        env = "TALLY_CELERIANT_POOL_SIZE",
        default_value_t = DEFAULT_POOL_SIZE
    )]
    pub pool_size: usize,

    /// CA bundle (PEM) that signs the nodes' certificates; setting it turns TLS on.
    #[arg(long = "celeriant-tls-ca", env = "TALLY_CELERIANT_TLS_CA")]
    pub tls_ca: Option<PathBuf>,

    /// Client certificate chain (PEM) for mutual TLS; needs `--celeriant-tls-key`.
    #[arg(long = "celeriant-tls-cert", env = "TALLY_CELERIANT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,

    /// Client private key (PEM) for mutual TLS; needs `--celeriant-tls-cert`.
    #[arg(long = "celeriant-tls-key", env = "TALLY_CELERIANT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,

    /// Name to verify the nodes' certificates against. Default: the address's host.
    #[arg(
        long = "celeriant-tls-server-name",
        env = "TALLY_CELERIANT_TLS_SERVER_NAME"
    )]
    pub tls_server_name: Option<String>,

    /// Celeriant API key (base64). Never logged.
    #[arg(
        long = "celeriant-api-key",
        env = "CELERIANT_API_KEY",
        hide_env_values = true
    )]
    pub api_key: Option<ApiKey>,
}

impl Default for CeleriantConfig {
    fn default() -> Self {
        Self {
            address: DEFAULT_ADDRESS.to_owned(),
            seeds: Vec::new(),
            request_timeout_ms: DEFAULT_REQUEST_TIMEOUT_MS,
            connect_timeout_ms: DEFAULT_CONNECT_TIMEOUT_MS,
            pool_size: DEFAULT_POOL_SIZE,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_server_name: None,
            api_key: None,
        }
    }
}

/// Why a [`CeleriantConfig`] cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CeleriantConfigError {
    #[error("invalid Celeriant setting {flag}: {reason}")]
    Invalid { flag: &'static str, reason: String },
    #[error("cannot load the Celeriant TLS files: {0}")]
    Tls(String),
}

fn invalid(flag: &'static str, reason: impl Into<String>) -> CeleriantConfigError {
    CeleriantConfigError::Invalid {
        flag,
        reason: reason.into(),
    }
}

/// Checks a `HOST:PORT` address: a non-empty host and a non-zero port.
fn check_address(flag: &'static str, address: &str) -> Result<(), CeleriantConfigError> {
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err(invalid(flag, format!("{address:?} is not HOST:PORT")));
    };
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err(invalid(flag, format!("{address:?} has no valid host")));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok(()),
        _ => Err(invalid(flag, format!("{address:?} has no valid port"))),
    }
}

fn check_timeout(flag: &'static str, ms: u64) -> Result<(), CeleriantConfigError> {
    if ms == 0 || ms > MAX_TIMEOUT_MS {
        return Err(invalid(
            flag,
            format!("{ms} is outside 1..={MAX_TIMEOUT_MS}"),
        ));
    }
    Ok(())
}

impl CeleriantConfig {
    /// Checks every setting without touching the network or the file system.
    pub fn validate(&self) -> Result<(), CeleriantConfigError> {
        check_address("--celeriant-address", &self.address)?;
        if self.seeds.len() > MAX_SEEDS {
            return Err(invalid(
                "--celeriant-seeds",
                format!("{} seeds; at most {MAX_SEEDS}", self.seeds.len()),
            ));
        }
        for seed in &self.seeds {
            check_address("--celeriant-seeds", seed)?;
        }
        check_timeout("--celeriant-request-timeout-ms", self.request_timeout_ms)?;
        check_timeout("--celeriant-connect-timeout-ms", self.connect_timeout_ms)?;
        if self.pool_size == 0 || self.pool_size > MAX_POOL_SIZE {
            return Err(invalid(
                "--celeriant-pool-size",
                format!("{} is outside 1..={MAX_POOL_SIZE}", self.pool_size),
            ));
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) => {
                return Err(invalid(
                    "--celeriant-tls-key",
                    "required with --celeriant-tls-cert",
                ));
            }
            (None, Some(_)) => {
                return Err(invalid(
                    "--celeriant-tls-cert",
                    "required with --celeriant-tls-key",
                ));
            }
            _ => {}
        }
        if self.tls_ca.is_none() {
            if self.tls_cert.is_some() {
                return Err(invalid(
                    "--celeriant-tls-ca",
                    "required with --celeriant-tls-cert",
                ));
            }
            if self.tls_server_name.is_some() {
                return Err(invalid(
                    "--celeriant-tls-ca",
                    "required with --celeriant-tls-server-name",
                ));
            }
        }
        if let Some(name) = &self.tls_server_name
            && (name.is_empty() || name.chars().any(char::is_whitespace))
        {
            return Err(invalid(
                "--celeriant-tls-server-name",
                format!("{name:?} is not a host name"),
            ));
        }
        Ok(())
    }

    /// Whether connections use TLS.
    pub fn tls_enabled(&self) -> bool {
        self.tls_ca.is_some()
    }

    pub(super) fn request_timeout(&self) -> Duration {
        Duration::from_millis(self.request_timeout_ms)
    }

    /// Loads the TLS files, when TLS is on.
    fn tls_config(&self) -> Result<Option<ClientTlsConfig>, CeleriantConfigError> {
        let Some(ca) = &self.tls_ca else {
            return Ok(None);
        };
        let server_name = match &self.tls_server_name {
            Some(name) => name.as_str(),
            None => {
                sni_host(&self.address).map_err(|e| CeleriantConfigError::Tls(format!("{e:?}")))?
            }
        };
        let identity = match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Some((cert.as_path(), key.as_path())),
            _ => None,
        };
        ClientTlsConfig::from_paths(ca, identity, server_name)
            .map(Some)
            .map_err(|e| CeleriantConfigError::Tls(format!("{e:?}")))
    }

    pub(super) fn pool_options(&self) -> Result<PoolOptions, CeleriantConfigError> {
        let mut options = PoolOptions::new(self.address.clone())
            .with_seed_addresses(self.seeds.clone())
            .with_max_connections(self.pool_size)
            .with_connection_timeout(Duration::from_millis(self.connect_timeout_ms))
            .with_request_timeout(self.request_timeout())
            .with_max_request_size(MAX_REQUEST_BYTES);
        if let Some(tls) = self.tls_config()? {
            options = options.with_tls(tls);
        }
        if let Some(key) = &self.api_key {
            options = options.with_identity(ClientIdentityConfig::from_api_key(key.expose()));
        }
        Ok(options)
    }
}
