//! A small seeded pseudo-random generator (SplitMix64) so account ids and the operation mix
//! are reproducible from `--seed`, independent of how tickets land on workers.

use uuid::Uuid;

/// Weyl-sequence increment of SplitMix64.
const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// Deterministic 64-bit generator; not for anything security-related.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator for one independent stream (`stream`) of the run seeded with `seed`.
    pub fn derive(seed: u64, stream: u64) -> Self {
        let mut mixer = Rng {
            state: seed ^ stream.wrapping_mul(GOLDEN_GAMMA).rotate_left(17),
        };
        Rng {
            state: mixer.next_u64() ^ stream,
        }
    }

    /// Next 64 uniformly distributed bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A value in `0..n`; `n == 0` yields 0.
    pub fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A value in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        const MANTISSA_BITS: u32 = 53;
        (self.next_u64() >> (64 - MANTISSA_BITS)) as f64 / (1u64 << MANTISSA_BITS) as f64
    }

    /// A version-4 UUID drawn from this stream.
    pub fn uuid_v4(&mut self) -> Uuid {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&self.next_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&self.next_u64().to_le_bytes());
        uuid::Builder::from_random_bytes(bytes).into_uuid()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream() {
        let mut a = Rng::derive(7, 3);
        let mut b = Rng::derive(7, 3);
        assert_eq!(a.uuid_v4(), b.uuid_v4());
        assert_ne!(Rng::derive(7, 3).next_u64(), Rng::derive(7, 4).next_u64());
        assert_ne!(Rng::derive(7, 3).next_u64(), Rng::derive(8, 3).next_u64());
    }

    #[test]
    fn ranges_hold() {
        let mut r = Rng::derive(1, 1);
        for _ in 0..1000 {
            assert!(r.below(5) < 5);
            let u = r.unit();
            assert!((0.0..1.0).contains(&u));
        }
        assert_eq!(r.below(0), 0);
        assert_eq!(r.uuid_v4().get_version_num(), 4);
    }
}
