//! Row arithmetic the cpu backend's host steps share (attention's softmax, cross-entropy):
//! a vectorizable `exp`, and row maximum, sum and dot product in a fixed lane order, with an
//! AVX2 build that gives the same bits as the portable one; attention's softmax row on
//! AVX-512 (`x86::softmax16`), with the same bits again.

/// `e^x` in f32 to about 1 ulp (Cephes `expf`: range reduction by ln 2, a degree-6 polynomial,
/// the exponent put back in the bits), written so a loop over a row vectorizes; libm's `expf`
/// is a call per element. Inputs below -87.3 give about 1e-38 instead of 0 or a denormal;
/// above 88.37 the result is infinite.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let mut p = EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = p * r + c;
    }
    let y = p * (r * r) + r + 1.0;
    y * pow2(n)
}

const EXP_MIN: f32 = -87.3;
const EXP_MAX: f32 = 88.7;
/// ln 2 split in two, so that `n * LN2_HI` is exact.
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_POLY: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];
/// 1.5 * 2^23: adding it to an integral float puts the integer in the low mantissa bits.
const MAGIC: f32 = 12_582_912.0;

/// `2^n` for an integral `n` in -126..=128, built in the exponent bits. `n as i32` would be a
/// saturating conversion, which LLVM leaves scalar (8 conversions per vector: it made `exp`
/// 3 ns per element); adding `MAGIC` puts `n` exactly in the low mantissa bits instead.
#[inline(always)]
fn pow2(n: f32) -> f32 {
    let n = (n + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits());
    f32::from_bits(n.wrapping_add(127) << 23)
}

/// Lanes of the partial sums and maxima below: eight independent chains that LLVM keeps in
/// one vector register, combined pairwise at the end, so the order is fixed by the length.
const LANES: usize = 8;

fn combine(mut acc: [f32; LANES], f: impl Fn(f32, f32) -> f32) -> f32 {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for l in 0..width {
            acc[l] = f(acc[l], acc[l + width]);
        }
    }
    acc[0]
}

fn lanes(xs: &[f32], init: f32, f: impl Fn(f32, f32) -> f32 + Copy) -> f32 {
    let mut acc = [init; LANES];
    let chunks = xs.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = f(acc[l], c[l]);
        }
    }
    tail.iter().fold(combine(acc, f), |a, &x| f(a, x))
}

/// `Σ a·b` over two rows, in the lane order of `lanes`.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .fold(0.0, |s, v| s + v);
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] += x[l] * y[l];
        }
    }
    combine(acc, |p, q| p + q) + tail
}

/// Row maximum, sum and dot product in the lane order of `lanes`: AVX2 registers where
/// `AVX2` (only inside functions that checked the feature), the portable loops otherwise. LLVM
/// does not vectorize the portable ones (eight scalar chains, 0.3 ns per element each), and
/// each lane of a register takes exactly the elements, in the order, of its scalar chain, so
/// both give the same bits.
#[inline(always)]
pub(crate) fn row_max<const AVX2: bool>(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is set only where the cpu has it.
        return unsafe { x86::reduce(xs, xs, x86::Reduce::Max) };
    }
    lanes(xs, f32::NEG_INFINITY, f32::max)
}

#[inline(always)]
pub(crate) fn row_sum<const AVX2: bool>(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as in `row_max`.
        return unsafe { x86::reduce(xs, xs, x86::Reduce::Sum) };
    }
    lanes(xs, 0.0, |a, b| a + b)
}

#[inline(always)]
pub(crate) fn row_dot<const AVX2: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as in `row_max`.
        return unsafe { x86::reduce(a, b, x86::Reduce::Dot) };
    }
    dot(a, b)
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use super::*;
    use std::arch::x86_64::*;

    /// [`exp`] on sixteen lanes, op for op (a multiply and an add, never fused; `max` and `min`
    /// with the bound first, which keeps a NaN as `clamp` does), so every lane gets the scalar
    /// function's bits.
    ///
    /// # Safety
    /// The cpu has AVX-512F.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn exp16(x: __m512) -> __m512 {
        let x = _mm512_min_ps(
            _mm512_set1_ps(EXP_MAX),
            _mm512_max_ps(_mm512_set1_ps(EXP_MIN), x),
        );
        // Round toward -inf (1), exceptions suppressed (8): `floor`.
        let n = _mm512_roundscale_ps::<0x09>(_mm512_add_ps(
            _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
            _mm512_set1_ps(0.5),
        ));
        let r = _mm512_sub_ps(
            _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))),
            _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)),
        );
        let mut p = _mm512_set1_ps(EXP_POLY[0]);
        for &c in &EXP_POLY[1..] {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(c));
        }
        let y = _mm512_add_ps(
            _mm512_add_ps(_mm512_mul_ps(p, _mm512_mul_ps(r, r)), r),
            _mm512_set1_ps(1.0),
        );
        let n = _mm512_sub_epi32(
            _mm512_castps_si512(_mm512_add_ps(n, _mm512_set1_ps(MAGIC))),
            _mm512_set1_epi32(MAGIC.to_bits() as i32),
        );
        let pow2 = _mm512_slli_epi32::<23>(_mm512_add_epi32(n, _mm512_set1_epi32(127)));
        _mm512_mul_ps(y, _mm512_castsi512_ps(pow2))
    }

    /// `e[i] = exp(x[i] - m)` on sixteen lanes, the last group masked: the scalar loop's bits
    /// (`exp16` is `exp` lane by lane), for rows whose length is not a multiple of 16 too.
    ///
    /// # Safety
    /// The cpu has AVX-512F; `e` is at least as long as `x`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn exp_minus16(x: &[f32], m: f32, e: &mut [f32]) {
        let (xp, ep, len) = (x.as_ptr(), e.as_mut_ptr(), x.len());
        let vm = _mm512_set1_ps(m);
        for g in 0..len.div_ceil(16) {
            let k = (u32::MAX >> (32 - (len - g * 16).min(16))) as __mmask16;
            // SAFETY: the mask covers `g*16 .. len` only, inside both slices.
            unsafe {
                let v = _mm512_sub_ps(_mm512_maskz_loadu_ps(k, xp.add(g * 16)), vm);
                _mm512_mask_storeu_ps(ep.add(g * 16), k, exp16(v));
            }
        }
    }

    /// One softmax row on sixteen lanes: `x * scale`, `exp(x - max)`, `/ sum` over the
    /// `live` elements, zeros past them. Why: `exp`'s arithmetic is most of a softmax's time
    /// (`perf annotate`), and LLVM vectorizes the scalar loop to eight lanes at most. A row's
    /// last group is masked, so causal rows, whose lengths change one by one, need no scalar
    /// tail. Each element goes through the scalar ops, the max is exact whatever the order,
    /// and the sum is [`reduce`]'s eight lanes in its order, so this gives the portable
    /// loops' bits (`attention.rs` tests it). Returns the row's `(max, sum)`.
    ///
    /// # Safety
    /// The cpu has AVX-512F; `live <= row.len()`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn softmax16(row: &mut [f32], live: usize, scale: f32) -> (f32, f32) {
        let x = row.as_mut_ptr();
        let groups = live.div_ceil(16);
        // Lanes of group `g` that hold live elements.
        let mask = |g: usize| -> __mmask16 { (u32::MAX >> (32 - (live - g * 16).min(16))) as u16 };
        // SAFETY (every masked load and store below): the mask covers `g*16 .. live` only.
        let (vscale, mut vmax) = (_mm512_set1_ps(scale), _mm512_set1_ps(f32::NEG_INFINITY));
        for g in 0..groups {
            let (k, at) = (mask(g), unsafe { x.add(g * 16) });
            let v = _mm512_mul_ps(unsafe { _mm512_maskz_loadu_ps(k, at) }, vscale);
            unsafe { _mm512_mask_storeu_ps(at, k, v) };
            vmax = _mm512_mask_max_ps(vmax, k, vmax, v);
        }
        let max = _mm512_reduce_max_ps(vmax);
        let vmax = _mm512_set1_ps(max);
        for g in 0..groups {
            let (k, at) = (mask(g), unsafe { x.add(g * 16) });
            let v = unsafe { exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, at), vmax)) };
            unsafe { _mm512_mask_storeu_ps(at, k, v) };
        }
        // SAFETY: AVX-512F implies AVX2.
        let sum = unsafe { reduce(&row[..live], &[], Reduce::Sum) };
        let vsum = _mm512_set1_ps(sum);
        for g in 0..groups {
            let (k, at) = (mask(g), unsafe { x.add(g * 16) });
            let v = _mm512_div_ps(unsafe { _mm512_maskz_loadu_ps(k, at) }, vsum);
            unsafe { _mm512_mask_storeu_ps(at, k, v) };
        }
        row[live..].fill(0.0);
        (max, sum)
    }

    /// `softmax16` from a row's given `(max, sum)` (the forward's, for attention's backward):
    /// `exp(x * scale - max) / sum` in one pass, the same operations on each element as
    /// `softmax16`'s three, so the same bits where the statistics are the ones it returned.
    ///
    /// # Safety
    /// The cpu has AVX-512F; `live <= row.len()`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    pub unsafe fn softmax16_from(row: &mut [f32], live: usize, scale: f32, (max, sum): (f32, f32)) {
        let x = row.as_mut_ptr();
        let (vscale, vmax, vsum) = (
            _mm512_set1_ps(scale),
            _mm512_set1_ps(max),
            _mm512_set1_ps(sum),
        );
        for g in 0..live.div_ceil(16) {
            let k = (u32::MAX >> (32 - (live - g * 16).min(16))) as __mmask16;
            // SAFETY: the mask covers `g*16 .. live` only.
            unsafe {
                let at = x.add(g * 16);
                let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, at), vscale);
                let e = exp16(_mm512_sub_ps(v, vmax));
                _mm512_mask_storeu_ps(at, k, _mm512_div_ps(e, vsum));
            }
        }
        row[live..].fill(0.0);
    }

    #[derive(Clone, Copy, PartialEq)]
    pub enum Reduce {
        Max,
        Sum,
        Dot,
    }

    /// `lanes` (max or sum of `a`) or `dot(a, b)` with one 8-wide register as the eight
    /// chains. NaN handling differs from `f32::max` (`maxps` keeps its second operand), which
    /// only matters for a row holding NaN, whose probabilities are NaN either way.
    ///
    /// # Safety
    /// The cpu has AVX2; `b` is at least as long as `a` for `Dot`.
    #[target_feature(enable = "avx2")]
    #[inline]
    pub unsafe fn reduce(a: &[f32], b: &[f32], op: Reduce) -> f32 {
        let n = a.len() / LANES * LANES;
        let mut acc = _mm256_set1_ps(if op == Reduce::Max {
            f32::NEG_INFINITY
        } else {
            0.0
        });
        let mut i = 0;
        while i < n {
            // SAFETY: `i + 8 <= n <= a.len()` (and `b.len()` for `Dot`).
            let x = unsafe { _mm256_loadu_ps(a.as_ptr().add(i)) };
            acc = match op {
                Reduce::Max => _mm256_max_ps(acc, x),
                Reduce::Sum => _mm256_add_ps(acc, x),
                Reduce::Dot => {
                    // SAFETY: as above.
                    let y = unsafe { _mm256_loadu_ps(b.as_ptr().add(i)) };
                    _mm256_add_ps(acc, _mm256_mul_ps(x, y))
                }
            };
            i += LANES;
        }
        let mut lanes = [0f32; LANES];
        // SAFETY: `lanes` holds eight floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
        match op {
            Reduce::Max => a[n..]
                .iter()
                .fold(combine(lanes, f32::max), |m, &x| m.max(x)),
            Reduce::Sum => a[n..]
                .iter()
                .fold(combine(lanes, |p, q| p + q), |s, &x| s + x),
            Reduce::Dot => {
                let tail = a[n..]
                    .iter()
                    .zip(&b[n..])
                    .map(|(x, y)| x * y)
                    .fold(0.0, |s, v| s + v);
                combine(lanes, |p, q| p + q) + tail
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn row(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919 % 1013) as f32 - 506.0) * 0.013)
            .collect()
    }

    /// The AVX2 row reductions give the portable loops' bits, odd lengths included.
    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(
        not(host_has_avx2),
        ignore = "this cpu has no AVX2 and FMA: the AVX2 path is not run here"
    )]
    fn avx2_rows_match_the_portable_loops_bit_for_bit() {
        assert!(
            is_x86_feature_detected!("avx2"),
            "built on a cpu with AVX2, tested on one without"
        );
        for len in (0..40).chain([255, 256, 257]) {
            let (a, b) = (row(len, 1), row(len, 5));
            // SAFETY: AVX2 checked above.
            let fast = unsafe {
                [
                    x86::reduce(&a, &a, x86::Reduce::Max),
                    x86::reduce(&a, &a, x86::Reduce::Sum),
                    x86::reduce(&a, &b, x86::Reduce::Dot),
                ]
            };
            let slow = [
                lanes(&a, f32::NEG_INFINITY, f32::max),
                lanes(&a, 0.0, |x, y| x + y),
                dot(&a, &b),
            ];
            assert_eq!(fast.map(f32::to_bits), slow.map(f32::to_bits), "len {len}");
        }
    }

    /// The sixteen-lane `exp` gives the scalar one's bits, over the whole range and past it.
    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(
        not(host_has_avx512f),
        ignore = "this cpu has no AVX-512F: the AVX-512 path is not run here"
    )]
    fn exp16_matches_the_scalar_exp_bit_for_bit() {
        assert!(
            is_x86_feature_detected!("avx512f"),
            "built on a cpu with AVX-512F, tested on one without"
        );
        use std::arch::x86_64::*;
        let mut xs: Vec<f32> = (0..200_000).map(|i| -100.0 + i as f32 * 0.001_01).collect();
        xs.extend([
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            0.0,
            1e-30,
            88.7,
            -87.3,
        ]);
        xs.resize(xs.len().next_multiple_of(16), 1.0);
        for group in xs.chunks_exact(16) {
            let mut got = [0f32; 16];
            // SAFETY: AVX-512F checked above; both arrays hold sixteen floats.
            unsafe {
                _mm512_storeu_ps(
                    got.as_mut_ptr(),
                    x86::exp16(_mm512_loadu_ps(group.as_ptr())),
                )
            };
            for (g, &x) in got.iter().zip(group) {
                assert_eq!(g.to_bits(), exp(x).to_bits(), "exp({x})");
            }
        }
    }

    /// `pow2` against the plain conversion it replaces, over every exponent `exp` can reach.
    #[test]
    fn pow2_builds_the_same_bits_as_the_conversion() {
        for n in -126..=127 {
            let want = f32::from_bits(((n + 127) as u32) << 23);
            assert_eq!(pow2(n as f32).to_bits(), want.to_bits(), "2^{n}");
        }
    }

    /// `exp` within 2 ulp of f64's from -87 to 88.3 (softmax only passes x <= 0), NaN kept,
    /// tiny below the range and infinite above it, as f32's own exp.
    #[test]
    fn exp_is_accurate_over_its_range() {
        let mut x = -87.0f32;
        while x < 88.3 {
            let (got, want) = (exp(x), (x as f64).exp() as f32);
            let ulps = (got.to_bits() as i64 - want.to_bits() as i64).abs();
            assert!(ulps <= 2, "exp({x}) = {got}, want {want} ({ulps} ulp)");
            x += 0.001_3;
        }
        assert!(exp(f32::NAN).is_nan());
        assert!(exp(-1000.0) > 0.0 && exp(-1000.0) < 1e-37);
        assert_eq!(exp(1000.0), f32::INFINITY);
    }
}
