//! The authentication flags: how requests are authenticated and paced.

use super::rate::{
    DEFAULT_AUTH_FAILURES_PER_MINUTE, DEFAULT_BURST_PER_CALLER, DEFAULT_RATE_PER_CALLER,
};
use super::{AuthMode, DEFAULT_AUDIENCE, DEFAULT_ISSUER, DEFAULT_LEEWAY_SECS, MAX_RATE_PER_CALLER};
use clap::builder::RangedU64ValueParser;

/// How to authenticate, and each caller's pace. The rate limits are checked in
/// range whatever `--auth`: a value no replica could use is a typo either way.
#[derive(Clone, Debug, PartialEq, Eq, clap::Args)]
#[command(next_help_heading = "Auth")]
pub struct AuthConfig {
    /// Whether API requests must carry a bearer token (JWT); `none` is for development.
    #[arg(long = "auth", value_name = "AUTH", env = "TALLY_AUTH", value_enum, value_parser = crate::flag::named::<AuthMode>(), default_value_t = AuthMode::None)]
    pub mode: AuthMode,

    /// With `--auth jwt`: a file holding the HS256 shared secret (at least 32 bytes).
    #[arg(
        long = "auth-secret-file",
        value_name = "AUTH_SECRET_FILE",
        env = "TALLY_AUTH_SECRET_FILE"
    )]
    pub secret_file: Option<std::path::PathBuf>,

    /// With `--auth jwt`: a JWKS file of public keys, reread when it changes.
    #[arg(
        long = "auth-jwks-file",
        value_name = "AUTH_JWKS_FILE",
        env = "TALLY_AUTH_JWKS_FILE"
    )]
    pub jwks_file: Option<std::path::PathBuf>,

    /// The issuer (`iss`) tokens must name.
    #[arg(long = "auth-issuer", value_name = "AUTH_ISSUER", env = "TALLY_AUTH_ISSUER", default_value = DEFAULT_ISSUER)]
    pub issuer: String,

    /// The audience (`aud`) tokens must name.
    #[arg(long = "auth-audience", value_name = "AUTH_AUDIENCE", env = "TALLY_AUTH_AUDIENCE", default_value = DEFAULT_AUDIENCE)]
    pub audience: String,

    /// Clock skew allowed on a token's `exp` and `nbf`, in seconds.
    #[arg(long = "auth-leeway-secs", value_name = "AUTH_LEEWAY_SECS", env = "TALLY_AUTH_LEEWAY_SECS", default_value_t = DEFAULT_LEEWAY_SECS)]
    pub leeway_secs: u64,

    /// With `--auth jwt`: requests a second per caller on this replica (0: no limit).
    #[arg(long = "rate-limit-per-caller", value_name = "RATE_LIMIT_PER_CALLER", env = "TALLY_RATE_LIMIT_PER_CALLER", default_value_t = DEFAULT_RATE_PER_CALLER, value_parser = RangedU64ValueParser::<u32>::new().range(0..=u64::from(MAX_RATE_PER_CALLER)))]
    pub rate_per_caller: u32,

    /// The burst each caller may make at once (raised to the per-second rate if below).
    #[arg(long = "rate-limit-burst", value_name = "RATE_LIMIT_BURST", env = "TALLY_RATE_LIMIT_BURST", default_value_t = DEFAULT_BURST_PER_CALLER, value_parser = RangedU64ValueParser::<u32>::new().range(0..=u64::from(MAX_RATE_PER_CALLER)))]
    pub rate_burst: u32,

    /// With `--auth jwt`: failed authentications a minute per peer address (0: no limit).
    #[arg(long = "auth-failures-per-minute", value_name = "AUTH_FAILURES_PER_MINUTE", env = "TALLY_AUTH_FAILURES_PER_MINUTE", default_value_t = DEFAULT_AUTH_FAILURES_PER_MINUTE, value_parser = RangedU64ValueParser::<u32>::new().range(0..=u64::from(MAX_RATE_PER_CALLER)))]
    pub failures_per_minute: u32,
}
