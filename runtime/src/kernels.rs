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

/// Picks argument `k` of the six per-input arguments a map launch passes.
#[cube]
fn pick(
    a0: usize,
    a1: usize,
    a2: usize,
    a3: usize,
    a4: usize,
    a5: usize,
    #[comptime] k: u32,
) -> usize {
    if comptime!(k == 0) {
        a0
    } else if comptime!(k == 1) {
        a1
    } else if comptime!(k == 2) {
        a2
    } else if comptime!(k == 3) {
        a3
    } else if comptime!(k == 4) {
        a4
    } else {
        a5
    }
}

/// Access modes of a map input, two bits each in the `modes` comptime argument (see
/// `graphtrain_lowering::Access`).
pub const MODE_FULL: u32 = 0;
pub const MODE_SCALAR: u32 = 1;
pub const MODE_OUTER: u32 = 2;
pub const MODE_INNER: u32 = 3;

/// The per-input arguments of a map kernel, gathered from its scalar launch arguments: offsets `o*` (in vectors for full inputs, in
/// elements otherwise) and parameters `p*` (`inner` or `period`), plus `base`, the output
/// element of vector 0, and `w`, the vector width.
#[derive(CubeType, Clone, Copy)]
pub struct MapArgs {
    o0: usize,
    o1: usize,
    o2: usize,
    o3: usize,
    o4: usize,
    o5: usize,
    p0: usize,
    p1: usize,
    p2: usize,
    p3: usize,
    p4: usize,
    p5: usize,
    base: usize,
    w: usize,
}

#[cube]
fn load<N: Size>(
    arena: &mut [Vector<f32, N>],
    args: &MapArgs,
    i: usize,
    #[comptime] k: u32,
    #[comptime] modes: u32,
) -> Vector<f32, N> {
    let o = pick(args.o0, args.o1, args.o2, args.o3, args.o4, args.o5, k);
    let mode = comptime!((modes >> (2 * k)) & 3);
    if comptime!(mode == MODE_FULL) {
        arena[o + i]
    } else if comptime!(mode == MODE_SCALAR) {
        Vector::<f32, N>::new(arena[o / args.w].extract_dynamic(o % args.w))
    } else if comptime!(mode == MODE_OUTER) {
        let p = pick(args.p0, args.p1, args.p2, args.p3, args.p4, args.p5, k);
        // Every lane of the vector maps to the same source element (inner % w == 0).
        let e = o + (args.base + i * args.w) / p;
        Vector::<f32, N>::new(arena[e / args.w].extract_dynamic(e % args.w))
    } else {
        let p = pick(args.p0, args.p1, args.p2, args.p3, args.p4, args.p5, k);
        // The lanes map to consecutive source elements (period % w == 0).
        arena[(o + (args.base + i * args.w) % p) / args.w]
    }
}

#[cube]
fn eval<N: Size>(
    arena: &mut [Vector<f32, N>],
    args: &MapArgs,
    i: usize,
    #[comptime] modes: u32,
    #[comptime] e: Expr,
) -> Vector<f32, N> {
    match e {
        Expr::Input(k) => load::<N>(arena, args, i, k, modes),
        Expr::Const(bits) => Vector::<f32, N>::new(f32::from_bits(bits)),
        Expr::Unary(op, a) => {
            let x = eval::<N>(arena, args, i, modes, *a);
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
            let x = eval::<N>(arena, args, i, modes, *a);
            let y = eval::<N>(arena, args, i, modes, *b);
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
            let x = eval::<N>(arena, args, i, modes, *a);
            let y = eval::<N>(arena, args, i, modes, *b);
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
            let cv = eval::<N>(arena, args, i, modes, *c);
            let x = eval::<N>(arena, args, i, modes, *a);
            let y = eval::<N>(arena, args, i, modes, *b);
            select_many(cv.not_equal(&Vector::<f32, N>::new(0.0)), x, y)
        }
        Expr::Trunc(a) => Vector::trunc(eval::<N>(arena, args, i, modes, *a)),
        Expr::NonZero(a) => {
            let x = eval::<N>(arena, args, i, modes, *a);
            let zero = Vector::<f32, N>::new(0.0);
            select_many(x.not_equal(&zero), Vector::<f32, N>::new(1.0), zero)
        }
    }
}

/// `arena[out + i] = expr(inputs at i)` for `i < len` (`out` and `len` in vectors of `N`); how
/// each input is read is in `modes` and `args` (see `MapArgs`).
#[cube(launch_unchecked, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn map_kernel<N: Size>(
    arena: &mut [Vector<f32, N>],
    o0: usize,
    o1: usize,
    o2: usize,
    o3: usize,
    o4: usize,
    o5: usize,
    p0: usize,
    p1: usize,
    p2: usize,
    p3: usize,
    p4: usize,
    p5: usize,
    base: usize,
    w: usize,
    out: usize,
    len: usize,
    #[comptime] modes: u32,
    #[comptime] expr: Expr,
) {
    let args = MapArgs {
        o0,
        o1,
        o2,
        o3,
        o4,
        o5,
        p0,
        p1,
        p2,
        p3,
        p4,
        p5,
        base,
        w,
    };
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let chunk = len.div_ceil(units);
    let start = ABSOLUTE_POS * chunk;
    let mut end = start + chunk;
    if end > len {
        end = len;
    }
    for i in start..end {
        arena[out + i] = eval::<N>(arena, &args, i, modes, expr.clone());
    }
}

/// Strided copy over up to four dims `[n0, n1, n2, n3]` (`n0` derived from `len`):
/// `arena[dst + Σ idx·t] = arena[src + Σ idx·s]`. Units take whole rows of the innermost dim,
/// so the index arithmetic is paid once per row, not per element.
#[cube(launch_unchecked, create_dummy_kernel)]
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
#[cube(launch_unchecked, create_dummy_kernel)]
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
