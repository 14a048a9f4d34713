//! Causal (grouped-query) attention forward and backward on the cpu backend, one head at a time
//! with the `[S, S]` scores in a per-task scratch buffer instead of the arena.
//!
//! Why: decomposed, attention materializes `[B, H, S, S]` scores, probabilities and their
//! gradients, which dominated the arena (`debug`'s 2048-token rows needed 18 GiB) and made a
//! dozen memory-bound passes over them per layer. Here every product is one of our GEMMs
//! (`gemm.rs`, single-threaded inside a task) on the arena and the scratch, and the softmax runs
//! on a row that is in cache.
//!
//! Work split: one task per (batch, kv head), which owns the query heads that share it. So the
//! kv gradients of a group are summed in a fixed order (query heads ascending) by one thread,
//! and the results never depend on the thread count.
//!
//! Numerics (f32, the decomposition `softmax(q kᵀ · scale + mask) v` op for op, except that
//! row sums and maxima take eight lanes combined pairwise and `exp` is our own, about 1 ulp):
//! `s = (q·k) * scale`, masked entries are -inf, `p = exp(s - max) / sum`; backward
//! `dv = pᵀ dout`, `dp = dout vᵀ`, `ds = p (dp - Σ_j p dp)`, `dq = (ds k) * scale`,
//! `dk = (dsᵀ q) * scale`.

use crate::gemm::{self, Layout};
use crate::pool::Pool;

/// A rank-4 `[B, H, S, D]` operand: element offset of `[0, 0, 0, 0]` in the arena and strides.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    pub offset: usize,
    pub strides: [usize; 4],
}

impl Heads {
    /// The `[S, D]` matrix of batch `b`, head `h`.
    fn at(&self, b: usize, h: usize) -> (usize, Layout) {
        (
            self.offset + b * self.strides[0] + h * self.strides[1],
            Layout {
                batch_stride: 0,
                row_stride: self.strides[2],
                col_stride: self.strides[3],
            },
        )
    }

    /// The same matrix read transposed, `[D, S]`.
    fn at_t(&self, b: usize, h: usize) -> (usize, Layout) {
        let (o, l) = self.at(b, h);
        (
            o,
            Layout {
                batch_stride: 0,
                row_stride: l.col_stride,
                col_stride: l.row_stride,
            },
        )
    }
}

/// Shapes shared by forward and backward.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub scale: f32,
}

/// The arena's base pointer, shared by the tasks (each writes its own heads only).
#[derive(Clone, Copy)]
struct Arena(*mut f32);
// SAFETY: tasks write disjoint output regions and only read shared inputs.
unsafe impl Sync for Arena {}
unsafe impl Send for Arena {}

fn row_major(cols: usize) -> Layout {
    Layout {
        batch_stride: 0,
        row_stride: cols,
        col_stride: 1,
    }
}

/// `c = a @ b` on one thread (`m x k` times `k x n` into contiguous `m x n`).
///
/// # Safety
/// The operands must be valid for their layouts; `c` must not overlap them.
#[allow(clippy::too_many_arguments)]
unsafe fn mm(
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    la: Layout,
    b: *const f32,
    lb: Layout,
    c: *mut f32,
) {
    // SAFETY: forwarded.
    unsafe { gemm::sgemm(1, m, n, k, a, la, b, lb, c, 1) }
}

/// `e^x` in f32 to about 1 ulp (Cephes `expf`: range reduction by ln 2, a degree-6 polynomial,
/// the exponent put back in the bits), written so a loop over a row vectorizes; libm's `expf`
/// is a call per element. Inputs below -87.3 give about 1e-38 instead of 0 or a denormal;
/// above 88.37 the result is infinite.
#[inline(always)]
fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let p = 1.987_569_1e-4_f32;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 1.666_666_5e-1;
    let p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    y * pow2(n)
}

/// `2^n` for an integral `n` in -126..=128, built in the exponent bits. `n as i32` would be a
/// saturating conversion, which LLVM leaves scalar (8 conversions per vector: it made `exp`
/// 3 ns per element); adding 1.5 * 2^23 puts `n` exactly in the low mantissa bits instead.
#[inline(always)]
fn pow2(n: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0;
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
fn row_max<const AVX2: bool>(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: `AVX2` is set only where the cpu has it.
        return unsafe { x86::reduce(xs, xs, x86::Reduce::Max) };
    }
    lanes(xs, f32::NEG_INFINITY, f32::max)
}

#[inline(always)]
fn row_sum<const AVX2: bool>(xs: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as in `row_max`.
        return unsafe { x86::reduce(xs, xs, x86::Reduce::Sum) };
    }
    lanes(xs, 0.0, |a, b| a + b)
}

#[inline(always)]
fn row_dot<const AVX2: bool>(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if AVX2 {
        // SAFETY: as in `row_max`.
        return unsafe { x86::reduce(a, b, x86::Reduce::Dot) };
    }
    dot(a, b)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{combine, LANES};
    use std::arch::x86_64::*;

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

/// One row of probabilities: `live` scaled, masked scores in, `p` out (zeros past `live`).
#[inline(always)]
fn softmax_row<const AVX2: bool>(row: &mut [f32], live: usize, scale: f32) {
    let (head, rest) = row.split_at_mut(live);
    head.iter_mut().for_each(|x| *x *= scale);
    let max = row_max::<AVX2>(head);
    head.iter_mut().for_each(|x| *x = exp(*x - max));
    let sum = row_sum::<AVX2>(head);
    head.iter_mut().for_each(|x| *x /= sum);
    rest.fill(0.0);
}

/// `ds = p (dp - Σ_j p dp)` row by row, in place over `ds` (which holds `dp`).
#[inline(always)]
fn softmax_grad_rows<const AVX2: bool>(p: &[f32], ds: &mut [f32], n: usize) {
    for (prow, drow) in p.chunks_exact(n).zip(ds.chunks_exact_mut(n)) {
        let t = row_dot::<AVX2>(prow, drow);
        for (x, pp) in drow.iter_mut().zip(prow) {
            *x = pp * (*x - t);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_grad_rows_avx2(p: &[f32], ds: &mut [f32], n: usize) {
    softmax_grad_rows::<true>(p, ds, n)
}

/// `softmax_grad_rows` in its AVX2 build where the cpu has it (same bits, see `row_max`).
fn softmax_grad(p: &[f32], ds: &mut [f32], n: usize) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the feature is present.
        unsafe { softmax_grad_rows_avx2(p, ds, n) };
        return;
    }
    softmax_grad_rows::<false>(p, ds, n)
}

/// Query rows per block. A causal block of rows `r0..r1` only needs keys `0..r1`, so blocks
/// skip most of the masked half of the scores; 64 rows keep a block's scores in L2.
const ROWS: usize = 64;

/// The row blocks of a head: `(r0, r1, n)` with `n` the keys the block sees.
fn blocks(d: &Dims) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    (0..d.seq).step_by(ROWS).map(|r0| {
        let r1 = (r0 + ROWS).min(d.seq);
        (r0, r1, if d.causal { r1 } else { d.seq })
    })
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_rows_avx2(p: &mut [f32], n: usize, r0: usize, d: &Dims) {
    for (i, row) in p.chunks_exact_mut(n).enumerate() {
        softmax_row::<true>(row, if d.causal { r0 + i + 1 } else { n }, d.scale);
    }
}

/// Softmax of each row of a block (`n` wide, its first row is row `r0` of the head), scaled
/// and masked in place, into probabilities. The AVX2 build of the same code runs where the cpu
/// has it: no FMA is formed either way (Rust never contracts), so both give the same bits.
fn softmax_rows(p: &mut [f32], n: usize, r0: usize, d: &Dims) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the feature is present.
        unsafe { softmax_rows_avx2(p, n, r0, d) };
        return;
    }
    for (i, row) in p.chunks_exact_mut(n).enumerate() {
        softmax_row::<false>(row, if d.causal { r0 + i + 1 } else { n }, d.scale);
    }
}

/// The probabilities of rows `r0..r1` over keys `0..n` of batch `b`, query head `h`, into `p`
/// (`(r1 - r0) x n`, row-major).
///
/// # Safety
/// `arena` holds `q` and `k` as described.
#[allow(clippy::too_many_arguments)]
unsafe fn probabilities(
    arena: Arena,
    d: &Dims,
    q: &Heads,
    k: &Heads,
    (b, h): (usize, usize),
    (r0, r1, n): (usize, usize, usize),
    p: &mut [f32],
) {
    let kvh = h / (d.heads / d.kv_heads);
    let (qo, ql) = q.at(b, h);
    let (ko, kl) = k.at_t(b, kvh);
    let p = &mut p[..(r1 - r0) * n];
    // SAFETY: the views lie in the arena; `p` is our own scratch.
    unsafe {
        mm(
            r1 - r0,
            n,
            d.head_dim,
            arena.0.add(qo + r0 * ql.row_stride),
            ql,
            arena.0.add(ko),
            kl,
            p.as_mut_ptr(),
        );
    }
    softmax_rows(p, n, r0, d);
}

/// `m x n` row-major read transposed.
fn transposed(n: usize) -> Layout {
    Layout {
        batch_stride: 0,
        row_stride: 1,
        col_stride: n,
    }
}

/// `out[b, h] = attention(q, k, v)`, `out` contiguous `[B, H, S, D]` at element offset `out`.
///
/// # Safety
/// `base` is the arena; the views and `out` lie inside it, `out` overlapping none of them.
pub unsafe fn forward(base: *mut f32, d: Dims, q: Heads, k: Heads, v: Heads, out: usize) {
    let arena = Arena(base);
    let group = d.heads / d.kv_heads;
    let (s, hd) = (d.seq, d.head_dim);
    Pool::global().run(d.batch * d.kv_heads, &|task| {
        let (b, g) = (task / d.kv_heads, task % d.kv_heads);
        let mut p = vec![0.0f32; ROWS.min(s) * s];
        let (vo, vl) = v.at(b, g);
        for h in g * group..(g + 1) * group {
            let o = out + (b * d.heads + h) * s * hd;
            for (r0, r1, n) in blocks(&d) {
                // SAFETY: the caller's contract; each task writes only its own heads of `out`.
                unsafe {
                    probabilities(arena, &d, &q, &k, (b, h), (r0, r1, n), &mut p);
                    mm(
                        r1 - r0,
                        hd,
                        n,
                        p.as_ptr(),
                        row_major(n),
                        arena.0.add(vo),
                        vl,
                        arena.0.add(o + r0 * hd),
                    );
                }
            }
        }
    });
}

/// Contiguous outputs of the backward step, as element offsets.
#[derive(Clone, Copy, Debug)]
pub struct Grads {
    pub dq: usize,
    pub dk: usize,
    pub dv: usize,
}

/// The gradients of `forward` for `dout` into `grads`. Per query head and row block: the
/// block's probabilities again, then `dv += pᵀ dout`, `ds = p (dout vᵀ - Σ_j ...)`,
/// `dq = ds k · scale`, `dk += dsᵀ q · scale`; kv gradients summed over heads, then blocks, in
/// ascending order.
///
/// # Safety
/// As for `forward`; the three outputs overlap nothing they are computed from nor each other.
pub unsafe fn backward(
    base: *mut f32,
    d: Dims,
    q: Heads,
    k: Heads,
    v: Heads,
    dout: Heads,
    grads: Grads,
) {
    let arena = Arena(base);
    let group = d.heads / d.kv_heads;
    let (s, hd) = (d.seq, d.head_dim);
    Pool::global().run(d.batch * d.kv_heads, &|task| {
        let (b, g) = (task / d.kv_heads, task % d.kv_heads);
        let mut p = vec![0.0f32; ROWS.min(s) * s];
        let mut ds = vec![0.0f32; ROWS.min(s) * s];
        let mut part = vec![0.0f32; s * hd];
        let mut dk = vec![0.0f32; s * hd];
        let mut dv = vec![0.0f32; s * hd];
        let (ko, kl) = k.at(b, g);
        let (vto, vtl) = v.at_t(b, g);
        for h in g * group..(g + 1) * group {
            let (doo, dol) = dout.at(b, h);
            let (qo, ql) = q.at(b, h);
            let dq = grads.dq + (b * d.heads + h) * s * hd;
            for (r0, r1, n) in blocks(&d) {
                let rows = r1 - r0;
                let (dob, qb) = (doo + r0 * dol.row_stride, qo + r0 * ql.row_stride);
                // SAFETY: the caller's contract; each task writes only its own heads.
                unsafe {
                    probabilities(arena, &d, &q, &k, (b, h), (r0, r1, n), &mut p);
                    let p = &p[..rows * n];
                    let ds = &mut ds[..rows * n];
                    // dv[..n] += pᵀ dout[r0..r1]
                    mm(
                        n,
                        hd,
                        rows,
                        p.as_ptr(),
                        transposed(n),
                        arena.0.add(dob),
                        dol,
                        part.as_mut_ptr(),
                    );
                    dv.iter_mut()
                        .zip(&part[..n * hd])
                        .for_each(|(a, x)| *a += x);
                    // dp = dout vᵀ, then ds = p (dp - Σ_j p dp) in place.
                    mm(
                        rows,
                        n,
                        hd,
                        arena.0.add(dob),
                        dol,
                        arena.0.add(vto),
                        vtl,
                        ds.as_mut_ptr(),
                    );
                    softmax_grad(p, ds, n);
                    // dq[r0..r1] = (ds k[..n]) * scale
                    let dqb = arena.0.add(dq + r0 * hd);
                    mm(
                        rows,
                        hd,
                        n,
                        ds.as_ptr(),
                        row_major(n),
                        arena.0.add(ko),
                        kl,
                        dqb,
                    );
                    std::slice::from_raw_parts_mut(dqb, rows * hd)
                        .iter_mut()
                        .for_each(|x| *x *= d.scale);
                    // dk[..n] += (dsᵀ q[r0..r1]) * scale
                    mm(
                        n,
                        hd,
                        rows,
                        ds.as_ptr(),
                        transposed(n),
                        arena.0.add(qb),
                        ql,
                        part.as_mut_ptr(),
                    );
                    dk.iter_mut()
                        .zip(&part[..n * hd])
                        .for_each(|(a, x)| *a += x * d.scale);
                }
            }
        }
        let at = (b * d.kv_heads + g) * s * hd;
        // SAFETY: this task's kv head of the contiguous outputs.
        unsafe {
            std::ptr::copy_nonoverlapping(dk.as_ptr(), arena.0.add(grads.dk + at), s * hd);
            std::ptr::copy_nonoverlapping(dv.as_ptr(), arena.0.add(grads.dv + at), s * hd);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(len: usize, seed: usize) -> Vec<f32> {
        (0..len)
            .map(|i| (((i + seed) * 7919 % 1013) as f32 - 506.0) * 0.013)
            .collect()
    }

    /// The AVX2 row reductions and softmax give the portable loops' bits, odd lengths included.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx2_rows_match_the_portable_loops_bit_for_bit() {
        if !is_x86_feature_detected!("avx2") {
            return;
        }
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
            if len >= 3 {
                let d = Dims {
                    batch: 1,
                    heads: 1,
                    kv_heads: 1,
                    seq: len,
                    head_dim: 2,
                    causal: true,
                    scale: 0.3,
                };
                let (mut fast, mut slow) = (a.repeat(3), a.repeat(3));
                // Three rows of a causal block starting at row len - 3: row i sees len - 2 + i keys.
                softmax_rows(&mut fast, len, len - 3, &d);
                for (i, r) in slow.chunks_exact_mut(len).enumerate() {
                    softmax_row::<false>(r, len - 2 + i, 0.3);
                }
                assert_eq!(
                    fast.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    slow.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "softmax, len {len}"
                );
                let (mut fast, mut slow) = (b.repeat(3), b.repeat(3));
                let p = a.repeat(3);
                softmax_grad(&p, &mut fast, len);
                softmax_grad_rows::<false>(&p, &mut slow, len);
                assert_eq!(
                    fast.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    slow.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "softmax gradient, len {len}"
                );
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
