//! GFLOP/s of the native GEMM on the shapes `peer`'s train step runs (from its profile), called
//! directly on host buffers, on one thread and on the pool's full width.
//! `cargo run --release -p graphtrain-runtime --example gemm_shapes [THREADS] [KERNEL] [sums]
//! [cold]`, KERNEL `f32` (the default), `vdpbf16ps` or `amx` (the bf16 GEMM's tiles, where the
//! cpu has them), which round C to bf16 as a bf16 matmul does, or with `sums` leave its f32 sums
//! (what the rounding costs). With `cold`, 256 MiB are written between calls and only the calls
//! are timed, so the operands come from memory as they do inside a train step, whose arena
//! cycles through more than the caches hold (docs/benchmarks.md).
//!
//! This machine's speed drifts by up to 1.5x within seconds (a shared host: a register-only FMA
//! loop measured 92-153 GFLOP/s per core within a minute), so compare two builds by alternating
//! them several times, and compare with `torch.matmul` in the same run of measurements
//! (docs/benchmarks.md).

use graphtrain_runtime::cpu::gemm::{sgemm, Layout};
use graphtrain_runtime::cpu::gemm_amx;
use graphtrain_runtime::cpu::gemm_bf16::{self, Bf16Tiles};
use std::time::Instant;

/// (label, m, n, k, A stored transposed, B stored transposed)
const SHAPES: &[(&str, usize, usize, usize, bool, bool)] = &[
    ("x @ w      2048x256x256", 2048, 256, 256, false, false),
    ("x @ w1     2048x768x256", 2048, 768, 256, false, false),
    ("x @ w1T    2048x768x256", 2048, 768, 256, false, true),
    ("h @ w2     2048x256x768", 2048, 256, 768, false, false),
    ("dy @ wT    2048x256x256", 2048, 256, 256, false, true),
    ("xT @ dy    256x256x2048", 256, 256, 2048, true, false),
    ("hT @ dy    768x256x2048", 768, 256, 2048, true, false),
    ("xT @ dy    256x768x2048", 256, 768, 2048, true, false),
    ("x @ head   2048x2048x256", 2048, 2048, 256, false, false),
    ("square     1024^3", 1024, 1024, 1024, false, false),
];

fn layout(rows: usize, cols: usize, trans: bool) -> Layout {
    let (row_stride, col_stride) = if trans { (1, rows) } else { (cols, 1) };
    Layout {
        row_stride,
        col_stride,
        batch_stride: rows * cols,
    }
}

fn main() {
    let width = graphtrain_runtime::cpu::pool::Pool::global().width();
    let threads: Vec<usize> = match std::env::args().nth(1) {
        Some(t) => vec![t.parse().expect("THREADS must be a number")],
        None => vec![1, width],
    };
    let tiles = match std::env::args().nth(2).as_deref() {
        None | Some("f32") => None,
        Some("vdpbf16ps") => Some(Bf16Tiles::Vdpbf16ps),
        Some("amx") => Some(Bf16Tiles::Amx),
        Some(other) => panic!("KERNEL is f32, vdpbf16ps or amx, not {other}"),
    };
    let (mut round_c, mut cold) = (true, false);
    for flag in std::env::args().skip(3) {
        match flag.as_str() {
            "sums" => round_c = false,
            "cold" => cold = true,
            other => panic!("the arguments after KERNEL are `sums` and `cold`, not {other}"),
        }
    }
    // Written between calls in `cold` runs: more than the caches this example has met hold.
    let mut evict = vec![0u8; if cold { 256 << 20 } else { 0 }];
    match tiles {
        Some(Bf16Tiles::Amx) => assert!(gemm_amx::available(), "this cpu runs no AMX tiles"),
        Some(Bf16Tiles::Vdpbf16ps) => assert!(gemm_bf16::available(), "no AVX512_BF16 here"),
        None => {}
    }
    for &(label, m, n, k, ta, tb) in SHAPES {
        let a: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7919) % 1000) as f32 * 1e-3)
            .collect();
        let b: Vec<f32> = (0..k * n)
            .map(|i| ((i * 104729) % 1000) as f32 * 1e-3)
            .collect();
        let mut c = vec![0f32; m * n];
        let (la, lb) = (layout(m, k, ta), layout(k, n, tb));
        let flops = 2.0 * (m * n * k) as f64;
        let mut line = format!("{label:<26}");
        for &t in &threads {
            // SAFETY: a, b and c hold exactly the m x k, k x n and m x n elements the layouts
            // address, and c overlaps neither.
            let run = |c: &mut [f32]| unsafe {
                let (pa, pb, pc) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
                match tiles {
                    Some(tiles) => {
                        gemm_bf16::gemm_bf16(tiles, 1, m, n, k, pa, la, pb, lb, pc, t, round_c)
                    }
                    None => sgemm(1, m, n, k, pa, la, pb, lb, pc, t),
                }
            };
            for _ in 0..3 {
                run(&mut c);
            }
            let reps = ((1e9 * t as f64 / flops) as usize).clamp(3, if cold { 40 } else { 400 });
            let mut best = f64::MAX;
            for _ in 0..3 {
                let mut elapsed = 0.0;
                for _ in 0..reps {
                    if cold {
                        evict.iter_mut().for_each(|x| *x = x.wrapping_add(1));
                        std::hint::black_box(&evict);
                    }
                    let t0 = Instant::now();
                    run(&mut c);
                    elapsed += t0.elapsed().as_secs_f64();
                }
                best = best.min(elapsed / reps as f64);
            }
            line += &format!("  {t} thr {:6.1} GFLOP/s", flops / best / 1e9);
        }
        println!("{line}");
    }
}
