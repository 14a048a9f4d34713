//! Graph -> Program: the ordered kernel launches a backend runs for one train step.
//!
//! What it does:
//! - legalizes the graph: composites are decomposed to primitives (`graphtrain_ir::decompose`),
//!   so every backend needs only the primitive kernels below;
//! - resolves layout ops to views: `reshape` of a contiguous value, `transpose`, `slice` and
//!   `expand` become strided reads of their source instead of copies where the consumer accepts a
//!   strided operand (matmul, copy, reduce), and an `expand` that only elementwise ops read
//!   becomes a broadcast `Access` of their operand — in `Fused` mode only;
//! - fuses elementwise chains (`Fused` mode): a value with one elementwise consumer is computed
//!   inside that consumer's kernel instead of going through memory. This relies on a backend
//!   never contracting a product and its sum into an FMA inside one kernel (the cpu kernels hide
//!   every product from cubecl's optimizer for that; `runtime/src/kernels.rs`, `opaque`);
//! - plans one arena for all materialized values (`plan_slots`), parameters and optimizer state
//!   updated in place.
//!
//! Guarantees: `Eager` mode launches one kernel per graph node, each reading and writing whole
//! contiguous buffers; `Fused` mode runs the same per-element arithmetic in the same order (an
//! inlined producer is the same expression evaluated in a register instead of reloaded; a
//! folded transpose only changes where a kernel or the GEMM reads, and the GEMM's summation
//! order does not depend on operand layout), so both give bitwise identical results on one
//! backend — tests/backends.rs and tests/gate.rs check it.
//!
//! Declines (with an error naming the node): dtypes other than f32 / i32 / bool, integer tensors
//! whose values cannot be held exactly by the f32 storage the kernels use (see `Storage`).

use crate::buffer_plan::{plan_slots, BufferPlan};
use graphtrain_ir::decompose::decompose;
use graphtrain_ir::{
    interp, BinaryOp, CompareOp, DType, Graph, HostTensor, Op, RopeLayout, UnaryOp, ValueId,
};
use std::fmt;

/// How a Program is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One kernel per primitive node, every value materialized: the numerics baseline.
    Eager,
    /// Layout views (transposes, slices, reshapes and broadcasts read in place; a transpose
    /// feeding a matmul becomes the GEMM's operand strides) and elementwise chains inlined into
    /// one kernel. Bitwise identical to `Eager`.
    Fused,
}

/// A strided read of (part of) a materialized value: element `idx` of the view lives at
/// `offset + sum(idx[d] * strides[d])` elements into `base`'s buffer.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct View {
    pub base: ValueId,
    pub offset: usize,
    pub shape: Vec<usize>,
    pub strides: Vec<usize>,
}

impl View {
    pub fn contiguous(base: ValueId, shape: &[usize]) -> View {
        View {
            base,
            offset: 0,
            shape: shape.to_vec(),
            strides: contiguous_strides(shape),
        }
    }

    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_contiguous(&self) -> bool {
        self.offset == 0 && self.strides == contiguous_strides(&self.shape)
    }

    /// The view with unit dimensions dropped and neighbours that walk memory as one dimension
    /// merged; kernels loop over fewer, longer dimensions.
    pub fn collapsed(&self) -> (Vec<usize>, Vec<usize>) {
        collapse(&self.shape, &[&self.strides])
            .into_iter()
            .map(|(d, s)| (d, s[0]))
            .unzip()
    }
}

/// Merges adjacent dims that are contiguous with each other in every operand.
pub fn collapse(shape: &[usize], strides: &[&[usize]]) -> Vec<(usize, Vec<usize>)> {
    let mut out: Vec<(usize, Vec<usize>)> = Vec::new();
    for d in 0..shape.len() {
        if shape[d] == 1 {
            continue;
        }
        let st: Vec<usize> = strides.iter().map(|s| s[d]).collect();
        if let Some((n, prev)) = out.last_mut() {
            if prev.iter().zip(&st).all(|(p, s)| *p == s * shape[d]) {
                *n *= shape[d];
                *prev = st;
                continue;
            }
        }
        out.push((shape[d], st));
    }
    out
}

pub fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// An elementwise expression over the inputs of a `Map` step, evaluated in f32. Booleans are
/// 1.0 / 0.0 and integers their exact f32 value (see `Storage`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Expr {
    /// Input `k` of the step at the current element (or its only element, when broadcast).
    Input(u32),
    /// A constant, as f32 bits.
    Const(u32),
    Unary(UnaryOp, Box<Expr>),
    Binary(BinaryOp, Box<Expr>, Box<Expr>),
    Compare(CompareOp, Box<Expr>, Box<Expr>),
    /// `if c != 0 { a } else { b }`.
    Select(Box<Expr>, Box<Expr>, Box<Expr>),
    /// Float -> integer conversion (towards zero, as the interpreter's `as i32`).
    Trunc(Box<Expr>),
    /// Float -> bool (`x != 0`).
    NonZero(Box<Expr>),
}

impl Expr {
    pub fn constant(x: f64) -> Expr {
        Expr::Const((x as f32).to_bits())
    }

    pub fn size(&self) -> usize {
        match self {
            Expr::Input(_) | Expr::Const(_) => 1,
            Expr::Unary(_, a) | Expr::Trunc(a) | Expr::NonZero(a) => 1 + a.size(),
            Expr::Binary(_, a, b) | Expr::Compare(_, a, b) => 1 + a.size() + b.size(),
            Expr::Select(c, a, b) => 1 + c.size() + a.size() + b.size(),
        }
    }

    fn shift_inputs(self, by: u32) -> Expr {
        self.map_inputs(&|k| Expr::Input(k + by))
    }

    /// Replaces `Input(k)` by `with[k]`.
    fn substitute(self, with: &[Expr]) -> Expr {
        self.map_inputs(&|k| with[k as usize].clone())
    }

    /// Replaces every `Input(k)` by `f(k)`.
    fn map_inputs(self, f: &dyn Fn(u32) -> Expr) -> Expr {
        let s = |e: Box<Expr>| Box::new(e.map_inputs(f));
        match self {
            Expr::Input(k) => f(k),
            Expr::Const(c) => Expr::Const(c),
            Expr::Unary(u, a) => Expr::Unary(u, s(a)),
            Expr::Trunc(a) => Expr::Trunc(s(a)),
            Expr::NonZero(a) => Expr::NonZero(s(a)),
            Expr::Binary(o, a, b) => Expr::Binary(o, s(a), s(b)),
            Expr::Compare(o, a, b) => Expr::Compare(o, s(a), s(b)),
            Expr::Select(c, a, b) => Expr::Select(s(c), s(a), s(b)),
        }
    }
}

/// How a `Map` reads one operand at output element `i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Access {
    /// `x[i]`: same shape as the output.
    Full,
    /// `x[0]`: one element for every `i`.
    Scalar,
    /// `x[i / inner]`: broadcast along trailing dims (`[R, 1] -> [R, C]` has `inner = C`).
    Outer { inner: usize },
    /// `x[i % period]`: broadcast along leading dims (`[1, C] -> [R, C]` has `period = C`).
    Inner { period: usize },
}

/// One input of a `Map`: a materialized contiguous value and how it is read.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MapInput {
    pub value: ValueId,
    pub access: Access,
}

impl MapInput {
    /// `v` read by an elementwise op whose output has `out_len` elements.
    fn direct(g: &Graph, v: ValueId, out_len: usize) -> MapInput {
        let access = if g.ty(v).numel() == 1 && out_len != 1 {
            Access::Scalar
        } else {
            Access::Full
        };
        MapInput { value: v, access }
    }
}

/// The broadcast an `expand` from `from` to `to` performs, when one `Access` expresses it.
fn expand_access(from: &[usize], to: &[usize]) -> Option<Access> {
    let kept = |d: usize| from[d] == to[d];
    let spread = |d: usize| from[d] == 1;
    let r = to.len();
    // Outer: kept dims first, then only broadcast (or unit) dims.
    if let Some(j) = (0..=r).find(|&j| (0..j).all(kept) && (j..r).all(spread)) {
        let inner: usize = to[j..].iter().product();
        if inner > 1 && from[..j].iter().product::<usize>() > 1 {
            return Some(Access::Outer { inner });
        }
    }
    // Inner: broadcast dims first, then only kept dims.
    if let Some(j) = (0..=r).find(|&j| (0..j).all(spread) && (j..r).all(kept)) {
        let period: usize = from.iter().product();
        if period > 1 && to[..j].iter().product::<usize>() > 1 {
            return Some(Access::Inner { period });
        }
    }
    None
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceKind {
    Sum,
    Max,
}

/// Which dims of an `[outer, inner]` value a `MapReduce` reduces.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOver {
    /// The trailing ones: one output per row.
    Inner,
    /// The leading ones: one output per column.
    Outer,
}

/// One launch. Values named here are materialized in the arena; outputs are contiguous.
#[derive(Clone, Debug, PartialEq)]
pub enum Step {
    /// `out[i] = expr(inputs at i)` for `i < len`.
    Map {
        out: ValueId,
        len: usize,
        inputs: Vec<MapInput>,
        expr: Expr,
    },
    /// Writes `src` into the region `dst` of a value (the whole of it unless it is a concat).
    Copy { dst: View, src: View },
    /// `out[o] = reduce over r of src[o, r]`: `src`'s leading `out_rank` dims are the output's,
    /// the rest are reduced, in index order.
    Reduce {
        kind: ReduceKind,
        out: ValueId,
        src: View,
        out_rank: usize,
    },
    /// An elementwise expression over `[outer, inner]` elements (element `r·inner + c` read
    /// as a `Map` reads element `i`), reduced without reaching the arena:
    /// * `ReduceOver::Inner`: `out[r] = reduce over c of expr(r, c)` (trailing dims reduced);
    /// * `ReduceOver::Outer`: `out[c] = reduce over r of expr(r, c)` (leading dims reduced).
    ///
    /// `inner` is a multiple of `BROADCAST_ALIGN` (and `outer` too for `Inner`), and the
    /// elements are combined in the order `Reduce` uses for the same shape, so the bits equal
    /// the `Map` then `Reduce` of eager.
    MapReduce {
        kind: ReduceKind,
        over: ReduceOver,
        out: ValueId,
        outer: usize,
        inner: usize,
        inputs: Vec<MapInput>,
        expr: Expr,
    },
    /// `out[b] = a[b] @ b[b]`, views of rank 3 `[batch, rows, cols]` (batch stride 0: shared).
    Matmul {
        out: ValueId,
        a: View,
        b: View,
        batch: usize,
        m: usize,
        n: usize,
        k: usize,
    },
    /// `out[pos] = src[pos with axis replaced by index[pos]]`.
    Gather {
        out: ValueId,
        src: ValueId,
        index: ValueId,
        axis: usize,
    },
    /// `out = src; out[pos with axis replaced by index[pos]] += add[pos]`, in index order.
    ScatterAdd {
        out: ValueId,
        src: ValueId,
        index: ValueId,
        add: ValueId,
        axis: usize,
    },
    /// `out[i] = (i / inner) % dim`.
    Iota {
        out: ValueId,
        inner: usize,
        dim: usize,
    },
    /// Counter-based random draws (`graphtrain_ir::rng`) from the seed tensor's first element.
    Random {
        out: ValueId,
        seed: ValueId,
        stream: u64,
        normal: bool,
    },
    /// `out = softmax(q kᵀ · scale, causal mask) v` per batch and query head, for rank-4
    /// `[B, H, S, D]` views (`k`, `v` with `Hkv` heads, shared by `H / Hkv` query heads). `out`
    /// is a `[B, H, S, D]` view with contiguous heads' rows (`strides[3] == 1`): contiguous, or
    /// the transposed view of the `[B, S, H, D]` value that is its only reader. The `[S, S]`
    /// probabilities never reach the arena.
    Attention {
        out: View,
        q: View,
        k: View,
        v: View,
        causal: bool,
        scale: f64,
    },
    /// Rotary embedding of a rank-4 `[B, S, H, D]` view into contiguous `out`, with the angle
    /// tables of `graphtrain_ir::decompose` (f64, cast to f32): per pair `(x1, x2)` of a head,
    /// `(x1·cos - x2·sin, x1·sin + x2·cos)`; `inverse` negates the angles (the gradient).
    Rope {
        out: ValueId,
        x: View,
        theta: f64,
        layout: RopeLayout,
        inverse: bool,
    },
    /// AdamW (torch.optim.AdamW, in the decomposition's f32 op order) over one or more
    /// parameters: per element `m' = m·b1 + g·(1 - b1)`, `v' = v·b2 + g²·(1 - b2)`,
    /// `p' = p·(1 - lr·wd) - (lr / (1 - b1^t))·m' / (sqrt(v') / sqrt(1 - b2^t) + eps)`, with
    /// `lr` and `step` (t) one-element values. Consecutive updates whose outputs all replace
    /// their inputs in place are one step, run as one job over every parameter.
    AdamW {
        updates: Vec<AdamWUpdate>,
        lr: ValueId,
        step: ValueId,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// Mean cross-entropy of `[N, C]` logits against `[N]` class indices, into the scalar `out`.
    CrossEntropy {
        out: ValueId,
        logits: View,
        targets: View,
    },
    /// The gradient of `CrossEntropy` for the scalar upstream gradient `grad`, into contiguous
    /// `[N, C]` `out`: `(softmax(logits) - onehot(targets)) · grad / N`.
    CrossEntropyBackward {
        out: ValueId,
        logits: View,
        targets: View,
        grad: ValueId,
    },
    /// The gradients of `Attention` for `dout`: `dq` `[B, H, S, D]`, `dk`, `dv` `[B, Hkv, S, D]`,
    /// views laid out as `Attention`'s `out`; the probabilities are recomputed per head.
    AttentionBackward {
        dq: View,
        dk: View,
        dv: View,
        q: View,
        k: View,
        v: View,
        dout: View,
        causal: bool,
        scale: f64,
    },
}

/// One parameter of an `AdamW` step: its inputs and the values replacing them.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWUpdate {
    pub p: ValueId,
    pub g: ValueId,
    pub m: ValueId,
    pub v: ValueId,
    pub p_out: ValueId,
    pub m_out: ValueId,
    pub v_out: ValueId,
}

/// Composites a Program runs as one step instead of decomposing them: attention, whose
/// decomposition materializes `[B, H, S, S]` scores and probabilities; rotary embedding, whose
/// decomposition is two slices, two broadcasts, four products and a concat per call; and
/// cross-entropy, whose decomposition makes five passes over the `[N, C]` logits and builds a
/// one-hot of the same size; and AdamW, whose decomposition is one kernel per output, each
/// re-reading the gradient and moments.
pub fn kept_composite(op: &Op) -> bool {
    matches!(
        op,
        Op::Attention { .. }
            | Op::AttentionBackward { .. }
            | Op::Rope { .. }
            | Op::CrossEntropy
            | Op::CrossEntropyBackward
            | Op::AdamW { .. }
    )
}

impl Step {
    /// Values this step reads from memory.
    pub fn reads(&self) -> Vec<ValueId> {
        match self {
            Step::Map { inputs, .. } | Step::MapReduce { inputs, .. } => {
                inputs.iter().map(|i| i.value).collect()
            }
            Step::Copy { src, .. } => vec![src.base],
            Step::Reduce { src, .. } => vec![src.base],
            Step::Matmul { a, b, .. } => vec![a.base, b.base],
            Step::Gather { src, index, .. } => vec![*src, *index],
            Step::ScatterAdd {
                src, index, add, ..
            } => vec![*src, *index, *add],
            Step::Iota { .. } => vec![],
            Step::Random { seed, .. } => vec![*seed],
            Step::Attention { q, k, v, .. } => vec![q.base, k.base, v.base],
            Step::Rope { x, .. } => vec![x.base],
            Step::AdamW {
                updates, lr, step, ..
            } => updates
                .iter()
                .flat_map(|u| [u.p, u.g, u.m, u.v])
                .chain([*lr, *step])
                .collect(),
            Step::CrossEntropy {
                logits, targets, ..
            } => vec![logits.base, targets.base],
            Step::CrossEntropyBackward {
                logits,
                targets,
                grad,
                ..
            } => vec![logits.base, targets.base, *grad],
            Step::AttentionBackward { q, k, v, dout, .. } => {
                vec![q.base, k.base, v.base, dout.base]
            }
        }
    }

    /// The value this step writes (the first one, for a step that writes several).
    pub fn writes(&self) -> ValueId {
        match self {
            Step::Map { out, .. }
            | Step::MapReduce { out, .. }
            | Step::Reduce { out, .. }
            | Step::Matmul { out, .. }
            | Step::Gather { out, .. }
            | Step::ScatterAdd { out, .. }
            | Step::Iota { out, .. }
            | Step::Random { out, .. }
            | Step::Rope { out, .. }
            | Step::CrossEntropy { out, .. }
            | Step::CrossEntropyBackward { out, .. } => *out,
            Step::Copy { dst, .. } => dst.base,
            Step::Attention { out, .. } => out.base,
            Step::AttentionBackward { dq, .. } => dq.base,
            Step::AdamW { updates, .. } => updates[0].p_out,
        }
    }

    /// Every value this step writes.
    pub fn outputs(&self) -> Vec<ValueId> {
        match self {
            Step::AttentionBackward { dq, dk, dv, .. } => vec![dq.base, dk.base, dv.base],
            Step::AdamW { updates, .. } => updates
                .iter()
                .flat_map(|u| [u.p_out, u.m_out, u.v_out])
                .collect(),
            _ => vec![self.writes()],
        }
    }

    pub fn kind(&self) -> &'static str {
        match self {
            Step::Map { .. } => "map",
            Step::Copy { .. } => "copy",
            Step::Reduce { .. } => "reduce",
            Step::MapReduce { .. } => "map_reduce",
            Step::Matmul { .. } => "matmul",
            Step::Gather { .. } => "gather",
            Step::ScatterAdd { .. } => "scatter_add",
            Step::Iota { .. } => "iota",
            Step::Random { .. } => "random",
            Step::Attention { .. } => "attention",
            Step::Rope { .. } => "rope",
            Step::AdamW { .. } => "adamw",
            Step::CrossEntropy { .. } => "cross_entropy",
            Step::CrossEntropyBackward { .. } => "cross_entropy_backward",
            Step::AttentionBackward { .. } => "attention_backward",
        }
    }
}

/// The storage every backend uses today: 4 bytes per element, f32 for floats, and integers and
/// booleans as the f32 holding their exact value, so one set of f32 kernels serves every op.
/// Integers beyond 2^24 cannot be held exactly and are refused where they can be seen (inputs,
/// iota sizes).
pub const ELEM_BYTES: usize = 4;
/// Largest integer the f32 storage holds exactly.
pub const MAX_EXACT_INT: usize = 1 << 24;
/// Arena offsets are aligned to this many bytes (a cache line; also a whole number of the
/// widest vectors the kernels use).
pub const ARENA_ALIGN: usize = 64;

#[derive(Clone, Debug)]
pub struct Program {
    /// The legalized graph (primitives only) the steps refer to.
    pub graph: Graph,
    pub steps: Vec<Step>,
    pub plan: BufferPlan,
    pub mode: Mode,
    /// Values that depend on no input (rope tables, masks, constants), computed once at lowering
    /// by the interpreter and written into the arena when the program loads. They keep their
    /// buffers for the whole program.
    pub constants: Vec<(ValueId, HostTensor)>,
    /// Per step, the capture region (`meta.tags.region`, set by the `capture` pass) of the node
    /// that produces what the step writes: a runtime replays a run of steps of one region as a
    /// pre-bound launch list, and dispatches steps with no region one by one.
    pub step_regions: Vec<Option<u32>>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LowerError {
    pub node: Option<usize>,
    pub module: String,
    pub message: String,
}

impl fmt::Display for LowerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.node {
            Some(n) if !self.module.is_empty() => {
                write!(
                    f,
                    "lowering node {n} (in {}): {}",
                    self.module, self.message
                )
            }
            Some(n) => write!(f, "lowering node {n}: {}", self.message),
            None => write!(f, "lowering: {}", self.message),
        }
    }
}

impl std::error::Error for LowerError {}

impl Program {
    /// Elements in the arena (4 bytes each).
    pub fn arena_elems(&self) -> usize {
        self.plan.arena_bytes / ELEM_BYTES
    }

    /// Element offset of a materialized value.
    pub fn elem_offset(&self, v: ValueId) -> usize {
        self.plan
            .offset_of(v)
            .unwrap_or_else(|| panic!("value {v:?} ({}) has no planned buffer", self.graph.ty(v)))
            / ELEM_BYTES
    }

    /// Counts of steps by kind, for reports.
    pub fn summary(&self) -> String {
        let mut counts: Vec<(&str, usize)> = Vec::new();
        for s in &self.steps {
            match counts.iter_mut().find(|(k, _)| *k == s.kind()) {
                Some((_, n)) => *n += 1,
                None => counts.push((s.kind(), 1)),
            }
        }
        let parts: Vec<String> = counts.iter().map(|(k, n)| format!("{n} {k}")).collect();
        format!("{} launches ({})", self.steps.len(), parts.join(", "))
    }
}

/// Lowers a verified train-step graph, keeping the composites `kept_composite` names.
pub fn lower(g: &Graph, mode: Mode) -> Result<Program, LowerError> {
    lower_with(g, mode, &kept_composite)
}

/// Lowers a verified train-step graph, keeping the composites `keep` accepts as one step each
/// and decomposing the others into primitives (a backend without a kernel for a composite
/// passes a `keep` that refuses it).
pub fn lower_with(
    g: &Graph,
    mode: Mode,
    keep: &dyn Fn(&Op) -> bool,
) -> Result<Program, LowerError> {
    let graph = decompose(g, &|op| op.is_composite() && !keep(op)).map_err(|e| LowerError {
        node: None,
        module: e.module.clone(),
        message: format!("decomposing composites failed: {e}"),
    })?;
    let (folded, constants) = fold_constants(&graph)?;
    check_dtypes(&graph, &folded)?;
    let steps = match mode {
        Mode::Eager => eager_steps(&graph, &folded)?,
        Mode::Fused => merge_adamw(&graph, fused_steps(&graph, &folded)?),
    };
    // Constants are written at load and read by every run: live from the first slot to the last.
    let const_ids: Vec<ValueId> = constants.iter().map(|(v, _)| *v).collect();
    let mut slots: Vec<(Vec<ValueId>, Vec<ValueId>)> = vec![(Vec::new(), const_ids.clone())];
    slots.extend(steps.iter().map(|s| (s.reads(), s.outputs())));
    slots.push((const_ids, Vec::new()));
    let plan = plan_slots(&graph, &slots, ELEM_BYTES, ARENA_ALIGN);
    let producers = graph.producers();
    let step_regions = steps
        .iter()
        .map(|s| producers[s.writes().index()].and_then(|n| graph.nodes[n].meta.tags.region))
        .collect();
    Ok(Program {
        graph,
        steps,
        plan,
        mode,
        constants,
        step_regions,
    })
}

/// Consecutive AdamW steps with the same scalars and hyperparameters become one when every
/// output replaces its input in place (a donated graph output): then no update writes bytes that
/// another one reads, and all of them can run as one job over every parameter.
fn merge_adamw(g: &Graph, steps: Vec<Step>) -> Vec<Step> {
    let donated: std::collections::HashMap<ValueId, ValueId> = g
        .outputs
        .iter()
        .filter_map(|o| o.donates.map(|d| (o.value, d)))
        .collect();
    let in_place = |u: &AdamWUpdate| {
        [(u.p_out, u.p), (u.m_out, u.m), (u.v_out, u.v)]
            .iter()
            .all(|(out, input)| donated.get(out) == Some(input))
    };
    let mut merged: Vec<Step> = Vec::with_capacity(steps.len());
    for s in steps {
        if let (
            Some(Step::AdamW {
                updates,
                lr,
                step,
                beta1,
                beta2,
                eps,
                weight_decay,
            }),
            Step::AdamW {
                updates: next,
                lr: lr2,
                step: step2,
                beta1: beta1_2,
                beta2: beta2_2,
                eps: eps2,
                weight_decay: wd2,
            },
        ) = (merged.last_mut(), &s)
        {
            let same = (*lr, *step) == (*lr2, *step2)
                && [*beta1, *beta2, *eps, *weight_decay] == [*beta1_2, *beta2_2, *eps2, *wd2];
            if same && updates.iter().all(in_place) && next.iter().all(in_place) {
                updates.extend(next.iter().cloned());
                continue;
            }
        }
        merged.push(s);
    }
    merged
}

/// Marks the nodes computable without any graph input (random draws excluded: their seed is an
/// input), and evaluates, with the interpreter, the folded values that unfolded nodes read.
/// Per node: folded; and the folded values the program needs, with their contents.
type Folding = (Vec<bool>, Vec<(ValueId, HostTensor)>);

fn fold_constants(g: &Graph) -> Result<Folding, LowerError> {
    let mut is_const = vec![false; g.values.len()];
    let mut folded = vec![false; g.nodes.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        let random = matches!(n.op, Op::RandomUniform { .. } | Op::RandomNormal { .. });
        if !random && n.inputs.iter().all(|v| is_const[v.index()]) {
            folded[k] = true;
            for o in &n.outputs {
                is_const[o.index()] = true;
            }
        }
    }
    // Folded values read by an unfolded node or returned by the graph.
    let producers = g.producers();
    let needed_by = |folded: &[bool]| {
        let mut needed: Vec<ValueId> = Vec::new();
        let mut push = |v: ValueId| {
            let folded_here = producers[v.index()].is_some_and(|k| folded[k]);
            if is_const[v.index()] && folded_here && !needed.contains(&v) {
                needed.push(v);
            }
        };
        for (k, n) in g.nodes.iter().enumerate() {
            if !folded[k] {
                n.inputs.iter().for_each(|&v| push(v));
            }
        }
        g.outputs.iter().for_each(|o| push(o.value));
        needed
    };
    // A needed `full` or `expand` is not folded: a `full` is a constant expression its
    // consumer's kernel evaluates, an `expand` a broadcast read of its (folded) input. Folded,
    // either would hold a buffer of the expanded size for the whole program and make every
    // reader stream it (the causal mask and its -inf fill are `[B, H, S, S]`).
    let computable = folded.clone();
    let mut needed = needed_by(&folded);
    loop {
        let mut unfolded = false;
        for v in &needed {
            if let Some(k) = producers[v.index()] {
                if folded[k]
                    && matches!(g.nodes[k].op, Op::Full { .. } | Op::Expand { .. })
                    && g.ty(*v).numel() > 1
                {
                    folded[k] = false;
                    unfolded = true;
                }
            }
        }
        if !unfolded {
            break;
        }
        needed = needed_by(&folded);
    }
    if needed.is_empty() {
        return Ok((folded, Vec::new()));
    }
    // The folded nodes the needed values depend on, as a graph of their own, run once by the
    // interpreter. (Only those: an unfolded `full` or `expand` may be huge, and nothing needs
    // its value at load.)
    let mut required = vec![false; g.nodes.len()];
    let mut stack: Vec<usize> = needed.iter().filter_map(|v| producers[v.index()]).collect();
    while let Some(k) = stack.pop() {
        if std::mem::replace(&mut required[k], true) {
            continue;
        }
        stack.extend(
            g.nodes[k]
                .inputs
                .iter()
                .filter_map(|v| producers[v.index()])
                .filter(|&p| computable[p]),
        );
    }
    let mut sub = Graph::new("constants");
    let mut map: Vec<Option<ValueId>> = vec![None; g.values.len()];
    for (k, n) in g.nodes.iter().enumerate() {
        if !required[k] {
            continue;
        }
        let ins: Vec<ValueId> = n
            .inputs
            .iter()
            .map(|v| map[v.index()].expect("folded"))
            .collect();
        let types = n.outputs.iter().map(|o| g.ty(*o).clone()).collect();
        let outs = sub.push_typed(n.op.clone(), ins, types, n.meta.clone());
        for (o, new) in n.outputs.iter().zip(outs) {
            map[o.index()] = Some(new);
        }
    }
    for (i, v) in needed.iter().enumerate() {
        sub.add_output(format!("c{i}"), map[v.index()].expect("folded"), None);
    }
    let out = interp::run(&sub, &[]).map_err(|e| LowerError {
        node: None,
        module: String::new(),
        message: format!("evaluating the graph's constants failed: {e}"),
    })?;
    for (v, t) in needed.iter().zip(&out.outputs) {
        let d = g.ty(*v).dtype;
        if !matches!(d, DType::F32 | DType::I32 | DType::Bool) {
            return Err(LowerError {
                node: None,
                module: String::new(),
                message: format!("a {d} constant reaches a kernel: the compiled backends hold f32, i32 and bool tensors"),
            });
        }
        if !d.is_float() && t.data.iter().any(|x| x.abs() > MAX_EXACT_INT as f64) {
            return Err(LowerError {
                node: None,
                module: String::new(),
                message:
                    "an integer constant exceeds 2^24, which the f32 storage cannot hold exactly"
                        .into(),
            });
        }
    }
    Ok((folded, needed.into_iter().zip(out.outputs).collect()))
}

fn err(g: &Graph, node: usize, message: String) -> LowerError {
    LowerError {
        node: Some(node),
        module: g.nodes[node].meta.module.clone(),
        message,
    }
}

fn check_dtypes(g: &Graph, folded: &[bool]) -> Result<(), LowerError> {
    let ok = |d: DType| matches!(d, DType::F32 | DType::I32 | DType::Bool);
    for i in &g.inputs {
        let d = g.ty(i.value).dtype;
        if !ok(d) {
            return Err(LowerError {
                node: None,
                module: String::new(),
                message: format!(
                    "input `{}` is {d}: the compiled backends support f32, i32 and bool tensors today (bf16/f64/i64 run on --backend reference)",
                    i.name
                ),
            });
        }
    }
    for (k, n) in g.nodes.iter().enumerate() {
        if folded[k] {
            continue;
        }
        for o in &n.outputs {
            let d = g.ty(*o).dtype;
            if !ok(d) {
                return Err(err(
                    g,
                    k,
                    format!(
                        "{} produces {d}: the compiled backends support f32, i32 and bool tensors today (bf16/f64/i64 run on --backend reference)",
                        n.op.name()
                    ),
                ));
            }
        }
        if let Op::Iota { shape, .. } = &n.op {
            if shape.iter().any(|&d| d > MAX_EXACT_INT) {
                return Err(err(g, k, format!("iota over {shape:?} exceeds the exact integer range of the f32 storage (2^24)")));
            }
        }
    }
    Ok(())
}

/// The elementwise expression of a node over its operands, if it is elementwise.
fn elementwise_expr(g: &Graph, k: usize) -> Option<Expr> {
    let n = &g.nodes[k];
    let i = |j: u32| Box::new(Expr::Input(j));
    Some(match &n.op {
        Op::Unary(u) => Expr::Unary(*u, i(0)),
        Op::Binary(b) => Expr::Binary(*b, i(0), i(1)),
        Op::Compare(c) => Expr::Compare(*c, i(0), i(1)),
        Op::Select => Expr::Select(i(0), i(1), i(2)),
        Op::AddScalar { value } => {
            Expr::Binary(BinaryOp::Add, i(0), Box::new(Expr::constant(*value)))
        }
        Op::MulScalar { value } => {
            Expr::Binary(BinaryOp::Mul, i(0), Box::new(Expr::constant(*value)))
        }
        Op::PowScalar { exponent } => {
            Expr::Binary(BinaryOp::Pow, i(0), Box::new(Expr::constant(*exponent)))
        }
        Op::Cast { dtype } => {
            let from = g.ty(n.inputs[0]).dtype;
            match (from, dtype) {
                (DType::F32, DType::I32) => Expr::Trunc(i(0)),
                (DType::F32 | DType::I32, DType::Bool) => Expr::NonZero(i(0)),
                _ => Expr::Input(0),
            }
        }
        Op::Offload | Op::Reload => Expr::Input(0),
        Op::Full { value, .. } => Expr::constant(round_for(g.ty(n.outputs[0]).dtype, *value)),
        // Broadcasting one element is elementwise too.
        Op::Expand { .. } if g.ty(n.inputs[0]).numel() == 1 => Expr::Input(0),
        _ => return None,
    })
}

fn round_for(d: DType, x: f64) -> f64 {
    graphtrain_ir::interp::round_to_dtype(d, x)
}

/// Eager: one step per node, every operand and result a whole contiguous buffer.
#[allow(clippy::needless_range_loop)] // `k` names the node in errors and in `structural_steps`
fn eager_steps(g: &Graph, folded: &[bool]) -> Result<Vec<Step>, LowerError> {
    let mut steps = Vec::with_capacity(g.nodes.len());
    for k in 0..g.nodes.len() {
        if folded[k] {
            continue;
        }
        let n = &g.nodes[k];
        let out = n.outputs[0];
        let out_len = g.ty(out).numel();
        if let Some(expr) = elementwise_expr(g, k) {
            let inputs = n
                .inputs
                .iter()
                .map(|&v| MapInput::direct(g, v, out_len))
                .collect();
            steps.push(Step::Map {
                out,
                len: out_len,
                inputs,
                expr,
            });
            continue;
        }
        let whole = |v: ValueId| View::contiguous(v, &g.ty(v).shape);
        steps.extend(structural_steps(g, k, &whole)?);
    }
    Ok(steps)
}

/// Steps for the non-elementwise node `k`, reading operands through `view_of`.
fn structural_steps(
    g: &Graph,
    k: usize,
    view_of: &dyn Fn(ValueId) -> View,
) -> Result<Vec<Step>, LowerError> {
    let n = &g.nodes[k];
    let out = n.outputs[0];
    let out_shape = g.ty(out).shape.clone();
    let whole_out = View::contiguous(out, &out_shape);
    let step = match &n.op {
        Op::Reshape { .. } => {
            let src = view_of(n.inputs[0]);
            match reshape_view(&src, &out_shape) {
                Some(v) => Step::Copy {
                    dst: whole_out,
                    src: v,
                },
                // A reshape keeps row-major order: writing the source, walked in its own shape,
                // contiguously into the output is the reshape.
                None => Step::Copy {
                    dst: View::contiguous(out, &src.shape),
                    src,
                },
            }
        }
        Op::Transpose { perm } => Step::Copy {
            dst: whole_out,
            src: transpose_view(&view_of(n.inputs[0]), perm),
        },
        Op::Expand { .. } => Step::Copy {
            dst: whole_out,
            src: expand_view(&view_of(n.inputs[0]), &out_shape),
        },
        Op::Slice { axis, start, .. } => Step::Copy {
            dst: whole_out,
            src: slice_view(&view_of(n.inputs[0]), *axis, *start, out_shape[*axis]),
        },
        Op::Concat { axis } => {
            let mut at = 0;
            let mut steps = Vec::new();
            for &v in &n.inputs {
                let len = g.ty(v).shape[*axis];
                steps.push(Step::Copy {
                    dst: slice_view(&whole_out, *axis, at, len),
                    src: view_of(v),
                });
                at += len;
            }
            return Ok(steps);
        }
        Op::ReduceSum { axes, .. } | Op::ReduceMax { axes, .. } => {
            let kind = reduce_kind(&n.op);
            let src = view_of(n.inputs[0]);
            // Kept axes first, reduced axes last, each group in order.
            let rank = src.shape.len();
            let mut perm: Vec<usize> = (0..rank).filter(|d| !axes.contains(d)).collect();
            let out_rank = perm.len();
            perm.extend((0..rank).filter(|d| axes.contains(d)));
            Step::Reduce {
                kind,
                out,
                src: transpose_view(&src, &perm),
                out_rank,
            }
        }
        Op::Matmul => {
            let a = view_of(n.inputs[0]);
            let b = view_of(n.inputs[1]);
            let ra = a.shape.len();
            let (m, kk) = (a.shape[ra - 2], a.shape[ra - 1]);
            let nn = b.shape[b.shape.len() - 1];
            let batch: usize = a.shape[..ra - 2].iter().product();
            let (a3, b3) = match (as_batched(&a, batch), as_batched(&b, batch)) {
                (Some(a3), Some(b3)) => (a3, b3),
                _ => {
                    return Err(err(
                        g,
                        k,
                        "internal error: matmul operand view has no batched form".into(),
                    ))
                }
            };
            Step::Matmul {
                out,
                a: a3,
                b: b3,
                batch,
                m,
                n: nn,
                k: kk,
            }
        }
        Op::Gather { axis } => Step::Gather {
            out,
            src: n.inputs[0],
            index: n.inputs[1],
            axis: *axis,
        },
        Op::ScatterAdd { axis } => Step::ScatterAdd {
            out,
            src: n.inputs[0],
            index: n.inputs[1],
            add: n.inputs[2],
            axis: *axis,
        },
        Op::Iota { shape, axis, .. } => Step::Iota {
            out,
            inner: shape[axis + 1..].iter().product(),
            dim: shape[*axis],
        },
        Op::Attention { causal, scale } => Step::Attention {
            out: whole_out,
            q: view_of(n.inputs[0]),
            k: view_of(n.inputs[1]),
            v: view_of(n.inputs[2]),
            causal: *causal,
            scale: *scale,
        },
        Op::Rope {
            theta,
            layout,
            inverse,
        } => Step::Rope {
            out,
            x: view_of(n.inputs[0]),
            theta: *theta,
            layout: *layout,
            inverse: *inverse,
        },
        Op::AdamW {
            beta1,
            beta2,
            eps,
            weight_decay,
        } => Step::AdamW {
            updates: vec![AdamWUpdate {
                p: n.inputs[0],
                g: n.inputs[1],
                m: n.inputs[2],
                v: n.inputs[3],
                p_out: n.outputs[0],
                m_out: n.outputs[1],
                v_out: n.outputs[2],
            }],
            lr: n.inputs[4],
            step: n.inputs[5],
            beta1: *beta1,
            beta2: *beta2,
            eps: *eps,
            weight_decay: *weight_decay,
        },
        Op::CrossEntropy => Step::CrossEntropy {
            out,
            logits: view_of(n.inputs[0]),
            targets: view_of(n.inputs[1]),
        },
        Op::CrossEntropyBackward => Step::CrossEntropyBackward {
            out,
            logits: view_of(n.inputs[0]),
            targets: view_of(n.inputs[1]),
            grad: n.inputs[2],
        },
        Op::AttentionBackward { causal, scale } => Step::AttentionBackward {
            dq: View::contiguous(n.outputs[0], &g.ty(n.outputs[0]).shape),
            dk: View::contiguous(n.outputs[1], &g.ty(n.outputs[1]).shape),
            dv: View::contiguous(n.outputs[2], &g.ty(n.outputs[2]).shape),
            q: view_of(n.inputs[0]),
            k: view_of(n.inputs[1]),
            v: view_of(n.inputs[2]),
            dout: view_of(n.inputs[3]),
            causal: *causal,
            scale: *scale,
        },
        Op::RandomUniform { stream, .. } | Op::RandomNormal { stream, .. } => Step::Random {
            out,
            seed: n.inputs[0],
            stream: *stream,
            normal: matches!(n.op, Op::RandomNormal { .. }),
        },
        other => {
            return Err(err(
                g,
                k,
                format!(
                    "no kernel for `{}` (it should have been decomposed)",
                    other.name()
                ),
            ))
        }
    };
    Ok(vec![step])
}

pub fn transpose_view(v: &View, perm: &[usize]) -> View {
    View {
        base: v.base,
        offset: v.offset,
        shape: perm.iter().map(|&p| v.shape[p]).collect(),
        strides: perm.iter().map(|&p| v.strides[p]).collect(),
    }
}

pub fn expand_view(v: &View, shape: &[usize]) -> View {
    View {
        base: v.base,
        offset: v.offset,
        shape: shape.to_vec(),
        strides: v
            .shape
            .iter()
            .zip(&v.strides)
            .map(|(&d, &s)| if d == 1 { 0 } else { s })
            .collect(),
    }
}

pub fn slice_view(v: &View, axis: usize, start: usize, len: usize) -> View {
    let mut s = v.clone();
    s.offset += start * v.strides[axis];
    s.shape[axis] = len;
    s
}

/// A reshape of a view as one strided view, when the split/merged dims allow it.
pub fn reshape_view(v: &View, shape: &[usize]) -> Option<View> {
    if v.is_contiguous() {
        return Some(View::contiguous(v.base, shape));
    }
    // Walk both shapes, matching groups of equal element counts; a group of source dims must be
    // mergeable (contiguous among themselves) to be re-split.
    let src: Vec<(usize, usize)> = v
        .shape
        .iter()
        .zip(&v.strides)
        .filter(|(d, _)| **d != 1)
        .map(|(&d, &s)| (d, s))
        .collect();
    let mut strides = vec![0; shape.len()];
    let (mut i, mut j) = (0, 0);
    while j < shape.len() {
        if shape[j] == 1 {
            j += 1;
            continue;
        }
        if i >= src.len() {
            return None;
        }
        // Grow a group until the counts match.
        let (mut sn, mut dn) = (src[i].0, shape[j]);
        let (i0, j0) = (i, j);
        while sn != dn {
            if sn < dn {
                i += 1;
                if i >= src.len() {
                    return None;
                }
                if src[i - 1].1 != src[i].1 * src[i].0 {
                    return None;
                }
                sn *= src[i].0;
            } else {
                j += 1;
                if j >= shape.len() {
                    return None;
                }
                dn *= shape[j];
            }
        }
        // The group's innermost stride, re-split over destination dims j0..=j.
        let mut stride = src[i].1;
        for d in (j0..=j).rev() {
            strides[d] = stride;
            stride *= shape[d];
        }
        let _ = i0;
        i += 1;
        j += 1;
    }
    if i != src.len() {
        return None;
    }
    Some(View {
        base: v.base,
        offset: v.offset,
        shape: shape.to_vec(),
        strides,
    })
}

/// `[..batch, r, c]` as `[batch, r, c]` (a rank-2 view is shared: batch stride 0).
fn as_batched(v: &View, batch: usize) -> Option<View> {
    let r = v.shape.len();
    if r == 2 {
        return Some(View {
            base: v.base,
            offset: v.offset,
            shape: vec![batch, v.shape[0], v.shape[1]],
            strides: vec![0, v.strides[0], v.strides[1]],
        });
    }
    let lead = View {
        base: v.base,
        offset: v.offset,
        shape: v.shape[..r - 2].to_vec(),
        strides: v.strides[..r - 2].to_vec(),
    };
    let (dims, strides) = lead.collapsed();
    let bs = match dims.len() {
        0 => 0,
        1 => strides[0],
        _ => return None,
    };
    Some(View {
        base: v.base,
        offset: v.offset,
        shape: vec![batch, v.shape[r - 2], v.shape[r - 1]],
        strides: vec![bs, v.strides[r - 2], v.strides[r - 1]],
    })
}

/// Broadcast reads are formed only when their period is a multiple of this (the widest vector a
/// backend uses): then a backend splits the work into whole vectors exactly as it does for
/// contiguous operands. A different split would change results, since vector and scalar code
/// of the same function (exp, sin, ...) may round differently.
pub const BROADCAST_ALIGN: usize = 8;

/// Most inputs a fused kernel reads (the kernels take this many offset arguments).
pub const MAX_MAP_INPUTS: usize = 6;
/// Largest fused expression, in nodes: bounds JIT time and register pressure.
const MAX_EXPR_NODES: usize = 48;

/// Fused: layout ops become views where every consumer can read strided, elementwise chains
/// become one `Map` each; the rest as in eager.
#[allow(clippy::needless_range_loop)] // `k` names the node in errors and in `structural_steps`
/// How many single-use elementwise nodes `fused_steps` follows from a value's first reader to
/// find its second one.
const CONVERGE_HOPS: usize = 6;

fn fused_steps(g: &Graph, folded: &[bool]) -> Result<Vec<Step>, LowerError> {
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
    let operand = |absorbed: &Vec<Option<MapInput>>, v: ValueId, out_len: usize| {
        absorbed[v.index()]
            .clone()
            .unwrap_or_else(|| MapInput::direct(g, v, out_len))
    };
    let mut steps = Vec::new();
    // Nodes whose output an earlier step already wrote (a transpose of a matmul result).
    let mut done = vec![false; g.nodes.len()];

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
                (0..CONVERGE_HOPS).any(|_| {
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
                .filter(|&&v| operand(&absorbed, v, out_len).access == Access::Full)
                .count()
                <= 1;
        let single_elementwise_consumer = !is_output[out.index()]
            && ((cons.len() == 1 && same_size_elementwise(cons[0]))
                || readers_converge
                || recomputed_by_readers);
        // A value whose one reader sums or maxes its trailing or its leading dims is computed
        // inside that reduction (`Step::MapReduce`): RMSNorm's squares, its gradient's
        // products, the products its weight's gradient sums over tokens.
        let feeds_reduce = !is_output[out.index()]
            && matches!(cons.as_slice(), [c] if fusable_reduce(g, *c).is_some());

        if let Some(expr) = elementwise_expr(g, k) {
            // Compose with inlined producers.
            let mut inputs: Vec<MapInput> = Vec::new();
            let mut parts: Vec<Expr> = Vec::new();
            for &v in &n.inputs {
                let read = operand(&absorbed, v, out_len);
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
                && inputs.len() <= MAX_MAP_INPUTS
                && expr.size() <= MAX_EXPR_NODES
            {
                inlined[out.index()] = Some((expr, inputs));
            } else if inputs.len() <= MAX_MAP_INPUTS {
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
                    direct.push(operand(&absorbed, v, out_len));
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

        // Layout ops become views when every consumer reads through a view (not a Map, which
        // needs contiguous operands) and the value is not a graph output.
        let is_layout = matches!(
            n.op,
            Op::Reshape { .. } | Op::Transpose { .. } | Op::Slice { .. } | Op::Expand { .. }
        );
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
            let readers_take_views = cons.iter().all(|&c| {
                elementwise_expr(g, c).is_none()
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
                    )
            });
            if let (Some(v), true) = (v, readers_take_views) {
                // A matmul reads views whose batch dims collapse; check before committing.
                let matmul_ok = cons.iter().all(|&c| {
                    if !matches!(g.nodes[c].op, Op::Matmul) {
                        return true;
                    }
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
                });
                if matmul_ok {
                    view[out.index()] = Some(v);
                    continue;
                }
            }
        }
        let _ = producer;
        // A matmul whose only reader transposes its last two dims writes the transpose
        // directly: `(a b)ᵀ = bᵀ aᵀ`, the same products summed in the same k order, so the
        // same bits, and no strided copy (the weight gradients feeding the optimizer).
        if let (Op::Matmul, [t]) = (&n.op, cons.as_slice()) {
            let r = out_ty.shape.len();
            let swaps_last_two = match &g.nodes[*t].op {
                Op::Transpose { perm } => {
                    perm.len() == r
                        && perm[..r - 2].iter().enumerate().all(|(i, &p)| p == i)
                        && perm[r - 2] == r - 1
                        && perm[r - 1] == r - 2
                }
                _ => false,
            };
            if swaps_last_two && !is_output[out.index()] && !folded[*t] {
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
                        out: g.nodes[*t].outputs[0],
                        a: b3,
                        b: a3,
                        batch,
                        m: nn,
                        n: m,
                        k: kk,
                    });
                    done[*t] = true;
                    continue;
                }
            }
        }
        let mut structural = structural_steps(g, k, &|v| view_of(&view, v))?;
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
                let cons = &consumers[o.base.index()];
                let [t] = cons.as_slice() else { continue };
                let swaps_heads =
                    matches!(&g.nodes[*t].op, Op::Transpose { perm } if perm == &[0, 2, 1, 3]);
                if swaps_heads && !is_output[o.base.index()] && !folded[*t] && !done[*t] {
                    let t_out = g.nodes[*t].outputs[0];
                    *o =
                        transpose_view(&View::contiguous(t_out, &g.ty(t_out).shape), &[0, 2, 1, 3]);
                    done[*t] = true;
                }
            }
        }
        steps.extend(structural);
    }
    Ok(steps)
}

/// The reduction a `reduce_sum` or `reduce_max` performs.
fn reduce_kind(op: &Op) -> ReduceKind {
    if matches!(op, Op::ReduceSum { .. }) {
        ReduceKind::Sum
    } else {
        ReduceKind::Max
    }
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

    #[test]
    fn reshape_views_split_and_merge_strided_dims() {
        let v = View {
            base: ValueId(0),
            offset: 0,
            shape: vec![4, 6],
            strides: vec![1, 4],
        };
        // [4, 6] column-major -> [4, 2, 3]: the 6 splits into 2 x 3 with strides 12, 4.
        let r = reshape_view(&v, &[4, 2, 3]).unwrap();
        assert_eq!(r.strides, vec![1, 12, 4]);
        // Merging the transposed dims is impossible.
        assert!(reshape_view(&v, &[24]).is_none());
    }

    /// A causal mask and its -inf fill, broadcast to the scores' shape, stay small: the mask is
    /// folded at its own `[S, S]` size and read as a broadcast, the fill is a constant in the
    /// kernel. Numerics are checked on the cpu backend (tests/backends.rs, attention).
    #[test]
    fn broadcast_and_filled_constants_are_not_folded_at_full_size() {
        let g = graphtrain_ir::text::parse(
            "graph g {
  input %x: f32[2,3,16,16]
  %1: i32[16,16] = iota(shape=[16,16], axis=0, dtype=i32)
  %2: i32[16,16] = iota(shape=[16,16], axis=1, dtype=i32)
  %3: bool[16,16] = gt(%2, %1)
  %7: bool[1,1,16,16] = reshape(%3, shape=[1,1,16,16])
  %4: bool[2,3,16,16] = expand(%7, shape=[2,3,16,16])
  %5: f32[2,3,16,16] = full(value=-inf, shape=[2,3,16,16], dtype=f32)
  %6: f32[2,3,16,16] = select(%4, %5, %x)
  output o = %6
}",
        )
        .unwrap();
        let p = lower(&g, Mode::Fused).unwrap();
        let folded: Vec<usize> = p.constants.iter().map(|(_, t)| t.data.len()).collect();
        assert_eq!(folded, vec![256], "only the [16, 16] mask is folded");
        assert_eq!(p.steps.len(), 1, "one map: {:?}", p.steps);
    }

    /// AdamW updates whose outputs replace their inputs in place are one step in fused mode;
    /// one that writes new values (here: the third, not donated) stays its own step. Numerics:
    /// tests/backends.rs (a whole train step against the interpreter and the eager lowering).
    #[test]
    fn in_place_adamw_updates_merge_into_one_step() {
        let mut src = String::from("graph g {\n  input %lr: f32[]\n  input %t: f32[]\n");
        for k in 0..3 {
            for (kind, x) in [
                ("param", "p"),
                ("input", "g"),
                ("state", "m"),
                ("state", "v"),
            ] {
                src += &format!("  {kind} %{x}{k}: f32[5]\n");
            }
        }
        for k in 0..3 {
            src += &format!(
                "  %P{k}: f32[5], %M{k}: f32[5], %V{k}: f32[5] = adamw(%p{k}, %g{k}, %m{k}, %v{k}, \
%lr, %t, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1)\n"
            );
        }
        for k in 0..3 {
            let donates = |x: &str| {
                if k < 2 {
                    format!(" donates %{x}{k}")
                } else {
                    String::new()
                }
            };
            for (out, x) in [("P", "p"), ("M", "m"), ("V", "v")] {
                src += &format!("  output {out}{k} = %{out}{k}{}\n", donates(x));
            }
        }
        src += "}";
        let g = graphtrain_ir::text::parse(&src).unwrap();
        graphtrain_ir::verify::verify(&g).unwrap();
        let sizes = |mode| {
            let p = lower(&g, mode).unwrap();
            p.steps
                .iter()
                .map(|s| match s {
                    Step::AdamW { updates, .. } => updates.len(),
                    other => panic!("unexpected step {other:?}"),
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(sizes(Mode::Fused), vec![2, 1]);
        assert_eq!(sizes(Mode::Eager), vec![1, 1, 1]);
    }

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

    #[test]
    fn collapse_merges_contiguous_runs_only() {
        let c = collapse(&[2, 3, 4], &[&[12, 4, 1]]);
        assert_eq!(c, vec![(24, vec![1])]);
        let c = collapse(&[2, 3, 4], &[&[1, 8, 2]]);
        assert_eq!(c.len(), 2);
    }
}
