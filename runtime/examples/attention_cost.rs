//! Time of the cpu backend's causal attention forward and backward at `peer`'s shape
//! ([8, 8, 256, 32], one kv head per query head), and the GFLOP/s of the products they do, in
//! f32 and as bf16 attention (on the bf16 GEMM's widest tiles where the cpu has them).
//! `cargo run --release -p graphtrain-runtime --example attention_cost [f32|bf16] [strided]
//! [cold]`. With `cold`, 256 MiB are written before each timed call, so that the operands come
//! from memory, as in a step whose arena cycles through the caches.

use graphtrain_runtime::cpu::attention::{
    backward, forward, Dims, Grads, Heads, Products, Qkv, Stats,
};
use graphtrain_runtime::cpu::bf16_pack::round_in_place;
use graphtrain_runtime::cpu::gemm::GemmKernel;
use graphtrain_runtime::cpu::gemm_bf16::{self, Bf16Tiles};
use std::time::Instant;

fn main() {
    let (b, h, s, d) = (8, 8, 256, 32);
    let dims = Dims {
        batch: b,
        heads: h,
        kv_heads: h,
        seq: s,
        head_dim: d,
        causal: true,
        scale: 1.0 / (d as f32).sqrt(),
    };
    let n = b * h * s * d;
    // q, k, v, dout, out, dq, dk, dv: eight [B, H, S, D] tensors, contiguous or (`strided`,
    // as the fused step reads and writes them) transposed views of [B, S, H, D] ones.
    let mut arena: Vec<f32> = (0..8 * n)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
        .collect();
    let flag = |f: &str| std::env::args().skip(2).any(|a| a == f);
    let (strided, cold) = (flag("strided"), flag("cold"));
    let mut evict = vec![0u8; if cold { 256 << 20 } else { 0 }];
    let heads = |t: usize| Heads {
        offset: t * n,
        strides: if strided {
            [h * s * d, d, h * d, 1]
        } else {
            [h * s * d, s * d, d, 1]
        },
    };
    let qkv = Qkv {
        q: heads(0),
        k: heads(1),
        v: heads(2),
    };
    let grads = Grads {
        dq: heads(5),
        dk: heads(6),
        dv: heads(7),
    };
    // Causal products: q kᵀ and p v over the lower triangle, forward; five of them backward.
    let tri = (s * (s + 1) / 2) as f64;
    let fwd_flops = (b * h) as f64 * 2.0 * 2.0 * tri * d as f64;
    let precision = std::env::args().nth(1).unwrap_or_else(|| "f32".into());
    let products = match precision.as_str() {
        "f32" => Products::F32(GemmKernel::Widest),
        "bf16" => {
            // bf16 attention reads bf16 values.
            round_in_place(&mut arena);
            Products::Bf16 {
                tiles: gemm_bf16::available().then(Bf16Tiles::widest),
                kernel: GemmKernel::Widest,
            }
        }
        other => panic!("unknown precision `{other}`: f32 or bf16"),
    };
    println!("{products:?}");
    // The forward's row statistics ([B, H, S, 2]) after the eight tensors.
    arena.extend(std::iter::repeat_n(0.0, b * h * s * 2));
    let stats = Some(Stats(8 * n));
    let base = arena.as_mut_ptr();
    // SAFETY (every call below): the views and the statistics lie in the arena, the outputs
    // apart from the operands; the forward wrote the statistics the backward reads.
    unsafe { forward(base, dims, products, qkv, heads(4), stats) };
    let runs: [(&str, f64, Option<Stats>); 3] = [
        ("forward", fwd_flops, stats),
        ("backward (softmax again)", 2.5 * fwd_flops, None),
        ("backward (forward's statistics)", 2.5 * fwd_flops, stats),
    ];
    // Rounds alternate the three, so that a drift of the host's clock shifts all of them.
    let mut best = [f64::MAX; 3];
    for _ in 0..5 {
        for (i, &(name, _, stats)) in runs.iter().enumerate() {
            let run = || unsafe {
                if name == "forward" {
                    forward(base, dims, products, qkv, heads(4), stats)
                } else {
                    backward(base, dims, products, qkv, heads(3), stats, grads)
                }
            };
            run();
            let mut elapsed = 0.0;
            for _ in 0..10 {
                if cold {
                    evict.iter_mut().for_each(|x| *x = x.wrapping_add(1));
                    std::hint::black_box(&evict);
                }
                let t0 = Instant::now();
                run();
                elapsed += t0.elapsed().as_secs_f64();
            }
            best[i] = best[i].min(elapsed / 10.0);
        }
    }
    for ((name, flops, _), best) in runs.iter().zip(best) {
        println!(
            "attention {name:<32} {:.2} ms  {:.1} GFLOP/s (causal products)",
            best * 1e3,
            flops / best / 1e9
        );
    }
}
