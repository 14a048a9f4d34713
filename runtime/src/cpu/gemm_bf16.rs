//! GEMM of bf16 operands with AVX512_BF16 (`vdpbf16ps`) or AMX tiles (`gemm_amx.rs`), for the
//! matmuls of a bf16-mixed step.
//!
//! Contract:
//! * `C[b] = A[b] @ B[b]` as f32 sums, C contiguous row-major, overwritten; with `round_c`
//!   each sum rounded to bf16 (`round_bf16`) as its tile is stored, while it is in cache.
//!   Packing (`bf16_pack.rs`) rounds each operand element to bf16 (to nearest, ties to even,
//!   as `round_bf16` does): the identity on bf16 values held in f32 slots (low 16 bits zero,
//!   which is how the cpu backend stores bf16), and the cast for the f32 operands a matmul
//!   reads through a cast that fusion folded into it (`Step::Matmul::round_bf16`).
//! * Every C element is one chain over k in pairs: `acc += a[2p] b[2p] + a[2p+1] b[2p+1]` for
//!   p = 0, 1, ..., one `vdpbf16ps` per pair (k odd: a zero pads the last pair). Threads split
//!   batch x m x n, never k, so the bits depend neither on the thread count nor on the
//!   scheduling. They differ from the f32 GEMM's chain (one FMA per k), by rounding only. AMX
//!   tiles (`Bf16Tiles::Amx`) sum each 16-pair chunk their own way: deterministic too, and
//!   different from `vdpbf16ps` by rounding (`gemm_amx.rs`).
//! * Runs where the cpu has AVX-512F and AVX512_BF16 (`available`), on AMX where it also has
//!   that (`Bf16Tiles::widest`); elsewhere the caller runs the f32 GEMM on the same values.
//!
//! Tiles: 12 rows x 32 columns of C in 24 registers; B is packed once per call into 32-column
//! panels of k pairs (a panel of `k` = 1536 is 96 KiB, in L2), A per task into row pairs.

pub use super::bf16_pack::Src;
use super::bf16_pack::{self, neighbours, pair, side_by_side};
use super::gemm::Layout;
use super::gemm_amx::{self, BLOCK_COLS, BLOCK_ROWS, TILE_PAIRS};
use super::lines::LineBuffer;
use super::pool::{Pool, TaskPtr};
use std::cell::RefCell;
use std::thread::LocalKey;

/// Rows and columns of one register tile.
const MR: usize = 12;
const NR: usize = 32;
/// Rows of C one task computes (a multiple of `MR` and of AMX's 32-row blocks): its packed A,
/// 96 x k pairs, stays in L2.
const ROWS_PER_TASK: usize = 96;
/// Pair rows of a row-major B one packing task packs (across every panel), and pair chunks
/// (16 pairs) of a transposed A (across every row).
const PAIRS_PER_PACKING_TASK: usize = 32;
const CHUNKS_PER_PACKING_TASK: usize = 2;

/// Whether this cpu runs the bf16 kernel.
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        // Every cpu with AVX512_BF16 has BW and VL; the packing of halves uses them.
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Which tiles compute C: AVX-512 registers (`vdpbf16ps`), or AMX tile registers where
/// `gemm_amx::available()` (the same bits: the module's contract).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bf16Tiles {
    Vdpbf16ps,
    Amx,
}

impl Bf16Tiles {
    /// AMX where the cpu runs it, else `vdpbf16ps`.
    pub fn widest() -> Bf16Tiles {
        if gemm_amx::available() {
            Bf16Tiles::Amx
        } else {
            Bf16Tiles::Vdpbf16ps
        }
    }
}

/// Where a GEMM of bf16 operands stores its contiguous C: in f32 slots, or as bf16 in 2
/// bytes an element (`Program::is_two_byte`: each element `bf16_pack::half` of its sum, so
/// rounded as `round_c` rounds).
#[derive(Clone, Copy, Debug)]
pub enum COut {
    F32(*mut f32),
    Halves(*mut u16),
}

// SAFETY: a `COut` only carries C's address, as `TaskPtr` does; the tasks write disjoint parts
// of C (every use says why).
unsafe impl Sync for COut {}
unsafe impl Send for COut {}

impl COut {
    /// Element `i` of C.
    fn at(self, i: usize) -> COut {
        match self {
            COut::F32(c) => COut::F32(c.wrapping_add(i)),
            COut::Halves(c) => COut::Halves(c.wrapping_add(i)),
        }
    }

    /// Rows of a block computed into f32 scratch (`src`, `src_stride` apart) to this place of
    /// C (`stride` apart), rounded to bf16 where `round` (always, into halves).
    ///
    /// # Safety
    /// As `bf16_pack::copy_rows`'s, for the block's live `rows` x `cols`.
    unsafe fn store(
        self,
        src: *const f32,
        src_stride: usize,
        stride: usize,
        rows_cols: (usize, usize),
        round: bool,
    ) {
        // SAFETY: the caller's contract.
        unsafe {
            match self {
                COut::F32(c) => bf16_pack::copy_rows(src, src_stride, c, stride, rows_cols, round),
                COut::Halves(c) => {
                    bf16_pack::copy_rows_to_halves(src, src_stride, c, stride, rows_cols)
                }
            }
        }
    }
}

/// `C = A @ B` over `batch` matrices (see the module's contract).
///
/// # Safety
/// `a`, `b` and `c` must address every element their layouts and shapes name; `c` must not
/// overlap `a` or `b`; `available()` must be true, and `gemm_amx::available()` for
/// `Bf16Tiles::Amx`.
#[allow(clippy::too_many_arguments)]
pub unsafe fn gemm_bf16(
    tiles: Bf16Tiles,
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
    round_c: bool,
) {
    // SAFETY: the caller's contract.
    unsafe {
        gemm_bf16_to(
            tiles,
            (batch, m, n, k),
            (Src::F32(a), la),
            (Src::F32(b), lb),
            COut::F32(c),
            threads,
            round_c,
        )
    }
}

/// `gemm_bf16` with C stored as `c` says.
///
/// # Safety
/// As `gemm_bf16`'s.
pub unsafe fn gemm_bf16_to(
    tiles: Bf16Tiles,
    (batch, m, n, k): (usize, usize, usize, usize),
    (a, la): (Src, Layout),
    (b, lb): (Src, Layout),
    c: COut,
    threads: usize,
    round_c: bool,
) {
    if batch == 0 || m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        // SAFETY: C holds `batch * m * n` elements (the caller's contract).
        unsafe {
            match c {
                COut::F32(c) => std::ptr::write_bytes(c, 0, batch * m * n),
                COut::Halves(c) => std::ptr::write_bytes(c, 0, batch * m * n),
            }
        };
        return;
    }
    let amx = tiles == Bf16Tiles::Amx;
    let pairs = k.div_ceil(2);
    let panels = n.div_ceil(NR);
    // AMX reads B's panels in whole tiles of 16 pairs: the rows past k's pairs are zeros.
    let panel_pairs = if amx {
        gemm_amx::padded_pairs(k)
    } else {
        pairs
    };
    let panel_len = panel_pairs * NR;
    // B shared by every batch (a weight) is packed once.
    let b_batches = if lb.batch_stride == 0 { 1 } else { batch };
    let mut packed_b_buffer = take_buffer(&PACKED_B);
    let packed_b = packed_b_buffer.u32s(b_batches * panels * panel_len);
    let pb = TaskPtr(packed_b.as_mut_ptr());
    let pool = Pool::current();
    let run = |tasks: usize, f: &(dyn Fn(usize) + Sync)| {
        if threads <= 1 {
            (0..tasks).for_each(f);
        } else {
            pool.run(tasks, f);
        }
    };
    let bp = TaskPtr(match b {
        Src::F32(b) => b as *mut f32,
        Src::Halves(_) => std::ptr::null_mut(),
    });
    if lb.col_stride == 1 {
        // Row-major B: a task packs a range of pair rows across every panel, reading B's rows
        // in memory order. (A task per panel walked a 128-byte strip of each row, rows `2n`
        // floats apart, which the prefetchers do not follow: its first loads waited on memory.)
        let groups = pairs.div_ceil(PAIRS_PER_PACKING_TASK);
        run(b_batches * groups, &|t| {
            let (bi, group) = (t / groups, t % groups);
            let first = group * PAIRS_PER_PACKING_TASK;
            for p in first..(first + PAIRS_PER_PACKING_TASK).min(pairs) {
                // Rows 2p and 2p + 1 (when < k) of batch bi's B, n elements each (the
                // caller's contract).
                let row = |kk: usize| b.at(bi * lb.batch_stride + kk * lb.row_stride);
                let (r0, r1) = (row(2 * p), (2 * p + 1 < k).then(|| row(2 * p + 1)));
                for panel in 0..panels {
                    let (from, cols) = (panel * NR, (n - panel * NR).min(NR));
                    // SAFETY: task t alone writes pair row p of batch bi's panels; the rows
                    // hold columns from..from + cols.
                    unsafe {
                        let out = std::slice::from_raw_parts_mut(
                            pb.at((bi * panels + panel) * panel_len + p * NR),
                            cols,
                        );
                        match (r0.at(from), r1.map(|r1| r1.at(from))) {
                            (Src::F32(x0), x1) => side_by_side(
                                std::slice::from_raw_parts(x0, cols),
                                x1.map(|x1| match x1 {
                                    Src::F32(x1) => std::slice::from_raw_parts(x1, cols),
                                    Src::Halves(_) => unreachable!("one operand, one storage"),
                                }),
                                out,
                            ),
                            // Stored in 2 bytes: the two rows' halves side by side.
                            (x0, x1) => bf16_pack::interleave_halves(
                                x0.halves_at(0).expect("one operand, one storage"),
                                x1.and_then(|x1| x1.halves_at(0)),
                                out,
                            ),
                        }
                    }
                }
            }
            if group + 1 == groups {
                for panel in 0..panels {
                    let base = (bi * panels + panel) * panel_len;
                    // SAFETY: the padding rows of batch bi's panels are this task's alone.
                    let padding = unsafe {
                        std::slice::from_raw_parts_mut(
                            pb.at(base + pairs * NR),
                            panel_len - pairs * NR,
                        )
                    };
                    padding.fill(0);
                }
            }
        });
    } else {
        run(b_batches * panels, &|t| {
            let (bi, panel) = (t / panels, t % panels);
            let at = |kk: usize, j: usize| -> f32 {
                if kk < k && j < n {
                    // SAFETY: (kk, j) is inside batch bi's B (caller's contract).
                    unsafe { b.get(bi * lb.batch_stride + kk * lb.row_stride + j * lb.col_stride) }
                } else {
                    0.0
                }
            };
            let base = (bi * panels + panel) * panel_len;
            // SAFETY: task t alone writes panel `panel` of batch `bi`, `panel_len` lanes.
            let dst = unsafe { std::slice::from_raw_parts_mut(pb.at(base), panel_len) };
            let cols = (n - panel * NR).min(NR);
            let origin = bi * lb.batch_stride + panel * NR * lb.col_stride;
            // Read B in its memory order: down columns when B is transposed (in f32 slots; one
            // stored in 2 bytes goes element by element below: the lowering stores in 2 bytes
            // values read row-major, and this keeps every other layout correct).
            if let (Src::F32(_), 1) = (b, lb.row_stride) {
                // Transposed B: each column's k elements are neighbours; 16 columns x 16 pairs at
                // a time turn into the panel's rows.
                // SAFETY: the panel's columns hold k elements from `origin`; the panel holds
                // its pair rows of NR lanes.
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    bf16_pack::column_panel(
                        bp.at(origin),
                        lb.col_stride,
                        (k, cols),
                        dst.as_mut_ptr(),
                        NR,
                    )
                };
                #[cfg(not(target_arch = "x86_64"))]
                for lane in 0..cols {
                    // SAFETY: column `panel * NR + lane` holds k elements from its start.
                    let col = unsafe {
                        std::slice::from_raw_parts(bp.at(origin + lane * lb.col_stride), k)
                    };
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
            dst[pairs * NR..].fill(0);
        });
    }
    // AMX packs A once, before the tasks, every 32-row block in parallel: its tiles compute
    // so fast that a task packing its rows again per column group (as the register tiles do
    // below) spent as long packing as computing.
    let ap = TaskPtr(match a {
        Src::F32(a) => a as *mut f32,
        Src::Halves(_) => std::ptr::null_mut(),
    });
    let a_block_len = BLOCK_ROWS * panel_pairs;
    let a_blocks = m.div_ceil(BLOCK_ROWS);
    // An A of halves with k contiguous in whole tiles and whole blocks: the tiles load it in
    // place (`ABlock::in_place`), no packing.
    let a_in_place = amx
        && matches!(a, Src::Halves(_))
        && la.col_stride == 1
        && k % 32 == 0
        && m % BLOCK_ROWS == 0;
    let pack_a = amx && !a_in_place;
    let mut packed_a_all_buffer = take_buffer(&PACKED_A_ALL);
    let packed_a_all = packed_a_all_buffer.u32s(if pack_a {
        batch * a_blocks * a_block_len
    } else {
        0
    });
    if pack_a && la.row_stride == 1 && la.col_stride != 1 {
        // Transposed A: tasks take ranges of k's chunks over every row (`pack_a_columns`).
        let pa = TaskPtr(packed_a_all.as_mut_ptr());
        let chunks = panel_pairs / TILE_PAIRS;
        let groups = chunks.div_ceil(CHUNKS_PER_PACKING_TASK);
        run(batch * groups, &|t| {
            let (bi, group) = (t / groups, t % groups);
            let first = group * CHUNKS_PER_PACKING_TASK;
            // SAFETY: task t alone writes these chunks of batch bi's row tiles; A's rows are
            // inside A (the caller's contract); `available()`.
            #[cfg(target_arch = "x86_64")]
            unsafe {
                gemm_amx::pack_a_columns(
                    a.at(bi * la.batch_stride),
                    la,
                    m,
                    k,
                    first..(first + CHUNKS_PER_PACKING_TASK).min(chunks),
                    pa.at(bi * a_blocks * a_block_len),
                )
            };
        });
    } else if pack_a {
        let pa = TaskPtr(packed_a_all.as_mut_ptr());
        run(batch * a_blocks, &|t| {
            let (bi, block) = (t / a_blocks, t % a_blocks);
            let first = block * BLOCK_ROWS;
            // SAFETY: task t alone writes block t's `a_block_len` lanes; its rows of batch
            // bi's A are inside A (the caller's contract); `available()`.
            unsafe {
                let out = std::slice::from_raw_parts_mut(pa.at(t * a_block_len), a_block_len);
                gemm_amx::pack_a(
                    a.at(bi * la.batch_stride + first * la.row_stride),
                    la,
                    (m - first).min(BLOCK_ROWS),
                    k,
                    out,
                );
            }
        });
    }
    let row_blocks = m.div_ceil(ROWS_PER_TASK);
    // Columns are split too where rows alone would leave a thread idle (a weight gradient of
    // 256 rows is three row blocks): each register-tile task then packs its A rows again, a
    // k x rows copy against k x rows x columns of arithmetic (AMX's tasks share A's packing).
    // On one thread (attention's products, inside its own tasks) a split only repeats the
    // packing and the tile configuration: 3-6% of bf16 attention (`attention_cost bf16
    // strided`).
    let wanted = if threads <= 1 { 1 } else { 4 * threads };
    let groups = wanted.div_ceil(batch * row_blocks).clamp(1, panels);
    let panels_per_group = panels.div_ceil(groups);
    let groups = panels.div_ceil(panels_per_group);
    let cp = c;
    let (b_packed, packed_a_all) = (&*packed_b, &*packed_a_all);
    run(batch * row_blocks * groups, &|t| {
        let (bi, rest) = (t / (row_blocks * groups), t % (row_blocks * groups));
        let (block, group) = (rest / groups, rest % groups);
        let task_panels = group * panels_per_group..((group + 1) * panels_per_group).min(panels);
        let rows = block * ROWS_PER_TASK..((block + 1) * ROWS_PER_TASK).min(m);
        let height = rows.len();
        let b_batch = if b_batches == 1 { 0 } else { bi };
        if amx {
            #[cfg(target_arch = "x86_64")]
            {
                let origin = bi * la.batch_stride + rows.start * la.row_stride;
                let a = match a.halves_at(origin).filter(|_| a_in_place) {
                    Some(at) => AmxA::InPlace {
                        at,
                        row_stride: la.row_stride,
                    },
                    None => AmxA::Packed(
                        &packed_a_all[(bi * a_blocks + rows.start / BLOCK_ROWS) * a_block_len..],
                    ),
                };
                // SAFETY: as the register path below: this task's rows of A, its panels'
                // columns of C; `gemm_amx::available()` (the caller's contract).
                unsafe {
                    amx_task(
                        a,
                        height,
                        panel_pairs,
                        &b_packed[b_batch * panels * panel_len..][..panels * panel_len],
                        task_panels,
                        n,
                        cp.at(bi * m * n + rows.start * n),
                        round_c,
                    )
                };
            }
            return;
        }
        // A's rows of this task in pairs, in whole tiles (rows past `height` are never stored).
        let tiles = height.div_ceil(MR);
        let mut packed_a_buffer = take_buffer(&PACKED_A);
        let packed_a = packed_a_buffer.u32s(tiles * MR * pairs);
        let at = |i: usize, kk: usize| -> f32 {
            if kk < k {
                // SAFETY: (i, kk) is inside batch bi's A (caller's contract).
                unsafe { a.get(bi * la.batch_stride + i * la.row_stride + kk * la.col_stride) }
            } else {
                0.0
            }
        };
        // Tile-major: the 12 rows of a tile, pair by pair, as the kernel broadcasts them. Read in
        // A's memory order: down columns (k and k + 1 side by side) when A is transposed, along
        // rows when it is row-major.
        let origin = bi * la.batch_stride + rows.start * la.row_stride;
        let halves = a.halves_at(origin);
        if let (Some(halves), true) = (halves, la.row_stride == 1 && la.col_stride != 1) {
            for p in 0..pairs {
                let c0 = halves.wrapping_add(2 * p * la.col_stride);
                let c1 = (2 * p + 1 < k).then(|| halves.wrapping_add((2 * p + 1) * la.col_stride));
                for tile in 0..tiles {
                    let live = (height - tile * MR).min(MR);
                    let out = &mut packed_a[(tile * pairs + p) * MR..][..live];
                    // SAFETY: columns 2p and 2p + 1 (when < k) hold the task's `height` rows.
                    unsafe {
                        bf16_pack::interleave_halves(
                            c0.add(tile * MR),
                            c1.map(|c1| c1.add(tile * MR)),
                            out,
                        )
                    };
                }
            }
        } else if let (Some(halves), 1) = (halves, la.col_stride) {
            for r in 0..height {
                let (tile, lane) = (r / MR, r % MR);
                // SAFETY: row `rows.start + r` holds k halves; its pairs go to lanes of
                // `packed_a` MR apart, inside it.
                unsafe {
                    bf16_pack::row_pairs_halves(
                        halves.add(r * la.row_stride),
                        k,
                        packed_a.as_mut_ptr().add(tile * pairs * MR + lane),
                        MR,
                    )
                };
            }
        } else if halves.is_some() {
            for r in 0..height {
                let (tile, lane) = (r / MR, r % MR);
                for p in 0..pairs {
                    let i = rows.start + r;
                    packed_a[(tile * pairs + p) * MR + lane] = pair(at(i, 2 * p), at(i, 2 * p + 1));
                }
            }
        } else if la.row_stride == 1 && la.col_stride != 1 {
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
                    match cp.at(bi * m * n + first * n + panel * NR) {
                        COut::F32(c_tile) => {
                            #[cfg(target_arch = "x86_64")]
                            tile_12x32(a_tile, b_panel, pairs, c_tile, n, live_rows, cols);
                            if round_c {
                                bf16_pack::round_rows(c_tile, n, live_rows, cols);
                            }
                            #[cfg(not(target_arch = "x86_64"))]
                            let _ = c_tile;
                        }
                        halves => {
                            // Through a tile of scratch: the register tile stores f32.
                            let mut scratch = [0f32; MR * NR];
                            #[cfg(target_arch = "x86_64")]
                            tile_12x32(
                                a_tile,
                                b_panel,
                                pairs,
                                scratch.as_mut_ptr(),
                                NR,
                                live_rows,
                                cols,
                            );
                            halves.store(scratch.as_ptr(), NR, n, (live_rows, cols), true);
                        }
                    }
                    #[cfg(not(target_arch = "x86_64"))]
                    let _ = (a_tile, b_panel, live_rows, cols);
                }
            }
        }
        keep_buffer(&PACKED_A, packed_a_buffer);
    });
    keep_buffer(&PACKED_B, packed_b_buffer);
    keep_buffer(&PACKED_A_ALL, packed_a_all_buffer);
}

/// A task's rows of A for the tiles: packed (`gemm_amx::pack_a`), or halves read in place.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum AmxA<'a> {
    Packed(&'a [u32]),
    InPlace { at: *const u16, row_stride: usize },
}

/// One task's `height` rows of C (from `c`, row stride `n`) over `panels` of B, on AMX tiles:
/// 32 x 32 blocks, each over the whole of k, from A's rows packed by `gemm_amx::pack_a`
/// (`panel_pairs` pairs a row) or read in place (`AmxA`); each block rounded to bf16 as it is
/// stored where `round_c`.
///
/// # Safety
/// As `gemm_bf16`'s: `c` addresses the task's rows of C alone; `gemm_amx::available()`.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
unsafe fn amx_task(
    a: AmxA,
    height: usize,
    panel_pairs: usize,
    b_panels: &[u32],
    panels: std::ops::Range<usize>,
    n: usize,
    c: COut,
    round_c: bool,
) {
    let chunks = panel_pairs / TILE_PAIRS;
    let blocks = height.div_ceil(BLOCK_ROWS);
    let block_len = BLOCK_ROWS * panel_pairs;
    let a_block = |block: usize| match a {
        AmxA::Packed(packed_a) => {
            gemm_amx::ABlock::packed(packed_a[block * block_len..].as_ptr(), chunks)
        }
        AmxA::InPlace { at, row_stride } => {
            gemm_amx::ABlock::in_place(at.wrapping_add(block * BLOCK_ROWS * row_stride), row_stride)
        }
    };
    if let AmxA::Packed(packed_a) = a {
        assert!(packed_a.len() >= blocks * block_len);
    }
    let panel_len = panel_pairs * NR;
    // SAFETY: `gemm_amx::available()` (the caller's contract).
    let tiles = unsafe { gemm_amx::Tiles::configure() };
    /// A whole block's stores, on cache lines as the tiles' stores want them (`lines.rs`).
    #[derive(Clone, Copy)]
    #[repr(C, align(64))]
    struct Staged([f32; BLOCK_ROWS * BLOCK_COLS]);
    // Blocks to round, and blocks past C's edge, are stored into one of two staging blocks in
    // L1 and copied into C (rounded) only after the next block's tile instructions are issued.
    // Rounding C in place right after `tilestored` spent two thirds of its samples on its first
    // load, waiting for the tile stores, and cost the GEMM a third of its time (`gemm_shapes 2
    // amx` on `peer`'s shapes, with and without the rounding).
    let mut staged = [Staged([0.0; BLOCK_ROWS * BLOCK_COLS]); 2];
    let mut next = 0;
    // (staging block, where in C, live rows, live columns)
    let mut pending: Option<(usize, COut, usize, usize)> = None;
    let flush = |pending: Option<(usize, COut, usize, usize)>, staged: &[Staged; 2]| {
        if let Some((slot, at, rows, cols)) = pending {
            // SAFETY: the block's live part of C is this task's; the staging block is whole.
            unsafe {
                at.store(
                    staged[slot].0.as_ptr(),
                    BLOCK_COLS,
                    n,
                    (rows, cols),
                    round_c,
                )
            };
        }
    };
    for panel in panels {
        let b_panel = b_panels[panel * panel_len..][..panel_len].as_ptr();
        let cols = (n - panel * NR).min(NR);
        for block in 0..blocks {
            let a_block = a_block(block);
            let live_rows = (height - block * BLOCK_ROWS).min(BLOCK_ROWS);
            let at = c.at(block * BLOCK_ROWS * n + panel * NR);
            let whole = live_rows == BLOCK_ROWS && cols == BLOCK_COLS;
            let staged_now = if let (true, false, COut::F32(at)) = (whole, round_c, at) {
                // SAFETY: the block's rows and the panel's columns of C are this task's.
                unsafe { tiles.block(a_block, b_panel, chunks, at, n) };
                None
            } else {
                let slot = next;
                next ^= 1;
                let to = staged[slot].0.as_mut_ptr();
                // SAFETY: the staging block holds a whole block (32 x 32).
                unsafe { tiles.block(a_block, b_panel, chunks, to, BLOCK_COLS) };
                Some((slot, at, live_rows, cols))
            };
            flush(pending.take(), &staged);
            pending = staged_now;
        }
    }
    flush(pending, &staged);
    drop(tiles);
}

std::thread_local! {
    /// Each thread's packing buffers, kept between calls: `peer`'s packed operands are hundreds
    /// of KiB to MiB, which a fresh allocation per call (or per task) maps and faults in again.
    /// They start on a cache line, as AMX's tile loads need to run at speed (`lines.rs`).
    static PACKED_A: RefCell<LineBuffer> = const { RefCell::new(LineBuffer::new()) };
    static PACKED_B: RefCell<LineBuffer> = const { RefCell::new(LineBuffer::new()) };
    /// AMX's A, packed once per call by every thread for the caller (`gemm_amx::pack_a`).
    static PACKED_A_ALL: RefCell<LineBuffer> = const { RefCell::new(LineBuffer::new()) };
}

/// This thread's buffer `key`, taken out of it until `keep_buffer` (so that a GEMM inside a
/// task of another, attention's, gets its own). Its contents are stale: the packing writes
/// every lane the kernel's stored results read, and the lanes past an edge (rows past the
/// task's, columns past `n`) only feed accumulators that are never stored.
fn take_buffer(key: &'static LocalKey<RefCell<LineBuffer>>) -> LineBuffer {
    key.with(|b| std::mem::take(&mut *b.borrow_mut()))
}

/// Gives `buffer` back to this thread for its next call.
fn keep_buffer(key: &'static LocalKey<RefCell<LineBuffer>>, buffer: LineBuffer) {
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
    use super::gemm::k_steps_in_fours;
    use std::arch::x86_64::*;
    assert!(a.len() >= pairs * MR && b.len() >= pairs * NR);
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    // One pair: every accumulator takes one more `vdpbf16ps`. Read through pointers, not the
    // slices: their indexing put a bounds check on each of the 12 broadcasts of a pair.
    let step = |a: *const u32, b: *const u32| {
        // SAFETY: a pair's 32 lanes of `b` and 12 of `a` (`k_steps_in_fours`, asserted above).
        let (b0, b1) = unsafe {
            (
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b as *const _)),
                std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(b.add(16) as *const _)),
            )
        };
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: as above.
            let av = unsafe {
                std::mem::transmute::<__m512i, __m512bh>(_mm512_set1_epi32(*a.add(r) as i32))
            };
            row[0] = _mm512_dpbf16_ps(row[0], av, b0);
            row[1] = _mm512_dpbf16_ps(row[1], av, b1);
        }
    };
    // Four pairs per iteration, in order (the same chains), as the f32 tiles run their k
    // steps: 1.00-1.02x per shape on the AMX Xeon, whose `vdpbf16ps` rate is the limit
    // (docs/benchmarks.md); not measured on Zen 4, where this tile is the bf16 path.
    // SAFETY: `pairs` steps of MR lanes of `a` and NR of `b` lie inside them (asserted).
    unsafe { k_steps_in_fours(pairs, (a.as_ptr(), MR), (b.as_ptr(), NR), step) };
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

#[cfg(test)]
mod tests {
    use super::*;
    use graphtrain_ir::host_tensor::round_bf16;

    /// The tiles this cpu runs: `vdpbf16ps`, and AMX where it has it.
    fn tile_kinds() -> Vec<Bf16Tiles> {
        let mut kinds = vec![Bf16Tiles::Vdpbf16ps];
        if gemm_amx::available() {
            kinds.push(Bf16Tiles::Amx);
        } else {
            eprintln!("this cpu has no AMX: testing the vdpbf16ps tiles only");
        }
        kinds
    }

    /// The bits of C from `gemm_bf16_to` on 2 threads (B in f32 slots, C's f32 sums unrounded).
    /// `tiles` must be available and the operands hold what the shapes name.
    fn c_bits(
        tiles: Bf16Tiles,
        (batch, m, n, k): (usize, usize, usize, usize),
        (a, la): (Src, Layout),
        (b, lb): (&[f32], Layout),
    ) -> Vec<u32> {
        let mut c = vec![f32::NAN; batch * m * n];
        // SAFETY: the buffers hold what the shapes name; `tiles` is available (the callers').
        unsafe {
            gemm_bf16_to(
                tiles,
                (batch, m, n, k),
                (a, la),
                (Src::F32(b.as_ptr()), lb),
                COut::F32(c.as_mut_ptr()),
                2,
                false,
            )
        };
        c.iter().map(|x| x.to_bits()).collect()
    }

    /// bf16 values as stored in 2 bytes (`Program::is_two_byte`): their high halves.
    fn halves_of(x: &[f32]) -> Vec<u16> {
        x.iter().map(|x| (x.to_bits() >> 16) as u16).collect()
    }

    /// An A stored in 2 bytes, row-major in whole tiles and blocks, is read by the AMX tiles
    /// where it lies (`ABlock::in_place`): the same bits as the same values in f32 slots,
    /// which are packed. Strided rows (a view) and a batch of two; and a height that is no
    /// whole number of blocks, which is packed.
    #[test]
    fn amx_reads_a_of_halves_in_place_as_it_packs_it() {
        if !gemm_amx::available() {
            eprintln!("skipping: this cpu has no AMX tiles");
            return;
        }
        let value = |i: usize| round_bf16(((i * 7919 % 1000) as f32 - 500.0) / 250.0);
        for &(batch, m, n, k, pad) in &[(2, 64, 40, 64, 32), (1, 96, 33, 96, 0), (1, 40, 16, 32, 0)]
        {
            let row_stride = k + pad;
            let a: Vec<f32> = (0..batch * m * row_stride).map(value).collect();
            let halves = halves_of(&a);
            let b: Vec<f32> = (0..k * n).map(|i| value(i + 5)).collect();
            let la = Layout {
                batch_stride: m * row_stride,
                row_stride,
                col_stride: 1,
            };
            let lb = Layout {
                batch_stride: 0,
                row_stride: n,
                col_stride: 1,
            };
            let run = |a: Src| c_bits(Bf16Tiles::Amx, (batch, m, n, k), (a, la), (&b, lb));
            let (in_place, packed) = (run(Src::Halves(halves.as_ptr())), run(Src::F32(a.as_ptr())));
            let differ = in_place.iter().zip(&packed).filter(|(x, y)| x != y).count();
            assert!(
                differ == 0,
                "({batch},{m},{n},{k}), rows {row_stride} apart: {differ} elements of C differ"
            );
        }
    }

    /// A transposed A stored in 2 bytes (a weight gradient's activations) gives the bits of the
    /// same values in f32 slots, on every tile kind: heights that leave a partial row tile (the
    /// masked loads of the last columns' halves), an odd k, a batch of two.
    #[test]
    fn a_transposed_a_of_halves_packs_as_its_f32_values() {
        if !available() {
            eprintln!("skipping: this cpu has no AVX512_BF16");
            return;
        }
        let value = |i: usize| round_bf16(((i * 7919 % 1000) as f32 - 500.0) / 250.0);
        for &(batch, m, n, k) in &[(1, 13, 37, 64), (2, 40, 16, 33), (1, 97, 32, 300)] {
            let a: Vec<f32> = (0..batch * m * k).map(value).collect();
            let halves = halves_of(&a);
            let b: Vec<f32> = (0..k * n).map(|i| value(i + 5)).collect();
            let la = Layout {
                batch_stride: m * k,
                row_stride: 1,
                col_stride: m,
            };
            let lb = Layout {
                batch_stride: 0,
                row_stride: n,
                col_stride: 1,
            };
            for tiles in tile_kinds() {
                let run = |a: Src| c_bits(tiles, (batch, m, n, k), (a, la), (&b, lb));
                let (from_halves, from_f32) =
                    (run(Src::Halves(halves.as_ptr())), run(Src::F32(a.as_ptr())));
                let differ = from_halves
                    .iter()
                    .zip(&from_f32)
                    .filter(|(x, y)| x != y)
                    .count();
                assert!(
                    differ == 0,
                    "{tiles:?} ({batch},{m},{n},{k}): {differ} elements of C differ"
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
            // Row-major B over several packing tasks' pair rows, per batch.
            (2, 40, 70, 141, false, false),
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
            for (tiles, threads) in tile_kinds().into_iter().flat_map(|t| [(t, 1), (t, 3)]) {
                // The run on 3 threads rounds C: it must be the 1-thread run's sums, rounded.
                let round_c = threads == 3;
                let mut c = vec![f32::NAN; batch * m * n];
                // SAFETY: the buffers hold what the shapes name.
                unsafe {
                    gemm_bf16(
                        tiles,
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
                        round_c,
                    )
                };
                for (idx, (&got, &want)) in c.iter().zip(&want).enumerate().filter(|_| !round_c) {
                    let scale: f64 = (0..k).map(|_| 4.0).sum::<f64>().max(1.0);
                    assert!(
                        (got as f64 - want).abs() <= 1e-6 * scale,
                        "{tiles:?} ({batch},{m},{n},{k}) element {idx}: {got} vs {want}"
                    );
                }
                runs.push((tiles, c.iter().map(|x| x.to_bits()).collect::<Vec<_>>()));
            }
            for pair in runs.chunks(2) {
                let rounded: Vec<u32> = pair[0]
                    .1
                    .iter()
                    .map(|&x| round_bf16(f32::from_bits(x)).to_bits())
                    .collect();
                assert!(
                    rounded == pair[1].1,
                    "{:?} ({batch},{m},{n},{k}): the bits depend on the thread count, or the rounding of C is not round_bf16's",
                    pair[0].0
                );
            }
        }
    }
}
