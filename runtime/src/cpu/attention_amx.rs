//! bf16 attention with its products on AMX tiles, issued here block by block
//! (`gemm_amx::Tiles`) instead of as calls of the bf16 GEMM: `attention.rs`'s forward and
//! backward for `Products::Bf16` on `Bf16Tiles::Amx` where the head dim is a multiple of 32.
//!
//! Why: through `gemm_bf16`, every product of every query block packed both its operands and
//! configured the tiles again, so a kv head's keys and values were packed once per block and
//! product; packing was about a third of bf16 attention's samples (`attention_cost bf16
//! strided` under `perf`). Here a task packs its kv head's operands once (kᵀ and v forward;
//! kᵀ, vᵀ and k backward), configures the tiles once, and takes 32 query rows a block (one
//! tile block: the causal blocks compute less of the masked half than 96 or 64 rows did); a
//! block's output (forward) or dq (backward) is rounded and written after the next block's
//! first product (`Staged`). At `peer`'s shape the forward takes 0.86x and the backward 0.76x
//! the time it took through `gemm_bf16` (docs/benchmarks.md).
//!
//! Contract: `attention.rs`'s bf16 numerics, with its helpers for everything but the
//! products. Every product reads bf16 operands (the packing rounds, as the GEMM's does) and
//! sums in f32 over k in 32-element chunks, in order, on the tiles; the softmax, `ds` and the
//! kv gradients' sums are f32, and the results are rounded to bf16 as they are written. What
//! differs from the same products through `gemm_bf16` is the order of two sums: dk and dv add
//! each block's product inside the tiles (the accumulator tiles start from the running sum),
//! and dk is scaled once at the end instead of per block. The backward's scores are the
//! forward's products on the same packed operands, so probabilities rebuilt from the
//! forward's statistics are the forward's, bit for bit (`attention_stats`' contract). Results
//! depend neither on the thread count nor the schedule: one task per (kv head, batch), as in
//! `attention.rs`.
//!
//! Edges: keys past the sequence are zero columns of kᵀ (and zero rows of v and k), so a
//! stored tile block never holds a stale value where the softmax or its gradient read it;
//! query rows past the last block's are computed from stale rows and never read.

use super::attention::{softmax_grad, softmax_rows, with_scratch, Dims, Grads, Heads, Qkv};
use super::attention::{RowStats, Stats};
use super::bf16_pack::{self, pair, side_by_side, Src};
use super::gemm::Layout;
use super::gemm_amx::{self, padded_pairs, ABlock, Tiles, BLOCK_COLS, BLOCK_ROWS, TILE_PAIRS};
use super::pool::{Pool, TaskPtr};

/// Whether attention of these dims runs here (where `Products` are bf16 on AMX): the values'
/// and gradients' products are 32 columns of C a block, so the head dim must be whole blocks.
pub fn applies(d: &Dims) -> bool {
    d.head_dim > 0 && d.head_dim.is_multiple_of(BLOCK_COLS)
}

/// Lanes (u32 or f32) of B packed into panels: `padded_pairs(k)` pair rows of 32 columns each.
fn panels_len(k: usize, n: usize) -> usize {
    n.div_ceil(BLOCK_COLS) * padded_pairs(k) * BLOCK_COLS
}

/// Lanes of A packed by `gemm_amx::pack_a`: whole 32-row blocks of `padded_pairs(k)` pairs.
fn a_len(m: usize, k: usize) -> usize {
    m.div_ceil(BLOCK_ROWS) * BLOCK_ROWS * padded_pairs(k)
}

/// B (`k x n` under `lb`, in f32 slots) into the tiles' panels as `Tiles::block` reads them:
/// panel j holds columns `32j..32j + 32`, `padded_pairs(k)` rows of 32 lanes, each lane a
/// pair of k's elements rounded to bf16. Pairs past k's and columns past n are zero.
///
/// # Safety
/// `b` addresses every element of `k x n` under `lb`; the cpu has AVX-512F (AMX implies it).
unsafe fn pack_b(b: *const f32, lb: Layout, (k, n): (usize, usize), out: &mut [u32]) {
    let pairs = k.div_ceil(2);
    let panel_len = padded_pairs(k) * BLOCK_COLS;
    let out = &mut out[..panels_len(k, n)];
    for (panel, dst) in out.chunks_exact_mut(panel_len).enumerate() {
        let (from, cols) = (panel * BLOCK_COLS, (n - panel * BLOCK_COLS).min(BLOCK_COLS));
        // Zeros where the packing below writes nothing: a partial panel's lanes past n, every
        // panel's pair rows past k's.
        if cols < BLOCK_COLS {
            dst.fill(0);
        } else {
            dst[pairs * BLOCK_COLS..].fill(0);
        }
        if lb.row_stride == 1 && lb.col_stride != 1 {
            // kᵀ, vᵀ: each column's k elements are neighbours.
            // SAFETY: columns from..from + cols hold k elements; the panel holds its pair rows.
            unsafe {
                bf16_pack::column_panel(
                    b.add(from * lb.col_stride),
                    lb.col_stride,
                    (k, cols),
                    dst.as_mut_ptr(),
                    BLOCK_COLS,
                )
            };
        } else if lb.col_stride == 1 {
            for p in 0..pairs {
                // SAFETY: rows 2p and 2p + 1 (when < k) hold columns from..from + cols.
                let row = |kk: usize| unsafe {
                    std::slice::from_raw_parts(b.add(kk * lb.row_stride + from), cols)
                };
                let second = (2 * p + 1 < k).then(|| row(2 * p + 1));
                side_by_side(row(2 * p), second, &mut dst[p * BLOCK_COLS..][..cols]);
            }
        } else {
            for p in 0..pairs {
                for (j, lane) in dst[p * BLOCK_COLS..][..cols].iter_mut().enumerate() {
                    // SAFETY: (kk, from + j) is inside B for kk < k.
                    let at = |kk: usize| {
                        (kk < k).then(|| unsafe {
                            *b.add(kk * lb.row_stride + (from + j) * lb.col_stride)
                        })
                    };
                    *lane = pair(at(2 * p).unwrap_or(0.0), at(2 * p + 1).unwrap_or(0.0));
                }
            }
        }
    }
}

/// `A (m x k, packed by pack_a, m whole blocks) @ B -> C` (`m x n`, row stride `ldc`), every
/// 32 x 32 block of C stored whole; added to C where `add`. B is `(panels, packed_k)`: packed
/// by `pack_b` for `packed_k >= k` rows, of which the first k are read (the keys a causal
/// block sees of a head's values).
///
/// # Safety
/// The tiles are configured; `c` holds `m` rows (rounded up to 32) of `n` (rounded up to 32)
/// columns at stride `ldc`; `a` and `b` as packed for these sizes.
#[allow(clippy::too_many_arguments)]
unsafe fn product(
    tiles: &Tiles,
    a: &[u32],
    (b, packed_k): (&[u32], usize),
    (m, n, k): (usize, usize, usize),
    c: *mut f32,
    ldc: usize,
    add: bool,
) {
    let chunks = padded_pairs(k) / TILE_PAIRS;
    let panel_len = padded_pairs(packed_k) * BLOCK_COLS;
    assert!(
        padded_pairs(k) <= padded_pairs(packed_k)
            && a.len() >= a_len(m, k)
            && b.len() >= panels_len(packed_k, n)
    );
    for block in 0..m.div_ceil(BLOCK_ROWS) {
        let a_block = ABlock::packed(a[block * BLOCK_ROWS * padded_pairs(k)..].as_ptr(), chunks);
        for panel in 0..n.div_ceil(BLOCK_COLS) {
            let b_panel = b[panel * panel_len..].as_ptr();
            let at = c.wrapping_add(block * BLOCK_ROWS * ldc + panel * BLOCK_COLS);
            // SAFETY: the caller's contract.
            unsafe {
                if add {
                    tiles.block_add(a_block, b_panel, chunks, at, ldc)
                } else {
                    tiles.block(a_block, b_panel, chunks, at, ldc)
                }
            };
        }
    }
}

/// Packs A (`m x k` under `la`, from `a`) for `product`.
///
/// # Safety
/// As `gemm_amx::pack_a`'s.
unsafe fn pack_a(a: *const f32, la: Layout, (m, k): (usize, usize), out: &mut [u32]) {
    // SAFETY: the caller's contract.
    unsafe { gemm_amx::pack_a(Src::F32(a), la, m, k, &mut out[..a_len(m, k)]) }
}

fn row_major(cols: usize) -> Layout {
    Layout {
        batch_stride: 0,
        row_stride: cols,
        col_stride: 1,
    }
}

/// `m x n` row-major, read transposed.
fn transposed(n: usize) -> Layout {
    Layout {
        batch_stride: 0,
        row_stride: 1,
        col_stride: n,
    }
}

/// Head `(b, h)` of `x` from row `r`, and its layout.
fn head_at(
    arena: TaskPtr<f32>,
    x: &Heads,
    (b, h): (usize, usize),
    r: usize,
) -> (*const f32, Layout) {
    let layout = Layout {
        batch_stride: 0,
        row_stride: x.strides[2],
        col_stride: x.strides[3],
    };
    let at = x.offset + b * x.strides[0] + h * x.strides[1] + r * x.strides[2];
    (arena.0.wrapping_add(at) as *const f32, layout)
}

/// The same head read transposed (`D x S`).
fn t(layout: Layout) -> Layout {
    Layout {
        batch_stride: 0,
        row_stride: layout.col_stride,
        col_stride: layout.row_stride,
    }
}

/// A head's query blocks: (first row, rows, the keys they see rounded up to whole tile
/// columns).
fn query_blocks(d: &Dims) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
    (0..d.seq).step_by(BLOCK_ROWS).map(|r0| {
        let rows = (d.seq - r0).min(BLOCK_ROWS);
        let keys = if d.causal { r0 + rows } else { d.seq };
        (r0, rows, keys.div_ceil(BLOCK_COLS) * BLOCK_COLS)
    })
}

/// The unscaled scores of a query block, `q kᵀ` (`rows x n_pad`, row stride `n_pad`, into
/// `p`), from its rows of query head `(b, h)` packed into `qa` and the kv head's packed `kt`:
/// the same products, on the same packed operands, in both directions.
///
/// # Safety
/// The tiles are configured; the head lies in the arena; the buffers are sized as the
/// forward's and backward's `sizes` say.
#[allow(clippy::too_many_arguments)]
unsafe fn scores(
    tiles: &Tiles,
    arena: TaskPtr<f32>,
    q: &Heads,
    (b, h): (usize, usize),
    (r0, rows, n_pad): (usize, usize, usize),
    hd: usize,
    (qa, kt): (&mut [u32], &[u32]),
    p: *mut f32,
) {
    let (q_at, ql) = head_at(arena, q, (b, h), r0);
    // SAFETY: the caller's contract.
    unsafe {
        pack_a(q_at, ql, (rows, hd), qa);
        product(tiles, qa, (kt, hd), (rows, n_pad, hd), p, n_pad, false);
    }
}

/// A block of results (the forward's output, the backward's dq) waiting in one of two
/// scratch blocks to be scaled, rounded to bf16 and written to its rows of `to`: written only
/// after the next block's first product is issued, because reading a block right after the
/// tiles stored it waits for the stores (`gemm_bf16`'s staging says by how much).
struct Staged<'a> {
    blocks: [&'a mut [f32]; 2],
    next: usize,
    /// (block, head, first row, rows) of the block waiting, if one is.
    pending: Option<(usize, (usize, usize), usize, usize)>,
}

impl<'a> Staged<'a> {
    /// The scratch block the next results go to.
    fn block(&mut self) -> *mut f32 {
        self.blocks[self.next].as_mut_ptr()
    }

    /// The results just stored into `block()`: rows `r0..r0 + rows` of `head`.
    fn stored(&mut self, head: (usize, usize), r0: usize, rows: usize) {
        debug_assert!(self.pending.is_none());
        self.pending = Some((self.next, head, r0, rows));
        self.next ^= 1;
    }

    /// Writes the waiting block, if any: `x * scale`, rounded to bf16, into its rows of `to`.
    ///
    /// # Safety
    /// `to` lies in the arena, with contiguous rows (`strides[3] == 1`), and its rows of the
    /// waiting block's head are this task's alone.
    unsafe fn flush(&mut self, arena: TaskPtr<f32>, to: &Heads, hd: usize, scale: f32) {
        if let Some((block, (b, h), r0, rows)) = self.pending.take() {
            let x = &mut self.blocks[block][..rows * hd];
            if scale != 1.0 {
                x.iter_mut().for_each(|x| *x *= scale);
            }
            let (dst, layout) = head_at(arena, to, (b, h), r0);
            // SAFETY: the caller's contract; the block holds `rows` rows of `hd`.
            unsafe {
                bf16_pack::copy_rows(
                    x.as_ptr(),
                    hd,
                    dst as *mut f32,
                    layout.row_stride,
                    (rows, hd),
                    true,
                )
            };
        }
    }
}

/// A task's scratch cut into buffers, each on a cache line (the tiles load and store whole
/// lines), f32 or packed u32 lanes.
struct Cuts<'a>(&'a mut [f32]);

/// Floats per cache line.
const LINE: usize = 16;

impl<'a> Cuts<'a> {
    fn f32s(&mut self, len: usize) -> &'a mut [f32] {
        let rest = std::mem::take(&mut self.0);
        let (head, rest) = rest.split_at_mut(len.div_ceil(LINE) * LINE);
        self.0 = rest;
        &mut head[..len]
    }

    fn u32s(&mut self, len: usize) -> &'a mut [u32] {
        let lanes = self.f32s(len);
        // SAFETY: the same memory, an exclusive borrow of it; every bit pattern is a u32.
        unsafe { std::slice::from_raw_parts_mut(lanes.as_mut_ptr().cast::<u32>(), lanes.len()) }
    }
}

/// Floats `Cuts` needs for buffers of these lengths.
fn lines(lens: &[usize]) -> usize {
    lens.iter().map(|l| l.div_ceil(LINE) * LINE).sum()
}

/// `attention::forward` on the tiles (this module's contract).
///
/// # Safety
/// As `attention::forward`'s; `gemm_amx::available()` and `applies(&d)`.
pub unsafe fn forward(base: *mut f32, d: Dims, qkv: Qkv, out: Heads, stats: Option<Stats>) {
    let Qkv { q, k, v } = qkv;
    let arena = TaskPtr(base);
    let group = d.heads / d.kv_heads;
    let (s, hd) = (d.seq, d.head_dim);
    let s_pad = s.div_ceil(BLOCK_ROWS) * BLOCK_ROWS;
    let sizes = [
        panels_len(hd, s),        // kᵀ's panels
        panels_len(s, hd),        // v's panels
        a_len(BLOCK_ROWS, hd),    // a block of q
        BLOCK_ROWS * s_pad,       // scores, then probabilities
        a_len(BLOCK_ROWS, s_pad), // probabilities packed
        BLOCK_ROWS * hd,          // a block of the output
        BLOCK_ROWS * hd,          // and the one before it, waiting
    ];
    Pool::current().run(d.batch * d.kv_heads, &|task| {
        // Consecutive tasks are different batches (`attention::forward` says why).
        let (b, g) = (task % d.batch, task / d.batch);
        with_scratch(lines(&sizes), |scratch| {
            let mut cut = Cuts(scratch);
            let (kt, vp, qa) = (cut.u32s(sizes[0]), cut.u32s(sizes[1]), cut.u32s(sizes[2]));
            let (p, pa) = (cut.f32s(sizes[3]), cut.u32s(sizes[4]));
            let mut o = Staged {
                blocks: [cut.f32s(sizes[5]), cut.f32s(sizes[6])],
                next: 0,
                pending: None,
            };
            // SAFETY (every block below): the caller's contract: the heads lie in the arena,
            // each task writes only its own heads of `out` and `stats`; the buffers are sized
            // for these products (`sizes`); AMX is available.
            unsafe {
                let (kp, kl) = head_at(arena, &k, (b, g), 0);
                pack_b(kp, t(kl), (hd, s), kt);
                let (vp_at, vl) = head_at(arena, &v, (b, g), 0);
                pack_b(vp_at, vl, (s, hd), vp);
            }
            // SAFETY: AMX is available (the caller's contract).
            let tiles = unsafe { Tiles::configure() };
            for h in g * group..(g + 1) * group {
                for (r0, rows, n_pad) in query_blocks(&d) {
                    let mut row_stats = [0f32; 2 * BLOCK_ROWS];
                    // SAFETY: as above.
                    unsafe {
                        let block = (r0, rows, n_pad);
                        scores(
                            &tiles,
                            arena,
                            &q,
                            (b, h),
                            block,
                            hd,
                            (qa, kt),
                            p.as_mut_ptr(),
                        );
                        // The previous block's output, now that its stores have landed.
                        o.flush(arena, &out, hd, 1.0);
                        let p = &mut p[..BLOCK_ROWS * n_pad];
                        softmax_rows(
                            &mut p[..rows * n_pad],
                            n_pad,
                            r0,
                            &d,
                            RowStats::Compute(&mut row_stats),
                        );
                        if let Some(stats) = stats {
                            std::ptr::copy_nonoverlapping(
                                row_stats.as_ptr(),
                                arena.0.add(stats.row(&d, (b, h), r0)),
                                2 * rows,
                            );
                        }
                        pack_a(p.as_ptr(), row_major(n_pad), (rows, n_pad), pa);
                        product(&tiles, pa, (vp, s), (rows, hd, n_pad), o.block(), hd, false);
                        o.stored((b, h), r0, rows);
                    }
                }
            }
            drop(tiles);
            // SAFETY: as above.
            unsafe { o.flush(arena, &out, hd, 1.0) };
        });
    });
}

/// `attention::backward` on the tiles (this module's contract).
///
/// # Safety
/// As `attention::backward`'s; `gemm_amx::available()` and `applies(&d)`.
pub unsafe fn backward(
    base: *mut f32,
    d: Dims,
    qkv: Qkv,
    dout: Heads,
    stats: Option<Stats>,
    grads: Grads,
) {
    let Qkv { q, k, v } = qkv;
    let arena = TaskPtr(base);
    let group = d.heads / d.kv_heads;
    let (s, hd) = (d.seq, d.head_dim);
    let s_pad = s.div_ceil(BLOCK_ROWS) * BLOCK_ROWS;
    let sizes = [
        panels_len(hd, s),          // 0: kᵀ's panels (scores)
        panels_len(hd, s),          // 1: vᵀ's panels (dp = dout vᵀ)
        panels_len(s, hd),          // 2: k's panels (dq = ds k)
        s_pad * hd,                 // 3: dk, summed over heads and blocks
        s_pad * hd,                 // 4: dv, the same
        BLOCK_ROWS * s_pad,         // 5: probabilities
        BLOCK_ROWS * s_pad,         // 6: dp, then ds
        a_len(BLOCK_ROWS, hd),      // 7: a block of q as A
        a_len(BLOCK_ROWS, hd),      // 8: a block of dout as A
        panels_len(BLOCK_ROWS, hd), // 9: a block of dout as B
        panels_len(BLOCK_ROWS, hd), // 10: a block of q as B
        a_len(s_pad, BLOCK_ROWS),   // 11: pᵀ as A
        a_len(BLOCK_ROWS, s_pad),   // 12: ds as A
        a_len(s_pad, BLOCK_ROWS),   // 13: dsᵀ as A
        BLOCK_ROWS * hd,            // 14: a block of dq
        BLOCK_ROWS * hd,            // 15: and the one before it, waiting
    ];
    Pool::current().run(d.batch * d.kv_heads, &|task| {
        // Consecutive tasks are different batches (as in `forward`).
        let (b, g) = (task % d.batch, task / d.batch);
        with_scratch(lines(&sizes), |scratch| {
            let mut cut = Cuts(scratch);
            let (kt, vt, kp) = (cut.u32s(sizes[0]), cut.u32s(sizes[1]), cut.u32s(sizes[2]));
            let (dk, dv) = (cut.f32s(sizes[3]), cut.f32s(sizes[4]));
            let (p, ds) = (cut.f32s(sizes[5]), cut.f32s(sizes[6]));
            let (qa, doa) = (cut.u32s(sizes[7]), cut.u32s(sizes[8]));
            let (dob, qb) = (cut.u32s(sizes[9]), cut.u32s(sizes[10]));
            let (pta, dsa, dsta) = (
                cut.u32s(sizes[11]),
                cut.u32s(sizes[12]),
                cut.u32s(sizes[13]),
            );
            let mut dq = Staged {
                blocks: [cut.f32s(sizes[14]), cut.f32s(sizes[15])],
                next: 0,
                pending: None,
            };
            dk.fill(0.0);
            dv.fill(0.0);
            // SAFETY (every block below): as in `forward`; the three outputs are this task's
            // heads alone.
            unsafe {
                let (k_at, kl) = head_at(arena, &k, (b, g), 0);
                pack_b(k_at, t(kl), (hd, s), kt);
                pack_b(k_at, kl, (s, hd), kp);
                let (v_at, vl) = head_at(arena, &v, (b, g), 0);
                pack_b(v_at, t(vl), (hd, s), vt);
            }
            // SAFETY: AMX is available (the caller's contract).
            let tiles = unsafe { Tiles::configure() };
            for h in g * group..(g + 1) * group {
                for (r0, rows, n_pad) in query_blocks(&d) {
                    let mut row_stats = [0f32; 2 * BLOCK_ROWS];
                    // SAFETY: as above.
                    unsafe {
                        let block_stats = RowStats::of_block(
                            stats,
                            arena,
                            &d,
                            (b, h),
                            (r0, rows),
                            &mut row_stats,
                        );
                        let (q_at, ql) = head_at(arena, &q, (b, h), r0);
                        let (do_at, dol) = head_at(arena, &dout, (b, h), r0);
                        // p, as the forward made it.
                        let block = (r0, rows, n_pad);
                        scores(
                            &tiles,
                            arena,
                            &q,
                            (b, h),
                            block,
                            hd,
                            (qa, kt),
                            p.as_mut_ptr(),
                        );
                        // The previous block's dq, now that its stores have landed.
                        dq.flush(arena, &grads.dq, hd, d.scale);
                        let p = &mut p[..rows * n_pad];
                        softmax_rows(p, n_pad, r0, &d, block_stats);
                        // dp = dout vᵀ, then ds = p (dp - Σ_j p dp) in place.
                        pack_a(do_at, dol, (rows, hd), doa);
                        product(
                            &tiles,
                            doa,
                            (vt, hd),
                            (rows, n_pad, hd),
                            ds.as_mut_ptr(),
                            n_pad,
                            false,
                        );
                        let ds = &mut ds[..rows * n_pad];
                        softmax_grad(p, ds, n_pad);
                        // dv[..n] += pᵀ dout[r0..r1]
                        pack_a(p.as_ptr(), transposed(n_pad), (n_pad, rows), pta);
                        pack_b(do_at, dol, (rows, hd), dob);
                        product(
                            &tiles,
                            pta,
                            (dob, rows),
                            (n_pad, hd, rows),
                            dv.as_mut_ptr(),
                            hd,
                            true,
                        );
                        // dq[r0..r1] = (ds k[..n]) * scale
                        pack_a(ds.as_ptr(), row_major(n_pad), (rows, n_pad), dsa);
                        product(
                            &tiles,
                            dsa,
                            (kp, s),
                            (rows, hd, n_pad),
                            dq.block(),
                            hd,
                            false,
                        );
                        dq.stored((b, h), r0, rows);
                        // dk[..n] += dsᵀ q[r0..r1] (scaled once, at the end)
                        pack_a(ds.as_ptr(), transposed(n_pad), (n_pad, rows), dsta);
                        pack_b(q_at, ql, (rows, hd), qb);
                        product(
                            &tiles,
                            dsta,
                            (qb, rows),
                            (n_pad, hd, rows),
                            dk.as_mut_ptr(),
                            hd,
                            true,
                        );
                    }
                }
            }
            drop(tiles);
            // SAFETY: as above.
            unsafe { dq.flush(arena, &grads.dq, hd, d.scale) };
            let (dk, dv) = (&mut dk[..s * hd], &mut dv[..s * hd]);
            dk.iter_mut().for_each(|x| *x *= d.scale);
            bf16_pack::round_in_place(dk);
            bf16_pack::round_in_place(dv);
            // SAFETY: this task's kv head of the outputs.
            unsafe {
                grads.dk.write_rows(arena, (b, g), 0, dk, hd);
                grads.dv.write_rows(arena, (b, g), 0, dv, hd);
            }
        });
    });
}
