//! The parsers of numeric flags, shared by every concern's flags. A leaf: it knows nothing
//! of Tally, so any layer's flags may use it.

use std::ops::RangeInclusive;

use clap::builder::RangedU64ValueParser;

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
