//! Time per element of map and reduce kernels over a 4M-element tensor (the size of `peer`'s
//! attention scores), replayed as bound launches, and the GEMM at 1024^3 through the lowering.
//! `cargo run --release -p graphtrain-runtime --example map_cost` (docs/benchmarks.md).

use graphtrain_ir::text;
use graphtrain_lowering::Mode;
use graphtrain_runtime::{load, Backend};
use std::time::Instant;

fn main() {
    let n = 8 * 8 * 256 * 256;
    let cases = [
        ("add", "%2: f32[{n}] = add(%x, %y)"),
        ("mul", "%2: f32[{n}] = mul(%x, %y)"),
        ("exp", "%2: f32[{n}] = exp(%x)"),
        (
            "exp(x - rowmax)",
            "%r: f32[8,8,256,256] = reshape(%x, shape=[8,8,256,256])
  %m: f32[8,8,256,1] = reduce_max(%r, axes=[3], keepdim=true)
  %b: f32[8,8,256,256] = expand(%m, shape=[8,8,256,256])
  %d: f32[8,8,256,256] = sub(%r, %b)
  %e: f32[8,8,256,256] = exp(%d)
  %2: f32[{n}] = reshape(%e, shape=[{n}])",
        ),
        (
            "rowmax",
            "%r: f32[16384,256] = reshape(%x, shape=[16384,256])
  %m: f32[16384] = reduce_max(%r, axes=[1], keepdim=false)
  %2: f32[16384] = add(%m, %m)",
        ),
        (
            "rowsum",
            "%r: f32[16384,256] = reshape(%x, shape=[16384,256])
  %m: f32[16384] = reduce_sum(%r, axes=[1], keepdim=false)
  %2: f32[16384] = add(%m, %m)",
        ),
        (
            "x / rowsum",
            "%r: f32[8,8,256,256] = reshape(%x, shape=[8,8,256,256])
  %m: f32[8,8,256,1] = reduce_sum(%r, axes=[3], keepdim=true)
  %b: f32[8,8,256,256] = expand(%m, shape=[8,8,256,256])
  %d: f32[8,8,256,256] = div(%r, %b)
  %2: f32[{n}] = reshape(%d, shape=[{n}])",
        ),
        (
            "matmul 1024^3",
            "%sa: f32[1048576] = slice(%x, axis=0, start=0, end=1048576)
  %sb: f32[1048576] = slice(%y, axis=0, start=0, end=1048576)
  %a: f32[1024,1024] = reshape(%sa, shape=[1024,1024])
  %b: f32[1024,1024] = reshape(%sb, shape=[1024,1024])
  %2: f32[1024,1024] = matmul(%a, %b)",
        ),
    ];
    let only = std::env::args().nth(1);
    for (name, body) in cases {
        if only.as_deref().is_some_and(|o| o != name) {
            continue;
        }
        let body = body.replace("{n}", &n.to_string());
        let src = format!(
            "graph g {{\n  input %x: f32[{n}]\n  input %y: f32[{n}]\n  {body}\n  output o = %2\n}}"
        );
        let mut g = text::parse(&src).unwrap();
        graphtrain_ir::verify::verify(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
        for node in &mut g.nodes {
            node.meta.tags.region = Some(0);
        }
        let mut ex = load(&g, Backend::Cpu, Mode::Fused).unwrap();
        ex.run().unwrap();
        let reps: usize = std::env::var("REPS").map_or(20, |r| r.parse().unwrap());
        let t = Instant::now();
        for _ in 0..reps {
            ex.run().unwrap();
        }
        let s = t.elapsed().as_secs_f64() / reps as f64;
        if let Some(report) = ex.profile_report() {
            print!("{report}");
        }
        if name.starts_with("matmul") {
            println!(
                "{name:>16}: {:.2} ms per run, {:.1} GFLOP/s",
                s * 1e3,
                2.0 * 1024f64.powi(3) / s / 1e9
            );
            continue;
        }
        println!(
            "{name:>16}: {:.2} ms per run, {:.2} ns/element, {:.1} GB/s moved",
            s * 1e3,
            s * 1e9 / n as f64,
            3.0 * 4.0 * n as f64 / s / 1e9
        );
    }
}
