//! The idempotency key: the caller's name for one intent, sent with every attempt of a write.

use std::fmt;

use crate::Error;

/// Longest key Tally accepts.
pub const MAX_KEY_LEN: usize = 255;

/// A key for one write: 1 to [`MAX_KEY_LEN`] visible ASCII characters (the bare form; the
/// server's quoted form, which may hold spaces, is not needed from Rust), sent byte for byte on
/// every attempt (with `--auth jwt` a key's other spellings are other keys, so it is never
/// normalised).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IdempotencyKey(String);

impl IdempotencyKey {
    /// A fresh random key (a UUIDv4), for a write the caller did not name.
    pub fn mint() -> Self {
        IdempotencyKey(uuid::Uuid::new_v4().to_string())
    }

    /// Checks `key` against what Tally accepts, so a bad key fails here, before any send.
    pub fn new(key: impl Into<String>) -> Result<Self, Error> {
        let key = key.into();
        let visible = |b: u8| (0x21..=0x7e).contains(&b);
        if key.is_empty() || key.len() > MAX_KEY_LEN || !key.bytes().all(visible) {
            return Err(Error::InvalidKey(key));
        }
        Ok(IdempotencyKey(key))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<uuid::Uuid> for IdempotencyKey {
    fn from(id: uuid::Uuid) -> Self {
        IdempotencyKey(id.to_string())
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_tally_refuses_are_refused_before_sending() {
        for bad in ["", "has space", "tab\t", "é", &"k".repeat(MAX_KEY_LEN + 1)] {
            assert!(IdempotencyKey::new(bad).is_err(), "{bad:?}");
        }
        for good in ["k", "order-42", "{x}", &"k".repeat(MAX_KEY_LEN)] {
            assert_eq!(IdempotencyKey::new(good).unwrap().as_str(), good);
        }
    }

    #[test]
    fn minted_keys_differ() {
        assert_ne!(IdempotencyKey::mint(), IdempotencyKey::mint());
    }
}
