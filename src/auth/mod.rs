//! Who is calling: bearer tokens (JWT) checked against a shared secret (HS256) or a JWKS
//! file (RS256, ES256, EdDSA), the caller they name, what it may do, and how often.
//!
//! This layer knows nothing of HTTP: it turns an `Authorization` header value into a
//! [`Caller`] or an [`AuthError`]; `http::auth` decides which routes need which [`Scope`]
//! and maps the errors to 401, 403 and 429. No token, and no part of one, is ever logged or
//! put in an error message: reasons are fixed phrases.
//!
//! Claims: `sub` (the caller), `scope` (space-separated, as in OAuth: `accounts:read`,
//! `accounts:write`, `devices:sync`), optionally `accounts` (the account ids the caller may
//! touch; absent means any), and `iss`, `aud`, `exp` (all required) and `nbf` (checked when
//! present), with [`DEFAULT_LEEWAY_SECS`] of clock skew allowed unless configured.

pub mod config;
pub mod keys;
pub mod mint;
pub mod rate;

pub use config::AuthConfig;

use std::sync::Arc;
use std::time::Duration;

use clap::ValueEnum;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, Validation};
use serde::Deserialize;
use uuid::Uuid;

use keys::{KeyMaterial, Keys};
use rate::{CallerLimiter, PeerFailureLimiter};

/// Clock skew allowed on `exp` and `nbf`, in seconds, unless configured: enough for hosts
/// kept in step by NTP, short enough that an expired token stops working within a minute.
pub const DEFAULT_LEEWAY_SECS: u64 = 30;
/// The largest `--auth-leeway-secs` accepted.
pub const MAX_LEEWAY_SECS: u64 = 300;
/// The largest `--rate-limit-per-caller` and `--rate-limit-burst` accepted (`config.rs`): a
/// caller at a million requests a second on one replica is no limit, so a larger value is a
/// typo.
pub const MAX_RATE_PER_CALLER: u32 = 1_000_000;
/// The longest bearer token read, in bytes; a longer one is refused unread.
pub const MAX_TOKEN_BYTES: usize = 8 * 1024;
/// The longest caller id (`sub`) accepted, in bytes.
pub const MAX_SUB_BYTES: usize = 255;
/// The most account ids one token may list.
pub const MAX_TOKEN_ACCOUNTS: usize = 1024;
/// The issuer (`iss`) expected unless configured: development tokens from `tally token`.
pub const DEFAULT_ISSUER: &str = "tally-dev";
/// The audience (`aud`) expected unless configured.
pub const DEFAULT_AUDIENCE: &str = "tally";
/// The realm named in `WWW-Authenticate`.
pub const REALM: &str = "tally";
/// Why a token without a usable `exp`, `iss`, `aud` or `sub` is refused.
const MISSING_OR_MALFORMED_CLAIM: &str = "a required claim is missing or malformed";

/// Whether requests must prove who they are.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum AuthMode {
    /// Anyone who reaches the replica may do anything (development; the default).
    None,
    /// Every API request carries a valid bearer token (JWT).
    Jwt,
}

/// What a caller may do. A token grants scopes by name in its `scope` claim.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// Read balances, histories and the account list.
    AccountsRead,
    /// Deposit, withdraw and transfer.
    AccountsWrite,
    /// Sync an offline device's run (the token's `sub` must be the device id).
    DevicesSync,
}

impl Scope {
    pub const ALL: [Scope; 3] = [
        Scope::AccountsRead,
        Scope::AccountsWrite,
        Scope::DevicesSync,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::AccountsRead => "accounts:read",
            Scope::AccountsWrite => "accounts:write",
            Scope::DevicesSync => "devices:sync",
        }
    }

    pub fn parse(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|s| s.as_str() == name)
    }
}

/// An authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Caller {
    /// The token's `sub`.
    pub id: String,
    scopes: Vec<Scope>,
    /// The accounts the caller may touch; `None` is any.
    accounts: Option<Vec<Uuid>>,
    /// When the token stops being accepted (its `exp` plus the leeway), as Unix seconds: a
    /// watch stream opened with it ends then. `None` for a caller made without a token.
    expires_at: Option<u64>,
    /// The key id and algorithm its token was checked with: a watch stream opened with it
    /// ends when a reload removes that key. `None` for a caller made without a token.
    signed_with: Option<(Option<String>, Algorithm, KeyMaterial)>,
}

impl Caller {
    pub fn new(id: impl Into<String>, scopes: Vec<Scope>, accounts: Option<Vec<Uuid>>) -> Self {
        Self {
            id: id.into(),
            scopes,
            accounts,
            expires_at: None,
            signed_with: None,
        }
    }

    /// The caller, whose token was checked with this key (id and algorithm).
    pub fn signed_with(self, kid: Option<String>, alg: Algorithm, material: KeyMaterial) -> Self {
        Self {
            signed_with: Some((kid, alg, material)),
            ..self
        }
    }

    /// Whether the key its token was checked with is still in `keys` (true for a caller
    /// made without a token).
    pub fn key_still_in(&self, keys: &Keys) -> bool {
        self.signed_with
            .as_ref()
            .is_none_or(|(kid, alg, material)| keys.still_has(kid.as_deref(), *alg, material))
    }

    /// The caller, whose token is accepted until `expires_at` (Unix seconds).
    pub fn expiring_at(self, expires_at: u64) -> Self {
        Self {
            expires_at: Some(expires_at),
            ..self
        }
    }

    /// How long the caller's token is still accepted, from now (zero when it no longer is);
    /// `None` when it has no expiry.
    pub fn time_left(&self) -> Option<Duration> {
        // The validator's own clock, which judged `exp` when the token was checked.
        let now = jsonwebtoken::get_current_timestamp();
        self.expires_at
            .map(|at| Duration::from_secs(at.saturating_sub(now)))
    }

    pub fn has(&self, scope: Scope) -> bool {
        self.scopes.contains(&scope)
    }

    /// Whether the caller may read this account's balance: the scope, and the account listed.
    pub fn may_read(&self, account: Uuid) -> bool {
        self.has(Scope::AccountsRead) && self.may_touch(account)
    }

    pub fn may_touch(&self, account: Uuid) -> bool {
        self.accounts.as_ref().is_none_or(|a| a.contains(&account))
    }

    /// Whether the caller may touch every account (its token names none): what the
    /// fleet-wide watch stream, which shows every account's writes, needs.
    pub fn may_touch_all(&self) -> bool {
        self.accounts.is_none()
    }
}

/// Why a request is not let through. Reasons are fixed phrases: never token contents.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("this request needs a bearer token (Authorization: Bearer <JWT>)")]
    Missing,
    #[error("the bearer token was refused: {0}")]
    Invalid(&'static str),
    #[error("the token lacks the scope {}", .0.as_str())]
    Scope(Scope),
    #[error("the token does not grant access to this {0}")]
    Resource(&'static str),
}

/// The claims Tally reads beyond the registered ones the validator checks.
#[derive(Deserialize)]
struct Claims {
    sub: String,
    /// Required and checked by the validator (which names it missing, so it is optional
    /// here); kept to end streams when it passes. A NumericDate may carry a fraction.
    #[serde(default)]
    exp: Option<f64>,
    #[serde(default)]
    scope: String,
    #[serde(default, deserialize_with = "listed")]
    accounts: Option<Vec<Uuid>>,
}

/// `accounts`, when present, is a list: `null` is refused like any other malformed value,
/// never read as "no restriction" (else it would grant every account).
fn listed<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Vec<Uuid>>, D::Error> {
    Vec::<Uuid>::deserialize(d).map(Some)
}

/// Checks tokens and paces callers; with [`AuthMode::None`], lets everything through.
pub struct Authenticator {
    mode: AuthMode,
    keys: Option<Arc<Keys>>,
    issuer: String,
    audience: String,
    leeway: u64,
    limiter: Option<CallerLimiter>,
    failures: Option<PeerFailureLimiter>,
}

impl Authenticator {
    /// Reads the key material (a secret file or a JWKS file); refuses a configuration that
    /// cannot check a token.
    pub fn new(config: &AuthConfig) -> Result<Self, String> {
        let keys = match config.mode {
            AuthMode::None => None,
            AuthMode::Jwt => {
                if config.issuer.is_empty() || config.audience.is_empty() {
                    return Err("--auth jwt needs --auth-issuer and --auth-audience".into());
                }
                if config.leeway_secs > MAX_LEEWAY_SECS {
                    return Err(format!("--auth-leeway-secs must be 0..={MAX_LEEWAY_SECS}"));
                }
                Some(Arc::new(match (&config.secret_file, &config.jwks_file) {
                    (Some(secret), None) => Keys::secret_file(secret)?,
                    (None, Some(jwks)) => Keys::jwks_file(jwks)?,
                    _ => {
                        return Err(
                            "--auth jwt needs exactly one of --auth-secret-file and --auth-jwks-file"
                                .into(),
                        );
                    }
                }))
            }
        };
        let limiter = match (config.mode, config.rate_per_caller) {
            (AuthMode::Jwt, n) if n > 0 => Some(CallerLimiter::new(n, config.rate_burst.max(n))),
            _ => None,
        };
        let failures = match (config.mode, config.failures_per_minute) {
            (AuthMode::Jwt, n) if n > 0 => Some(PeerFailureLimiter::new(n)),
            _ => None,
        };
        Ok(Self {
            mode: config.mode,
            keys,
            issuer: config.issuer.clone(),
            audience: config.audience.clone(),
            leeway: config.leeway_secs,
            limiter,
            failures,
        })
    }

    pub fn mode(&self) -> AuthMode {
        self.mode
    }

    pub fn is_on(&self) -> bool {
        self.mode == AuthMode::Jwt
    }

    /// The key set, for the reloader.
    pub fn keys(&self) -> Option<&Arc<Keys>> {
        self.keys.as_ref()
    }

    /// The caller a request's `Authorization` header value proves, or why not.
    pub fn verify(&self, authorization: Option<&[u8]>) -> Result<Caller, AuthError> {
        let Some(keys) = &self.keys else {
            return Err(AuthError::Invalid("authentication is off"));
        };
        let raw = authorization.ok_or(AuthError::Missing)?;
        if raw.len() > MAX_TOKEN_BYTES + 7 {
            return Err(AuthError::Invalid("token too long"));
        }
        let value = std::str::from_utf8(raw).map_err(|_| AuthError::Invalid("not a token"))?;
        // Another scheme (Basic, say) carries no bearer token: answered as none at all, with
        // no error code (RFC 6750, section 3.1).
        let (scheme, token) = value.trim().split_once(' ').unwrap_or((value.trim(), ""));
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(AuthError::Missing);
        }
        let token = token.trim();
        if token.is_empty() {
            return Err(AuthError::Invalid("the Bearer scheme without a token"));
        }
        let header = jsonwebtoken::decode_header(token)
            .map_err(|_| AuthError::Invalid("malformed token or unsupported algorithm"))?;
        let (key, alg, material) = keys.key_for(header.kid.as_deref(), header.alg)?;
        let mut v = Validation::new(alg);
        v.algorithms = vec![alg];
        v.leeway = self.leeway;
        v.validate_exp = true;
        v.validate_nbf = true;
        v.set_audience(&[&self.audience]);
        v.set_issuer(&[&self.issuer]);
        v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
        let data = jsonwebtoken::decode::<Claims>(token, &key, &v).map_err(|e| {
            AuthError::Invalid(match e.kind() {
                ErrorKind::ExpiredSignature => "token expired",
                ErrorKind::ImmatureSignature => "token not yet valid",
                ErrorKind::InvalidAudience => "wrong audience",
                ErrorKind::InvalidIssuer => "wrong issuer",
                ErrorKind::InvalidSignature => "bad signature",
                ErrorKind::InvalidAlgorithm => "algorithm not allowed",
                // The validator reads a claim it cannot parse (an `exp` past u64, or
                // negative) as absent (else the message would say only missing).
                ErrorKind::MissingRequiredClaim(_) => MISSING_OR_MALFORMED_CLAIM,
                _ => "malformed token",
            })
        })?;
        // The validator refused a token without `exp`; float to integer saturates, and a
        // negative or NaN `exp` was refused as expired or malformed.
        let exp = data
            .claims
            .exp
            .ok_or(AuthError::Invalid(MISSING_OR_MALFORMED_CLAIM))?;
        let expires_at = (exp as u64).saturating_add(self.leeway);
        Ok(caller_from(data.claims)?
            .expiring_at(expires_at)
            .signed_with(header.kid, alg, material))
    }

    /// Takes one request from the caller's allowance; `Err` is how long until the next
    /// one is allowed.
    pub fn admit(&self, caller: &Caller) -> Result<(), Duration> {
        match &self.limiter {
            Some(l) => l.check(&caller.id),
            None => Ok(()),
        }
    }

    /// Counts a failed authentication of `peer`; `Err` is how long until its next failure
    /// is allowed (past its allowance).
    pub fn note_failure(&self, peer: std::net::IpAddr) -> Result<(), Duration> {
        match &self.failures {
            Some(f) => f.fail(peer),
            None => Ok(()),
        }
    }

    /// Forgets callers and peers idle long enough to be back at a full allowance.
    pub fn forget_idle_callers(&self) {
        if let Some(l) = &self.limiter {
            l.forget_idle();
        }
        if let Some(f) = &self.failures {
            f.forget_idle();
        }
    }
}

/// Says at start, loudly, whether requests are authenticated, and starts the background
/// upkeep: rereading a JWKS file and forgetting idle callers' rate-limit buckets. Both tasks
/// hold weak references and end when the authenticator is dropped.
pub fn announce_and_maintain(auth: &Arc<Authenticator>) {
    match auth.mode {
        AuthMode::None => tracing::warn!(
            "AUTHENTICATION IS OFF (--auth none): anyone who can reach this replica can read \
             and move any account's money; run with --auth jwt outside development"
        ),
        AuthMode::Jwt => tracing::info!(
            issuer = %auth.issuer,
            audience = %auth.audience,
            leeway_secs = auth.leeway,
            keys = auth.keys.as_ref().map_or(0, |k| k.len()),
            jwks = matches!(auth.keys.as_deref(), Some(Keys::Jwks(_))),
            rate_limited = auth.limiter.is_some(),
            failures_limited = auth.failures.is_some(),
            "authentication is on (--auth jwt): API requests need a bearer token"
        ),
    }
    if let Some(keys) = &auth.keys
        && matches!(**keys, Keys::Jwks(_))
    {
        keys::spawn_reloader(Arc::downgrade(keys), keys::JWKS_RELOAD_INTERVAL);
    }
    if auth.limiter.is_some() || auth.failures.is_some() {
        let weak = Arc::downgrade(auth);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(rate::FORGET_IDLE_INTERVAL);
            loop {
                tick.tick().await;
                let Some(auth) = weak.upgrade() else { return };
                auth.forget_idle_callers();
            }
        });
    }
}

fn caller_from(claims: Claims) -> Result<Caller, AuthError> {
    if claims.sub.is_empty() || claims.sub.len() > MAX_SUB_BYTES {
        return Err(AuthError::Invalid("sub must be 1 to 255 bytes"));
    }
    if claims
        .accounts
        .as_ref()
        .is_some_and(|a| a.len() > MAX_TOKEN_ACCOUNTS)
    {
        return Err(AuthError::Invalid("too many accounts in the token"));
    }
    // Unknown scope names are someone else's: ignored, never an error.
    let scopes = claims
        .scope
        .split_whitespace()
        .filter_map(Scope::parse)
        .collect();
    Ok(Caller::new(claims.sub, scopes, claims.accounts))
}

/// The algorithms a JWKS key may use.
pub const ASYMMETRIC_ALGORITHMS: [Algorithm; 3] =
    [Algorithm::RS256, Algorithm::ES256, Algorithm::EdDSA];

#[cfg(test)]
mod tests;
