//! Fused lowering: fewer launches and fewer values in the arena, with the eager lowering's bits.
//!
//! What it does, on top of the per-node steps of `eager`:
//! - layout ops become views: `reshape` of a contiguous value, `transpose`, `slice` and `expand`
//!   are strided reads of their source where every reader takes a strided operand (matmul,
//!   copy, reduce, the kept composites); a transpose feeding a matmul becomes GEMM strides, and
//!   an `expand` that only elementwise ops of its size read becomes a broadcast `Access` of
//!   their operand (period a multiple of `BROADCAST_ALIGN`), and a `reshape` of a whole value
//!   in memory is that value to elementwise readers too (no copy for them to read);
//! - a matmul read only through a transpose of its last two dims writes the transpose
//!   (`bᵀ aᵀ`), also through a widening cast of its bf16 result, and an attention output (or
//!   gradient) read only through `transpose(0, 2, 1, 3)`, also through a widening cast of its
//!   bf16 result, is written in that layout through its output view;
//! - bf16-mixed's casts: a cast of f32 to bf16 that only bf16 matmuls and bf16 attention read
//!   (through layout ops) is a view of its operand, which those steps round as they read it
//!   (`Bf16Rounding::a`/`b`, and bf16 attention's contract: the same rounding the cast kernel
//!   does); a cast that changes no stored bit (bf16 widened to f32: bf16 is held in f32
//!   slots), of a value in memory, that
//!   only elementwise ops and views read is that value (its readers read the operand). Neither
//!   takes a kernel or arena bytes: the weights are no longer transposed and rounded into a copy
//!   for every matmul, no bf16 copy is held until the backward, and SiLU's output is recomputed
//!   by its readers from the bf16 product as in f32 (so `peer`'s arena is f32's);
//! - elementwise chains become one `Map`: a value with one elementwise reader of its size is
//!   computed inside that reader's kernel; so is a value with two readers whose single-use
//!   chains meet again within `FusionLimits::converge_hops` (SiLU's gradient), and one op over
//!   values in memory, at most one of them full-size, read only by elementwise ops of its size,
//!   which each of them recomputes (SiLU's output, RMSNorm's `x · rstd`);
//! - a single-use elementwise value whose reader sums or maxes its trailing or its leading dims
//!   is computed inside that reduction (`MapReduce`; row length a multiple of 8, and the row
//!   count too when rows are reduced, so the elements are computed in the eager map's vectors
//!   and combined in `Reduce`'s order).
//!
//! None of these inline a value into a reader of another micro-batch: in a step split into
//! micro-batches each value is computed in its own, so what it reads dies there.
//!
//! Guarantees: the same per-element arithmetic in the same order as eager, so the same bits on
//! one backend. This relies on a backend never contracting a product and its sum into an FMA
//! inside one kernel (the cpu kernels hide every product from cubecl's optimizer for that;
//! `runtime`'s kernels, `opaque`). No kernel reads more than `FusionLimits::max_map_inputs`
//! values, and no value whose expression exceeds `FusionLimits::max_expr_nodes` nodes is
//! inlined into its reader (so a kernel's expression is at most one op over such parts): where
//! a chain would exceed either, it is split and its producers materialized.
//!
//! Declines: as `eager` (a node with no step), and `FusionLimits::validate`'s out-of-range
//! limits.

use crate::eager::{elementwise_expr, reduce_kind, structural_steps};
use crate::program::{
    Access, Bf16Rounding, Expr, LowerError, MapInput, ReduceOver, Step, View, BROADCAST_ALIGN,
    MAX_MAP_INPUTS,
};
use crate::views::{
    as_batched, contiguous_strides, expand_access, expand_view, reshape_view, slice_view,
    transpose_view,
};
use graphtrain_ir::{DType, Graph, Op, ValueId};

/// The limits of one fused kernel: options of `lower_with_limits` (`Default` is what `lower`
/// and `lower_with` use). They bound what fusion inlines, never what a node needs: an
/// elementwise op always gets a kernel of its own operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FusionLimits {
    /// Most values one `Map` or `MapReduce` reads. At most `MAX_MAP_INPUTS` (what the runtime's
    /// map kernel takes) and at least 3 (a `select` reads three, and one op is never split).
    pub max_map_inputs: usize,
    /// Largest expression of a value inlined into its reader's kernel, in `Expr` nodes: bounds
    /// JIT time and register pressure (a kernel is one op over such expressions, so it may be a
    /// few nodes larger). At least 1.
    pub max_expr_nodes: usize,
    /// How many single-use elementwise nodes fusion follows from a value's first reader to find
    /// its second one (the converging readers above). At least 1.
    pub converge_hops: usize,
}

/// Largest fused expression, in nodes: bounds JIT time and register pressure.
const MAX_EXPR_NODES: usize = 48;

/// How many single-use elementwise nodes `fused_steps` follows from a value's first reader to
/// find its second one.
const CONVERGE_HOPS: usize = 6;

/// The most operands one elementwise op reads (`select`): a `Map` of a single node, which
/// fusion cannot split further, reads that many.
const MIN_MAP_INPUTS: usize = 3;

impl Default for FusionLimits {
    fn default() -> Self {
        FusionLimits {
            max_map_inputs: MAX_MAP_INPUTS,
            max_expr_nodes: MAX_EXPR_NODES,
            converge_hops: CONVERGE_HOPS,
        }
    }
}

impl FusionLimits {
    /// Refuses limits a Program could not honour or a backend could not run.
    pub fn validate(&self) -> Result<(), LowerError> {
        let fail = |message: String| {
            Err(LowerError {
                node: None,
                module: String::new(),
                message: format!("invalid fusion limits: {message}"),
            })
        };
        if self.max_map_inputs > MAX_MAP_INPUTS {
            return fail(format!(
                "max_map_inputs = {} exceeds {MAX_MAP_INPUTS}, the most inputs the runtime's map kernel takes",
                self.max_map_inputs
            ));
        }
        if self.max_map_inputs < MIN_MAP_INPUTS {
            return fail(format!(
                "max_map_inputs = {} is below {MIN_MAP_INPUTS}: a `select` reads {MIN_MAP_INPUTS} inputs in one kernel, which fusion cannot split",
                self.max_map_inputs
            ));
        }
        if self.max_expr_nodes == 0 {
            return fail("max_expr_nodes = 0: it must be at least 1".into());
        }
        if self.converge_hops == 0 {
            return fail("converge_hops = 0: it must be at least 1".into());
        }
        Ok(())
    }
}

/// Fused: layout ops become views where every consumer can read strided, elementwise chains
/// become one `Map` each; the rest as in eager.
#[allow(clippy::needless_range_loop)] // `k` names the node in errors and in `structural_steps`
pub(crate) fn fused_steps(
    g: &Graph,
    folded: &[bool],
    packed: &[bool],
    limits: &FusionLimits,
) -> Result<Vec<Step>, LowerError> {
    let nv = g.values.len();
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); nv];
    for (k, n) in g.nodes.iter().enumerate() {
        for v in &n.inputs {
            consumers[v.index()].push(k);
        }
    }
    let mut is_output = vec![false; nv];
    for o in &g.outputs {
        is_output[o.value.index()] = true;
    }
    let producer = {
        let mut p = vec![None; nv];
        for (k, n) in g.nodes.iter().enumerate() {
            for o in &n.outputs {
                p[o.index()] = Some(k);
            }
        }
        p
    };

    // Views: values that are a strided read of another materialized value.
    let mut view: Vec<Option<View>> = vec![None; nv];
    let view_of = |view: &Vec<Option<View>>, v: ValueId| -> View {
        view[v.index()]
            .clone()
            .unwrap_or_else(|| View::contiguous(v, &g.ty(v).shape))
    };
    // Elementwise expressions over materialized values, for values that are inlined.
    let mut inlined: Vec<Option<(Expr, Vec<MapInput>)>> = vec![None; nv];
    // Expands read by elementwise ops only: the readers take the source with a broadcast access
    // instead of a materialized copy.
    let mut absorbed: Vec<Option<MapInput>> = vec![None; nv];
    // Casts that change no bit of the stored value (bf16 widened to f32: bf16 is held in f32
    // slots) read by elementwise ops and views only: readers read the operand itself.
    let mut alias: Vec<Option<ValueId>> = vec![None; nv];
    let operand =
        |absorbed: &Vec<Option<MapInput>>, alias: &Vec<Option<ValueId>>, v: ValueId, out_len| {
            absorbed[v.index()]
                .clone()
                .unwrap_or_else(|| MapInput::direct(g, alias[v.index()].unwrap_or(v), out_len))
        };
    let mut steps = Vec::new();
    // Nodes whose output an earlier step already wrote (a transpose of a matmul result), or
    // that need no step (a concat read in place, `packs.rs`).
    let mut done = packed.to_vec();
    // Casts of f32 values to bf16 that only bf16 matmuls and attention read (through layout
    // ops): each reader rounds the f32 operand as it reads it, so the cast is a view of its
    // operand instead of a kernel and a bf16 copy in the arena (bf16-mixed's weights, which
    // would otherwise be transposed and rounded into a copy for every matmul, attention's q, k
    // and v, and saved activations).
    let cast_folds: Vec<bool> = (0..g.nodes.len())
        .map(|k| {
            let n = &g.nodes[k];
            matches!(n.op, Op::Cast { dtype: DType::BF16 })
                && g.ty(n.inputs[0]).dtype == DType::F32
                && only_rounding_readers_read(g, &consumers, &is_output, n.outputs[0])
        })
        .collect();
    // Values holding f32 that their readers (bf16 matmuls and attention) round: folded casts
    // and the layout ops over them (a matmul is told so, `Bf16Rounding`; bf16 attention always
    // rounds what it reads).
    let mut holds_unrounded = vec![false; nv];
    // A matmul reads views whose batch dims collapse into one.
    let collapses = |v: &View| {
        let r = v.shape.len();
        r == 2 || {
            let lead = View {
                base: v.base,
                offset: v.offset,
                shape: v.shape[..r - 2].to_vec(),
                strides: v.strides[..r - 2].to_vec(),
            };
            lead.collapsed().0.len() <= 1
        }
    };
    // Whether the readers among `cons` that read a value as a matmul operand (directly, or
    // through a folded cast) can take `v` as one.
    let matmuls_take = |v: &View, cons: &[usize]| {
        cons.iter().all(|&c| {
            if matches!(g.nodes[c].op, Op::Matmul) {
                collapses(v)
            } else if cast_folds[c] {
                consumers[g.nodes[c].outputs[0].index()]
                    .iter()
                    .all(|&m| !matches!(g.nodes[m].op, Op::Matmul) || collapses(v))
            } else {
                true
            }
        })
    };
    // Readers that read an operand through a view.
    let reads_views = |c: usize| {
        cast_folds[c]
            || (elementwise_expr(g, c).is_none()
                && matches!(
                    g.nodes[c].op,
                    Op::Matmul
                        | Op::Reshape { .. }
                        | Op::Transpose { .. }
                        | Op::Slice { .. }
                        | Op::Expand { .. }
                        | Op::ReduceSum { .. }
                        | Op::ReduceMax { .. }
                        | Op::Concat { .. }
                        | Op::Attention { .. }
                        | Op::AttentionBackward { .. }
                        | Op::Rope { .. }
                        | Op::CrossEntropy
                        | Op::CrossEntropyBackward
                ))
    };

    for k in 0..g.nodes.len() {
        if folded[k] || done[k] {
            continue;
        }
        let n = &g.nodes[k];
        let out = n.outputs[0];
        let out_ty = g.ty(out);
        let out_len = out_ty.numel();
        let cons = &consumers[out.index()];
        let same_size_elementwise = |c: usize| {
            elementwise_expr(g, c).is_some() && g.ty(g.nodes[c].outputs[0]).numel() == out_len
        };
        // Two readers whose single-use elementwise chains meet again (SiLU's gradient reads
        // `sigmoid(x)` twice on the way to one product): inlined into both, the value is
        // computed inside the kernel that ends both chains instead of being written and read.
        let readers_converge =
            cons.len() == 2 && cons.iter().all(|&c| same_size_elementwise(c)) && {
                let (first, second) = (cons[0].min(cons[1]), cons[0].max(cons[1]));
                let mut at = first;
                (0..limits.converge_hops).any(|_| {
                    let o = g.nodes[at].outputs[0];
                    match consumers[o.index()].as_slice() {
                        [next] if !is_output[o.index()] && same_size_elementwise(*next) => {
                            at = *next;
                            at == second
                        }
                        _ => false,
                    }
                })
            };
        // One op over values in memory, at most one of them full-size (the others broadcast or
        // single elements), read only by elementwise ops of its size: each reader recomputes
        // it, which costs one op per element where storing it costs a write, a read and its
        // bytes in the arena until the backward. SiLU's output, read by the forward product
        // and by its gradient's; RMSNorm's `x · rstd`, read by the weight's product and by the
        // weight's gradient. The operands it keeps alive are no larger than the value.
        let recomputed_by_readers = cons.len() > 1
            && cons.iter().all(|&c| same_size_elementwise(c))
            && elementwise_expr(g, k).is_some_and(|e| e.size() <= 3)
            && n.inputs.iter().all(|&v| inlined[v.index()].is_none())
            && n.inputs
                .iter()
                .filter(|&&v| operand(&absorbed, &alias, v, out_len).access == Access::Full)
                .count()
                <= 1;
        // A value is computed in its own micro-batch (`graphtrain_ir::micro_batches`): inlined
        // into a reader of a later one, it would be computed there and keep its operands live
        // until then (the running sum of a split step's gradients would hold every micro-batch's
        // gradient to the last).
        let own_micro_batch = cons
            .iter()
            .all(|&c| g.nodes[c].meta.micro_batch == n.meta.micro_batch);
        let single_elementwise_consumer = own_micro_batch
            && !is_output[out.index()]
            && ((cons.len() == 1 && same_size_elementwise(cons[0]))
                || readers_converge
                || recomputed_by_readers);
        // A value whose one reader sums or maxes its trailing or its leading dims is computed
        // inside that reduction (`Step::MapReduce`): RMSNorm's squares, its gradient's
        // products, the products its weight's gradient sums over tokens.
        let feeds_reduce = own_micro_batch
            && !is_output[out.index()]
            && matches!(cons.as_slice(), [c] if fusable_reduce(g, *c).is_some());

        if cast_folds[k] {
            let src = n.inputs[0];
            if inlined[src.index()].is_none() && absorbed[src.index()].is_none() {
                let v = view_of(&view, src);
                if matmuls_take(&v, cons) {
                    view[out.index()] = Some(v);
                    holds_unrounded[out.index()] = true;
                    continue;
                }
                if view[src.index()].is_some() {
                    // The layout op made `src` a view for this cast after the same check.
                    return Err(crate::lower::err(
                        g,
                        k,
                        "internal error: a folded cast's operand view does not suit its matmuls"
                            .into(),
                    ));
                }
            }
        }

        // A cast that changes no stored bit, of a value in memory, that elementwise ops and
        // views alone read is that value: no kernel, no bytes.
        if matches!(n.op, Op::Cast { .. })
            && elementwise_expr(g, k) == Some(Expr::Input(0))
            && !is_output[out.index()]
            && !cons.is_empty()
            && cons
                .iter()
                .all(|&c| same_size_elementwise(c) || reads_views(c))
        {
            let src = n.inputs[0];
            let in_memory = inlined[src.index()].is_none()
                && absorbed[src.index()].is_none()
                && (view[src.index()].is_none() || alias[src.index()].is_some());
            if in_memory {
                let base = alias[src.index()].unwrap_or(src);
                alias[out.index()] = Some(base);
                view[out.index()] = Some(View::contiguous(base, &out_ty.shape));
                continue;
            }
        }

        if let Some(expr) = elementwise_expr(g, k) {
            // Compose with inlined producers.
            let mut inputs: Vec<MapInput> = Vec::new();
            let mut parts: Vec<Expr> = Vec::new();
            for &v in &n.inputs {
                let read = operand(&absorbed, &alias, v, out_len);
                match (&inlined[v.index()], read.access) {
                    (Some((e, ins)), Access::Full) => {
                        let shifted = e.clone().shift_inputs(inputs.len() as u32);
                        inputs.extend(ins.iter().cloned());
                        parts.push(shifted);
                    }
                    _ => {
                        parts.push(Expr::Input(inputs.len() as u32));
                        inputs.push(read);
                    }
                }
            }
            let expr = expr.substitute(&parts);
            let (expr, inputs) = dedup_inputs(expr, inputs);
            if (single_elementwise_consumer || feeds_reduce)
                && inputs.len() <= limits.max_map_inputs
                && expr.size() <= limits.max_expr_nodes
            {
                inlined[out.index()] = Some((expr, inputs));
            } else if inputs.len() <= limits.max_map_inputs {
                steps.push(Step::Map {
                    out,
                    len: out_len,
                    inputs,
                    expr,
                });
            } else {
                // Too many operands for one kernel: materialize the inlined producers first.
                let mut direct = Vec::new();
                for &v in &n.inputs {
                    if let Some((e, ins)) = inlined[v.index()].take() {
                        steps.push(Step::Map {
                            out: v,
                            len: g.ty(v).numel(),
                            inputs: ins,
                            expr: e,
                        });
                    }
                    direct.push(operand(&absorbed, &alias, v, out_len));
                }
                let expr = elementwise_expr(g, k).expect("checked above");
                steps.push(Step::Map {
                    out,
                    len: out_len,
                    inputs: direct,
                    expr,
                });
            }
            continue;
        }

        if let (Some((over, outer, inner)), Some((expr, inputs))) =
            (fusable_reduce(g, k), inlined[n.inputs[0].index()].take())
        {
            steps.push(Step::MapReduce {
                kind: reduce_kind(&n.op),
                over,
                out,
                outer,
                inner,
                inputs,
                expr,
            });
            continue;
        }

        // An expand that only elementwise ops of its own size read, from a value in memory, is
        // read in place by them.
        if let Op::Expand { .. } = n.op {
            let src = n.inputs[0];
            // A source that is a reshape of a whole materialized value (its view contiguous
            // from offset 0) is read as that value: same elements in the same order.
            let whole = |v: &View| {
                v.offset == 0
                    && v.strides == contiguous_strides(&v.shape)
                    && g.ty(v.base).numel() == g.ty(src).numel()
            };
            let (src_mem, src_is_view_of_whole) = match &view[src.index()] {
                Some(v) if whole(v) => (v.base, true),
                _ => (src, false),
            };
            // (A folded source is in memory too: an unfolded expand's constant operand is one
            // the program writes at load.)
            let in_memory = inlined[src.index()].is_none()
                && (view[src.index()].is_none() || src_is_view_of_whole)
                && absorbed[src.index()].is_none();
            let readers_elementwise = !cons.is_empty()
                && cons.iter().all(|&c| {
                    elementwise_expr(g, c).is_some()
                        && g.ty(g.nodes[c].outputs[0]).numel() == out_len
                });
            let access = expand_access(&g.ty(src).shape, &out_ty.shape).filter(|a| match a {
                Access::Outer { inner: p } | Access::Inner { period: p } => {
                    p % BROADCAST_ALIGN == 0
                }
                _ => false,
            });
            if let (true, true, false, Some(access)) = (
                in_memory,
                readers_elementwise,
                is_output[out.index()],
                access,
            ) {
                absorbed[out.index()] = Some(MapInput {
                    value: src_mem,
                    access,
                });
                continue;
            }
        }

        // A reshape of a whole value in memory keeps its elements in their order: it is that
        // value, for elementwise readers as for views (no copy for a `Map` to read).
        if let Op::Reshape { .. } = n.op {
            let src = n.inputs[0];
            let in_memory = inlined[src.index()].is_none()
                && absorbed[src.index()].is_none()
                && !holds_unrounded[src.index()]
                && (view[src.index()].is_none() || alias[src.index()].is_some());
            let readers_take_it = !cons.is_empty()
                && cons
                    .iter()
                    .all(|&c| same_size_elementwise(c) || reads_views(c));
            if in_memory && readers_take_it && !is_output[out.index()] {
                let base = alias[src.index()].unwrap_or(src);
                alias[out.index()] = Some(base);
                view[out.index()] = Some(View::contiguous(base, &out_ty.shape));
                continue;
            }
        }

        // Layout ops become views when every consumer reads through a view (not a Map, which
        // needs contiguous operands) and the value is not a graph output.
        let is_layout = matches!(
            n.op,
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Expand { .. }
        );
        if is_layout {
            holds_unrounded[out.index()] = holds_unrounded[n.inputs[0].index()];
        }
        if is_layout && !is_output[out.index()] {
            let src = view_of(&view, n.inputs[0]);
            let v = match &n.op {
                Op::Reshape { .. } => reshape_view(&src, &out_ty.shape),
                Op::Transpose { perm } => Some(transpose_view(&src, perm)),
                Op::Slice { axis, start, .. } => {
                    Some(slice_view(&src, *axis, *start, out_ty.shape[*axis]))
                }
                Op::Expand { .. } => Some(expand_view(&src, &out_ty.shape)),
                _ => None,
            };
            // A numel-1 expand is a Map (a broadcast read), which needs its operand materialized.
            let readers_take_views = cons.iter().all(|&c| reads_views(c));
            if let (Some(v), true) = (v, readers_take_views) {
                if matmuls_take(&v, cons) {
                    view[out.index()] = Some(v);
                    continue;
                }
            }
        }
        let _ = producer;
        // A matmul whose only reader transposes its last two dims writes the transpose
        // directly: `(a b)ᵀ = bᵀ aᵀ`, the same products summed in the same k order, so the
        // same bits, and no strided copy (the weight gradients feeding the optimizer). A bf16
        // product's only reader may be its widening cast, read only by that transpose (the
        // same weight gradients under bf16-mixed): the bf16 result is the cast's value.
        let rounds_out = out_ty.dtype == DType::BF16;
        let transposed_reader = sole_reader_through_widening(g, &consumers, &is_output, out);
        if let (Op::Matmul, Some((cast, t))) = (&n.op, transposed_reader) {
            let r = out_ty.shape.len();
            let swaps_last_two = match &g.nodes[t].op {
                Op::Transpose { perm } => {
                    perm.len() == r
                        && perm[..r - 2].iter().enumerate().all(|(i, &p)| p == i)
                        && perm[r - 2] == r - 1
                        && perm[r - 1] == r - 2
                }
                _ => false,
            };
            if swaps_last_two && !is_output[out.index()] && !folded[t] {
                let swapped = |v: View| {
                    let mut perm: Vec<usize> = (0..v.shape.len()).collect();
                    let q = perm.len();
                    perm.swap(q - 2, q - 1);
                    transpose_view(&v, &perm)
                };
                let at = swapped(view_of(&view, n.inputs[0]));
                let bt = swapped(view_of(&view, n.inputs[1]));
                let batch: usize = out_ty.shape[..r - 2].iter().product();
                let (m, nn) = (out_ty.shape[r - 2], out_ty.shape[r - 1]);
                let kk = at.shape[at.shape.len() - 2];
                if let (Some(b3), Some(a3)) = (as_batched(&bt, batch), as_batched(&at, batch)) {
                    steps.push(Step::Matmul {
                        out: g.nodes[t].outputs[0],
                        a: b3,
                        b: a3,
                        batch,
                        m: nn,
                        n: m,
                        k: kk,
                        bf16: Bf16Rounding {
                            a: holds_unrounded[n.inputs[1].index()],
                            b: holds_unrounded[n.inputs[0].index()],
                            out: rounds_out,
                        },
                    });
                    done[t] = true;
                    if let Some(c) = cast {
                        done[c] = true;
                    }
                    continue;
                }
            }
        }
        let mut structural = structural_steps(g, k, &|v| view_of(&view, v))?;
        for s in &mut structural {
            if let Step::Matmul { bf16, .. } = s {
                bf16.a = holds_unrounded[n.inputs[0].index()];
                bf16.b = holds_unrounded[n.inputs[1].index()];
            }
        }
        // An attention output read only through `transpose(0, 2, 1, 3)` (back to `[B, S, H, D]`
        // for the next matmul) is written there directly: the kernel addresses its output
        // through a view, so the transpose costs no copy.
        for s in &mut structural {
            let outs: Vec<&mut View> = match s {
                Step::Attention { out, .. } => vec![out],
                Step::AttentionBackward { dq, dk, dv, .. } => vec![dq, dk, dv],
                _ => vec![],
            };
            for o in outs {
                if is_output[o.base.index()] {
                    continue;
                }
                // bf16 attention's result is read through its widening cast (the same bits).
                let Some((cast, t)) =
                    sole_reader_through_widening(g, &consumers, &is_output, o.base)
                else {
                    continue;
                };
                let swaps_heads =
                    matches!(&g.nodes[t].op, Op::Transpose { perm } if perm == &[0, 2, 1, 3]);
                let cast_free = cast.is_none_or(|c| !folded[c] && !done[c]);
                if swaps_heads && cast_free && !folded[t] && !done[t] {
                    let t_out = g.nodes[t].outputs[0];
                    *o =
                        transpose_view(&View::contiguous(t_out, &g.ty(t_out).shape), &[0, 2, 1, 3]);
                    done[t] = true;
                    if let Some(c) = cast {
                        done[c] = true;
                    }
                }
            }
        }
        steps.extend(structural);
    }
    Ok(steps)
}

/// The one node that reads `v`, looking through a widening cast of a bf16 `v` (the same bits)
/// when the cast is all that reads `v`: `(the cast, the reader)`. `None` where `v` or the cast
/// has several readers, or the cast is a graph output.
fn sole_reader_through_widening(
    g: &Graph,
    consumers: &[Vec<usize>],
    is_output: &[bool],
    v: ValueId,
) -> Option<(Option<usize>, usize)> {
    match consumers[v.index()].as_slice() {
        [c] if widens_bf16(g, *c) => {
            let cast_out = g.nodes[*c].outputs[0];
            match consumers[cast_out.index()].as_slice() {
                [t] if !is_output[cast_out.index()] => Some((Some(*c), *t)),
                _ => None,
            }
        }
        [t] => Some((None, *t)),
        _ => None,
    }
}

/// Whether node `c` is a cast of bf16 to f32: the same bits, as bf16 is held in f32 slots.
fn widens_bf16(g: &Graph, c: usize) -> bool {
    let n = &g.nodes[c];
    matches!(n.op, Op::Cast { dtype: DType::F32 }) && g.ty(n.inputs[0]).dtype == DType::BF16
}

/// Whether every reader of `v`, looking through layout ops, rounds its operands to bf16 as it
/// reads them (a matmul with a bf16 result, bf16 attention or its gradient), and `v` is no
/// graph output.
fn only_rounding_readers_read(
    g: &Graph,
    consumers: &[Vec<usize>],
    is_output: &[bool],
    v: ValueId,
) -> bool {
    let cons = &consumers[v.index()];
    !is_output[v.index()]
        && !cons.is_empty()
        && cons.iter().all(|&c| {
            let n = &g.nodes[c];
            match n.op {
                Op::Matmul | Op::Attention { .. } | Op::AttentionBackward { .. } => {
                    g.ty(n.outputs[0]).dtype == DType::BF16
                }
                Op::Reshape { .. }
                | Op::Transpose { .. }
                | Op::Slice { .. }
                | Op::Expand { .. } => {
                    elementwise_expr(g, c).is_none()
                        && only_rounding_readers_read(g, consumers, is_output, n.outputs[0])
                }
                _ => false,
            }
        })
}

/// How `Step::MapReduce` can take over node `k`: a sum or max over the trailing dims of its
/// operand (`Inner`) or over its leading dims (`Outer`), as `(over, outer, inner)` for the
/// operand seen as `[outer, inner]`. `inner` must be a non-zero multiple of `BROADCAST_ALIGN`
/// (every backend's vector width then divides a row), and for `Inner` `outer` too (whole
/// vectors of outputs split evenly between units).
fn fusable_reduce(g: &Graph, k: usize) -> Option<(ReduceOver, usize, usize)> {
    let n = &g.nodes[k];
    let (Op::ReduceSum { axes, .. } | Op::ReduceMax { axes, .. }) = &n.op else {
        return None;
    };
    let shape = &g.ty(*n.inputs.first()?).shape;
    let mut axes = axes.clone();
    axes.sort_unstable();
    axes.dedup();
    let rank = shape.len();
    if axes.is_empty() || axes.len() >= rank || axes.iter().any(|&a| a >= rank) {
        return None;
    }
    let aligned = |x: usize| x > 0 && x.is_multiple_of(BROADCAST_ALIGN);
    let split = |at: usize| {
        (
            shape[..at].iter().product::<usize>(),
            shape[at..].iter().product::<usize>(),
        )
    };
    let kept = rank - axes.len();
    if axes.iter().enumerate().all(|(i, &a)| a == kept + i) {
        let (outer, inner) = split(kept);
        return (aligned(outer) && aligned(inner)).then_some((ReduceOver::Inner, outer, inner));
    }
    if axes.iter().enumerate().all(|(i, &a)| a == i) {
        let (outer, inner) = split(axes.len());
        return (outer > 0 && aligned(inner)).then_some((ReduceOver::Outer, outer, inner));
    }
    None
}

/// Merges repeated inputs (the same value read twice) into one.
fn dedup_inputs(expr: Expr, inputs: Vec<MapInput>) -> (Expr, Vec<MapInput>) {
    let mut unique: Vec<MapInput> = Vec::new();
    let mut remap: Vec<Expr> = Vec::new();
    for i in inputs {
        let at = match unique.iter().position(|u| *u == i) {
            Some(p) => p,
            None => {
                unique.push(i);
                unique.len() - 1
            }
        };
        remap.push(Expr::Input(at as u32));
    }
    (expr.substitute(&remap), unique)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{lower, Mode};

    /// Attention's output read only through `transpose(0, 2, 1, 3)` is written in the
    /// transposed layout: no copy step, and the step writes the transpose's value. Numerics:
    /// tests/backends.rs (composites, the `tiny` train step, fused against eager).
    #[test]
    fn attention_writes_its_transposed_reader_directly() {
        let g = graphtrain_ir::text::parse(
            "graph g {
  input %q: f32[2,3,5,4]
  input %w: f32[12,6]
  %1: f32[2,3,5,4] = attention(%q, %q, %q, causal=true, scale=0.5)
  %2: f32[2,5,3,4] = transpose(%1, perm=[0,2,1,3])
  %3: f32[10,12] = reshape(%2, shape=[10,12])
  %4: f32[10,6] = matmul(%3, %w)
  output o = %4
}",
        )
        .unwrap();
        let p = lower(&g, Mode::Fused).unwrap();
        assert!(
            !p.steps.iter().any(|s| matches!(s, Step::Copy { .. })),
            "{:?}",
            p.steps
        );
        let Step::Attention { out, .. } = &p.steps[0] else {
            panic!("{:?}", p.steps)
        };
        assert_eq!(
            (out.base, out.strides.as_slice()),
            (ValueId(3), &[60, 4, 12, 1][..])
        );
    }

    /// A value whose two readers' chains meet in one node (SiLU's gradient) is computed inside
    /// that node's kernel: one map, no `sigmoid` step. A unary op of a value in memory whose
    /// readers stay apart is recomputed by each (no `exp` step); a binary one is materialized
    /// once (`%8`). Numerics: tests/backends.rs (`converging_readers`,
    /// `a_unary_read_by_several_maps_is_recomputed`).
    #[test]
    fn a_value_read_twice_on_the_way_to_one_node_is_inlined() {
        let g = graphtrain_ir::text::parse(
            "graph g {
  input %x: f32[7]
  %1: f32[7] = sigmoid(%x)
  %2: f32[7] = neg(%1)
  %3: f32[7] = add_scalar(%2, value=1.0)
  %4: f32[7] = mul(%1, %3)
  %5: f32[7] = exp(%x)
  %6: f32[7] = neg(%5)
  %7: f32[7] = sqrt(%5)
  %8: f32[7] = mul(%x, %5)
  %9: f32[7] = neg(%8)
  %10: f32[7] = sqrt(%8)
  output a = %4
  output b = %6
  output c = %7
  output d = %9
  output e = %10
}",
        )
        .unwrap();
        let p = lower(&g, Mode::Fused).unwrap();
        let outs: Vec<u32> = p.steps.iter().map(|s| s.writes().0).collect();
        assert_eq!(outs, vec![4, 6, 7, 8, 9, 10], "{:?}", p.steps);
    }
}
