//! The `Idempotency-Key` header: a caller's name for one intent.
//!
//! A UUID is the event id as is. Any other key of 1 to 255 visible ASCII characters (bare,
//! or as a quoted structured-field string `"..."`) maps to UUIDv5 of the key in
//! [`KEY_NAMESPACE`], so every replica derives the same id. A missing key is minted (a
//! random UUID) and sent back, so the caller can still retry safely. A key is never
//! silently replaced.

use hyper::HeaderMap;
use uuid::Uuid;

use super::error::ApiError;

pub const HEADER: &str = "idempotency-key";
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
pub const WINDOW_HEADER: &str = "idempotency-window";
/// The longest key accepted, in characters.
pub const MAX_KEY_LEN: usize = 255;
/// The namespace opaque keys are hashed in: a fixed UUID chosen for Tally. Never change it:
/// every opaque key would name a different event id, and retries across the change would
/// write twice.
pub const KEY_NAMESPACE: Uuid = Uuid::from_u128(0x9b1b_4a3c_2d3f_5e8a_9c0d_1e2f_3a4b_5c6d);

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
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, ApiError> {
        let mut values = headers.get_all(HEADER).iter();
        let Some(value) = values.next() else {
            let id = Uuid::new_v4();
            let key = id.hyphenated().to_string();
            return Ok(Self {
                event_id: id,
                echo: key.clone(),
                key,
                minted: true,
            });
        };
        if values.next().is_some() {
            return Err(invalid("send one Idempotency-Key header, not several"));
        }
        let raw = value
            .to_str()
            .map_err(|_| invalid("the Idempotency-Key must be visible ASCII"))?;
        Self::parse(raw)
    }

    /// A short, stable hash of the key for logs: enough to correlate a retry with its first
    /// attempt, never enough to recover the key.
    pub fn short_hash(&self) -> String {
        let id = self.event_id.as_u128();
        let mixed = (id as u64 ^ (id >> 64) as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        format!("{:08x}", mixed >> 32)
    }

    pub fn parse(raw: &str) -> Result<Self, ApiError> {
        let key = unquote(raw)?;
        if key.is_empty() || key.chars().count() > MAX_KEY_LEN {
            return Err(invalid(&format!(
                "the Idempotency-Key must be 1 to {MAX_KEY_LEN} characters"
            )));
        }
        let event_id = match Uuid::try_parse(&key) {
            Ok(uuid) => uuid,
            Err(_) => Uuid::new_v5(&KEY_NAMESPACE, key.as_bytes()),
        };
        Ok(Self {
            event_id,
            key,
            echo: raw.to_owned(),
            minted: false,
        })
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
    ApiError::bad_request("INVALID_IDEMPOTENCY_KEY", message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_key_is_the_event_id_as_is() {
        let id = Uuid::new_v4();
        let k = IdempotencyKey::parse(&id.to_string()).unwrap();
        assert_eq!(k.event_id, id);
        assert!(!k.minted);
    }

    #[test]
    fn an_opaque_key_maps_to_a_stable_id_and_quotes_are_the_same_key() {
        let a = IdempotencyKey::parse("order-42").unwrap();
        let b = IdempotencyKey::parse("\"order-42\"").unwrap();
        assert_eq!(a.event_id, b.event_id);
        assert_eq!(a.event_id, Uuid::new_v5(&KEY_NAMESPACE, b"order-42"));
        assert_ne!(
            a.event_id,
            IdempotencyKey::parse("order-43").unwrap().event_id
        );
        assert_eq!(
            IdempotencyKey::parse(r#""a \"b\" c""#).unwrap().key,
            r#"a "b" c"#
        );
    }

    #[test]
    fn bad_keys_are_refused_never_replaced() {
        for bad in ["", "\"\"", "has space", "\"open", "\"bad\\x\"", "é"] {
            assert!(IdempotencyKey::parse(bad).is_err(), "{bad:?}");
        }
        assert!(IdempotencyKey::parse(&"k".repeat(MAX_KEY_LEN)).is_ok());
        assert!(IdempotencyKey::parse(&"k".repeat(MAX_KEY_LEN + 1)).is_err());
    }

    #[test]
    fn no_key_mints_one() {
        let k = IdempotencyKey::from_headers(&HeaderMap::new()).unwrap();
        assert!(k.minted);
        assert_eq!(Uuid::parse_str(&k.key).unwrap(), k.event_id);
    }
}
