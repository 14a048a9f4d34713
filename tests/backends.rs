//! The compiled backends (cpu, and wgpu where it is built and has an adapter) against the
//! reference interpreter, op by op and for whole train steps, plus the bitwise gate between the
//! fused and the eager lowering on the same backend.
//!
//! Every case runs a small graph (text format) on seeded random inputs: interpreter, cpu eager,
//! cpu fused, both again with every step captured (replayed as bound launches, not dispatched
//! through cubecl), and wgpu eager and fused (the same composites kept, run on its own kernels).
//! Each backend must match the interpreter to 1e-4 relative (the interpreter computes in f64
//! and rounds each op to f32; the backends compute in f32); on each backend eager must equal
//! fused, and a replayed run the dispatched one, bit for bit, and maps read 8 lanes at a time
//! the same bits as the widest vectors (16 with AVX-512). Shapes are odd on purpose: not
//! multiples of the vector widths or the GEMM tiles.
//!
//! Every comparison goes through `common` (`tests/common/mod.rs`): NaN or infinity on either
//! side fails (in the bitwise check too), output and element counts must match, and "relative"
//! is `|got - want| <= tol * max(|want|, floor)` with the floor the reference tensor's RMS
//! (`common::SCALE_FLOOR`), so each tensor is compared at its own scale. The tests at the end
//! show that the helper fails where it must.
//!
//! wgpu runs on Mesa's lavapipe where there is no GPU. Without an adapter the wgpu half of a
//! test is skipped with a message, except under CI (`CI` set), where it fails: CI installs
//! lavapipe, so a missing adapter there is a broken setup, not a reason to pass.

mod common;

use common::{compare_named, compare_outputs, compare_values, Agree};
use graphtrain::gate::{self, RunRecord};
use graphtrain_ir::{text, DType, Graph, HostTensor, TensorType};
use graphtrain_lowering::Mode;
use graphtrain_passes::testing::random_inputs;
use graphtrain_runtime::{
    run_once, run_once_with, Backend, DeviceMatmul, GemmKernel, MapVector, RuntimeOptions,
};

/// The names of `g`'s outputs, in order.
fn output_names(g: &Graph) -> Vec<String> {
    g.outputs.iter().map(|o| o.name.clone()).collect()
}

/// Panics with `what` and every difference when `got` and `want` do not agree as `how` says.
fn assert_outputs(
    what: &str,
    names: &[String],
    got: &[HostTensor],
    want: &[HostTensor],
    how: Agree,
) {
    if let Err(e) = compare_outputs(names, got, want, how) {
        panic!("{what}:\n{e}");
    }
}

/// Panics unless two training runs agree as `how` says on every step's loss and grad norm and
/// on every parameter and optimizer-state tensor at the end.
fn assert_runs(what: &str, got: &RunRecord, want: &RunRecord, how: Agree) {
    let steps = [want.losses.len()];
    let errors: Vec<String> = [
        compare_values("loss", &steps, &got.losses, &want.losses, how),
        compare_values("grad_norm", &steps, &got.grad_norms, &want.grad_norms, how),
        compare_named(&got.state, &want.state, how),
    ]
    .into_iter()
    .filter_map(Result::err)
    .collect();
    assert!(errors.is_empty(), "{what}:\n{}", errors.join("\n"));
}

/// `g` with every node in capture region 0, so the cpu backend replays all its kernel steps
/// as bound launches instead of dispatching them through cubecl.
fn captured(g: &Graph) -> Graph {
    let mut g = g.clone();
    for n in &mut g.nodes {
        n.meta.tags.region = Some(0);
    }
    g
}

fn device_backends() -> Vec<Backend> {
    gate::device_backends_for_tests()
}

/// Reports whether the wgpu halves of this file's tests (and of `gate`, `checkpoint`, `cli` and
/// `eval`) ran: ignored, with the reason, on a machine with no Vulkan driver (decided at build
/// time by `build.rs`); where a driver is installed, wgpu must find an adapter.
#[test]
#[cfg_attr(
    not(feature = "wgpu"),
    ignore = "built without the wgpu feature: the wgpu halves are not run"
)]
#[cfg_attr(
    not(vulkan_driver_found),
    ignore = "no Vulkan driver here: the wgpu halves of the backend tests are not run \
              (scripts/setup.sh installs Mesa's lavapipe)"
)]
fn the_wgpu_halves_run_here() {
    assert_eq!(
        device_backends(),
        vec![Backend::Wgpu],
        "a Vulkan driver is installed, so wgpu must run"
    );
}

fn check(name: &str, src: &str) {
    let g = text::parse(src).unwrap_or_else(|e| panic!("{name}: {e}"));
    graphtrain_ir::verify::verify(&g).unwrap_or_else(|e| panic!("{name}: {e}"));
    let names = output_names(&g);
    for seed in 0..2 {
        let inputs = random_inputs(&g, seed);
        let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
        let eager = run_once(&g, Backend::Cpu, Mode::Eager, &inputs)
            .unwrap_or_else(|e| panic!("{name}: cpu eager: {e}"));
        let fused = run_once(&g, Backend::Cpu, Mode::Fused, &inputs)
            .unwrap_or_else(|e| panic!("{name}: cpu fused: {e}"));
        let replayed = [Mode::Eager, Mode::Fused].map(|mode| {
            run_once(&captured(&g), Backend::Cpu, mode, &inputs)
                .unwrap_or_else(|e| panic!("{name}: cpu {mode:?} captured: {e}"))
        });
        let eight_lanes = RuntimeOptions {
            map_vector: MapVector::Eight,
            ..RuntimeOptions::default()
        };
        let narrow = run_once_with(&g, Backend::Cpu, Mode::Fused, eight_lanes, &inputs)
            .unwrap_or_else(|e| panic!("{name}: cpu fused, maps at 8 lanes: {e}"));
        let case = |what: &str| format!("{name} (seed {seed}): {what}");
        assert_outputs(
            &case("cpu eager vs the interpreter"),
            &names,
            &eager,
            &want,
            Agree::Relative(1e-4),
        );
        assert_outputs(
            &case("cpu fused vs cpu eager"),
            &names,
            &fused,
            &eager,
            Agree::Bitwise,
        );
        assert_outputs(
            &case("cpu fused: maps at 8 lanes vs the widest"),
            &names,
            &narrow,
            &fused,
            Agree::Bitwise,
        );
        assert_outputs(
            &case("cpu eager: replayed launches vs dispatched ones"),
            &names,
            &replayed[0],
            &eager,
            Agree::Bitwise,
        );
        assert_outputs(
            &case("cpu fused: replayed launches vs dispatched ones"),
            &names,
            &replayed[1],
            &fused,
            Agree::Bitwise,
        );
        for backend in device_backends() {
            let [eager, fused] = [Mode::Eager, Mode::Fused].map(|mode| {
                run_once(&g, backend, mode, &inputs)
                    .unwrap_or_else(|e| panic!("{name}: {backend} {mode:?}: {e}"))
            });
            assert_outputs(
                &case(&format!("{backend} eager vs the interpreter")),
                &names,
                &eager,
                &want,
                Agree::Relative(1e-4),
            );
            assert_outputs(
                &case(&format!("{backend} fused vs {backend} eager")),
                &names,
                &fused,
                &eager,
                Agree::Bitwise,
            );
        }
    }
}

#[test]
fn elementwise_chains_with_odd_lengths() {
    check(
        "unary/binary chain",
        "graph g {
  input %x: f32[3,37]
  input %y: f32[3,37]
  %2: f32[3,37] = mul(%x, %y)
  %3: f32[3,37] = exp(%2)
  %4: f32[3,37] = add(%3, %x)
  %5: f32[3,37] = silu(%4)
  %6: f32[3,37] = tanh(%5)
  %7: f32[3,37] = sigmoid(%6)
  %8: f32[3,37] = sub(%7, %y)
  %9: f32[3,37] = square(%8)
  %10: f32[3,37] = max(%9, %x)
  %11: f32[3,37] = min(%10, %y)
  %12: f32[3,37] = neg(%11)
  %13: f32[3,37] = abs(%12)
  %14: f32[3,37] = add_scalar(%13, value=0.5)
  %15: f32[3,37] = sqrt(%14)
  %16: f32[3,37] = rsqrt(%14)
  %17: f32[3,37] = recip(%16)
  %18: f32[3,37] = log(%17)
  %19: f32[3,37] = sin(%18)
  %20: f32[3,37] = cos(%19)
  %21: f32[3,37] = mul_scalar(%20, value=-1.5)
  %22: f32[3,37] = div(%21, %15)
  %23: f32[3,37] = pow_scalar(%14, exponent=1.5)
  output a = %22
  output b = %23
  output c = %5
}",
    );
}

/// A product feeding a sum is where one kernel would round differently (an FMA); the fused
/// lowering keeps it bitwise anyway.
#[test]
fn products_feeding_sums_stay_bitwise() {
    check(
        "mul-add",
        "graph g {
  input %x: f32[67]
  input %y: f32[67]
  input %z: f32[67]
  %3: f32[67] = mul(%x, %y)
  %4: f32[67] = add(%3, %z)
  %5: f32[67] = square(%4)
  %6: f32[67] = sub(%z, %5)
  %7: f32[67] = mul_scalar(%6, value=0.9)
  %8: f32[67] = add_scalar(%7, value=0.1)
  output a = %8
}",
    );
}

/// A value read twice on the way to one product (SiLU's gradient), computed inside the final
/// kernel in fused mode and materialized in eager mode: the same bits.
#[test]
fn converging_readers() {
    check(
        "converging readers",
        "graph g {
  input %x: f32[37]
  input %d: f32[37]
  %1: f32[37] = sigmoid(%x)
  %2: f32[37] = neg(%1)
  %3: f32[37] = add_scalar(%2, value=1.0)
  %4: f32[37] = mul(%x, %3)
  %5: f32[37] = add_scalar(%4, value=1.0)
  %6: f32[37] = mul(%1, %5)
  %7: f32[37] = mul(%d, %6)
  output a = %7
}",
    );
}

#[test]
fn compare_select_and_casts() {
    check(
        "compare/select",
        "graph g {
  input %x: f32[5,9]
  input %y: f32[5,9]
  %2: bool[5,9] = gt(%x, %y)
  %3: f32[5,9] = select(%2, %x, %y)
  %4: bool[5,9] = le(%x, %y)
  %5: f32[5,9] = cast(%4, dtype=f32)
  %6: f32[5,9] = add(%3, %5)
  %7: i32[5,9] = cast(%6, dtype=i32)
  output a = %6
  output b = %7
}",
    );
}

#[test]
fn broadcasts_transposes_slices_and_concat() {
    check(
        "layout",
        "graph g {
  input %x: f32[3,5,7]
  input %s: f32[1,1,1]
  %2: f32[7,3,5] = transpose(%x, perm=[2,0,1])
  %3: f32[7,3,5] = expand(%s, shape=[7,3,5])
  %4: f32[7,3,5] = add(%2, %3)
  %5: f32[7,2,5] = slice(%4, axis=1, start=1, end=3)
  %6: f32[7,5,5] = concat(%5, %4, axis=1)
  %7: f32[35,5] = reshape(%6, shape=[35,5])
  %8: f32[3,1,7] = slice(%x, axis=1, start=2, end=3)
  %9: f32[3,4,7] = expand(%8, shape=[3,4,7])
  output a = %7
  output b = %9
}",
    );
}

/// Expands read in place by elementwise ops: row and column broadcasts, vector-aligned (16, 24)
/// and not (5, 7), and one that is neither pattern (a middle axis) and stays a copy.
#[test]
fn broadcast_reads_in_elementwise_ops() {
    check(
        "broadcast",
        "graph g {
  input %x: f32[6,16]
  input %r: f32[6,1]
  input %c: f32[1,16]
  input %y: f32[5,7]
  input %yr: f32[5,1]
  input %yc: f32[1,7]
  input %z: f32[2,3,24]
  input %zm: f32[2,1,24]
  %8: f32[6,16] = expand(%r, shape=[6,16])
  %9: f32[6,16] = expand(%c, shape=[6,16])
  %10: f32[6,16] = sub(%x, %8)
  %11: f32[6,16] = mul(%10, %9)
  %12: f32[6,16] = exp(%11)
  %13: f32[5,7] = expand(%yr, shape=[5,7])
  %14: f32[5,7] = expand(%yc, shape=[5,7])
  %15: f32[5,7] = div(%y, %13)
  %16: f32[5,7] = add(%15, %14)
  %17: f32[2,3,24] = expand(%zm, shape=[2,3,24])
  %18: f32[2,3,24] = mul(%z, %17)
  output a = %12
  output b = %16
  output c = %18
}",
    );
}

/// Gather and scatter-add along the first, a middle and the last axis, with indices that vary
/// along a row and with rows of one index (the embedding's pattern, copied as whole rows).
#[test]
fn gather_and_scatter_add_along_every_axis() {
    check(
        "gather/scatter_add",
        "graph g {
  input %s: f32[6,5]
  input %i0: i32[4,5]
  input %i1: i32[6,3]
  input %e: i32[4,1]
  input %a0: f32[4,5]
  input %a1: f32[6,3]
  input %t: f32[3,4,5]
  input %i2: i32[3,2,5]
  input %a2: f32[3,2,5]
  %x: i32[4,5] = expand(%e, shape=[4,5])
  %g0: f32[4,5] = gather(%s, %i0, axis=0)
  %g1: f32[6,3] = gather(%s, %i1, axis=1)
  %g2: f32[4,5] = gather(%s, %x, axis=0)
  %g3: f32[3,2,5] = gather(%t, %i2, axis=1)
  %s0: f32[6,5] = scatter_add(%s, %i0, %a0, axis=0)
  %s1: f32[6,5] = scatter_add(%s, %x, %a0, axis=0)
  %s2: f32[6,5] = scatter_add(%s, %i1, %a1, axis=1)
  %s3: f32[3,4,5] = scatter_add(%t, %i2, %a2, axis=1)
  output g0 = %g0
  output g1 = %g1
  output g2 = %g2
  output g3 = %g3
  output s0 = %s0
  output s1 = %s1
  output s2 = %s2
  output s3 = %s3
}",
    );
}

/// `%y`'s reductions over outer and middle axes keep a contiguous inner dim of whole vectors
/// (24), so they run eight outputs at a time (`reduce_cols_kernel`); `%x`'s (11) cannot.
#[test]
fn reductions_over_leading_trailing_and_middle_axes() {
    check(
        "reduce",
        "graph g {
  input %x: f32[4,6,11]
  input %y: f32[3,5,24]
  %1: f32[4,6] = reduce_sum(%x, axes=[2], keepdim=false)
  %2: f32[11] = reduce_sum(%x, axes=[0,1], keepdim=false)
  %3: f32[4,1,11] = reduce_max(%x, axes=[1], keepdim=true)
  %4: f32[] = reduce_sum(%x, axes=[0,1,2], keepdim=false)
  %5: f32[24] = reduce_sum(%y, axes=[0,1], keepdim=false)
  %6: f32[3,24] = reduce_max(%y, axes=[1], keepdim=false)
  %7: f32[1,5,24] = reduce_sum(%y, axes=[0], keepdim=true)
  output a = %1
  output b = %2
  output c = %3
  output d = %4
  output e = %5
  output f = %6
  output g = %7
}",
    );
}

/// One op over values in memory, at most one of them full-size, with several elementwise
/// readers of its size (SiLU's output; RMSNorm's `x · rstd`) is recomputed by each reader
/// instead of stored, with the same bits as eager, which stores it. Stored still: a product of
/// two full-size values (recomputing it would keep both alive), and a value that a reduction
/// also reads.
#[test]
fn one_op_read_by_several_maps_is_recomputed() {
    let src = "graph g {
  input %x: f32[3,40]
  input %y: f32[3,40]
  input %z: f32[3,40]
  input %r: f32[3,1]
  %4: f32[3,40] = silu(%x)
  %5: f32[3,40] = mul(%4, %y)
  %6: f32[3,40] = sub(%z, %4)
  %7: f32[3,40] = exp(%x)
  %8: f32[3,40] = mul(%7, %y)
  %9: f32[3] = reduce_max(%7, axes=[1], keepdim=false)
  %10: f32[3,40] = expand(%r, shape=[3,40])
  %11: f32[3,40] = mul(%x, %10)
  %12: f32[3,40] = mul(%11, %y)
  %13: f32[3,40] = add(%11, %z)
  %14: f32[3,40] = mul(%x, %y)
  %15: f32[3,40] = neg(%14)
  %16: f32[3,40] = exp(%14)
  output a = %5
  output b = %6
  output c = %8
  output d = %9
  output e = %12
  output f = %13
  output g = %15
  output h = %16
}";
    let g = text::parse(src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    let program = graphtrain_lowering::lower(&g, Mode::Fused).unwrap();
    let writes: Vec<u32> = program
        .steps
        .iter()
        .filter(|s| s.kind() == "map")
        .map(|s| s.writes().0)
        .collect();
    // Recomputed, so never written: %4 (silu) and %11 (x · r). Stored: %7 (a reduction reads
    // it) and %14 (two full-size operands).
    assert_eq!(
        writes,
        vec![5, 6, 7, 8, 12, 13, 14, 15, 16],
        "{:?}",
        program.steps
    );
    check("one op read by several maps", src);
}

/// Elementwise producers of a sum or max run inside the reduction (`Step::MapReduce`), over
/// trailing dims (one output per row) and over leading dims (one per column): squares
/// (RMSNorm's), chains through `exp` and `tanh` with per-row and per-column broadcasts (read
/// on the element's row or column), and enough work to split over every core; over columns, 33
/// vectors of 8 split as 17 and 16 between two units, so each unit runs whole groups of 8 side
/// by side and one a single vector after them. Bitwise equal to eager's map then reduce on each
/// backend. Declined, and kept as a map and a reduce: rows of
/// 13 or 12, a middle axis, and a producer that is also an output.
#[test]
fn reductions_fused_with_their_producers() {
    let src = "graph g {
  input %x: f32[40,48]
  input %w: f32[1,48]
  input %r: f32[40,1]
  input %z: f32[16,4,8]
  input %a: f32[512,64]
  input %b: f32[512,64]
  input %o: f32[6,13]
  input %ar: f32[512,1]
  input %u: f32[3,5,24]
  input %uc: f32[1,1,24]
  input %m: f32[4,6,16]
  input %t: f32[10,12]
  input %c: f32[72,264]
  input %cr: f32[72,1]
  %12: f32[40,48] = square(%x)
  %13: f32[40,1] = reduce_sum(%12, axes=[1], keepdim=true)
  %14: f32[40,48] = expand(%w, shape=[40,48])
  %15: f32[40,48] = expand(%r, shape=[40,48])
  %16: f32[40,48] = mul(%x, %14)
  %17: f32[40,48] = sub(%16, %15)
  %18: f32[40,48] = exp(%17)
  %19: f32[40] = reduce_max(%18, axes=[1], keepdim=false)
  %20: f32[16,4,8] = tanh(%z)
  %21: f32[16] = reduce_sum(%20, axes=[1,2], keepdim=false)
  %22: f32[512,64] = mul(%a, %b)
  %23: f32[512] = reduce_sum(%22, axes=[1], keepdim=false)
  %24: f32[6,13] = square(%o)
  %25: f32[6] = reduce_sum(%24, axes=[1], keepdim=false)
  %26: f32[16,4,8] = sigmoid(%z)
  %27: f32[16] = reduce_max(%26, axes=[1,2], keepdim=false)
  %28: f32[512,64] = expand(%ar, shape=[512,64])
  %29: f32[512,64] = mul(%a, %28)
  %30: f32[512,64] = add(%29, %b)
  %31: f32[64] = reduce_sum(%30, axes=[0], keepdim=false)
  %32: f32[40,48] = mul(%x, %15)
  %33: f32[1,48] = reduce_sum(%32, axes=[0], keepdim=true)
  %34: f32[3,5,24] = expand(%uc, shape=[3,5,24])
  %35: f32[3,5,24] = mul(%u, %34)
  %36: f32[3,5,24] = exp(%35)
  %37: f32[24] = reduce_max(%36, axes=[0,1], keepdim=false)
  %38: f32[4,6,16] = tanh(%m)
  %39: f32[4,16] = reduce_sum(%38, axes=[1], keepdim=false)
  %40: f32[10,12] = square(%t)
  %41: f32[12] = reduce_sum(%40, axes=[0], keepdim=false)
  %42: f32[72,264] = expand(%cr, shape=[72,264])
  %43: f32[72,264] = mul(%c, %42)
  %44: f32[264] = reduce_sum(%43, axes=[0], keepdim=false)
  %45: f32[72,264] = exp(%c)
  %46: f32[264] = reduce_max(%45, axes=[0], keepdim=false)
  output a = %13
  output b = %19
  output c = %21
  output d = %23
  output e = %25
  output f = %27
  output g = %26
  output h = %31
  output i = %33
  output j = %37
  output k = %39
  output l = %41
  output m = %44
  output n = %46
}";
    let g = text::parse(src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    let program = graphtrain_lowering::lower(&g, Mode::Fused).unwrap();
    let kinds: Vec<&str> = program.steps.iter().map(|s| s.kind()).collect();
    let count = |k: &str| kinds.iter().filter(|&&x| x == k).count();
    // Fused: a, b, c, d over rows; h, i, j, m, n over columns. Not: e and l (rows of 13 and
    // 12), f (its producer is an output), k (a middle axis).
    assert_eq!(count("map_reduce"), 9, "{kinds:?}");
    assert_eq!(count("reduce"), 4, "{kinds:?}");
    check("reductions fused with their producers", src);
}

/// Sizes large enough that maps, copies and reductions split over every core (4096 elements,
/// 64 outputs), odd so the vector tail runs too, and a copy over five strided dims (peeled into
/// several launches).
#[test]
fn multi_unit_launches_with_odd_sizes() {
    check(
        "multi-unit",
        "graph g {
  input %x: f32[67,129]
  input %y: f32[67,129]
  input %r: f32[67,1]
  input %t: f32[2,3,5,7,11]
  %4: f32[67,129] = mul(%x, %y)
  %5: f32[67,129] = exp(%4)
  %6: f32[67,129] = expand(%r, shape=[67,129])
  %7: f32[67,129] = sub(%5, %6)
  %8: f32[67] = reduce_sum(%7, axes=[1], keepdim=false)
  %9: f32[129] = reduce_max(%7, axes=[0], keepdim=false)
  %10: f32[129,67] = transpose(%7, perm=[1,0])
  %11: f32[11,7,5,3,2] = transpose(%t, perm=[4,3,2,1,0])
  output a = %8
  output b = %9
  output c = %10
  output d = %11
}",
    );
}

/// Attention and its backward run as one step each (never decomposed on cpu): grouped-query
/// (4 query heads on 2 kv heads), causal and not, odd sequence and head sizes (7: one block of
/// query rows; 131: two full blocks of 64 and a partial one), and queries read through a
/// transpose (a strided view in the fused lowering). And the same with the forward's row
/// statistics (`stats=true`): written by the forward, compared as an output, and read by the
/// backward instead of a softmax of its own.
#[test]
fn attention_forward_and_backward_grouped_query() {
    for s in [7, 131] {
        for causal in [true, false] {
            for stats in [false, true] {
                // With statistics: the forward's second output, read by the backward.
                let (fwd_outs, bwd_stats, attrs, stats_out) = if stats {
                    (
                        format!("%5: f32[2,4,{s},5], %6: f32[2,4,{s},2]"),
                        ", %6",
                        ", stats=true",
                        "\n  output stats = %6",
                    )
                } else {
                    (format!("%5: f32[2,4,{s},5]"), "", "", "")
                };
                let (dq, dk, dv) = if stats { (7, 8, 9) } else { (6, 7, 8) };
                check(
                    &format!("attention seq={s} causal={causal} stats={stats}"),
                    &format!(
                        "graph g {{
  input %x: f32[2,{s},4,5]
  input %k: f32[2,2,{s},5]
  input %v: f32[2,2,{s},5]
  input %g: f32[2,4,{s},5]
  %4: f32[2,4,{s},5] = transpose(%x, perm=[0,2,1,3])
  {fwd_outs} = attention(%4, %k, %v, causal={causal}, scale=0.45{attrs})
  %{dq}: f32[2,4,{s},5], %{dk}: f32[2,2,{s},5], %{dv}: f32[2,2,{s},5] = attention_backward(%4, %k, %v, %g{bwd_stats}, causal={causal}, scale=0.45{attrs})
  output o = %5{stats_out}
  output dq = %{dq}
  output dk = %{dk}
  output dv = %{dv}
}}"
                    ),
                );
            }
        }
    }
}

/// Attention over 600 keys with 32-wide heads: the device kernels' loops over a head's
/// elements are unrolled (its width is a comptime argument), so a unit takes a few loop trips
/// per key; before, the query side of backward took about 200 per key and this step was
/// refused on lavapipe (its budget of 65,535 trips, `shared::kernels::LOOP_BUDGET`).
#[test]
fn attention_over_long_rows_fits_the_devices_loop_budget() {
    check(
        "attention over 600 keys",
        "graph g {
  input %q: f32[1,2,600,32]
  input %k: f32[1,1,600,32]
  input %v: f32[1,1,600,32]
  input %g: f32[1,2,600,32]
  %4: f32[1,2,600,32] = attention(%q, %k, %v, causal=true, scale=0.17677669529663687)
  %5: f32[1,2,600,32], %6: f32[1,1,600,32], %7: f32[1,1,600,32] = attention_backward(%q, %k, %v, %g, causal=true, scale=0.17677669529663687)
  output o = %4
  output dq = %5
  output dk = %6
  output dv = %7
}",
    );
}

/// The composites at their smallest: one query row and one element per head (a causal
/// softmax over a single key), rope on one pair, cross-entropy over one class and over one
/// row. The device kernels' first-element starts (max from the first key or class) meet
/// their edge here.
#[test]
fn composites_at_their_smallest_sizes() {
    check(
        "smallest composites",
        "graph g {
  input %q: f32[1,2,1,1]
  input %k: f32[1,1,1,1]
  input %v: f32[1,1,1,1]
  input %g: f32[1,2,1,1]
  input %x: f32[1,1,1,2]
  input %l1: f32[3,1]
  input %t1: i32[3]
  input %l2: f32[1,4]
  input %t2: i32[1]
  input %s: f32[]
  %10: f32[1,2,1,1] = attention(%q, %k, %v, causal=true, scale=0.5)
  %11: f32[1,2,1,1], %12: f32[1,1,1,1], %13: f32[1,1,1,1] = attention_backward(%q, %k, %v, %g, causal=true, scale=0.5)
  %14: f32[1,1,1,2] = rope(%x, theta=10000.0, layout=half, inverse=false)
  %15: f32[] = cross_entropy(%l1, %t1)
  %16: f32[3,1] = cross_entropy_backward(%l1, %t1, %s)
  %17: f32[] = cross_entropy(%l2, %t2)
  %18: f32[1,4] = cross_entropy_backward(%l2, %t2, %s)
  output o = %10
  output dq = %11
  output dk = %12
  output dv = %13
  output r = %14
  output ce1 = %15
  output dce1 = %16
  output ce2 = %17
  output dce2 = %18
}",
    );
}

/// Rotary embedding runs as one step on cpu: both layouts, forward and inverse (the gradient),
/// odd sequence and head counts, and an input read through a transpose.
#[test]
fn rope_both_layouts_and_inverse() {
    for layout in ["half", "interleaved"] {
        for inverse in [false, true] {
            check(
                &format!("rope {layout} inverse={inverse}"),
                &format!(
                    "graph g {{
  input %x: f32[2,3,7,6]
  %1: f32[2,7,3,6] = transpose(%x, perm=[0,2,1,3])
  %2: f32[2,7,3,6] = rope(%1, theta=10000.0, layout={layout}, inverse={inverse})
  output y = %2
}}"
                ),
            );
        }
    }
}

#[test]
fn matmuls_with_odd_shapes_transposed_and_shared_operands() {
    check(
        "matmul",
        "graph g {
  input %a: f32[3,13,29]
  input %b: f32[3,29,7]
  input %w: f32[17,29]
  %3: f32[3,13,7] = matmul(%a, %b)
  %4: f32[29,17] = transpose(%w, perm=[1,0])
  %5: f32[3,13,17] = matmul(%a, %4)
  %6: f32[3,29,13] = transpose(%a, perm=[0,2,1])
  %7: f32[3,13,13] = matmul(%a, %6)
  %9: f32[3,17,13] = transpose(%5, perm=[0,2,1])
  output a = %3
  output b = %9
  output c = %7
}",
    );
    // The fused lowering writes a matmul read only through a transpose of its last two dims
    // as `bᵀ aᵀ`; eager computes `a b` and copies: the same bits (`check` compares them).
    check(
        "matmul then transpose",
        "graph g {
  input %x: f32[37,23]
  input %dy: f32[37,11]
  input %a: f32[2,5,9]
  input %b: f32[9,6]
  %4: f32[23,37] = transpose(%x, perm=[1,0])
  %5: f32[23,11] = matmul(%4, %dy)
  %6: f32[11,23] = transpose(%5, perm=[1,0])
  %7: f32[11,23] = mul_scalar(%6, value=0.5)
  %8: f32[2,5,6] = matmul(%a, %b)
  %9: f32[2,6,5] = transpose(%8, perm=[0,2,1])
  output w = %7
  output t = %9
}",
    );
}

#[test]
fn composites_decompose_and_match() {
    check(
        "embedding/rmsnorm/rope/attention/cross-entropy",
        "graph g {
  input %emb: f32[19,16]
  input %tokens: i32[2,5]
  input %targets: i32[2,5]
  input %w: f32[16]
  %4: f32[2,5,16] = embedding(%emb, %tokens)
  %5: f32[2,5,16] = rms_norm(%4, %w, eps=1e-5)
  %6: f32[2,5,2,8] = reshape(%5, shape=[2,5,2,8])
  %7: f32[2,5,2,8] = rope(%6, theta=10000.0, layout=interleaved, inverse=false)
  %8: f32[2,2,5,8] = transpose(%7, perm=[0,2,1,3])
  %9: f32[2,2,5,8] = attention(%8, %8, %8, causal=true, scale=0.35)
  %10: f32[2,5,2,8] = transpose(%9, perm=[0,2,1,3])
  %11: f32[10,16] = reshape(%10, shape=[10,16])
  %12: f32[16,19] = transpose(%emb, perm=[1,0])
  %13: f32[10,19] = matmul(%11, %12)
  %14: f32[10,19] = log_softmax(%13, axis=1)
  %15: i32[10] = reshape(%targets, shape=[10])
  %16: f32[] = cross_entropy(%13, %15)
  output logp = %14
  output loss = %16
}",
    );
}

/// Cross-entropy and its gradient as host steps: odd sizes (not multiples of the 8-wide
/// lanes), logits read through a transpose (a strided row), and an upstream gradient that is
/// not 1.
#[test]
fn cross_entropy_forward_and_backward() {
    check(
        "cross-entropy",
        "graph g {
  input %x: f32[13,37]
  input %xt: f32[37,13]
  input %t: i32[13]
  input %g: f32[]
  %1: f32[] = cross_entropy(%x, %t)
  %2: f32[13,37] = cross_entropy_backward(%x, %t, %g)
  %3: f32[13,37] = transpose(%xt, perm=[1,0])
  %4: f32[] = cross_entropy(%3, %t)
  %5: f32[13,37] = cross_entropy_backward(%3, %t, %g)
  output loss = %1
  output grad = %2
  output loss_t = %4
  output grad_t = %5
}",
    );
}

/// A target outside the classes is an error that names it, not a wrong loss.
#[test]
fn a_bad_cross_entropy_target_is_an_error() {
    let g = text::parse(
        "graph g {
  input %x: f32[3,5]
  input %t: i32[3]
  %1: f32[] = cross_entropy(%x, %t)
  output loss = %1
}",
    )
    .unwrap();
    let mut inputs = random_inputs(&g, 0);
    inputs[1].data[2] = 5.0;
    let err = run_once(&g, Backend::Cpu, Mode::Fused, &inputs).unwrap_err();
    assert!(
        err.to_string()
            .contains("target 5 at row 2 is out of range 0..5"),
        "{err}"
    );
    // On a device the targets, an input, are checked by the host as it writes them, naming the
    // row.
    for backend in device_backends() {
        for (row, bad) in [(2, 5.0), (0, -1.0), (1, 0.5)] {
            let mut inputs = random_inputs(&g, 0);
            inputs[1].data[row] = bad;
            let err = run_once(&g, backend, Mode::Fused, &inputs).unwrap_err();
            assert!(
                err.to_string().contains(&format!(
                    "(cross_entropy): cross-entropy target {bad} at row {row} is out of range 0..5"
                )),
                "{backend}: {err}"
            );
        }
    }
}

/// On a device, an embedding's token ids (an input broadcast by one copy into the gather's
/// indices) are checked by the host as it writes them: an id out of range is refused before
/// anything runs, naming the gather, the id and its position among the tokens (the device
/// check would name a position among the broadcast indices: seen failing with the host check
/// off). The whole `tiny` step in one device graph follows from it (`bench` prints it).
#[test]
fn a_bad_token_id_is_refused_as_it_is_written_on_a_device() {
    let g = text::parse(
        "graph g {
  input %w: f32[10,4]
  input %t: i32[6]
  %2: i32[6,1] = reshape(%t, shape=[6,1])
  %3: i32[6,4] = expand(%2, shape=[6,4])
  %4: f32[6,4] = gather(%w, %3, axis=0)
  %5: f32[6,4] = exp(%4)
  output y = %5
}",
    )
    .unwrap();
    let mut inputs = random_inputs(&g, 0);
    for (k, x) in inputs[1].data.iter_mut().enumerate() {
        *x = (k % 10) as f64;
    }
    let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
    for backend in device_backends() {
        let got = run_once(&g, backend, Mode::Fused, &inputs).unwrap();
        assert_outputs(
            "gather",
            &output_names(&g),
            &got,
            &want,
            Agree::Relative(1e-6),
        );
        for (pos, bad) in [(3, 10.0), (0, -1.0), (5, 2.5)] {
            let mut inputs = inputs.clone();
            inputs[1].data[pos] = bad;
            let err = run_once(&g, backend, Mode::Fused, &inputs).unwrap_err();
            assert!(
                err.to_string().contains(&format!(
                    "(gather): index {bad} at position {pos} is out of range 0..10"
                )),
                "{backend}: {err}"
            );
        }
    }
    // Indices the step computes (here twice the ids) keep the device's check: still an error
    // naming the gather, at a position among its indices.
    let computed = text::parse(
        "graph g {
  input %w: f32[10,4]
  input %t: i32[6]
  %2: i32[6,1] = reshape(%t, shape=[6,1])
  %3: i32[6,4] = expand(%2, shape=[6,4])
  %4: i32[6,4] = add(%3, %3)
  %5: f32[6,4] = gather(%w, %4, axis=0)
  output y = %5
}",
    )
    .unwrap();
    for backend in device_backends() {
        let mut bad = inputs.clone();
        bad[1].data = vec![0.0, 1.0, 2.0, 5.0, 4.0, 3.0];
        let err = run_once(&computed, backend, Mode::Fused, &bad).unwrap_err();
        let err = err.to_string();
        assert!(
            err.contains("(gather): index 10 at position 1") && err.contains("out of range 0..10"),
            "{backend}: {err}"
        );
    }
}

/// AdamW as one step over several parameters (in place, merged) and as separate steps
/// (eager), sizes around the cpu's 64-element block, on cpu and on the device backends:
/// against the interpreter, and bit for bit between the two lowerings.
#[test]
fn adamw_in_place_over_several_parameters() {
    let sizes = [70, 5, 128];
    let mut src = String::from("graph g {\n  input %lr: f32[]\n  input %t: f32[]\n");
    for (k, n) in sizes.iter().enumerate() {
        for (kind, x) in [
            ("param", "p"),
            ("input", "g"),
            ("state", "m"),
            ("state", "v"),
        ] {
            src += &format!("  {kind} %{x}{k}: f32[{n}]\n");
        }
    }
    for (k, n) in sizes.iter().enumerate() {
        src += &format!(
            "  %P{k}: f32[{n}], %M{k}: f32[{n}], %V{k}: f32[{n}] = adamw(%p{k}, %g{k}, %m{k}, \
%v{k}, %lr, %t, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)\n"
        );
    }
    for k in 0..sizes.len() {
        for (out, x) in [("P", "p"), ("M", "m"), ("V", "v")] {
            src += &format!("  output {out}{k} = %{out}{k} donates %{x}{k}\n");
        }
    }
    src += "}";
    let g = text::parse(&src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    let inputs: Vec<HostTensor> = g
        .inputs
        .iter()
        .enumerate()
        .map(|(k, input)| {
            let ty = g.ty(input.value).clone();
            let name = &input.name;
            HostTensor::from_fn(ty, |i| {
                let x = ((i * 7919 + k * 104_729) % 1000) as f64 / 1000.0;
                match name.chars().next() {
                    Some('l') => 1e-3,
                    Some('t') => 3.0,
                    // Second moments are non-negative; the rest spread around zero.
                    Some('v') => 0.01 * x,
                    _ => 2.0 * x - 1.0,
                }
            })
        })
        .collect();
    let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
    let names = output_names(&g);
    for backend in [Backend::Cpu].into_iter().chain(device_backends()) {
        let fused = run_once(&g, backend, Mode::Fused, &inputs).unwrap();
        let eager = run_once(&g, backend, Mode::Eager, &inputs).unwrap();
        assert_outputs(
            &format!("adamw: {backend} fused vs the interpreter"),
            &names,
            &fused,
            &want,
            Agree::Relative(1e-4),
        );
        assert_outputs(
            &format!("adamw: {backend} fused vs {backend} eager"),
            &names,
            &fused,
            &eager,
            Agree::Bitwise,
        );
    }
}

/// A whole train step on `tiny`: cpu follows the interpreter within 1e-4 for 5 AdamW steps.
#[test]
fn tiny_train_step_matches_the_interpreter_after_five_steps() {
    let (reference, cpu) = gate::train_on_backends(
        "tiny",
        5,
        Backend::Reference,
        Mode::Eager,
        Backend::Cpu,
        Mode::Fused,
    )
    .unwrap();
    assert_runs(
        "tiny, 5 steps: cpu vs the interpreter",
        &cpu,
        &reference,
        Agree::Relative(1e-4),
    );
}

/// The bitwise gate: the fused program and eager op-by-op execution on the cpu backend agree
/// exactly on loss, grad norm, parameters and optimizer state after 5 AdamW steps.
#[test]
fn fused_and_eager_are_bitwise_identical_on_cpu() {
    assert_fused_equals_eager(Backend::Cpu);
}

/// The same `tiny` train step on wgpu: within 1e-4 of the interpreter after 5 AdamW steps, and
/// bitwise equal between its fused and eager lowerings.
#[test]
fn tiny_train_step_on_wgpu_matches_the_interpreter_and_its_eager_run() {
    for backend in device_backends() {
        let (reference, device) = gate::train_on_backends(
            "tiny",
            5,
            Backend::Reference,
            Mode::Eager,
            backend,
            Mode::Fused,
        )
        .unwrap();
        assert_runs(
            &format!("tiny, 5 steps: {backend} vs the interpreter"),
            &device,
            &reference,
            Agree::Relative(1e-4),
        );
        assert_fused_equals_eager(backend);
    }
}

/// A step past lavapipe's loop budget in places (2,048 tokens of width 256: the embedding's
/// reshape copies 524,288 elements): wgpu's losses and gradient norms over 3 AdamW steps
/// within 1e-4 of cpu's. With a copy row in one unit, lavapipe had kept its first 65,535
/// elements and step 1 was off by 1%.
#[test]
fn a_step_with_long_rows_on_wgpu_matches_cpu() {
    use graphtrain::data::DataSource;
    use graphtrain::ir::optim::OptimConfig;
    use graphtrain::lr_schedule::LrSchedule;
    use graphtrain::trainer::{TrainConfig, Trainer};
    use graphtrain_runtime::CompileOptions;
    let mut cfg = graphtrain::models::Llama3Config::builtin("tiny").unwrap();
    (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) = (256, 1, 8, 8);
    (cfg.batch, cfg.seq_len) = (8, 256);
    let pipeline = graphtrain::passes::PipelineSpec::default_pipeline()
        .build(&graphtrain::passes::Registry::builtin())
        .unwrap();
    let train = |backend: Backend| -> Vec<(f64, f64)> {
        let tc = TrainConfig {
            data: DataSource::Fixed,
            seed: 0,
            lr: LrSchedule::constant(1e-3),
            optim: OptimConfig::default(),
        };
        let options = CompileOptions::new(&pipeline, Mode::Fused);
        let mut t = Trainer::build(&cfg, tc, backend, &options)
            .unwrap_or_else(|e| panic!("{backend}: {e}"));
        (0..3)
            .map(|_| t.step().unwrap_or_else(|e| panic!("{backend}: {e}")))
            .map(|m| (m.loss, m.grad_norm))
            .collect()
    };
    let want = train(Backend::Cpu);
    for backend in device_backends() {
        for (step, (got, want)) in train(backend).iter().zip(&want).enumerate() {
            for (what, g, w) in [("loss", got.0, want.0), ("gradient norm", got.1, want.1)] {
                assert!(
                    (g - w).abs() <= 1e-4 * w.abs(),
                    "{backend} step {}: {what} {g}, cpu {w}",
                    step + 1
                );
            }
        }
    }
}

fn assert_fused_equals_eager(backend: Backend) {
    let (eager, fused) =
        gate::train_on_backends("tiny", 5, backend, Mode::Eager, backend, Mode::Fused).unwrap();
    assert_runs(
        &format!("tiny, 5 steps: {backend} fused vs {backend} eager"),
        &fused,
        &eager,
        Agree::Bitwise,
    );
}

// The comparison helper fails where it must: each test below hands it a result that an honest
// comparison rejects.

fn f32_tensor(shape: &[usize], data: Vec<f64>) -> HostTensor {
    HostTensor::new(TensorType::new(DType::F32, shape.to_vec()), data).unwrap()
}

/// cpu's and the interpreter's outputs of a small graph, with their names.
fn small_run() -> (Vec<String>, Vec<HostTensor>, Vec<HostTensor>) {
    let g = text::parse(
        "graph g {
  input %x: f32[3,5]
  %1: f32[3,5] = exp(%x)
  %2: f32[3,5] = mul(%1, %x)
  output a = %1
  output b = %2
}",
    )
    .unwrap();
    let inputs = random_inputs(&g, 0);
    let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
    let got = run_once(&g, Backend::Cpu, Mode::Fused, &inputs).unwrap();
    compare_outputs(&output_names(&g), &got, &want, Agree::Relative(1e-4)).unwrap();
    (output_names(&g), got, want)
}

#[test]
fn a_nan_or_inf_in_one_backends_output_fails() {
    let (names, got, want) = small_run();
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let mut broken = got.clone();
        broken[1].data[7] = bad;
        for how in [Agree::Relative(1e-4), Agree::Bitwise] {
            let err = compare_outputs(&names, &broken, &want, how).unwrap_err();
            assert!(
                err.contains("`b` element 7 [1, 2]") && err.contains("not finite"),
                "{how:?}: {err}"
            );
            // On the reference side as well.
            let err = compare_outputs(&names, &want, &broken, how).unwrap_err();
            assert!(err.contains("`b` element 7"), "{how:?}: {err}");
        }
    }
}

#[test]
fn nan_on_both_sides_fails() {
    let (names, mut got, mut want) = small_run();
    got[0].data[3] = f64::NAN;
    want[0].data[3] = f64::NAN;
    for how in [Agree::Relative(1e-4), Agree::Bitwise] {
        let err = compare_outputs(&names, &got, &want, how).unwrap_err();
        assert!(
            err.contains("`a` element 3 [0, 3]: got NaN, want NaN: not finite"),
            "{how:?}: {err}"
        );
    }
    let both = [f64::NAN];
    assert!(compare_values("x", &[1], &both, &both, Agree::Bitwise).is_err());
}

#[test]
fn count_mismatches_fail() {
    let (names, got, want) = small_run();
    for how in [Agree::Relative(1e-4), Agree::Bitwise] {
        // One output fewer, on either side.
        let err = compare_outputs(&names, &got[..1], &want, how).unwrap_err();
        assert!(err.contains("1 outputs, the reference has 2"), "{err}");
        assert!(compare_outputs(&names, &got, &want[..1], how).is_err());
        assert!(compare_outputs(&names[..1], &got, &want, how).is_err());
        // One element fewer: a different type (shape), and different lengths of values.
        let mut short = got.clone();
        short[0] = f32_tensor(&[14], got[0].data[..14].to_vec());
        let err = compare_outputs(&names, &short, &want, how).unwrap_err();
        assert!(err.contains("`a`: got a f32[14] tensor"), "{err}");
        let err = compare_values("v", &[15], &got[0].data[..14], &want[0].data, how).unwrap_err();
        assert!(err.contains("14 elements, the reference has 15"), "{err}");
        // A state tensor missing or renamed.
        let state = |t: &[HostTensor]| -> Vec<(String, HostTensor)> {
            names.iter().cloned().zip(t.iter().cloned()).collect()
        };
        assert!(compare_named(&state(&got), &state(&got), how).is_ok());
        assert!(compare_named(&state(&got)[..1], &state(&got), how).is_err());
        assert!(compare_named(&state(&got), &state(&got)[..1], how).is_err());
        let mut renamed = state(&got);
        renamed[1].0 = "c".into();
        assert!(compare_named(&renamed, &state(&got), how).is_err());
    }
}

/// AdamW's second moments live around 1e-8: a 1% error there is a wrong update and fails at
/// 1e-4 (the old `max(1, |b|)` divisor read it as 1e-10). Errors of f32 rounding pass.
#[test]
fn a_one_percent_error_in_a_tiny_tensor_fails() {
    let want = f32_tensor(
        &[37],
        (0..37).map(|i| 1e-8 * (1.0 + i as f64 / 9.0)).collect(),
    );
    let mut got = want.clone();
    got.data[20] *= 1.01;
    let names = ["v".to_string()];
    let err = compare_outputs(
        &names,
        std::slice::from_ref(&got),
        std::slice::from_ref(&want),
        Agree::Relative(1e-4),
    )
    .unwrap_err();
    assert!(
        err.contains("`v` element 20 [20]")
            && err.contains(&format!("got {:e}, want {:e}", got.data[20], want.data[20])),
        "{err}"
    );
    // The whole tensor off by 1% fails too; off by a few f32 roundings it passes.
    let scaled = |f: f64| f32_tensor(&[37], want.data.iter().map(|x| x * f).collect());
    assert!(compare_values(
        "v",
        &[37],
        &scaled(1.01).data,
        &want.data,
        Agree::Relative(1e-4)
    )
    .is_err());
    assert!(compare_values(
        "v",
        &[37],
        &scaled(1.0 + 1e-6).data,
        &want.data,
        Agree::Relative(1e-4)
    )
    .is_ok());
}

/// The floor is the tensor's own scale: an element near zero (by cancellation) is judged
/// against the tensor's RMS, not against itself, and not against 1; an element above the RMS
/// against itself.
#[test]
fn elements_near_zero_are_judged_at_their_tensors_scale() {
    let want = [1.0, -1.0, 1e-9];
    let within = |got: &[f64], want: &[f64]| {
        compare_values("x", &[got.len()], got, want, Agree::Relative(1e-4))
    };
    // rms ~ 0.8165, so the floor is 0.8165: 1e-5 off the small element is within 1e-4 x floor...
    assert!(within(&[1.0, -1.0, 1e-5], &want).is_ok());
    // ...1e-3 off it is not.
    let err = within(&[1.0, -1.0, 1e-3], &want).unwrap_err();
    assert!(err.contains("`x` element 2 [2]"), "{err}");
    // The same at 1e-6 scale: the floor scales with the tensor.
    let small: Vec<f64> = want.iter().map(|x| x * 1e-6).collect();
    let off: Vec<f64> = [1.0, -1.0, 1e-3].iter().map(|x| x * 1e-6).collect();
    assert!(within(&off, &small).is_err());
    // Above the RMS an element is its own scale: 100 off by 2e-2 fails though the RMS is ~58.
    assert!(within(&[100.0 + 2e-3, 1.0, 1.0], &[100.0, 1.0, 1.0]).is_ok());
    assert!(within(&[100.0 + 2e-2, 1.0, 1.0], &[100.0, 1.0, 1.0]).is_err());
}

/// bf16 values are held as f32 rounded to bf16: casts, elementwise ops on bf16 and layout ops
/// on them agree with the interpreter's rounding, and fused with eager, on every backend.
#[test]
fn bf16_casts_elementwise_and_layout() {
    check(
        "bf16 elementwise",
        "graph g {
  input %x: f32[5,9]
  input %y: f32[5,9]
  %2: bf16[5,9] = cast(%x, dtype=bf16)
  %3: bf16[5,9] = cast(%y, dtype=bf16)
  %4: bf16[5,9] = mul(%2, %3)
  %5: bf16[9,5] = transpose(%4, perm=[1,0])
  %6: f32[9,5] = cast(%5, dtype=f32)
  %7: f32[5,9] = cast(%2, dtype=f32)
  output a = %6
  output b = %7
}",
    );
}

/// A matmul of bf16 operands: f32 sums rounded once to bf16, within one bf16 step (2^-8
/// relative) of the interpreter's f64 sums rounded to bf16; transposed operands and a
/// transposed result included; on cpu (AMX tiles where it has AMX, `vdpbf16ps` where it has
/// AVX512_BF16, and the f32 GEMM)
/// and on the device backends with both matmul kernels. Fused, the casts of `a` and `b` fold
/// into the matmuls (which round the f32 inputs as they read them): bit for bit the eager
/// Program's cast kernels, with every kernel.
#[test]
fn bf16_matmuls_on_cpu_round_their_f32_sums() {
    let src = "graph g {
  input %a: f32[3,7,33]
  input %b: f32[33,19]
  %2: bf16[3,7,33] = cast(%a, dtype=bf16)
  %3: bf16[33,19] = cast(%b, dtype=bf16)
  %4: bf16[3,7,19] = matmul(%2, %3)
  %5: bf16[19,33] = transpose(%3, perm=[1,0])
  %6: bf16[3,7,33] = matmul(%4, %5)
  %7: bf16[3,33,7] = transpose(%6, perm=[0,2,1])
  %8: f32[3,33,7] = cast(%7, dtype=f32)
  output y = %8
}";
    let g = text::parse(src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    let names = output_names(&g);
    // cpu with either GEMM; the device backends with either matmul kernel.
    let mut kernels = vec![
        (Backend::Cpu, GemmKernel::Widest, DeviceMatmul::Auto),
        (Backend::Cpu, GemmKernel::Avx512, DeviceMatmul::Auto),
        (Backend::Cpu, GemmKernel::Avx2, DeviceMatmul::Auto),
    ];
    for backend in device_backends() {
        for kernel in [DeviceMatmul::PerOutput, DeviceMatmul::Tiled] {
            kernels.push((backend, GemmKernel::Widest, kernel));
        }
    }
    let fused = graphtrain_lowering::lower(&g, Mode::Fused).unwrap();
    assert!(
        !fused.steps.iter().any(|s| [2, 3].contains(&s.writes().0)),
        "the casts %2 and %3 did not fold into the matmuls:\n{fused}"
    );
    for seed in 0..2 {
        let inputs = random_inputs(&g, seed);
        let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
        for &(backend, gemm, kernel) in &kernels {
            let options = RuntimeOptions {
                gemm_kernel: gemm,
                device_matmul: kernel,
                ..RuntimeOptions::default()
            };
            let mut runs = Vec::new();
            for mode in [Mode::Eager, Mode::Fused] {
                let got = run_once_with(&g, backend, mode, options.clone(), &inputs)
                    .unwrap_or_else(|e| panic!("{backend} {mode:?} {gemm:?} {kernel:?}: {e}"));
                let what =
                    format!("bf16 matmuls, {backend} {mode:?} {gemm:?} {kernel:?} (seed {seed})");
                assert_outputs(&what, &names, &got, &want, Agree::Relative(1.0 / 256.0));
                // Every element is a bf16 value.
                for x in &got[0].data {
                    assert_eq!((*x as f32).to_bits() & 0xFFFF, 0, "{what}: {x} is not bf16");
                }
                runs.push(got[0].data.clone());
            }
            assert!(
                runs[0]
                    .iter()
                    .zip(&runs[1])
                    .all(|(e, f)| e.to_bits() == f.to_bits()),
                "{backend} {gemm:?} {kernel:?} (seed {seed}): fused differs from eager"
            );
        }
    }
}

/// bf16 values stored in 2 bytes an element on cpu (`Program::store_bf16_in_two_bytes`): GEMMs
/// and maps write halves, maps, a fused row sum, rope (both layouts) and cross-entropy (as
/// logits) widen them as they read, and GEMMs pack them as operands (row-major and transposed A, row-major B). With
/// every GEMM kernel, eager,
/// fused and replayed, the results are bit for bit those of the same Program with every value
/// in a 4-byte slot, and within a bf16 step of the interpreter.
#[test]
fn bf16_values_stored_in_two_bytes_read_as_they_were_written() {
    let src = "graph g {
  input %a: f32[2,24,40]
  input %b: f32[40,48]
  input %c: f32[2,24,48]
  input %d: f32[48,16]
  input %e: f32[2,8,24]
  input %h: f32[40,48]
  input %w: f32[40,48]
  input %t: i32[48]
  input %g: f32[]
  %3: bf16[2,24,40] = cast(%a, dtype=bf16)
  %4: bf16[40,48] = cast(%b, dtype=bf16)
  %5: bf16[2,24,48] = matmul(%3, %4)
  %6: f32[2,24,48] = cast(%5, dtype=f32)
  %7: f32[2,24,48] = mul(%6, %c)
  %11: f32[2,24,48] = mul(%6, %6)
  %8: f32[2,24] = reduce_sum(%11, axes=[2], keepdim=false)
  %9: bf16[2,24,48] = mul(%5, %5)
  %10: f32[2,24,48] = cast(%9, dtype=f32)
  %12: bf16[48,16] = cast(%d, dtype=bf16)
  %13: bf16[2,24,16] = matmul(%9, %12)
  %14: bf16[2,48,24] = transpose(%9, perm=[0,2,1])
  %15: bf16[2,48,16] = matmul(%14, %13)
  %16: bf16[2,8,24] = cast(%e, dtype=bf16)
  %17: bf16[2,8,48] = matmul(%16, %9)
  %18: f32[2,48,16] = cast(%15, dtype=f32)
  %19: f32[2,8,48] = cast(%17, dtype=f32)
  %25: bf16[40,48] = cast(%h, dtype=bf16)
  %20: bf16[2,24,48] = matmul(%3, %25)
  %21: f32[2,24,48] = cast(%20, dtype=f32)
  %24: f32[48,48] = reshape(%21, shape=[48,48])
  %22: f32[] = cross_entropy(%24, %t)
  %23: f32[48,48] = cross_entropy_backward(%24, %t, %g)
  %28: bf16[40,48] = cast(%w, dtype=bf16)
  %26: bf16[2,24,48] = matmul(%3, %28)
  %29: f32[2,24,48] = cast(%26, dtype=f32)
  %30: f32[2,24,4,12] = reshape(%29, shape=[2,24,4,12])
  %31: f32[2,24,4,12] = rope(%30, theta=10000.0, layout=half, inverse=false)
  %32: f32[2,24,4,12] = rope(%30, theta=10000.0, layout=interleaved, inverse=true)
  output y = %7
  output s = %8
  output q = %10
  output r = %18
  output t = %19
  output ce = %22
  output dce = %23
  output rh = %31
  output ri = %32
}";
    let g = text::parse(src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    let names = output_names(&g);
    let pipeline = graphtrain_passes::Pipeline::new(Vec::new());
    for seed in 0..2 {
        let inputs = random_inputs(&g, seed);
        let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
        let kernels = [
            (GemmKernel::Widest, MapVector::Widest),
            (GemmKernel::Widest, MapVector::Eight),
            (GemmKernel::Avx512, MapVector::Widest),
            (GemmKernel::Avx2, MapVector::Widest),
        ];
        let mut widest = None;
        for (gemm, map_vector) in kernels {
            for (graph, mode) in [
                (g.clone(), Mode::Eager),
                (g.clone(), Mode::Fused),
                (captured(&g), Mode::Fused),
            ] {
                let options = graphtrain_runtime::CompileOptions {
                    runtime: RuntimeOptions {
                        gemm_kernel: gemm,
                        map_vector,
                        ..RuntimeOptions::default()
                    },
                    ..graphtrain_runtime::CompileOptions::new(&pipeline, mode)
                };
                let compile = || graphtrain_runtime::compile(&graph, Backend::Cpu, &options);
                let halves = compile().unwrap();
                let program = halves.program.as_ref().unwrap();
                let chosen = (0..program.graph.values.len())
                    .filter(|&v| program.is_two_byte(graphtrain_ir::ValueId(v as u32)))
                    .count();
                assert!(
                    chosen > 0,
                    "{mode:?}: no value stored in 2 bytes:\n{program}"
                );
                // The same Program with every value in a 4-byte slot.
                let mut slots = compile().unwrap();
                let p = slots.program.as_mut().unwrap();
                p.bf16_in_two_bytes.clear();
                p.plan_in_windows(1 << 40).unwrap();
                let what =
                    format!("bf16 in 2 bytes, {mode:?} {gemm:?} {map_vector:?} (seed {seed})");
                let got = graphtrain_runtime::run_compiled(halves, &inputs)
                    .unwrap_or_else(|e| panic!("{what}: {e}"));
                let in_slots = graphtrain_runtime::run_compiled(slots, &inputs)
                    .unwrap_or_else(|e| panic!("{what}, 4-byte slots: {e}"));
                assert_outputs(&what, &names, &got, &in_slots, Agree::Bitwise);
                assert_outputs(&what, &names, &got, &want, Agree::Relative(1.0 / 64.0));
                // Maps at 8 lanes: the bits of the widest vectors, on the same GEMM.
                if gemm == GemmKernel::Widest {
                    match (&widest, map_vector) {
                        (None, MapVector::Widest) => widest = Some(got.clone()),
                        (Some(w), MapVector::Eight) => {
                            assert_outputs(&what, &names, &got, w, Agree::Bitwise)
                        }
                        _ => {}
                    }
                }
            }
        }
    }
}

/// bf16 attention and its gradient (bf16-mixed's, `Step::Attention`): products read bf16
/// operands, probabilities and score gradients, and sum in f32 (the interpreter: in f64), so
/// every backend agrees with the interpreter within 2^-6 of the element or of the tensor's rms
/// (measured on the AMX Xeon: at most 1.95 x 2^-8, about 7e-5 of the tensor's norm; had the
/// kernels kept the probabilities in f32, as the interpreter once did, the cpu's dq was 5.3 x
/// 2^-8 off and every output 3e-3 of its norm), with
/// grouped-query heads, masked and not, odd lengths, and a head of 40 (pairs past one AMX tile
/// row; and heads of 32 and 64, which run on AMX as whole tile blocks, `attention_amx.rs`).
/// Fused, the casts of q, k, v and the output gradient fold into the attention steps
/// (which round as they read), and the results are written through their widening casts
/// straight into the transposed readers: bit for bit the eager Program, with every GEMM kernel
/// on cpu (AMX tiles, `vdpbf16ps`, the f32 GEMM on rounded copies). With the forward's row
/// statistics read by the backward (`stats=true`), every result is the one without, bit for
/// bit: the backward rebuilds the forward's probabilities exactly.
#[test]
fn bf16_attention_matches_the_interpreter_on_every_kernel() {
    let mut kernels = vec![
        (Backend::Cpu, GemmKernel::Widest),
        (Backend::Cpu, GemmKernel::Avx512),
        (Backend::Cpu, GemmKernel::Avx2),
    ];
    for backend in device_backends() {
        kernels.push((backend, GemmKernel::Widest));
    }
    let shapes = [(7, 40), (131, 40), (7, 32), (131, 32), (45, 64)];
    for (s, d) in shapes {
        for causal in [true, false] {
            let mut with_and_without = Vec::new();
            for stats in [false, true] {
                // With statistics: the forward's second output, read by the backward.
                let (stats_out, bwd_stats, attrs) = if stats {
                    (format!(", %19: f32[2,4,{s},2]"), ", %19", ", stats=true")
                } else {
                    (String::new(), "", "")
                };
                let src = format!(
                "graph g {{
  input %x: f32[2,{s},4,{d}]
  input %k: f32[2,2,{s},{d}]
  input %v: f32[2,2,{s},{d}]
  input %g: f32[2,4,{s},{d}]
  %4: f32[2,4,{s},{d}] = transpose(%x, perm=[0,2,1,3])
  %5: bf16[2,4,{s},{d}] = cast(%4, dtype=bf16)
  %6: bf16[2,2,{s},{d}] = cast(%k, dtype=bf16)
  %7: bf16[2,2,{s},{d}] = cast(%v, dtype=bf16)
  %8: bf16[2,4,{s},{d}] = cast(%g, dtype=bf16)
  %9: bf16[2,4,{s},{d}]{stats_out} = attention(%5, %6, %7, causal={causal}, scale=0.45{attrs})
  %10: f32[2,4,{s},{d}] = cast(%9, dtype=f32)
  %11: f32[2,{s},4,{d}] = transpose(%10, perm=[0,2,1,3])
  %12: bf16[2,4,{s},{d}], %13: bf16[2,2,{s},{d}], %14: bf16[2,2,{s},{d}] = attention_backward(%5, %6, %7, %8{bwd_stats}, causal={causal}, scale=0.45{attrs})
  %15: f32[2,4,{s},{d}] = cast(%12, dtype=f32)
  %16: f32[2,{s},4,{d}] = transpose(%15, perm=[0,2,1,3])
  %17: f32[2,2,{s},{d}] = cast(%13, dtype=f32)
  %18: f32[2,2,{s},{d}] = cast(%14, dtype=f32)
  output o = %11
  output dq = %16
  output dk = %17
  output dv = %18
}}"
            );
                let g = text::parse(&src).unwrap_or_else(|e| panic!("{e}\n{src}"));
                graphtrain_ir::verify::verify(&g).unwrap();
                let names = output_names(&g);
                let fused = graphtrain_lowering::lower(&g, Mode::Fused).unwrap();
                let written: Vec<usize> = fused
                    .steps
                    .iter()
                    .flat_map(|s| s.outputs())
                    .map(|v| v.index())
                    .collect();
                assert!(
                    // The casts' values (numbered in order of definition: the statistics, where
                    // present, are the tenth).
                    [5, 6, 7, 8, 10 + stats as usize, 15 + stats as usize]
                        .iter()
                        .all(|v| !written.contains(v)),
                    "the casts did not fold into the attention steps:\n{fused}"
                );
                for seed in 0..2 {
                    let inputs = random_inputs(&g, seed);
                    let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
                    for &(backend, gemm) in &kernels {
                        let options = RuntimeOptions {
                            gemm_kernel: gemm,
                            ..RuntimeOptions::default()
                        };
                        let mut runs = Vec::new();
                        for mode in [Mode::Eager, Mode::Fused] {
                            let what = format!(
                            "bf16 attention s={s} d={d} causal={causal} stats={stats}, {backend} {mode:?} \
{gemm:?} (seed {seed})"
                        );
                            let got = run_once_with(&g, backend, mode, options.clone(), &inputs)
                                .unwrap_or_else(|e| panic!("{what}: {e}"));
                            assert_outputs(&what, &names, &got, &want, Agree::Relative(1.0 / 64.0));
                            for (name, t) in names.iter().zip(&got) {
                                for x in &t.data {
                                    let bits = (*x as f32).to_bits();
                                    assert_eq!(
                                        bits & 0xFFFF,
                                        0,
                                        "{what}: {name} holds {x}, not bf16"
                                    );
                                }
                            }
                            runs.push(got);
                        }
                        let bits = |r: &Vec<HostTensor>| -> Vec<u64> {
                            r.iter()
                                .flat_map(|t| t.data.iter().map(|x| x.to_bits()))
                                .collect()
                        };
                        assert_eq!(
                        bits(&runs[0]),
                        bits(&runs[1]),
                        "bf16 attention s={s} d={d} causal={causal} stats={stats}, {backend} {gemm:?} \
(seed {seed}): fused differs from eager"
                    );
                        with_and_without.push(((seed, backend, gemm), bits(&runs[0])));
                    }
                }
            }
            let (without, with) = with_and_without.split_at(with_and_without.len() / 2);
            for ((run, a), (_, b)) in without.iter().zip(with) {
                assert!(
                    a == b,
                    "bf16 attention s={s} d={d} causal={causal}, {run:?}: the backward from the \
forward's statistics differs from the one without"
                );
            }
        }
    }
}

/// `tiny` under bf16-mixed on cpu (and on the device backends) against the interpreter under
/// the same policy: after one AdamW step every first moment (0.1 x the gradient) within 1e-3 of
/// its tensor's norm and every other tensor within 2e-3; five steps' losses within 1e-3 (cpu). And bf16-mixed trains as f32
/// does: after 20 steps its loss is within 1% of f32's.
#[test]
fn bf16_mixed_tiny_matches_the_interpreter_and_trains_as_f32() {
    use graphtrain_ir::autocast::Precision;
    let run = |steps| {
        gate::train_on_backends_in(
            "tiny",
            steps,
            Precision::Bf16Mixed,
            (Backend::Reference, Mode::Eager),
            (Backend::Cpu, Mode::Fused),
        )
        .unwrap()
    };
    let (reference, cpu) = run(1);
    let mut compared = vec![(Backend::Cpu, cpu)];
    for backend in device_backends() {
        let (_, device) = gate::train_on_backends_in(
            "tiny",
            1,
            Precision::Bf16Mixed,
            (Backend::Reference, Mode::Eager),
            (backend, Mode::Fused),
        )
        .unwrap();
        compared.push((backend, device));
    }
    for (backend, run) in &compared {
        for ((name, got), (_, want)) in run.state.iter().zip(&reference.state) {
            let diff: f64 = got
                .data
                .iter()
                .zip(&want.data)
                .map(|(x, y)| (x - y) * (x - y))
                .sum::<f64>()
                .sqrt();
            let norm: f64 = want.data.iter().map(|y| y * y).sum::<f64>().sqrt();
            let rel = diff / norm;
            let tolerance = if name.starts_with("opt.m.") {
                1e-3
            } else {
                2e-3
            };
            assert!(
                rel <= tolerance,
                "{backend} {name}: {rel:.2e} of its norm from the interpreter's (bf16-mixed)"
            );
        }
    }
    let (reference, cpu) = run(5);
    for (k, (got, want)) in cpu.losses.iter().zip(&reference.losses).enumerate() {
        let rel = (got - want).abs() / want.abs();
        assert!(rel <= 1e-3, "step {}: loss {got} vs {want}", k + 1);
    }
    let (f32_run, _) = gate::train_on_backends(
        "tiny",
        20,
        Backend::Cpu,
        Mode::Fused,
        Backend::Cpu,
        Mode::Fused,
    )
    .unwrap();
    let (mixed, _) = gate::train_on_backends_in(
        "tiny",
        20,
        Precision::Bf16Mixed,
        (Backend::Cpu, Mode::Fused),
        (Backend::Cpu, Mode::Fused),
    )
    .unwrap();
    let (a, b) = (f32_run.losses[19], mixed.losses[19]);
    assert!(
        a.is_finite() && b.is_finite() && (a - b).abs() <= 0.01 * a.abs(),
        "step 20: f32 {a}, bf16-mixed {b}"
    );
    assert!(
        a != b,
        "bf16-mixed computed exactly as f32: the casts did nothing"
    );
}

/// Offload and reload through every backend: the value goes to host memory and comes back, its
/// arena bytes reused meanwhile (on cpu the driver removes both nodes; the device backends run
/// the Program's offload and reload steps).
#[test]
fn offloaded_values_come_back_unchanged() {
    check(
        "offload",
        "graph offload {
  input %x: f32[5,13]
  %1: f32[5,13] = exp(%x)
  %2: f32[5,13] = offload(%1)
  %3: f32[5,13] = sin(%x)
  %4: f32[5,13] = mul(%3, %3)
  %5: f32[5,13] = reload(%2)
  %6: f32[5,13] = mul(%5, %4)
  output o = %6
}",
    );
}

/// `offload` on a whole train step: on a device it moves what it says to host memory, the
/// arena (planned, and as the device's allocator measures it) shrinks, and training is bitwise
/// the same; on cpu, whose arena is host memory, the report says nothing moved and the Program
/// holds no offload step.
#[test]
fn offload_moves_saved_activations_to_host_memory_on_devices_and_says_so_on_cpu() {
    use graphtrain::data::DataSource;
    use graphtrain::lr_schedule::LrSchedule;
    use graphtrain::trainer::{TrainConfig, Trainer};
    use graphtrain_ir::optim::OptimConfig;
    use graphtrain_passes::{PipelineSpec, Registry};
    use graphtrain_runtime::CompileOptions;

    let tiny = graphtrain_models::Llama3Config::builtin("tiny").unwrap();
    let build = |list: &str, backend: Backend| {
        let pipeline = PipelineSpec::parse_list(list)
            .unwrap()
            .build(&Registry::builtin())
            .unwrap();
        let cfg = TrainConfig {
            data: DataSource::Random,
            seed: 0,
            lr: LrSchedule::constant(1e-3),
            optim: OptimConfig::default(),
        };
        Trainer::build_on(
            &tiny,
            cfg,
            backend,
            &CompileOptions::new(&pipeline, Mode::Fused),
            None,
        )
        .unwrap_or_else(|e| panic!("{list} on {backend}: {e}"))
    };
    let offload = "offload=min_bytes:1024;prefetch:2,default";
    let offloads = |t: &Trainer| {
        t.program()
            .unwrap()
            .steps
            .iter()
            .filter(|s| s.kind() == "offload")
            .count()
    };

    let cpu = build(offload, Backend::Cpu);
    assert_eq!(offloads(&cpu), 0, "cpu runs no offload step");
    assert_eq!(cpu.program().unwrap().host_bytes(), 0);
    let record = cpu.passes.iter().find(|r| r.pass == "offload").unwrap();
    assert!(
        record
            .report
            .declined
            .iter()
            .any(|d| d.reason.contains("nothing to move")),
        "the cpu run must say that offload moved nothing: {:?}",
        record.report
    );

    for backend in device_backends() {
        let run = |list: &str| {
            let mut t = build(list, backend);
            let steps: Vec<(u64, u64)> = (0..3)
                .map(|_| {
                    let m = t.step().unwrap();
                    (m.loss.to_bits(), m.grad_norm.to_bits())
                })
                .collect();
            let p = t.program().unwrap();
            let planned = (p.plan.arena_bytes, p.host_bytes(), offloads(&t));
            (steps, planned, t.measured_memory().unwrap())
        };
        let (steps_with, (arena_with, moved, n_offloads), m_with) = run(offload);
        let (steps_without, (arena_without, _, _), m_without) = run("default");
        assert!(n_offloads > 0 && moved > 0, "{backend}: nothing offloaded");
        assert_eq!(
            steps_with, steps_without,
            "{backend}: offloading changed the step"
        );
        assert!(
            arena_with < arena_without,
            "{backend}: the planned arena did not shrink: {arena_with} with offload, \
{arena_without} without"
        );
        assert_eq!(m_with.host_bytes, moved as u64, "{backend}: host bytes");
        assert_eq!(m_without.host_bytes, 0);
        assert_eq!(
            m_without.device_bytes as i64 - m_with.device_bytes as i64,
            arena_without as i64 - arena_with as i64,
            "{backend}: the device allocator gave the arena {} bytes with offload, {} without",
            m_with.device_bytes,
            m_without.device_bytes
        );
    }
}

/// Rows longer than lavapipe's loop budget (llvmpipe leaves every loop of a kernel unit after
/// 65535 trips in all, silently: a 131,072-element copy kept 65,535 elements, a 600,000-element
/// sum stopped at 524,280): a copy cut into short rows and sums taking four blocks per trip stay
/// inside it, on every lowering; a sum that would still take more is refused when the program
/// loads, naming the limit, where the device has one (and computed where it has none).
#[test]
fn long_rows_stay_inside_the_devices_loop_budget_or_are_refused() {
    let src = |n: usize| {
        format!(
            "graph g {{
  input %x: f32[{n}]
  %1: f32[1,{n}] = reshape(%x, shape=[1,{n}])
  %2: f32[] = reduce_sum(%x, axes=[0], keepdim=false)
  %3: f32[{n}] = mul(%x, %x)
  %4: f32[] = reduce_sum(%3, axes=[0], keepdim=false)
  output copy = %1
  output sum = %2
  output squares = %4
}}"
        )
    };
    for backend in device_backends() {
        for n in [70_000, 1_048_576] {
            let g = text::parse(&src(n)).unwrap();
            let inputs = random_inputs(&g, 0);
            let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
            for mode in [Mode::Eager, Mode::Fused] {
                let got = run_once(&g, backend, mode, &inputs)
                    .unwrap_or_else(|e| panic!("{backend} {mode:?}, {n} elements: {e}"));
                assert_outputs(
                    &format!("{backend} {mode:?}, {n} elements"),
                    &output_names(&g),
                    &got,
                    &want,
                    Agree::Relative(1e-4),
                );
            }
        }
        // Column sums of squares (fused: one map-reduce over the rows per group of output
        // vectors): 20,000 rows take about 20,000 trips in a unit that holds fewer than eight
        // outputs, and run.
        let columns = text::parse(
            "graph g {
  input %x: f32[20000,64]
  %1: f32[20000,64] = mul(%x, %x)
  %2: f32[64] = reduce_sum(%1, axes=[0], keepdim=false)
  output squares = %2
}",
        )
        .unwrap();
        let inputs = random_inputs(&columns, 0);
        let want = run_once(&columns, Backend::Reference, Mode::Eager, &inputs).unwrap();
        for mode in [Mode::Eager, Mode::Fused] {
            let got = run_once(&columns, backend, mode, &inputs)
                .unwrap_or_else(|e| panic!("{backend} {mode:?}, column sums: {e}"));
            assert_outputs(
                &format!("{backend} {mode:?}, column sums over 20,000 rows"),
                &output_names(&columns),
                &got,
                &want,
                Agree::Relative(1e-4),
            );
        }
        let g = text::parse(&src(3_000_000)).unwrap();
        let inputs = random_inputs(&g, 0);
        match run_once(&g, backend, Mode::Eager, &inputs) {
            Err(e) => assert!(
                e.to_string().contains("loop trips in one kernel unit")
                    && e.to_string().contains("(llvmpipe's limit)"),
                "{e}"
            ),
            Ok(got) => assert_outputs(
                &format!("{backend}, 3,000,000 elements on a device without a loop budget"),
                &output_names(&g),
                &got,
                &run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap(),
                Agree::Relative(1e-4),
            ),
        }
    }
}

/// The device backends' two matmul kernels: the tiled one (16 x 16 outputs per cube, operands
/// staged in shared memory; the default on `cuda`) against the interpreter, and bit for bit
/// against the one-unit-per-output kernel (each sums `k` in index order), on products smaller
/// than a tile, spanning several with ragged edges, batched, and read through transposes.
#[test]
fn the_tiled_device_matmul_matches_the_per_output_one() {
    let src = "graph g {
  input %a: f32[3,37,45]
  input %b: f32[3,45,29]
  input %c: f32[5,7]
  input %d: f32[7,3]
  input %e: f32[40,33]
  input %f: f32[50,33]
  input %g: f32[40,21]
  %7: f32[3,37,29] = matmul(%a, %b)
  %8: f32[5,3] = matmul(%c, %d)
  %9: f32[33,50] = transpose(%f, perm=[1,0])
  %10: f32[40,50] = matmul(%e, %9)
  %11: f32[33,40] = transpose(%e, perm=[1,0])
  %12: f32[33,21] = matmul(%11, %g)
  output p = %7
  output q = %8
  output r = %10
  output s = %12
}";
    let g = text::parse(src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    let names = output_names(&g);
    for backend in device_backends() {
        for seed in 0..2 {
            let inputs = random_inputs(&g, seed);
            let want = run_once(&g, Backend::Reference, Mode::Eager, &inputs).unwrap();
            let with = |kernel| {
                let options = RuntimeOptions {
                    device_matmul: kernel,
                    ..RuntimeOptions::default()
                };
                run_once_with(&g, backend, Mode::Fused, options, &inputs)
                    .unwrap_or_else(|e| panic!("{backend} {kernel:?}: {e}"))
            };
            let tiled = with(DeviceMatmul::Tiled);
            assert_outputs(
                &format!("{backend} tiled matmul vs the interpreter (seed {seed})"),
                &names,
                &tiled,
                &want,
                Agree::Relative(1e-4),
            );
            assert_outputs(
                &format!("{backend} tiled vs per-output matmul (seed {seed})"),
                &names,
                &tiled,
                &with(DeviceMatmul::PerOutput),
                Agree::Bitwise,
            );
            assert_outputs(
                &format!("{backend} tiled matmul run again (seed {seed})"),
                &names,
                &with(DeviceMatmul::Tiled),
                &tiled,
                Agree::Bitwise,
            );
        }
    }
}
