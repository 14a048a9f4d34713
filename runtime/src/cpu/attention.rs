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

use super::gemm::{self, Layout};
use super::pool::{Pool, TaskPtr};
use super::rows::{exp, row_dot, row_max, row_sum};
pub use crate::shared::attention_shape::Dims;
use std::cell::RefCell;

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

/// The arena, shared by the tasks (each writes its own heads only).
type Arena = TaskPtr<f32>;

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
    kernel: gemm::GemmKernel,
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
    unsafe { gemm::sgemm_with(kernel, 1, m, n, k, a, la, b, lb, c, 1) }
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
/// skip most of the masked half of the scores, at the cost of smaller products. Measured on
/// `peer` (`attention_cost` example): forward is faster with 128 rows than with 64 (4.7
/// against 5.4 ms), and with 96 (a multiple of the GEMM's 12-row tile) than with 128 (time
/// ratios 0.969 and 0.942, the two alternated in one process); backward, with five products
/// per block and two score-sized buffers, with 64 (11.5 against 12.5-15.6 ms; 48 made no
/// difference).
const FORWARD_ROWS: usize = 96;
const BACKWARD_ROWS: usize = 64;

fn blocks(d: &Dims, rows: usize) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    (0..d.seq).step_by(rows).map(move |r0| {
        let r1 = (r0 + rows).min(d.seq);
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_rows_avx512(p: &mut [f32], n: usize, r0: usize, d: &Dims) {
    for (i, row) in p.chunks_exact_mut(n).enumerate() {
        let live = if d.causal { r0 + i + 1 } else { n };
        // SAFETY: the feature is enabled here; `live <= n`.
        unsafe { super::rows::x86::softmax16(row, live, d.scale) };
    }
}

/// Softmax of each row of a block (`n` wide, its first row is row `r0` of the head), scaled
/// and masked in place, into probabilities. Where the cpu has them, AVX-512 (`softmax16`: a
/// third less time than the AVX2 build in `peer`'s step, docs/benchmarks.md) or the AVX2 build
/// of the same code run instead. No FMA is formed by any of them (Rust never contracts; the
/// AVX-512 code uses separate multiplies and adds), so all give the same bits.
fn softmax_rows(p: &mut [f32], n: usize, r0: usize, d: &Dims) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature is present.
        unsafe { softmax_rows_avx512(p, n, r0, d) };
        return;
    }
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
    kernel: gemm::GemmKernel,
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
            kernel,
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

/// Calls `f` with this thread's scratch, at least `len` floats, holding whatever the last task
/// left there: every caller overwrites what it reads, or zeroes it. Tasks used to allocate
/// their zeroed buffers on every call (64 per launch): `memset`, `calloc` and `free` were
/// about 3% of attention's samples under `perf`, and with this the forward runs about 5% and
/// the backward 1-2% faster (alternated in one process, `attention_cost`'s shape).
fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    thread_local! {
        static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    }
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => {
            if s.len() < len {
                s.resize(len, 0.0);
            }
            f(&mut s[..len])
        }
        // Attention inside an attention task on this thread (none does so) gets its own.
        Err(_) => f(&mut vec![0.0; len]),
    })
}

/// `m x n` row-major read transposed.
fn transposed(n: usize) -> Layout {
    Layout {
        batch_stride: 0,
        row_stride: 1,
        col_stride: n,
    }
}

impl Heads {
    /// Element offset of row `r` of head `(b, h)`.
    fn row(&self, b: usize, h: usize, r: usize) -> usize {
        self.offset + b * self.strides[0] + h * self.strides[1] + r * self.strides[2]
    }

    /// Writes `rows` (contiguous, `head_dim` wide) as rows `r0..` of head `(b, h)`.
    ///
    /// # Safety
    /// The head lies in the arena and no other task writes it.
    unsafe fn write_rows(
        &self,
        arena: Arena,
        (b, h): (usize, usize),
        r0: usize,
        rows: &[f32],
        head_dim: usize,
    ) {
        for (i, row) in rows.chunks_exact(head_dim).enumerate() {
            // SAFETY: the caller's contract; rows are contiguous (`strides[3] == 1`).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    row.as_ptr(),
                    arena.0.add(self.row(b, h, r0 + i)),
                    head_dim,
                )
            };
        }
    }
}

/// `out[b, h] = attention(q, k, v)`. `out` is a `[B, H, S, D]` view with contiguous rows
/// (`strides[3] == 1`): contiguous, or the `[B, S, H, D]` value the next matmul reads.
///
/// # Safety
/// `base` is the arena; the views and `out` lie inside it, `out` overlapping none of them.
pub unsafe fn forward(base: *mut f32, d: Dims, kernel: gemm::GemmKernel, qkv: Qkv, out: Heads) {
    let Qkv { q, k, v } = qkv;
    let arena = TaskPtr(base);
    let group = d.heads / d.kv_heads;
    let (s, hd) = (d.seq, d.head_dim);
    Pool::current().run(d.batch * d.kv_heads, &|task| {
        let (b, g) = (task / d.kv_heads, task % d.kv_heads);
        let rows = FORWARD_ROWS.min(s);
        with_scratch(rows * (s + hd), |scratch| {
            let (p, o) = scratch.split_at_mut(rows * s);
            let (vo, vl) = v.at(b, g);
            for h in g * group..(g + 1) * group {
                for (r0, r1, n) in blocks(&d, FORWARD_ROWS) {
                    // SAFETY: the caller's contract; each task writes only its own heads of `out`.
                    unsafe {
                        probabilities(arena, &d, kernel, &q, &k, (b, h), (r0, r1, n), p);
                        mm(
                            kernel,
                            r1 - r0,
                            hd,
                            n,
                            p.as_ptr(),
                            row_major(n),
                            arena.0.add(vo),
                            vl,
                            o.as_mut_ptr(),
                        );
                        out.write_rows(arena, (b, h), r0, &o[..(r1 - r0) * hd], hd);
                    }
                }
            }
        });
    });
}

/// The operands of both directions: queries `[B, H, S, D]`, keys and values `[B, Hkv, S, D]`.
#[derive(Clone, Copy, Debug)]
pub struct Qkv {
    pub q: Heads,
    pub k: Heads,
    pub v: Heads,
}

/// Outputs of the backward step, laid out as `forward`'s `out`.
#[derive(Clone, Copy, Debug)]
pub struct Grads {
    pub dq: Heads,
    pub dk: Heads,
    pub dv: Heads,
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
    kernel: gemm::GemmKernel,
    qkv: Qkv,
    dout: Heads,
    grads: Grads,
) {
    let Qkv { q, k, v } = qkv;
    let arena = TaskPtr(base);
    let group = d.heads / d.kv_heads;
    let (s, hd) = (d.seq, d.head_dim);
    Pool::current().run(d.batch * d.kv_heads, &|task| {
        let (b, g) = (task / d.kv_heads, task % d.kv_heads);
        let rows = BACKWARD_ROWS.min(s);
        // A few cache lines between the buffers, so that `p` and `ds`, read together row by
        // row, do not start at the same offset in a 4 KiB page, where they would share L1
        // sets (a precaution: not measured on its own, only with the scratch as a whole).
        let pad = 48;
        with_scratch(2 * rows * s + 3 * s * hd + 4 * pad, |scratch| {
            let (p, rest) = scratch.split_at_mut(rows * s + pad);
            let (ds, rest) = rest.split_at_mut(rows * s + pad);
            let (part, rest) = rest.split_at_mut(s * hd + pad);
            let (dk, dv) = rest.split_at_mut(s * hd + pad);
            let (dk, dv) = (&mut dk[..s * hd], &mut dv[..s * hd]);
            // The kv gradients accumulate over heads and blocks from zero.
            dk.fill(0.0);
            dv.fill(0.0);
            let (ko, kl) = k.at(b, g);
            let (vto, vtl) = v.at_t(b, g);
            for h in g * group..(g + 1) * group {
                let (doo, dol) = dout.at(b, h);
                let (qo, ql) = q.at(b, h);
                for (r0, r1, n) in blocks(&d, BACKWARD_ROWS) {
                    let rows = r1 - r0;
                    let (dob, qb) = (doo + r0 * dol.row_stride, qo + r0 * ql.row_stride);
                    // SAFETY: the caller's contract; each task writes only its own heads.
                    unsafe {
                        probabilities(arena, &d, kernel, &q, &k, (b, h), (r0, r1, n), p);
                        let p = &p[..rows * n];
                        let ds = &mut ds[..rows * n];
                        // dv[..n] += pᵀ dout[r0..r1]
                        mm(
                            kernel,
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
                            kernel,
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
                        mm(
                            kernel,
                            rows,
                            hd,
                            n,
                            ds.as_ptr(),
                            row_major(n),
                            arena.0.add(ko),
                            kl,
                            part.as_mut_ptr(),
                        );
                        let dq = &mut part[..rows * hd];
                        dq.iter_mut().for_each(|x| *x *= d.scale);
                        grads.dq.write_rows(arena, (b, h), r0, dq, hd);
                        // dk[..n] += (dsᵀ q[r0..r1]) * scale
                        mm(
                            kernel,
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
            // SAFETY: this task's kv head of the outputs.
            unsafe {
                grads.dk.write_rows(arena, (b, g), 0, dk, hd);
                grads.dv.write_rows(arena, (b, g), 0, dv, hd);
            }
        });
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::rows::tests::row;

    /// Causal softmax rows through `softmax_rows` (a vector build) against the portable loop.
    #[cfg(target_arch = "x86_64")]
    fn check_softmax(what: &str, softmax_rows: impl Fn(&mut [f32], usize, usize, &Dims)) {
        for len in (3..40).chain([255, 256, 257]) {
            let a = row(len, 1);
            let d = Dims {
                batch: 1,
                heads: 1,
                kv_heads: 1,
                seq: len,
                head_dim: 2,
                causal: true,
                scale: 0.3,
            };
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let mut slow = a.repeat(3);
            // Three rows of a causal block starting at row len - 3: row i sees len - 2 + i keys.
            for (i, r) in slow.chunks_exact_mut(len).enumerate() {
                softmax_row::<false>(r, len - 2 + i, 0.3);
            }
            let mut fast = a.repeat(3);
            softmax_rows(&mut fast, len, len - 3, &d);
            assert_eq!(bits(&fast), bits(&slow), "{what} softmax, len {len}");
        }
    }

    /// The AVX2 softmax and softmax gradient give the portable loops' bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(
        not(host_has_avx2),
        ignore = "this cpu has no AVX2 and FMA: the AVX2 path is not run here"
    )]
    fn avx2_softmax_matches_the_portable_loops_bit_for_bit() {
        assert!(
            is_x86_feature_detected!("avx2"),
            "built on a cpu with AVX2, tested on one without"
        );
        // SAFETY: AVX2 checked above.
        check_softmax("AVX2", |x, len, r0, d| unsafe {
            softmax_rows_avx2(x, len, r0, d)
        });
        for len in (3..40).chain([255, 256, 257]) {
            let (a, b) = (row(len, 1), row(len, 5));
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            let (mut fast, mut slow) = (b.repeat(3), b.repeat(3));
            let p = a.repeat(3);
            softmax_grad(&p, &mut fast, len);
            softmax_grad_rows::<false>(&p, &mut slow, len);
            assert_eq!(bits(&fast), bits(&slow), "softmax gradient, len {len}");
        }
    }

    /// The AVX-512 softmax gives the portable loop's bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(
        not(host_has_avx512f),
        ignore = "this cpu has no AVX-512F: the AVX-512 path is not run here"
    )]
    fn avx512_softmax_matches_the_portable_loops_bit_for_bit() {
        assert!(
            is_x86_feature_detected!("avx512f"),
            "built on a cpu with AVX-512F, tested on one without"
        );
        // SAFETY: AVX-512F checked above.
        check_softmax("AVX-512", |x, len, r0, d| unsafe {
            softmax_rows_avx512(x, len, r0, d)
        });
    }
}
