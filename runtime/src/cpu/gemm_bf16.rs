//! GEMM of bf16 operands with AVX512_BF16 (`vdpbf16ps`), for the matmuls of a bf16-mixed step.
//!
//! Contract:
//! * `C[b] = A[b] @ B[b]` as f32 sums, C contiguous row-major, overwritten; the caller rounds C
//!   to bf16. Packing rounds each operand element to bf16 (to nearest, ties to even, as
//!   `round_bf16` does): the identity on bf16 values held in f32 slots (low 16 bits zero, which
//!   is how the cpu backend stores bf16), and the cast for the f32 operands a matmul reads
//!   through a cast that fusion folded into it (`Step::Matmul::round_bf16`).
//! * Every C element is one chain over k in pairs: `acc += a[2p] b[2p] + a[2p+1] b[2p+1]` for
//!   p = 0, 1, ..., one `vdpbf16ps` per pair (k odd: a zero pads the last pair). Threads split
//!   batch x m x n, never k, so the bits depend neither on the thread count nor on the
//!   scheduling. They
//!   differ from the f32 GEMM's chain (one FMA per k), by rounding only.
//! * Runs where the cpu has AVX-512F and AVX512_BF16 (`available`); elsewhere the caller runs
//!   the f32 GEMM on the same values.
//!
//! Tiles: 12 rows x 32 columns of C in 24 registers; B is packed once per call into 32-column
//! panels of k pairs (a panel of `k` = 1536 is 96 KiB, in L2), A per task into row pairs.

use super::gemm::Layout;
use super::pool::{Pool, TaskPtr};
use std::cell::RefCell;
use std::thread::LocalKey;

/// Rows and columns of one register tile.
const MR: usize = 12;
const NR: usize = 32;
/// Rows of C one task computes (a multiple of `MR`): its packed A, 96 x k pairs, stays in L2.
const ROWS_PER_TASK: usize = 96;

/// Whether this cpu runs the bf16 kernel.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The bf16 pair (x0, x1), each rounded to bf16, as one 32-bit lane: x0 in the low half, as
/// `vdpbf16ps` reads it.
fn pair(x0: f32, x1: f32) -> u32 {
    let bits = |x: f32| graphtrain_ir::host_tensor::round_bf16(x).to_bits();
    (bits(x0) >> 16) | (bits(x1) & 0xFFFF_0000)
}

/// `out[i] = pair(x0[i], x1[i])`, with zeros for a missing `x1` (an odd k's last pair): two
/// rows (or columns) of an operand that hold pairs' first and second elements side by side.
fn side_by_side(x0: &[f32], x1: Option<&[f32]>, out: &mut [u32]) {
    let len = out.len();
    assert!(x0.len() >= len && x1.is_none_or(|x1| x1.len() >= len));
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    while done < len {
        let live = (len - done).min(16);
        // SAFETY: `gemm_bf16`'s caller checked `available()`; the masks touch `live` lanes from
        // `done`, inside the slices (asserted above).
        unsafe {
            simd::side_by_side_16(
                x0.as_ptr().add(done),
                x1.map(|x1| x1.as_ptr().add(done)),
                out.as_mut_ptr().add(done),
                live,
            )
        };
        done += live;
    }
    for i in done..len {
        out[i] = pair(x0[i], x1.map_or(0.0, |x1| x1[i]));
    }
}

/// `out[p * stride] = pair(x[2p], x[2p + 1])` for every pair of `x` (a zero after an odd last
/// element): a row (or column) of an operand whose neighbours are pairs.
fn neighbours(x: &[f32], out: &mut [u32], stride: usize) {
    let pairs = x.len().div_ceil(2);
    assert!(pairs == 0 || out.len() > (pairs - 1) * stride);
    let mut p = 0;
    #[cfg(target_arch = "x86_64")]
    while p + 16 <= x.len() / 2 {
        // SAFETY: as in `side_by_side`; 32 elements from 2p are inside `x`.
        let lanes = unsafe { simd::neighbours_16(x.as_ptr().add(2 * p)) };
        for (q, lane) in lanes.into_iter().enumerate() {
            out[(p + q) * stride] = lane;
        }
        p += 16;
    }
    for q in p..pairs {
        out[q * stride] = pair(x[2 * q], x.get(2 * q + 1).copied().unwrap_or(0.0));
    }
}

/// `C = A @ B` over `batch` matrices (see the module's contract).
///
/// # Safety
/// `a`, `b` and `c` must address every element their layouts and shapes name; `c` must not
/// overlap `a` or `b`; `available()` must be true.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bf16(
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    la: Layout,
    b: *const f32,
    lb: Layout,
    c: *mut f32,
    threads: usize,
) {
    if batch == 0 || m == 0 || n == 0 {
        return;
    }
    let pairs = k.div_ceil(2);
    let panels = n.div_ceil(NR);
    let panel_len = pairs * NR;
    // B shared by every batch (a weight) is packed once.
    let b_batches = if lb.batch_stride == 0 { 1 } else { batch };
    let mut packed_b = take_buffer(&PACKED_B, b_batches * panels * panel_len);
    let pb = TaskPtr(packed_b.as_mut_ptr());
    let pool = Pool::current();
    let run = |tasks: usize, f: &(dyn Fn(usize) + Sync)| {
        if threads <= 1 {
            (0..tasks).for_each(f);
        } else {
            pool.run(tasks, f);
        }
    };
    let bp = TaskPtr(b as *mut f32);
    run(b_batches * panels, &|t| {
        let (bi, panel) = (t / panels, t % panels);
        let at = |kk: usize, j: usize| -> f32 {
            if kk < k && j < n {
                // SAFETY: (kk, j) is inside batch bi's B (caller's contract).
                unsafe { *bp.at(bi * lb.batch_stride + kk * lb.row_stride + j * lb.col_stride) }
            } else {
                0.0
            }
        };
        let base = (bi * panels + panel) * panel_len;
        // SAFETY: task t alone writes panel `panel` of batch `bi`, `panel_len` lanes.
        let dst = unsafe { std::slice::from_raw_parts_mut(pb.at(base), panel_len) };
        let cols = (n - panel * NR).min(NR);
        let origin = bi * lb.batch_stride + panel * NR * lb.col_stride;
        // Read B in its memory order, in runs the compiler vectorizes: along rows (k and
        // k + 1 side by side), or down columns when B is transposed.
        if lb.col_stride == 1 {
            for p in 0..pairs {
                // SAFETY: rows 2p and 2p + 1 (when < k) hold `cols` elements from `origin`.
                let r0 = unsafe {
                    std::slice::from_raw_parts(bp.at(origin + 2 * p * lb.row_stride), cols)
                };
                let out = &mut dst[p * NR..p * NR + cols];
                let r1 = (2 * p + 1 < k).then(|| unsafe {
                    std::slice::from_raw_parts(bp.at(origin + (2 * p + 1) * lb.row_stride), cols)
                });
                side_by_side(r0, r1, out);
            }
        } else if lb.row_stride == 1 {
            for lane in 0..cols {
                // SAFETY: column `panel * NR + lane` holds k elements from its start.
                let col =
                    unsafe { std::slice::from_raw_parts(bp.at(origin + lane * lb.col_stride), k) };
                neighbours(col, &mut dst[lane..], NR);
            }
        } else {
            for p in 0..pairs {
                for lane in 0..cols {
                    let j = panel * NR + lane;
                    dst[p * NR + lane] = pair(at(2 * p, j), at(2 * p + 1, j));
                }
            }
        }
    });
    let row_blocks = m.div_ceil(ROWS_PER_TASK);
    // Columns are split too where rows alone would leave a thread idle (a weight gradient of
    // 256 rows is three row blocks): each task then packs its A rows again, a k x rows copy
    // against k x rows x columns of arithmetic.
    let wanted = 4 * threads.max(1);
    let groups = wanted.div_ceil(batch * row_blocks).clamp(1, panels);
    let panels_per_group = panels.div_ceil(groups);
    let groups = panels.div_ceil(panels_per_group);
    let ap = TaskPtr(a as *mut f32);
    let cp = TaskPtr(c);
    let b_packed = &packed_b;
    run(batch * row_blocks * groups, &|t| {
        let (bi, rest) = (t / (row_blocks * groups), t % (row_blocks * groups));
        let (block, group) = (rest / groups, rest % groups);
        let task_panels = group * panels_per_group..((group + 1) * panels_per_group).min(panels);
        let rows = block * ROWS_PER_TASK..((block + 1) * ROWS_PER_TASK).min(m);
        let height = rows.len();
        // A's rows of this task in pairs, in whole tiles (rows past `height` are never stored).
        let tiles = height.div_ceil(MR);
        let mut packed_a = take_buffer(&PACKED_A, tiles * MR * pairs);
        let at = |i: usize, kk: usize| -> f32 {
            if kk < k {
                // SAFETY: (i, kk) is inside batch bi's A (caller's contract).
                unsafe { *ap.at(bi * la.batch_stride + i * la.row_stride + kk * la.col_stride) }
            } else {
                0.0
            }
        };
        // Tile-major: the 12 rows of a tile, pair by pair, as the kernel broadcasts them. Read in
        // A's memory order: down columns (k and k + 1 side by side) when A is transposed, along
        // rows when it is row-major.
        let origin = bi * la.batch_stride + rows.start * la.row_stride;
        if la.row_stride == 1 && la.col_stride != 1 {
            for p in 0..pairs {
                // SAFETY: columns 2p and 2p + 1 (when < k) hold the task's `height` rows.
                let c0 = unsafe {
                    std::slice::from_raw_parts(ap.at(origin + 2 * p * la.col_stride), height)
                };
                let c1 = (2 * p + 1 < k).then(|| unsafe {
                    std::slice::from_raw_parts(ap.at(origin + (2 * p + 1) * la.col_stride), height)
                });
                for tile in 0..tiles {
                    let live = (height - tile * MR).min(MR);
                    let out = &mut packed_a[(tile * pairs + p) * MR..][..live];
                    let x0 = &c0[tile * MR..tile * MR + live];
                    let x1 = c1.map(|c1| &c1[tile * MR..tile * MR + live]);
                    side_by_side(x0, x1, out);
                }
            }
        } else if la.col_stride == 1 {
            for r in 0..height {
                // SAFETY: row `rows.start + r` holds k elements.
                let row =
                    unsafe { std::slice::from_raw_parts(ap.at(origin + r * la.row_stride), k) };
                let (tile, lane) = (r / MR, r % MR);
                neighbours(row, &mut packed_a[tile * pairs * MR + lane..], MR);
            }
        } else {
            for r in 0..height {
                let (tile, lane) = (r / MR, r % MR);
                for p in 0..pairs {
                    let i = rows.start + r;
                    packed_a[(tile * pairs + p) * MR + lane] = pair(at(i, 2 * p), at(i, 2 * p + 1));
                }
            }
        }
        let b_batch = if b_batches == 1 { 0 } else { bi };
        for panel in task_panels.clone() {
            let b_panel = &b_packed[(b_batch * panels + panel) * panel_len..][..panel_len];
            let cols = (n - panel * NR).min(NR);
            for tile in 0..tiles {
                let a_tile = &packed_a[tile * pairs * MR..][..pairs * MR];
                let first = rows.start + tile * MR;
                let live_rows = (rows.end - first).min(MR);
                // SAFETY: rows first..first+live_rows and columns panel*NR..+cols of batch bi's
                // C belong to this task alone; `available()` (the caller's contract).
                unsafe {
                    let c_tile = cp.at(bi * m * n + first * n + panel * NR);
                    #[cfg(target_arch = "x86_64")]
                    tile_12x32(a_tile, b_panel, pairs, c_tile, n, live_rows, cols);
                    #[cfg(not(target_arch = "x86_64"))]
                    let _ = (a_tile, b_panel, c_tile, live_rows, cols);
                }
            }
        }
        keep_buffer(&PACKED_A, packed_a);
    });
    keep_buffer(&PACKED_B, packed_b);
}

std::thread_local! {
    /// Each thread's packing buffers, kept between calls: `peer`'s packed operands are hundreds
    /// of KiB to MiB, which a fresh allocation per call (or per task) maps and faults in again.
    static PACKED_A: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
    static PACKED_B: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

/// This thread's buffer `key`, at least `len` long. Its contents are stale: the packing writes
/// every lane the kernel's stored results read, and the lanes past an edge (rows past the
/// task's, columns past `n`) only feed accumulators that are never stored.
fn take_buffer(key: &'static LocalKey<RefCell<Vec<u32>>>, len: usize) -> Vec<u32> {
    let mut buffer = key.with(|b| std::mem::take(&mut *b.borrow_mut()));
    if buffer.len() < len {
        buffer.resize(len, 0);
    }
    buffer
}

/// Gives `buffer` back to this thread for its next call.
fn keep_buffer(key: &'static LocalKey<RefCell<Vec<u32>>>, buffer: Vec<u32>) {
    key.with(|b| *b.borrow_mut() = buffer);
}

/// One 12 x 32 tile of C: `rows` x `cols` of it stored at `c` (row stride `ldc`).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile_12x32(
    a: &[u32],
    b: &[u32],
    pairs: usize,
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
) {
    use std::arch::x86_64::*;
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    for p in 0..pairs {
        // SAFETY: `b` holds `pairs` x 32 lanes, `a` `pairs` x 12 (the packing above).
        let (b0, b1) = unsafe {
            (
                _mm512_loadu_si512(b.as_ptr().add(p * NR) as *const _),
                _mm512_loadu_si512(b.as_ptr().add(p * NR + 16) as *const _),
            )
        };
        let (b0, b1) = (
            std::mem::transmute::<__m512i, __m512bh>(b0),
            std::mem::transmute::<__m512i, __m512bh>(b1),
        );
        for (r, row) in acc.iter_mut().enumerate() {
            let av =
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(a[p * MR + r] as i32));
            row[0] = _mm512_dpbf16_ps(row[0], av, b0);
            row[1] = _mm512_dpbf16_ps(row[1], av, b1);
        }
    }
    let mask = |from: usize| -> __mmask16 {
        let live = cols.saturating_sub(from).min(16);
        if live == 16 {
            0xFFFF
        } else {
            ((1u32 << live) - 1) as __mmask16
        }
    };
    let (m0, m1) = (mask(0), mask(16));
    for (r, row) in acc.iter().enumerate().take(rows) {
        // SAFETY: the masks store only the tile's live columns of its live rows.
        unsafe {
            let at = c.add(r * ldc);
            _mm512_mask_storeu_ps(at, m0, row[0]);
            if cols > 16 {
                _mm512_mask_storeu_ps(at.add(16), m1, row[1]);
            }
        }
    }
}

/// Packing 16 pairs at a time: `round_bf16` on integer lanes (so denormals round as the cast
/// kernels round them, which `vcvtne2ps2bf16` would flush), then each pair's two high halves
/// into one lane.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// `round_bf16`'s bits of 16 lanes: nearest, ties to even, NaN kept as it is.
    #[target_feature(enable = "avx512f")]
    fn rounded(x: __m512i) -> __m512i {
        let kept_low = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(kept_low, _mm512_set1_epi32(0x7FFF));
        let r = _mm512_and_si512(_mm512_add_epi32(x, bias), _mm512_set1_epi32(-65536));
        let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
        _mm512_mask_blend_epi32(nan, r, x)
    }

    /// `pair` of each lane of `x0` and `x1`.
    #[target_feature(enable = "avx512f")]
    fn paired(x0: __m512i, x1: __m512i) -> __m512i {
        _mm512_or_si512(
            _mm512_srli_epi32::<16>(rounded(x0)),
            _mm512_and_si512(rounded(x1), _mm512_set1_epi32(-65536)),
        )
    }

    /// `out[i] = pair(x0[i], x1[i])` (zero for a missing `x1`) for the first `live` (<= 16) lanes.
    ///
    /// # Safety
    /// `live` elements must be readable from `x0` (and `x1`) and writable at `out`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn side_by_side_16(
        x0: *const f32,
        x1: Option<*const f32>,
        out: *mut u32,
        live: usize,
    ) {
        let mask = if live >= 16 {
            0xFFFF
        } else {
            ((1u32 << live) - 1) as __mmask16
        };
        // SAFETY: the masked lanes are inside the caller's slices.
        unsafe {
            let a = _mm512_maskz_loadu_epi32(mask, x0 as *const i32);
            let b = match x1 {
                Some(x1) => _mm512_maskz_loadu_epi32(mask, x1 as *const i32),
                None => _mm512_setzero_si512(),
            };
            _mm512_mask_storeu_epi32(out as *mut i32, mask, paired(a, b));
        }
    }

    /// `pair(x[2q], x[2q + 1])` for q in 0..16.
    ///
    /// # Safety
    /// 32 elements must be readable from `x`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn neighbours_16(x: *const f32) -> [u32; 16] {
        // SAFETY: 32 elements from `x` (the caller's contract).
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_si512(x as *const _),
                _mm512_loadu_si512(x.add(16) as *const _),
            )
        };
        // Even elements (pairs' first) and odd ones (second) of the 32, in pair order.
        let evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        let odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        let first = _mm512_permutex2var_epi32(lo, evens, hi);
        let second = _mm512_permutex2var_epi32(lo, odds, hi);
        let mut lanes = [0u32; 16];
        // SAFETY: `lanes` holds 16 lanes.
        unsafe { _mm512_storeu_si512(lanes.as_mut_ptr() as *mut _, paired(first, second)) };
        lanes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphtrain_ir::host_tensor::round_bf16;

    /// The vector packing paths give `pair`'s bits, lane for lane, on the values rounding
    /// treats specially: ties (to even, both ways), denormals (rounded, not flushed), NaN (kept,
    /// payload and all), infinities, the largest finite values (which round to infinity), -0.
    #[test]
    fn vector_packing_rounds_as_pair_does() {
        if !available() {
            eprintln!("skipping: this cpu has no AVX512_BF16");
            return;
        }
        let special = [
            0x3F80_8000u32, // 1 + 2^-8: a tie, kept part even: down
            0x3F81_8000,    // a tie, kept part odd: up
            0x3F80_8001,    // just above a tie: up
            0x0000_8000,    // a denormal tie
            0x0001_7FFF,    // a denormal below a tie
            0x007F_FFFF,    // the largest denormal: up to the smallest normal
            0x7FC0_1234,    // a quiet NaN with a payload in the dropped half
            0x7FFF_FFFF,    // a NaN that rounding would carry into the sign (-0)
            0xFFBF_FFFF,    // a NaN that rounding would carry into its kept half
            0xFF80_0001,    // a signalling NaN
            0x7F80_0000,    // infinity
            0x7F7F_FFFF,    // the largest finite: up to infinity
            0x8000_0000,    // -0
            0xBF7F_7FFF,
        ];
        let xs: Vec<f32> = (0..77)
            .map(|i| f32::from_bits(special[i % special.len()] ^ ((i as u32 / 12) << 24)))
            .collect();
        for len in [0, 1, 12, 16, 17, 33, 70] {
            let (x0, x1) = (&xs[..len], &xs[3..3 + len]);
            let mut got = vec![0u32; len];
            side_by_side(x0, Some(x1), &mut got);
            let want: Vec<u32> = x0.iter().zip(x1).map(|(&a, &b)| pair(a, b)).collect();
            assert_eq!(got, want, "side by side, {len} lanes");
            side_by_side(x0, None, &mut got);
            let want: Vec<u32> = x0.iter().map(|&a| pair(a, 0.0)).collect();
            assert_eq!(got, want, "side by side with no second row, {len} lanes");
            let pairs = len.div_ceil(2);
            let stride = 3;
            let mut got = vec![0u32; pairs * stride];
            neighbours(x0, &mut got, stride);
            for q in 0..pairs {
                let want = pair(x0[2 * q], x0.get(2 * q + 1).copied().unwrap_or(0.0));
                assert_eq!(
                    got[q * stride],
                    want,
                    "neighbours, {len} elements, pair {q}"
                );
            }
        }
    }

    /// Against a naive f64 sum of the operands rounded to bf16: within f32 rounding, at odd
    /// sizes (edge tiles, an odd k), row-major and transposed operands (each packing path but
    /// the general-stride one), a shared B, and any thread count. The operands are given
    /// unrounded (f32 that are not bf16, rounding up and down), so packing must round them.
    #[test]
    fn matches_the_naive_sum_at_odd_sizes_and_layouts() {
        if !available() {
            eprintln!("skipping: this cpu has no AVX512_BF16");
            return;
        }
        let value = |i: usize| ((i * 7919 % 1000) as f32 - 500.0) / 250.0 * 1.000_123_7;
        for &(batch, m, n, k, shared, transposed) in &[
            (1, 13, 37, 33, true, false),
            (2, 100, 65, 7, false, true),
            (3, 1, 1, 1, false, false),
            (1, 97, 32, 300, true, true),
        ] {
            let a: Vec<f32> = (0..batch * m * k).map(value).collect();
            let b: Vec<f32> = (0..(if shared { 1 } else { batch }) * k * n)
                .map(|i| value(i + 17))
                .collect();
            // A row-major, or stored as its transpose (column-major reads).
            let (a_given, b_given) = (a.clone(), b.clone());
            let (a, b): (Vec<f32>, Vec<f32>) = (
                a.into_iter().map(round_bf16).collect(),
                b.into_iter().map(round_bf16).collect(),
            );
            assert!(a.iter().zip(&a_given).any(|(r, g)| r != g));
            let la = if transposed {
                Layout {
                    batch_stride: m * k,
                    row_stride: 1,
                    col_stride: m,
                }
            } else {
                Layout {
                    batch_stride: m * k,
                    row_stride: k,
                    col_stride: 1,
                }
            };
            // B likewise: row-major, or stored as its transpose.
            let (row_stride, col_stride) = if transposed { (1, k) } else { (n, 1) };
            let lb = Layout {
                batch_stride: if shared { 0 } else { k * n },
                row_stride,
                col_stride,
            };
            let want: Vec<f64> = (0..batch * m * n)
                .map(|idx| {
                    let (bi, i, j) = (idx / (m * n), idx / n % m, idx % n);
                    (0..k)
                        .map(|kk| {
                            let x = a[bi * m * k + i * la.row_stride + kk * la.col_stride];
                            let y =
                                b[bi * lb.batch_stride + kk * lb.row_stride + j * lb.col_stride];
                            x as f64 * y as f64
                        })
                        .sum()
                })
                .collect();
            let mut runs = Vec::new();
            for threads in [1, 3] {
                let mut c = vec![f32::NAN; batch * m * n];
                // SAFETY: the buffers hold what the shapes name.
                unsafe {
                    gemm_bf16(
                        batch,
                        m,
                        n,
                        k,
                        a_given.as_ptr(),
                        la,
                        b_given.as_ptr(),
                        lb,
                        c.as_mut_ptr(),
                        threads,
                    )
                };
                for (idx, (&got, &want)) in c.iter().zip(&want).enumerate() {
                    let scale: f64 = (0..k).map(|_| 4.0).sum::<f64>().max(1.0);
                    assert!(
                        (got as f64 - want).abs() <= 1e-6 * scale,
                        "({batch},{m},{n},{k}) element {idx}: {got} vs {want}"
                    );
                }
                runs.push(c.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
            assert_eq!(runs[0], runs[1], "the bits depend on the thread count");
        }
    }
}
