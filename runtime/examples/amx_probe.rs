//! What bounds the AMX GEMM's tiles on this cpu: `tdpbf16ps` alone (four accumulators, no
//! loads), `tileloadd` alone (eight tiles in turn, L1-resident), and the GEMM's own block
//! (`gemm_amx::Tiles::block`: per 16-pair chunk two A and two B tile loads and four
//! `tdpbf16ps`) over operands in L1, in nanoseconds per instruction and GFLOP/s of one core;
//! the loads and the block from buffers that start on a cache line (as the GEMM's packing
//! buffers do, `cpu/lines.rs`) and from buffers 16 bytes past one (as a Vec may start), where
//! every 64-byte tile row straddles two lines.
//! `cargo run --release -p graphtrain-runtime --example amx_probe`
//!
//! A `tdpbf16ps` is 16 x 16 x 32 multiply-adds (16,384 FLOP). The block loads one tile per
//! `tdpbf16ps` (the most eight tile registers allow: four accumulators, two A and two B), so
//! where a tile load costs more than a `tdpbf16ps`, the loads bound the block, not the
//! arithmetic (docs/benchmarks.md, "AMX tiles").

use graphtrain_runtime::cpu::gemm_amx::{self, ABlock, Tiles};
use graphtrain_runtime::cpu::lines::LineBuffer;
use std::time::Instant;

const FLOP_PER_TDP: f64 = 16.0 * 16.0 * 32.0 * 2.0;

fn main() {
    #[cfg(target_arch = "x86_64")]
    probe();
    #[cfg(not(target_arch = "x86_64"))]
    println!("AMX is an x86-64 extension: nothing to measure here");
}

#[cfg(target_arch = "x86_64")]
fn probe() {
    if !gemm_amx::available() {
        println!("this cpu (or its kernel) does not run AMX tiles: nothing to measure");
        return;
    }
    // bf16 pairs of 1.0: no denormals, no overflow over the repetitions.
    let mut buffer = LineBuffer::new();
    let ones = buffer.u32s(8 * 256 + 16);
    ones.fill(0x3f80_3f80);
    let ones = ones.as_ptr();
    let reps = 1_000_000u64;
    // SAFETY: `available()` above; the tile instructions read `ones` inside its bounds (16 rows
    // of 64 bytes, 64 bytes apart, from offsets up to 7 KiB) and write only tiles.
    let tiles = unsafe { Tiles::configure() };
    let t0 = Instant::now();
    // SAFETY: as above.
    unsafe {
        std::arch::asm!(
            "tileloadd tmm4, [{a} + {s} * 1]",
            "tileloadd tmm5, [{a} + {s} * 1]",
            "tileloadd tmm6, [{a} + {s} * 1]",
            "tileloadd tmm7, [{a} + {s} * 1]",
            "2:",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "dec {n}",
            "jnz 2b",
            a = in(reg) ones,
            s = in(reg) 64usize,
            n = inout(reg) reps => _,
            options(nostack),
        );
    }
    let per_tdp = t0.elapsed().as_secs_f64() / (reps as f64 * 4.0);
    drop(tiles);
    println!(
        "tdpbf16ps alone                {:5.1} ns each  {:6.0} GFLOP/s",
        per_tdp * 1e9,
        FLOP_PER_TDP / per_tdp / 1e9
    );
    for (what, skew) in [("on a cache line", 0), ("16 bytes past one", 4)] {
        // SAFETY: as above: `skew` (4 lanes) is inside the 16 spare lanes.
        let per_load = unsafe { loads(ones.add(skew), reps) };
        println!(
            "tileloadd alone, {what:<17} {:5.1} ns each (1 KiB)",
            per_load * 1e9
        );
        let per_tdp = block(skew, reps);
        println!(
            "Tiles::block, {what:<17}    {:5.1} ns per tdpbf16ps  {:6.0} GFLOP/s (k 256)",
            per_tdp * 1e9,
            FLOP_PER_TDP / per_tdp / 1e9
        );
    }
}

/// Seconds per `tileloadd` of eight 1 KiB tiles in turn from `from`, `reps` times.
///
/// # Safety
/// `gemm_amx::available()`; 8 KiB readable from `from`.
#[cfg(target_arch = "x86_64")]
unsafe fn loads(from: *const u32, reps: u64) -> f64 {
    // SAFETY: the caller's contract.
    let tiles = unsafe { Tiles::configure() };
    let t0 = Instant::now();
    // SAFETY: eight tiles of 16 rows of 64 bytes, 64 bytes apart, from offsets up to 7 KiB.
    unsafe {
        std::arch::asm!(
            "2:",
            "tileloadd tmm0, [{a} + {s} * 1]",
            "tileloadd tmm1, [{a} + {s} * 1 + 1024]",
            "tileloadd tmm2, [{a} + {s} * 1 + 2048]",
            "tileloadd tmm3, [{a} + {s} * 1 + 3072]",
            "tileloadd tmm4, [{a} + {s} * 1 + 4096]",
            "tileloadd tmm5, [{a} + {s} * 1 + 5120]",
            "tileloadd tmm6, [{a} + {s} * 1 + 6144]",
            "tileloadd tmm7, [{a} + {s} * 1 + 7168]",
            "dec {n}",
            "jnz 2b",
            a = in(reg) from,
            s = in(reg) 64usize,
            n = inout(reg) reps => _,
            options(nostack),
        );
    }
    let per_load = t0.elapsed().as_secs_f64() / (reps as f64 * 8.0);
    drop(tiles);
    per_load
}

/// Seconds per `tdpbf16ps` of the GEMM's block over 8 chunks (k = 256), A, B and C in L1,
/// each `skew` lanes past a cache line.
#[cfg(target_arch = "x86_64")]
fn block(skew: usize, reps: u64) -> f64 {
    let chunks = 8;
    let (mut a, mut b, mut c) = (LineBuffer::new(), LineBuffer::new(), LineBuffer::new());
    let a = &mut a.u32s(2 * chunks * 256 + skew)[skew..];
    let b = &mut b.u32s(chunks * 16 * 32 + skew)[skew..];
    let c = &mut c.f32s(32 * 32 + skew)[skew..];
    a.fill(0x3f80_3f80);
    b.fill(0x3f80_3f80);
    // SAFETY: `available()` (the caller checked); `a` holds both row tiles' chunks, `b` a panel
    // of `chunks * 16` pairs x 32 columns, `c` 32 x 32.
    let tiles = unsafe { Tiles::configure() };
    let calls = reps / chunks as u64;
    let t0 = Instant::now();
    for _ in 0..calls {
        // SAFETY: as above.
        unsafe {
            tiles.block(
                ABlock::packed(a.as_ptr(), chunks),
                b.as_ptr(),
                chunks,
                c.as_mut_ptr(),
                32,
            )
        };
    }
    let per_tdp = t0.elapsed().as_secs_f64() / (calls as f64 * chunks as f64 * 4.0);
    drop(tiles);
    per_tdp
}
