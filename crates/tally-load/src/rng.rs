//! Seeded randomness for the load tool, so account ids and the operation mix are reproducible
//! from `--seed`, independent of how tickets land on workers: ChaCha8 (`rand_chacha`), one
//! stream of it per worker or purpose.

use rand::{Rng as _, RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;
use uuid::Uuid;

/// Deterministic generator for one stream of a run; not for anything security-related.
#[derive(Clone, Debug)]
pub struct Rng {
    inner: ChaCha8Rng,
}

impl Rng {
    /// A generator for one independent stream (`stream`) of the run seeded with `seed`.
    pub fn derive(seed: u64, stream: u64) -> Self {
        let mut inner = ChaCha8Rng::seed_from_u64(seed);
        inner.set_stream(stream);
        Rng { inner }
    }

    /// A value in `0..n`; `n == 0` yields 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.inner.gen_range(0..n)
        }
    }

    /// A value in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        self.inner.r#gen::<f64>()
    }

    /// A version-4 UUID drawn from this stream.
    pub fn uuid_v4(&mut self) -> Uuid {
        let mut bytes = [0u8; 16];
        self.inner.fill_bytes(&mut bytes);
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
        assert_ne!(Rng::derive(7, 3).uuid_v4(), Rng::derive(7, 4).uuid_v4());
        assert_ne!(Rng::derive(7, 3).uuid_v4(), Rng::derive(8, 3).uuid_v4());
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
