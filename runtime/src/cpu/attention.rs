//! Causal (grouped-query) attention forward and backward on the cpu backend, one head at a time
//! with the `[S, S]` scores in a per-task scratch buffer instead of the arena.
//!
//! Why: decomposed, attention materializes `[B, H, S, S]` scores, probabilities and their
//! gradients, which dominated the arena (`debug`'s 2048-token rows needed 18 GiB) and made a
//! dozen memory-bound passes over them per layer. Here every product is one of our GEMMs
//! (`gemm.rs`, or `gemm_bf16.rs` for bf16 attention; single-threaded inside a task) on the arena
//! and the scratch, and the softmax runs on a row that is in cache.
//!
//! Work split: one task per (kv head, batch), which owns the query heads that share it. So the
//! kv gradients of a group are summed in a fixed order (query heads ascending) by one thread,
//! and the results never depend on the thread count.
//!
//! Numerics (f32, the decomposition `softmax(q kᵀ · scale + mask) v` op for op, except that
//! row sums and maxima take eight lanes combined pairwise and `exp` is our own, about 1 ulp):
//! `s = (q·k) * scale`, masked entries are -inf, `p = exp(s - max) / sum`; backward
//! `dv = pᵀ dout`, `dp = dout vᵀ`, `ds = p (dp - Σ_j p dp)`, `dq = (ds k) * scale`,
//! `dk = (dsᵀ q) * scale`.
//!
//! bf16 attention (`Products::Bf16`, bf16-mixed's, `Step::Attention`'s contract; torch's cpu
//! flash attention computes the same way): every product reads bf16 operands and sums in f32,
//! so q, k, v and dout (f32 where fusion folded their casts), `p` and `ds` are rounded to bf16
//! where a product reads them, while the softmax, `ds` itself (from the f32 `p`) and the kv
//! gradients' sums over heads and blocks stay f32; the outputs are rounded to bf16 as they are
//! written. The products run on the bf16 GEMM's tiles (AMX, `vdpbf16ps`) where the cpu has
//! them, whose packing rounds; elsewhere on the f32 GEMM over rounded copies of the heads and
//! `p` and `ds` rounded in place (the same products, summed in another order).

use super::bf16_pack;
use super::gemm::{self, Layout};
use super::gemm_bf16::{gemm_bf16, Bf16Tiles};
use super::lines::LineBuffer;
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
}

/// The arena, shared by the tasks (each writes its own heads only).
pub(super) type Arena = TaskPtr<f32>;

fn row_major(cols: usize) -> Layout {
    Layout {
        batch_stride: 0,
        row_stride: cols,
        col_stride: 1,
    }
}

/// How the products of one attention call run (the module's numerics).
#[derive(Clone, Copy, Debug)]
pub enum Products {
    /// f32 GEMMs.
    F32(gemm::GemmKernel),
    /// bf16 operands, f32 sums: on `tiles` where given (`gemm_bf16::available()` must hold),
    /// else on `kernel`, the f32 GEMM, over operands already rounded.
    Bf16 {
        tiles: Option<Bf16Tiles>,
        kernel: gemm::GemmKernel,
    },
}

impl Products {
    fn bf16(self) -> bool {
        matches!(self, Products::Bf16 { .. })
    }

    /// Whether the products read rounded copies: bf16 attention on the f32 GEMM (the bf16
    /// tiles round as they pack, and f32 attention reads f32).
    fn copies_operands(self) -> bool {
        matches!(self, Products::Bf16 { tiles: None, .. })
    }

    /// `x` (probabilities or score gradients a product reads next) as that product reads it:
    /// rounded to bf16 where the f32 GEMM runs bf16 attention's products.
    fn round_operand(self, x: &mut [f32]) {
        if self.copies_operands() {
            bf16_pack::round_in_place(x);
        }
    }

    /// A result as the step stores it: rounded to bf16 in bf16 attention.
    fn round_result(self, x: &mut [f32]) {
        if self.bf16() {
            bf16_pack::round_in_place(x);
        }
    }
}

/// `c = a @ b` on one thread (`m x k` times `k x n` into contiguous `m x n`).
///
/// # Safety
/// The operands must be valid for their layouts; `c` must not overlap them.
#[allow(clippy::too_many_arguments)]
unsafe fn mm(
    products: Products,
    m: usize,
    n: usize,
    k: usize,
    a: *const f32,
    la: Layout,
    b: *const f32,
    lb: Layout,
    c: *mut f32,
) {
    match products {
        // SAFETY: forwarded; `gemm_bf16::available()` holds where `tiles` is given (the
        // variant's contract).
        Products::Bf16 {
            tiles: Some(tiles), ..
        } => unsafe { gemm_bf16(tiles, 1, m, n, k, a, la, b, lb, c, 1, false) },
        Products::F32(kernel) | Products::Bf16 { kernel, .. } => {
            // SAFETY: forwarded.
            unsafe { gemm::sgemm_with(kernel, 1, m, n, k, a, la, b, lb, c, 1) }
        }
    }
}

/// One row of probabilities: `live` scaled, masked scores in, `p` out (zeros past `live`).
/// Returns the row's statistics `(max, sum)`.
#[inline(always)]
fn softmax_row<const AVX2: bool>(row: &mut [f32], live: usize, scale: f32) -> (f32, f32) {
    let (head, rest) = row.split_at_mut(live);
    head.iter_mut().for_each(|x| *x *= scale);
    let max = row_max::<AVX2>(head);
    head.iter_mut().for_each(|x| *x = exp(*x - max));
    let sum = row_sum::<AVX2>(head);
    head.iter_mut().for_each(|x| *x /= sum);
    rest.fill(0.0);
    (max, sum)
}

/// `softmax_row` from the row's given statistics: the same operations on each element in one
/// pass, so the same bits where they are the ones `softmax_row` returned.
#[inline(always)]
fn softmax_row_from(row: &mut [f32], live: usize, scale: f32, (max, sum): (f32, f32)) {
    let (head, rest) = row.split_at_mut(live);
    head.iter_mut()
        .for_each(|x| *x = exp(*x * scale - max) / sum);
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
pub(super) fn softmax_grad(p: &[f32], ds: &mut [f32], n: usize) {
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

/// A block's row statistics, two floats (max, sum) a row: computed by its softmax and stored
/// here, or given (the forward's, read by the backward) and used instead of a softmax.
pub(super) enum RowStats<'a> {
    Compute(&'a mut [f32]),
    Given(&'a [f32]),
}

impl<'a> RowStats<'a> {
    /// The backward's statistics of rows `r0..r0 + rows` of head `(b, h)`: the forward's,
    /// from `stats`, where given; else computed into `scratch` by the block's softmax.
    ///
    /// # Safety
    /// Where given, `stats` lies in the arena and holds what the forward wrote there.
    pub(super) unsafe fn of_block(
        stats: Option<Stats>,
        arena: Arena,
        d: &Dims,
        (b, h): (usize, usize),
        (r0, rows): (usize, usize),
        scratch: &'a mut [f32],
    ) -> RowStats<'a> {
        match stats {
            // SAFETY: the caller's contract; the block's rows hold two floats each.
            Some(stats) => RowStats::Given(unsafe {
                std::slice::from_raw_parts(arena.0.add(stats.row(d, (b, h), r0)), 2 * rows)
            }),
            None => RowStats::Compute(scratch),
        }
    }
}

/// The rows of a block (`n` wide, its first row is row `r0` of the head) into probabilities:
/// each row by `softmax`, its statistics stored, or from the given ones by `from`, as `stats`
/// says.
#[inline(always)]
fn block_rows(
    p: &mut [f32],
    (n, r0): (usize, usize),
    d: &Dims,
    stats: &mut RowStats,
    softmax: impl Fn(&mut [f32], usize, f32) -> (f32, f32),
    from: impl Fn(&mut [f32], usize, f32, (f32, f32)),
) {
    for (i, row) in p.chunks_exact_mut(n).enumerate() {
        let live = if d.causal { r0 + i + 1 } else { n.min(d.seq) };
        match stats {
            RowStats::Compute(out) => {
                let (max, sum) = softmax(row, live, d.scale);
                out[2 * i] = max;
                out[2 * i + 1] = sum;
            }
            RowStats::Given(given) => from(row, live, d.scale, (given[2 * i], given[2 * i + 1])),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn softmax_rows_avx2(p: &mut [f32], n: usize, r0: usize, d: &Dims, stats: &mut RowStats) {
    block_rows(p, (n, r0), d, stats, softmax_row::<true>, softmax_row_from);
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn softmax_rows_avx512(p: &mut [f32], n: usize, r0: usize, d: &Dims, stats: &mut RowStats) {
    use super::rows::x86::{softmax16, softmax16_from};
    // SAFETY (both closures): the feature is enabled here; `live <= n`.
    block_rows(
        p,
        (n, r0),
        d,
        stats,
        |r, l, s| unsafe { softmax16(r, l, s) },
        |r, l, s, st| unsafe { softmax16_from(r, l, s, st) },
    );
}

/// Softmax of each row of a block (`n` wide, its first row is row `r0` of the head; keys past
/// the sequence, where `n` is wider, are masked), scaled and masked in place, into
/// probabilities, with each row's statistics stored into or taken from `stats`. Where the cpu has them, AVX-512 (`softmax16`: a third less time than the AVX2
/// build in `peer`'s step, docs/benchmarks.md) or the AVX2 build of the same code run instead.
/// No FMA is formed by any of them (Rust never contracts; the AVX-512 code uses separate
/// multiplies and adds), so all give the same bits, and so do the softmax and its rebuilding
/// from the statistics it returned.
pub(super) fn softmax_rows(p: &mut [f32], n: usize, r0: usize, d: &Dims, mut stats: RowStats) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512f") {
        // SAFETY: the feature is present.
        unsafe { softmax_rows_avx512(p, n, r0, d, &mut stats) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") {
        // SAFETY: the feature is present.
        unsafe { softmax_rows_avx2(p, n, r0, d, &mut stats) };
        return;
    }
    block_rows(
        p,
        (n, r0),
        d,
        &mut stats,
        softmax_row::<false>,
        softmax_row_from,
    );
}

/// One head's `[S, D]` matrix (or its transpose) where the products read it.
#[derive(Clone, Copy)]
struct Mat {
    ptr: *const f32,
    layout: Layout,
}

impl Mat {
    /// The matrix from row `r` on.
    fn row(self, r: usize) -> *const f32 {
        self.ptr.wrapping_add(r * self.layout.row_stride)
    }

    /// The same matrix read transposed.
    fn t(self) -> Mat {
        Mat {
            ptr: self.ptr,
            layout: Layout {
                batch_stride: 0,
                row_stride: self.layout.col_stride,
                col_stride: self.layout.row_stride,
            },
        }
    }
}

/// Head `(b, h)` of `x` as the products read it: in place, or, where bf16 attention runs on
/// the f32 GEMM (which reads what it is given), rounded to bf16 into `copy` (`S x D` row-major),
/// as the bf16 tiles' packing rounds it (an operand a fused cast left in f32; the identity on
/// bf16 values). (Copying strided heads into contiguous ones for every kind of product was
/// tried: no faster, `attention_cost ... strided`.)
///
/// # Safety
/// The head lies in the arena.
unsafe fn head(
    products: Products,
    arena: Arena,
    x: &Heads,
    (b, h): (usize, usize),
    d: &Dims,
    copy: &mut [f32],
) -> Mat {
    let (o, l) = x.at(b, h);
    let at = arena.0.wrapping_add(o) as *const f32;
    if !products.copies_operands() {
        return Mat { ptr: at, layout: l };
    }
    let hd = d.head_dim;
    let copy = &mut copy[..d.seq * hd];
    for (r, row) in copy.chunks_exact_mut(hd).enumerate() {
        for (c, y) in row.iter_mut().enumerate() {
            // SAFETY: (r, c) is inside the head (the caller's contract).
            *y = unsafe { *at.add(r * l.row_stride + c * l.col_stride) };
        }
    }
    bf16_pack::round_in_place(copy);
    Mat {
        ptr: copy.as_ptr(),
        layout: row_major(hd),
    }
}

/// The probabilities of rows `r0..r1` of query head `q` over keys `0..n` (`kt`, the head's
/// keys transposed) into `p` (`(r1 - r0) x n`, row-major), each row's statistics stored into
/// or taken from `stats`.
///
/// # Safety
/// `q` and `kt` address the heads they name.
unsafe fn probabilities(
    d: &Dims,
    products: Products,
    q: Mat,
    kt: Mat,
    (r0, r1, n): (usize, usize, usize),
    p: &mut [f32],
    stats: RowStats,
) {
    let p = &mut p[..(r1 - r0) * n];
    // SAFETY: the caller's contract; `p` is our own scratch.
    unsafe {
        mm(
            products,
            r1 - r0,
            n,
            d.head_dim,
            q.row(r0),
            q.layout,
            kt.ptr,
            kt.layout,
            p.as_mut_ptr(),
        );
    }
    softmax_rows(p, n, r0, d, stats);
}

/// Calls `f` with this thread's scratch, at least `len` floats, holding whatever the last task
/// left there: every caller overwrites what it reads, or zeroes it. Tasks used to allocate
/// their zeroed buffers on every call (64 per launch): `memset`, `calloc` and `free` were
/// about 3% of attention's samples under `perf`, and with this the forward runs about 5% and
/// the backward 1-2% faster (alternated in one process, `attention_cost`'s shape).
pub(super) fn with_scratch<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    thread_local! {
        // On a cache line: the products' tiles store `p` and the partial gradients into it.
        static SCRATCH: RefCell<LineBuffer> = const { RefCell::new(LineBuffer::new()) };
    }
    SCRATCH.with(|s| match s.try_borrow_mut() {
        Ok(mut s) => f(s.f32s(len)),
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
    pub(super) unsafe fn write_rows(
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

/// Where each query row's softmax statistics live: a contiguous `[B, H, S, 2]` value (max,
/// sum) at this element offset of the arena.
#[derive(Clone, Copy, Debug)]
pub struct Stats(pub usize);

impl Stats {
    /// Element offset of row `r`'s statistics in head `(b, h)`.
    pub(super) fn row(self, d: &Dims, (b, h): (usize, usize), r: usize) -> usize {
        self.0 + ((b * d.heads + h) * d.seq + r) * 2
    }
}

/// Whether bf16 products on AMX run as `attention_amx`'s tile blocks: where the head dim is
/// whole tile blocks (`attention_amx::applies`).
#[cfg(target_arch = "x86_64")]
fn on_tiles(products: Products, d: &Dims) -> bool {
    matches!(
        products,
        Products::Bf16 {
            tiles: Some(Bf16Tiles::Amx),
            ..
        }
    ) && super::attention_amx::applies(d)
}

/// `out[b, h] = attention(q, k, v)`. `out` is a `[B, H, S, D]` view with contiguous rows
/// (`strides[3] == 1`): contiguous, or the `[B, S, H, D]` value the next matmul reads. Each
/// query row's softmax max and sum go to `stats` where given.
///
/// # Safety
/// `base` is the arena; the views, `out` and `stats` lie inside it, `out` and `stats`
/// overlapping none of the operands nor each other.
pub unsafe fn forward(
    base: *mut f32,
    d: Dims,
    products: Products,
    qkv: Qkv,
    out: Heads,
    stats: Option<Stats>,
) {
    #[cfg(target_arch = "x86_64")]
    if on_tiles(products, &d) {
        // SAFETY: the caller's contract; `on_tiles` checked AMX and the head dim.
        unsafe { super::attention_amx::forward(base, d, qkv, out, stats) };
        return;
    }
    let Qkv { q, k, v } = qkv;
    let arena = TaskPtr(base);
    let group = d.heads / d.kv_heads;
    let (s, hd) = (d.seq, d.head_dim);
    // Rounded copies of k, v and one query head, where the products need them (`head`).
    let copy = if products.copies_operands() {
        s * hd
    } else {
        0
    };
    Pool::current().run(d.batch * d.kv_heads, &|task| {
        // Consecutive tasks, which the threads take at the same time, are different batches:
        // as neighbouring heads of one batch they wrote the interleaved rows of one `[B, S, H,
        // D]` output side by side, and sharing those lines cost the backward 20% and the
        // forward 10% (`attention_cost ... strided`).
        let (b, g) = (task % d.batch, task / d.batch);
        let rows = FORWARD_ROWS.min(s);
        with_scratch(rows * (s + hd) + 3 * copy, |scratch| {
            let (p, rest) = scratch.split_at_mut(rows * s);
            let (o, rest) = rest.split_at_mut(rows * hd);
            let (k_copy, rest) = rest.split_at_mut(copy);
            let (v_copy, q_copy) = rest.split_at_mut(copy);
            // SAFETY: the caller's contract: the heads lie in the arena.
            let (kh, vh) = unsafe {
                (
                    head(products, arena, &k, (b, g), &d, k_copy),
                    head(products, arena, &v, (b, g), &d, v_copy),
                )
            };
            for h in g * group..(g + 1) * group {
                // SAFETY: as above.
                let qh = unsafe { head(products, arena, &q, (b, h), &d, q_copy) };
                for (r0, r1, n) in blocks(&d, FORWARD_ROWS) {
                    let mut row_stats = [0f32; 2 * FORWARD_ROWS];
                    // SAFETY: the caller's contract; each task writes only its own heads of `out`
                    // and `stats`.
                    unsafe {
                        let block_stats = RowStats::Compute(&mut row_stats);
                        probabilities(&d, products, qh, kh.t(), (r0, r1, n), p, block_stats);
                        if let Some(stats) = stats {
                            std::ptr::copy_nonoverlapping(
                                row_stats.as_ptr(),
                                arena.0.add(stats.row(&d, (b, h), r0)),
                                2 * (r1 - r0),
                            );
                        }
                        products.round_operand(&mut p[..(r1 - r0) * n]);
                        mm(
                            products,
                            r1 - r0,
                            hd,
                            n,
                            p.as_ptr(),
                            row_major(n),
                            vh.ptr,
                            vh.layout,
                            o.as_mut_ptr(),
                        );
                        let o = &mut o[..(r1 - r0) * hd];
                        products.round_result(o);
                        out.write_rows(arena, (b, h), r0, o, hd);
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
/// block's probabilities again (from the forward's `stats` where given: one pass over each
/// score row instead of a softmax, the same bits), then `ds = p (dout vᵀ - Σ_j ...)`, `dv += pᵀ dout`,
/// `dq = ds k · scale`, `dk += dsᵀ q · scale`; kv gradients summed over heads, then blocks, in
/// ascending order. (`ds` comes before `dv` so that bf16 attention on the f32 GEMM can round
/// `p` in place after `ds` has read it in f32.)
///
/// # Safety
/// As for `forward`; the three outputs overlap nothing they are computed from nor each other;
/// `stats` lies in the arena and holds what `forward` wrote there for the same operands.
pub unsafe fn backward(
    base: *mut f32,
    d: Dims,
    products: Products,
    qkv: Qkv,
    dout: Heads,
    stats: Option<Stats>,
    grads: Grads,
) {
    #[cfg(target_arch = "x86_64")]
    if on_tiles(products, &d) {
        // SAFETY: the caller's contract; `on_tiles` checked AMX and the head dim.
        unsafe { super::attention_amx::backward(base, d, qkv, dout, stats, grads) };
        return;
    }
    let Qkv { q, k, v } = qkv;
    let arena = TaskPtr(base);
    let group = d.heads / d.kv_heads;
    let (s, hd) = (d.seq, d.head_dim);
    // Rounded copies of k, v, one query head and its output gradient, where the products need
    // them (`head`).
    let copy = if products.copies_operands() {
        s * hd
    } else {
        0
    };
    Pool::current().run(d.batch * d.kv_heads, &|task| {
        // Consecutive tasks are different batches (as in `forward`).
        let (b, g) = (task % d.batch, task / d.batch);
        let rows = BACKWARD_ROWS.min(s);
        // A few cache lines between the buffers, so that `p` and `ds`, read together row by
        // row, do not start at the same offset in a 4 KiB page, where they would share L1
        // sets (a precaution: not measured on its own, only with the scratch as a whole).
        let pad = 48;
        with_scratch(2 * rows * s + 3 * s * hd + 4 * pad + 4 * copy, |scratch| {
            let (p, rest) = scratch.split_at_mut(rows * s + pad);
            let (ds, rest) = rest.split_at_mut(rows * s + pad);
            let (part, rest) = rest.split_at_mut(s * hd + pad);
            let (dk, rest) = rest.split_at_mut(s * hd + pad);
            let (dv, rest) = rest.split_at_mut(s * hd);
            let (dk, dv) = (&mut dk[..s * hd], &mut dv[..s * hd]);
            let (k_copy, rest) = rest.split_at_mut(copy);
            let (v_copy, rest) = rest.split_at_mut(copy);
            let (q_copy, dout_copy) = rest.split_at_mut(copy);
            // The kv gradients accumulate over heads and blocks from zero.
            dk.fill(0.0);
            dv.fill(0.0);
            // SAFETY: the caller's contract: the heads lie in the arena.
            let (kh, vh) = unsafe {
                (
                    head(products, arena, &k, (b, g), &d, k_copy),
                    head(products, arena, &v, (b, g), &d, v_copy),
                )
            };
            for h in g * group..(g + 1) * group {
                // SAFETY: as above.
                let (qh, doh) = unsafe {
                    (
                        head(products, arena, &q, (b, h), &d, q_copy),
                        head(products, arena, &dout, (b, h), &d, dout_copy),
                    )
                };
                for (r0, r1, n) in blocks(&d, BACKWARD_ROWS) {
                    let rows = r1 - r0;
                    let mut row_stats = [0f32; 2 * BACKWARD_ROWS];
                    // SAFETY: the caller's contract; each task writes only its own heads.
                    unsafe {
                        let block_stats = RowStats::of_block(
                            stats,
                            arena,
                            &d,
                            (b, h),
                            (r0, rows),
                            &mut row_stats,
                        );
                        probabilities(&d, products, qh, kh.t(), (r0, r1, n), p, block_stats);
                        let p = &mut p[..rows * n];
                        let ds = &mut ds[..rows * n];
                        // dp = dout vᵀ, then ds = p (dp - Σ_j p dp) in place (from the f32 p).
                        let vt = vh.t();
                        mm(
                            products,
                            rows,
                            n,
                            hd,
                            doh.row(r0),
                            doh.layout,
                            vt.ptr,
                            vt.layout,
                            ds.as_mut_ptr(),
                        );
                        softmax_grad(p, ds, n);
                        // dv[..n] += pᵀ dout[r0..r1]
                        products.round_operand(p);
                        mm(
                            products,
                            n,
                            hd,
                            rows,
                            p.as_ptr(),
                            transposed(n),
                            doh.row(r0),
                            doh.layout,
                            part.as_mut_ptr(),
                        );
                        dv.iter_mut()
                            .zip(&part[..n * hd])
                            .for_each(|(a, x)| *a += x);
                        // dq[r0..r1] = (ds k[..n]) * scale
                        products.round_operand(ds);
                        mm(
                            products,
                            rows,
                            hd,
                            n,
                            ds.as_ptr(),
                            row_major(n),
                            kh.ptr,
                            kh.layout,
                            part.as_mut_ptr(),
                        );
                        let dq = &mut part[..rows * hd];
                        dq.iter_mut().for_each(|x| *x *= d.scale);
                        products.round_result(dq);
                        grads.dq.write_rows(arena, (b, h), r0, dq, hd);
                        // dk[..n] += (dsᵀ q[r0..r1]) * scale
                        mm(
                            products,
                            n,
                            hd,
                            rows,
                            ds.as_ptr(),
                            transposed(n),
                            qh.row(r0),
                            qh.layout,
                            part.as_mut_ptr(),
                        );
                        dk.iter_mut()
                            .zip(&part[..n * hd])
                            .for_each(|(a, x)| *a += x * d.scale);
                    }
                }
            }
            products.round_result(dk);
            products.round_result(dv);
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

    /// Causal softmax rows through `softmax_rows` (a vector build) against the portable loop,
    /// and rebuilt from the statistics each returned.
    #[cfg(target_arch = "x86_64")]
    fn check_softmax(
        what: &str,
        softmax_rows: impl Fn(&mut [f32], usize, usize, &Dims, &mut RowStats),
    ) {
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
            let mut slow_stats = Vec::new();
            // Three rows of a causal block starting at row len - 3: row i sees len - 2 + i keys.
            for (i, r) in slow.chunks_exact_mut(len).enumerate() {
                let (max, sum) = softmax_row::<false>(r, len - 2 + i, 0.3);
                slow_stats.extend([max, sum]);
            }
            let mut fast = a.repeat(3);
            let mut stats = [0.0; 6];
            softmax_rows(
                &mut fast,
                len,
                len - 3,
                &d,
                &mut RowStats::Compute(&mut stats),
            );
            assert_eq!(bits(&fast), bits(&slow), "{what} softmax, len {len}");
            assert_eq!(
                bits(&stats),
                bits(&slow_stats),
                "{what} statistics, len {len}"
            );
            let mut rebuilt = a.repeat(3);
            softmax_rows(&mut rebuilt, len, len - 3, &d, &mut RowStats::Given(&stats));
            assert_eq!(
                bits(&rebuilt),
                bits(&slow),
                "{what} from statistics, len {len}"
            );
        }
    }

    /// The portable softmax rebuilt from its own statistics gives its bits.
    #[test]
    fn probabilities_rebuilt_from_the_statistics_are_the_softmaxs() {
        for len in (1..40).chain([255, 256, 257]) {
            let a = row(len, 3);
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for live in [1, len.div_ceil(2), len] {
                let mut soft = a.clone();
                let stats = softmax_row::<false>(&mut soft, live, 0.3);
                let mut rebuilt = a.clone();
                softmax_row_from(&mut rebuilt, live, 0.3, stats);
                assert_eq!(bits(&rebuilt), bits(&soft), "len {len}, live {live}");
            }
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
        check_softmax("AVX2", |x, len, r0, d, stats| unsafe {
            softmax_rows_avx2(x, len, r0, d, stats)
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
        check_softmax("AVX-512", |x, len, r0, d, stats| unsafe {
            softmax_rows_avx512(x, len, r0, d, stats)
        });
    }
}
