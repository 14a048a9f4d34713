//! The op set: small primitives that everything decomposes to, plus composites that keep their
//! identity because a backend has a better kernel for them. Every composite has a decomposition
//! (`decompose.rs`) and a gradient rule (`autodiff.rs`).
//!
//! Conventions (chosen so a burn-ir import maps one to one where burn has the op):
//! - binary ops and `select` take operands of identical shape; broadcasting is explicit (`expand`);
//! - axes are non-negative indices;
//! - `matmul` is batched `[..., M, K] @ [..., K, N]` with equal batch dims, or a rank-2 right operand
//!   shared across the batch (a linear layer);
//! - attention takes `[B, H, S, D]`; rope takes `[B, S, H, D]`.

use crate::dtype::DType;
use crate::mesh::Reduce;
use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum UnaryOp {
    Neg,
    Exp,
    Log,
    Sqrt,
    Rsqrt,
    Recip,
    Sin,
    Cos,
    Tanh,
    Sigmoid,
    Silu,
    Abs,
    Square,
}

impl UnaryOp {
    pub const ALL: [UnaryOp; 13] = [
        UnaryOp::Neg,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Recip,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Silu,
        UnaryOp::Abs,
        UnaryOp::Square,
    ];

    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Recip => "recip",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Silu => "silu",
            UnaryOp::Abs => "abs",
            UnaryOp::Square => "square",
        }
    }

    pub fn apply(self, x: f64) -> f64 {
        match self {
            UnaryOp::Neg => -x,
            UnaryOp::Exp => x.exp(),
            UnaryOp::Log => x.ln(),
            UnaryOp::Sqrt => x.sqrt(),
            UnaryOp::Rsqrt => 1.0 / x.sqrt(),
            UnaryOp::Recip => 1.0 / x,
            UnaryOp::Sin => x.sin(),
            UnaryOp::Cos => x.cos(),
            UnaryOp::Tanh => x.tanh(),
            UnaryOp::Sigmoid => 1.0 / (1.0 + (-x).exp()),
            UnaryOp::Silu => x / (1.0 + (-x).exp()),
            UnaryOp::Abs => x.abs(),
            UnaryOp::Square => x * x,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Max,
    Min,
    Pow,
}

impl BinaryOp {
    pub const ALL: [BinaryOp; 7] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Pow,
    ];

    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::Pow => "pow",
        }
    }

    pub fn apply(self, a: f64, b: f64) -> f64 {
        match self {
            BinaryOp::Add => a + b,
            BinaryOp::Sub => a - b,
            BinaryOp::Mul => a * b,
            BinaryOp::Div => a / b,
            // NaN-propagating, as torch.maximum/minimum.
            BinaryOp::Max => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.max(b)
                }
            }
            BinaryOp::Min => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.min(b)
                }
            }
            BinaryOp::Pow => a.powf(b),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum CompareOp {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl CompareOp {
    pub const ALL: [CompareOp; 6] = [
        CompareOp::Eq,
        CompareOp::Ne,
        CompareOp::Lt,
        CompareOp::Le,
        CompareOp::Gt,
        CompareOp::Ge,
    ];

    pub fn name(self) -> &'static str {
        match self {
            CompareOp::Eq => "eq",
            CompareOp::Ne => "ne",
            CompareOp::Lt => "lt",
            CompareOp::Le => "le",
            CompareOp::Gt => "gt",
            CompareOp::Ge => "ge",
        }
    }

    pub fn apply(self, a: f64, b: f64) -> bool {
        match self {
            CompareOp::Eq => a == b,
            CompareOp::Ne => a != b,
            CompareOp::Lt => a < b,
            CompareOp::Le => a <= b,
            CompareOp::Gt => a > b,
            CompareOp::Ge => a >= b,
        }
    }
}

/// How rotary embedding pairs the channels of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RopeLayout {
    /// Channel `i` pairs with `i + D/2` (GPT-NeoX / Hugging Face "rotate half").
    Half,
    /// Channel `2i` pairs with `2i + 1` (Meta's complex-number layout, torchtitan).
    Interleaved,
}

impl RopeLayout {
    pub fn name(self) -> &'static str {
        match self {
            RopeLayout::Half => "half",
            RopeLayout::Interleaved => "interleaved",
        }
    }

    pub fn from_name(name: &str) -> Option<RopeLayout> {
        match name {
            "half" => Some(RopeLayout::Half),
            "interleaved" => Some(RopeLayout::Interleaved),
            _ => None,
        }
    }
}

/// What a collective computes over a group of ranks: the ranks that differ only in the
/// coordinates of the collective's mesh dimensions, in the order `Mesh::group` gives; member `i`
/// is the rank at position `i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Collective {
    /// Every member gets the members' tensors concatenated along `axis`, in group order.
    AllGather { axis: usize },
    /// Member `i` gets block `i` (along `axis`) of the sum (or mean) of the members' tensors.
    ReduceScatter { axis: usize, reduce: Reduce },
    /// Every member gets the sum (or mean) of the members' tensors.
    AllReduce { reduce: Reduce },
    /// Member `i` splits its tensor along `split_axis` into group-size blocks and sends block
    /// `j` to member `j`; it gets the blocks sent to it concatenated along `concat_axis`, in
    /// sender order.
    AllToAll {
        split_axis: usize,
        concat_axis: usize,
    },
    /// Every member gets member `root`'s tensor.
    Broadcast { root: usize },
}

impl Collective {
    /// The text-format name of its start node.
    pub fn start_name(self) -> &'static str {
        match self {
            Collective::AllGather { .. } => "all_gather_start",
            Collective::ReduceScatter { .. } => "reduce_scatter_start",
            Collective::AllReduce { .. } => "all_reduce_start",
            Collective::AllToAll { .. } => "all_to_all_start",
            Collective::Broadcast { .. } => "broadcast_start",
        }
    }

    pub const START_NAMES: [&'static str; 5] = [
        "all_gather_start",
        "reduce_scatter_start",
        "all_reduce_start",
        "all_to_all_start",
        "broadcast_start",
    ];
}

/// One operation. Attributes are static; tensors come in as node inputs.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Op {
    // ---- elementwise primitives
    /// `y = f(x)`.
    Unary(UnaryOp),
    /// `y = a ∘ b`, same shapes and dtypes.
    Binary(BinaryOp),
    /// `y = a ⋈ b` as bool.
    Compare(CompareOp),
    /// `y = cond ? a : b`; inputs `(cond: bool, a, b)`.
    Select,
    /// `y = x + value`.
    AddScalar { value: f64 },
    /// `y = x * value`.
    MulScalar { value: f64 },
    /// `y = x ^ exponent`.
    PowScalar { exponent: f64 },
    /// Converts the element type.
    Cast { dtype: DType },
    /// Identity on values; the buffer moves to host memory (placed by the `offload` pass).
    Offload,
    /// Identity on values; brings an offloaded buffer back to the device.
    Reload,

    // ---- reductions
    /// Sum over `axes`; `keepdim` keeps them as size 1.
    ReduceSum { axes: Vec<usize>, keepdim: bool },
    /// Max over `axes`.
    ReduceMax { axes: Vec<usize>, keepdim: bool },

    // ---- layout
    /// Same elements in row-major order, new shape.
    Reshape { shape: Vec<usize> },
    /// `y.shape[i] = x.shape[perm[i]]`.
    Transpose { perm: Vec<usize> },
    /// Same rank; every dim of `x` is 1 or equal to `shape`'s.
    Expand { shape: Vec<usize> },
    /// `x[..., start..end, ...]` along `axis`.
    Slice {
        axis: usize,
        start: usize,
        end: usize,
    },
    /// Concatenates all inputs along `axis`.
    Concat { axis: usize },
    /// `y[i..] = x[i.. with i_axis = idx[i..]]`; `idx` has x's shape except along `axis`.
    Gather { axis: usize },
    /// `y = x; y[i.. with i_axis = idx[i..]] += src[i..]`; inputs `(x, idx, src)`.
    ScatterAdd { axis: usize },

    // ---- contraction
    /// Batched matrix product.
    Matmul,

    // ---- sources
    /// A tensor filled with `value`.
    Full {
        value: f64,
        shape: Vec<usize>,
        dtype: DType,
    },
    /// `y[i..] = i_axis`.
    Iota {
        shape: Vec<usize>,
        axis: usize,
        dtype: DType,
    },
    /// Uniform in [0, 1) from a counter-based generator keyed by the `seed` input (an i64 scalar)
    /// and `stream`, so randomness is an explicit graph input.
    RandomUniform {
        shape: Vec<usize>,
        dtype: DType,
        stream: u64,
    },
    /// Standard normal, same keying as `RandomUniform`.
    RandomNormal {
        shape: Vec<usize>,
        dtype: DType,
        stream: u64,
    },

    // ---- composites
    /// `y[.., :] = weight[ids[..], :]`; inputs `(weight: [V, D], ids: int[..])`.
    Embedding,
    /// Gradient of `embedding` w.r.t. the weight: rows of `grad` added at `ids`; inputs
    /// `(grad: [.., D], ids: int[..])`, output `[rows, D]`.
    EmbeddingBackward { rows: usize },
    /// `y = x / sqrt(mean(x², last axis) + eps) * weight`; inputs `(x, weight: [D])`.
    RmsNorm { eps: f64 },
    /// Inputs `(x, weight, grad_y)`; outputs `(grad_x, grad_weight)`.
    RmsNormBackward { eps: f64 },
    /// Rotary position embedding of `x: [B, S, H, D]`, position = index along S, frequency
    /// `theta^(-2i/D)`. `inverse` rotates by the negative angle (the gradient).
    Rope {
        theta: f64,
        layout: RopeLayout,
        inverse: bool,
    },
    /// `softmax(q kᵀ * scale + causal mask) v` with grouped-query heads: q `[B, Hq, S, D]`,
    /// k and v `[B, Hkv, S, D]`, `Hq % Hkv == 0`, query head `h` reads kv head `h / (Hq / Hkv)`.
    /// With `stats`, a second output: each query row's softmax statistics `[B, Hq, S, 2]` (f32;
    /// f64 for f64 queries),
    /// `(m, l)` with `m` the max of the row's scaled, masked scores and `l = Σ_j exp(s_j - m)`,
    /// for the backward to rebuild the probabilities from (`attention_stats`).
    Attention {
        causal: bool,
        scale: f64,
        #[serde(default)]
        stats: bool,
    },
    /// Inputs `(q, k, v, grad_out)`, and with `stats` the forward's statistics (as
    /// `Attention`'s second output) as a fifth, from which the probabilities are
    /// `exp(s_j - m) / l` instead of a softmax of their own; outputs `(grad_q, grad_k, grad_v)`.
    AttentionBackward {
        causal: bool,
        scale: f64,
        #[serde(default)]
        stats: bool,
    },
    /// `exp(x) / sum(exp(x))` along `axis`.
    Softmax { axis: usize },
    /// `x - log(sum(exp(x)))` along `axis`.
    LogSoftmax { axis: usize },
    /// Mean over rows of `-log_softmax(logits)[row, target]`; inputs `(logits: [N, V], targets: int[N])`,
    /// output a scalar.
    CrossEntropy,
    /// Inputs `(logits, targets, grad_loss: scalar)`; output `grad_logits`.
    CrossEntropyBackward,
    /// One AdamW step (bias-corrected, decoupled weight decay); inputs
    /// `(param, grad, m, v, lr: scalar, step: scalar)`, outputs `(param', m', v')`.
    AdamW {
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    },
    /// `param' = param - lr * (grad + weight_decay * param)`; inputs `(param, grad, lr: scalar)`.
    Sgd { weight_decay: f64 },

    // ---- communication (graphs with a mesh)
    /// Starts `collective` over the ranks that differ only along mesh dimensions `mesh_dims`
    /// (`group` of them: the product of those dimensions' sizes). Its output is a handle, typed
    /// as the result, that only its one `wait` may read: a pass may move the start earlier and
    /// the wait later, and compute in between overlaps the communication.
    CollectiveStart {
        collective: Collective,
        mesh_dims: Vec<usize>,
        group: usize,
    },
    /// The result of the collective whose handle it reads, once it has arrived.
    Wait,
    /// A replicated value made partial(sum) over mesh dimensions `mesh_dims` (`group` ranks):
    /// each rank keeps `x / group`, so the ranks' sum is `x`. No data moves. It starts the
    /// backward pass of a loss replicated over tensor-parallel ranks, whose gradient is then
    /// partial like that of every other replicated value.
    ToPartial { mesh_dims: Vec<usize>, group: usize },
}

/// An attribute value as written in the text format.
#[derive(Clone, Debug, PartialEq)]
pub enum Attr {
    Int(i64),
    Float(f64),
    Bool(bool),
    Ints(Vec<i64>),
    Ident(String),
}

impl fmt::Display for Attr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Attr::Int(v) => write!(f, "{v}"),
            // `{:?}` prints the shortest text that parses back to the same f64.
            Attr::Float(v) => write!(f, "{v:?}"),
            Attr::Bool(v) => write!(f, "{v}"),
            Attr::Ints(v) => {
                f.write_str("[")?;
                for (i, x) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{x}")?;
                }
                f.write_str("]")
            }
            Attr::Ident(s) => f.write_str(s),
        }
    }
}

/// How many inputs an op takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    Exactly(usize),
    AtLeast(usize),
}

impl Op {
    /// The name used in the text format.
    pub fn name(&self) -> &'static str {
        match self {
            Op::Unary(u) => u.name(),
            Op::Binary(b) => b.name(),
            Op::Compare(c) => c.name(),
            Op::Select => "select",
            Op::AddScalar { .. } => "add_scalar",
            Op::MulScalar { .. } => "mul_scalar",
            Op::PowScalar { .. } => "pow_scalar",
            Op::Cast { .. } => "cast",
            Op::Offload => "offload",
            Op::Reload => "reload",
            Op::ReduceSum { .. } => "reduce_sum",
            Op::ReduceMax { .. } => "reduce_max",
            Op::Reshape { .. } => "reshape",
            Op::Transpose { .. } => "transpose",
            Op::Expand { .. } => "expand",
            Op::Slice { .. } => "slice",
            Op::Concat { .. } => "concat",
            Op::Gather { .. } => "gather",
            Op::ScatterAdd { .. } => "scatter_add",
            Op::Matmul => "matmul",
            Op::Full { .. } => "full",
            Op::Iota { .. } => "iota",
            Op::RandomUniform { .. } => "random_uniform",
            Op::RandomNormal { .. } => "random_normal",
            Op::Embedding => "embedding",
            Op::EmbeddingBackward { .. } => "embedding_backward",
            Op::RmsNorm { .. } => "rms_norm",
            Op::RmsNormBackward { .. } => "rms_norm_backward",
            Op::Rope { .. } => "rope",
            Op::Attention { .. } => "attention",
            Op::AttentionBackward { .. } => "attention_backward",
            Op::Softmax { .. } => "softmax",
            Op::LogSoftmax { .. } => "log_softmax",
            Op::CrossEntropy => "cross_entropy",
            Op::CrossEntropyBackward => "cross_entropy_backward",
            Op::AdamW { .. } => "adamw",
            Op::Sgd { .. } => "sgd",
            Op::CollectiveStart { collective, .. } => collective.start_name(),
            Op::ToPartial { .. } => "to_partial",
            Op::Wait => "wait",
        }
    }

    /// Every op name the text format knows, for error messages.
    pub fn all_names() -> Vec<&'static str> {
        let mut names: Vec<&'static str> = Vec::new();
        names.extend(UnaryOp::ALL.iter().map(|u| u.name()));
        names.extend(BinaryOp::ALL.iter().map(|b| b.name()));
        names.extend(CompareOp::ALL.iter().map(|c| c.name()));
        names.extend([
            "select",
            "add_scalar",
            "mul_scalar",
            "pow_scalar",
            "cast",
            "offload",
            "reload",
            "reduce_sum",
            "reduce_max",
            "reshape",
            "transpose",
            "expand",
            "slice",
            "concat",
            "gather",
            "scatter_add",
            "matmul",
            "full",
            "iota",
            "random_uniform",
            "random_normal",
            "embedding",
            "embedding_backward",
            "rms_norm",
            "rms_norm_backward",
            "rope",
            "attention",
            "attention_backward",
            "softmax",
            "log_softmax",
            "cross_entropy",
            "cross_entropy_backward",
            "adamw",
            "sgd",
        ]);
        names.extend(Collective::START_NAMES);
        names.push("wait");
        names.push("to_partial");
        names
    }

    pub fn arity(&self) -> Arity {
        use Arity::*;
        match self {
            Op::Unary(_)
            | Op::AddScalar { .. }
            | Op::MulScalar { .. }
            | Op::PowScalar { .. }
            | Op::Cast { .. }
            | Op::Offload
            | Op::Reload
            | Op::ReduceSum { .. }
            | Op::ReduceMax { .. }
            | Op::Reshape { .. }
            | Op::Transpose { .. }
            | Op::Expand { .. }
            | Op::Slice { .. }
            | Op::Rope { .. }
            | Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::CollectiveStart { .. }
            | Op::ToPartial { .. }
            | Op::Wait => Exactly(1),
            Op::Binary(_)
            | Op::Compare(_)
            | Op::Gather { .. }
            | Op::Matmul
            | Op::Embedding
            | Op::EmbeddingBackward { .. }
            | Op::RmsNorm { .. }
            | Op::CrossEntropy => Exactly(2),
            Op::Select
            | Op::ScatterAdd { .. }
            | Op::RmsNormBackward { .. }
            | Op::Attention { .. }
            | Op::CrossEntropyBackward
            | Op::Sgd { .. } => Exactly(3),
            Op::AttentionBackward { stats, .. } => Exactly(if *stats { 5 } else { 4 }),
            Op::AdamW { .. } => Exactly(6),
            Op::Concat { .. } => AtLeast(1),
            Op::Full { .. } | Op::Iota { .. } => Exactly(0),
            Op::RandomUniform { .. } | Op::RandomNormal { .. } => Exactly(1),
        }
    }

    pub fn num_outputs(&self) -> usize {
        match self {
            Op::RmsNormBackward { .. } | Op::Attention { stats: true, .. } => 2,
            Op::AttentionBackward { .. } | Op::AdamW { .. } => 3,
            _ => 1,
        }
    }

    /// Composites keep their identity for the lowering and have a decomposition into primitives.
    pub fn is_composite(&self) -> bool {
        matches!(
            self,
            Op::Embedding
                | Op::EmbeddingBackward { .. }
                | Op::RmsNorm { .. }
                | Op::RmsNormBackward { .. }
                | Op::Rope { .. }
                | Op::Attention { .. }
                | Op::AttentionBackward { .. }
                | Op::Softmax { .. }
                | Op::LogSoftmax { .. }
                | Op::CrossEntropy
                | Op::CrossEntropyBackward
                | Op::AdamW { .. }
                | Op::Sgd { .. }
        )
    }

    /// Elementwise ops map each output element from the same-index input elements.
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::Compare(_)
                | Op::Select
                | Op::AddScalar { .. }
                | Op::MulScalar { .. }
                | Op::PowScalar { .. }
                | Op::Cast { .. }
                | Op::ToPartial { .. }
        )
    }

    /// Static attributes in text-format order.
    pub fn attrs(&self) -> Vec<(&'static str, Attr)> {
        fn ints(v: &[usize]) -> Attr {
            Attr::Ints(v.iter().map(|&x| x as i64).collect())
        }
        fn int(v: usize) -> Attr {
            Attr::Int(v as i64)
        }
        fn dt(d: DType) -> Attr {
            Attr::Ident(d.name().to_string())
        }
        match self {
            Op::AddScalar { value } | Op::MulScalar { value } => {
                vec![("value", Attr::Float(*value))]
            }
            Op::PowScalar { exponent } => vec![("exponent", Attr::Float(*exponent))],
            Op::Cast { dtype } => vec![("dtype", dt(*dtype))],
            Op::ReduceSum { axes, keepdim } | Op::ReduceMax { axes, keepdim } => {
                vec![("axes", ints(axes)), ("keepdim", Attr::Bool(*keepdim))]
            }
            Op::Reshape { shape } | Op::Expand { shape } => vec![("shape", ints(shape))],
            Op::Transpose { perm } => vec![("perm", ints(perm))],
            Op::Slice { axis, start, end } => vec![
                ("axis", int(*axis)),
                ("start", int(*start)),
                ("end", int(*end)),
            ],
            Op::Concat { axis }
            | Op::Gather { axis }
            | Op::ScatterAdd { axis }
            | Op::Softmax { axis }
            | Op::LogSoftmax { axis } => vec![("axis", int(*axis))],
            Op::Full {
                value,
                shape,
                dtype,
            } => vec![
                ("value", Attr::Float(*value)),
                ("shape", ints(shape)),
                ("dtype", dt(*dtype)),
            ],
            Op::Iota { shape, axis, dtype } => vec![
                ("shape", ints(shape)),
                ("axis", int(*axis)),
                ("dtype", dt(*dtype)),
            ],
            Op::RandomUniform {
                shape,
                dtype,
                stream,
            }
            | Op::RandomNormal {
                shape,
                dtype,
                stream,
            } => vec![
                ("shape", ints(shape)),
                ("dtype", dt(*dtype)),
                ("stream", Attr::Int(*stream as i64)),
            ],
            Op::EmbeddingBackward { rows } => vec![("rows", int(*rows))],
            Op::RmsNorm { eps } | Op::RmsNormBackward { eps } => vec![("eps", Attr::Float(*eps))],
            Op::Rope {
                theta,
                layout,
                inverse,
            } => vec![
                ("theta", Attr::Float(*theta)),
                ("layout", Attr::Ident(layout.name().to_string())),
                ("inverse", Attr::Bool(*inverse)),
            ],
            Op::Attention {
                causal,
                scale,
                stats,
            }
            | Op::AttentionBackward {
                causal,
                scale,
                stats,
            } => {
                let mut attrs = vec![
                    ("causal", Attr::Bool(*causal)),
                    ("scale", Attr::Float(*scale)),
                ];
                // Printed only where set, so that graphs without statistics read as before.
                if *stats {
                    attrs.push(("stats", Attr::Bool(true)));
                }
                attrs
            }
            Op::AdamW {
                beta1,
                beta2,
                eps,
                weight_decay,
            } => vec![
                ("beta1", Attr::Float(*beta1)),
                ("beta2", Attr::Float(*beta2)),
                ("eps", Attr::Float(*eps)),
                ("weight_decay", Attr::Float(*weight_decay)),
            ],
            Op::Sgd { weight_decay } => vec![("weight_decay", Attr::Float(*weight_decay))],
            Op::ToPartial { mesh_dims, group } => {
                vec![("mesh_dims", ints(mesh_dims)), ("group", int(*group))]
            }
            Op::CollectiveStart {
                collective,
                mesh_dims,
                group,
            } => {
                let mut attrs = vec![("mesh_dims", ints(mesh_dims)), ("group", int(*group))];
                let reduce = |r: Reduce| Attr::Ident(r.name().to_string());
                match *collective {
                    Collective::AllGather { axis } => attrs.push(("axis", int(axis))),
                    Collective::ReduceScatter { axis, reduce: r } => {
                        attrs.push(("axis", int(axis)));
                        attrs.push(("reduce", reduce(r)));
                    }
                    Collective::AllReduce { reduce: r } => attrs.push(("reduce", reduce(r))),
                    Collective::AllToAll {
                        split_axis,
                        concat_axis,
                    } => {
                        attrs.push(("split_axis", int(split_axis)));
                        attrs.push(("concat_axis", int(concat_axis)));
                    }
                    Collective::Broadcast { root } => attrs.push(("root", int(root))),
                }
                attrs
            }
            Op::Unary(_)
            | Op::Binary(_)
            | Op::Compare(_)
            | Op::Select
            | Op::Matmul
            | Op::Offload
            | Op::Reload
            | Op::Embedding
            | Op::CrossEntropy
            | Op::CrossEntropyBackward
            | Op::Wait => Vec::new(),
        }
    }

    /// Builds an op from its text-format name and attributes. Every attribute the op has must be
    /// given exactly once; unknown ones are refused.
    pub fn from_name_attrs(name: &str, attrs: &[(String, Attr)]) -> Result<Op, String> {
        let mut a = AttrReader::new(name, attrs);
        let op = match name {
            "select" => Op::Select,
            "add_scalar" => Op::AddScalar {
                value: a.float("value")?,
            },
            "mul_scalar" => Op::MulScalar {
                value: a.float("value")?,
            },
            "pow_scalar" => Op::PowScalar {
                exponent: a.float("exponent")?,
            },
            "cast" => Op::Cast {
                dtype: a.dtype("dtype")?,
            },
            "reduce_sum" => Op::ReduceSum {
                axes: a.usizes("axes")?,
                keepdim: a.bool("keepdim")?,
            },
            "reduce_max" => Op::ReduceMax {
                axes: a.usizes("axes")?,
                keepdim: a.bool("keepdim")?,
            },
            "reshape" => Op::Reshape {
                shape: a.usizes("shape")?,
            },
            "transpose" => Op::Transpose {
                perm: a.usizes("perm")?,
            },
            "expand" => Op::Expand {
                shape: a.usizes("shape")?,
            },
            "slice" => Op::Slice {
                axis: a.usize("axis")?,
                start: a.usize("start")?,
                end: a.usize("end")?,
            },
            "concat" => Op::Concat {
                axis: a.usize("axis")?,
            },
            "gather" => Op::Gather {
                axis: a.usize("axis")?,
            },
            "scatter_add" => Op::ScatterAdd {
                axis: a.usize("axis")?,
            },
            "matmul" => Op::Matmul,
            "offload" => Op::Offload,
            "reload" => Op::Reload,
            "full" => Op::Full {
                value: a.float("value")?,
                shape: a.usizes("shape")?,
                dtype: a.dtype("dtype")?,
            },
            "iota" => Op::Iota {
                shape: a.usizes("shape")?,
                axis: a.usize("axis")?,
                dtype: a.dtype("dtype")?,
            },
            "random_uniform" => Op::RandomUniform {
                shape: a.usizes("shape")?,
                dtype: a.dtype("dtype")?,
                stream: a.usize("stream")? as u64,
            },
            "random_normal" => Op::RandomNormal {
                shape: a.usizes("shape")?,
                dtype: a.dtype("dtype")?,
                stream: a.usize("stream")? as u64,
            },
            "embedding" => Op::Embedding,
            "embedding_backward" => Op::EmbeddingBackward {
                rows: a.usize("rows")?,
            },
            "rms_norm" => Op::RmsNorm {
                eps: a.float("eps")?,
            },
            "rms_norm_backward" => Op::RmsNormBackward {
                eps: a.float("eps")?,
            },
            "rope" => Op::Rope {
                theta: a.float("theta")?,
                layout: {
                    let s = a.ident("layout")?;
                    RopeLayout::from_name(&s).ok_or_else(|| {
                        format!("rope: layout must be `half` or `interleaved`, found `{s}`")
                    })?
                },
                inverse: a.bool("inverse")?,
            },
            "attention" => Op::Attention {
                causal: a.bool("causal")?,
                scale: a.float("scale")?,
                stats: a.optional_bool("stats")?,
            },
            "attention_backward" => Op::AttentionBackward {
                causal: a.bool("causal")?,
                scale: a.float("scale")?,
                stats: a.optional_bool("stats")?,
            },
            "softmax" => Op::Softmax {
                axis: a.usize("axis")?,
            },
            "log_softmax" => Op::LogSoftmax {
                axis: a.usize("axis")?,
            },
            "cross_entropy" => Op::CrossEntropy,
            "cross_entropy_backward" => Op::CrossEntropyBackward,
            "adamw" => Op::AdamW {
                beta1: a.float("beta1")?,
                beta2: a.float("beta2")?,
                eps: a.float("eps")?,
                weight_decay: a.float("weight_decay")?,
            },
            "sgd" => Op::Sgd {
                weight_decay: a.float("weight_decay")?,
            },
            "wait" => Op::Wait,
            "to_partial" => Op::ToPartial {
                mesh_dims: a.usizes("mesh_dims")?,
                group: a.usize("group")?,
            },
            start if Collective::START_NAMES.contains(&start) => {
                let mesh_dims = a.usizes("mesh_dims")?;
                let group = a.usize("group")?;
                let collective = match start {
                    "all_gather_start" => Collective::AllGather {
                        axis: a.usize("axis")?,
                    },
                    "reduce_scatter_start" => Collective::ReduceScatter {
                        axis: a.usize("axis")?,
                        reduce: a.reduce("reduce")?,
                    },
                    "all_reduce_start" => Collective::AllReduce {
                        reduce: a.reduce("reduce")?,
                    },
                    "all_to_all_start" => Collective::AllToAll {
                        split_axis: a.usize("split_axis")?,
                        concat_axis: a.usize("concat_axis")?,
                    },
                    _ => Collective::Broadcast {
                        root: a.usize("root")?,
                    },
                };
                Op::CollectiveStart {
                    collective,
                    mesh_dims,
                    group,
                }
            }
            other => {
                if let Some(u) = UnaryOp::ALL.into_iter().find(|u| u.name() == other) {
                    Op::Unary(u)
                } else if let Some(b) = BinaryOp::ALL.into_iter().find(|b| b.name() == other) {
                    Op::Binary(b)
                } else if let Some(c) = CompareOp::ALL.into_iter().find(|c| c.name() == other) {
                    Op::Compare(c)
                } else {
                    return Err(format!(
                        "unknown op `{other}`; known ops: {}",
                        Op::all_names().join(", ")
                    ));
                }
            }
        };
        a.finish()?;
        Ok(op)
    }
}

/// Reads named attributes for `Op::from_name_attrs`, tracking which were used.
struct AttrReader<'a> {
    op: &'a str,
    attrs: &'a [(String, Attr)],
    used: Vec<bool>,
}

impl<'a> AttrReader<'a> {
    fn new(op: &'a str, attrs: &'a [(String, Attr)]) -> Self {
        AttrReader {
            op,
            attrs,
            used: vec![false; attrs.len()],
        }
    }

    fn get(&mut self, key: &str) -> Result<&'a Attr, String> {
        let mut found = None;
        for (i, (k, v)) in self.attrs.iter().enumerate() {
            if k == key {
                if found.is_some() {
                    return Err(format!("{}: attribute `{key}` given twice", self.op));
                }
                self.used[i] = true;
                found = Some(v);
            }
        }
        found.ok_or_else(|| format!("{}: missing attribute `{key}`", self.op))
    }

    fn float(&mut self, key: &str) -> Result<f64, String> {
        match self.get(key)? {
            Attr::Float(v) => Ok(*v),
            Attr::Int(v) => Ok(*v as f64),
            other => Err(format!(
                "{}: attribute `{key}` must be a number, found `{other}`",
                self.op
            )),
        }
    }

    fn usize(&mut self, key: &str) -> Result<usize, String> {
        match self.get(key)? {
            Attr::Int(v) if *v >= 0 => Ok(*v as usize),
            other => Err(format!(
                "{}: attribute `{key}` must be a non-negative integer, found `{other}`",
                self.op
            )),
        }
    }

    fn usizes(&mut self, key: &str) -> Result<Vec<usize>, String> {
        match self.get(key)? {
            Attr::Ints(v) if v.iter().all(|x| *x >= 0) => Ok(v.iter().map(|&x| x as usize).collect()),
            other => Err(format!(
                "{}: attribute `{key}` must be a list of non-negative integers like [1,2], found `{other}`",
                self.op
            )),
        }
    }

    fn bool(&mut self, key: &str) -> Result<bool, String> {
        match self.get(key)? {
            Attr::Bool(v) => Ok(*v),
            other => Err(format!(
                "{}: attribute `{key}` must be true or false, found `{other}`",
                self.op
            )),
        }
    }

    /// A boolean attribute that defaults to false where absent.
    fn optional_bool(&mut self, key: &str) -> Result<bool, String> {
        if self.attrs.iter().any(|(k, _)| k == key) {
            self.bool(key)
        } else {
            Ok(false)
        }
    }

    fn ident(&mut self, key: &str) -> Result<String, String> {
        match self.get(key)? {
            Attr::Ident(v) => Ok(v.clone()),
            other => Err(format!(
                "{}: attribute `{key}` must be a name, found `{other}`",
                self.op
            )),
        }
    }

    fn reduce(&mut self, key: &str) -> Result<Reduce, String> {
        let s = self.ident(key)?;
        Reduce::from_name(&s).ok_or_else(|| {
            format!(
                "{}: attribute `{key}` must be `sum` or `avg`, found `{s}`",
                self.op
            )
        })
    }

    fn dtype(&mut self, key: &str) -> Result<DType, String> {
        let s = self.ident(key)?;
        DType::from_name(&s).ok_or_else(|| {
            format!(
                "{}: attribute `{key}`: unknown dtype `{s}` (known: f64, f32, bf16, i64, i32, bool)",
                self.op
            )
        })
    }

    fn finish(self) -> Result<(), String> {
        for (i, (k, _)) in self.attrs.iter().enumerate() {
            if !self.used[i] {
                return Err(format!("{}: unknown attribute `{k}`", self.op));
            }
        }
        Ok(())
    }
}
