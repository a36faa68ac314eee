//! `tally token`: mints a development token (HS256) from a secret file, so a replica run
//! with `--auth jwt --auth-secret-file F` can be tried with curl in a minute:
//!
//! ```text
//! tally token --secret-file F --sub alice --scope accounts:write
//! ```
//!
//! Production tokens come from the operator's identity provider, not from here.

use std::path::PathBuf;
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::json;
use uuid::Uuid;

use super::keys::{self, MIN_SECRET_BYTES};
use super::{DEFAULT_AUDIENCE, DEFAULT_ISSUER, Scope};

/// The longest lifetime of a development token, in seconds (a week).
pub const MAX_TTL_SECS: u64 = 7 * 86_400;

/// Mint a development bearer token (HS256) from a secret file; prints it on stdout.
#[derive(Clone, Debug, Parser)]
#[command(name = "tally token")]
pub struct TokenArgs {
    /// The file holding the shared secret (the replica's --auth-secret-file).
    #[arg(long, env = "TALLY_AUTH_SECRET_FILE")]
    pub secret_file: PathBuf,

    /// The caller the token names (`sub`).
    #[arg(long, default_value = "dev")]
    pub sub: String,

    /// A scope to grant (repeatable): accounts:read, accounts:write, devices:sync.
    /// Default: accounts:read and accounts:write.
    #[arg(long = "scope")]
    pub scopes: Vec<String>,

    /// An account the caller may touch (repeatable). Default: any account.
    #[arg(long = "account")]
    pub accounts: Vec<Uuid>,

    /// The issuer (`iss`); must match the replica's --auth-issuer.
    #[arg(long, env = "TALLY_AUTH_ISSUER", default_value = DEFAULT_ISSUER)]
    pub issuer: String,

    /// The audience (`aud`); must match the replica's --auth-audience.
    #[arg(long, env = "TALLY_AUTH_AUDIENCE", default_value = DEFAULT_AUDIENCE)]
    pub audience: String,

    /// Seconds until the token expires.
    #[arg(long, default_value_t = 3600)]
    pub ttl_secs: u64,
}

impl TokenArgs {
    /// The token, or why it cannot be minted.
    pub fn mint(&self) -> Result<String, String> {
        if self.ttl_secs == 0 || self.ttl_secs > MAX_TTL_SECS {
            return Err(format!("--ttl-secs must be 1..={MAX_TTL_SECS}"));
        }
        // What the server accepts: never print a token every replica refuses.
        if self.sub.is_empty() || self.sub.len() > super::MAX_SUB_BYTES {
            return Err(format!("--sub must be 1 to {} bytes", super::MAX_SUB_BYTES));
        }
        let scopes: Vec<&str> = if self.scopes.is_empty() {
            vec![Scope::AccountsRead.as_str(), Scope::AccountsWrite.as_str()]
        } else {
            self.scopes.iter().map(String::as_str).collect()
        };
        if let Some(bad) = scopes.iter().find(|s| Scope::parse(s).is_none()) {
            return Err(format!(
                "unknown scope {bad:?}; known: accounts:read, accounts:write, devices:sync"
            ));
        }
        let secret = secret_from(&self.secret_file)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_err(|e| e.to_string())?
            .as_secs();
        let mut claims = json!({
            "sub": self.sub,
            "scope": scopes.join(" "),
            "iss": self.issuer,
            "aud": self.audience,
            "iat": now,
            "nbf": now,
            "exp": now + self.ttl_secs,
        });
        if !self.accounts.is_empty() {
            claims["accounts"] = json!(self.accounts);
        }
        let key = EncodingKey::from_secret(&secret).map_err(|e| format!("unusable secret: {e}"))?;
        jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key)
            .map_err(|e| format!("cannot sign the token: {e}"))
    }
}

/// The secret as the replica reads it (trimmed), checked the same way.
fn secret_from(path: &std::path::Path) -> Result<Vec<u8>, String> {
    // The same checks as the replica's, so a token minted here is one it can verify.
    keys::Keys::secret_file(path)?;
    let bytes = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let secret = bytes.trim_ascii().to_vec();
    debug_assert!(secret.len() >= MIN_SECRET_BYTES);
    Ok(secret)
}
