//! Cross-entropy forward and backward on the cpu backend, one host step each.
//!
//! Why: decomposed, the loss is a log-softmax over the `[N, C]` logits (a max, an exp, a sum and
//! two subtractions: five passes over N·C values, after a copy of the logits), and its gradient
//! a softmax minus a one-hot built by scattering ones into a zero `[N, C]` tensor (another copy).
//! Here each is one pass of tasks over blocks of rows, each row read while it is in cache.
//!
//! Numerics (f32 per element, the loss total in f64): per row `m = max_j x_j`,
//! `s = Σ_j exp(x_j - m)` (`rows.rs`: fixed lane order, our `exp`),
//! `loss_r = (m + ln s) - x_t`, and the loss is `Σ_r loss_r / N` with the rows summed in order,
//! so the bits depend neither on the thread count nor on the split. Gradient:
//! `(exp(x_j - m) / s - [j == t]) · (g / N)`.

use super::pool::{Pool, TaskPtr};
use super::rows::{exp, row_max, row_sum};

/// `[N, C]` logits in the arena: element `(r, j)` at `offset + r·row_stride + j·col_stride`, in
/// 4-byte slots, or in 2-byte halves where `halves` (bf16 stored in 2 bytes,
/// `Program::is_two_byte`).
#[derive(Clone, Copy, Debug)]
pub struct Logits {
    pub offset: usize,
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
    pub halves: bool,
}

/// The arena, shared by the tasks (each writes its own rows only).
type Arena = TaskPtr<f32>;

/// Row `r` of `x`, copied into `scratch` when its elements are not contiguous f32 (widened
/// there when they are stored in 2 bytes: the row is read from memory at half the bytes and
/// reused from L1).
///
/// # Safety
/// `x` lies in the arena.
unsafe fn row<'a>(arena: Arena, x: &Logits, r: usize, scratch: &'a mut [f32]) -> &'a [f32] {
    if x.halves {
        let start = (arena.0 as *const u16).wrapping_add(x.offset + r * x.row_stride);
        if x.col_stride == 1 {
            // SAFETY: the caller's contract: the row's `cols` halves are in the arena.
            let halves = unsafe { std::slice::from_raw_parts(start, x.cols) };
            for (s, h) in scratch.iter_mut().zip(halves) {
                *s = f32::from_bits((*h as u32) << 16);
            }
        } else {
            for (j, s) in scratch.iter_mut().enumerate() {
                // SAFETY: the caller's contract.
                *s = unsafe { super::bf16_pack::widen(start, j * x.col_stride) };
            }
        }
        return scratch;
    }
    let start = arena.at(x.offset + r * x.row_stride);
    if x.col_stride == 1 {
        // SAFETY: the caller's contract.
        return unsafe { std::slice::from_raw_parts(start, x.cols) };
    }
    for (j, s) in scratch.iter_mut().enumerate() {
        // SAFETY: the caller's contract.
        *s = unsafe { *start.add(j * x.col_stride) };
    }
    scratch
}

/// Checks every target against the number of classes; returns them as indices.
///
/// # Safety
/// `targets` (`n` elements at `stride`) lies in the arena.
pub unsafe fn targets(
    base: *const f32,
    offset: usize,
    stride: usize,
    n: usize,
    classes: usize,
) -> Result<Vec<usize>, String> {
    (0..n)
        .map(|r| {
            // SAFETY: the caller's contract.
            let t = unsafe { *base.add(offset + r * stride) };
            if t >= 0.0 && (t as usize) < classes && t.fract() == 0.0 {
                Ok(t as usize)
            } else {
                Err(format!(
                    "cross-entropy target {t} at row {r} is out of range 0..{classes}"
                ))
            }
        })
        .collect()
}

/// `max`, then `exp(x - max)` into `e` and its sum. `EXP16`: the exponentials on AVX-512's
/// sixteen lanes (only inside a function built with that feature); LLVM vectorizes the scalar
/// loop to eight at most, and `exp`'s arithmetic is most of this loop's time. Same bits
/// either way.
#[inline(always)]
fn exp_row<const AVX2: bool, const EXP16: bool>(x: &[f32], e: &mut [f32]) -> (f32, f32) {
    let m = row_max::<AVX2>(x);
    #[cfg(target_arch = "x86_64")]
    if EXP16 {
        // SAFETY: `EXP16` is set only in the AVX-512 builds below; `e` is as long as `x`.
        unsafe { super::rows::x86::exp_minus16(x, m, e) };
        return (m, row_sum::<AVX2>(e));
    }
    for (e, &x) in e.iter_mut().zip(x) {
        *e = exp(x - m);
    }
    (m, row_sum::<AVX2>(e))
}

#[inline(always)]
fn losses<const AVX2: bool, const EXP16: bool>(
    arena: Arena,
    x: &Logits,
    t: &[usize],
    rows: &[usize],
    out: &mut [f64],
) {
    let (mut e, mut scratch) = (vec![0.0f32; x.cols], vec![0.0f32; x.cols]);
    for (&r, loss) in rows.iter().zip(out) {
        // SAFETY: `forward`'s contract.
        let xs = unsafe { row(arena, x, r, &mut scratch) };
        let (m, s) = exp_row::<AVX2, EXP16>(xs, &mut e);
        *loss = ((m + s.ln()) - xs[t[r]]) as f64;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn losses_avx2(arena: Arena, x: &Logits, t: &[usize], rows: &[usize], out: &mut [f64]) {
    losses::<true, false>(arena, x, t, rows, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn losses_avx512(arena: Arena, x: &Logits, t: &[usize], rows: &[usize], out: &mut [f64]) {
    losses::<true, true>(arena, x, t, rows, out)
}

#[inline(always)]
fn grads<const AVX2: bool, const EXP16: bool>(
    arena: Arena,
    x: &Logits,
    t: &[usize],
    scale: f32,
    out: usize,
    rows: &[usize],
) {
    let mut scratch = vec![0.0f32; x.cols];
    for &r in rows {
        // SAFETY: `backward`'s contract: `out` is a contiguous `[N, C]` apart from the logits.
        let (xs, g) = unsafe {
            (
                row(arena, x, r, &mut scratch),
                std::slice::from_raw_parts_mut(arena.0.add(out + r * x.cols), x.cols),
            )
        };
        let (_, s) = exp_row::<AVX2, EXP16>(xs, g);
        let target_p = g[t[r]] / s;
        for p in g.iter_mut() {
            *p = *p / s * scale;
        }
        g[t[r]] = (target_p - 1.0) * scale;
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn grads_avx2(
    arena: Arena,
    x: &Logits,
    t: &[usize],
    scale: f32,
    out: usize,
    rows: &[usize],
) {
    grads::<true, false>(arena, x, t, scale, out, rows)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2")]
unsafe fn grads_avx512(
    arena: Arena,
    x: &Logits,
    t: &[usize],
    scale: f32,
    out: usize,
    rows: &[usize],
) {
    grads::<true, true>(arena, x, t, scale, out, rows)
}

/// Rows `0..n` in blocks, one per task, for the pool.
fn row_blocks(n: usize) -> Vec<Vec<usize>> {
    let tasks = (Pool::current().width() * 4).min(n).max(1);
    (0..tasks)
        .map(|k| (n * k / tasks..n * (k + 1) / tasks).collect())
        .collect()
}

/// The widest build of the row loops this cpu runs: 2 (AVX-512 with AVX2), 1 (AVX2), 0.
fn isa() -> u8 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx2") {
            2
        } else {
            u8::from(is_x86_feature_detected!("avx2"))
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        0
    }
}

/// The mean cross-entropy of `x` against the checked targets `t`, written to `out` (one f32).
///
/// # Safety
/// `base` is the arena; `x` and `out` lie in it.
pub unsafe fn forward(base: *mut f32, x: Logits, t: &[usize], out: usize) {
    let arena = TaskPtr(base);
    let blocks = row_blocks(x.rows);
    let mut per_row = vec![0.0f64; x.rows];
    let slots = TaskPtr(per_row.as_mut_ptr());
    let isa = isa();
    Pool::current().run(blocks.len(), &|k| {
        let rows = &blocks[k];
        let Some(&first) = rows.first() else { return };
        // SAFETY: blocks are disjoint ranges of `per_row`, which outlives the job.
        let out = unsafe { std::slice::from_raw_parts_mut(slots.at(first), rows.len()) };
        // SAFETY (both): the features are present; the logits are in the arena.
        #[cfg(target_arch = "x86_64")]
        match isa {
            2 => return unsafe { losses_avx512(arena, &x, t, rows, out) },
            1 => return unsafe { losses_avx2(arena, &x, t, rows, out) },
            _ => {}
        }
        let _ = isa;
        losses::<false, false>(arena, &x, t, rows, out);
    });
    let total: f64 = per_row.iter().sum();
    // SAFETY: `out` is in the arena.
    unsafe { *base.add(out) = (total / x.rows as f64) as f32 };
}

/// The gradient of `forward` for an upstream gradient `g`, into contiguous `[N, C]` at `out`.
///
/// # Safety
/// `base` is the arena; `x` and `out` lie in it, `out` apart from `x`.
pub unsafe fn backward(base: *mut f32, x: Logits, t: &[usize], g: f32, out: usize) {
    let arena = TaskPtr(base);
    let blocks = row_blocks(x.rows);
    let scale = g / x.rows as f32;
    let isa = isa();
    Pool::current().run(blocks.len(), &|k| {
        let rows = &blocks[k];
        // SAFETY (both): the features are present; each task writes its own rows of `out`.
        #[cfg(target_arch = "x86_64")]
        match isa {
            2 => return unsafe { grads_avx512(arena, &x, t, scale, out, rows) },
            1 => return unsafe { grads_avx2(arena, &x, t, scale, out, rows) },
            _ => {}
        }
        let _ = isa;
        grads::<false, false>(arena, &x, t, scale, out, rows);
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::rows::tests::row;

    /// The AVX2 build of the loss and gradient loops gives the portable loops' bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(
        not(host_has_avx2),
        ignore = "this cpu has no AVX2 and FMA: the AVX2 path is not run here"
    )]
    fn avx2_build_matches_the_portable_loops_bit_for_bit() {
        assert!(
            is_x86_feature_detected!("avx2"),
            "built on a cpu with AVX2, tested on one without"
        );
        vector_build_matches_the_portable_loops(false);
    }

    /// The AVX-512 build of the loss and gradient loops gives the portable loops' bits.
    #[test]
    #[cfg(target_arch = "x86_64")]
    #[cfg_attr(
        not(host_has_avx512f),
        ignore = "this cpu has no AVX-512F: the AVX-512 path is not run here"
    )]
    fn avx512_build_matches_the_portable_loops_bit_for_bit() {
        assert!(
            is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx2"),
            "built on a cpu with AVX-512F, tested on one without"
        );
        vector_build_matches_the_portable_loops(true);
    }

    /// Rows whose length leaves a partial last group of 16 and of 8, through the AVX2 build or
    /// the AVX-512 one (the caller checked the cpu has it).
    #[cfg(target_arch = "x86_64")]
    fn vector_build_matches_the_portable_loops(avx512: bool) {
        let (n, c) = (5, 37);
        let mut arena: Vec<f32> = (0..n).flat_map(|r| row(c, r + 1)).collect();
        arena.resize(2 * n * c, f32::NAN);
        let x = Logits {
            offset: 0,
            rows: n,
            cols: c,
            row_stride: c,
            col_stride: 1,
            halves: false,
        };
        let t: Vec<usize> = (0..n).map(|r| (r * 7) % c).collect();
        let rows: Vec<usize> = (0..n).collect();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let base = TaskPtr(arena.as_mut_ptr());
        let mut want = vec![0.0f64; n];
        losses::<false, false>(base, &x, &t, &rows, &mut want);
        grads::<false, false>(base, &x, &t, 0.3, n * c, &rows);
        let want_grads = bits(&arena[n * c..]);
        let mut got = vec![0.0f64; n];
        arena[n * c..].fill(f32::NAN);
        // SAFETY: the callers checked the instruction sets; the logits and the gradient rows
        // are in `arena`.
        unsafe {
            if avx512 {
                losses_avx512(base, &x, &t, &rows, &mut got);
                grads_avx512(base, &x, &t, 0.3, n * c, &rows);
            } else {
                losses_avx2(base, &x, &t, &rows, &mut got);
                grads_avx2(base, &x, &t, 0.3, n * c, &rows);
            }
        }
        assert_eq!(got, want, "losses (AVX-512: {avx512})");
        assert_eq!(
            bits(&arena[n * c..]),
            want_grads,
            "gradients (AVX-512: {avx512})"
        );
    }
}
