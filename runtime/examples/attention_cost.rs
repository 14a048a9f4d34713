//! Time of the cpu backend's causal attention forward and backward at `peer`'s shape
//! ([8, 8, 256, 32], one kv head per query head), and the GFLOP/s of the products they do.
//! `cargo run --release -p graphtrain-runtime --example attention_cost`

use graphtrain_runtime::cpu::attention::{backward, forward, Dims, Grads, Heads, Qkv};
use graphtrain_runtime::cpu::gemm::GemmKernel;
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
    // q, k, v, dout, out, dq, dk, dv: eight contiguous [B, H, S, D] tensors.
    let mut arena: Vec<f32> = (0..8 * n)
        .map(|i| ((i * 7919) % 1000) as f32 * 1e-3 - 0.5)
        .collect();
    let heads = |t: usize| Heads {
        offset: t * n,
        strides: [h * s * d, s * d, d, 1],
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
    let base = arena.as_mut_ptr();
    for (name, flops) in [("forward", fwd_flops), ("backward", 2.5 * fwd_flops)] {
        let run = || unsafe {
            if name == "forward" {
                forward(base, dims, GemmKernel::Widest, qkv, heads(4))
            } else {
                backward(base, dims, GemmKernel::Widest, qkv, heads(3), grads)
            }
        };
        run();
        let mut best = f64::MAX;
        for _ in 0..5 {
            let t0 = Instant::now();
            for _ in 0..10 {
                run();
            }
            best = best.min(t0.elapsed().as_secs_f64() / 10.0);
        }
        println!(
            "attention {name:<8} {:.2} ms  {:.1} GFLOP/s (causal products)",
            best * 1e3,
            flops / best / 1e9
        );
    }
}
