//! The account domain: identities, events and their codec, the fold, and the business rules.

pub mod events;
pub mod fold;
pub mod holds;
pub mod rules;

use std::fmt;
use std::str::FromStr;

use uuid::Uuid;

use crate::store::{AggregateKey, ClientId};

pub use events::{AccountEvent, CodecError};
pub use rules::{Operation, RuleError, Standing};

/// The namespace every default identity is derived in (UUIDv5 of a name), shared with the
/// existing account streams so that Tally can take them over.
pub const IDENTITY_NAMESPACE: Uuid = Uuid::from_u128(0xa1b2c3d4_e5f6_7890_abcd_ef1234567890);

/// The largest amount one operation may move, in cents. Existing account streams decode
/// `AmountCents` as a 32-bit integer, so anything larger would poison their readers.
pub const MAX_AMOUNT_CENTS: i64 = i32::MAX as i64;

/// UUIDv5 of `name` in [`IDENTITY_NAMESPACE`].
pub fn named_id(name: &str) -> Uuid {
    Uuid::new_v5(&IDENTITY_NAMESPACE, name.as_bytes())
}

/// Which ids take writes (`--accounts`). An account exists once its stream does: it was
/// opened (`POST /api/accounts`), or written while accounts were implicit (the demo seeds
/// among them), so turning explicit on keeps every account already in use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum AccountsMode {
    /// Every id is an account: a write to one never written creates it, as in the replaced
    /// service, which a migrating fleet may still run beside Tally.
    #[default]
    Implicit,
    /// A write, a transfer leg, a device run, a balance or a history of an account that does
    /// not exist is refused (404 `ACCOUNT_NOT_FOUND`), and nothing is written.
    Explicit,
}

/// An account id: the aggregate id of the account's stream.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AccountId(pub Uuid);

impl AccountId {
    pub fn as_u128(self) -> u128 {
        self.0.as_u128()
    }
}

impl fmt::Display for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

impl fmt::Debug for AccountId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl FromStr for AccountId {
    type Err = uuid::Error;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Uuid::parse_str(s).map(AccountId)
    }
}

/// How an amount that is not one is refused, in the API's words (the field's name and the
/// bound a caller can send), whatever was sent: a number out of range, a string, a fraction.
pub fn amount_refusal(got: impl fmt::Display) -> String {
    format!("amountCents must be an integer from 1 to {MAX_AMOUNT_CENTS}, got {got}")
}

/// Reads an `amountCents` field of a JSON body: any integer (the range is
/// [`AmountCents::new`]'s to check), and anything else refused with [`amount_refusal`]. The
/// derived reading of an `i64` would answer in Rust's words (`expected i64`), which name
/// neither the field nor the bound.
pub fn deserialize_amount_cents<'de, D>(d: D) -> Result<i64, D::Error>
where
    D: serde::Deserializer<'de>,
{
    use serde::Deserialize;
    use serde::de::Error;
    let value = serde_json::Value::deserialize(d)?;
    match value.as_i64() {
        Some(cents) => Ok(cents),
        // A whole number in another spelling (`1e2`, `100.0`) reaches here as a float:
        // JSON keeps no spelling, so the refusal says what the API takes instead.
        None => match value.as_f64() {
            Some(f) if f.fract() == 0.0 && (1.0..=MAX_AMOUNT_CENTS as f64).contains(&f) => {
                Err(D::Error::custom(amount_refusal(format!(
                    "{value} (written with a fraction or an exponent); send plain digits: {}",
                    f as i64
                ))))
            }
            // Past i64 but still an integer: out of range like any other too-large amount.
            _ => Err(D::Error::custom(amount_refusal(json_shown(&value)))),
        },
    }
}

/// A JSON value as a refusal quotes it: a scalar as sent (a long string cut short), an
/// array or object by its kind only.
pub fn json_shown(value: &serde_json::Value) -> String {
    /// The most characters of a string quoted back.
    const SHOWN_CHARS: usize = 32;
    use serde_json::Value;
    match value {
        Value::String(s) if s.chars().count() > SHOWN_CHARS => {
            let head: String = s.chars().take(SHOWN_CHARS).collect();
            format!("a string starting {}...", Value::String(head))
        }
        Value::String(_) => format!("the string {value}"),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "an object".into(),
        Value::Null | Value::Bool(_) | Value::Number(_) => value.to_string(),
    }
}

/// A positive amount of cents, at most [`MAX_AMOUNT_CENTS`]. Parsed at the edge; the rest of
/// Tally never sees an invalid amount.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub struct AmountCents(i64);

impl AmountCents {
    pub fn new(cents: i64) -> Result<Self, RuleError> {
        if cents <= 0 || cents > MAX_AMOUNT_CENTS {
            return Err(RuleError::Validation(amount_refusal(cents)));
        }
        Ok(Self(cents))
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

/// Who Tally is on the store: the org, the aggregate type of accounts, and the service's
/// client id (one per service, shared by every replica; never per replica or per request).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    pub org_id: Uuid,
    pub account_type_id: Uuid,
    pub client_id: Uuid,
}

impl Identity {
    pub const DEFAULT_ORG: &'static str = "DemoOrg";
    pub const DEFAULT_ACCOUNT_TYPE: &'static str = "Account";
    pub const DEFAULT_CLIENT: &'static str = "Tally";
    /// The client id name of the existing reference account service, for joining its fleet.
    pub const REFERENCE_SERVICE_CLIENT: &'static str = "ReferenceApiService";
    /// The aggregate type of the server-clock probe: never an account type.
    pub const SERVER_CLOCK_TYPE: &'static str = "TallyServerClock";
    /// The aggregate type of the store's epoch (`projection/regress.rs`).
    pub const STORE_EPOCH_TYPE: &'static str = "TallyStoreEpoch";
    /// The aggregate type of account checkpoints (`projection/checkpoint.rs`): never an
    /// account type, so the replaced service and older replicas never fold one.
    pub const CHECKPOINT_TYPE: &'static str = "TallyCheckpoint";

    pub fn client(&self) -> ClientId {
        self.client_id.as_u128()
    }

    pub fn key(&self, account: AccountId) -> AggregateKey {
        AggregateKey {
            org_id: self.org_id.as_u128(),
            aggregate_type_id: self.account_type_id.as_u128(),
            aggregate_id: account.as_u128(),
        }
    }

    /// Where a replica writes its server-clock probe: one aggregate per service (keyed by
    /// the client id), of a type of its own, so it is never read as an account.
    pub fn server_clock_key(&self) -> AggregateKey {
        AggregateKey {
            org_id: self.org_id.as_u128(),
            aggregate_type_id: named_id(Self::SERVER_CLOCK_TYPE).as_u128(),
            aggregate_id: self.client(),
        }
    }

    /// Where the checkpoints of `account` live: one stream per account, keyed by the account
    /// id, in an aggregate type of Tally's own (never the account stream itself).
    pub fn checkpoint_key(&self, account: AccountId) -> AggregateKey {
        AggregateKey {
            org_id: self.org_id.as_u128(),
            aggregate_type_id: named_id(Self::CHECKPOINT_TYPE).as_u128(),
            aggregate_id: account.as_u128(),
        }
    }

    /// Where the service names the store it writes to: one create-only event carrying a
    /// random id, written by the first replica that finds none (`projection/regress.rs`).
    pub fn store_epoch_key(&self) -> AggregateKey {
        AggregateKey {
            org_id: self.org_id.as_u128(),
            aggregate_type_id: named_id(Self::STORE_EPOCH_TYPE).as_u128(),
            aggregate_id: self.client(),
        }
    }
}

impl Default for Identity {
    fn default() -> Self {
        Self {
            org_id: named_id(Self::DEFAULT_ORG),
            account_type_id: named_id(Self::DEFAULT_ACCOUNT_TYPE),
            client_id: named_id(Self::DEFAULT_CLIENT),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amounts_are_positive_and_bounded() {
        assert!(AmountCents::new(0).is_err());
        assert!(AmountCents::new(-5).is_err());
        assert!(AmountCents::new(MAX_AMOUNT_CENTS + 1).is_err());
        assert_eq!(
            AmountCents::new(MAX_AMOUNT_CENTS).unwrap().get(),
            MAX_AMOUNT_CENTS
        );
        assert_eq!(
            AmountCents::new(0).unwrap_err().to_string(),
            "amountCents must be an integer from 1 to 2147483647, got 0"
        );
    }

    /// Rule: an amount that is not an integer is refused in the API's words (the field and
    /// its bound), never in Rust's (`expected i64`).
    #[test]
    fn an_amount_of_the_wrong_type_is_refused_in_the_apis_words() {
        #[derive(serde::Deserialize, Debug)]
        struct Body {
            #[serde(deserialize_with = "deserialize_amount_cents")]
            #[allow(dead_code)]
            amount: i64,
        }
        let refusal = |json: &str| serde_json::from_str::<Body>(json).unwrap_err().to_string();
        let rule = "amountCents must be an integer from 1 to 2147483647, got";
        for (body, got) in [
            (r#"{"amount":"100"}"#, r#"the string "100""#),
            (r#"{"amount":1.5}"#, "1.5"),
            (r#"{"amount":null}"#, "null"),
            (r#"{"amount":[1]}"#, "an array"),
            (r#"{"amount":18446744073709551615}"#, "18446744073709551615"),
        ] {
            let message = refusal(body);
            assert!(
                message.starts_with(&format!("{rule} {got}")),
                "{body}: {message}"
            );
        }
        let long = format!(r#"{{"amount":"{}"}}"#, "9".repeat(100));
        assert!(refusal(&long).contains(r#"a string starting "999"#));
        assert!(!refusal(&long).contains(&"9".repeat(33)));
    }

    #[test]
    fn default_identity_uses_the_names_of_existing_streams() {
        let id = Identity::default();
        assert_eq!(id.org_id, Uuid::new_v5(&IDENTITY_NAMESPACE, b"DemoOrg"));
        assert_ne!(id.client_id, named_id(Identity::REFERENCE_SERVICE_CLIENT));
        assert_eq!(id.key(AccountId(Uuid::nil())).aggregate_id, 0);
    }
}
