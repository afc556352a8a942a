//! SplitMix64 (Steele, Lea, Flood: "Fast splittable pseudorandom number generators",
//! OOPSLA 2014; constants as in Vigna's reference `splitmix64.c`). One `u64` of state, so it
//! serialises trivially; good enough statistically for shuffling data windows.

use serde::{Deserialize, Serialize};

const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The SplitMix64 output function: a strong 64-bit mixer (bijective).
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A SplitMix64 generator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SplitMix64 {
    pub state: u64,
}

impl SplitMix64 {
    /// A generator whose first output is `mix64(seed + GAMMA)`.
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GAMMA);
        mix64(self.state)
    }

    /// Uniform integer in `[0, n)` (Lemire's multiply-and-reject, unbiased). `n` must be > 0.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        let mut m = u128::from(self.next_u64()) * u128::from(n);
        if (m as u64) < n {
            let threshold = n.wrapping_neg() % n;
            while (m as u64) < threshold {
                m = u128::from(self.next_u64()) * u128::from(n);
            }
        }
        (m >> 64) as u64
    }

    /// Shuffles `v` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            v.swap(i, j);
        }
    }
}

/// The seed of the data-order stream of `epoch` for a run seeded with `seed`: each epoch gets
/// an independent-looking stream (not a shifted copy of another epoch's).
pub fn epoch_seed(seed: u64, epoch: u64) -> u64 {
    const DATA_DOMAIN: u64 = 0x6461_7461_6f72_6472; // "dataordr": separates from other uses of the seed
    mix64(mix64(seed ^ DATA_DOMAIN).wrapping_add(mix64(epoch)))
}
