//! Programs as data: small graphs in the text format go in, the Program's text form comes out,
//! eager and fused side by side, compared against the snapshots in `tests/snapshots/`. The
//! numerics of these lowerings are checked on the backends (tests/backends.rs, the bitwise gate);
//! here it is their shape: which steps, what they read and write, what got fused.

use graphtrain_ir::text::parse;
use graphtrain_lowering::{kept_composite, lower, lower_with_limits, FusionLimits, Mode};

/// The Program of `src` in both modes, as one text.
fn both(src: &str) -> String {
    let g = parse(src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    let eager = lower(&g, Mode::Eager).unwrap();
    let fused = lower(&g, Mode::Fused).unwrap();
    format!("{eager}\n{fused}")
}

/// The fused Program of `src` under `limits`.
fn fused_with(src: &str, limits: &FusionLimits) -> String {
    let g = parse(src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    lower_with_limits(&g, Mode::Fused, &kept_composite, limits)
        .unwrap()
        .to_string()
}

const CHAIN: &str = "graph chain {
  input %x: f32[4,8]
  input %y: f32[4,8]
  %2: f32[4,8] = exp(%x)  # fwd region=0
  %3: f32[4,8] = mul(%2, %y)  # fwd region=0
  %4: f32[4,8] = add_scalar(%3, value=1.0)  # fwd region=0
  %5: f32[4,8] = sqrt(%4)  # fwd region=0
  output o = %5
}";

// An elementwise chain is one map per node in eager and one map in fused, in its capture region.
#[test]
fn elementwise_chain_fuses_into_one_map() {
    insta::assert_snapshot!(both(CHAIN));
}

// A sum over rows of 16 (a multiple of 8, as are the 8 rows) takes its squaring producer in.
#[test]
fn reduction_takes_its_elementwise_producer() {
    insta::assert_snapshot!(both(
        "graph rms {
  input %x: f32[8,16]
  %1: f32[8,16] = square(%x)
  %2: f32[8] = reduce_sum(%1, axes=[1], keepdim=false)
  output o = %2
}"
    ));
}

// Rows of 12 are not a multiple of 8: the map and the reduction stay apart in fused mode too.
#[test]
fn reduction_over_unaligned_rows_is_not_fused() {
    insta::assert_snapshot!(both(
        "graph rms {
  input %x: f32[8,12]
  %1: f32[8,12] = square(%x)
  %2: f32[8] = reduce_sum(%1, axes=[1], keepdim=false)
  output o = %2
}"
    ));
}

// A reshape of a value in memory, read by an elementwise op and by a matmul, is that value to
// both: the map reads `%3` itself, the GEMM a view of it; nothing is copied.
#[test]
fn a_reshape_read_by_a_map_is_its_value_not_a_copy() {
    let out = both(
        "graph reshaped {
  input %x: f32[2,4,8]
  input %w: f32[8,6]
  input %y: f32[8,8]
  %3: f32[2,4,8] = exp(%x)
  %4: f32[8,8] = reshape(%3, shape=[8,8])
  %5: f32[8,6] = matmul(%4, %w)
  %6: f32[8,8] = add(%4, %y)
  output a = %5
  output b = %6
}",
    );
    let fused = out.split("program").last().unwrap();
    assert!(!fused.contains("copy"), "{out}");
    insta::assert_snapshot!(out);
}

// A transposed weight is read by the GEMM through strides instead of copied first.
#[test]
fn matmul_reads_a_transpose_as_strides() {
    insta::assert_snapshot!(both(
        "graph linear {
  input %x: f32[2,4,8]
  input %w: f32[6,8]
  %2: f32[8,6] = transpose(%w, perm=[1,0])
  %3: f32[2,4,6] = matmul(%x, %2)
  output o = %3
}"
    ));
}

// A matmul read only through a transpose of its last two dims writes the transpose (b^T a^T).
#[test]
fn matmul_writes_its_transposed_reader() {
    insta::assert_snapshot!(both(
        "graph grad {
  input %x: f32[16,8]
  input %dy: f32[16,6]
  %2: f32[8,16] = transpose(%x, perm=[1,0])
  %3: f32[8,6] = matmul(%2, %dy)
  %4: f32[6,8] = transpose(%3, perm=[1,0])
  output o = %4
}"
    ));
}

// Reshaped and expanded values become broadcast reads (a row, a column, a scalar) of one map.
#[test]
fn reshape_and_expand_become_broadcast_reads() {
    insta::assert_snapshot!(both(
        "graph bias {
  input %x: f32[16,8]
  input %b: f32[8]
  input %s: f32[16]
  input %k: f32[]
  %4: f32[1,8] = reshape(%b, shape=[1,8])
  %5: f32[16,8] = expand(%4, shape=[16,8])
  %6: f32[16,1] = reshape(%s, shape=[16,1])
  %7: f32[16,8] = expand(%6, shape=[16,8])
  %8: f32[1,1] = reshape(%k, shape=[1,1])
  %9: f32[16,8] = expand(%8, shape=[16,8])
  %10: f32[16,8] = add(%x, %5)
  %11: f32[16,8] = mul(%10, %7)
  %12: f32[16,8] = sub(%11, %9)
  output o = %12
}"
    ));
}

// A reshape that a matmul reads is a view of its source; a slice feeding a copy is an offset.
#[test]
fn reshape_and_slice_are_views() {
    insta::assert_snapshot!(both(
        "graph views {
  input %x: f32[2,4,8]
  input %w: f32[8,6]
  %2: f32[8,8] = reshape(%x, shape=[8,8])
  %3: f32[8,6] = matmul(%2, %w)
  %4: f32[2,2,8] = slice(%x, axis=1, start=1, end=3)
  %5: f32[2,8,2] = transpose(%4, perm=[0,2,1])
  output o = %3
  output s = %5
}"
    ));
}

// Cross-entropy and its backward are kept composites: one step each, in both modes.
#[test]
fn cross_entropy_is_one_step() {
    insta::assert_snapshot!(both(
        "graph loss {
  input %logits: f32[8,16]
  input %t: i32[8]
  %2: f32[] = cross_entropy(%logits, %t)
  %3: f32[] = full(value=1.0, shape=[], dtype=f32)
  %4: f32[8,16] = cross_entropy_backward(%logits, %t, %3)
  output loss = %2
  output grad = %4
}"
    ));
}

// Rope is a kept composite: one step reading its input in place.
#[test]
fn rope_is_one_step() {
    insta::assert_snapshot!(both(
        "graph rope {
  input %x: f32[1,4,2,8]
  %1: f32[1,4,2,8] = rope(%x, theta=10000.0, layout=interleaved, inverse=false)
  %2: f32[1,4,2,8] = mul_scalar(%1, value=0.5)
  output o = %2
}"
    ));
}

// Two in-place AdamW updates with the same scalars are two steps in eager, one in fused.
#[test]
fn in_place_adamw_updates_merge_in_fused_mode() {
    insta::assert_snapshot!(both(
        "graph opt {
  input %lr: f32[]
  input %t: f32[]
  param %p0: f32[8]
  input %g0: f32[8]
  state %m0: f32[8]
  state %v0: f32[8]
  param %p1: f32[16]
  input %g1: f32[16]
  state %m1: f32[16]
  state %v1: f32[16]
  %10: f32[8], %11: f32[8], %12: f32[8] = adamw(%p0, %g0, %m0, %v0, %lr, %t, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
  %13: f32[16], %14: f32[16], %15: f32[16] = adamw(%p1, %g1, %m1, %v1, %lr, %t, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)
  output p0 = %10 donates %p0
  output m0 = %11 donates %m0
  output v0 = %12 donates %v0
  output p1 = %13 donates %p1
  output m1 = %14 donates %m1
  output v1 = %15 donates %v1
}"
    ));
}

// Merged projections (`merge_matmuls`) read their weights side by side: the concat of
// parameters is no step in fused mode, its parts planned one after the other, each updated in
// place afterwards. A second concat of the same parameters is copied (a part is in one pack),
// and so is one read after a part's update (it must hold the values from before).
#[test]
fn a_concat_of_parameters_is_read_in_place() {
    let out = both(
        "graph merged {
  input %x: f32[4,16]
  input %lr: f32[]
  param %wq: f32[16,16]
  param %wk: f32[8,16]
  param %w1: f32[8,16]
  param %w3: f32[8,16]
  %6: f32[24,16] = concat(%wq, %wk, axis=0)  # fwd
  %7: f32[16,24] = transpose(%6, perm=[1,0])  # fwd
  %8: f32[4,24] = matmul(%x, %7)  # fwd
  %9: f32[40,16] = concat(%wq, %wk, %wq, axis=0)  # fwd
  %10: f32[16,16] = concat(%w1, %w3, axis=0)  # fwd
  %11: f32[16,16] = mul_scalar(%wq, value=0.5)  # opt
  %12: f32[8,16] = mul_scalar(%w1, value=0.5)  # opt
  %13: f32[16,16] = transpose(%10, perm=[1,0])  # opt
  %14: f32[4,16] = matmul(%x, %13)  # opt
  output y = %8
  output z = %9
  output u = %14
  output wq = %11 donates %wq
  output w1 = %12 donates %w1
}",
    );
    insta::assert_snapshot!(out);
    let fused = out.split("program fused").nth(1).unwrap();
    assert_eq!(fused.matches("pack ").count(), 1, "{fused}");
    // `%wk` starts where `%wq`'s 16 x 16 x 4 bytes end, and the concat where `%wq` does.
    let line = fused.lines().find(|l| l.starts_with("pack ")).unwrap();
    let at = |name: &str| -> usize {
        let rest = &line[line.find(name).unwrap() + name.len()..];
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    assert_eq!(at("%wk@"), at("%wq@") + 1024, "{line}");
    assert_eq!(at("%6@"), at("%wq@"), "{line}");
}

// An iota/compare causal mask is folded into a constant; its -inf fill stays in the kernel.
#[test]
fn input_independent_mask_is_folded() {
    insta::assert_snapshot!(both(
        "graph mask {
  input %x: f32[8,8]
  %1: i32[8,8] = iota(shape=[8,8], axis=0, dtype=i32)
  %2: i32[8,8] = iota(shape=[8,8], axis=1, dtype=i32)
  %3: bool[8,8] = gt(%2, %1)
  %4: f32[8,8] = full(value=-inf, shape=[8,8], dtype=f32)
  %5: f32[8,8] = select(%3, %4, %x)
  output o = %5
}"
    ));
}

const FOUR_INPUTS: &str = "graph four {
  input %a: f32[32]
  input %b: f32[32]
  input %c: f32[32]
  input %d: f32[32]
  %4: f32[32] = mul(%a, %b)
  %5: f32[32] = mul(%c, %d)
  %6: f32[32] = add(%4, %5)
  output o = %6
}";

// With at most 3 inputs per kernel, a 4-input fused map splits: its producers are materialized.
#[test]
fn a_smaller_input_limit_splits_the_kernel() {
    let default = fused_with(FOUR_INPUTS, &FusionLimits::default());
    let three = FusionLimits {
        max_map_inputs: 3,
        ..FusionLimits::default()
    };
    insta::assert_snapshot!(format!("{default}\n{}", fused_with(FOUR_INPUTS, &three)));
}

// With at most 4 nodes per inlined expression, the chain is cut after the op that outgrows them.
#[test]
fn a_smaller_expression_limit_splits_the_chain() {
    let small = FusionLimits {
        max_expr_nodes: 4,
        ..FusionLimits::default()
    };
    insta::assert_snapshot!(fused_with(CHAIN, &small));
}

// Limits the runtime's map kernel cannot honour, or zero, are refused with the reason.
#[test]
fn out_of_range_limits_are_refused() {
    let g = parse(CHAIN).unwrap();
    let refuse = |limits: FusionLimits| {
        lower_with_limits(&g, Mode::Fused, &kept_composite, &limits)
            .unwrap_err()
            .to_string()
    };
    let d = FusionLimits::default();
    let too_many = refuse(FusionLimits {
        max_map_inputs: 7,
        ..d
    });
    assert!(
        too_many.contains("max_map_inputs = 7 exceeds 6"),
        "{too_many}"
    );
    let zero = refuse(FusionLimits {
        max_map_inputs: 0,
        ..d
    });
    assert!(zero.contains("max_map_inputs = 0 is below 3"), "{zero}");
    let zero = refuse(FusionLimits {
        max_expr_nodes: 0,
        ..d
    });
    assert!(zero.contains("max_expr_nodes = 0"), "{zero}");
    let zero = refuse(FusionLimits {
        converge_hops: 0,
        ..d
    });
    assert!(zero.contains("converge_hops = 0"), "{zero}");
    assert_eq!(d.validate(), Ok(()));
}

// Folding, a broadcast read and fusion together: a masked, weighted sum of squares is one kernel.
#[test]
fn masked_weighted_sum_of_squares_is_one_kernel() {
    insta::assert_snapshot!(both(
        "graph g {
  input %x: f32[8,16]
  input %w: f32[16]
  %2: i32[8,16] = iota(shape=[8,16], axis=0, dtype=i32)
  %3: i32[8,16] = iota(shape=[8,16], axis=1, dtype=i32)
  %4: bool[8,16] = gt(%3, %2)
  %5: f32[8,16] = full(value=0.0, shape=[8,16], dtype=f32)
  %6: f32[1,16] = reshape(%w, shape=[1,16])
  %7: f32[8,16] = expand(%6, shape=[8,16])
  %8: f32[8,16] = mul(%x, %7)  # fwd region=1
  %9: f32[8,16] = select(%4, %5, %8)  # fwd region=1
  %10: f32[8,16] = square(%9)  # fwd region=1
  %11: f32[8] = reduce_sum(%10, axes=[1], keepdim=false)  # fwd region=1
  output o = %11
}"
    ));
}

// A collective is a start step and a wait step in both modes. The start reads its operand
// whole (an elementwise producer is materialized for it, not inlined), the wait's result is
// stored in the handle's bytes (same offset), and the operand's buffer lives until the wait.
#[test]
fn collectives_lower_to_start_and_wait_steps() {
    let src = "graph fsdp {
  mesh dp_shard=2
  input %x: f32[2,8] @ [shard(0)]
  param %w: f32[4,8] @ [shard(0)]
  %2: f32[4,8] = mul_scalar(%w, value=2.0)  # fwd
  %3: f32[8,8] = all_gather_start(%2, mesh_dims=[0], group=2, axis=0)  # fwd
  %4: f32[2,8] = exp(%x)  # fwd
  %5: f32[8,8] = wait(%3)  # fwd
  %6: f32[2,8] = matmul(%4, %5)  # fwd
  %7: f32[] = reduce_sum(%6, axes=[0,1], keepdim=false)  # loss
  %8: f32[] = all_reduce_start(%7, mesh_dims=[0], group=2, reduce=sum)  # loss
  %9: f32[] = wait(%8)  # loss
  output loss = %9 @ [replicate]
}";
    for mode in [Mode::Eager, Mode::Fused] {
        let g = parse(src).unwrap();
        graphtrain_ir::verify::verify(&g).unwrap();
        let p = lower(&g, mode).unwrap();
        let (v, plan) = (graphtrain_ir::ValueId, &p.plan);
        // Handle and wait result share one buffer; the gathered operand %2 is live until the
        // wait, so nothing planned between start and wait may take its bytes.
        assert_eq!(plan.offset_of(v(3)), plan.offset_of(v(5)), "{mode:?}");
        let b2 = &plan.buffers[plan.buffer_of[2].unwrap()];
        let b3 = &plan.buffers[plan.buffer_of[3].unwrap()];
        assert!(
            b2.live.1 > b3.live.0,
            "{mode:?}: %2 dies at its collective's start, before the wait"
        );
    }
    insta::assert_snapshot!(both(src));
}

// An offloaded value leaves the arena between its offload and its reload: it is written to host
// memory (`@host`), its arena bytes go to values computed meanwhile, and the reload writes it
// back into the arena for the readers after. Offload and reload are never inlined as identities
// (which would keep the value in the arena).
#[test]
fn offloaded_values_live_in_host_memory_between_offload_and_reload() {
    let src = "graph offload {
  input %x: f32[8,16]
  %1: f32[8,16] = exp(%x)
  %2: f32[8,16] = offload(%1)
  %3: f32[8,16] = sin(%x)
  %4: f32[8,16] = mul(%3, %3)
  %5: f32[8,16] = reload(%2)
  %6: f32[8,16] = mul(%5, %4)
  output o = %6
}";
    let g = parse(src).unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    for mode in [Mode::Eager, Mode::Fused] {
        let p = lower(&g, mode).unwrap();
        let kinds: Vec<&str> = p.steps.iter().map(|s| s.kind()).collect();
        assert!(
            kinds.contains(&"offload") && kinds.contains(&"reload"),
            "{mode:?}: {kinds:?}"
        );
        assert_eq!(p.host_bytes(), 8 * 16 * 4, "{mode:?}");
        for v in &p.host_values {
            assert_eq!(
                p.plan.offset_of(*v),
                None,
                "{mode:?}: a host value got arena bytes"
            );
        }
    }
    insta::assert_snapshot!(both(src));
}

// bf16-mixed: a cast to bf16 read only by bf16 matmuls (directly or through layout ops) folds
// into them, which round the f32 operand as they read it (`round_bf16(..)` on the operand, no
// cast kernel, no bf16 copy): the weight read through its transpose, the activation read by
// two matmuls. A cast with another reader (`%15`, also squared) stays a kernel. A widening cast
// read by views and elementwise ops is the bf16 value (`%8` for the reduction), and a bf16 weight
// gradient read through its widening cast by a transpose is written transposed, rounded
// (`round_out=bf16`: its f32 output holds a bf16 value). Numerics: tests/backends.rs
// (`bf16_matmuls_on_cpu_round_their_f32_sums`) and tests/gate.rs (bf16-mixed, fused bitwise
// eager on `tiny`).
#[test]
fn bf16_casts_fold_into_the_matmuls_that_read_them() {
    insta::assert_snapshot!(both(
        "graph mixed {
  input %x: f32[8,8]
  param %w: f32[6,8]
  input %gy: f32[8,6]
  input %z: f32[8,8]
  %4: f32[8,6] = transpose(%w, perm=[1,0])
  %5: bf16[8,6] = cast(%4, dtype=bf16)
  %6: bf16[8,8] = cast(%x, dtype=bf16)
  %7: bf16[8,6] = matmul(%6, %5)
  %8: f32[8,6] = cast(%7, dtype=f32)
  %9: f32[8] = reduce_sum(%8, axes=[1], keepdim=false)
  %10: bf16[8,6] = cast(%gy, dtype=bf16)
  %11: bf16[8,8] = transpose(%6, perm=[1,0])
  %12: bf16[8,6] = matmul(%11, %10)
  %13: f32[8,6] = cast(%12, dtype=f32)
  %14: f32[6,8] = transpose(%13, perm=[1,0])
  %15: bf16[8,8] = cast(%z, dtype=bf16)
  %16: bf16[8,8] = mul(%15, %15)
  %17: bf16[8,6] = matmul(%15, %5)
  output s = %9
  output gw = %14
  output q = %16
  output r = %17
}"
    ));
}

// bf16 stored in 2 bytes (`Program::store_bf16_in_two_bytes`, the cpu backend's): bf16 values
// written by a matmul or a rounding map and read only whole by maps, by a map fused into a row
// sum, or by matmuls are marked `(2 bytes)` (eager: the casts of `a` and `b` and the products;
// fused, where the casts fold into the matmuls: the products); declined: values read through a
// copy (eager: `t`'s product, read transposed, and `c`'s cast, of which `e` reads a slice), an
// output (`r`), and a value of 8 elements, not a whole pair of the map kernel's vectors (`e`'s
// product). Numerics: tests/backends.rs
// (`bf16_values_stored_in_two_bytes_read_as_they_were_written`).
#[test]
fn bf16_values_whose_steps_take_halves_are_stored_in_two_bytes() {
    let g = parse(
        "graph halves {
  input %a: f32[16,8]
  input %b: f32[8,16]
  input %c: f32[16,16]
  %3: bf16[16,8] = cast(%a, dtype=bf16)
  %4: bf16[8,16] = cast(%b, dtype=bf16)
  %5: bf16[16,16] = cast(%c, dtype=bf16)
  %6: bf16[16,16] = matmul(%3, %4)
  %7: f32[16,16] = cast(%6, dtype=f32)
  %8: f32[16,16] = mul(%7, %c)
  %9: bf16[16,16] = matmul(%5, %5)
  %19: f32[16,16] = cast(%9, dtype=f32)
  %20: f32[16,16] = square(%19)
  %21: f32[16] = reduce_sum(%20, axes=[1], keepdim=false)
  %10: bf16[16,16] = matmul(%5, %5)
  %11: bf16[16,16] = matmul(%10, %5)
  %12: f32[16,16] = cast(%11, dtype=f32)
  %13: bf16[16,16] = matmul(%5, %5)
  %14: bf16[16,16] = transpose(%13, perm=[1,0])
  %16: f32[16,16] = cast(%14, dtype=f32)
  %15: bf16[16,16] = matmul(%5, %5)
  %17: bf16[1,16] = slice(%5, axis=0, start=0, end=1)
  %18: bf16[1,8] = matmul(%17, %3)
  %22: f32[1,8] = cast(%18, dtype=f32)
  %23: f32[1,8] = exp(%22)
  output y = %8
  output s = %21
  output z = %12
  output t = %16
  output r = %15
  output e = %23
}",
    )
    .unwrap();
    graphtrain_ir::verify::verify(&g).unwrap();
    let mut text = String::new();
    for mode in [Mode::Eager, Mode::Fused] {
        let mut p = lower(&g, mode).unwrap();
        let before = p.plan.arena_bytes;
        let chosen = p.store_bf16_in_two_bytes();
        text += &format!(
            "{chosen} values in 2 bytes, arena {before} -> {} bytes\n{p}\n",
            p.plan.arena_bytes
        );
    }
    insta::assert_snapshot!(text);
}

// bf16 attention (bf16-mixed's): fused, the casts of q (through its transpose), k, v and the
// output gradient are views that the attention steps round as they read them, and each result
// is written through its widening cast straight into its transposed reader; eager materializes
// every cast. Numerics: tests/backends.rs, `bf16_attention_matches_the_interpreter_on_every_kernel`.
#[test]
fn bf16_casts_fold_into_attention_and_its_gradient() {
    insta::assert_snapshot!(both(
        "graph mixed {
  input %x: f32[1,4,2,8]
  input %k: f32[1,2,4,8]
  input %v: f32[1,2,4,8]
  input %g: f32[1,2,4,8]
  %4: f32[1,2,4,8] = transpose(%x, perm=[0,2,1,3])
  %5: bf16[1,2,4,8] = cast(%4, dtype=bf16)
  %6: bf16[1,2,4,8] = cast(%k, dtype=bf16)
  %7: bf16[1,2,4,8] = cast(%v, dtype=bf16)
  %8: bf16[1,2,4,8] = cast(%g, dtype=bf16)
  %9: bf16[1,2,4,8] = attention(%5, %6, %7, causal=true, scale=0.25)
  %10: f32[1,2,4,8] = cast(%9, dtype=f32)
  %11: f32[1,4,2,8] = transpose(%10, perm=[0,2,1,3])
  %12: bf16[1,2,4,8], %13: bf16[1,2,4,8], %14: bf16[1,2,4,8] = attention_backward(%5, %6, %7, %8, causal=true, scale=0.25)
  %15: f32[1,2,4,8] = cast(%12, dtype=f32)
  %16: f32[1,4,2,8] = transpose(%15, perm=[0,2,1,3])
  output o = %11
  output dq = %16
  output dk = %13
  output dv = %14
}"
    ));
}
