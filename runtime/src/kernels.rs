//! The cubecl kernels the cpu backend launches. Every kernel addresses the one arena buffer with
//! element (or vector) offsets passed at launch, so a Program binds one buffer for all its
//! launches, and a new offset never means a new JIT compile: only the comptime arguments (the
//! fused expression, which inputs are broadcast) and the vector width pick a compiled kernel.
//!
//! Work split: one cube of `CubeDim` units; unit `u` takes the `u`-th contiguous chunk of the
//! output. On cubecl-cpu a unit is a worker thread, and contiguous chunks measured 1.7x faster
//! than one element per unit (docs/cubecl-notes.md).
//!
//! Numerics: f32 throughout, no fused multiply-add contraction in the expressions (each op rounds
//! as the eager kernel does), so a fused kernel and the op-by-op kernels agree bit for bit.

use cubecl::prelude::*;
use graphtrain_ir::{BinaryOp, CompareOp, UnaryOp};
use graphtrain_lowering::Expr;

/// Picks offset `k` of the six a map launch passes.
#[cube]
fn offset_of(
    o0: usize,
    o1: usize,
    o2: usize,
    o3: usize,
    o4: usize,
    o5: usize,
    #[comptime] k: u32,
) -> usize {
    if comptime!(k == 0) {
        o0
    } else if comptime!(k == 1) {
        o1
    } else if comptime!(k == 2) {
        o2
    } else if comptime!(k == 3) {
        o3
    } else if comptime!(k == 4) {
        o4
    } else {
        o5
    }
}

#[cube]
#[allow(clippy::too_many_arguments)]
fn eval<N: Size>(
    arena: &mut [Vector<f32, N>],
    o0: usize,
    o1: usize,
    o2: usize,
    o3: usize,
    o4: usize,
    o5: usize,
    i: usize,
    #[comptime] bcast: u32,
    #[comptime] e: Expr,
) -> Vector<f32, N> {
    match e {
        Expr::Input(k) => {
            let at = offset_of(o0, o1, o2, o3, o4, o5, k);
            if comptime!((bcast >> k) & 1 == 1) {
                Vector::<f32, N>::new(arena[at].extract(0usize))
            } else {
                arena[at + i]
            }
        }
        Expr::Const(bits) => Vector::<f32, N>::new(f32::from_bits(bits)),
        Expr::Unary(op, a) => {
            let x = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *a);
            let one = Vector::<f32, N>::new(1.0);
            match op {
                UnaryOp::Neg => -x,
                UnaryOp::Exp => Vector::exp(x),
                UnaryOp::Log => Vector::ln(x),
                UnaryOp::Sqrt => Vector::sqrt(x),
                UnaryOp::Rsqrt => one / Vector::sqrt(x),
                UnaryOp::Recip => one / x,
                UnaryOp::Sin => Vector::sin(x),
                UnaryOp::Cos => Vector::cos(x),
                UnaryOp::Tanh => Vector::tanh(x),
                UnaryOp::Sigmoid => one / (one + Vector::exp(-x)),
                UnaryOp::Silu => x / (one + Vector::exp(-x)),
                UnaryOp::Abs => Vector::abs(x),
                UnaryOp::Square => x * x,
            }
        }
        Expr::Binary(op, a, b) => {
            let x = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *a);
            let y = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *b);
            match op {
                BinaryOp::Add => x + y,
                BinaryOp::Sub => x - y,
                BinaryOp::Mul => x * y,
                BinaryOp::Div => x / y,
                BinaryOp::Max => max(x, y),
                BinaryOp::Min => min(x, y),
                BinaryOp::Pow => Vector::powf(x, y),
            }
        }
        Expr::Compare(op, a, b) => {
            let x = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *a);
            let y = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *b);
            let one = Vector::<f32, N>::new(1.0);
            let zero = Vector::<f32, N>::new(0.0);
            let c = match op {
                CompareOp::Eq => x.equal(&y),
                CompareOp::Ne => x.not_equal(&y),
                CompareOp::Lt => x.less_than(&y),
                CompareOp::Le => x.less_equal(&y),
                CompareOp::Gt => x.greater_than(&y),
                CompareOp::Ge => x.greater_equal(&y),
            };
            select_many(c, one, zero)
        }
        Expr::Select(c, a, b) => {
            let cv = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *c);
            let x = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *a);
            let y = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *b);
            select_many(cv.not_equal(&Vector::<f32, N>::new(0.0)), x, y)
        }
        Expr::Trunc(a) => Vector::trunc(eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *a)),
        Expr::NonZero(a) => {
            let x = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, *a);
            let zero = Vector::<f32, N>::new(0.0);
            select_many(x.not_equal(&zero), Vector::<f32, N>::new(1.0), zero)
        }
    }
}

/// `arena[out + i] = expr(inputs at i)` for `i < len` (offsets and `len` in vectors of `N`).
/// Bit `k` of `bcast` set: input `k` is one element, at vector offset `ok`, read for every `i`.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn map_kernel<N: Size>(
    arena: &mut [Vector<f32, N>],
    o0: usize,
    o1: usize,
    o2: usize,
    o3: usize,
    o4: usize,
    o5: usize,
    out: usize,
    len: usize,
    #[comptime] bcast: u32,
    #[comptime] expr: Expr,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let chunk = len.div_ceil(units);
    let start = ABSOLUTE_POS * chunk;
    let mut end = start + chunk;
    if end > len {
        end = len;
    }
    for i in start..end {
        arena[out + i] = eval::<N>(arena, o0, o1, o2, o3, o4, o5, i, bcast, expr.clone());
    }
}

/// Strided copy over up to four dims `[n0, n1, n2, n3]` (`n0` derived from `len`):
/// `arena[dst + Σ idx·t] = arena[src + Σ idx·s]`. Units take whole rows of the innermost dim,
/// so the index arithmetic is paid once per row, not per element.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn copy_kernel(
    arena: &mut [f32],
    len: usize,
    n1: usize,
    n2: usize,
    n3: usize,
    s0: usize,
    s1: usize,
    s2: usize,
    s3: usize,
    t0: usize,
    t1: usize,
    t2: usize,
    t3: usize,
    src: usize,
    dst: usize,
) {
    let rows = len / n3;
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let chunk = rows.div_ceil(units);
    let start = ABSOLUTE_POS * chunk;
    let mut end = start + chunk;
    if end > rows {
        end = rows;
    }
    for r in start..end {
        let i2 = r % n2;
        let q = r / n2;
        let i1 = q % n1;
        let i0 = q / n1;
        let sb = src + i0 * s0 + i1 * s1 + i2 * s2;
        let tb = dst + i0 * t0 + i1 * t1 + i2 * t2;
        for j in 0..n3 {
            arena[tb + j * t3] = arena[sb + j * s3];
        }
    }
}

/// `arena[out + o] = reduce_{r0 < m0, r1 < m1} arena[src + base(o) + r0·q0 + r1·q1]` where
/// `o` walks `[len / (n1·n2), n1, n2]` with source strides `s0, s1, s2`, in index order.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn reduce_kernel(
    arena: &mut [f32],
    len: usize,
    n1: usize,
    n2: usize,
    s0: usize,
    s1: usize,
    s2: usize,
    m0: usize,
    m1: usize,
    q0: usize,
    q1: usize,
    src: usize,
    out: usize,
    #[comptime] is_max: bool,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let chunk = len.div_ceil(units);
    let start = ABSOLUTE_POS * chunk;
    let mut end = start + chunk;
    if end > len {
        end = len;
    }
    for o in start..end {
        let i2 = o % n2;
        let r = o / n2;
        let i1 = r % n1;
        let i0 = r / n1;
        let base = src + i0 * s0 + i1 * s1 + i2 * s2;
        let mut acc = if is_max {
            f32::new(f32::NEG_INFINITY)
        } else {
            f32::new(0.0)
        };
        for a in 0..m0 {
            for b in 0..m1 {
                let x = arena[base + a * q0 + b * q1];
                if is_max {
                    acc = max(acc, x);
                } else {
                    acc += x;
                }
            }
        }
        arena[out + o] = acc;
    }
}
