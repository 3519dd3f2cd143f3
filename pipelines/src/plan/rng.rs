//! Stable seeds and the planner's random generator: SplitMix64, written out here so a
//! plan is the same on every machine, build and version of Rust or `rand`.
//!
//! Seeds are never taken from the clock or from `std`'s `DefaultHasher` (whose output
//! may change between Rust releases); they are mixed from the inputs with [`mix64`].

/// The SplitMix64 increment (2^64 divided by the golden ratio, rounded to odd).
const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// SplitMix64's output function (Stafford's "Mix13"): a bijection on `u64` whose output
/// bits each depend on every input bit. Equal inputs give equal outputs everywhere.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The seed of one worker's random stream for one epoch (or data pass):
/// `h = mix64(seed)`, then `h = mix64((h + GAMMA) ^ x)` for `x` in `epoch, rank, worker`.
/// Each step is injective in `x`, so neighbouring ranks, workers and epochs get
/// unrelated streams.
pub fn derive_seed(seed: u64, epoch: u64, rank: u32, worker: u32) -> u64 {
    [epoch, u64::from(rank), u64::from(worker)]
        .into_iter()
        .fold(mix64(seed), |h, x| mix64(h.wrapping_add(GOLDEN_GAMMA) ^ x))
}

/// SplitMix64 (Steele, Lea and Flood 2014): 64 bits of state, one addition and one
/// [`mix64`] per number. Not cryptographic; good enough to shuffle and draw shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// A uniform number in `0..n`, without modulo bias (rejection sampling). `n == 0`
    /// gives 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        // The largest multiple of n that fits; draws at or above it are rejected.
        let zone = u64::MAX - (u64::MAX % n + 1) % n;
        loop {
            let x = self.next_u64();
            if x <= zone {
                return x % n;
            }
        }
    }

    /// A uniform float in `[0, 1)` with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Fisher-Yates, from the last element down.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// So the transforms (which take any [`rand::Rng`]) can draw from a seeded SplitMix64.
impl rand::RngCore for SplitMix64 {
    fn next_u32(&mut self) -> u32 {
        (SplitMix64::next_u64(self) >> 32) as u32
    }

    fn next_u64(&mut self) -> u64 {
        SplitMix64::next_u64(self)
    }

    fn fill_bytes(&mut self, dst: &mut [u8]) {
        for chunk in dst.chunks_mut(8) {
            let bytes = SplitMix64::next_u64(self).to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // First outputs of the reference C implementation seeded with 1234567.
        let mut rng = SplitMix64::new(1_234_567);
        let got: Vec<u64> = (0..5).map(|_| rng.next_u64()).collect();
        assert_eq!(
            got,
            [
                6_457_827_717_110_365_317,
                3_203_168_211_198_807_973,
                9_817_491_932_198_370_423,
                4_593_380_528_125_082_431,
                16_408_922_859_458_223_821,
            ]
        );
    }

    #[test]
    fn derived_seeds_differ_per_input_and_are_stable() {
        let base = derive_seed(7, 0, 0, 0);
        assert_eq!(base, derive_seed(7, 0, 0, 0));
        let others = [
            derive_seed(8, 0, 0, 0),
            derive_seed(7, 1, 0, 0),
            derive_seed(7, 0, 1, 0),
            derive_seed(7, 0, 0, 1),
        ];
        for other in others {
            assert_ne!(base, other);
        }
        // Swapping rank and worker must not collide either.
        assert_ne!(derive_seed(7, 0, 1, 2), derive_seed(7, 0, 2, 1));
    }

    #[test]
    fn below_stays_in_range_and_shuffle_permutes() {
        let mut rng = SplitMix64::new(3);
        for n in [1u64, 2, 3, 7, 1000, u64::MAX] {
            for _ in 0..100 {
                assert!(rng.below(n) < n);
            }
        }
        assert_eq!(rng.below(0), 0);
        let mut items: Vec<u32> = (0..50).collect();
        rng.shuffle(&mut items);
        assert_ne!(items, (0..50).collect::<Vec<_>>());
        items.sort_unstable();
        assert_eq!(items, (0..50).collect::<Vec<_>>());
        let x = rng.next_f64();
        assert!((0.0..1.0).contains(&x));
    }
}
