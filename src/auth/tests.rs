//! The verifier on its own: secrets, JWKS keys and their reload, and the claims read.

use std::path::PathBuf;

use jsonwebtoken::jwk::{Jwk, JwkSet};
use jsonwebtoken::{EncodingKey, Header};
use serde_json::{Value, json};

use super::*;

const SECRET: &[u8] = b"0123456789abcdef0123456789abcdef-unit";

/// An Ed25519 private key as PKCS#8 v1 DER: the fixed 16-byte prefix, then the seed.
fn ed25519_der(seed: u8) -> Vec<u8> {
    let mut der = vec![
        0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04,
        0x20,
    ];
    der.extend([seed; 32]);
    der
}

fn temp_file(name: &str, contents: &[u8]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("tally-auth-unit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

fn config(secret: Option<PathBuf>, jwks: Option<PathBuf>) -> AuthConfig {
    AuthConfig {
        mode: AuthMode::Jwt,
        secret_file: secret,
        jwks_file: jwks,
        issuer: "iss-test".into(),
        audience: "aud-test".into(),
        leeway_secs: 5,
        rate_per_caller: 0,
        rate_burst: 0,
        failures_per_minute: 0,
    }
}

fn now() -> u64 {
    jsonwebtoken::get_current_timestamp()
}

fn claims() -> Value {
    json!({"sub": "alice", "scope": "accounts:read other:thing", "iss": "iss-test",
           "aud": "aud-test", "exp": now() + 60})
}

fn hs(claims: &Value) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(SECRET).unwrap(),
    )
    .unwrap()
}

fn bearer(token: &str) -> Vec<u8> {
    format!("Bearer {token}").into_bytes()
}

#[test]
fn an_hs256_token_names_its_caller_and_scopes() {
    let auth = Authenticator::new(&config(Some(temp_file("s1", SECRET)), None)).unwrap();
    let caller = auth.verify(Some(&bearer(&hs(&claims())))).unwrap();
    assert_eq!(caller.id, "alice");
    assert!(caller.has(Scope::AccountsRead));
    assert!(!caller.has(Scope::AccountsWrite));
    assert!(caller.may_touch(Uuid::from_u128(1)));
    let mut limited = claims();
    limited["accounts"] = json!([Uuid::from_u128(1)]);
    let caller = auth.verify(Some(&bearer(&hs(&limited)))).unwrap();
    assert!(caller.may_touch(Uuid::from_u128(1)));
    assert!(!caller.may_touch(Uuid::from_u128(2)));
}

#[test]
fn every_bad_token_is_refused_with_its_reason() {
    let auth = Authenticator::new(&config(Some(temp_file("s2", SECRET)), None)).unwrap();
    let with = |f: &dyn Fn(&mut Value)| {
        let mut c = claims();
        f(&mut c);
        auth.verify(Some(&bearer(&hs(&c))))
    };
    let invalid = |r| Err(AuthError::Invalid(r));
    // A restriction that is present but null restricts like a malformed one: refused.
    let malformed_accounts = with(&|c| c["accounts"] = json!(0));
    assert!(malformed_accounts.is_err());
    assert_eq!(with(&|c| c["accounts"] = json!(null)), malformed_accounts);
    assert_eq!(
        with(&|c| c["exp"] = json!(now() - 60)),
        invalid("token expired")
    );
    // Within the leeway, an expired token still passes.
    assert!(with(&|c| c["exp"] = json!(now() - 2)).is_ok());
    assert_eq!(
        with(&|c| c["nbf"] = json!(now() + 60)),
        invalid("token not yet valid")
    );
    assert_eq!(
        with(&|c| c["aud"] = json!("other")),
        invalid("wrong audience")
    );
    assert_eq!(
        with(&|c| c["iss"] = json!("other")),
        invalid("wrong issuer")
    );
    assert_eq!(
        with(&|c| {
            c.as_object_mut().unwrap().remove("exp");
        }),
        invalid(MISSING_OR_MALFORMED_CLAIM)
    );
    for exp in [json!(-1), json!(u64::MAX as f64 * 2.0)] {
        assert_eq!(
            with(&|c| c["exp"] = exp.clone()),
            invalid(MISSING_OR_MALFORMED_CLAIM),
            "exp {exp}"
        );
    }
    assert_eq!(auth.verify(None), Err(AuthError::Missing));
    assert_eq!(
        auth.verify(Some(b"Basic dXNlcjpwdw==")),
        Err(AuthError::Missing),
        "another scheme carries no bearer token"
    );
    assert_eq!(
        auth.verify(Some(b"Bearer ")),
        invalid("the Bearer scheme without a token")
    );
    assert_eq!(
        auth.verify(Some(b"bearer")),
        invalid("the Bearer scheme without a token")
    );
    let forged = jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims(),
        &EncodingKey::from_secret(b"another secret of enough length, 32+").unwrap(),
    )
    .unwrap();
    assert_eq!(
        auth.verify(Some(&bearer(&forged))),
        invalid("bad signature")
    );
}

#[test]
fn a_short_secret_or_two_key_sources_are_refused_at_start() {
    assert!(Authenticator::new(&config(Some(temp_file("short", b"tiny")), None)).is_err());
    let s = temp_file("s3", SECRET);
    assert!(Authenticator::new(&config(Some(s.clone()), Some(s))).is_err());
    assert!(Authenticator::new(&config(None, None)).is_err());
}

fn ed_jwk(seed: u8, kid: &str) -> (EncodingKey, Jwk) {
    let key = EncodingKey::from_ed_der(&ed25519_der(seed));
    let mut jwk = Jwk::from_encoding_key(&key, Algorithm::EdDSA).unwrap();
    jwk.common.key_id = Some(kid.into());
    (key, jwk)
}

fn ed_token(key: &EncodingKey, kid: &str) -> String {
    let mut h = Header::new(Algorithm::EdDSA);
    h.kid = Some(kid.into());
    jsonwebtoken::encode(&h, &claims(), key).unwrap()
}

#[test]
fn jwks_keys_are_chosen_by_kid_and_reloaded_when_the_file_changes() {
    let (k1, j1) = ed_jwk(1, "one");
    let (k2, j2) = ed_jwk(2, "two");
    let write = |keys: Vec<Jwk>| serde_json::to_vec(&JwkSet { keys }).unwrap();
    let path = temp_file("jwks.json", &write(vec![j1.clone()]));
    let auth = Authenticator::new(&config(None, Some(path.clone()))).unwrap();
    auth.verify(Some(&bearer(&ed_token(&k1, "one")))).unwrap();
    assert_eq!(
        auth.verify(Some(&bearer(&ed_token(&k2, "two")))),
        Err(AuthError::Invalid("unknown key id"))
    );
    // A token signed by key two but naming key one fails its signature.
    assert_eq!(
        auth.verify(Some(&bearer(&ed_token(&k2, "one")))),
        Err(AuthError::Invalid("bad signature"))
    );
    // Rotation: key two joins, key one leaves.
    std::fs::write(&path, write(vec![j2])).unwrap();
    assert_eq!(auth.keys().unwrap().reload(), Ok(true));
    assert_eq!(auth.keys().unwrap().reload(), Ok(false), "unchanged file");
    auth.verify(Some(&bearer(&ed_token(&k2, "two")))).unwrap();
    assert!(auth.verify(Some(&bearer(&ed_token(&k1, "one")))).is_err());
    // A broken file keeps the keys in use, and is not parsed again until it changes.
    std::fs::write(&path, b"{not json").unwrap();
    let refused = auth.keys().unwrap().reload();
    assert!(refused.is_err());
    assert_eq!(
        auth.keys().unwrap().reload(),
        refused,
        "the same refusal, once parsed"
    );
    auth.verify(Some(&bearer(&ed_token(&k2, "two")))).unwrap();
    // An HS256 token is never accepted against a JWKS.
    assert_eq!(
        auth.verify(Some(&bearer(&hs(&claims())))),
        Err(AuthError::Invalid("the token names no key id"))
    );
    // An explicitly empty set revokes every key; keys coming back are used again.
    std::fs::write(&path, write(vec![])).unwrap();
    assert_eq!(auth.keys().unwrap().reload(), Ok(true));
    assert!(auth.keys().unwrap().is_empty());
    assert_eq!(
        auth.verify(Some(&bearer(&ed_token(&k2, "two")))),
        Err(AuthError::Invalid("unknown key id"))
    );
    std::fs::write(&path, write(vec![j1])).unwrap();
    assert_eq!(auth.keys().unwrap().reload(), Ok(true));
    auth.verify(Some(&bearer(&ed_token(&k1, "one")))).unwrap();
    // At start an empty set is a configuration that cannot check a token.
    let empty = temp_file("empty-jwks.json", &write(vec![]));
    assert!(Authenticator::new(&config(None, Some(empty))).is_err());
}

#[test]
fn with_auth_off_nothing_is_checked_and_nobody_is_paced() {
    let mut c = config(None, None);
    c.mode = AuthMode::None;
    c.rate_per_caller = 1;
    let auth = Authenticator::new(&c).unwrap();
    assert!(!auth.is_on());
    let anyone = Caller::new("x", vec![], None);
    for _ in 0..10 {
        auth.admit(&anyone).unwrap();
    }
}

/// RS256 and ES256 keys from a JWKS verify their own tokens, and neither accepts a token
/// that names its kid but was signed by the other key.
#[test]
fn rs256_and_es256_jwks_keys_verify_their_tokens() {
    let rsa = EncodingKey::from_rsa_der(include_bytes!("testdata/rs256-test-key.pk1.der"));
    let ec = EncodingKey::from_ec_der(include_bytes!("testdata/es256-test-key.pk8.der"));
    let mut rsa_jwk = Jwk::from_encoding_key(&rsa, Algorithm::RS256).unwrap();
    rsa_jwk.common.key_id = Some("rsa".into());
    let mut ec_jwk = Jwk::from_encoding_key(&ec, Algorithm::ES256).unwrap();
    ec_jwk.common.key_id = Some("ec".into());
    let set = JwkSet {
        keys: vec![rsa_jwk, ec_jwk],
    };
    let path = temp_file("jwks-rs-es.json", &serde_json::to_vec(&set).unwrap());
    let auth = Authenticator::new(&config(None, Some(path))).unwrap();
    let sign = |alg: Algorithm, kid: &str, key: &EncodingKey| {
        let mut h = Header::new(alg);
        h.kid = Some(kid.into());
        jsonwebtoken::encode(&h, &claims(), key).unwrap()
    };
    assert_eq!(
        auth.verify(Some(&bearer(&sign(Algorithm::RS256, "rsa", &rsa))))
            .unwrap()
            .id,
        "alice"
    );
    assert_eq!(
        auth.verify(Some(&bearer(&sign(Algorithm::ES256, "ec", &ec))))
            .unwrap()
            .id,
        "alice"
    );
    // The header's algorithm must be the key's.
    assert_eq!(
        auth.verify(Some(&bearer(&sign(Algorithm::ES256, "rsa", &ec)))),
        Err(AuthError::Invalid("algorithm not allowed"))
    );
    // PS256 over an RSA key is not RS256: refused.
    assert_eq!(
        auth.verify(Some(&bearer(&sign(Algorithm::PS256, "rsa", &rsa)))),
        Err(AuthError::Invalid("algorithm not allowed"))
    );
}
