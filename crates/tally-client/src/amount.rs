//! The amount a write moves, checked when it is made, so a value Tally refuses never leaves
//! the caller's process.

use std::fmt;

use serde::Serialize;

use crate::Error;

/// The largest amount one write may move, in cents: the API's bound (2,147,483,647).
pub const MAX_AMOUNT_CENTS: i64 = i32::MAX as i64;

/// A positive amount of cents, at most [`MAX_AMOUNT_CENTS`]: what the API's `amountCents`
/// takes. Made by [`AmountCents::new`] (or `try_from`), which refuses anything else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(transparent)]
pub struct AmountCents(i64);

impl AmountCents {
    /// `cents` if it is from 1 to [`MAX_AMOUNT_CENTS`]; [`Error::InvalidAmount`] otherwise.
    pub fn new(cents: i64) -> Result<Self, Error> {
        if (1..=MAX_AMOUNT_CENTS).contains(&cents) {
            Ok(AmountCents(cents))
        } else {
            Err(Error::InvalidAmount(cents))
        }
    }

    pub fn get(self) -> i64 {
        self.0
    }
}

impl TryFrom<i64> for AmountCents {
    type Error = Error;
    fn try_from(cents: i64) -> Result<Self, Error> {
        AmountCents::new(cents)
    }
}

impl TryFrom<u32> for AmountCents {
    type Error = Error;
    fn try_from(cents: u32) -> Result<Self, Error> {
        AmountCents::new(i64::from(cents))
    }
}

impl fmt::Display for AmountCents {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rule: an amount the API refuses is refused at construction, before any send.
    #[test]
    fn amounts_outside_the_apis_range_are_refused_at_construction() {
        for bad in [
            0,
            -1,
            MAX_AMOUNT_CENTS + 1,
            3_000_000_000,
            i64::MIN,
            i64::MAX,
        ] {
            assert!(
                matches!(AmountCents::new(bad), Err(Error::InvalidAmount(c)) if c == bad),
                "{bad}"
            );
        }
        assert!(AmountCents::try_from(3_000_000_000_u32).is_err());
        for good in [1, 5_000, MAX_AMOUNT_CENTS] {
            assert_eq!(AmountCents::new(good).unwrap().get(), good);
        }
        assert_eq!(
            serde_json::to_string(&AmountCents::new(42).unwrap()).unwrap(),
            "42"
        );
    }
}
