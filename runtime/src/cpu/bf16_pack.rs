//! Packing f32 operands into bf16 pairs, for the bf16 GEMM (`gemm_bf16.rs`, `gemm_amx.rs`).
//!
//! A pair is one 32-bit lane with two bf16 values along k: k = 2p in the low half, k = 2p + 1
//! in the high half, as `vdpbf16ps` and `tdpbf16ps` read them. Every element is rounded as
//! `round_bf16` rounds (nearest, ties to even, denormals rounded and not flushed, NaN kept):
//! the identity on bf16 values in f32 slots, the cast for f32 operands. An odd k's last pair
//! has a zero high half.
//!
//! Operands come in two orders along k, and each is read in memory order:
//! * k runs down a column (two rows side by side make a vector of pairs): `side_by_side`;
//!   turned into rows of pairs (AMX's A tiles) by `columns_to_rows`.
//! * k runs along a row (neighbours make a pair): `neighbours`; turned into columns of pairs
//!   (B's panels) by `rows_to_columns`.
//!
//! The vector paths run AVX-512F: the safe functions check for it (one cached load) and fall
//! back to `pair` one lane at a time; the block transposes are `unsafe` and leave the check
//! to their callers (the GEMM, which runs only where `gemm_bf16::available()`).

/// The bf16 pair (x0, x1), each rounded to bf16, as one 32-bit lane: x0 in the low half. A NaN
/// gets its quiet bit set, so that its high half (all a bf16 keeps) is a NaN too: one whose
/// payload lay in the low half alone would otherwise become an infinity.
pub fn pair(x0: f32, x1: f32) -> u32 {
    let bits = |x: f32| {
        let rounded = graphtrain_ir::host_tensor::round_bf16(x).to_bits();
        if x.is_nan() {
            rounded | QUIET_BIT
        } else {
            rounded
        }
    };
    (bits(x0) >> 16) | (bits(x1) & 0xFFFF_0000)
}

/// The quiet bit of an f32 NaN, inside the high half a bf16 keeps.
const QUIET_BIT: u32 = 0x0040_0000;

/// `out[i] = pair(x0[i], x1[i])`, with zeros for a missing `x1` (an odd k's last pair): two
/// rows (or columns) of an operand that hold pairs' first and second elements side by side.
pub fn side_by_side(x0: &[f32], x1: Option<&[f32]>, out: &mut [u32]) {
    let len = out.len();
    assert!(x0.len() >= len && x1.is_none_or(|x1| x1.len() >= len));
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present; `len` elements are inside every slice (asserted above).
        unsafe {
            simd::side_by_side(x0.as_ptr(), x1.map(<[f32]>::as_ptr), out.as_mut_ptr(), len);
        }
        return;
    }
    for i in 0..len {
        out[i] = pair(x0[i], x1.map_or(0.0, |x1| x1[i]));
    }
}

/// `out[p * stride] = pair(x[2p], x[2p + 1])` for every pair of `x` (a zero after an odd last
/// element): a row (or column) of an operand whose neighbours are pairs.
pub fn neighbours(x: &[f32], out: &mut [u32], stride: usize) {
    let pairs = x.len().div_ceil(2);
    assert!(pairs == 0 || out.len() > (pairs - 1) * stride);
    let mut p = 0;
    #[cfg(target_arch = "x86_64")]
    let vector = is_x86_feature_detected!("avx512f");
    #[cfg(target_arch = "x86_64")]
    while vector && p < pairs {
        let live = (x.len() - 2 * p).min(32);
        // SAFETY: AVX-512F is present; `live` elements from 2p are inside `x`, and the lanes
        // stored (the live pairs) inside `out` (asserted above).
        unsafe {
            let lanes = simd::neighbours(x.as_ptr().add(2 * p), live);
            simd::store_strided(
                lanes,
                out.as_mut_ptr().add(p * stride),
                stride,
                live.div_ceil(2),
            );
        }
        p += 16;
    }
    #[allow(clippy::needless_range_loop)]
    for q in p..pairs {
        out[q * stride] = pair(x[2 * q], x.get(2 * q + 1).copied().unwrap_or(0.0));
    }
}

/// `x[i] = round_bf16(x[i])`: a bf16 product's f32 sums, rounded once (on AVX-512 where the
/// cpu has it, else one at a time: the same bits).
pub fn round_in_place(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: AVX-512F is present; the slice's elements are read and written in place.
        unsafe { simd::round_in_place(x.as_mut_ptr(), x.len()) };
        return;
    }
    for v in x {
        *v = graphtrain_ir::host_tensor::round_bf16(*v);
    }
}

/// `round_in_place` of `rows` rows of `cols` elements from `x`, `stride` apart (a stored tile
/// of C, while it is in L1).
///
/// # Safety
/// Those elements readable and writable.
pub unsafe fn round_rows(x: *mut f32, stride: usize, rows: usize, cols: usize) {
    // SAFETY: the caller's contract; a copy onto itself (`copy_rows` allows it).
    unsafe { copy_rows(x, stride, x, stride, (rows, cols), true) }
}

/// Row r of `dst` (`cols` elements, `dst_stride` apart) = row r of `src` (`src_stride` apart),
/// rounded to bf16 where `round` (a stored tile of C on its way from L1 scratch to C).
///
/// # Safety
/// Those elements readable at `src`, writable at `dst`; the two are the same place (rounding
/// in place: each 16 lanes are read before they are written) or do not overlap.
pub unsafe fn copy_rows(
    src: *const f32,
    src_stride: usize,
    dst: *mut f32,
    dst_stride: usize,
    (rows, cols): (usize, usize),
    round: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        for r in 0..rows {
            // SAFETY: row r's `cols` elements (the caller's contract); AVX-512F is present.
            unsafe {
                simd::copy(
                    src.add(r * src_stride),
                    dst.add(r * dst_stride),
                    cols,
                    round,
                )
            };
        }
        return;
    }
    for r in 0..rows {
        for c in 0..cols {
            // SAFETY: (r, c) inside both (the caller's contract).
            unsafe {
                let x = *src.add(r * src_stride + c);
                *dst.add(r * dst_stride + c) = if round {
                    graphtrain_ir::host_tensor::round_bf16(x)
                } else {
                    x
                };
            }
        }
    }
}

/// The 2 bytes a bf16 value is stored in (`Program::is_two_byte`): `round_bf16(x)`'s high half,
/// a NaN kept a NaN by its quiet bit (its payload may lie in the dropped half), as `pair` keeps
/// it.
pub fn half(x: f32) -> u16 {
    let rounded = graphtrain_ir::host_tensor::round_bf16(x).to_bits();
    let bits = if x.is_nan() {
        rounded | QUIET_BIT
    } else {
        rounded
    };
    (bits >> 16) as u16
}

/// Row r of `dst` (`cols` 2-byte elements, `dst_stride` apart) = `half` of row r of `src`
/// (`src_stride` apart): a block of a bf16 product's C, from L1 scratch to C stored in 2 bytes.
///
/// # Safety
/// Those elements readable at `src`, writable at `dst`; the two do not overlap.
pub unsafe fn copy_rows_to_halves(
    src: *const f32,
    src_stride: usize,
    dst: *mut u16,
    dst_stride: usize,
    (rows, cols): (usize, usize),
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        for r in 0..rows {
            // SAFETY: row r's `cols` elements (the caller's contract); AVX-512F is present.
            unsafe { simd::to_halves(src.add(r * src_stride), dst.add(r * dst_stride), cols) };
        }
        return;
    }
    for r in 0..rows {
        for c in 0..cols {
            // SAFETY: (r, c) inside both (the caller's contract).
            unsafe { *dst.add(r * dst_stride + c) = half(*src.add(r * src_stride + c)) };
        }
    }
}

/// Where a GEMM of bf16 operands reads an operand: f32 slots (each element rounded to bf16 as
/// it is packed), or bf16 stored in 2 bytes an element (`Program::is_two_byte`: packed as the
/// halves they are).
#[derive(Clone, Copy, Debug)]
pub enum Src {
    F32(*const f32),
    Halves(*const u16),
}

// SAFETY: a `Src` only carries the operand's address, which the tasks only read.
unsafe impl Sync for Src {}
unsafe impl Send for Src {}

impl Src {
    /// Element `i` as the f32 it holds (not rounded).
    ///
    /// # Safety
    /// Element `i` readable.
    pub unsafe fn get(self, i: usize) -> f32 {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                Src::F32(x) => *x.add(i),
                Src::Halves(x) => widen(x, i),
            }
        }
    }

    /// The operand from its element `i` on.
    pub fn at(self, i: usize) -> Src {
        match self {
            Src::F32(x) => Src::F32(x.wrapping_add(i)),
            Src::Halves(x) => Src::Halves(x.wrapping_add(i)),
        }
    }

    /// Element `i` of an operand stored in 2 bytes (`None` for f32 slots).
    pub fn halves_at(self, i: usize) -> Option<*const u16> {
        match self {
            Src::F32(_) => None,
            Src::Halves(x) => Some(x.wrapping_add(i)),
        }
    }
}

/// Element `i` of a bf16 value stored in 2 bytes (`Program::is_two_byte`), as the f32 it is.
///
/// # Safety
/// `x + i` readable.
pub unsafe fn widen(x: *const u16, i: usize) -> f32 {
    // SAFETY: the caller's contract.
    f32::from_bits((unsafe { *x.add(i) } as u32) << 16)
}

/// `out[j] = x0[j] | x1[j] << 16` for `j < out.len()`: the pairs of two neighbouring k of an
/// operand stored in 2 bytes whose k-th elements lie side by side (a row-major B's rows, a
/// transposed A's columns), zeros for a missing `x1`. `side_by_side` for halves: they are
/// bf16 already, so nothing rounds.
///
/// # Safety
/// `out.len()` halves readable from `x0` (and `x1`).
pub unsafe fn interleave_halves(x0: *const u16, x1: Option<*const u16>, out: &mut [u32]) {
    for (j, o) in out.iter_mut().enumerate() {
        // SAFETY: j < out.len() (the caller's contract).
        unsafe {
            let high = x1.map_or(0, |x1| *x1.add(j) as u32);
            *o = *x0.add(j) as u32 | high << 16;
        }
    }
}

/// `out[p * stride]` = pair p of `k` elements stored in 2 bytes from `x` (a row of a
/// row-major operand): the 4-byte words they already are where `x` is 4-byte aligned, the last
/// pair's second half zero when `k` is odd. `neighbours` for halves.
///
/// # Safety
/// `k` halves readable from `x`; `out` writable at every `p * stride` for the `k.div_ceil(2)`
/// pairs.
pub unsafe fn row_pairs_halves(x: *const u16, k: usize, out: *mut u32, stride: usize) {
    let whole = k / 2;
    if (x as usize).is_multiple_of(4) {
        let words = x as *const u32;
        for p in 0..whole {
            // SAFETY: pair p's two halves are inside the row (the caller's contract).
            unsafe { *out.add(p * stride) = words.add(p).read() };
        }
    } else {
        for p in 0..whole {
            // SAFETY: as above.
            unsafe {
                *out.add(p * stride) = *x.add(2 * p) as u32 | (*x.add(2 * p + 1) as u32) << 16
            };
        }
    }
    if k % 2 == 1 {
        // SAFETY: element k - 1 is the row's last (the caller's contract).
        unsafe { *out.add(whole * stride) = *x.add(k - 1) as u32 };
    }
}

#[cfg(target_arch = "x86_64")]
pub use simd::{columns_to_rows, columns_to_rows_halves, rows_to_columns};

/// `cols` columns of an operand whose k runs down each column (column j's k elements
/// contiguous at `x + j * col_stride`) as a panel's pair rows: lane j of row p (at `out + p *
/// out_stride + j`) = `pair(x_j[2p], x_j[2p + 1])` for every pair of k, a zero after an odd
/// last element. Columns go 16 at a time: the lanes past `cols` in the last group of 16 are
/// written as zeros, those past it are not written. (Transposed B of the bf16 GEMM, and the
/// keys and values attention's products read transposed.)
///
/// # Safety
/// Each column's k elements readable; `k.div_ceil(2)` rows of `cols.next_multiple_of(16)`
/// lanes writable at `out`, `out_stride` apart; AVX-512F.
#[cfg(target_arch = "x86_64")]
pub unsafe fn column_panel(
    x: *const f32,
    col_stride: usize,
    (k, cols): (usize, usize),
    out: *mut u32,
    out_stride: usize,
) {
    let pairs = k.div_ceil(2);
    for first in (0..pairs).step_by(16) {
        for lane in (0..cols).step_by(16) {
            // SAFETY: columns lane.. (the live ones) hold k elements; rows first..first + 16
            // (those < pairs) of 16 lanes from `lane` are writable (the caller's contract).
            unsafe {
                rows_to_columns(
                    x.add(lane * col_stride),
                    col_stride,
                    k,
                    first,
                    (cols - lane).min(16),
                    (pairs - first).min(16),
                    out.add(first * out_stride + lane),
                    out_stride,
                )
            };
        }
    }
}

/// A row of `k` elements as tile rows of 16 pairs: pairs `16c..16c + 16` (zeros past k's) to
/// the 16 lanes at `out + c * chunk_stride`, for every chunk c of `k.div_ceil(32)`. (An AMX A
/// row, straight into its chunks: through a row of pairs and a copy per chunk, packing the
/// probabilities spent as long in `memmove` as in the packing itself.)
///
/// # Safety
/// `k` elements readable from `x`; 16 lanes writable at each chunk's place; AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
pub unsafe fn row_chunks(x: *const f32, k: usize, out: *mut u32, chunk_stride: usize) {
    for c in 0..k.div_ceil(32) {
        // SAFETY: the chunk's live elements are inside the row; its 16 lanes are writable
        // (the caller's contract).
        unsafe {
            let lanes = simd::neighbours(x.add(32 * c), (k - 32 * c).min(32));
            simd::store_strided(lanes, out.add(c * chunk_stride), 1, 16);
        }
    }
}

/// Packing 16 pairs at a time: `round_bf16` on integer lanes (so denormals round as the cast
/// kernels round them, which `vcvtne2ps2bf16` would flush), then each pair's two high halves
/// into one lane.
#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    /// The first `live` of 16 lanes.
    fn mask(live: usize) -> __mmask16 {
        if live >= 16 {
            0xFFFF
        } else {
            ((1u32 << live) - 1) as __mmask16
        }
    }

    /// `round_bf16`'s bits of 16 lanes: nearest, ties to even, NaN kept as it is (with its quiet
    /// bit set where `QUIET_NAN`, as `pair` sets it).
    #[target_feature(enable = "avx512f")]
    fn rounded<const QUIET_NAN: bool>(x: __m512i) -> __m512i {
        let kept_low = _mm512_and_si512(_mm512_srli_epi32::<16>(x), _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(kept_low, _mm512_set1_epi32(0x7FFF));
        let r = _mm512_and_si512(_mm512_add_epi32(x, bias), _mm512_set1_epi32(-65536));
        let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
        let nan = _mm512_cmpgt_epi32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
        let nan_bits = if QUIET_NAN {
            _mm512_or_si512(x, _mm512_set1_epi32(super::QUIET_BIT as i32))
        } else {
            x
        };
        _mm512_mask_blend_epi32(nan, r, nan_bits)
    }

    /// `pair` of each lane of `x0` and `x1`.
    #[target_feature(enable = "avx512f")]
    fn paired(x0: __m512i, x1: __m512i) -> __m512i {
        _mm512_or_si512(
            _mm512_srli_epi32::<16>(rounded::<true>(x0)),
            _mm512_and_si512(rounded::<true>(x1), _mm512_set1_epi32(-65536)),
        )
    }

    /// The first `live` lanes from `x` (zeros after; no lane past them is read).
    ///
    /// # Safety
    /// `live` (<= 16) elements readable from `x`.
    #[target_feature(enable = "avx512f")]
    unsafe fn load(x: *const f32, live: usize) -> __m512i {
        // SAFETY: the masked lanes are readable (the caller's contract).
        unsafe { _mm512_maskz_loadu_epi32(mask(live), x as *const i32) }
    }

    /// # Safety
    /// `len` elements readable from `x0` (and `x1`), writable at `out`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn side_by_side(
        x0: *const f32,
        x1: Option<*const f32>,
        out: *mut u32,
        len: usize,
    ) {
        let mut done = 0;
        while done < len {
            let live = (len - done).min(16);
            // SAFETY: `live` lanes from `done` are inside the caller's buffers.
            unsafe {
                let a = load(x0.add(done), live);
                let b = match x1 {
                    Some(x1) => load(x1.add(done), live),
                    None => _mm512_setzero_si512(),
                };
                _mm512_mask_storeu_epi32(out.add(done) as *mut i32, mask(live), paired(a, b));
            }
            done += live;
        }
    }

    /// # Safety
    /// `len` elements readable and writable at `x`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_in_place(x: *mut f32, len: usize) {
        // SAFETY: the caller's contract; `copy` reads each 16 lanes before it writes them.
        unsafe { copy(x, x, len, true) }
    }

    /// # Safety
    /// `len` elements readable at `src` and writable at `dst` (the same place, or apart).
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn copy(src: *const f32, dst: *mut f32, len: usize, round: bool) {
        let mut done = 0;
        while done < len {
            let live = (len - done).min(16);
            // SAFETY: `live` lanes from `done` are inside the caller's buffers.
            unsafe {
                let v = load(src.add(done), live);
                let v = if round { rounded::<false>(v) } else { v };
                _mm512_mask_storeu_epi32(dst.add(done) as *mut i32, mask(live), v);
            }
            done += live;
        }
    }

    /// `half` of `len` elements from `src`, to `dst`.
    ///
    /// # Safety
    /// `len` elements readable at `src`, `len` halves writable at `dst`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn to_halves(src: *const f32, dst: *mut u16, len: usize) {
        let mut done = 0;
        while done < len {
            let live = (len - done).min(16);
            // SAFETY: `live` lanes from `done` are inside the caller's buffers.
            unsafe {
                let high = _mm512_srli_epi32::<16>(rounded::<true>(load(src.add(done), live)));
                _mm512_mask_cvtepi32_storeu_epi16(dst.add(done) as *mut i16, mask(live), high);
            }
            done += live;
        }
    }

    /// `pair(x[2q], x[2q + 1])` for q in 0..16, of the first `live` (<= 32) elements of `x`
    /// (zeros after them).
    ///
    /// # Safety
    /// `live` elements readable from `x`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn neighbours(x: *const f32, live: usize) -> __m512i {
        // SAFETY: the loads' masks cover `live` elements.
        let (lo, hi) = unsafe {
            (
                load(x, live.min(16)),
                load(x.add(16), live.saturating_sub(16)),
            )
        };
        // Even elements (pairs' first) and odd ones (second) of the 32, in pair order.
        let evens = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
        let odds = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
        let first = _mm512_permutex2var_epi32(lo, evens, hi);
        let second = _mm512_permutex2var_epi32(lo, odds, hi);
        paired(first, second)
    }

    /// Lane q of `lanes` to `out + q * stride`, for q < `live`.
    ///
    /// # Safety
    /// Those `live` places writable.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn store_strided(lanes: __m512i, out: *mut u32, stride: usize, live: usize) {
        if stride == 1 {
            // SAFETY: `live` contiguous lanes (the caller's contract).
            unsafe { _mm512_mask_storeu_epi32(out as *mut i32, mask(live), lanes) };
            return;
        }
        let mut spilled = [0u32; 16];
        // SAFETY: `spilled` holds 16 lanes; the writes below are the caller's places.
        unsafe {
            _mm512_storeu_si512(spilled.as_mut_ptr() as *mut _, lanes);
            for (q, &lane) in spilled.iter().enumerate().take(live) {
                *out.add(q * stride) = lane;
            }
        }
    }

    /// Rows of `v` become columns: lane c of row r goes to lane r of row c.
    #[target_feature(enable = "avx512f")]
    fn transpose(v: [__m512i; 16]) -> [__m512i; 16] {
        // Within each 128-bit lane: pairs of rows interleaved, then quads, so that t2[4g + j]
        // holds, in 128-bit lane L, column 4L + j of rows 4g..4g + 4.
        let mut t1 = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t1[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
            t1[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
        }
        let mut t2 = [_mm512_setzero_si512(); 16];
        for g in 0..4 {
            let t = &t1[4 * g..4 * g + 4];
            t2[4 * g] = _mm512_unpacklo_epi64(t[0], t[2]);
            t2[4 * g + 1] = _mm512_unpackhi_epi64(t[0], t[2]);
            t2[4 * g + 2] = _mm512_unpacklo_epi64(t[1], t[3]);
            t2[4 * g + 3] = _mm512_unpackhi_epi64(t[1], t[3]);
        }
        // Then the 128-bit lanes: row 4L + j gathers lane L of t2[j], t2[4 + j], t2[8 + j],
        // t2[12 + j].
        let mut out = [_mm512_setzero_si512(); 16];
        for j in 0..4 {
            let low01 = _mm512_shuffle_i32x4::<0x44>(t2[j], t2[4 + j]);
            let high01 = _mm512_shuffle_i32x4::<0x44>(t2[8 + j], t2[12 + j]);
            let low23 = _mm512_shuffle_i32x4::<0xEE>(t2[j], t2[4 + j]);
            let high23 = _mm512_shuffle_i32x4::<0xEE>(t2[8 + j], t2[12 + j]);
            out[j] = _mm512_shuffle_i32x4::<0x88>(low01, high01);
            out[4 + j] = _mm512_shuffle_i32x4::<0xDD>(low01, high01);
            out[8 + j] = _mm512_shuffle_i32x4::<0x88>(low23, high23);
            out[12 + j] = _mm512_shuffle_i32x4::<0xDD>(low23, high23);
        }
        out
    }

    /// A 16 x 16 block of pairs from an operand whose k runs down its columns: element (r, kk)
    /// at `x + r + kk * col_stride`. Writes rows r = 0..16 (live rows: `rows`; the rest zero)
    /// of pairs `first..first + 16` (zeros past k's) at `out + r * out_stride`, 16 lanes each.
    ///
    /// # Safety
    /// The elements named (rows `..rows`, k `..k`) must be readable, `out` writable for 16
    /// rows; AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn columns_to_rows(
        x: *const f32,
        col_stride: usize,
        k: usize,
        first: usize,
        rows: usize,
        out: *mut u32,
        out_stride: usize,
    ) {
        let mut v = [_mm512_setzero_si512(); 16];
        for (q, lanes) in v.iter_mut().enumerate() {
            let kk = 2 * (first + q);
            if kk >= k {
                break;
            }
            // SAFETY: columns kk and kk + 1 (when < k) hold `rows` readable rows.
            unsafe {
                let x0 = load(x.add(kk * col_stride), rows);
                let x1 = if kk + 1 < k {
                    load(x.add((kk + 1) * col_stride), rows)
                } else {
                    _mm512_setzero_si512()
                };
                *lanes = paired(x0, x1);
            }
        }
        for (r, row) in transpose(v).into_iter().enumerate() {
            // SAFETY: 16 rows of 16 lanes writable (the caller's contract).
            unsafe { _mm512_storeu_si512(out.add(r * out_stride) as *mut _, row) };
        }
    }

    /// `columns_to_rows` of an operand stored in 2 bytes (`Program::is_two_byte`): element
    /// (r, kk) at `x + r + kk * col_stride` halves; the pairs are its halves side by side.
    ///
    /// # Safety
    /// As `columns_to_rows`'s; AVX-512BW and VL as well (`gemm_bf16::available`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn columns_to_rows_halves(
        x: *const u16,
        col_stride: usize,
        k: usize,
        first: usize,
        rows: usize,
        out: *mut u32,
        out_stride: usize,
    ) {
        // `rows` (<= 16) halves zero-extended into 16 lanes; none past them is read (a masked
        // load: through a copy into 16 lanes on the stack, `memmove` took as long as the rest
        // of the packing, and the weight gradients that read halves transposed ran a fifth
        // slower).
        let live = mask(rows);
        let widened = |p: *const u16| {
            // SAFETY: `rows` halves readable at `p` (the caller's contract), the rest masked.
            unsafe { _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p as *const i16)) }
        };
        let mut v = [_mm512_setzero_si512(); 16];
        for (q, lanes) in v.iter_mut().enumerate() {
            let kk = 2 * (first + q);
            if kk >= k {
                break;
            }
            let x0 = widened(x.wrapping_add(kk * col_stride));
            let x1 = if kk + 1 < k {
                widened(x.wrapping_add((kk + 1) * col_stride))
            } else {
                _mm512_setzero_si512()
            };
            *lanes = _mm512_or_si512(x0, _mm512_slli_epi32::<16>(x1));
        }
        for (r, row) in transpose(v).into_iter().enumerate() {
            // SAFETY: 16 rows of 16 lanes writable (the caller's contract).
            unsafe { _mm512_storeu_si512(out.add(r * out_stride) as *mut _, row) };
        }
    }

    /// A 16 x 16 block of pairs from an operand whose k runs along its rows: element (kk, j)
    /// at `x + kk + j * col_stride`. Writes pairs q = 0..`pairs` (from `first`) of columns
    /// j = 0..16 (live columns: `cols`; the rest zero) at `out + q * out_stride`, 16 lanes
    /// each.
    ///
    /// # Safety
    /// The elements named (columns `..cols`, k `..k`) must be readable, `out` writable for
    /// `pairs` rows; AVX-512F.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f")]
    pub unsafe fn rows_to_columns(
        x: *const f32,
        col_stride: usize,
        k: usize,
        first: usize,
        cols: usize,
        pairs: usize,
        out: *mut u32,
        out_stride: usize,
    ) {
        let mut v = [_mm512_setzero_si512(); 16];
        let live = k.saturating_sub(2 * first).min(32);
        for (j, lanes) in v.iter_mut().enumerate().take(cols) {
            // SAFETY: column j's `live` elements from k = 2 * first are readable.
            *lanes = unsafe { neighbours(x.add(j * col_stride + 2 * first), live) };
        }
        for (q, row) in transpose(v).into_iter().enumerate().take(pairs) {
            // SAFETY: `pairs` rows of 16 lanes writable (the caller's contract).
            unsafe { _mm512_storeu_si512(out.add(q * out_stride) as *mut _, row) };
        }
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
        if !super::super::gemm_bf16::available() {
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
        for &bits in &special {
            let x = f32::from_bits(bits);
            if x.is_nan() {
                let lanes = pair(x, x);
                assert!(
                    f32::from_bits(lanes << 16).is_nan()
                        && f32::from_bits(lanes & 0xFFFF_0000).is_nan(),
                    "pair of the NaN {bits:#x} is {lanes:#x}: a half is not a NaN"
                );
            }
        }
        let xs: Vec<f32> = (0..77)
            .map(|i| f32::from_bits(special[i % special.len()] ^ ((i as u32 / 12) << 24)))
            .collect();
        let mut rounded = xs.clone();
        round_in_place(&mut rounded);
        for (r, x) in rounded.iter().zip(&xs) {
            assert_eq!(
                r.to_bits(),
                round_bf16(*x).to_bits(),
                "round_in_place of {x:e}"
            );
        }
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

    /// The 16 x 16 blocks give `pair`'s lanes in transposed places: at k's end (odd, and short
    /// of a whole block), with rows and columns short of 16 (zeros there), strides as the
    /// GEMM's packings use them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn blocks_turn_pairs_as_pair_places_them() {
        if !super::super::gemm_bf16::available() {
            eprintln!("skipping: this cpu has no AVX512_BF16");
            return;
        }
        let value = |i: usize| ((i * 7919 % 1000) as f32 - 500.0) / 250.0 * 1.000_123_7;
        for (k, first, live) in [(45, 16, 9), (64, 0, 16), (33, 16, 1), (31, 0, 16)] {
            // k down the columns: element (r, kk) at r + kk * 20.
            let col_stride = 20;
            let x: Vec<f32> = (0..k * col_stride).map(value).collect();
            let mut out = vec![7u32; 16 * 24];
            // SAFETY: rows < live <= 16 <= 20 and k columns are inside `x`; 16 rows of 24.
            unsafe {
                columns_to_rows(x.as_ptr(), col_stride, k, first, live, out.as_mut_ptr(), 24)
            };
            for r in 0..16 {
                for q in 0..16 {
                    let kk = 2 * (first + q);
                    let at = |kk: usize| {
                        if kk < k && r < live {
                            x[r + kk * col_stride]
                        } else {
                            0.0
                        }
                    };
                    let want = if kk < k { pair(at(kk), at(kk + 1)) } else { 0 };
                    assert_eq!(
                        out[r * 24 + q],
                        want,
                        "columns_to_rows k {k} row {r} pair {q}"
                    );
                }
                assert_eq!(
                    out[r * 24 + 16],
                    7,
                    "columns_to_rows wrote past its 16 lanes"
                );
            }
            // k along the rows: element (kk, j) at kk + j * 50.
            let col_stride = 50;
            let x: Vec<f32> = (0..16 * col_stride).map(value).collect();
            let pairs = k.div_ceil(2).saturating_sub(first).min(16);
            let mut out = vec![7u32; 17 * 32];
            // SAFETY: columns < live, k <= 50 elements each, inside `x`; `pairs` rows of 32.
            unsafe {
                rows_to_columns(
                    x.as_ptr(),
                    col_stride,
                    k,
                    first,
                    live,
                    pairs,
                    out.as_mut_ptr(),
                    32,
                )
            };
            for q in 0..pairs {
                for j in 0..16 {
                    let kk = 2 * (first + q);
                    let at = |kk: usize| {
                        if kk < k && j < live {
                            x[kk + j * col_stride]
                        } else {
                            0.0
                        }
                    };
                    assert_eq!(
                        out[q * 32 + j],
                        pair(at(kk), at(kk + 1)),
                        "rows_to_columns k {k} pair {q} column {j}"
                    );
                }
                assert_eq!(
                    out[q * 32 + 16],
                    7,
                    "rows_to_columns wrote past its 16 lanes"
                );
            }
            assert_eq!(out[pairs * 32], 7, "rows_to_columns wrote past its pairs");
        }
    }
}
