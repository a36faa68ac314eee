//! The `Idempotency-Key` header: a caller's name for one intent.
//!
//! A UUID is the event id as is. Any other key of 1 to 255 visible ASCII characters (bare,
//! or as a quoted structured-field string `"..."`) maps to UUIDv5 of the key in
//! [`KEY_NAMESPACE`], so every replica derives the same id. A missing key is minted (a
//! random UUID) and sent back, so the caller can still retry safely. A key is never
//! silently replaced.
//!
//! Keys belong to their caller. With authentication on, the event id is UUIDv5,
//! in [`CALLER_KEY_NAMESPACE`], of the caller (`sub`, length-prefixed) and the key (a UUID
//! key too): the same key from two callers names two events, and a guessed key never
//! replays someone else's response. With authentication off there is no caller and the
//! derivation above holds, as in the service Tally replaces.

use hyper::HeaderMap;
use hyper::header::HeaderName;
use uuid::Uuid;

use super::error::{ApiError, ErrorCode};

pub const HEADER: &str = "idempotency-key";
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
pub const WINDOW_HEADER: &str = "idempotency-window";
/// How long a landed write's key is remembered, stated on every write answer as the window is.
pub const RETENTION_HEADER: &str = "idempotency-retention";
/// The headers' names, parsed once: an answer inserts them by name, and a `&str` would be
/// parsed on every insert.
pub const KEY_NAME: HeaderName = HeaderName::from_static(HEADER);
pub const REPLAYED_NAME: HeaderName = HeaderName::from_static(REPLAYED_HEADER);
pub const WINDOW_NAME: HeaderName = HeaderName::from_static(WINDOW_HEADER);
pub const RETENTION_NAME: HeaderName = HeaderName::from_static(RETENTION_HEADER);
/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;
/// The namespace opaque keys are hashed in: a fixed UUID chosen for Tally. Never change it:
/// every opaque key would name a different event id, and retries across the change would
/// write twice.
pub const KEY_NAMESPACE: Uuid = Uuid::from_u128(0x9b1b_4a3c_2d3f_5e8a_9c0d_1e2f_3a4b_5c6d);
/// The namespace (caller, key) pairs are hashed in when authentication is on. Never change
/// it, for the same reason.
pub const CALLER_KEY_NAMESPACE: Uuid = Uuid::from_u128(0x3c71_e0a4_5b26_4d8f_a1c9_7e52_0f3b_9d64);

/// A request's idempotency key and the event id it names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdempotencyKey {
    pub event_id: Uuid,
    /// The key (unquoted), or the minted one.
    pub key: String,
    /// The header value as the client sent it (quotes and escapes kept), echoed back so the
    /// client can resend it as is.
    pub echo: String,
    pub minted: bool,
}

impl IdempotencyKey {
    /// The request's key; `caller` is the authenticated caller's id, when there is one.
    pub fn from_headers(headers: &HeaderMap, caller: Option<&str>) -> Result<Self, ApiError> {
        let value = super::headers::at_most_one(headers, HEADER)
            .map_err(|_| invalid("send one Idempotency-Key header, not several"))?;
        let Some(value) = value else {
            let key = Uuid::new_v4().hyphenated().to_string();
            return Ok(Self {
                // Derived like a sent key's, so a retry that sends the minted key back
                // names the same event.
                event_id: event_id(&key, caller),
                echo: key.clone(),
                key,
                minted: true,
            });
        };
        let raw = value
            .to_str()
            .map_err(|_| invalid("the Idempotency-Key must be visible ASCII"))?;
        Self::parse(raw, caller)
    }

    /// A short, stable hash of the key for logs: enough to correlate a retry with its first
    /// attempt, never enough to recover the key.
    pub fn short_hash(&self) -> String {
        let id = self.event_id.as_u128();
        let mixed = (id as u64 ^ (id >> 64) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        format!("{:08x}", mixed >> 32)
    }

    pub fn parse(raw: &str, caller: Option<&str>) -> Result<Self, ApiError> {
        let key = unquote(raw)?;
        if key.is_empty() || key.chars().count() > MAX_KEY_LEN {
            return Err(invalid(&format!(
                "the Idempotency-Key must be 1 to {MAX_KEY_LEN} characters"
            )));
        }
        Ok(Self {
            event_id: event_id(&key, caller),
            key,
            echo: raw.to_owned(),
            minted: false,
        })
    }
}

/// The event id a key names: for a caller, UUIDv5 of (caller, key); without one, a UUID key
/// as is and any other key's UUIDv5.
fn event_id(key: &str, caller: Option<&str>) -> Uuid {
    match caller {
        Some(caller) => {
            // Length-prefixed, so no (caller, key) pair spells another's name.
            let mut name = Vec::with_capacity(4 + caller.len() + key.len());
            name.extend_from_slice(&(caller.len() as u32).to_be_bytes());
            name.extend_from_slice(caller.as_bytes());
            name.extend_from_slice(key.as_bytes());
            Uuid::new_v5(&CALLER_KEY_NAMESPACE, &name)
        }
        None => {
            Uuid::try_parse(key).unwrap_or_else(|_| Uuid::new_v5(&KEY_NAMESPACE, key.as_bytes()))
        }
    }
}

/// A bare key is visible ASCII without spaces; a quoted one (`"..."`) may hold spaces and
/// the escapes `\"` and `\\`.
fn unquote(raw: &str) -> Result<String, ApiError> {
    let Some(inner) = raw.strip_prefix('"') else {
        if raw.bytes().all(|b| b.is_ascii_graphic()) {
            return Ok(raw.to_owned());
        }
        return Err(invalid(
            "the Idempotency-Key must be visible ASCII (quote it to include spaces)",
        ));
    };
    let inner = inner
        .strip_suffix('"')
        .ok_or_else(|| invalid("unterminated quoted Idempotency-Key"))?;
    let mut out = String::with_capacity(inner.len());
    let mut chars = inner.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some(e @ ('"' | '\\')) => out.push(e),
                _ => return Err(invalid("bad escape in quoted Idempotency-Key")),
            },
            '"' => return Err(invalid("unescaped quote in quoted Idempotency-Key")),
            c if c == ' ' || c.is_ascii_graphic() => out.push(c),
            _ => return Err(invalid("the Idempotency-Key must be visible ASCII")),
        }
    }
    Ok(out)
}

fn invalid(message: &str) -> ApiError {
    ApiError::bad_request(ErrorCode::InvalidIdempotencyKey, message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_key_is_the_event_id_as_is() {
        let id = Uuid::new_v4();
        let k = IdempotencyKey::parse(&id.to_string(), None).unwrap();
        assert_eq!(k.event_id, id);
        assert!(!k.minted);
    }

    #[test]
    fn an_opaque_key_maps_to_a_stable_id_and_quotes_are_the_same_key() {
        let a = IdempotencyKey::parse("order-42", None).unwrap();
        let b = IdempotencyKey::parse("\"order-42\"", None).unwrap();
        assert_eq!(a.event_id, b.event_id);
        assert_eq!(a.event_id, Uuid::new_v5(&KEY_NAMESPACE, b"order-42"));
        assert_ne!(
            a.event_id,
            IdempotencyKey::parse("order-43", None).unwrap().event_id
        );
        assert_eq!(
            IdempotencyKey::parse(r#""a \"b\" c""#, None).unwrap().key,
            r#"a "b" c"#
        );
    }

    #[test]
    fn bad_keys_are_refused_never_replaced() {
        for bad in ["", "\"\"", "has space", "\"open", "\"bad\\x\"", "é"] {
            assert!(IdempotencyKey::parse(bad, None).is_err(), "{bad:?}");
        }
        assert!(IdempotencyKey::parse(&"k".repeat(MAX_KEY_LEN), None).is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(MAX_KEY_LEN + 1), None).is_err());
    }

    #[test]
    fn no_key_mints_one() {
        let k = IdempotencyKey::from_headers(&HeaderMap::new(), None).unwrap();
        assert!(k.minted);
        assert_eq!(Uuid::parse_str(&k.key).unwrap(), k.event_id);
    }

    #[test]
    fn with_a_caller_the_same_key_names_a_different_event_per_caller() {
        let id = Uuid::new_v4().to_string();
        for key in ["order-42", id.as_str()] {
            let alice = IdempotencyKey::parse(key, Some("alice")).unwrap();
            let bob = IdempotencyKey::parse(key, Some("bob")).unwrap();
            let anonymous = IdempotencyKey::parse(key, None).unwrap();
            assert_ne!(alice.event_id, bob.event_id, "{key}");
            assert_ne!(alice.event_id, anonymous.event_id, "{key}");
            // Stable: every replica derives the same id for the same caller and key.
            assert_eq!(
                alice.event_id,
                IdempotencyKey::parse(key, Some("alice")).unwrap().event_id
            );
        }
        // The length prefix keeps ("ab", "c") and ("a", "bc") apart.
        assert_ne!(
            IdempotencyKey::parse("c", Some("ab")).unwrap().event_id,
            IdempotencyKey::parse("bc", Some("a")).unwrap().event_id
        );
    }

    /// Rule: with a caller, a key is taken byte for byte (a UUID key's other spellings are
    /// other keys), and the mapping never changes between releases: a retry that crosses a
    /// rolling upgrade must name the same event on the old replica and the new one. The
    /// vector below was computed once; a change that moves it writes such retries twice.
    #[test]
    fn with_a_caller_a_key_maps_byte_for_byte_and_the_mapping_never_changes() {
        let lower = "7d3c2a10-1111-4222-8333-944455556666";
        let id = |key: &str| IdempotencyKey::parse(key, Some("alice")).unwrap().event_id;
        assert_eq!(id(lower), Uuid::parse_str(GOLDEN_ALICE_LOWER).unwrap());
        for other in [
            "7D3C2A10-1111-4222-8333-944455556666",
            "{7d3c2a10-1111-4222-8333-944455556666}",
            "urn:uuid:7d3c2a10-1111-4222-8333-944455556666",
        ] {
            assert_ne!(id(other), id(lower), "{other}");
        }
    }

    /// `event_id("7d3c2a10-1111-4222-8333-944455556666", caller "alice")`.
    const GOLDEN_ALICE_LOWER: &str = "1639823a-a2e0-5620-83ec-f83e16f139d0";

    #[test]
    fn a_minted_key_sent_back_names_the_same_event() {
        let minted = IdempotencyKey::from_headers(&HeaderMap::new(), Some("alice")).unwrap();
        assert!(minted.minted);
        let resent = IdempotencyKey::parse(&minted.key, Some("alice")).unwrap();
        assert_eq!(minted.event_id, resent.event_id);
    }
}
