//! The cubecl kernels the device backends (`wgpu`, `cuda`) launch for the steps the cpu backend
//! runs on the host: matmul, gather, scatter-add and the index check in front of both. Like
//! `kernels.rs`, every operand is a binding of its own (the arena's buffer that holds it),
//! addressed with element offsets passed at launch.
//!
//! Work split: unit `u` of `U` takes outputs `u, u + U, u + 2U, ...` (a grid-stride loop), so
//! neighbouring units touch neighbouring outputs, as a GPU's memory system wants.
//!
//! Numerics: each output is computed by one unit in a fixed order (a matmul sums over `k` in
//! index order; a scatter-add adds its contributions in position order, as the interpreter
//! does), so results do not depend on the grid, and the same Program gives the same bits every
//! run. The order differs from the cpu backend's GEMM: the two backends agree within rounding,
//! not bit for bit.

use cubecl::prelude::*;

/// `c[b, i, j] = Σ_k a[b, i, k] · b[b, k, j]` over strided `a` and `b` (element strides per
/// batch, row and column), into a contiguous `[batch, m, n]` output at `c`, rounded to bf16
/// when `round_bf16` is 1. Bit 0 of `round_in` rounds each element of `a` to bf16 as it is
/// read, bit 1 each of `b` (f32 operands a bf16 product reads through a folded cast).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn matmul_kernel(
    a_buf: &mut [f32],
    b_buf: &mut [f32],
    c_buf: &mut [f32],
    a: usize,
    a_batch: usize,
    a_row: usize,
    a_col: usize,
    b: usize,
    b_batch: usize,
    b_row: usize,
    b_col: usize,
    c: usize,
    m: usize,
    n: usize,
    k: usize,
    total: usize,
    round_bf16: u32,
    round_in: u32,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut e = ABSOLUTE_POS;
    while e < total {
        let j = e % n;
        let t = e / n;
        let i = t % m;
        let batch = t / m;
        let row = a + batch * a_batch + i * a_row;
        let col = b + batch * b_batch + j * b_col;
        let mut acc = f32::new(0.0);
        for kk in 0..k {
            acc += rounded(a_buf[row + kk * a_col], round_in & 1)
                * rounded(b_buf[col + kk * b_row], (round_in >> 1) & 1);
        }
        c_buf[c + e] = rounded(acc, round_bf16);
        e += units;
    }
}

/// `x` rounded to bf16 (to nearest, ties to even; NaN kept) when `round_bf16` is 1, as
/// `graphtrain_ir::host_tensor::round_bf16` and the map kernels' `RoundBf16` do: a bf16 matmul
/// (bf16-mixed) sums in f32 and rounds its result once.
#[cube]
// `x == x` is false for NaN only: the test the map kernels' `RoundBf16` makes too.
#[allow(clippy::eq_op)]
pub(super) fn rounded(x: f32, round_bf16: u32) -> f32 {
    let mut out = x;
    if round_bf16 == 1 {
        let bits = u32::reinterpret(x);
        let kept_low = (bits >> 16) & 1;
        let r = (bits + 32767 + kept_low) & 4294901760;
        if x == x {
            out = f32::reinterpret(r);
        }
    }
    out
}

/// `arena[at..at + total]` rounded to bf16 in place (as `rounded` does): a bf16 sum that NCCL
/// made in f32, rounded once, as the other collective engines round theirs.
#[cube(launch_unchecked)]
pub fn round_bf16_kernel(x: &mut [f32], at: usize, total: usize) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut e = ABSOLUTE_POS;
    while e < total {
        x[at + e] = rounded(x[at + e], 1u32);
        e += units;
    }
}

/// The product `matmul_kernel` computes, a 16 x 16 tile of outputs per cube (`CubeDim` 16 x
/// 16, cube `(x, y, z)` = (column tile, row tile, batch)): the cube stages 16-wide slices of
/// `a`'s rows and `b`'s columns in shared memory, one element per unit, and each unit sums its
/// output's `k` in index order as `matmul_kernel` does, so the two give the same bits where the
/// device compiles `acc += x * y` alike. Each operand element is read from the arena once per
/// tile instead of once per output: the kernel a GPU wants for large products.
#[cube(launch_unchecked)]
// Plain arithmetic (`(k + 15) / 16`) is what the cube macro expands; `div_ceil` it may not.
#[allow(clippy::too_many_arguments, clippy::manual_div_ceil)]
pub fn matmul_tiled_kernel(
    a_buf: &mut [f32],
    b_buf: &mut [f32],
    c_buf: &mut [f32],
    a: usize,
    a_batch: usize,
    a_row: usize,
    a_col: usize,
    b: usize,
    b_batch: usize,
    b_row: usize,
    b_col: usize,
    c: usize,
    m: usize,
    n: usize,
    k: usize,
    round_bf16: u32,
    round_in: u32,
) {
    let tx = UNIT_POS_X as usize;
    let ty = UNIT_POS_Y as usize;
    let j = CUBE_POS_X as usize * 16 + tx;
    let i = CUBE_POS_Y as usize * 16 + ty;
    let batch = CUBE_POS_Z as usize;
    let mut a_tile = Shared::<[f32]>::new_slice(256usize);
    let mut b_tile = Shared::<[f32]>::new_slice(256usize);
    let row = a + batch * a_batch + i * a_row;
    let col = b + batch * b_batch + j * b_col;
    let mut acc = f32::new(0.0);
    let tiles = (k + 15) / 16;
    for t in 0..tiles {
        let ka = t * 16 + tx;
        let mut va = f32::new(0.0);
        if i < m && ka < k {
            va = rounded(a_buf[row + ka * a_col], round_in & 1);
        }
        a_tile[ty * 16 + tx] = va;
        let kb = t * 16 + ty;
        let mut vb = f32::new(0.0);
        if j < n && kb < k {
            vb = rounded(b_buf[col + kb * b_row], (round_in >> 1) & 1);
        }
        b_tile[ty * 16 + tx] = vb;
        sync_cube();
        // Only the tile's real `k`: adding a padding zero could turn a -0 sum into +0.
        for q in 0..16usize {
            if t * 16 + q < k {
                acc += a_tile[ty * 16 + q] * b_tile[q * 16 + tx];
            }
        }
        sync_cube();
    }
    if i < m && j < n {
        c_buf[c + (batch * m + i) * n + j] = rounded(acc, round_bf16);
    }
}

/// Flags an index out of `[0, bound)` or not a whole number, among `n` indices at `index`,
/// `stride` apart: writes its position + 1 into `arena[status]`. Which bad position wins when
/// there are several is up to the schedule; each write is one whole float.
#[cube(launch_unchecked)]
pub fn check_indices_kernel(
    index_buf: &mut [f32],
    status_buf: &mut [f32],
    index: usize,
    stride: usize,
    n: usize,
    bound: f32,
    status: usize,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut e = ABSOLUTE_POS;
    while e < n {
        let x = index_buf[index + e * stride];
        let whole = f32::floor(x) == x;
        if !(x >= 0.0 && x < bound && whole) {
            status_buf[status] = f32::cast_from(e + 1);
        }
        e += units;
    }
}

/// `out[c] = src[Σ_d c_d·s_d + index[c]·s_axis]` for every position `c` of a contiguous
/// index tensor of up to four dims `[n0, n1, n2, n3]` (`n0` from `total`); `s_d` are the
/// source's strides with the indexed axis's set to 0, `s_axis` the one it had. An index the
/// check rejected reads as 0 (the run then fails with the check's error).
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn gather_kernel(
    src_buf: &mut [f32],
    index_buf: &mut [f32],
    out_buf: &mut [f32],
    src: usize,
    index: usize,
    out: usize,
    n1: usize,
    n2: usize,
    n3: usize,
    s0: usize,
    s1: usize,
    s2: usize,
    s3: usize,
    s_axis: usize,
    bound: usize,
    total: usize,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut e = ABSOLUTE_POS;
    while e < total {
        let c3 = e % n3;
        let t = e / n3;
        let c2 = t % n2;
        let t = t / n2;
        let c1 = t % n1;
        let c0 = t / n1;
        let x = index_buf[index + e];
        let mut value = f32::new(0.0);
        if x >= 0.0 && x < f32::cast_from(bound) {
            let i = usize::cast_from(x);
            value = src_buf[src + c0 * s0 + c1 * s1 + c2 * s2 + c3 * s3 + i * s_axis];
        }
        out_buf[out + e] = value;
        e += units;
    }
}

/// `out = src`, then `out[c with axis ← index[c]] += add[c]` for every index position `c`, each
/// output summing its contributions in position order. One unit per output element walks the
/// indexed axis of the index tensor, so no two units write one element and no atomics are
/// needed. Dims are padded to four: `m1..m3` the source's (`m0` from `total`), `i0..i3` the
/// index tensor's, `q0..q3` its contiguous strides; `axis` is the indexed dim (0..4). `out`
/// may be `src` (an in-place update): each unit reads its element before writing it.
#[cube(launch_unchecked)]
#[allow(clippy::too_many_arguments)]
pub fn scatter_add_kernel(
    src_buf: &mut [f32],
    index_buf: &mut [f32],
    add_buf: &mut [f32],
    out_buf: &mut [f32],
    src: usize,
    index: usize,
    add: usize,
    out: usize,
    m1: usize,
    m2: usize,
    m3: usize,
    i0: usize,
    i1: usize,
    i2: usize,
    i3: usize,
    q0: usize,
    q1: usize,
    q2: usize,
    q3: usize,
    axis: u32,
    total: usize,
) {
    let units = CUBE_DIM as usize * CUBE_COUNT;
    let mut e = ABSOLUTE_POS;
    while e < total {
        let o3 = e % m3;
        let t = e / m3;
        let o2 = t % m2;
        let t = t / m2;
        let o1 = t % m1;
        let o0 = t / m1;
        let mut acc = src_buf[src + e];
        // The output's coordinate along the axis is the index value to match; the others must
        // exist in the index tensor.
        let mut inside = (axis == 0 || o0 < i0) && (axis == 1 || o1 < i1);
        inside = inside && (axis == 2 || o2 < i2) && (axis == 3 || o3 < i3);
        let mut target = o3;
        let mut along = i3;
        let mut step = q3;
        let mut base = o0 * q0 + o1 * q1 + o2 * q2;
        if axis == 0 {
            target = o0;
            along = i0;
            step = q0;
            base = o1 * q1 + o2 * q2 + o3 * q3;
        } else if axis == 1 {
            target = o1;
            along = i1;
            step = q1;
            base = o0 * q0 + o2 * q2 + o3 * q3;
        } else if axis == 2 {
            target = o2;
            along = i2;
            step = q2;
            base = o0 * q0 + o1 * q1 + o3 * q3;
        }
        if inside {
            let want = f32::cast_from(target);
            for j in 0..along {
                let p = base + j * step;
                if index_buf[index + p] == want {
                    acc += add_buf[add + p];
                }
            }
        }
        out_buf[out + e] = acc;
        e += units;
    }
}

/// Takes `n` loop trips and writes how many it took into `out[at]`: a device that leaves
/// shader loops early (llvmpipe, after 65535 trips: `shared::kernels::LOOP_BUDGET`) writes
/// fewer. The count is a float, exact up to 2^24.
#[cube(launch_unchecked)]
pub fn loop_probe_kernel(out: &mut [f32], at: usize, n: usize) {
    if ABSOLUTE_POS == 0 {
        let mut trips = 0usize;
        while trips < n {
            trips += 1;
        }
        out[at] = f32::cast_from(trips);
    }
}
