//! The parsers every concern's flags share: ranged counts, and enums listed by name.
//! A leaf: it knows nothing of Tally, so any layer's flags may use it.

use std::ffi::OsStr;
use std::ops::RangeInclusive;

use clap::builder::{EnumValueParser, PossibleValue, RangedU64ValueParser, TypedValueParser};
use clap::{Arg, Command, Error, ValueEnum};

/// The parser of a count flag: `1..=max`. Nothing is unbounded, and a value no replica could
/// use is a typo clap refuses at start, naming the flag (several of these size a semaphore,
/// which panics past its own maximum).
pub fn count(max: usize) -> RangedU64ValueParser<usize> {
    usize_in(1..=max)
}

/// The parser of a `usize` flag accepted in `range`.
pub fn usize_in(range: RangeInclusive<usize>) -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(*range.start() as u64..=*range.end() as u64)
}

/// The parser of an enum flag that `--help` lists by its values' names alone, on the flag's
/// one line. A value's own description (its doc comment) would turn `--help` into clap's
/// long form, a paragraph per flag; `docs/operations.md` says what each value does. Parsing,
/// and the refusal of a value it does not know, are clap's own for the enum.
pub fn named<E: ValueEnum + Clone + Send + Sync + 'static>() -> Named<E> {
    Named(EnumValueParser::new())
}

/// See [`named`].
#[derive(Clone)]
pub struct Named<E: ValueEnum + Clone + Send + Sync + 'static>(EnumValueParser<E>);

impl<E: ValueEnum + Clone + Send + Sync + 'static> TypedValueParser for Named<E> {
    type Value = E;

    fn parse_ref(&self, cmd: &Command, arg: Option<&Arg>, value: &OsStr) -> Result<E, Error> {
        self.0.parse_ref(cmd, arg, value)
    }

    fn possible_values(&self) -> Option<Box<dyn Iterator<Item = PossibleValue> + '_>> {
        let names = E::value_variants()
            .iter()
            .filter_map(ValueEnum::to_possible_value)
            .map(|value| value.help(None::<&'static str>));
        Some(Box::new(names))
    }
}
