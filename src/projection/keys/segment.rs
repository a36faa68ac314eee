//! The keys of one version range as a checkpoint carries them: each key's fingerprint, then
//! its version and balance as differences from the key before, in LEB128 varints. A key of a
//! busy account costs about 8 bytes in the stream.

use bytes::{Buf, BufMut};

/// The most keys one segment carries: what a checkpoint may hold, about 0.5 MB at most.
pub const MAX_SEGMENT_KEYS: usize = 65_536;

/// One key in a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SegmentKey {
    pub fingerprint: u32,
    pub version: u64,
    pub balance: i64,
}

/// Every key the fold took at versions in `(after, checkpoint version]`, in version order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Segment {
    pub after: u64,
    /// The commit time (server ms) of the batch at `after`; [`UNKNOWN_MS`] when not known.
    /// Once it is past the retention, no key below the segment is needed.
    pub after_ms: u64,
    /// Its writer had forgotten the keys at and below `after` inside the retention (a cap,
    /// or more keys than one segment carries): a chain ends here, and `after_ms` is then no
    /// earlier than the newest of them was committed.
    pub forgotten: bool,
    pub keys: Vec<SegmentKey>,
}

/// A commit time not known: taken as never past the retention.
pub const UNKNOWN_MS: u64 = u64::MAX;

impl Segment {
    pub fn encode(&self, out: &mut impl BufMut) {
        out.put_u64_le(self.after);
        out.put_u64_le(self.after_ms);
        out.put_u8(u8::from(self.forgotten));
        put_varint(out, self.keys.len() as u64);
        let (mut version, mut balance) = (self.after, 0i64);
        for k in &self.keys {
            out.put_u32_le(k.fingerprint);
            put_varint(out, k.version - version);
            put_varint(out, zigzag(k.balance.wrapping_sub(balance)));
            (version, balance) = (k.version, k.balance);
        }
    }

    /// The segment `buf` holds; `None` when it is malformed (versions out of order, too many
    /// keys, cut short, or anything left over).
    pub fn decode(mut buf: &[u8], through: u64) -> Option<Self> {
        if buf.remaining() < 17 {
            return None;
        }
        let after = buf.get_u64_le();
        let after_ms = buf.get_u64_le();
        let forgotten = match buf.get_u8() {
            0 => false,
            1 => true,
            _ => return None,
        };
        let n = usize::try_from(get_varint(&mut buf)?).ok()?;
        if n > MAX_SEGMENT_KEYS || after > through {
            return None;
        }
        let mut keys = Vec::with_capacity(n);
        let (mut version, mut balance) = (after, 0i64);
        for _ in 0..n {
            if buf.remaining() < 4 {
                return None;
            }
            let fingerprint = buf.get_u32_le();
            version = version.checked_add(get_varint(&mut buf)?)?;
            balance = balance.wrapping_add(unzigzag(get_varint(&mut buf)?));
            if version <= after || version > through {
                return None;
            }
            keys.push(SegmentKey {
                fingerprint,
                version,
                balance,
            });
        }
        buf.is_empty().then_some(Self {
            after,
            after_ms,
            forgotten,
            keys,
        })
    }
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn put_varint(out: &mut impl BufMut, mut v: u64) {
    while v >= 0x80 {
        out.put_u8((v as u8) | 0x80);
        v >>= 7;
    }
    out.put_u8(v as u8);
}

#[inline]
fn get_varint(buf: &mut &[u8]) -> Option<u64> {
    // Most of a busy account's differences fit one byte.
    if let Some((&byte, rest)) = buf.split_first()
        && byte < 0x80
    {
        *buf = rest;
        return Some(u64::from(byte));
    }
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *buf.first()?;
        buf.advance(1);
        v |= u64::from(byte & 0x7f).checked_shl(shift)?;
        if byte & 0x80 == 0 {
            return Some(v);
        }
    }
    None
}
