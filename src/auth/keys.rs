//! The keys tokens are checked against: a shared secret (HS256) read once at start, or a
//! JWKS file of public keys (RS256, ES256, EdDSA) that is reread when its contents change,
//! so keys rotate without a restart.
//!
//! A JWKS key is used only with a `kid` (tokens name the key that signed them) and only
//! with the one algorithm its type implies (RSA → RS256, P-256 → ES256, Ed25519 → EdDSA;
//! a key whose `alg` says otherwise is skipped). A reread that fails (unreadable, not
//! JSON, no usable key) keeps the keys in use and logs a warning: a half-written file
//! never locks every caller out.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet};
use jsonwebtoken::{Algorithm, DecodingKey};
use parking_lot::{Mutex, RwLock};
use sha2::{Digest, Sha256};

use super::{ASYMMETRIC_ALGORITHMS, AuthError};

/// The shortest HS256 secret accepted, in bytes (the hash's own size).
pub const MIN_SECRET_BYTES: usize = 32;
/// The largest key file read, in bytes.
pub const MAX_KEY_FILE_BYTES: u64 = 1024 * 1024;
/// How often the JWKS file is checked for changes.
pub const JWKS_RELOAD_INTERVAL: Duration = Duration::from_secs(2);

pub enum Keys {
    Secret(DecodingKey),
    Jwks(JwksFile),
}

pub struct JwksFile {
    path: PathBuf,
    loaded: RwLock<Loaded>,
    /// Bumped on every change of the keys, so a long-lived holder of a token (a watch
    /// stream) checks its key again only when something changed.
    generation: AtomicU64,
    /// The digest of the last contents that could not be used, and why: not parsed again
    /// (nor its skipped keys logged again) until the file changes.
    refused: Mutex<Option<([u8; 32], String)>>,
}

struct Loaded {
    digest: [u8; 32],
    keys: HashMap<String, JwksKey>,
}

/// One usable JWKS key.
struct JwksKey {
    key: DecodingKey,
    alg: Algorithm,
    /// A digest of the key's material: a key replaced under the same kid is another key.
    material: KeyMaterial,
}

/// Which key checked a token: the digest of a JWKS key's material (a shared secret, read
/// once, never changes: all zeroes).
pub type KeyMaterial = [u8; 32];

impl Keys {
    /// HS256 with the secret in this file.
    pub fn secret_file(path: &Path) -> Result<Keys, String> {
        let bytes = read_bounded(path)?;
        let secret = bytes.trim_ascii();
        if secret.len() < MIN_SECRET_BYTES {
            return Err(format!(
                "the secret in {} must be at least {MIN_SECRET_BYTES} bytes",
                path.display()
            ));
        }
        DecodingKey::from_secret(secret)
            .map(Keys::Secret)
            .map_err(|e| format!("the secret in {} is unusable: {e}", path.display()))
    }

    /// The public keys in this JWKS file; at least one must be usable.
    pub fn jwks_file(path: &Path) -> Result<Keys, String> {
        let bytes = read_bounded(path)?;
        let loaded = parse_jwks(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        if loaded.keys.is_empty() {
            return Err(format!("{}: the key set is empty", path.display()));
        }
        Ok(Keys::Jwks(JwksFile {
            path: path.to_owned(),
            loaded: RwLock::new(loaded),
            generation: AtomicU64::new(0),
            refused: Mutex::new(None),
        }))
    }

    /// The key and algorithm a token with this header is checked with, and which key that
    /// is ([`KeyMaterial`]).
    pub fn key_for(
        &self,
        kid: Option<&str>,
        alg: Algorithm,
    ) -> Result<(DecodingKey, Algorithm, KeyMaterial), AuthError> {
        match self {
            Keys::Secret(key) if alg == Algorithm::HS256 => Ok((key.clone(), alg, [0; 32])),
            Keys::Secret(_) => Err(AuthError::Invalid("algorithm not allowed")),
            Keys::Jwks(file) => {
                let kid = kid.ok_or(AuthError::Invalid("the token names no key id"))?;
                let loaded = file.loaded.read();
                let k = loaded
                    .keys
                    .get(kid)
                    .ok_or(AuthError::Invalid("unknown key id"))?;
                if k.alg != alg {
                    return Err(AuthError::Invalid("algorithm not allowed"));
                }
                Ok((k.key.clone(), alg, k.material))
            }
        }
    }

    /// Rereads the JWKS file; `Ok(true)` when its keys changed. A secret never changes. An
    /// explicitly empty key set (`{"keys":[]}`) revokes every key: every token is refused
    /// until keys return. A file that does not parse, or whose keys are all unusable, keeps
    /// the keys in use.
    pub fn reload(&self) -> Result<bool, String> {
        let Keys::Jwks(file) = self else {
            return Ok(false);
        };
        let bytes = read_bounded(&file.path)?;
        let digest: [u8; 32] = Sha256::digest(&bytes).into();
        if digest == file.loaded.read().digest {
            return Ok(false);
        }
        if let Some((seen, why)) = file.refused.lock().as_ref()
            && *seen == digest
        {
            return Err(why.clone());
        }
        match parse_jwks(&bytes) {
            Ok(loaded) => {
                *file.loaded.write() = loaded;
                file.generation.fetch_add(1, Ordering::SeqCst);
                *file.refused.lock() = None;
                Ok(true)
            }
            Err(why) => {
                *file.refused.lock() = Some((digest, why.clone()));
                Err(why)
            }
        }
    }

    /// Changes with every reload that changed the keys (always 0 for a secret).
    pub fn generation(&self) -> u64 {
        match self {
            Keys::Secret(_) => 0,
            Keys::Jwks(file) => file.generation.load(Ordering::SeqCst),
        }
    }

    /// Whether a token checked with this key (id, algorithm and material) would still be
    /// checked with the same key: a JWKS reload that removed it, or replaced its material
    /// under the same kid, revoked it.
    pub fn still_has(&self, kid: Option<&str>, alg: Algorithm, material: &KeyMaterial) -> bool {
        match self {
            Keys::Secret(_) => alg == Algorithm::HS256,
            Keys::Jwks(file) => kid.is_some_and(|kid| {
                file.loaded
                    .read()
                    .keys
                    .get(kid)
                    .is_some_and(|k| k.alg == alg && k.material == *material)
            }),
        }
    }

    /// How many keys are in use.
    pub fn len(&self) -> usize {
        match self {
            Keys::Secret(_) => 1,
            Keys::Jwks(file) => file.loaded.read().keys.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Rereads a JWKS file every `every` until the keys are dropped. Holds only a weak
/// reference, so it ends with the replica.
pub fn spawn_reloader(keys: Weak<Keys>, every: Duration) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // A file that stays unusable is reported once, not every tick.
        let mut reported: Option<String> = None;
        loop {
            tick.tick().await;
            let Some(keys) = keys.upgrade() else { return };
            // A small file, read off the async workers.
            let result = tokio::task::spawn_blocking({
                let keys = Arc::clone(&keys);
                move || keys.reload()
            })
            .await;
            match result {
                Ok(Ok(true)) if keys.is_empty() => {
                    reported = None;
                    tracing::warn!("JWKS file holds no keys: every token is refused until it does")
                }
                Ok(Ok(true)) => {
                    reported = None;
                    tracing::info!(keys = keys.len(), "JWKS file changed: keys reloaded")
                }
                Ok(Ok(false)) => reported = None,
                Ok(Err(e)) if reported.as_ref() != Some(&e) => {
                    tracing::warn!(error = %e, "JWKS file unusable; keeping the keys in use");
                    reported = Some(e);
                }
                Ok(Err(_)) => {}
                Err(e) => tracing::warn!(error = %e, "JWKS reload task failed"),
            }
        }
    })
}

fn read_bounded(path: &Path) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.len() > MAX_KEY_FILE_BYTES {
        return Err(format!(
            "{} is larger than {MAX_KEY_FILE_BYTES} bytes",
            path.display()
        ));
    }
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn parse_jwks(bytes: &[u8]) -> Result<Loaded, String> {
    let set: JwkSet =
        serde_json::from_slice(bytes).map_err(|e| format!("not a JWKS document: {e}"))?;
    let keys: HashMap<_, _> = set
        .keys
        .iter()
        .filter_map(|jwk| {
            let usable = usable(jwk);
            if usable.is_none() {
                tracing::warn!(
                    kid = jwk.common.key_id.as_deref().unwrap_or(""),
                    "JWKS key skipped: needs a kid and an RSA, P-256 or Ed25519 key (RS256, ES256, EdDSA)"
                );
            }
            usable
        })
        .collect();
    // An empty set is the operator's word (revoke every key); keys that are all unusable are
    // a mistake, and refused.
    if keys.is_empty() && !set.keys.is_empty() {
        return Err("no usable key (RS256, ES256 or EdDSA, each with a kid)".into());
    }
    Ok(Loaded {
        digest: Sha256::digest(bytes).into(),
        keys,
    })
}

fn usable(jwk: &Jwk) -> Option<(String, JwksKey)> {
    let kid = jwk.common.key_id.clone()?;
    let alg = match &jwk.algorithm {
        AlgorithmParameters::RSA(_) => Algorithm::RS256,
        AlgorithmParameters::EllipticCurve(p) if p.curve == EllipticCurve::P256 => Algorithm::ES256,
        AlgorithmParameters::OctetKeyPair(p) if p.curve == EllipticCurve::Ed25519 => {
            Algorithm::EdDSA
        }
        _ => return None,
    };
    debug_assert!(ASYMMETRIC_ALGORITHMS.contains(&alg));
    if let Some(stated) = jwk.common.key_algorithm
        && stated.to_string() != format!("{alg:?}")
    {
        return None;
    }
    let key = DecodingKey::from_jwk(jwk).ok()?;
    let params = serde_json::to_vec(&jwk.algorithm).ok()?;
    let material = Sha256::digest(&params).into();
    Some((kid, JwksKey { key, alg, material }))
}
