//! The Program data model: what lowering produces and a backend runs. A `Program` is the
//! legalized graph, its `Step`s in launch order, one planned arena and the constants written
//! into that arena at load.
//!
//! What every Program guarantees a backend, whichever `Mode` built it:
//! - every value a step names has a buffer in the arena (`plan`), `ELEM_BYTES` per element
//!   (f32 storage: integers and booleans as the f32 of their exact value, never beyond
//!   `MAX_EXACT_INT`), at an offset aligned to `ARENA_ALIGN`; except the bf16 values marked
//!   `is_two_byte` (`storage.rs`), 2 bytes an element, whose producer and readers take halves;
//! - a step writes contiguous buffers, except through a `View` it names as its output (`Copy`'s
//!   `dst`, attention's outputs);
//! - a `Map` or `MapReduce` reads at most `MAX_MAP_INPUTS` values; a broadcast `Access` period
//!   and a `MapReduce` row length are multiples of `BROADCAST_ALIGN`;
//! - the only composites left are those `lower_with`'s `keep` accepted (`kept_composite` by
//!   default: attention and its backward, rope, cross-entropy and its backward, AdamW), one step
//!   each; every other op is a primitive step.
//!
//! The view algebra and the entry points are re-exported here under the paths they had when
//! this file held all of the lowering (`program::collapse`, `program::lower`, ...): other crates
//! use them.

use crate::buffer_plan::{plan_sized, BufferPlan};
use graphtrain_ir::{
    BinaryOp, Collective, CompareOp, Graph, HostTensor, Op, RopeLayout, UnaryOp, ValueId,
};
use std::fmt;

pub use crate::fusion::FusionLimits;
pub use crate::lower::{lower, lower_with, lower_with_limits};
pub use crate::views::{
    collapse, contiguous_strides, expand_view, reshape_view, slice_view, transpose_view,
};

/// How a Program is built.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// One step per node (a kept composite is one node), every value materialized: the
    /// numerics baseline.
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

/// An elementwise expression over the inputs of a `Map` step, evaluated in f32. Booleans are
/// 1.0 / 0.0 and integers their exact f32 value (see `ELEM_BYTES`).
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
    /// The nearest bf16 value (ties to even), held as f32: how a bf16 value is stored.
    RoundBf16(Box<Expr>),
}

impl Expr {
    pub fn constant(x: f64) -> Expr {
        Expr::Const((x as f32).to_bits())
    }

    pub fn size(&self) -> usize {
        match self {
            Expr::Input(_) | Expr::Const(_) => 1,
            Expr::Unary(_, a) | Expr::Trunc(a) | Expr::NonZero(a) | Expr::RoundBf16(a) => {
                1 + a.size()
            }
            Expr::Binary(_, a, b) | Expr::Compare(_, a, b) => 1 + a.size() + b.size(),
            Expr::Select(c, a, b) => 1 + c.size() + a.size() + b.size(),
        }
    }

    pub(crate) fn shift_inputs(self, by: u32) -> Expr {
        self.map_inputs(&|k| Expr::Input(k + by))
    }

    /// Replaces `Input(k)` by `with[k]`.
    pub(crate) fn substitute(self, with: &[Expr]) -> Expr {
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
            Expr::RoundBf16(a) => Expr::RoundBf16(s(a)),
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
    pub(crate) fn direct(g: &Graph, v: ValueId, out_len: usize) -> MapInput {
        let access = if g.ty(v).numel() == 1 && out_len != 1 {
            Access::Scalar
        } else {
            Access::Full
        };
        MapInput { value: v, access }
    }
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

/// What a matmul rounds to bf16 (bf16-mixed): a bf16 product is the f32 sum of products of
/// bf16 operands, rounded once to bf16 (`out`). `a` and `b` say that the operand holds f32
/// values the product rounds as it reads them: fusion's place for a `cast` to bf16 that only
/// bf16 matmuls read (bf16-mixed's weights and saved activations), which then needs no kernel
/// and no bytes of its own. Eager sets `out` for a bf16 result and never `a` or `b`; fusion
/// also sets `out` where a bf16 product is written straight into its f32 reader's layout.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Bf16Rounding {
    pub a: bool,
    pub b: bool,
    pub out: bool,
}

/// One launch. Values named here are materialized in the arena; outputs are contiguous unless
/// the step writes them through a `View`.
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
        bf16: Bf16Rounding,
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
    /// probabilities never reach the arena. With `bf16` (bf16-mixed's attention) every element
    /// of `q`, `k` and `v` is rounded to bf16 as it is read (the identity on bf16 values; fusion
    /// leaves f32 where it folded their casts), the probabilities are rounded to bf16 where
    /// the product with `v` reads them (as torch's cpu kernel does for bf16), and `out` is
    /// rounded to bf16; the rest is computed in f32 at least (the interpreter: f64). With
    /// `stats`, each query row's softmax max and sum are written to that contiguous `[B, H, S,
    /// 2]` f32 value, as the row's softmax computed them (`Op::Attention`'s second output).
    Attention {
        out: View,
        q: View,
        k: View,
        v: View,
        stats: Option<ValueId>,
        causal: bool,
        scale: f64,
        bf16: bool,
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
    /// views laid out as `Attention`'s `out`; the probabilities are recomputed per head: from
    /// the forward's `stats` (`exp(s - max) / sum`, the same bits as a softmax of the row)
    /// where given, else by a softmax of each score row. With
    /// `bf16` the operands are rounded to bf16 as they are read (as `Attention`'s), so are the
    /// probabilities and score gradients `ds = p (dp - Σ p dp)` (computed from the unrounded
    /// `p`) where the products read them, and the three gradients as they are stored.
    AttentionBackward {
        dq: View,
        dk: View,
        dv: View,
        q: View,
        k: View,
        v: View,
        dout: View,
        stats: Option<ValueId>,
        causal: bool,
        scale: f64,
        bf16: bool,
    },
    /// Starts `collective` on the whole of contiguous `src` over this rank's group: the ranks
    /// that differ from it only along mesh dimensions `mesh_dims` (`graphtrain_ir::Mesh::group`
    /// of the graph's mesh). The result arrives in `handle`'s bytes, at the latest when the
    /// matching `Wait` returns; until then `src` must stay as it is (the plan keeps its buffer
    /// live to the `Wait`) and nothing else touches `handle`.
    CollectiveStart {
        collective: Collective,
        mesh_dims: Vec<usize>,
        src: ValueId,
        handle: ValueId,
    },
    /// Copies the whole of contiguous `src` out of the arena into host memory as `out`, which
    /// has no bytes in the arena (`Program::host_values`): `src`'s bytes are free for other
    /// values from here until the `Reload` of `out`.
    Offload { src: ValueId, out: ValueId },
    /// Copies the host-resident `src` (an `Offload`'s result) back into the arena as `out`.
    Reload { src: ValueId, out: ValueId },
    /// Returns once the collective started on `handle` has completed. `out` is stored in
    /// `handle`'s bytes (the plan joins them), so nothing is copied; it names `src` so that the
    /// collective's operand stays live until here.
    Wait {
        handle: ValueId,
        src: ValueId,
        out: ValueId,
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
            Step::AttentionBackward {
                q,
                k,
                v,
                dout,
                stats,
                ..
            } => [q.base, k.base, v.base, dout.base]
                .into_iter()
                .chain(*stats)
                .collect(),
            Step::CollectiveStart { src, .. } => vec![*src],
            Step::Offload { src, .. } | Step::Reload { src, .. } => vec![*src],
            Step::Wait { handle, src, .. } => vec![*handle, *src],
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
            | Step::CrossEntropyBackward { out, .. }
            | Step::Wait { out, .. }
            | Step::Offload { out, .. }
            | Step::Reload { out, .. } => *out,
            Step::CollectiveStart { handle, .. } => *handle,
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
            Step::Attention { out, stats, .. } => [out.base].into_iter().chain(*stats).collect(),
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
            Step::CollectiveStart { collective, .. } => collective.start_name(),
            Step::Wait { .. } => "wait",
            Step::Offload { .. } => "offload",
            Step::Reload { .. } => "reload",
        }
    }
}

/// The storage every backend uses: 4 bytes per element, f32 for floats, and integers and
/// booleans as the f32 holding their exact value, so one set of f32 kernels serves every op
/// (bf16 values stored in 2 bytes, `Program::is_two_byte`, are the one exception).
/// Integers beyond 2^24 cannot be held exactly and are refused where they can be seen (inputs,
/// iota sizes).
pub const ELEM_BYTES: usize = 4;
/// Largest integer the f32 storage holds exactly.
pub const MAX_EXACT_INT: usize = 1 << 24;
/// Arena offsets are aligned to this many bytes (a cache line; also a whole number of the
/// widest vectors the kernels use).
pub const ARENA_ALIGN: usize = 64;

/// Broadcast reads are formed only when their period is a multiple of this (the widest vector a
/// backend uses): then a backend splits the work into whole vectors exactly as it does for
/// contiguous operands. A different split would change results, since vector and scalar code
/// of the same function (exp, sin, ...) may round differently.
pub const BROADCAST_ALIGN: usize = 8;

/// Most inputs a `Map` or `MapReduce` reads (the runtime's map kernel takes this many offset
/// arguments); `FusionLimits::max_map_inputs` may lower it, never raise it.
pub const MAX_MAP_INPUTS: usize = 6;

#[derive(Clone, Debug)]
pub struct Program {
    /// The legalized graph the steps refer to: primitives and the kept composites.
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
    /// Values held in host memory instead of the arena: the results of `Offload` steps, read
    /// back by `Reload` steps. The plan gives them no buffer.
    pub host_values: Vec<ValueId>,
    /// Per value (by index; empty: none), whether it is stored as bf16 in 2 bytes per element
    /// instead of in a 4-byte slot (`Program::store_bf16_in_two_bytes`, `storage.rs`).
    pub bf16_in_two_bytes: Vec<bool>,
    /// Concats of graph inputs that are the inputs stored side by side (`packs.rs`): no step
    /// computes them, the plan places their parts so.
    pub packs: Vec<crate::packs::Pack>,
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

/// What each planner slot reads and writes: slot 0 writes the constants (at load), one slot
/// per step follows, and a last slot reads the constants (they live to the end). Offloaded
/// values are in host memory, not in the arena, so no slot names them.
pub(crate) fn arena_slots(
    steps: &[Step],
    constants: &[(ValueId, HostTensor)],
    host_values: &[ValueId],
    n_values: usize,
) -> Vec<(Vec<ValueId>, Vec<ValueId>)> {
    let const_ids: Vec<ValueId> = constants.iter().map(|(v, _)| *v).collect();
    let mut on_host = vec![false; n_values];
    for v in host_values {
        on_host[v.index()] = true;
    }
    let in_arena = |vs: Vec<ValueId>| -> Vec<ValueId> {
        vs.into_iter().filter(|v| !on_host[v.index()]).collect()
    };
    let mut slots: Vec<(Vec<ValueId>, Vec<ValueId>)> = vec![(Vec::new(), const_ids.clone())];
    slots.extend(
        steps
            .iter()
            .map(|s| (in_arena(s.reads()), in_arena(s.outputs()))),
    );
    slots.push((const_ids, Vec::new()));
    slots
}

impl Program {
    /// Plans the arena again so that no buffer crosses a multiple of `window` bytes (a
    /// multiple of `ARENA_ALIGN`): a backend whose buffers hold less than the whole arena
    /// then holds it in buffers of `window` bytes, each value inside one. Fails, naming the
    /// value, when one is larger than a window.
    pub fn plan_in_windows(&mut self, window: usize) -> Result<(), String> {
        self.plan_again(Some(window))
    }

    /// Plans the arena again from the steps, each value taking `value_bytes` (in windows of
    /// `window` bytes where given).
    pub(crate) fn plan_again(&mut self, window: Option<usize>) -> Result<(), String> {
        let slots = arena_slots(
            &self.steps,
            &self.constants,
            &self.host_values,
            self.graph.values.len(),
        );
        self.plan = plan_sized(
            &self.graph,
            &slots,
            &|v| self.value_bytes(v),
            ARENA_ALIGN,
            window,
            &self.packs,
        )?;
        Ok(())
    }

    /// 4-byte slots in the arena.
    pub fn arena_elems(&self) -> usize {
        self.plan.arena_bytes / ELEM_BYTES
    }

    /// Bytes the Program keeps in host memory (`host_values`) while it runs.
    pub fn host_bytes(&self) -> usize {
        self.host_values
            .iter()
            .map(|v| self.graph.ty(*v).numel() * ELEM_BYTES)
            .sum()
    }

    /// Offset of a materialized value in 4-byte slots (for a value stored in 2 bytes,
    /// `is_two_byte`, the slot holding its elements 0 and 1).
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
