//! Counter-based random numbers: value `i` of stream `s` under seed `k` is a pure function of
//! `(k, s, i)`, so results never depend on evaluation order, thread count or backend. Used by the
//! `random_*` ops and by parameter initialization.

/// SplitMix64's finalizer: a bijective mix of 64 bits.
pub fn mix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// 64 random bits for element `index` of `stream` under `seed`.
pub fn bits(seed: u64, stream: u64, index: u64) -> u64 {
    mix64(mix64(mix64(seed) ^ stream.wrapping_mul(0xD1B5_4A32_D192_ED03)) ^ index)
}

/// Uniform in [0, 1) with 53 random bits.
pub fn uniform(seed: u64, stream: u64, index: u64) -> f64 {
    (bits(seed, stream, index) >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Standard normal by Box-Muller on two uniforms derived from `index`.
pub fn normal(seed: u64, stream: u64, index: u64) -> f64 {
    let u1 = uniform(seed, stream, index.wrapping_mul(2));
    let u2 = uniform(seed, stream, index.wrapping_mul(2).wrapping_add(1));
    // 1 - u1 lies in (0, 1], so the log is finite.
    (-2.0 * (1.0 - u1).ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
}

/// Uniform integer in `0..n` (n > 0); the modulo bias is below 2^-40 for any n < 2^24.
pub fn below(seed: u64, stream: u64, index: u64, n: u64) -> u64 {
    bits(seed, stream, index) % n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normal_has_unit_moments() {
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|i| normal(7, 3, i)).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01, "mean {mean}");
        assert!((var - 1.0).abs() < 0.01, "var {var}");
    }

    #[test]
    fn streams_and_seeds_differ() {
        assert_ne!(bits(1, 0, 0), bits(2, 0, 0));
        assert_ne!(bits(1, 0, 0), bits(1, 1, 0));
        assert_ne!(bits(1, 0, 0), bits(1, 0, 1));
        assert_eq!(bits(1, 2, 3), bits(1, 2, 3));
    }
}
