//! The cubecl kernels the cpu and device backends launch. Every kernel addresses the one arena buffer with
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

/// Element `at` of input `k`'s binding.
#[cube]
#[allow(clippy::too_many_arguments)]
fn read<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    at: usize,
    #[comptime] k: u32,
) -> Vector<f32, N> {
    if comptime!(k == 0) {
        x0[at]
    } else if comptime!(k == 1) {
        x1[at]
    } else if comptime!(k == 2) {
        x2[at]
    } else if comptime!(k == 3) {
        x3[at]
    } else if comptime!(k == 4) {
        x4[at]
    } else {
        x5[at]
    }
}

/// Loop trips one kernel unit may take on lavapipe: llvmpipe (the CPU Vulkan driver the device
/// backends are tested on) counts the trips of every loop of a shader invocation against one
/// budget of 65535 and leaves the loops, without a word, when it runs out (a 131,072-element
/// copy in one unit kept 65,535 elements; a 600,000-element sum, 524,280). So kernels keep a
/// unit's trips low: a copy's rows are cut short (`launches.rs`), the row reductions take four
/// blocks of eight per trip, and the device executor refuses, on llvmpipe, a launch that would
/// still take more (`device::loop_trips`).
pub const LOOP_BUDGET: usize = 65535;

/// Access modes of a map input, two bits each in the `modes` comptime argument (see
/// `graphtrain_lowering::Access`).
pub const MODE_FULL: u32 = 0;
pub const MODE_SCALAR: u32 = 1;
pub const MODE_OUTER: u32 = 2;
pub const MODE_INNER: u32 = 3;

/// Bit of input `k` in `modes` (above the two-bit access modes) saying that its broadcast
/// parameter equals the launch's row length `l`: its source is then the running row (outer) or
/// column (inner) the kernel keeps, with no division per vector.
pub const ON_ROW_SHIFT: u32 = 16;
/// All the on-row bits (one per input).
const ON_ROW_BITS: u32 = 0x3f << ON_ROW_SHIFT;

/// Bit of `modes` asking that every op's result in a fused expression pass through `guard`, so
/// that the shader compiler below cubecl cannot rewrite across ops (the device backends:
/// lavapipe's NIR fuses `a * b + c` into one FMA and `1 / (1 / x)` into `x`; the op-by-op
/// kernels, each op alone, cannot be rewritten so, and would round differently).
pub const GUARD_OPS: u32 = 1 << 30;

/// Bit of `modes` saying that input `k` (read whole, `MODE_FULL`) is stored as bf16 in 2 bytes
/// an element (`Program::is_two_byte`); its offset is then in 4-byte slots, not vectors. The
/// bits lie where the other fields leave room.
pub const fn two_byte_bit(k: usize) -> u32 {
    [1 << 12, 1 << 13, 1 << 14, 1 << 15, 1 << 22, 1 << 23][k]
}

/// Bit of `modes` saying that a map's output is stored as bf16 in 2 bytes an element: `out` is
/// then in vectors of 4-byte slots, each unit takes whole pairs of vectors and stores each pair
/// as one vector of slots.
pub const OUT_TWO_BYTE: u32 = 1 << 28;

/// Bits of `modes` that make a map kernel reduce its expression instead of storing it
/// (`Step::MapReduce`): a sum or a max over rows of `l` elements, `len` rows.
pub const REDUCE_SUM: u32 = 1 << 24;
pub const REDUCE_MAX: u32 = 1 << 25;
/// With `REDUCE_*`: the kernel's vectors hold 4 lanes, so each block of eight elements is two
/// vectors (without it, vectors hold 8 lanes and a block is one vector).
pub const REDUCE_HALVES: u32 = 1 << 26;
/// With `REDUCE_*`: reduce over the rows instead, one output per column (`len` rows of `l`
/// elements).
pub const REDUCE_OUTER: u32 = 1 << 27;

/// The per-input arguments of a map kernel, gathered from its scalar launch arguments: offsets
/// `o*` (in vectors for full inputs, in elements otherwise) and parameters `p*` (`inner` or
/// `period`), plus `base`, the output element of vector 0, `w`, the vector width, `shift` and
/// `mask` (log2 w and w - 1, so element -> vector is a shift, not a division).
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
    shift: usize,
    mask: usize,
}

/// One vector of input `k` at output vector `i`, which lies in row `row`, column `col` of the
/// launch's row length.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    args: &MapArgs,
    i: usize,
    row: usize,
    col: usize,
    #[comptime] k: u32,
    #[comptime] modes: u32,
) -> Vector<f32, N> {
    let o = pick(args.o0, args.o1, args.o2, args.o3, args.o4, args.o5, k);
    let mode = comptime!((modes >> (2 * k)) & 3);
    let on_row = comptime!((modes >> (ON_ROW_SHIFT + k)) & 1 == 1);
    if comptime!(mode == MODE_FULL && modes & two_byte_bit(k as usize) != 0) {
        load_two_byte::<N>(x0, x1, x2, x3, x4, x5, args, o, i, k)
    } else if comptime!(mode == MODE_FULL) {
        read::<N>(x0, x1, x2, x3, x4, x5, o + i, k)
    } else if comptime!(mode == MODE_SCALAR) {
        Vector::<f32, N>::new(
            read::<N>(x0, x1, x2, x3, x4, x5, o >> args.shift, k).extract_dynamic(o & args.mask),
        )
    } else if comptime!(mode == MODE_OUTER) {
        // Every lane of the vector maps to the same source element (inner % w == 0).
        let mut e = o + row;
        if comptime!(!on_row) {
            let p = pick(args.p0, args.p1, args.p2, args.p3, args.p4, args.p5, k);
            e = o + (args.base + i * args.w) / p;
        }
        Vector::<f32, N>::new(
            read::<N>(x0, x1, x2, x3, x4, x5, e >> args.shift, k).extract_dynamic(e & args.mask),
        )
    } else {
        // The lanes map to consecutive source elements (period % w == 0).
        let mut e = o + col;
        if comptime!(!on_row) {
            let p = pick(args.p0, args.p1, args.p2, args.p3, args.p4, args.p5, k);
            e = o + (args.base + i * args.w) % p;
        }
        read::<N>(x0, x1, x2, x3, x4, x5, e >> args.shift, k)
    }
}

/// Vector `i` of input `k` stored as bf16 in 2 bytes an element from 4-byte slot `o`: its
/// elements `2j` and `2j + 1` are the low and high halves of slot `o + j` (little-endian, in
/// element order), each widened to the f32 it is by placing it in the high half. `o` is a
/// multiple of the vector width (the arena's alignment), so a vector's slots are the low or
/// the high half of one vector of slots.
#[cube]
#[allow(clippy::too_many_arguments)]
fn load_two_byte<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    args: &MapArgs,
    o: usize,
    i: usize,
    #[comptime] k: u32,
) -> Vector<f32, N> {
    let mut out = Vector::<f32, N>::empty();
    let lanes = out.vector_size();
    let high = u32::new(4294901760i64);
    let sixteen = u32::new(16);
    if comptime!(lanes == 1) {
        let slot = o + (i >> 1);
        let bits = u32::reinterpret(read::<N>(x0, x1, x2, x3, x4, x5, slot, k).extract(0usize));
        let widened = select((i & 1) == 1, bits & high, bits << sixteen);
        out.insert(0usize, f32::reinterpret(widened));
    } else {
        let half = comptime!(lanes / 2);
        let first = o + i * half;
        let v = Vector::<u32, N>::reinterpret(read::<N>(
            x0,
            x1,
            x2,
            x3,
            x4,
            x5,
            first >> args.shift,
            k,
        ));
        let even = v << Vector::<u32, N>::new(16);
        let odd = v & Vector::<u32, N>::new(4294901760);
        // The vector from the low half of the slots, and the one from the high half.
        let mut from_low = Vector::<u32, N>::empty();
        let mut from_high = Vector::<u32, N>::empty();
        #[unroll]
        for j in 0..lanes {
            let low_lane = comptime!(j / 2);
            let high_lane = comptime!(half + j / 2);
            if comptime!(j % 2 == 0) {
                from_low.insert(j, even.extract(low_lane));
                from_high.insert(j, even.extract(high_lane));
            } else {
                from_low.insert(j, odd.extract(low_lane));
                from_high.insert(j, odd.extract(high_lane));
            }
        }
        let upper = Vector::<u32, N>::new(u32::cast_from(first & args.mask));
        let bits = select_many(
            upper.not_equal(&Vector::<u32, N>::new(0)),
            from_high,
            from_low,
        );
        out = Vector::<f32, N>::reinterpret(bits);
    }
    out
}

/// A unit's share of a launch: items `start..end`.
#[derive(CubeType, Clone, Copy)]
struct Span {
    start: usize,
    end: usize,
}

/// The contiguous share of `len` items that this unit takes, in whole multiples of `multiple`
/// (the last unit's may be shorter, a unit past the end gets none). Contiguous chunks, not one
/// item per unit: on cubecl-cpu a unit is a worker thread (see the module's doc).
#[cube]
fn unit_span(len: usize, multiple: usize) -> Span {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let chunk = len.div_ceil(units).div_ceil(multiple) * multiple;
    let start = ABSOLUTE_POS * chunk;
    let mut end = start + chunk;
    if end > len {
        end = len;
    }
    Span { start, end }
}

/// `x` with its defining op hidden from cubecl's optimizer: a bit-for-bit round trip through
/// `u32` that LLVM folds away. cubecl-opt's `InstCombine` turns a single-use product feeding an
/// add or subtract into one FMA (one rounding where the op-by-op kernels round twice); it matches
/// only a product that directly defines the addend, so every product passes through here, and a
/// fused `a * b + c` rounds exactly like `mul` then `add` run apart.
#[cube]
fn opaque<N: Size>(x: Vector<f32, N>) -> Vector<f32, N> {
    Vector::<f32, N>::reinterpret(Vector::<u32, N>::reinterpret(x))
}

/// `x`, through a select on a value known only at run time (the vector width, never 0): a
/// compiler cannot rewrite an expression through it, as it can through a bitcast.
#[cube]
fn guard<N: Size>(x: Vector<f32, N>, args: &MapArgs) -> Vector<f32, N> {
    let width = Vector::<u32, N>::new(u32::cast_from(args.w));
    let keep = width.not_equal(&Vector::<u32, N>::new(0));
    select_many(keep, x, Vector::<f32, N>::new(0.0))
}

/// The float with bits `bits`, built at run time from `seed` (any value) when it is not finite:
/// cubecl-wgpu prints a non-finite float constant as `Inf`/`NaN`, which WGSL cannot parse, and
/// cubecl-opt folds a bitcast of a constant back into one. Finite values stay constants.
#[cube]
fn float_bits(#[comptime] bits: u32, seed: usize) -> f32 {
    if comptime!(f32::from_bits(bits).is_finite()) {
        f32::from_bits(bits)
    } else {
        f32::reinterpret(u32::new(bits as i64) | (u32::cast_from(seed) & u32::new(0)))
    }
}

/// The value of `e`, each op's result guarded when `modes` has `GUARD_OPS`.
#[cube]
fn eval<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    args: &MapArgs,
    i: usize,
    row: usize,
    col: usize,
    #[comptime] modes: u32,
    #[comptime] e: Expr,
) -> Vector<f32, N> {
    let leaf = comptime!(matches!(e, Expr::Input(_) | Expr::Const(_)));
    let x = eval_op::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, e);
    if comptime!(modes & GUARD_OPS != 0 && !leaf) {
        guard::<N>(x, args)
    } else {
        x
    }
}

#[cube]
fn eval_op<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    args: &MapArgs,
    i: usize,
    row: usize,
    col: usize,
    #[comptime] modes: u32,
    #[comptime] e: Expr,
) -> Vector<f32, N> {
    match e {
        Expr::Input(k) => load::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, k, modes),
        Expr::Const(bits) => Vector::<f32, N>::new(float_bits(bits, args.w)),
        Expr::Unary(op, a) => {
            let x = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *a);
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
                UnaryOp::Square => opaque::<N>(x * x),
            }
        }
        Expr::Binary(op, a, b) => {
            let x = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *a);
            let y = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *b);
            match op {
                BinaryOp::Add => x + y,
                BinaryOp::Sub => x - y,
                BinaryOp::Mul => opaque::<N>(x * y),
                BinaryOp::Div => x / y,
                BinaryOp::Max => max(x, y),
                BinaryOp::Min => min(x, y),
                BinaryOp::Pow => Vector::powf(x, y),
            }
        }
        Expr::Compare(op, a, b) => {
            let x = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *a);
            let y = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *b);
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
            let cv = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *c);
            let x = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *a);
            let y = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *b);
            select_many(cv.not_equal(&Vector::<f32, N>::new(0.0)), x, y)
        }
        Expr::Trunc(a) => Vector::trunc(eval::<N>(
            x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *a,
        )),
        Expr::NonZero(a) => {
            let x = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *a);
            let zero = Vector::<f32, N>::new(0.0);
            select_many(x.not_equal(&zero), Vector::<f32, N>::new(1.0), zero)
        }
        Expr::RoundBf16(a) => {
            // As `graphtrain_ir::host_tensor::round_bf16`: adding 0x7FFF plus the lowest kept
            // bit carries into the kept bits exactly when the dropped half is above one half, or
            // one half with an odd kept part; NaN passes through.
            let x = eval::<N>(x0, x1, x2, x3, x4, x5, args, i, row, col, modes, *a);
            let bits = Vector::<u32, N>::reinterpret(x);
            let kept_low = (bits >> Vector::<u32, N>::new(16)) & Vector::<u32, N>::new(1);
            let rounded = (bits + Vector::<u32, N>::new(32767) + kept_low)
                & Vector::<u32, N>::new(4294901760);
            select_many(x.equal(&x), Vector::<f32, N>::reinterpret(rounded), x)
        }
    }
}

/// `arena[out + i] = expr(inputs at i)` for `i < len` (`out` and `len` in vectors of `N`); how
/// each input is read is in `modes` and `args` (see `MapArgs`).
#[cube(launch_unchecked, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn map_kernel<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    y: &mut [Vector<f32, N>],
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
    shift: usize,
    l: usize,
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
        shift,
        mask: w - 1,
    };
    if comptime!(modes & (REDUCE_SUM | REDUCE_MAX) != 0 && modes & REDUCE_OUTER != 0) {
        map_reduce_outer::<N>(x0, x1, x2, x3, x4, x5, y, &args, l, out, len, modes, expr);
    } else if comptime!(modes & (REDUCE_SUM | REDUCE_MAX) != 0) {
        map_reduce::<N>(x0, x1, x2, x3, x4, x5, y, &args, l, out, len, modes, expr);
    } else {
        map_store::<N>(x0, x1, x2, x3, x4, x5, y, &args, l, out, len, modes, expr);
    }
}

/// The body of `map_kernel` without `REDUCE_*`.
#[cube]
fn map_store<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    y: &mut [Vector<f32, N>],
    args: &MapArgs,
    l: usize,
    out: usize,
    len: usize,
    #[comptime] modes: u32,
    #[comptime] expr: Expr,
) {
    if comptime!(modes & OUT_TWO_BYTE != 0) {
        map_store_two_byte::<N>(x0, x1, x2, x3, x4, x5, y, args, l, out, len, modes, expr);
    } else {
        map_store_slots::<N>(x0, x1, x2, x3, x4, x5, y, args, l, out, len, modes, expr);
    }
}

/// `map_store` into 4-byte slots: vector `i` of the output at vector `out + i`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn map_store_slots<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    y: &mut [Vector<f32, N>],
    args: &MapArgs,
    l: usize,
    out: usize,
    len: usize,
    #[comptime] modes: u32,
    #[comptime] expr: Expr,
) {
    let span = unit_span(len, 1);
    let rowed = comptime!(modes & ON_ROW_BITS != 0);
    let mut at = position_of(span.start, args, l, rowed);
    for i in span.start..span.end {
        y[out + i] = eval::<N>(
            x0,
            x1,
            x2,
            x3,
            x4,
            x5,
            args,
            i,
            at.row,
            at.col,
            modes,
            expr.clone(),
        );
        advance(&mut at, args, l, rowed);
    }
}

/// Where output vector `i` lies in rows of the launch's row length `l`: what on-row inputs
/// read (`ON_ROW_SHIFT`). Zeros where no input is on-row (`rowed` false).
#[derive(CubeType, Clone, Copy)]
struct Position {
    row: usize,
    col: usize,
}

/// The position of output vector `first`.
#[cube]
fn position_of(first: usize, args: &MapArgs, l: usize, #[comptime] rowed: bool) -> Position {
    let mut row = 0;
    let mut col = 0;
    if comptime!(rowed) {
        let pos = args.base + first * args.w;
        row = pos / l;
        col = pos % l;
    }
    Position { row, col }
}

/// Moves `at` to the next vector (`l % w == 0`, so a vector never straddles two rows).
#[cube]
fn advance(at: &mut Position, args: &MapArgs, l: usize, #[comptime] rowed: bool) {
    if comptime!(rowed) {
        at.col += args.w;
        if at.col == l {
            at.col = 0;
            at.row += 1;
        }
    }
}

/// `map_store` of bf16 values into 2-byte halves (`OUT_TWO_BYTE`): output vectors `i` and
/// `i + 1` (`len` is even) become vector `out + i / 2` of slots, each slot the halves of two
/// neighbouring elements (the lower element in the low half), a NaN kept a NaN by its quiet
/// bit. The expression's values are bf16 already (the lowering chooses only maps whose
/// expression ends in `RoundBf16`), so keeping their high halves loses nothing.
#[cube]
#[allow(clippy::too_many_arguments)]
fn map_store_two_byte<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    y: &mut [Vector<f32, N>],
    args: &MapArgs,
    l: usize,
    out: usize,
    len: usize,
    #[comptime] modes: u32,
    #[comptime] expr: Expr,
) {
    let span = unit_span(len, 2);
    let rowed = comptime!(modes & ON_ROW_BITS != 0);
    let mut at = position_of(span.start, args, l, rowed);
    let mut i = span.start;
    while i < span.end {
        let first = eval::<N>(
            x0,
            x1,
            x2,
            x3,
            x4,
            x5,
            args,
            i,
            at.row,
            at.col,
            modes,
            expr.clone(),
        );
        advance(&mut at, args, l, rowed);
        let second = eval::<N>(
            x0,
            x1,
            x2,
            x3,
            x4,
            x5,
            args,
            i + 1,
            at.row,
            at.col,
            modes,
            expr.clone(),
        );
        advance(&mut at, args, l, rowed);
        y[out + (i >> 1)] = two_byte_slots::<N>(first, second);
        i += 2;
    }
}

/// The slots holding `first` then `second` as bf16 halves (see `map_store_two_byte`).
#[cube]
fn two_byte_slots<N: Size>(first: Vector<f32, N>, second: Vector<f32, N>) -> Vector<f32, N> {
    let quiet = Vector::<u32, N>::new(4194304);
    let a = select_many(
        first.equal(&first),
        Vector::<u32, N>::reinterpret(first),
        Vector::<u32, N>::reinterpret(first) | quiet,
    );
    let b = select_many(
        second.equal(&second),
        Vector::<u32, N>::reinterpret(second),
        Vector::<u32, N>::reinterpret(second) | quiet,
    );
    let low = a >> Vector::<u32, N>::new(16);
    let high = a & Vector::<u32, N>::new(4294901760);
    let low_b = b >> Vector::<u32, N>::new(16);
    let high_b = b & Vector::<u32, N>::new(4294901760);
    let mut slots = Vector::<u32, N>::empty();
    let lanes = slots.vector_size();
    if comptime!(lanes == 1) {
        slots.insert(0usize, low.extract(0usize) | high_b.extract(0usize));
    } else {
        let half = comptime!(lanes / 2);
        #[unroll]
        for j in 0..half {
            let even = comptime!(2 * j);
            let odd = comptime!(2 * j + 1);
            let at = comptime!(half + j);
            slots.insert(j, low.extract(even) | high.extract(odd));
            slots.insert(at, low_b.extract(even) | high_b.extract(odd));
        }
    }
    Vector::<f32, N>::reinterpret(slots)
}

/// The body of `map_kernel` with `REDUCE_*`: `arena[out·w + o] = reduce over j < l of
/// expr(inputs at element o·l + j)` for `o < len` (`out` in vectors, `l % 8 == 0`).
///
/// Order: lane `q` of the accumulator (of `lo` and `hi` with `REDUCE_HALVES`) takes the
/// elements `j ≡ q (mod 8)` in order, and the eight partials combine as
/// ((p0·p1)·(p2·p3))·((p4·p5)·(p6·p7)): `reduce_kernel`'s order for one contiguous reduced
/// dim. The elements are computed in vectors of the width the eager map uses, so the bits
/// equal a map followed by a reduce.
#[cube]
fn map_reduce<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    y: &mut [Vector<f32, N>],
    args: &MapArgs,
    l: usize,
    out: usize,
    len: usize,
    #[comptime] modes: u32,
    #[comptime] expr: Expr,
) {
    let is_max = comptime!(modes & REDUCE_MAX != 0);
    let halves = comptime!(modes & REDUCE_HALVES != 0);
    let w = args.w;
    // Whole output vectors per unit, so that no two units write lanes of one vector.
    let span = unit_span(len, w);
    let init = if is_max {
        float_bits(comptime!(f32::NEG_INFINITY.to_bits()), len)
    } else {
        f32::new(0.0)
    };
    let blocks = l / 8;
    // Four blocks per trip, then the rest: the same elements in the same order as one block per
    // trip, in a quarter of the loop trips (`LOOP_BUDGET`).
    let quads = blocks / 4;
    for o in span.start..span.end {
        let first = o * l;
        let mut lo = Vector::<f32, N>::new(init);
        let mut hi = Vector::<f32, N>::new(init);
        for q in 0..quads {
            #[unroll]
            for u in 0..4 {
                let p = fold_block::<N>(
                    x0,
                    x1,
                    x2,
                    x3,
                    x4,
                    x5,
                    args,
                    lo,
                    hi,
                    first,
                    o,
                    q * 4 + u,
                    modes,
                    expr.clone(),
                );
                lo = p.lo;
                hi = p.hi;
            }
        }
        for b in quads * 4..blocks {
            let p = fold_block::<N>(
                x0,
                x1,
                x2,
                x3,
                x4,
                x5,
                args,
                lo,
                hi,
                first,
                o,
                b,
                modes,
                expr.clone(),
            );
            lo = p.lo;
            hi = p.hi;
        }
        let r = if comptime!(halves) {
            let low = combine(
                combine(lo.extract(0usize), lo.extract(1usize), is_max),
                combine(lo.extract(2usize), lo.extract(3usize), is_max),
                is_max,
            );
            let high = combine(
                combine(hi.extract(0usize), hi.extract(1usize), is_max),
                combine(hi.extract(2usize), hi.extract(3usize), is_max),
                is_max,
            );
            combine(low, high, is_max)
        } else {
            let low = combine(
                combine(lo.extract(0usize), lo.extract(1usize), is_max),
                combine(lo.extract(2usize), lo.extract(3usize), is_max),
                is_max,
            );
            let high = combine(
                combine(lo.extract(4usize), lo.extract(5usize), is_max),
                combine(lo.extract(6usize), lo.extract(7usize), is_max),
                is_max,
            );
            combine(low, high, is_max)
        };
        let v = out + (o >> args.shift);
        let mut packed = y[v];
        packed.insert_dynamic(o & args.mask, r);
        y[v] = packed;
    }
}

/// The two running partials of a row reduction (`hi` only with `REDUCE_HALVES`).
#[derive(CubeType, Clone, Copy)]
struct Partials<N: Size> {
    lo: Vector<f32, N>,
    hi: Vector<f32, N>,
}

/// The partials `(lo, hi)` with block `b` (elements `8b..8b + 8`) of output `o`'s row, whose
/// first element is `first`, folded in.
#[cube]
#[allow(clippy::too_many_arguments)]
fn fold_block<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    args: &MapArgs,
    lo: Vector<f32, N>,
    hi: Vector<f32, N>,
    first: usize,
    o: usize,
    b: usize,
    #[comptime] modes: u32,
    #[comptime] expr: Expr,
) -> Partials<N> {
    let is_max = comptime!(modes & REDUCE_MAX != 0);
    let j = b * 8;
    let x = eval::<N>(
        x0,
        x1,
        x2,
        x3,
        x4,
        x5,
        args,
        (first + j) >> args.shift,
        o,
        j,
        modes,
        expr.clone(),
    );
    let lo = combine_vec::<N>(lo, x, is_max);
    let mut hi = hi;
    if comptime!(modes & REDUCE_HALVES != 0) {
        let y = eval::<N>(
            x0,
            x1,
            x2,
            x3,
            x4,
            x5,
            args,
            (first + j + 4) >> args.shift,
            o,
            j + 4,
            modes,
            expr,
        );
        hi = combine_vec::<N>(hi, y, is_max);
    }
    Partials::<N> { lo, hi }
}

/// Output vectors that `map_reduce_outer` accumulates side by side in one pass over the rows.
const OUTER_GROUP: usize = 8;

/// The body of `map_kernel` with `REDUCE_*` and `REDUCE_OUTER`, over `len` rows of `l`
/// elements (`l % w == 0`): output vector `v < l / w` (columns `v·w ..`) is `reduce over
/// r < len of expr(inputs at element r·l + v·w)`. Each lane takes its rows in order from the
/// identity, as `reduce_cols_kernel` does, and the elements are the eager map's vectors, so
/// the bits equal a map followed by a reduce.
///
/// A unit's outputs go in groups of [`OUTER_GROUP`] adjacent vectors, each group one pass over
/// the rows that reads the group's vectors of every row together (four cache lines at 8
/// lanes); the few left over take a pass each. With a pass per output, every cache line was
/// fetched once per vector in it, one row at a time a row length apart, and `peer`'s RMSNorm
/// weight gradients (2048 x 256) took 0.43-0.57 ms per launch; grouped, 0.29 ms
/// (docs/benchmarks.md). Each lane still adds its rows in order, so the bits are unchanged.
#[cube]
fn map_reduce_outer<N: Size>(
    x0: &mut [Vector<f32, N>],
    x1: &mut [Vector<f32, N>],
    x2: &mut [Vector<f32, N>],
    x3: &mut [Vector<f32, N>],
    x4: &mut [Vector<f32, N>],
    x5: &mut [Vector<f32, N>],
    y: &mut [Vector<f32, N>],
    args: &MapArgs,
    l: usize,
    out: usize,
    len: usize,
    #[comptime] modes: u32,
    #[comptime] expr: Expr,
) {
    let is_max = comptime!(modes & REDUCE_MAX != 0);
    let row_vectors = l >> args.shift;
    let span = unit_span(row_vectors, 1);
    let init = if is_max {
        Vector::<f32, N>::new(float_bits(comptime!(f32::NEG_INFINITY.to_bits()), len))
    } else {
        Vector::<f32, N>::new(0.0)
    };
    let mut v0 = span.start;
    while v0 + OUTER_GROUP <= span.end {
        let mut acc = Array::<Vector<f32, N>>::new(OUTER_GROUP);
        #[unroll]
        for j in 0..OUTER_GROUP {
            acc[j] = init;
        }
        for r in 0..len {
            #[unroll]
            for j in 0..OUTER_GROUP {
                let v = v0 + j;
                let x = eval::<N>(
                    x0,
                    x1,
                    x2,
                    x3,
                    x4,
                    x5,
                    args,
                    r * row_vectors + v,
                    r,
                    v * args.w,
                    modes,
                    expr.clone(),
                );
                acc[j] = combine_vec::<N>(acc[j], x, is_max);
            }
        }
        #[unroll]
        for j in 0..OUTER_GROUP {
            y[out + v0 + j] = acc[j];
        }
        v0 += OUTER_GROUP;
    }
    for v in v0..span.end {
        let mut acc = init;
        for r in 0..len {
            let x = eval::<N>(
                x0,
                x1,
                x2,
                x3,
                x4,
                x5,
                args,
                r * row_vectors + v,
                r,
                v * args.w,
                modes,
                expr.clone(),
            );
            acc = combine_vec::<N>(acc, x, is_max);
        }
        y[out + v] = acc;
    }
}

/// Strided copy over up to four dims `[n0, n1, n2, n3]` (`n0` derived from `len`):
/// `arena[dst + Σ idx·t] = arena[src + Σ idx·s]`. Units take whole rows of the innermost dim,
/// so the index arithmetic is paid once per row, not per element.
#[cube(launch_unchecked, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn copy_kernel(
    x: &mut [f32],
    y: &mut [f32],
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
    let span = unit_span(rows, 1);
    for r in span.start..span.end {
        let i2 = r % n2;
        let q = r / n2;
        let i1 = q % n1;
        let i0 = q / n1;
        let sb = src + i0 * s0 + i1 * s1 + i2 * s2;
        let tb = dst + i0 * t0 + i1 * t1 + i2 * t2;
        for j in 0..n3 {
            y[tb + j * t3] = x[sb + j * s3];
        }
    }
}

#[cube]
fn combine(acc: f32, x: f32, #[comptime] is_max: bool) -> f32 {
    if comptime!(is_max) {
        max(acc, x)
    } else {
        acc + x
    }
}

/// `arena[out + o] = reduce_{r0 < m0, r1 < m1} arena[src + base(o) + r0·q0 + r1·q1]` where
/// `o` walks `[len / (n1·n2), n1, n2]` with source strides `s0, s1, s2`.
///
/// Order: with `rows` (one contiguous reduced dim: `m0 == 1`, `q1 == 1`), eight running
/// partials take every eighth element (LLVM turns them into one vector register), are combined
/// pairwise ((p0·p1)·(p2·p3))·((p4·p5)·(p6·p7)), and the last `m1 % 8` elements follow in order;
/// otherwise the elements are taken in index order. Either way the order is fixed by the
/// shape alone.
#[cube(launch_unchecked, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn reduce_kernel(
    x: &mut [f32],
    y: &mut [f32],
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
    #[comptime] rows: bool,
) {
    let span = unit_span(len, 1);
    let init = if is_max {
        float_bits(comptime!(f32::NEG_INFINITY.to_bits()), len)
    } else {
        f32::new(0.0)
    };
    for o in span.start..span.end {
        let i2 = o % n2;
        let r = o / n2;
        let i1 = r % n1;
        let i0 = r / n1;
        let base = src + i0 * s0 + i1 * s1 + i2 * s2;
        let mut acc = init;
        if comptime!(rows) {
            let mut p0 = init;
            let mut p1 = init;
            let mut p2 = init;
            let mut p3 = init;
            let mut p4 = init;
            let mut p5 = init;
            let mut p6 = init;
            let mut p7 = init;
            let blocks = m1 / 8;
            // Four blocks per trip, then the rest, as in `map_reduce`.
            let quads = blocks / 4;
            for q in 0..quads {
                #[unroll]
                for u in 0..4 {
                    let j = base + (q * 4 + u) * 8;
                    p0 = combine(p0, x[j], is_max);
                    p1 = combine(p1, x[j + 1], is_max);
                    p2 = combine(p2, x[j + 2], is_max);
                    p3 = combine(p3, x[j + 3], is_max);
                    p4 = combine(p4, x[j + 4], is_max);
                    p5 = combine(p5, x[j + 5], is_max);
                    p6 = combine(p6, x[j + 6], is_max);
                    p7 = combine(p7, x[j + 7], is_max);
                }
            }
            for b in quads * 4..blocks {
                let j = base + b * 8;
                p0 = combine(p0, x[j], is_max);
                p1 = combine(p1, x[j + 1], is_max);
                p2 = combine(p2, x[j + 2], is_max);
                p3 = combine(p3, x[j + 3], is_max);
                p4 = combine(p4, x[j + 4], is_max);
                p5 = combine(p5, x[j + 5], is_max);
                p6 = combine(p6, x[j + 6], is_max);
                p7 = combine(p7, x[j + 7], is_max);
            }
            let low = combine(combine(p0, p1, is_max), combine(p2, p3, is_max), is_max);
            let high = combine(combine(p4, p5, is_max), combine(p6, p7, is_max), is_max);
            acc = combine(low, high, is_max);
            for j in blocks * 8..m1 {
                acc = combine(acc, x[base + j], is_max);
            }
        } else {
            for a in 0..m0 {
                for b in 0..m1 {
                    acc = combine(acc, x[base + a * q0 + b * q1], is_max);
                }
            }
        }
        y[out + o] = acc;
    }
}

#[cube]
fn combine_vec<N: Size>(
    acc: Vector<f32, N>,
    x: Vector<f32, N>,
    #[comptime] is_max: bool,
) -> Vector<f32, N> {
    if comptime!(is_max) {
        max(acc, x)
    } else {
        acc + x
    }
}

/// `reduce_kernel` without `rows`, `N` outputs at a time: every argument counts vectors of `N`
/// (offsets and strides included), and each lane of an output vector takes its elements in the
/// same index order as the scalar kernel, so the bits are the same. For reductions over outer
/// dims whose kept inner dim is contiguous (the norm weights' gradients: `[S, D] -> [D]`), where
/// the scalar kernel reads one float per cache line per output.
#[cube(launch_unchecked, create_dummy_kernel)]
#[allow(clippy::too_many_arguments)]
pub fn reduce_cols_kernel<N: Size>(
    x: &mut [Vector<f32, N>],
    y: &mut [Vector<f32, N>],
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
    let span = unit_span(len, 1);
    let init = if is_max {
        Vector::<f32, N>::new(float_bits(comptime!(f32::NEG_INFINITY.to_bits()), len))
    } else {
        Vector::<f32, N>::new(0.0)
    };
    for o in span.start..span.end {
        let i2 = o % n2;
        let r = o / n2;
        let i1 = r % n1;
        let i0 = r / n1;
        let base = src + i0 * s0 + i1 * s1 + i2 * s2;
        let mut acc = init;
        for a in 0..m0 {
            for b in 0..m1 {
                acc = combine_vec::<N>(acc, x[base + a * q0 + b * q1], is_max);
            }
        }
        y[out + o] = acc;
    }
}
