//! Launch cost of the cpu runtime: 1,000 launches of a tiny map kernel, then one sync.
//! `cargo run --release -p graphtrain-runtime --example launch_cost` (docs/benchmarks.md).

use cubecl::prelude::*;
use graphtrain_lowering::Expr;
use graphtrain_runtime::shared::kernels::map_kernel;
use std::time::Instant;

fn main() {
    let client = cubecl::Device::cpu().unwrap().client();
    let data = vec![1.0f32; 1 << 16];
    let arena = client.create_from_slice(f32::as_bytes(&data));
    let buffer = || unsafe { BufferArg::from_raw_parts(arena.clone(), data.len() / 8) };
    let e = Expr::Unary(graphtrain_ir::UnaryOp::Exp, Box::new(Expr::Input(0)));
    for units in [1u32, 2] {
        for rep in 0..3 {
            let t = Instant::now();
            for _ in 0..1000 {
                unsafe {
                    map_kernel::launch_unchecked(
                        &client,
                        CubeCount::Static(1, 1, 1),
                        CubeDim::new_1d(units),
                        8,
                        // The six inputs' buffers and the output's: all the one arena.
                        buffer(),
                        buffer(),
                        buffer(),
                        buffer(),
                        buffer(),
                        buffer(),
                        buffer(),
                        // Input offsets (in vectors) and broadcast parameters of six inputs,
                        // then the output's first element, the width, its log2, the row length,
                        // the output offset (in vectors) and the length (in vectors); all inputs
                        // read in full.
                        0usize,
                        0usize,
                        0usize,
                        0usize,
                        0usize,
                        0usize,
                        1usize,
                        1usize,
                        1usize,
                        1usize,
                        1usize,
                        1usize,
                        0usize,
                        8usize,
                        3usize,
                        1usize,
                        1024usize,
                        16usize,
                        0u32,
                        e.clone(),
                    )
                };
            }
            cubecl::future::block_on(client.sync()).unwrap();
            println!(
                "units {units} rep {rep}: {:.1} us/launch",
                t.elapsed().as_secs_f64() * 1e3
            );
        }
    }
}
