//! The bf16 GEMM's tiles on AMX (`tdpbf16ps`), where the cpu and the kernel allow them.
//!
//! Contract: the same as `gemm_bf16`'s (it drives this file: packs A and B, splits the
//! tasks), with two differences in how a task computes its part of C:
//! * A is packed in 16 x 16-pair chunks (one tile register each: 16 rows of 64 bytes) and k is
//!   padded with zero pairs to a multiple of 16, in A and in B's panels, so every tile load is
//!   whole. The padding adds `+0 * 0` to the sums. An A stored in 2 bytes with k contiguous,
//!   k a multiple of 32 and whole 32-row blocks is not packed: the tiles load its rows where
//!   they lie (`ABlock::in_place`), the same pairs in the same order.
//! * A block of C is 32 rows x 32 columns, four accumulator tiles; each k chunk loads two A
//!   tiles and two B tiles (a B panel's 16 pairs x 16 columns, read at the panel's 128-byte row
//!   stride) and issues four `tdpbf16ps`.
//!
//! Rounding: each C element is a chain over k's 16-pair chunks, in order, one `tdpbf16ps` per
//! chunk; how the hardware sums a chunk's 32 products is its own (measured on a Xeon: not one
//! f32 rounding per product as `vdpbf16ps` rounds, e.g. `2^30 + 1 - 2^30` in one chunk gives 1
//! where vdpbf16ps gives 0), so the two kernels' bits differ by rounding. Each is
//! deterministic: threads split rows and columns only, as in `gemm_bf16`, so the bits depend
//! neither on the thread count nor on the schedule (tested).
//!
//! Availability: CPUID's AMX-TILE and AMX-BF16 bits, the OS's XCR0 tile state, and Linux's
//! permission for the tile data (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, asked
//! once per process, which the kernel grants to every thread). Tile instructions are inline
//! assembly: stable Rust has no AMX intrinsics. Each task loads the tile configuration before
//! its first tile instruction and releases the tiles after its last, so a thread that is not
//! in a GEMM carries no tile state.

use super::bf16_pack::{self, pair, Src};
use super::gemm::Layout;
use std::sync::OnceLock;

/// Rows of a tile, and pairs (of bf16) in a tile's row: 64 bytes.
pub const TILE_ROWS: usize = 16;
pub const TILE_PAIRS: usize = 16;
/// Rows and columns of the C block one call of `block` computes: 2 x 2 tiles.
pub const BLOCK_ROWS: usize = 32;
pub const BLOCK_COLS: usize = 32;

/// Whether this cpu runs the AMX tiles (asked once; the first call also asks Linux for the
/// tile data permission).
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            detect::amx_usable()
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            false
        }
    })
}

/// `k`'s pairs padded to whole tile rows.
pub fn padded_pairs(k: usize) -> usize {
    k.div_ceil(2).div_ceil(TILE_PAIRS) * TILE_PAIRS
}

/// Packs `height` rows of A (from `a`, under `la`) into `out`, chunk-major: chunk (row tile
/// t, pair chunk c) is 16 rows x 16 pairs, contiguous, at `(t * chunks + c) * 256`; pairs past
/// k's are zero, rows past `height` zero or left as they are (they only feed rows of C that
/// are never stored). `out` holds whole row tiles. An A in f32 slots is rounded to bf16 as it
/// is packed; one stored in 2 bytes is packed as the halves it is.
///
/// # Safety
/// `a` must address every element of `height` rows x `k` columns under `la`; AVX-512F.
pub unsafe fn pack_a(a: Src, la: Layout, height: usize, k: usize, out: &mut [u32]) {
    let chunks = padded_pairs(k) / TILE_PAIRS;
    let pairs = k.div_ceil(2);
    let chunk_len = TILE_ROWS * TILE_PAIRS;
    assert!(out.len() >= height.div_ceil(TILE_ROWS) * chunks * chunk_len);
    let chunk_at = |t: usize, c: usize| (t * chunks + c) * chunk_len;
    if la.row_stride == 1 && la.col_stride != 1 {
        // SAFETY: the caller's contract; `out` holds every chunk (asserted).
        #[cfg(target_arch = "x86_64")]
        unsafe {
            pack_a_columns(a, la, height, k, 0..chunks, out.as_mut_ptr())
        };
        return;
    }
    // Rows in f32 slots: each row's chunks written where they go.
    #[cfg(target_arch = "x86_64")]
    if let (Src::F32(a), 1) = (a, la.col_stride) {
        for r in 0..height {
            let (t, lane) = (r / TILE_ROWS, r % TILE_ROWS);
            // SAFETY: row r holds k elements (the caller's contract); the row's lanes of its
            // tile's chunks are inside `out` (asserted); AVX-512F.
            unsafe {
                bf16_pack::row_chunks(
                    a.add(r * la.row_stride),
                    k,
                    out.as_mut_ptr().add(chunk_at(t, 0) + lane * TILE_PAIRS),
                    chunk_len,
                )
            };
        }
        return;
    }
    let mut row_pairs = vec![0u32; chunks * TILE_PAIRS];
    for r in 0..height {
        match a {
            // SAFETY: row r holds k halves (the caller's contract); `row_pairs` its pairs.
            Src::Halves(a) if la.col_stride == 1 => unsafe {
                bf16_pack::row_pairs_halves(a.add(r * la.row_stride), k, row_pairs.as_mut_ptr(), 1)
            },
            _ => {
                for (p, lane) in row_pairs.iter_mut().enumerate().take(pairs) {
                    let at = |kk: usize| {
                        // SAFETY: (r, kk) is inside A (the caller's contract).
                        (kk < k).then(|| unsafe { a.get(r * la.row_stride + kk * la.col_stride) })
                    };
                    *lane = pair(at(2 * p).unwrap_or(0.0), at(2 * p + 1).unwrap_or(0.0));
                }
            }
        }
        let (t, lane) = (r / TILE_ROWS, r % TILE_ROWS);
        for (c, chunk) in row_pairs.chunks(TILE_PAIRS).enumerate() {
            out[chunk_at(t, c) + lane * TILE_PAIRS..][..TILE_PAIRS].copy_from_slice(chunk);
        }
    }
}

/// Packs pair chunks `chunks` of every row tile of a transposed A (`m` rows, k down its
/// columns: `la.row_stride == 1`, a weight gradient's activations) into `out`, where `pack_a`
/// puts them for consecutive blocks: chunk (row tile t, chunk c) at `(t * all + c) * 256`, `all`
/// being `padded_pairs(k) / 16`. Chunk by chunk, every row tile of one, so that A's stored rows
/// (k) are read in memory order: a block's two row tiles at a time walked a 128-byte strip of
/// each stored row, which the prefetchers do not follow.
///
/// # Safety
/// `a` must address `m` rows x `k` columns under `la`; `out` every chunk named; the bf16
/// kernels' features (`gemm_bf16::available`).
#[cfg(target_arch = "x86_64")]
pub unsafe fn pack_a_columns(
    a: Src,
    la: Layout,
    m: usize,
    k: usize,
    chunks: std::ops::Range<usize>,
    out: *mut u32,
) {
    let all = padded_pairs(k) / TILE_PAIRS;
    for c in chunks {
        for t in 0..m.div_ceil(TILE_ROWS) {
            let (rows, to) = (
                (m - t * TILE_ROWS).min(TILE_ROWS),
                out.wrapping_add((t * all + c) * TILE_ROWS * TILE_PAIRS),
            );
            // SAFETY: the tile's live rows of every column < k are inside A, the chunk's 16 rows
            // of 16 lanes inside `out` (the caller's contract).
            unsafe {
                match a {
                    Src::F32(a) => bf16_pack::columns_to_rows(
                        a.add(t * TILE_ROWS),
                        la.col_stride,
                        k,
                        c * TILE_PAIRS,
                        rows,
                        to,
                        TILE_PAIRS,
                    ),
                    Src::Halves(a) => bf16_pack::columns_to_rows_halves(
                        a.add(t * TILE_ROWS),
                        la.col_stride,
                        k,
                        c * TILE_PAIRS,
                        rows,
                        to,
                        TILE_PAIRS,
                    ),
                }
            };
        }
    }
}

/// Where a 32-row block's A tiles are: its first row tile's first chunk at `at`, `row_bytes`
/// between a tile's rows, `chunk_bytes` from one k chunk to the next, the second row tile
/// (16 rows down) `second` bytes after the first.
#[derive(Clone, Copy)]
pub struct ABlock {
    pub at: *const u8,
    pub row_bytes: usize,
    pub chunk_bytes: usize,
    pub second: usize,
}

impl ABlock {
    /// A block as `pack_a` lays it out over `chunks` chunks.
    pub fn packed(at: *const u32, chunks: usize) -> ABlock {
        let chunk_bytes = TILE_ROWS * TILE_PAIRS * 4;
        ABlock {
            at: at.cast(),
            row_bytes: TILE_PAIRS * 4,
            chunk_bytes,
            second: chunks * chunk_bytes,
        }
    }

    /// A block read where it lies: 32 rows of halves from `at`, `row_stride` halves apart, k
    /// contiguous. A tile's row is 16 pairs, 32 consecutive halves of one row of A: the pairs
    /// `pack_a` would make, in the order it would put them.
    pub fn in_place(at: *const u16, row_stride: usize) -> ABlock {
        ABlock {
            at: at.cast(),
            row_bytes: 2 * row_stride,
            chunk_bytes: TILE_PAIRS * 4,
            second: TILE_ROWS * 2 * row_stride,
        }
    }
}

/// The tile state of one task: configured on creation, released on drop.
pub struct Tiles(());

impl Tiles {
    /// Loads the configuration: eight tiles of 16 rows x 64 bytes.
    ///
    /// # Safety
    /// `available()` must be true.
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn configure() -> Tiles {
        #[repr(C, align(64))]
        struct Config {
            palette: u8,
            start_row: u8,
            reserved: [u8; 14],
            bytes_per_row: [u16; 16],
            rows: [u8; 16],
        }
        let mut config = Config {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            bytes_per_row: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            config.bytes_per_row[t] = (TILE_PAIRS * 4) as u16;
            config.rows[t] = TILE_ROWS as u8;
        }
        // SAFETY: the configuration is 64 bytes, palette 1 (which `available()` checked);
        // loading it zeroes the tiles and touches no memory but the configuration.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) &config, options(nostack, readonly));
        }
        Tiles(())
    }

    /// C's 32 x 32 block at `c` (row stride `ldc` floats) = A's two row tiles (`a`) times B's
    /// panel from `b`, over `chunks` pair chunks.
    ///
    /// # Safety
    /// `a` must address `chunks` chunks of both row tiles, `b` a panel of `chunks * 16` pairs x
    /// 32 columns, `c` 32 rows of 32 columns at stride `ldc`; `chunks >= 1`.
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn block(&self, a: ABlock, b: *const u32, chunks: usize, c: *mut f32, ldc: usize) {
        // SAFETY: the caller's contract; the tiles were configured by `configure`.
        unsafe {
            block_asm!(
                a,
                b,
                chunks,
                c,
                ldc,
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
            )
        }
    }

    /// `block`, adding to the 32 x 32 block of C at `c` instead of overwriting it: the
    /// accumulator tiles start from C (a sum over several products, kept in f32 in C).
    ///
    /// # Safety
    /// As `block`'s; C's block is read as well as written.
    #[cfg(target_arch = "x86_64")]
    pub unsafe fn block_add(
        &self,
        a: ABlock,
        b: *const u32,
        chunks: usize,
        c: *mut f32,
        ldc: usize,
    ) {
        // SAFETY: the caller's contract; the tiles were configured by `configure`.
        unsafe {
            block_asm!(
                a,
                b,
                chunks,
                c,
                ldc,
                "tileloadd tmm0, [{c0} + {ldc} * 1]",
                "tileloadd tmm1, [{c0} + {ldc} * 1 + 64]",
                "tileloadd tmm2, [{c1} + {ldc} * 1]",
                "tileloadd tmm3, [{c1} + {ldc} * 1 + 64]",
            )
        }
    }
}

/// The tile loop of `Tiles::block` and `Tiles::block_add`, after `start` (the four lines that
/// set the accumulator tiles: zeroed, or loaded from C): per k chunk, two A tiles, two B tiles
/// and four `tdpbf16ps`; then the accumulators stored to C.
#[cfg(target_arch = "x86_64")]
macro_rules! block_asm {
    ($a:expr, $b:expr, $chunks:expr, $c:expr, $ldc:expr, $($start:literal,)*) => {{
        let ABlock {
            at,
            row_bytes,
            chunk_bytes,
            second,
        } = $a;
        let a1 = at.wrapping_add(second);
        std::arch::asm!(
            $($start,)*
            "2:",
            "tileloadd tmm4, [{a0} + {a_stride} * 1]",
            "tileloadd tmm5, [{a1} + {a_stride} * 1]",
            "tileloadd tmm6, [{b} + {b_stride} * 1]",
            "tileloadd tmm7, [{b} + {b_stride} * 1 + 64]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, {chunk_bytes}",
            "add {a1}, {chunk_bytes}",
            "add {b}, {b_chunk_bytes}",
            "dec {n}",
            "jnz 2b",
            "tilestored [{c0} + {ldc} * 1], tmm0",
            "tilestored [{c0} + {ldc} * 1 + 64], tmm1",
            "tilestored [{c1} + {ldc} * 1], tmm2",
            "tilestored [{c1} + {ldc} * 1 + 64], tmm3",
            a0 = inout(reg) at => _,
            a1 = inout(reg) a1 => _,
            b = inout(reg) $b => _,
            n = inout(reg) $chunks => _,
            a_stride = in(reg) row_bytes,
            b_stride = in(reg) BLOCK_COLS * 4,
            chunk_bytes = in(reg) chunk_bytes,
            b_chunk_bytes = in(reg) TILE_PAIRS * BLOCK_COLS * 4,
            c0 = in(reg) $c,
            c1 = in(reg) $c.wrapping_add(TILE_ROWS * $ldc),
            ldc = in(reg) $ldc * 4,
            options(nostack),
        )
    }};
}
#[cfg(target_arch = "x86_64")]
use block_asm;

#[cfg(target_arch = "x86_64")]
impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: releases the tile state this task configured; touches no memory.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
mod detect {
    use std::arch::x86_64::{__cpuid, __cpuid_count};

    /// CPUID.7.0:EDX bits 22 (AMX-BF16) and 24 (AMX-TILE), CPUID.1:ECX bit 27 (OSXSAVE), XCR0
    /// bits 17 and 18 (tile configuration and data enabled by the OS), then the permission.
    pub fn amx_usable() -> bool {
        if !super::super::gemm_bf16::available() {
            // The packing runs AVX-512; an AMX cpu has it, but say so rather than assume.
            return false;
        }
        // Leaf 7 is below the maximum leaf on any cpu that passed the AVX-512 check above.
        let (leaf1, leaf7) = (__cpuid(1), __cpuid_count(7, 0));
        let amx = leaf7.edx & (1 << 22) != 0 && leaf7.edx & (1 << 24) != 0;
        if !amx || leaf1.ecx & (1 << 27) == 0 {
            return false;
        }
        let xcr0 = xgetbv0();
        if xcr0 & (0b11 << 17) != 0b11 << 17 {
            return false;
        }
        request_tile_data()
    }

    fn xgetbv0() -> u64 {
        let (lo, hi): (u32, u32);
        // SAFETY: OSXSAVE is set (checked by the caller), so XGETBV with ECX = 0 is defined.
        unsafe {
            std::arch::asm!("xgetbv", in("ecx") 0, out("eax") lo, out("edx") hi,
                options(nostack, nomem, preserves_flags));
        }
        (u64::from(hi) << 32) | u64::from(lo)
    }

    /// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: 0 when Linux grants the tile
    /// data to this process (kernels before 5.16 answer EINVAL: no AMX).
    fn request_tile_data() -> bool {
        const SYS_ARCH_PRCTL: usize = 158;
        const ARCH_REQ_XCOMP_PERM: usize = 0x1023;
        const XFEATURE_XTILEDATA: usize = 18;
        let ret: isize;
        // SAFETY: a system call that only changes this process's permitted xsave features.
        unsafe {
            std::arch::asm!("syscall",
                inlateout("rax") SYS_ARCH_PRCTL as isize => ret,
                in("rdi") ARCH_REQ_XCOMP_PERM,
                in("rsi") XFEATURE_XTILEDATA,
                lateout("rcx") _, lateout("r11") _,
                options(nostack));
        }
        ret == 0
    }
}
