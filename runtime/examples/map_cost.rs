//! Time per element of map and reduce kernels over a 4M-element tensor (the size of `peer`'s
//! attention scores), replayed as bound launches, and the GEMM at 1024^3 through the lowering.
//! `cargo run --release -p graphtrain-runtime --example map_cost [CASE]` (docs/benchmarks.md);
//! `PROFILE=1` also times each launch (`Profile::EachStep`), `REPS=N` runs N times (20).

use graphtrain_ir::text;
use graphtrain_lowering::Mode;
use graphtrain_runtime::{compile, Backend, CompileOptions, Profile, SingleRank};
use std::time::Instant;

/// SwiGLU's gradients over bf16 operands `g`, `h1`, `h3` stored in 2 bytes (kept in memory by
/// a second reader), followed by `$tail`.
macro_rules! swiglu_grads {
    ($tail:literal) => {
        concat!(
            "%e0: f32[{n}] = exp(%x)
  %e1: f32[{n}] = exp(%y)
  %e2: f32[{n}] = sin(%x)
  %g: bf16[{n}] = cast(%e0, dtype=bf16)
  %h1: bf16[{n}] = cast(%e1, dtype=bf16)
  %h3: bf16[{n}] = cast(%e2, dtype=bf16)
  %t0: bf16[{n}] = add(%g, %h1)
  %t1: bf16[{n}] = add(%t0, %h3)
  %tf: f32[{n}] = cast(%t1, dtype=f32)
  output t = %tf
  %sg: bf16[{n}] = sigmoid(%h1)
  %sl: bf16[{n}] = silu(%h1)
  %dh3: bf16[{n}] = mul(%g, %sl)
  %onex: bf16[{n}] = full(value=1.0, shape=[{n}], dtype=bf16)
  %oms: bf16[{n}] = sub(%onex, %sg)
  %q: bf16[{n}] = mul(%h1, %oms)
  %q1: bf16[{n}] = add(%q, %onex)
  %q2: bf16[{n}] = mul(%sg, %q1)
  %gh: bf16[{n}] = mul(%g, %h3)
  %dh1: bf16[{n}] = mul(%gh, %q2)
",
            $tail
        )
    };
}

fn main() {
    let n = 8 * 8 * 256 * 256;
    let cases = [
        ("add", "%2: f32[{n}] = add(%x, %y)"),
        ("mul", "%2: f32[{n}] = mul(%x, %y)"),
        ("exp", "%2: f32[{n}] = exp(%x)"),
        ("sigmoid(x)", "%2: f32[{n}] = sigmoid(%x)"),
        ("silu(x)", "%2: f32[{n}] = silu(%x)"),
        (
            "silu(x) * y",
            "%s: f32[{n}] = silu(%x)
  %2: f32[{n}] = mul(%s, %y)",
        ),
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
        // SwiGLU's forward map on operands stored in 2 bytes (bf16 values that a second reader
        // keeps in memory, as the feed-forward's products are in the step).
        (
            "bf16 silu(x) * y",
            "%ex: f32[{n}] = exp(%x)
  %ey: f32[{n}] = exp(%y)
  %a: bf16[{n}] = cast(%ex, dtype=bf16)
  %b: bf16[{n}] = cast(%ey, dtype=bf16)
  %s: bf16[{n}] = silu(%a)
  %m: bf16[{n}] = mul(%s, %b)
  %2: f32[{n}] = cast(%m, dtype=f32)
  %t: bf16[{n}] = add(%a, %b)
  %tf: f32[{n}] = cast(%t, dtype=f32)
  output t = %tf",
        ),
        // SwiGLU's two gradient maps (`g · silu(h1)` and `g · h3 · silu'(h1)`) as the step runs
        // them, two kernels, and summed into one: what one kernel with both outputs would save.
        (
            "swiglu grads apart",
            swiglu_grads!(
                "  %d1f: f32[{n}] = cast(%dh1, dtype=f32)
  output d1 = %d1f
  %2: f32[{n}] = cast(%dh3, dtype=f32)"
            ),
        ),
        (
            "swiglu grads summed",
            swiglu_grads!(
                "  %ds: bf16[{n}] = add(%dh1, %dh3)
  %2: f32[{n}] = cast(%ds, dtype=f32)"
            ),
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
        // A case may name outputs of its own (to keep a value in memory); they go last.
        let (outputs, nodes): (Vec<&str>, Vec<&str>) = body
            .lines()
            .partition(|l| l.trim_start().starts_with("output "));
        let (nodes, outputs) = (nodes.join("\n  "), outputs.join("\n"));
        let src = format!(
            "graph g {{\n  input %x: f32[{n}]\n  input %y: f32[{n}]\n  {nodes}\n{outputs}\n  output o = %2\n}}"
        );
        let mut g = text::parse(&src).unwrap();
        graphtrain_ir::verify::verify(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
        for node in &mut g.nodes {
            node.meta.tags.region = Some(0);
        }
        let pipeline = graphtrain_passes::Pipeline::new(Vec::new());
        let mut options = CompileOptions::new(&pipeline, Mode::Fused);
        if std::env::var("PROFILE").is_ok() {
            options.runtime.profile = Profile::EachStep;
        }
        let mut ex = compile(&g, Backend::Cpu, &options)
            .unwrap()
            .load(Box::new(SingleRank))
            .unwrap();
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
